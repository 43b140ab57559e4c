// moe_align_block_size on the GPU: one launch of one thread-block cluster (1 to 16 CTAs), no
// workspace, no host synchronisation, fixed-size outputs; bit-for-bit the contract of
// align_reference (wna16/reference.h): slot ids grouped by ascending expert, ascending within an
// expert, each expert's run padded with the sentinel (= num_slots) to a multiple of block_m.
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
//              CTA total; after a cluster barrier it reads the other CTAs' totals (DSMEM), pads each
//              expert's total to block_m and takes a block-wide exclusive scan over experts.
//  3. scatter: the same walk over the chunk again; the shared counter now returns the output
//              position, lane rank among its peers added: slot s lands at a position that only
//              depends on (expert, s), so the result is deterministic and stable.
//  4. fill:    the padding of every expert's run, the tail past the padded total (sentinel) and
//              expert_ids (binary search over the padded offsets; -1 past the padded total), spread
//              over every thread of the cluster. The padding and the scattered slots never overlap,
//              so no ordering between 3 and 4 is needed.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <mutex>
#include <string>

#include "cuda/cuda_check.h"
#include "wna16/cuda_kernels.h"
#include "wna16/error.h"
#include "wna16/reference.h"

namespace wna16::cuda {
namespace {

namespace cg = cooperative_groups;

// ---- configuration (may change speed, never results) -------------------------------------------
constexpr int kAlignThreads = 1024;  // one thread per expert in the prefix step, so E <= 1024
constexpr int kAlignWarps = kAlignThreads / 32;
constexpr int kAlignMaxExperts = kAlignThreads;
constexpr int kAlignUnroll = 8;          // rounds of 32 ids loaded before the first is used (MLP)
constexpr int kAlignSlotsPerCta = 4096;  // fewer slots per CTA than this: the cluster barriers cost
                                         // more than the extra SMs save
constexpr int kAlignMaxCluster = 16;     // non-portable on Hopper; the launcher falls back to 8..1
static_assert(kAlignThreads % 32 == 0 && kAlignThreads <= 1024, "block size");
static_assert(kAlignWarps <= 32, "the block scan reduces the warp totals with one warp");
static_assert(kAlignMaxExperts <= kAlignThreads, "the prefix step gives each expert one thread");

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// Split cluster barrier: arrive once this CTA is done reading the others' shared memory, wait just
// before exiting (a CTA's shared memory must outlive every remote read of it).
__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
}

// The lanes of this warp whose key equals this lane's (valid keys >= 0; ids are < 2^nbits):
// intersect, for every bit of the key, the ballot of the lanes that agree on that bit.
__device__ __forceinline__ unsigned warp_peers(int key, int nbits) {
  unsigned peers = __ballot_sync(0xffffffffu, key >= 0);
  for (int b = 0; b < nbits; ++b) {
    const bool bit = (key >> b) & 1;
    const unsigned vote = __ballot_sync(0xffffffffu, bit);
    peers &= bit ? vote : ~vote;
  }
  return peers;
}

// Walks this warp's chunk [begin, end) 32 slots per round, in slot order. Count mode adds each
// expert's group size to the warp's row; scatter mode gets the group's base position back from the
// same counter (which the prefix step turned into an output offset) and writes the slot ids.
// Ids outside [0, E) are skipped (they take no room and land nowhere), so bad input can never
// write out of bounds.
template <bool kScatter>
__device__ __forceinline__ void walk_chunk(const int32_t* __restrict__ topk_ids, int64_t begin,
                                           int64_t end, int E, int nbits, int32_t* row, int32_t* sorted) {
  const int lane = threadIdx.x & 31;
  const unsigned lt = lanemask_lt();
  for (int64_t base = begin; base < end; base += 32 * kAlignUnroll) {
    int key[kAlignUnroll];
#pragma unroll
    for (int u = 0; u < kAlignUnroll; ++u) {
      const int64_t s = base + u * 32 + lane;
      const int v = s < end ? __ldg(topk_ids + s) : -1;
      key[u] = (unsigned)v < (unsigned)E ? v : -1;
    }
#pragma unroll
    for (int u = 0; u < kAlignUnroll; ++u) {
      if (base + u * 32 >= end) break;  // warp-uniform
      const unsigned peers = warp_peers(key[u], nbits);
      const int leader = __ffs(peers) - 1;  // garbage for invalid lanes, which do nothing with it
      int old = 0;
      // NOTE: the previous round's counter update by another lane must be visible before this
      // one reads the counter; __syncwarp orders the warp's shared-memory accesses.
      if (kScatter) __syncwarp();
      if (key[u] >= 0 && lane == leader) old = atomicAdd(row + key[u], __popc(peers));
      if (kScatter) {
        old = __shfl_sync(0xffffffffu, old, leader & 31);
        if (key[u] >= 0) sorted[old + __popc(peers & lt)] = static_cast<int32_t>(base + u * 32 + lane);
      }
    }
  }
}

// Block-wide inclusive scan of one int per thread (kAlignThreads threads).
__device__ __forceinline__ int block_inclusive_scan(int v, int* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += n;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int w = lane < kAlignWarps ? warp_sums[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += n;
    }
    if (lane < kAlignWarps) warp_sums[lane] = w;
  }
  __syncthreads();
  return warp > 0 ? v + warp_sums[warp - 1] : v;
}

