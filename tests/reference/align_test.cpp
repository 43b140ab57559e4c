// The moe_align_block_size contract (reference.h): a hand-worked case, then every invariant
// checked on edge cases and on random inputs with up to 512 experts.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "wna16/error.h"
#include "wna16/reference.h"

using namespace wna16;

namespace {

// Checks every clause of the contract against a count-based re-derivation.
void check_contract(const std::vector<int32_t>& ids, int E, int block_m, const AlignResult& r) {
  const int64_t n = int64_t(ids.size());
  const int32_t sentinel = int32_t(n);
  ASSERT_EQ(int64_t(r.sorted_token_ids.size()), max_padded_slots(n, E, block_m));
  ASSERT_EQ(int64_t(r.expert_ids.size()), max_align_blocks(n, E, block_m));
  std::vector<int64_t> count(size_t(E), 0);
  for (int32_t id : ids) ++count[size_t(id)];
  int64_t total = 0;
  for (int e = 0; e < E; ++e) total += (count[size_t(e)] + block_m - 1) / block_m * block_m;
  ASSERT_EQ(r.num_tokens_post_padded, total);
  ASSERT_EQ(total % block_m, 0);

  std::vector<int> seen(size_t(n), 0);
  int64_t pos = 0;
  for (int e = 0; e < E; ++e) {
    if (count[size_t(e)] == 0) continue;  // no room for an expert without slots
    const int64_t padded = (count[size_t(e)] + block_m - 1) / block_m * block_m;
    // The run: count slots of expert e, ascending, then sentinels up to the padded length.
    for (int64_t i = 0; i < padded; ++i) {
      const int32_t v = r.sorted_token_ids[size_t(pos + i)];
      if (i < count[size_t(e)]) {
        ASSERT_GE(v, 0);
        ASSERT_LT(v, sentinel);
        ASSERT_EQ(ids[size_t(v)], e) << "slot " << v << " in the run of expert " << e;
        ++seen[size_t(v)];
        if (i > 0) {
          ASSERT_LT(r.sorted_token_ids[size_t(pos + i - 1)], v) << "not ascending in expert " << e;
        }
      } else {
        ASSERT_EQ(v, sentinel) << "padding of expert " << e;
      }
    }
    // One expert per block, and it is e.
    for (int64_t b = pos / block_m; b < (pos + padded) / block_m; ++b) ASSERT_EQ(r.expert_ids[size_t(b)], e);
    pos += padded;
  }
  ASSERT_EQ(pos, total);
  for (int64_t s = 0; s < n; ++s) ASSERT_EQ(seen[size_t(s)], 1) << "slot " << s;
  for (size_t i = size_t(total); i < r.sorted_token_ids.size(); ++i) ASSERT_EQ(r.sorted_token_ids[i], sentinel);
  for (size_t b = size_t(total / block_m); b < r.expert_ids.size(); ++b) ASSERT_EQ(r.expert_ids[b], -1);
}

AlignResult align(const std::vector<int32_t>& ids, int E, int block_m) {
  return align_reference(ids.data(), int64_t(ids.size()), E, block_m);
}

std::string error_of(const std::vector<int32_t>& ids, int E, int block_m) {
  try {
    align(ids, E, block_m);
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

}  // namespace

TEST(Align, HandWorkedExample) {
  // M = 3 tokens, top-2: slots 0..5 -> experts 2 0 | 1 2 | 2 0. E = 4, block_m = 4, sentinel 6.
  // expert 0: slots 1, 5 -> [1 5 6 6]; expert 1: slot 2 -> [2 6 6 6]; expert 2: 0, 3, 4 -> [0 3 4 6];
  // expert 3: nothing. Padded total 12. Buffer length 6 + 4*3 = 18, blocks ceil(18/4) = 5.
  AlignResult r = align({2, 0, 1, 2, 2, 0}, 4, 4);
  std::vector<int32_t> want_sorted = {1, 5, 6, 6, 2, 6, 6, 6, 0, 3, 4, 6, 6, 6, 6, 6, 6, 6};
  std::vector<int32_t> want_experts = {0, 1, 2, -1, -1};
  EXPECT_EQ(r.sorted_token_ids, want_sorted);
  EXPECT_EQ(r.expert_ids, want_experts);
  EXPECT_EQ(r.num_tokens_post_padded, 12);
}

TEST(Align, ExactMultiplesNeedNoPadding) {
  // block_m 2: expert 1 gets slots 0, 3; expert 0 gets 1, 2 -> [1 2 | 0 3], total 4; length 4 + 2 = 6.
  AlignResult r = align({1, 0, 0, 1}, 2, 2);
  EXPECT_EQ(r.sorted_token_ids, (std::vector<int32_t>{1, 2, 0, 3, 4, 4}));
  EXPECT_EQ(r.expert_ids, (std::vector<int32_t>{0, 1, -1}));
  EXPECT_EQ(r.num_tokens_post_padded, 4);
}

TEST(Align, ZeroTokenExpertsTakeNoRoom) {
  std::vector<int32_t> ids = {7, 7, 3, 7, 0};
  AlignResult r = align(ids, 8, 4);
  check_contract(ids, 8, 4, r);
  EXPECT_EQ(r.num_tokens_post_padded, 12);  // experts 0, 3, 7: one block each
  EXPECT_EQ(r.expert_ids[0], 0);
  EXPECT_EQ(r.expert_ids[1], 3);
  EXPECT_EQ(r.expert_ids[2], 7);
}

TEST(Align, AllSlotsOnOneExpert) {
  std::vector<int32_t> ids(37, 5);
  AlignResult r = align(ids, 16, 16);
  check_contract(ids, 16, 16, r);
  EXPECT_EQ(r.num_tokens_post_padded, 48);
  for (int i = 0; i < 37; ++i) EXPECT_EQ(r.sorted_token_ids[size_t(i)], i);
  EXPECT_EQ(r.expert_ids[0], 5);
  EXPECT_EQ(r.expert_ids[2], 5);
  EXPECT_EQ(r.expert_ids[3], -1);
}

TEST(Align, SingleExpert) {
  std::vector<int32_t> ids(10, 0);
  AlignResult r = align(ids, 1, 8);
  check_contract(ids, 1, 8, r);
  EXPECT_EQ(r.num_tokens_post_padded, 16);
  EXPECT_EQ(r.sorted_token_ids.size(), 17u);  // 10 + 1 * 7
  EXPECT_EQ(r.expert_ids, (std::vector<int32_t>{0, 0, -1}));
}

TEST(Align, BlockOfOneIsAPlainStableSort) {
  std::vector<int32_t> ids = {3, 1, 3, 0, 1, 1};
  AlignResult r = align(ids, 4, 1);
  check_contract(ids, 4, 1, r);
  EXPECT_EQ(r.sorted_token_ids, (std::vector<int32_t>{3, 1, 4, 5, 0, 2}));
  EXPECT_EQ(r.expert_ids, (std::vector<int32_t>{0, 1, 1, 1, 3, 3}));
  EXPECT_EQ(r.num_tokens_post_padded, 6);
}

TEST(Align, NoSlots) {
  AlignResult r = align_reference(nullptr, 0, 4, 16);
  check_contract({}, 4, 16, r);
  EXPECT_EQ(r.num_tokens_post_padded, 0);
  EXPECT_EQ(r.sorted_token_ids, std::vector<int32_t>(60, 0));  // sentinel = 0 slots
  EXPECT_EQ(r.expert_ids, std::vector<int32_t>(4, -1));
}

TEST(Align, RandomRoutingsUpTo512Experts) {
  std::mt19937 rng(1234);
  const int Es[] = {1, 2, 8, 60, 64, 128, 256, 512};
  const int blocks[] = {1, 8, 16, 64, 128};
  const int64_t Ms[] = {1, 3, 17, 118};
  for (int E : Es)
    for (int bm : blocks)
      for (int64_t M : Ms) {
        const int k = std::min(E, 8);
        // Each token takes k distinct experts, as a router would; skewed so some experts get nothing.
        std::vector<int32_t> ids;
        for (int64_t m = 0; m < M; ++m) {
          std::vector<int32_t> pool(static_cast<size_t>(E));
          for (int e = 0; e < E; ++e) pool[size_t(e)] = e;
          std::shuffle(pool.begin(), pool.begin() + std::min(E, 2 * k), rng);
          for (int j = 0; j < k; ++j) ids.push_back(pool[size_t(j)]);
        }
        SCOPED_TRACE("E=" + std::to_string(E) + " block_m=" + std::to_string(bm) + " M=" + std::to_string(M));
        check_contract(ids, E, bm, align(ids, E, bm));
        // Uniform ids, with repeats, too.
        std::uniform_int_distribution<int32_t> any(0, E - 1);
        for (auto& id : ids) id = any(rng);
        check_contract(ids, E, bm, align(ids, E, bm));
      }
}

TEST(Align, ErrorsNameSlotAndId) {
  EXPECT_NE(error_of({0, 1, 2, 9}, 8, 4).find("topk_ids[3] = 9"), std::string::npos) << error_of({0, 1, 2, 9}, 8, 4);
  EXPECT_NE(error_of({0, -1}, 8, 4).find("topk_ids[1] = -1"), std::string::npos);
  EXPECT_NE(error_of({8}, 8, 4).find("E=8"), std::string::npos);
  EXPECT_NE(error_of({0}, 0, 4).find("E=0"), std::string::npos);
  EXPECT_NE(error_of({0}, 4, 0).find("block_m=0"), std::string::npos);
  EXPECT_NE(error_of({0}, 4, -16).find("block_m=-16"), std::string::npos);
}
