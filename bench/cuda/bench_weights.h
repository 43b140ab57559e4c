// Fast synthetic layers for `wna16 bench --device cuda`. DeepSeek-V3 alone is ~5.8 GB of int4
// words, far too much for the round-to-nearest quantizer (moe.h's random_layer), so this fills the
// checkpoint tensors directly: random qweight words, random (or sym) zero points, small random
// f16-exact scales. Every value is valid for the packing by construction, so unpack/dequantize and
// the reference read these layers exactly like a real checkpoint. Multi-threaded and seeded.
#pragma once
#include <cstdint>
#include <vector>

#include "wna16/half.h"
#include "wna16/moe.h"

namespace wna16::cuda::bench {

// Weights are scaled so that W = s*(q - z) has a standard deviation near 1/sqrt(K): x ~ N(0,1)
// then gives layer activations of order 1 (no overflow in bf16/f16, no vanishing outputs).
// Router ~ N(0, 1/H) so the logits are O(1) (realistic routing, no saturated sigmoid), bias ~
// N(0, 0.02) so the load stays balanced, as a trained e_score_correction_bias keeps it. Bits must be 4 or 8 (the kernels' widths). Throws Error naming a bad value.
MoeLayerWeights random_bench_layer(const MoeLayerSpec& spec, const QuantScheme& scheme, uint64_t seed);

// Activations [rows, H]: N(0, 1) rounded to `t` (F16 or BF16), as raw 16-bit patterns; one seeded
// stream per row, generated on all cores.
std::vector<uint16_t> random_activations(int64_t rows, int64_t H, DType t, uint64_t seed);

// Raw 16-bit activations (F16 or BF16 patterns) as floats: the host side of the bench's checks.
std::vector<float> to_float(const uint16_t* p, size_t n, DType t);

// Bytes of one linear as stored (qweight + f16 scales + zero points when the scheme has them).
// g_idx is not counted: act-order is resolved at load, never read per call.
int64_t linear_stored_bytes(int64_t K, int64_t N, const QuantScheme& scheme);

}  // namespace wna16::cuda::bench
