// The decode kernel of the fused MoE GEMM: the "m8" tile config (at most 8 tokens per m-block)
// without act-order. Same packed layout, operand roles (swapped mma.sync m16n8k16), dequantisation
// modes and epilogues as wna16_moe_gemm_kernel (sm90_wna16_moe_gemm.cuh); what differs is how the
// weights travel, because at decode the kernel is a weight stream and nothing else:
//  - weights go straight from global memory to registers (16-byte non-caching loads), PF k-chunks
//    ahead of their use; no shared-memory staging, no barrier per chunk;
//  - the tokens' activations are read from global memory too (L1 hits after the first warp of the
//    block), loaded in the same ring;
//  - a warp owns one gate/up tile pair (PPW = 1) or two adjacent ones (PPW = 2, the "4-tile"
//    variant, int4 only: the activation reads, the row-sum MMAs and the ring bookkeeping serve
//    twice the weight bytes; its ring is half as deep in chunks of twice the bytes, so the bytes in
//    flight per warp stay the same); kw = 1, 2 or 4 warps of a block share the tiles along K and
//    add their partial sums through shared memory at the end, so that even one token routed to
//    nine experts gives every SM enough warps (and bytes in flight) to stream at full bandwidth.
// Act-order (a per-expert activation gather) stays on the staged kernel.
#pragma once
#include "cuda/dispatch.h"
#include "cuda/pdl.cuh"
#include "cuda/routing_device.cuh"
#include "cuda/sm90_wna16_moe_common.cuh"

