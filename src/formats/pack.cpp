// Exact pack/unpack between the checkpoint layouts (GPTQ v1/v2, AWQ gemm) and UnpackedLinear,
// plus dequantization. Bit layouts: formats.md and packing.h.
//
// NOTE on GPTQ v1 zeros: v1 stores zero-1 in each b-bit field. Writers (AutoGPTQ's pack) compute
// zeros-1 before packing, so a real zero of 0 underflows to -1, whose all-ones bits are ORed into the
// word and corrupt the neighbouring fields; v1 kernels then read (field & mask) + 1. We read exactly
// as those kernels do, so a v1 zero lies in [1, 2^b] (a field of all ones means zero 2^b, which v2
// and AWQ cannot hold), and pack() refuses zero 0 for v1 instead of writing a field that would
// read back as 2^b. With that, unpack(pack(u)) == u and pack(unpack(w)) == w bit for bit.
#include <fmt/format.h>

#include "formats/packing.h"
#include "wna16/error.h"
#include "wna16/quant.h"

namespace wna16 {
namespace {

using detail::awq_get;
using detail::awq_put;
using detail::stream_get;
using detail::stream_put;

// Range of real zero points a format can store; sym additionally pins the zero to 2^(b-1).
struct ZeroRange {
  int32_t lo, hi;
};
ZeroRange zero_range(Format f, int bits) {
  const int32_t levels = int32_t(1) << bits;
  if (f == Format::GptqV1) return {1, levels};  // stored zero-1 in [0, 2^b-1]
  return {0, levels - 1};
}

void check_size(const char* name, size_t got, int64_t rows, int64_t cols) {
  if (int64_t(got) != rows * cols)
    throw Error(fmt::format("unpacked {} has {} elements, expected {} ([{}, {}])", name, got, rows * cols, rows,
                            cols));
}

// Shape and range checks an UnpackedLinear must pass before anything indexes into it.
void check_unpacked(const UnpackedLinear& u) {
  if (u.bits != 2 && u.bits != 3 && u.bits != 4 && u.bits != 8)
    throw Error(fmt::format("unpacked bits={} is not supported (expected 2, 3, 4 or 8)", u.bits));
  if (u.K <= 0 || u.N <= 0 || u.groups <= 0)
    throw Error(fmt::format("unpacked K={}, N={}, groups={} must all be positive", u.K, u.N, u.groups));
  check_size("q", u.q.size(), u.K, u.N);
  check_size("zeros", u.zeros.size(), u.groups, u.N);
  check_size("scales", u.scales.size(), u.groups, u.N);
  check_size("g_idx", u.g_idx.size(), 1, u.K);
  if (!u.bias.empty() && int64_t(u.bias.size()) != u.N)
    throw Error(fmt::format("unpacked bias has {} elements, expected N={}", u.bias.size(), u.N));
  for (int64_t k = 0; k < u.K; ++k)
    if (u.g_idx[k] < 0 || u.g_idx[k] >= u.groups)
      throw Error(fmt::format("g_idx[{}]={} is out of range [0, {})", k, u.g_idx[k], u.groups));
  const uint32_t levels = 1u << u.bits;
  for (int64_t i = 0; i < u.K * u.N; ++i)
    if (u.q[i] >= levels)
      throw Error(fmt::format("q[{}, {}]={} does not fit {} bits", i / u.N, i % u.N, u.q[i], u.bits));
}

// Without act-order a channel's group is fixed by its position; a g_idx saying otherwise would make
// kernels that trust scheme.act_order compute something else than the reference.
void check_plain_g_idx(const std::vector<int32_t>& g_idx, int64_t len, const QuantScheme& s) {
  for (size_t k = 0; k < g_idx.size(); ++k)
    if (g_idx[k] != int32_t(int64_t(k) / len))
      throw Error(fmt::format("g_idx[{}]={} but scheme {} is not act-order (expected {})", k, g_idx[k],
                              s.describe(), int64_t(k) / len));
}

}  // namespace

UnpackedLinear unpack(const QuantizedLinear& w) {
  w.validate();
  const QuantScheme& s = w.scheme;
  const int b = s.bits;
  const int64_t K = w.K, N = w.N, G = s.num_groups(K), len = s.group_len(K);
  if (!s.act_order) check_plain_g_idx(w.g_idx, len, s);

  UnpackedLinear u;
  u.bits = b;
  u.K = K;
  u.N = N;
  u.groups = G;
  u.q.resize(static_cast<size_t>(K * N));
  u.zeros.resize(static_cast<size_t>(G * N));
  u.scales = w.scales;
  u.bias = w.bias;
  u.g_idx.resize(static_cast<size_t>(K));
  for (int64_t k = 0; k < K; ++k) u.g_idx[k] = w.g_idx.empty() ? int32_t(k / len) : w.g_idx[k];

  if (s.format == Format::Awq) {
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) u.q[k * N + n] = uint8_t(awq_get(w.qweight.data() + k * (N / 8), n));
    for (int64_t g = 0; g < G; ++g)
      for (int64_t n = 0; n < N; ++n) u.zeros[g * N + n] = int32_t(awq_get(w.qzeros.data() + g * (N / 8), n));
  } else {
    // qweight: column n is a bit stream along K with stride N between its words.
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) u.q[k * N + n] = uint8_t(stream_get(w.qweight.data() + n, N, b, k));
    // qzeros: row g is a bit stream along N.
    const int64_t zw = N * b / 32;
    const int32_t add = s.format == Format::GptqV1 ? 1 : 0;  // v1 stores zero-1
    for (int64_t g = 0; g < G; ++g)
      for (int64_t n = 0; n < N; ++n)
        u.zeros[g * N + n] = int32_t(stream_get(w.qzeros.data() + g * zw, 1, b, n)) + add;
  }

  if (s.sym) {
    const int32_t z = int32_t(1) << (b - 1);
    for (int64_t i = 0; i < G * N; ++i)
      if (u.zeros[i] != z)
        throw Error(fmt::format("scheme {} is sym but qzeros[{}, {}] holds zero {} (expected {})", s.describe(),
                                i / N, i % N, u.zeros[i], z));
  }
  return u;
}

