// The whole CUDA MoE layer (router -> routing -> align -> GEMM1 -> GEMM2 -> top-k sum) against the
// float64 reference (moe_reference), relative Frobenius error within layer_tolerance(act): every
// format and group size, int4 / int8, bf16 / f16, act-order, shared experts (plain and gated), the
// DeepSeek routings, awkward real widths, M from 1 to 4096, E up to 256, experts with no tokens, all
// tokens on one expert; poisoned outputs; the per-expert loop baseline; graph capture and replay.
#include "gpu/gpu_test_util.h"

#ifdef WNA16_HAVE_CUDA
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "test_util.h"
#include "wna16/backend.h"
#include "wna16/cuda.h"
#include "wna16/error.h"
#include "wna16/half.h"
#include "wna16/moe.h"
#include "wna16/reference.h"

namespace wna16::cuda {
namespace {

struct Dev {
  void* p = nullptr;
  explicit Dev(size_t n) { cudaMalloc(&p, n ? n : 4); }
  ~Dev() { cudaFree(p); }
};

uint16_t to_act(DType t, float f) { return t == DType::BF16 ? float_to_bf16(f) : float_to_f16(f); }
float from_act(DType t, uint16_t h) { return t == DType::BF16 ? bf16_to_float(h) : f16_to_float(h); }

struct Inputs {
  std::vector<uint16_t> x;
  std::vector<float> xf;
};
Inputs random_inputs(int64_t M, int64_t H, DType act, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  Inputs in;
  in.x.resize(size_t(M * H));
  in.xf.resize(size_t(M * H));
  for (size_t i = 0; i < in.x.size(); ++i) {
    in.x[i] = to_act(act, nd(rng));
    in.xf[i] = from_act(act, in.x[i]);
  }
  return in;
}

enum class Path { Fused, PerExpertLoop };

// Runs the layer on fresh inputs with a NaN-poisoned output; returns the relative error.
// x_offset: bytes from an allocation's start to x (a multiple of 16).
double layer_error(const MoeLayerSpec& spec, const MoeLayerWeights& w, const CudaMoeLayer& layer, DType act, int64_t M,
                   uint64_t seed, Path path = Path::Fused, size_t x_offset = 0) {
  const int64_t H = spec.hidden;
  const Inputs in = random_inputs(M, H, act, seed);
  const std::vector<double> ref = moe_reference(spec, w, in.xf.data(), M);
  Dev xa(in.x.size() * 2 + x_offset), out(in.x.size() * 2), ws(layer.workspace_bytes(M));
  void* x = static_cast<char*>(xa.p) + x_offset;
  cudaMemcpy(x, in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice);
  cudaMemset(out.p, 0xFF, in.x.size() * 2);
  if (path == Path::Fused) layer.forward(x, out.p, M, act, ws.p, layer.workspace_bytes(M), nullptr);
  else layer.forward_per_expert_loop(x, out.p, M, act, ws.p, layer.workspace_bytes(M), nullptr);
  if (cudaDeviceSynchronize() != cudaSuccess) return INFINITY;
  std::vector<uint16_t> o(in.x.size());
  cudaMemcpy(o.data(), out.p, o.size() * 2, cudaMemcpyDeviceToHost);
  std::vector<float> of(o.size());
  for (size_t i = 0; i < o.size(); ++i) of[i] = from_act(act, o[i]);
  return rel_error(of.data(), ref.data(), M * H);  // NaN (unwritten) anywhere gives +inf
}

MoeLayerSpec spec_of(const std::string& name, int64_t H, int64_t I, int E, int k) {
  MoeLayerSpec s;
  s.name = name;
  s.hidden = H;
  s.inter = I;
  s.routing.num_experts = E;
  s.routing.top_k = k;
  return s;
}

// DeepSeek-V3's routing on a small layer: 256 experts, top 8 in 4 of 8 groups, a shared expert.
MoeLayerSpec dsv3_like() {
  MoeLayerSpec s = spec_of("dsv3-like", 256, 128, 256, 8);
  s.routing.method = RoutingMethod::NoauxTc;
  s.routing.n_group = 8;
  s.routing.topk_group = 4;
  s.shared_kind = SharedExpertKind::Plain;
  s.shared_inter = 128;
  return s;
}
// A wide layer (K * bits >= 16384) with a shared expert: its shared slices run ahead of the
// routing chain (in K parts at one token without act-order).
MoeLayerSpec wide_shared() {
  MoeLayerSpec s = spec_of("wide-shared", 4096, 128, 16, 4);
  s.shared_kind = SharedExpertKind::Plain;
  s.shared_inter = 256;
  return s;
}

using test::error_of;
using test::scheme;

std::string fmt_case(const MoeLayerSpec& spec, const QuantScheme& scheme, DType act) {
  return spec.name + " H=" + std::to_string(spec.hidden) + " I=" + std::to_string(spec.inter) + " E=" +
         std::to_string(spec.routing.num_experts) + " k=" + std::to_string(spec.routing.top_k) +
         (spec.routing.renormalize ? " renorm " : " ") + scheme.describe() + " " + dtype_name(act);
}

void check_layer(const MoeLayerSpec& spec, const QuantScheme& scheme, DType act, std::vector<int64_t> Ms,
                 uint64_t seed = 1) {
  SCOPED_TRACE(spec.name + " " + scheme.describe() + " " + dtype_name(act));
  const MoeLayerWeights w = random_layer(spec, scheme, seed);
  const CudaMoeLayer layer(spec, w);
  for (int64_t M : Ms) {
    const double err = layer_error(spec, w, layer, act, M, seed * 1000 + uint64_t(M));
    EXPECT_LT(err, layer_tolerance(act)) << "M=" << M;
  }
}

TEST(CudaLayer, SmallPresetInt4Bf16AllM) {
  WNA16_REQUIRE_GPU();
  check_layer(preset("small"), scheme(Format::GptqV1, 4, 128, true), DType::BF16, {1, 3, 17, 118, 1024, 4096});
}

TEST(CudaLayer, FormatsAndGroups) {
  WNA16_REQUIRE_GPU();
  const MoeLayerSpec s = preset("small");
  check_layer(s, scheme(Format::GptqV2, 4, 64, false), DType::F16, {1, 17, 118});
  check_layer(s, scheme(Format::Awq, 4, 128, false), DType::BF16, {3, 118});
  check_layer(s, scheme(Format::Awq, 4, 32, false), DType::F16, {17});
  check_layer(s, scheme(Format::GptqV1, 4, 32, false), DType::BF16, {3, 118});
  check_layer(s, scheme(Format::GptqV1, 4, -1, true), DType::BF16, {1, 118});
  check_layer(s, scheme(Format::GptqV1, 4, -1, true), DType::F16, {17});
}

TEST(CudaLayer, Int8) {
  WNA16_REQUIRE_GPU();
  const MoeLayerSpec s = preset("small");
  check_layer(s, scheme(Format::GptqV1, 8, 128, true), DType::BF16, {1, 17, 118});
  check_layer(s, scheme(Format::GptqV2, 8, 32, false), DType::F16, {3, 118});
  check_layer(s, scheme(Format::GptqV1, 8, 64, false), DType::BF16, {1024});
  check_layer(s, scheme(Format::GptqV1, 8, -1, true), DType::F16, {1, 1024});
}

TEST(CudaLayer, ActOrder) {
  WNA16_REQUIRE_GPU();
  const MoeLayerSpec s = preset("small");
  // random_layer gives gate and up different act-order permutations: the dual-gather path.
  check_layer(s, scheme(Format::GptqV1, 4, 64, true, true), DType::BF16, {1, 17, 118, 1024});
  check_layer(s, scheme(Format::GptqV2, 4, 32, false, true), DType::F16, {3, 118});
  check_layer(s, scheme(Format::GptqV1, 8, 128, true, true), DType::BF16, {17});
}

// GPTQ act-order with one channel order per expert for gate and up, as real checkpoints have it
// (desc_act orders channels by the Hessian of the linear's input, which gate and up share): x is
// gathered per slot (launch_gather_slots) and GEMM1 runs the kernels of plain checkpoints (the
// decode kernel with its handoff, the wgmma prefill kernel on k-permuted rows) at every M, with
// shared experts, and in the per-expert loop. ActOrder above keeps distinct gate/up orders.
MoeLayerWeights one_order_per_expert(MoeLayerWeights w) {
  for (ExpertWeights& e : w.experts) e.up.g_idx = e.gate.g_idx;
  if (w.shared) w.shared->up.g_idx = w.shared->gate.g_idx;
  return w;
}

TEST(CudaLayer, ActOrderGatheredPerSlot) {
  WNA16_REQUIRE_GPU();
  auto check = [](const MoeLayerSpec& s, const QuantScheme& q, DType act, std::vector<int64_t> Ms, uint64_t seed) {
    SCOPED_TRACE(s.name + " " + q.describe() + " " + dtype_name(act));
    const MoeLayerWeights w = one_order_per_expert(random_layer(s, q, seed));
    ASSERT_FALSE(w.experts[0].gate.g_idx.empty());
    const CudaMoeLayer layer(s, w);
    for (int64_t M : Ms)
      EXPECT_LT(layer_error(s, w, layer, act, M, seed * 1000 + uint64_t(M)), layer_tolerance(act)) << "M=" << M;
    for (int64_t M : {int64_t(1), int64_t(118)})
      EXPECT_LT(layer_error(s, w, layer, act, M, seed + uint64_t(M), Path::PerExpertLoop), layer_tolerance(act))
          << "per-expert loop, M=" << M;
  };
  const MoeLayerSpec small = preset("small");
  check(small, scheme(Format::GptqV1, 4, 64, true, true), DType::BF16, {1, 3, 17, 118, 1024, 4096}, 11);
  check(small, scheme(Format::GptqV2, 4, 32, false, true), DType::F16, {1, 118}, 12);
  check(small, scheme(Format::GptqV1, 8, 128, true, true), DType::BF16, {1, 17, 1024}, 13);
  MoeLayerSpec v2 = spec_of("dsv2-lite-like", 256, 128, 64, 6);
  v2.routing.method = RoutingMethod::GroupLimitedGreedy;
  v2.routing.n_group = 8;
  v2.routing.topk_group = 3;
  v2.shared_kind = SharedExpertKind::Plain;
  v2.shared_inter = 256;
  check(v2, scheme(Format::GptqV1, 4, 128, true, true), DType::BF16, {1, 17, 118}, 14);
  MoeLayerSpec q = spec_of("qwen1.5-like", 256, 128, 60, 4);
  q.shared_kind = SharedExpertKind::SigmoidGated;
  q.shared_inter = 512;
  check(q, scheme(Format::GptqV1, 4, 128, false, true), DType::F16, {1, 3}, 15);
  // A wide layer (K * bits >= 16384) with a shared expert: up to 16 tokens its shared slices'
  // rows are gathered before the routing and run ahead of the wait; 17 tokens take the usual order.
  check(wide_shared(), scheme(Format::GptqV1, 4, 128, true, true), DType::BF16, {1, 3, 16, 17}, 16);
}

TEST(CudaLayer, DeepSeekV3Routing256Experts) {
  WNA16_REQUIRE_GPU();
  MoeLayerSpec s = dsv3_like();
  s.routing.routed_scaling_factor = 2.5;
  check_layer(s, scheme(Format::GptqV1, 4, 128, true), DType::BF16, {1, 3, 17, 118});
  check_layer(s, scheme(Format::Awq, 4, 64, false), DType::F16, {17});
}

// A hidden size of 4096 makes GEMM1 run the shared slices' items in K parts on several blocks at
// one token (shared_slice_parts_pay; GemmRun::pre_scratch: the router zero-fills their counts and
// the routing kernel releases the chain only after it); the layer must equal the reference as
// before, and at 2 and 17 tokens (no parts) too.
TEST(CudaLayer, SharedSlicesInKParts) {
  WNA16_REQUIRE_GPU();
  MoeLayerSpec s = spec_of("shared-k-parts", 4096, 128, 64, 6);
  s.shared_kind = SharedExpertKind::Plain;
  s.shared_inter = 256;
  check_layer(s, scheme(Format::GptqV1, 4, 128, true), DType::BF16, {1, 17});
  check_layer(s, scheme(Format::Awq, 4, 64, false), DType::F16, {1, 2});
}

TEST(CudaLayer, DeepSeekV2AndQwenShapes) {
  WNA16_REQUIRE_GPU();
  MoeLayerSpec v2 = spec_of("dsv2-lite-like", 256, 128, 64, 6);
  v2.routing.method = RoutingMethod::GroupLimitedGreedy;
  v2.routing.n_group = 8;
  v2.routing.topk_group = 3;
  v2.routing.renormalize = false;
  v2.routing.routed_scaling_factor = 1.5;
  v2.shared_kind = SharedExpertKind::Plain;
  v2.shared_inter = 256;
  check_layer(v2, scheme(Format::GptqV1, 4, 64, true), DType::BF16, {3, 118});
  // Qwen1.5-like: sigmoid-gated shared expert 4x wider than a routed one; no renormalisation.
  MoeLayerSpec q = spec_of("qwen1.5-like", 256, 128, 60, 4);
  q.routing.renormalize = false;
  q.shared_kind = SharedExpertKind::SigmoidGated;
  q.shared_inter = 512;
  check_layer(q, scheme(Format::GptqV1, 4, 128, true), DType::F16, {1, 118});
  // Shared width not a multiple of I (the last slice is zero-padded).
  MoeLayerSpec odd = spec_of("shared-192", 256, 128, 8, 2);
  odd.shared_kind = SharedExpertKind::Plain;
  odd.shared_inter = 192;
  check_layer(odd, scheme(Format::GptqV1, 4, 64, true), DType::BF16, {3, 17});
  check_layer(odd, scheme(Format::GptqV1, 4, -1, false), DType::BF16, {17});
}

TEST(CudaLayer, AwkwardRealWidths) {
  WNA16_REQUIRE_GPU();
  check_layer(spec_of("H576-I1408", 576, 1408, 4, 2), scheme(Format::GptqV1, 4, 64, true), DType::BF16, {1, 17});
  check_layer(spec_of("H256-I1344", 256, 1344, 4, 2), scheme(Format::Awq, 4, 64, false), DType::F16, {3});
  check_layer(spec_of("H512-I768", 512, 768, 8, 2), scheme(Format::GptqV1, 4, 128, true), DType::BF16, {17});
  check_layer(spec_of("K10944", 10944, 128, 4, 2), scheme(Format::GptqV1, 4, 64, true), DType::BF16, {3});
  check_layer(spec_of("E1", 256, 128, 1, 1), scheme(Format::GptqV1, 4, 128, true), DType::BF16, {1, 118});
}

// A router whose values are exact in bf16 (as real checkpoints store it, with the gate row of a
// gated shared expert) is kept in bf16: half its bytes (weight_bytes against the same layer with one
// value that bf16 cannot hold) and the layer still equals the reference, at decode and prefill M.
TEST(CudaLayer, Bf16ExactRouterIsStoredInBf16) {
  WNA16_REQUIRE_GPU();
  MoeLayerSpec q = spec_of("qwen-like-bf16-router", 256, 128, 60, 4);
  q.shared_kind = SharedExpertKind::SigmoidGated;
  q.shared_inter = 256;
  MoeLayerWeights w = random_layer(q, scheme(Format::GptqV1, 4, 128, true), 9);
  for (auto& v : w.router) v = round_to(DType::BF16, v);
  for (auto& v : w.shared_gate) v = round_to(DType::BF16, v);
  const CudaMoeLayer layer(q, w);
  for (int64_t M : {1, 17, 118, 1024}) {
    EXPECT_LT(layer_error(q, w, layer, DType::BF16, M, 31 + uint64_t(M)), layer_tolerance(DType::BF16)) << "M=" << M;
    EXPECT_LT(layer_error(q, w, layer, DType::F16, M, 41 + uint64_t(M)), layer_tolerance(DType::F16)) << "M=" << M;
  }
  MoeLayerWeights w32 = w;
  w32.router[7] = std::nextafter(w32.router[7], 1.f);  // not exact in bf16: the fp32 router
  const CudaMoeLayer layer32(q, w32);
  const size_t rows = size_t(q.routing.num_experts + 1);
  EXPECT_EQ(layer32.weight_bytes() - layer.weight_bytes(), rows * size_t(q.hidden) * 2);
  EXPECT_LT(layer_error(q, w32, layer32, DType::BF16, 17, 51), layer_tolerance(DType::BF16));
}

TEST(CudaLayer, AllTokensOnOneExpert) {
  WNA16_REQUIRE_GPU();
  MoeLayerSpec s = spec_of("one-expert", 256, 128, 16, 1);
  s.routing.method = RoutingMethod::NoauxTc;
  s.routing.n_group = 1;
  s.routing.topk_group = 1;
  MoeLayerWeights w = random_layer(s, scheme(Format::GptqV1, 4, 128, true), 5);
  for (auto& b : w.correction_bias) b = 0.f;
  w.correction_bias[5] = 100.f;  // every token selects expert 5 (its weight is the unbiased score)
  const CudaMoeLayer layer(s, w);
  for (int64_t M : {1, 118, 1024}) {
    Routing r;
    const Inputs in = random_inputs(M, s.hidden, DType::BF16, 77);
    moe_reference(s, w, in.xf.data(), M, &r);
    for (int32_t id : r.ids) ASSERT_EQ(id, 5);
    EXPECT_LT(layer_error(s, w, layer, DType::BF16, M, 77), layer_tolerance(DType::BF16)) << "M=" << M;
  }
}

// One token without shared experts, softmax routing over at most 32 experts, int4 in groups of
// 128: the decode GEMMs route the token themselves from the router logits and no routing kernel
// runs (gemm_routes). The layer equals the reference and the per-expert loop (which routes with
// the routing kernel) for E from 1 to 32, top-k 1 to 8, with and without renormalisation, zero
// points, bf16 / f16, a layer wide enough for the m-block handoff (2048 x 8192, two experts), tied
// logits (a zero router: the lowest experts win, equal weights), and a graph replayed on a new
// token; other weights (int8, groups of 64) take the routing kernel and must match as well.
TEST(CudaLayer, OneTokenRoutedInTheGemms) {
  WNA16_REQUIRE_GPU();
  struct Case {
    int64_t H, I;
    int E, k;
    bool renorm;
    QuantScheme q;
    DType act;
  };
  const Case cases[] = {
      {256, 128, 8, 2, true, scheme(Format::GptqV1, 4, 128, true), DType::BF16},
      {256, 256, 32, 4, false, scheme(Format::Awq, 4, 128, false), DType::F16},
      {384, 128, 32, 8, true, scheme(Format::GptqV2, 4, 128, false), DType::BF16},
      {256, 128, 1, 1, false, scheme(Format::GptqV1, 4, 128, true), DType::F16},
      {2048, 8192, 2, 2, true, scheme(Format::GptqV1, 4, 128, true), DType::BF16},
      {512, 128, 2, 2, true, scheme(Format::GptqV1, 8, 128, true), DType::BF16},
      {256, 192, 8, 2, true, scheme(Format::GptqV2, 4, 64, false), DType::F16},
  };
  for (const Case& c : cases) {
    MoeLayerSpec s = spec_of("gemm-routed", c.H, c.I, c.E, c.k);
    s.routing.renormalize = c.renorm;
    SCOPED_TRACE(fmt_case(s, c.q, c.act));
    MoeLayerWeights w = random_layer(s, c.q, 31);
    for (int tied = 0; tied < 2; ++tied) {
      if (tied) std::fill(w.router.begin(), w.router.end(), 0.f);
      const CudaMoeLayer layer(s, w);
      EXPECT_LT(layer_error(s, w, layer, c.act, 1, 41), layer_tolerance(c.act)) << "tied logits " << tied;
      EXPECT_LT(layer_error(s, w, layer, c.act, 1, 41, Path::PerExpertLoop), layer_tolerance(c.act))
          << "loop, tied logits " << tied;
    }
  }
  // Captured once, replayed on a new token.
  const MoeLayerSpec s = spec_of("gemm-routed-graph", 256, 128, 8, 2);
  const MoeLayerWeights w = random_layer(s, scheme(Format::GptqV1, 4, 128, true), 32);
  const CudaMoeLayer layer(s, w);
  const DType act = DType::BF16;
  const Inputs a = random_inputs(1, s.hidden, act, 51), b = random_inputs(1, s.hidden, act, 52);
  Dev x(size_t(s.hidden) * 2), out(size_t(s.hidden) * 2), ws(layer.workspace_bytes(1));
  cudaStream_t st;
  CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  CUDA_OK(cudaMemcpy(x.p, a.x.data(), size_t(s.hidden) * 2, cudaMemcpyHostToDevice));
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  layer.forward(x.p, out.p, 1, act, ws.p, layer.workspace_bytes(1), st);
  CUDA_OK(cudaStreamEndCapture(st, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaMemcpy(x.p, b.x.data(), size_t(s.hidden) * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(out.p, 0xFF, size_t(s.hidden) * 2));
  CUDA_OK(cudaGraphLaunch(exec, st));
  CUDA_OK(cudaStreamSynchronize(st));
  std::vector<uint16_t> o(size_t(s.hidden));
  CUDA_OK(cudaMemcpy(o.data(), out.p, o.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<float> of(o.size());
  for (size_t i = 0; i < o.size(); ++i) of[i] = from_act(act, o[i]);
  const std::vector<double> ref = moe_reference(s, w, b.xf.data(), 1);
  EXPECT_LT(rel_error(of.data(), ref.data(), s.hidden), layer_tolerance(act)) << "graph replay on a new token";
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(st));
}

TEST(CudaLayer, PerExpertLoopBaselineMatches) {
  WNA16_REQUIRE_GPU();
  const MoeLayerSpec s = preset("small");
  const MoeLayerWeights w = random_layer(s, scheme(Format::GptqV1, 4, 128, true), 3);
  const CudaMoeLayer layer(s, w);
  for (int64_t M : {1, 17, 1024})
    EXPECT_LT(layer_error(s, w, layer, DType::BF16, M, 9, Path::PerExpertLoop), layer_tolerance(DType::BF16))
        << "M=" << M;
}

TEST(CudaLayer, GraphCaptureReplayWithNewInputs) {
  WNA16_REQUIRE_GPU();
  const MoeLayerSpec s = preset("small");
  const DType act = DType::BF16;
  const MoeLayerWeights w = random_layer(s, scheme(Format::GptqV1, 4, 128, true), 4);
  const CudaMoeLayer layer(s, w);
  for (int64_t M : {3, 118}) {
    const int64_t n = M * s.hidden;
    Dev x(size_t(n) * 2), out(size_t(n) * 2), ws(layer.workspace_bytes(M));
    cudaStream_t st;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const Inputs a = random_inputs(M, s.hidden, act, 100), b = random_inputs(M, s.hidden, act, 200);
    CUDA_OK(cudaMemcpy(x.p, a.x.data(), size_t(n) * 2, cudaMemcpyHostToDevice));
    cudaGraph_t graph;
    CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    layer.forward(x.p, out.p, M, act, ws.p, layer.workspace_bytes(M), st);
    CUDA_OK(cudaStreamEndCapture(st, &graph));
    cudaGraphExec_t exec;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    // Replay on new inputs, then the eager call on the same inputs.
    CUDA_OK(cudaMemcpy(x.p, b.x.data(), size_t(n) * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(out.p, 0xFF, size_t(n) * 2));
    CUDA_OK(cudaGraphLaunch(exec, st));
    CUDA_OK(cudaStreamSynchronize(st));
    const size_t nn = static_cast<size_t>(n);
    std::vector<uint16_t> replay(nn), eager(nn);
    CUDA_OK(cudaMemcpy(replay.data(), out.p, size_t(n) * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemset(out.p, 0xFF, size_t(n) * 2));
    layer.forward(x.p, out.p, M, act, ws.p, layer.workspace_bytes(M), st);
    CUDA_OK(cudaStreamSynchronize(st));
    CUDA_OK(cudaMemcpy(eager.data(), out.p, size_t(n) * 2, cudaMemcpyDeviceToHost));
    const std::vector<double> ref = moe_reference(s, w, b.xf.data(), M);
    std::vector<float> rf(nn), ef(nn);
    std::vector<double> ed(nn);
    for (int64_t i = 0; i < n; ++i) {
      rf[size_t(i)] = from_act(act, replay[size_t(i)]);
      ef[size_t(i)] = from_act(act, eager[size_t(i)]);
      ed[size_t(i)] = ef[size_t(i)];
    }
    EXPECT_LT(rel_error(rf.data(), ref.data(), n), layer_tolerance(act)) << "replay, M=" << M;
    EXPECT_LT(rel_error(ef.data(), ref.data(), n), layer_tolerance(act)) << "eager, M=" << M;
    // fp32 atomics may add in another order (three slots per token here: two experts and the
    // shared one), so an output may round to the neighbouring bf16 value: every output within one
    // ulp, and only a few of them differing at all. NOTE: a norm-wise bound does not work at M=3,
    // where a single flipped output of 768 moves the relative error by ~5e-4.
    int64_t differ = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float r = rf[size_t(i)], e = ef[size_t(i)];
      if (r == e) continue;
      ++differ;
      const float ulp = std::ldexp(1.0f, std::ilogb(std::max(std::fabs(r), std::fabs(e))) - 7);  // bf16: 8 bits
      EXPECT_LE(std::fabs(r - e), ulp) << "replay vs eager, M=" << M << " output " << i << ": " << r << " vs " << e;
    }
    EXPECT_LE(differ, std::max<int64_t>(8, n / 100)) << "replay vs eager, M=" << M << ": outputs that differ";
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    CUDA_OK(cudaStreamDestroy(st));
  }
}

TEST(CudaLayer, BackendAdapterForwardHost) {
  WNA16_REQUIRE_GPU();
  const MoeLayerSpec s = preset("small");
  const MoeLayerWeights w = random_layer(s, scheme(Format::GptqV1, 4, 128, true), 6);
  ASSERT_TRUE(cuda_available());
  auto layer = make_cuda_layer(s, w);
  EXPECT_EQ(layer->device(), Device::Cuda);
  const int64_t M = 9;
  const Inputs in = random_inputs(M, s.hidden, DType::F16, 8);
  std::vector<uint16_t> out(in.x.size(), 0xFFFF);
  layer->forward_host(in.x.data(), out.data(), M, DType::F16);
  const std::vector<double> ref = moe_reference(s, w, in.xf.data(), M);
  std::vector<float> of(out.size());
  for (size_t i = 0; i < out.size(); ++i) of[i] = f16_to_float(out[i]);
  EXPECT_LT(rel_error(of.data(), ref.data(), M * s.hidden), layer_tolerance(DType::F16));
}


TEST(CudaLayer, RefusesUnsupportedValuesBeforeLaunch) {
  WNA16_REQUIRE_GPU();
  const MoeLayerSpec s = preset("small");
  {
    const MoeLayerWeights w = random_layer(s, scheme(Format::GptqV1, 2, 128, true), 1);
    EXPECT_NE(error_of([&] { CudaMoeLayer l(s, w); }).find("bits=2"), std::string::npos);
  }
  {
    const MoeLayerSpec odd = spec_of("H96", 96, 64, 4, 2);
    const MoeLayerWeights w = random_layer(odd, scheme(Format::GptqV1, 4, 32, true), 1);
    const std::string msg = error_of([&] { CudaMoeLayer l(odd, w); });
    EXPECT_NE(msg.find("H=96 is not a multiple of 64"), std::string::npos) << msg;
  }
  {
    const MoeLayerWeights w = random_layer(s, scheme(Format::GptqV1, 4, 128, true), 1);
    const CudaMoeLayer l(s, w);
    Dev x(256 * 2 * 4), out(256 * 2 * 4), ws(16);
    const std::string msg = error_of([&] { l.forward(x.p, out.p, 4, DType::BF16, ws.p, 16, nullptr); });
    EXPECT_NE(msg.find("workspace of 16 bytes"), std::string::npos) << msg;
    const std::string m2 = error_of([&] { l.forward(x.p, out.p, 4, DType::F32, ws.p, 16, nullptr); });
    EXPECT_NE(m2.find("f32"), std::string::npos) << m2;
  }
  {
    // Misaligned x, out or workspace: refused naming the pointer, before any launch.
    const MoeLayerWeights w = random_layer(s, scheme(Format::GptqV1, 4, 128, true), 1);
    const CudaMoeLayer l(s, w);
    const size_t wsb = l.workspace_bytes(1);
    Dev x(256 * 2 + 16), out(256 * 2 + 16), ws(wsb + 16);
    char* xc = static_cast<char*>(x.p);
    char* oc = static_cast<char*>(out.p);
    char* wc = static_cast<char*>(ws.p);
    using Args = std::tuple<char*, char*, char*, std::string>;
    for (const Args& a : std::vector<Args>{{xc + 2, oc, wc, "x"}, {xc, oc + 8, wc, "out"}, {xc, oc, wc + 4, "workspace"}}) {
      char *xp = std::get<0>(a), *op = std::get<1>(a), *wp = std::get<2>(a);
      const std::string& name = std::get<3>(a);
      const std::string msg = error_of([&] { l.forward(xp, op, 1, DType::BF16, wp, wsb, nullptr); });
      EXPECT_NE(msg.find(name + " at "), std::string::npos) << msg;
      EXPECT_NE(msg.find("16-byte aligned"), std::string::npos) << msg;
      const std::string loop =
          error_of([&] { l.forward_per_expert_loop(xp, op, 1, DType::BF16, wp, wsb, nullptr); });
      EXPECT_NE(loop.find(name + " at "), std::string::npos) << loop;
    }
    // A 16-byte offset is accepted and computes the layer.
    EXPECT_LT(layer_error(s, w, l, DType::BF16, 1, 5, Path::Fused, 16), layer_tolerance(DType::BF16));
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
}

// Deterministic by default: the same input gives the same output bits on every run, on every path
// (the decode kernel with its K splits and the shared slices' K parts at one token, the staged and
// wgmma kernels), with a shared expert and 256 experts of top 8: no float is added by an atomic.
TEST(CudaLayer, SameBitsEveryRun) {
  WNA16_REQUIRE_GPU();
  for (const MoeLayerSpec& s : {wide_shared(), dsv3_like()}) {
    SCOPED_TRACE(s.name);
    const MoeLayerWeights w = random_layer(s, scheme(Format::GptqV1, 4, 128, true), 3);
    const CudaMoeLayer layer(s, w);
    for (int64_t M : {int64_t(1), int64_t(3), int64_t(17), int64_t(118), int64_t(1024)}) {
      const Inputs in = random_inputs(M, s.hidden, DType::BF16, 77 + uint64_t(M));
      const size_t wsb = layer.workspace_bytes(M);
      Dev x(in.x.size() * 2), out(in.x.size() * 2), ws(wsb);
      cudaMemcpy(x.p, in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice);
      std::vector<uint16_t> first, o(in.x.size());
      for (int run = 0; run < 12; ++run) {
        cudaMemset(out.p, 0xFF, in.x.size() * 2);
        layer.forward(x.p, out.p, M, DType::BF16, ws.p, wsb, nullptr);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        cudaMemcpy(o.data(), out.p, o.size() * 2, cudaMemcpyDeviceToHost);
        if (run == 0) first = o;
        else ASSERT_TRUE(o == first) << "M=" << M << ": run " << run << " differs from run 0";
      }
    }
  }
}

// Batch-invariant mode: each token's output bits are those of the same token in any other batch
// (every prefix of one batch against the whole), on the decode-sized and the prefill-sized calls,
// with 256 experts and a shared expert, a few-expert layer (the router's small kernel), and
// act-order with distinct gate and up orders (the staged gather); and still within tolerance.
TEST(CudaLayer, BatchInvariantMode) {
  WNA16_REQUIRE_GPU();
  const MoeLayerSpec v3 = dsv3_like();
  const MoeLayerSpec few = spec_of("few-experts", 512, 256, 8, 2);
  struct Case {
    MoeLayerSpec spec;
    QuantScheme q;
  };
  for (const Case& c : {Case{v3, scheme(Format::GptqV1, 4, 128, true)}, Case{few, scheme(Format::Awq, 4, 64, false)},
                        Case{few, scheme(Format::GptqV1, 4, 128, true, true)}}) {
    SCOPED_TRACE(c.spec.name + " " + c.q.describe());
    const MoeLayerWeights w = random_layer(c.spec, c.q, 4);
    CudaMoeLayer layer(c.spec, w);
    layer.set_batch_invariant(true);
    ASSERT_TRUE(layer.batch_invariant());
    EXPECT_LT(layer_error(c.spec, w, layer, DType::BF16, 17, 9), layer_tolerance(DType::BF16));
    const int64_t H = c.spec.hidden, Mmax = 600;
    const Inputs in = random_inputs(Mmax, H, DType::BF16, 5);
    const size_t wsb = layer.workspace_bytes(Mmax);
    Dev x(in.x.size() * 2), out(in.x.size() * 2), ws(wsb);
    cudaMemcpy(x.p, in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice);
    auto run = [&](int64_t M) {
      std::vector<uint16_t> o(size_t(M * H));
      cudaMemset(out.p, 0xFF, o.size() * 2);
      layer.forward(x.p, out.p, M, DType::BF16, ws.p, wsb, nullptr);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      cudaMemcpy(o.data(), out.p, o.size() * 2, cudaMemcpyDeviceToHost);
      return o;
    };
    const std::vector<uint16_t> all = run(Mmax);
    for (int64_t M : {int64_t(1), int64_t(3), int64_t(17), int64_t(118), int64_t(300)}) {
      const std::vector<uint16_t> part = run(M);
      EXPECT_TRUE(std::equal(part.begin(), part.end(), all.begin())) << "M=" << M << " differs from the first rows of M=" << Mmax;
    }
  }
}

}  // namespace
}  // namespace wna16::cuda
#endif
