// The float64 reference MoE layer: dequantize, SwiGLU per expert, weighted sum over the top-k,
// plus the shared expert. Loops are plain on purpose: this is the oracle, not a fast path.
#include <algorithm>
#include <cmath>
#include <string>

#include "wna16/error.h"
#include "wna16/half.h"
#include "wna16/reference.h"

namespace wna16 {

namespace {

// y[m, n] = sum_k x[m, k] * W[k, n] (+ bias[n]), W dequantized to double.
std::vector<double> linear(const QuantizedLinear& l, const double* x, int64_t M) {
  const std::vector<double> W = dequantize(l);
  const int64_t K = l.K, N = l.N;
  std::vector<double> y(static_cast<size_t>(M * N), 0.0);
  for (int64_t m = 0; m < M; ++m) {
    double* yr = y.data() + m * N;
    for (int64_t k = 0; k < K; ++k) {
      const double xv = x[m * K + k];
      const double* wr = W.data() + k * N;
      for (int64_t n = 0; n < N; ++n) yr[n] += xv * wr[n];
    }
    if (!l.bias.empty())
      for (int64_t n = 0; n < N; ++n) yr[n] += double(l.bias[size_t(n)]);
  }
  return y;
}

double silu(double v) { return v / (1.0 + std::exp(-v)); }
double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

}  // namespace

std::vector<double> expert_mlp_reference(const ExpertWeights& e, const double* x, int64_t M) {
  const int64_t H = e.gate.K, I = e.gate.N;
  if (e.up.K != H || e.up.N != I || e.down.K != I || e.down.N != H)
    throw Error("expert shapes disagree: gate [" + std::to_string(H) + ", " + std::to_string(I) + "], up [" +
                std::to_string(e.up.K) + ", " + std::to_string(e.up.N) + "], down [" + std::to_string(e.down.K) +
                ", " + std::to_string(e.down.N) + "]");
  if (M == 0) return {};
  const std::vector<double> g = linear(e.gate, x, M), u = linear(e.up, x, M);
  std::vector<double> h(static_cast<size_t>(M * I));
  for (size_t i = 0; i < h.size(); ++i) h[i] = silu(g[i]) * u[i];
  return linear(e.down, h.data(), M);
}

void check_routing(const RoutingConfig& cfg, const int32_t* ids, const float* weights, int64_t M, int top_k,
                   const char* who) {
  const std::string w(who);
  if (M < 0) throw Error(w + ": M=" + std::to_string(M) + " is negative");
  if (top_k < 1 || top_k > cfg.num_experts)
    throw Error(w + ": top_k=" + std::to_string(top_k) + " is outside [1, " + std::to_string(cfg.num_experts) +
                "] (the layer's number of experts)");
  if (M > 0 && (!ids || !weights)) throw Error(w + ": null topk_ids or topk_weights for M=" + std::to_string(M));
  for (int64_t m = 0; m < M; ++m)
    for (int j = 0; j < top_k; ++j) {
      const int64_t s = m * top_k + j;
      if (ids[s] < 0 || ids[s] >= cfg.num_experts)
        throw Error(w + ": topk_ids[" + std::to_string(m) + ", " + std::to_string(j) + "]=" + std::to_string(ids[s]) +
                    " is outside [0, " + std::to_string(cfg.num_experts) + ")");
      if (!std::isfinite(weights[s]))
        throw Error(w + ": topk_weights[" + std::to_string(m) + ", " + std::to_string(j) + "]=" +
                    std::to_string(weights[s]) + " is not finite");
    }
}

std::vector<double> moe_reference(const MoeLayerSpec& spec, const MoeLayerWeights& w, const float* x, int64_t M,
                                  Routing* routing_out) {
  w.validate(spec);
  if (M < 0) throw Error("moe_reference: M=" + std::to_string(M) + " is negative");
  const std::vector<float> logits = router_logits_reference(spec, w, x, M);
  Routing r = route_reference(spec.routing, logits.data(), M, w.correction_bias.empty() ? nullptr : w.correction_bias.data());
  std::vector<double> out = moe_reference_routed(spec, w, x, M, r);
  if (routing_out) *routing_out = std::move(r);
  return out;
}

std::vector<double> moe_reference_routed(const MoeLayerSpec& spec, const MoeLayerWeights& w, const float* x,
                                         int64_t M, const Routing& r) {
  w.validate(spec);
  const int k = r.top_k;
  if (r.M != M || int64_t(r.ids.size()) != M * k || int64_t(r.weights.size()) != M * k)
    throw Error("moe_reference_routed: routing of M=" + std::to_string(r.M) + ", top_k=" + std::to_string(k) +
                " with " + std::to_string(r.ids.size()) + " ids does not match M=" + std::to_string(M));
  check_routing(spec.routing, r.ids.data(), r.weights.data(), M, k, "moe_reference_routed");
  const int64_t H = spec.hidden, E = spec.routing.num_experts;

  std::vector<double> out(static_cast<size_t>(M * H), 0.0);
  // One expert at a time: gather its tokens, run the MLP, scatter-add weight * result.
  for (int64_t e = 0; e < E; ++e) {
    std::vector<int64_t> tokens;
    std::vector<double> weights;
    for (int64_t s = 0; s < M * k; ++s)
      if (r.ids[size_t(s)] == e) {
        tokens.push_back(s / k);
        weights.push_back(double(r.weights[size_t(s)]));
      }
    if (tokens.empty()) continue;
    std::vector<double> xe(tokens.size() * size_t(H));
    for (size_t t = 0; t < tokens.size(); ++t)
      for (int64_t h = 0; h < H; ++h) xe[t * size_t(H) + size_t(h)] = double(x[tokens[t] * H + h]);
    const std::vector<double> ye = expert_mlp_reference(w.experts[size_t(e)], xe.data(), int64_t(tokens.size()));
    for (size_t t = 0; t < tokens.size(); ++t)
      for (int64_t h = 0; h < H; ++h) out[size_t(tokens[t] * H + h)] += weights[t] * ye[t * size_t(H) + size_t(h)];
  }

  if (spec.shared_kind != SharedExpertKind::None && M > 0) {
    std::vector<double> xd(static_cast<size_t>(M * H));
    for (size_t i = 0; i < xd.size(); ++i) xd[i] = double(x[i]);
    const std::vector<double> ys = expert_mlp_reference(*w.shared, xd.data(), M);
    for (int64_t m = 0; m < M; ++m) {
      double gate = 1.0;
      if (spec.shared_kind == SharedExpertKind::SigmoidGated) {
        // Qwen2-MoE: sigmoid(shared_expert_gate(x)), a [1, H] linear kept in full precision.
        double acc = 0;
        for (int64_t h = 0; h < H; ++h) acc += xd[size_t(m * H + h)] * double(w.shared_gate[size_t(h)]);
        gate = sigmoid(acc);
      }
      for (int64_t h = 0; h < H; ++h) out[size_t(m * H + h)] += gate * ys[size_t(m * H + h)];
    }
  }

  return out;
}

namespace {
template <typename T>
double rel_error_impl(const T* a, const double* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double av = double(a[i]), bv = b[i];
    if (!std::isfinite(av) || !std::isfinite(bv)) return INFINITY;
    num += (av - bv) * (av - bv);
    den += bv * bv;
  }
  if (num == 0) return 0.0;
  if (den == 0) return INFINITY;
  return std::sqrt(num / den);
}
}  // namespace

double rel_error(const double* a, const double* b, int64_t n) { return rel_error_impl(a, b, n); }
double rel_error(const float* a, const double* b, int64_t n) { return rel_error_impl(a, b, n); }

BitDiff compare_bits(const uint16_t* a, const uint16_t* b, int64_t rows, int64_t cols, DType t) {
  if (t != DType::BF16 && t != DType::F16)
    throw Error(std::string("compare_bits: dtype ") + dtype_name(t) + " is not a 16-bit float (bf16, f16)");
  BitDiff d;
  for (int64_t i = 0; i < rows * cols; ++i) {
    if (a[i] == b[i]) continue;
    if (d.first_row < 0) d.first_row = i / cols;
    const double x = t == DType::F16 ? f16_to_float(a[i]) : bf16_to_float(a[i]);
    const double y = t == DType::F16 ? f16_to_float(b[i]) : bf16_to_float(b[i]);
    const double diff = std::fabs(x - y);
    // NaN (either side) or inf - inf: unbounded; two NaNs with different payloads too.
    d.max_abs = std::max(d.max_abs, std::isnan(diff) ? INFINITY : diff);
  }
  return d;
}

}  // namespace wna16