namespace wna16::cuda::gemm {

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * 32;
constexpr int kDecodePF = 4;             // int4 k-chunks of one tile pair (1 KB of weights each) in flight per warp
constexpr int kDecodeBM = CfgM8::BLOCK_M;
// Blocks per SM the register budget is cut for (4: <= 128 registers, 16 warps per SM). The weight
// ring lives in registers (a shared-memory ring filled by cp.async, for more warps per SM, was
// measured slower: docs/perf.md).
constexpr int kDecodeMinBlocks = 4;
static_assert(kDecodeBM == 8, "one MMA token column per m-block");
static_assert(PackedGemm::kTilePad % (2 * kDecodeWarps) == 0, "a block's tile pairs must divide the n-tile padding");
// The 4-tile variant's units (2 pairs) divide the padding, and so do blocks of 2 units (kw = 2, 4).
// kw = 1 (4 units per block) may leave the last block's warps without tiles: they skip the item.
static_assert(PackedGemm::kTilePad % 8 == 0, "blocks of two 4-tile units must divide the n-tile padding");


// 16 bytes of a weight stream: read once, so keep it out of L1 (the activations live there).
__device__ __forceinline__ uint4 ld_stream16(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// DEFER: deferred group scaling (group_len a multiple of 64, and not int8 with bf16); else the
// scale (and zero) is applied per weight. CPG (deferred only): the chunks per group when it
// divides the ring depth, so group boundaries fall on fixed ring slots (slices are then whole
// groups) and the group bookkeeping, the zeroing of the partial sums and the flush test vanish
// from the loop; 0: tracked at run time. CPG may exceed the ring depth: the loop body then covers
// CPG chunks (several turns of the ring). PPW: tile pairs per warp (1, or 2 for int4). PARTS: the
// shared slices' items ahead of the wait may come in K parts (KParams::pre_parts); a variant of its
// own, so that the kernels without parts keep their code (int4 static groups only). ROUTED: one
// token routed in the kernel (KParams::route_logits), a variant of its own for the same reason
// (int4, groups of two chunks; decode_routes_token).
template <class T, int BITS, bool DEFER, int CPG, int PPW = 1, bool PARTS = false, bool ROUTED = false>
__global__ void __launch_bounds__(kDecodeThreads, kDecodeMinBlocks) wna16_moe_decode_kernel(const KParams p) {
  constexpr int U = BITS / 4;         // uint4 per lane per tile and k-chunk
  constexpr int NTW = 2 * PPW;        // tiles per warp
  constexpr int PF = kDecodePF / U / PPW;  // k-chunks in flight per warp: the same bytes for every variant
  static_assert(PPW == 1 || (PPW == 2 && BITS == 4), "two pairs per warp: int4 only (int8 would leave a 1-chunk ring)");
  static_assert(PF >= 2, "a ring of at least two chunks");
  static_assert(!DEFER || !(BITS == 8 && std::is_same_v<T, __nv_bfloat16>), "int8 codes exceed bf16's magic range");
  constexpr int kCpg = CPG ? CPG : 1;
  constexpr int UN = PF > kCpg ? PF : kCpg;  // chunks per loop body (unrolled); ring slot = position % PF
  static_assert(CPG == 0 || (DEFER && UN % kCpg == 0 && UN % PF == 0), "static groups need deferred scaling, CPG | UN, PF | UN");
  static_assert(!PARTS || (BITS == 4 && CPG != 0), "shared-slice parts: int4 static groups only");
  constexpr bool kStaticGroups = CPG != 0;
  // Deferred partial-sum chains per tile: two (even / odd k-steps) with one pair, so consecutive
  // MMAs do not wait on each other; one with two pairs (four tiles already give four chains).
  constexpr int CH = PPW == 1 ? 2 : 1;
  // Per-warp rings, PF chunks deep, filled by cp.async: the activations ([token row][16-byte unit],
  // rows padded to 9 units against bank conflicts) and the scale / zero words of each tile.
  constexpr int kXRingSlot = kDecodeBM * 9;
  __shared__ uint4 xs_ring[kDecodeWarps][PF][kDecodeBM][9];
  // The k-slices' partial sums [tile][reg][lane] of warp w, in w's own activation ring (free once
  // w's cp.async groups are drained at the end of an item).
  auto red = [&](int w) { return reinterpret_cast<float*>(&xs_ring[w][0][0][0]); };
  static_assert(sizeof(xs_ring[0]) >= NTW * 4 * 32 * sizeof(float), "partial sums fit in a warp's ring");
  // [warp][ring][scale of tile 0 .. NTW-1, zero of tile 0 .. NTW-1][lane]
  __shared__ uint32_t meta_ring[kDecodeWarps][PF][2 * NTW][32];

  // Programmatic dependent launch (no-ops without the launch attribute): the next kernel may
  // start its weight prefetch now (griddepcontrol.wait there still waits for this whole grid and
  // its writes); and this grid waits for the previous one only before its first read of x
  // (below), so its first weights stream while that kernel finishes. pdl == 2 (GEMM1 after the
  // align step, whose tables drive it): wait first, and release the next kernel (GEMM2, which
  // reads the same tables before its own wait) only after that.
  // Ahead of the wait (p.pre_slices, GemmRun::pre_wait_slices): the shared slices' m-blocks lead
  // the align output with tables known from M alone, so the blocks that start on them stream
  // those weights while the routing chain runs, and wait (and release the next kernel) after.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, tig = lane & 3;
  const int kw = p.decode_kw;                      // warps per unit (PPW tile pairs) along K
  const int wp = warp / kw, wk = warp % kw;        // unit within the block, k-slice
  const int units_per_block = kDecodeWarps / kw;
  const int nb_count = ((p.NT / NTW) + units_per_block - 1) / units_per_block;
  const int pre_tokens = p.num_slots / p.topk;
  const int pre_mps = (pre_tokens + kDecodeBM - 1) / kDecodeBM;  // m-blocks per shared slice
  // PARTS: the shared-slice items, each in pre_parts parts along K (the part in WorkItem::split,
  // pre_kc chunks each; KParams holds the host's counts); after the wait, item pre_total + i is
  // the routed item pre_base + i. Else one item per part (pre_base = pre_total).
  const int pre_total = PARTS ? p.pre_total : p.pre_slices * pre_mps * nb_count * p.splits;  // < 2^31: checked on the host
  const int pre_base = PARTS ? p.pre_base : pre_total;
  bool tables = !(p.pdl == 2 && int64_t(blockIdx.x) < pre_total);  // the align tables may be read
  if (p.pdl == 2 && tables) pdl_wait();
  if (tables) pdl_launch_dependents();
  bool waited = p.pdl == 2;  // x is ready (pdl 2: x precedes the whole routing chain)
  // One token routed here (KParams::route_logits): m-block j is the j-th chosen expert by id, its
  // one slot the choice's rank; the logits are complete (GEMM1 waited first; GEMM2 starts after).
  static_assert(!ROUTED || (!PARTS && DEFER), "one token routed here: no shared-slice parts");
  constexpr int kRouteSlots = ROUTED ? 32 : 1;
  __shared__ int route_expert[kRouteSlots], route_slot[kRouteSlots];
  __shared__ float route_weight[kRouteSlots];
  constexpr bool routed_here = ROUTED;
  if constexpr (routed_here) {
    if (warp == 0) {
      const float logit = lane < p.route_E ? __ldg(p.route_logits + lane) : 0.f;
      const OneTokenChoice c = route_one_token(logit, p.route_E, p.route_topk, p.route_renorm != 0);
      const unsigned chosen = __ballot_sync(0xffffffffu, c.chosen);
      if (c.chosen) {
        const int j = __popc(chosen & ((1u << lane) - 1u));
        route_expert[j] = lane;
        route_slot[j] = c.rank;
        route_weight[c.rank] = c.weight;
      }
    }
    __syncthreads();
  }
  auto total_items = [&] {
    const int num_mb = routed_here ? p.route_topk : p.mb_count >= 0 ? p.mb_count : (__ldg(p.ntpp) / kDecodeBM);
    if constexpr (PARTS) return int64_t(num_mb) * nb_count * p.splits - pre_base + pre_total;
    else return int64_t(num_mb) * nb_count * p.splits;
  };
  int64_t total = tables ? total_items() : pre_total;
  const T* x = static_cast<const T*>(p.x);
  const int64_t wstride = int64_t(p.NT) * U * 32;  // uint4 per k-chunk
  const int mstride = p.NT * 8;                    // meta words per group

  // The m-block handoff (GemmRun::mb_done): GEMM1's warps release their m-block's tile pairs once
  // stored; GEMM2 blocks start on item blockIdx.x and take the later ones in order from a counter
  // (blocks that start during GEMM1's tail take more of them). The next item is claimed when an
  // item starts (the atomic's round trip overlaps the item), passed on through shared memory
  // (double-buffered: one block barrier per item).
  __shared__ int claimed[2];
  int claims = 0;
  int next_claim = 0;  // thread 0
  auto next_item = [&](int64_t item) -> int64_t {
    if (!p.item_claim) return item + gridDim.x;
    if (threadIdx.x == 0) claimed[claims & 1] = next_claim;
    __syncthreads();
    return claimed[claims++ & 1];
  };
  // Unit u of m-block mb stored: its PPW tile pairs count in their handoff slot (a slot holds an
  // even number of pairs: a unit never straddles two).
  auto release_mb = [&](int mb, int u) {
    if (p.epilogue == 0 && p.mb_done) {
      __syncwarp();  // the warp's stores are ordered before lane 0's fence and count
      if (lane == 0) {
        __threadfence();
        atomicAdd(p.mb_done + mb * kHandoffSlots + PPW * u / p.mb_done_pps, PPW);
      }
    }
  };

  // A shared slice's item ahead of the wait: expert = slice (mb_begin is 0); split = its K part.
  auto pre_item = [&](int64_t item) {
    WorkItem w;
    int64_t rest;
    if constexpr (PARTS) {
      w.split = int(item % p.pre_parts);
      rest = item / p.pre_parts / p.splits;
    } else {
      w.split = int(item % p.splits);
      rest = item / p.splits;
    }
    w.nb = int(rest % nb_count);
    w.mb = int(rest / nb_count);
    w.expert = w.mb / pre_mps;
    return w;
  };
  // Whether this warp adds to mb_done for its item (see the skips and the epilogue below).
  auto releases = [&](int nb) { return wk == 0 && !(PPW > 1 && NTW * (nb * units_per_block + wp) >= p.NT); };
  // Parts > 1: the m-block and unit each warp completed as the last part (released after the
  // wait; the host keeps every block to at most one shared-slice item then), else -1. In shared
  // memory, not registers: the loop has none to spare.
  __shared__ int pre_done_mb[PARTS ? kDecodeWarps : 1], pre_done_unit[PARTS ? kDecodeWarps : 1];
  if constexpr (PARTS) {
    if (lane == 0) pre_done_mb[warp] = -1;
    __syncwarp();
  }

  for (int64_t item = blockIdx.x;; item = next_item(item)) {
    if (!tables && item >= pre_total) {
      pdl_wait();
      pdl_launch_dependents();
      tables = true;
      // The items run ahead stored their m-blocks before the wait; the counters (zeroed by the
      // chain's first kernel) may take their releases only now.
      if (!PARTS || p.pre_parts == 1) {
        for (int64_t j = blockIdx.x; j < pre_total; j += gridDim.x) {
          const WorkItem pj = pre_item(j);
          if (releases(pj.nb)) release_mb(pj.mb, pj.nb * units_per_block + wp);
        }
      } else if (pre_done_mb[warp] >= 0) {  // warp-uniform
        release_mb(pre_done_mb[warp], pre_done_unit[warp]);
      }
      total = total_items();
    }
    if (item >= total) break;
    if (p.item_claim && threadIdx.x == 0) next_claim = int(gridDim.x) + atomicAdd(p.item_claim, 1);
    const WorkItem it = tables ? decode_item(p, PARTS ? item - pre_total + pre_base : item, nb_count,
                                             routed_here ? route_expert : nullptr)
                               : pre_item(item);
    const int split = it.split, nb = it.nb, mb = it.mb, expert = it.expert;
    if (expert < 0) continue;  // block-uniform
    const int unit = nb * units_per_block + wp;
    const int nt0 = NTW * unit;  // this warp's first tile
    // PPW = 2, kw = 1: the last block of a row may hang over NT (warp-uniform; no block barrier
    // follows with kw = 1, and kw = 2, 4 blocks divide NT exactly).
    if constexpr (PPW > 1)
      if (nt0 >= p.NT) continue;
    // Lane c < 8 holds token column c's slot (-1: padding); valid columns form a prefix. Ahead of
    // the wait: token t = (mb % pre_mps) * 8 + c takes its slice as choice topk - pre_slices + slice.
    int slot = -1;
    if (lane < kDecodeBM) {
      if (routed_here) {
        slot = lane == 0 ? route_slot[mb] : -1;
      } else if (tables) {
        const int s = __ldg(p.sorted_ids + int64_t(mb) * kDecodeBM + lane);
        slot = (s >= 0 && s < p.num_slots) ? s : -1;
      } else {
        const int t = (mb % pre_mps) * kDecodeBM + lane;
        slot = t < pre_tokens ? t * p.topk + p.topk - p.pre_slices + expert : -1;
      }
    }
    if (__ballot_sync(0xffffffffu, slot >= 0) == 0) {  // block-uniform
      if (wk == 0 && tables) release_mb(mb, unit);
      continue;
    }
    // B operand: lane (g, tig) feeds token column g with real k 16*tig .. +16 of each chunk.
    const int my_slot = __shfl_sync(0xffffffffu, slot, g);
    // Weighted sum: the routing weights of this lane's C columns (2*tig, 2*tig + 1), requested now
    // so that their round trip overlaps the item instead of preceding the epilogue's atomics.
    // (int4 only: with int8's ring the two registers made ptxas spill.)
    constexpr bool kEarlyWt = BITS == 4;
    float wt[2] = {0.f, 0.f};
    if (kEarlyWt && p.epilogue != 0) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int s = __shfl_sync(0xffffffffu, slot, 2 * tig + e);
        if (s >= 0) wt[e] = routed_here ? route_weight[s] : __ldg(p.topk_weights + s);
      }
    }
    const T* xrow = nullptr;
    if (my_slot >= 0) {
      const int64_t src = p.epilogue == 0 ? my_slot / p.x_div : int64_t(mb) * kDecodeBM + g;
      xrow = x + src * p.x_stride + 16 * tig;
    }

    // This warp's k-chunks: the split's range cut into kw slices (whole groups when deferred).
    const int kcs = PARTS && !tables ? p.pre_kc : p.kc_per_split;
    const int ks0 = split * kcs, ks_end = min(p.KC, ks0 + kcs);
    int per = (ks_end - ks0 + kw - 1) / kw;
    if (DEFER && (kStaticGroups || p.G > 1)) per = (per + p.chunks_per_group - 1) / p.chunks_per_group * p.chunks_per_group;
    const int kb = min(ks_end, ks0 + wk * per), ke = min(ks_end, kb + per);
    const int nk = ke - kb;

    // Ring loads, in chunk order (one running pointer per stream). Each lane copies exactly what it
    // later reads (its B operand's 32 bytes, its rows' meta words), so its own cp.async.wait_group
    // is the only synchronisation. NOTE: activations and scales need the same lead as the weights:
    // they come from L2 or DRAM, and a round trip under a full DRAM stream is far longer than one
    // chunk's work.
    uint4 wbuf[PF][NTW * U];
    const uint4* wnext = p.qweight + int64_t(expert) * p.qw_stride + int64_t(kb) * wstride + int64_t(nt0) * U * 32 + lane;
    const uint4* xnext = reinterpret_cast<const uint4*>(xrow ? xrow + kb * 64 : x);
    uint4* xring = &xs_ring[warp][0][g][2 * tig];
    uint32_t* mring = &meta_ring[warp][0][0][lane];
    const uint32_t* sbase = p.scales + int64_t(expert) * p.meta_stride + int64_t(nt0) * 8 + g;
    const uint32_t* zbase = p.zeros ? p.zeros + (sbase - p.scales) : nullptr;
    // Group bookkeeping of the loads, advanced one chunk per load (no division in the loop).
    // DEFER: the chunk's group and its index in the group; the scales are needed (and loaded)
    // only with the chunk that closes a group or the slice, which sets its ring slot's flush bit.
    // Else: this lane's group (k = 64 kc + 16 tig) and k's offset in it.
    int grp, pos, kc_next = kb;
    unsigned flush = 0, starts = 0;  // run-time groups: ring slots whose chunk closes / opens a group
    if (DEFER) {
      grp = kb / p.chunks_per_group;
      pos = kb - grp * p.chunks_per_group;
    } else {
      const int k = kb * 64 + 16 * tig;
      grp = k / p.group_len;
      pos = k - grp * p.group_len;
    }
    auto load_w = [&](int ring) {
#pragma unroll
      for (int u = 0; u < NTW * U; ++u) wbuf[ring][u] = ld_stream16(wnext + u * 32);
      wnext += wstride;
    };
    // cyc: the chunk's position in the loop body's UN chunks (static groups: it fixes the group
    // position).
    auto load_x_meta = [&](int ring, int cyc) {
      cp_async16_zfill(xring + ring * kXRingSlot, xnext, xrow != nullptr);
      cp_async16_zfill(xring + ring * kXRingSlot + 1, xnext + 1, xrow != nullptr);
      if (xrow) xnext += 8;  // 64 elements
      bool closes;
      if constexpr (kStaticGroups) {
        closes = cyc % kCpg == kCpg - 1;
      } else {
        closes = !DEFER || pos == p.chunks_per_group - 1 || kc_next == ke - 1;
        const bool opens = pos == 0 || kc_next == kb;
        flush = closes ? flush | (1u << ring) : flush & ~(1u << ring);
        starts = opens ? starts | (1u << ring) : starts & ~(1u << ring);
      }
      if (closes) {
        const int64_t off = int64_t(grp) * mstride;
#pragma unroll
        for (int i = 0; i < NTW; ++i) {
          cp_async4(mring + (ring * 2 * NTW + i) * 32, sbase + off + i * 8);
          if (zbase) cp_async4(mring + (ring * 2 * NTW + NTW + i) * 32, zbase + off + i * 8);
        }
      }
      ++kc_next;
      if (DEFER) {
        if (++pos == p.chunks_per_group) pos = 0, ++grp;
      } else {
        for (pos += 64; pos >= p.group_len; pos -= p.group_len) ++grp;
      }
    };
#pragma unroll
    for (int s = 0; s < PF; ++s)
      if (s < nk) load_w(s);
    if (p.epilogue != 0 && p.mb_done) {
      // The handoff: wait for the slots of this m-block's intermediate that this warp's k-chunks
      // read, tile pairs [4 kb, 4 ke) (GEMM1 may still run elsewhere, even on this m-block): lane
      // i polls slot q0 + i, all at once (one L2 round trip when they are ready). A count that
      // never arrives (a broken caller) traps after 30 s instead of hanging.
      constexpr int kPairsPerChunk = int(PackedGemm::kChunkK / 16);  // 16 intermediate columns per pair
      const int pps = p.mb_done_pps;
      const int q = kPairsPerChunk * kb / pps + lane;
      if (nk > 0 && q * pps < min(kPairsPerChunk * ke, p.mb_done_target)) {
        const int target = min(p.mb_done_target - q * pps, pps);  // the last slot may hold fewer
        const uint64_t t0 = globaltimer_ns();
        while (ld_acquire_gpu(p.mb_done + mb * kHandoffSlots + q) < target) {
          __nanosleep(64);
          if (globaltimer_ns() - t0 > 30000000000ull) __trap();
        }
      }
      __syncwarp();  // the lanes' acquires order the warp's reads of x after them
    } else if (!waited) {  // x may be the previous kernel's output
      pdl_wait();
      waited = true;
    }
#pragma unroll
    for (int s = 0; s < PF; ++s) {
      if (s < nk) load_x_meta(s, s);
      cp_async_commit();  // one group per chunk, empty past the end (the wait count stays fixed)
    }

    float acc[NTW][4];
    // Deferred mode: raw partial sums of the group, CH chains per tile; the tokens' row sums in CH
    // chains too (the halves of the chunk).
    float tmp[DEFER ? CH : 1][NTW][4], xsum[CH][2];
#pragma unroll
    for (int i = 0; i < NTW; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        acc[i][e] = 0.f;
#pragma unroll
        for (int c = 0; c < (DEFER ? CH : 1); ++c) tmp[c][i][e] = 0.f;
      }
#pragma unroll
    for (int c = 0; c < CH; ++c) xsum[c][0] = xsum[c][1] = 0.f;
    const float zsym = magic_value<T>() + float(1 << (BITS - 1));  // magic + zero point, symmetric
    const uint32_t one = ones2<T>();
    const uint32_t ones[4] = {one, one, one, one};
    auto tsum = [&](int i, int e) {
      if constexpr (DEFER && CH == 2) return tmp[0][i][e] + tmp[1][i][e];
      else return tmp[0][i][e];
    };

    for (int k0 = 0; k0 < nk; k0 += UN) {
#pragma unroll
      for (int s = 0; s < UN; ++s) {
        const int kt = k0 + s;
        if (kt >= nk) break;
        const int r = s % PF;     // ring slot
        const int gs = s % kCpg;  // static groups: position in the group
        cp_async_wait<PF - 1>();  // this chunk's activations (and scales) have landed
        const uint4 xb[2] = {xring[r * kXRingSlot], xring[r * kXRingSlot + 1]};
        uint32_t wq[NTW][4 * U];
#pragma unroll
        for (int i = 0; i < NTW; ++i)
#pragma unroll
          for (int u = 0; u < U; ++u) {
            put_words(&wq[i][4 * u], wbuf[r][i * U + u]);
          }

        if constexpr (DEFER) {
          if (kStaticGroups ? gs == 0 : (starts >> r & 1)) {  // a new group's partial sums
#pragma unroll
            for (int i = 0; i < NTW; ++i)
#pragma unroll
              for (int e = 0; e < 4; ++e)
#pragma unroll
                for (int c = 0; c < CH; ++c) tmp[c][i][e] = 0.f;
#pragma unroll
            for (int c = 0; c < CH; ++c) xsum[c][0] = xsum[c][1] = 0.f;
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            // Row sums of the tokens (the zero-point correction), from an all-ones A operand.
            float d[4] = {xsum[h % CH][0], xsum[h % CH][1], 0.f, 0.f};
            Act<T>::mma(d, ones, xb[h].x, xb[h].y);
            Act<T>::mma(d, ones, xb[h].z, xb[h].w);
            xsum[h % CH][0] = d[0];
            xsum[h % CH][1] = d[1];
            if constexpr (CH == 2) {
#pragma unroll
              for (int i = 0; i < NTW; ++i)
#pragma unroll
                for (int jj = 0; jj < 2; ++jj) {
                  uint32_t a[4];
                  raw_codes<T, BITS>(wq[i], 2 * h + jj, a);
                  Act<T>::mma(tmp[jj][i], a, jj ? xb[h].z : xb[h].x, jj ? xb[h].w : xb[h].y);
                }
            } else {
              // One chain per tile: the k-step outside, so the NTW MMAs of a step are independent.
#pragma unroll
              for (int jj = 0; jj < 2; ++jj)
#pragma unroll
                for (int i = 0; i < NTW; ++i) {
                  uint32_t a[4];
                  raw_codes<T, BITS>(wq[i], 2 * h + jj, a);
                  Act<T>::mma(tmp[0][i], a, jj ? xb[h].z : xb[h].x, jj ? xb[h].w : xb[h].y);
                }
            }
          }
          if (kStaticGroups ? gs == kCpg - 1 : (flush >> r & 1)) {
            // acc += s * (sum (magic + q) x - (magic + z) * sum x), per weight row and token.
            float x0 = xsum[0][0], x1 = xsum[0][1];
            if constexpr (CH == 2) x0 += xsum[1][0], x1 += xsum[1][1];
#pragma unroll
            for (int i = 0; i < NTW; ++i) {
              const uint32_t sw = mring[(r * 2 * NTW + i) * 32];
              const float s_lo = f16_lo(sw), s_hi = f16_hi(sw);
              float z_lo = zsym, z_hi = zsym;
              if (zbase) {
                const uint32_t zw = mring[(r * 2 * NTW + NTW + i) * 32];
                z_lo = magic_value<T>() + float(zw & 0xffffu);
                z_hi = magic_value<T>() + float(zw >> 16);
              }
              acc[i][0] = fmaf(s_lo, fmaf(-z_lo, x0, tsum(i, 0)), acc[i][0]);
              acc[i][1] = fmaf(s_lo, fmaf(-z_lo, x1, tsum(i, 1)), acc[i][1]);
              acc[i][2] = fmaf(s_hi, fmaf(-z_hi, x0, tsum(i, 2)), acc[i][2]);
              acc[i][3] = fmaf(s_hi, fmaf(-z_hi, x1, tsum(i, 3)), acc[i][3]);
            }
          }
        } else {
          // Per-weight dequantisation with the scale of this lane's 16 k (one group).
          TileMeta<T, BITS> meta[NTW];
#pragma unroll
          for (int i = 0; i < NTW; ++i)
            meta[i].load(mring[(r * 2 * NTW + i) * 32], zbase ? mring[(r * 2 * NTW + NTW + i) * 32] : p.default_zero);
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < NTW; ++i)
#pragma unroll
              for (int jj = 0; jj < 2; ++jj) {
                uint32_t a[4];
                dequant<T, BITS>(wq[i], 2 * h + jj, meta[i], a);
                Act<T>::mma(acc[i], a, jj ? xb[h].z : xb[h].x, jj ? xb[h].w : xb[h].y);
              }
        }
        // Refill this ring slot now that its weights, activations and scales are consumed.
        if (kt + PF < nk) load_w(r), load_x_meta(r, (s + PF) % UN);
        cp_async_commit();
      }
    }
    cp_async_wait<0>();  // nothing in flight into the rings before the next item reuses them

