// ThreadPool: fork-join over task indices. Workers spin briefly after a run before sleeping on a
// condition variable: a MoE forward is several short dependent phases, and waking a sleeping
// thread costs tens of microseconds, comparable to a whole decode phase.
#include "cpu/thread_pool.h"

#include <chrono>
#include <cstdlib>
#include <string>

#include "common/knobs.h"
#include "wna16/error.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define WNA16_CPU_RELAX() _mm_pause()
#else
#define WNA16_CPU_RELAX() ((void)0)
#endif

namespace wna16::cpu {

namespace {
int default_threads() {
  if (const int n = knobs::cpu_threads(); n > 0) return n;
  const unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 ? 1 : int(hc);
}
// How long an idle worker polls for the next run before it blocks.
constexpr auto kSpin = std::chrono::microseconds(300);
}  // namespace

ThreadPool::ThreadPool(int threads) {
  const int n = threads > 0 ? threads : default_threads();
  for (int i = 1; i < n; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    generation_.fetch_add(1);
  }
  wake_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::work(int id) {
  for (int64_t t; !failed_.load(std::memory_order_relaxed) && (t = next_.fetch_add(1)) < ntasks_;) {
    try {
      (*fn_)(t, id);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
      failed_.store(true);
    }
  }
}

void ThreadPool::worker_loop(int id) {
  uint64_t seen = 0;
  for (;;) {
    // Poll for a new generation for a short while, then sleep.
    const auto until = std::chrono::steady_clock::now() + kSpin;
    int polls = 0;
    while (generation_.load(std::memory_order_acquire) == seen) {
      WNA16_CPU_RELAX();
      if (++polls % 256 == 0 && std::chrono::steady_clock::now() > until) {
        std::unique_lock<std::mutex> lock(mu_);
        wake_cv_.wait(lock, [&] { return generation_.load() != seen; });
        break;
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      seen = generation_.load();
      if (!open_) continue;  // woke after the run was closed: nothing left to claim
      ++active_;
    }
    work(id);
    std::lock_guard<std::mutex> lock(mu_);
    if (--active_ == 0) done_cv_.notify_all();
  }
}

void ThreadPool::run(int64_t ntasks, const std::function<void(int64_t, int)>& fn) {
  if (ntasks <= 0) return;
  if (workers_.empty() || ntasks == 1) {
    for (int64_t t = 0; t < ntasks; ++t) fn(t, 0);
    return;
  }
  std::lock_guard<std::mutex> run_lock(run_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    ntasks_ = ntasks;
    next_.store(0);
    error_ = nullptr;
    failed_.store(false);
    open_ = true;
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_cv_.notify_all();
  work(0);
  // Every task is claimed: close the run, then wait only for workers still finishing theirs.
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lock(mu_);
    open_ = false;
    done_cv_.wait(lock, [&] { return active_ == 0; });
    err = error_;
    error_ = nullptr;
    fn_ = nullptr;
  }
  if (err) std::rethrow_exception(err);
}

ThreadPool& thread_pool() {
  static ThreadPool pool;
  return pool;
}

}  // namespace wna16::cpu
