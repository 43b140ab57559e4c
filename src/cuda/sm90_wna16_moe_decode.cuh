// The decode kernel of the fused MoE GEMM: the "m8" tile config (at most 8 tokens per m-block)
// without act-order. Same packed layout, operand roles (swapped mma.sync m16n8k16), dequantisation
// modes and epilogues as wna16_moe_gemm_kernel (sm90_wna16_moe_gemm.cuh); what differs is how the
// work is cut and how the weights travel, because at decode the kernel is a weight stream:
//  - stream-K: the work is one flat sequence of "turns" (PF consecutive 64-k chunks of one tile
//    pair of one m-block), cut into equal contiguous ranges, one per warp of the persistent grid,
//    so every warp streams the same number of bytes whatever the expert and token counts (a tile
//    pair's K range may be shared by consecutive warps: GEMM2 adds partial sums with its atomics
//    anyway, GEMM1 combines them in the last warp to arrive, see splitk_fixup);
//  - weights go straight from global memory to registers (16-byte non-caching loads) one turn
//    ahead of their use, across tile-pair boundaries, so the ring never drains inside a range; no
//    shared-memory staging, no block barrier;
//  - the tokens' activations and the group scales ride the same ring in per-warp shared-memory
//    rings filled by cp.async (each lane reads back only what it copied).
// Act-order (a per-expert activation gather) stays on the staged kernel.
#pragma once
#include "cuda/sm90_wna16_moe_gemm.cuh"

namespace wna16::cuda::gemm {

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * 32;
constexpr int kDecodePF = 4;        // int4 k-chunks (1 KB of weights per warp each) in a turn
constexpr int kDecodeMinBlocks = 4; // <= 128 registers: 16 warps per SM
constexpr int kDecodeBM = CfgM8::BLOCK_M;
static_assert(kDecodeBM == 8, "one MMA token column per m-block");
// Split-K scratch per warp of the grid: partial sums of its first and last tile pair.
constexpr int kDecodePartialFloats = 2 * 4 * 32;  // [tile][reg][lane]

// 16 bytes of a weight stream, read once: keep it out of L1 (the activations live there).
__device__ __forceinline__ uint4 ld_stream16(const uint4* p, bool pred) {
  uint4 v;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
      " @p ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "r"(int(pred)));
  return v;
}
__device__ __forceinline__ void cp_async4_pred(void* dst, const void* src, bool pred) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p cp.async.ca.shared.global [%0], [%1], 4;\n}\n" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(int(pred)));
}
// mma with a zero accumulator (the first k-step of a group).
template <class T>
__device__ __forceinline__ void mma_fresh(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  d[0] = d[1] = d[2] = d[3] = 0.f;
  Act<T>::mma(d, a, b0, b1);
}

// Stream-K geometry, the same on the host and the device.
struct DecodeSplit {
  int64_t turns;  // total turns
  int64_t warps;  // warps that get a non-empty range (<= turns)
  __host__ __device__ int64_t begin(int64_t w) const { return w * turns / warps; }
  // The warp whose range holds turn t.
  __host__ __device__ int64_t owner(int64_t t) const { return ((t + 1) * warps - 1) / turns; }
};

