// Router logits -> top-k expert ids and weights on the GPU, one warp per token, fp32 math; the
// semantics of route_reference (src/reference/routing.cpp): softmax top-k (+- renormalise),
// DeepSeek-V2 group_limited_greedy (group score = max), DeepSeek-V3 noaux_tc (sigmoid, choose on
// s + bias, group score = sum of the top 2, weights from the unbiased s). Ties go to the lower
// expert index and the lower group index; ids come out best first.
//
// Exactness against the float64 reference:
//  - softmax and group_limited_greedy choose on the fp32 logit itself. exp is monotonic, so the
//    order of the logits is the order of the reference's double probabilities (distinct fp32
//    logits give distinct doubles; equal ones tie in both): the ids are exact on any finite input.
//  - noaux_tc chooses on s + bias, rounded differently in fp32 than in double: ids are exact
//    unless two candidates (or two group scores) lie within a few fp32 ulps of each other.
// Weights are within ~5e-7 relative: exp/sigmoid in accurate fp32 (expf, not __expf), the
// argument rounding of exp(l - max) compensated, sums over at most 32 terms per lane.
// Non-finite logits (which the reference refuses; the GPU cannot throw): a NaN key counts as -inf,
// and ids always stay in [0, E), so a bad token can never send align or the GEMM out of bounds;
// its weights are then unspecified.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "cuda/cuda_check.h"
#include "wna16/cuda_kernels.h"
#include "wna16/error.h"

namespace wna16::cuda {
namespace {

// ---- configuration (may change speed, never results) -------------------------------------------
constexpr int kRouteWarps = 4;  // tokens per block: one warp each
constexpr int kRouteThreads = kRouteWarps * 32;
constexpr int kRouteMaxVpl = 32;  // experts per lane; E <= 32 * kRouteMaxVpl
constexpr int kRouteMaxExperts = 32 * kRouteMaxVpl;
constexpr int kRouteMaxTopK = 32;    // one chosen expert per lane
constexpr int kRouteMaxGroups = 32;  // one group score per lane
static_assert(kRouteMaxVpl <= 32, "the taken-mask of a lane is one 32-bit word");

enum Method : int { kSoftmax = 0, kGroupLimited = 1, kNoaux = 2 };

struct RouteParams {
  const void* logits;
  int dtype;  // 0 f32, 1 bf16, 2 f16
  int64_t M;
  int E;
  int top_k;
  int method;
  bool renormalize;
  int n_group;     // > 1 selects groups first (always applied for noaux_tc, as in the reference)
  int topk_group;
  float scale;     // routed_scaling_factor where the method applies it, else 1
  const float* bias;
  int32_t* ids;
  float* weights;
};

__device__ __forceinline__ float load_logit(const void* p, int dtype, int64_t i) {
  if (dtype == 0) return __ldg(static_cast<const float*>(p) + i);
  const unsigned short u = __ldg(static_cast<const unsigned short*>(p) + i);
  if (dtype == 1) return __uint_as_float(uint32_t(u) << 16);  // bf16 is the top half of an fp32
  return __half2float(__ushort_as_half(u));
}

// (v, i) beats (w, j): larger value, or equal value and lower index. Every lane of a butterfly
// ends with the same winner because this is a total order on (value, index).
__device__ __forceinline__ bool beats(float v, int i, float w, int j) { return v > w || (v == w && i < j); }

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, off);
    const int oi = __shfl_xor_sync(0xffffffffu, i, off);
    if (beats(ov, oi, v, i)) { v = ov; i = oi; }
  }
}

// The same, carrying the winner's weight value w along.
__device__ __forceinline__ void warp_argmax(float& v, int& i, float& w) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, off);
    const int oi = __shfl_xor_sync(0xffffffffu, i, off);
    const float ow = __shfl_xor_sync(0xffffffffu, w, off);
    if (beats(ov, oi, v, i)) { v = ov; i = oi; w = ow; }
  }
}

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

constexpr int kNone = 0x7fffffff;  // index of "no candidate": loses every tie

