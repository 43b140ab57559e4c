// Presets, spec and weight validation, and the seeded random layer.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "test_util.h"
#include "wna16/error.h"
#include "wna16/moe.h"

using namespace wna16;

namespace {
using test::error_of;
#define EXPECT_ERROR_HAS(stmt, text)                                     \
  do {                                                                   \
    const std::string msg_ = error_of([&] { stmt; });                    \
    EXPECT_NE(msg_.find(text), std::string::npos) << "message: " << msg_; \
  } while (0)

QuantScheme g32() {
  QuantScheme s;
  s.group_size = 32;
  return s;
}

MoeLayerSpec tiny() {
  MoeLayerSpec s;
  s.name = "tiny";
  s.hidden = 64;
  s.inter = 32;
  s.routing.num_experts = 4;
  s.routing.top_k = 2;
  return s;
}
}  // namespace

TEST(Presets, RealModelShapes) {
  const auto names = preset_names();
  ASSERT_EQ(names.size(), 8u);
  EXPECT_EQ(names[0], "small");
  for (const auto& n : names) EXPECT_NO_THROW(preset(n).validate()) << n;

  const MoeLayerSpec mx = preset("mixtral-8x7b");
  EXPECT_EQ(mx.hidden, 4096);
  EXPECT_EQ(mx.inter, 14336);
  EXPECT_EQ(mx.routing.num_experts, 8);
  EXPECT_EQ(mx.routing.top_k, 2);
  EXPECT_TRUE(mx.routing.renormalize);
  EXPECT_EQ(mx.shared_kind, SharedExpertKind::None);

  const MoeLayerSpec q15 = preset("qwen1.5-moe-a2.7b");
  EXPECT_EQ(q15.routing.num_experts, 60);
  EXPECT_EQ(q15.routing.top_k, 4);
  EXPECT_FALSE(q15.routing.renormalize);
  EXPECT_EQ(q15.shared_kind, SharedExpertKind::SigmoidGated);
  EXPECT_EQ(q15.shared_inter, 5632);

  const MoeLayerSpec q3 = preset("qwen3-30b-a3b");
  EXPECT_EQ(q3.inter, 768);
  EXPECT_EQ(q3.routing.num_experts, 128);
  EXPECT_EQ(q3.routing.top_k, 8);
  EXPECT_TRUE(q3.routing.renormalize);

  const MoeLayerSpec v2 = preset("deepseek-v2-lite");
  EXPECT_EQ(v2.hidden, 2048);
  EXPECT_EQ(v2.inter, 1408);
  EXPECT_EQ(v2.routing.method, RoutingMethod::GroupLimitedGreedy);
  EXPECT_EQ(v2.routing.num_experts, 64);
  EXPECT_EQ(v2.routing.top_k, 6);
  EXPECT_EQ(v2.routing.n_group, 1);
  EXPECT_FALSE(v2.routing.renormalize);
  EXPECT_EQ(v2.routing.routed_scaling_factor, 1.0);
  EXPECT_EQ(v2.shared_kind, SharedExpertKind::Plain);
  EXPECT_EQ(v2.shared_inter, 2816);

  const MoeLayerSpec v3 = preset("deepseek-v3");
  EXPECT_EQ(v3.hidden, 7168);
  EXPECT_EQ(v3.inter, 2048);
  EXPECT_EQ(v3.routing.method, RoutingMethod::NoauxTc);
  EXPECT_EQ(v3.routing.num_experts, 256);
  EXPECT_EQ(v3.routing.n_group, 8);
  EXPECT_EQ(v3.routing.topk_group, 4);
  EXPECT_EQ(v3.routing.routed_scaling_factor, 2.5);
  EXPECT_TRUE(v3.routing.renormalize);
  EXPECT_EQ(v3.shared_inter, 2048);
}

TEST(Presets, UnknownNameListsTheKnownOnes) {
  EXPECT_ERROR_HAS(preset("mixtral"), "unknown model preset 'mixtral'");
  EXPECT_ERROR_HAS(preset("mixtral"), "deepseek-v2-lite");
  EXPECT_STREQ(routing_name(RoutingMethod::NoauxTc), "noaux_tc");
  EXPECT_STREQ(routing_name(RoutingMethod::GroupLimitedGreedy), "group_limited_greedy");
}

TEST(Spec, BadValuesAreNamed) {
  MoeLayerSpec s = tiny();
  s.hidden = 0;
  EXPECT_ERROR_HAS(s.validate(), "hidden=0");
  s = tiny();
  s.inter = -5;
  EXPECT_ERROR_HAS(s.validate(), "inter=-5");
  s = tiny();
  s.shared_inter = 64;
  EXPECT_ERROR_HAS(s.validate(), "shared_inter=64");
  s = tiny();
  s.shared_kind = SharedExpertKind::Plain;
  EXPECT_ERROR_HAS(s.validate(), "shared_inter=0");
  s = tiny();
  s.routing.top_k = 5;
  EXPECT_ERROR_HAS(s.validate(), "top_k=5");
}

