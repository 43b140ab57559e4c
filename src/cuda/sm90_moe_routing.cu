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
//
// Two kernels: moe_routing_kernel (any M; the layer's two-kernel path, followed by the align
// kernel of sm90_moe_align.cu) and moe_route_align_small_kernel (M <= 64 and at most
// kAlignSmallMaxSlots slots: routing and align in one CTA, the same outputs bit for bit; see its
// section below).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>

#include "cuda/align_tuning.h"
#include "cuda/cuda_check.h"
#include "cuda/moe_layer_kernels.h"
#include "wna16/cuda_kernels.h"
#include "wna16/error.h"
#include "wna16/reference.h"

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
  int32_t* ids;      // [M, ld]
  float* weights;    // [M, ld]
  int64_t ld;        // top_k + S
  int S;             // shared-expert slices appended as choices top_k.. with ids E..E+S-1
  const float* gate_logit;  // [M]: their weight is sigmoid(gate_logit[m]); null: weight 1
};

// The logits' dtype is a template parameter: a run-time switch put every load in its own branch
// with the conversion right after it, which made the VPL loads of a lane one dependent DRAM round
// trip each (DeepSeek-V3: 8, plus 8 more for the bias).
template <int DT>
__device__ __forceinline__ float load_logit(const void* p, int64_t i) {
  if constexpr (DT == 0) return __ldg(static_cast<const float*>(p) + i);
  const unsigned short u = __ldg(static_cast<const unsigned short*>(p) + i);
  if constexpr (DT == 1) return __uint_as_float(uint32_t(u) << 16);  // bf16 is the top half of an fp32
  return __half2float(__ushort_as_half(u));
}

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

constexpr int kNone = 0x7fffffff;  // index of "no candidate": loses every tie

// Per-warp shared scratch: the keys of the token (group scores), then the top-k candidates, then
// the chosen ids and values in output order.
template <int VPL>
struct RouteScratch {
  float key[32 * VPL];
  float val[32 * VPL];
  int16_t idx[32 * VPL];  // E <= 1024
  int32_t out_id[kRouteMaxTopK];
  float out_val[kRouteMaxTopK];
};

