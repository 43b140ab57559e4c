// AVX2 + FMA + F16C kernels.
//  - 4-bit codes: int8 rows (kernels.h: XRow). Codes are masked into u8 lanes and pmaddubsw
//    multiplies them with the activations' int8 terms (u8 x s8, adjacent pairs summed to int16,
//    exact for 4-bit codes), pmaddwd against ones sums the pairs into int32: 3 instructions per
//    32 products and term, where expanding codes to fp32 costs 2 per 8 (a convert and an FMA),
//    which kept 2 cores at 38% of the read bandwidth. Scale and zero point as in the VNNI kernel.
//  - 8-bit codes: fp32 rows, codes expanded to fp32 in registers, fp32 FMAs, one token at a time.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu/kernels.h"

// Everything up to the matching pop is compiled for AVX2 + FMA + F16C. Every standard header is
// included above: only functions defined inside the region get the target, and no std::
// template (which the linker could share with code built for the baseline CPU) is defined here.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#include "cpu/fma_probe.h"  // inside the region: compiled for this ISA

namespace wna16::cpu {
namespace {

// Software prefetch of the 4-bit weight stream, 8 KiB ahead: at one token the loop runs ahead of
// DRAM. 8 KiB measured 5-10% faster than 4 KiB at M=1 (16 KiB level with 8, 1 KiB slower). One
// token's rows prefetch into L1 (T0), not L2: that kernel's arithmetic takes about as long as its
// stream, and with L2 prefetches the two did not overlap (Zen 5, 2 vCPUs, 2026-12-02: M=1 -8%
// Qwen3-30B-A3B, -23% DeepSeek-V2-Lite, faster in 4 of 4 alternating runs; one linear from DRAM
// 1.28x, 11 of 12). One token's prefetches are spread over its steps, a pass's own lines each
// step: issued 32 at a time at an activation block's start they held up the arithmetic behind
// the core's outstanding misses (Zen 3, 2026-12-03: one linear from DRAM 50-59% -> 68-80% of
// the adjacent read probe). Several tokens' rows keep L2 and the block-start burst (their passes
// reuse 2 KiB of codes from L1; L1 prefetches there were not measured apart from the host's
// noise). May change speed, never results.
constexpr int kPrefetchBytes = 8192;
constexpr int kGroups8 = kBlockN / 8;  // 8-column groups (one ymm of int32 / fp32 lanes) per block

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);  // x[k..k+3] as one 32-bit lane
  return _mm256_set1_epi32(v);
}

