// Reference routing: router logits -> top-k expert ids and weights, in double, for the three
// routing methods of moe.h. Ties go to the lower expert (and group) index everywhere.
#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "wna16/error.h"
#include "wna16/reference.h"

namespace wna16 {

namespace {

// The k best of `score` among indices with allowed[i], best first; equal scores: lower index first.
std::vector<int> top_k_indices(const std::vector<double>& score, const std::vector<char>& allowed, int k) {
  std::vector<int> idx;
  for (int i = 0; i < int(score.size()); ++i)
    if (allowed[size_t(i)]) idx.push_back(i);
  auto better = [&](int a, int b) { return score[size_t(a)] > score[size_t(b)] || (score[size_t(a)] == score[size_t(b)] && a < b); };
  k = std::min<int>(k, int(idx.size()));
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), better);
  idx.resize(static_cast<size_t>(k));
  return idx;
}

std::vector<double> softmax(const float* logits, int E) {
  double mx = -INFINITY;
  for (int e = 0; e < E; ++e) mx = std::max(mx, double(logits[e]));
  std::vector<double> p(static_cast<size_t>(E));
  double sum = 0;
  for (int e = 0; e < E; ++e) sum += (p[size_t(e)] = std::exp(double(logits[e]) - mx));
  for (auto& v : p) v /= sum;
  return p;
}

// Marks the experts of the topk_group best groups (group score given per group) as allowed.
std::vector<char> keep_groups(const std::vector<double>& group_score, int per_group, int topk_group) {
  const std::vector<char> all(group_score.size(), 1);
  std::vector<char> allowed(group_score.size() * size_t(per_group), 0);
  for (int g : top_k_indices(group_score, all, topk_group))
    std::fill_n(allowed.begin() + int64_t(g) * per_group, per_group, char(1));
  return allowed;
}

}  // namespace

Routing route_reference(const RoutingConfig& cfg, const float* logits, int64_t M, const float* bias) {
  cfg.validate();
  if (M < 0) throw Error("route_reference: M=" + std::to_string(M) + " is negative");
  const int E = cfg.num_experts, k = cfg.top_k;
  if (M > 0 && !logits) throw Error("route_reference: logits is null for M=" + std::to_string(M));
  if (cfg.method == RoutingMethod::NoauxTc && !bias)
    throw Error("route_reference: noaux_tc routing needs the correction bias (got null)");
  for (int64_t i = 0; i < M * E; ++i)
    if (!std::isfinite(logits[i]))
      throw Error("route_reference: router logit [" + std::to_string(i / E) + ", " + std::to_string(i % E) +
                  "] is not finite");
  if (cfg.method == RoutingMethod::NoauxTc)
    for (int e = 0; e < E; ++e)
      if (!std::isfinite(bias[e]))
        throw Error("route_reference: correction_bias[" + std::to_string(e) + "] is not finite");

  Routing r;
  r.M = M;
  r.top_k = k;
  r.ids.resize(static_cast<size_t>(M * k));
  r.weights.resize(static_cast<size_t>(M * k));
  const int per_group = E / std::max(1, cfg.n_group);
  const std::vector<char> all(static_cast<size_t>(E), 1);

  for (int64_t m = 0; m < M; ++m) {
    const float* row = logits + m * E;
    std::vector<int> chosen;
    std::vector<double> weight(static_cast<size_t>(k));
    switch (cfg.method) {
      case RoutingMethod::SoftmaxTopK: {
        // Mixtral / Qwen: softmax over all E, top-k, optionally divide by the chosen mass.
        const std::vector<double> p = softmax(row, E);
        chosen = top_k_indices(p, all, k);
        double sum = 0;
        for (int j = 0; j < k; ++j) sum += (weight[size_t(j)] = p[size_t(chosen[size_t(j)])]);
        if (cfg.renormalize)
          for (auto& w : weight) w /= sum;
        break;
      }
      case RoutingMethod::GroupLimitedGreedy: {
        // DeepSeek-V2: softmax; group score = the max in the group; keep topk_group groups; top-k
        // inside them. n_group == 1 is plain "greedy" top-k.
        const std::vector<double> p = softmax(row, E);
        std::vector<char> allowed = all;
        if (cfg.n_group > 1) {
          std::vector<double> gs(static_cast<size_t>(cfg.n_group));
          for (int g = 0; g < cfg.n_group; ++g)
            gs[size_t(g)] = *std::max_element(p.begin() + int64_t(g) * per_group, p.begin() + int64_t(g + 1) * per_group);
          allowed = keep_groups(gs, per_group, cfg.topk_group);
        }
        chosen = top_k_indices(p, allowed, k);
        double sum = 0;
        for (int j = 0; j < k; ++j) sum += (weight[size_t(j)] = p[size_t(chosen[size_t(j)])]);
        // DeepSeek-V2 semantics: renormalise (with HF's 1e-20 guard) or scale, never both.
        for (auto& w : weight) w = cfg.renormalize ? w / (sum + 1e-20) : w * cfg.routed_scaling_factor;
        break;
      }
      case RoutingMethod::NoauxTc: {
        // DeepSeek-V3: s = sigmoid(logit); selection uses s + bias, the weights the unbiased s.
        std::vector<double> s(static_cast<size_t>(E)), choice(static_cast<size_t>(E));
        for (int e = 0; e < E; ++e) {
          s[size_t(e)] = 1.0 / (1.0 + std::exp(-double(row[e])));
          choice[size_t(e)] = s[size_t(e)] + double(bias[e]);
        }
        // Group score = sum of the two best (s + bias) in the group.
        std::vector<double> gs(static_cast<size_t>(cfg.n_group));
        for (int g = 0; g < cfg.n_group; ++g) {
          std::vector<double> grp(choice.begin() + int64_t(g) * per_group, choice.begin() + int64_t(g + 1) * per_group);
          std::partial_sort(grp.begin(), grp.begin() + 2, grp.end(), std::greater<double>());
          gs[size_t(g)] = grp[0] + grp[1];
        }
        // NOTE: experts of dropped groups are excluded outright (vLLM masks them to -inf). HF's
        // masked_fill(0.0) could pick one when every kept s + bias is negative; we do not.
        chosen = top_k_indices(choice, keep_groups(gs, per_group, cfg.topk_group), k);
        double sum = 0;
        for (int j = 0; j < k; ++j) sum += (weight[size_t(j)] = s[size_t(chosen[size_t(j)])]);
        for (auto& w : weight) {
          if (cfg.renormalize) w /= (sum + 1e-20);
          w *= cfg.routed_scaling_factor;
        }
        break;
      }
    }
    for (int j = 0; j < k; ++j) {
      r.ids[size_t(m * k + j)] = chosen[size_t(j)];
      r.weights[size_t(m * k + j)] = float(weight[size_t(j)]);
    }
  }
  return r;
}

std::vector<float> router_logits_reference(const MoeLayerSpec& spec, const MoeLayerWeights& w, const float* x,
                                           int64_t M) {
  const int64_t H = spec.hidden, E = spec.routing.num_experts;
  if (int64_t(w.router.size()) != E * H)
    throw Error("router has " + std::to_string(w.router.size()) + " values, expected [E=" + std::to_string(E) +
                ", H=" + std::to_string(H) + "]");
  std::vector<float> logits(static_cast<size_t>(M * E));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t e = 0; e < E; ++e) {
      double acc = 0;
      for (int64_t h = 0; h < H; ++h) acc += double(x[m * H + h]) * double(w.router[size_t(e * H + h)]);
      logits[size_t(m * E + e)] = float(acc);
    }
  return logits;
}

}  // namespace wna16
