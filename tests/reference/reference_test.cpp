// The float64 reference layer: hand-worked MLPs and layers, then random small layers of every
// routing method and shared-expert kind against an independent float32 path written here.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "test_util.h"
#include "wna16/error.h"
#include "wna16/half.h"
#include "wna16/reference.h"

using namespace wna16;

namespace {

// An 8x8 linear W = scale * diag(d) (d in -7..7), packed as GPTQ v1 4-bit sym, one group.
QuantizedLinear diag_linear(const std::vector<int>& d, float scale) {
  UnpackedLinear u;
  u.bits = 4;
  u.K = u.N = 8;
  u.groups = 1;
  u.q.assign(64, 8);
  for (int i = 0; i < 8; ++i) u.q[size_t(i * 8 + i)] = uint8_t(8 + d[size_t(i)]);
  u.zeros.assign(8, 8);
  u.scales.assign(8, scale);
  u.g_idx.assign(8, 0);
  QuantScheme s;
  s.format = Format::GptqV1;
  s.bits = 4;
  s.group_size = -1;
  s.sym = true;
  return pack(u, s);
}

ExpertWeights diag_expert(float gate, float up, float down) {
  const std::vector<int> one(8, 1);
  return {diag_linear(one, gate), diag_linear(one, up), diag_linear(one, down)};
}

double silu(double v) { return v / (1 + std::exp(-v)); }

// ---- the independent float32 path: per token, per choice, float weights and float sums ----------
std::vector<float> f32_weights(const QuantizedLinear& l) {
  const std::vector<double> d = dequantize(l);
  return std::vector<float>(d.begin(), d.end());
}

std::vector<float> f32_mlp(const ExpertWeights& e, const float* x) {
  const int64_t H = e.gate.K, I = e.gate.N;
  const std::vector<float> g = f32_weights(e.gate), u = f32_weights(e.up), d = f32_weights(e.down);
  std::vector<float> h(static_cast<size_t>(I)), out(static_cast<size_t>(H), 0.f);
  for (int64_t n = 0; n < I; ++n) {
    float a = 0, b = 0;
    for (int64_t k = 0; k < H; ++k) {
      a += x[k] * g[size_t(k * I + n)];
      b += x[k] * u[size_t(k * I + n)];
    }
    h[size_t(n)] = a / (1.f + std::exp(-a)) * b;
  }
  for (int64_t n = 0; n < H; ++n) {
    float acc = 0;
    for (int64_t k = 0; k < I; ++k) acc += h[size_t(k)] * d[size_t(k * H + n)];
    out[size_t(n)] = acc;
  }
  return out;
}

std::vector<float> f32_layer(const MoeLayerSpec& spec, const MoeLayerWeights& w, const std::vector<float>& x,
                             int64_t M, const Routing& r) {
  const int64_t H = spec.hidden;
  std::vector<float> out(size_t(M * H), 0.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x.data() + m * H;
    for (int j = 0; j < r.top_k; ++j) {
      const auto y = f32_mlp(w.experts[size_t(r.ids[size_t(m * r.top_k + j)])], xm);
      for (int64_t h = 0; h < H; ++h) out[size_t(m * H + h)] += r.weights[size_t(m * r.top_k + j)] * y[size_t(h)];
    }
    if (spec.shared_kind != SharedExpertKind::None) {
      float gate = 1.f;
      if (spec.shared_kind == SharedExpertKind::SigmoidGated) {
        float a = 0;
        for (int64_t h = 0; h < H; ++h) a += xm[h] * w.shared_gate[size_t(h)];
        gate = 1.f / (1.f + std::exp(-a));
      }
      const auto y = f32_mlp(*w.shared, xm);
      for (int64_t h = 0; h < H; ++h) out[size_t(m * H + h)] += gate * y[size_t(h)];
    }
  }
  return out;
}

std::vector<float> random_x(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = round_to(DType::BF16, nd(rng));
  return x;
}

MoeLayerSpec small_spec(RoutingMethod m, int E, int k, bool renorm, SharedExpertKind shared) {
  MoeLayerSpec s;
  s.name = "test";
  s.hidden = 64;
  s.inter = 32;
  s.routing.method = m;
  s.routing.num_experts = E;
  s.routing.top_k = k;
  s.routing.renormalize = renorm;
  s.shared_kind = shared;
  s.shared_inter = shared == SharedExpertKind::None ? 0 : 64;
  return s;
}

using test::scheme;

// Reference vs the float32 path for M in {1, 5, 33}; also checks the router logits agree.
void check_against_f32(const MoeLayerSpec& spec, const QuantScheme& q, uint64_t seed) {
  const MoeLayerWeights w = random_layer(spec, q, seed);
  for (int64_t M : {1, 5, 33}) {
    SCOPED_TRACE(spec.name + " " + q.describe() + " M=" + std::to_string(M));
    const std::vector<float> x = random_x(M * spec.hidden, uint32_t(seed + uint64_t(M)));
    Routing r;
    const std::vector<double> ref = moe_reference(spec, w, x.data(), M, &r);
    ASSERT_EQ(int64_t(ref.size()), M * spec.hidden);
    ASSERT_EQ(r.M, M);
    // Every token has top_k distinct valid experts.
    for (int64_t m = 0; m < M; ++m)
      for (int j = 0; j < r.top_k; ++j) {
        const int32_t id = r.ids[size_t(m * r.top_k + j)];
        ASSERT_GE(id, 0);
        ASSERT_LT(id, spec.routing.num_experts);
        for (int i = 0; i < j; ++i) ASSERT_NE(r.ids[size_t(m * r.top_k + i)], id);
      }
    // float32 router logits agree with the reference's to float accuracy.
    const std::vector<float> logits = router_logits_reference(spec, w, x.data(), M);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t e = 0; e < spec.routing.num_experts; ++e) {
        float a = 0;
        for (int64_t h = 0; h < spec.hidden; ++h) a += x[size_t(m * spec.hidden + h)] * w.router[size_t(e * spec.hidden + h)];
        ASSERT_NEAR(a, logits[size_t(m * spec.routing.num_experts + e)], 1e-4);
      }
    const std::vector<float> f = f32_layer(spec, w, x, M, r);
    const double err = rel_error(f.data(), ref.data(), M * spec.hidden);
    EXPECT_LT(err, 1e-5);
    EXPECT_GT(err, 0.0);  // float32 rounding must show: the paths really are different
  }
}

}  // namespace