// One step (8 channels) of one token, two int8 terms, four 8-column groups (128 contiguous code
// bytes at w): a[e][c] += pair sums of codes x term e. Written out because the compiler kept only
// half of the eight int16 sums in registers (a load, add and store of the others every step): here
// the sums, the four activation broadcasts and three temporaries take exactly the 16 ymm
// registers, 12 instructions per 32 code bytes.
inline void one_token_step(const uint8_t* w, const int8_t* x0, const int8_t* x1, __m256i low4, __m256i (&a)[2][4]) {
  __m256i b0, b1, b2, b3, t0, t1, t2;
  asm("vpbroadcastd (%[x0]), %[b0]\n\t"
      "vpbroadcastd 4(%[x0]), %[b1]\n\t"
      "vpbroadcastd (%[x1]), %[b2]\n\t"
      "vpbroadcastd 4(%[x1]), %[b3]\n\t"
#define WNA16_AVX2_GROUP(OFF, A0, A1)                                                        \
  "vmovdqa " #OFF "(%[w]), %[t1]\n\t"      /* codes of 8 columns x 8 channels */           \
  "vpand %[t1], %[m], %[t0]\n\t"           /* lo: channels k..k+3 */                      \
  "vpsrlw $4, %[t1], %[t1]\n\t"                                                              \
  "vpand %[t1], %[m], %[t1]\n\t"           /* hi: channels k+4..k+7 */                    \
  "vpmaddubsw %[b0], %[t0], %[t2]\n\t"                                                       \
  "vpaddw %[t2], %[" #A0 "], %[" #A0 "]\n\t"                                                 \
  "vpmaddubsw %[b2], %[t0], %[t0]\n\t"                                                       \
  "vpaddw %[t0], %[" #A1 "], %[" #A1 "]\n\t"                                                 \
  "vpmaddubsw %[b1], %[t1], %[t2]\n\t"                                                       \
  "vpaddw %[t2], %[" #A0 "], %[" #A0 "]\n\t"                                                 \
  "vpmaddubsw %[b3], %[t1], %[t1]\n\t"                                                       \
  "vpaddw %[t1], %[" #A1 "], %[" #A1 "]\n\t"
      WNA16_AVX2_GROUP(0, a00, a10) WNA16_AVX2_GROUP(32, a01, a11) WNA16_AVX2_GROUP(64, a02, a12)
      WNA16_AVX2_GROUP(96, a03, a13)
#undef WNA16_AVX2_GROUP
      : [a00] "+x"(a[0][0]), [a01] "+x"(a[0][1]), [a02] "+x"(a[0][2]), [a03] "+x"(a[0][3]),
        [a10] "+x"(a[1][0]), [a11] "+x"(a[1][1]), [a12] "+x"(a[1][2]), [a13] "+x"(a[1][3]),
        [b0] "=&x"(b0), [b1] "=&x"(b1), [b2] "=&x"(b2), [b3] "=&x"(b3), [t0] "=&x"(t0), [t1] "=&x"(t1),
        [t2] "=&x"(t2)
      : [w] "r"(w), [x0] "r"(x0), [x1] "r"(x1), [m] "x"(low4),
        // The bytes read, as memory operands (no "memory" clobber: loop-invariant loads stay hoisted).
        "m"(*reinterpret_cast<const uint8_t(*)[128]>(w)), "m"(*reinterpret_cast<const int8_t(*)[8]>(x0)),
        "m"(*reinterpret_cast<const int8_t(*)[8]>(x1)));
}

