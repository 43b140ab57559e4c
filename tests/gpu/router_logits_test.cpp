// The router-logits kernels (launch_router_logits) against a float64 dot product of the same
// rounded inputs: every router kernel, the gate row, bitwise-equal repeated launches, the router
// stored in bf16.
#include "gpu/gpu_test_util.h"

#ifdef WNA16_HAVE_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/moe_layer_kernels.h"
#include "wna16/cuda_kernels.h"
#include "wna16/error.h"
#include "wna16/half.h"
#include "wna16/reference.h"

using namespace wna16;
using wna16::gpu_test::cases;
using wna16::gpu_test::DevBuf;
using wna16::gpu_test::first_mismatch;

namespace {

// ---- router logits -------------------------------------------------------------------------------
// x [M, H] (bf16 / f16) times the fp32 router [E_ext, H] transposed, against a float64 dot product
// of the same rounded inputs, for every router kernel (one row per block, H split over a cluster,
// tiled with split H; narrow and wide tiles; tensor cores at many tokens x experts, with split H); the gate row
// (E_ext = E + 1) lands in gate_logit; the accumulator is zeroed; a second launch is bitwise equal
// (the split sums are added in a fixed order). bf16_values: the router's values are exact in bf16
// (as real checkpoints store it), and the router stored in bf16 gives bitwise the logits of the same
// values stored in fp32.
struct RouterCase {
  int64_t M;
  int E, E_ext;
  int64_t H;
  DType act;
};
void expect_router_logits_match(const std::vector<RouterCase>& list, bool bf16_values = false) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreate(&s));
  for (const RouterCase& c : list) {
    const std::string what = "M=" + std::to_string(c.M) + " E=" + std::to_string(c.E) + " E_ext=" + std::to_string(c.E_ext) +
                             " H=" + std::to_string(c.H) + " " + dtype_name(c.act);
    std::vector<uint16_t> xh(size_t(c.M * c.H));
    std::vector<double> xd(xh.size());
    for (size_t i = 0; i < xh.size(); ++i) {
      const float v = nd(rng);
      xh[i] = c.act == DType::BF16 ? float_to_bf16(v) : float_to_f16(v);
      xd[i] = c.act == DType::BF16 ? bf16_to_float(xh[i]) : f16_to_float(xh[i]);
    }
    std::vector<float> r(size_t(c.E_ext * c.H));
    for (auto& v : r) v = 0.05f * nd(rng);
    std::vector<uint16_t> rb(r.size());
    if (bf16_values)
      for (size_t i = 0; i < r.size(); ++i) r[i] = bf16_to_float(rb[i] = float_to_bf16(r[i]));
    const int64_t zero_n = 4 * ((c.M * 4 + 3) / 4);
    DevBuf<uint16_t> dx{xh.size()}, drb{rb.size()};
    DevBuf<float> dr{r.size()}, logits{size_t(c.M * c.E)}, gate{size_t(c.M)}, zero{size_t(zero_n)};
    dx.upload(xh);
    dr.upload(r);
    drb.upload(rb);
    std::vector<float> first, first_gate;
    // Runs 0, 1: the fp32 router; run 2 (bf16_values): the same values stored in bf16.
    for (int run = 0; run < (bf16_values ? 3 : 2); ++run) {
      logits.poison();
      gate.poison();
      zero.poison();
      const bool rbf = run == 2;
      cuda::launch_router_logits(dx.p, c.act, c.M, c.H, rbf ? static_cast<const void*>(drb.p) : dr.p,
                                 rbf ? DType::BF16 : DType::F32, c.E, c.E_ext, logits.p,
                                 c.E_ext > c.E ? gate.p : nullptr, zero.p, zero_n, s);
      CUDA_OK(cudaStreamSynchronize(s));
      std::vector<float> got = logits.download();
      const std::vector<float> g = gate.download(), z = zero.download();
      for (size_t i = 0; i < z.size(); ++i) ASSERT_EQ(z[i], 0.f) << what << ": accumulator entry " << i << " not zeroed";
      int bad = 0;
      for (int64_t m = 0; m < c.M && bad < 5; ++m)
        for (int e = 0; e < c.E_ext && bad < 5; ++e) {
          double ref = 0, mag = 0;
          for (int64_t h = 0; h < c.H; ++h) {
            const double t = xd[size_t(m * c.H + h)] * double(r[size_t(e * c.H + h)]);
            ref += t;
            mag += std::fabs(t);
          }
          const float v = e < c.E ? got[size_t(m * c.E + e)] : g[size_t(m)];
          if (!(std::fabs(double(v) - ref) <= 2e-5 * mag + 1e-6)) {
            ADD_FAILURE() << what << ": logit (" << m << ", " << e << ") = " << v << ", float64 " << ref;
            ++bad;
          }
        }
      if (run == 0) {
        first = got;
        first_gate = g;
      } else {
        EXPECT_EQ(first_mismatch(first, got), -1) << what << (rbf ? ": the bf16 router's logits differ" : ": a second launch differs");
        if (c.E_ext > c.E) {
          EXPECT_EQ(first_mismatch(first_gate, g), -1) << what << ": gate logit of run " << run << " differs";
        }
      }
    }
  }
  CUDA_OK(cudaStreamDestroy(s));
}