// DEFER: deferred group scaling (group_len a multiple of 64, and not int8 with bf16); else the
// scale (and zero) is applied per weight. CPG (deferred only): the chunks per group when it
// divides the turn and every item is whole turns, so group boundaries fall on fixed ring slots and
// the group bookkeeping leaves the loop; 0: tracked at run time.
template <class T, int BITS, bool DEFER, int CPG>
__global__ void __launch_bounds__(kDecodeThreads, kDecodeMinBlocks) wna16_moe_decode_kernel(const KParams p) {
  constexpr int U = BITS / 4;        // uint4 per lane per tile and k-chunk
  constexpr int PF = kDecodePF / U;  // chunks per turn: the same bytes for int4 and int8
  static_assert(!DEFER || !(BITS == 8 && std::is_same_v<T, __nv_bfloat16>), "int8 codes exceed bf16's magic range");
  static_assert(CPG == 0 || (DEFER && PF % (CPG ? CPG : 1) == 0), "static groups need deferred scaling and CPG | PF");
  constexpr bool kStatic = CPG != 0;
  constexpr int kCpg = CPG ? CPG : 1;
  // Per-warp rings, one slot per chunk of a turn, filled by cp.async: the activations ([token
  // row][16-byte unit], rows padded to 9 units against bank conflicts) and the scale / zero words.
  constexpr int kXRingSlot = kDecodeBM * 9;
  __shared__ uint4 xs_ring[kDecodeWarps][PF][kDecodeBM][9];
  __shared__ uint32_t meta_ring[kDecodeWarps][PF][4][32];  // [.][.][scale tile 0, 1, zero 0, 1][lane]

  // Programmatic dependent launch (no-ops without the launch attribute). A dependent of the align
  // step waits for it first: everything below reads its outputs (and so may the next kernel,
  // released just after). Otherwise this grid waits only before its first read of x, and the next
  // kernel may start its weight prefetch at once (its griddepcontrol.wait still waits for this
  // whole grid and its writes).
  if (p.pdl == 2) asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, tig = lane & 3;
  const int num_mb = p.mb_count >= 0 ? p.mb_count : (__ldg(p.ntpp) / kDecodeBM);
  const int NP = p.NT / 2;                 // tile pairs
  const int KT = (p.KC + PF - 1) / PF;     // turns per item (an item = one tile pair of one m-block)
  const int64_t turns = int64_t(num_mb) * NP * KT;
  if (turns == 0) return;
  const int64_t grid_warps = p.decode_warps > 0 ? p.decode_warps : int64_t(gridDim.x) * kDecodeWarps;
  const DecodeSplit sk{turns, grid_warps < turns ? grid_warps : turns};
  const int64_t w = int64_t(blockIdx.x) * kDecodeWarps + warp;
  if (w >= sk.warps) return;  // no block-wide synchronisation below
  const int64_t t_begin = sk.begin(w), t_end = sk.begin(w + 1);

  const T* x = static_cast<const T*>(p.x);
  const int64_t wstride = int64_t(p.NT) * U * 32;  // uint4 per k-chunk
  const int mstride = p.NT * 8;                    // meta words per group
  uint4* xring = &xs_ring[warp][0][g][2 * tig];
  uint32_t* mring = &meta_ring[warp][0][0][lane];

  // ---- the load cursor: the turn whose chunks are being fetched ----
  struct Cursor {
    int item, kc0, nvalid;  // nvalid: chunks of this turn to load / use (0: nothing, e.g. an empty m-block)
    bool last;              // the item's last turn
    int mb, pair, slot;     // slot: lane c < 8 holds token column c's slot (-1: padding)
  };
  Cursor L;
  int l_mb = -1, l_expert = -1;
  bool x_ok = false;                    // this lane's token column is a real token
  const uint4* l_w = nullptr;           // weights of chunk kc0, this lane
  const uint4* l_x = nullptr;           // activations of chunk kc0, this lane's 32 bytes
  const uint32_t* l_s = nullptr;        // scale word of this lane's rows, group 0 of the item's tiles
  const uint32_t* l_z = nullptr;
  int l_slot = -1;
  auto set_item = [&](int item, int kc0) {
    L.item = item;
    L.kc0 = kc0;
    L.mb = p.mb_begin + item / NP;
    L.pair = item - (item / NP) * NP;
    if (L.mb != l_mb) {  // token columns and expert of a new m-block (rare: items of one m-block are adjacent)
      l_mb = L.mb;
      l_expert = __ldg(p.expert_ids + L.mb);
      int s = -1;
      if (lane < kDecodeBM) {
        const int v = __ldg(p.sorted_ids + int64_t(L.mb) * kDecodeBM + lane);
        s = (v >= 0 && v < p.num_slots) ? v : -1;
      }
      l_slot = s;
    }
    L.slot = l_slot;
    // B operand: lane (g, tig) feeds token column g with real k 16*tig .. +16 of each chunk.
    const int my_slot = __shfl_sync(0xffffffffu, l_slot, g);
    const bool any = __ballot_sync(0xffffffffu, l_slot >= 0) != 0;
    L.nvalid = (l_expert >= 0 && any) ? min(PF, p.KC - kc0) : 0;
    L.last = kc0 + PF >= p.KC;
    x_ok = my_slot >= 0;
    const int nt0 = 2 * L.pair;
    const int64_t e = l_expert < 0 ? 0 : l_expert;
    l_w = p.qweight + e * p.qw_stride + int64_t(kc0) * wstride + int64_t(nt0) * U * 32 + lane;
    const int64_t src = p.epilogue == 0 ? my_slot / p.topk : int64_t(L.mb) * kDecodeBM + g;
    l_x = reinterpret_cast<const uint4*>(x_ok ? x + src * p.x_stride + 16 * tig + kc0 * 64 : x);
    l_s = p.scales + e * p.meta_stride + int64_t(nt0) * 8 + g;
    l_z = p.zeros ? p.zeros + (l_s - p.scales) : nullptr;
  };
  auto advance = [&]() {  // to the next turn (callers check the range end)
    if (!L.last) {
      L.kc0 += PF;
      L.nvalid = L.nvalid ? min(PF, p.KC - L.kc0) : 0;
      L.last = L.kc0 + PF >= p.KC;
      l_w += PF * wstride;
      if (x_ok) l_x += PF * 8;
    } else {
      set_item(L.item + 1, 0);
    }
  };
  // Does chunk kc (slot s of a turn) close a group? Static: fixed slots. Run time: the group's last
  // chunk, the item's last chunk, or the last chunk of this warp's range (a partial group is still
  // a correct partial sum: the scale is linear).
  auto closes_rt = [&](int kc, bool range_last_turn, int nvalid, int s) {
    if (!DEFER) return true;
    const bool grp_end = p.cpg_shift >= 0 ? ((kc + 1) & ((1 << p.cpg_shift) - 1)) == 0 : (kc + 1) % p.chunks_per_group == 0;
    return grp_end || kc + 1 == p.KC || (range_last_turn && s == nvalid - 1);
  };
  // Issue the loads of slot s of the load cursor's turn.
  uint4 wbuf[PF][2 * U];
  auto load_w = [&](int s) {
    const bool v = s < L.nvalid;
#pragma unroll
    for (int u = 0; u < 2 * U; ++u) wbuf[s][u] = ld_stream16(l_w + s * wstride + u * 32, v);
  };
  auto load_x_meta = [&](int s, bool range_last_turn) {
    const bool v = s < L.nvalid;
    if (v) {
      cp_async16_zfill(xring + s * kXRingSlot, l_x + s * 8, x_ok);
      cp_async16_zfill(xring + s * kXRingSlot + 1, l_x + s * 8 + 1, x_ok);
    }
    const int kc = L.kc0 + s;
    bool closes;
    int grp;
    if constexpr (kStatic) {
      closes = s % kCpg == kCpg - 1;
      grp = kc / kCpg;  // kCpg is a power of two
    } else {
      closes = closes_rt(kc, range_last_turn, L.nvalid, s);
      if (DEFER) grp = p.cpg_shift >= 0 ? kc >> p.cpg_shift : kc / p.chunks_per_group;
      else {
        const int k = kc * 64 + 16 * tig;  // this lane's 16 k lie in one group (group_len % 16 == 0)
        grp = p.group_shift >= 0 ? k >> p.group_shift : k / p.group_len;
      }
    }
    if (closes) {
      const int64_t off = int64_t(grp) * mstride;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        cp_async4_pred(mring + (s * 4 + i) * 32, l_s + off + i * 8, v);
        if (l_z) cp_async4_pred(mring + (s * 4 + 2 + i) * 32, l_z + off + i * 8, v);
      }
    }
  };

  // ---- prologue: the first turn's loads ----
  {
    const int item = int(t_begin / KT);
    set_item(item, int(t_begin - int64_t(item) * KT) * PF);
  }
