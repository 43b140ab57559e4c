// The device packer's work items (device_pack.cu launches them, one thread per item): each item
// reads checkpoint-layout tensors and writes its words of the packed layout (moe_gemm.h), exactly
// the bytes the host path (KernelLinear + pack_kernel_linear) writes. __host__ __device__, so the
// tests run the same items on the CPU against the host oracle.
#pragma once
#include <cstdint>

#include "cuda/moe_gemm_layout.h"

namespace wna16::cuda::devpack {

enum ScalesType : int32_t { kScalesF16 = 0, kScalesBF16 = 1, kScalesF32 = 2 };

// One checkpoint linear (GPTQ v1/v2 or AWQ, 4 or 8 bit) in the memory the items read.
struct SrcLinear {
  const int32_t* qweight = nullptr;  // GPTQ [K*bits/32, N]; AWQ [K, N/8]
  const int32_t* qzeros = nullptr;   // GPTQ [G, N*bits/32]; AWQ [G, N/8]; null: zero 2^(bits-1)
  const void* scales = nullptr;      // [G, N] of scales_type
  int64_t K = 0, N = 0, G = 0;
  int32_t awq = 0;
  int32_t zero_add = 0;  // GPTQ v1 stores zero - 1
  int32_t scales_type = kScalesF16;
  int32_t sym = 0;       // the scheme pins every zero to 2^(bits-1): checked
  int32_t id = 0;        // names the linear in an error key
};

// Where kernel expert e2's rows, columns and groups come from (pack_plan.h's KernelExpertMap).
struct ExpertMaps {
  const int32_t* rows_g = nullptr;  // [H]; null: identity
  const int32_t* rows_u = nullptr;  // [H]; null: identity
  const int32_t* inter = nullptr;   // [I], -1: padding column / row
  const int32_t* grp_g = nullptr;   // [H / gl1]
  const int32_t* grp_u = nullptr;
  const int32_t* grp_d = nullptr;   // [I / gl2], -1: padding rows only
};

// A batch of n kernel experts (e2_first ..) packed into the layer's arrays (E2 experts each).
struct PackBatch {
  int bits = 4;
  int has_zeros = 0;
  int64_t H = 0, I = 0, gl1 = 0, gl2 = 0;
  int64_t NT1 = 0, NT2 = 0, G1 = 0, G2 = 0;  // padded n-tiles and kernel groups of GEMM1 / GEMM2
  int n = 0;
  int64_t e2_first = 0;
  const SrcLinear* lin = nullptr;  // [n][3]: gate, up, down of each kernel expert
  const ExpertMaps* maps = nullptr;  // [n]
  uint32_t *qw1 = nullptr, *sc1 = nullptr, *zr1 = nullptr, *qw2 = nullptr, *sc2 = nullptr, *zr2 = nullptr;
};

// The checks of a batch's distinct source linears (a shared expert once, not per slice).
struct CheckBatch {
  int bits = 4;
  int n = 0;
  int64_t per = 0;  // items per linear: the largest G * N
  const SrcLinear* lin = nullptr;  // [n]
};

// An error key: the smallest over all items is the one reported, so the report is deterministic:
// non-finite scales before wrong zeros, then by linear id, then by element g * N + n.
constexpr unsigned long long kNoError = ~0ull;
constexpr int kErrScale = 0, kErrZero = 1;
WNA16_HD unsigned long long error_key(int kind, int32_t id, int64_t elem) {
  return (static_cast<unsigned long long>(kind) << 62) | (static_cast<unsigned long long>(id) << 40) |
         static_cast<unsigned long long>(elem);
}

// ---- reading the checkpoint layouts (formats.md) ----------------------------------------------
WNA16_HD uint32_t src_code(const SrcLinear& L, int bits, int64_t k, int64_t n) {
  if (L.awq) return (uint32_t(L.qweight[k * (L.N / 8) + n / 8]) >> (4 * layout::awq_nibble(n))) & 0xFu;
  const int per = 32 / bits;  // 4 and 8 bit: no value straddles a word
  return (uint32_t(L.qweight[(k / per) * L.N + n]) >> (bits * int(k % per))) & ((1u << bits) - 1u);
}

// The real zero point (GPTQ v1's +1 applied), as unpack() reads it.
WNA16_HD int32_t src_zero(const SrcLinear& L, int bits, int64_t g, int64_t n) {
  if (!L.qzeros) return int32_t(1) << (bits - 1);
  if (L.awq) return int32_t((uint32_t(L.qzeros[g * (L.N / 8) + n / 8]) >> (4 * layout::awq_nibble(n))) & 0xFu);
  const int per = 32 / bits;
  const int64_t zw = L.N / per;
  return int32_t((uint32_t(L.qzeros[g * zw + n / per]) >> (bits * int(n % per))) & ((1u << bits) - 1u)) +
         L.zero_add;
}

// Raw bits of scale i, and whether it is finite.
WNA16_HD uint32_t src_scale_raw(const SrcLinear& L, int64_t i) {
  if (L.scales_type == kScalesF32) return static_cast<const uint32_t*>(L.scales)[i];
  return static_cast<const uint16_t*>(L.scales)[i];
}
WNA16_HD bool scale_finite(int32_t type, uint32_t raw) {
  if (type == kScalesF16) return (raw & 0x7c00u) != 0x7c00u;
  if (type == kScalesBF16) return (raw & 0x7f80u) != 0x7f80u;
  return (raw & 0x7f800000u) != 0x7f800000u;
}
// The f16 bits the kernel reads: the host path keeps scales as float and rounds them to f16, which
// leaves every finite f16 unchanged.
WNA16_HD uint32_t src_scale_f16(const SrcLinear& L, int64_t i) {
  const uint32_t raw = src_scale_raw(L, i);
  if (L.scales_type == kScalesF16) return raw;
  return layout::f16_bits_from_f32_bits(L.scales_type == kScalesBF16 ? raw << 16 : raw);
}

WNA16_HD void store_words(uint32_t* dst, const uint32_t* w) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);  // 16-byte aligned: one store
#else
  for (int i = 0; i < 4; ++i) dst[i] = w[i];
