// CudaMoeLayer::forward_routed (caller-owned routing, the entry an engine or the PyTorch op uses)
// against moe_reference_routed in float64: formats, bits, both activation dtypes, shared experts
// (plain and gated), M across the kernel table's rows; the device entry under graph capture with
// new ids between replays; the host adapter's refusals (ids out of range, another top_k).
#include "gpu/gpu_test_util.h"

#ifdef WNA16_HAVE_CUDA
#include <random>
#include <string>
#include <vector>

#include "wna16/backend.h"
#include "wna16/cuda.h"
#include "wna16/error.h"
#include "wna16/half.h"
#include "wna16/moe.h"
#include "wna16/reference.h"

namespace wna16::cuda {
namespace {

MoeLayerSpec routed_spec(SharedExpertKind shared, int E, int k) {
  MoeLayerSpec s;
  s.name = "routed";
  s.hidden = 256;
  s.inter = 128;
  s.routing.num_experts = E;
  s.routing.top_k = k;
  s.shared_kind = shared;
  s.shared_inter = shared == SharedExpertKind::None ? 0 : 128;
  return s;
}

// Distinct ids per token (as a router gives them), weights of either sign.
Routing random_routing(int64_t M, int k, int E, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> id(0, E - 1);
  std::uniform_real_distribution<float> wt(-0.5f, 1.5f);
  Routing r;
  r.M = M;
  r.top_k = k;
  for (int64_t m = 0; m < M; ++m)
    for (int j = 0; j < k; ++j) {
      int e = id(rng);
      for (bool seen = true; seen; e = seen ? id(rng) : e) {
        seen = false;
        for (int i = 0; i < j; ++i) seen = seen || r.ids[size_t(m * k + i)] == e;
      }
      r.ids.push_back(e);
      r.weights.push_back(wt(rng));
    }
  return r;
}

std::vector<uint16_t> random_x(int64_t n, DType act, uint64_t seed, std::vector<float>* values) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> x(static_cast<size_t>(n));
  values->resize(static_cast<size_t>(n));
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = act == DType::BF16 ? float_to_bf16(nd(rng)) : float_to_f16(nd(rng));
    (*values)[i] = act == DType::BF16 ? bf16_to_float(x[i]) : f16_to_float(x[i]);
  }
  return x;
}

double routed_error(MoeBackendLayer& layer, const MoeLayerSpec& spec, const MoeLayerWeights& w, DType act, int64_t M,
                    uint64_t seed) {
  std::vector<float> xf;
  const std::vector<uint16_t> x = random_x(M * spec.hidden, act, seed, &xf);
  const Routing r = random_routing(M, spec.routing.top_k, spec.routing.num_experts, seed + 1);
  std::vector<uint16_t> out(x.size(), 0xFFFF);  // NaN in bf16 and f16: an unwritten element fails
  layer.forward_routed_host(x.data(), r.ids.data(), r.weights.data(), r.top_k, out.data(), M, act);
  const std::vector<double> ref = moe_reference_routed(spec, w, xf.data(), M, r);
  std::vector<float> got(out.size());
  for (size_t i = 0; i < out.size(); ++i) got[i] = act == DType::BF16 ? bf16_to_float(out[i]) : f16_to_float(out[i]);
  return rel_error(got.data(), ref.data(), M * spec.hidden);
}

TEST(CudaRoutedLayer, MatchesReferenceAcrossFormatsSharedKindsAndM) {
  WNA16_REQUIRE_GPU();
  const QuantScheme schemes[] = {{Format::GptqV1, 4, 128, true, false},
                                 {Format::GptqV2, 4, 32, false, false},
                                 {Format::Awq, 4, 64, false, false},
                                 {Format::GptqV1, 8, 128, true, false},
                                 {Format::GptqV1, 4, 128, true, true}};
  uint64_t seed = 40;
  int i = 0;
  for (const QuantScheme& q : schemes)
    for (SharedExpertKind sk : {SharedExpertKind::None, SharedExpertKind::Plain, SharedExpertKind::SigmoidGated}) {
      const MoeLayerSpec spec = routed_spec(sk, 8, 2);
      const MoeLayerWeights w = random_layer(spec, q, ++seed);
      auto layer = make_cuda_layer(spec, w);
      // 1 and 7 tokens: the decode kernel; 100 (25 per expert): m32w; 600 (150): m144w.
      for (int64_t M : {int64_t(1), int64_t(7), int64_t(100), int64_t(600)}) {
        const DType act = (i++ % 2) ? DType::F16 : DType::BF16;
        SCOPED_TRACE(q.describe() + " shared " + std::to_string(int(sk)) + " " + dtype_name(act) +
                     " M=" + std::to_string(M));
        const double err = routed_error(*layer, spec, w, act, M, ++seed);
        EXPECT_LE(err, layer_tolerance(act)) << "rel error " << err;
      }
    }
}

