// The CPU backend's sharded layer (one rank), and the driver that runs every rank of a plan on
// threads over a World (in-process, or NCCL with one GPU per rank), for the CPU ranks and the CUDA
// ones (sharded_cuda.cpp). One forward on a CPU rank:
//
//   1  route its own tokens (the router is replicated; route_reference, the same ids and weights
//      as the unsharded layer) or take the caller's routing
//   2  dispatch (plan_dispatch): to each expert group, each token once with its choices there
//   3  its experts' slice on the tokens received, one row per (token, choice), weighted; the rows
//      of a token summed in top-k order -> one float row per token received
//   4  combine: the rows travel back; the source adds groups 0..ep-1, then the shared expert's
//      slice (gate * shared(x), computed on its own tokens)
//   5  the tp ranks' partial outputs summed by one all-reduce (rank order), rounded to the dtype
//
// With tp = ep = 1 every addition happens in the unsharded layer's order: bit-identical output.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu/act_io.h"
#include "cpu/cpu_layer.h"
#include "cpu/isa.h"
#include "wna16/backend.h"
#include "wna16/error.h"
#include "wna16/half.h"
#include "wna16/parallel.h"
#include "wna16/reference.h"

namespace wna16 {

namespace {

// A byte buffer written and read field by field (the dispatch message).
struct Bytes {
  std::vector<uint8_t> b;
  size_t at = 0;
  template <class T>
  void put(const T* p, size_t n) {
    const size_t o = b.size();
    b.resize(o + n * sizeof(T));
    if (n) std::memcpy(b.data() + o, p, n * sizeof(T));
  }
  template <class T>
  void get(T* p, size_t n) {
    if (at + n * sizeof(T) > b.size()) throw Error("internal: truncated dispatch message");
    if (n) std::memcpy(p, b.data() + at, n * sizeof(T));
    at += n * sizeof(T);
  }
};

// A CPU layer over `experts` alone, driven with caller routing (top_k 1 per row): its router is
// never used.
std::unique_ptr<cpu::CpuMoeLayer> experts_layer(const MoeLayerSpec& full, std::vector<ExpertWeights> experts,
                                                const std::string& name) {
  MoeLayerSpec s;
  s.name = name;
  s.hidden = full.hidden;
  s.inter = experts[0].gate.N;
  s.routing.num_experts = int(experts.size());
  s.routing.top_k = 1;
  MoeLayerWeights w;
  w.router.assign(size_t(s.routing.num_experts * s.hidden), 0.f);
  w.experts = std::move(experts);
  return cpu::make_cpu_layer_isa(s, w, cpu::default_isa());
}

class ShardedCpuLayer final : public ShardedMoeLayer {
 public:
  ShardedCpuLayer(const ParallelPlan& plan, const MoeLayerSpec& spec, const MoeLayerWeights& full, Communicator& world)
      : plan_(plan), spec_(spec) {
    plan.validate(world.size());
    layout_ = shard_layout(plan, spec, world.rank());
    tp_ = world.split(layout_.ep_rank, layout_.tp_rank);
    ep_ = world.split(layout_.tp_rank, layout_.ep_rank);
    ShardWeights sw = shard_weights(plan, spec, full, world.rank());
    for (const auto& e : sw.experts) bytes_ += expert_stored_bytes(e);
    routed_ = experts_layer(spec, std::move(sw.experts), spec.name + " experts");
    if (sw.shared) {
      bytes_ += expert_stored_bytes(*sw.shared);
      std::vector<ExpertWeights> one;
      one.push_back(std::move(*sw.shared));
      shared_ = experts_layer(spec, std::move(one), spec.name + " shared expert");
    }
    router_.router = full.router;
    router_.correction_bias = full.correction_bias;
    shared_gate_ = full.shared_gate;
  }

  const ShardLayout& layout() const override { return layout_; }
  int64_t weight_bytes() const override { return bytes_; }
  const CommStats& last_stats() const override { return stats_; }

  void forward_host(const void* x, void* out, int64_t M, DType dtype) override {
    cpu::check_forward_args(x, out, M, "sharded forward");
    const std::vector<float> xf = to_float(x, M, dtype);
    const std::vector<float> logits = router_logits_reference(spec_, router_, xf.data(), M);
    const Routing r = route_reference(spec_.routing, logits.data(), M,
                                      router_.correction_bias.empty() ? nullptr : router_.correction_bias.data());
    run(x, xf, r.ids.data(), r.weights.data(), r.top_k, out, M, dtype);
  }

