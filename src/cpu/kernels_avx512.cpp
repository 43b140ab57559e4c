// AVX-512 kernels with AVX512_BF16: int4/int8 codes become bf16 (128 + q) in registers with one
// mask-and-or (see packed_linear.h), and vdpbf16ps multiplies them by broadcast activation pairs
// with fp32 accumulation: 32 multiply-adds per instruction and no float weight ever stored. Up to
// 4 tokens share each decoded weight vector.

// NOTE: GCC 12 reports the self-initialised _mm512_undefined_*() inside its own intrinsic headers
// as maybe-uninitialized once they are inlined; the warning is a known false positive.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/kernels.h"

// Everything up to the matching pop is compiled for AVX-512 + BF16. Every standard header is
// included above: only functions defined inside the region get the target, and no std::
// template (which the linker could share with code built for the baseline CPU) is defined here.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c"))), \
                             apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")
#endif

namespace wna16::cpu {
namespace {

constexpr int kMaxRows = 4;  // tokens sharing one decoded weight vector (16 accumulators)
#ifndef WNA16_CPU_PREFETCH_BYTES
#define WNA16_CPU_PREFETCH_BYTES 1024
#endif
constexpr int kPrefetchBytes = WNA16_CPU_PREFETCH_BYTES;  // may change speed, never results

inline __m512i bcast_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);  // the bf16 pair (x[k], x[k+1]) as one 32-bit lane
  return _mm512_set1_epi32(v);
}

inline __m512 dot(__m512 acc, __m512i w, __m512i x) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(w), reinterpret_cast<__m512bh&>(x));
}

// MR tokens x one 64-column block. INT8: two nibble planes per tile. LO: f16 activations, whose
// exact bf16 residual is a second dot product into the same accumulator.
template <int MR, bool INT8, bool LO>
void gemm_mr(const BlockView& v, const XRow* rows, float* out) {
  const __m512i nib = _mm512_set1_epi16(0x000F);
  const __m512i mag = _mm512_set1_epi16(0x4300);    // bf16 128.0: OR a code < 128 into its mantissa
  const __m512i mag16 = _mm512_set1_epi16(0x4500);  // bf16 2048.0: nibble h gives 16 * (128 + h)
  // Every decoded weight is q + off: removed with the zero point at the end of each group.
  const float off = INT8 ? 128.f * 17.f : 128.f;
  for (int t = 0; t < MR; ++t)
    for (int c = 0; c < kBlockN; c += 16) _mm512_storeu_ps(out + t * kBlockN + c, _mm512_setzero_ps());
  const uint8_t* p = v.data;
  for (int64_t gi = 0; gi < v.groups; ++gi) {
    const uint8_t* hdr = p;
    p += v.header_bytes;
    // NOTE: with one token the 4 tile accumulators would be 4 dependency chains of 4-16 dot
    // products per step, latency-bound; a second set (odd pairs) doubles the chains.
    constexpr bool kSplit = MR == 1;
    __m512 acc[MR][kTilesPerBlock], acc2[kTilesPerBlock];
    for (int j = 0; j < kTilesPerBlock; ++j) {
      for (int t = 0; t < MR; ++t) acc[t][j] = _mm512_setzero_ps();
      acc2[j] = _mm512_setzero_ps();
    }
    const int64_t k_begin = v.group_kstart[gi], k_end = k_begin + v.group_len[gi];
    for (int64_t k = k_begin; k < k_end; k += kStepK, p += v.step_bytes) {
      // NOTE: software prefetch kPrefetchBytes ahead (about one DRAM latency of this loop at
      // one token) keeps more lines in flight than the L2 streamer alone.
      for (int l = 0; l < (INT8 ? 8 : 4); ++l)
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes + 64 * l, _MM_HINT_T0);
      for (int j = 0; j < kTilesPerBlock; ++j) {
        const uint8_t* b = p + j * (INT8 ? 128 : 64);
        // (words >> 4i) & 0xF, lane c = channels (k+2i, k+2i+1) of column c; | 0x4300 -> bf16 128 + q.
        const __m512i w = _mm512_load_si512(b);
        __m512i wv[4];
        wv[0] = _mm512_ternarylogic_epi32(w, nib, mag, 0xEA);  // (w & nib) | mag
        wv[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 4), nib, mag, 0xEA);
        wv[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 8), nib, mag, 0xEA);
        wv[3] = _mm512_or_si512(_mm512_srli_epi16(w, 12), mag);
        __m512i hv[4];
        if constexpr (INT8) {
          const __m512i h = _mm512_load_si512(b + 64);
          hv[0] = _mm512_ternarylogic_epi32(h, nib, mag16, 0xEA);
          hv[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(h, 4), nib, mag16, 0xEA);
          hv[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(h, 8), nib, mag16, 0xEA);
          hv[3] = _mm512_or_si512(_mm512_srli_epi16(h, 12), mag16);
        }
        for (int t = 0; t < MR; ++t)
          for (int i = 0; i < 4; ++i) {
            // Pairs 0, 2 go to acc, pairs 1, 3 to acc2 when split (two chains per tile).
            __m512& a = (kSplit && (i & 1)) ? acc2[j] : acc[t][j];
            const __m512i xh = bcast_pair(rows[t].hi + k + 2 * i);
            a = dot(a, wv[i], xh);
            if constexpr (INT8) a = dot(a, hv[i], xh);
            if constexpr (LO) {
              const __m512i xl = bcast_pair(rows[t].lo + k + 2 * i);
              a = dot(a, wv[i], xl);
              if constexpr (INT8) a = dot(a, hv[i], xl);
            }
          }
      }
    }
    // out += s * (acc - (z + off) * xs), once per group and column.
    const __m512 zu = _mm512_set1_ps(float(v.zero) + off);
    for (int j = 0; j < kTilesPerBlock; ++j) {
      const __m512 s =
          v.scales_f16 ? _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(hdr + 32 * j)))
                       : _mm512_load_ps(reinterpret_cast<const float*>(hdr) + 16 * j);
      __m512 zb = zu;
      if (!v.uniform_zero) {
        const uint8_t* zp = hdr + v.scale_bytes;
        const __m512i z =
            INT8 ? _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(zp + 32 * j)))
                 : _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(zp + 16 * j)));
        zb = _mm512_add_ps(_mm512_cvtepi32_ps(z), _mm512_set1_ps(off));
      }
      if constexpr (kSplit) acc[0][j] = _mm512_add_ps(acc[0][j], acc2[j]);
      for (int t = 0; t < MR; ++t) {
        const __m512 r = _mm512_fnmadd_ps(zb, _mm512_set1_ps(rows[t].xs[gi]), acc[t][j]);
        float* o = out + t * kBlockN + 16 * j;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(s, r, _mm512_loadu_ps(o)));
      }
    }
  }
}

