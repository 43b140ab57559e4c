// What the fused MoE GEMM's kernels share (the staged kernel of sm90_wna16_moe_gemm.cuh, the decode
// kernel, the wgmma kernel): the tile table's configs, PTX helpers, the activation-type traits,
// dequantisation, the kernel arguments, work items and token tables. Weight layout and operand
// roles: see moe_gemm.h.
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

// The wgmma tile configs (the kernel table's rows m32w, m64w, m96w and m144w, dispatch.cu): the same
// kernel with 32, 64, 96 or 144 tokens per m-block. 144 tokens take 242 registers (one block per SM); 64 fit two
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
  // Always 144 token columns and m64w's barrier-free k-loop unrolled over the ring, GEMM1's x in
  // m-block order: against the width-per-m-block barrier loop 18-21% faster at 4096 and 8192 tokens
  // (H200, 2026-12-02, us barrier / this: DeepSeek-V3 M=8192 17557 / 14414, Mixtral M=4096 6666 /
  // 5244, Qwen3-30B-A3B M=4096 1026 / 865, DeepSeek-V2-Lite M=4096 1608 / 1319, Qwen1.5-MoE M=4096
  // 1575 / 1299). The width switch inside that loop made ptxas serialise the wgmmas (C7520).
  static constexpr bool BARRIER_FREE = true;
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
  // Always 64 token columns (both wgmma configs run their full width): no width branch per k-step
  // (ptxas serialised the wgmmas of per-width k-loops, and the branch with its descriptor moves was
  // ~45 of ~400 instructions per chunk). A 32-column k-loop for m-blocks of at most 32 tokens,
  // beside the 64-column one in the barrier-free kernel, was tried (2026-12-02): a second
  // unrolled ring spilled 156 bytes inside the loop, a width branch per k-step ran out of
  // registers (C7511), separate zeroing per width still serialised (C7515).
  // With the token tiles by tensor copies (GemmRun::x_by_position / GEMM2's intermediate): the
  // k-loop without block barriers (s_full / s_empty mbarriers per stage), the copies issued by the
  // four warps of one warpgroup, scales converted once per group (sm90_wna16_moe_prefill.cuh).
  static constexpr bool BARRIER_FREE = true;
};

// 32 tokens per m-block, three blocks per SM (24 warps, 80 registers: the k-loop keeps its
// registers, a few of the item set-up spill): for 9-28 tokens per expert, where m64w pads a block's
// tokens to 64 columns and its two blocks per SM leave the schedulers with ~1 eligible warp of 3.9
// (ncu, GEMM1 DeepSeek-V3 M=1024: stalls on fixed-latency dependencies 23%, dispatch 15%). The
// occupancy, not the narrower MMA, is most of the gain: the same 32-column kernel at two blocks per
// SM was 8-15% slower than at three (H200, 2026-12-02, us 2 / 3 blocks: Mixtral M=64 386 / 326,
// DeepSeek-V2-Lite M=256 229 / 201, Qwen3-30B-A3B M=256 190 / 177). Four int4 stages (16 KB each)
// so that three blocks fit 228 KB; int8's stages (24 KB) fit two.
struct CfgM32W : CfgM64W {
  static constexpr const char* NAME = "m32w";
  static constexpr int BLOCK_M = 32;
  static constexpr int MIN_BLOCKS = 3;
  static constexpr int XROWS = (BLOCK_M + 31) / 32;
  static constexpr int stages(int) { return 4; }
};

// 96 tokens per m-block, one block per SM (m144w's ring and registers; no spills): 61-80 tokens per
// expert (the kernel table's bounds, dispatch.cu), where m64w takes a second m-block (and
// dequantises again) for many experts and m144w pads to 144 columns.
struct CfgM96W : CfgM144W {
  static constexpr const char* NAME = "m96w";
  static constexpr int BLOCK_M = 96;
  static constexpr int XROWS = (BLOCK_M + 31) / 32;
};


