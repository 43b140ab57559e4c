// The parallel plan: refusals naming the values, the layout of each rank, the token split, the
// dispatch of a hand-made routing, and shard weights that are exactly the slices of the full ones
// (act-order included).
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "wna16/error.h"
#include "wna16/parallel.h"

namespace wna16 {
namespace {

MoeLayerSpec spec_of(int64_t H, int64_t I, int E, int k, int64_t shared = 0) {
  MoeLayerSpec s;
  s.name = "plan";
  s.hidden = H;
  s.inter = I;
  s.routing.num_experts = E;
  s.routing.top_k = k;
  s.shared_kind = shared ? SharedExpertKind::Plain : SharedExpertKind::None;
  s.shared_inter = shared;
  return s;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(ParallelPlan, RefusesBadPlansNamingTheValues) {
  EXPECT_EQ(error_of([] { ParallelPlan{0, 2}.validate(); }), "parallel plan: tp=0 must be at least 1");
  EXPECT_EQ(error_of([] { ParallelPlan{2, -1}.validate(); }), "parallel plan: ep=-1 must be at least 1");
  EXPECT_EQ(error_of([] { ParallelPlan{2, 3}.validate(4); }),
            "parallel plan: tp=2 x ep=3 = 6 ranks, but the world has 4");
  const MoeLayerSpec s = spec_of(64, 96, 6, 2, 64);
  EXPECT_EQ(error_of([&] { check_plan({1, 4}, s); }),
            "parallel plan tp=1 x ep=4 (4 ranks): num_experts=6 is not divisible by ep=4");
  EXPECT_EQ(error_of([&] { check_plan({5, 1}, s); }),
            "parallel plan tp=5 x ep=1 (5 ranks): expert width I=96 is not divisible by tp=5");
  EXPECT_EQ(error_of([&] { check_plan({3, 1}, s); }),
            "parallel plan tp=3 x ep=1 (3 ranks): shared expert width=64 is not divisible by tp=3");
  EXPECT_NO_THROW(check_plan({2, 3}, s));
}

TEST(ParallelPlan, CutsInsideGroupsGetTheGcdGroupLength) {
  const MoeLayerSpec s = spec_of(128, 384, 4, 2);
  const MoeLayerWeights g128 = random_layer(s, {Format::GptqV1, 4, 128, true, false}, 1);
  const QuantizedLinear& d = g128.experts[0].down;
  EXPECT_EQ(slice_group_len(d, 0, 192), 64);    // tp=2: the cut at 192 is 64 into group 1
  EXPECT_EQ(slice_group_len(d, 192, 384), 64);
  EXPECT_EQ(slice_group_len(d, 0, 96), 32);     // tp=4
  EXPECT_EQ(slice_group_len(d, 96, 192), 32);
  EXPECT_EQ(slice_group_len(d, 128, 256), 128);  // whole groups keep theirs
  EXPECT_EQ(slice_group_len(d, 0, 48), 16);     // tp=8
  EXPECT_NO_THROW(check_plan({2, 1}, s, g128));
  EXPECT_NO_THROW(check_plan({8, 2}, s, g128));
  // Act-order: positions of inter_order, where each group is a run of 128 channels.
  const MoeLayerWeights act = random_layer(s, {Format::GptqV1, 4, 128, true, true}, 2);
  EXPECT_EQ(slice_group_len(act.experts[1].down, 192, 384), 64);
  // One group over the width stays one group.
  const MoeLayerWeights whole = random_layer(s, {Format::GptqV1, 4, -1, true, true}, 3);
  EXPECT_EQ(slice_group_len(whole.experts[0].down, 0, 96), -1);
  EXPECT_EQ(error_of([&] { slice_group_len(d, 96, 96); }), "slice_group_len: rows [96, 96) are not a non-empty range of K=384");
}

TEST(ParallelPlan, RefusesSlicesThatCutPackedWords) {
  const MoeLayerSpec s = spec_of(128, 128, 4, 2);
  // One group over the whole width (Mixtral's GPTQ): any split into whole packed words is fine...
  const MoeLayerWeights whole = random_layer(s, {Format::GptqV1, 4, -1, true, true}, 2);
  EXPECT_NO_THROW(check_plan({16, 1}, s, whole));
  // ... but 128 / 32 = 4 rows cannot hold whole 8-value words.
  EXPECT_EQ(error_of([&] { check_plan({32, 1}, s, whole); }),
            "parallel plan tp=32 x ep=1 (32 ranks): expert 0 gate [K=128, N=128] split by tp=32 (columns): gptq "
            "4-bit: N=4 is not a multiple of 8 (qzeros pack along N)");
  const MoeLayerWeights awq = random_layer(s, {Format::Awq, 4, 32, false, false}, 3);
  EXPECT_EQ(error_of([&] { check_plan({32, 1}, s, awq); }),
            "parallel plan tp=32 x ep=1 (32 ranks): expert 0 gate [K=128, N=128] split by tp=32 (columns): awq "
            "4-bit: N=4 is not a multiple of 8 (packing along N)");
  // Down rows: 2-bit GPTQ packs K by 16, so 8 rows per rank are refused even where gate/up (8-bit,
  // packed by 4) split.
  MoeLayerWeights mixed = random_layer(s, {Format::GptqV1, 8, 128, true, false}, 4);
  mixed.experts[2].down = random_layer(s, {Format::GptqV1, 2, 128, true, false}, 5).experts[2].down;
  EXPECT_EQ(error_of([&] { check_plan({16, 1}, s, mixed); }),
            "parallel plan tp=16 x ep=1 (16 ranks): expert 2 down [K=128, N=128] split by tp=16 (rows): tp rank 0's "
            "rows [0, 8) in groups of 8 (group_size=128): gptq 2-bit: K=8 is not a multiple of 16 (qweight packs "
            "along K)");
}

TEST(ParallelPlan, LayoutTokensAndOwners) {
  const MoeLayerSpec s = spec_of(64, 128, 8, 2, 64);
  const ParallelPlan p{2, 2};
  const ShardLayout l = shard_layout(p, s, 3);
  EXPECT_EQ(l.tp_rank, 1);
  EXPECT_EQ(l.ep_rank, 1);
  EXPECT_EQ(l.expert_begin, 4);
  EXPECT_EQ(l.expert_end, 8);
  EXPECT_EQ(l.inter_begin, 64);
  EXPECT_EQ(l.inter_end, 128);
  EXPECT_EQ(l.shared_begin, 32);
  EXPECT_EQ(l.shared_end, 64);
  EXPECT_EQ(expert_owner(p, s, 3), 0);
  EXPECT_EQ(expert_owner(p, s, 4), 1);
  EXPECT_EQ(error_of([&] { shard_layout(p, s, 4); }), "rank 4 is outside [0, 4) for tp=2 x ep=2 (4 ranks)");
  const ParallelPlan ep3{1, 3};
  int64_t next = 0;
  for (int g = 0; g < 3; ++g) {
    const TokenRange r = token_range(ep3, 7, g);
    EXPECT_EQ(r.begin, next);
    EXPECT_EQ(r.size(), g == 0 ? 3 : 2);
    next = r.end;
  }
  EXPECT_EQ(token_range({1, 2}, 1, 1).size(), 0);
}

TEST(ParallelPlan, DispatchSendsEachTokenOncePerGroupWithItsChoices) {
  const MoeLayerSpec s = spec_of(64, 128, 8, 3);
  // Token 0: experts 5, 1, 6 -> group 0 gets (1), group 1 gets (5, 6) in top-k order.
  // Token 1: experts 2, 3, 0 -> group 0 only. Token 2: experts 7, 4, 5 -> group 1 only.
  const int32_t ids[9] = {5, 1, 6, 2, 3, 0, 7, 4, 5};
  const float w[9] = {.5f, .3f, .2f, .6f, .3f, .1f, .7f, .2f, .1f};
  const DispatchPlan d = plan_dispatch({1, 2}, s, ids, w, 3, 3);
  ASSERT_EQ(d.groups.size(), 2u);
  EXPECT_EQ(d.groups[0].tokens, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(d.groups[0].choice_begin, (std::vector<int32_t>{0, 1, 4}));
  EXPECT_EQ(d.groups[0].experts, (std::vector<int32_t>{1, 2, 3, 0}));
  EXPECT_EQ(d.groups[0].weights, (std::vector<float>{.3f, .6f, .3f, .1f}));
  EXPECT_EQ(d.groups[1].tokens, (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(d.groups[1].choice_begin, (std::vector<int32_t>{0, 2, 5}));
  EXPECT_EQ(d.groups[1].experts, (std::vector<int32_t>{1, 2, 3, 0, 1}));
  EXPECT_EQ(d.groups[1].weights, (std::vector<float>{.5f, .2f, .7f, .2f, .1f}));
}

// Each rank's dequantized gate/up columns and down rows are the full ones at inter_order's
// positions, the groups' scales come along, and the down bias stays on tp rank 0 only.
void expect_exact_slices(const MoeLayerSpec& s, const QuantScheme& q, const ParallelPlan& p, int64_t down_group) {
  const std::string what = q.describe() + " I=" + std::to_string(s.inter) + " " + p.describe();
  MoeLayerWeights full = random_layer(s, q, 4);
  full.experts[1].down.bias.assign(size_t(s.hidden), 0.25f);
  const int64_t H = s.hidden, I = s.inter, w = I / p.tp;
  for (int rank = 0; rank < p.world(); ++rank) {
    const ShardLayout l = shard_layout(p, s, rank);
    const ShardWeights sw = shard_weights(p, s, full, rank);
    ASSERT_EQ(int(sw.experts.size()), l.expert_end - l.expert_begin);
    for (int i = 0; i < int(sw.experts.size()); ++i) {
      const ExpertWeights& f = full.experts[size_t(l.expert_begin + i)];
      const ExpertWeights& x = sw.experts[size_t(i)];
      const std::vector<int32_t> order = inter_order(f.down);
      const std::vector<double> fg = dequantize(f.gate), xg = dequantize(x.gate);
      const std::vector<double> fu = dequantize(f.up), xu = dequantize(x.up);
      const std::vector<double> fd = dequantize(f.down), xd = dequantize(x.down);
      ASSERT_EQ(x.gate.N, w) << what;
      ASSERT_EQ(x.down.K, w) << what;
      EXPECT_EQ(x.down.scheme.group_size, down_group) << what << " rank " << rank;
      EXPECT_FALSE(x.down.scheme.act_order) << what;
      for (int64_t c = 0; c < w; ++c) {
        const int64_t ch = order[size_t(l.inter_begin + c)];
        for (int64_t k = 0; k < H; ++k) {
          ASSERT_EQ(xg[size_t(k * w + c)], fg[size_t(k * I + ch)]) << what;
          ASSERT_EQ(xu[size_t(k * w + c)], fu[size_t(k * I + ch)]) << what;
        }
        for (int64_t n = 0; n < H; ++n) ASSERT_EQ(xd[size_t(c * H + n)], fd[size_t(ch * H + n)]) << what;
      }
      EXPECT_EQ(x.down.bias.empty(), !(l.tp_rank == 0 && l.expert_begin + i == 1)) << rank;
    }
    if (s.shared_kind != SharedExpertKind::None) {
      ASSERT_TRUE(sw.shared.has_value());
      EXPECT_EQ(sw.shared->gate.N, s.shared_inter / p.tp);
    }
  }
}

TEST(ParallelPlan, ShardWeightsAreExactSlicesOfTheFullTensors) {
  const MoeLayerSpec s = spec_of(64, 128, 4, 2, 128);
  for (const QuantScheme& q : {QuantScheme{Format::GptqV1, 4, 32, true, true}, QuantScheme{Format::GptqV2, 8, 32, false, false},
                               QuantScheme{Format::Awq, 4, 16, false, false}})
    expect_exact_slices(s, q, {4, 2}, q.group_size);
}

// Cuts inside a group: the slice's groups are shorter, each with its original group's scale and
// zero, and the slice dequantizes to exactly the full rows.
TEST(ParallelPlan, CutsInsideGroupsAreExactSlices) {
  const MoeLayerSpec small = spec_of(128, 128, 4, 2, 128);  // I/tp = 64 with g128
  const MoeLayerSpec wide = spec_of(128, 384, 4, 2);        // cuts at 192 = 64 into group 1
  for (const QuantScheme& q : {QuantScheme{Format::GptqV1, 4, 128, true, false}, QuantScheme{Format::GptqV1, 4, 128, true, true},
                               QuantScheme{Format::GptqV2, 4, 128, false, true}, QuantScheme{Format::GptqV1, 8, 128, false, false},
                               QuantScheme{Format::GptqV2, 8, 128, true, true}, QuantScheme{Format::Awq, 4, 128, false, false}}) {
    expect_exact_slices(small, q, {2, 1}, 64);
    expect_exact_slices(small, q, {2, 2}, 64);
    expect_exact_slices(small, q, {4, 1}, 32);
    expect_exact_slices(wide, q, {2, 2}, 64);
  }
  expect_exact_slices(small, {Format::GptqV1, 4, -1, false, true}, {4, 1}, -1);
}

// regroup_rows: shorter groups with the scales and zeros repeated dequantize to the same values;
// act-order, -1 and lengths that do not divide the group size are refused, naming the scheme.
TEST(ParallelPlan, RegroupRowsKeepsTheValues) {
  const MoeLayerSpec s = spec_of(128, 256, 4, 2, 128);
  for (const QuantScheme& q : {QuantScheme{Format::GptqV1, 4, 128, true, false}, QuantScheme{Format::GptqV2, 8, 128, false, false},
                               QuantScheme{Format::Awq, 4, 128, false, false}}) {
    const MoeLayerWeights w = random_layer(s, q, 41);
    const QuantizedLinear& d = w.experts[1].down;
    for (int64_t len : {64, 32}) {
      const QuantizedLinear r = regroup_rows(d, len, "down");
      EXPECT_EQ(r.scheme.group_size, len) << q.describe();
      EXPECT_EQ(dequantize(r), dequantize(d)) << q.describe() << " in groups of " << len;
    }
    EXPECT_THROW(regroup_rows(d, 48, "down"), Error);
  }
  const MoeLayerWeights a = random_layer(s, {Format::GptqV1, 4, 128, true, true}, 42);
  try {
    regroup_rows(a.experts[0].down, 64, "expert 0 down");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert 0 down: cannot regroup"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace wna16
