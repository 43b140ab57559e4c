// `wna16 bench --routing` (bench/routing_skew.h): the option parser, the Zipf law, the realized
// routing of calibrated presets against that law, the floor of a hand-routed tiny case, uniform
// leaving the inputs untouched, and the CPU bench end to end. Host only.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "bench/routing_skew.h"
#include "cli_runner.h"
#include "common/splitmix64.h"
#include "wna16/error.h"

namespace {

using namespace wna16;
using namespace wna16::bench;

bool has(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

std::string refusal(const std::string& arg) {
  try {
    parse_routing(arg);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(BenchRouting, ParserAcceptsUniformAndZipf) {
  EXPECT_TRUE(parse_routing("uniform").uniform());
  EXPECT_EQ(parse_routing("uniform").name(), "uniform");
  EXPECT_DOUBLE_EQ(parse_routing("zipf:1.2").zipf_s, 1.2);
  EXPECT_EQ(parse_routing("zipf:1.2").name(), "zipf:1.2");
  EXPECT_DOUBLE_EQ(parse_routing("zipf:0.5").zipf_s, 0.5);
  EXPECT_DOUBLE_EQ(parse_routing("zipf:10").zipf_s, 10.0);
  EXPECT_DOUBLE_EQ(parse_routing("zipf:2e-1").zipf_s, 0.2);
}

TEST(BenchRouting, ParserRefusesNamingTheValue) {
  for (const std::string bad : {"", "Uniform", "zipf", "zipf:", "zipf:0", "zipf:-1", "zipf:abc", "zipf:1.2x",
                                "zipf:nan", "zipf:inf", "zipf:10.5", "zipf 1.2", "normal:1"}) {
    const std::string msg = refusal(bad);
    ASSERT_FALSE(msg.empty()) << "accepted '" << bad << "'";
    EXPECT_TRUE(has(msg, "'" + bad + "'")) << msg;
  }
  EXPECT_TRUE(has(refusal("zipf:0"), "(0, 10]"));
  EXPECT_TRUE(has(refusal("zipf:abc"), "not a number"));
  EXPECT_TRUE(has(refusal("normal:1"), "uniform or zipf:S"));
}

TEST(BenchRouting, ZipfLawByHandAndCapped) {
  // E=4, k=1, S=1: 1, 1/2, 1/3, 1/4 over their sum 25/12.
  const std::vector<double> a = zipf_inclusion(4, 1, 1.0);
  EXPECT_NEAR(a[0], 12.0 / 25, 1e-12);
  EXPECT_NEAR(a[1], 6.0 / 25, 1e-12);
  EXPECT_NEAR(a[2], 4.0 / 25, 1e-12);
  EXPECT_NEAR(a[3], 3.0 / 25, 1e-12);
  // DeepSeek-V3's shape at S=1.2: the k picks sum to k, the head is capped at 1 (a token picks an
  // expert once), below the cap the law's ratios hold.
  const std::vector<double> b = zipf_inclusion(256, 8, 1.2);
  EXPECT_NEAR(std::accumulate(b.begin(), b.end(), 0.0), 8.0, 1e-9);
  EXPECT_DOUBLE_EQ(b[0], 1.0);
  EXPECT_DOUBLE_EQ(b[1], 1.0);
  EXPECT_LT(b[2], 1.0);
  EXPECT_NEAR(b[10] / b[20], std::pow(21.0 / 11.0, 1.2), 1e-9);
  const std::vector<double> all = zipf_inclusion(8, 8, 1.2);
  for (double p : all) EXPECT_DOUBLE_EQ(p, 1.0);
  EXPECT_THROW(zipf_inclusion(4, 5, 1.0), Error);
}

// A router as both benches generate it: N(0, 1/H), bf16-exact; noaux_tc's bias N(0, 0.02).
MoeLayerWeights bench_router(const MoeLayerSpec& spec, uint64_t seed) {
  SplitMix64 g(seed);
  auto normal = [&] {
    const double u1 = std::max(g.uniform(), 1e-300), u2 = g.uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  };
  MoeLayerWeights w;
  w.router.resize(size_t(spec.routing.num_experts * spec.hidden));
  for (auto& v : w.router) v = round_to(DType::BF16, float(normal() / std::sqrt(double(spec.hidden))));
  if (spec.routing.method == RoutingMethod::NoauxTc) {
    w.correction_bias.resize(size_t(spec.routing.num_experts));
    for (auto& v : w.correction_bias) v = float(normal() * 0.02);
  }
  return w;
}

std::vector<float> tokens(int64_t rows, int64_t H, uint64_t seed) {
  SplitMix64 g(seed);
  std::vector<float> x(size_t(rows * H));
  for (auto& v : x) {
    const double u1 = std::max(g.uniform(), 1e-300), u2 = g.uniform();
    v = round_to(DType::BF16, float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2)));
  }
  return x;
}

// Fresh tokens (not the calibration's) through the calibrated router: each expert's pick rate
// against the law, by popularity rank.
class RealizedZipf : public ::testing::TestWithParam<const char*> {};

TEST_P(RealizedZipf, FollowsTheLawOnFreshTokens) {
  const MoeLayerSpec spec = preset(GetParam());
  const int E = spec.routing.num_experts, k = spec.routing.top_k;
  MoeLayerWeights w = bench_router(spec, 11);
  const RoutingSkew s = apply_routing(spec, parse_routing("zipf:1.2"), w, 5);
  EXPECT_EQ(s.x_component, spec.routing.method != RoutingMethod::NoauxTc);
  constexpr int64_t N = 4096;
  std::vector<float> x = tokens(N, spec.hidden, 99);
  skew_activations(s, x.data(), N, spec.hidden);
  const std::vector<int32_t> ids = route_rows(spec, w, x.data(), N);
  const std::vector<int> c = expert_counts(ids.data(), N, k, E);

  std::vector<double> seen(static_cast<size_t>(E)), law(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) {
    seen[size_t(s.rank[size_t(e)])] = double(c[size_t(e)]) / N;
    law[size_t(s.rank[size_t(e)])] = s.target[size_t(e)];
  }
  EXPECT_EQ(law, zipf_inclusion(E, k, 1.2));
  // The most popular expert's share of the slots, and the head of the law, within 15% (or 0.02).
  EXPECT_NEAR(seen[0] / k, law[0] / k, 0.15 * law[0] / k) << GetParam();
  for (int r = 0; r < std::min(E, 10); ++r)
    EXPECT_NEAR(seen[size_t(r)], law[size_t(r)], std::max(0.02, 0.15 * law[size_t(r)])) << "rank " << r;
  // Skewed as asked: the head takes many times its uniform share, and the whole distribution of
  // slots is close to the law's (total variation).
  EXPECT_GT(seen[0], 3.0 * k / E);
  double tv = 0;
  for (int r = 0; r < E; ++r) tv += std::fabs(seen[size_t(r)] - law[size_t(r)]) / (2.0 * k);
  EXPECT_LT(tv, 0.05) << GetParam();
}

INSTANTIATE_TEST_SUITE_P(Presets, RealizedZipf,
                         ::testing::Values("small", "qwen3-30b-a3b", "deepseek-v2-lite", "deepseek-v3"),
                         [](const auto& p) {
                           std::string n = p.param;
                           std::replace_if(n.begin(), n.end(), [](char ch) { return !std::isalnum(ch); }, '_');
                           return n;
                         });

TEST(BenchRouting, WritesTheOffsetWhereTheMethodReadsIt) {
  const MoeLayerSpec qwen = preset("qwen3-30b-a3b");
  MoeLayerWeights a = bench_router(qwen, 3);
  const MoeLayerWeights a0 = a;
  apply_routing(qwen, parse_routing("zipf:1.2"), a, 1);
  for (int64_t e = 0; e < qwen.routing.num_experts; ++e) {
    const float v = a.router[size_t(e * qwen.hidden)];
    EXPECT_EQ(v, round_to(DType::BF16, v)) << "column 0 of router row " << e << " is not bf16-exact";
    for (int64_t h = 1; h < qwen.hidden; ++h)
      ASSERT_EQ(a.router[size_t(e * qwen.hidden + h)], a0.router[size_t(e * qwen.hidden + h)]);
  }
  const MoeLayerSpec v3 = preset("deepseek-v3");
  MoeLayerWeights b = bench_router(v3, 3);
  const MoeLayerWeights b0 = b;
  apply_routing(v3, parse_routing("zipf:1.2"), b, 1);
  EXPECT_EQ(b.router, b0.router);  // noaux_tc: the bias carries the offset, activations unchanged
  EXPECT_NE(b.correction_bias, b0.correction_bias);

  // x[:, 0] = 1 in each encoding.
  RoutingSkew s;
  s.x_component = true;
  std::vector<uint16_t> bits = {7, 7, 7, 7};
  skew_activations(s, bits.data(), 2, 2, DType::BF16);
  EXPECT_EQ(bits, (std::vector<uint16_t>{0x3F80, 7, 0x3F80, 7}));
  skew_activations(s, bits.data(), 2, 2, DType::F16);
  EXPECT_EQ(bits, (std::vector<uint16_t>{0x3C00, 7, 0x3C00, 7}));
}

TEST(BenchRouting, UniformLeavesWeightsAndActivationsUntouched) {
  const MoeLayerSpec spec = preset("deepseek-v2-lite");
  MoeLayerWeights w = bench_router(spec, 8);
  const MoeLayerWeights w0 = w;
  const RoutingSkew s = apply_routing(spec, parse_routing("uniform"), w, 1);
  EXPECT_FALSE(s.x_component);
  EXPECT_TRUE(s.rank.empty());
  EXPECT_EQ(w.router, w0.router);
  EXPECT_EQ(w.correction_bias, w0.correction_bias);
  std::vector<float> x = tokens(3, spec.hidden, 2);
  const std::vector<float> x0 = x;
  skew_activations(s, x.data(), 3, spec.hidden);
  EXPECT_EQ(x, x0);
  std::vector<uint16_t> bits(size_t(3 * spec.hidden), 0x1234);
  skew_activations(s, bits.data(), 3, spec.hidden, DType::BF16);
  EXPECT_EQ(bits, std::vector<uint16_t>(size_t(3 * spec.hidden), 0x1234));
}

TEST(BenchRouting, FloorOfARealizedRoutingByHand) {
  // E=4, k=2, H=2, softmax top-k; router rows +x, +y, -x, -y.
  MoeLayerSpec spec;
  spec.hidden = 2;
  spec.inter = 3;
  spec.routing.num_experts = 4;
  spec.routing.top_k = 2;
  MoeLayerWeights w;
  w.router = {1, 0, 0, 1, -1, 0, 0, -1};
  // Logits (2, 1, -2, -1) -> {0, 1}; (1, 3, -1, -3) -> {1, 0}; (-2, .5, 2, -.5) -> {2, 1}.
  const std::vector<float> x = {2, 1, 1, 3, -2, 0.5f};
  const std::vector<int32_t> ids = route_rows(spec, w, x.data(), 3);
  EXPECT_EQ(ids, (std::vector<int32_t>{0, 1, 1, 0, 2, 1}));
  const std::vector<int> c = expert_counts(ids.data(), 3, 2, 4);
  EXPECT_EQ(c, (std::vector<int>{2, 3, 1, 0}));
  // Expert 100 bytes, fixed 50, H=2, I=3, I_shared=5, 2-byte activations.
  const CallCost cc = call_cost(c, 3, CostModel{100, 50, 2, 3, 5, 2});
  EXPECT_EQ(cc.active, 3);
  EXPECT_EQ(cc.max_tokens, 3);
  EXPECT_DOUBLE_EQ(cc.mean_tokens, 2.0);
  // 3 experts x 100 + 50 + x and out (2 x 3 tokens x 2 x 2 bytes) = 374.
  EXPECT_DOUBLE_EQ(cc.bytes, 374.0);
  // 2 x 6 slots x 3 x I3 x H2 + 2 x 3 tokens x 3 x Is5 x H2 = 216 + 180.
  EXPECT_DOUBLE_EQ(cc.flops, 396.0);
  const int32_t bad[] = {0, 4};
  EXPECT_THROW(expert_counts(bad, 1, 2, 4), Error);
}

TEST(BenchRoutingCli, CpuBenchZipfRunsAndReportsItsRouting) {
  const std::string json = ::testing::TempDir() + "/wna16_zipf_bench_" + std::to_string(getpid()) + ".json";
  const test::CliRun r = test::run_cli_combined(
      "bench --device cpu --model small --m 64 --min-seconds 0.01 --routing zipf:1.2 --json " + json);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "routing zipf:1.2")) << r.out;
  EXPECT_TRUE(has(r.out, "max/e")) << r.out;
  EXPECT_TRUE(has(r.out, "PASSED")) << r.out;
  const std::string j = test::slurp_file(json);
  EXPECT_TRUE(has(j, "\"routing\": \"zipf:1.2\"")) << j;
  EXPECT_TRUE(has(j, "\"tokens_per_expert_max\"")) << j;
  std::remove(json.c_str());
}

TEST(BenchRoutingCli, BadRoutingFailsNamingIt) {
  const test::CliRun r = test::run_cli_combined("bench --device cpu --model small --m 1 --routing zipf:-2");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "zipf:-2")) << r.out;
}

}  // namespace