// One warp per token. Lane l holds experts e = j * 32 + l (j < VPL): coalesced row loads.
// Every reduction that the reference does as a sequence of argmax rounds is done here as a rank
// count in the total order `beats` (value desc, index asc), which gives the same set and order:
//  - group scores: 32 / n_group lanes per group scan the group's keys in shared memory, then a
//    segmented butterfly; all groups at once.
//  - kept groups: each group's rank among the n_group scores (32 independent shuffles).
//  - top-k: T = the k-th best of the 32 lane maxima; every expert in the top k is not beaten by T
//    (k lane maxima are >= T), and nothing beaten by T beats such an expert, so the top k are the
//    ranks < k among the candidates not beaten by T (at most k * VPL, usually about k).
template <int VPL, int DT>
__global__ void __launch_bounds__(kRouteThreads) moe_routing_kernel(const RouteParams p) {
  __shared__ RouteScratch<VPL> scratch[kRouteWarps];
  // Programmatic dependent launch (no-ops unless the launches carry the attribute): the next
  // kernel (align) may start its set-up now; it waits for this grid's completion before reading
  // topk_ids. And the logits are read only once the previous kernel (the router GEMM) is done.
  // NOTE: every thread waits before it may return, so this grid completes only after its
  // predecessor did (the layer's chain relies on that for the router's zero-fill).
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int lane = threadIdx.x & 31;
  const int64_t m = int64_t(blockIdx.x) * kRouteWarps + (threadIdx.x >> 5);
  if (m >= p.M) return;  // warp-uniform
  RouteScratch<VPL>& sc = scratch[threadIdx.x >> 5];
  const int E = p.E;
  const unsigned lt = (1u << lane) - 1u;

  // Every global load of the token is issued here, before the first use: logits, bias, the gate
  // logit. Addresses are clamped into [0, E) instead of branching, so the loads are unconditional
  // and all in flight together: one memory round trip for the whole token.
  float key[VPL];  // what is chosen on: the logit, or s + bias
  float val[VPL];  // what the weight is made of: exp(l - max), or s
  float bia[VPL] = {};
  uint32_t avail = 0;  // bit j: expert j*32+lane exists and may still be chosen
#pragma unroll
  for (int j = 0; j < VPL; ++j) {
    const int e = min(j * 32 + lane, E - 1);
    key[j] = load_logit<DT>(p.logits, m * E + e);
    avail |= j * 32 + lane < E ? 1u << j : 0u;
  }
  const bool noaux = p.method == kNoaux;
  if (noaux) {  // one branch around all the bias loads; their uses come later
#pragma unroll
    for (int j = 0; j < VPL; ++j) bia[j] = __ldg(p.bias + min(j * 32 + lane, E - 1));
  }
  const float gate_logit = p.S > 0 && p.gate_logit != nullptr ? __ldg(p.gate_logit + m) : 0.f;
#pragma unroll
  for (int j = 0; j < VPL; ++j) {
    key[j] = avail >> j & 1 ? key[j] : -INFINITY;
    val[j] = 0.f;
  }

  float total = 1.f;  // softmax denominator over all E (only used without renormalisation)
  if (noaux) {
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      if (avail >> j & 1) {
        const float s = 1.f / (1.f + expf(-key[j]));
        val[j] = s;
        key[j] = s + bia[j];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < VPL; ++j) key[j] = isnan(key[j]) ? -INFINITY : key[j];
  if (!noaux) {
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

  const bool grouped = p.method == kNoaux || (p.method == kGroupLimited && p.n_group > 1);
  if (grouped) {
    const int n_group = p.n_group, per_group = E / n_group;
#pragma unroll
    for (int j = 0; j < VPL; ++j)
      if (avail >> j & 1) sc.key[j * 32 + lane] = key[j];
    __syncwarp();
    // Lanes [g * lpg, (g + 1) * lpg) score group g: max (group_limited) or the sum of the two best
    // (noaux_tc). max/min are exact, so the score is the same float whatever the order.
    int lpg = 1;
    while (lpg * 2 * n_group <= 32) lpg *= 2;
    const int g = lane / lpg;
    float a1 = -INFINITY, a2 = -INFINITY;  // the two best keys this lane saw
    if (g < n_group) {
      const int end = (g + 1) * per_group;
      for (int e = g * per_group + lane % lpg; e < end; e += lpg) {
        const float k = sc.key[e];
        a2 = fmaxf(a2, fminf(a1, k));
        a1 = fmaxf(a1, k);
      }
    }
    for (int off = lpg >> 1; off > 0; off >>= 1) {  // stays inside the aligned segment of lpg lanes
      const float b1 = __shfl_xor_sync(0xffffffffu, a1, off);
      const float b2 = __shfl_xor_sync(0xffffffffu, a2, off);
      a2 = fmaxf(fminf(a1, b1), fmaxf(a2, b2));
      a1 = fmaxf(a1, b1);
    }
    // per_group >= 2 is validated for noaux_tc.
    const float seg_score = p.method == kNoaux ? a1 + a2 : a1;
    // Lane g (< n_group) takes group g's score; NaN (only from non-finite bias) counts as -inf.
    float gs = __shfl_sync(0xffffffffu, seg_score, (lane * lpg) & 31);
    gs = lane < n_group && !isnan(gs) ? gs : -INFINITY;
    // Rank of group `lane` among all groups. Lanes >= n_group hold (-inf, higher index): they beat
    // no real group, so the loop needs no bound.
    int rank = 0;
#pragma unroll
    for (int h = 0; h < 32; ++h) rank += beats(__shfl_sync(0xffffffffu, gs, h), h, gs, lane) ? 1 : 0;
    const uint32_t kept = __ballot_sync(0xffffffffu, lane < n_group && rank < p.topk_group);
#pragma unroll
    for (int j = 0; j < VPL; ++j)
      if ((avail >> j & 1) && !(kept >> ((j * 32 + lane) / per_group) & 1)) avail &= ~(1u << j);
    __syncwarp();  // every lane is done reading sc.key before the candidates overwrite it
  }

  // Lane maximum (ascending j: the lower index wins a tie), and its rank among the 32 lanes.
  float hv = -INFINITY;
  int hi = kNone;
#pragma unroll
  for (int j = 0; j < VPL; ++j)
    if ((avail >> j & 1) && beats(key[j], j * 32 + lane, hv, hi)) { hv = key[j]; hi = j * 32 + lane; }
  int hrank = 0;
#pragma unroll
  for (int o = 0; o < 32; ++o)
    hrank += beats(__shfl_sync(0xffffffffu, hv, o), __shfl_sync(0xffffffffu, hi, o), hv, hi) ? 1 : 0;
  // T: the k-th best lane maximum; with fewer than k lanes holding a candidate, (-inf, none), which
  // beats nothing. Real maxima have distinct indices, hence distinct ranks: one lane matches.
  const uint32_t has = __ballot_sync(0xffffffffu, hi != kNone);
  const uint32_t at_k = __ballot_sync(0xffffffffu, hi != kNone && hrank == p.top_k - 1);
  float tv = -INFINITY;
  int ti = kNone;
  if (__popc(has) >= p.top_k && at_k != 0) {
    const int tl = __ffs(at_k) - 1;
    tv = __shfl_sync(0xffffffffu, hv, tl);
    ti = __shfl_sync(0xffffffffu, hi, tl);
  }

  // Candidates: available and not beaten by T, compacted in (j, lane) order into shared memory.
  if (lane < kRouteMaxTopK) {
    sc.out_id[lane] = kNone;
    sc.out_val[lane] = 0.f;
  }
  int n_cand = 0;
#pragma unroll
  for (int j = 0; j < VPL; ++j) {
    const int e = j * 32 + lane;
    const bool c = (avail >> j & 1) && !beats(tv, ti, key[j], e);
    const uint32_t b = __ballot_sync(0xffffffffu, c);
    if (c) {
      const int pos = n_cand + __popc(b & lt);
      sc.key[pos] = key[j];
      sc.val[pos] = val[j];
      sc.idx[pos] = static_cast<int16_t>(e);
    }
    n_cand += __popc(b);
  }
  __syncwarp();
  // Rank of each candidate among the candidates; ranks < top_k are the output positions.
  for (int c = lane; c < n_cand; c += 32) {
    const float cv = sc.key[c];
    const int ci = sc.idx[c];
    int r = 0;
    for (int d = 0; d < n_cand; ++d) r += beats(sc.key[d], sc.idx[d], cv, ci) ? 1 : 0;
    if (r < p.top_k) {
      sc.out_id[r] = ci;
      sc.out_val[r] = sc.val[c];
    }
  }
  __syncwarp();

  const bool chosen = lane < p.top_k;
  int my_id = 0;
  float my_val = 0.f;
  if (chosen) {
    const int i = sc.out_id[lane];
    my_id = i < E ? i : E - 1;  // i == kNone cannot happen on valid configs; ids stay in [0, E) anyway
    my_val = sc.out_val[lane];
  }
  float w = my_val;
  if (p.renormalize) {
    const float sum = warp_sum(chosen ? my_val : 0.f);
    // NOTE: the reference adds HF's 1e-20 guard for the DeepSeek methods only.
    w = my_val / (p.method == kSoftmax ? sum : sum + 1e-20f);
  } else if (p.method != kNoaux) {
    w = my_val / total;
  }
  w *= p.scale;
  const int64_t row = m * p.ld;
  if (chosen) {
    p.ids[row + lane] = my_id;
    p.weights[row + lane] = w;
  }
  // The S shared-expert slices as extra choices (the layer's append step, fused).
  if (p.S > 0) {
    float sw = 1.f;
    if (p.gate_logit) sw = 1.0f / (1.0f + expf(-gate_logit));
    for (int s = lane; s < p.S; s += 32) {
      p.ids[row + p.top_k + s] = E + s;
      p.weights[row + p.top_k + s] = sw;
    }
  }
}

template <int VPL, int DT>
void launch_vpl_dt(const RouteParams& p, cudaStream_t s, bool pdl) {
  const unsigned blocks = static_cast<unsigned>((p.M + kRouteWarps - 1) / kRouteWarps);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kRouteThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  WNA16_CUDA_CHECK(cudaLaunchKernelEx(&cfg, moe_routing_kernel<VPL, DT>, p));
}

template <int VPL>
void launch_vpl(const RouteParams& p, cudaStream_t s, bool pdl) {
  if (p.dtype == 0) launch_vpl_dt<VPL, 0>(p, s, pdl);
  else if (p.dtype == 1) launch_vpl_dt<VPL, 1>(p, s, pdl);
  else launch_vpl_dt<VPL, 2>(p, s, pdl);
}

}  // namespace

namespace {

// The argument rules every routing launcher shares (throws Error naming the bad value).
void check_routing_args(const RoutingConfig& cfg, int64_t M, const float* bias, int S) {
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
  if (S < 0 || S > kRouteMaxExperts)
    throw Error("routing: S=" + std::to_string(S) + " shared slices is outside [0, " +
                std::to_string(kRouteMaxExperts) + "]");
  if (cfg.method == RoutingMethod::NoauxTc && bias == nullptr)
    throw Error("routing: noaux_tc needs the correction bias (got null)");
}

// The kernel's method code and weight scale for cfg.
int method_code(const RoutingConfig& cfg) {
  return cfg.method == RoutingMethod::SoftmaxTopK ? kSoftmax
         : cfg.method == RoutingMethod::GroupLimitedGreedy ? kGroupLimited
                                                           : kNoaux;
}
float weight_scale(const RoutingConfig& cfg) {
  // DeepSeek-V2 scales only without renormalisation; V3 always; softmax never (validate() insists on 1).
  const bool scaled = cfg.method == RoutingMethod::NoauxTc ||
                      (cfg.method == RoutingMethod::GroupLimitedGreedy && !cfg.renormalize);
  return scaled ? static_cast<float>(cfg.routed_scaling_factor) : 1.f;
}

void launch_routing_impl(const RoutingConfig& cfg, const void* logits, DType logits_dtype, int64_t M,
                         const float* bias, const float* gate_logit, int S, int32_t* topk_ids, float* topk_weights,
                         bool pdl, cudaStream_t s) {
  check_routing_args(cfg, M, bias, S);
  const int E = cfg.num_experts;
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
  p.method = method_code(cfg);
  p.renormalize = cfg.renormalize;
  p.n_group = cfg.n_group;
  p.topk_group = cfg.topk_group;
  p.scale = weight_scale(cfg);
  p.bias = bias;
  p.ids = topk_ids;
  p.weights = topk_weights;
  p.ld = cfg.top_k + S;
  p.S = S;
  p.gate_logit = S > 0 ? gate_logit : nullptr;

  const int vpl = (E + 31) / 32;
  if (vpl <= 1) launch_vpl<1>(p, s, pdl);
  else if (vpl <= 2) launch_vpl<2>(p, s, pdl);
  else if (vpl <= 4) launch_vpl<4>(p, s, pdl);
  else if (vpl <= 8) launch_vpl<8>(p, s, pdl);
  else if (vpl <= 16) launch_vpl<16>(p, s, pdl);
  else launch_vpl<32>(p, s, pdl);
}

// ---- fused routing + align for small slot counts (the decode case) ------------------------------
// One launch of one CTA does what moe_routing_kernel (above, with the shared slices appended) and
// then the align kernel (sm90_moe_align.cu) do, with the same outputs bit for bit: ids2 / weights2
// from the same fp32 arithmetic (the top-k set and order are fixed by the total order (value desc,
// index asc), the weights by the same expressions in the same order), and the align contract of
// align_reference. Nothing travels through global memory between the two steps:
//  1. set-up (before griddepcontrol.wait, shared memory only): tokmask[e], a 64-bit mask of the
//     tokens that chose expert e, cleared; the shared slices' masks are all tokens.
//  2. routing: warp w routes tokens w, w + route_warps (at most two); every global load of the token
//     is issued before the first use. The choice is made on 64-bit keys (the order-preserving bits
//     of the fp32 value above the inverted expert index) so that "beats" is one integer compare:
//     T = the k-th best of the 32 lane maxima (a rank count through shared memory), candidates =
//     the keys >= T (at most k * VPL), their ranks among themselves give the output order. Each
//     chosen expert sets its token's bit in tokmask (shared atomicOr).
//  3. one barrier; warp 0 turns the masks into counts, pads them to block_m and scans them
//     (lane l owns experts [l * vpe, l * vpe + vpe): serial sums, one warp scan); one barrier.
//  4. the routing lanes write their slots' positions from registers: offs[e] + the earlier tokens
//     of e (popcount of the mask below the token); every thread fills padding, expert_ids and the
//     sentinel tail. Positions only depend on (expert, slot): deterministic and stable.
// Threads per CTA at most, by the registers a lane needs for its VPL keys and values: 32 warps
// (64 registers) up to VPL = 8 (E <= 256), 16 warps (128) for VPL = 16, 8 warps for VPL = 32 (which
// spills at 128 registers; the two-kernel routing uses ~150).
constexpr int fused_max_threads(int vpl) { return vpl <= 8 ? 1024 : vpl <= 16 ? 512 : 256; }
constexpr int kFusedMinWarps = 8;       // the fill after routing is spread over at least 256 threads
constexpr int kFusedMaxTokens = 64;     // one 64-bit token mask per expert
constexpr int kFusedTokensPerWarp = 2;  // more would serialise the routing: the two-kernel path is faster
constexpr int kFusedMaxBlockM = 1024;   // keeps the reciprocal divisions below exact (n * d < 2^32)
// Dynamic shared memory at most (set once per device as the kernels' attribute): DeepSeek-V3 at
// M = 64 takes 32 routing warps x 1.8 KB + 4 KB.
constexpr size_t kFusedSmemBudget = 96 * 1024;

struct FusedParams {
  const float* logits;      // [M, E] fp32
  const float* bias;        // [E] (noaux_tc) or null
  const float* gate_logit;  // [M] or null
  int M, E, top_k, method, n_group, topk_group, per_group;
  uint32_t group_magic;  // floor(2^32 / per_group) + 1 (per_group >= 2)
  bool renormalize;
  float scale;
  int S, k2, E2;
  int32_t* ids2;  // [M, k2]
  float* w2;      // [M, k2]
  int block_m;
  uint32_t bm_magic;  // floor(2^32 / block_m) + 1 (block_m >= 2)
  int padded_cap, num_blocks;
  int32_t* sorted;
  int32_t* expert_ids;
  int32_t* ntpp;
  int route_warps;
  int cap;                       // candidates per warp: top_k * VPL
  uint32_t scratch_bytes;        // per routing warp
  uint32_t off_scratch, off_offs, off_cnt;  // byte offsets in dynamic shared memory
};

// n / d for n * d < 2^32 (magic = floor(2^32 / d) + 1; d == 1 has no 32-bit magic).
__device__ __forceinline__ int div_small(int n, int d, uint32_t magic) {
  return d == 1 ? n : static_cast<int>(__umulhi(static_cast<uint32_t>(n), magic));
}

// Larger key = better choice: the fp32 order of v (-0 as +0, as the float compare has it; NaN never
// gets here) above the inverted index (lower index wins a tie). 0 is below every real key (-inf
// with any index is 0x007fffff....), so it marks "no candidate".
__device__ __forceinline__ uint64_t order_key(float v, int idx) {
  uint32_t u = __float_as_uint(v);
  if (u == 0x80000000u) u = 0u;
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (uint64_t(u) << 32) | uint64_t(0xffffffffu - uint32_t(idx));
}
__device__ __forceinline__ int key_index(uint64_t k) { return static_cast<int>(0xffffffffu - uint32_t(k)); }

__device__ __forceinline__ uint64_t shfl_u64(uint64_t v, int src) {
  const uint32_t lo = __shfl_sync(0xffffffffu, uint32_t(v), src);
  const uint32_t hi = __shfl_sync(0xffffffffu, uint32_t(v >> 32), src);
  return (uint64_t(hi) << 32) | lo;
}

// Rank of `mine` among the n keys at k[0..n) (how many are larger); k is warp-shared, read by
// broadcast, two keys per 16-byte load.
__device__ __forceinline__ int rank_among(const uint64_t* k, int n, uint64_t mine) {
  int r = 0;
  int d = 0;
  for (; d + 4 <= n; d += 4) {
    const ulonglong2 a = *reinterpret_cast<const ulonglong2*>(k + d);
    const ulonglong2 b = *reinterpret_cast<const ulonglong2*>(k + d + 2);
    r += (a.x > mine) + (a.y > mine) + (b.x > mine) + (b.y > mine);
  }
  for (; d < n; ++d) r += k[d] > mine;
  return r;
}

template <int VPL>
__global__ void __launch_bounds__(fused_max_threads(VPL)) moe_route_align_small_kernel(const FusedParams p) {
  extern __shared__ __align__(16) unsigned char fsm[];
  uint64_t* tokmask = reinterpret_cast<uint64_t*>(fsm);                  // [E2]
  int32_t* offs = reinterpret_cast<int32_t*>(fsm + p.off_offs);          // [E2 + 1] padded offsets
  int32_t* cnt = reinterpret_cast<int32_t*>(fsm + p.off_cnt);            // [E2] slots per expert
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nthreads = static_cast<int>(blockDim.x);
  const int E = p.E, E2 = p.E2, M = p.M;

  // 1. Set-up: shared memory only, so it may overlap the router (programmatic dependent launch).
  const uint64_t all_tokens = M >= 64 ? ~0ull : (1ull << M) - 1ull;
  for (int e = tid; e < E2; e += nthreads) tokmask[e] = e < E ? 0ull : all_tokens;
  __syncthreads();
  // NOTE: every thread waits before its first global access and before it may exit, so this grid
  // completes only after the router did (the chain relies on that for the router's zero-fill).
  // GEMM1 (a programmatic dependent that waits for this grid before anything) may launch now.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");

  // 2. Routing, one warp per token.
  const unsigned lt = (1u << lane) - 1u;
  int my_ids[kFusedTokensPerWarp];  // lane < top_k: the expert of slot (token, lane)
  const bool noaux = p.method == kNoaux;
  const bool grouped = (noaux || p.method == kGroupLimited) && p.n_group > 1;
  unsigned char* scr = fsm + p.off_scratch + size_t(warp) * p.scratch_bytes;
  uint64_t* lmax = reinterpret_cast<uint64_t*>(scr);                     // [32]: lane maxima, group keys
  uint64_t* cand = reinterpret_cast<uint64_t*>(scr + 256);               // [cap]; the token's keys before
  float* gkey = reinterpret_cast<float*>(scr + 256);                     //   (grouped: [E] floats)
  const uint32_t cand_bytes = max(uint32_t(p.cap) * 8u, (uint32_t(E) * 4u + 7u) & ~7u);
  float* cval = reinterpret_cast<float*>(scr + 256 + cand_bytes);        // [cap]
  int32_t* out_id = reinterpret_cast<int32_t*>(scr + 256 + cand_bytes + ((uint32_t(p.cap) * 4u + 7u) & ~7u));
  float* out_val = reinterpret_cast<float*>(out_id + 32);

#pragma unroll
  for (int t = 0; t < kFusedTokensPerWarp; ++t) {
    my_ids[t] = 0;
    const int m = warp + t * p.route_warps;
    if (warp >= p.route_warps || m >= M) continue;  // warp-uniform

    // Every global load of the token first: logits, bias (into val, its first use is the sum
    // below), the gate logit. Clamped addresses: no branch between the loads.
    float key[VPL], val[VPL];
    uint32_t avail = 0;
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      const int e = min(j * 32 + lane, E - 1);
      key[j] = __ldg(p.logits + int64_t(m) * E + e);
      val[j] = 0.f;
      avail |= j * 32 + lane < E ? 1u << j : 0u;
    }
    if (noaux) {
#pragma unroll
      for (int j = 0; j < VPL; ++j) val[j] = __ldg(p.bias + min(j * 32 + lane, E - 1));
    }
    const float gate_logit = p.S > 0 && p.gate_logit != nullptr ? __ldg(p.gate_logit + m) : 0.f;
    out_id[lane] = kNone;  // the output slots of this token start empty
    out_val[lane] = 0.f;

    // The same arithmetic as moe_routing_kernel, expression for expression.
#pragma unroll
    for (int j = 0; j < VPL; ++j) key[j] = avail >> j & 1 ? key[j] : -INFINITY;
    float total = 1.f;
    if (noaux) {
#pragma unroll
      for (int j = 0; j < VPL; ++j) {
        const float b = val[j];
        val[j] = 0.f;
        if (avail >> j & 1) {
          const float s = 1.f / (1.f + expf(-key[j]));
          val[j] = s;
          key[j] = s + b;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < VPL; ++j) key[j] = isnan(key[j]) ? -INFINITY : key[j];
    if (!noaux) {
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
      if (!p.renormalize) total = warp_sum(part);  // only used without renormalisation
    }

    if (grouped) {  // n_group == 1 keeps the only group: nothing to do
      const int n_group = p.n_group, per_group = p.per_group;
#pragma unroll
      for (int j = 0; j < VPL; ++j)
        if (avail >> j & 1) gkey[j * 32 + lane] = key[j];
      __syncwarp();
      // Lanes [g * lpg, (g + 1) * lpg) score group g, four keys per step (loads in flight
      // together). The top two as a multiset do not depend on the order, so neither does the score.
      int lpg = 1;
      while (lpg * 2 * n_group <= 32) lpg *= 2;
      const int g = lane / lpg;
      float a1 = -INFINITY, a2 = -INFINITY;
      if (g < n_group) {
        const int end = (g + 1) * per_group;
        for (int e = g * per_group + lane % lpg; e < end; e += 4 * lpg) {
          float v[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) v[u] = e + u * lpg < end ? gkey[e + u * lpg] : -INFINITY;
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            a2 = fmaxf(a2, fminf(a1, v[u]));
            a1 = fmaxf(a1, v[u]);
          }
        }
      }
      for (int off = lpg >> 1; off > 0; off >>= 1) {
        const float b1 = __shfl_xor_sync(0xffffffffu, a1, off);
        const float b2 = __shfl_xor_sync(0xffffffffu, a2, off);
        a2 = fmaxf(fminf(a1, b1), fmaxf(a2, b2));
        a1 = fmaxf(a1, b1);
      }
      const float seg_score = noaux ? a1 + a2 : a1;
      float gs = __shfl_sync(0xffffffffu, seg_score, (lane * lpg) & 31);
      gs = !isnan(gs) ? gs : -INFINITY;
      const uint64_t gk = lane < n_group ? order_key(gs, lane) : 0ull;
      lmax[lane] = gk;
      __syncwarp();
      const int grank = rank_among(lmax, n_group, gk);
      const uint32_t kept = __ballot_sync(0xffffffffu, lane < n_group && grank < p.topk_group);
#pragma unroll
      for (int j = 0; j < VPL; ++j) {
        const int grp = div_small(j * 32 + lane, per_group, p.group_magic);
        if ((avail >> j & 1) && !(kept >> grp & 1)) avail &= ~(1u << j);
      }
      __syncwarp();  // lmax and gkey are read by every lane before they are overwritten below
    }

    // Lane maximum; T = the k-th best lane maximum (0 when fewer than k lanes hold one).
    uint64_t hk = 0;
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      const uint64_t k64 = avail >> j & 1 ? order_key(key[j], j * 32 + lane) : 0ull;
      hk = k64 > hk ? k64 : hk;
    }
    lmax[lane] = hk;
    __syncwarp();
    const int hrank = rank_among(lmax, 32, hk);
    const uint32_t has = __ballot_sync(0xffffffffu, hk != 0);
    const uint32_t at_k = __ballot_sync(0xffffffffu, hk != 0 && hrank == p.top_k - 1);
    uint64_t T = 0;
    if (__popc(has) >= p.top_k && at_k != 0) T = shfl_u64(hk, __ffs(at_k) - 1);  // warp-uniform branch

    // Candidates: the keys >= T, compacted in (j, lane) order (at most top_k * VPL of them).
    int n_cand = 0;
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      const uint64_t k64 = avail >> j & 1 ? order_key(key[j], j * 32 + lane) : 0ull;
      const bool c = k64 != 0 && k64 >= T;
      const uint32_t b = __ballot_sync(0xffffffffu, c);
      if (c) {
        const int pos = n_cand + __popc(b & lt);
        cand[pos] = k64;
        cval[pos] = val[j];
      }
      n_cand += __popc(b);
    }
    __syncwarp();
    for (int c = lane; c < n_cand; c += 32) {
      const uint64_t ck = cand[c];
      const int r = rank_among(cand, n_cand, ck);
      if (r < p.top_k) {
        out_id[r] = key_index(ck);
        out_val[r] = cval[c];
      }
    }
    __syncwarp();

    const bool chosen = lane < p.top_k;
    int my_id = 0;
    float my_val = 0.f;
    if (chosen) {
      const int i = out_id[lane];
      my_id = i < E ? i : E - 1;
      my_val = out_val[lane];
    }
    float w = my_val;
    if (p.renormalize) {
      const float sum = warp_sum(chosen ? my_val : 0.f);
      w = my_val / (p.method == kSoftmax ? sum : sum + 1e-20f);
    } else if (p.method != kNoaux) {
      w = my_val / total;
    }
    w *= p.scale;
    const int64_t row = int64_t(m) * p.k2;
    if (chosen) {
      p.ids2[row + lane] = my_id;
      p.w2[row + lane] = w;
      atomicOr(reinterpret_cast<unsigned long long*>(tokmask + my_id), 1ull << m);
    }
    if (p.S > 0) {
      float sw = 1.f;
      if (p.gate_logit) sw = 1.0f / (1.0f + expf(-gate_logit));
      for (int s = lane; s < p.S; s += 32) {
        p.ids2[row + p.top_k + s] = E + s;
        p.w2[row + p.top_k + s] = sw;
      }
    }
    my_ids[t] = my_id;
    __syncwarp();  // the scratch is reused by the next token
  }
  __syncthreads();  // every token's mask bits are set

  // 3. Counts, padded sizes and their exclusive scan over the experts, by warp 0.
  if (warp == 0) {
    const int vpe = (E2 + 31) / 32;
    const int e0 = lane * vpe, e1 = min(e0 + vpe, E2);
    int sum = 0;
    for (int e = e0; e < e1; ++e) {
      const int c = __popcll(tokmask[e]);
      sum += div_small(c + p.block_m - 1, p.block_m, p.bm_magic) * p.block_m;
    }
    int incl = sum;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += n;
    }
    int run = incl - sum;
    for (int e = e0; e < e1; ++e) {
      const int c = __popcll(tokmask[e]);
      offs[e] = run;
      cnt[e] = c;
      run += div_small(c + p.block_m - 1, p.block_m, p.bm_magic) * p.block_m;
    }
    if (lane == 31) offs[E2] = incl;
  }
  __syncthreads();

  // 4. The slots, from the routing lanes' registers.