#endif
}

// An item index as ((i * nk + k) * nt_count + nt) * inner + r: the batch's expert i, its k-chunk or
// group k, the 16-row tile nt and the lane or word r inside it.
struct ItemIndex {
  int r;
  int64_t nt, k, i;
};
WNA16_HD ItemIndex split_item(int64_t item, int inner, int64_t nt_count, int64_t nk) {
  ItemIndex x;
  x.r = int(item % inner);
  int64_t t = item / inner;
  x.nt = t % nt_count;
  t /= nt_count;
  x.k = t % nk;
  x.i = t / nk;
  return x;
}

// ---- GEMM1 (gate/up): items = n * (H / 64) * NT1 * 32 lanes ------------------------------------
WNA16_HD int64_t qweight1_items(const PackBatch& b) { return b.n * (b.H / 64) * b.NT1 * 32; }
WNA16_HD void pack_qweight1(const PackBatch& b, int64_t item) {
  const ItemIndex x = split_item(item, 32, b.NT1, b.H / 64);
  const int lane = x.r;
  const int64_t nt = x.nt, kc = x.k, i = x.i;
  const SrcLinear* L = b.lin + 3 * i;
  const ExpertMaps& m = b.maps[i];
  auto code = [&](int64_t k, int64_t n) -> uint32_t {
    if (n >= 2 * b.I) return 0;  // padding tile
    const int32_t sc = m.inter[layout::gemm1_inter_col(n)];
    if (sc < 0) return 0;  // padding column past the shared width
    const bool up = layout::gemm1_is_up(n);
    const int32_t* rows = up ? m.rows_u : m.rows_g;
    return src_code(L[up ? 1 : 0], b.bits, rows ? rows[k] : k, sc);
  };
  uint32_t words[8];
  layout::lane_words(b.bits, kc, nt, lane, code, words);
  const int U = b.bits / 4;
  uint32_t* qw = b.qw1 + (b.e2_first + i) * ((b.H / 64) * b.NT1 * 32 * 4 * U);
  for (int u = 0; u < U; ++u) store_words(qw + layout::qweight_word(kc, nt, u, lane, b.NT1, U), words + 4 * u);
}