#pragma unroll
  for (int s = 0; s < PF; ++s) load_w(s);
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x may be the previous kernel's output
#pragma unroll
  for (int s = 0; s < PF; ++s) {
    load_x_meta(s, t_begin + 1 == t_end);
    cp_async_commit();  // one group per slot (empty past the end: the wait count stays fixed)
  }

  float acc[2][4];
  // Deferred mode: raw partial sums of the group, two chains per tile (even / odd k-steps) so
  // consecutive MMAs do not wait on each other; the tokens' row sums likewise.
  float tmp[DEFER ? 2 : 1][2][4], xsum[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      acc[i][e] = 0.f;
      tmp[0][i][e] = 0.f;
      if constexpr (DEFER) tmp[1][i][e] = 0.f;
    }
  xsum[0][0] = xsum[0][1] = xsum[1][0] = xsum[1][1] = 0.f;
  const float zsym = magic_value<T>() + float(1 << (BITS - 1));  // magic + zero point, symmetric
  const uint32_t one = ones2<T>();
  const uint32_t ones[4] = {one, one, one, one};

  for (int64_t t = t_begin; t < t_end; ++t) {
    const Cursor C = L;  // the turn consumed now; L moves one turn ahead
    const bool c_range_last = t + 1 == t_end;
    unsigned c_close = 0;
    if constexpr (!kStatic)
#pragma unroll
      for (int s = 0; s < PF; ++s) c_close |= unsigned(closes_rt(C.kc0 + s, c_range_last, C.nvalid, s)) << s;
    if (!c_range_last) advance();
    else L.nvalid = 0;
    const bool l_range_last = t + 2 == t_end;

#pragma unroll
    for (int s = 0; s < PF; ++s) {
      cp_async_wait<PF - 1>();  // this chunk's activations (and scales) have landed
      if (s < C.nvalid) {
        const uint4 xb[2] = {xring[s * kXRingSlot], xring[s * kXRingSlot + 1]};
        uint32_t wq[2][4 * U];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const uint4 v = wbuf[s][i * U + u];
            wq[i][4 * u + 0] = v.x;
            wq[i][4 * u + 1] = v.y;
            wq[i][4 * u + 2] = v.z;
            wq[i][4 * u + 3] = v.w;
          }
        if constexpr (DEFER) {
          // A group's first chunk starts its chains from zero (static slots; at run time the
          // chains are zeroed after each flush instead).
          const bool fresh = kStatic && s % kCpg == 0;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            // Row sums of the tokens (the zero-point correction), from an all-ones A operand.
            float d[4] = {xsum[h][0], xsum[h][1], 0.f, 0.f};
            if (fresh) mma_fresh<T>(d, ones, xb[h].x, xb[h].y);
            else Act<T>::mma(d, ones, xb[h].x, xb[h].y);
            Act<T>::mma(d, ones, xb[h].z, xb[h].w);
            xsum[h][0] = d[0];
            xsum[h][1] = d[1];
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
              for (int jj = 0; jj < 2; ++jj) {
                uint32_t a[4];
                raw_codes<T, BITS>(wq[i], 2 * h + jj, a);
                if (fresh && h == 0) mma_fresh<T>(tmp[jj][i], a, jj ? xb[h].z : xb[h].x, jj ? xb[h].w : xb[h].y);
                else Act<T>::mma(tmp[jj][i], a, jj ? xb[h].z : xb[h].x, jj ? xb[h].w : xb[h].y);
              }
          }
          if (kStatic ? s % kCpg == kCpg - 1 : (c_close >> s & 1)) {
            // acc += s * (sum (magic + q) x - (magic + z) * sum x), per weight row and token.
            const float x0 = xsum[0][0] + xsum[1][0], x1 = xsum[0][1] + xsum[1][1];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              const uint32_t sw = mring[(s * 4 + i) * 32];
              const float s_lo = f16_lo(sw), s_hi = f16_hi(sw);
              float z_lo = zsym, z_hi = zsym;
              if (l_z) {
                const uint32_t zw = mring[(s * 4 + 2 + i) * 32];
                z_lo = magic_value<T>() + float(zw & 0xffffu);
                z_hi = magic_value<T>() + float(zw >> 16);
              }
              acc[i][0] = fmaf(s_lo, fmaf(-z_lo, x0, tmp[0][i][0] + tmp[1][i][0]), acc[i][0]);
              acc[i][1] = fmaf(s_lo, fmaf(-z_lo, x1, tmp[0][i][1] + tmp[1][i][1]), acc[i][1]);
              acc[i][2] = fmaf(s_hi, fmaf(-z_hi, x0, tmp[0][i][2] + tmp[1][i][2]), acc[i][2]);
              acc[i][3] = fmaf(s_hi, fmaf(-z_hi, x1, tmp[0][i][3] + tmp[1][i][3]), acc[i][3]);
            }
            if constexpr (!kStatic) {
#pragma unroll
              for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) tmp[0][i][e] = tmp[1][i][e] = 0.f;
              xsum[0][0] = xsum[0][1] = xsum[1][0] = xsum[1][1] = 0.f;
            }
          }
        } else {
          // Per-weight dequantisation with the scale of this lane's 16 k (one group).
          TileMeta<T, BITS> meta[2];
#pragma unroll
          for (int i = 0; i < 2; ++i)
            meta[i].load(mring[(s * 4 + i) * 32], l_z ? mring[(s * 4 + 2 + i) * 32] : p.default_zero);
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
              for (int jj = 0; jj < 2; ++jj) {
                uint32_t a[4];
                dequant<T, BITS>(wq[i], 2 * h + jj, meta[i], a);
                Act<T>::mma(acc[i], a, jj ? xb[h].z : xb[h].x, jj ? xb[h].w : xb[h].y);
              }
        }
      }
      // Refill this ring slot with the next turn's chunk now that it is consumed.
      load_w(s);
      load_x_meta(s, l_range_last);
      cp_async_commit();
    }

    if (!(C.last || c_range_last) || C.nvalid == 0) continue;
    // ---- the end of this warp's share of an item: epilogue ----
    // Token columns 2*tig and 2*tig + 1 of the C fragment.
    const int slot0 = __shfl_sync(0xffffffffu, C.slot, 2 * tig);
    const int slot1 = __shfl_sync(0xffffffffu, C.slot, 2 * tig + 1);
    const int nt0 = 2 * C.pair;
    if (p.epilogue == 0) {
      // SiLU(gate) * up needs the whole K sum: when consecutive warps share this item, the last
      // to arrive adds the others' partial sums (kept in the scratch, with an arrival counter).
      const int64_t q0 = int64_t(C.item) * KT, q1 = q0 + KT - 1;
      const int64_t wa = sk.owner(q0), wb = sk.owner(q1);
      bool finish = true;
      if (wa != wb) {
        float* part = p.splitk_partials;
        const int mine = C.item == int(t_begin / KT) ? 0 : 1;
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            __stcg(part + (w * 2 + mine) * kDecodePartialFloats + (i * 4 + e) * 32 + lane, acc[i][e]);
        __threadfence();
        __syncwarp();
        int old = 0;
        if (lane == 0) old = atomicAdd(p.splitk_counters + wa, 1);
        old = __shfl_sync(0xffffffffu, old, 0);
        finish = old == int(wb - wa);
        if (finish) {
          __threadfence();
          for (int64_t o = wa; o <= wb; ++o) {
            if (o == w) continue;
            const int theirs = C.item == int(sk.begin(o) / KT) ? 0 : 1;
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
              for (int e = 0; e < 4; ++e)
                acc[i][e] += __ldcg(part + (o * 2 + theirs) * kDecodePartialFloats + (i * 4 + e) * 32 + lane);
          }
          if (lane == 0) p.splitk_counters[wa] = 0;  // every contributor has arrived: ready for the next launch
        }
      }
      const int c_lo = C.pair * 16 + g, c_hi = c_lo + 8;
      if (finish && c_lo < p.N / 2) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if ((e ? slot1 : slot0) < 0) continue;
          char* row = static_cast<char*>(p.out) +
                      (int64_t(C.mb) * kDecodeBM + 2 * tig + e) * p.out_stride * int64_t(sizeof(T));
          Act<T>::store(row + c_lo * sizeof(T), silu(acc[0][e]) * acc[1][e]);
          if (c_hi < p.N / 2) Act<T>::store(row + c_hi * sizeof(T), silu(acc[0][2 + e]) * acc[1][2 + e]);
        }
      }
    } else {
      float* out = static_cast<float*>(p.out);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int s = e ? slot1 : slot0;
        if (s < 0) continue;
        const float wt = __ldg(p.topk_weights + s);
        float* orow = out + int64_t(s / p.topk) * p.out_stride;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int n_lo = (nt0 + i) * 16 + g;
          if (n_lo < p.N) atomicAdd(orow + n_lo, wt * acc[i][e]);
          if (n_lo + 8 < p.N) atomicAdd(orow + n_lo + 8, wt * acc[i][2 + e]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
  }
  cp_async_wait<0>();  // nothing in flight into shared memory when the warp exits
}

