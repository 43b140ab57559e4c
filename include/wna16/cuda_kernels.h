// CUDA building blocks of the fused MoE layer: routing and moe_align_block_size. Raw device
// pointers, sizes and a stream; no allocation, no host synchronisation, capturable in a CUDA graph.
// Every launcher checks its arguments before launching and throws wna16::Error naming the bad value.
// Only declared when the build has CUDA (WNA16_HAVE_CUDA); the header itself has no CUDA includes.
#pragma once
#include <cstddef>
#include <cstdint>

#include "wna16/half.h"
#include "wna16/moe.h"

namespace wna16::cuda {

using Stream = void*;  // cudaStream_t

// Router logits [M, E] on the device, fp32 or bf16 (logits_dtype), -> topk_ids [M, top_k] int32 and
// topk_weights [M, top_k] fp32, the same semantics and tie-breaking (lower index wins) as
// route_reference. bias: [E] fp32 device pointer for NoauxTc (e_score_correction_bias), else null.
void launch_routing(const RoutingConfig& cfg, const void* logits, DType logits_dtype, int64_t M,
                    const float* bias, int32_t* topk_ids, float* topk_weights, Stream stream);

// moe_align_block_size on the device; see the contract in wna16/reference.h (align_reference).
// Output buffers are sized from the upper bound: sorted_token_ids[max_padded_slots(num_slots, E,
// block_m)], expert_ids[max_align_blocks(...)], num_tokens_post_padded[1]; all stay on the device.
// Needs no workspace. Supports E up to 1024 and num_slots up to 2^24.
void launch_align(const int32_t* topk_ids, int64_t num_slots, int E, int block_m,
                  int32_t* sorted_token_ids, int32_t* expert_ids, int32_t* num_tokens_post_padded,
                  Stream stream);

// The ids of one expert group's layer: out[i] = ids[i] - begin for ids[i] in [begin, end), else -1
// (CudaMoeLayer::forward_routed adds nothing for an id outside its experts). n = M x top_k.
void launch_local_expert_ids(const int32_t* ids, int64_t n, int begin, int end, int32_t* out, Stream stream);

}  // namespace wna16::cuda