// ---- GEMM2 (down): items = n * (I / 64) * NT2 * 32 lanes ----------------------------------------
WNA16_HD int64_t qweight2_items(const PackBatch& b) { return b.n * (b.I / 64) * b.NT2 * 32; }
WNA16_HD void pack_qweight2(const PackBatch& b, int64_t item) {
  const ItemIndex x = split_item(item, 32, b.NT2, b.I / 64);
  const int lane = x.r;
  const int64_t nt = x.nt, kc = x.k, i = x.i;
  const SrcLinear& D = b.lin[3 * i + 2];
  const ExpertMaps& m = b.maps[i];
  const int32_t zsym = int32_t(1) << (b.bits - 1);
  auto code = [&](int64_t c, int64_t n) -> uint32_t {
    if (n >= b.H) return 0;  // padding tile
    const int32_t r = m.inter[c];
    if (r >= 0) return src_code(D, b.bits, r, n);
    // Padding row (past shared_inter): code = the kernel group's zero point where it fits, as the
    // host path writes it (GEMM1 gives 0 in this column, so it only has to be finite).
    const int32_t grp = m.grp_d[c / b.gl2];
    const int32_t z = b.has_zeros ? (grp >= 0 ? src_zero(D, b.bits, grp, n) : 0) : zsym;
    return uint32_t(z < (1 << b.bits) ? z : 0);
  };
  uint32_t words[8];
  layout::lane_words(b.bits, kc, nt, lane, code, words);
  const int U = b.bits / 4;
  uint32_t* qw = b.qw2 + (b.e2_first + i) * ((b.I / 64) * b.NT2 * 32 * 4 * U);
  for (int u = 0; u < U; ++u) store_words(qw + layout::qweight_word(kc, nt, u, lane, b.NT2, U), words + 4 * u);
}

// ---- scales and zeros: items = n * G * NT * 8 (rows g and g + 8 of a tile per word) -------------
WNA16_HD int64_t meta1_items(const PackBatch& b) { return b.n * b.G1 * b.NT1 * 8; }
WNA16_HD void pack_meta1(const PackBatch& b, int64_t item) {
  const ItemIndex x = split_item(item, 8, b.NT1, b.G1);
  const int g = x.r;
  const int64_t nt = x.nt, kg = x.k, i = x.i;
  const SrcLinear* L = b.lin + 3 * i;
  const ExpertMaps& m = b.maps[i];
  uint32_t s[2] = {0, 0}, z[2] = {0, 0};  // padding columns: scale 0, zero 0
  for (int h = 0; h < 2; ++h) {
    const int64_t n = nt * 16 + g + 8 * h;
    if (n >= 2 * b.I) continue;
    const int32_t sc = m.inter[layout::gemm1_inter_col(n)];
    if (sc < 0) continue;
    const bool up = layout::gemm1_is_up(n);
    const SrcLinear& S = L[up ? 1 : 0];
    const int32_t grp = (up ? m.grp_u : m.grp_g)[kg];
    s[h] = src_scale_f16(S, grp * S.N + sc);
    z[h] = uint32_t(src_zero(S, b.bits, grp, sc));
  }
  const int64_t o = (b.e2_first + i) * (b.G1 * b.NT1 * 8) + layout::meta_word(kg, nt, g, b.NT1);
  b.sc1[o] = s[0] | s[1] << 16;
  if (b.has_zeros) b.zr1[o] = z[0] | z[1] << 16;
}

WNA16_HD int64_t meta2_items(const PackBatch& b) { return b.n * b.G2 * b.NT2 * 8; }
WNA16_HD void pack_meta2(const PackBatch& b, int64_t item) {
  const ItemIndex x = split_item(item, 8, b.NT2, b.G2);
  const int g = x.r;
  const int64_t nt = x.nt, kg = x.k, i = x.i;
  const SrcLinear& D = b.lin[3 * i + 2];
  const int32_t grp = b.maps[i].grp_d[kg];
  uint32_t s[2] = {0, 0}, z[2] = {0, 0};  // padding columns and groups of padding rows: 0
  for (int h = 0; h < 2; ++h) {
    const int64_t n = nt * 16 + g + 8 * h;
    if (n >= b.H || grp < 0) continue;
    s[h] = src_scale_f16(D, grp * D.N + n);
    z[h] = uint32_t(src_zero(D, b.bits, grp, n));
  }
  const int64_t o = (b.e2_first + i) * (b.G2 * b.NT2 * 8) + layout::meta_word(kg, nt, g, b.NT2);
  b.sc2[o] = s[0] | s[1] << 16;
  if (b.has_zeros) b.zr2[o] = z[0] | z[1] << 16;
}

// ---- checks: items = n * per; element e of linear i: its scale e and its zero e -----------------
WNA16_HD int64_t check_items(const CheckBatch& c) { return c.n * c.per; }
WNA16_HD unsigned long long check_item(const CheckBatch& c, int64_t item) {
  const SrcLinear& L = c.lin[item / c.per];
  const int64_t e = item % c.per;
  if (e >= L.G * L.N) return kNoError;
  if (!scale_finite(L.scales_type, src_scale_raw(L, e))) return error_key(kErrScale, L.id, e);
  if (L.sym && src_zero(L, c.bits, e / L.N, e % L.N) != (int32_t(1) << (c.bits - 1)))
    return error_key(kErrZero, L.id, e);
  return kNoError;
}

}  // namespace wna16::cuda::devpack
