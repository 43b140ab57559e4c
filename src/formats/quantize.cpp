// Round-to-nearest quantizer for tests and synthetic checkpoints: turns float weights into any
// scheme through the canonical UnpackedLinear and pack().
//
// Choices, each made so that every element lands within half a step: |w - deq| <= scale/2.
// - Like GPTQ, each group's range is widened to include 0 (lo = min(min, 0), hi = max(max, 0)), so
//   the zero point round(-lo/scale) always lies on the grid [0, 2^b-1] and nothing is clamped away.
//   (AWQ's own quantizer does not widen and can clamp all-positive groups; we do not copy that.)
// - Scales are f16 values rounded *up* from the ideal (hi-lo)/(2^b-1), never down, so the group's
//   range still fits in 2^b-1 steps after rounding.
// - sym follows GPTQ: zero 2^(b-1), scale = 2*max|w| / (2^b-1); codes -2^(b-1) .. 2^(b-1)-1 around
//   the zero, so +max|w| sits half a step past the top code and is clamped by exactly scale/2.
// - GPTQ v1 cannot store zero 0 (it stores zero-1; see pack.cpp). When an asym group would get
//   zero 0 (its minimum is within half a step of 0), v1 instead uses zero 1 with
//   scale = hi / (2^b-2), rounded up: the group then spans codes 1..2^b-1 and keeps the bound.
// - A group that is all zeros gets scale 1 and zero 2^(b-1): every code is the zero, deq is 0.
// - Codes are round-half-to-even (torch.round's rule), computed in double.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include <fmt/format.h>

#include "wna16/error.h"
#include "wna16/half.h"
#include "wna16/quant.h"

namespace wna16 {
namespace {

constexpr double kF16Max = 65504.0;

// Smallest positive f16 value >= x (x >= 0). Throws when that exceeds f16's range.
float f16_round_up(double x, int64_t g, int64_t n) {
  if (!(x <= kF16Max))
    throw Error(fmt::format("group {} of column {} needs scale {} beyond f16's maximum 65504", g, n, x));
  uint16_t h = float_to_f16(float(x));
  // Positive f16 bit patterns are ordered like their values; h == 0 (x tiny or 0) becomes the
  // smallest subnormal so that every scale stays > 0.
  if (double(f16_to_float(h)) < x || h == 0) ++h;
  return f16_to_float(h);
}

}  // namespace

// Fisher-Yates on a 64-bit Mersenne Twister: reproducible across standard libraries, unlike
// std::shuffle / std::uniform_int_distribution.
std::vector<int32_t> seeded_perm(int64_t K, uint64_t seed) {
  std::vector<int32_t> p(static_cast<size_t>(K));
  for (int64_t i = 0; i < K; ++i) p[i] = int32_t(i);
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  for (int64_t i = K - 1; i > 0; --i) {
    const int64_t j = int64_t(rng() % uint64_t(i + 1));
    std::swap(p[i], p[j]);
  }
  return p;
}

QuantizedLinear quantize(const std::vector<float>& w, int64_t K, int64_t N, const QuantScheme& scheme, uint64_t seed,
                         const std::vector<int32_t>* perm) {
  scheme.validate(K, N);
  if (int64_t(w.size()) != K * N)
    throw Error(fmt::format("quantize: w has {} elements, expected K*N = {}*{} = {}", w.size(), K, N, K * N));
  for (int64_t i = 0; i < K * N; ++i)
    if (!std::isfinite(w[i])) throw Error(fmt::format("quantize: w[{}, {}]={} is not finite", i / N, i % N, w[i]));
  if (perm && !scheme.act_order)
    throw Error(fmt::format("quantize: a perm was given but scheme {} is not act-order", scheme.describe()));

  const int b = scheme.bits;
  const int64_t G = scheme.num_groups(K), len = scheme.group_len(K);
  const int32_t maxq = (int32_t(1) << b) - 1;
  const int32_t mid = int32_t(1) << (b - 1);

  UnpackedLinear u;
  u.bits = b;
  u.K = K;
  u.N = N;
  u.groups = G;
  u.g_idx.resize(static_cast<size_t>(K));
  if (scheme.act_order) {
    std::vector<int32_t> p;
    if (perm) {
      if (int64_t(perm->size()) != K)
        throw Error(fmt::format("quantize: perm has {} elements, expected K={}", perm->size(), K));
      std::vector<char> seen(size_t(K), 0);
      for (int64_t i = 0; i < K; ++i) {
        const int32_t c = (*perm)[i];
        if (c < 0 || c >= K || seen[c])
          throw Error(fmt::format("quantize: perm[{}]={} is out of range [0, {}) or repeated", i, c, K));
        seen[c] = 1;
      }
      p = *perm;
    } else {
      p = seeded_perm(K, seed);
      // A random permutation is non-monotonic almost surely; make it certain (G >= 2): swapping the
      // first and last entries puts channel p[K-1] in group 0 and p[0] in group G-1.
      bool monotonic = true;
      std::vector<int32_t> gi(static_cast<size_t>(K));
      for (int64_t i = 0; i < K; ++i) gi[p[i]] = int32_t(i / len);
      for (int64_t k = 1; k < K; ++k) monotonic = monotonic && gi[k - 1] <= gi[k];
      if (monotonic && G >= 2) std::swap(p[0], p[K - 1]);
    }
    for (int64_t i = 0; i < K; ++i) u.g_idx[p[i]] = int32_t(i / len);
  } else {
    for (int64_t k = 0; k < K; ++k) u.g_idx[k] = int32_t(k / len);
  }

  // Per group and column: the range, widened to include 0.
  std::vector<double> lo(size_t(G * N), 0.0), hi(size_t(G * N), 0.0);
  for (int64_t k = 0; k < K; ++k) {
    const int64_t g = u.g_idx[k];
    for (int64_t n = 0; n < N; ++n) {
      const double x = w[k * N + n];
      lo[g * N + n] = std::min(lo[g * N + n], x);
      hi[g * N + n] = std::max(hi[g * N + n], x);
    }
  }

  u.scales.resize(static_cast<size_t>(G * N));
  u.zeros.resize(static_cast<size_t>(G * N));
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t n = 0; n < N; ++n) {
      const int64_t i = g * N + n;
      float s;
      int32_t z;
      if (hi[i] == lo[i]) {  // all zeros: any positive scale reproduces them
        s = 1.0f;
        z = mid;
      } else if (scheme.sym) {
        const double amax = std::max(-lo[i], hi[i]);
        s = f16_round_up(2.0 * amax / maxq, g, n);
        z = mid;
      } else {
        s = f16_round_up((hi[i] - lo[i]) / maxq, g, n);
        z = int32_t(std::nearbyint(-lo[i] / double(s)));
        if (z == 0 && scheme.format == Format::GptqV1) {  // see the note at the top
          s = f16_round_up(hi[i] / (maxq - 1), g, n);
          z = 1;
        }
        z = std::clamp(z, int32_t(0), maxq);
      }
      u.scales[i] = s;
      u.zeros[i] = z;
    }
  }

  u.q.resize(static_cast<size_t>(K * N));
  for (int64_t k = 0; k < K; ++k) {
    const int64_t g = u.g_idx[k];
    for (int64_t n = 0; n < N; ++n) {
      const double c = std::nearbyint(double(w[k * N + n]) / double(u.scales[g * N + n])) + u.zeros[g * N + n];
      u.q[k * N + n] = uint8_t(std::clamp(c, 0.0, double(maxq)));
    }
  }
  return pack(u, scheme);
}

}  // namespace wna16
