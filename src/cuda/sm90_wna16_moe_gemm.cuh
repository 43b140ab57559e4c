// The fused grouped W4A16 / W8A16 MoE GEMM (device code + templated launcher). One launch covers
// every expert: work items are (m-block of the align output, n-block, k-split); a persistent grid
// walks them, and the number of m-blocks is read on the device from num_tokens_post_padded, so
// blocks past the padded count never start work and the launch is capturable in a CUDA graph.
// Weight layout and operand roles: see moe_gemm.h. Instantiated per bit width in
// sm90_wna16_moe_gemm_w{4,8}.cu.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>

#include "cuda/cuda_check.h"
#include "cuda/moe_gemm.h"

namespace wna16::cuda::gemm {

// ---- tile table (a row may change speed, never results) ----------------------------------------
// Warps sit side by side along n and share the block's token tile (the B operand in shared
// memory); each warp owns WN = 2 consecutive 16-row weight tiles, which in GEMM1 are one gate/up
// pair, so the SiLU(gate)*up epilogue stays inside the lane.
template <int WARPS_, int WN_, int WM_, int STAGES_, bool DEFER_>
struct TileConfig {
  static constexpr int WARPS = WARPS_;             // warps per block, side by side along n
  static constexpr int WN = WN_;                   // 16-row weight tiles per warp (gate/up pairs in GEMM1)
  static constexpr int WM = WM_;                   // 8-token MMA columns per warp (= BLOCK_M / 8)
  static constexpr int STAGES = STAGES_;           // cp.async pipeline depth (64 k per stage)
  // Deferred scaling (few tokens, issue-bound): the MMA takes the raw magic-number codes, the
  // group's scale and zero point are applied to the fp32 partial sums once per group, the zero
  // point through the tokens' row sums (one extra MMA per k-step with an all-ones A operand).
  // 5 integer ops per 8 int4 weights instead of 15. Used when the group covers whole 64-k chunks.
  static constexpr bool DEFER = DEFER_;
  static constexpr int THREADS = WARPS * 32;
  static constexpr int NTB = WARPS * WN;           // 16-row tiles per block
  static constexpr int BLOCK_N = NTB * 16;
  static constexpr int BLOCK_M = WM * 8;
  static_assert(WN % 2 == 0, "GEMM1 needs whole gate/up tile pairs per warp");
  static_assert(PackedGemm::kTilePad % NTB == 0, "a block's tiles must divide the n-tile padding");
  static_assert(BLOCK_M <= THREADS, "one thread per token row fills the row tables");
  static_assert(STAGES >= 2 && STAGES <= 8, "pipeline depth");
  static_assert(WM >= 1 && WM <= 8, "accumulators: WN*WM*4 floats per lane");
};

// Decode (a few tokens per expert): one warp streams 2 tiles (a gate/up pair), deep pipeline,
// deferred. Two tiles, not four: at M=1 the warps per scheduler, not the
// instructions per byte, bound the rate (ncu, DeepSeek-V3 M=1: 1.1 warps and 0.29 issues per cycle).
using CfgM8 = TileConfig<1, 2, 1, 6, true>;
// Medium (up to ~40 tokens per expert).
using CfgM32 = TileConfig<4, 2, 4, 4, true>;
// Prefill: 64-token tiles, each dequantised weight fragment feeds 8 MMAs; weights reused via L2.
using CfgM64 = TileConfig<4, 2, 8, 4, false>;

// The wgmma tile configs (the kernel table's rows m64w and m144w, dispatch.cu): the same kernel
// with 64 or 144 tokens per m-block. 144 tokens take 242 registers (one block per SM); 64 fit two
// blocks per SM, whose rings and k-loops interleave (the mid-range m-blocks of 21-64 tokens).
struct CfgM144W {
  static constexpr const char* NAME = "m144w";
  static constexpr int THREADS = 256;  // 2 warpgroups
  static constexpr int BLOCK_M = 144;  // tokens per m-block (the align block size)
  static constexpr int MIN_BLOCKS = 1;  // blocks per SM the registers are budgeted for
  static constexpr int XROWS = (BLOCK_M + 31) / 32;  // token rows a thread copies per stage
  static constexpr int NTB = 16;       // 16-row weight tiles per block
  static constexpr int BLOCK_N = NTB * 16;
  static constexpr int stages(int bits) { return bits == 4 ? 6 : 5; }  // chunks in the ring
  // The wgmma width follows the m-block's tokens (16-column steps; 65-144 tokens vary widely).
  static constexpr bool FULL_WIDTH = false;
  // A block barrier per chunk, one thread issuing the copies, scales converted every chunk, GEMM1's
  // x in token rows: m64w's way (BARRIER_FREE, x in m-block order) measured 3-10% slower on
  // m144w's rows of Qwen3-30B-A3B, DeepSeek-V2-Lite and Qwen1.5-MoE at 1024-4096 tokens and +3% at
  // DeepSeek-V3 M=4096, 2-3% faster on Mixtral's (2026-12-02, H200).
  static constexpr bool BARRIER_FREE = false;
};
struct CfgM64W {
  static constexpr const char* NAME = "m64w";
  static constexpr int THREADS = 256;
  static constexpr int BLOCK_M = 64;
  static constexpr int MIN_BLOCKS = 2;
  static constexpr int XROWS = (BLOCK_M + 31) / 32;
  static constexpr int NTB = 16;
  static constexpr int BLOCK_N = NTB * 16;
  // Two blocks of 5 int4 stages (20 KB each) share an SM's 228 KB; int8 stages (28 KB) fit one.
  static constexpr int stages(int bits) { return bits == 4 ? 5 : 6; }
  // Always 64 token columns: no width branch per k-step (ptxas serialised the wgmmas of per-width
  // k-loops, and the branch with its descriptor moves was ~45 of ~400 instructions per chunk),
  // spills 84/292 -> 8/8 bytes; the padding columns cost tensor time the issue-bound loop spares.
  static constexpr bool FULL_WIDTH = true;
  // With the token tiles by tensor copies (GemmRun::x_by_position / GEMM2's intermediate): the
  // k-loop without block barriers (s_full / s_empty mbarriers per stage), the copies issued by the
  // four warps of one warpgroup, scales converted once per group (sm90_wna16_moe_prefill.cuh).
  static constexpr bool BARRIER_FREE = true;
};

// ---- PTX helpers ----------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global->shared; src_bytes = 0 zero-fills (padding rows).
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
// NOTE: no L2::cache_hint (evict-first) variant: ptxas 13.0 sometimes encoded its 64-bit policy
// operand in an odd uniform register (LDGSTS ... desc[UR1]), an illegal instruction at run time.
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)), "l"(src));
}
// The same two copies to a shared-memory address the caller computed once (a generic pointer is
// converted again at every call: ncu counted that conversion in the wgmma kernel's k-loop).
__device__ __forceinline__ void cp_async16_s(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async4_s(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
// The four words of a 16-byte load, in order, into w[0..3] (packed weight codes of one lane).
__device__ __forceinline__ void put_words(uint32_t* w, const uint4& v) {
  w[0] = v.x;
  w[1] = v.y;
  w[2] = v.z;
  w[3] = v.w;
}
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ int ld_acquire_gpu(const int32_t* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
template <int LUT>
__device__ __forceinline__ uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c), "n"(LUT));
  return r;
}

