// moe_align_block_size on the GPU: one launch of one thread-block cluster (1 to 16 CTAs), no
// workspace, no host synchronisation, fixed-size outputs; bit-for-bit the contract of
// align_reference (wna16/reference.h): slot ids grouped by ascending expert, ascending within an
// expert, each expert's run padded with the sentinel (= num_slots) to a multiple of block_m.
// The launch carries programmatic dependent launch (align_tuning.h): the kernel waits
// (griddepcontrol.wait) for the previous kernel in the stream before its first global access, so
// only its shared-memory set-up overlaps that kernel; it is correct after any predecessor.
//
// Why a cluster: the scatter must be stable (slot ids ascending within an expert), so every slot
// needs the number of same-expert slots before it. With one cluster, the per-chunk counts live in
// shared memory and the cross-CTA prefix goes through distributed shared memory: no global scratch
// (the launcher has no workspace parameter), no grid-wide barrier, one kernel node in a graph.
//
// The kernel, per CTA (all CTAs of the cluster do the same on their own slice of the slots):
//  1. count:   each warp owns a contiguous chunk of slots and a row of per-expert counters in
//              shared memory; 32 slots at a time, the lanes with the same expert find each other
//              with one ballot per bit of the expert id (warp multi-split) and the lowest lane adds
//              the group size (no cross-warp contention; the order inside the chunk is kept by
//              construction). NOTE: ballots rather than __match_any_sync: a fixed, small cost
//              (ceil(log2 E) votes) whatever the number of distinct experts in the round.
//  2. prefix:  thread e turns column e of the count table into per-warp exclusive offsets and the
//              CTA total. Each CTA pushes its row of totals into every CTA's shared memory (DSMEM,
//              16-byte stores) and passes one cluster barrier; then thread e sums the rows of the
//              lower CTAs and of all CTAs, pads each expert's total to block_m and takes a
//              block-wide exclusive scan over experts (paired with a scan of the CTA's own totals:
//              the staging offsets).
//  3. scatter: the same walk over the chunk again; the shared counter now returns the position,
//              lane rank among its peers added: slot s lands at a position that only depends on
//              (expert, s), so the result is deterministic and stable. Where the CTA's slots fit
//              in shared memory (the default 1024 per CTA do), the walk writes a staging buffer
//              ordered as the output and a second pass copies it out: a CTA's slots of one expert
//              are one contiguous run of the output, so the global stores coalesce. Otherwise the
//              walk writes the output directly.
//  4. fill:    the padding of every expert's run, the tail past the padded total (sentinel) and
//              expert_ids (binary search over the padded offsets; -1 past the padded total), spread
//              over every thread of the cluster. The padding and the scattered slots never overlap,
//              so no ordering between 3 and 4 is needed.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <mutex>
#include <string>

#include "cuda/align_tuning.h"
#include "cuda/cluster.cuh"
#include "cuda/cuda_check.h"
#include "cuda/dispatch.h"
#include "cuda/pdl.cuh"
#include "wna16/cuda_kernels.h"
#include "wna16/error.h"
#include "wna16/reference.h"