// The grid is exactly one cluster. padded_cap = max_padded_slots, num_blocks = max_align_blocks.
__global__ void __launch_bounds__(kAlignThreads, 1)
    moe_align_kernel(const int32_t* __restrict__ topk_ids, int num_slots, int E, int nbits, int block_m,
                     int padded_cap, int num_blocks, int32_t* __restrict__ sorted,
                     int32_t* __restrict__ expert_ids, int32_t* __restrict__ post_padded) {
  extern __shared__ int32_t counts[];                // [kAlignWarps][E]: per-warp counters
  __shared__ int32_t cta_total[kAlignMaxExperts];    // this CTA's slots per expert (read remotely)
  __shared__ int32_t expert_total[kAlignMaxExperts]; // all slots per expert (cluster-wide)
  __shared__ int32_t offsets[kAlignMaxExperts + 1];  // padded exclusive offsets; [E] = padded total
  __shared__ int32_t warp_sums[kAlignWarps];

  const cg::cluster_group cluster = cg::this_cluster();
  const int n_cta = static_cast<int>(cluster.num_blocks());
  const int cta = static_cast<int>(cluster.block_rank());
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  for (int i = tid; i < kAlignWarps * E; i += kAlignThreads) counts[i] = 0;
  __syncthreads();

  // This warp's chunk: contiguous, in slot order across (cta, warp), a multiple of 32 long.
  const int64_t n_chunks = int64_t(n_cta) * kAlignWarps;
  const int64_t chunk = (((num_slots + n_chunks - 1) / n_chunks) + 31) / 32 * 32;
  const int64_t begin = std::min<int64_t>(int64_t(cta * kAlignWarps + warp) * chunk, num_slots);
  const int64_t end = std::min<int64_t>(begin + chunk, num_slots);
  int32_t* row = counts + warp * E;

  walk_chunk<false>(topk_ids, begin, end, E, nbits, row, nullptr);
  __syncthreads();

  // Column e of the count table -> per-warp exclusive offsets within this CTA, and the CTA total.
  if (tid < E) {
    int run = 0;
#pragma unroll
    for (int w = 0; w < kAlignWarps; ++w) {
      const int v = counts[w * E + tid];
      counts[w * E + tid] = run;
      run += v;
    }
    cta_total[tid] = run;
  }
  __syncwarp();    // reconverge after the tid < E branch before the cluster barrier
  cluster.sync();  // every CTA's cta_total is written and visible cluster-wide

  int before = 0, total = 0;  // slots of expert tid in lower CTAs, and in all CTAs
  if (tid < E) {
    for (int r = 0; r < n_cta; ++r) {
      const int v = *cluster.map_shared_rank(cta_total + tid, r);
      before += r < cta ? v : 0;
      total += v;
    }
  }
  cluster_arrive_release();  // done with remote shared memory; waited for before exit

  const int padded = tid < E ? (total + block_m - 1) / block_m * block_m : 0;
  const int incl = block_inclusive_scan(padded, warp_sums);
  if (tid < E) {
    offsets[tid] = incl - padded;
    expert_total[tid] = total;
    if (tid == E - 1) offsets[E] = incl;
    const int base = incl - padded + before;
#pragma unroll
    for (int w = 0; w < kAlignWarps; ++w) counts[w * E + tid] += base;
  }
  __syncthreads();

  walk_chunk<true>(topk_ids, begin, end, E, nbits, row, sorted);

  const int padded_total = offsets[E];
  const int sentinel = num_slots;
  const int gthread = cta * kAlignThreads + tid, n_threads = n_cta * kAlignThreads;
  // Padding after each expert's slots: one warp per expert, so the stores coalesce.
  for (int e = cta * kAlignWarps + warp; e < E; e += n_cta * kAlignWarps) {
    for (int p = offsets[e] + expert_total[e] + lane; p < offsets[e + 1]; p += 32) sorted[p] = sentinel;
  }
  // Tail past the padded total.
  for (int64_t p = int64_t(padded_total) + gthread; p < padded_cap; p += n_threads) sorted[p] = sentinel;
  // expert_ids: the expert whose padded run holds the block's first entry: the largest e with
  // offsets[e] <= pos (experts with no slots have an empty run and are skipped by "largest").
  for (int64_t b = gthread; b < num_blocks; b += n_threads) {
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
  if (cta == 0 && tid == 0) *post_padded = padded_total;

  cluster_wait_acquire();
}

// Per-device launch facts, found once: the largest cluster the device co-schedules with the
// largest shared-memory configuration (E = kAlignMaxExperts), and the attributes set on the kernel.
struct AlignDeviceInfo {
  std::once_flag once;
  int max_cluster = 1;
};
constexpr int kMaxDevices = 64;
std::array<AlignDeviceInfo, kMaxDevices> g_align_info;

size_t align_dynamic_smem(int E) { return size_t(kAlignWarps) * E * sizeof(int32_t); }

int align_max_cluster(int device) {
  AlignDeviceInfo& info = g_align_info[device];
  std::call_once(info.once, [&] {
    // NOTE: the first launch may happen inside a stream capture; these set-up calls are not stream
    // work, so run them in relaxed capture mode (restored on every path out).
    struct RelaxedCapture {
      cudaStreamCaptureMode prev = cudaStreamCaptureModeRelaxed;
      RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&prev); }
      ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&prev); }
    } relaxed;
    const size_t smem = align_dynamic_smem(kAlignMaxExperts);
    WNA16_CUDA_CHECK(cudaFuncSetAttribute(moe_align_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    WNA16_CUDA_CHECK(cudaFuncSetAttribute(moe_align_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    int best = 0;
    for (int c = kAlignMaxCluster; c >= 1 && best == 0; c /= 2) {
      cudaLaunchConfig_t cfg = {};
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = c;
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.gridDim = dim3(c);
      cfg.blockDim = dim3(kAlignThreads);
      cfg.dynamicSmemBytes = smem;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      int n = 0;
      if (cudaOccupancyMaxActiveClusters(&n, moe_align_kernel, &cfg) != cudaSuccess) {
        cudaGetLastError();  // an unsupported size is an answer, not an error
        n = 0;
      }
      if (n >= 1) best = c;
    }
    if (best == 0) throw Error("moe_align: this device cannot schedule even one 1024-thread CTA with " +
                               std::to_string(smem) + " bytes of shared memory");
    info.max_cluster = best;
  });
  return info.max_cluster;
}

}  // namespace

