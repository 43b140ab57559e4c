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
#include "parallel/sharded_cases.h"
#include "wna16/error.h"
#include "wna16/parallel.h"

namespace wna16 {
namespace {

using cpu_test::random_activations;
using cpu_test::to_float;
using namespace sharded_test;

void check(const Variant& v, const QuantScheme& q, const ParallelPlan& plan, DType act, bool routed, uint64_t seed) {
  sharded_test::check(Device::Cpu, v, q, plan, act, routed, seed);
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
  auto sharded = make_threaded_sharded_layer(Device::Cpu, {1, 1}, v.spec, w);
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
    auto layer = make_sharded_layer(Device::Cpu, plan, v.spec, w, c);
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

TEST(ShardedCpuLayer, RefusesBadPlansAndComms) {
  const Variant v = variants()[0];
  const MoeLayerWeights w = random_layer(v.spec, formats()[0], 7);
  if (!cuda_available()) {
    try {
      make_threaded_sharded_layer(Device::Cuda, {2, 1}, v.spec, w);
      FAIL();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("no CUDA GPU is present"), std::string::npos) << e.what();
    }
  }
  try {
    make_threaded_sharded_layer(Device::Cpu, {2, 1}, v.spec, w, CommKind::Nccl);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "--comm nccl moves device memory between GPUs: it needs --device cuda");
  }
  try {
    make_threaded_sharded_layer(Device::Cpu, {1, 3}, v.spec, w);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "parallel plan tp=1 x ep=3 (3 ranks): num_experts=8 is not divisible by ep=3");
  }
}

}  // namespace
}  // namespace wna16
