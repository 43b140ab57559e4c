// The wgmma kernel of the fused MoE GEMM (tile configs "m144w", "m96w", "m64w" and "m32w"): Hopper wgmma
// (sm_90a), 144 (96, 64, 32) tokens per m-block, 256 weight rows per block; the text below speaks of
// m144w. Same work items, operand roles, dequantisation and epilogues as the staged kernel
// (sm90_wna16_moe_gemm.cuh); instantiated in sm90_wna16_moe_prefill_<config>.cu. No act-order (the launcher refuses a perm).
//
// ---- design ----------------------------------------------------------------------------------
// Block = 2 consumer warpgroups (256 threads), one block per SM, persistent over items
// (m-block, n-block, split). n-block = 16 weight tiles (256 rows); warp q (0..3) of warpgroup wg owns
// tiles nb*16 + wg*8 + 2q and +1 (a gate/up pair in GEMM1, so SiLU(gate)*up stays in the lane). Per
// 16-k step a warpgroup issues one wgmma m64nNk16 for "tile 0 of each warp" and one for "tile 1":
// A (64 weight rows = 4 tiles, one per warp) comes from registers, dequantised per weight by each
// lane exactly as the staged kernel's mma.sync A fragments (TileMeta / dequant: the wgmma A fragment
// of warp q is the mma.m16n8k16 A fragment of rows 16q..16q+15); B = the block's tokens (K-major,
// from shared memory). N = BLOCK_M, whatever the m-block's valid tokens (a width per m-block made
// ptxas serialise the wgmmas of the barrier-free loop; sm90_wna16_moe_common.cuh). fp32
// accumulators: [2 tiles][N/2 <= 72] per thread.
// Why 144 tokens, not 128: every m-block dequantises its expert's weights again, and that work,
// not the MMAs, bounds the kernel. Routed experts at prefill get n ~ Binomial(M, topk / E) tokens;
// at DeepSeek-V3 M=4096 that is 128 +- 11, so 128-token blocks need E[ceil(n / 128)] = 1.48 blocks
// per expert where 144-token blocks need 1.07 (and ceil(n / 144) <= ceil(n / 128) for every n).
// 144 is as far as the registers go: 2 x 72 accumulators per thread.
//
// Shared-memory ring (STAGES deep, each stage one 64-k chunk; the tokens by cp.async from all
// threads, the weights and scales by bulk copies that one thread issues on the stage's mbarrier):
//   x:       144 token rows x 128 bytes, 128-byte swizzled (16-byte unit c of row r at c ^ (r & 7)),
//            1024-byte aligned: the wgmma B operand. The packed weights permute k inside a chunk
//            (moe_gemm.h: lane tig's A registers of k-step j hold real k 16*tig + 4j + {0,1} and
//            {2,3}), so the tokens are stored in the same permuted order: real k-pair rp (0..31) of a
//            chunk goes to logical pair 8*(rp>>1 & 3) + 4*(rp & 1) + (rp >> 3), i.e. 16-byte unit
//            rp & 7, word rp >> 3. That is a 4-byte granularity, hence 4-byte cp.async: lane l of a
//            warp copies pairs (l & 7) + 8c of row (l >> 3) + 4*warp + 32*i (i = 0..4; rows past
//            144 are skipped), a full 32-byte sector
//            per row and instruction, bank-conflict free (the word c rotates with the row).
//            Padding rows are not loaded: they only feed accumulator columns that are discarded.
//   weights: the block's tiles of the chunk (16 x U x 512 bytes, contiguous in global memory), one
//            bulk copy; read once per stage by each lane (16-byte loads): registers hold only the
//            chunk in use.
//   scales / zeros: per group slot, the block's 16 tiles x 8 words (contiguous in global memory,
//            one bulk copy each); lane (g, tig) reads word 8 * tile + g of slot tig & slot_mask.
// Why bulk copies: with per-thread cp.async the weight, scale and zero copies and their address
// arithmetic were about a third of the k-loop's instructions (SASS, ncu source view), and the
// kernel is bound by its warps' instruction issue, not by the tensor cores.
// Schedule per chunk kt: wait for its cp.async group, fence.proxy.async (cp.async writes are
// generic-proxy writes, wgmma reads through the async proxy), __syncthreads, refill the stage of
// chunk kt-2 with chunk kt+STAGES-2 (every warpgroup finished chunk kt-2's wgmmas before this
// barrier: it waited on them before dequantising chunk kt-1), wait for the stage's mbarrier (the
// bulk copies; each thread tracks every stage's parity), read the chunk's codes and scales,
// wgmma.wait_group 0 (the previous chunk's wgmmas are done with the A registers), dequantise the
// chunk (2 tiles x 4 k-steps x 4 registers), fence, 8 wgmmas, commit. The two warpgroups drift into
// a ping-pong: one dequantises while the other's wgmmas run.
// With the token tiles by tensor copies (GEMM1's x in m-block order, GEMM2's intermediate) both
// configs run the barrier-free schedule instead (FREE, its own instantiation): per-stage s_full /
// s_empty mbarriers, the k-loop unrolled over the ring (stage offsets and barrier addresses are
// constants), the copies split over four issuing lanes, shared loads at 32-bit addresses; every
// per-chunk instruction outside the dequantisation and the wgmmas counts there (the kernel is
// issue-bound).
#pragma once
#include <cuda.h>  // CUtensorMap (the tensor map is encoded through the runtime's driver entry point)
#include <cudaTypedefs.h>

