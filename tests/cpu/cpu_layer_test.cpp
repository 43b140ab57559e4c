// The SIMD CPU backend against the float64 reference: every format, bit width, group size,
// symmetric/asymmetric, act-order, activation dtype, routing variant and shared-expert kind, on
// every ISA build this machine can run, with fresh random data and poisoned outputs.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <tuple>

#include "bench/cpu/scalar_baseline.h"
#include "cpu/cpu_layer.h"
#include "cpu/isa.h"
#include "cpu_test_util.h"
#include "wna16/error.h"

namespace wna16 {
namespace {

using cpu::Isa;
using cpu_test::error_vs_reference;
using cpu_test::random_activations;

MoeLayerSpec tiny_spec() {
  MoeLayerSpec s;
  s.name = "tiny";
  s.hidden = 256;
  s.inter = 128;
  s.routing.num_experts = 8;
  s.routing.top_k = 2;
  s.shared_kind = SharedExpertKind::SigmoidGated;
  s.shared_inter = 384;
  return s;
}

std::string case_name(const QuantScheme& q, DType act, Isa isa, int64_t M) {
  return q.describe() + " " + dtype_name(act) + " " + cpu::isa_name(isa) + " M=" + std::to_string(M);
}

void expect_matches(const MoeLayerSpec& spec, const QuantScheme& q, DType act, Isa isa, int64_t M, uint64_t seed) {
  SCOPED_TRACE(case_name(q, act, isa, M) + " spec " + spec.name);
  const MoeLayerWeights w = random_layer(spec, q, seed);
  auto layer = cpu::make_cpu_layer_isa(spec, w, isa);
  const auto x = random_activations(M * spec.hidden, act, seed * 7 + 3);
  const double err = error_vs_reference(*layer, spec, w, x, M, act);
  EXPECT_LE(err, layer_tolerance(act)) << "rel error " << err;
}

// ---- format matrix --------------------------------------------------------------------------
class FormatMatrix : public ::testing::TestWithParam<std::tuple<Format, int, int, bool, bool>> {};

TEST_P(FormatMatrix, MatchesReferenceOnEveryIsaAndDtype) {
  const auto [format, bits, group, sym, act_order] = GetParam();
  QuantScheme q;
  q.format = format;
  q.bits = bits;
  q.group_size = group;
  q.sym = sym;
  q.act_order = act_order;
  uint64_t seed = 11;
  for (Isa isa : cpu_test::isas_under_test())
    for (DType act : {DType::BF16, DType::F16}) expect_matches(tiny_spec(), q, act, isa, 17, ++seed);
}

std::vector<std::tuple<Format, int, int, bool, bool>> format_cases() {
  std::vector<std::tuple<Format, int, int, bool, bool>> v;
  for (Format f : {Format::GptqV1, Format::GptqV2})
    for (int bits : {4, 8})
      for (int g : {32, 64, 128, -1})
        for (bool sym : {true, false})
          for (bool ao : {false, true}) v.emplace_back(f, bits, g, sym, ao);
  for (int g : {32, 64, 128, -1}) v.emplace_back(Format::Awq, 4, g, false, false);
  return v;
}

std::string format_case_name(const ::testing::TestParamInfo<std::tuple<Format, int, int, bool, bool>>& info) {
  const auto& [format, bits, group, sym, ao] = info.param;
  return std::string(format_name(format)) + "_b" + std::to_string(bits) + "_g" +
         (group < 0 ? std::string("all") : std::to_string(group)) + (sym ? "_sym" : "_asym") + (ao ? "_actorder" : "");
}

INSTANTIATE_TEST_SUITE_P(Cpu, FormatMatrix, ::testing::ValuesIn(format_cases()), format_case_name);

// ---- routing variants x shared experts x M --------------------------------------------------
struct RoutingCase {
  const char* name;
  RoutingMethod method;
  bool renorm;
  int n_group, topk_group;
  double scale;
};

class RoutingMatrix : public ::testing::TestWithParam<std::tuple<int, SharedExpertKind>> {};

TEST_P(RoutingMatrix, MatchesReferenceForEveryM) {
  static const RoutingCase cases[] = {
      {"softmax_renorm", RoutingMethod::SoftmaxTopK, true, 1, 1, 1.0},
      {"softmax_no_renorm", RoutingMethod::SoftmaxTopK, false, 1, 1, 1.0},
      {"greedy_scaled", RoutingMethod::GroupLimitedGreedy, false, 1, 1, 1.5},
      {"group_limited_renorm", RoutingMethod::GroupLimitedGreedy, true, 4, 2, 1.0},
      {"group_limited_scaled", RoutingMethod::GroupLimitedGreedy, false, 4, 2, 2.5},
      {"noaux_tc", RoutingMethod::NoauxTc, true, 4, 2, 2.5},
      {"noaux_tc_no_renorm", RoutingMethod::NoauxTc, false, 2, 1, 2.5},
  };
  const auto [ci, shared] = GetParam();
  const RoutingCase& rc = cases[ci];
  MoeLayerSpec spec = tiny_spec();
  spec.name = rc.name;
  spec.routing.method = rc.method;
  spec.routing.num_experts = 16;
  spec.routing.top_k = 3;
  spec.routing.renormalize = rc.renorm;
  spec.routing.n_group = rc.n_group;
  spec.routing.topk_group = rc.topk_group;
  spec.routing.routed_scaling_factor = rc.scale;
  spec.shared_kind = shared;
  spec.shared_inter = shared == SharedExpertKind::None ? 0 : 384;
  QuantScheme q;  // gptq 4-bit g128 sym
  uint64_t seed = 100 + uint64_t(ci) * 10;
  for (Isa isa : cpu_test::isas_under_test())
    for (int64_t M : {1, 3, 17, 118})
      for (DType act : {DType::BF16, DType::F16}) expect_matches(spec, q, act, isa, M, ++seed);
}

INSTANTIATE_TEST_SUITE_P(Cpu, RoutingMatrix,
                         ::testing::Combine(::testing::Range(0, 7),
                                            ::testing::Values(SharedExpertKind::None, SharedExpertKind::Plain,
                                                              SharedExpertKind::SigmoidGated)));

// ---- awkward shapes -------------------------------------------------------------------------
TEST(CpuLayer, RealModelWidthsI1408H576) {
  MoeLayerSpec spec = tiny_spec();
  spec.name = "h576_i1408";
  spec.hidden = 576;
  spec.inter = 1408;
  spec.routing.num_experts = 4;
  spec.routing.top_k = 2;
  spec.shared_kind = SharedExpertKind::Plain;
  spec.shared_inter = 2816;
  for (bool ao : {false, true}) {
    QuantScheme q;
    q.group_size = 64;
    q.act_order = ao;
    q.sym = !ao;
    for (Isa isa : cpu_test::isas_under_test()) expect_matches(spec, q, DType::BF16, isa, 3, ao ? 5 : 6);
  }
}

TEST(CpuLayer, WidthsNotMultipleOf64) {
  // N = 96 and 40 leave partial 64-column blocks; K = 40 with g=-1 is one group.
  MoeLayerSpec spec = tiny_spec();
  spec.name = "h96_i40";
  spec.hidden = 96;
  spec.inter = 40;
  spec.shared_inter = 24;
  for (Format f : {Format::GptqV2, Format::Awq}) {
    QuantScheme q;
    q.format = f;
    q.group_size = -1;
    q.sym = false;
    for (Isa isa : cpu_test::isas_under_test())
      for (DType act : {DType::BF16, DType::F16}) expect_matches(spec, q, act, isa, 17, 9);
  }
}

TEST(CpuLayer, AllTokensOnOneExpertAndZeroTokenExperts) {
  MoeLayerSpec spec = tiny_spec();
  spec.routing.top_k = 1;
  QuantScheme q;
  q.sym = false;
  MoeLayerWeights w = random_layer(spec, q, 77);
  // Router: only expert 5 has weights; with positive activations it wins every token, and the
  // other 7 experts get none.
  std::fill(w.router.begin(), w.router.end(), 0.f);
  for (int64_t h = 0; h < spec.hidden; ++h) w.router[size_t(5 * spec.hidden + h)] = 0.05f;
  for (Isa isa : cpu_test::isas_under_test()) {
    auto layer = cpu::make_cpu_layer_isa(spec, w, isa);
    for (int64_t M : {1, 118}) {
      auto x = random_activations(M * spec.hidden, DType::BF16, 5 + uint64_t(M));
      for (size_t i = 0; i < x.bits.size(); ++i) {
        x.bits[i] &= 0x7FFF;  // |x|
        x.values[i] = std::fabs(x.values[i]);
      }
      Routing r;
      moe_reference(spec, w, x.values.data(), M, &r);
      for (int32_t id : r.ids) ASSERT_EQ(id, 5);
      const double err = error_vs_reference(*layer, spec, w, x, M, DType::BF16);
      EXPECT_LE(err, layer_tolerance(DType::BF16)) << cpu::isa_name(isa) << " M=" << M;
    }
  }
}

TEST(CpuLayer, RepeatedCallsAndZeroTokens) {
  const MoeLayerSpec spec = tiny_spec();
  const MoeLayerWeights w = random_layer(spec, QuantScheme{}, 3);
  auto layer = make_cpu_layer(spec, w);
  EXPECT_EQ(layer->device(), Device::Cpu);
  layer->forward_host(nullptr, nullptr, 0, DType::BF16);  // M = 0 is a no-op
  for (int rep = 0; rep < 3; ++rep) {
    const auto x = random_activations(5 * spec.hidden, DType::BF16, 40 + uint64_t(rep));
    EXPECT_LE(error_vs_reference(*layer, spec, w, x, 5, DType::BF16), layer_tolerance(DType::BF16));
  }
}

TEST(CpuLayer, Float32InputIsRoundedToBf16) {
  const MoeLayerSpec spec = tiny_spec();
  const MoeLayerWeights w = random_layer(spec, QuantScheme{}, 4);
  auto layer = make_cpu_layer(spec, w);
  const int64_t M = 3;
  const auto x = random_activations(M * spec.hidden, DType::BF16, 8);
  std::vector<float> xf(x.values.size());
  for (size_t i = 0; i < xf.size(); ++i) xf[i] = x.values[i] * (1.f + 1e-3f);  // not bf16-exact
  std::vector<float> out(xf.size(), NAN);
  layer->forward_host(xf.data(), out.data(), M, DType::F32);
  std::vector<float> xr(xf.size());
  for (size_t i = 0; i < xf.size(); ++i) xr[i] = round_to(DType::BF16, xf[i]);
  const std::vector<double> ref = moe_reference(spec, w, xr.data(), M);
  EXPECT_LE(rel_error(out.data(), ref.data(), M * spec.hidden), layer_tolerance(DType::BF16));
}

// ---- bad inputs -----------------------------------------------------------------------------
TEST(CpuLayer, RefusesUnsupportedBitsNamingThem) {
  MoeLayerSpec spec = tiny_spec();
  QuantScheme q;
  q.bits = 3;
  q.group_size = 32;
  const MoeLayerWeights w = random_layer(spec, q, 1);
  try {
    make_cpu_layer(spec, w);
    FAIL() << "3-bit weights were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bits=3"), std::string::npos) << e.what();
  }
}

