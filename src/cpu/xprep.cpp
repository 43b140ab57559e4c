#include "cpu/xprep.h"

#include "wna16/half.h"

namespace wna16::cpu {

RowLayout row_layout(const PackedLinear& L, bool bf16, bool lo) {
  RowLayout r;
  int64_t off = 0;
  auto take = [&](int64_t bytes) {
    const int64_t o = off;
    off += (bytes + 63) / 64 * 64;
    return o;
  };
  if (bf16) {
    r.hi = take(L.Kp * 2);
    if (lo) r.lo = take(L.Kp * 2);
  } else {
    r.f = take(L.Kp * 4);
  }
  r.xs = take(L.num_groups() * 4);
  r.stride = off;
  return r;
}

XRow view_row(const RowLayout& r, const uint8_t* row) {
  XRow x;
  if (r.hi >= 0) x.hi = reinterpret_cast<const uint16_t*>(row + r.hi);
  if (r.lo >= 0) x.lo = reinterpret_cast<const uint16_t*>(row + r.lo);
  if (r.f >= 0) x.f = reinterpret_cast<const float*>(row + r.f);
  x.xs = reinterpret_cast<const float*>(row + r.xs);
  return x;
}

// Gathers x (original K order) into L's kernel order, in the row format of `r`, with group sums.
void prep_row(const PackedLinear& L, const RowLayout& r, const float* x, uint8_t* row) {
  uint16_t* hi = r.hi >= 0 ? reinterpret_cast<uint16_t*>(row + r.hi) : nullptr;
  uint16_t* lo = r.lo >= 0 ? reinterpret_cast<uint16_t*>(row + r.lo) : nullptr;
  float* f = r.f >= 0 ? reinterpret_cast<float*>(row + r.f) : nullptr;
  float* xs = reinterpret_cast<float*>(row + r.xs);
  for (int64_t gi = 0; gi < L.num_groups(); ++gi) {
    double sum = 0;
    const int64_t k0 = L.group_kstart[size_t(gi)], k1 = k0 + L.group_len[size_t(gi)];
    for (int64_t kp = k0; kp < k1; ++kp) {
      float v;
      if (L.identity_k) {
        v = x[kp];
      } else {
        const int32_t k = L.kmap[size_t(kp)];
        v = k >= 0 ? x[k] : 0.f;
      }
      sum += v;
      if (f) {
        f[kp] = v;
      } else {
        // bf16 activations are exact in hi; f16 ones split exactly into hi + lo.
        const uint16_t h = float_to_bf16(v);
        hi[kp] = h;
        if (lo) lo[kp] = float_to_bf16(v - bf16_to_float(h));
      }
    }
    xs[gi] = float(sum);
  }
}

}  // namespace wna16::cpu
