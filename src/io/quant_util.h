// Checks shared by the quantization config parsers (GPTQ/AWQ and compressed-tensors).
#pragma once
#include <cctype>
#include <cstdint>
#include <string>
#include <vector>

#include "io/config_util.h"
#include "wna16/checkpoint.h"
#include "wna16/error.h"

namespace wna16::io {

inline std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Bits the kernels run; formats.md lists 2 and 3 as valid GPTQ, which we refuse by name.
inline void check_bits(int64_t bits, QuantMethod m, const std::string& where) {
  if (m == QuantMethod::Awq && bits != 4)
    throw Error(where + " = " + std::to_string(bits) + ": AWQ (gemm) checkpoints are 4-bit only");
  if (bits == 2 || bits == 3)
    throw Error(where + " = " + std::to_string(bits) + " is a valid GPTQ width, but wna16's kernels support 4 and 8 bits only");
  if (bits != 4 && bits != 8) throw Error(where + " = " + std::to_string(bits) + " is not a supported width (4 or 8)");
}

inline void check_group(int64_t g, const std::string& where) {
  if (g == 0 || g < -1) throw Error(where + " = " + std::to_string(g) + " is not a valid group size (> 0, or -1 for one group)");
}

// a [rows, cols] row-major -> [cols, rows]: compressed-tensors stores [out, ...] what GPTQ stores [..., out].
template <class T>
std::vector<T> transpose(const std::vector<T>& a, int64_t rows, int64_t cols) {
  std::vector<T> t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = a[size_t(r * cols + c)];
  return t;
}

// compressed-tensors `quantization_config` (quant_method "compressed-tensors"): fills q's
// ct_groups and ct_ignore. `o` is the quantization config object, read from `origin` at key `path`.
void parse_compressed_tensors(const Obj& o, const std::string& origin, const std::string& path, QuantConfig& q);
std::string describe_compressed_tensors(const QuantConfig& q);

}  // namespace wna16::io
