// Routing on hand-worked examples. Logits are written as log(v) so that softmax gives v / sum(v),
// and as logit(s) = log(s / (1 - s)) so that sigmoid gives s: expected weights are small fractions.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "test_util.h"
#include "wna16/error.h"
#include "wna16/reference.h"

using namespace wna16;

namespace {

std::vector<float> logs(const std::vector<double>& v) {
  std::vector<float> out;
  for (double x : v) out.push_back(float(std::log(x)));
  return out;
}

float logit(double s) { return float(std::log(s / (1.0 - s))); }

using test::routing;

void expect_route(const Routing& r, int64_t m, const std::vector<int>& ids, const std::vector<double>& w) {
  ASSERT_EQ(int(ids.size()), r.top_k);
  for (int j = 0; j < r.top_k; ++j) {
    EXPECT_EQ(r.ids[size_t(m * r.top_k + j)], ids[size_t(j)]) << "token " << m << " choice " << j;
    EXPECT_NEAR(r.weights[size_t(m * r.top_k + j)], w[size_t(j)], 2e-6) << "token " << m << " choice " << j;
  }
}

using test::error_of;

}  // namespace

TEST(Routing, SoftmaxTopKWithAndWithoutRenormalisation) {
  // exp(logits) = 1, 2, 3, 4 (sum 10): p = .1 .2 .3 .4; top-2 = e3 (.4), e2 (.3).
  const auto l = logs({1, 2, 3, 4});
  Routing plain = route_reference(routing(RoutingMethod::SoftmaxTopK, 4, 2, false), l.data(), 1, nullptr);
  expect_route(plain, 0, {3, 2}, {0.4, 0.3});
  // Renormalised over the chosen mass .7: 4/7, 3/7.
  Routing renorm = route_reference(routing(RoutingMethod::SoftmaxTopK, 4, 2, true), l.data(), 1, nullptr);
  expect_route(renorm, 0, {3, 2}, {4.0 / 7, 3.0 / 7});
}

TEST(Routing, SoftmaxTopKSeveralTokensAreIndependent) {
  // Token 0: exp = 1 8 1 (p = .1 .8 .1); token 1: exp = 5 1 4 (p = .5 .1 .4). top-1, no renorm.
  std::vector<float> l = logs({1, 8, 1, 5, 1, 4});
  Routing r = route_reference(routing(RoutingMethod::SoftmaxTopK, 3, 1, false), l.data(), 2, nullptr);
  expect_route(r, 0, {1}, {0.8});
  expect_route(r, 1, {0}, {0.5});
  // top-1 renormalised is always weight 1.
  Routing rn = route_reference(routing(RoutingMethod::SoftmaxTopK, 3, 1, true), l.data(), 2, nullptr);
  expect_route(rn, 1, {0}, {1.0});
}

TEST(Routing, TiesGoToTheLowerExpertIndex) {
  // All equal: p = .25 each; top-2 = e0, e1 (renormalised .5 .5).
  std::vector<float> flat(4, 0.5f);
  expect_route(route_reference(routing(RoutingMethod::SoftmaxTopK, 4, 2, true), flat.data(), 1, nullptr), 0, {0, 1},
               {0.5, 0.5});
  // exp = 1 3 3 2 (sum 9): e1 and e2 tie for first; e1 comes first, then e2.
  auto l = logs({1, 3, 3, 2});
  expect_route(route_reference(routing(RoutingMethod::SoftmaxTopK, 4, 2, false), l.data(), 1, nullptr), 0, {1, 2},
               {3.0 / 9, 3.0 / 9});
  // Same for noaux_tc when the biased scores tie: s = .5 .5 .5 .5, bias 0 .1 0 .1 -> e1, e3.
  std::vector<float> z(4, 0.0f), b = {0.f, 0.1f, 0.f, 0.1f};
  expect_route(route_reference(routing(RoutingMethod::NoauxTc, 4, 2, true, 2, 2), z.data(), 1, b.data()), 0, {1, 3},
               {0.5, 0.5});
}