namespace wna16::cuda {
namespace {


// ---- configuration (may change speed, never results) -------------------------------------------
// The cluster kernel comes in two block sizes: each expert gets one thread in the prefix step, so
// 1024 threads hold E <= 1024, and 512 (fewer warps to pass each barrier and to sum per expert:
// ~1 us less at E = 256 and 32k slots on the H200) hold E <= 512.
constexpr int kAlignMaxThreads = 1024;
constexpr int kAlignMaxExperts = kAlignMaxThreads;
constexpr int kAlignSmallThreads = 1024;  // the small path: one thread per slot
constexpr int kAlignUnroll = 4;           // rounds of 32 ids loaded before the first is used (MLP)
constexpr int kAlignMaxCluster = 16;      // non-portable on Hopper; the launcher falls back to 8..1
// Dynamic shared memory the cluster kernel may take (its count table, the cluster's per-CTA totals
// and, where it fits, the staging buffer); H200 allows 227 KB per block with the static part.
constexpr size_t kAlignMaxDynamicSmem = 200 * 1024;
// A staged entry: expert id above, slot offset within the CTA below (E <= 1024: 10 + 21 bits).
constexpr int kStageSlotBits = 21;
static_assert(kAlignMaxThreads / 32 <= 32, "the block scan reduces the warp totals with one warp");
static_assert(kAlignMaxExperts <= (1 << (31 - kStageSlotBits)), "a staged entry holds every expert id");

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// The lanes of this warp whose key equals this lane's (valid keys >= 0). kPeers = 0: one
// __match_any_sync; kPeers = n > 0 (ids < 2^n): intersect, for each of the n bits, the ballot of the
// lanes that agree on that bit (warp multi-split), a fixed cost whatever the number of distinct ids.
template <int kPeers>
__device__ __forceinline__ unsigned warp_peers(int key) {
  if constexpr (kPeers == 0) {
    return __match_any_sync(0xffffffffu, key) & __ballot_sync(0xffffffffu, key >= 0);
  } else {
    unsigned peers = __ballot_sync(0xffffffffu, key >= 0);
#pragma unroll
    for (int b = 0; b < kPeers; ++b) {
      const bool bit = (key >> b) & 1;
      const unsigned vote = __ballot_sync(0xffffffffu, bit);
      peers &= bit ? vote : ~vote;
    }
    return peers;
  }
}

// Walks this warp's chunk [begin, end) 32 slots per round, in slot order. Count mode adds one per
// slot to the warp's row (order does not matter for a count, so plain shared atomics); scatter mode
// groups the lanes of each expert, gets the group's base position back from the same counter
// (which the prefix step turned into an output offset) and writes the slot ids in lane order.
// Ids outside [0, E) are skipped (they take no room and land nowhere), so bad input can never
// write out of bounds.
// first: the keys of the chunk's first 32 * kAlignUnroll slots, kept in registers by the count
// walk for the scatter walk (at the common sizes that is the whole chunk: no second load).
// out: where scatter mode writes. stage_base < 0: out is sorted_token_ids and gets the slot id;
// else out is the CTA's shared staging buffer and gets the slot packed with its expert
// (key << kStageSlotBits | slot - stage_base).
template <bool kScatter, int kPeers>
__device__ __forceinline__ void walk_chunk(const int32_t* __restrict__ topk_ids, int begin, int end, int E,
                                           int32_t* row, int32_t* out, int stage_base, int (&first)[kAlignUnroll]) {
  const int lane = threadIdx.x & 31;
  const unsigned lt = lanemask_lt();
  const int n = end - begin;  // offsets from begin: no int overflow near INT32_MAX slots
  for (int done = 0; done < n; done += 32 * kAlignUnroll) {
    const int left = n - done;  // > 0
    int key[kAlignUnroll];
    if (kScatter && done == 0) {
#pragma unroll
      for (int u = 0; u < kAlignUnroll; ++u) key[u] = first[u];
    } else {
#pragma unroll
      for (int u = 0; u < kAlignUnroll; ++u) {
        const int off = u * 32 + lane;
        const int v = off < left ? __ldg(topk_ids + begin + done + off) : -1;
        key[u] = (unsigned)v < (unsigned)E ? v : -1;
      }
      if (!kScatter && done == 0) {
#pragma unroll
        for (int u = 0; u < kAlignUnroll; ++u) first[u] = key[u];
      }
    }
#pragma unroll
    for (int u = 0; u < kAlignUnroll; ++u) {
      if (u * 32 >= left) break;  // warp-uniform
      if constexpr (!kScatter) {
        if (key[u] >= 0) atomicAdd(row + key[u], 1);
      } else {
        const unsigned peers = warp_peers<kPeers>(key[u]);
        const int leader = __ffs(peers) - 1;  // garbage for invalid lanes, which do nothing with it
        int old = 0;
        // NOTE: the previous round's counter update by another lane must be visible before this
        // one reads the counter; __syncwarp orders the warp's shared-memory accesses.
        __syncwarp();
        if (key[u] >= 0 && lane == leader) old = atomicAdd(row + key[u], __popc(peers));
        old = __shfl_sync(0xffffffffu, old, leader & 31);
        if (key[u] >= 0) {
          const int slot = begin + done + u * 32 + lane;
          out[old + __popc(peers & lt)] = stage_base < 0 ? slot : (key[u] << kStageSlotBits) | (slot - stage_base);
        }
      }
    }
  }
}

// Block-wide inclusive scan of a pair of ints per thread (blockDim.x threads, a multiple of 32):
// two scans for the barriers of one.
__device__ __forceinline__ int2 block_inclusive_scan(int2 v, int2* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int nx = __shfl_up_sync(0xffffffffu, v.x, d), ny = __shfl_up_sync(0xffffffffu, v.y, d);
    if (lane >= d) v.x += nx, v.y += ny;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int n_warps = static_cast<int>(blockDim.x >> 5);
    int2 w = lane < n_warps ? warp_sums[lane] : make_int2(0, 0);
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int nx = __shfl_up_sync(0xffffffffu, w.x, d), ny = __shfl_up_sync(0xffffffffu, w.y, d);
      if (lane >= d) w.x += nx, w.y += ny;
    }
    if (lane < n_warps) warp_sums[lane] = w;
  }
  __syncthreads();
  if (warp > 0) v.x += warp_sums[warp - 1].x, v.y += warp_sums[warp - 1].y;
  return v;
}

