// AVX-512 VNNI kernels: int4 codes are masked into u8 lanes (int8 codes are used as stored) and
// vpdpbusd multiplies them with the int8 terms of the activations (kernels.h: XRow), four
// products summed into each int32 lane per instruction: 64 multiply-adds, exact, no float weight
// ever formed. Per activation block the int32 sums become fp32 once; per group the scale and zero
// point are applied once. Up to kMaxRows tokens share each decoded weight vector.

// NOTE: GCC 12 reports the self-initialised _mm512_undefined_*() inside its own intrinsic headers
// (used by the reduce/convert intrinsics) as (maybe-)uninitialized once they are inlined; the
// warning is a known false positive.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/kernels.h"

// Everything up to the matching pop is compiled for AVX-512 + VNNI. Every standard header is
// included above: only functions defined inside the region get the target, and no std::
// template (which the linker could share with code built for the baseline CPU) is defined here.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))), \
                             apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#endif

#include "cpu/fma_probe.h"  // inside the region: compiled for this ISA

namespace wna16::cpu {
namespace {

constexpr int kMaxRows = 2;  // tokens sharing one decoded weight vector (int32 accumulators: 8 per token and term)
// Software prefetch of the weight stream, kPrefetchBytes ahead, into L2: at one token the loop
// runs far ahead of DRAM, and L2 prefetches are tracked by the L2's larger miss queue rather than
// the L1's fill buffers. May change speed, never results.
constexpr int kPrefetchBytes = 4096;
constexpr auto kPrefetchHint = _MM_HINT_T1;

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);  // x[k..k+3] as one 32-bit lane
  return _mm512_set1_epi32(v);
}

// MR tokens x one 64-column block, TERMS int8 terms per activation, 4- or 8-bit codes.
template <int MR, int TERMS, bool INT8>
void gemm_mr(const BlockView& v, const XRow* rows, float* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512 inv = _mm512_set1_ps(1.f / kTermRatio), inv2 = _mm512_set1_ps(1.f / (kTermRatio * kTermRatio));
  const uint8_t* p = v.data;
  start_block(p, kPrefetchBytes, out, MR);
  for (int64_t gi = 0; gi < v.groups; ++gi) {
    const uint8_t* hdr = p;
    p += v.header_bytes;
    __m512 zero[kTilesPerBlock];  // per-column zero points of this group, as float
    for (int j = 0; j < kTilesPerBlock; ++j) {
      if (v.uniform_zero) {
        zero[j] = _mm512_set1_ps(float(v.zero));
      } else {
        const uint8_t* zp = hdr + v.scale_bytes;
        zero[j] = _mm512_cvtepi32_ps(
            INT8 ? _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(zp + 32 * j)))
                 : _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(zp + 16 * j))));
      }
    }
    __m512 gacc[MR][kTilesPerBlock];  // this group's sum of x q - z x, unscaled by the weight scale
    for (int t = 0; t < MR; ++t)
      for (int j = 0; j < kTilesPerBlock; ++j) gacc[t][j] = _mm512_setzero_ps();
    for (int64_t xb = v.group_xblock[gi]; xb < v.group_xblock[gi + 1]; ++xb) {
      __m512i acc[MR][kTilesPerBlock][TERMS];
      for (int t = 0; t < MR; ++t)
        for (int j = 0; j < kTilesPerBlock; ++j)
          for (int e = 0; e < TERMS; ++e) acc[t][j][e] = _mm512_setzero_si512();
      const int64_t k_end = v.xblock_kstart[xb] + v.xblock_len[xb];
      for (int64_t k = v.xblock_kstart[xb]; k < k_end; k += kStepK, p += v.step_bytes) {
        for (int l = 0; l < (INT8 ? 8 : 4); ++l)
          _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes + 64 * l, kPrefetchHint);
        for (int j = 0; j < kTilesPerBlock; ++j) {
          const uint8_t* b = p + j * (INT8 ? 128 : 64);
          // Lane c of lo (hi): the u8 codes of channels k..k+3 (k+4..k+7) of column c.
          __m512i lo, hi;
          if constexpr (INT8) {
            lo = _mm512_load_si512(b);
            hi = _mm512_load_si512(b + 64);
          } else {
            const __m512i w = _mm512_load_si512(b);
            lo = _mm512_and_si512(w, low4);
            hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
          }
          for (int t = 0; t < MR; ++t)
            for (int e = 0; e < TERMS; ++e) {
              acc[t][j][e] = _mm512_dpbusd_epi32(acc[t][j][e], lo, bcast4(rows[t].q[e] + k));
              acc[t][j][e] = _mm512_dpbusd_epi32(acc[t][j][e], hi, bcast4(rows[t].q[e] + k + 4));
            }
        }
      }
      // Block end: gacc += s_x * ((A0 + A1 / 254 + A2 / 254^2) - z * bsum).
      for (int t = 0; t < MR; ++t) {
        const __m512 sx = _mm512_set1_ps(rows[t].bscale[xb]), bs = _mm512_set1_ps(rows[t].bsum[xb]);
        for (int j = 0; j < kTilesPerBlock; ++j) {
          __m512 f = _mm512_cvtepi32_ps(acc[t][j][0]);
          f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t][j][1]), inv, f);
          if constexpr (TERMS == 3) f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t][j][2]), inv2, f);
          f = _mm512_fnmadd_ps(zero[j], bs, f);
          gacc[t][j] = _mm512_fmadd_ps(f, sx, gacc[t][j]);
        }
      }
    }
    // Group end: out += weight scale * gacc.
    for (int j = 0; j < kTilesPerBlock; ++j) {
      const __m512 s =
          v.scales_f16 ? _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(hdr + 32 * j)))
                       : _mm512_load_ps(reinterpret_cast<const float*>(hdr) + 16 * j);
      for (int t = 0; t < MR; ++t) {
        float* o = out + t * kBlockN + 16 * j;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(s, gacc[t][j], _mm512_loadu_ps(o)));
      }
    }
  }
}