#include <utility>  // the barrier-free k-loop unrolled over the ring (integer_sequence)

#include "cuda/sm90_wna16_moe_common.cuh"

namespace wna16::cuda::gemm {

template <class C, int BITS>
struct PrefillSmem {
  static constexpr int U = BITS / 4;                 // 16-byte words per lane per tile per chunk
  static constexpr int STAGES = C::stages(BITS);     // chunks in the ring (STAGES - 2 in flight)
  static constexpr int kXBytes = C::BLOCK_M * 128;   // multiple of 1024
  static constexpr int kWBytes = C::NTB * U * 32 * 16;
  static constexpr int kMetaBytes = C::NTB * 32 * 4;
  static constexpr int kStage = kXBytes + kWBytes + 2 * kMetaBytes;
  static constexpr int kBytes = STAGES * kStage + 1024;  // + slack to align the ring to 1024 bytes
  static_assert(kStage % 1024 == 0, "every stage's token tile starts on a 1024-byte swizzle atom");
  static_assert(C::BLOCK_M % 16 == 0, "wgmma token widths are multiples of 16");
};

// wgmma m64nNk16 with A from registers; ACC: accumulators per tile and thread (BLOCK_M / 2), of
// which N / 2 hold the N token columns.
template <class T, int N, int ACC>
struct WgmmaRS;
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WNA16_HAVE_WGMMA 1
#include "cuda/sm90_wgmma_rs.inc"
#endif

// 1 in device code built for sm_90a (wgmma), 0 otherwise: prepare_prefill refuses the config
// when the image the driver loaded for this GPU has no wgmma (the kernel would only trap).
#ifdef WNA16_HAVE_WGMMA
__device__ const int kPrefillHasWgmma = 1;
#else
__device__ const int kPrefillHasWgmma = 0;
#endif

// Whether this build's image for the current device has the wgmma kernel, read once (host).
inline bool prefill_has_wgmma() {
  static const bool has = [] {
    int v = 0;
    WNA16_CUDA_CHECK(cudaMemcpyFromSymbol(&v, kPrefillHasWgmma, sizeof(int)));
    return v != 0;
  }();
  return has;
}

__device__ __forceinline__ void wgmma_fence() {
#ifdef WNA16_HAVE_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef WNA16_HAVE_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef WNA16_HAVE_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart
// (stride byte offset), leading byte offset unused for swizzled K-major (encoded 1), base offset 0
// (the tile starts on a 1024-byte boundary).
// Built from its low word (start address | leading byte offset) and the constant high word, so a
// k-step's descriptor (+32 bytes: + 2) is one 32-bit add.
constexpr uint32_t kSw128DescHi = (1024u >> 4) | (1u << 30);
__device__ __forceinline__ uint32_t sw128_desc_lo(uint32_t saddr) { return ((saddr & 0x3FFFFu) >> 4) | (1u << 16); }
__device__ __forceinline__ uint64_t sw128_desc(uint32_t lo) { return (uint64_t(kSw128DescHi) << 32) | lo; }

// mbarrier and bulk-copy (TMA engine, no tensor map) helpers of the prefill ring.
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait_parity(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred P;\n mbarrier.try_wait.parity.shared::cta.b64 P, [%1], %2;\n selp.u32 %0, 1, 0, P;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
// v in a register the compiler cannot recompute it into (a volatile move).
__device__ __forceinline__ uint32_t pinned(uint32_t v) {
  asm volatile("mov.b32 %0, %0;\n" : "+r"(v));
  return v;
}
// Shared-memory loads at 32-bit addresses (volatile: they stay after the mbarrier wait).
__device__ __forceinline__ uint4 lds128(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ uint32_t lds32(uint32_t a) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(a));
  return v;
}
// bytes (a multiple of 16; both addresses 16-byte aligned) global -> shared, counted on bar.
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// A GEMM2 token tile: BLOCK_M rows of 128 bytes (one k-chunk of the k-permuted intermediate, whose
// rows are already in m-block order) as one tensor copy (box 64 x BLOCK_M, 128-byte swizzle) into
// the 1024-byte aligned tile at dst, counted on bar: unit c of row r lands at c ^ (r & 7), as the
// wgmma B operand wants it. Rows past the tensor's extent arrive as zeros (they are padding).
__device__ __forceinline__ void tma_tile_g2s(uint32_t dst, const CUtensorMap* map, int k0, int row0, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k0), "r"(row0), "r"(bar)
      : "memory");
}