  void forward_routed_host(const void* x, const int32_t* ids, const float* wts, int top_k, void* out, int64_t M,
                           DType dtype) override {
    cpu::check_forward_args(x, out, M, "sharded forward_routed_host");
    check_routing(spec_.routing, ids, wts, M, top_k, "sharded forward_routed_host");
    run(x, to_float(x, M, dtype), ids, wts, top_k, out, M, dtype);
  }

 private:
  std::vector<float> to_float(const void* x, int64_t M, DType dtype) const {
    std::vector<float> xf(size_t(M * spec_.hidden));
    for (int64_t i = 0; i < M * spec_.hidden; ++i) xf[size_t(i)] = cpu::load_act(x, dtype, i);
    return xf;
  }

  void run(const void* x, const std::vector<float>& xf, const int32_t* ids, const float* wts, int k, void* out,
           int64_t M, DType dtype) {
    const int64_t H = spec_.hidden, row = H * int64_t(dtype_size(dtype));
    const int ep = plan_.ep;
    stats_ = {};
    const DispatchPlan plan = plan_dispatch(plan_, spec_, ids, wts, M, k);

    // ---- 2: dispatch ---------------------------------------------------------------------------
    std::vector<std::vector<uint8_t>> send(static_cast<size_t>(ep));
    for (int g = 0; g < ep; ++g) {
      const DispatchPlan::ToGroup& to = plan.groups[size_t(g)];
      Bytes m;
      const int64_t counts[2] = {int64_t(to.tokens.size()), int64_t(to.experts.size())};
      m.put(counts, 2);
      m.put(to.choice_begin.data(), to.choice_begin.size());
      m.put(to.experts.data(), to.experts.size());
      m.put(to.weights.data(), to.weights.size());
      for (int32_t t : to.tokens) m.put(static_cast<const uint8_t*>(x) + t * row, size_t(row));
      if (g != layout_.ep_rank) stats_.dispatch_bytes += int64_t(m.b.size());
      send[size_t(g)] = std::move(m.b);
    }
    const std::vector<std::vector<uint8_t>> recv = exchange_bytes(*ep_, send);

    // ---- 3: the local experts on one row per (token, choice) -------------------------------------
    std::vector<int64_t> tokens_from(static_cast<size_t>(ep));
    std::vector<int32_t> slot_begin{0}, slot_ids;
    std::vector<float> slot_w;
    std::vector<uint8_t> slot_x;
    for (int g = 0; g < ep; ++g) {
      Bytes m{recv[size_t(g)], 0};
      int64_t counts[2];
      m.get(counts, 2);
      tokens_from[size_t(g)] = counts[0];
      std::vector<int32_t> begin(size_t(counts[0] + 1)), ex(static_cast<size_t>(counts[1]));
      std::vector<float> w(static_cast<size_t>(counts[1]));
      m.get(begin.data(), begin.size());
      m.get(ex.data(), ex.size());
      m.get(w.data(), w.size());
      std::vector<uint8_t> rows(size_t(counts[0] * row));
      m.get(rows.data(), rows.size());
      for (int64_t t = 0; t < counts[0]; ++t) {
        for (int32_t c = begin[size_t(t)]; c < begin[size_t(t + 1)]; ++c) {
          slot_ids.push_back(ex[size_t(c)]);
          slot_w.push_back(w[size_t(c)]);
          slot_x.insert(slot_x.end(), rows.begin() + t * row, rows.begin() + (t + 1) * row);
        }
        slot_begin.push_back(int32_t(slot_ids.size()));
      }
    }
    const int64_t S = int64_t(slot_ids.size());
    std::vector<float> y(size_t(S * H));
    if (S > 0) routed_->forward_routed_f32(slot_x.data(), slot_ids.data(), slot_w.data(), 1, y.data(), S, dtype);

    // ---- 4: combine ------------------------------------------------------------------------------
    std::vector<std::vector<uint8_t>> reply(static_cast<size_t>(ep));
    int64_t t_all = 0;
    for (int g = 0; g < ep; ++g) {
      std::vector<float> rows(size_t(tokens_from[size_t(g)] * H), 0.f);
      for (int64_t t = 0; t < tokens_from[size_t(g)]; ++t, ++t_all)
        for (int32_t s = slot_begin[size_t(t_all)]; s < slot_begin[size_t(t_all + 1)]; ++s)
          for (int64_t h = 0; h < H; ++h) rows[size_t(t * H + h)] += y[size_t(s * H + h)];
      Bytes m;
      m.put(rows.data(), rows.size());
      if (g != layout_.ep_rank) stats_.combine_bytes += int64_t(m.b.size());
      reply[size_t(g)] = std::move(m.b);
    }
    const std::vector<std::vector<uint8_t>> back = exchange_bytes(*ep_, reply);
    std::vector<float> acc(size_t(M * H), 0.f);
    for (int g = 0; g < ep; ++g) {
      const auto& tokens = plan.groups[size_t(g)].tokens;
      if (back[size_t(g)].size() != tokens.size() * size_t(H) * sizeof(float))
        throw Error("internal: expert group " + std::to_string(g) + " returned " + std::to_string(back[size_t(g)].size()) +
                    " bytes for " + std::to_string(tokens.size()) + " tokens");
      const float* rows = reinterpret_cast<const float*>(back[size_t(g)].data());
      for (size_t t = 0; t < tokens.size(); ++t)
        for (int64_t h = 0; h < H; ++h) acc[size_t(tokens[t] * H + h)] += rows[t * size_t(H) + size_t(h)];
    }
    if (shared_ && M > 0) add_shared(x, xf, M, dtype, acc);

    // ---- 5: tp all-reduce, one rounding ------------------------------------------------------------
    if (plan_.tp > 1) {
      tp_->all_reduce_sum(acc.data(), int64_t(acc.size()));
      stats_.all_reduce_bytes = int64_t(acc.size() * sizeof(float));
    }
    for (int64_t i = 0; i < M * H; ++i) cpu::store_act(out, dtype, i, acc[size_t(i)]);
  }

