// Private knobs of the moe_align kernel (src/cuda/sm90_moe_align.cu), for its tests and its
// micro-benchmark: every setting gives the same, bit-exact result; only the speed differs. The
// layer calls launch_align (wna16/cuda_kernels.h), which uses kAlignDefaultTuning.
#pragma once
#include <cstdint>

#include "wna16/cuda_kernels.h"

namespace wna16::cuda {

// The member defaults are the default tuning: the fastest of the variants measured on the H200
// (2026-12-02, idle GPU, graph replay; E=256 and 32k slots, block_m=64: 1024 or 2048 slots per CTA
// with PDL 7.10 us (both clamp to the 16-CTA cluster there); unstaged 7.65; without PDL 7.95;
// 4096 slots per CTA 8.79 with PDL, 9.62 without; 8192 13.77; match_any 0.9-1.7 us slower than
// ballots. 1024 rather than 2048 slots per CTA: 5.20 against 6.31 us at E=256 with 4096 slots,
// 5.13 against 6.02 at E=128 with 8192).
// small_max_slots: up to this many slots run the small path (one plain CTA, no cluster; ncu on the
// H200, DeepSeek-V3 M=1, 9 slots: 4.5 us against 7.2 us for the cluster kernel).
constexpr int kAlignSmallMaxSlots = 1024;  // the small path has one thread per slot

struct AlignTuning {
  bool match_any = false;     // same-expert lanes by __match_any_sync instead of one ballot per id bit
  int slots_per_cta = 1024;   // cluster size = clamp(ceil(num_slots / slots_per_cta), 1, max cluster)
  bool plain_single = false;  // a one-CTA grid is launched without the cluster attribute
  bool pdl = true;            // programmatic dependent launch: set-up overlaps the previous kernel
  bool stage = true;          // scatter through shared memory where a CTA's slots fit (coalesced stores)
  int small_max_slots = kAlignSmallMaxSlots;  // num_slots <= this: the small path (0: never)
  const char* name = "ballot/1024/pdl";
};
extern const AlignTuning kAlignDefaultTuning;

void launch_align_tuned(const int32_t* topk_ids, int64_t num_slots, int E, int block_m, int32_t* sorted_token_ids,
                        int32_t* expert_ids, int32_t* num_tokens_post_padded, const AlignTuning& tuning,
                        Stream stream);

// The largest cluster the current device co-schedules for the align kernel (16 where the
// non-portable size is available, else 8 or fewer).
int align_max_cluster_size();

// Calibration for the micro-benchmark: an empty kernel of the align kernel's shape (n_cta CTAs of
// 1024 threads as one cluster, or a plain launch when cluster is false).
void launch_align_shaped_noop(int n_cta, bool cluster, Stream stream);

}  // namespace wna16::cuda
