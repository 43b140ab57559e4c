// AVX2 + FMA + F16C kernels: codes expanded to fp32 in registers, 8 lanes, fp32 FMAs. One token
// at a time (16 ymm registers do not leave room to reuse decoded weights across tokens); the
// column block's bytes stay in L2 between tokens.
#include <immintrin.h>

#include <cstdint>

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

namespace wna16::cpu {
namespace {

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
  for (int64_t e = 0; e < E; ++e) {
    const float* wr = w + e * H;
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    int64_t h = 0;
    for (; h + 8 <= H; h += 8) {
      a0 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + h)), _mm256_cvtps_pd(_mm_loadu_ps(wr + h)), a0);
      a1 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + h + 4)), _mm256_cvtps_pd(_mm_loadu_ps(wr + h + 4)), a1);
    }
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, _mm256_add_pd(a0, a1));
    double acc = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (; h < H; ++h) acc += double(x[h]) * double(wr[h]);
    logits[e] = float(acc);
  }
}

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
  gemm_rows_avx2(v, rows, m, out);
}

void router_avx2(const float* x, const float* w, int64_t H, int64_t E, float* logits) {
  router_avx2_impl(x, w, H, E, logits);
}

uint64_t stream_sum_avx2(const uint64_t* p, int64_t n) { return stream_sum_avx2_impl(p, n); }

}  // namespace wna16::cpu