#pragma unroll
  for (int t = 0; t < kFusedTokensPerWarp; ++t) {
    const int m = warp + t * p.route_warps;
    if (warp >= p.route_warps || m >= M) continue;
    const int row = m * p.k2;
    if (lane < p.top_k) {
      const int e = my_ids[t];
      const uint64_t below = (1ull << m) - 1ull;
      p.sorted[offs[e] + __popcll(tokmask[e] & below)] = row + lane;
    }
    for (int s = lane; s < p.S; s += 32) p.sorted[offs[E + s] + m] = row + p.top_k + s;  // every token has it
  }
  // Padding of every expert's run and its blocks' expert ids; the padding and the slots never
  // overlap, so no ordering with the stores above is needed.
  const int sentinel = M * p.k2;
  for (int e = tid; e < E2; e += nthreads) {
    const int o0 = offs[e], o1 = offs[e + 1], c = cnt[e];
    for (int q = o0 + c; q < o1; ++q) p.sorted[q] = sentinel;
    const int b1 = div_small(o1, p.block_m, p.bm_magic);
    for (int b = div_small(o0, p.block_m, p.bm_magic); b < b1; ++b) p.expert_ids[b] = e;
  }
  // The tail past the padded total: sentinel, and -1 for its blocks.
  const int total = offs[E2];
  int q0 = total;
  if ((reinterpret_cast<uintptr_t>(p.sorted) & 15u) == 0) {
    const int a0 = min(p.padded_cap, (total + 3) & ~3);
    for (int q = total + tid; q < a0; q += nthreads) p.sorted[q] = sentinel;
    const int n4 = max(0, (p.padded_cap - a0) / 4);
    int4* s4 = reinterpret_cast<int4*>(p.sorted + a0);
    for (int i = tid; i < n4; i += nthreads) s4[i] = make_int4(sentinel, sentinel, sentinel, sentinel);
    q0 = a0 + 4 * n4;
  }
  for (int q = q0 + tid; q < p.padded_cap; q += nthreads) p.sorted[q] = sentinel;
  for (int b = div_small(total, p.block_m, p.bm_magic) + tid; b < p.num_blocks; b += nthreads) p.expert_ids[b] = -1;
  if (tid == 0) *p.ntpp = total;
}