// ---- activation-type traits -------------------------------------------------------------------
template <class T>
struct Act;

template <>
struct Act<__half> {
  // 0x6400 = 1024.0: OR-ing a code q < 1024 into the mantissa gives exactly 1024 + q.
  static constexpr uint32_t kMagic = 0x6400u;
  __device__ static __forceinline__ uint32_t sub2(uint32_t a, uint32_t b) {
    uint32_t r;
    asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
  }
  __device__ static __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
    uint32_t r;
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
  }
  // The checkpoint's f16 scale is the f16 operand as is.
  __device__ static __forceinline__ uint32_t scale2(uint32_t s16) { return s16 * 0x10001u; }
  __device__ static __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ static __forceinline__ void store(void* p, float v) { *static_cast<__half*>(p) = __float2half_rn(v); }
};

template <>
struct Act<__nv_bfloat16> {
  // 0x4300 = 128.0 in bf16 (7 mantissa bits): 128 + q is exact for q < 128.
  static constexpr uint32_t kMagic = 0x4300u;
  __device__ static __forceinline__ uint32_t sub2(uint32_t a, uint32_t b) {
    uint32_t r;
    asm("sub.rn.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
  }
  __device__ static __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
    uint32_t r;
    asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
  }
  // NOTE: the f16 scale is rounded to bf16 once per group here (the weight then carries bf16's
  // 8 significant bits, the same precision as the activations it multiplies).
  __device__ static __forceinline__ uint32_t scale2(uint32_t s16) {
    const float f = __half2float(__ushort_as_half(static_cast<unsigned short>(s16)));
    const uint32_t b = __bfloat16_as_ushort(__float2bfloat16_rn(f));
    return b * 0x10001u;
  }
  __device__ static __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ static __forceinline__ void store(void* p, float v) {
    *static_cast<__nv_bfloat16*>(p) = __float2bfloat16_rn(v);
  }
};

// Per lane and 16-row tile, what dequantisation needs for the current group: rows g and g+8.
template <class T, int BITS>
struct TileMeta {
  uint32_t s_lo, s_hi;  // scale pairs (both halves equal) in T; int8+bf16: unused
  uint32_t z_lo, z_hi;  // (magic + z) pairs in T; int8+bf16: unused
  float fs_lo, fs_hi, fz_lo, fz_hi;  // int8+bf16 only: fp32 scale and 2^23 + z

  __device__ __forceinline__ void load(uint32_t sw, uint32_t zw) {
    const uint32_t zl = zw & 0xffffu, zh = zw >> 16;
    if constexpr (BITS == 8 && std::is_same_v<T, __nv_bfloat16>) {
      // 8-bit codes do not fit bf16's 7-bit mantissa trick: go through fp32 (2^23 + q is exact).
      fs_lo = __half2float(__ushort_as_half(static_cast<unsigned short>(sw & 0xffffu)));
      fs_hi = __half2float(__ushort_as_half(static_cast<unsigned short>(sw >> 16)));
      fz_lo = 8388608.0f + static_cast<float>(zl);
      fz_hi = 8388608.0f + static_cast<float>(zh);
    } else {
      s_lo = Act<T>::scale2(sw & 0xffffu);
      s_hi = Act<T>::scale2(sw >> 16);
      z_lo = (Act<T>::kMagic | zl) * 0x10001u;
      z_hi = (Act<T>::kMagic | zh) * 0x10001u;
    }
  }
};