// One k-step's 2 wgmmas (tile 0 and tile 1 of each warp) with N = 16 * NSEL token columns.
template <int NSEL, class T, int ACC>
__device__ __forceinline__ void prefill_mma_step(float (&acc)[2][ACC], const uint32_t (&a)[2][4], uint64_t desc) {
#ifdef WNA16_HAVE_WGMMA
  WgmmaRS<T, 16 * NSEL, ACC>::run(acc[0], a[0], desc);
  WgmmaRS<T, 16 * NSEL, ACC>::run(acc[1], a[1], desc);
#endif
}
// x_map (x_tma != 0: k-permuted x with one row per m-block position: GEMM2's intermediate, or
// GEMM1's x gathered by launch_kperm_positions): the token tile by the copy engine,
// one tensor copy per chunk from one thread on the stage's mbarrier; else per-thread cp.async.
// NOTE: per-row tensor copies (144 per chunk) were tried for GEMM1's gathered rows: 3x slower.
// FREE: the k-loop without block barriers (C::BARRIER_FREE configs with x_tma), its own
// instantiation: the barrier path's code and registers stay out of it.
template <class C, class T, int BITS, bool FREE>
__global__ void __launch_bounds__(C::THREADS, C::MIN_BLOCKS)
    wna16_moe_prefill_kernel(const KParams p, const __grid_constant__ CUtensorMap x_map, const int x_tma) {
#ifdef WNA16_HAVE_WGMMA
  using S = PrefillSmem<C, BITS>;
  constexpr int U = S::U, STAGES = S::STAGES, PF = STAGES - 2;
  constexpr int BM = C::BLOCK_M, NTB = C::NTB;
  constexpr int XROWS = C::XROWS;
  constexpr int ACC = BM / 2;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ int s_src[BM];   // x row feeding each token column; -1: padding
  __shared__ int s_slot[BM];  // slot (token * topk + choice) of each column; -1: padding
  __shared__ float s_wt[BM];  // weighted sum: routing weight of each column
  __shared__ __align__(8) uint64_t s_full[STAGES];   // stage s's weights and scales have landed
  __shared__ __align__(8) uint64_t s_empty[STAGES];  // FREE: every thread is done reading stage s
  // FREE: the item's copy sources and sizes, read by the issuing lanes only (in registers they
  // would crowd the k-loop's working set in every thread).
  struct FreeFill {
    const uint4* w;              // the block's weight tiles of chunk 0
    const uint32_t* meta[2];     // scales, zeros: the block's words of group 0
    uint32_t wbytes, mbytes;     // weight bytes per chunk, meta bytes per group slot
    int row0;                    // the m-block's first row in the token tensor map
  };
  __shared__ FreeFill s_ff;
  unsigned char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  const uint32_t smem_base = smem_addr(smem);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wq = warp & 3;
  const int g = lane >> 2, tig = lane & 3;
  const int num_mb = p.mb_count >= 0 ? p.mb_count : (__ldg(p.ntpp) / BM);
  const int nb_count = (p.NT + NTB - 1) / NTB;
  const int64_t total = int64_t(num_mb) * nb_count * p.splits;
  const T* x = static_cast<const T*>(p.x);
  // This thread's token rows in the x copy: 32*i + 4*warp + (lane >> 3), i < XROWS; all have the
  // same row & 7, so the swizzled unit of its pairs (lane & 7) + 8c is the same in every row.
  const int xr0 = 4 * warp + (lane >> 3), xp8 = lane & 7;
  const uint32_t xsoff = uint32_t(xr0 * 128 + ((xp8 ^ (xr0 & 7)) << 4));
  uint32_t full0 = smem_addr(&s_full[0]), empty0 = smem_addr(&s_empty[0]);
  if constexpr (FREE) full0 = pinned(full0), empty0 = pinned(empty0);
  static_assert(!FREE || C::BARRIER_FREE, "the barrier-free k-loop is the config's");
  if (tid == 0) {
    // Threads that arrive on a stage's s_full per fill: FREE: weights, token tile, scales and
    // zeros each from their own warp; else one thread issues every copy.
    const int issuers = FREE ? 3 + (p.zeros ? 1 : 0) : 1;
    for (int st = 0; st < STAGES; ++st) {
      mbar_init(full0 + 8 * st, issuers);
      mbar_init(empty0 + 8 * st, C::THREADS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  uint32_t phase = 0;  // barrier path: bit st: the parity of stage st's next fill
  uint32_t full_par = 0, fill_par = 0;  // FREE: per-stage parities (the k-loop's comment)
  // Scale slots: lane tig's 16 k of a chunk use the group copied to slot tig & slot_mask (groups
  // of 64 k or more, or one group: slot 0; 32: slots 0 and 2; other multiples of 16: one per tig).
  const int slot_mask = (p.G == 1 || p.group_len % 64 == 0) ? 0 : (p.group_len % 32 == 0 ? 2 : 3);
  // FREE: this lane's shared-memory offsets in a stage: its 16 bytes of tile 0's codes (tile 1:
  // + U * 512) and its scale word of tile 0 (tile 1: + 32; zeros: + kMetaBytes); whether its
  // warp issues copies (zeros only where the checkpoint has them).
  const int ntl0 = wg * 8 + 2 * wq;
  const uint32_t w_off = uint32_t(S::kXBytes + ntl0 * U * 512 + lane * 16);
  const uint32_t m_off = uint32_t(S::kXBytes + S::kWBytes + 4 * ((tig & slot_mask) * NTB * 8 + ntl0 * 8 + g));
  const bool issuer = lane == 0 && (wq != 3 || p.zeros);
  // pinned(): kept in a register (ptxas otherwise recomputed them from the thread index and the
  // shared window base in every chunk, ~15 instructions).
  const uint32_t w_addr = FREE ? pinned(smem_base + w_off) : 0u, m_addr = FREE ? pinned(smem_base + m_off) : 0u;
  const uint32_t desc_lo0 = sw128_desc_lo(smem_base);
  constexpr uint32_t zpair = TileMeta<T, BITS>::kDefaultZeroPair;  // FREE: without a zeros table

  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const WorkItem it = decode_item(p, item, nb_count);
    const int split = it.split, nb = it.nb, mb = it.mb, expert = it.expert;
    __syncthreads();  // the previous item is done with s_src / s_slot and every stage buffer
    if (FREE && tid == 0 && expert >= 0) {
      const int mbase = int(int64_t(expert) * p.meta_stride + int64_t(nb) * NTB * 8);
      const int nt = min(NTB, p.NT - nb * NTB);
      s_ff.w = p.qweight + int64_t(expert) * p.qw_stride + int64_t(nb) * NTB * U * 32;
      s_ff.meta[0] = p.scales + mbase;
      s_ff.meta[1] = p.zeros ? p.zeros + mbase : nullptr;
      s_ff.wbytes = uint32_t(nt * U * 32 * 16);
      s_ff.mbytes = uint32_t(nt * 8 * 4);
      s_ff.row0 = mb * BM;
    }
    const int nvalid = fill_row_tables<BM>(p, mb, tid, s_slot, s_src, s_wt);
    if (expert < 0 || nvalid == 0) continue;  // uniform across the block
    const int kc0 = split * p.kc_per_split;
    const int kc_end = min(p.KC, kc0 + p.kc_per_split);
    const int nk = kc_end - kc0;
    if (nk <= 0) continue;
    const int ntiles = min(NTB, p.NT - nb * NTB);  // 16, or 8 in a last n-block (NT is a multiple of 8)
    const bool wg_active = wg * 8 < ntiles;        // uniform per warpgroup

    const uint4* wexp = p.qweight + int64_t(expert) * p.qw_stride + int64_t(nb) * NTB * U * 32;
    const int64_t wstride = int64_t(p.NT) * U * 32;  // uint4 per k-chunk
    const int mstride = p.NT * 8;                    // meta words per group
    const int meta_base = int(int64_t(expert) * p.meta_stride + int64_t(nb) * NTB * 8);

    // Scales (or zeros) of chunk kc's groups into dst0: per group slot, the block's tiles x 8
    // contiguous words, one bulk copy each, counted on bar.
    auto copy_meta = [&](int kc, const uint32_t* src, uint32_t dst0, uint32_t bar) {
      const uint32_t mbytes = uint32_t(ntiles * 8 * 4);
      if (slot_mask == 0) {  // one group for the chunk (groups of 64 k or more, or one group)
        const int grp = p.G == 1 ? 0 : (p.group_shift >= 0 ? (kc * 64) >> p.group_shift : kc * 64 / p.group_len);
        bulk_copy_g2s(dst0, src + meta_base + grp * mstride, mbytes, bar);
        return;
      }
      for (int slot = 0; slot < 4; ++slot) {
        if ((slot & slot_mask) != slot) continue;
        const int k = kc * 64 + slot * 16;
        const int grp = p.group_shift >= 0 ? k >> p.group_shift : k / p.group_len;
        bulk_copy_g2s(dst0 + uint32_t(slot * NTB * 8 * 4), src + meta_base + grp * mstride, mbytes, bar);
      }
    };
    const uint32_t nslots = slot_mask == 0 ? 1u : slot_mask == 2 ? 2u : 4u;
    const uint32_t wbytes = uint32_t(ntiles * U * 32 * 16), mbytes = uint32_t(ntiles * 8 * 4);

    float acc[2][ACC];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int e = 0; e < ACC; ++e) acc[i][e] = 0.0f;
    uint32_t a[2][2][4];  // [k-step buffer][tile][register]
    // The dequantisation constants of the current group, kept across its chunks (slot_mask 0:
    // groups of whole chunks, cpg of them, or one group).
    TileMeta<T, BITS> meta[2];
    const int cpg = p.G == 1 ? (1 << 30) : max(1, p.group_len / 64);
    int gpos = p.G == 1 ? 1 : kc0 % cpg;  // chunk kt's position in its group (0: a group starts)
    // A chunk's 4 k-steps: codes wv, B operand at desc_lo. One commit group per k-step, A registers
    // double-buffered across k-steps: before dequantising step s into buffer s & 1, wait until at
    // most one group (step s-1) is in flight, i.e. step s-2 (the buffer's last reader) is done.
    // free_bar (non-zero): arrived on after that wait at step 1, where the previous chunk's wgmmas
    // are all done (every thread arrives: an arrive, a release, orders only its own thread's reads
    // of the stage; lane 0 arriving for its warp after __syncwarp made ptxas 13.0 serialise the
    // wgmmas, C7513).
    auto mma_chunk = [&](const uint32_t (&wv)[2][4 * U], uint32_t desc_lo, uint32_t free_bar) {
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        wgmma_wait<1>();
        if (s == 1 && free_bar != 0) mbar_arrive(free_bar);
#pragma unroll
        for (int i = 0; i < 2; ++i) dequant<T, BITS>(wv[i], s, meta[i], a[s & 1][i]);
        wgmma_fence();
        prefill_mma_step<BM / 16, T>(acc, a[s & 1], sw128_desc(desc_lo + 2 * s));
        wgmma_commit();
      }
    };

    if constexpr (FREE) {
      // ---- the barrier-free k-loop: every byte of a stage arrives by the copy engine (the async
      // proxy, which wgmma reads through), so no cp.async wait, proxy fence or block barrier: a
      // chunk is waited for on s_full, and every thread frees its stage on s_empty once its
      // wgmmas are done (the two warpgroups drift apart freely). Chunk kt of an item is in stage
      // kt % STAGES and the loop is unrolled over the ring, so every stage offset, barrier address
      // and fill assignment is a constant of its copy of the chunk code (a stage index at run time
      // cost about 40 of the ~290 instructions per chunk in address arithmetic and
      // rematerialisation, ncu 2026-12-02). Bit st of full_par / fill_par: the parity of stage
      // st's next s_full completion / of its next fill's s_empty wait (a fresh mbarrier reports
      // parity 1 complete, so a stage's first fill passes at once).
      // Stage fs's fill with chunk kc: lane 0 of warp 0 / 1 / 2 / 3 of warpgroup fs & 1 copies the
      // weights / token tile / scales / zeros (its wgmmas wait for the slowest warp: one thread
      // issuing all took 9-16% longer at 32-64 tokens per expert, 2026-12-02, H200) once every
      // thread has freed the stage's previous fill (s_empty).
      auto fill = [&](auto fsc, int kc) {
        constexpr int fs = decltype(fsc)::value;
        if (wg == (fs & 1) && issuer) {
          const uint32_t bar = full0 + 8 * fs, sbase = smem_base + uint32_t(fs * S::kStage);
          mbar_wait_parity(empty0 + 8 * fs, ((fill_par >> fs) & 1u) ^ 1u);
          // The threads' reads of the stage (weights and scales by ld.shared: the generic proxy)
          // before this copy's writes (the async proxy).
          fence_proxy_async_smem();
          if (wq == 0) {
            const uint32_t wb = s_ff.wbytes;
            mbar_arrive_expect_tx(bar, wb);
            bulk_copy_g2s(sbase + S::kXBytes, s_ff.w + int64_t(kc) * (int64_t(p.NT) * U * 32), wb, bar);
          } else if (wq == 1) {
            mbar_arrive_expect_tx(bar, uint32_t(BM * 128));
            tma_tile_g2s(sbase, &x_map, kc * 64, s_ff.row0, bar);
          } else {
            // Scales (wq 2) or zeros (wq 3) of the chunk's groups: per group slot, the block's
            // tiles x 8 contiguous words, one bulk copy each.
            const uint32_t* src = s_ff.meta[wq - 2];
            const uint32_t mb_ = s_ff.mbytes, dst0 = sbase + S::kXBytes + S::kWBytes + uint32_t((wq - 2) * S::kMetaBytes);
            const int mstride = p.NT * 8;
            auto grp_of = [&](int k) { return p.G == 1 ? 0 : (p.group_shift >= 0 ? k >> p.group_shift : k / p.group_len); };
            if (slot_mask == 0) {
              mbar_arrive_expect_tx(bar, mb_);
              bulk_copy_g2s(dst0, src + grp_of(kc * 64) * mstride, mb_, bar);
            } else {
              mbar_arrive_expect_tx(bar, nslots * mb_);
              for (int slot = 0; slot < 4; ++slot)
                if ((slot & slot_mask) == slot)
                  bulk_copy_g2s(dst0 + uint32_t(slot * NTB * 8 * 4), src + grp_of(kc * 64 + slot * 16) * mstride, mb_, bar);
            }
          }
        }
        fill_par ^= 1u << fs;
      };
      [&]<int... I>(std::integer_sequence<int, I...>) {
        ((I < nk ? fill(std::integral_constant<int, I>{}, kc0 + I) : void()), ...);
      }(std::make_integer_sequence<int, PF>{});
      int kt = 0;
      // Chunk kt in stage st; false once the item has no chunk kt. A warpgroup without tiles in
      // the block (a last n-block of 8 tiles) reads nothing but frees each stage once it was
      // filled (an early arrival would count toward the stage's previous fill).
      auto chunk = [&](auto stc, auto activec) -> bool {
        constexpr int st = decltype(stc)::value;
        constexpr bool active = decltype(activec)::value;
        if (kt >= nk) return false;
        if (kt + PF < nk) fill(std::integral_constant<int, (st + PF) % STAGES>{}, kc0 + kt + PF);
        mbar_wait_parity(full0 + 8 * st, (full_par >> st) & 1u);  // the chunk's weights, tokens and scales
        full_par ^= 1u << st;
        if constexpr (!active) {
          mbar_arrive(empty0 + 8 * st);
        } else {
          constexpr uint32_t so = uint32_t(st * S::kStage);
          uint32_t wv[2][4 * U];
#pragma unroll
          for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int u = 0; u < U; ++u) put_words(&wv[i][4 * u], lds128(w_addr + so + uint32_t((i * U + u) * 512)));
          if (kt == 0 || slot_mask != 0 || gpos == 0) {  // a new group: its scales (and zeros)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              if constexpr (TileMeta<T, BITS>::kZeroPair) {
                if (!p.zeros) {
                  meta[i].load_scales(lds32(m_addr + so + 32 * i), zpair);
                  continue;
                }
              }
              meta[i].load(lds32(m_addr + so + 32 * i), p.zeros ? lds32(m_addr + so + S::kMetaBytes + 32 * i) : p.default_zero);
            }
          }
          // The previous chunk's stage is freed inside (its wgmmas are done by k-step 1); an
          // item's first chunk has none (the last item freed its own at its end).
          mma_chunk(wv, desc_lo0 + (so >> 4), kt > 0 ? empty0 + 8 * ((st + STAGES - 1) % STAGES) : 0u);
          if (++gpos == cpg) gpos = 0;
        }
        ++kt;
        return true;
      };
      auto ring = [&](auto activec) {
        while ([&]<int... I>(std::integer_sequence<int, I...>) {
          return (chunk(std::integral_constant<int, I>{}, activec) && ...);
        }(std::make_integer_sequence<int, STAGES>{})) {
        }
      };
      if (!wg_active) {
        ring(std::false_type{});
        continue;  // no accumulators, no epilogue
      }
      ring(std::true_type{});
      wgmma_wait<0>();
      mbar_arrive(empty0 + 8 * ((nk - 1) % STAGES));  // the last chunk's stage
    } else {
      // ---- the k-loop with a block barrier per chunk: it orders the tokens' cp.async copies (if
      // any) and the stage refills (one thread issues every bulk copy) ----
      // x element offset of this thread's 4 token rows (-1: padding), once per item: 32-bit (the
      // launcher checks that x's rows fit), so they cost 4 registers, not 8. The thread fills
      // 16-byte unit xp8 of its rows: natural x: real pairs xp8 + 8c (c = 0..3, one 4-byte copy
      // each); k-permuted x: those four pairs are already adjacent, at element 8 * xp8.
      const int kperm = p.x_kperm;  // uniform
      int xo[XROWS];
#pragma unroll
      for (int i = 0; i < XROWS; ++i) {
        const int r = 32 * i + xr0;  // r < nvalid <= BM: rows past the block are never copied
        xo[i] = r < nvalid && !x_tma ? s_src[r] * int(p.x_stride) + (kperm ? 8 : 2) * xp8 : -1;
      }
      auto load_stage = [&](int kc, int st) {
        const uint32_t sx = smem_base + uint32_t(st * S::kStage) + xsoff;  // this thread's token unit
        if (x_tma) {
          // Tokens: the issuing thread's tensor copy below.
        } else if (kperm) {
          // Tokens, k-permuted x: one 16-byte copy per row.
#pragma unroll
          for (int i = 0; i < XROWS; ++i)
            if (xo[i] >= 0) cp_async16_s(sx + i * 4096, x + (xo[i] + kc * 64));
        } else {
          // Tokens: pair (lane & 7) + 8c of each row; c rotates with the row (bank-conflict free).
#pragma unroll
          for (int i = 0; i < XROWS; ++i) {
            if (xo[i] < 0) continue;
            const T* src = x + (xo[i] + kc * 64);
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) {
              const int c = (cc + (lane >> 3)) & 3;
              cp_async4_s(sx + i * 4096 + c * 4, src + 16 * c);
            }
          }
        }
        // Weights (for one k-chunk the block's tiles are contiguous in memory), the token tile
        // (x_tma) and the scales (and zeros) of the chunk's groups: bulk copies counted on the
        // stage's mbarrier.
        if (tid == 0) {
          const uint32_t bar = full0 + 8 * st, sbase = smem_base + uint32_t(st * S::kStage);
          const uint32_t xbytes = x_tma ? uint32_t(BM * 128) : 0u;
          mbar_arrive_expect_tx(bar, xbytes + wbytes + nslots * mbytes * (p.zeros ? 2u : 1u));
          bulk_copy_g2s(sbase + S::kXBytes, wexp + int64_t(kc) * wstride, wbytes, bar);
          if (x_tma) tma_tile_g2s(sbase, &x_map, kc * 64, mb * BM, bar);
          copy_meta(kc, p.scales, sbase + S::kXBytes + S::kWBytes, bar);
          if (p.zeros) copy_meta(kc, p.zeros, sbase + S::kXBytes + S::kWBytes + S::kMetaBytes, bar);
        }
      };
