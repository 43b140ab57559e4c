// The CPU kernels, one build per ISA (isa.h), all reading the layout of packed_linear.h.
#pragma once
#include <cstdint>
#include <cstring>

#include "cpu/isa.h"
#include "cpu/packed_linear.h"

namespace wna16::cpu {

// One token's activation prepared for one kernel K order (see PackedLinear::kmap), Kp entries:
//  - fp32 kernels (scalar; AVX2 for 8-bit codes): f = the activation as float; xs = per kernel
//    group, the sum of the group's activations (for the zero-point term).
//  - int8 kernels (AVX-512 VNNI; AVX2 for 4-bit codes): per activation block (PackedLinear::xblock_*) of up to 64
//    channels with scale s = max|x| / 127, the activation is split into int8 terms
//        x ~= s * (q0 + q1 / 254 + q2 / 254^2),   |q_t| <= 127,
//    each term the rounded remainder of the previous one. Two terms (bf16 activations, q2 null)
//    leave an error <= max|x| / 64516 per element, 3 terms (f16) about max|x| * 2^-23 (the fp32
//    rounding of x / s): far below the activation dtype's own rounding for all but channels 100x
//    smaller than their block's largest. bscale = s, bsum = sum over the block of
//    (q0 + q1 / 254 + q2 / 254^2).
struct XRow {
  const float* f = nullptr;
  const float* xs = nullptr;
  const int8_t* q[3] = {nullptr, nullptr, nullptr};
  const float* bscale = nullptr;
  const float* bsum = nullptr;
};
inline constexpr float kTermRatio = 254.f;  // each int8 term resolves the previous one's half step

// Plain-data view of one column block, so the ISA-specific code touches no std:: template (the
// AVX-512/AVX2 files compile their functions for other targets; see kernels_avx512.cpp).
struct BlockView {
  const uint8_t* data;        // the block's byte stream
  int64_t groups;
  const int64_t* group_kstart;
  const int64_t* group_len;
  const int64_t* group_xblock;  // [groups + 1]
  const int64_t* xblock_kstart;
  const int64_t* xblock_len;
  int bits;
  bool scales_f16;
  bool uniform_zero;
  int32_t zero;
  int64_t scale_bytes, header_bytes, tile_bytes, step_bytes;
  bool zeros_u16;  // stored zero points are uint16 (int8), else uint8
};
inline BlockView block_view(const PackedLinear& L, int64_t nb) {
  return {L.block(nb),      L.num_groups(),       L.group_kstart.data(),        L.group_len.data(),
          L.group_xblock.data(), L.xblock_kstart.data(), L.xblock_len.data(), L.bits,
          L.scale_fmt == ScaleFmt::F16, L.uniform_zero, L.zero, L.scale_bytes(),
          L.header_bytes(), L.tile_bytes(), L.step_bytes(), L.zero_bytes() == 2};
}

// The start every SIMD kernel shares: zero the m x kBlockN outputs and request the first `bytes`
// of the block's stream into L2 at once, not one miss after another (defined here, for the
// baseline CPU, and inlined into the ISA builds).
inline void start_block(const uint8_t* p, int bytes, float* out, int m) {
  std::memset(out, 0, sizeof(float) * size_t(m) * kBlockN);
  for (int off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);  // locality 2: L2 (T1)
}

// Does a kernel of this ISA take int8-term rows for b-bit codes? AVX2 multiplies u8 codes by s8
// terms with pmaddubsw, whose int16 pair sums saturate past 4-bit codes (2 x 255 x 127 > 32767).
inline bool isa_uses_int8_rows(Isa isa, int bits) { return isa == Isa::Avx512Vnni || (isa == Isa::Avx2 && bits == 4); }

// out[t * kBlockN + c] = sum_k x_t[k] W[k, 64 nb + c] for the m rows (no bias), c < 64.
using GemmBlockFn = void (*)(const PackedLinear& L, int64_t nb, const XRow* rows, int m, float* out);
// logits[e] = float(sum_h double(x[h]) * double(w[e * H + h])) for e < E.
using RouterFn = void (*)(const float* x, const float* w, int64_t H, int64_t E, float* logits);

// Sum of n 64-bit words (the benchmark's read-bandwidth probe: widest loads the ISA has, so the
// probe stays memory-bound even with a small share of a busy core).
using StreamSumFn = uint64_t (*)(const uint64_t* p, int64_t n);

// The benchmark's compute-ceiling probe: iters rounds of independent fp32 FMAs on registers only,
// the ISA's widest vectors, enough chains to cover the FMA latency on two ports. Returns the FLOPs
// done (2 per lane and FMA).
using FmaLoopFn = double (*)(int64_t iters);

struct Kernels {
  Isa isa;
  GemmBlockFn gemm_block;
  RouterFn router;
  StreamSumFn stream_sum;
  FmaLoopFn fma_loop;
};

// Throws Error when the ISA is not supported by this CPU.
const Kernels& kernels(Isa isa);

// One activation block (n <= kXBlock values, n a multiple of 8) to int8 terms (see XRow):
// q[t][i] for t < terms, *scale = max|v| / 127, *sum = sum_i (q0 + q1 / 254 + q2 / 254^2).
// The scalar, AVX2 and AVX-512 builds give identical results.
void quantize_block_scalar(const float* v, int64_t n, int terms, int8_t* const* q, float* scale, float* sum);
void quantize_block_avx2(const float* v, int64_t n, int terms, int8_t* const* q, float* scale, float* sum);
void quantize_block_avx512(const float* v, int64_t n, int terms, int8_t* const* q, float* scale, float* sum);

// Per-ISA entry points (kernels_<isa>.cpp); only call what isa_supported() allows.
void gemm_block_scalar(const PackedLinear& L, int64_t nb, const XRow* rows, int m, float* out);
void router_scalar(const float* x, const float* w, int64_t H, int64_t E, float* logits);
uint64_t stream_sum_scalar(const uint64_t* p, int64_t n);
uint64_t stream_sum_avx2(const uint64_t* p, int64_t n);
uint64_t stream_sum_avx512(const uint64_t* p, int64_t n);
double fma_loop_scalar(int64_t iters);
double fma_loop_avx2(int64_t iters);
double fma_loop_avx512(int64_t iters);
void gemm_block_avx2(const PackedLinear& L, int64_t nb, const XRow* rows, int m, float* out);
void router_avx2(const float* x, const float* w, int64_t H, int64_t E, float* logits);
void gemm_block_avx512vnni(const PackedLinear& L, int64_t nb, const XRow* rows, int m, float* out);
void router_avx512(const float* x, const float* w, int64_t H, int64_t E, float* logits);

}  // namespace wna16::cpu
