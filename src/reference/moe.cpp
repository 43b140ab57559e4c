// The MoE layer description: names, validation, the model presets and the seeded random layer.
#include "wna16/moe.h"

#include "common/splitmix64.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <exception>
#include <mutex>
#include <thread>

#include "wna16/error.h"

namespace wna16 {

const char* routing_name(RoutingMethod m) {
  switch (m) {
    case RoutingMethod::SoftmaxTopK: return "softmax_topk";
    case RoutingMethod::GroupLimitedGreedy: return "group_limited_greedy";
    case RoutingMethod::NoauxTc: return "noaux_tc";
  }
  return "?";
}

namespace {
std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}
}  // namespace

void RoutingConfig::validate() const {
  const std::string m = routing_name(method);
  if (num_experts <= 0) throw Error("num_experts=" + std::to_string(num_experts) + " must be positive");
  if (top_k <= 0 || top_k > num_experts)
    throw Error("top_k=" + std::to_string(top_k) + " must be in [1, num_experts=" +
                std::to_string(num_experts) + "]");
  if (!std::isfinite(routed_scaling_factor) || routed_scaling_factor <= 0)
    throw Error("routed_scaling_factor=" + num(routed_scaling_factor) + " must be finite and positive");
  if (method == RoutingMethod::SoftmaxTopK) {
    // NOTE: Mixtral/Qwen have no scaling factor; refusing one here avoids silently ignoring it.
    if (routed_scaling_factor != 1.0)
      throw Error("routed_scaling_factor=" + num(routed_scaling_factor) +
                  " has no effect with softmax_topk routing (only 1 is accepted)");
    return;
  }
  if (n_group <= 0 || num_experts % n_group != 0)
    throw Error(m + ": n_group=" + std::to_string(n_group) + " must be positive and divide num_experts=" +
                std::to_string(num_experts));
  if (topk_group <= 0 || topk_group > n_group)
    throw Error(m + ": topk_group=" + std::to_string(topk_group) + " must be in [1, n_group=" +
                std::to_string(n_group) + "]");
  const int per_group = num_experts / n_group;
  if (int64_t(topk_group) * per_group < top_k)
    throw Error(m + ": top_k=" + std::to_string(top_k) + " exceeds the " +
                std::to_string(int64_t(topk_group) * per_group) + " experts in topk_group=" +
                std::to_string(topk_group) + " groups of " + std::to_string(per_group));
  if (method == RoutingMethod::NoauxTc && per_group < 2)
    throw Error("noaux_tc: groups of " + std::to_string(per_group) + " expert (num_experts=" +
                std::to_string(num_experts) + ", n_group=" + std::to_string(n_group) +
                "); the group score sums the top 2, so each group needs at least 2");
}

void MoeLayerSpec::validate() const {
  if (hidden <= 0) throw Error("spec '" + name + "': hidden=" + std::to_string(hidden) + " must be positive");
  if (inter <= 0) throw Error("spec '" + name + "': inter=" + std::to_string(inter) + " must be positive");
  routing.validate();
  if (shared_kind == SharedExpertKind::None && shared_inter != 0)
    throw Error("spec '" + name + "': shared_inter=" + std::to_string(shared_inter) +
                " but the layer has no shared expert");
  if (shared_kind != SharedExpertKind::None && shared_inter <= 0)
    throw Error("spec '" + name + "': shared_inter=" + std::to_string(shared_inter) +
                " must be positive for a layer with a shared expert");
}

namespace {
void check_linear(const QuantizedLinear& l, const std::string& what, int64_t K, int64_t N) {
  if (l.K != K || l.N != N)
    throw Error(what + " is [K=" + std::to_string(l.K) + ", N=" + std::to_string(l.N) + "], expected [K=" +
                std::to_string(K) + ", N=" + std::to_string(N) + "]");
  try {
    l.validate();
  } catch (const Error& e) {
    throw Error(what + ": " + e.what());
  }
}

void check_expert(const ExpertWeights& e, const std::string& what, int64_t H, int64_t I) {
  check_linear(e.gate, what + ".gate", H, I);
  check_linear(e.up, what + ".up", H, I);
  check_linear(e.down, what + ".down", I, H);
}
}  // namespace