// MR tokens x one 64-column block, TERMS int8 terms, 4-bit codes. The block's columns are done in
// passes of NC 8-column groups per activation block (64 channels, 2 KiB of codes, L1-resident
// between passes), so the MR x TERMS x NC int16 accumulators stay in the 16 ymm registers.
// pmaddubsw's pair sums are added in int16 for up to kSteps16 steps (|pair sum| <= 2 x 15 x 127,
// two per step: 4 x 3810 x 2 = 30480 < 32767), then pmaddwd against ones widens them to int32:
// one pmaddwd per 4 steps instead of one per step.
constexpr int kSteps16 = 4;
template <int MR, int TERMS, int NC>
void gemm_i8(const BlockView& v, const XRow* rows, float* out) {
  static_assert(kGroups8 % NC == 0, "passes cover the block");
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256 inv = _mm256_set1_ps(1.f / kTermRatio), inv2 = _mm256_set1_ps(1.f / (kTermRatio * kTermRatio));
  const uint8_t* p = v.data;
  start_block(p, kPrefetchBytes, out, MR);
  for (int64_t gi = 0; gi < v.groups; ++gi) {
    const uint8_t* hdr = p;
    p += v.header_bytes;
    __m256 gacc[MR][kGroups8];  // this group's sum of x q - z x, unscaled by the weight scale
    for (int t = 0; t < MR; ++t)
      for (int g = 0; g < kGroups8; ++g) gacc[t][g] = _mm256_setzero_ps();
    for (int64_t xb = v.group_xblock[gi]; xb < v.group_xblock[gi + 1]; ++xb) {
      const int64_t k0 = v.xblock_kstart[xb], steps = v.xblock_len[xb] / kStepK;
      if constexpr (MR > 1)
        for (int64_t s = 0; s < steps; ++s)
          for (int l = 0; l < 4; ++l)
            _mm_prefetch(reinterpret_cast<const char*>(p + s * v.step_bytes) + kPrefetchBytes + 64 * l, _MM_HINT_T1);
      for (int g0 = 0; g0 < kGroups8; g0 += NC) {
        __m256i acc[MR][TERMS][NC];
        for (int t = 0; t < MR; ++t)
          for (int e = 0; e < TERMS; ++e)
            for (int c = 0; c < NC; ++c) acc[t][e][c] = _mm256_setzero_si256();
        for (int64_t s0 = 0; s0 < steps; s0 += kSteps16) {
          __m256i a16[MR][TERMS][NC];
          for (int t = 0; t < MR; ++t)
            for (int e = 0; e < TERMS; ++e)
              for (int c = 0; c < NC; ++c) a16[t][e][c] = _mm256_setzero_si256();
          const int64_t s1 = s0 + kSteps16 < steps ? s0 + kSteps16 : steps;
          for (int64_t s = s0; s < s1; ++s) {
            const int64_t k = k0 + s * kStepK;
            const uint8_t* ps = p + s * v.step_bytes;
            if constexpr (MR == 1)  // this pass's lines of the step, kPrefetchBytes ahead
              for (int l = 0; l < NC / 2; ++l)
                _mm_prefetch(reinterpret_cast<const char*>(ps + 32 * g0 + 64 * l) + kPrefetchBytes, _MM_HINT_T0);
            if constexpr (MR == 1 && TERMS == 2 && NC == 4) {
              one_token_step(ps + 32 * g0, rows[0].q[0] + k, rows[0].q[1] + k, low4, a16[0]);
              continue;
            }
            for (int c = 0; c < NC; ++c) {
              const int g = g0 + c;  // tile g / 2, half g % 2 (packed_linear.h)
              const __m256i d = _mm256_load_si256(reinterpret_cast<const __m256i*>(ps + (g >> 1) * 64 + 32 * (g & 1)));
              // Lane j of lo (hi): the u8 codes of channels k..k+3 (k+4..k+7) of column j.
              const __m256i lo = _mm256_and_si256(d, low4);
              const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(d, 4), low4);
              for (int t = 0; t < MR; ++t)
                for (int e = 0; e < TERMS; ++e) {
                  a16[t][e][c] = _mm256_add_epi16(a16[t][e][c], _mm256_maddubs_epi16(lo, bcast4(rows[t].q[e] + k)));
                  a16[t][e][c] = _mm256_add_epi16(a16[t][e][c], _mm256_maddubs_epi16(hi, bcast4(rows[t].q[e] + k + 4)));
                }
            }
          }
          for (int t = 0; t < MR; ++t)
            for (int e = 0; e < TERMS; ++e)
              for (int c = 0; c < NC; ++c)
                acc[t][e][c] = _mm256_add_epi32(acc[t][e][c], _mm256_madd_epi16(a16[t][e][c], ones));
        }
        // Block end: gacc += s_x * ((A0 + A1 / 254 + A2 / 254^2) - z * bsum).
        for (int c = 0; c < NC; ++c) {
          const int g = g0 + c;
          __m256 z = _mm256_set1_ps(float(v.zero));
          if (!v.uniform_zero)
            z = _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(hdr + v.scale_bytes + 8 * g))));
          for (int t = 0; t < MR; ++t) {
            __m256 f = _mm256_cvtepi32_ps(acc[t][0][c]);
            f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t][1][c]), inv, f);
            if constexpr (TERMS == 3) f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t][2][c]), inv2, f);
            f = _mm256_fnmadd_ps(z, _mm256_set1_ps(rows[t].bsum[xb]), f);
            gacc[t][g] = _mm256_fmadd_ps(f, _mm256_set1_ps(rows[t].bscale[xb]), gacc[t][g]);
          }
        }
      }
      p += steps * v.step_bytes;
    }
    // Group end: out += weight scale * gacc.
    for (int g = 0; g < kGroups8; ++g) {
      const __m256 s = v.scales_f16 ? _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(hdr + 16 * g)))
                                    : _mm256_load_ps(reinterpret_cast<const float*>(hdr) + 8 * g);
      for (int t = 0; t < MR; ++t) {
        float* o = out + t * kBlockN + 8 * g;
        _mm256_storeu_ps(o, _mm256_fmadd_ps(s, gacc[t][g], _mm256_loadu_ps(o)));
      }
    }
  }
}