// Thread tid < E holds expert tid's token count `total` (and a second count `local`, scanned
// alongside): each expert's run padded to block_m, the block scan of the padded runs,
// offsets[tid] (offsets[E] = the padded total) and expert_total[tid]. Returns tid's exclusive
// padded offset and the inclusive scan of `local` (both 0 past E). Every thread of the block calls it.
__device__ __forceinline__ int2 padded_offsets(int total, int local, int E, int block_m, int2* warp_sums, int* offsets,
                                               int* expert_total) {
  const int tid = threadIdx.x;
  const int padded = tid < E ? (total + block_m - 1) / block_m * block_m : 0;
  const int2 incl = block_inclusive_scan(make_int2(padded, tid < E ? local : 0), warp_sums);
  if (tid < E) {
    offsets[tid] = incl.x - padded;
    expert_total[tid] = total;
    if (tid == E - 1) offsets[E] = incl.x;
  }
  return make_int2(incl.x - padded, incl.y);
}

// Step 4: the padding of every expert's run and the tail past the padded total (sentinel), spread
// over n_threads threads (gthread: this thread's rank; gwarp: its warp's rank among n_warps), and
// expert_ids, cut into n_parts contiguous parts, part `part` spread over this block's threads.
// Reads only offsets and expert_total (complete before the call). The padding and the scattered
// slots never overlap, so no ordering with the scatter is needed.
__device__ __forceinline__ void fill_padding_and_blocks(const int32_t* offsets, const int32_t* expert_total, int E,
                                                        int block_m, int num_slots, int padded_cap, int num_blocks,
                                                        int gwarp, int n_warps, int gthread, int n_threads, int part,
                                                        int n_parts, int32_t* __restrict__ sorted,
                                                        int32_t* __restrict__ expert_ids) {
  const int lane = threadIdx.x & 31;
  const int padded_total = offsets[E];
  const int sentinel = num_slots;
  // Padding after each expert's slots (at most block_m - 1 entries): a group of `width` lanes per
  // expert, the smallest power of two (up to a warp) that covers block_m - 1, so the stores of a
  // group coalesce and small block_m does not leave most lanes idle.
  if (block_m > 1) {
    int width = 1;
    while (width < 32 && width < block_m - 1) width <<= 1;
    const int groups_per_warp = 32 / width;
    const int stride = n_warps * groups_per_warp;
    for (int e = gwarp * groups_per_warp + lane / width; e < E; e += stride)
      for (int p = offsets[e] + expert_total[e] + lane % width; p < offsets[e + 1]; p += width) sorted[p] = sentinel;
  }
  // Tail past the padded total.
  for (int64_t p = int64_t(padded_total) + gthread; p < padded_cap; p += n_threads) sorted[p] = sentinel;
  // expert_ids: the expert whose padded run holds the block's first entry: the largest e with
  // offsets[e] <= pos (experts with no slots have an empty run and are skipped by "largest").
  const int per_part = (num_blocks + n_parts - 1) / n_parts;
  const int b_end = min(num_blocks, (part + 1) * per_part);
  for (int b = part * per_part + static_cast<int>(threadIdx.x); b < b_end; b += static_cast<int>(blockDim.x)) {
    const int64_t pos = int64_t(b) * block_m;
    int e = -1;
    if (pos < padded_total) {
      int lo = 0, hi = E;
      while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (offsets[mid] <= pos) lo = mid; else hi = mid;
      }
      e = lo;
    }
    expert_ids[b] = e;
  }
}