#pragma unroll
      for (int s = 0; s < PF; ++s) {
        if (s < nk) load_stage(kc0 + s, s);
        cp_async_commit();
      }
      int st = 0, st_load = PF;  // stage of chunk kt, stage of chunk kt + PF
      for (int kt = 0; kt < nk; ++kt) {
        cp_async_wait<PF - 1>();
        fence_proxy_async_smem();  // this thread's cp.async data -> visible to the async proxy (wgmma)
        __syncthreads();           // ... and to every warpgroup; all are past chunk kt-2's wgmmas
        if (kt + PF < nk) load_stage(kc0 + kt + PF, st_load);
        cp_async_commit();
        const uint32_t parity = (phase >> st) & 1u;
        phase ^= 1u << st;
        if (wg_active) {
          mbar_wait_parity(full0 + 8 * st, parity);  // the chunk's weights and scales
          const unsigned char* sb = smem + st * S::kStage;
          const uint4* sw = reinterpret_cast<const uint4*>(sb + S::kXBytes);
          const uint32_t* ss = reinterpret_cast<const uint32_t*>(sb + S::kXBytes + S::kWBytes);
          const uint32_t* sz = ss + NTB * 32;
          uint32_t wv[2][4 * U];
          // C::BARRIER_FREE: scales and zeros converted only where a new group starts (the
          // width-per-m-block m144w measured 3.6-4.7% slower so, docs/perf.md).
          const bool need_meta = !C::BARRIER_FREE || kt == 0 || slot_mask != 0 || gpos == 0;
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int ntl = wg * 8 + 2 * wq + i;
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const uint4 v = sw[(ntl * U + u) * 32 + lane];
              put_words(&wv[i][4 * u], v);
            }
            const int mi = (tig & slot_mask) * NTB * 8 + ntl * 8 + g;
            if (need_meta) meta[i].load(ss[mi], p.zeros ? sz[mi] : p.default_zero);
          }
          mma_chunk(wv, sw128_desc_lo(smem_base + uint32_t(st * S::kStage)), 0u);
        }
        if (++gpos == cpg) gpos = 0;
        st = st + 1 == STAGES ? 0 : st + 1;
        st_load = st_load + 1 == STAGES ? 0 : st_load + 1;
      }
      wgmma_wait<0>();
      cp_async_wait<0>();
    }
    if (!wg_active) continue;

    // ---- epilogue: accumulator e = 4t + r holds weight row g + 8*(r >> 1) of the warp's tile and
    // token column 8t + 2*tig + (r & 1) (the mma.m16n8 C layout, repeated along N) ----
    const int nact = (nvalid + 7) >> 3;  // 8-token column groups holding at least one token
    const int tile0 = nb * NTB + wg * 8 + 2 * wq;
    // f(col, a) for this lane's token columns col that hold a token; a: their accumulator index in
    // acc[tile] for weight row g (row g + 8: a + 2).
    auto each_token = [&](auto&& f) {
#pragma unroll
      for (int t = 0; t < BM / 8; ++t) {
        if (t >= nact) break;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = t * 8 + 2 * tig + e;
          if (s_slot[col] >= 0) f(col, 4 * t + e);
        }
      }
    };
    if (p.epilogue == 0) {
      // Tiles (tile0, tile0 + 1) = gate, up of intermediate columns 16 * (tile0 / 2) + g (+8),
      // stored at their k-permuted positions for an m144w GEMM2 (out_kperm).
      const int c_lo = (tile0 / 2) * 16 + g, c_hi = c_lo + 8;
      const int o_lo = p.out_kperm ? int(kperm_pos(c_lo)) : c_lo, o_hi = p.out_kperm ? int(kperm_pos(c_hi)) : c_hi;
      if (c_lo < p.N / 2)
        each_token([&](int col, int a) {
          char* row = static_cast<char*>(p.out) + (int64_t(mb) * BM + col) * p.out_stride * int64_t(sizeof(T));
          Act<T>::store(row + o_lo * sizeof(T), silu(acc[0][a]) * acc[1][a]);
          if (c_hi < p.N / 2) Act<T>::store(row + o_hi * sizeof(T), silu(acc[0][a + 2]) * acc[1][a + 2]);
        });
    } else {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int n_lo = (tile0 + i) * 16 + g;
        if (n_lo >= p.N) continue;
        each_token([&](int col, int a) {
          const float w = s_wt[col];
          T* orow = static_cast<T*>(p.out) + (int64_t(split) * p.num_slots + s_slot[col]) * p.out_stride;  // the slot's row of this split
          Act<T>::store(orow + n_lo, w * acc[i][a]);
          if (n_lo + 8 < p.N) Act<T>::store(orow + n_lo + 8, w * acc[i][a + 2]);
        });
      }
    }
  }
