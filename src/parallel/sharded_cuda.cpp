// The device-resident CUDA rank. Every rank takes the whole batch (replicated, as after a
// tensor-parallel attention block) and returns the whole output; each holds one CUDA layer:
//  - ep = 1 (tensor parallel): its slice of every expert's width and of the shared expert's, and
//    the whole router, so the layer routes the tokens itself;
//  - ep > 1: its expert group's experts (cut to its tp slice) and a 1 / (tp x ep) slice of the
//    shared expert's width (so the shared work is spread over every rank, not repeated per group);
//    the rank routes every token with the layer's router kernel on the whole router
//    (launch_router_logits, launch_routing), maps the chosen ids to its group's
//    (launch_local_expert_ids: others to -1, which add nothing) and runs the layer on them.
// Every rank computes the same logits with the same kernel, so every rank makes the same choices.
// One forward: the layer's partial output in fp32 (CudaMoeLayer::forward_f32), one all-reduce
// over all ranks, one rounding to the activation dtype (cast_f32_to). With NCCL (device buffers)
// nothing returns to the host and nothing synchronises it (graph capture is not tested yet; the
// buffers grow on the first call of a larger M, so a capture needs a warm-up at its M); the in-process
// communicator stages the partial through host memory. Expert parallelism here moves the whole
// batch's partials (M x H fp32 per rank) rather than each token's rows to its groups: the simple
// exchange, right for ep = 2, where almost every token has choices in both groups.
#include "wna16/error.h"
#include "wna16/parallel.h"

#ifdef WNA16_HAVE_CUDA
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/dev_buf.h"
#include "cuda/host_staging.h"
#include "cuda/moe_layer_kernels.h"
#include "wna16/cuda.h"
#include "wna16/cuda_kernels.h"
#include "wna16/half.h"
#include "wna16/reference.h"

namespace wna16 {

namespace {

class CudaDeviceRank final : public ShardedMoeLayer {
 public:
  CudaDeviceRank(const ParallelPlan& plan, const MoeLayerSpec& spec, const MoeLayerWeights& full, Communicator& world)
      : spec_(spec), comm_(world), ep_(plan.ep > 1) {
    plan.validate(world.size());
    layout_ = shard_layout(plan, spec, world.rank());
    ShardWeights sw = shard_weights(plan, spec, full, world.rank(), !ep_);  // ep: the shared slice below
    MoeLayerSpec s = spec;
    s.inter = layout_.inter_end - layout_.inter_begin;
    s.shared_inter = layout_.shared_end - layout_.shared_begin;
    MoeLayerWeights w;
    w.router = full.router;
    w.correction_bias = full.correction_bias;
    w.shared_gate = full.shared_gate;
    w.experts = std::move(sw.experts);
    w.shared = std::move(sw.shared);
    if (ep_) {
      // The group's experts under caller routing: a plain softmax spec (its router is never run).
      const int El = layout_.expert_end - layout_.expert_begin;
      if (El < spec.routing.top_k)
        throw Error(fmt::format("ep={} leaves {} experts per group, fewer than top_k={}: the CUDA rank's layer needs "
                                "at least top_k experts",
                                plan.ep, El, spec.routing.top_k));
      s.routing = RoutingConfig{};
      s.routing.num_experts = El;
      s.routing.top_k = spec.routing.top_k;
      w.router.assign(size_t(int64_t(El) * spec.hidden), 0.f);
      w.correction_bias.clear();
      if (full.shared) {
        const int world_n = plan.world();
        if (spec.shared_inter % world_n != 0)
          throw Error(fmt::format("the shared expert's width {} is not divisible by the {} ranks of {}", spec.shared_inter,
                                  world_n, plan.describe()));
        const int64_t part = spec.shared_inter / world_n;
        s.shared_inter = part;
        w.shared = slice_expert_width(*full.shared, part * world.rank(), part * (world.rank() + 1), world.rank() == 0,
                                      "shared expert");
      }
      router_.alloc(full.router.size() * 4);
      WNA16_CUDA_CHECK(cudaMemcpy(router_.p, full.router.data(), full.router.size() * 4, cudaMemcpyHostToDevice));
      if (!full.correction_bias.empty()) {
        bias_.alloc(full.correction_bias.size() * 4);
        WNA16_CUDA_CHECK(cudaMemcpy(bias_.p, full.correction_bias.data(), full.correction_bias.size() * 4,
                                    cudaMemcpyHostToDevice));
      }
    }
    // One down group length per CUDA layer: a shared slice cut at group starts keeps the
    // checkpoint's groups while the routed slices were cut inside one (tp = 2 of I = 128 at g128):
    // the shared down takes the routed length (the same scales, repeated).
    if (w.shared && !w.experts.empty()) {
      const QuantScheme &rs = w.experts[0].down.scheme, &ss = w.shared->down.scheme;
      if (rs.group_size != -1 && ss.group_size != -1 && rs.group_size != ss.group_size) {
        const int64_t len = std::gcd(rs.group_size, ss.group_size);
        if (len != ss.group_size) w.shared->down = regroup_rows(w.shared->down, len, "shared expert down");
        if (len != rs.group_size)
          for (size_t e = 0; e < w.experts.size(); ++e)
            w.experts[e].down = regroup_rows(w.experts[e].down, len, "expert " + std::to_string(e) + " down");
      }
    }
    for (const auto& e : w.experts) bytes_ += expert_stored_bytes(e);
    if (w.shared) bytes_ += expert_stored_bytes(*w.shared);
    layer_ = std::make_unique<cuda::CudaMoeLayer>(s, w);
  }

