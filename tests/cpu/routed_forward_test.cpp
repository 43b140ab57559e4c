// forward_routed_host: the CPU layer with routing decided by the caller (ids and weights), against
// moe_reference_routed in float64, for the formats, both activation dtypes, a top_k other than the
// spec's, repeated ids, and every refusal (ids out of range, bad top_k, non-finite weights).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>

#include "cpu/cpu_layer.h"
#include "cpu/isa.h"
#include "cpu_test_util.h"
#include "test_util.h"
#include "wna16/error.h"

namespace wna16 {
namespace {

using cpu_test::random_activations;
using cpu_test::to_float;

MoeLayerSpec spec_with(SharedExpertKind shared) {
  MoeLayerSpec s;
  s.name = "routed";
  s.hidden = 128;
  s.inter = 64;
  s.routing.num_experts = 6;
  s.routing.top_k = 2;
  s.shared_kind = shared;
  s.shared_inter = shared == SharedExpertKind::None ? 0 : 96;
  return s;
}

Routing random_routing(int64_t M, int k, int E, uint64_t seed, bool allow_repeats) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> id(0, E - 1);
  std::uniform_real_distribution<float> wt(-0.5f, 1.5f);
  Routing r;
  r.M = M;
  r.top_k = k;
  for (int64_t m = 0; m < M; ++m)
    for (int j = 0; j < k; ++j) {
      int e = id(rng);
      if (!allow_repeats)
        while (true) {
          bool seen = false;
          for (int i = 0; i < j; ++i) seen = seen || r.ids[size_t(m * k + i)] == e;
          if (!seen) break;
          e = id(rng);
        }
      r.ids.push_back(e);
      r.weights.push_back(wt(rng));
    }
  return r;
}

double routed_error(const MoeLayerSpec& spec, const QuantScheme& q, DType act, int64_t M, int k, bool repeats,
                    uint64_t seed) {
  const MoeLayerWeights w = random_layer(spec, q, seed);
  auto layer = make_cpu_layer(spec, w);
  const auto x = random_activations(M * spec.hidden, act, seed + 1);
  const Routing r = random_routing(M, k, spec.routing.num_experts, seed + 2, repeats);
  std::vector<uint16_t> out(size_t(M * spec.hidden), 0xFFFF);
  layer->forward_routed_host(x.bits.data(), r.ids.data(), r.weights.data(), k, out.data(), M, act);
  const std::vector<double> ref = moe_reference_routed(spec, w, x.values.data(), M, r);
  const std::vector<float> got = to_float(out, act);
  return rel_error(got.data(), ref.data(), M * spec.hidden);
}

TEST(RoutedForward, MatchesReferenceAcrossFormatsAndDtypes) {
  std::vector<QuantScheme> schemes;
  for (Format f : {Format::GptqV1, Format::GptqV2})
    for (int bits : {4, 8})
      for (bool sym : {true, false})
        for (bool ao : {false, true}) schemes.push_back({f, bits, 32, sym, ao});
  schemes.push_back({Format::Awq, 4, 32, false, false});
  uint64_t seed = 100;
  for (const QuantScheme& q : schemes)
    for (DType act : {DType::BF16, DType::F16})
      for (int64_t M : {1, 7, 64}) {
        SCOPED_TRACE(q.describe() + " " + dtype_name(act) + " M=" + std::to_string(M));
        const double err = routed_error(spec_with(SharedExpertKind::SigmoidGated), q, act, M, 2, false, ++seed);
        EXPECT_LE(err, layer_tolerance(act)) << "rel error " << err;
      }
}

TEST(RoutedForward, OtherTopKRepeatedIdsAndSharedKinds) {
  const QuantScheme q{Format::GptqV1, 4, 32, false, false};
  uint64_t seed = 500;
  for (SharedExpertKind sk : {SharedExpertKind::None, SharedExpertKind::Plain, SharedExpertKind::SigmoidGated})
    for (int k : {1, 3, 6}) {
      SCOPED_TRACE("k=" + std::to_string(k) + " shared " + std::to_string(int(sk)));
      const double err = routed_error(spec_with(sk), q, DType::BF16, 9, k, true, ++seed);
      EXPECT_LE(err, layer_tolerance(DType::BF16)) << "rel error " << err;
    }
}

// With the layer's own routing passed in, the routed path gives forward_host's bytes exactly.
TEST(RoutedForward, OwnRoutingGivesForwardHostBitForBit) {
  const MoeLayerSpec spec = spec_with(SharedExpertKind::SigmoidGated);
  const MoeLayerWeights w = random_layer(spec, QuantScheme{Format::GptqV2, 4, 32, true, true}, 7);
  auto layer = make_cpu_layer(spec, w);
  const int64_t M = 13;
  const auto x = random_activations(M * spec.hidden, DType::BF16, 8);
  Routing r;
  moe_reference(spec, w, x.values.data(), M, &r);
  std::vector<uint16_t> a(size_t(M * spec.hidden)), b(a.size(), 0xFFFF);
  layer->forward_host(x.bits.data(), a.data(), M, DType::BF16);
  layer->forward_routed_host(x.bits.data(), r.ids.data(), r.weights.data(), r.top_k, b.data(), M, DType::BF16);
  EXPECT_EQ(a, b);
}

TEST(RoutedForward, RefusesBadRoutingNamingTheValue) {
  const MoeLayerSpec spec = spec_with(SharedExpertKind::None);
  const MoeLayerWeights w = random_layer(spec, QuantScheme{Format::GptqV1, 4, 32, true, false}, 3);
  auto layer = make_cpu_layer(spec, w);
  std::vector<uint16_t> x(size_t(2 * spec.hidden), 0), out(x.size());
  auto message = [&](std::vector<int32_t> ids, std::vector<float> wts, int k) {
    return test::error_of(
        [&] { layer->forward_routed_host(x.data(), ids.data(), wts.data(), k, out.data(), 2, DType::BF16); });
  };
  EXPECT_NE(message({0, 1, 2, 6}, {1, 1, 1, 1}, 2).find("topk_ids[1, 1]=6 is outside [0, 6)"), std::string::npos);
  EXPECT_NE(message({0, -1, 2, 3}, {1, 1, 1, 1}, 2).find("topk_ids[0, 1]=-1"), std::string::npos);
  EXPECT_NE(message({0, 1, 2, 3}, {1, 1, 1, 1}, 0).find("top_k=0"), std::string::npos);
  EXPECT_NE(message(std::vector<int32_t>(14, 0), std::vector<float>(14, 1), 7).find("top_k=7"), std::string::npos);
  EXPECT_NE(message({0, 1, 2, 3}, {1, std::numeric_limits<float>::quiet_NaN(), 1, 1}, 2).find("topk_weights[0, 1]"),
            std::string::npos);
}

}  // namespace
}  // namespace wna16