TEST(Routing, GroupLimitedGreedyDropsAGroupHoldingTheThirdBestExpert) {
  // exp = g0{10, 1} g1{6, 5} g2{7, 2} g3{1, 1}, sum 33. Group score = max: 10, 6, 7, 1 -> keep g0, g2.
  // Candidates e0 10, e1 1, e4 7, e5 2 -> top-3 = e0, e4, e5 = 10/33, 7/33, 2/33 (no renorm, scale 1).
  // Plain top-3 would take e2 (6/33) instead of e5: it sits in the dropped group g1.
  const auto l = logs({10, 1, 6, 5, 7, 2, 1, 1});
  Routing r = route_reference(routing(RoutingMethod::GroupLimitedGreedy, 8, 3, false, 4, 2), l.data(), 1, nullptr);
  expect_route(r, 0, {0, 4, 5}, {10.0 / 33, 7.0 / 33, 2.0 / 33});
  // n_group 1 ("greedy", DeepSeek-V2-Lite): plain top-3.
  Routing g = route_reference(routing(RoutingMethod::GroupLimitedGreedy, 8, 3, false, 1, 1), l.data(), 1, nullptr);
  expect_route(g, 0, {0, 4, 2}, {10.0 / 33, 7.0 / 33, 6.0 / 33});
  // Renormalised: 10/19, 7/19, 2/19.
  Routing rn = route_reference(routing(RoutingMethod::GroupLimitedGreedy, 8, 3, true, 4, 2), l.data(), 1, nullptr);
  expect_route(rn, 0, {0, 4, 5}, {10.0 / 19, 7.0 / 19, 2.0 / 19});
}

TEST(Routing, GroupLimitedGreedyScalesOnlyWithoutRenormalisation) {
  const auto l = logs({10, 1, 6, 5, 7, 2, 1, 1});
  // No renorm: scaled by 2: 20/33, 14/33, 4/33.
  Routing s = route_reference(routing(RoutingMethod::GroupLimitedGreedy, 8, 3, false, 4, 2, 2.0), l.data(), 1, nullptr);
  expect_route(s, 0, {0, 4, 5}, {20.0 / 33, 14.0 / 33, 4.0 / 33});
  // Renorm: the factor is not applied (DeepSeek-V2 semantics).
  Routing n = route_reference(routing(RoutingMethod::GroupLimitedGreedy, 8, 3, true, 4, 2, 2.0), l.data(), 1, nullptr);
  expect_route(n, 0, {0, 4, 5}, {10.0 / 19, 7.0 / 19, 2.0 / 19});
}

TEST(Routing, GroupLimitedGreedyGroupTiesKeepTheLowerGroup) {
  // exp = g0{1, 4} g1{4, 1} g2{4, 2}, sum 16; every group max is 4: keep g0 only (topk_group 1).
  // top-2 inside g0: e1 (4/16), e0 (1/16), although e4 (2/16) is larger than e0.
  const auto l = logs({1, 4, 4, 1, 4, 2});
  Routing r = route_reference(routing(RoutingMethod::GroupLimitedGreedy, 6, 2, false, 3, 1), l.data(), 1, nullptr);
  expect_route(r, 0, {1, 0}, {4.0 / 16, 1.0 / 16});
}

TEST(Routing, NoauxTcBiasChangesTheChoiceButNotTheWeight) {
  // s = sigmoid(logit) = .75 .5 .25 .8; bias 0 0 .6 0 -> s + bias = .75 .5 .85 .8.
  // Choice on s + bias: e2 (.85), e3 (.8). Weights use the unbiased s: .25 and .8, renormalised over
  // 1.05 and scaled by 2.5: .25/1.05*2.5 = 0.5952381, .8/1.05*2.5 = 1.9047619.
  std::vector<float> l = {logit(.75), logit(.5), logit(.25), logit(.8)};
  std::vector<float> bias = {0.f, 0.f, 0.6f, 0.f};
  Routing r = route_reference(routing(RoutingMethod::NoauxTc, 4, 2, true, 1, 1, 2.5), l.data(), 1, bias.data());
  expect_route(r, 0, {2, 3}, {.25 / 1.05 * 2.5, .8 / 1.05 * 2.5});
  // Without the bias: e3 (.8), e0 (.75): .8/1.55*2.5, .75/1.55*2.5.
  std::vector<float> zero(4, 0.f);
  Routing u = route_reference(routing(RoutingMethod::NoauxTc, 4, 2, true, 1, 1, 2.5), l.data(), 1, zero.data());
  expect_route(u, 0, {3, 0}, {.8 / 1.55 * 2.5, .75 / 1.55 * 2.5});
}

TEST(Routing, NoauxTcScalesEvenWithoutRenormalisation) {
  // Same scores as above, no renorm: weights = s * 2.5 = .625, 2.0.
  std::vector<float> l = {logit(.75), logit(.5), logit(.25), logit(.8)};
  std::vector<float> bias = {0.f, 0.f, 0.6f, 0.f};
  Routing r = route_reference(routing(RoutingMethod::NoauxTc, 4, 2, false, 1, 1, 2.5), l.data(), 1, bias.data());
  expect_route(r, 0, {2, 3}, {.25 * 2.5, .8 * 2.5});
}

