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
// One kernel, moe_routing_kernel (any M), followed in the layer by the align kernel of
// sm90_moe_align.cu.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/dispatch.h"
#include "cuda/moe_layer_kernels.h"
#include "cuda/pdl.cuh"
#include "cuda/routing_device.cuh"
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
  int S;             // shared-expert slices appended as choices top_k.. with ids 0..S-1; the routed
                     // ids are then offset by S (the layer's kernel experts: shared slices first)
  const float* gate_logit;  // [M]: their weight is sigmoid(gate_logit[m]); null: weight 1
  RoutingAlignOut align;    // M == 1 only (align.sorted null: off): the align step's outputs
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
// LATE: release the dependents only after the wait (launch_routing_with_shared's release_late; a
// variant of its own, fp32 logits only, so that the usual kernels keep their code).
template <int VPL, int DT, bool LATE = false>
// (min blocks 1: ptxas otherwise capped VPL 32 at 128 registers and spilled)
__global__ void __launch_bounds__(kRouteThreads, 1) moe_routing_kernel(const RouteParams p) {
  __shared__ RouteScratch<VPL> scratch[kRouteWarps];
  // Programmatic dependent launch (no-ops unless the launches carry the attribute): the next
  // kernel (align) may start its set-up now; it waits for this grid's completion before reading
  // topk_ids. And the logits are read only once the previous kernel (the router GEMM) is done.
  // NOTE: every thread waits before it may return, so this grid completes only after its
  // predecessor did (the layer's chain relies on that for the router's zero-fill).
  if constexpr (!LATE) pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int64_t m = int64_t(blockIdx.x) * kRouteWarps + (threadIdx.x >> 5);
  const int E = p.E;
  const bool noaux = p.method == kNoaux;
  // Ahead of the wait, what no earlier kernel of the chain writes: the correction bias (a weight),
  // and with the align tables (one token, one block) their sentinel fill by the idle warps 1..3.
  // The tables may be written this early: the layer's router before this kernel is a plain launch,
  // so every earlier reader of them (the previous call's GEMMs) has completed.
  float bia[VPL] = {};
  if (noaux && m < p.M) {  // one branch around all the bias loads; their uses come later
#pragma unroll
    for (int j = 0; j < VPL; ++j) bia[j] = __ldg(p.bias + min(j * 32 + lane, E - 1));
  }
  // The fill skips exactly the entries the routing warp writes (sorted[r * block_m] and
  // expert_ids[r] for the n = top_k + S ranks r): no two threads store to one address, so the
  // warps need no barrier between them.
  const RoutingAlignOut& a = p.align;
  if (a.sorted && m >= p.M) {
    const int t = threadIdx.x - 32, nt = kRouteThreads - 32;
    const int n = int(p.ld);
    const int64_t head = std::min<int64_t>(int64_t(n) * a.block_m, a.max_padded);  // holds the entries
    for (int64_t i = t; i < head; i += nt)
      if (i % a.block_m != 0) a.sorted[i] = n;
    const bool v4 = reinterpret_cast<uintptr_t>(a.sorted) % 16 == 0;
    const int64_t v0 = v4 ? std::min<int64_t>((head + 3) / 4 * 4, a.max_padded) : a.max_padded;
    for (int64_t i = head + t; i < v0; i += nt) a.sorted[i] = n;
    const int64_t v1 = v4 ? v0 + (a.max_padded - v0) / 4 * 4 : v0;
    for (int64_t i = v0 / 4 + t; i < v1 / 4; i += nt) reinterpret_cast<int4*>(a.sorted)[i] = make_int4(n, n, n, n);
    for (int64_t i = v1 + t; i < a.max_padded; i += nt) a.sorted[i] = n;
    for (int64_t b = n + t; b < a.max_blocks; b += nt) a.expert_ids[b] = -1;
  }
  pdl_wait();
  // release_late: the dependents start only once the previous kernel (the router, with its
  // zero-fill) has completed: GEMM1's shared-slice parts use zeroed scratch before their own wait.
  if constexpr (LATE) pdl_launch_dependents();
  if (m >= p.M) return;  // warp-uniform
  RouteScratch<VPL>& sc = scratch[threadIdx.x >> 5];
  const unsigned lt = (1u << lane) - 1u;

  // Every global load of the token is issued here, before the first use: logits, bias, the gate
  // logit. Addresses are clamped into [0, E) instead of branching, so the loads are unconditional
  // and all in flight together: one memory round trip for the whole token.
  float key[VPL];  // what is chosen on: the logit, or s + bias
  float val[VPL];  // what the weight is made of: exp(l - max), or s
  uint32_t avail = 0;  // bit j: expert j*32+lane exists and may still be chosen
#pragma unroll
  for (int j = 0; j < VPL; ++j) {
    const int e = min(j * 32 + lane, E - 1);
    key[j] = load_logit<DT>(p.logits, m * E + e);
    avail |= j * 32 + lane < E ? 1u << j : 0u;
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
    for (int h = 0; h < 32; ++h) {
      if (h >= n_group) break;  // warp-uniform
      rank += beats(__shfl_sync(0xffffffffu, gs, h), h, gs, lane) ? 1 : 0;
    }
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
    p.ids[row + lane] = my_id + p.S;
    p.weights[row + lane] = w;
  }
  // The S shared-expert slices as extra choices (the layer's append step, fused).
  if (p.S > 0) {
    float sw = 1.f;
    if (p.gate_logit) sw = 1.0f / (1.0f + expf(-gate_logit));
    for (int s = lane; s < p.S; s += 32) {
      p.ids[row + p.top_k + s] = s;
      p.weights[row + p.top_k + s] = sw;
    }
  }
  // One token (M == 1, ld <= 32): its choices are distinct experts with one slot each, so the align
  // step's output is each expert's block of block_m rows in id order, the slot first, the rest
  // sentinels (= ld, the slot count), exactly as launch_align would write it.
  if (a.sorted) {
    const int n = int(p.ld);
    const int id = lane < p.top_k ? my_id + p.S : lane < n ? lane - p.top_k : -1;
    int rank = 0;  // experts with a smaller id
    for (int i = 0; i < n; ++i) rank += __shfl_sync(0xffffffffu, id, i) < id;
    if (lane < n) {
      a.sorted[int64_t(rank) * a.block_m] = lane;
      a.expert_ids[rank] = id;
    }
    if (lane == 0) *a.ntpp = n * a.block_m;
  }
}