void launch_align(const int32_t* topk_ids, int64_t num_slots, int E, int block_m, int32_t* sorted_token_ids,
                  int32_t* expert_ids, int32_t* num_tokens_post_padded, Stream stream) {
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
  const int64_t num_blocks = max_align_blocks(num_slots, E, block_m);

  int device = 0;
  WNA16_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices) throw Error("moe_align: device ordinal " + std::to_string(device) +
                                                       " is above the supported " + std::to_string(kMaxDevices));
  const int max_cluster = align_max_cluster(device);
  int n_cta = static_cast<int>(std::min<int64_t>((num_slots + kAlignSlotsPerCta - 1) / kAlignSlotsPerCta,
                                                 max_cluster));
  n_cta = std::max(n_cta, 1);

  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = n_cta;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.gridDim = dim3(n_cta);
  cfg.blockDim = dim3(kAlignThreads);
  cfg.dynamicSmemBytes = align_dynamic_smem(E);
  cfg.stream = static_cast<cudaStream_t>(stream);
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const int nbits = E > 1 ? 32 - __builtin_clz(unsigned(E - 1)) : 0;  // bits of the largest id, E - 1
  WNA16_CUDA_CHECK(cudaLaunchKernelEx(&cfg, moe_align_kernel, topk_ids, static_cast<int>(num_slots), E, nbits, block_m,
                                      static_cast<int>(padded_cap), static_cast<int>(num_blocks), sorted_token_ids,
                                      expert_ids, num_tokens_post_padded));
}

}  // namespace wna16::cuda