// One warp per token. Lane l holds experts e = j * 32 + l (j < VPL): coalesced row loads.
template <int VPL>
__global__ void __launch_bounds__(kRouteThreads) moe_routing_kernel(const RouteParams p) {
  // Programmatic dependent launch (no-ops unless the launches carry the attribute): the next
  // kernel (align) may start its set-up now; it waits for this grid's completion before reading
  // topk_ids. And the logits are read only once the previous kernel (the router GEMM) is done.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int lane = threadIdx.x & 31;
  const int64_t m = int64_t(blockIdx.x) * kRouteWarps + (threadIdx.x >> 5);
  if (m >= p.M) return;  // warp-uniform
  const int E = p.E;

  float key[VPL];  // what is chosen on: the logit, or s + bias
  float val[VPL];  // what the weight is made of: exp(l - max), or s
  uint32_t avail = 0;  // bit j: expert j*32+lane exists and may still be chosen
#pragma unroll
  for (int j = 0; j < VPL; ++j) {
    const int e = j * 32 + lane;
    key[j] = -INFINITY;
    val[j] = 0.f;
    if (e < E) {
      key[j] = load_logit(p.logits, p.dtype, m * E + e);
      avail |= 1u << j;
    }
  }

  float total = 1.f;  // softmax denominator over all E (only used without renormalisation)
  if (p.method == kNoaux) {
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      if (avail >> j & 1) {
        const float s = 1.f / (1.f + expf(-key[j]));
        val[j] = s;
        key[j] = s + __ldg(p.bias + j * 32 + lane);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < VPL; ++j) key[j] = isnan(key[j]) ? -INFINITY : key[j];
  if (p.method != kNoaux) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < VPL; ++j) mx = fmaxf(mx, key[j]);
    mx = warp_max(mx);
    float part = 0.f;
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      if (avail >> j & 1) {
        val[j] = exp_diff(key[j], mx);
        part += val[j];
      }
    }
    total = warp_sum(part);
  }

  // Group selection: lane g ends up with group g's score; topk_group rounds of argmax over lanes.
  const bool grouped = p.method == kNoaux || (p.method == kGroupLimited && p.n_group > 1);
  if (grouped) {
    const int per_group = E / p.n_group;
    int group[VPL];  // group of expert j*32+lane
#pragma unroll
    for (int j = 0; j < VPL; ++j) group[j] = (j * 32 + lane) / per_group;
    float gscore = -INFINITY;
    for (int g = 0; g < p.n_group; ++g) {
      float a1 = -INFINITY, a2 = -INFINITY;  // the two best keys of group g in this lane
#pragma unroll
      for (int j = 0; j < VPL; ++j) {
        if ((avail >> j & 1) && group[j] == g) {
          const float k = key[j];
          a2 = fmaxf(a2, fminf(a1, k));
          a1 = fmaxf(a1, k);
        }
      }
      if (p.method == kNoaux) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
          const float b1 = __shfl_xor_sync(0xffffffffu, a1, off);
          const float b2 = __shfl_xor_sync(0xffffffffu, a2, off);
          a2 = fmaxf(fminf(a1, b1), fmaxf(a2, b2));
          a1 = fmaxf(a1, b1);
        }
        a1 += a2;  // sum of the two best, as the reference (per_group >= 2 is validated)
      } else {
        a1 = warp_max(a1);
      }
      if (lane == g) gscore = a1;
    }
    uint32_t kept = 0;
    bool mine = lane < p.n_group;
    for (int r = 0; r < p.topk_group; ++r) {
      float v = mine ? gscore : -INFINITY;
      int i = mine ? lane : kNone;
      warp_argmax(v, i);
      kept |= i < 32 ? 1u << i : 0u;  // i is always a lane here unless a group score is NaN
      if (lane == i) mine = false;
    }
#pragma unroll
    for (int j = 0; j < VPL; ++j)
      if ((avail >> j & 1) && !(kept >> group[j] & 1)) avail &= ~(1u << j);  // group[j] < 32 when avail
  }

  // Top-k: k rounds of warp argmax; lane r keeps the r-th choice.
  int my_id = 0;
  float my_val = 0.f;
  // NOTE: the weight value travels with the winner through the butterfly; picking val[i >> 5] in
  // the owner lane afterwards would be a run-time register index (local memory).
  for (int r = 0; r < p.top_k; ++r) {
    float v = -INFINITY, w = 0.f;
    int i = kNone;
#pragma unroll
    for (int j = 0; j < VPL; ++j)
      if ((avail >> j & 1) && beats(key[j], j * 32 + lane, v, i)) { v = key[j]; i = j * 32 + lane; w = val[j]; }
    warp_argmax(v, i, w);
    if (lane == (i & 31)) avail &= ~(1u << (i >> 5));
    if (lane == r) { my_id = i < E ? i : E - 1; my_val = w; }  // i == kNone only on NaN input
  }

  const bool chosen = lane < p.top_k;
  float w = my_val;
  if (p.renormalize) {
    const float sum = warp_sum(chosen ? my_val : 0.f);
    // NOTE: the reference adds HF's 1e-20 guard for the DeepSeek methods only.
    w = my_val / (p.method == kSoftmax ? sum : sum + 1e-20f);
  } else if (p.method != kNoaux) {
    w = my_val / total;
  }
  w *= p.scale;
  if (chosen) {
    p.ids[m * p.top_k + lane] = my_id;
    p.weights[m * p.top_k + lane] = w;
  }
}