// Everything the launch needs, or ok = false where the fused kernel does not apply.
struct FusedPlan {
  bool ok = false;
  int vpl = 1, nwarps = 0, route_warps = 0, cap = 0;
  uint32_t scratch_bytes = 0, off_scratch = 0, off_offs = 0, off_cnt = 0;
  size_t smem = 0;
};

FusedPlan plan_fused(const RoutingConfig& cfg, int64_t M, int S, int block_m) {
  FusedPlan pl;
  const int E = cfg.num_experts, k = cfg.top_k;
  if (E < 1 || E > kRouteMaxExperts || k < 1 || k > kRouteMaxTopK || S < 0) return pl;
  const int64_t E2 = int64_t(E) + S, slots = M * (int64_t(k) + S);
  if (M < 1 || M > kFusedMaxTokens || slots > kAlignSmallMaxSlots || E2 > kRouteMaxExperts) return pl;
  if (block_m < 1 || block_m > kFusedMaxBlockM) return pl;
  if (max_padded_slots(slots, E2, block_m) > INT32_MAX) return pl;
  const int need = (E + 31) / 32;
  pl.vpl = need <= 1 ? 1 : need <= 2 ? 2 : need <= 4 ? 4 : need <= 8 ? 8 : need <= 16 ? 16 : 32;
  pl.cap = k * pl.vpl;
  auto up8 = [](uint64_t b) { return uint32_t((b + 7) / 8 * 8); };
  const uint32_t cand_bytes = std::max<uint32_t>(uint32_t(pl.cap) * 8u, up8(uint64_t(E) * 4));
  pl.scratch_bytes = (256 + cand_bytes + up8(uint64_t(pl.cap) * 4) + 256 + 15u) / 16u * 16u;  // 16-byte loads
  pl.off_offs = up8(uint64_t(E2) * 8);
  pl.off_cnt = pl.off_offs + up8(uint64_t(E2 + 1) * 4);
  pl.off_scratch = (pl.off_cnt + up8(uint64_t(E2) * 4) + 15u) / 16u * 16u;
  pl.nwarps = int(std::min<int64_t>(fused_max_threads(pl.vpl) / 32, std::max<int64_t>(kFusedMinWarps, M)));
  // (M > 32 needs 32 warps for two tokens each: VPL <= 8)
  if (pl.off_scratch >= kFusedSmemBudget) return pl;
  pl.route_warps = int(std::min<size_t>(size_t(pl.nwarps), (kFusedSmemBudget - pl.off_scratch) / pl.scratch_bytes));
  if (pl.route_warps < 1 || (M + pl.route_warps - 1) / pl.route_warps > kFusedTokensPerWarp) return pl;
  pl.smem = pl.off_scratch + size_t(pl.route_warps) * pl.scratch_bytes;
  pl.ok = true;
  return pl;
}

