// GraphExec and the event timer of the CUDA benchmark (see device_timing.h).
#include "bench/cuda/device_timing.h"

#include <exception>
#include <vector>

namespace wna16::cuda::bench {

bool GraphExec::capture(cudaStream_t s, const std::function<void()>& body, std::string& why) {
  WNA16_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  cudaGraph_t g = nullptr;
  try {
    body();
  } catch (const std::exception& e) {
    cudaStreamEndCapture(s, &g);
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
    why = e.what();
    return false;
  }
  cudaError_t err = cudaStreamEndCapture(s, &g);
  if (err == cudaSuccess) err = cudaGraphInstantiate(&exec_, g, 0);
  if (g) cudaGraphDestroy(g);
  if (err != cudaSuccess) {
    cudaGetLastError();
    why = cudaGetErrorString(err);
    exec_ = nullptr;
    return false;
  }
  return true;
}

std::vector<double> event_times_ms(cudaStream_t s, int reps, const std::function<void()>& body) {
  std::vector<cudaEvent_t> ev(size_t(2 * reps));
  for (auto& e : ev) WNA16_CUDA_CHECK(cudaEventCreate(&e));
  for (int r = 0; r < reps; ++r) {
    WNA16_CUDA_CHECK(cudaEventRecord(ev[size_t(2 * r)], s));
    body();
    WNA16_CUDA_CHECK(cudaEventRecord(ev[size_t(2 * r + 1)], s));
  }
  WNA16_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<double> ms(static_cast<size_t>(reps));
  for (int r = 0; r < reps; ++r) {
    float t = 0;
    WNA16_CUDA_CHECK(cudaEventElapsedTime(&t, ev[size_t(2 * r)], ev[size_t(2 * r + 1)]));
    ms[size_t(r)] = t;
  }
  for (auto& e : ev) WNA16_CUDA_CHECK(cudaEventDestroy(e));
  return ms;
}

Timing time_calls(cudaStream_t s, int calls, double budget_s, const std::function<void()>& enqueue) {
  enqueue();
  WNA16_CUDA_CHECK(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  WNA16_CUDA_CHECK(cudaEventCreate(&a));
  WNA16_CUDA_CHECK(cudaEventCreate(&b));
  WNA16_CUDA_CHECK(cudaEventRecord(a, s));
  enqueue();
  WNA16_CUDA_CHECK(cudaEventRecord(b, s));
  WNA16_CUDA_CHECK(cudaEventSynchronize(b));
  float first_ms = 0;
  WNA16_CUDA_CHECK(cudaEventElapsedTime(&first_ms, a, b));
  WNA16_CUDA_CHECK(cudaEventDestroy(a));
  WNA16_CUDA_CHECK(cudaEventDestroy(b));
  const int reps = int(std::clamp(budget_s * 1e3 / std::max(double(first_ms), 1e-3), 3.0, 200.0));

  std::vector<double> us = event_times_ms(s, reps, enqueue);
  for (double& v : us) v *= 1e3 / calls;
  std::sort(us.begin(), us.end());
  Timing t;
  t.median_us = us[us.size() / 2];
  t.p10_us = us[us.size() / 10];
  t.p90_us = us[us.size() - 1 - us.size() / 10];
  t.reps = reps;
  t.calls = calls;
  return t;
}

}  // namespace wna16::cuda::bench
