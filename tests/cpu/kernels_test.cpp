// The CPU kernels at the level of one linear, apart from the fused layer: the repacked layout
// (uneven act-order groups that need padding, zero points up to 2^b, f32-only scales, partial
// column blocks) times every ISA build and 1..9 token rows, against a float64 sum. Also the
// align step against align_reference, and the thread pool.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cpu/align.h"
#include "cpu_test_util.h"
#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "cpu/packed_linear.h"
#include "cpu/thread_pool.h"
#include "cpu/xprep.h"
#include "wna16/error.h"
#include "wna16/half.h"
#include "wna16/reference.h"

namespace wna16 {
namespace {

using namespace cpu;

struct LinearCase {
  int bits;
  int64_t K, N, groups;
  bool shuffled_groups;  // g_idx random (uneven, non-monotonic groups)
  bool f16_scales;       // else scales that f16 cannot hold exactly (f32 path)
  bool sym;
};

UnpackedLinear random_unpacked(const LinearCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  UnpackedLinear u;
  u.bits = c.bits;
  u.K = c.K;
  u.N = c.N;
  u.groups = c.groups;
  const int levels = 1 << c.bits;
  u.q.resize(size_t(c.K * c.N));
  for (auto& q : u.q) q = uint8_t(rng() % uint64_t(levels));
  u.zeros.resize(size_t(c.groups * c.N));
  for (auto& z : u.zeros) z = c.sym ? levels / 2 : int32_t(rng() % uint64_t(levels + 1));  // up to 2^b
  if (!c.sym) u.zeros[0] = levels;  // GPTQ v1's largest zero, always present
  u.scales.resize(u.zeros.size());
  std::uniform_real_distribution<float> ud(0.5f, 1.5f);
  for (auto& s : u.scales) {
    s = ud(rng) * 0.01f;
    if (c.f16_scales) s = f16_to_float(float_to_f16(s));
  }
  u.g_idx.resize(size_t(c.K));
  const int64_t len = (c.K + c.groups - 1) / c.groups;
  for (int64_t k = 0; k < c.K; ++k) u.g_idx[size_t(k)] = int32_t(c.shuffled_groups ? rng() % uint64_t(c.groups) : k / len);
  return u;
}

void check_case(const LinearCase& c, uint64_t seed) {
  SCOPED_TRACE("bits=" + std::to_string(c.bits) + " K=" + std::to_string(c.K) + " N=" + std::to_string(c.N) +
               " groups=" + std::to_string(c.groups) + (c.shuffled_groups ? " shuffled" : "") +
               (c.f16_scales ? " f16-scales" : " f32-scales") + (c.sym ? " sym" : " asym"));
  const UnpackedLinear u = random_unpacked(c, seed);
  const PackedLinear L = pack_linear(u);
  EXPECT_EQ(L.scale_fmt, c.f16_scales ? ScaleFmt::F16 : ScaleFmt::F32);
  EXPECT_EQ(L.uniform_zero, c.sym);
  if (c.shuffled_groups && c.groups > 1) {
    EXPECT_FALSE(L.identity_k);
  }
  const std::vector<double> W = dequantize(u);
  std::mt19937_64 rng(seed + 1);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int max_rows = 9;
  for (DType act : {DType::BF16, DType::F16}) {
    std::vector<float> x(static_cast<size_t>(max_rows * c.K));
    for (auto& v : x) v = round_to(act, nd(rng));
    // float64 truth
    std::vector<double> ref(static_cast<size_t>(max_rows * c.N), 0.0);
    for (int t = 0; t < max_rows; ++t)
      for (int64_t k = 0; k < c.K; ++k)
        for (int64_t n = 0; n < c.N; ++n)
          ref[size_t(t * c.N + n)] += double(x[size_t(t * c.K + k)]) * W[size_t(k * c.N + n)];
    for (Isa isa : cpu_test::isas_under_test()) {
      const RowLayout rl = row_layout_for(L, isa, act);
      std::vector<uint8_t> rows_mem(static_cast<size_t>(max_rows * rl.stride) + 64);
      uint8_t* base = rows_mem.data() + (64 - reinterpret_cast<uintptr_t>(rows_mem.data()) % 64) % 64;
      std::vector<XRow> rows(max_rows);
      for (int t = 0; t < max_rows; ++t) {
        prep_row(L, rl, &x[size_t(t * c.K)], base + t * rl.stride);
        rows[size_t(t)] = view_row(rl, base + t * rl.stride);
      }
      for (int m = 1; m <= max_rows; ++m) {
        std::vector<float> got(static_cast<size_t>(m * c.N), NAN);
        std::vector<float> blk(static_cast<size_t>(m * kBlockN), NAN);
        for (int64_t nb = 0; nb < L.NB; ++nb) {
          kernels(isa).gemm_block(L, nb, rows.data(), m, blk.data());
          for (int t = 0; t < m; ++t)
            for (int64_t c2 = 0; c2 < kBlockN && nb * kBlockN + c2 < c.N; ++c2)
              got[size_t(t * c.N + nb * kBlockN + c2)] = blk[size_t(t * kBlockN + c2)];
        }
        const double err = rel_error(got.data(), ref.data(), m * c.N);
        // fp32 rows: fp32 rounding only. int8 rows: 2 terms (bf16) resolve each activation to
        // max|x| / 64516 of its 64-channel block, 3 terms (f16) to max|x| / 1.6e7 (kernels.h).
        const double tol = rl.terms == 2 ? 2e-4 : 2e-5;
        EXPECT_LE(err, tol) << isa_name(isa) << " " << dtype_name(act) << " m=" << m;
      }
    }
  }
}

TEST(CpuKernels, PackedLinearMatchesFloat64) {
  uint64_t seed = 1;
  for (int bits : {4, 8})
    for (bool shuffled : {false, true})
      for (bool f16s : {true, false})
        for (bool sym : {true, false}) {
          check_case({bits, 256, 128, 4, shuffled, f16s, sym}, ++seed);
          check_case({bits, 100, 72, 3, shuffled, f16s, sym}, ++seed);  // K % 4 != 0, partial block
          check_case({bits, 40, 8, 1, shuffled, f16s, sym}, ++seed);    // one group, N < one tile
        }
}

TEST(CpuKernels, RejectsBitsAndZerosNamingThem) {
  UnpackedLinear u = random_unpacked({4, 32, 16, 1, false, true, false}, 3);
  u.bits = 2;
  try {
    pack_linear(u);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bits=2"), std::string::npos) << e.what();
  }
  u.bits = 4;
  u.zeros[5] = 17;
  try {
    pack_linear(u);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("zero point 17"), std::string::npos) << e.what();
  }
}

TEST(CpuKernels, RouterMatchesDoubleAccumulation) {
  std::mt19937_64 rng(9);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t H = 203, E = 7;  // H not a multiple of the vector width
  std::vector<float> x(static_cast<size_t>(H)), w(static_cast<size_t>(E * H));
  for (auto& v : x) v = nd(rng);
  for (auto& v : w) v = nd(rng);
  std::vector<float> want(static_cast<size_t>(E));
  router_scalar(x.data(), w.data(), H, E, want.data());
  for (Isa isa : cpu_test::isas_under_test()) {
    std::vector<float> got(static_cast<size_t>(E), NAN);
    kernels(isa).router(x.data(), w.data(), H, E, got.data());
    for (int64_t e = 0; e < E; ++e) EXPECT_EQ(got[size_t(e)], want[size_t(e)]) << isa_name(isa) << " e=" << e;
  }
}

TEST(CpuAlign, MatchesAlignReference) {
  std::mt19937_64 rng(4);
  for (int E : {1, 3, 16, 64})
    for (int block_m : {1, 4, 16, 64})
      for (int64_t slots : {0, 1, 7, 100, 1000}) {
        std::vector<int32_t> ids(static_cast<size_t>(slots));
        // Skewed ids: many experts empty, one crowded.
        for (auto& id : ids) id = rng() % 3 == 0 ? int32_t(E - 1) : int32_t(rng() % uint64_t(std::max(1, E / 2)));
        const AlignResult want = align_reference(ids.data(), slots, E, block_m);
        const AlignResult got = align_slots(ids.data(), slots, E, block_m);
        EXPECT_EQ(got.sorted_token_ids, want.sorted_token_ids) << E << " " << block_m << " " << slots;
        EXPECT_EQ(got.expert_ids, want.expert_ids);
        EXPECT_EQ(got.num_tokens_post_padded, want.num_tokens_post_padded);
      }
  const int32_t bad[] = {0, 5};
  try {
    align_slots(bad, 2, 4, 1);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("slot 1 has expert id 5"), std::string::npos) << e.what();
  }
}

