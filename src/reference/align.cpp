// Reference moe_align_block_size: the host statement of the contract in reference.h that the GPU
// kernels reproduce bit for bit (same buffer sizes, same sentinel and -1 fill).
#include <cstdint>
#include <limits>

#include "wna16/error.h"
#include "wna16/reference.h"

namespace wna16 {

AlignResult align_reference(const int32_t* topk_ids, int64_t num_slots, int E, int block_m) {
  if (E <= 0) throw Error("align: E=" + std::to_string(E) + " must be positive");
  if (block_m <= 0) throw Error("align: block_m=" + std::to_string(block_m) + " must be positive");
  if (num_slots < 0) throw Error("align: num_slots=" + std::to_string(num_slots) + " is negative");
  if (num_slots > 0 && !topk_ids) throw Error("align: topk_ids is null for num_slots=" + std::to_string(num_slots));
  const int64_t max_padded = max_padded_slots(num_slots, E, block_m);
  // NOTE: every id and count is int32 on the GPU; refuse sizes that would not fit there.
  if (max_padded > std::numeric_limits<int32_t>::max())
    throw Error("align: num_slots=" + std::to_string(num_slots) + " with E=" + std::to_string(E) +
                " and block_m=" + std::to_string(block_m) + " needs " + std::to_string(max_padded) +
                " padded slots, more than int32 can index");

  std::vector<int64_t> count(static_cast<size_t>(E), 0);
  for (int64_t s = 0; s < num_slots; ++s) {
    const int32_t id = topk_ids[s];
    if (id < 0 || id >= E)
      throw Error("align: topk_ids[" + std::to_string(s) + "] = " + std::to_string(id) + " is outside [0, E=" +
                  std::to_string(E) + ")");
    ++count[size_t(id)];
  }

  // Each expert's run starts where the previous one's padded run ends; empty experts take no room.
  std::vector<int64_t> start(static_cast<size_t>(E) + 1, 0);
  for (int e = 0; e < E; ++e) {
    const int64_t padded = (count[size_t(e)] + block_m - 1) / block_m * block_m;
    start[size_t(e) + 1] = start[size_t(e)] + padded;
  }

  AlignResult r;
  const int32_t sentinel = int32_t(num_slots);
  r.num_tokens_post_padded = int32_t(start[size_t(E)]);
  r.sorted_token_ids.assign(static_cast<size_t>(max_padded), sentinel);
  r.expert_ids.assign(static_cast<size_t>(max_align_blocks(num_slots, E, block_m)), -1);

  // Visiting slots in ascending order keeps slot ids ascending within each expert.
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t s = 0; s < num_slots; ++s) r.sorted_token_ids[size_t(fill[size_t(topk_ids[s])]++)] = int32_t(s);
  for (int e = 0; e < E; ++e)
    for (int64_t b = start[size_t(e)] / block_m; b < start[size_t(e) + 1] / block_m; ++b) r.expert_ids[size_t(b)] = e;
  return r;
}

}  // namespace wna16