TEST(Routing, NoauxTcGroupScoreIsTheSumOfTheTopTwo) {
  // s + bias (bias 0): g0{.95, .05} = 1.0, g1{.6, .6} = 1.2, g2{.55, .55} = 1.1, g3{.1, .1} = .2.
  // Keep g1, g2 (topk_group 2): the best expert overall, e0 (.95), is in the dropped group g0.
  // top-2 inside: e2, e3 (tie at .6, lower index first); renormalised .5 .5, scale 1.
  std::vector<float> l = {logit(.95), logit(.05), logit(.6), logit(.6), logit(.55), logit(.55), logit(.1), logit(.1)};
  std::vector<float> bias(8, 0.f);
  Routing r = route_reference(routing(RoutingMethod::NoauxTc, 8, 2, true, 4, 2, 1.0), l.data(), 1, bias.data());
  expect_route(r, 0, {2, 3}, {.5, .5});
  // A group-max rule (V2) would have kept g0: with topk_group 2 and max scores .95 .6 .55 .1 it
  // keeps g0, g1 and picks e0 (.95), e2 (.6).
  // Sigmoid scores through the softmax-based V2 router differ, so check the selection only.
  Routing v2 = route_reference(routing(RoutingMethod::GroupLimitedGreedy, 8, 2, true, 4, 2), l.data(), 1, nullptr);
  EXPECT_EQ(v2.ids[0], 0);
  EXPECT_EQ(v2.ids[1], 2);
}

TEST(Routing, RouterLogitsAreXTimesRouterTransposed) {
  // H = 2, E = 3: router rows [1, 2], [0, -1], [0.5, 0.5]; x = [[3, 4], [-1, 1]].
  MoeLayerSpec spec;
  spec.hidden = 2;
  spec.routing.num_experts = 3;
  MoeLayerWeights w;
  w.router = {1, 2, 0, -1, 0.5f, 0.5f};
  std::vector<float> x = {3, 4, -1, 1};
  std::vector<float> l = router_logits_reference(spec, w, x.data(), 2);
  std::vector<float> want = {11, -4, 3.5f, 1, -1, 0};
  EXPECT_EQ(l, want);
}

TEST(Routing, EmptyBatchGivesEmptyRouting) {
  Routing r = route_reference(routing(RoutingMethod::SoftmaxTopK, 4, 2, true), nullptr, 0, nullptr);
  EXPECT_EQ(r.M, 0);
  EXPECT_TRUE(r.ids.empty());
  EXPECT_TRUE(r.weights.empty());
}

TEST(Routing, BadConfigsNameTheValue) {
  EXPECT_NE(error_of([] { routing(RoutingMethod::SoftmaxTopK, 8, 9, true).validate(); }).find("top_k=9"),
            std::string::npos);
  EXPECT_NE(error_of([] { routing(RoutingMethod::SoftmaxTopK, 0, 1, true).validate(); }).find("num_experts=0"),
            std::string::npos);
  EXPECT_NE(error_of([] { routing(RoutingMethod::GroupLimitedGreedy, 8, 2, true, 3, 1).validate(); }).find("n_group=3"),
            std::string::npos);
  EXPECT_NE(error_of([] { routing(RoutingMethod::NoauxTc, 8, 2, true, 4, 5).validate(); }).find("topk_group=5"),
            std::string::npos);
  // 2 groups of 2 kept = 4 experts < top_k 5.
  EXPECT_NE(error_of([] { routing(RoutingMethod::GroupLimitedGreedy, 8, 5, true, 4, 2).validate(); }).find("top_k=5"),
            std::string::npos);
  EXPECT_NE(error_of([] { routing(RoutingMethod::NoauxTc, 8, 2, true, 8, 4).validate(); }).find("at least 2"),
            std::string::npos);
  EXPECT_NE(error_of([] { routing(RoutingMethod::SoftmaxTopK, 8, 2, true, 1, 1, 2.5).validate(); })
                .find("routed_scaling_factor=2.5"),
            std::string::npos);
  EXPECT_NE(error_of([] { routing(RoutingMethod::NoauxTc, 8, 2, true, 1, 1, -1).validate(); })
                .find("routed_scaling_factor=-1"),
            std::string::npos);
}

TEST(Routing, BadInputsAreRefused) {
  std::vector<float> l = {0.f, NAN, 0.f, 0.f};
  EXPECT_NE(error_of([&] { route_reference(routing(RoutingMethod::SoftmaxTopK, 4, 2, true), l.data(), 1, nullptr); })
                .find("[0, 1]"),
            std::string::npos);
  std::vector<float> ok(4, 0.f);
  EXPECT_NE(error_of([&] { route_reference(routing(RoutingMethod::NoauxTc, 4, 2, true, 2, 1), ok.data(), 1, nullptr); })
                .find("bias"),
            std::string::npos);
}