TEST(RandomLayer, DeterministicAndValid) {
  MoeLayerSpec s = tiny();
  s.shared_kind = SharedExpertKind::SigmoidGated;
  s.shared_inter = 32;
  const MoeLayerWeights a = random_layer(s, g32(), 7), b = random_layer(s, g32(), 7), c = random_layer(s, g32(), 8);
  EXPECT_NO_THROW(a.validate(s));
  EXPECT_EQ(a.router, b.router);
  EXPECT_EQ(a.shared_gate, b.shared_gate);
  for (size_t e = 0; e < a.experts.size(); ++e) {
    EXPECT_EQ(a.experts[e].gate.qweight, b.experts[e].gate.qweight);
    EXPECT_EQ(a.experts[e].down.scales, b.experts[e].down.scales);
  }
  EXPECT_EQ(a.shared->up.qweight, b.shared->up.qweight);
  EXPECT_NE(a.router, c.router);
  EXPECT_NE(a.experts[0].gate.qweight, c.experts[0].gate.qweight);
  // Experts differ from each other.
  EXPECT_NE(a.experts[0].up.qweight, a.experts[1].up.qweight);
  EXPECT_TRUE(a.correction_bias.empty());
}

TEST(RandomLayer, NoauxTcGetsABias) {
  MoeLayerSpec s = tiny();
  s.routing.method = RoutingMethod::NoauxTc;
  s.routing.n_group = 2;
  s.routing.topk_group = 1;
  const MoeLayerWeights w = random_layer(s, g32(), 1);
  ASSERT_EQ(w.correction_bias.size(), 4u);
  EXPECT_NO_THROW(w.validate(s));
}

TEST(RandomLayer, BadSchemeForTheShapeIsRefused) {
  QuantScheme q;
  q.group_size = 48;  // does not divide inter = 32 (down's K)
  const std::string msg = error_of([&] { random_layer(tiny(), q, 1); });
  EXPECT_NE(msg, "<no error>");
}

TEST(Weights, ValidateNamesWhatIsWrong) {
  const MoeLayerSpec s = tiny();
  const MoeLayerWeights good = random_layer(s, g32(), 3);
  MoeLayerWeights w = good;
  w.experts.pop_back();
  EXPECT_ERROR_HAS(w.validate(s), "3 experts");
  w = good;
  w.router.pop_back();
  EXPECT_ERROR_HAS(w.validate(s), "router has 255 values");
  w = good;
  w.experts[2].down = good.experts[2].gate;  // [64, 32] where [32, 64] is expected
  EXPECT_ERROR_HAS(w.validate(s), "expert 2.down");
  w = good;
  w.shared = good.experts[0];
  EXPECT_ERROR_HAS(w.validate(s), "shared");
  w = good;
  w.shared_gate.assign(64, 0.f);
  EXPECT_ERROR_HAS(w.validate(s), "shared_gate");

  MoeLayerSpec noaux = s;
  noaux.routing.method = RoutingMethod::NoauxTc;
  noaux.routing.n_group = 2;
  EXPECT_ERROR_HAS(good.validate(noaux), "correction_bias has 0 values");

  MoeLayerSpec gated = s;
  gated.shared_kind = SharedExpertKind::SigmoidGated;
  gated.shared_inter = 32;
  EXPECT_ERROR_HAS(good.validate(gated), "no shared weights");
}

TEST(RandomLayer, DistributionsHaveTheDocumentedSpread) {
  // router and shared_gate ~ N(0, 1/sqrt(H)), bias ~ N(0, 0.1); weights ~ N(0, 1/sqrt(K)) before
  // quantisation (checked on the dequantised gate through its RMS, within the 4-bit grid's error).
  MoeLayerSpec s;
  s.name = "stats";
  s.hidden = 1024;
  s.inter = 64;
  s.routing.method = RoutingMethod::NoauxTc;
  s.routing.num_experts = 64;
  s.routing.top_k = 4;
  s.routing.n_group = 8;
  s.routing.topk_group = 4;
  s.routing.routed_scaling_factor = 2.5;
  QuantScheme q;
  q.group_size = 64;
  const MoeLayerWeights w = random_layer(s, q, 42);
  auto stats = [](const std::vector<float>& v, double& mean, double& sd) {
    double a = 0, b = 0;
    for (float x : v) a += x;
    mean = a / double(v.size());
    for (float x : v) b += (x - mean) * (x - mean);
    sd = std::sqrt(b / double(v.size()));
  };
  double mean, sd;
  stats(w.router, mean, sd);  // 65536 samples: sd of the mean ~ 1.2e-4
  EXPECT_NEAR(mean, 0.0, 1e-3);
  EXPECT_NEAR(sd, 1.0 / 32, 1.0 / 32 * 0.02);
  // Within 3.3 sd of a normal: about 99.9 %; a uniform of the same sd has none beyond 1.74 sd.
  int64_t beyond2 = 0;
  for (float x : w.router) beyond2 += std::abs(x) > 2.0 / 32;
  EXPECT_NEAR(double(beyond2) / double(w.router.size()), 0.0455, 0.005);
  // The far tail too (P(|x| > 3 sd) = 0.0027, ~177 of 65536, sd ~13), and nothing absurd.
  int64_t beyond3 = 0;
  for (float x : w.router) beyond3 += std::abs(x) > 3.0 / 32;
  EXPECT_NEAR(double(beyond3) / double(w.router.size()), 0.0027, 0.0008);
  for (float x : w.router) ASSERT_LT(std::abs(x), 7.0 / 32);
  stats(w.correction_bias, mean, sd);  // 64 samples
  EXPECT_GT(sd, 0.06);
  EXPECT_LT(sd, 0.14);
  const std::vector<double> d = dequantize(w.experts[5].gate);
  double ss = 0;
  for (double x : d) ss += x * x;
  EXPECT_NEAR(std::sqrt(ss / double(d.size())), 1.0 / 32, 1.0 / 32 * 0.1);
}