template <bool INT8, bool LO>
void gemm_rows(const BlockView& v, const XRow* rows, int m, float* out) {
  for (int t0 = 0; t0 < m; t0 += kMaxRows) {
    const XRow* r = rows + t0;
    float* o = out + int64_t(t0) * kBlockN;
    switch (std::min(kMaxRows, m - t0)) {
      case 1: gemm_mr<1, INT8, LO>(v, r, o); break;
      case 2: gemm_mr<2, INT8, LO>(v, r, o); break;
      case 3: gemm_mr<3, INT8, LO>(v, r, o); break;
      default: gemm_mr<4, INT8, LO>(v, r, o); break;
    }
  }
}

void gemm_dispatch(const BlockView& v, const XRow* rows, int m, float* out) {
  if (m <= 0) return;
  const bool lo = rows[0].lo != nullptr;
  if (v.bits == 8)
    lo ? gemm_rows<true, true>(v, rows, m, out) : gemm_rows<true, false>(v, rows, m, out);
  else
    lo ? gemm_rows<false, true>(v, rows, m, out) : gemm_rows<false, false>(v, rows, m, out);
}

void router_impl(const float* x, const float* w, int64_t H, int64_t E, float* logits) {
  for (int64_t e = 0; e < E; ++e) {
    const float* wr = w + e * H;
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    int64_t h = 0;
    for (; h + 16 <= H; h += 16) {
      a0 = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + h)), _mm512_cvtps_pd(_mm256_loadu_ps(wr + h)), a0);
      a1 = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + h + 8)), _mm512_cvtps_pd(_mm256_loadu_ps(wr + h + 8)),
                           a1);
    }
    double acc = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
    for (; h < H; ++h) acc += double(x[h]) * double(wr[h]);
    logits[e] = float(acc);
  }
}

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

void gemm_block_avx512bf16(const PackedLinear& L, int64_t nb, const XRow* rows, int m, float* out) {
  const BlockView v = block_view(L, nb);
  gemm_dispatch(v, rows, m, out);
}

void router_avx512(const float* x, const float* w, int64_t H, int64_t E, float* logits) {
  router_impl(x, w, H, E, logits);
}

uint64_t stream_sum_avx512(const uint64_t* p, int64_t n) { return stream_sum_impl(p, n); }

}  // namespace wna16::cpu