  // acc += gate * shared(x) for this rank's slice, gate as the unsharded CPU layer computes it.
  void add_shared(const void* x, const std::vector<float>& xf, int64_t M, DType dtype, std::vector<float>& acc) {
    const int64_t H = spec_.hidden;
    std::vector<float> gate(size_t(M), 1.f);
    if (spec_.shared_kind == SharedExpertKind::SigmoidGated)
      for (int64_t m = 0; m < M; ++m) {
        double d = 0;
        for (int64_t h = 0; h < H; ++h) d += double(xf[size_t(m * H + h)]) * double(shared_gate_[size_t(h)]);
        gate[size_t(m)] = float(1.0 / (1.0 + std::exp(-d)));
      }
    const std::vector<int32_t> zero(size_t(M), 0);
    std::vector<float> ys(size_t(M * H));
    shared_->forward_routed_f32(x, zero.data(), gate.data(), 1, ys.data(), M, dtype);
    for (size_t i = 0; i < acc.size(); ++i) acc[i] += ys[i];
  }

  ParallelPlan plan_;
  MoeLayerSpec spec_;
  ShardLayout layout_;
  std::unique_ptr<Communicator> tp_, ep_;
  std::unique_ptr<cpu::CpuMoeLayer> routed_, shared_;
  MoeLayerWeights router_;  // router and correction bias only (router_logits_reference reads those)
  std::vector<float> shared_gate_;
  int64_t bytes_ = 0;
  CommStats stats_;
};

// Every rank on a thread of one World; on CUDA, rank r builds and runs its layers on GPU
// r % cuda_device_count() (an NCCL world has one GPU per rank).
class ThreadedShardedLayer final : public MoeBackendLayer {
 public:
  ThreadedShardedLayer(Device device, const ParallelPlan& plan, const MoeLayerSpec& spec, const MoeLayerWeights& full,
                       std::unique_ptr<World> world)
      : device_(device), plan_(plan), spec_(spec), world_(std::move(world)), ranks_(size_t(plan.world())) {
    world_->run([&](Communicator& c) {
      on_rank_device(c.rank());
      ranks_[size_t(c.rank())] = make_sharded_layer(device, plan, spec, full, c);
    });
  }
  Device device() const override { return device_; }