// ---- PTX helpers ----------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global->shared; src_bytes = 0 zero-fills (padding rows). Cached in L1 (.ca): the
// decode kernel's warps of one block copy the same m-block's activations, and L2 was its busiest
// unit (82% at DeepSeek-V3 M=256, ncu 2026-12-03); the weights bypass L1 (ld_stream16).
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
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
  // Both f16 scales of a word, each broadcast to a pair.
  __device__ static __forceinline__ void scales2(uint32_t sw, uint32_t& lo, uint32_t& hi) {
    lo = __byte_perm(sw, 0u, 0x1010);
    hi = __byte_perm(sw, 0u, 0x3232);
  }
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
  // sub / mul.bf16x2 are sm_90 PTX; below it the same results come from fma.rn.bf16x2, which rounds
  // once too: a - b = b * -1 + a, a * b = a * b + -0.
  __device__ static __forceinline__ uint32_t sub2(uint32_t a, uint32_t b) {
    uint32_t r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(b), "r"(0xBF80BF80u), "r"(a));
#else
    asm("sub.rn.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
#endif
    return r;
  }
  __device__ static __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
    uint32_t r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
#else
    asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
#endif
    return r;
  }
  // NOTE: the f16 scale is rounded to bf16 once per group here (the weight then carries bf16's
  // 8 significant bits, the same precision as the activations it multiplies).
  __device__ static __forceinline__ uint32_t scale2(uint32_t s16) {
    const float f = __half2float(__ushort_as_half(static_cast<unsigned short>(s16)));
    const uint32_t b = __bfloat16_as_ushort(__float2bfloat16_rn(f));
    return b * 0x10001u;
  }
  // Both f16 scales of a word rounded to bf16 (one conversion of the pair), each broadcast to a pair.
  __device__ static __forceinline__ void scales2(uint32_t sw, uint32_t& lo, uint32_t& hi) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&sw));
    const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
    const uint32_t u = *reinterpret_cast<const uint32_t*>(&b);
    lo = __byte_perm(u, 0u, 0x1010);
    hi = __byte_perm(u, 0u, 0x3232);
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
      Act<T>::scales2(sw, s_lo, s_hi);
      z_lo = (Act<T>::kMagic | zl) * 0x10001u;
      z_hi = (Act<T>::kMagic | zh) * 0x10001u;
    }
  }
  // Without a zeros table every row has the zero 2^(bits-1): its (magic + z) pair once per
  // kernel (zero_pair of the default zero word), then only the scales per group (kZeroPair: not
  // the int8 + bf16 fp32 path).
  static constexpr bool kZeroPair = !(BITS == 8 && std::is_same_v<T, __nv_bfloat16>);
  static __device__ __forceinline__ uint32_t zero_pair(uint32_t zw) { return (Act<T>::kMagic | (zw & 0xffffu)) * 0x10001u; }
  // The pair of the launcher's default zero 2^(bits-1) (KParams::default_zero), a constant.
  static constexpr uint32_t kDefaultZeroPair = (Act<T>::kMagic | (1u << (BITS - 1))) * 0x10001u;
  __device__ __forceinline__ void load_scales(uint32_t sw, uint32_t zpair) {
    Act<T>::scales2(sw, s_lo, s_hi);
    z_lo = z_hi = zpair;
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
  float* pre_scratch;    //   each part's own floats at pre_scratch + part * pre_part_stride
  int64_t pre_part_stride;
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
// column's routing weight s_wt[c], read here once per item
// by all columns at once: read in the epilogue, each weight was a dependent L2 round trip per
// column (ncu, prefill GEMM2 at DeepSeek-V3 M=4096: the epilogue's FMULs waited on them).
// Returns the valid columns, block-wide (they form a prefix: align pads each expert's run at its
// end). Every thread of the block calls it.
template <int BM>
__device__ __forceinline__ int fill_row_tables(const KParams& p, int mb, int tid, int* s_slot, int* s_src, float* s_wt) {
  int is_valid = 0;
  if (tid < BM) {
    const int slot = __ldg(p.sorted_ids + int64_t(mb) * BM + tid);
    is_valid = slot >= 0 && slot < p.num_slots;
    s_slot[tid] = is_valid ? slot : -1;
    s_src[tid] = !is_valid ? -1 : (p.epilogue == 0 && !p.x_pos ? slot / p.x_div : mb * BM + tid);
    if (p.epilogue != 0) s_wt[tid] = is_valid ? __ldg(p.topk_weights + slot) : 0.f;
  }
  return __syncthreads_count(is_valid);
}

struct DeviceInfo {
  int sms = 0;
  int max_smem_optin = 0;
  int cc = 0;  // compute capability, 10 * major + minor
};
DeviceInfo device_info();  // cached per process (current device at first call)

}  // namespace wna16::cuda::gemm