uint32_t magic_for(int d) { return d <= 1 ? 0u : uint32_t((uint64_t(1) << 32) / uint64_t(d) + 1); }

using FusedKernel = void (*)(FusedParams);
constexpr FusedKernel kFusedKernels[] = {moe_route_align_small_kernel<1>, moe_route_align_small_kernel<2>,
                                         moe_route_align_small_kernel<4>, moe_route_align_small_kernel<8>,
                                         moe_route_align_small_kernel<16>, moe_route_align_small_kernel<32>};

// cudaFuncAttributeMaxDynamicSharedMemorySize = kFusedSmemBudget on every instantiation, once per
// device. NOTE: may run inside a stream capture: not stream work, so relaxed capture mode.
void allow_fused_smem() {
  constexpr int kMaxDevices = 64;
  static std::array<std::once_flag, kMaxDevices> once;
  int dev = 0;
  WNA16_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices)
    throw Error("routing+align: device ordinal " + std::to_string(dev) + " is too large");
  std::call_once(once[size_t(dev)], [] {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    cudaError_t e = cudaSuccess;
    for (FusedKernel k : kFusedKernels)
      if (e == cudaSuccess)
        e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kFusedSmemBudget));
    cudaThreadExchangeStreamCaptureMode(&mode);
    WNA16_CUDA_CHECK(e);
  });
}

}  // namespace