// Codes of MMA k-step j (words of this lane's chunk data) -> the 4 A-operand registers.
// (q - z) is exact in T (small integers), times s rounds once.
template <class T, int BITS>
__device__ __forceinline__ void dequant(const uint32_t* wv, int j, const TileMeta<T, BITS>& m, uint32_t (&a)[4]) {
  using A = Act<T>;
  if constexpr (BITS == 4) {
    const uint32_t w = wv[j];
    constexpr uint32_t kMask = 0x000f000fu, kMagic2 = A::kMagic * 0x10001u;
    // (x & mask) | magic in one lop3: nibbles i and i+4 land in the two halves of register i.
    a[0] = A::mul2(A::sub2(lop3<0xEA>(w, kMask, kMagic2), m.z_lo), m.s_lo);
    a[1] = A::mul2(A::sub2(lop3<0xEA>(w >> 4, kMask, kMagic2), m.z_hi), m.s_hi);
    a[2] = A::mul2(A::sub2(lop3<0xEA>(w >> 8, kMask, kMagic2), m.z_lo), m.s_lo);
    a[3] = A::mul2(A::sub2(lop3<0xEA>(w >> 12, kMask, kMagic2), m.z_hi), m.s_hi);
  } else if constexpr (std::is_same_v<T, __half>) {
    const uint32_t w0 = wv[2 * j], w1 = wv[2 * j + 1];
    // prmt builds {0x64, q_b, 0x64, q_a}: two f16 values 1024 + q.
    a[0] = A::mul2(A::sub2(__byte_perm(w0, 0x64646464u, 0x4140), m.z_lo), m.s_lo);
    a[1] = A::mul2(A::sub2(__byte_perm(w0, 0x64646464u, 0x4342), m.z_hi), m.s_hi);
    a[2] = A::mul2(A::sub2(__byte_perm(w1, 0x64646464u, 0x4140), m.z_lo), m.s_lo);
    a[3] = A::mul2(A::sub2(__byte_perm(w1, 0x64646464u, 0x4342), m.z_hi), m.s_hi);
  } else {
    const uint32_t w0 = wv[2 * j], w1 = wv[2 * j + 1];
    // prmt builds the fp32 bit pattern 0x4B0000qq = 2^23 + q.
    auto f = [](uint32_t w, int byte) { return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540 | byte)); };
    auto pk = [](float lo, float hi) {
      __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
      return *reinterpret_cast<uint32_t*>(&v);
    };
    a[0] = pk((f(w0, 0) - m.fz_lo) * m.fs_lo, (f(w0, 1) - m.fz_lo) * m.fs_lo);
    a[1] = pk((f(w0, 2) - m.fz_hi) * m.fs_hi, (f(w0, 3) - m.fz_hi) * m.fs_hi);
    a[2] = pk((f(w1, 0) - m.fz_lo) * m.fs_lo, (f(w1, 1) - m.fz_lo) * m.fs_lo);
    a[3] = pk((f(w1, 2) - m.fz_hi) * m.fs_hi, (f(w1, 3) - m.fz_hi) * m.fs_hi);
  }
}

// Deferred mode: the A registers hold magic + q exactly (no zero point, no scale).
template <class T, int BITS>
__device__ __forceinline__ void raw_codes(const uint32_t* wv, int j, uint32_t (&a)[4]) {
  if constexpr (BITS == 4) {
    const uint32_t w = wv[j];
    constexpr uint32_t kMask = 0x000f000fu, kMagic2 = Act<T>::kMagic * 0x10001u;
    a[0] = lop3<0xEA>(w, kMask, kMagic2);
    a[1] = lop3<0xEA>(w >> 4, kMask, kMagic2);
    a[2] = lop3<0xEA>(w >> 8, kMask, kMagic2);
    a[3] = lop3<0xEA>(w >> 12, kMask, kMagic2);
  } else {
    static_assert(std::is_same_v<T, __half>, "int8 codes exceed bf16's magic-number range");
    const uint32_t w0 = wv[2 * j], w1 = wv[2 * j + 1];
    a[0] = __byte_perm(w0, 0x64646464u, 0x4140);
    a[1] = __byte_perm(w0, 0x64646464u, 0x4342);
    a[2] = __byte_perm(w1, 0x64646464u, 0x4140);
    a[3] = __byte_perm(w1, 0x64646464u, 0x4342);
  }
}
template <class T>
__device__ __forceinline__ float magic_value() {
  return std::is_same_v<T, __half> ? 1024.0f : 128.0f;
}
template <class T>
__device__ __forceinline__ uint32_t ones2() {
  return std::is_same_v<T, __half> ? 0x3C003C00u : 0x3F803F80u;  // 1.0 in both halves
}
__device__ __forceinline__ float f16_lo(uint32_t w) { return __half2float(__ushort_as_half((unsigned short)(w & 0xffffu))); }
__device__ __forceinline__ float f16_hi(uint32_t w) { return __half2float(__ushort_as_half((unsigned short)(w >> 16))); }

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

