// The CPU backend's weight layout: every quantized linear is repacked once at load, from the
// canonical UnpackedLinear (quant.h), into the order the kernels stream it.
//
// Layout of one linear (K inputs, N outputs, b = 4 or 8 bits)
// ------------------------------------------------------------
// Kernel K order. Input channels are sorted by group (stable argsort of g_idx), so act-order
//   (desc_act) checkpoints become contiguous groups once, at load; the activation is gathered in
//   the same order at call time (kmap). Each group is padded to a multiple of 8 channels with
//   code 0 / activation 0 (padding contributes exactly nothing). Kp = the padded total. When the
//   order is the identity and nothing is padded, identity_k is set and no gather happens.
//   Each group is further cut into activation blocks of at most kXBlock channels (the unit the
//   int8 kernels scale activations by; see kernels.h).
// Column blocks. N is padded to Np = 64 * NB; column block nb holds columns [64 nb, 64 nb + 64),
//   split in 4 tiles of 16 (one 16-lane fp32 vector of results each). Padded columns have scale
//   0 and code 0. Each block is one contiguous byte stream (block_bytes long, 64-byte aligned), so a
//   thread computing a block reads one sequential run of memory and every weight byte once:
//     for each group gi (kernel order):
//       header: 64 scales (f16, or f32 when a scale is not exactly an f16), then, unless every
//               zero point of the linear is the same value (GPTQ sym), 64 zero points as uint8
//               (int4) or uint16 (int8: a GPTQ v1 zero can be 2^b, see src/formats/pack.cpp);
//       steps:  group_len[gi] / 8 steps of 8 channels k0..k0+7, each 4 tiles of
//               int4: 64 bytes per tile; for tile column j (0..15) and i (0..3):
//                       byte 4j+i = q[k0+i][j] | q[k0+4+i][j] << 4
//               int8: 128 bytes per tile: byte 4j+i = q[k0+i][j], byte 64+4j+i = q[k0+4+i][j].
//   Why this order: one 64-byte load holds a tile's 8 channels; masking the low (high) nibbles
//   leaves in 32-bit lane j the four bytes q[k0..k0+3][j] (q[k0+4..k0+7][j]), exactly the u8
//   operand of a VNNI dot product (vpdpbusd: four u8 x s8 products summed into an int32 lane)
//   against the broadcast int8 activations x[k0..k0+3]: 2 bitwise instructions per 128 weights,
//   none for int8. The AVX2 and scalar kernels read lane j as the 8 codes of column j.
//
// Zero point and scale are applied once per activation block / group and column, never per weight:
//   sum_{k in g} x[k] s (q[k] - z) = s * (sum_k x[k] q[k] - z * sum_k x[k]).
#pragma once
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "wna16/quant.h"

namespace wna16::cpu {

inline constexpr int kTileN = 16;                      // columns per tile = fp32 lanes of a zmm
inline constexpr int kTilesPerBlock = 4;               // tiles per column block
inline constexpr int kBlockN = kTileN * kTilesPerBlock;  // columns one task computes
inline constexpr int kStepK = 8;                       // channels per step (two 4-byte VNNI lanes)
inline constexpr int kXBlock = 64;                     // activation block (int8 kernels' scale unit)
static_assert(kBlockN == 64, "the layout comment and the kernels assume 64-column blocks");
static_assert(kXBlock % kStepK == 0, "activation blocks are whole steps");

enum class ScaleFmt : uint8_t { F16, F32 };

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBytes = std::unique_ptr<uint8_t[], AlignedFree>;
AlignedBytes aligned_bytes(size_t n);  // 64-byte aligned, zero-filled

struct PackedLinear {
  int bits = 4;
  int64_t K = 0, N = 0;  // logical shape
  int64_t Kp = 0;        // kernel-order channels, padding included
  int64_t NB = 0;        // column blocks
  ScaleFmt scale_fmt = ScaleFmt::F16;
  bool uniform_zero = true;  // every zero point equals `zero`: no per-column zeros stored
  int32_t zero = 0;
  bool identity_k = true;            // kernel order == original order, no padding
  std::vector<int32_t> kmap;         // [Kp] original channel at each kernel position, -1 = pad
  std::vector<int64_t> group_kstart; // per kernel group: first kernel position
  std::vector<int64_t> group_len;    // per kernel group: channels incl. padding (multiple of 8)
  // Activation blocks: groups cut in runs of at most kXBlock channels. Group gi owns blocks
  // [group_xblock[gi], group_xblock[gi + 1]).
  std::vector<int64_t> xblock_kstart, xblock_len, group_xblock;
  int64_t block_bytes = 0;
  AlignedBytes data;                 // NB * block_bytes
  std::vector<float> bias;           // [N] or empty

  int64_t num_groups() const { return int64_t(group_len.size()); }
  int64_t num_xblocks() const { return int64_t(xblock_len.size()); }
  int64_t tile_bytes() const { return bits == 4 ? 64 : 128; }  // one tile, one step
  int64_t step_bytes() const { return tile_bytes() * kTilesPerBlock; }
  int64_t scale_bytes() const { return (scale_fmt == ScaleFmt::F16 ? 2 : 4) * kBlockN; }
  int64_t zero_bytes() const { return bits == 8 ? 2 : 1; }  // per stored zero point
  int64_t header_bytes() const { return scale_bytes() + (uniform_zero ? 0 : kBlockN * zero_bytes()); }
  const uint8_t* block(int64_t nb) const { return data.get() + nb * block_bytes; }
  // True when a token prepared for `o` (same kernel order and groups) can be used for this one.
  bool same_k_order(const PackedLinear& o) const;
  // Bytes of the checkpoint form a forward must read for this linear: b-bit codes, f16 scales and
  // b-bit zero points unless they are uniform (the accounting the benchmark uses; this layout
  // reads slightly more: uint8 zeros, f32 scales when not f16-exact).
  int64_t checkpoint_bytes() const;
};

// Throws Error naming the value for bits other than 4 and 8, or inconsistent tensors.
PackedLinear pack_linear(const UnpackedLinear& u);

}  // namespace wna16::cpu
