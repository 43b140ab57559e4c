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

#include "cuda/align_tuning.h"
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
template <bool kScatter, int kPeers>
__device__ __forceinline__ void walk_chunk(const int32_t* __restrict__ topk_ids, int64_t begin,
                                           int64_t end, int E, int32_t* row, int32_t* sorted,
                                           int (&first)[kAlignUnroll]) {
  const int lane = threadIdx.x & 31;
  const unsigned lt = lanemask_lt();
  for (int64_t base = begin; base < end; base += 32 * kAlignUnroll) {
    int key[kAlignUnroll];
    if (kScatter && base == begin) {
#pragma unroll
      for (int u = 0; u < kAlignUnroll; ++u) key[u] = first[u];
    } else {
#pragma unroll
      for (int u = 0; u < kAlignUnroll; ++u) {
        const int64_t s = base + u * 32 + lane;
        const int v = s < end ? __ldg(topk_ids + s) : -1;
        key[u] = (unsigned)v < (unsigned)E ? v : -1;
      }
      if (!kScatter && base == begin) {
#pragma unroll
        for (int u = 0; u < kAlignUnroll; ++u) first[u] = key[u];
      }
    }
#pragma unroll
    for (int u = 0; u < kAlignUnroll; ++u) {
      if (base + u * 32 >= end) break;  // warp-uniform
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
        if (key[u] >= 0) sorted[old + __popc(peers & lt)] = static_cast<int32_t>(base + u * 32 + lane);
      }
    }
  }
}

// Block-wide inclusive scan of one int per thread (blockDim.x threads, a multiple of 32).
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
    const int n_warps = static_cast<int>(blockDim.x >> 5);
    int w = lane < n_warps ? warp_sums[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += n;
    }
    if (lane < n_warps) warp_sums[lane] = w;
  }
  __syncthreads();
  return warp > 0 ? v + warp_sums[warp - 1] : v;
}

// Thread tid < E holds expert tid's token count: each expert's run padded to block_m, the block
// scan of the padded runs, offsets[tid] (offsets[E] = the padded total) and expert_total[tid].
// Returns tid's exclusive padded offset (0 past E). Every thread of the block calls it.
__device__ __forceinline__ int padded_offsets(int total, int E, int block_m, int* warp_sums, int* offsets,
                                              int* expert_total) {
  const int tid = threadIdx.x;
  const int padded = tid < E ? (total + block_m - 1) / block_m * block_m : 0;
  const int incl = block_inclusive_scan(padded, warp_sums);
  if (tid < E) {
    offsets[tid] = incl - padded;
    expert_total[tid] = total;
    if (tid == E - 1) offsets[E] = incl;
  }
  return incl - padded;
}

// Step 4, spread over n_threads threads (gthread: this thread's rank; gwarp: its warp's rank among
// n_warps): the padding of every expert's run, the tail past the padded total (sentinel) and
// expert_ids. Reads only offsets and expert_total (complete before the call). The padding and the
// scattered slots never overlap, so no ordering with the scatter is needed.
__device__ __forceinline__ void fill_padding_and_blocks(const int32_t* offsets, const int32_t* expert_total, int E,
                                                        int block_m, int num_slots, int padded_cap, int num_blocks,
                                                        int gwarp, int n_warps, int gthread, int n_threads,
                                                        int32_t* __restrict__ sorted,
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
}