    // Token columns 2*tig and 2*tig + 1 of the C fragment (shuffles by every lane, before branching).
    const int slot0 = __shfl_sync(0xffffffffu, slot, 2 * tig);
    const int slot1 = __shfl_sync(0xffffffffu, slot, 2 * tig + 1);
    if (kw > 1) {  // block-uniform: add the k-slices of each unit in its first warp
#pragma unroll
      for (int i = 0; i < NTW; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) red(warp)[(i * 4 + e) * 32 + lane] = acc[i][e];
      __syncthreads();
      if (wk == 0)
        for (int w = 1; w < kw; ++w)
#pragma unroll
          for (int i = 0; i < NTW; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][e] += red(warp + w)[(i * 4 + e) * 32 + lane];
      __syncthreads();  // the rings are free for the next item
      if (wk != 0) continue;
    }

    // ---- epilogue: C rows are weight rows (g, g+8), columns are tokens (2*tig, 2*tig+1) ----
    if (PARTS && !tables && p.pre_parts > 1) {  // a K part of a shared-slice item
      // This part's sums into its own scratch; the unit's last part adds every part's in part
      // order (not arrival order: the same bits on every run) and stores.
      // scratch [part][m-block][token column][NT * 16]: this lane's columns 2*tig (+1), rows g (+8).
      float* scr = p.pre_scratch + (int64_t(mb) * kDecodeBM + 2 * tig) * (p.NT * 16) + nt0 * 16 + g;
      const int cstride = p.NT * 16;
      const bool v0 = slot0 >= 0, v1 = slot1 >= 0;
#pragma unroll
      for (int i = 0; i < NTW; ++i)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          if ((r & 1) ? v1 : v0) __stcg(scr + split * p.pre_part_stride + (r & 1) * cstride + i * 16 + 8 * (r >> 1), acc[i][r]);
      __threadfence();
      __syncwarp();
      int last = 0;
      if (lane == 0) last = atomicAdd(p.pre_count + mb * (p.NT / NTW) + unit, 1) == p.pre_parts - 1;
      if (!__shfl_sync(0xffffffffu, last, 0)) continue;  // warp-uniform; no block barrier follows
      __syncwarp();  // lane 0 observed every part's count: its lanes read the sums after it
      __threadfence();
      float part[kPreMaxParts][NTW][4];  // every part's sums in flight at once, then added in order
#pragma unroll
      for (int q = 0; q < kPreMaxParts; ++q)
#pragma unroll
        for (int i = 0; i < NTW; ++i)
#pragma unroll
          for (int r = 0; r < 4; ++r)
            part[q][i][r] = q < p.pre_parts && ((r & 1) ? v1 : v0)
                                ? __ldcg(scr + q * p.pre_part_stride + (r & 1) * cstride + i * 16 + 8 * (r >> 1))
                                : 0.f;
#pragma unroll
      for (int i = 0; i < NTW; ++i)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          acc[i][r] = part[0][i][r];
#pragma unroll
          for (int q = 1; q < kPreMaxParts; ++q)
            if (q < p.pre_parts) acc[i][r] += part[q][i][r];
        }
      if (lane == 0) pre_done_mb[warp] = mb, pre_done_unit[warp] = unit;
      __syncwarp();
    }
    if (p.epilogue == 0) {
#pragma unroll
      for (int q = 0; q < PPW; ++q) {  // tile pair PPW * unit + q: tiles 2q (gate), 2q + 1 (up)
        const int c_lo = (PPW * unit + q) * 16 + g, c_hi = c_lo + 8;
        if (c_lo < p.N / 2) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            if ((e ? slot1 : slot0) < 0) continue;
            char* row = static_cast<char*>(p.out) +
                        (int64_t(mb) * kDecodeBM + 2 * tig + e) * p.out_stride * int64_t(sizeof(T));
            Act<T>::store(row + c_lo * sizeof(T), silu(acc[2 * q][e]) * acc[2 * q + 1][e]);
            if (c_hi < p.N / 2) Act<T>::store(row + c_hi * sizeof(T), silu(acc[2 * q][2 + e]) * acc[2 * q + 1][2 + e]);
          }
        }
      }
    } else {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int s = e ? slot1 : slot0;
        if (s < 0) continue;
        const float w = kEarlyWt ? wt[e] : routed_here ? route_weight[s] : __ldg(p.topk_weights + s);
        T* orow = static_cast<T*>(p.out) + (int64_t(split) * p.num_slots + s) * p.out_stride;  // the slot's row of this split
#pragma unroll
        for (int i = 0; i < NTW; ++i) {
          const int n_lo = (nt0 + i) * 16 + g;
          if (n_lo < p.N) Act<T>::store(orow + n_lo, w * acc[i][e]);
          if (n_lo + 8 < p.N) Act<T>::store(orow + n_lo + 8, w * acc[i][2 + e]);
        }
      }
    }
    if (tables) release_mb(mb, unit);  // else after the wait
  }
}