template <int VPL, int DT>
void launch_vpl_dt(const RouteParams& p, cudaStream_t s, bool pdl, bool late) {
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
  cfg.numAttrs = pdl && !portable_path() ? 1 : 0;
  if constexpr (DT == 0) {
    if (late) {
      WNA16_CUDA_CHECK(cudaLaunchKernelEx(&cfg, moe_routing_kernel<VPL, DT, true>, p));
      return;
    }
  }
  if (late) throw Error("routing: release_late needs fp32 logits");
  WNA16_CUDA_CHECK(cudaLaunchKernelEx(&cfg, moe_routing_kernel<VPL, DT>, p));
}

template <int VPL>
void launch_vpl(const RouteParams& p, cudaStream_t s, bool pdl, bool late) {
  if (p.dtype == 0) launch_vpl_dt<VPL, 0>(p, s, pdl, late);
  else if (p.dtype == 1) launch_vpl_dt<VPL, 1>(p, s, pdl, late);
  else launch_vpl_dt<VPL, 2>(p, s, pdl, late);
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
                         bool pdl, cudaStream_t s, const RoutingAlignOut& align = {}, bool release_late = false) {
  check_routing_args(cfg, M, bias, S);
  if (align.sorted) {
    if (M != 1 || cfg.top_k + S > 32)
      throw Error("routing with the align outputs: needs M=1 and top_k + S <= 32 (M=" + std::to_string(M) +
                  ", top_k + S=" + std::to_string(cfg.top_k + S) + ")");
    if (!align.expert_ids || !align.ntpp || align.block_m < 1 ||
        align.max_padded < max_padded_slots(cfg.top_k + S, cfg.num_experts + S, align.block_m) ||
        align.max_blocks < max_align_blocks(cfg.top_k + S, cfg.num_experts + S, align.block_m))
      throw Error("routing with the align outputs: block_m=" + std::to_string(align.block_m) + ", max_padded=" +
                  std::to_string(align.max_padded) + ", max_blocks=" + std::to_string(align.max_blocks) +
                  " or a null table do not fit the align contract for " + std::to_string(cfg.num_experts + S) +
                  " experts");
  }
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
  p.align = align;

  const int vpl = (E + 31) / 32;
  if (vpl <= 1) launch_vpl<1>(p, s, pdl, release_late);
  else if (vpl <= 2) launch_vpl<2>(p, s, pdl, release_late);
  else if (vpl <= 4) launch_vpl<4>(p, s, pdl, release_late);
  else if (vpl <= 8) launch_vpl<8>(p, s, pdl, release_late);
  else if (vpl <= 16) launch_vpl<16>(p, s, pdl, release_late);
  else launch_vpl<32>(p, s, pdl, release_late);
}

}  // namespace

void launch_routing(const RoutingConfig& cfg, const void* logits, DType logits_dtype, int64_t M, const float* bias,
                    int32_t* topk_ids, float* topk_weights, Stream stream) {
  launch_routing_impl(cfg, logits, logits_dtype, M, bias, nullptr, 0, topk_ids, topk_weights, false,
                      static_cast<cudaStream_t>(stream));
}

void launch_routing_with_shared(const RoutingConfig& cfg, const float* logits, int64_t M, const float* bias,
                                const float* gate_logit, int S, int32_t* ids2, float* weights2, Stream stream,
                                const RoutingAlignOut& align, bool release_late) {
  launch_routing_impl(cfg, logits, DType::F32, M, bias, gate_logit, S, ids2, weights2, true,
                      static_cast<cudaStream_t>(stream), align, release_late);
}

}  // namespace wna16::cuda
