// Kernel-engineer's timing smoke (not the benchmark: `wna16 bench --device cuda` is): real preset
// shapes, int4 g128 bf16, fused single launch vs the per-expert loop, microseconds, GB/s against the
// read-bandwidth floor and TFLOP/s. Skipped unless WNA16_GPU_PERF is set (it loads GBs of weights);
// WNA16_GPU_PERF_MODELS (comma list) and WNA16_GPU_PERF_MS restrict it. Correctness of the same
// layer is the layer tests' job; here only a finite-output check.
#include "gpu/gpu_test_util.h"

#ifdef WNA16_HAVE_CUDA
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "bench/cuda/bench_weights.h"
#include "wna16/cuda.h"
#include "wna16/half.h"
#include "wna16/moe.h"
#include "wna16/reference.h"

namespace wna16::cuda {
namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  for (std::string t; std::getline(ss, t, ',');)
    if (!t.empty()) v.push_back(t);
  return v;
}

struct Dev {
  void* p = nullptr;
  explicit Dev(size_t n) { cudaMalloc(&p, n ? n : 4); }
  ~Dev() { cudaFree(p); }
};

template <class F>
double median_us(cudaStream_t st, int reps, F&& f) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ts;
  for (int r = 0; r < reps; ++r) {
    cudaEventRecord(a, st);
    f();
    cudaEventRecord(b, st);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    ts.push_back(ms * 1000.f);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

TEST(CudaPerf, PresetTimings) {
  WNA16_REQUIRE_GPU();
  if (!std::getenv("WNA16_GPU_PERF")) GTEST_SKIP() << "set WNA16_GPU_PERF=1 to run the timing smoke";
  std::vector<std::string> models = {"deepseek-v3", "mixtral-8x7b"};
  if (const char* m = std::getenv("WNA16_GPU_PERF_MODELS")) models = split(m);
  std::vector<int64_t> ms = {1, 16, 64, 256, 1024, 4096};
  if (const char* m = std::getenv("WNA16_GPU_PERF_MS")) {
    ms.clear();
    for (const auto& t : split(m)) ms.push_back(std::stoll(t));
  }
  const double bw = 4.38e12;  // measured read-stream ceiling (../shared/docs/performance.md)
  QuantScheme q;
  q.bits = 4;
  q.group_size = 128;
  const DType act = DType::BF16;
  cudaStream_t st;
  CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  std::printf("%-14s %6s %9s %9s %8s %7s %8s %7s %6s\n", "model", "M", "fused_us", "loop_us", "x_loop", "experts",
              "GB/s", "%bw", "TFLOP/s");
  for (const auto& name : models) {
    const MoeLayerSpec spec = preset(name);
    const MoeLayerWeights w = bench::random_bench_layer(spec, q, 1);
    const CudaMoeLayer layer(spec, w);
    const int64_t H = spec.hidden, E = spec.routing.num_experts, k = spec.routing.top_k;
    const int64_t S = spec.shared_kind == SharedExpertKind::None ? 0 : (spec.shared_inter + spec.inter - 1) / spec.inter;
    const double bytes_per_expert = double(layer.weight_bytes()) / double(E + S);
    const int64_t maxM = *std::max_element(ms.begin(), ms.end());
    constexpr int kSlices = 8;  // different token slices per call: different experts, colder L2
    const std::vector<uint16_t> xh = bench::random_activations(maxM * kSlices, H, act, 7);
    Dev x(xh.size() * 2), out(size_t(maxM * H) * 2), ws(layer.workspace_bytes(maxM));
    CUDA_OK(cudaMemcpy(x.p, xh.data(), xh.size() * 2, cudaMemcpyHostToDevice));
    for (int64_t M : ms) {
      auto xs = [&](int i) { return static_cast<const char*>(x.p) + size_t(i % kSlices) * size_t(M * H) * 2; };
      // Distinct experts per call, from the reference routing (small M only; all experts otherwise).
      double experts = double(E);
      if (M <= 64) {
        double sum = 0;
        for (int i = 0; i < kSlices; ++i) {
          std::vector<float> xf(size_t(M * H));
          for (size_t j = 0; j < xf.size(); ++j) xf[j] = bf16_to_float(xh[size_t(i) * size_t(M * H) + j]);
          const std::vector<float> lg = router_logits_reference(spec, w, xf.data(), M);
          const Routing r = route_reference(spec.routing, lg.data(), M,
                                            w.correction_bias.empty() ? nullptr : w.correction_bias.data());
          sum += double(std::set<int32_t>(r.ids.begin(), r.ids.end()).size());
        }
        experts = sum / kSlices;
      }
      experts += double(S);
      // Fused: a graph of kSlices calls (launch gaps as in a real decode step), median of replays.
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      for (int i = 0; i < kSlices; ++i) layer.forward(xs(i), out.p, M, act, ws.p, layer.workspace_bytes(maxM), st);
      CUDA_OK(cudaStreamEndCapture(st, &graph));
      CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
      CUDA_OK(cudaGraphLaunch(exec, st));  // warm-up
      CUDA_OK(cudaStreamSynchronize(st));
      const int reps = M >= 1024 ? 5 : 15;
      const double fused = median_us(st, reps, [&] { cudaGraphLaunch(exec, st); }) / kSlices;
      CUDA_OK(cudaGetLastError());
      CUDA_OK(cudaGraphExecDestroy(exec));
      CUDA_OK(cudaGraphDestroy(graph));
      const double loop = median_us(st, 3, [&] {
                            for (int i = 0; i < kSlices; ++i)
                              layer.forward_per_expert_loop(xs(i), out.p, M, act, ws.p, layer.workspace_bytes(maxM), st);
                          }) / kSlices;
      std::vector<uint16_t> o(size_t(M * H));
      CUDA_OK(cudaMemcpy(o.data(), out.p, o.size() * 2, cudaMemcpyDeviceToHost));
      for (uint16_t v : o) ASSERT_TRUE(std::isfinite(bf16_to_float(v))) << name << " M=" << M;
      const double bytes = experts * bytes_per_expert + double(M * H) * 4;
      const double flops = 2.0 * double(M) * double(k * spec.inter + (S ? spec.shared_inter : 0)) * 3.0 * double(H);
      std::printf("%-14s %6lld %9.1f %9.1f %8.2f %7.1f %8.0f %6.1f%% %6.1f\n", name.c_str(), (long long)M, fused, loop,
                  loop / fused, experts, bytes / fused * 1e-3, 100.0 * bytes / (fused * 1e-6) / bw,
                  flops / fused * 1e-6);
      std::fflush(stdout);
    }
  }
  CUDA_OK(cudaStreamDestroy(st));
}

}  // namespace
}  // namespace wna16::cuda
#endif