// Blocks of the decode kernel resident per SM (cached per instantiation).
template <class T, int BITS, bool DEFER, int CPG, int PPW, bool PARTS = false, bool ROUTED = false>
int prepare_decode_variant() {
  static int bps = 0;
  static std::once_flag once;
  std::call_once(once, [] {
    WNA16_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &bps, wna16_moe_decode_kernel<T, BITS, DEFER, CPG, PPW, PARTS, ROUTED>, kDecodeThreads, 0));
    if (bps < 1) throw Error("the decode kernel cannot be resident on this device");
  });
  return bps;
}
// Deferred scaling cannot hold int8 codes with bf16: that pair only has the per-weight variant.
template <class T, int BITS>
constexpr bool kDecodeCanDefer = !(BITS == 8 && std::is_same_v<T, __nv_bfloat16>);
// The 4-tile variant (two tile pairs per warp) exists for int4 only.
template <int BITS>
constexpr bool kDecodeHas4Tiles = BITS == 4;
// The shared-slice parts variant (KParams::pre_parts > 1) exists for int4 static groups only.
template <int BITS>
constexpr bool kDecodeHasParts = BITS == 4;
// The variant that routes one token itself (KParams::route_logits): int4, static groups of two
// chunks (group 128) only, the layers it was measured on (decode_routes_token).
template <int BITS>
constexpr bool kDecodeRoutes = BITS == 4;
constexpr int kDecodeRouteCpg = 2;