#else
  __trap();  // built without sm_90a: never launched (prepare_prefill refuses, kPrefillHasWgmma)
#endif
}

// x [rows, K] (2-byte elements, row stride `stride` elements; rows = what is allocated) as a
// tensor map of 64 x box_rows boxes with the 128-byte swizzle: one box is one k-chunk of an m-block.
// The driver's encoder, looked up once (first from prepare_prefill, at layer construction: never
// inside a stream capture).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    WNA16_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || !fn) throw Error("the wgmma tile configs: the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

inline void encode_x_tile_map(CUtensorMap* map, const void* x, int64_t K, int64_t rows, int64_t stride, int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || (stride * 2) % 16 != 0 || K % 64 != 0 || rows < 1 || rows > (int64_t(1) << 32))
    throw Error("wgmma tile config: x (K=" + std::to_string(K) + ", " + std::to_string(rows) + " rows, stride " +
                std::to_string(stride) + ") cannot be a tensor map (16-byte rows and base needed)");
  const cuuint64_t dims[2] = {cuuint64_t(K), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(stride * 2)};
  const cuuint32_t box[2] = {64, cuuint32_t(box_rows)}, elem[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, const_cast<void*>(x), dims, strides, box, elem,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) throw Error("wgmma tile config: cuTensorMapEncodeTiled failed (" + std::to_string(int(r)) + ")");
}