  const ShardLayout& layout() const override { return layout_; }
  int64_t weight_bytes() const override { return bytes_; }
  const CommStats& last_stats() const override { return stats_; }
  bool runs_on_device() const override { return true; }

  void forward_device(const void* x, void* out, int64_t M, DType act, void* stream) override {
    run_device(x, nullptr, nullptr, 0, out, M, act, static_cast<cudaStream_t>(stream));
  }
  void forward_host(const void* x, void* out, int64_t M, DType dtype) override {
    run_host(x, nullptr, nullptr, 0, out, M, dtype);
  }
  void forward_routed_host(const void* x, const int32_t* ids, const float* wts, int top_k, void* out, int64_t M,
                           DType dtype) override {
    check_routing(spec_.routing, ids, wts, M, top_k, "sharded cuda forward_routed_host");
    run_host(x, ids, wts, top_k, out, M, dtype);
  }

 private:
  // ids / wts: device [M, top_k] (null: the layer routes).
  void run_device(const void* x, const int32_t* ids, const float* wts, int top_k, void* out, int64_t M, DType act,
                  cudaStream_t st) {
    stats_ = {};
    if (M == 0) return;
    const int64_t n = M * spec_.hidden;
    ensure(M);
    if (ep_) {
      const int k = spec_.routing.top_k, E = spec_.routing.num_experts;
      auto* lids = static_cast<int32_t*>(lids_.p);
      if (!ids) {  // the rank routes every token (the same choices on every rank)
        auto* logits = static_cast<float*>(logits_.p);
        cuda::launch_router_logits(x, act, M, spec_.hidden, router_.p, DType::F32, E, E, logits, nullptr, nullptr, 0, st);
        cuda::launch_routing(spec_.routing, logits, DType::F32, M, static_cast<const float*>(bias_.p),
                             static_cast<int32_t*>(gids_.p), static_cast<float*>(gwts_.p), st);
        ids = static_cast<const int32_t*>(gids_.p);
        wts = static_cast<const float*>(gwts_.p);
        top_k = k;
      }
      if (top_k != k)
        throw Error(fmt::format("sharded cuda forward: top_k={} differs from the layer's top_k={}", top_k, k));
      cuda::launch_local_expert_ids(ids, M * k, layout_.expert_begin, layout_.expert_end, lids, st);
      ids = lids;
    }
    layer_->forward_f32(x, ids, wts, top_k, static_cast<float*>(part_.p), M, act, ws_.p, ws_.bytes, st);
    if (comm_.size() > 1) {
      if (comm_.device_buffers()) {
        comm_.all_reduce_sum_device(static_cast<float*>(part_.p), n, st);
      } else {  // host memory only: through the host
        host_.resize(size_t(n));
        WNA16_CUDA_CHECK(cudaMemcpyAsync(host_.data(), part_.p, size_t(n) * 4, cudaMemcpyDeviceToHost, st));
        WNA16_CUDA_CHECK(cudaStreamSynchronize(st));
        comm_.all_reduce_sum(host_.data(), n);
        WNA16_CUDA_CHECK(cudaMemcpyAsync(part_.p, host_.data(), size_t(n) * 4, cudaMemcpyHostToDevice, st));
      }
      stats_.all_reduce_bytes = n * 4;
    }
    cuda::cast_f32_to(static_cast<const float*>(part_.p), out, n, act, st);
  }

  // Host in and out (the CLI and tests), as the CUDA backend adapter.
  void run_host(const void* x, const int32_t* ids, const float* wts, int top_k, void* out, int64_t M, DType dtype) {
    if (ids && M > 0) io_.stage_routing(ids, wts, size_t(M) * size_t(top_k));
    io_.run(x, out, M, dtype, [&](const void* xd, void* od, DType act) {
      run_device(xd, ids ? io_.ids() : nullptr, ids ? io_.wts() : nullptr, top_k, od, M, act, nullptr);
    });
  }

  void ensure(int64_t M) {
    if (M <= cap_) return;
    cap_ = std::max<int64_t>(M, 2 * cap_);
    part_.alloc(size_t(cap_ * spec_.hidden * 4));
    ws_.alloc(layer_->workspace_bytes(cap_));
    if (ep_) {
      const size_t slots = size_t(cap_) * size_t(spec_.routing.top_k);
      logits_.alloc(size_t(cap_) * size_t(spec_.routing.num_experts) * 4);
      gids_.alloc(slots * 4);
      gwts_.alloc(slots * 4);
      lids_.alloc(slots * 4);
    }
  }

  MoeLayerSpec spec_;
  Communicator& comm_;
  bool ep_;  // an expert group's rank: routes outside its layer
  ShardLayout layout_;
  std::unique_ptr<cuda::CudaMoeLayer> layer_;
  int64_t bytes_ = 0, cap_ = 0;
  cuda::HostStaging io_{spec_.hidden};
  cuda::DevBuf part_, ws_, router_, bias_, logits_, gids_, gwts_, lids_;
  std::vector<float> host_;
  CommStats stats_;
};

}  // namespace

std::unique_ptr<ShardedMoeLayer> make_cuda_device_rank(const ParallelPlan& plan, const MoeLayerSpec& spec,
                                                       const MoeLayerWeights& full, Communicator& world) {
  return std::make_unique<CudaDeviceRank>(plan, spec, full, world);
}

}  // namespace wna16

#else

namespace wna16 {
std::unique_ptr<ShardedMoeLayer> make_cuda_device_rank(const ParallelPlan&, const MoeLayerSpec&, const MoeLayerWeights&,
                                                       Communicator&) {
  throw Error("this build of wna16 has no CUDA backend; use --device cpu");
}
}  // namespace wna16

#endif