// Kernel arguments (by value; everything the launcher checked).
struct KParams {
  const uint4* qweight;
  const uint32_t* scales;
  const uint32_t* zeros;    // null: symmetric
  const int32_t* perm;      // GEMM1 act-order gather for the gate (or all) tiles; null: none
  const int32_t* perm_up;   // GEMM1 act-order gather for the up tiles when it differs; null: same
  int64_t qw_stride;        // uint4 per expert
  int64_t meta_stride;      // words per expert
  int K, N, NT, group_len, KC, G;
  uint32_t default_zero;    // (2^(bits-1)) in both halves, when zeros == null
  const void* x;
  int64_t x_stride;
  void* out;
  int64_t out_stride;
  const float* topk_weights;
  int topk;                 // slots per token
  int x_div;                // SiluMul: x row = slot / x_div (topk; 1 when x holds one row per slot)
  int num_slots;
  const int32_t* sorted_ids;
  const int32_t* expert_ids;
  const int32_t* ntpp;
  int mb_begin, mb_count;
  int splits, kc_per_split;
  int epilogue;  // 0: SiluMul, 1: WeightedSum
  int defer_ok;  // deferred scaling possible: group_len a multiple of 64, and not int8 with bf16
  int chunks_per_group;  // group_len / 64 when defer_ok
  int cpg_shift;         // log2(chunks_per_group) when a power of two, else -1
  int group_shift;       // log2(group_len) when a power of two, else -1 (shifts, not divisions)
  int decode_kw;         // decode kernel only: warps sharing a tile pair along K (1, 2, 4)
  int pdl;               // decode kernel only: launched as a programmatic dependent (1: waits before
                         // reading x; 2: waits before anything)
  int static_groups;     // decode kernel only: splits are whole groups, static-group variants allowed
  int decode_ppw;        // decode kernel only: tile pairs per warp (1; 2: the int4 4-tile variant)
  int x_kperm;           // prefill kernel only: x k-permuted (kperm_pos): 16-byte token copies
  int out_kperm;         // prefill kernel only, GEMM1: output written k-permuted
  int64_t x_rows;        // prefill kernel, GEMM2 or x_pos: rows of x allocated (GemmRun::x_rows); 0: unknown
  int x_pos;             // SiluMul: x row = m-block position, not token (GemmRun::x_by_position)
  int32_t* mb_done;      // decode kernel only, null: none. [m-block][kHandoffSlots]: GEMM1 adds the
                         // tile pairs it stored to slot pair / mb_done_pps of their m-block;
  int mb_done_target;    // GEMM2: GEMM1's tile pairs (all slots); waits for the slots its k-chunks read
  int mb_done_pps;       // tile pairs per handoff slot (handoff_pairs_per_slot), even
  int split_major;       // decode kernel only: items ordered (m-block, split, n-block), not split fastest
  int32_t* item_claim;   // decode kernel only, GEMM2 with mb_done: work items taken from this counter
  int pre_slices;        // decode kernel only, GEMM1 with pdl == 2: GemmRun::pre_wait_slices
  int pre_parts;         // decode kernel only: K parts per shared-slice item (1: whole K), each pre_kc
  int pre_kc;            //   chunks (whole groups); > 1 needs pre_scratch, pre_count (GemmRun)
  float* pre_scratch;
  int32_t* pre_count;
  int pre_base;          // decode kernel only: the shared slices' items (whole K), and x pre_parts
  int pre_total;
  // Decode kernel only, one token (GemmRun::route_logits): the token's [route_E] fp32 router
  // logits; the kernel routes it itself (route_one_token) instead of reading the align tables and
  // routing weights. Null: off.
  const float* route_logits;
  int route_E, route_topk, route_renorm;
};

// A work item of the persistent loops (staged, decode and prefill kernels): (m-block, n-block,
// k-split), the split varying fastest (the decode kernel's GEMM2 with handoff slots: the n-block
// fastest, so the items claimed first read the slots GEMM1 stores first). expert < 0: a padding
// m-block of the align output.
struct WorkItem {
  int split, nb, mb, expert;
};
// route_expert: the experts of the m-blocks where the kernel routed the token itself (shared
// memory), else null (expert_ids).
__device__ __forceinline__ WorkItem decode_item(const KParams& p, int64_t item, int nb_count,
                                                const int* route_expert = nullptr) {
  WorkItem w;
  // (m-block, outer, inner): the inner index varies fastest (the split, or the n-block).
  const int inner_n = p.split_major ? nb_count : p.splits;
  const int inner = int(item % inner_n);
  const int64_t rest = item / inner_n;
  const int outer_n = p.split_major ? p.splits : nb_count;
  const int outer = int(rest % outer_n);
  w.mb = p.mb_begin + int(rest / outer_n);
  w.split = p.split_major ? outer : inner;
  w.nb = p.split_major ? inner : outer;
  w.expert = route_expert ? route_expert[w.mb] : __ldg(p.expert_ids + w.mb);
  return w;
}

// The staged and prefill kernels' token tables of m-block mb: s_slot[c] = the slot of token column c
// (-1: padding), s_src[c] = the x row that feeds it; for the weighted sum (epilogue 1) also the
// column's output row s_orow[c] (its token) and routing weight s_wt[c], read here once per item
// by all columns at once: read in the epilogue, each weight was a dependent L2 round trip per
// column (ncu, prefill GEMM2 at DeepSeek-V3 M=4096: the epilogue's FMULs waited on them).
// Returns the valid columns, block-wide (they form a prefix: align pads each expert's run at its
// end). Every thread of the block calls it.
template <int BM>
__device__ __forceinline__ int fill_row_tables(const KParams& p, int mb, int tid, int* s_slot, int* s_src, int* s_orow,
                                               float* s_wt) {
  int is_valid = 0;
  if (tid < BM) {
    const int slot = __ldg(p.sorted_ids + int64_t(mb) * BM + tid);
    is_valid = slot >= 0 && slot < p.num_slots;
    s_slot[tid] = is_valid ? slot : -1;
    s_src[tid] = !is_valid ? -1 : (p.epilogue == 0 && !p.x_pos ? slot / p.x_div : mb * BM + tid);
    if (p.epilogue != 0) {
      s_orow[tid] = is_valid ? slot / p.topk : -1;
      s_wt[tid] = is_valid ? __ldg(p.topk_weights + slot) : 0.f;
    }
  }
  return __syncthreads_count(is_valid);
}

template <class CFG, int BITS>
struct Smem {
  static constexpr int U = BITS / 4;  // 16-byte words per lane per chunk
  static constexpr int kXRow = 9;     // 16-byte units per token row: 8 + 1 pad (no bank conflicts)
  static constexpr int kWBytes = CFG::NTB * U * 32 * 16;
  static constexpr int kXBytes = CFG::BLOCK_M * kXRow * 16;
  static constexpr int kMetaBytes = CFG::NTB * 32 * 4;
  static constexpr int stage_bytes(int xcopies) { return kWBytes + xcopies * kXBytes + 2 * kMetaBytes; }
  static constexpr int bytes(int xcopies) { return CFG::STAGES * stage_bytes(xcopies); }
};

