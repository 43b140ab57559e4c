// The float64 CPU reference: the oracle every backend is compared against. Written for clarity,
// not speed. Also the moe_align_block_size contract that the GPU kernels match bit for bit.
#pragma once
#include <cstdint>
#include <vector>

#include "wna16/half.h"
#include "wna16/moe.h"

namespace wna16 {

struct Routing {
  int64_t M = 0;
  int top_k = 0;
  std::vector<int32_t> ids;      // [M, top_k] expert ids, in selection order (best first)
  std::vector<float> weights;    // [M, top_k] routing weights (already renormalised / scaled)
};

// Router logits [M, E] (fp32) -> top-k ids and weights. Computed in double. Ties are broken toward
// the lower expert index (and the lower group index), deterministically. `bias` is the NoauxTc
// correction bias [E] (ignored by other methods; may be null for them).
Routing route_reference(const RoutingConfig& cfg, const float* logits, int64_t M, const float* bias);

// Router logits of the layer: logits[m, e] = sum_h x[m, h] * router[e, h], float64 accumulation,
// rounded to fp32 (what the GPU computes in fp32 is compared against this within tolerance).
std::vector<float> router_logits_reference(const MoeLayerSpec& spec, const MoeLayerWeights& w,
                                           const float* x, int64_t M);

// Checks a routing decided by the caller: ids and weights [M, top_k] (row-major), 1 <= top_k <= E,
// every id in [0, E), every weight finite. Throws Error naming `who`, the token, the choice and the
// value. Repeated ids within a token are allowed (their contributions add).
void check_routing(const RoutingConfig& cfg, const int32_t* ids, const float* weights, int64_t M, int top_k,
                   const char* who);

// ---- moe_align_block_size contract ---------------------------------------------------------
// Input: topk_ids [num_slots] (num_slots = M * top_k, slot s = token s / top_k, choice s % top_k),
// each in [0, E). Output, with sentinel = num_slots:
//  - sorted_token_ids, length max_padded_slots(num_slots, E, block_m) = num_slots + E*(block_m-1):
//    the slot ids grouped by expert in ascending expert order, slot ids ascending within an expert,
//    each expert's run padded with sentinel up to a multiple of block_m; experts with no slots
//    take no room; every entry past the padded total is the sentinel too.
//  - expert_ids, length max_blocks = ceil(max_padded / block_m): the expert of each block of block_m
//    entries; -1 for every block at or past num_tokens_post_padded / block_m.
//  - num_tokens_post_padded: the padded total (a multiple of block_m).
// The GPU kernel fills the same fixed-size buffers with the same values, with no host sync.
struct AlignResult {
  std::vector<int32_t> sorted_token_ids;
  std::vector<int32_t> expert_ids;
  int32_t num_tokens_post_padded = 0;
};
inline int64_t max_padded_slots(int64_t num_slots, int64_t E, int64_t block_m) {
  return num_slots + E * (block_m - 1);
}
inline int64_t max_align_blocks(int64_t num_slots, int64_t E, int64_t block_m) {
  return (max_padded_slots(num_slots, E, block_m) + block_m - 1) / block_m;
}
// Throws Error for E <= 0, block_m <= 0, or an id outside [0, E) (naming slot and id).
AlignResult align_reference(const int32_t* topk_ids, int64_t num_slots, int E, int block_m);

// One expert's SwiGLU MLP in float64 on dequantized weights: x [M, H] -> out [M, H].
std::vector<double> expert_mlp_reference(const ExpertWeights& e, const double* x, int64_t M);

// The whole layer in float64: x [M, H] (float values, e.g. already rounded to bf16) ->
// out [M, H] = sum over top-k of weight * expert(x) (+ shared expert). Routing uses
// route_reference on router_logits_reference.
std::vector<double> moe_reference(const MoeLayerSpec& spec, const MoeLayerWeights& w,
                                  const float* x, int64_t M, Routing* routing_out = nullptr);

// The layer in float64 with the routing given (r.ids / r.weights [M, r.top_k], checked with
// check_routing): sum over the top-k of weight * expert(x), plus the shared expert. The router is not
// used. moe_reference is route_reference followed by this.
std::vector<double> moe_reference_routed(const MoeLayerSpec& spec, const MoeLayerWeights& w, const float* x,
                                         int64_t M, const Routing& r);

// Relative Frobenius error ||a - b|| / ||b||; NaN or inf anywhere gives +inf.
double rel_error(const double* a, const double* b, int64_t n);
double rel_error(const float* a, const double* b, int64_t n);

// Bitwise comparison of two [rows, cols] arrays of 16-bit floats of type t (bf16 or f16): the first
// row with a differing bit pattern (-1 when identical) and the largest absolute difference of the
// values (infinite where one side is NaN or infinite and the other not). Determinism checks.
struct BitDiff {
  int64_t first_row = -1;
  double max_abs = 0;
};
BitDiff compare_bits(const uint16_t* a, const uint16_t* b, int64_t rows, int64_t cols, DType t);

}  // namespace wna16