// The grid is exactly one cluster of kThreads-thread CTAs (E <= kThreads). padded_cap =
// max_padded_slots, num_blocks = max_align_blocks. kPeers: how scatter rounds find same-expert
// lanes (see warp_peers). staged: the CTA's slots go through the shared staging buffer (the
// launcher checks that they fit).
// Dynamic shared memory: counts [kWarps][E], totals [n_cta][round_up(E, 4)], then the staging buffer.
template <int kThreads, int kPeers>
__global__ void __launch_bounds__(kThreads, 1)
    moe_align_kernel(const int32_t* __restrict__ topk_ids, int num_slots, int E, int block_m,
                     int padded_cap, int num_blocks, int staged, int32_t* __restrict__ sorted,
                     int32_t* __restrict__ expert_ids, int32_t* __restrict__ post_padded) {
  constexpr int kWarps = kThreads / 32;
  extern __shared__ int4 dynamic_smem[];
  __shared__ int4 cta_row4[kThreads / 4];    // this CTA's slots per expert (pushed to every CTA)
  __shared__ int32_t expert_total[kThreads]; // all slots per expert (cluster-wide)
  __shared__ int32_t offsets[kThreads + 1];  // padded exclusive offsets; [E] = padded total
  __shared__ int32_t stage_shift[kThreads];  // output position - staging position, per expert
  __shared__ int2 warp_sums[kWarps];
  __shared__ int32_t n_staged;

  const ClusterView cluster;
  const int n_cta = cluster.size();
  const int cta = cluster.rank();
  const int tid = threadIdx.x, warp = tid >> 5;
  const int E4 = (E + 3) / 4 * 4;  // totals rows of whole int4s
  int32_t* const counts = reinterpret_cast<int32_t*>(dynamic_smem);  // per-warp counters
  int32_t* const totals = counts + kWarps * E;  // [r][e]: CTA r's slots of expert e (16-byte aligned)
  int32_t* const stage = totals + n_cta * E4;    // this CTA's slots in output order
  int32_t* const cta_row = reinterpret_cast<int32_t*>(cta_row4);

  // Arrive now, wait before the first remote store: by then every CTA of the cluster has started
  // (its shared memory exists). The arrive orders nothing, so it may be relaxed.
  cluster.arrive_relaxed();
  // Programmatic dependent launch (no-ops without the launch attribute): let the next kernel in
  // the stream start launching now (it must wait for our completion before reading our outputs),
  // and wait for the previous kernel (which writes topk_ids, or still reads our outputs) before
  // the first global access. Only the shared-memory set-up overlaps the previous kernel.
  pdl_launch_dependents();
  for (int i = tid; i < kWarps * E; i += kThreads) counts[i] = 0;
  pdl_wait();
  __syncthreads();

  // This warp's chunk: contiguous, in slot order across (cta, warp), a multiple of 32 long.
  const int n_chunks = n_cta * kWarps;
  const int chunk = ((num_slots / n_chunks + (num_slots % n_chunks != 0)) + 31) / 32 * 32;
  const int64_t cta_first = std::min<int64_t>(int64_t(cta) * kWarps * chunk, num_slots);
  const int cta_begin = static_cast<int>(cta_first);
  const int begin = static_cast<int>(std::min<int64_t>(int64_t(cta * kWarps + warp) * chunk, num_slots));
  const int end = static_cast<int>(std::min<int64_t>(int64_t(begin) + chunk, num_slots));
  int32_t* row = counts + warp * E;

  int first[kAlignUnroll];
  walk_chunk<false, kPeers>(topk_ids, begin, end, E, row, nullptr, -1, first);
  __syncthreads();

  // Column e of the count table -> per-warp exclusive offsets within this CTA (kept in registers
  // until the expert's output offset is known), and the CTA total.
  int col[kWarps];
  int run = 0;
  if (tid < E) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int v = counts[w * E + tid];
      col[w] = run;
      run += v;
    }
  }
  if (tid < E4) cta_row[tid] = run;  // 0 past E
  __syncthreads();
  // Push the CTA's totals into every CTA's row for it, 16 bytes a store; the cluster barrier
  // (release/acquire) then makes the n_cta rows of this CTA's own table visible to it. This CTA
  // makes no remote access after it, so none can reach a CTA that has exited.
  cluster.wait();
  {
    const int per_rank = E4 / 4;
    for (int i = tid; i < n_cta * per_rank; i += kThreads) {
      const int r = i / per_rank, q = i - r * per_rank;
      int4* remote = reinterpret_cast<int4*>(cluster.map(totals + cta * E4, r));
      remote[q] = cta_row4[q];
    }
  }
  cluster.sync();

  int before = 0, total = 0;  // slots of expert tid in lower CTAs, and in all CTAs
  if (tid < E) {
    for (int r = 0; r < n_cta; ++r) {
      const int v = totals[r * E4 + tid];
      before += r < cta ? v : 0;
      total += v;
    }
  }
  // Offsets: padded, cluster-wide (output positions), and within this CTA's staging buffer.
  const int2 scan = padded_offsets(total, run, E, block_m, warp_sums, offsets, expert_total);
  if (tid < E) {
    const int out_base = scan.x + before, stage_base = scan.y - run;
    stage_shift[tid] = out_base - stage_base;
    if (tid == E - 1) n_staged = scan.y;
    const int base = staged ? stage_base : out_base;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) counts[w * E + tid] = base + col[w];
  }
  __syncthreads();

  if (staged) {
    // Scatter into shared memory, then copy out in staging order: a CTA's slots of one expert are
    // one contiguous run of the output, so the global stores coalesce.
    walk_chunk<true, kPeers>(topk_ids, begin, end, E, row, stage, cta_begin, first);
    __syncthreads();
    for (int i = tid; i < n_staged; i += kThreads) {
      const int v = stage[i];
      sorted[i + stage_shift[v >> kStageSlotBits]] = cta_begin + (v & ((1 << kStageSlotBits) - 1));
    }
  } else {
    walk_chunk<true, kPeers>(topk_ids, begin, end, E, row, sorted, -1, first);
  }

  fill_padding_and_blocks(offsets, expert_total, E, block_m, num_slots, padded_cap, num_blocks, cta * kWarps + warp,
                          n_cta * kWarps, cta * kThreads + tid, n_cta * kThreads, cta, n_cta, sorted, expert_ids);
  if (cta == 0 && tid == 0) *post_padded = offsets[E];
}