// Once per instantiation: shared-memory limit and blocks per SM (graph capture never hits a
// first-use cudaFuncSetAttribute: prepare_moe_gemm calls this at layer construction).
template <class C, class T, int BITS>
int prepare_prefill() {
  using S = PrefillSmem<C, BITS>;
  static int blocks_per_sm = 0;
  static std::once_flag once;
  std::call_once(once, [] {
    const DeviceInfo di = device_info();
    if (S::kBytes > di.max_smem_optin)
      throw Error(std::string("tile config ") + C::NAME + " needs " + std::to_string(S::kBytes) + " bytes of shared memory; the device allows " +
                  std::to_string(di.max_smem_optin));
    // Both k-loops of a barrier-free config (the barrier one runs x in token rows).
    for (auto kern : {wna16_moe_prefill_kernel<C, T, BITS, false>, wna16_moe_prefill_kernel<C, T, BITS, C::BARRIER_FREE>}) {
      WNA16_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kBytes));
      int n = 0;
      WNA16_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kern, C::THREADS, S::kBytes));
      if (n < 1) throw Error(std::string("tile config ") + C::NAME + " cannot be resident on this device");
      blocks_per_sm = blocks_per_sm == 0 ? n : std::min(blocks_per_sm, n);
    }
    if (!prefill_has_wgmma())
      throw Error(std::string("tile config ") + C::NAME + " needs the sm_90a build (wgmma); this binary's code for the device has none");
    tensor_map_encoder();
  });
  return blocks_per_sm;
}

