// The small kernels around the fused GEMMs: router logits, shared-expert slots, the fp32 -> act
// cast. Raw device pointers and a stream; no allocation, no host synchronisation.
#pragma once
#include <cstdint>

#include "wna16/half.h"
#include "wna16/moe.h"

namespace wna16::cuda {

using Stream = void*;

// logits[m, e] = sum_h x[m, h] * router[e, h] in fp32 for e < E; when E_ext = E + 1 the extra
// router row is the shared-expert gate and its result goes to gate_logit[m] instead.
// x: act [M, H]; router: [E_ext, H] in fp32, or in bf16 (router_dtype), which gives the same
// logits for the same values at half the bytes; H a multiple of 4. Also zeroes zero[0, zero_n)
// (the layer's counters; zero_n a multiple of 4) so the layer needs no separate memset.
// batch_invariant: one kernel and H split for every M (the tensor-core router for 32 or more rows,
// else the small kernel), so a token's logits do not depend on the other tokens of the call.
void launch_router_logits(const void* x, DType act, int64_t M, int64_t H, const void* router, DType router_dtype,
                          int E, int E_ext, float* logits, float* gate_logit, float* zero, int64_t zero_n,
                          Stream stream, bool batch_invariant = false);

struct RoutingAlignOut {
  int32_t* sorted = nullptr;
  int32_t* expert_ids = nullptr;
  int32_t* ntpp = nullptr;
  int block_m = 0;
  int64_t max_padded = 0, max_blocks = 0;
};

// launch_routing (wna16/cuda_kernels.h) on fp32 logits, with the S shared-expert slices as extra
// choices of every token: ids2 / weights2 are [M, top_k + S] (S may be 0); ids2[m, top_k + s] = s
// with weight 1 (gate_logit null) or sigmoid(gate_logit[m]), and the routed ids are offset by S
// (the layer's kernel experts: the shared slices first, so their m-blocks lead the align output).
// Launched with programmatic dependent launch; the kernel waits for the previous kernel in the
// stream before its first global access.
// align (M == 1 and top_k + S <= 32 only; sorted null: off): the routing kernel also writes what
// launch_align(ids2, top_k + S, num_experts + S, block_m, ...) would, so the layer's one-token chain
// has no align launch. max_padded / max_blocks: the tables' sizes (at least the align contract's).
// release_late: the kernels after it may start only once the kernel before it has completed
// (default: at its start), for a dependent that uses what that kernel zeroed before its own wait,
// or whose early start would slow that kernel down (the layer's choice, cuda_moe_layer.cpp).
void launch_routing_with_shared(const RoutingConfig& cfg, const float* logits, int64_t M, const float* bias,
                                const float* gate_logit, int S, int32_t* ids2, float* weights2, Stream stream,
                                const RoutingAlignOut& align = {}, bool release_late = false);

// Caller-owned routing: ids2 / weights2 as launch_routing_with_shared writes them ([M, k + S],
// routed ids offset by S, shared slice s at k + s with weight 1, or sigmoid(x . gate_row) when
// gate_row is given: the router's extra row, in gate_dtype), from the caller's ids / weights
// [M, k]; also zeroes zero[0, zero_n) as launch_router_logits does. An id outside [0, E) adds
// nothing (the device cannot refuse it without a host round trip: callers check first). A plain
// launch (given_routing.cu).
void launch_given_slots(const void* x, DType act, int64_t M, int64_t H, const int32_t* ids, const float* weights,
                        int k, int E, int S, const void* gate_row, DType gate_dtype, int32_t* ids2, float* w2,
                        float* zero, int64_t zero_n, Stream stream);

// y = x with each row's K axis k-permuted for the prefill kernel (kperm_pos in moe_gemm.h: inside
// each 64-element chunk the 32 element pairs as an 8 x 4 transpose). x, y: act [M, H], H a multiple
// of 64, y 16-byte aligned; x may have any 2-byte alignment (16-byte aligned x takes 16-byte loads).
// GEMM1's x for the wgmma kernel's tensor copies (GemmRun::x_by_position): y[p] = x[sorted_ids[p] /
// x_div] k-permuted, for the positions p < min(*ntpp, rows) of the align output whose slot is in
// [0, num_slots); padding positions are not written (they feed discarded token columns). x: [*, H]
// (2-byte elements, any alignment; 16-byte aligned x and H take 16-byte loads); y: [rows, H],
// 16-byte aligned. sorted_ids and ntpp are read on the device (a plain launch after the align).
void launch_kperm_positions(const void* x, int64_t H, const int32_t* sorted_ids, const int32_t* ntpp,
                            int64_t num_slots, int x_div, int64_t rows, void* y, Stream stream);

// Act-order (GPTQ desc_act) activations, gathered once per call: out[s, j] = x[s / k2, perm[ids[s], j]]
// for the M * k2 slots s, so that GEMM1 reads each slot's row in its expert's k order as plain rows
// (GemmRun::x_per_slot) and needs no gather of its own. x: [M, H] (2-byte elements, any
// alignment); ids: [M * k2] kernel expert ids in [0, n_perm); perm: [n_perm, H]; out: [M * k2, H],
// at kperm_pos(j) instead of j with kperm (the prefill kernel's k-permuted rows, H a multiple of
// 64). A programmatic dependent launch: it waits for the previous kernel (the routing chain) before
// reading ids. Only each token's slots j_begin <= j < j_end (default: all k2). ids null: slot j's
// expert is j - j_begin (the shared slices, whose slots need no routing); the kernel then reads
// nothing the chain writes and waits for the previous kernel only at its end.
void launch_gather_slots(const void* x, int64_t M, int64_t H, const int32_t* ids, int k2, const int32_t* perm,
                         int n_perm, void* out, bool kperm, Stream stream, int j_begin = 0, int j_end = -1);

// The top-k sum of GEMM2's per-slot rows (GemmRun WeightedSum): out[t, n] = act(the fp32 sum of
// part[s, t * k2 + j, n] over the token's rows r = j * splits + s), in a fixed order (lane q of 8
// adds rows q, q + 8, ... in turn, then the lanes pairwise) that depends on neither M nor timing: the
// same bits on every run. part: [splits, M * k2, H] in act; H a multiple of 8. Launched with
// programmatic dependent launch after the layer's GEMM2: it waits (griddepcontrol.wait) for the
// previous kernel before reading part.
// out_f32: the sums stored as fp32 (CudaMoeLayer::forward_f32), not rounded to act.
void launch_slot_sum_out(const void* part, int splits, int64_t M, int k2, int64_t H, void* out, DType act,
                         Stream stream, bool out_f32 = false);

}  // namespace wna16::cuda
