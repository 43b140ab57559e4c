// The CPU sharded layer, every rank on a thread of one in-process world, against the float64
// reference (within the layer tolerance) and against the unsharded CPU layer: bit for bit with one
// rank, and within float reassociation otherwise (the partial sums are added in another order).
// Every routing variant (softmax with and without renormalisation, DeepSeek-V2 group-limited,
// DeepSeek-V3 noaux_tc; sigmoid-gated, plain and no shared expert) and every format, for the plans
// tp=2, ep=2, tp=2 x ep=2, tp=4, ep=4 and tp=1 x ep=1, on the caller-routed path too; and the
// small preset with group size 128, where TP cuts fall inside groups.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/cpu_test_util.h"
#include "wna16/error.h"
#include "wna16/parallel.h"

namespace wna16 {
namespace {

using cpu_test::random_activations;
using cpu_test::to_float;

struct Variant {
  const char* name;
  MoeLayerSpec spec;
};

// Small shapes with every routing method; I = 128 and the shared widths split into whole groups of
// 32 for tp up to 4, E = 8 for ep up to 4.
std::vector<Variant> variants() {
  auto make = [](const char* name, RoutingMethod m, int k, bool renorm, SharedExpertKind shared) {
    MoeLayerSpec s;
    s.name = name;
    s.hidden = 128;
    s.inter = 128;
    s.routing.method = m;
    s.routing.num_experts = 8;
    s.routing.top_k = k;
    s.routing.renormalize = renorm;
    s.shared_kind = shared;
    s.shared_inter = shared == SharedExpertKind::None ? 0 : 256;
    return Variant{name, s};
  };
  std::vector<Variant> v;
  v.push_back(make("softmax renorm, gated shared (Qwen2-MoE)", RoutingMethod::SoftmaxTopK, 2, true,
                   SharedExpertKind::SigmoidGated));
  v.push_back(make("softmax no renorm (Qwen1.5-MoE)", RoutingMethod::SoftmaxTopK, 4, false, SharedExpertKind::SigmoidGated));
  v.push_back(make("softmax, no shared (Mixtral, Qwen3)", RoutingMethod::SoftmaxTopK, 2, true, SharedExpertKind::None));
  Variant v2 = make("group-limited greedy, plain shared (DeepSeek-V2)", RoutingMethod::GroupLimitedGreedy, 3, false,
                    SharedExpertKind::Plain);
  v2.spec.routing.n_group = 4;
  v2.spec.routing.topk_group = 2;
  v2.spec.routing.routed_scaling_factor = 1.5;
  v.push_back(v2);
  Variant v3 = make("noaux_tc, plain shared (DeepSeek-V3)", RoutingMethod::NoauxTc, 3, true, SharedExpertKind::Plain);
  v3.spec.routing.n_group = 4;
  v3.spec.routing.topk_group = 2;
  v3.spec.routing.routed_scaling_factor = 2.5;
  v.push_back(v3);
  return v;
}

std::vector<QuantScheme> formats() {
  return {{Format::GptqV1, 4, 32, true, false},  {Format::GptqV1, 4, 32, true, true},  {Format::GptqV1, 8, 32, false, false},
          {Format::GptqV2, 4, 32, false, true},  {Format::GptqV2, 8, -1, true, false}, {Format::Awq, 4, 32, false, false}};
}

const std::vector<ParallelPlan> kPlans = {{2, 1}, {1, 2}, {2, 2}, {4, 1}, {1, 4}, {1, 1}};

// Sharded vs unsharded: the same weights and inputs, the sums in another order. Far below the
// reference tolerance (a wrong slice, group or routing weight gives 1e-2 and more).
double reassociation_bound(DType act) { return act == DType::BF16 ? 4e-3 : 1e-3; }

void check(const Variant& v, const QuantScheme& q, const ParallelPlan& plan, DType act, bool routed, uint64_t seed) {
  const MoeLayerSpec& spec = v.spec;
  const std::string what = std::string(v.name) + ", " + q.describe() + ", " + plan.describe() + ", " +
                           dtype_name(act) + (routed ? ", caller routing" : "");
  const MoeLayerWeights w = random_layer(spec, q, seed);
  auto sharded = make_in_process_sharded_layer(Device::Cpu, plan, spec, w);
  auto plain = make_cpu_layer(spec, w);
  for (int64_t M : {1, 5, 33}) {
    const int64_t n = M * spec.hidden;
    const auto x = random_activations(n, act, seed + uint64_t(M));
    std::vector<uint16_t> got(static_cast<size_t>(n), 0xFFFF), want(static_cast<size_t>(n), 0xFFFF);
    std::vector<double> ref;
    if (routed) {
      // Any expert, repeats allowed, negative weights too: the routed path must not assume softmax.
      std::mt19937_64 rng(seed + 7);
      Routing r;
      r.M = M;
      r.top_k = 3;
      for (int64_t i = 0; i < M * 3; ++i) {
        r.ids.push_back(int32_t(rng() % uint64_t(spec.routing.num_experts)));
        r.weights.push_back(float(int(rng() % 200) - 50) / 100.f);
      }
      sharded->forward_routed_host(x.bits.data(), r.ids.data(), r.weights.data(), 3, got.data(), M, act);
      plain->forward_routed_host(x.bits.data(), r.ids.data(), r.weights.data(), 3, want.data(), M, act);
      ref = moe_reference_routed(spec, w, x.values.data(), M, r);
    } else {
      sharded->forward_host(x.bits.data(), got.data(), M, act);
      plain->forward_host(x.bits.data(), want.data(), M, act);
      ref = moe_reference(spec, w, x.values.data(), M);
    }
    const std::vector<float> g = to_float(got, act), u = to_float(want, act);
    EXPECT_LE(rel_error(g.data(), ref.data(), n), layer_tolerance(act)) << what << ", M=" << M;
    if (plan.world() == 1) {
      EXPECT_EQ(got, want) << what << ", M=" << M << ": one rank must match the unsharded layer bit for bit";
    } else {
      std::vector<double> ud(u.begin(), u.end());
      EXPECT_LE(rel_error(g.data(), ud.data(), n), reassociation_bound(act)) << what << ", M=" << M;
    }
  }
}

TEST(ShardedCpuLayer, EveryRoutingVariantUnderEveryPlan) {
  uint64_t seed = 10;
  for (const ParallelPlan& plan : kPlans)
    for (const Variant& v : variants()) check(v, formats()[0], plan, DType::BF16, false, seed++);
}

TEST(ShardedCpuLayer, EveryFormatUnderEveryPlan) {
  const Variant v3 = variants()[4];
  uint64_t seed = 100;
  for (const ParallelPlan& plan : kPlans)
    for (const QuantScheme& q : formats()) {
      check(v3, q, plan, seed % 2 ? DType::F16 : DType::BF16, false, seed);
      ++seed;
    }
}

TEST(ShardedCpuLayer, CallerRoutingWithRepeatsAndF16) {
  uint64_t seed = 200;
  for (const ParallelPlan& plan : {ParallelPlan{2, 2}, ParallelPlan{1, 4}, ParallelPlan{1, 1}})
    for (const Variant& v : {variants()[0], variants()[3]}) check(v, formats()[1], plan, DType::F16, true, seed++);
}

// The small preset with the default group size 128 (I = 128): every TP cut falls inside a group
// (64 or 32 rows per rank), for every format.
TEST(ShardedCpuLayer, SmallPresetWithDefaultGroupSizeCutsInsideGroups) {
  const Variant v{"small preset", preset("small")};
  uint64_t seed = 300;
  for (const ParallelPlan& plan : {ParallelPlan{2, 1}, ParallelPlan{2, 2}, ParallelPlan{4, 1}})
    for (const QuantScheme& q : {QuantScheme{Format::GptqV1, 4, 128, true, false}, QuantScheme{Format::GptqV1, 4, 128, true, true},
                                 QuantScheme{Format::GptqV2, 4, 128, false, true}, QuantScheme{Format::GptqV1, 8, 128, false, false},
                                 QuantScheme{Format::Awq, 4, 128, false, false}}) {
      check(v, q, plan, seed % 2 ? DType::F16 : DType::BF16, false, seed);
      ++seed;
    }
}

TEST(ShardedCpuLayer, OneRankAlsoBitExactWithF32Inputs) {
  const Variant v = variants()[0];
  const MoeLayerWeights w = random_layer(v.spec, formats()[0], 5);
  auto sharded = make_in_process_sharded_layer(Device::Cpu, {1, 1}, v.spec, w);
  auto plain = make_cpu_layer(v.spec, w);
  const int64_t n = 9 * v.spec.hidden;
  std::vector<float> x(static_cast<size_t>(n)), a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
  std::mt19937_64 rng(3);
  std::normal_distribution<float> nd;
  for (float& f : x) f = nd(rng);
  sharded->forward_host(x.data(), a.data(), 9, DType::F32);
  plain->forward_host(x.data(), b.data(), 9, DType::F32);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
}

// Each rank holds only its shard: the expert bytes of the ranks add up to the layer's (tp splits
// every expert, ep the experts; the shared expert is replicated over the ep groups).
TEST(ShardedCpuLayer, EachRankHoldsOnlyItsShard) {
  const Variant v = variants()[3];
  const MoeLayerWeights w = random_layer(v.spec, formats()[0], 6);
  const ParallelPlan plan{2, 2};
  InProcessWorld world(plan.world());
  std::vector<int64_t> bytes(4), dispatch(4), reduce(4);
  world.run([&](Communicator& c) {
    auto layer = make_sharded_cpu_layer(plan, v.spec, w, c);
    const TokenRange r = token_range(plan, 16, layer->layout().ep_rank);
    const auto x = random_activations(16 * v.spec.hidden, DType::BF16, 1);
    std::vector<uint16_t> out(size_t(r.size() * v.spec.hidden));
    layer->forward_host(x.bits.data() + r.begin * v.spec.hidden, out.data(), r.size(), DType::BF16);
    bytes[size_t(c.rank())] = layer->weight_bytes();
    dispatch[size_t(c.rank())] = layer->last_stats().dispatch_bytes;
    reduce[size_t(c.rank())] = layer->last_stats().all_reduce_bytes;
  });
  auto linear_bytes = [](const QuantizedLinear& l) {
    return int64_t((l.qweight.size() + l.qzeros.size() + l.g_idx.size()) * 4 + l.scales.size() * 2);
  };
  int64_t routed = 0, shared = 0;
  for (const auto& e : w.experts) routed += linear_bytes(e.gate) + linear_bytes(e.up) + linear_bytes(e.down);
  shared = linear_bytes(w.shared->gate) + linear_bytes(w.shared->up) + linear_bytes(w.shared->down);
  // g_idx of gate/up is not split (their K is the hidden size): allow those few bytes per rank.
  const int64_t g_idx = 2 * v.spec.hidden * 4 * (v.spec.routing.num_experts / 2 + 1);
  for (int r = 0; r < 4; ++r) {
    EXPECT_GE(bytes[size_t(r)], (routed / 2 + shared) / 2) << r;
    EXPECT_LE(bytes[size_t(r)], (routed / 2 + shared) / 2 + g_idx) << r;
    EXPECT_GT(dispatch[size_t(r)], 0) << r;  // 8 tokens with 3 of 8 experts each: both groups get some
    EXPECT_EQ(reduce[size_t(r)], 8 * v.spec.hidden * 4) << r;
  }
}

TEST(ShardedCpuLayer, RefusesCudaAndBadPlans) {
  const Variant v = variants()[0];
  const MoeLayerWeights w = random_layer(v.spec, formats()[0], 7);
  try {
    make_in_process_sharded_layer(Device::Cuda, {2, 1}, v.spec, w);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cpu backend only so far"), std::string::npos) << e.what();
  }
  try {
    make_in_process_sharded_layer(Device::Cpu, {1, 3}, v.spec, w);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "parallel plan tp=1 x ep=3 (3 ranks): num_experts=8 is not divisible by ep=3");
  }
}

}  // namespace
}  // namespace wna16