template <int TERMS>
void gemm_rows_i8(const BlockView& v, const XRow* rows, int m, float* out) {
  int t0 = 0;
  if constexpr (TERMS == 2) {
    for (; m - t0 >= 4; t0 += 4) gemm_i8<4, TERMS, 1>(v, rows + t0, out + int64_t(t0) * kBlockN);
    if (m - t0 == 3) return gemm_i8<3, TERMS, 1>(v, rows + t0, out + int64_t(t0) * kBlockN);
  }
  for (; m - t0 >= 2; t0 += 2) gemm_i8<2, TERMS, TERMS == 2 ? 2 : 1>(v, rows + t0, out + int64_t(t0) * kBlockN);
  if (t0 < m) gemm_i8<1, TERMS, TERMS == 2 ? 4 : 2>(v, rows + t0, out + int64_t(t0) * kBlockN);
}

void gemm_rows_avx2(const BlockView& v, const XRow* rows, int m, float* out) {
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  const __m256i low8 = _mm256_set1_epi32(0xFF);
  for (int t = 0; t < m; ++t) {
    float* o = out + int64_t(t) * kBlockN;
    for (int c = 0; c < kBlockN; c += 8) _mm256_storeu_ps(o + c, _mm256_setzero_ps());
    const float* x = rows[t].f;
    const uint8_t* p = v.data;
    for (int64_t gi = 0; gi < v.groups; ++gi) {
      const uint8_t* hdr = p;
      p += v.header_bytes;
      __m256 acc[8];
      for (auto& a : acc) a = _mm256_setzero_ps();
      const int64_t k_end = v.group_kstart[gi] + v.group_len[gi];
      for (int64_t k0 = v.group_kstart[gi]; k0 < k_end; k0 += kStepK, p += v.step_bytes) {
        __m256 xk[kStepK];
        for (int i = 0; i < kStepK; ++i) xk[i] = _mm256_broadcast_ss(x + k0 + i);
        for (int v8 = 0; v8 < 8; ++v8) {  // 8 groups of 8 columns: tile v8/2, half v8%2
          // Lane c: the 4 bytes of column 8 (v8 % 2) + c; byte i holds channels k0+i and k0+4+i.
          const uint8_t* b = p + (v8 >> 1) * v.tile_bytes + 32 * (v8 & 1);
          const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
          __m256 a = acc[v8];
          if (v.bits == 4) {
            for (int i = 0; i < 4; ++i) {
              const __m256i qa = _mm256_and_si256(_mm256_srli_epi32(d, 8 * i), low4);
              const __m256i qb = _mm256_and_si256(_mm256_srli_epi32(d, 8 * i + 4), low4);
              a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(qa), xk[i], a);
              a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(qb), xk[4 + i], a);
            }
          } else {  // int8: the second 64 bytes hold channels k0+4..k0+7
            const __m256i d2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64));
            for (int i = 0; i < 4; ++i) {
              const __m256i qa = _mm256_and_si256(_mm256_srli_epi32(d, 8 * i), low8);
              const __m256i qb = _mm256_and_si256(_mm256_srli_epi32(d2, 8 * i), low8);
              a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(qa), xk[i], a);
              a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(qb), xk[4 + i], a);
            }
          }
          acc[v8] = a;
        }
      }
      // o += s * (acc - z * xs), once per group and column.
      const __m256 xs = _mm256_set1_ps(rows[t].xs[gi]);
      const __m256 zu = _mm256_set1_ps(float(v.zero));
      for (int v8 = 0; v8 < 8; ++v8) {
        const __m256 s = v.scales_f16
                             ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hdr + 16 * v8)))
                             : _mm256_loadu_ps(reinterpret_cast<const float*>(hdr) + 8 * v8);
        __m256 z = zu;
        if (!v.uniform_zero) {
          const uint8_t* zp = hdr + v.scale_bytes;
          z = _mm256_cvtepi32_ps(
              v.zeros_u16 ? _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(zp + 16 * v8)))
                          : _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(zp + 8 * v8))));
        }
        const __m256 r = _mm256_fnmadd_ps(z, xs, acc[v8]);
        _mm256_storeu_ps(o + 8 * v8, _mm256_fmadd_ps(s, r, _mm256_loadu_ps(o + 8 * v8)));
      }
    }
  }
}