// The grid is exactly one cluster. padded_cap = max_padded_slots, num_blocks = max_align_blocks.
// kPeers: how scatter rounds find same-expert lanes (see warp_peers).
template <int kPeers>
__global__ void __launch_bounds__(kAlignThreads, 1)
    moe_align_kernel(const int32_t* __restrict__ topk_ids, int num_slots, int E, int block_m,
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
  const int tid = threadIdx.x, warp = tid >> 5;

  // Programmatic dependent launch (no-ops without the launch attribute): let the next kernel in
  // the stream start launching now (it must wait for our completion before reading our outputs),
  // and wait for the previous kernel (which writes topk_ids, or still reads our outputs) before
  // the first global access. Only the shared-memory set-up overlaps the previous kernel.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  for (int i = tid; i < kAlignWarps * E; i += kAlignThreads) counts[i] = 0;
  asm volatile("griddepcontrol.wait;" ::: "memory");
  __syncthreads();

  // This warp's chunk: contiguous, in slot order across (cta, warp), a multiple of 32 long.
  const int64_t n_chunks = int64_t(n_cta) * kAlignWarps;
  const int64_t chunk = (((num_slots + n_chunks - 1) / n_chunks) + 31) / 32 * 32;
  const int64_t begin = std::min<int64_t>(int64_t(cta * kAlignWarps + warp) * chunk, num_slots);
  const int64_t end = std::min<int64_t>(begin + chunk, num_slots);
  int32_t* row = counts + warp * E;

  int first[kAlignUnroll];
  walk_chunk<false, kPeers>(topk_ids, begin, end, E, row, nullptr, first);
  __syncthreads();

  // Column e of the count table -> per-warp exclusive offsets within this CTA (kept in registers
  // until the expert's output offset is known), and the CTA total.
  int col[kAlignWarps];
  if (tid < E) {
    int run = 0;
#pragma unroll
    for (int w = 0; w < kAlignWarps; ++w) {
      const int v = counts[w * E + tid];
      col[w] = run;
      run += v;
    }
    cta_total[tid] = run;
  }
  __syncwarp();    // reconverge after the tid < E branch before the cluster barrier
  cluster.sync();  // every CTA's cta_total is written and visible cluster-wide

  int before = 0, total = 0;  // slots of expert tid in lower CTAs, and in all CTAs
  if (tid < E) {
    // Unrolled to the largest cluster so that the remote loads are all in flight at once.
#pragma unroll
    for (int r = 0; r < kAlignMaxCluster; ++r) {
      if (r < n_cta) {
        const int v = *cluster.map_shared_rank(cta_total + tid, r);
        before += r < cta ? v : 0;
        total += v;
      }
    }
  }
  cluster_arrive_release();  // done with remote shared memory; waited for before exit

  const int offset = padded_offsets(total, E, block_m, warp_sums, offsets, expert_total);
  if (tid < E) {
    const int base = offset + before;
#pragma unroll
    for (int w = 0; w < kAlignWarps; ++w) counts[w * E + tid] = base + col[w];
  }
  __syncthreads();

  walk_chunk<true, kPeers>(topk_ids, begin, end, E, row, sorted, first);

  fill_padding_and_blocks(offsets, expert_total, E, block_m, num_slots, padded_cap, num_blocks, cta * kAlignWarps + warp,
                          n_cta * kAlignWarps, cta * kAlignThreads + tid, n_cta * kAlignThreads, sorted, expert_ids);
  if (cta == 0 && tid == 0) *post_padded = offsets[E];

  cluster_wait_acquire();
}

// The small path (num_slots <= kAlignSmallMaxSlots, the decode case): one plain CTA, one slot per
// thread, warp w holding slots [32w, 32w + 32). A slot's output position is its expert's padded
// offset + the same-expert slots of the lower warps (a [warp][expert] table of byte counts, <= 32
// each) + its rank among its same-expert lanes; no per-warp counter rows to clear, no second walk,
// no cluster barrier. Same outputs as moe_align_kernel, bit for bit.
template <int kPeers>
__global__ void __launch_bounds__(kAlignThreads, 1)
    moe_align_small_kernel(const int32_t* __restrict__ topk_ids, int num_slots, int E, int block_m, int padded_cap,
                           int num_blocks, int32_t* __restrict__ sorted, int32_t* __restrict__ expert_ids,
                           int32_t* __restrict__ post_padded) {
  extern __shared__ uint32_t table_words[];           // [n_warps][E] uint8, cleared as words
  __shared__ int32_t expert_total[kAlignMaxExperts];  // all slots per expert
  __shared__ int32_t offsets[kAlignMaxExperts + 1];   // padded exclusive offsets; [E] = padded total
  __shared__ int32_t warp_sums[kAlignWarps];
  uint8_t* table = reinterpret_cast<uint8_t*>(table_words);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int n_warps = (num_slots + 31) / 32;
  // blockDim.x: a multiple of 32 covering max(E, num_slots) (the launcher keeps it small at decode:
  // fewer warps to launch and to pass each barrier; the fill below is spread over whatever is there).
  const int n_threads = static_cast<int>(blockDim.x);

  // As in moe_align_kernel: only the clearing of shared memory overlaps the previous kernel.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  for (int i = tid; i < (n_warps * E + 3) / 4; i += n_threads) table_words[i] = 0;
  asm volatile("griddepcontrol.wait;" ::: "memory");

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
  padded_offsets(total, E, block_m, warp_sums, offsets, expert_total);
  __syncthreads();

  if (key >= 0) {
    int pos = offsets[key] + __popc(peers & lanemask_lt());
    for (int w = 0; w < warp; ++w) pos += table[w * E + key];
    sorted[pos] = tid;
  }
  fill_padding_and_blocks(offsets, expert_total, E, block_m, num_slots, padded_cap, num_blocks, warp, n_threads / 32,
                          tid, n_threads, sorted, expert_ids);
  if (tid == 0) *post_padded = offsets[E];
}

