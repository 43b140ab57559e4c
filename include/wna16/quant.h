// Quantization formats: the scheme, the checkpoint layouts (GPTQ v1/v2, AWQ gemm), exact
// pack/unpack between them and one canonical unpacked form, dequantization, and a round-to-nearest
// quantizer for tests and synthetic checkpoints. See ../shared/docs/formats.md for the layouts.
//
// Convention everywhere in wna16: a linear layer has K inputs and N outputs and computes
// y[m, n] = sum_k x[m, k] * W[k, n]; W is addressed [K, N] (the transpose of torch's Linear.weight),
// which is how GPTQ's qweight [K*b/32, N] is laid out.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace wna16 {

enum class Format {
  GptqV1,  // "gptq": qzeros hold zero-1
  GptqV2,  // "gptq_v2": qzeros hold the real zero
  Awq,     // AutoAWQ "gemm": packed along N with the [0,2,4,6,1,3,5,7] interleave, 4-bit only
};

const char* format_name(Format f);  // "gptq", "gptq_v2", "awq"
Format parse_format(const std::string& s);  // throws Error naming s

struct QuantScheme {
  Format format = Format::GptqV1;
  int bits = 4;          // 2, 3, 4 or 8 (AWQ: 4 only). Kernels support 4 and 8.
  int group_size = 128;  // > 0, or -1 = one group spanning all of K
  bool sym = true;       // true: zero point is 2^(bits-1) for every group (GPTQ sym); false: stored zeros
  bool act_order = false;  // GPTQ desc_act: g_idx maps each input channel to its group, non-monotonic

  // Number of groups along K (ceil(K / group_size), or 1 for group_size -1).
  int64_t num_groups(int64_t K) const;
  // Effective group size for a given K (K when group_size == -1).
  int64_t group_len(int64_t K) const;
  // Throws Error naming the bad value: bits not in {2,3,4,8}, AWQ with bits != 4, group_size 0 or
  // < -1, K not a multiple of group_size, K or N not a multiple of the packing, K/N <= 0.
  void validate(int64_t K, int64_t N) const;
  std::string describe() const;  // e.g. "gptq 4-bit g128 sym act-order"
};

// A linear layer exactly as a checkpoint stores it (see formats.md for shapes).
// GPTQ: qweight [K*bits/32, N], qzeros [G, N*bits/32], scales [G, N], g_idx [K] (may be empty
//       when not act-order: then g_idx[k] = k / group_len).
// AWQ:  qweight [K, N/8],        qzeros [G, N/8],        scales [G, N], no g_idx.
// Scales are kept as float; their values are exactly those of the file's F16 (or BF16).
struct QuantizedLinear {
  QuantScheme scheme;
  int64_t K = 0, N = 0;
  std::vector<int32_t> qweight;
  std::vector<int32_t> qzeros;
  std::vector<float> scales;
  std::vector<int32_t> g_idx;
  std::vector<float> bias;  // [N] or empty

  // Checks every tensor's size and every g_idx value against the scheme; throws Error naming the
  // tensor, its size and the expected one.
  void validate() const;
};

// The canonical, format-free form every format unpacks to and every kernel repacks from:
// W[k, n] = scales[g(k), n] * (q[k, n] - zeros[g(k), n]) with g(k) = g_idx[k].
struct UnpackedLinear {
  int bits = 4;
  int64_t K = 0, N = 0, groups = 0;
  std::vector<uint8_t> q;       // [K, N] unsigned codes in [0, 2^bits)
  std::vector<int32_t> zeros;   // [groups, N] real zero points (GPTQ v1's +1 already applied)
  std::vector<float> scales;    // [groups, N]
  std::vector<int32_t> g_idx;   // [K], always filled
  std::vector<float> bias;      // [N] or empty
};

// GPTQ v1 reads a stored field f as zero f+1, exactly as v1 kernels do, so v1 zeros lie in
// [1, 2^b] (v2/AWQ: [0, 2^b-1]). Throws Error if w fails validate(), if a sym scheme's qzeros hold
// anything but 2^(b-1), or if a non-act-order scheme has a g_idx other than k / group_len.
UnpackedLinear unpack(const QuantizedLinear& w);
// Packs into scheme.format. Throws Error if a code or zero does not fit the format (e.g. GPTQ v1
// cannot store zero 0 since it stores zero-1; a sym scheme needs every zero = 2^(bits-1)).
QuantizedLinear pack(const UnpackedLinear& u, const QuantScheme& scheme);

// Dequantized weights, [K, N] row-major, in double (exact: products of f16 scales and small ints).
std::vector<double> dequantize(const UnpackedLinear& u);
std::vector<double> dequantize(const QuantizedLinear& w);

// Round-to-nearest quantizer. w is [K, N] row-major float. Per group and column: min/max over the
// group's channels, widened to include 0 (as GPTQ does); sym: zero 2^(b-1), scale = 2*max|w|/(2^b-1);
// asym: scale = (max-min)/(2^b-1), zero = round(-min/scale) in [0, 2^b-1] (GPTQ v1, which cannot
// store zero 0, uses zero 1 and scale = max/(2^b-2) for such groups). Scales are f16 values rounded
// up, never down, and > 0 (an all-zero group gets scale 1), so every |w - deq| <= scale/2. Codes
// round half to even. Throws Error for non-finite weights or a scale beyond f16's 65504.
// With scheme.act_order, channels are assigned to groups through a random-looking but seeded
// permutation (g_idx non-monotonic, as GPTQ's desc_act produces), unless perm is given: perm[i] is
// the i-th channel in quantization order, and g_idx[perm[i]] = i / group_len (a perm with a
// non-act-order scheme is an Error).
QuantizedLinear quantize(const std::vector<float>& w, int64_t K, int64_t N, const QuantScheme& scheme,
                         uint64_t seed = 0, const std::vector<int32_t>* perm = nullptr);

// A permutation of [0, K) drawn from seed, the same on every standard library: the channel order
// quantize gives an act-order scheme when no perm is passed.
std::vector<int32_t> seeded_perm(int64_t K, uint64_t seed);

}  // namespace wna16