// The chunks per group the static-group variants exist for (those dividing the pair kernel's ring
// depth; the 4-tile variant covers the same ones by unrolling its 2-chunk ring twice for 4).
template <int BITS>
constexpr bool decode_static_cpg(int cpg) {
  return (cpg == 1 || cpg == 2 || cpg == 4) && (kDecodePF / (BITS / 4)) % cpg == 0;
}

template <class T, int BITS, int PPW>
int prepare_decode_ppw() {
  int a = prepare_decode_variant<T, BITS, false, 0, PPW>();
  if constexpr (kDecodeCanDefer<T, BITS>) {
    a = std::min(a, prepare_decode_variant<T, BITS, true, 0, PPW>());
    a = std::min(a, prepare_decode_variant<T, BITS, true, 1, PPW>());
    a = std::min(a, prepare_decode_variant<T, BITS, true, 2, PPW>());
    if constexpr (decode_static_cpg<BITS>(4)) a = std::min(a, prepare_decode_variant<T, BITS, true, 4, PPW>());
    if constexpr (kDecodeRoutes<BITS>) a = std::min(a, prepare_decode_variant<T, BITS, true, 2, PPW, false, true>());
    if constexpr (kDecodeHasParts<BITS>) {
      a = std::min(a, prepare_decode_variant<T, BITS, true, 1, PPW, true>());
      a = std::min(a, prepare_decode_variant<T, BITS, true, 2, PPW, true>());
      a = std::min(a, prepare_decode_variant<T, BITS, true, 4, PPW, true>());
    }
  }
  return a;
}
template <class T, int BITS>
int prepare_decode() {
  int a = prepare_decode_ppw<T, BITS, 1>();
  if constexpr (kDecodeHas4Tiles<BITS>) a = std::min(a, prepare_decode_ppw<T, BITS, 2>());
  return a;
}