TEST(CpuLayer, RefusesNegativeM) {
  const MoeLayerSpec spec = tiny_spec();
  auto layer = make_cpu_layer(spec, random_layer(spec, QuantScheme{}, 2));
  uint16_t dummy = 0;
  EXPECT_THROW(layer->forward_host(&dummy, &dummy, -1, DType::BF16), Error);
}

}  // namespace
}  // namespace wna16

namespace wna16 {
namespace {

// The benchmark's scalar baseline must compute the same layer (it is the "plain loop" speedups
// are quoted against).
TEST(CpuScalarBaseline, MatchesReference) {
  MoeLayerSpec spec = tiny_spec();
  spec.shared_kind = SharedExpertKind::Plain;
  for (bool ao : {false, true}) {
    QuantScheme q;
    q.act_order = ao;
    q.sym = ao;
    q.bits = ao ? 8 : 4;
    const MoeLayerWeights w = random_layer(spec, q, 21);
    auto layer = cpu::make_scalar_baseline(spec, w);
    for (DType act : {DType::BF16, DType::F16}) {
      const auto x = random_activations(17 * spec.hidden, act, 5);
      EXPECT_LE(error_vs_reference(*layer, spec, w, x, 17, act), layer_tolerance(act)) << q.describe();
    }
  }
}

}  // namespace
}  // namespace wna16