void MoeLayerWeights::validate(const MoeLayerSpec& spec) const {
  spec.validate();
  const int64_t H = spec.hidden, E = spec.routing.num_experts;
  if (int64_t(router.size()) != E * H)
    throw Error("router has " + std::to_string(router.size()) + " values, expected [E=" + std::to_string(E) +
                ", H=" + std::to_string(H) + "] = " + std::to_string(E * H));
  if (spec.routing.method == RoutingMethod::NoauxTc) {
    if (int64_t(correction_bias.size()) != E)
      throw Error("correction_bias has " + std::to_string(correction_bias.size()) +
                  " values, expected E=" + std::to_string(E) + " (noaux_tc routing needs it)");
  } else if (!correction_bias.empty() && int64_t(correction_bias.size()) != E) {
    throw Error("correction_bias has " + std::to_string(correction_bias.size()) + " values, expected 0 or E=" +
                std::to_string(E));
  }
  if (int64_t(experts.size()) != E)
    throw Error("layer has " + std::to_string(experts.size()) + " experts, spec says num_experts=" +
                std::to_string(E));
  for (int64_t e = 0; e < E; ++e) check_expert(experts[e], "expert " + std::to_string(e), H, spec.inter);
  if (spec.shared_kind == SharedExpertKind::None) {
    if (shared) throw Error("layer has shared expert weights but the spec has no shared expert");
  } else {
    if (!shared) throw Error("spec '" + spec.name + "' has a shared expert but the layer has no shared weights");
    check_expert(*shared, "shared expert", H, spec.shared_inter);
  }
  if (spec.shared_kind == SharedExpertKind::SigmoidGated) {
    if (int64_t(shared_gate.size()) != H)
      throw Error("shared_gate has " + std::to_string(shared_gate.size()) + " values, expected H=" +
                  std::to_string(H));
  } else if (!shared_gate.empty()) {
    throw Error("shared_gate has " + std::to_string(shared_gate.size()) +
                " values but the shared expert is not sigmoid-gated");
  }
}

// ---- presets --------------------------------------------------------------------------------

namespace {
MoeLayerSpec make_spec(const char* name, int64_t H, int64_t I, int E, int k, RoutingMethod method, bool renorm) {
  MoeLayerSpec s;
  s.name = name;
  s.hidden = H;
  s.inter = I;
  s.routing.method = method;
  s.routing.num_experts = E;
  s.routing.top_k = k;
  s.routing.renormalize = renorm;
  return s;
}

std::vector<MoeLayerSpec> all_presets() {
  std::vector<MoeLayerSpec> v;
  // Small, CPU-fast, but with a sigmoid-gated shared expert, two K groups for gate/up at g128, and
  // more experts than top-k so some experts get no tokens at small M.
  MoeLayerSpec small = make_spec("small", 256, 128, 8, 2, RoutingMethod::SoftmaxTopK, true);
  small.shared_kind = SharedExpertKind::SigmoidGated;
  small.shared_inter = 256;
  v.push_back(small);

  v.push_back(make_spec("mixtral-8x7b", 4096, 14336, 8, 2, RoutingMethod::SoftmaxTopK, true));

  MoeLayerSpec qwen15 = make_spec("qwen1.5-moe-a2.7b", 2048, 1408, 60, 4, RoutingMethod::SoftmaxTopK, false);
  qwen15.shared_kind = SharedExpertKind::SigmoidGated;
  qwen15.shared_inter = 5632;
  v.push_back(qwen15);

  v.push_back(make_spec("qwen3-30b-a3b", 2048, 768, 128, 8, RoutingMethod::SoftmaxTopK, true));

  // DeepSeek-V2-Lite's config: topk_method "greedy" (= group-limited with one group), no renorm.
  MoeLayerSpec v2 = make_spec("deepseek-v2-lite", 2048, 1408, 64, 6, RoutingMethod::GroupLimitedGreedy, false);
  v2.routing.n_group = 1;
  v2.routing.topk_group = 1;
  v2.routing.routed_scaling_factor = 1.0;
  v2.shared_kind = SharedExpertKind::Plain;
  v2.shared_inter = 2 * 1408;  // n_shared_experts=2 fused
  v.push_back(v2);

  MoeLayerSpec v3 = make_spec("deepseek-v3", 7168, 2048, 256, 8, RoutingMethod::NoauxTc, true);
  v3.routing.n_group = 8;
  v3.routing.topk_group = 4;
  v3.routing.routed_scaling_factor = 2.5;
  v3.shared_kind = SharedExpertKind::Plain;
  v3.shared_inter = 2048;  // n_shared_experts=1
  v.push_back(v3);

  // GLM-4.5-Air (glm4_moe): DeepSeek-V3's router with one group and no scaling; one shared expert
  // of the routed width.
  MoeLayerSpec glm = make_spec("glm-4.5-air", 4096, 1408, 128, 8, RoutingMethod::NoauxTc, true);
  glm.routing.n_group = 1;
  glm.routing.topk_group = 1;
  glm.routing.routed_scaling_factor = 1.0;
  glm.shared_kind = SharedExpertKind::Plain;
  glm.shared_inter = 1408;  // n_shared_experts=1
  v.push_back(glm);

  // Qwen3-Next-80B-A3B (qwen3_next): 512 small experts, top-10 renormalised, a gated shared expert.
  MoeLayerSpec next = make_spec("qwen3-next-80b-a3b", 2048, 512, 512, 10, RoutingMethod::SoftmaxTopK, true);
  next.shared_kind = SharedExpertKind::SigmoidGated;
  next.shared_inter = 512;
  v.push_back(next);
  return v;
}
}  // namespace

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& s : all_presets()) names.push_back(s.name);
  return names;
}

