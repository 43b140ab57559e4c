// A rank's weights, cut from the full checkpoint tensors in the canonical unpacked form and packed
// back in the checkpoint's own format: gate/up keep their K (the hidden size, act-order g_idx
// unchanged) and take the rank's columns; down takes the rank's rows in groups of
// slice_group_len (smaller than the checkpoint's when a cut falls inside a group), each with the
// scales and zeros of the original group it lies in. Channels are taken in inter_order (act-order down projections: sorted by group), the
// same order for the three linears of an expert, so the expert's function is unchanged.
#include <algorithm>
#include <string>

#include "wna16/error.h"
#include "wna16/parallel.h"

namespace wna16 {

namespace {

// Columns cols of a gate/up linear.
QuantizedLinear take_columns(const QuantizedLinear& l, const std::vector<int32_t>& cols) {
  const UnpackedLinear u = unpack(l);
  const int64_t N = int64_t(cols.size());
  UnpackedLinear s;
  s.bits = u.bits;
  s.K = u.K;
  s.N = N;
  s.groups = u.groups;
  s.g_idx = u.g_idx;
  s.q.resize(size_t(u.K * N));
  for (int64_t k = 0; k < u.K; ++k)
    for (int64_t n = 0; n < N; ++n) s.q[size_t(k * N + n)] = u.q[size_t(k * u.N + cols[size_t(n)])];
  s.zeros.resize(size_t(u.groups * N));
  s.scales.resize(size_t(u.groups * N));
  for (int64_t g = 0; g < u.groups; ++g)
    for (int64_t n = 0; n < N; ++n) {
      s.zeros[size_t(g * N + n)] = u.zeros[size_t(g * u.N + cols[size_t(n)])];
      s.scales[size_t(g * N + n)] = u.scales[size_t(g * u.N + cols[size_t(n)])];
    }
  for (int64_t n = 0; n < N && !u.bias.empty(); ++n) s.bias.push_back(u.bias[size_t(cols[size_t(n)])]);
  return pack(s, l.scheme);
}

// Rows of a down linear in groups of len (slice_group_len; -1 keeps one group over the rows),
// renumbered to groups 0.. in order: the shard's g_idx is k / len, so it is stored without
// act-order. Each new group lies in one original group (the rows are sorted by group and len
// divides every run) and takes its scales and zeros. keep_bias: the output bias is added by one tp
// rank only (the partial outputs are summed).
QuantizedLinear take_rows(const QuantizedLinear& l, const std::vector<int32_t>& rows, int64_t len, bool keep_bias,
                          const std::string& who) {
  const UnpackedLinear u = unpack(l);
  const int64_t K = int64_t(rows.size()), N = u.N;
  QuantScheme scheme = l.scheme;
  scheme.act_order = false;
  if (scheme.group_size != -1) scheme.group_size = int(len);
  const int64_t L = scheme.group_len(K), G = scheme.num_groups(K);
  UnpackedLinear s;
  s.bits = u.bits;
  s.K = K;
  s.N = N;
  s.groups = G;
  s.q.resize(size_t(K * N));
  s.zeros.resize(size_t(G * N));
  s.scales.resize(size_t(G * N));
  for (int64_t k = 0; k < K; ++k) {
    const int64_t g = u.g_idx[size_t(rows[size_t(k)])], first = u.g_idx[size_t(rows[size_t(k / L * L)])];
    if (g != first)
      throw Error(who + ": row " + std::to_string(rows[size_t(k)]) + " is in group " + std::to_string(g) +
                  ", but the slice's group " + std::to_string(k / L) + " of " + std::to_string(L) +
                  " rows starts in group " + std::to_string(first) + " (internal: not a group length of the slice)");
    s.g_idx.push_back(int32_t(k / L));
    std::copy(u.q.begin() + rows[size_t(k)] * N, u.q.begin() + (rows[size_t(k)] + 1) * N, s.q.begin() + k * N);
    if (k % L == 0) {
      std::copy(u.zeros.begin() + g * N, u.zeros.begin() + (g + 1) * N, s.zeros.begin() + k / L * N);
      std::copy(u.scales.begin() + g * N, u.scales.begin() + (g + 1) * N, s.scales.begin() + k / L * N);
    }
  }
  if (keep_bias) s.bias = u.bias;
  return pack(s, scheme);
}

}  // namespace

ExpertWeights slice_expert_width(const ExpertWeights& e, int64_t begin, int64_t end, bool keep_bias, const std::string& who) {
  const std::vector<int32_t> order = inter_order(e.down);
  const std::vector<int32_t> chans(order.begin() + begin, order.begin() + end);
  try {
    return ExpertWeights{take_columns(e.gate, chans), take_columns(e.up, chans),
                         take_rows(e.down, chans, slice_group_len(e.down, begin, end), keep_bias, who)};
  } catch (const Error& err) {
    throw Error(who + ": " + err.what());
  }
}

int64_t expert_stored_bytes(const ExpertWeights& e) {
  int64_t b = 0;
  for (const QuantizedLinear* l : {&e.gate, &e.up, &e.down})
    b += int64_t((l->qweight.size() + l->qzeros.size() + l->g_idx.size()) * 4 + l->scales.size() * 2);
  return b;
}

QuantizedLinear regroup_rows(const QuantizedLinear& l, int64_t len, const std::string& who) {
  if (l.scheme.group_size == -1 || l.scheme.act_order || len <= 0 || l.scheme.group_size % len != 0)
    throw Error(who + ": cannot regroup " + l.scheme.describe() + " into groups of " + std::to_string(len) +
                " (a divisor of its group size, without act-order)");
  std::vector<int32_t> rows(static_cast<size_t>(l.K));
  for (int64_t k = 0; k < l.K; ++k) rows[size_t(k)] = int32_t(k);
  return take_rows(l, rows, len, true, who);
}

ShardWeights shard_weights(const ParallelPlan& plan, const MoeLayerSpec& spec, const MoeLayerWeights& full, int rank,
                           bool with_shared) {
  check_plan(plan, spec, full);
  const ShardLayout l = shard_layout(plan, spec, rank);
  const bool keep_bias = l.tp_rank == 0;
  ShardWeights s;
  for (int e = l.expert_begin; e < l.expert_end; ++e) {
    const ExpertWeights& x = full.experts[size_t(e)];
    s.experts.push_back(plan.tp == 1 ? x : slice_expert_width(x, l.inter_begin, l.inter_end, keep_bias, "expert " + std::to_string(e)));
  }
  if (full.shared && with_shared)
    s.shared = plan.tp == 1 ? *full.shared
                            : slice_expert_width(*full.shared, l.shared_begin, l.shared_end, keep_bias, "shared expert");
  return s;
}

}  // namespace wna16
