// Private knobs of the moe_align kernel (src/cuda/sm90_moe_align.cu), for its tests and its
// micro-benchmark: every setting gives the same, bit-exact result; only the speed differs. The
// layer calls launch_align (wna16/cuda_kernels.h), which uses kAlignDefaultTuning.
#pragma once
#include <cstdint>

#include "wna16/cuda_kernels.h"

namespace wna16::cuda {

struct AlignTuning {
  bool match_any = false;     // same-expert lanes by __match_any_sync instead of one ballot per id bit
  int slots_per_cta = 4096;   // cluster size = clamp(ceil(num_slots / slots_per_cta), 1, max cluster)
  bool plain_single = false;  // a one-CTA grid is launched without the cluster attribute
  bool pdl = false;           // programmatic dependent launch: set-up overlaps the previous kernel
  const char* name = "ballot/4096";
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