MoeLayerSpec preset(const std::string& name) {
  for (const auto& s : all_presets())
    if (s.name == name) return s;
  std::string known;
  for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
  throw Error("unknown model preset '" + name + "' (known: " + known + ")");
}

// ---- random layer ---------------------------------------------------------------------------

namespace {
using Rng = SplitMix64;

uint64_t stream_seed(uint64_t seed, uint64_t tensor) {
  Rng r(seed * 0x2545f4914f6cdd1dull + tensor * 0x9e3779b97f4a7c15ull + 0x1234567ull);
  r.next();
  return r.next();
}

// Ziggurat tables (Marsaglia & Tsang's method, 128 layers in Doornik's formulation): layer i spans
// [0, x[i]]; a uniform draw inside the layer's inner rectangle (|u| < x[i+1]/x[i], ~99% of draws)
// is accepted with one multiply: no log, no exp, ~4x faster than the polar method. The big presets
// draw 10^9 normals, so this decides whether `verify` of a real shape takes seconds or a minute.
struct Ziggurat {
  static constexpr int kLayers = 128;
  static constexpr double kR = 3.442619855899;       // start of the tail
  static constexpr double kV = 9.91256303526217e-3;  // area of every layer
  double x[kLayers + 1], ratio[kLayers];
  Ziggurat() {
    double f = std::exp(-0.5 * kR * kR);
    x[0] = kV / f;  // the base layer: rectangle plus tail, as a wider virtual rectangle
    x[1] = kR;
    x[kLayers] = 0;
    for (int i = 2; i < kLayers; ++i) {
      x[i] = std::sqrt(-2.0 * std::log(kV / x[i - 1] + f));
      f = std::exp(-0.5 * x[i] * x[i]);
    }
    for (int i = 0; i < kLayers; ++i) ratio[i] = x[i + 1] / x[i];
  }
};

double standard_normal(Rng& r, const Ziggurat& z) {
  for (;;) {
    const uint64_t bits = r.next();
    const int i = int(bits & 0x7f);                                          // low 7 bits: the layer
    const double u = double(bits >> 11) * (2.0 / 9007199254740992.0) - 1.0;  // top 53: u in [-1, 1)
    if (std::fabs(u) < z.ratio[i]) return u * z.x[i];
    if (i == 0) {  // the tail beyond R, by Marsaglia's exponential rejection
      double t, y;
      do {
        t = std::log((double(r.next() >> 11) + 1.0) / 9007199254740992.0) / Ziggurat::kR;
        y = std::log((double(r.next() >> 11) + 1.0) / 9007199254740992.0);
      } while (-2.0 * y < t * t);
      return u < 0 ? t - Ziggurat::kR : Ziggurat::kR - t;
    }
    // The wedge between this layer's inner rectangle and the curve: accept under the density.
    const double v = u * z.x[i];
    const double f0 = std::exp(-0.5 * (z.x[i] * z.x[i] - v * v));
    const double f1 = std::exp(-0.5 * (z.x[i + 1] * z.x[i + 1] - v * v));
    if (f1 + (double(r.next() >> 11) / 9007199254740992.0) * (f0 - f1) < 1.0) return v;
  }
}

// n samples of N(0, stddev).
std::vector<float> normal(uint64_t seed, uint64_t tensor, int64_t n, double stddev) {
  static const Ziggurat z;
  Rng r(stream_seed(seed, tensor));
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& e : v) e = float(stddev * standard_normal(r, z));
  return v;
}