TEST(Reference, ExpertMlpByHand) {
  // gate = I, up = 2I, down = I: out_i = silu(x_i) * 2 x_i.
  // x = 1 -> 2 silu(1) = 1.46211715726; 0 -> 0; -1 -> -2 silu(-1) = 0.53788284274;
  // 2 -> 4 silu(2) = 7.04637662382; .5 -> silu(.5) = 0.31122966560; -3 -> -6 silu(-3) = 0.85366571720.
  const ExpertWeights e = diag_expert(1.f, 2.f, 1.f);
  const std::vector<double> x = {1, 0, -1, 2, 0.5, 0, 0, -3};
  const std::vector<double> y = expert_mlp_reference(e, x.data(), 1);
  const std::vector<double> want = {1.46211715726, 0, 0.53788284274, 7.04637662382, 0.31122966560, 0, 0,
                                    0.85366571720};
  ASSERT_EQ(y.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_NEAR(y[i], want[i], 1e-10) << i;
}

TEST(Reference, ExpertMlpRowsAreIndependent) {
  const ExpertWeights e = diag_expert(0.5f, 1.f, -1.f);
  std::vector<double> x = {1, 2, 3, 4, 5, 6, 7, 8, -1, -2, -3, -4, -5, -6, -7, -8};
  const auto both = expert_mlp_reference(e, x.data(), 2);
  const auto second = expert_mlp_reference(e, x.data() + 8, 1);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(both[8 + i], second[i]);
  // out_i = -silu(x_i / 2) * x_i
  EXPECT_NEAR(both[0], -silu(0.5) * 1, 1e-12);
}

TEST(Reference, LayerByHandWithSigmoidGatedSharedExpert) {
  // H = I = 8. Expert 0: f(x) = silu(x) * x; expert 1: -f(x). Router rows e0 = +x0, e1 = -x0, so
  // top-2 softmax weights without renorm are p0 = sigmoid(2 x0), p1 = 1 - p0 and the routed sum is
  // (p0 - p1) f(x) = tanh(x0) f(x). Shared expert f(x), gated by sigmoid(x1).
  // Total: (tanh(x0) + sigmoid(x1)) * silu(x) * x.
  MoeLayerSpec spec;
  spec.name = "hand";
  spec.hidden = spec.inter = 8;
  spec.routing.num_experts = 2;
  spec.routing.top_k = 2;
  spec.routing.renormalize = false;
  spec.shared_kind = SharedExpertKind::SigmoidGated;
  spec.shared_inter = 8;
  MoeLayerWeights w;
  w.router.assign(16, 0.f);
  w.router[0] = 1.f;
  w.router[8] = -1.f;
  w.experts = {diag_expert(1, 1, 1), diag_expert(1, 1, -1)};
  w.shared = diag_expert(1, 1, 1);
  w.shared_gate.assign(8, 0.f);
  w.shared_gate[1] = 1.f;
  const std::vector<float> x = {0.75f, -0.5f, 1, 2, -1, 0, 3, -2, -1.25f, 2, 0.5f, 0, 1, 1, -4, 0.25f};
  Routing r;
  const std::vector<double> y = moe_reference(spec, w, x.data(), 2, &r);
  for (int m = 0; m < 2; ++m) {
    const double x0 = x[size_t(m * 8)], x1 = x[size_t(m * 8 + 1)];
    const double g = std::tanh(x0) + 1 / (1 + std::exp(-x1));
    for (int i = 0; i < 8; ++i) {
      const double xi = x[size_t(m * 8 + i)];
      // routing weights are rounded to float: allow float-level error
      EXPECT_NEAR(y[size_t(m * 8 + i)], g * silu(xi) * xi, 1e-6) << m << "," << i;
    }
  }
  EXPECT_EQ(r.ids[0], 0);  // x0 > 0: expert 0 first
  EXPECT_EQ(r.ids[2], 1);  // x0 < 0: expert 1 first
}

TEST(Reference, PlainSharedExpertIsAddedUngated) {
  MoeLayerSpec spec;
  spec.name = "hand";
  spec.hidden = spec.inter = 8;
  spec.routing.num_experts = 2;
  spec.routing.top_k = 1;
  spec.shared_kind = SharedExpertKind::Plain;
  spec.shared_inter = 8;
  MoeLayerWeights w;
  w.router.assign(16, 0.f);
  // Expert 0: 0 (down scale 0 is not packable with sym, use d = 0 codes); expert 1 never routed.
  w.experts = {{diag_linear(std::vector<int>(8, 1), 1), diag_linear(std::vector<int>(8, 1), 1),
                diag_linear(std::vector<int>(8, 0), 1)},
               diag_expert(1, 1, 1)};
  w.shared = diag_expert(1, 1, 2);  // 2 f(x)
  std::vector<float> x = {1, -1, 2, 0, 0, 0, 0, 3};
  const std::vector<double> y = moe_reference(spec, w, x.data(), 1);
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(y[size_t(i)], 2 * silu(x[size_t(i)]) * x[size_t(i)], 1e-12) << i;
}

TEST(Reference, BatchEqualsTokenByToken) {
  // Every token's output depends on its own row only, bit for bit (verify relies on this).
  const MoeLayerSpec spec = small_spec(RoutingMethod::NoauxTc, 16, 4, true, SharedExpertKind::Plain);
  MoeLayerSpec s = spec;
  s.routing.n_group = 4;
  s.routing.topk_group = 2;
  s.routing.routed_scaling_factor = 2.5;
  const MoeLayerWeights w = random_layer(s, scheme(Format::GptqV1, 4, 32, true), 5);
  const std::vector<float> x = random_x(9 * s.hidden, 3);
  const std::vector<double> all = moe_reference(s, w, x.data(), 9);
  for (int64_t m = 0; m < 9; ++m) {
    const std::vector<double> one = moe_reference(s, w, x.data() + m * s.hidden, 1);
    for (int64_t h = 0; h < s.hidden; ++h) ASSERT_EQ(one[size_t(h)], all[size_t(m * s.hidden + h)]) << m << "," << h;
  }
}

TEST(Reference, EmptyBatch) {
  const MoeLayerSpec spec = small_spec(RoutingMethod::SoftmaxTopK, 8, 2, true, SharedExpertKind::SigmoidGated);
  const MoeLayerWeights w = random_layer(spec, scheme(Format::GptqV1, 4, 32, true), 1);
  Routing r;
  EXPECT_TRUE(moe_reference(spec, w, nullptr, 0, &r).empty());
  EXPECT_EQ(r.M, 0);
}

TEST(Reference, RoutingOutMatchesRouteReference) {
  MoeLayerSpec spec = small_spec(RoutingMethod::GroupLimitedGreedy, 8, 3, false, SharedExpertKind::None);
  spec.routing.n_group = 4;
  spec.routing.topk_group = 2;
  spec.routing.routed_scaling_factor = 1.5;
  const MoeLayerWeights w = random_layer(spec, scheme(Format::Awq, 4, 32, false), 2);
  const std::vector<float> x = random_x(4 * spec.hidden, 9);
  Routing r;
  moe_reference(spec, w, x.data(), 4, &r);
  const auto logits = router_logits_reference(spec, w, x.data(), 4);
  const Routing want = route_reference(spec.routing, logits.data(), 4, nullptr);
  EXPECT_EQ(r.ids, want.ids);
  EXPECT_EQ(r.weights, want.weights);
}

TEST(ReferenceVsF32, SoftmaxRenormalisedGptq4) {
  check_against_f32(small_spec(RoutingMethod::SoftmaxTopK, 8, 2, true, SharedExpertKind::None),
                    scheme(Format::GptqV1, 4, 32, true), 11);
}

TEST(ReferenceVsF32, SoftmaxUnnormalisedSigmoidGatedSharedAwq) {
  check_against_f32(small_spec(RoutingMethod::SoftmaxTopK, 6, 3, false, SharedExpertKind::SigmoidGated),
                    scheme(Format::Awq, 4, 32, false), 12);
}

TEST(ReferenceVsF32, GroupLimitedGreedyPlainSharedGptqV2Asym8) {
  MoeLayerSpec s = small_spec(RoutingMethod::GroupLimitedGreedy, 8, 3, false, SharedExpertKind::Plain);
  s.routing.n_group = 4;
  s.routing.topk_group = 2;
  s.routing.routed_scaling_factor = 1.5;
  check_against_f32(s, scheme(Format::GptqV2, 8, 32, false), 13);
}

TEST(ReferenceVsF32, GreedyLikeDeepSeekV2LiteActOrder) {
  MoeLayerSpec s = small_spec(RoutingMethod::GroupLimitedGreedy, 16, 6, false, SharedExpertKind::Plain);
  check_against_f32(s, scheme(Format::GptqV1, 4, 32, true, true), 14);
}

TEST(ReferenceVsF32, NoauxTcLikeDeepSeekV3WholeKGroups) {
  MoeLayerSpec s = small_spec(RoutingMethod::NoauxTc, 16, 4, true, SharedExpertKind::Plain);
  s.routing.n_group = 4;
  s.routing.topk_group = 2;
  s.routing.routed_scaling_factor = 2.5;
  check_against_f32(s, scheme(Format::GptqV1, 4, -1, true), 15);
}

TEST(ReferenceVsF32, NoauxTcUnnormalisedSigmoidGated8Bit) {
  MoeLayerSpec s = small_spec(RoutingMethod::NoauxTc, 8, 2, false, SharedExpertKind::SigmoidGated);
  s.routing.n_group = 2;
  s.routing.topk_group = 1;
  s.routing.routed_scaling_factor = 2.0;
  check_against_f32(s, scheme(Format::GptqV1, 8, 16, true), 16);
}

TEST(RelError, FrobeniusAndNonFinite) {
  const std::vector<double> b = {3, 4};  // ||b|| = 5
  const std::vector<double> a = {3, 4 + 0.05};
  EXPECT_NEAR(rel_error(a.data(), b.data(), 2), 0.01, 1e-12);
  const std::vector<float> af = {3.f, 4.f};
  EXPECT_EQ(rel_error(af.data(), b.data(), 2), 0.0);
  const std::vector<float> nan = {NAN, 4.f};
  EXPECT_TRUE(std::isinf(rel_error(nan.data(), b.data(), 2)));
  const std::vector<double> inf = {INFINITY, 4};
  EXPECT_TRUE(std::isinf(rel_error(inf.data(), b.data(), 2)));
  const std::vector<double> zero = {0, 0};
  EXPECT_EQ(rel_error(zero.data(), zero.data(), 2), 0.0);
  EXPECT_TRUE(std::isinf(rel_error(b.data(), zero.data(), 2)));
}

TEST(CompareBits, FirstDifferingRowAndLargestDifference) {
  for (DType t : {DType::BF16, DType::F16}) {
    auto bits = [t](float v) { return t == DType::F16 ? float_to_f16(v) : float_to_bf16(v); };
    std::vector<uint16_t> a(3 * 4), b;
    for (size_t i = 0; i < a.size(); ++i) a[i] = bits(float(i) - 5.f);
    b = a;
    BitDiff d = compare_bits(a.data(), b.data(), 3, 4, t);
    EXPECT_EQ(d.first_row, -1);
    EXPECT_EQ(d.max_abs, 0.0);
    b[9] = bits(8.f);  // row 2: 4 -> 8
    b[5] = bits(0.5f);  // row 1: 0 -> 0.5
    d = compare_bits(a.data(), b.data(), 3, 4, t);
    EXPECT_EQ(d.first_row, 1);
    EXPECT_EQ(d.max_abs, 4.0);
    // -0 and +0 are equal values but different bits: a difference of 0 in row 0.
    a[0] = bits(0.f), b[0] = bits(-0.f);
    d = compare_bits(a.data(), b.data(), 3, 4, t);
    EXPECT_EQ(d.first_row, 0);
    EXPECT_EQ(d.max_abs, 4.0);
    b[11] = bits(NAN);
    EXPECT_TRUE(std::isinf(compare_bits(a.data(), b.data(), 3, 4, t).max_abs));
  }
  std::vector<uint16_t> z(4);
  EXPECT_THROW(compare_bits(z.data(), z.data(), 1, 4, DType::F32), Error);
}