template <class T, int BITS, int PPW>
void launch_decode_ppw(const cudaLaunchConfig_t& cfg, const KParams& kp) {
  if constexpr (kDecodeCanDefer<T, BITS>) {
    if (kp.defer_ok) {
      // Static groups need every slice to be whole groups: the split's chunk count a multiple of
      // the group's (launch_moe_gemm rounds it).
      const bool stat = kp.static_groups && decode_static_cpg<BITS>(kp.chunks_per_group) &&
                        kp.kc_per_split % kp.chunks_per_group == 0;
      const int cpg = stat ? kp.chunks_per_group : 0;
      if (kp.route_logits) {
        if constexpr (kDecodeRoutes<BITS>) {
          if (cpg == kDecodeRouteCpg && kp.pre_parts <= 1) {
            WNA16_CUDA_CHECK(cudaLaunchKernelEx(&cfg, wna16_moe_decode_kernel<T, BITS, true, kDecodeRouteCpg, PPW, false, true>, kp));
            return;
          }
        }
        throw Error("decode kernel: one token routed in the kernel needs int4 static groups of " +
                    std::to_string(kDecodeRouteCpg) + " chunks (chunks per group " + std::to_string(cpg) + ")");
      }
      if constexpr (kDecodeHasParts<BITS>) {
        if (kp.pre_parts > 1) {
          if (cpg != 1 && cpg != 2 && cpg != 4)
            throw Error("decode kernel: shared-slice parts need static groups (chunks per group " +
                        std::to_string(kp.chunks_per_group) + ")");
          auto kern = cpg == 1   ? wna16_moe_decode_kernel<T, BITS, true, 1, PPW, true>
                      : cpg == 2 ? wna16_moe_decode_kernel<T, BITS, true, 2, PPW, true>
                                 : wna16_moe_decode_kernel<T, BITS, true, 4, PPW, true>;
          WNA16_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, kp));
          return;
        }
      }
      auto kern = cpg == 1   ? wna16_moe_decode_kernel<T, BITS, true, 1, PPW>
                  : cpg == 2 ? wna16_moe_decode_kernel<T, BITS, true, 2, PPW>
                  : cpg == 4 ? wna16_moe_decode_kernel<T, BITS, true, decode_static_cpg<BITS>(4) ? 4 : 0, PPW>
                             : wna16_moe_decode_kernel<T, BITS, true, 0, PPW>;
      WNA16_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, kp));
      return;
    }
  }
  if (kp.pre_parts > 1) throw Error("decode kernel: shared-slice parts need the int4 static-group variants");
  if (kp.route_logits) throw Error("decode kernel: one token routed in the kernel needs deferred scaling");
  WNA16_CUDA_CHECK(cudaLaunchKernelEx(&cfg, wna16_moe_decode_kernel<T, BITS, false, 0, PPW>, kp));
}