namespace wna16 {
namespace {

// Real hidden states have a few channels 100x larger than the rest. The int8 kernels scale
// activations per 64-channel block (kernels.h), so an outlier coarsens its block's resolution:
// check it stays well inside the tolerance.
TEST(CpuLayer, ActivationOutliers) {
  const MoeLayerSpec spec = tiny_spec();
  const MoeLayerWeights w = random_layer(spec, QuantScheme{}, 31);
  for (Isa isa : cpu_test::isas_under_test()) {
    auto layer = cpu::make_cpu_layer_isa(spec, w, isa);
    for (DType act : {DType::BF16, DType::F16}) {
      const int64_t M = 17;
      auto x = random_activations(M * spec.hidden, act, 8);
      std::mt19937_64 rng(3);
      for (int i = 0; i < 40; ++i) {  // ~1 outlier per 64-channel block
        const size_t at = size_t(rng() % x.values.size());
        const float v = (rng() % 2 ? 100.f : -100.f) * x.values[at];
        x.bits[at] = act == DType::BF16 ? float_to_bf16(v) : float_to_f16(v);
        x.values[at] = act == DType::BF16 ? bf16_to_float(x.bits[at]) : f16_to_float(x.bits[at]);
      }
      const double err = error_vs_reference(*layer, spec, w, x, M, act);
      EXPECT_LE(err, 0.5 * layer_tolerance(act)) << cpu::isa_name(isa) << " " << dtype_name(act);
    }
  }
}

}  // namespace
}  // namespace wna16
