// `wna16 bench --device cuda --tp N --ep N [--comm nccl]`: the sharded layer against one GPU, per preset
// and M, in one run: the unsharded CUDA layer on GPU 0, then every rank of the plan on its GPU
// (rank r on GPU r mod the GPUs present), each timed on the host around back-to-back device calls
// (eager launches, the same for both), the slowest rank reported; the all-reduce payload per rank
// and call; the sharded output checked against the one-GPU output.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <functional>
#include <vector>

#include "bench/bench.h"
#include "bench/cuda/bench_weights.h"
#include "bench/cuda/device_timing.h"
#include "cuda/cuda_check.h"
#include "wna16/backend.h"
#include "wna16/cuda.h"
#include "wna16/error.h"
#include "wna16/parallel.h"
#include "wna16/reference.h"

namespace wna16 {

namespace {

using cuda::bench::DevBuf;
using cuda::bench::to_float;
using Clock = std::chrono::steady_clock;

// Two warm-up calls of `call` (device work on stream s), then one timed on the host: the number of
// calls that fill `budget_s` (5 to 2000). sync_all: what else must finish with each call (the
// ranks' barrier).
int calls_for_budget(cudaStream_t s, double budget_s, const std::function<void()>& call,
                     const std::function<void()>& sync_all) {
  for (int i = 0; i < 2; ++i) call();
  WNA16_CUDA_CHECK(cudaStreamSynchronize(s));
  sync_all();
  auto t0 = Clock::now();
  call();
  WNA16_CUDA_CHECK(cudaStreamSynchronize(s));
  sync_all();
  const double one = std::chrono::duration<double>(Clock::now() - t0).count();
  return int(std::clamp(budget_s / std::max(one, 1e-6), 5.0, 2000.0));
}

}  // namespace

int run_cuda_sharded_bench(const BenchOptions& opts, const ParallelPlan& plan, CommKind comm) {
  plan.validate();
  if (!cuda_available()) throw Error("bench --tp/--ep: no CUDA GPU is present");
  std::vector<std::string> models = opts.models;
  if (models.empty())
    for (const auto& n : preset_names())
      if (n != "small") models.push_back(n);
  const std::vector<int64_t> ms = opts.ms.empty() ? std::vector<int64_t>{1, 16, 256, 4096} : opts.ms;
  const double budget = opts.min_seconds > 0 ? opts.min_seconds : 0.3;
  const int gpus = cuda_device_count();
  std::printf("sharded layer: %s over %s, %d GPU(s) present (rank r on GPU r mod %d); %s, %s; host-timed eager calls\n",
              plan.describe().c_str(), comm_kind_name(comm), gpus, gpus, opts.scheme.describe().c_str(),
              dtype_name(opts.act));
  std::printf("%-20s %6s %12s %12s %8s %14s %10s %7s\n", "preset", "M", "1 GPU us", "sharded us", "speedup",
              "all-reduce MB", "rel err", "check");
  int failures = 0;
  for (const auto& name : models) {
    const MoeLayerSpec spec = preset(name);
    const MoeLayerWeights w = cuda::bench::random_bench_layer(spec, opts.scheme, 17);
    const int64_t H = spec.hidden, max_m = *std::max_element(ms.begin(), ms.end());
    const std::vector<uint16_t> xh = cuda::bench::random_activations(max_m, H, opts.act, 23);
    // One GPU: the unsharded layer on GPU 0.
    set_cuda_device(0);
    std::vector<double> one_us;
    std::vector<std::vector<uint16_t>> one_out;
    {
      cuda::CudaMoeLayer layer(spec, w);
      DevBuf x(size_t(max_m * H * 2)), out(size_t(max_m * H * 2)), ws(layer.workspace_bytes(max_m));
      WNA16_CUDA_CHECK(cudaMemcpy(x.get(), xh.data(), xh.size() * 2, cudaMemcpyHostToDevice));
      cudaStream_t s;
      WNA16_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      for (int64_t M : ms) {
        auto call = [&] { layer.forward(x.get(), out.get(), M, opts.act, ws.get(), ws.size(), s); };
        const int n = calls_for_budget(s, budget, call, [] {});
        const auto t0 = Clock::now();
        for (int i = 0; i < n; ++i) call();
        WNA16_CUDA_CHECK(cudaStreamSynchronize(s));
        one_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / n);
        std::vector<uint16_t> o(size_t(M * H));
        WNA16_CUDA_CHECK(cudaMemcpy(o.data(), out.get(), o.size() * 2, cudaMemcpyDeviceToHost));
        one_out.push_back(std::move(o));
      }
      WNA16_CUDA_CHECK(cudaStreamDestroy(s));
    }
    // The plan: every rank builds its shard, then times the same calls (the NCCL all-reduce keeps
    // the ranks in step; a barrier closes each timed batch).
    std::unique_ptr<World> world;
    if (comm == CommKind::Nccl) world = make_nccl_world(plan.world());
    else world = std::make_unique<InProcessWorld>(plan.world());
    std::vector<std::vector<double>> rank_us(size_t(plan.world()));
    std::vector<std::vector<uint16_t>> rank0_out(ms.size());
    std::vector<int64_t> ar_bytes(ms.size());
    world->run([&](Communicator& c) {
      set_cuda_device(c.rank() % gpus);
      auto rank = make_sharded_layer(Device::Cuda, plan, spec, w, c);
      DevBuf x(size_t(max_m * H * 2)), out(size_t(max_m * H * 2));
      WNA16_CUDA_CHECK(cudaMemcpy(x.get(), xh.data(), xh.size() * 2, cudaMemcpyHostToDevice));
      cudaStream_t s;
      WNA16_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      for (size_t i = 0; i < ms.size(); ++i) {
        const int64_t M = ms[i];
        auto call = [&] { rank->forward_device(x.get(), out.get(), M, opts.act, s); };
        // Rank 0 sizes the batch; every rank makes the same number of calls.
        std::vector<float> nb{float(calls_for_budget(s, budget, call, [&] { c.barrier(); }))};
        if (c.rank() != 0) nb[0] = 0;
        c.all_reduce_sum(nb.data(), 1);
        const int n = int(nb[0]);
        c.barrier();
        const auto t0 = Clock::now();
        for (int k = 0; k < n; ++k) call();
        WNA16_CUDA_CHECK(cudaStreamSynchronize(s));
        rank_us[size_t(c.rank())].push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / n);
        c.barrier();
        if (c.rank() == 0) {
          rank0_out[i].resize(size_t(M * H));
          WNA16_CUDA_CHECK(cudaMemcpy(rank0_out[i].data(), out.get(), size_t(M * H * 2), cudaMemcpyDeviceToHost));
          ar_bytes[i] = rank->last_stats().all_reduce_bytes;
        }
      }
      WNA16_CUDA_CHECK(cudaStreamDestroy(s));
    });
    for (size_t i = 0; i < ms.size(); ++i) {
      double us = 0;
      for (const auto& r : rank_us) us = std::max(us, r[i]);
      const std::vector<float> a = to_float(rank0_out[i].data(), rank0_out[i].size(), opts.act);
      const std::vector<float> bf = to_float(one_out[i].data(), one_out[i].size(), opts.act);
      const std::vector<double> b(bf.begin(), bf.end());
      const double rel = rel_error(a.data(), b.data(), int64_t(a.size()));
      // One GPU and the ranks differ by the order of float additions and one rounding: well
      // inside the layer tolerance (a wrong slice or a lost all-reduce is far outside it).
      const bool ok = std::isfinite(rel) && rel <= layer_tolerance(opts.act) / 2;
      failures += ok ? 0 : 1;
      std::printf("%-20s %6lld %12.1f %12.1f %8.2f %14.3f %10.2e %7s\n", name.c_str(), (long long)ms[i], one_us[i], us,
                  one_us[i] / us, double(ar_bytes[i]) / 1e6, rel, ok ? "PASS" : "FAIL");
    }
  }
  std::printf("%s\n", failures ? "FAILED" : "PASSED");
  return failures ? 1 : 0;
}

}  // namespace wna16