void router_avx2_impl(const float* x, const float* w, int64_t H, int64_t E, float* logits) {
  // Four experts at a time share each converted activation vector (as in the AVX-512 router);
  // float64 accumulation. The router's E x H fp32 weights are read from DRAM at every call.
  int64_t e = 0;
  for (; e < E; e += 4) {
    const int64_t ne = E - e < 4 ? E - e : 4;
    const float* wr[4];
    for (int r = 0; r < 4; ++r) wr[r] = w + (e + (r < ne ? r : 0)) * H;  // short tail: repeat expert e
    __m256d a[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    int64_t h = 0;
    for (; h + 4 <= H; h += 4) {
      const __m256d xv = _mm256_cvtps_pd(_mm_loadu_ps(x + h));
      for (int r = 0; r < 4; ++r) {
        if (h % 16 == 0) _mm_prefetch(reinterpret_cast<const char*>(wr[r] + h) + kPrefetchBytes, _MM_HINT_T1);
        a[r] = _mm256_fmadd_pd(xv, _mm256_cvtps_pd(_mm_loadu_ps(wr[r] + h)), a[r]);
      }
    }
    for (int r = 0; r < ne; ++r) {
      alignas(32) double lanes[4];
      _mm256_store_pd(lanes, a[r]);
      double acc = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
      for (int64_t t = h; t < H; ++t) acc += double(x[t]) * double(wr[r][t]);
      logits[e + r] = float(acc);
    }
  }
}

void quantize_block_impl(const float* v, int64_t n, int terms, int8_t* const* q, float* scale, float* sum) {
  // Same arithmetic as quantize_block_scalar, 8 lanes at a time (n is a multiple of 8).
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(v + i), absmask));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float mx = 0.f;
  for (float l : lanes) mx = mx > l ? mx : l;
  const float inv = mx > 0.f ? 127.f / mx : 0.f;
  *scale = mx / 127.f;
  const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f),
               ratio = _mm256_set1_ps(kTermRatio);
  __m256 acc[3] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t i = 0; i < n; i += 8) {
    __m256 rem = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(v + i), vinv), lo), hi);
    for (int t = 0; t < terms; ++t) {
      const __m256 r =
          _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(rem, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi);
      const __m256i w = _mm256_cvtps_epi32(r);  // |w| <= 127: the packs below are exact
      const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q[t] + i), _mm_packs_epi16(w16, w16));
      acc[t] = _mm256_add_ps(acc[t], r);
      rem = _mm256_mul_ps(_mm256_sub_ps(rem, r), ratio);
    }
  }
  float s[3];
  for (int t = 0; t < 3; ++t) {  // integer sums, exact in float in any order
    _mm256_store_ps(lanes, acc[t]);
    s[t] = 0.f;
    for (float l : lanes) s[t] += l;
  }
  *sum = float(double(s[0]) + double(s[1]) / kTermRatio + double(s[2]) / (double(kTermRatio) * kTermRatio));
}

struct FmaOps {
  using V = __m256;
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
};
double fma_loop_impl(int64_t iters) { return fma_probe<FmaOps>(iters); }

uint64_t stream_sum_avx2_impl(const uint64_t* p, int64_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 4)));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 8)));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 12)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                     _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
  uint64_t s = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (; i < n; ++i) s += p[i];
  return s;
}

}  // namespace
}  // namespace wna16::cpu

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

namespace wna16::cpu {

void gemm_block_avx2(const PackedLinear& L, int64_t nb, const XRow* rows, int m, float* out) {
  const BlockView v = block_view(L, nb);
  if (m <= 0) return;
  if (v.bits == 8)
    gemm_rows_avx2(v, rows, m, out);
  else if (rows[0].q[2])
    gemm_rows_i8<3>(v, rows, m, out);
  else
    gemm_rows_i8<2>(v, rows, m, out);
}

void quantize_block_avx2(const float* v, int64_t n, int terms, int8_t* const* q, float* scale, float* sum) {
  quantize_block_impl(v, n, terms, q, scale, sum);
}

void router_avx2(const float* x, const float* w, int64_t H, int64_t E, float* logits) {
  router_avx2_impl(x, w, H, E, logits);
}

uint64_t stream_sum_avx2(const uint64_t* p, int64_t n) { return stream_sum_avx2_impl(p, n); }

double fma_loop_avx2(int64_t iters) { return fma_loop_impl(iters); }

}  // namespace wna16::cpu