// The small path (num_slots <= kAlignSmallMaxSlots, the decode case): one plain CTA, one slot per
// thread, warp w holding slots [32w, 32w + 32). A slot's output position is its expert's padded
// offset + the same-expert slots of the lower warps (a [warp][expert] table of byte counts, <= 32
// each) + its rank among its same-expert lanes; no per-warp counter rows to clear, no second walk,
// no cluster barrier. Same outputs as moe_align_kernel, bit for bit.
template <int kPeers>
__global__ void __launch_bounds__(kAlignSmallThreads, 1)
    moe_align_small_kernel(const int32_t* __restrict__ topk_ids, int num_slots, int E, int block_m, int padded_cap,
                           int num_blocks, int32_t* __restrict__ sorted, int32_t* __restrict__ expert_ids,
                           int32_t* __restrict__ post_padded) {
  extern __shared__ uint32_t table_words[];           // [n_warps][E] uint8, cleared as words
  __shared__ int32_t expert_total[kAlignMaxExperts];  // all slots per expert
  __shared__ int32_t offsets[kAlignMaxExperts + 1];   // padded exclusive offsets; [E] = padded total
  __shared__ int2 warp_sums[kAlignSmallThreads / 32];
  uint8_t* table = reinterpret_cast<uint8_t*>(table_words);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int n_warps = (num_slots + 31) / 32;
  // blockDim.x: a multiple of 32 covering max(E, num_slots) (the launcher keeps it small at decode:
  // fewer warps to launch and to pass each barrier; the fill below is spread over whatever is there).
  const int n_threads = static_cast<int>(blockDim.x);

  // As in moe_align_kernel: only the clearing of shared memory overlaps the previous kernel.
  pdl_launch_dependents();
  for (int i = tid; i < (n_warps * E + 3) / 4; i += n_threads) table_words[i] = 0;
  pdl_wait();

  int key = -1;  // ids outside [0, E) take no room and land nowhere
  if (tid < num_slots) {
    const int v = __ldg(topk_ids + tid);
    key = (unsigned)v < (unsigned)E ? v : -1;
  }
  __syncthreads();  // the table is clear

  unsigned peers = 0;
  if (warp < n_warps) {  // warp-uniform
    peers = warp_peers<kPeers>(key);
    // One writer per (warp, expert): the lowest lane of the group.
    if (key >= 0 && lane == __ffs(peers) - 1) table[warp * E + key] = static_cast<uint8_t>(__popc(peers));
  }
  __syncthreads();

  int total = 0;
  if (tid < E)
    for (int w = 0; w < n_warps; ++w) total += table[w * E + tid];
  padded_offsets(total, 0, E, block_m, warp_sums, offsets, expert_total);
  __syncthreads();

  if (key >= 0) {
    int pos = offsets[key] + __popc(peers & lanemask_lt());
    for (int w = 0; w < warp; ++w) pos += table[w * E + key];
    sorted[pos] = tid;
  }
  fill_padding_and_blocks(offsets, expert_total, E, block_m, num_slots, padded_cap, num_blocks, warp, n_threads / 32,
                          tid, n_threads, 0, 1, sorted, expert_ids);
  if (tid == 0) *post_padded = offsets[E];
}

