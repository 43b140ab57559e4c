// Device helpers of the routing semantics (sm90_moe_routing.cu), shared with the decode kernel,
// which routes one token itself where the layer skips the routing kernel (route_one_token).
#pragma once
#include <cuda_runtime.h>

#include <cmath>

namespace wna16::cuda {

// (v, i) beats (w, j): larger value, or equal value and lower index. A total order on (value,
// index) for non-NaN values: every butterfly lane ends with the same winner, and ranks are distinct.
__device__ __forceinline__ bool beats(float v, int i, float w, int j) { return v > w || (v == w && i < j); }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// exp(a - b) without the rounding of a - b to fp32 in the argument: a - b = hi + lo exactly
// (TwoSum), exp(hi + lo) ~= exp(hi) * (1 + lo). NOTE: |a - b| ~ 8 would otherwise cost up to
// 5e-7 relative, half the weight tolerance.
__device__ __forceinline__ float exp_diff(float a, float b) {
  const float hi = a - b;
  const float bb = hi - a;
  const float lo = (a - (hi - bb)) + (-b - bb);
  const float e = expf(hi);
  return fmaf(e, lo, e);
}

// One token's softmax top-k over E <= 32 experts, lane e holding expert e's logit (any value
// on lanes >= E): the routing kernel's choice for that token (the order `beats` on the logit, a
// NaN counting as -inf) and its weights (exp(l - max) over the sum of all E, or of the chosen
// ones with renormalisation). The sums are butterflies over the experts' lanes, not the routing
// kernel's over its choice lanes, so a weight may differ from its in the last bit.
struct OneTokenChoice {
  bool chosen;   // lane < E and among the top_k
  int rank;      // the choice's position (0: best)
  float weight;  // valid where chosen
};
__device__ __forceinline__ OneTokenChoice route_one_token(float logit, int E, int top_k, bool renormalize) {
  const int lane = threadIdx.x & 31;
  float key = lane < E ? logit : -INFINITY;
  key = isnan(key) ? -INFINITY : key;
  const float mx = warp_max(key);
  const float val = lane < E ? exp_diff(key, mx) : 0.f;
  int rank = 0;
#pragma unroll
  for (int o = 0; o < 32; ++o) rank += beats(__shfl_sync(0xffffffffu, key, o), o, key, lane) ? 1 : 0;
  const bool chosen = lane < E && rank < top_k;
  const float sum = warp_sum(renormalize ? (chosen ? val : 0.f) : val);
  return {chosen, rank, val / sum};
}

}  // namespace wna16::cuda
