// Bit-level helpers shared by the formats stage (private: not part of the public API).
#pragma once
#include <cstdint>
#include <vector>

namespace wna16::detail {

// Values in one whole run of 32-bit words: 32/bits, except 3-bit whose values straddle words and
// only realign after 3 words (32 values = 96 bits). K (GPTQ qweight) and N (qzeros) must be
// multiples of it.
inline int64_t pack_run(int bits) { return bits == 3 ? 32 : 32 / bits; }

// GPTQ packing treats a line of words (one qweight column, or one qzeros row) as a single
// LSB-first bit stream: value i occupies stream bits [bits*i, bits*i + bits), and stream bit p is
// bit p%32 of word p/32. For 2/4/8 bits no value crosses a word; for 3 bits this is exactly the
// AutoGPTQ layout where values 10 and 21 of each 3-word run straddle a boundary.
// `stride` is the distance between consecutive words of the line in the int32 array.
inline uint32_t stream_get(const int32_t* words, int64_t stride, int bits, int64_t i) {
  const int64_t p = int64_t(bits) * i;
  const int64_t w = p / 32;
  const int s = int(p % 32);
  uint64_t lo = uint32_t(words[w * stride]);
  if (s + bits > 32) lo |= uint64_t(uint32_t(words[(w + 1) * stride])) << 32;  // straddles
  return uint32_t(lo >> s) & ((1u << bits) - 1u);
}

// Writes value v (already < 2^bits) into a zero-initialised line (ORs bits in).
inline void stream_put(int32_t* words, int64_t stride, int bits, int64_t i, uint32_t v) {
  const int64_t p = int64_t(bits) * i;
  const int64_t w = p / 32;
  const int s = int(p % 32);
  const uint64_t shifted = uint64_t(v) << s;
  words[w * stride] = int32_t(uint32_t(words[w * stride]) | uint32_t(shifted));
  if (s + bits > 32)
    words[(w + 1) * stride] = int32_t(uint32_t(words[(w + 1) * stride]) | uint32_t(shifted >> 32));
}

// AWQ gemm: nibble i of word c holds column 8c + kAwqOrder[i]; column 8c + j is nibble kAwqReverse[j].
inline constexpr int kAwqOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};
inline constexpr int kAwqReverse[8] = {0, 4, 1, 5, 2, 6, 3, 7};

inline uint32_t awq_get(const int32_t* row, int64_t n) {
  return (uint32_t(row[n / 8]) >> (4 * kAwqReverse[n % 8])) & 0xFu;
}
inline void awq_put(int32_t* row, int64_t n, uint32_t v) {
  row[n / 8] = int32_t(uint32_t(row[n / 8]) | (v << (4 * kAwqReverse[n % 8])));
}

}  // namespace wna16::detail