template <class CFG, class T, int BITS>
__global__ void __launch_bounds__(CFG::THREADS) wna16_moe_gemm_kernel(const KParams p) {
  using S = Smem<CFG, BITS>;
  constexpr int U = S::U, BM = CFG::BLOCK_M, NTB = CFG::NTB, WN = CFG::WN, WM = CFG::WM;
  constexpr int STAGES = CFG::STAGES, THREADS = CFG::THREADS;
  // int8 codes do not fit bf16's magic-number trick: that pair always scales per weight.
  constexpr bool kCanDefer = CFG::DEFER && !(BITS == 8 && std::is_same_v<T, __nv_bfloat16>);
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int s_src[BM];   // x row feeding each token column; -1: padding
  __shared__ int s_slot[BM];  // slot (token * topk + choice) of each column; -1: padding
  __shared__ int s_orow[BM];  // weighted sum: output row (token) of each column
  __shared__ float s_wt[BM];  // weighted sum: routing weight of each column

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tig = lane & 3;
  const int xcopies = p.perm_up != nullptr ? 2 : 1;
  const int stage_bytes = S::stage_bytes(xcopies);
  const bool defer = kCanDefer && p.defer_ok;
  const int num_mb = p.mb_count >= 0 ? p.mb_count : (__ldg(p.ntpp) / BM);
  const int nb_count = p.NT / NTB;
  const int64_t total = int64_t(num_mb) * nb_count * p.splits;
  const T* x = static_cast<const T*>(p.x);

  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const WorkItem it = decode_item(p, item, nb_count);
    const int split = it.split, nb = it.nb, mb = it.mb, expert = it.expert;
    __syncthreads();  // the previous item is done with s_src / s_slot and every stage buffer
    const int nvalid = fill_row_tables<BM>(p, mb, tid, s_slot, s_src, s_orow, s_wt);
    if (expert < 0 || nvalid == 0) continue;  // uniform across the block
    const int nact = (nvalid + 7) / 8;        // 8-token MMA columns holding at least one token
    const int kc0 = split * p.kc_per_split;
    const int kc_end = min(p.KC, kc0 + p.kc_per_split);
    const int nk = kc_end - kc0;
    if (nk <= 0) continue;

    const uint4* wexp = p.qweight + int64_t(expert) * p.qw_stride + int64_t(nb) * NTB * U * 32;
    const int64_t wstride = int64_t(p.NT) * U * 32;  // uint4 per k-chunk
    const int mstride = p.NT * 8;                    // meta words per group
    const int64_t meta_base = int64_t(expert) * p.meta_stride + int64_t(nb) * NTB * 8;
    const int32_t* perm_e = p.perm ? p.perm + int64_t(expert) * p.K : nullptr;
    const int32_t* perm_up_e = p.perm_up ? p.perm_up + int64_t(expert) * p.K : nullptr;
    // Deferred mode flushes (and needs the scales of) the last chunk of each group and of the split.
    auto group_ends = [&](int kc) {
      if (kc + 1 == kc_end) return true;
      if (p.G == 1) return kc + 1 == p.KC;
      return p.cpg_shift >= 0 ? ((kc + 1) & ((1 << p.cpg_shift) - 1)) == 0 : (kc + 1) % p.chunks_per_group == 0;
    };
    // Per-thread load state, computed once per item so a stage costs a few adds per copy: the
    // x rows this thread copies (row base + its 16-byte unit; null: padding row) and the
    // offsets of its scale/zero entries.
    constexpr int NW = (NTB * U * 32 + THREADS - 1) / THREADS;
    constexpr int NXE = (BM * 8 + THREADS - 1) / THREADS;
    constexpr int NME = (NTB * 32 + THREADS - 1) / THREADS;
    // NOTE: 32-bit element offsets (the launcher checks that they fit) keep the register count
    // of the 64-token config below its spill point.
    int xoff[NXE];  // x element offset of this thread's row and unit, -1: padding row
#pragma unroll
    for (int e = 0; e < NXE; ++e) {
      const int i = tid + e * THREADS;
      const int r = i >> 3;
      xoff[e] = (i < BM * 8 && r < nvalid) ? s_src[r] * int(p.x_stride) + (i & 7) * 8 : -1;
    }
    int moff[NME];  // meta word offset of this thread's entries (group 0)
#pragma unroll
    for (int e = 0; e < NME; ++e) {
      const int i = tid + e * THREADS, ntl = i >> 5, ln = i & 31;
      moff[e] = int(meta_base) + ntl * 8 + (ln >> 2);
    }

    auto load_stage = [&](int kc, int st) {
      unsigned char* sb = smem + st * stage_bytes;
      uint4* sw = reinterpret_cast<uint4*>(sb);
      // Weights: for one k-chunk the block's NTB tiles are contiguous in memory.
      const uint4* wsrc = wexp + int64_t(kc) * wstride;
#pragma unroll
      for (int e = 0; e < NW; ++e) {
        const int i = tid + e * THREADS;
        if ((NTB * U * 32) % THREADS == 0 || i < NTB * U * 32) cp_async16(sw + i, wsrc + i);
      }
      // Activations: the valid rows of BM x 64 k (eight 16-byte units). Padding rows are not
      // loaded: they only feed MMA columns whose results are discarded.
      uint4* sx = reinterpret_cast<uint4*>(sb + S::kWBytes);
#pragma unroll
      for (int e = 0; e < NXE; ++e) {
        if (xoff[e] < 0) continue;
        const int i = tid + e * THREADS;
        const int dst = (i >> 3) * S::kXRow + (i & 7);
        if (perm_e == nullptr) {
          cp_async16(sx + dst, x + xoff[e] + kc * 64);
        } else {
          // Act-order: gather the channels in sorted-g_idx order (synchronous; the stage being
          // written is not read until after the next barrier). Up tiles may have their own order.
          const int k = kc * 64 + (i & 7) * 8;
          const unsigned short* xr = reinterpret_cast<const unsigned short*>(x + xoff[e] - (i & 7) * 8);
          for (int c = 0; c < xcopies; ++c) {
            const int32_t* pm = (c == 0 ? perm_e : perm_up_e) + k;
            uint32_t v[4] = {0u, 0u, 0u, 0u};
#pragma unroll
            for (int q = 0; q < 8; ++q) v[q >> 1] |= uint32_t(__ldg(xr + __ldg(pm + q))) << (16 * (q & 1));
            sx[c * BM * S::kXRow + dst] = make_uint4(v[0], v[1], v[2], v[3]);
          }
        }
      }
      // Scales (and zeros) of each lane's group for this chunk: lane tig covers k in
      // [64*kc + 16*tig, +16), always inside one group (group_len is a multiple of 16).
      if (!defer || group_ends(kc)) {
        uint32_t* ss = reinterpret_cast<uint32_t*>(sb + S::kWBytes + xcopies * S::kXBytes);
        uint32_t* sz = ss + NTB * 32;
        const int grp0 = p.G == 1 ? 0 : (p.cpg_shift >= 0 ? kc >> p.cpg_shift : kc / p.chunks_per_group);
#pragma unroll
        for (int e = 0; e < NME; ++e) {
          const int i = tid + e * THREADS;
          if ((NTB * 32) % THREADS != 0 && i >= NTB * 32) continue;
          int grp = grp0;
          if (!defer) {
            const int k = kc * 64 + ((tid + e * THREADS) & 3) * 16;
            grp = p.G == 1 ? 0 : (p.group_shift >= 0 ? k >> p.group_shift : k / p.group_len);
          }
          const int off = moff[e] + grp * mstride;
          cp_async4(ss + i, p.scales + off);
          if (p.zeros) cp_async4(sz + i, p.zeros + off);
        }
      }
    };

    float acc[WN][WM][4];
#pragma unroll
    for (int i = 0; i < WN; ++i)
#pragma unroll
      for (int t = 0; t < WM; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][t][e] = 0.0f;
    // Deferred mode: this group's raw partial sums and the tokens' row sums (per activation copy).
    // NOTE: two named row-sum arrays (not xs[copy]) keep every index a compile-time constant:
    // the copy is a run-time value, and a run-time index would move the array to local memory.
    float tmp[kCanDefer ? WN : 1][kCanDefer ? WM : 1][4];
    float xs0[kCanDefer ? WM : 1][2], xs1[kCanDefer ? WM : 1][2];
    if constexpr (kCanDefer) {
#pragma unroll
      for (int i = 0; i < WN; ++i)
#pragma unroll
        for (int t = 0; t < WM; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) tmp[i][t][e] = 0.0f;
#pragma unroll
      for (int t = 0; t < WM; ++t) xs0[t][0] = xs0[t][1] = xs1[t][0] = xs1[t][1] = 0.0f;
    }

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < nk) load_stage(kc0 + s, s);
      cp_async_commit();
    }

    for (int kt = 0; kt < nk; ++kt) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // stage kt visible to all; everyone is past stage kt-1 (its buffer is reused)
      {
        const int nx = kt + STAGES - 1;
        if (nx < nk) load_stage(kc0 + nx, nx % STAGES);
        cp_async_commit();
      }
      const unsigned char* sb = smem + (kt % STAGES) * stage_bytes;
      const uint4* sw = reinterpret_cast<const uint4*>(sb);
      const uint4* sx = reinterpret_cast<const uint4*>(sb + S::kWBytes);
      const uint32_t* ss = reinterpret_cast<const uint32_t*>(sb + S::kWBytes + xcopies * S::kXBytes);
      const uint32_t* sz = ss + NTB * 32;

      uint32_t wq[WN][4 * U];
