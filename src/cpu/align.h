// moe_align_block_size on the CPU: the same contract and the same output as align_reference
// (reference.h) in one counting-sort pass. The CPU forward uses block_m = 1 (no padding): the slot
// ids grouped by expert, ascending within each.
#pragma once
#include <cstdint>

#include "wna16/reference.h"

namespace wna16::cpu {

// Throws Error for E <= 0, block_m <= 0 or an id outside [0, E) (naming slot and id).
AlignResult align_slots(const int32_t* topk_ids, int64_t num_slots, int E, int block_m);

}  // namespace wna16::cpu