template <int TERMS, bool INT8>
void gemm_rows(const BlockView& v, const XRow* rows, int m, float* out) {
  for (int t0 = 0; t0 < m; t0 += kMaxRows) {
    if (m - t0 >= 2)
      gemm_mr<2, TERMS, INT8>(v, rows + t0, out + int64_t(t0) * kBlockN);
    else
      gemm_mr<1, TERMS, INT8>(v, rows + t0, out + int64_t(t0) * kBlockN);
  }
}

void gemm_dispatch(const BlockView& v, const XRow* rows, int m, float* out) {
  if (m <= 0) return;
  const bool three = rows[0].q[2] != nullptr;
  if (v.bits == 8)
    three ? gemm_rows<3, true>(v, rows, m, out) : gemm_rows<2, true>(v, rows, m, out);
  else
    three ? gemm_rows<3, false>(v, rows, m, out) : gemm_rows<2, false>(v, rows, m, out);
}

void router_impl(const float* x, const float* w, int64_t H, int64_t E, float* logits) {
  // Four experts at a time share each converted activation vector; float64 accumulation.
  int64_t e = 0;
  for (; e + 4 <= E; e += 4) {
    const float* wr[4] = {w + e * H, w + (e + 1) * H, w + (e + 2) * H, w + (e + 3) * H};
    __m512d a[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd()};
    int64_t h = 0;
    for (; h + 8 <= H; h += 8) {
      const __m512d xv = _mm512_cvtps_pd(_mm256_loadu_ps(x + h));
      for (int r = 0; r < 4; ++r) {
        if (h % 16 == 0) _mm_prefetch(reinterpret_cast<const char*>(wr[r] + h) + kPrefetchBytes, kPrefetchHint);
        a[r] = _mm512_fmadd_pd(xv, _mm512_cvtps_pd(_mm256_loadu_ps(wr[r] + h)), a[r]);
      }
    }
    for (int r = 0; r < 4; ++r) {
      alignas(64) double lanes[8];
      _mm512_store_pd(lanes, a[r]);
      double acc = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
      for (int64_t t = h; t < H; ++t) acc += double(x[t]) * double(wr[r][t]);
      logits[e + r] = float(acc);
    }
  }
  for (; e < E; ++e) {
    double acc = 0;
    for (int64_t h = 0; h < H; ++h) acc += double(x[h]) * double(w[e * H + h]);
    logits[e] = float(acc);
  }
}

void quantize_block_impl(const float* v, int64_t n, int terms, int8_t* const* q, float* scale, float* sum) {
  // Same arithmetic as quantize_block_scalar, 16 lanes at a time (n is a multiple of 8).
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16(0x00FF);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_maskz_loadu_ps(m, v + i)));
  }
  const float mx = _mm512_reduce_max_ps(vmax);
  const float inv = mx > 0.f ? 127.f / mx : 0.f;
  *scale = mx / 127.f;
  const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f),
               ratio = _mm512_set1_ps(kTermRatio);
  __m512 acc[3] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16(0x00FF);
    __m512 rem = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, v + i), vinv), lo), hi);
    for (int t = 0; t < terms; ++t) {
      const __m512 r = _mm512_min_ps(
          _mm512_max_ps(_mm512_roundscale_ps(rem, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi);
      _mm_mask_storeu_epi8(q[t] + i, m, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r)));
      acc[t] = _mm512_add_ps(acc[t], r);
      rem = _mm512_mul_ps(_mm512_sub_ps(rem, r), ratio);
    }
  }
  float s[3];
  for (int t = 0; t < 3; ++t) s[t] = _mm512_reduce_add_ps(acc[t]);
  *sum = float(double(s[0]) + double(s[1]) / kTermRatio + double(s[2]) / (double(kTermRatio) * kTermRatio));
}

struct FmaOps {
  using V = __m512;
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
};
double fma_loop_impl(int64_t iters) { return fma_probe<FmaOps>(iters); }

uint64_t stream_sum_impl(const uint64_t* p, int64_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(p + i + 8));
    a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(p + i + 16));
    a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(p + i + 24));
  }
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
  uint64_t s = 0;
  for (uint64_t l : lanes) s += l;
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

void gemm_block_avx512vnni(const PackedLinear& L, int64_t nb, const XRow* rows, int m, float* out) {
  const BlockView v = block_view(L, nb);
  gemm_dispatch(v, rows, m, out);
}

void router_avx512(const float* x, const float* w, int64_t H, int64_t E, float* logits) {
  router_impl(x, w, H, E, logits);
}

uint64_t stream_sum_avx512(const uint64_t* p, int64_t n) { return stream_sum_impl(p, n); }

void quantize_block_avx512(const float* v, int64_t n, int terms, int8_t* const* q, float* scale, float* sum) {
  quantize_block_impl(v, n, terms, q, scale, sum);
}

double fma_loop_avx512(int64_t iters) { return fma_loop_impl(iters); }

}  // namespace wna16::cpu