#pragma unroll
      for (int i = 0; i < WN; ++i) {
        const int ntl = warp * WN + i;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const uint4 v = sw[(ntl * U + u) * 32 + lane];
          put_words(&wq[i][4 * u], v);
        }
      }

      if (kCanDefer && defer) {
        if constexpr (kCanDefer) {
          const uint32_t one = ones2<T>();
          const uint32_t ones[4] = {one, one, one, one};
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            // B operand: token row (t*8 + g), 16-byte unit (2*tig + h) = real k 16*tig + 8*h .. +8,
            // i.e. MMA k-steps 2h (words 0,1) and 2h+1 (words 2,3).
            uint4 xb[WM];
#pragma unroll
            for (int i = 0; i < WN; ++i) {
              const int c = (xcopies == 2 && (i & 1)) ? 1 : 0;
              if (i == 0 || xcopies == 2) {
#pragma unroll
                for (int t = 0; t < WM; ++t)
                  if (WM == 1 || t < nact) xb[t] = sx[c * BM * S::kXRow + (t * 8 + g) * S::kXRow + 2 * tig + h];
                if (i < 2) {  // row sums of this copy (the zero-point correction); i == 1: up copy
#pragma unroll
                  for (int t = 0; t < WM; ++t)
                    if (WM == 1 || t < nact) {
                      float(&xr)[2] = i == 0 ? xs0[t] : xs1[t];
                      float d[4] = {xr[0], xr[1], 0.f, 0.f};
                      Act<T>::mma(d, ones, xb[t].x, xb[t].y);
                      Act<T>::mma(d, ones, xb[t].z, xb[t].w);
                      xr[0] = d[0];
                      xr[1] = d[1];
                    }
                }
              }
#pragma unroll
              for (int jj = 0; jj < 2; ++jj) {
                uint32_t a[4];
                raw_codes<T, BITS>(wq[i], 2 * h + jj, a);
#pragma unroll
                for (int t = 0; t < WM; ++t)
                  if (WM == 1 || t < nact) Act<T>::mma(tmp[i][t], a, jj ? xb[t].z : xb[t].x, jj ? xb[t].w : xb[t].y);
              }
            }
          }
          if (group_ends(kc0 + kt)) {
            // acc += s * (sum (magic + q) x - (magic + z) * sum x) = s * sum (q - z) x, per row.
#pragma unroll
            for (int i = 0; i < WN; ++i) {
              const int ntl = warp * WN + i;
              const bool up_copy = xcopies == 2 && (i & 1);
              const uint32_t sw32 = ss[ntl * 32 + lane];
              const uint32_t zw = p.zeros ? sz[ntl * 32 + lane] : p.default_zero;
              const float s_lo = f16_lo(sw32), s_hi = f16_hi(sw32);
              const float zc_lo = magic_value<T>() + float(zw & 0xffffu), zc_hi = magic_value<T>() + float(zw >> 16);
#pragma unroll
              for (int t = 0; t < WM; ++t) {
                const float x0 = up_copy ? xs1[t][0] : xs0[t][0], x1 = up_copy ? xs1[t][1] : xs0[t][1];
                acc[i][t][0] = fmaf(s_lo, fmaf(-zc_lo, x0, tmp[i][t][0]), acc[i][t][0]);
                acc[i][t][1] = fmaf(s_lo, fmaf(-zc_lo, x1, tmp[i][t][1]), acc[i][t][1]);
                acc[i][t][2] = fmaf(s_hi, fmaf(-zc_hi, x0, tmp[i][t][2]), acc[i][t][2]);
                acc[i][t][3] = fmaf(s_hi, fmaf(-zc_hi, x1, tmp[i][t][3]), acc[i][t][3]);
                tmp[i][t][0] = tmp[i][t][1] = tmp[i][t][2] = tmp[i][t][3] = 0.f;
              }
            }
#pragma unroll
            for (int t = 0; t < WM; ++t) xs0[t][0] = xs0[t][1] = xs1[t][0] = xs1[t][1] = 0.f;
          }
        }
      } else {
        TileMeta<T, BITS> meta[WN];
#pragma unroll
        for (int i = 0; i < WN; ++i) {
          const int ntl = warp * WN + i;
          meta[i].load(ss[ntl * 32 + lane], p.zeros ? sz[ntl * 32 + lane] : p.default_zero);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint4 xb[WM];
#pragma unroll
          for (int i = 0; i < WN; ++i) {
            if (i == 0 || xcopies == 2) {
              // Up tiles of GEMM1 with their own act-order read the second activation copy.
              const int c = (xcopies == 2 && (i & 1)) ? 1 : 0;
#pragma unroll
              for (int t = 0; t < WM; ++t)
                if (WM == 1 || t < nact) xb[t] = sx[c * BM * S::kXRow + (t * 8 + g) * S::kXRow + 2 * tig + h];
            }
#pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
              uint32_t a[4];
              dequant<T, BITS>(wq[i], 2 * h + jj, meta[i], a);
#pragma unroll
              for (int t = 0; t < WM; ++t)
                if (WM == 1 || t < nact) Act<T>::mma(acc[i][t], a, jj ? xb[t].z : xb[t].x, jj ? xb[t].w : xb[t].y);
            }
          }
        }
      }
    }
    cp_async_wait<0>();

    // ---- epilogue: C rows are weight rows (g, g+8), columns are tokens (2*tig, 2*tig+1) ----
    if (p.epilogue == 0) {
      // Tiles (2p, 2p+1) = gate, up of intermediate columns 16p + g and 16p + g + 8.
#pragma unroll
      for (int pr = 0; pr < WN / 2; ++pr) {
        const int pair = (nb * NTB + warp * WN) / 2 + pr;
        const int c_lo = pair * 16 + g, c_hi = c_lo + 8;
        if (c_lo >= p.N / 2) continue;
#pragma unroll
        for (int t = 0; t < WM; ++t) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = t * 8 + 2 * tig + e;
            if (t < nact && s_slot[col] >= 0) {
              char* row = static_cast<char*>(p.out) + (int64_t(mb) * BM + col) * p.out_stride * int64_t(sizeof(T));
              Act<T>::store(row + c_lo * sizeof(T), silu(acc[2 * pr][t][e]) * acc[2 * pr + 1][t][e]);
              if (c_hi < p.N / 2)
                Act<T>::store(row + c_hi * sizeof(T), silu(acc[2 * pr][t][2 + e]) * acc[2 * pr + 1][t][2 + e]);
            }
          }
        }
      }
    } else {
      float* out = static_cast<float*>(p.out);
#pragma unroll
      for (int i = 0; i < WN; ++i) {
        const int n_lo = (nb * NTB + warp * WN + i) * 16 + g;
        if (n_lo >= p.N) continue;
#pragma unroll
        for (int t = 0; t < WM; ++t) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = t * 8 + 2 * tig + e;
            const int orow_i = t < nact ? s_orow[col] : -1;
            if (orow_i >= 0) {
              const float w = s_wt[col];
              float* orow = out + int64_t(orow_i) * p.out_stride;
              atomicAdd(orow + n_lo, w * acc[i][t][e]);
              atomicAdd(orow + n_lo + 8, w * acc[i][t][2 + e]);
            }
          }
        }
      }
    }
  }
}