using AlignKernel = void (*)(const int32_t*, int, int, int, int, int, int, int32_t*, int32_t*, int32_t*);
using AlignSmallKernel = void (*)(const int32_t*, int, int, int, int, int, int32_t*, int32_t*, int32_t*);

// The instantiations: kPeers = 0 (match_any) and ballots over 3, 6, 8 or 10 id bits (E <= 8, 64,
// 256, 1024); a launch takes the narrowest that holds E - 1. The 1024-thread cluster kernel only
// runs E > 512 (10 bits), so its table repeats that variant.
constexpr int kAlignBallotBits[] = {3, 6, 8, 10};
constexpr AlignKernel kAlignKernels512[] = {moe_align_kernel<512, 0>, moe_align_kernel<512, 3>, moe_align_kernel<512, 6>,
                                            moe_align_kernel<512, 8>, moe_align_kernel<512, 10>};
constexpr AlignKernel kAlignKernels1024[] = {moe_align_kernel<1024, 0>, moe_align_kernel<1024, 10>,
                                             moe_align_kernel<1024, 10>, moe_align_kernel<1024, 10>,
                                             moe_align_kernel<1024, 10>};
static_assert((1 << kAlignBallotBits[3]) >= kAlignMaxExperts, "the widest ballot variant holds every id");
// The cluster kernel's block size for E experts (one thread per expert in the prefix step).
int cluster_threads(int E) { return E <= 512 ? 512 : 1024; }
const AlignKernel (&cluster_kernels(int E))[5] { return E <= 512 ? kAlignKernels512 : kAlignKernels1024; }

constexpr AlignSmallKernel kAlignSmallKernels[] = {moe_align_small_kernel<0>, moe_align_small_kernel<3>,
                                                   moe_align_small_kernel<6>, moe_align_small_kernel<8>,
                                                   moe_align_small_kernel<10>};
static_assert(kAlignSmallMaxSlots <= kAlignSmallThreads, "the small path gives each slot one thread");

template <typename Kernel>
Kernel pick_kernel(const Kernel (&kernels)[5], int E, bool match_any) {
  if (match_any) return kernels[0];
  for (int i = 0; i < 4; ++i)
    if ((1 << kAlignBallotBits[i]) >= E) return kernels[i + 1];
  throw Error("moe_align: E=" + std::to_string(E) + " has no kernel variant");
}

__global__ void __launch_bounds__(1024, 1) align_shaped_noop_kernel() {}

// attr must have room for 2 entries: the cluster shape, and programmatic stream serialisation (pdl).
cudaLaunchConfig_t cluster_config(int n_cta, int threads, size_t smem, cudaStream_t stream, cudaLaunchAttribute* attr,
                                  bool cluster, bool pdl = false) {
  cudaLaunchConfig_t cfg = {};
  unsigned n = 0;
  if (cluster) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = n_cta;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.gridDim = dim3(n_cta);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cfg;
}

// Per-device launch facts, found once: the dynamic shared memory the cluster kernel may take, the
// largest cluster the device co-schedules for every variant with its largest configuration that
// needs no staging (E = its block size), and the attributes set on the kernels.
struct AlignDeviceInfo {
  std::once_flag once;
  int max_cluster = 1;
  size_t max_dynamic_smem = 0;
};
constexpr int kMaxDevices = 64;
std::array<AlignDeviceInfo, kMaxDevices> g_align_info;

// The cluster kernel's dynamic shared memory: counts, the cluster's totals, the staging buffer.
size_t align_dynamic_smem(int E, int n_cta, int64_t staged_slots) {
  const size_t E4 = size_t(E + 3) / 4 * 4;
  return (size_t(cluster_threads(E) / 32) * size_t(E) + size_t(n_cta) * E4 + size_t(staged_slots)) * sizeof(int32_t);
}

int current_device() {
  int device = 0;
  WNA16_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices)
    throw Error("moe_align: device ordinal " + std::to_string(device) + " is above the supported " +
                std::to_string(kMaxDevices));
  return device;
}