TEST(RouterLogitsGpu, MatchFloat64AndAreDeterministic) {
  WNA16_REQUIRE_GPU();
  // (Under a sanitizer: the same kernels and tile shapes at smaller M and H.)
  expect_router_logits_match(cases<RouterCase>(
      {{1, 256, 256, 7168, DType::BF16}, {8, 8, 8, 4096, DType::F16}, {33, 60, 61, 2048, DType::BF16},
       {64, 256, 256, 7168, DType::BF16}, {65, 8, 8, 4096, DType::BF16}, {118, 60, 61, 2048, DType::F16},
       {256, 8, 8, 4096, DType::BF16}, {256, 256, 256, 7168, DType::F16}, {300, 16, 17, 1004, DType::BF16},
       {517, 16, 16, 1004, DType::F16}, {1024, 64, 64, 2048, DType::BF16}, {40, 3, 4, 100, DType::BF16},
       {640, 256, 257, 2336, DType::BF16}},  // tensor cores, H split 3 ways unevenly (800, 800, 736)
      {{1, 256, 256, 1024, DType::BF16}, {8, 8, 8, 1024, DType::F16}, {33, 60, 61, 512, DType::BF16},
       {64, 256, 256, 512, DType::BF16}, {65, 8, 8, 512, DType::BF16}, {118, 60, 61, 768, DType::F16},
       {300, 16, 17, 1004, DType::BF16}, {40, 3, 4, 100, DType::BF16}}));
}

// A router whose values are exact in bf16, stored in bf16: the same logits as stored in fp32, on
// every router kernel (one row per block, split over a cluster, tiled narrow and wide, tensor
// cores; f16 and bf16 x; a gate row). Small enough for the sanitizer subsets.
TEST(RouterLogitsGpu, Bf16RouterGivesTheFp32Logits) {
  WNA16_REQUIRE_GPU();
  expect_router_logits_match({{1, 256, 256, 7168, DType::BF16}, {3, 60, 61, 2048, DType::F16},
                              {8, 8, 8, 4096, DType::F16},      {16, 256, 256, 1024, DType::BF16},
                              {40, 3, 4, 100, DType::BF16},     {65, 64, 65, 512, DType::F16},
                              {8448, 64, 64, 256, DType::BF16}, {8448, 64, 65, 256, DType::F16}},
                             /*bf16_values=*/true);
}

// The tensor-core router (at least one 64 x 64 tile per SM): partial tiles in M, E_ext and the
// last 32-k step, a gate row, bf16 and f16. Small enough for the sanitizer subsets.
TEST(RouterLogitsGpu, TensorCoreTilesMatchFloat64) {
  WNA16_REQUIRE_GPU();
  expect_router_logits_match({{8448, 64, 64, 512, DType::BF16}, {4200, 128, 129, 1008, DType::F16},
                              {4200, 128, 129, 1008, DType::BF16}});
}

}  // namespace

#endif  // WNA16_HAVE_CUDA
