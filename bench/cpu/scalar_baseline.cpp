// The scalar per-expert baseline (see scalar_baseline.h). Deliberately plain: codes from unpack(),
// each weight dequantised as it is used, fp32 accumulation, one thread. It rounds the SwiGLU
// intermediate to the activation dtype exactly as the fast backend does.
#include "bench/cpu/scalar_baseline.h"

#include <cmath>
#include <vector>

#include "cpu/act_io.h"
#include "wna16/reference.h"

namespace wna16::cpu {
namespace {

// y[n] = sum_k x[k] * s[g(k), n] * (q[k, n] - z[g(k), n]) (+ bias[n]).
void linear(const UnpackedLinear& L, const float* x, float* y) {
  const int64_t K = L.K, N = L.N;
  for (int64_t n = 0; n < N; ++n) y[n] = L.bias.empty() ? 0.f : L.bias[size_t(n)];
  for (int64_t k = 0; k < K; ++k) {
    const float xv = x[k];
    const int64_t g = L.g_idx[size_t(k)];
    const uint8_t* q = L.q.data() + k * N;
    const int32_t* z = L.zeros.data() + g * N;
    const float* s = L.scales.data() + g * N;
    for (int64_t n = 0; n < N; ++n) y[n] += xv * (s[n] * float(int32_t(q[n]) - z[n]));
  }
}

struct Expert {
  UnpackedLinear gate, up, down;
};

Expert unpack_expert(const ExpertWeights& e) { return {unpack(e.gate), unpack(e.up), unpack(e.down)}; }

class ScalarBaselineLayer final : public MoeBackendLayer {
 public:
  ScalarBaselineLayer(const MoeLayerSpec& spec, const MoeLayerWeights& w) : spec_(spec) {
    w.validate(spec);
    router_ = w.router;
    bias_ = w.correction_bias;
    shared_gate_ = w.shared_gate;
    for (const auto& e : w.experts) experts_.push_back(unpack_expert(e));
    if (w.shared) shared_.push_back(unpack_expert(*w.shared));
  }

  Device device() const override { return Device::Cpu; }

  void forward_host(const void* x, void* out, int64_t M, DType dtype) override {
    check_forward_args(x, out, M, "cpu scalar baseline forward");
    const DType act = compute_dtype(dtype);
    const int64_t H = spec_.hidden, E = spec_.routing.num_experts;
    const int k = spec_.routing.top_k;
    std::vector<float> xf(size_t(M * H));
    for (int64_t i = 0; i < M * H; ++i) xf[size_t(i)] = load_act(x, dtype, i);

    // Router logits: float64 accumulation rounded to fp32, so the expert ids match the reference.
    std::vector<float> logits(size_t(M * E));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t e = 0; e < E; ++e) {
        double acc = 0;
        for (int64_t h = 0; h < H; ++h) acc += double(xf[size_t(m * H + h)]) * double(router_[size_t(e * H + h)]);
        logits[size_t(m * E + e)] = float(acc);
      }
    const Routing r = route_reference(spec_.routing, logits.data(), M, bias_.empty() ? nullptr : bias_.data());

    std::vector<float> acc(size_t(M * H), 0.f);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t m = 0; m < M; ++m)
        for (int j = 0; j < k; ++j)
          if (r.ids[size_t(m * k + j)] == e)
            expert(experts_[size_t(e)], &xf[size_t(m * H)], r.weights[size_t(m * k + j)], act, &acc[size_t(m * H)]);
    if (!shared_.empty())
      for (int64_t m = 0; m < M; ++m) {
        float g = 1.f;
        if (spec_.shared_kind == SharedExpertKind::SigmoidGated) {
          double d = 0;
          for (int64_t h = 0; h < H; ++h) d += double(xf[size_t(m * H + h)]) * double(shared_gate_[size_t(h)]);
          g = float(1.0 / (1.0 + std::exp(-d)));
        }
        expert(shared_[0], &xf[size_t(m * H)], g, act, &acc[size_t(m * H)]);
      }
    for (int64_t i = 0; i < M * H; ++i) store_act(out, dtype, i, acc[size_t(i)]);
  }

 private:
  // acc[:] += weight * down(round(silu(gate(x)) * up(x))) for one token.
  void expert(const Expert& ex, const float* x, float weight, DType act, float* acc) const {
    const int64_t I = ex.gate.N, H = spec_.hidden;
    std::vector<float> g(static_cast<size_t>(I)), u(static_cast<size_t>(I)), y(static_cast<size_t>(H));
    linear(ex.gate, x, g.data());
    linear(ex.up, x, u.data());
    for (int64_t i = 0; i < I; ++i) {
      const float gv = g[size_t(i)];
      g[size_t(i)] = round_to(act, gv / (1.f + std::exp(-gv)) * u[size_t(i)]);
    }
    linear(ex.down, g.data(), y.data());
    for (int64_t h = 0; h < H; ++h) acc[h] += weight * y[size_t(h)];
  }

  MoeLayerSpec spec_;
  std::vector<float> router_, bias_, shared_gate_;
  std::vector<Expert> experts_;
  std::vector<Expert> shared_;  // zero or one
};

}  // namespace

std::unique_ptr<MoeBackendLayer> make_scalar_baseline(const MoeLayerSpec& spec, const MoeLayerWeights& w) {
  return std::make_unique<ScalarBaselineLayer>(spec, w);
}

}  // namespace wna16::cpu