const AlignDeviceInfo& align_device_info(int device) {
  AlignDeviceInfo& info = g_align_info[size_t(device)];
  std::call_once(info.once, [&] {
    // NOTE: the first launch may happen inside a stream capture; these set-up calls are not stream
    // work, so run them in relaxed capture mode (restored on every path out).
    struct RelaxedCapture {
      cudaStreamCaptureMode prev = cudaStreamCaptureModeRelaxed;
      RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&prev); }
      ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&prev); }
    } relaxed;
    int optin = 0;
    WNA16_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    struct Variant {
      const AlignKernel (&kernels)[5];
      int max_experts;
    };
    const Variant variants[] = {{kAlignKernels512, 512}, {kAlignKernels1024, 1024}};
    size_t max_static = 0;
    for (const Variant& v : variants)
      for (AlignKernel k : v.kernels) {
        cudaFuncAttributes fa{};
        WNA16_CUDA_CHECK(cudaFuncGetAttributes(&fa, k));
        max_static = std::max(max_static, fa.sharedSizeBytes);
      }
    const size_t limit = size_t(optin) > max_static ? std::min(kAlignMaxDynamicSmem, size_t(optin) - max_static) : 0;
    info.max_dynamic_smem = limit;
    for (const Variant& v : variants)
      for (AlignKernel k : v.kernels)
        WNA16_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(limit)));
    if (portable_path()) {  // one CTA per launch, no cluster attributes (below sm_90 there are none)
      info.max_cluster = 1;
      return;
    }
    int best = kAlignMaxCluster;
    for (const Variant& v : variants)
      for (AlignKernel k : v.kernels) {
        WNA16_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        int fits = 0;
        for (int c = best; c >= 1 && fits == 0; c /= 2) {
          const size_t smem = align_dynamic_smem(v.max_experts, c, 0);
          if (smem > limit) continue;
          cudaLaunchAttribute attr[2];
          const cudaLaunchConfig_t cfg = cluster_config(c, cluster_threads(v.max_experts), smem, nullptr, attr, true);
          int n = 0;
          if (cudaOccupancyMaxActiveClusters(&n, k, &cfg) != cudaSuccess) {
            cudaGetLastError();  // an unsupported size is an answer, not an error
            n = 0;
          }
          if (n >= 1) fits = c;
        }
        if (fits == 0)
          throw Error("moe_align: this device cannot schedule even one " + std::to_string(cluster_threads(v.max_experts)) +
                      "-thread CTA with " + std::to_string(align_dynamic_smem(v.max_experts, 1, 0)) +
                      " bytes of shared memory (limit " + std::to_string(limit) + ")");
        best = fits;
      }
    WNA16_CUDA_CHECK(cudaFuncSetAttribute(align_shaped_noop_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    info.max_cluster = best;
  });
  return info;
}

}  // namespace

const AlignTuning kAlignDefaultTuning{};

int align_max_cluster_size() { return align_device_info(current_device()).max_cluster; }

void launch_align_shaped_noop(int n_cta, bool cluster, Stream stream) {
  align_device_info(current_device());
  cudaLaunchAttribute attr[2];
  const cudaLaunchConfig_t cfg = cluster_config(n_cta, 1024, 0, static_cast<cudaStream_t>(stream), attr, cluster);
  WNA16_CUDA_CHECK(cudaLaunchKernelEx(&cfg, align_shaped_noop_kernel));
}