  void forward_host(const void* x, void* out, int64_t M, DType dtype) override {
    run(x, out, M, dtype, [&](ShardedMoeLayer& l, const uint8_t* xs, uint8_t* os, int64_t m, const TokenRange&) {
      l.forward_host(xs, os, m, dtype);
    });
  }
  void forward_routed_host(const void* x, const int32_t* ids, const float* wts, int k, void* out, int64_t M,
                           DType dtype) override {
    check_routing(spec_.routing, ids, wts, M, k, "sharded forward_routed_host");
    run(x, out, M, dtype, [&](ShardedMoeLayer& l, const uint8_t* xs, uint8_t* os, int64_t m, const TokenRange& r) {
      l.forward_routed_host(xs, ids + r.begin * k, wts + r.begin * k, k, os, m, dtype);
    });
  }

 private:
  void on_rank_device(int rank) const {
    if (device_ == Device::Cuda) set_cuda_device(rank % cuda_device_count());
  }

  template <class Fn>
  void run(const void* x, void* out, int64_t M, DType dtype, const Fn& fn) {
    cpu::check_forward_args(x, out, M, "sharded forward");
    const int64_t row = spec_.hidden * int64_t(dtype_size(dtype));
    std::vector<std::vector<uint8_t>> outs(ranks_.size());
    world_->run([&](Communicator& c) {
      on_rank_device(c.rank());
      ShardedMoeLayer& l = *ranks_[size_t(c.rank())];
      const TokenRange r = range_of(l.layout().ep_rank, M);
      outs[size_t(c.rank())].assign(size_t(r.size() * row), 0);
      fn(l, static_cast<const uint8_t*>(x) + r.begin * row, outs[size_t(c.rank())].data(), r.size(), r);
    });
    for (int rank = 0; rank < plan_.world(); ++rank) {
      const TokenRange r = range_of(plan_.ep_rank(rank), M);
      // Who must agree: the tp ranks of a group; every rank where each takes the whole batch.
      const int leader = whole_batch() ? 0 : rank - plan_.tp_rank(rank);
      const std::vector<uint8_t>& first = outs[size_t(leader)];
      if (outs[size_t(rank)] != first)
        throw Error("internal: rank " + std::to_string(rank) + " disagrees with rank " + std::to_string(leader));
      if (rank == leader && r.size() > 0)
        std::memcpy(static_cast<uint8_t*>(out) + r.begin * row, first.data(), first.size());
    }
  }

  // The CUDA ranks take the whole batch and return all of it (sharded_cuda.cpp); the CPU ranks
  // their expert group's tokens.
  bool whole_batch() const { return device_ == Device::Cuda; }
  TokenRange range_of(int ep_rank, int64_t M) const {
    return whole_batch() ? TokenRange{0, M} : token_range(plan_, M, ep_rank);
  }

  Device device_;
  ParallelPlan plan_;
  MoeLayerSpec spec_;
  std::unique_ptr<World> world_;
  std::vector<std::unique_ptr<ShardedMoeLayer>> ranks_;
};

}  // namespace

// sharded_cuda.cpp: the device-resident CUDA rank.
std::unique_ptr<ShardedMoeLayer> make_cuda_device_rank(const ParallelPlan& plan, const MoeLayerSpec& spec,
                                                       const MoeLayerWeights& full, Communicator& world);

std::unique_ptr<ShardedMoeLayer> make_sharded_layer(Device device, const ParallelPlan& plan, const MoeLayerSpec& spec,
                                                    const MoeLayerWeights& full, Communicator& world) {
  if (device == Device::Cuda) return make_cuda_device_rank(plan, spec, full, world);
  return std::make_unique<ShardedCpuLayer>(plan, spec, full, world);
}

std::unique_ptr<MoeBackendLayer> make_threaded_sharded_layer(Device device, const ParallelPlan& plan,
                                                             const MoeLayerSpec& spec, const MoeLayerWeights& full,
                                                             CommKind comm) {
  check_plan(plan, spec, full);  // here, so a bad plan is reported once, without a rank prefix
  if (device == Device::Cuda && cuda_device_count() == 0)
    throw Error("the sharded layer on --device cuda: no CUDA GPU is present (or this build has no CUDA backend)");
  if (comm == CommKind::Nccl && device != Device::Cuda)
    throw Error("--comm nccl moves device memory between GPUs: it needs --device cuda");
  return std::make_unique<ThreadedShardedLayer>(device, plan, spec, full, make_world(comm, plan.world()));
}

}  // namespace wna16
