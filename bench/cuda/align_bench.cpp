// bench_align_us: graph replay of back-to-back launch_align calls, timed with CUDA events.
#include "bench/cuda/align_bench.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_check.h"
#include "wna16/cuda_kernels.h"
#include "wna16/error.h"
#include "wna16/reference.h"

namespace wna16::cuda {
namespace {

constexpr int kLaunchesPerGraph = 20;  // amortises the graph launch itself
constexpr int kWarmup = 3;

// Frees whatever was created, also when a check throws half way.
struct BenchResources {
  void* ids = nullptr;
  void* sorted = nullptr;
  void* experts = nullptr;
  void* post = nullptr;
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  ~BenchResources() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (stream) cudaStreamDestroy(stream);
    cudaFree(ids);
    cudaFree(sorted);
    cudaFree(experts);
    cudaFree(post);
  }
};

// Median microseconds per launch: warm-up, a graph of kLaunchesPerGraph launches, timed replays.
template <typename Launch>
double time_graph_us(BenchResources& r, int replays, Launch&& launch) {
  if (replays < 1) throw Error("align bench: replays=" + std::to_string(replays) + " is not positive");
  WNA16_CUDA_CHECK(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking));
  WNA16_CUDA_CHECK(cudaEventCreate(&r.start));
  WNA16_CUDA_CHECK(cudaEventCreate(&r.stop));
  for (int i = 0; i < kWarmup; ++i) launch(r.stream);
  WNA16_CUDA_CHECK(cudaStreamSynchronize(r.stream));

  WNA16_CUDA_CHECK(cudaStreamBeginCapture(r.stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kLaunchesPerGraph; ++i) launch(r.stream);
  WNA16_CUDA_CHECK(cudaStreamEndCapture(r.stream, &r.graph));
  WNA16_CUDA_CHECK(cudaGraphInstantiate(&r.exec, r.graph, 0));
  WNA16_CUDA_CHECK(cudaGraphLaunch(r.exec, r.stream));  // warm the graph
  WNA16_CUDA_CHECK(cudaStreamSynchronize(r.stream));

  std::vector<float> ms(size_t(replays), 0.f);
  for (int i = 0; i < replays; ++i) {
    WNA16_CUDA_CHECK(cudaEventRecord(r.start, r.stream));
    WNA16_CUDA_CHECK(cudaGraphLaunch(r.exec, r.stream));
    WNA16_CUDA_CHECK(cudaEventRecord(r.stop, r.stream));
    WNA16_CUDA_CHECK(cudaEventSynchronize(r.stop));
    WNA16_CUDA_CHECK(cudaEventElapsedTime(&ms[size_t(i)], r.start, r.stop));
  }
  std::nth_element(ms.begin(), ms.begin() + replays / 2, ms.end());
  return double(ms[size_t(replays / 2)]) * 1000.0 / kLaunchesPerGraph;
}

}  // namespace

double bench_align_us(int E, int64_t num_slots, int block_m) {
  return bench_align_us(E, num_slots, block_m, kAlignDefaultTuning);
}

double bench_align_us(int E, int64_t num_slots, int block_m, const AlignTuning& tuning, int replays) {
  const int64_t padded = max_padded_slots(num_slots, E, block_m);
  const int64_t blocks = max_align_blocks(num_slots, E, block_m);
  std::vector<int32_t> ids(static_cast<size_t>(num_slots));
  std::mt19937 rng(12345);
  std::uniform_int_distribution<int32_t> pick(0, std::max(E, 1) - 1);
  for (auto& v : ids) v = pick(rng);

  BenchResources r;
  WNA16_CUDA_CHECK(cudaMalloc(&r.ids, std::max<size_t>(ids.size(), 1) * sizeof(int32_t)));
  WNA16_CUDA_CHECK(cudaMalloc(&r.sorted, std::max<int64_t>(padded, 1) * sizeof(int32_t)));
  WNA16_CUDA_CHECK(cudaMalloc(&r.experts, std::max<int64_t>(blocks, 1) * sizeof(int32_t)));
  WNA16_CUDA_CHECK(cudaMalloc(&r.post, sizeof(int32_t)));
  WNA16_CUDA_CHECK(cudaMemcpy(r.ids, ids.data(), ids.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  WNA16_CUDA_CHECK(cudaDeviceSynchronize());  // the benchmark stream does not wait for the legacy stream
  return time_graph_us(r, replays, [&](cudaStream_t s) {
    launch_align_tuned(static_cast<const int32_t*>(r.ids), num_slots, E, block_m, static_cast<int32_t*>(r.sorted),
                       static_cast<int32_t*>(r.experts), static_cast<int32_t*>(r.post), tuning, s);
  });
}

double bench_align_noop_us(int n_cta, bool cluster, int replays) {
  BenchResources r;
  return time_graph_us(r, replays, [&](cudaStream_t s) { launch_align_shaped_noop(n_cta, cluster, s); });
}

}  // namespace wna16::cuda