template <int VPL>
void launch_vpl(const RouteParams& p, cudaStream_t s) {
  const unsigned blocks = static_cast<unsigned>((p.M + kRouteWarps - 1) / kRouteWarps);
  moe_routing_kernel<VPL><<<blocks, kRouteThreads, 0, s>>>(p);
}

}  // namespace

void launch_routing(const RoutingConfig& cfg, const void* logits, DType logits_dtype, int64_t M, const float* bias,
                    int32_t* topk_ids, float* topk_weights, Stream stream) {
  cfg.validate();  // the reference's rules, with their messages (E, top_k, n_group, topk_group, ...)
  const int E = cfg.num_experts;
  if (E > kRouteMaxExperts)
    throw Error("routing: num_experts=" + std::to_string(E) + " is above the GPU maximum of " +
                std::to_string(kRouteMaxExperts));
  if (cfg.top_k > kRouteMaxTopK)
    throw Error("routing: top_k=" + std::to_string(cfg.top_k) + " is above the GPU maximum of " +
                std::to_string(kRouteMaxTopK));
  const bool grouped = cfg.method == RoutingMethod::NoauxTc ||
                       (cfg.method == RoutingMethod::GroupLimitedGreedy && cfg.n_group > 1);
  if (grouped && cfg.n_group > kRouteMaxGroups)
    throw Error("routing: n_group=" + std::to_string(cfg.n_group) + " is above the GPU maximum of " +
                std::to_string(kRouteMaxGroups));
  if (M < 0) throw Error("routing: M=" + std::to_string(M) + " is negative");
  if (M > int64_t(0x7fffffff) * kRouteWarps) throw Error("routing: M=" + std::to_string(M) + " is too large");
  if (cfg.method == RoutingMethod::NoauxTc && bias == nullptr)
    throw Error("routing: noaux_tc needs the correction bias (got null)");
  int dtype = 0;
  switch (logits_dtype) {
    case DType::F32: dtype = 0; break;
    case DType::BF16: dtype = 1; break;
    case DType::F16: dtype = 2; break;
  }
  if (M == 0) return;
  if (logits == nullptr || topk_ids == nullptr || topk_weights == nullptr)
    throw Error("routing: a null pointer among logits, topk_ids, topk_weights (M=" + std::to_string(M) + ")");

  RouteParams p;
  p.logits = logits;
  p.dtype = dtype;
  p.M = M;
  p.E = E;
  p.top_k = cfg.top_k;
  p.method = cfg.method == RoutingMethod::SoftmaxTopK ? kSoftmax
             : cfg.method == RoutingMethod::GroupLimitedGreedy ? kGroupLimited
                                                               : kNoaux;
  p.renormalize = cfg.renormalize;
  p.n_group = cfg.n_group;
  p.topk_group = cfg.topk_group;
  // DeepSeek-V2 scales only without renormalisation; V3 always; softmax never (validate() insists on 1).
  const bool scaled = cfg.method == RoutingMethod::NoauxTc ||
                      (cfg.method == RoutingMethod::GroupLimitedGreedy && !cfg.renormalize);
  p.scale = scaled ? static_cast<float>(cfg.routed_scaling_factor) : 1.f;
  p.bias = bias;
  p.ids = topk_ids;
  p.weights = topk_weights;

  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int vpl = (E + 31) / 32;
  if (vpl <= 1) launch_vpl<1>(p, s);
  else if (vpl <= 2) launch_vpl<2>(p, s);
  else if (vpl <= 4) launch_vpl<4>(p, s);
  else if (vpl <= 8) launch_vpl<8>(p, s);
  else if (vpl <= 16) launch_vpl<16>(p, s);
  else launch_vpl<32>(p, s);
  WNA16_CUDA_CHECK_LAUNCH();
}

}  // namespace wna16::cuda