bool routing_align_small_fits(const RoutingConfig& cfg, int64_t M, int S, int block_m) {
  return plan_fused(cfg, M, S, block_m).ok;
}

void launch_routing_align_small(const RoutingConfig& cfg, const float* logits, int64_t M, const float* bias,
                                const float* gate_logit, int S, int32_t* ids2, float* weights2, int block_m,
                                int32_t* sorted_token_ids, int32_t* expert_ids, int32_t* num_tokens_post_padded,
                                Stream stream) {
  check_routing_args(cfg, M, bias, S);
  const FusedPlan pl = plan_fused(cfg, M, S, block_m);
  if (!pl.ok)
    throw Error("routing+align: M=" + std::to_string(M) + " top_k=" + std::to_string(cfg.top_k) +
                " S=" + std::to_string(S) + " E=" + std::to_string(cfg.num_experts) + " block_m=" +
                std::to_string(block_m) + " is outside the fused kernel's range (routing_align_small_fits)");
  if (logits == nullptr || ids2 == nullptr || weights2 == nullptr || sorted_token_ids == nullptr ||
      expert_ids == nullptr || num_tokens_post_padded == nullptr)
    throw Error("routing+align: a null pointer among logits, ids2, weights2, sorted_token_ids, expert_ids, "
                "num_tokens_post_padded");
  const int E = cfg.num_experts;
  FusedParams p{};
  p.logits = logits;
  p.bias = bias;
  p.gate_logit = S > 0 ? gate_logit : nullptr;
  p.M = int(M);
  p.E = E;
  p.top_k = cfg.top_k;
  p.method = method_code(cfg);
  p.n_group = cfg.n_group;
  p.topk_group = cfg.topk_group;
  p.per_group = E / std::max(1, cfg.n_group);
  p.group_magic = magic_for(p.per_group);
  p.renormalize = cfg.renormalize;
  p.scale = weight_scale(cfg);
  p.S = S;
  p.k2 = cfg.top_k + S;
  p.E2 = E + S;
  p.ids2 = ids2;
  p.w2 = weights2;
  p.block_m = block_m;
  p.bm_magic = magic_for(block_m);
  const int64_t slots = M * p.k2;
  p.padded_cap = int(max_padded_slots(slots, p.E2, block_m));
  p.num_blocks = int(max_align_blocks(slots, p.E2, block_m));
  p.sorted = sorted_token_ids;
  p.expert_ids = expert_ids;
  p.ntpp = num_tokens_post_padded;
  p.route_warps = pl.route_warps;
  p.cap = pl.cap;
  p.scratch_bytes = pl.scratch_bytes;
  p.off_scratch = pl.off_scratch;
  p.off_offs = pl.off_offs;
  p.off_cnt = pl.off_cnt;

  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t lc = {};
  lc.gridDim = dim3(1);
  lc.blockDim = dim3(unsigned(pl.nwarps * 32));
  lc.dynamicSmemBytes = pl.smem;
  lc.stream = static_cast<cudaStream_t>(stream);
  lc.attrs = attr;
  lc.numAttrs = 1;
  const int slot = pl.vpl == 1 ? 0 : pl.vpl == 2 ? 1 : pl.vpl == 4 ? 2 : pl.vpl == 8 ? 3 : pl.vpl == 16 ? 4 : 5;
  if (pl.smem > 48 * 1024) allow_fused_smem();
  WNA16_CUDA_CHECK(cudaLaunchKernelEx(&lc, kFusedKernels[slot], p));
}

void launch_routing(const RoutingConfig& cfg, const void* logits, DType logits_dtype, int64_t M, const float* bias,
                    int32_t* topk_ids, float* topk_weights, Stream stream) {
  launch_routing_impl(cfg, logits, logits_dtype, M, bias, nullptr, 0, topk_ids, topk_weights, false,
                      static_cast<cudaStream_t>(stream));
}

void launch_routing_with_shared(const RoutingConfig& cfg, const float* logits, int64_t M, const float* bias,
                                const float* gate_logit, int S, int32_t* ids2, float* weights2, Stream stream) {
  launch_routing_impl(cfg, logits, DType::F32, M, bias, gate_logit, S, ids2, weights2, true,
                      static_cast<cudaStream_t>(stream));
}

}  // namespace wna16::cuda
