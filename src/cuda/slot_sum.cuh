// The top-k sum of GEMM2's per-slot rows into a token's output, one 8-element piece at a time:
// the device code of the sum kernel (launch_slot_sum_out) and of the decode kernel's tail sum
// (KParams::tail_count), so that both give the same bits.
// The order of additions, the same at every M: partial q (q < 8) adds rows q, q + 8, ... in turn;
// the result is ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)). LANES = 8: one lane per partial
// (all loads in flight at once: a few tokens' call is a latency chain), added by a butterfly of
// shuffles (a + b == b + a: both lanes of a pair hold the same sum); LANES = 1: one thread per
// 8-element piece, the same additions in registers (many tokens: an eighth of the instructions).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace wna16::cuda {

constexpr int kSumParts = 8;
// Pieces (tokens x H / 8) from which the sum runs one lane per piece (fewer: eight).
constexpr int64_t kSumOneLanePieces = 16384;

template <class T>
__device__ __forceinline__ void slot_sum_add8(float (&s)[8], const uint4& v) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] += float(e[i]);
}

// Token t's piece h (H8 pieces of 8 elements per row): the rows of its k2 slots and `splits` K
// splits (row r = slot r / splits, split r % splits; a split's rows are plane8 pieces apart) added
// in the order above and stored to out[t * H8 + h]. q: this thread's lane of the piece (LANES = 8:
// the 8 lanes of an aligned group of a warp, all of whose lanes must call); valid: false for
// lanes past the last piece (they add nothing and store nothing but take part in the shuffles).
// L2_ONLY: the rows are read from L2 (written by other blocks of the running kernel).
template <class T, int LANES, bool L2_ONLY = false>
__device__ __forceinline__ void slot_sum_piece(const uint4* __restrict__ part, int splits, int k2, int H8, int64_t plane8,
                                               int64_t t, int h, int q, bool valid, uint4* __restrict__ out) {
  const int n = k2 * splits;
  float s[kSumParts / LANES][8] = {};
  if (valid) {
    const uint4* rows = part + t * k2 * H8 + h;
    auto row = [&](int r) {
      const int j = splits == 1 ? r : r / splits, sp = r - j * splits;
      const uint4* a = rows + sp * plane8 + int64_t(j) * H8;
      if constexpr (L2_ONLY) return __ldcg(a);
      else return __ldcs(a);
    };
    if constexpr (LANES == kSumParts) {
#pragma unroll 4
      for (int r = q; r < n; r += kSumParts) slot_sum_add8<T>(s[0], row(r));
    } else {
      for (int r0 = 0; r0 < n; r0 += kSumParts)
#pragma unroll
        for (int p = 0; p < kSumParts; ++p)
          if (r0 + p < n) slot_sum_add8<T>(s[p], row(r0 + p));
    }
  }
  float v[8];
  if constexpr (LANES == kSumParts) {
#pragma unroll
    for (int m = kSumParts / 2; m > 0; m >>= 1)
#pragma unroll
      for (int i = 0; i < 8; ++i) s[0][i] += __shfl_xor_sync(0xffffffffu, s[0][i], m);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = s[0][i];
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = ((s[0][i] + s[4][i]) + (s[2][i] + s[6][i])) + ((s[1][i] + s[5][i]) + (s[3][i] + s[7][i]));
  }
  if (valid && q == 0) {
    uint4 o;
    T* e = reinterpret_cast<T*>(&o);
#pragma unroll
    for (int i = 0; i < 8; ++i) e[i] = T(v[i]);
    out[t * H8 + h] = o;
  }
}

}  // namespace wna16::cuda
