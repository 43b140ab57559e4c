// The parallel plan: its validation against a layer, which experts and which intermediate
// channels each rank holds, how a batch is split over the expert groups, and what each token sends
// where. The one place these are decided, for every backend's sharded layer.
#include <algorithm>
#include <numeric>
#include <string>

#include "wna16/error.h"
#include "wna16/parallel.h"

namespace wna16 {

std::string ParallelPlan::describe() const {
  return "tp=" + std::to_string(tp) + " x ep=" + std::to_string(ep) + " (" + std::to_string(world()) +
         (world() == 1 ? " rank)" : " ranks)");
}

void ParallelPlan::validate(int world_size) const {
  if (tp < 1) throw Error("parallel plan: tp=" + std::to_string(tp) + " must be at least 1");
  if (ep < 1) throw Error("parallel plan: ep=" + std::to_string(ep) + " must be at least 1");
  if (int64_t(tp) * ep > 1024)
    throw Error("parallel plan: tp=" + std::to_string(tp) + " x ep=" + std::to_string(ep) + " exceeds 1024 ranks");
  if (world_size > 0 && tp * ep != world_size)
    throw Error("parallel plan: tp=" + std::to_string(tp) + " x ep=" + std::to_string(ep) + " = " +
                std::to_string(tp * ep) + " ranks, but the world has " + std::to_string(world_size));
}

namespace {

void check_width(const ParallelPlan& p, int64_t width, const char* what) {
  if (width % p.tp != 0)
    throw Error("parallel plan " + p.describe() + ": " + what + "=" + std::to_string(width) +
                " is not divisible by tp=" + std::to_string(p.tp));
}

// One linear's slice on a rank: gate/up keep K and take N/tp columns (each rank's columns are
// checked once: the packing along N does not depend on which columns); down takes K/tp rows, each
// rank's rows in groups of slice_group_len, checked per rank.
void check_linear(const ParallelPlan& p, const QuantizedLinear& l, bool rows, const std::string& who) {
  const int64_t K = rows ? l.K / p.tp : l.K, N = rows ? l.N : l.N / p.tp;
  const std::string where = "parallel plan " + p.describe() + ": " + who + " [K=" + std::to_string(l.K) +
                            ", N=" + std::to_string(l.N) + "] split by tp=" + std::to_string(p.tp) + " (" +
                            (rows ? "rows" : "columns") + ")";
  if (!rows) {
    try {
      l.scheme.validate(K, N);
    } catch (const Error& e) {
      throw Error(where + ": " + e.what());
    }
    return;
  }
  for (int r = 0; r < p.tp; ++r) {
    const int64_t a = r * K, b = a + K;
    QuantScheme s = l.scheme;
    s.act_order = false;
    if (s.group_size != -1) s.group_size = int(slice_group_len(l, a, b));
    try {
      s.validate(K, N);
    } catch (const Error& e) {
      throw Error(where + ": tp rank " + std::to_string(r) + "'s rows [" + std::to_string(a) + ", " +
                  std::to_string(b) + ") in groups of " + std::to_string(s.group_size) + " (group_size=" +
                  std::to_string(l.scheme.group_size) + "): " + e.what());
    }
  }
}

void check_expert(const ParallelPlan& p, const ExpertWeights& e, const std::string& who) {
  check_linear(p, e.gate, false, who + " gate");
  check_linear(p, e.up, false, who + " up");
  check_linear(p, e.down, true, who + " down");
}

}  // namespace

void check_plan(const ParallelPlan& p, const MoeLayerSpec& spec) {
  p.validate();
  spec.validate();
  const int E = spec.routing.num_experts;
  if (E % p.ep != 0)
    throw Error("parallel plan " + p.describe() + ": num_experts=" + std::to_string(E) + " is not divisible by ep=" +
                std::to_string(p.ep));
  check_width(p, spec.inter, "expert width I");
  if (spec.shared_kind != SharedExpertKind::None) check_width(p, spec.shared_inter, "shared expert width");
}

void check_plan(const ParallelPlan& p, const MoeLayerSpec& spec, const MoeLayerWeights& w) {
  check_plan(p, spec);
  w.validate(spec);
  if (p.tp == 1) return;
  for (size_t e = 0; e < w.experts.size(); ++e) check_expert(p, w.experts[e], "expert " + std::to_string(e));
  if (w.shared) check_expert(p, *w.shared, "shared expert");
}

ShardLayout shard_layout(const ParallelPlan& p, const MoeLayerSpec& spec, int rank) {
  check_plan(p, spec);
  if (rank < 0 || rank >= p.world())
    throw Error("rank " + std::to_string(rank) + " is outside [0, " + std::to_string(p.world()) + ") for " +
                p.describe());
  ShardLayout l;
  l.rank = rank;
  l.tp_rank = p.tp_rank(rank);
  l.ep_rank = p.ep_rank(rank);
  const int per_group = spec.routing.num_experts / p.ep;
  l.expert_begin = l.ep_rank * per_group;
  l.expert_end = l.expert_begin + per_group;
  const int64_t w = spec.inter / p.tp, ws = spec.shared_inter / p.tp;
  l.inter_begin = l.tp_rank * w;
  l.inter_end = l.inter_begin + w;
  l.shared_begin = l.tp_rank * ws;
  l.shared_end = l.shared_begin + ws;
  return l;
}

int expert_owner(const ParallelPlan& p, const MoeLayerSpec& spec, int expert) {
  return expert / (spec.routing.num_experts / p.ep);
}

TokenRange token_range(const ParallelPlan& p, int64_t M, int ep_rank) {
  const int64_t base = M / p.ep, extra = M % p.ep;
  TokenRange r;
  r.begin = ep_rank * base + std::min<int64_t>(ep_rank, extra);
  r.end = r.begin + base + (ep_rank < extra ? 1 : 0);
  return r;
}

std::vector<int32_t> inter_order(const QuantizedLinear& down) {
  std::vector<int32_t> order(size_t(down.K));
  std::iota(order.begin(), order.end(), 0);
  if (down.scheme.act_order && down.scheme.group_size != -1 && !down.g_idx.empty())
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return down.g_idx[size_t(a)] < down.g_idx[size_t(b)]; });
  return order;
}