// Blocks of the decode kernel resident per SM (cached per instantiation).
template <class T, int BITS, bool DEFER, int CPG>
int prepare_decode_variant() {
  static int bps = 0;
  static std::once_flag once;
  std::call_once(once, [] {
    WNA16_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bps, wna16_moe_decode_kernel<T, BITS, DEFER, CPG>,
                                                                   kDecodeThreads, 0));
    if (bps < 1) throw Error("the decode kernel cannot be resident on this device");
  });
  return bps;
}
// Deferred scaling cannot hold int8 codes with bf16: that pair only has the per-weight variant.
template <class T, int BITS>
constexpr bool kDecodeCanDefer = !(BITS == 8 && std::is_same_v<T, __nv_bfloat16>);

// The chunks per group the static-group variants exist for (those dividing a turn).
template <int BITS>
constexpr bool decode_static_cpg(int cpg) {
  return (cpg == 1 || cpg == 2 || cpg == 4) && (kDecodePF / (BITS / 4)) % cpg == 0;
}
inline bool decode_static_ok(int bits, int cpg, int kc) {
  const int pf = kDecodePF / (bits / 4);
  return (bits == 4 ? decode_static_cpg<4>(cpg) : decode_static_cpg<8>(cpg)) && kc % pf == 0;
}