template <class C, class T, int BITS>
void launch_prefill(const KParams& kp, int64_t upper_mblocks, cudaStream_t stream) {
  using S = PrefillSmem<C, BITS>;
  // The bulk copies of the scales (and zeros) need 16-byte aligned groups (packer-owned buffers).
  auto aligned16 = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  if (!aligned16(kp.scales) || (kp.zeros && !aligned16(kp.zeros)) || kp.meta_stride % 4 != 0 || kp.NT % 2 != 0)
    throw Error(std::string("tile config ") + C::NAME + ": scales/zeros not 16-byte aligned per group (meta_stride=" +
                std::to_string(kp.meta_stride) + ", NT=" + std::to_string(kp.NT) + ")");
  const int bps = prepare_prefill<C, T, BITS>();
  // x k-permuted in m-block order (GEMM2's intermediate, GEMM1's positioned x) of known extent:
  // the token tile by one tensor copy per chunk.
  CUtensorMap x_map{};
  const int x_tma = (kp.epilogue == 1 || kp.x_pos) && kp.x_kperm && kp.x_rows > 0 ? 1 : 0;
  if (x_tma) encode_x_tile_map(&x_map, kp.x, kp.K, kp.x_rows, kp.x_stride, C::BLOCK_M);
  const int64_t nb_count = (kp.NT + C::NTB - 1) / C::NTB;
  const int64_t upper = upper_mblocks * nb_count * kp.splits;
  // Up to 4 waves of resident blocks (one item each, the hardware balances uneven SMs); beyond
  // that the persistent loop.
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(upper, 4 * int64_t(device_info().sms) * bps));
  if (C::BARRIER_FREE && x_tma)
    wna16_moe_prefill_kernel<C, T, BITS, C::BARRIER_FREE><<<dim3(unsigned(grid)), dim3(C::THREADS), S::kBytes, stream>>>(kp, x_map, x_tma);
  else
    wna16_moe_prefill_kernel<C, T, BITS, false><<<dim3(unsigned(grid)), dim3(C::THREADS), S::kBytes, stream>>>(kp, x_map, x_tma);
  WNA16_CUDA_CHECK_LAUNCH();
}

// The explicit instantiations of config C (4- and 8-bit weights, both activation types), one
// translation unit per config (sm90_wna16_moe_prefill_<config>.cu) so that they build in parallel.
#define WNA16_PREFILL_INSTANTIATE(C, T, B)  \
  template int prepare_prefill<C, T, B>(); \
  template void launch_prefill<C, T, B>(const KParams&, int64_t, cudaStream_t);
#define WNA16_PREFILL_INSTANTIATE_CONFIG(C)                                                        \
  WNA16_PREFILL_INSTANTIATE(C, __half, 4) WNA16_PREFILL_INSTANTIATE(C, __nv_bfloat16, 4)           \
  WNA16_PREFILL_INSTANTIATE(C, __half, 8) WNA16_PREFILL_INSTANTIATE(C, __nv_bfloat16, 8)

}  // namespace wna16::cuda::gemm