TEST(CpuThreadPool, RunsEveryTaskOnceAndPropagatesErrors) {
  ThreadPool pool(3);
  EXPECT_EQ(pool.size(), 3);
  for (int64_t n : {0, 1, 2, 5, 1000}) {
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
    pool.run(n, [&](int64_t t, int worker) {
      EXPECT_GE(worker, 0);
      EXPECT_LT(worker, 3);
      hits[size_t(t)].fetch_add(1);
    });
    for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  }
  EXPECT_THROW(pool.run(100, [](int64_t t, int) {
    if (t == 37) throw std::runtime_error("task 37");
  }), std::runtime_error);
  std::atomic<int64_t> sum{0};
  pool.run(10, [&](int64_t t, int) { sum += t; });  // still usable after an error
  EXPECT_EQ(sum.load(), 45);
}

// WNA16_CPU_THREADS sizes a default pool; anything but a whole number from 1 to 4096 is refused
// with the value named (a typo must not silently pick a size).
TEST(CpuThreadPool, ThreadsFromTheEnvironment) {
  const char* saved = std::getenv("WNA16_CPU_THREADS");
  const std::string keep = saved ? saved : "";
  ASSERT_EQ(setenv("WNA16_CPU_THREADS", "2", 1), 0);
  EXPECT_EQ(ThreadPool(0).size(), 2);
  for (const char* bad : {"0", "-3", "abc", "4x", "5000", "99999"}) {
    ASSERT_EQ(setenv("WNA16_CPU_THREADS", bad, 1), 0);
    try {
      ThreadPool pool(0);
      ADD_FAILURE() << "WNA16_CPU_THREADS=" << bad << " accepted (" << pool.size() << " threads)";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("WNA16_CPU_THREADS=") + bad), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(ThreadPool(3).size(), 3);  // an explicit size ignores the variable
  if (saved) setenv("WNA16_CPU_THREADS", keep.c_str(), 1);
  else unsetenv("WNA16_CPU_THREADS");
}

}  // namespace
}  // namespace wna16

