// Helpers shared by the formats tests: random canonical layers and small comparisons.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "test_util.h"
#include "wna16/half.h"
#include "wna16/quant.h"

namespace wna16::test {

// A random UnpackedLinear that `s` can store: codes anywhere in [0, 2^b), zeros in the format's
// range (v1: [1, 2^b], v2/AWQ: [0, 2^b-1]; sym: 2^(b-1)), f16 scales, act-order g_idx when asked
// (every group gets exactly group_len channels, in shuffled order).
inline UnpackedLinear random_unpacked(const QuantScheme& s, int64_t K, int64_t N, uint64_t seed, bool bias = false) {
  std::mt19937_64 rng(seed);
  const int levels = 1 << s.bits;
  UnpackedLinear u;
  u.bits = s.bits;
  u.K = K;
  u.N = N;
  u.groups = s.num_groups(K);
  const int64_t len = s.group_len(K);
  u.q.resize(static_cast<size_t>(K * N));
  for (auto& q : u.q) q = uint8_t(rng() % levels);
  u.zeros.resize(static_cast<size_t>(u.groups * N));
  for (auto& z : u.zeros) {
    if (s.sym) z = levels / 2;
    else if (s.format == Format::GptqV1) z = int32_t(1 + rng() % levels);
    else z = int32_t(rng() % levels);
  }
  u.scales.resize(static_cast<size_t>(u.groups * N));
  for (auto& sc : u.scales) sc = f16_to_float(float_to_f16(0.001f + float(rng() % 10000) * 1e-5f));
  std::vector<int32_t> order(static_cast<size_t>(K));
  for (int64_t k = 0; k < K; ++k) order[k] = int32_t(k);
  if (s.act_order)
    for (int64_t i = K - 1; i > 0; --i) std::swap(order[i], order[rng() % uint64_t(i + 1)]);
  u.g_idx.resize(static_cast<size_t>(K));
  for (int64_t i = 0; i < K; ++i) u.g_idx[order[i]] = int32_t(i / len);
  if (bias) {
    u.bias.resize(static_cast<size_t>(N));
    for (auto& b : u.bias) b = float(int(rng() % 200) - 100) / 64.0f;
  }
  return u;
}

inline std::vector<float> random_weights(int64_t K, int64_t N, uint64_t seed, float stddev = 0.02f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> w(static_cast<size_t>(K * N));
  for (auto& x : w) x = d(rng);
  return w;
}

inline void expect_same(const UnpackedLinear& a, const UnpackedLinear& b) {
  EXPECT_EQ(a.bits, b.bits);
  EXPECT_EQ(a.K, b.K);
  EXPECT_EQ(a.N, b.N);
  EXPECT_EQ(a.groups, b.groups);
  EXPECT_EQ(a.q, b.q);
  EXPECT_EQ(a.zeros, b.zeros);
  EXPECT_EQ(a.scales, b.scales);
  EXPECT_EQ(a.g_idx, b.g_idx);
  EXPECT_EQ(a.bias, b.bias);
}


}  // namespace wna16::test