template <class T, int BITS>
int prepare_decode() {
  int a = prepare_decode_variant<T, BITS, false, 0>();
  if constexpr (kDecodeCanDefer<T, BITS>) {
    a = std::min(a, prepare_decode_variant<T, BITS, true, 0>());
    a = std::min(a, prepare_decode_variant<T, BITS, true, 1>());
    a = std::min(a, prepare_decode_variant<T, BITS, true, 2>());
    if constexpr (decode_static_cpg<BITS>(4)) a = std::min(a, prepare_decode_variant<T, BITS, true, 4>());
  }
  return a;
}

// A persistent grid of at most the resident blocks (kp.decode_warps, when set, caps the warps that
// get work: tests use it to force many-way K splits).
template <class T, int BITS>
void launch_decode(const KParams& kp, int64_t upper_mblocks, cudaStream_t stream) {
  const int64_t resident = int64_t(prepare_decode<T, BITS>()) * device_info().sms;
  const int64_t pf = kDecodePF / (BITS / 4);
  const int64_t turns = upper_mblocks * (kp.NT / 2) * ((kp.KC + pf - 1) / pf);
  const int64_t grid = kp.decode_warps > 0 ? (kp.decode_warps + kDecodeWarps - 1) / kDecodeWarps
                                           : std::max<int64_t>(1, std::min(resident, (turns + kDecodeWarps - 1) / kDecodeWarps));
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(grid));
  cfg.blockDim = dim3(kDecodeThreads);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = kp.pdl ? 1 : 0;
  if constexpr (kDecodeCanDefer<T, BITS>) {
    if (kp.defer_ok) {
      const int cpg = kp.static_groups ? kp.chunks_per_group : 0;
      auto kern = cpg == 1   ? wna16_moe_decode_kernel<T, BITS, true, 1>
                  : cpg == 2 ? wna16_moe_decode_kernel<T, BITS, true, 2>
                  : cpg == 4 ? wna16_moe_decode_kernel<T, BITS, true, decode_static_cpg<BITS>(4) ? 4 : 0>
                             : wna16_moe_decode_kernel<T, BITS, true, 0>;
      WNA16_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, kp));
      return;
    }
  }
  WNA16_CUDA_CHECK(cudaLaunchKernelEx(&cfg, wna16_moe_decode_kernel<T, BITS, false, 0>, kp));
}

}  // namespace wna16::cuda::gemm