// ---- host side ---------------------------------------------------------------------------------
struct DeviceInfo {
  int sms = 0;
  int max_smem_optin = 0;
};
DeviceInfo device_info();  // cached per process (current device at first call)

// Once per instantiation: raise the dynamic shared-memory limit and remember the occupancy for
// one and two activation copies (a persistent grid of exactly the blocks that fit). Done at layer
// construction too, so a first forward() inside a graph capture only launches.
template <class CFG, class T, int BITS>
const int* prepare_config() {
  using S = Smem<CFG, BITS>;
  static int blocks_per_sm[3] = {0, 0, 0};
  static std::once_flag once;
  std::call_once(once, [] {
    auto kern = wna16_moe_gemm_kernel<CFG, T, BITS>;
    const DeviceInfo di = device_info();
    if (S::bytes(2) > di.max_smem_optin)
      throw Error("tile config needs " + std::to_string(S::bytes(2)) + " bytes of shared memory; the device allows " +
                  std::to_string(di.max_smem_optin));
    WNA16_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, S::bytes(2)));
    for (int xc = 1; xc <= 2; ++xc) {
      int n = 0;
      WNA16_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kern, CFG::THREADS, S::bytes(xc)));
      if (n < 1) throw Error("tile config cannot be resident on this device");
      blocks_per_sm[xc] = n;
    }
  });
  return blocks_per_sm;
}