void launch_align_tuned(const int32_t* topk_ids, int64_t num_slots, int E, int block_m, int32_t* sorted_token_ids,
                        int32_t* expert_ids, int32_t* num_tokens_post_padded, const AlignTuning& tuning,
                        Stream stream) {
  if (E <= 0) throw Error("moe_align: E=" + std::to_string(E) + " must be >= 1");
  if (E > kAlignMaxExperts)
    throw Error("moe_align: E=" + std::to_string(E) + " is above the supported maximum of " +
                std::to_string(kAlignMaxExperts) + " experts");
  if (block_m <= 0) throw Error("moe_align: block_m=" + std::to_string(block_m) + " must be >= 1");
  if (num_slots < 0) throw Error("moe_align: num_slots=" + std::to_string(num_slots) + " must be >= 0");
  const int64_t padded_cap = max_padded_slots(num_slots, E, block_m);
  if (padded_cap > INT32_MAX)
    throw Error("moe_align: num_slots=" + std::to_string(num_slots) + " with E=" + std::to_string(E) +
                " and block_m=" + std::to_string(block_m) + " gives " + std::to_string(padded_cap) +
                " padded slots, more than int32 sorted_token_ids can index");
  if (num_slots > 0 && topk_ids == nullptr) throw Error("moe_align: topk_ids is null with num_slots=" +
                                                        std::to_string(num_slots));
  if ((padded_cap > 0 && sorted_token_ids == nullptr) || expert_ids == nullptr || num_tokens_post_padded == nullptr)
    throw Error("moe_align: an output pointer is null (sorted_token_ids, expert_ids, num_tokens_post_padded)");
  if (tuning.slots_per_cta <= 0)
    throw Error("moe_align: tuning slots_per_cta=" + std::to_string(tuning.slots_per_cta) + " must be >= 1");
  if (tuning.small_max_slots < 0 || tuning.small_max_slots > kAlignSmallMaxSlots)
    throw Error("moe_align: tuning small_max_slots=" + std::to_string(tuning.small_max_slots) + " is outside [0, " +
                std::to_string(kAlignSmallMaxSlots) + "]");
  const int64_t num_blocks = max_align_blocks(num_slots, E, block_m);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool portable = portable_path();  // no clusters, no programmatic dependent launch

  if (tuning.small_max_slots > 0 && num_slots <= tuning.small_max_slots) {
    // One plain CTA; its byte table fits the default 48 KB of dynamic shared memory (<= 32 KB).
    const int n_warps = static_cast<int>((num_slots + 31) / 32);
    const size_t smem = (size_t(n_warps) * E + 3) / 4 * 4;
    cudaLaunchAttribute attr[2];
    cudaLaunchConfig_t cfg = cluster_config(1, kAlignSmallThreads, smem, s, attr, false, tuning.pdl && !portable);
    // Only the threads the kernel needs (one per slot and one per expert): at decode with E = 257
    // that is 9 warps instead of 32.
    cfg.blockDim = dim3(unsigned((std::max<int64_t>({num_slots, int64_t(E), 1}) + 31) / 32 * 32));
    WNA16_CUDA_CHECK(cudaLaunchKernelEx(&cfg, pick_kernel(kAlignSmallKernels, E, tuning.match_any), topk_ids,
                                        static_cast<int>(num_slots), E, block_m, static_cast<int>(padded_cap),
                                        static_cast<int>(num_blocks), sorted_token_ids, expert_ids,
                                        num_tokens_post_padded));
    return;
  }

  const AlignDeviceInfo& info = align_device_info(current_device());
  // The portable path: one CTA, no cluster.
  const int n_cta = portable ? 1 : static_cast<int>(std::clamp<int64_t>(
      (num_slots + tuning.slots_per_cta - 1) / tuning.slots_per_cta, 1, info.max_cluster));
  // The kernel's split of the slots (moe_align_kernel): warps of 32-slot multiples, CTA by CTA.
  const int threads = cluster_threads(E);
  const int64_t n_chunks = int64_t(n_cta) * (threads / 32);
  const int64_t cta_slots = ((num_slots + n_chunks - 1) / n_chunks + 31) / 32 * 32 * (threads / 32);
  const bool staged = tuning.stage && align_dynamic_smem(E, n_cta, cta_slots) <= info.max_dynamic_smem;
  const size_t smem = align_dynamic_smem(E, n_cta, staged ? cta_slots : 0);
  if (smem > info.max_dynamic_smem)  // unreachable with E <= kAlignMaxExperts (checked at set-up)
    throw Error("moe_align: E=" + std::to_string(E) + " needs " + std::to_string(smem) +
                " bytes of shared memory, above this device's " + std::to_string(info.max_dynamic_smem));
  cudaLaunchAttribute attr[2];
  const cudaLaunchConfig_t cfg =
      cluster_config(n_cta, threads, smem, s, attr, !portable && !(tuning.plain_single && n_cta == 1), tuning.pdl && !portable);
  WNA16_CUDA_CHECK(cudaLaunchKernelEx(&cfg, pick_kernel(cluster_kernels(E), E, tuning.match_any), topk_ids,
                                      static_cast<int>(num_slots), E, block_m, static_cast<int>(padded_cap),
                                      static_cast<int>(num_blocks), staged ? 1 : 0, sorted_token_ids, expert_ids,
                                      num_tokens_post_padded));
}

void launch_align(const int32_t* topk_ids, int64_t num_slots, int E, int block_m, int32_t* sorted_token_ids,
                  int32_t* expert_ids, int32_t* num_tokens_post_padded, Stream stream) {
  launch_align_tuned(topk_ids, num_slots, E, block_m, sorted_token_ids, expert_ids, num_tokens_post_padded,
                     kAlignDefaultTuning, stream);
}

}  // namespace wna16::cuda
