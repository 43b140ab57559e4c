// The packed weight layout of moe_gemm.h as arithmetic that both packers share: the host packer
// (pack_kernel_linear, the test oracle) and the device packer (device_pack_kernels.h) call these
// same functions, so the layout is decided in one place. Compiled by g++ and nvcc alike.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define WNA16_HD __host__ __device__ __forceinline__
#else
#define WNA16_HD inline
#endif

namespace wna16::cuda::layout {

// Word offset, inside one kernel expert's packed qweight, of the 4-word group u of `lane` in chunk
// kc (64 k) of n-tile nt; U = bits / 4 groups per lane.
WNA16_HD int64_t qweight_word(int64_t kc, int64_t nt, int u, int lane, int64_t NT, int U) {
  return ((kc * NT + nt) * U) * 32 * 4 + (int64_t(u) * 32 + lane) * 4;
}

// Word offset, inside one kernel expert's scales (or zeros), of rows g and g+8 of n-tile nt in
// kernel group grp.
WNA16_HD int64_t meta_word(int64_t grp, int64_t nt, int g, int64_t NT) { return (grp * NT + nt) * 8 + g; }

// The lane's words (4 for int4, 8 for int8) of chunk kc, n-tile nt, in the MMA fragment order of
// moe_gemm.h; code(k, n) gives the kernel-order code at kernel row k, kernel column n.
template <class Code>
WNA16_HD void lane_words(int bits, int64_t kc, int64_t nt, int lane, const Code& code, uint32_t (&words)[8]) {
  const int g = lane / 4, tig = lane % 4;
  const int64_t row_lo = nt * 16 + g, row_hi = row_lo + 8;
  for (int j = 0; j < 4; ++j) {
    const int64_t k0 = kc * 64 + 16 * tig + 4 * j;
    if (bits == 4) {
      uint32_t w = 0;
      for (int i = 0; i < 8; ++i) {
        const int r = i & 3, el = i >> 2;  // MMA register r, element el of its 16-bit pair
        const int64_t row = (r & 1) ? row_hi : row_lo;
        const int64_t k = k0 + 2 * (r >> 1) + el;
        w |= (code(k, row) & 0xFu) << (4 * i);
      }
      words[j] = w;
      words[j + 4] = 0;
    } else {
      words[2 * j] = code(k0, row_lo) | code(k0 + 1, row_lo) << 8 | code(k0, row_hi) << 16 | code(k0 + 1, row_hi) << 24;
      words[2 * j + 1] =
          code(k0 + 2, row_lo) | code(k0 + 3, row_lo) << 8 | code(k0 + 2, row_hi) << 16 | code(k0 + 3, row_hi) << 24;
    }
  }
}

// GEMM1 (gate/up) interleave: kernel column n belongs to n-tile n / 16; even tiles are gate, odd
// tiles up, both for intermediate columns 16p..16p+15 of tile pair p.
WNA16_HD bool gemm1_is_up(int64_t n) { return (n / 16) % 2 == 1; }
WNA16_HD int64_t gemm1_inter_col(int64_t n) { return (n / 32) * 16 + n % 16; }

WNA16_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

// f32 bits -> f16 bits, round to nearest even, overflow to inf, NaN to a quiet NaN: bit for bit
// wna16::float_to_f16 (half.h), in integer arithmetic so that the device gives the same bits.
WNA16_HD uint16_t f16_bits_from_f32_bits(uint32_t u) {
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520
  if (a < 0x38800000u) {                                   // below 2^-14: an f16 subnormal or zero
    if (a < 0x33000000u) return uint16_t(sign);            // below 2^-25 (2^-25 itself ties to 0)
    // value = m * 2^(e - 150); in units of 2^-24 that is m >> (126 - e), rounded to nearest even.
    const int e = int(a >> 23);
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;
    const int shift = 126 - e;  // 14..24
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return uint16_t(sign | r);
  }
  const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  return uint16_t(sign | ((r - 0x38000000u) >> 13));
}

// AWQ gemm: column 8c + j sits in nibble kAwqReverse[j] = {0, 4, 1, 5, 2, 6, 3, 7}[j] of word c.
WNA16_HD int awq_nibble(int64_t n) {
  const int j = int(n % 8);
  return (j >> 1) + 4 * (j & 1);
}

}  // namespace wna16::cuda::layout