template <class CFG, class T, int BITS>
void launch_config(const KParams& kp, int64_t upper_mblocks, cudaStream_t stream) {
  using S = Smem<CFG, BITS>;
  const int xcopies = kp.perm_up ? 2 : 1;
  const int bps = prepare_config<CFG, T, BITS>()[xcopies];
  const int64_t nb_count = kp.NT / CFG::NTB;
  const int64_t upper = upper_mblocks * nb_count * kp.splits;
  // Up to 4 waves of resident blocks: one item per block, so the hardware block scheduler balances
  // uneven SMs; beyond that a persistent loop (>= 4 items per block, tail <= 1/4).
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(upper, 4 * int64_t(device_info().sms) * bps));
  wna16_moe_gemm_kernel<CFG, T, BITS><<<dim3(unsigned(grid)), dim3(CFG::THREADS), S::bytes(xcopies), stream>>>(kp);
  WNA16_CUDA_CHECK_LAUNCH();
}

// The decode kernel (sm90_wna16_moe_decode.cuh, included by the instantiating files).
template <class T, int BITS>
int prepare_decode();
template <class T, int BITS>
void launch_decode(const KParams& kp, int64_t upper_mblocks, cudaStream_t stream);

// The wgmma kernel, configs m64w and m144w (sm90_wna16_moe_prefill.cuh), explicitly instantiated
// in sm90_wna16_moe_prefill_w{4,8}.cu.
template <class C, class T, int BITS>
int prepare_prefill();
template <class C, class T, int BITS>
void launch_prefill(const KParams& kp, int64_t upper_mblocks, cudaStream_t stream);
#define WNA16_PREFILL_EXTERN(C, T, B)                 \
  extern template int prepare_prefill<C, T, B>();     \
  extern template void launch_prefill<C, T, B>(const KParams&, int64_t, cudaStream_t);
#define WNA16_PREFILL_EXTERN_BITS(C, B) WNA16_PREFILL_EXTERN(C, __half, B) WNA16_PREFILL_EXTERN(C, __nv_bfloat16, B)
WNA16_PREFILL_EXTERN_BITS(CfgM64W, 4)
WNA16_PREFILL_EXTERN_BITS(CfgM64W, 8)
WNA16_PREFILL_EXTERN_BITS(CfgM144W, 4)
WNA16_PREFILL_EXTERN_BITS(CfgM144W, 8)
#undef WNA16_PREFILL_EXTERN_BITS
#undef WNA16_PREFILL_EXTERN

// kp == nullptr: only prepare the instantiation. Returns the blocks resident per SM (one copy).
template <int BITS>
int launch_bits(const KParams* kp, int config, DType act, int64_t upper_mblocks, cudaStream_t s) {
  auto by_act = [&](auto cfg) {
    using C = decltype(cfg);
    if (act == DType::BF16) {
      if (kp) launch_config<C, __nv_bfloat16, BITS>(*kp, upper_mblocks, s);
      return prepare_config<C, __nv_bfloat16, BITS>()[1];
    }
    if (kp) launch_config<C, __half, BITS>(*kp, upper_mblocks, s);
    return prepare_config<C, __half, BITS>()[1];
  };
  auto wgmma = [&](auto cfg) {
    // The wgmma kernel (the launcher refuses act-order for it).
    using C = decltype(cfg);
    if (act == DType::BF16) {
      if (kp) launch_prefill<C, __nv_bfloat16, BITS>(*kp, upper_mblocks, s);
      return prepare_prefill<C, __nv_bfloat16, BITS>();
    }
    if (kp) launch_prefill<C, __half, BITS>(*kp, upper_mblocks, s);
    return prepare_prefill<C, __half, BITS>();
  };
  switch (config) {
    case 0:
      // The m8 config runs on the decode kernel unless it needs the act-order gather; prepare
      // both, report the decode kernel's occupancy (the one the split choice is for).
      if (kp && kp->perm) return by_act(CfgM8{});
      if (act == DType::BF16) {
        if (kp) launch_decode<__nv_bfloat16, BITS>(*kp, upper_mblocks, s);
        else by_act(CfgM8{});
        return prepare_decode<__nv_bfloat16, BITS>();
      }
      if (kp) launch_decode<__half, BITS>(*kp, upper_mblocks, s);
      else by_act(CfgM8{});
      return prepare_decode<__half, BITS>();
    case 1: return by_act(CfgM32{});
    case 2: return by_act(CfgM64{});
    case 3: return wgmma(CfgM64W{});
    default: return wgmma(CfgM144W{});
  }
}

// One translation unit per bit width (compile time: 6 kernels each).
// kp == nullptr: prepare only (shared-memory limit, occupancy).
int launch_w4(const KParams* kp, int config, DType act, int64_t upper_mblocks, cudaStream_t s);
int launch_w8(const KParams* kp, int config, DType act, int64_t upper_mblocks, cudaStream_t s);

}  // namespace wna16::cuda::gemm