namespace wna16 {
namespace {

TEST(CpuKernels, StreamSumEveryIsa) {
  std::vector<uint64_t> v(1003);
  for (size_t i = 0; i < v.size(); ++i) v[i] = i * 2654435761u;
  const uint64_t want = cpu::stream_sum_scalar(v.data(), int64_t(v.size()));
  for (cpu::Isa isa : cpu_test::isas_under_test())
    for (int64_t n : {0, 1, 31, 32, 1003})
      EXPECT_EQ(cpu::kernels(isa).stream_sum(v.data(), n), cpu::stream_sum_scalar(v.data(), n)) << cpu::isa_name(isa);
  EXPECT_NE(want, 0u);
}

}  // namespace
}  // namespace wna16

namespace wna16 {
namespace {

// Every SIMD activation quantizer must give exactly the scalar one's terms, scale and sum.
TEST(CpuKernels, QuantizeBlockSimdMatchesScalar) {
  using QuantizeFn = void (*)(const float*, int64_t, int, int8_t* const*, float*, float*);
  const std::pair<cpu::Isa, QuantizeFn> builds[] = {{cpu::Isa::Avx2, cpu::quantize_block_avx2},
                                                    {cpu::Isa::Avx512Vnni, cpu::quantize_block_avx512}};
  std::mt19937_64 rng(12);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (const auto& [isa, quantize] : builds) {
    if (!cpu::isa_supported(isa)) {
      std::printf("[  SKIPPED ] %s quantizer: not supported by this CPU\n", cpu::isa_name(isa));
      continue;
    }
    for (int terms : {2, 3})
      for (int64_t n : {8, 24, 64}) {
        std::vector<float> v(static_cast<size_t>(n));
        for (auto& x : v) x = nd(rng) * (rng() % 8 == 0 ? 50.f : 1.f);
        if (n == 8) std::fill(v.begin(), v.end(), 0.f);  // all-zero block
        int8_t a[3][64] = {}, b[3][64] = {};
        int8_t* qa[3] = {a[0], a[1], a[2]};
        int8_t* qb[3] = {b[0], b[1], b[2]};
        float sa = -1, sb = -2, ua = -1, ub = -2;
        cpu::quantize_block_scalar(v.data(), n, terms, qa, &sa, &ua);
        quantize(v.data(), n, terms, qb, &sb, &ub);
        EXPECT_EQ(sa, sb) << cpu::isa_name(isa);
        EXPECT_EQ(ua, ub) << cpu::isa_name(isa);
        for (int t = 0; t < terms; ++t)
          for (int64_t i = 0; i < n; ++i)
            ASSERT_EQ(a[t][i], b[t][i]) << cpu::isa_name(isa) << " term " << t << " i " << i;
        // The terms reconstruct v to within half the last term's unit, plus the float rounding of
        // v * 127 / max (2^-23 relative).
        for (int64_t i = 0; i < n; ++i) {
          double r = 0, unit = 1;
          for (int t = 0; t < terms; ++t, unit /= cpu::kTermRatio) r += a[t][i] * unit;
          const double half_unit = terms == 2 ? 0.5 / 254 : 0.5 / (254.0 * 254.0);
          EXPECT_LE(std::fabs(r * sa - v[size_t(i)]), sa * (half_unit + 127 * 0x1p-23) + 1e-12);
        }
      }
  }
}

}  // namespace
}  // namespace wna16