// The device entry in a CUDA graph: new x, ids and weights uploaded between replays give the
// reference of each.
TEST(CudaRoutedLayer, GraphReplayWithNewRouting) {
  WNA16_REQUIRE_GPU();
  const MoeLayerSpec spec = routed_spec(SharedExpertKind::SigmoidGated, 16, 4);
  const MoeLayerWeights w = random_layer(spec, QuantScheme{Format::GptqV1, 4, 128, true, false}, 9);
  CudaMoeLayer layer(spec, w);
  const int64_t M = 40, H = spec.hidden, k = spec.routing.top_k;
  void *x = nullptr, *out = nullptr, *ids = nullptr, *wts = nullptr, *ws = nullptr;
  const size_t ws_bytes = layer.workspace_bytes(M);
  CUDA_OK(cudaMalloc(&x, size_t(M * H * 2)));
  CUDA_OK(cudaMalloc(&out, size_t(M * H * 2)));
  CUDA_OK(cudaMalloc(&ids, size_t(M * k * 4)));
  CUDA_OK(cudaMalloc(&wts, size_t(M * k * 4)));
  CUDA_OK(cudaMalloc(&ws, ws_bytes));
  cudaStream_t st = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  layer.forward_routed(x, static_cast<const int32_t*>(ids), static_cast<const float*>(wts), int(k), out, M,
                       DType::BF16, ws, ws_bytes, st);
  CUDA_OK(cudaStreamEndCapture(st, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (uint64_t rep = 0; rep < 3; ++rep) {
    std::vector<float> xf;
    const std::vector<uint16_t> xh = random_x(M * H, DType::BF16, 70 + rep, &xf);
    const Routing r = random_routing(M, int(k), spec.routing.num_experts, 80 + rep);
    std::vector<uint16_t> o(size_t(M * H), 0xFFFF);
    CUDA_OK(cudaMemcpyAsync(x, xh.data(), xh.size() * 2, cudaMemcpyHostToDevice, st));
    CUDA_OK(cudaMemcpyAsync(ids, r.ids.data(), r.ids.size() * 4, cudaMemcpyHostToDevice, st));
    CUDA_OK(cudaMemcpyAsync(wts, r.weights.data(), r.weights.size() * 4, cudaMemcpyHostToDevice, st));
    CUDA_OK(cudaMemcpyAsync(out, o.data(), o.size() * 2, cudaMemcpyHostToDevice, st));
    CUDA_OK(cudaGraphLaunch(exec, st));
    CUDA_OK(cudaMemcpyAsync(o.data(), out, o.size() * 2, cudaMemcpyDeviceToHost, st));
    CUDA_OK(cudaStreamSynchronize(st));
    const std::vector<double> ref = moe_reference_routed(spec, w, xf.data(), M, r);
    std::vector<float> got(o.size());
    for (size_t i = 0; i < o.size(); ++i) got[i] = bf16_to_float(o[i]);
    const double err = rel_error(got.data(), ref.data(), M * H);
    EXPECT_LE(err, layer_tolerance(DType::BF16)) << "replay " << rep << ": rel error " << err;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(st);
  for (void* p : {x, out, ids, wts, ws}) cudaFree(p);
}

TEST(CudaRoutedLayer, RefusesBadRoutingNamingTheValue) {
  WNA16_REQUIRE_GPU();
  const MoeLayerSpec spec = routed_spec(SharedExpertKind::None, 6, 2);
  const MoeLayerWeights w = random_layer(spec, QuantScheme{Format::GptqV1, 4, 128, true, false}, 3);
  auto layer = make_cuda_layer(spec, w);
  std::vector<uint16_t> x(size_t(2 * spec.hidden), 0), out(x.size());
  auto message = [&](std::vector<int32_t> ids, std::vector<float> wts, int k) {
    try {
      layer->forward_routed_host(x.data(), ids.data(), wts.data(), k, out.data(), 2, DType::BF16);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({0, 1, 2, 6}, {1, 1, 1, 1}, 2).find("topk_ids[1, 1]=6 is outside [0, 6)"), std::string::npos);
  // The CUDA backend takes the layer's top_k only.
  const std::string k3 = message({0, 1, 2, 3, 4, 5}, {1, 1, 1, 1, 1, 1}, 3);
  EXPECT_NE(k3.find("top_k=3"), std::string::npos) << k3;
  EXPECT_NE(k3.find("top_k=2"), std::string::npos) << k3;
}

}  // namespace
}  // namespace wna16::cuda
#endif  // WNA16_HAVE_CUDA
