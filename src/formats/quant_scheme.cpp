// QuantScheme and QuantizedLinear: names, shape rules and validation. Every check names the value
// that broke it, so a bad checkpoint or a bad CLI flag reads as one line.
#include <cctype>
#include <cmath>
#include <string>

#include <fmt/format.h>

#include "formats/packing.h"
#include "wna16/error.h"
#include "wna16/quant.h"

namespace wna16 {

const char* format_name(Format f) {
  switch (f) {
    case Format::GptqV1: return "gptq";
    case Format::GptqV2: return "gptq_v2";
    case Format::Awq: return "awq";
  }
  return "?";
}

Format parse_format(const std::string& s) {
  std::string l;
  for (char c : s) l += char(std::tolower(static_cast<unsigned char>(c)));
  if (l == "gptq" || l == "gptq_v1") return Format::GptqV1;
  if (l == "gptq_v2") return Format::GptqV2;
  if (l == "awq") return Format::Awq;
  throw Error(fmt::format("unknown quantization format '{}' (expected gptq, gptq_v2 or awq)", s));
}

int64_t QuantScheme::num_groups(int64_t K) const {
  if (group_size == -1) return 1;
  if (group_size <= 0) throw Error(fmt::format("group_size={} is invalid (must be > 0 or -1)", group_size));
  return (K + group_size - 1) / group_size;
}

int64_t QuantScheme::group_len(int64_t K) const {
  if (group_size == -1) return K;
  if (group_size <= 0) throw Error(fmt::format("group_size={} is invalid (must be > 0 or -1)", group_size));
  return group_size;
}

void QuantScheme::validate(int64_t K, int64_t N) const {
  const std::string what = fmt::format("{} scheme", format_name(format));
  if (bits != 2 && bits != 3 && bits != 4 && bits != 8)
    throw Error(fmt::format("{}: bits={} is not supported (expected 2, 3, 4 or 8)", what, bits));
  if (format == Format::Awq && bits != 4)
    throw Error(fmt::format("awq scheme: bits={} is not supported (AWQ gemm is 4-bit only)", bits));
  if (format == Format::Awq && act_order)
    throw Error("awq scheme: act-order (desc_act) is a GPTQ option; AWQ has no g_idx");
  if (group_size == 0 || group_size < -1)
    throw Error(fmt::format("{}: group_size={} is invalid (must be > 0 or -1)", what, group_size));
  if (K <= 0 || N <= 0) throw Error(fmt::format("{}: K={} and N={} must both be positive", what, K, N));
  if (group_size > 0 && K % group_size != 0)
    throw Error(fmt::format("K={} is not a multiple of group_size={}", K, group_size));
  const int64_t run = detail::pack_run(bits);  // values per whole run of words
  if (format == Format::Awq) {
    if (N % 8 != 0) throw Error(fmt::format("awq 4-bit: N={} is not a multiple of 8 (packing along N)", N));
  } else {
    if (K % run != 0)
      throw Error(fmt::format("gptq {}-bit: K={} is not a multiple of {} (qweight packs along K)", bits, K, run));
    if (N % run != 0)
      throw Error(fmt::format("gptq {}-bit: N={} is not a multiple of {} (qzeros pack along N)", bits, N, run));
  }
}

std::string QuantScheme::describe() const {
  std::string s = fmt::format("{} {}-bit g{} {}", format_name(format), bits, group_size, sym ? "sym" : "asym");
  if (act_order) s += " act-order";
  return s;
}

namespace {

void check_size(const char* name, size_t got, int64_t rows, int64_t cols) {
  const int64_t want = rows * cols;
  if (int64_t(got) != want)
    throw Error(fmt::format("{} has {} elements, expected {} ([{}, {}])", name, got, want, rows, cols));
}

}  // namespace

void QuantizedLinear::validate() const {
  scheme.validate(K, N);
  const int64_t G = scheme.num_groups(K);
  const int b = scheme.bits;
  if (scheme.format == Format::Awq) {
    check_size("qweight", qweight.size(), K, N / 8);
    check_size("qzeros", qzeros.size(), G, N / 8);
  } else {
    check_size("qweight", qweight.size(), K * b / 32, N);
    check_size("qzeros", qzeros.size(), G, N * b / 32);
  }
  check_size("scales", scales.size(), G, N);
  for (size_t i = 0; i < scales.size(); ++i)
    if (!std::isfinite(scales[i]))
      throw Error(fmt::format("scales[{}, {}]={} is not finite", int64_t(i) / N, int64_t(i) % N, scales[i]));
  if (!g_idx.empty()) {
    if (scheme.format == Format::Awq)
      throw Error(fmt::format("g_idx has {} elements but AWQ has no g_idx", g_idx.size()));
    if (int64_t(g_idx.size()) != K)
      throw Error(fmt::format("g_idx has {} elements, expected K={}", g_idx.size(), K));
    for (int64_t k = 0; k < K; ++k)
      if (g_idx[k] < 0 || g_idx[k] >= G)
        throw Error(fmt::format("g_idx[{}]={} is out of range [0, {})", k, g_idx[k], G));
  } else if (scheme.act_order && scheme.group_size != -1) {
    throw Error(fmt::format("g_idx is empty but the scheme is act-order ({})", scheme.describe()));
  }
  if (!bias.empty() && int64_t(bias.size()) != N)
    throw Error(fmt::format("bias has {} elements, expected N={}", bias.size(), N));
}

}  // namespace wna16