// kp.decode_kw and kp.decode_ppw must be set (launch_moe_gemm chooses them). A persistent grid of
// at most the resident blocks.
template <class T, int BITS>
void launch_decode(const KParams& kp, int64_t upper_mblocks, cudaStream_t stream) {
  const int ppw = kDecodeHas4Tiles<BITS> && kp.decode_ppw == 2 ? 2 : 1;
  const int64_t resident = int64_t(prepare_decode<T, BITS>()) * device_info().sms;
  const int64_t units = kp.NT / (2 * ppw), units_per_block = kDecodeWarps / kp.decode_kw;
  const int64_t nbc = (units + units_per_block - 1) / units_per_block;
  // The shared slices' items count once per K part: launch_moe_gemm set pre_base (whole K) and
  // pre_total (in parts); the extra parts are the difference, for any number of splits.
  if (kp.pre_total < kp.pre_base || kp.pre_base < 0)
    throw Error("decode kernel: shared-slice items " + std::to_string(kp.pre_base) + " / parts " +
                std::to_string(kp.pre_total) + ": the parts cannot be fewer than the items");
  const int64_t items = upper_mblocks * nbc * kp.splits + (int64_t(kp.pre_total) - kp.pre_base);
  const int64_t grid = std::max<int64_t>(1, std::min(items, resident));
  if (kp.pre_parts > 1 && (grid < kp.pre_total || !kp.pre_scratch || !kp.pre_count))
    throw Error("decode kernel: " + std::to_string(kp.pre_total) + " shared-slice parts for a grid of " +
                std::to_string(grid) + " blocks (or no scratch): at most one per block");
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(grid));
  cfg.blockDim = dim3(kDecodeThreads);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = kp.pdl && !portable_path() ? 1 : 0;
  if constexpr (kDecodeHas4Tiles<BITS>) {
    if (ppw == 2) {
      launch_decode_ppw<T, BITS, 2>(cfg, kp);
      return;
    }
  }
  launch_decode_ppw<T, BITS, 1>(cfg, kp);
}

}  // namespace wna16::cuda::gemm