// Tensor ids of the random streams: experts first, then fixed ids for the rest.
constexpr uint64_t kRouterId = 1ull << 40, kBiasId = kRouterId + 1, kSharedGateId = kRouterId + 2,
                   kSharedExpertId = kRouterId + 16;

QuantizedLinear random_linear(int64_t K, int64_t N, const QuantScheme& scheme, uint64_t seed, uint64_t id) {
  std::vector<float> w = normal(seed, id, K * N, 1.0 / std::sqrt(double(K)));
  return quantize(w, K, N, scheme, stream_seed(seed, id ^ 0x5555ull));
}

ExpertWeights random_expert(int64_t H, int64_t I, const QuantScheme& scheme, uint64_t seed, uint64_t base) {
  ExpertWeights e;
  e.gate = random_linear(H, I, scheme, seed, base * 3 + 0);
  e.up = random_linear(H, I, scheme, seed, base * 3 + 1);
  e.down = random_linear(I, H, scheme, seed, base * 3 + 2);
  return e;
}
}  // namespace

MoeLayerWeights random_layer(const MoeLayerSpec& spec, const QuantScheme& scheme, uint64_t seed) {
  spec.validate();
  scheme.validate(spec.hidden, spec.inter);
  scheme.validate(spec.inter, spec.hidden);
  if (spec.shared_kind != SharedExpertKind::None) {
    scheme.validate(spec.hidden, spec.shared_inter);
    scheme.validate(spec.shared_inter, spec.hidden);
  }
  const int64_t H = spec.hidden, E = spec.routing.num_experts;
  MoeLayerWeights w;
  // NOTE: the router is N(0, 1/sqrt(H)) rather than N(0, 1) so that logits of unit-variance
  // activations are O(1): softmax weights then spread over the top-k instead of being one-hot.
  w.router = normal(seed, kRouterId, E * H, 1.0 / std::sqrt(double(H)));
  if (spec.routing.method == RoutingMethod::NoauxTc) w.correction_bias = normal(seed, kBiasId, E, 0.1);
  if (spec.shared_kind == SharedExpertKind::SigmoidGated)
    w.shared_gate = normal(seed, kSharedGateId, H, 1.0 / std::sqrt(double(H)));

  // Experts (and the shared one, job E) are independent: spread them over threads. Each has its
  // own random stream, so the result does not depend on the thread count.
  const int64_t jobs = E + (spec.shared_kind != SharedExpertKind::None ? 1 : 0);
  w.experts.resize(static_cast<size_t>(E));
  std::atomic<int64_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mu;
  auto worker = [&] {
    for (int64_t j; (j = next.fetch_add(1)) < jobs;) {
      try {
        if (j < E)
          w.experts[size_t(j)] = random_expert(H, spec.inter, scheme, seed, uint64_t(j));
        else
          w.shared = random_expert(H, spec.shared_inter, scheme, seed, kSharedExpertId);
      } catch (...) {
        std::lock_guard<std::mutex> lock(failure_mu);
        if (!failure) failure = std::current_exception();
      }
    }
  };
  const int64_t threads = std::min<int64_t>(jobs, std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
  return w;
}

}  // namespace wna16
