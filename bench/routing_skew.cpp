// Skewed routing for `wna16 bench` (see routing_skew.h).
#include "bench/routing_skew.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "common/splitmix64.h"
#include "cpu/thread_pool.h"
#include "wna16/error.h"
#include "wna16/quant.h"
#include "wna16/reference.h"

namespace wna16::bench {
namespace {

// Calibration: stochastic approximation (Robbins-Monro, decaying step) over a pool of tokens, one
// chunk a round. The pool is large because offsets fitted to 4096 fixed tokens missed the law by
// up to 12% on fresh ones (qwen3 at S=1.2); a chunk sees a DeepSeek-V3 tail expert at S=1.2 (pick
// probability ~0.003) a dozen times.
constexpr int64_t kCalibTokens = 32768;
constexpr int64_t kCalibChunk = 4096;
constexpr int kCalibRounds = 96;
constexpr double kStep = 0.5;        // offset step per unit of log-odds(target / seen), in score spreads
constexpr double kMaxOffset = 30.0;  // in score spreads: a capped expert's offset stops growing here
constexpr int64_t kRouteChunk = 256; // rows per route_reference call on the pool

double normal(SplitMix64& r) {
  double u1 = r.uniform(), u2 = r.uniform();
  if (u1 < 1e-300) u1 = 1e-300;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// logits[m, e] = sum_h x[m, h] router[e, h] in fp32, eight rows per task sharing one pass over the
// transposed router (the inner loop runs over experts, so it vectorises without reassociation).
std::vector<float> logits_of(const std::vector<float>& router, const float* x, int64_t rows, int64_t H, int E) {
  std::vector<float> rt(size_t(H) * size_t(E));
  for (int e = 0; e < E; ++e)
    for (int64_t h = 0; h < H; ++h) rt[size_t(h * E + e)] = router[size_t(e * H + h)];
  std::vector<float> out(size_t(rows) * size_t(E), 0.0f);
  constexpr int64_t kRows = 8;
  cpu::thread_pool().run((rows + kRows - 1) / kRows, [&](int64_t t, int) {
    const int64_t r0 = t * kRows, r1 = std::min(rows, r0 + kRows);
    for (int64_t h = 0; h < H; ++h) {
      const float* rh = rt.data() + h * E;
      for (int64_t r = r0; r < r1; ++r) {
        const float xv = x[r * H + h];
        float* acc = out.data() + r * E;
        for (int e = 0; e < E; ++e) acc[e] += xv * rh[e];
      }
    }
  });
  return out;
}

// Logits of `rows` tokens x ~ N(0, I) drawn directly: router x is Gaussian with covariance
// router router^T, so L z (L its Cholesky factor, z ~ N(0, I_E)) has the logits' distribution at
// E^2 / 2 multiply-adds a token instead of E H (28x fewer for DeepSeek-V3).
std::vector<float> gaussian_logits(const std::vector<float>& router, int64_t H, int E, int64_t rows, uint64_t seed) {
  std::vector<double> L(size_t(E) * size_t(E), 0.0);
  cpu::thread_pool().run(E, [&](int64_t i, int) {
    for (int64_t j = 0; j <= i; ++j) {
      double acc = 0;
      for (int64_t h = 0; h < H; ++h) acc += double(router[size_t(i * H + h)]) * double(router[size_t(j * H + h)]);
      L[size_t(i * E + j)] = acc;
    }
  });
  for (int j = 0; j < E; ++j) {  // in place, lower triangle
    double d = L[size_t(j * E + j)];
    for (int p = 0; p < j; ++p) d -= L[size_t(j * E + p)] * L[size_t(j * E + p)];
    if (!(d > 0))
      throw Error("bench --routing: router rows are linearly dependent (Gram matrix singular at expert " +
                  std::to_string(j) + ")");
    d = std::sqrt(d);
    L[size_t(j * E + j)] = d;
    for (int i = j + 1; i < E; ++i) {
      double v = L[size_t(i * E + j)];
      for (int p = 0; p < j; ++p) v -= L[size_t(i * E + p)] * L[size_t(j * E + p)];
      L[size_t(i * E + j)] = v / d;
    }
  }
  std::vector<float> out(size_t(rows) * size_t(E));
  cpu::thread_pool().run(rows, [&](int64_t r, int) {
    SplitMix64 g(seed * 0x9e3779b97f4a7c15ull + uint64_t(r) + 1);
    std::vector<double> z(static_cast<size_t>(E));
    for (double& v : z) v = normal(g);
    for (int e = 0; e < E; ++e) {
      double acc = 0;
      for (int p = 0; p <= e; ++p) acc += L[size_t(e * E + p)] * z[size_t(p)];
      out[size_t(r * E + e)] = float(acc);
    }
  });
  return out;
}

std::vector<int32_t> route_logits(const RoutingConfig& cfg, const float* logits, int64_t rows, const float* bias) {
  const int k = cfg.top_k, E = cfg.num_experts;
  std::vector<int32_t> ids(size_t(rows) * size_t(k));
  cpu::thread_pool().run((rows + kRouteChunk - 1) / kRouteChunk, [&](int64_t t, int) {
    const int64_t r0 = t * kRouteChunk, n = std::min(rows, r0 + kRouteChunk) - r0;
    const Routing r = route_reference(cfg, logits + r0 * E, n, bias);
    std::copy(r.ids.begin(), r.ids.end(), ids.begin() + r0 * k);
  });
  return ids;
}

double spread(const std::vector<double>& v) {
  double mean = 0, sq = 0;
  for (double a : v) mean += a;
  mean /= double(v.size());
  for (double a : v) sq += (a - mean) * (a - mean);
  return std::sqrt(sq / double(v.size()));
}

}  // namespace

std::string RoutingOption::name() const {
  if (uniform()) return "uniform";
  char b[48];
  std::snprintf(b, sizeof b, "zipf:%g", zipf_s);
  return b;
}

RoutingOption parse_routing(const std::string& s) {
  RoutingOption o;
  if (s == "uniform") return o;
  const std::string why = "bench --routing '" + s + "': ";
  if (s.rfind("zipf:", 0) != 0) throw Error(why + "expected uniform or zipf:S (e.g. zipf:1.2)");
  const std::string num = s.substr(5);
  char* end = nullptr;
  const double v = num.empty() ? NAN : std::strtod(num.c_str(), &end);
  if (num.empty() || end != num.c_str() + num.size() || !std::isfinite(v))
    throw Error(why + "the Zipf exponent '" + num + "' is not a number");
  // Above 10 the law is "the same k experts for every token" to within 1e-3: nothing left to skew.
  if (!(v > 0 && v <= 10)) throw Error(why + "the Zipf exponent " + num + " must be in (0, 10]");
  o.zipf_s = v;
  return o;
}

std::vector<double> zipf_inclusion(int E, int k, double S) {
  if (E < 1 || k < 1 || k > E)
    throw Error("zipf_inclusion: needs 1 <= k <= E, got E=" + std::to_string(E) + " k=" + std::to_string(k));
  std::vector<double> w(static_cast<size_t>(E));
  for (int r = 0; r < E; ++r) w[size_t(r)] = std::pow(double(r + 1), -S);
  // sum_r min(1, c w_r) = k: increasing in c; bisect on log c.
  auto total = [&](double c) {
    double t = 0;
    for (double x : w) t += std::min(1.0, c * x);
    return t;
  };
  double lo = 0, hi = 1;
  while (total(hi) < double(k) - 1e-12) hi *= 2;
  for (int i = 0; i < 200; ++i) {
    const double mid = 0.5 * (lo + hi);
    (total(mid) < double(k) ? lo : hi) = mid;
  }
  for (double& x : w) x = std::min(1.0, hi * x);
  return w;
}

RoutingSkew apply_routing(const MoeLayerSpec& spec, const RoutingOption& o, MoeLayerWeights& w, uint64_t seed) {
  RoutingSkew s;
  if (o.uniform()) return s;
  const RoutingConfig& cfg = spec.routing;
  const int E = cfg.num_experts, k = cfg.top_k;
  const int64_t H = spec.hidden;
  if (int64_t(w.router.size()) != E * H)
    throw Error("bench --routing: router has " + std::to_string(w.router.size()) + " values, expected E*H");
  const bool via_bias = cfg.method == RoutingMethod::NoauxTc;
  s.x_component = !via_bias;

  const std::vector<int32_t> perm = seeded_perm(E, seed);
  const std::vector<double> law = zipf_inclusion(E, k, o.zipf_s);
  s.rank.resize(size_t(E));
  s.target.resize(size_t(E));
  for (int r = 0; r < E; ++r) {
    s.rank[size_t(perm[size_t(r)])] = r;
    s.target[size_t(perm[size_t(r)])] = law[size_t(r)];
  }

  // Logits of N(0, 1) tokens like the bench's activations; with x[:, 0] = 1 the router's column 0
  // holds the offset alone, so the rest of the logit comes from the other columns.
  if (s.x_component)
    for (int e = 0; e < E; ++e) w.router[size_t(e * H)] = 0.0f;
  const std::vector<float> base = gaussian_logits(w.router, H, E, kCalibTokens, seed);
  const std::vector<float> bias0 = w.correction_bias;

  // The offset moves a selection score: a logit, or (noaux_tc) a sigmoid score + bias. Steps are
  // in units of that score's spread over experts and tokens.
  std::vector<double> scores(base.begin(), base.end());
  if (via_bias)
    for (double& v : scores) v = 1.0 / (1.0 + std::exp(-v));
  const double unit = spread(scores);
  std::vector<double> off(static_cast<size_t>(E), 0.0);
  std::vector<float> logits(size_t(kCalibChunk) * size_t(E)), bias = bias0;
  auto route_with = [&](const std::vector<double>& d, int64_t r0) {  // rows [r0, r0 + kCalibChunk)
    const float* l = base.data() + r0 * E;
    if (via_bias) {
      for (int e = 0; e < E; ++e) bias[size_t(e)] = bias0[size_t(e)] + float(d[size_t(e)]);
    } else {
      for (int64_t r = 0; r < kCalibChunk; ++r)
        for (int e = 0; e < E; ++e) logits[size_t(r * E + e)] = l[r * E + e] + float(d[size_t(e)]);
      l = logits.data();
    }
    return route_logits(cfg, l, kCalibChunk, bias.empty() ? nullptr : bias.data());
  };
  // Log-odds, not log: an expert the law picks for every token (target 1) keeps being pushed up
  // until the sample sees it in (nearly) every token.
  const double lo = 0.5 / double(kCalibChunk + 1);
  auto clip = [&](double p) { return std::clamp(p, lo, 1.0 - lo); };
  auto log_odds = [](double p) { return std::log(p / (1.0 - p)); };
  for (int round = 0; round < kCalibRounds; ++round) {
    const int64_t r0 = round % (kCalibTokens / kCalibChunk) * kCalibChunk;
    const std::vector<int> c = expert_counts(route_with(off, r0).data(), kCalibChunk, k, E);
    const double step = kStep * unit / (1.0 + round / 20.0);
    for (int e = 0; e < E; ++e) {
      const double seen = clip((double(c[size_t(e)]) + 0.5) / double(kCalibChunk + 1));
      off[size_t(e)] += step * (log_odds(clip(s.target[size_t(e)])) - log_odds(seen));
      off[size_t(e)] = std::clamp(off[size_t(e)], -kMaxOffset * unit, kMaxOffset * unit);
    }
  }

  if (via_bias) {
    for (int e = 0; e < E; ++e) w.correction_bias[size_t(e)] = bias0[size_t(e)] + float(off[size_t(e)]);
  } else {
    // bf16-exact, as the CUDA bench's router is (the layer keeps its router in bf16).
    for (int e = 0; e < E; ++e) w.router[size_t(e * H)] = round_to(DType::BF16, float(off[size_t(e)]));
  }
  return s;
}

void skew_activations(const RoutingSkew& s, float* x, int64_t rows, int64_t H) {
  if (!s.x_component) return;
  for (int64_t r = 0; r < rows; ++r) x[r * H] = 1.0f;
}

void skew_activations(const RoutingSkew& s, uint16_t* x, int64_t rows, int64_t H, DType t) {
  if (!s.x_component) return;
  if (t != DType::BF16 && t != DType::F16)
    throw Error(std::string("skew_activations: activations must be bf16 or f16, got ") + dtype_name(t));
  const uint16_t one = t == DType::BF16 ? float_to_bf16(1.0f) : float_to_f16(1.0f);
  for (int64_t r = 0; r < rows; ++r) x[r * H] = one;
}

std::vector<int32_t> route_rows(const MoeLayerSpec& spec, const MoeLayerWeights& w, const float* x, int64_t rows) {
  const std::vector<float> l = logits_of(w.router, x, rows, spec.hidden, spec.routing.num_experts);
  return route_logits(spec.routing, l.data(), rows, w.correction_bias.empty() ? nullptr : w.correction_bias.data());
}

std::vector<int> expert_counts(const int32_t* ids, int64_t M, int k, int E) {
  std::vector<int> c(static_cast<size_t>(E), 0);
  for (int64_t i = 0; i < M * k; ++i) {
    if (ids[i] < 0 || ids[i] >= E)
      throw Error("expert_counts: slot " + std::to_string(i) + " has expert " + std::to_string(ids[i]) +
                  ", outside [0, " + std::to_string(E) + ")");
    ++c[size_t(ids[i])];
  }
  return c;
}

CallCost call_cost(const std::vector<int>& counts, int64_t M, const CostModel& m) {
  CallCost c;
  int64_t slots = 0;
  for (int v : counts) {
    c.active += v > 0;
    c.max_tokens = std::max(c.max_tokens, v);
    slots += v;
  }
  c.mean_tokens = c.active ? double(slots) / double(c.active) : 0.0;
  c.bytes = double(c.active * m.expert_bytes + m.fixed_bytes) + 2.0 * double(M * m.H) * double(m.act_size);
  c.flops = 2.0 * double(slots) * 3.0 * double(m.I) * double(m.H) + 2.0 * double(M) * 3.0 * double(m.Is) * double(m.H);
  return c;
}

}  // namespace wna16::bench