using AlignKernel = void (*)(const int32_t*, int, int, int, int, int, int32_t*, int32_t*, int32_t*);

// The instantiations: kPeers = 0 (match_any) and ballots over 3, 6, 8 or 10 id bits (E <= 8, 64,
// 256, 1024); a launch takes the narrowest that holds E - 1.
constexpr int kAlignBallotBits[] = {3, 6, 8, 10};
constexpr AlignKernel kAlignKernels[] = {moe_align_kernel<0>, moe_align_kernel<3>, moe_align_kernel<6>,
                                         moe_align_kernel<8>, moe_align_kernel<10>};
static_assert((1 << kAlignBallotBits[3]) >= kAlignMaxExperts, "the widest ballot variant holds every id");

constexpr AlignKernel kAlignSmallKernels[] = {moe_align_small_kernel<0>, moe_align_small_kernel<3>,
                                              moe_align_small_kernel<6>, moe_align_small_kernel<8>,
                                              moe_align_small_kernel<10>};
static_assert(kAlignSmallMaxSlots <= kAlignThreads, "the small path gives each slot one thread");

AlignKernel pick_kernel(const AlignKernel (&kernels)[5], int E, bool match_any) {
  if (match_any) return kernels[0];
  for (int i = 0; i < 4; ++i)
    if ((1 << kAlignBallotBits[i]) >= E) return kernels[i + 1];
  throw Error("moe_align: E=" + std::to_string(E) + " has no kernel variant");
}

__global__ void __launch_bounds__(kAlignThreads, 1) align_shaped_noop_kernel() {}

// attr must have room for 2 entries: the cluster shape, and programmatic stream serialisation (pdl).
cudaLaunchConfig_t cluster_config(int n_cta, size_t smem, cudaStream_t stream, cudaLaunchAttribute* attr, bool cluster,
                                  bool pdl = false) {
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
  cfg.blockDim = dim3(kAlignThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cfg;
}

// Per-device launch facts, found once: the largest cluster the device co-schedules with the
// largest shared-memory configuration (E = kAlignMaxExperts), and the attributes set on the kernels.
struct AlignDeviceInfo {
  std::once_flag once;
  int max_cluster = 1;
};
constexpr int kMaxDevices = 64;
std::array<AlignDeviceInfo, kMaxDevices> g_align_info;

size_t align_dynamic_smem(int E) { return size_t(kAlignWarps) * E * sizeof(int32_t); }

int current_device() {
  int device = 0;
  WNA16_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices)
    throw Error("moe_align: device ordinal " + std::to_string(device) + " is above the supported " +
                std::to_string(kMaxDevices));
  return device;
}

