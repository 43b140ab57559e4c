// The CPU backend's worker pool: created once per process, sized from the machine, reused by every
// layer and every call. run() is a fork-join parallel-for over task indices with dynamic
// scheduling (an atomic counter), the calling thread taking part as worker 0.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace wna16::cpu {

class ThreadPool {
 public:
  // threads <= 0: hardware_concurrency(), or WNA16_CPU_THREADS when set (a whole number from 1 to
  // 4096; anything else throws Error naming the value).
  explicit ThreadPool(int threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }

  // Calls fn(task, worker) for every task in [0, ntasks), spread over the pool; returns when all
  // are done. The first exception thrown by a task is rethrown here (remaining tasks are skipped).
  // Calls from several threads are serialised.
  void run(int64_t ntasks, const std::function<void(int64_t task, int worker)>& fn);

 private:
  void worker_loop(int id);
  void work(int id);

  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // one run() at a time

  std::mutex mu_;
  std::condition_variable wake_cv_, done_cv_;
  std::atomic<uint64_t> generation_{0};  // bumped once per run(); workers wait for a new value
  bool stop_ = false;

  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t ntasks_ = 0;
  std::atomic<int64_t> next_{0};
  // Workers that joined the current run and have not left it. A worker joins only while the run
  // is open; run() closes it once every task is claimed, so a worker that wakes late (e.g. when
  // the machine is oversubscribed) never delays the caller.
  int active_ = 0;
  bool open_ = false;
  std::exception_ptr error_;
  std::atomic<bool> failed_{false};
};

// The process-wide pool (created on first use).
ThreadPool& thread_pool();

}  // namespace wna16::cpu
