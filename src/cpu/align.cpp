#include "cpu/align.h"

#include <string>
#include <vector>

#include "wna16/error.h"

namespace wna16::cpu {

AlignResult align_slots(const int32_t* topk_ids, int64_t num_slots, int E, int block_m) {
  if (E <= 0) throw Error("align: E=" + std::to_string(E) + " must be positive");
  if (block_m <= 0) throw Error("align: block_m=" + std::to_string(block_m) + " must be positive");
  if (num_slots < 0) throw Error("align: num_slots=" + std::to_string(num_slots) + " is negative");
  std::vector<int64_t> count(static_cast<size_t>(E), 0);
  for (int64_t s = 0; s < num_slots; ++s) {
    const int32_t e = topk_ids[s];
    if (e < 0 || e >= E)
      throw Error("align: slot " + std::to_string(s) + " has expert id " + std::to_string(e) + " outside [0, " +
                  std::to_string(E) + ")");
    ++count[size_t(e)];
  }
  const int32_t sentinel = int32_t(num_slots);
  AlignResult r;
  r.sorted_token_ids.assign(size_t(max_padded_slots(num_slots, E, block_m)), sentinel);
  r.expert_ids.assign(size_t(max_align_blocks(num_slots, E, block_m)), -1);
  // Each expert's run starts at the padded prefix sum of the counts before it.
  std::vector<int64_t> start(static_cast<size_t>(E));
  int64_t total = 0;
  for (int e = 0; e < E; ++e) {
    start[size_t(e)] = total;
    const int64_t padded = (count[size_t(e)] + block_m - 1) / block_m * block_m;
    for (int64_t b = total / block_m; b < (total + padded) / block_m; ++b) r.expert_ids[size_t(b)] = e;
    total += padded;
  }
  r.num_tokens_post_padded = int32_t(total);
  for (int64_t s = 0; s < num_slots; ++s) r.sorted_token_ids[size_t(start[size_t(topk_ids[s])]++)] = int32_t(s);
  return r;
}

}  // namespace wna16::cpu
