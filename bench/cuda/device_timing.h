// Host-side helpers of the CUDA benchmark: an owning device buffer, a CUDA graph captured from a
// sequence of launches, and the event timer every number of the benchmark comes from.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "bench/cuda/bench_report.h"
#include "cuda/cuda_check.h"

namespace wna16::cuda::bench {

// Owning device allocation.
class DevBuf {
 public:
  DevBuf() = default;
  explicit DevBuf(size_t bytes) {
    WNA16_CUDA_CHECK(cudaMalloc(&p_, std::max<size_t>(bytes, 16)));
    n_ = bytes;
  }
  ~DevBuf() {
    if (p_) cudaFree(p_);
  }
  DevBuf(DevBuf&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  DevBuf& operator=(DevBuf&& o) noexcept {
    if (this != &o) {
      if (p_) cudaFree(p_);
      p_ = o.p_, n_ = o.n_;
      o.p_ = nullptr, o.n_ = 0;
    }
    return *this;
  }
  template <class T = void>
  T* get() const {
    return static_cast<T*>(p_);
  }
  char* bytes_at(size_t off) const { return static_cast<char*>(p_) + off; }
  size_t size() const { return n_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

// An instantiated graph, destroyed with its owner.
class GraphExec {
 public:
  GraphExec() = default;
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;
  ~GraphExec() {
    if (exec_) cudaGraphExecDestroy(exec_);
  }
  // Captures `body` on stream s. Returns false (with the reason) when capture is refused, so the
  // caller can fall back to eager launches and say so.
  bool capture(cudaStream_t s, const std::function<void()>& body, std::string& why);
  void launch(cudaStream_t s) const { WNA16_CUDA_CHECK(cudaGraphLaunch(exec_, s)); }

 private:
  cudaGraphExec_t exec_ = nullptr;
};

// Milliseconds of each of `reps` back-to-back runs of `body` on stream s, from events around each
// run (no warm-up: the caller's).
std::vector<double> event_times_ms(cudaStream_t s, int reps, const std::function<void()>& body);

// Median / p10 / p90 of per-call microseconds over replays of `enqueue`, each of which performs
// `calls` layer calls. One warm-up replay (graph upload, lazy loading, cuBLAS heuristics), one to
// size the repetition count to `budget_s`, then at least 3 timed replays.
Timing time_calls(cudaStream_t s, int calls, double budget_s, const std::function<void()>& enqueue);

}  // namespace wna16::cuda::bench