int align_max_cluster(int device) {
  AlignDeviceInfo& info = g_align_info[size_t(device)];
  std::call_once(info.once, [&] {
    // NOTE: the first launch may happen inside a stream capture; these set-up calls are not stream
    // work, so run them in relaxed capture mode (restored on every path out).
    struct RelaxedCapture {
      cudaStreamCaptureMode prev = cudaStreamCaptureModeRelaxed;
      RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&prev); }
      ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&prev); }
    } relaxed;
    const size_t smem = align_dynamic_smem(kAlignMaxExperts);
    int best = kAlignMaxCluster;
    for (AlignKernel k : kAlignKernels) {
      WNA16_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
      WNA16_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
      int fits = 0;
      for (int c = best; c >= 1 && fits == 0; c /= 2) {
        cudaLaunchAttribute attr[2];
        const cudaLaunchConfig_t cfg = cluster_config(c, smem, nullptr, attr, true);
        int n = 0;
        if (cudaOccupancyMaxActiveClusters(&n, k, &cfg) != cudaSuccess) {
          cudaGetLastError();  // an unsupported size is an answer, not an error
          n = 0;
        }
        if (n >= 1) fits = c;
      }
      if (fits == 0)
        throw Error("moe_align: this device cannot schedule even one 1024-thread CTA with " + std::to_string(smem) +
                    " bytes of shared memory");
      best = fits;
    }
    WNA16_CUDA_CHECK(cudaFuncSetAttribute(align_shaped_noop_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    info.max_cluster = best;
  });
  return info.max_cluster;
}

}  // namespace

const AlignTuning kAlignDefaultTuning{};

int align_max_cluster_size() { return align_max_cluster(current_device()); }

void launch_align_shaped_noop(int n_cta, bool cluster, Stream stream) {
  align_max_cluster(current_device());
  cudaLaunchAttribute attr[2];
  const cudaLaunchConfig_t cfg = cluster_config(n_cta, 0, static_cast<cudaStream_t>(stream), attr, cluster);
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

  if (tuning.small_max_slots > 0 && num_slots <= tuning.small_max_slots) {
    // One plain CTA; its byte table fits the default 48 KB of dynamic shared memory (<= 32 KB).
    const int n_warps = static_cast<int>((num_slots + 31) / 32);
    const size_t smem = (size_t(n_warps) * E + 3) / 4 * 4;
    cudaLaunchAttribute attr[2];
    cudaLaunchConfig_t cfg = cluster_config(1, smem, s, attr, false, tuning.pdl);
    // Only the threads the kernel needs (one per slot and one per expert): at decode with E = 257
    // that is 9 warps instead of 32.
    cfg.blockDim = dim3(unsigned((std::max<int64_t>({num_slots, int64_t(E), 1}) + 31) / 32 * 32));
    WNA16_CUDA_CHECK(cudaLaunchKernelEx(&cfg, pick_kernel(kAlignSmallKernels, E, tuning.match_any), topk_ids,
                                        static_cast<int>(num_slots), E, block_m, static_cast<int>(padded_cap),
                                        static_cast<int>(num_blocks), sorted_token_ids, expert_ids,
                                        num_tokens_post_padded));
    return;
  }

  const int max_cluster = align_max_cluster(current_device());
  const int n_cta = static_cast<int>(std::clamp<int64_t>(
      (num_slots + tuning.slots_per_cta - 1) / tuning.slots_per_cta, 1, max_cluster));
  cudaLaunchAttribute attr[2];
  const cudaLaunchConfig_t cfg = cluster_config(n_cta, align_dynamic_smem(E), s, attr,
                                                !(tuning.plain_single && n_cta == 1), tuning.pdl);
  WNA16_CUDA_CHECK(cudaLaunchKernelEx(&cfg, pick_kernel(kAlignKernels, E, tuning.match_any), topk_ids, static_cast<int>(num_slots), E,
                                      block_m, static_cast<int>(padded_cap), static_cast<int>(num_blocks),
                                      sorted_token_ids, expert_ids, num_tokens_post_padded));
}

void launch_align(const int32_t* topk_ids, int64_t num_slots, int E, int block_m, int32_t* sorted_token_ids,
                  int32_t* expert_ids, int32_t* num_tokens_post_padded, Stream stream) {
  launch_align_tuned(topk_ids, num_slots, E, block_m, sorted_token_ids, expert_ids, num_tokens_post_padded,
                     kAlignDefaultTuning, stream);
}

}  // namespace wna16::cuda
