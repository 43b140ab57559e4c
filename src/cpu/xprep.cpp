#include "cpu/xprep.h"

#include <algorithm>
#include <cmath>

#include "wna16/half.h"

namespace wna16::cpu {

RowLayout row_layout(const PackedLinear& L, int terms) {
  RowLayout r;
  r.terms = terms;
  int64_t off = 0;
  auto take = [&](int64_t bytes) {
    const int64_t o = off;
    off += (bytes + 63) / 64 * 64;
    return o;
  };
  if (terms > 0) {
    for (int t = 0; t < terms; ++t) r.q[t] = take(L.Kp);
    r.bscale = take(L.num_xblocks() * 4);
    r.bsum = take(L.num_xblocks() * 4);
  } else {
    r.f = take(L.Kp * 4);
    r.xs = take(L.num_groups() * 4);
  }
  r.stride = off;
  return r;
}

RowLayout row_layout_for(const PackedLinear& L, Isa isa, DType act) {
  return row_layout(L, isa_uses_int8_rows(isa, L.bits) ? (act == DType::F16 ? 3 : 2) : 0);
}

XRow view_row(const RowLayout& r, const uint8_t* row) {
  XRow x;
  if (r.f >= 0) x.f = reinterpret_cast<const float*>(row + r.f);
  if (r.xs >= 0) x.xs = reinterpret_cast<const float*>(row + r.xs);
  for (int t = 0; t < 3; ++t)
    if (r.q[t] >= 0) x.q[t] = reinterpret_cast<const int8_t*>(row + r.q[t]);
  if (r.bscale >= 0) x.bscale = reinterpret_cast<const float*>(row + r.bscale);
  if (r.bsum >= 0) x.bsum = reinterpret_cast<const float*>(row + r.bsum);
  return x;
}

// Gathers x (original K order) into L's kernel order, in the row format of `r`.
void prep_row(const PackedLinear& L, const RowLayout& r, const float* x, uint8_t* row) {
  auto value = [&](int64_t kp) -> float {
    if (L.identity_k) return x[kp];
    const int32_t k = L.kmap[size_t(kp)];
    return k >= 0 ? x[k] : 0.f;
  };
  if (r.terms == 0) {
    float* f = reinterpret_cast<float*>(row + r.f);
    float* xs = reinterpret_cast<float*>(row + r.xs);
    for (int64_t gi = 0; gi < L.num_groups(); ++gi) {
      double sum = 0;
      const int64_t k0 = L.group_kstart[size_t(gi)], k1 = k0 + L.group_len[size_t(gi)];
      for (int64_t kp = k0; kp < k1; ++kp) sum += (f[kp] = value(kp));
      xs[gi] = float(sum);
    }
    return;
  }
  int8_t* q[3] = {};
  for (int t = 0; t < r.terms; ++t) q[t] = reinterpret_cast<int8_t*>(row + r.q[t]);
  float* bscale = reinterpret_cast<float*>(row + r.bscale);
  float* bsum = reinterpret_cast<float*>(row + r.bsum);
  // The builds give identical terms; int8 rows only exist where AVX2 does (kernels.h).
  static const auto quantize = isa_supported(Isa::Avx512Vnni) ? quantize_block_avx512 : quantize_block_avx2;
  alignas(64) float v[kXBlock];
  for (int64_t b = 0; b < L.num_xblocks(); ++b) {
    const int64_t k0 = L.xblock_kstart[size_t(b)], n = L.xblock_len[size_t(b)];
    const float* src = x + k0;
    if (!L.identity_k) {
      for (int64_t i = 0; i < n; ++i) v[i] = value(k0 + i);
      src = v;
    }
    int8_t* qb[3] = {q[0] + k0, q[1] + k0, q[2] ? q[2] + k0 : nullptr};
    quantize(src, n, r.terms, qb, &bscale[b], &bsum[b]);
  }
}

}  // namespace wna16::cpu