QuantizedLinear pack(const UnpackedLinear& u, const QuantScheme& s) {
  s.validate(u.K, u.N);
  if (u.bits != s.bits)
    throw Error(fmt::format("unpacked weights have bits={} but the scheme {} has bits={}", u.bits, s.describe(),
                            s.bits));
  const int b = s.bits;
  const int64_t K = u.K, N = u.N, G = s.num_groups(K), len = s.group_len(K);
  if (u.groups != G)
    throw Error(fmt::format("unpacked groups={} but scheme {} with K={} has {} groups", u.groups, s.describe(), K, G));
  check_unpacked(u);
  if (!s.act_order) check_plain_g_idx(u.g_idx, len, s);

  const ZeroRange zr = zero_range(s.format, b);
  const int32_t sym_zero = int32_t(1) << (b - 1);
  for (int64_t i = 0; i < G * N; ++i) {
    const int32_t z = u.zeros[i];
    if (s.sym && z != sym_zero)
      throw Error(fmt::format("scheme {} is sym but zeros[{}, {}]={} (expected {})", s.describe(), i / N, i % N, z,
                              sym_zero));
    if (z < zr.lo || z > zr.hi)
      throw Error(fmt::format("zeros[{}, {}]={} cannot be stored by {} {}-bit (range [{}, {}]{})", i / N, i % N, z,
                              format_name(s.format), b, zr.lo, zr.hi,
                              s.format == Format::GptqV1 ? ", v1 stores zero-1" : ""));
  }

  QuantizedLinear w;
  w.scheme = s;
  w.K = K;
  w.N = N;
  w.scales = u.scales;
  w.bias = u.bias;
  if (s.format == Format::Awq) {
    w.qweight.assign(size_t(K * (N / 8)), 0);
    w.qzeros.assign(size_t(G * (N / 8)), 0);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) awq_put(w.qweight.data() + k * (N / 8), n, u.q[k * N + n]);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t n = 0; n < N; ++n) awq_put(w.qzeros.data() + g * (N / 8), n, uint32_t(u.zeros[g * N + n]));
  } else {
    const int64_t zw = N * b / 32;
    w.qweight.assign(size_t(K * b / 32 * N), 0);
    w.qzeros.assign(size_t(G * zw), 0);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) stream_put(w.qweight.data() + n, N, b, k, u.q[k * N + n]);
    const int32_t sub = s.format == Format::GptqV1 ? 1 : 0;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t n = 0; n < N; ++n) stream_put(w.qzeros.data() + g * zw, 1, b, n, uint32_t(u.zeros[g * N + n] - sub));
    w.g_idx = u.g_idx;  // GPTQ checkpoints always carry g_idx, act-order or not
  }
  w.validate();
  return w;
}

std::vector<double> dequantize(const UnpackedLinear& u) {
  check_unpacked(u);
  std::vector<double> out(static_cast<size_t>(u.K * u.N));
  for (int64_t k = 0; k < u.K; ++k) {
    const int64_t g = u.g_idx[k];
    for (int64_t n = 0; n < u.N; ++n)
      out[k * u.N + n] = double(u.scales[g * u.N + n]) * double(int32_t(u.q[k * u.N + n]) - u.zeros[g * u.N + n]);
  }
  return out;
}

std::vector<double> dequantize(const QuantizedLinear& w) { return dequantize(unpack(w)); }

}  // namespace wna16