int64_t slice_group_len(const QuantizedLinear& down, int64_t begin, int64_t end) {
  if (begin < 0 || end > down.K || begin >= end)
    throw Error("slice_group_len: rows [" + std::to_string(begin) + ", " + std::to_string(end) +
                ") are not a non-empty range of K=" + std::to_string(down.K));
  if (down.scheme.group_size == -1) return -1;
  const std::vector<int32_t> order = inter_order(down);
  const int64_t len = down.scheme.group_len(down.K);
  const auto group = [&](int64_t pos) -> int64_t {
    const int32_t ch = order[size_t(pos)];
    return down.g_idx.empty() ? ch / len : down.g_idx[size_t(ch)];
  };
  int64_t g = len;  // a length dividing the group size too (the same for every expert of a layer)
  for (int64_t i = begin; i < end;) {
    int64_t j = i + 1;
    while (j < end && group(j) == group(i)) ++j;
    g = std::gcd(g, j - i);
    i = j;
  }
  return g;
}

DispatchPlan plan_dispatch(const ParallelPlan& p, const MoeLayerSpec& spec, const int32_t* ids, const float* wts,
                           int64_t M, int top_k) {
  check_plan(p, spec);
  const int per_group = spec.routing.num_experts / p.ep;
  DispatchPlan d;
  d.groups.resize(size_t(p.ep));
  for (auto& g : d.groups) g.choice_begin.push_back(0);
  for (int64_t m = 0; m < M; ++m)
    for (int j = 0; j < top_k; ++j) {
      const int32_t e = ids[m * top_k + j];
      if (e < 0 || e >= spec.routing.num_experts)
        throw Error("plan_dispatch: token " + std::to_string(m) + " choice " + std::to_string(j) + ": expert id " +
                    std::to_string(e) + " is outside [0, " + std::to_string(spec.routing.num_experts) + ")");
      DispatchPlan::ToGroup& g = d.groups[size_t(e / per_group)];
      if (g.tokens.empty() || g.tokens.back() != int32_t(m)) {
        g.tokens.push_back(int32_t(m));
        g.choice_begin.push_back(int32_t(g.experts.size()));
      }
      g.experts.push_back(e % per_group);
      g.weights.push_back(wts[m * top_k + j]);
      g.choice_begin.back() = int32_t(g.experts.size());
    }
  return d;
}

}  // namespace wna16
