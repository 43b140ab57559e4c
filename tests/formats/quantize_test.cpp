// Round-to-nearest quantizer: half-a-step error bound on fresh random data for every scheme,
// f16 scales, zero ranges per format, act-order g_idx, determinism and the quantizer's errors.
#include <cmath>
#include <limits>
#include <set>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "formats/formats_test_util.h"
#include "wna16/error.h"
#include "wna16/half.h"
#include "wna16/quant.h"

namespace wna16 {
namespace {

using test::random_weights;
using test::scheme;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// Checks |w - deq| <= scale/2 (+ a relative hair for the double division) on every element and
// returns the largest error in units of its own scale.
double check_half_step(const std::vector<float>& w, const QuantizedLinear& ql) {
  const UnpackedLinear u = unpack(ql);
  const std::vector<double> d = dequantize(u);
  double worst = 0;
  for (int64_t k = 0; k < u.K; ++k)
    for (int64_t n = 0; n < u.N; ++n) {
      const double s = u.scales[u.g_idx[k] * u.N + n];
      const double err = std::abs(double(w[k * u.N + n]) - d[k * u.N + n]);
      EXPECT_LE(err, s / 2 * (1 + 1e-9)) << "k=" << k << " n=" << n << " w=" << w[k * u.N + n] << " s=" << s;
      if (err > s / 2 * (1 + 1e-9)) return err / s;  // one report is enough
      worst = std::max(worst, err / s);
    }
  return worst;
}

bool is_f16(float x) { return f16_to_float(float_to_f16(x)) == x; }

TEST(Quantize, HalfStepBoundForEveryScheme) {
  uint64_t seed = 1;
  for (Format f : {Format::GptqV1, Format::GptqV2, Format::Awq})
    for (int bits : {2, 3, 4, 8})
      for (int g : {-1, 32, 128})
        for (bool sym : {true, false})
          for (bool act : {false, true}) {
            if (f == Format::Awq && (bits != 4 || act)) continue;
            const QuantScheme s = scheme(f, bits, g, sym, act);
            SCOPED_TRACE(s.describe());
            const std::vector<float> w = random_weights(256, 64, ++seed);
            const QuantizedLinear q = quantize(w, 256, 64, s, seed);
            EXPECT_NO_THROW(q.validate());
            const double worst = check_half_step(w, q);
            EXPECT_GT(worst, 0.3);  // the grid is actually coarse: errors approach half a step
          }
}

TEST(Quantize, ScalesArePositiveF16Values) {
  const std::vector<float> w = random_weights(128, 32, 3, 1.5f);
  for (const QuantScheme& s : {scheme(Format::GptqV1, 4, 32, true), scheme(Format::Awq, 4, 32, false),
                               scheme(Format::GptqV2, 8, -1, false)}) {
    const QuantizedLinear q = quantize(w, 128, 32, s);
    for (float x : q.scales) {
      EXPECT_GT(x, 0.0f);
      EXPECT_TRUE(std::isfinite(x));
      EXPECT_TRUE(is_f16(x)) << x;
    }
  }
}

TEST(Quantize, SymUsesTheMidZeroAndGptqScale) {
  // Column 0 spans [-1, 0.5]: GPTQ sym scale = 2*max|w| / (2^b - 1) = 2/15, rounded up to f16.
  std::vector<float> w(8 * 8, 0.0f);
  for (int k = 0; k < 8; ++k) w[k * 8] = -1.0f + float(k) * 0.2f;  // -1 .. 0.4
  const QuantizedLinear q = quantize(w, 8, 8, scheme(Format::GptqV1, 4, -1, true));
  EXPECT_EQ(uint32_t(q.qzeros[0]), 0x77777777u);
  const UnpackedLinear u = unpack(q);
  const float want = f16_to_float(float_to_f16(2.0f / 15.0f));
  EXPECT_GE(double(u.scales[0]), 2.0 / 15.0);
  EXPECT_LE(double(u.scales[0]) - 2.0 / 15.0, std::abs(double(want) - 2.0 / 15.0) + 1e-4);
  // -1 / (2/15) would be -7.5, but the scale was rounded up so -1/s = -7.49..: -7, code 1.
  EXPECT_GT(double(u.scales[0]), 2.0 / 15.0);
  EXPECT_EQ(u.q[0], 1);
  check_half_step(w, q);
}

TEST(Quantize, AsymZeroIsRoundedMinOverScale) {
  // Column 0: values in [-0.3, 1.2]; scale = 1.5/15 = 0.1 (f16 rounded up), zero = round(0.3/s) = 3.
  std::vector<float> w(8 * 8, 0.0f);
  const float col[8] = {-0.3f, 1.2f, 0.0f, 0.5f, -0.1f, 0.7f, 1.0f, 0.2f};
  for (int k = 0; k < 8; ++k) w[k * 8] = col[k];
  const UnpackedLinear u = unpack(quantize(w, 8, 8, scheme(Format::GptqV2, 4, -1, false)));
  EXPECT_GE(double(u.scales[0]), 0.1);
  EXPECT_LT(double(u.scales[0]), 0.1001);
  EXPECT_EQ(u.zeros[0], 3);
  EXPECT_EQ(u.q[0], 0);        // -0.3 -> lowest code
  EXPECT_EQ(u.q[1 * 8], 15);   // 1.2 -> highest code
  EXPECT_EQ(u.q[2 * 8], 3);    // 0 -> the zero exactly
  EXPECT_EQ(u.zeros[1], 8);    // an all-zero column: degenerate group
  EXPECT_EQ(u.scales[1], 1.0f);
}

TEST(Quantize, AllPositiveGroupGetsZeroZeroExceptInV1) {
  std::vector<float> w(32 * 32);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.5f + float(i % 7) * 0.01f;
  const UnpackedLinear v2 = unpack(quantize(w, 32, 32, scheme(Format::GptqV2, 4, -1, false)));
  const UnpackedLinear v1q = unpack(quantize(w, 32, 32, scheme(Format::GptqV1, 4, -1, false)));
  for (int n = 0; n < 32; ++n) {
    EXPECT_EQ(v2.zeros[n], 0) << n;
    EXPECT_EQ(v1q.zeros[n], 1) << n;  // v1 cannot store 0: shifted grid, see quantize.cpp
  }
  check_half_step(w, quantize(w, 32, 32, scheme(Format::GptqV1, 4, -1, false)));
  check_half_step(w, quantize(w, 32, 32, scheme(Format::GptqV1, 2, -1, false)));
  check_half_step(w, quantize(w, 32, 32, scheme(Format::Awq, 4, -1, false)));
}

TEST(Quantize, AllEqualAndAllZeroGroups) {
  for (float c : {0.0f, 0.25f, -3.0f}) {
    const std::vector<float> w(64 * 16, c);
    for (const QuantScheme& s : {scheme(Format::GptqV1, 4, 32, true), scheme(Format::GptqV1, 4, 32, false),
                                 scheme(Format::Awq, 4, 32, false), scheme(Format::GptqV2, 8, 32, false)}) {
      SCOPED_TRACE(s.describe() + " c=" + std::to_string(c));
      const QuantizedLinear q = quantize(w, 64, 16, s);
      for (float x : q.scales) EXPECT_GT(x, 0.0f);
      check_half_step(w, q);
      if (c == 0.0f) {
        for (double d : dequantize(q)) EXPECT_EQ(d, 0.0);
      }
    }
  }
}

TEST(Quantize, TinyWeightsGetSubnormalButPositiveScales) {
  std::vector<float> w = random_weights(64, 16, 8, 1e-7f);
  w[0] = 0.0f;
  for (const QuantScheme& s : {scheme(Format::GptqV1, 4, 32, false), scheme(Format::GptqV2, 4, 32, true)}) {
    const QuantizedLinear q = quantize(w, 64, 16, s);
    for (float x : q.scales) EXPECT_GT(x, 0.0f);
    check_half_step(w, q);
  }
  // A group of one tiny negative value and zeros: its ideal scale underflows f16 entirely.
  std::vector<float> t(64 * 16, 0.0f);
  t[0] = -1e-9f;
  const QuantizedLinear q = quantize(t, 64, 16, scheme(Format::GptqV1, 4, 32, false));
  for (float x : q.scales) EXPECT_GT(x, 0.0f);
  check_half_step(t, q);
}

TEST(Quantize, LargeWeightsOverflowF16ScaleIsAnError) {
  std::vector<float> w(64 * 16, 0.0f);
  w[5] = 1e7f;
  EXPECT_THAT([&] { quantize(w, 64, 16, scheme(Format::GptqV2, 4, 32, false)); },
              ThrowsMessage<Error>(AllOf(HasSubstr("group 0 of column 5"), HasSubstr("65504"))));
  w[5] = 60000.0f;  // fits at 8 bits: 60000/255 is a fine f16
  EXPECT_NO_THROW(quantize(w, 64, 16, scheme(Format::GptqV2, 8, 32, false)));
}

TEST(Quantize, ActOrderGIdxIsNonMonotonicAndBalanced) {
  const QuantScheme s = scheme(Format::GptqV1, 4, 32, true, true);
  const QuantizedLinear q = quantize(random_weights(256, 32, 4), 256, 32, s, 1234);
  ASSERT_EQ(q.g_idx.size(), 256u);
  bool monotonic = true;
  std::vector<int> count(8, 0);
  for (int k = 0; k < 256; ++k) {
    if (k > 0 && q.g_idx[k] < q.g_idx[k - 1]) monotonic = false;
    ASSERT_GE(q.g_idx[k], 0);
    ASSERT_LT(q.g_idx[k], 8);
    ++count[q.g_idx[k]];
  }
  EXPECT_FALSE(monotonic);
  for (int c : count) EXPECT_EQ(c, 32);  // desc_act groups are still group_size channels each
}

TEST(Quantize, ActOrderIsNonMonotonicEvenForTinyK) {
  // With two groups of 2 channels, 1 permutation in 6 would give a monotonic g_idx; none may.
  for (uint64_t seed = 0; seed < 200; ++seed) {
    const QuantizedLinear q = quantize(random_weights(4, 4, seed), 4, 4, scheme(Format::GptqV2, 8, 2, true, true), seed);
    EXPECT_FALSE(std::is_sorted(q.g_idx.begin(), q.g_idx.end())) << seed;
  }
}

TEST(Quantize, GivenPermDefinesGIdx) {
  const int64_t K = 64, len = 16;
  std::vector<int32_t> perm(K);
  for (int64_t i = 0; i < K; ++i) perm[i] = int32_t((i * 37 + 5) % K);  // 37 is coprime to 64
  const std::vector<float> w = random_weights(K, 16, 6);
  const QuantizedLinear q = quantize(w, K, 16, scheme(Format::GptqV2, 4, len, false, true), 0, &perm);
  for (int64_t i = 0; i < K; ++i) EXPECT_EQ(q.g_idx[perm[i]], i / len) << i;
  EXPECT_FALSE(std::is_sorted(q.g_idx.begin(), q.g_idx.end()));
  check_half_step(w, q);
}

TEST(Quantize, ActOrderGroupsUseTheirOwnChannelsRange) {
  // One huge channel placed by perm into group 1: only group 1's scales grow.
  const int64_t K = 32, N = 8;
  std::vector<float> w = random_weights(K, N, 2, 0.01f);
  for (int n = 0; n < N; ++n) w[0 * N + n] = 10.0f;
  std::vector<int32_t> perm(K);
  for (int64_t i = 0; i < K; ++i) perm[i] = int32_t(K - 1 - i);  // channel 0 is last: group 1
  const UnpackedLinear u =
      unpack(quantize(w, K, N, scheme(Format::GptqV1, 4, 16, true, true), 0, &perm));
  EXPECT_EQ(u.g_idx[0], 1);
  for (int n = 0; n < N; ++n) {
    EXPECT_GT(u.scales[1 * N + n], 1.0f);
    EXPECT_LT(u.scales[0 * N + n], 0.01f);
  }
}

TEST(Quantize, ActOrderWithWholeKGroupIsPlain) {
  const QuantizedLinear q = quantize(random_weights(64, 16, 3), 64, 16, scheme(Format::GptqV1, 4, -1, true, true), 7);
  for (int32_t g : q.g_idx) EXPECT_EQ(g, 0);
}

TEST(Quantize, SeedDeterminesThePermutation) {
  const std::vector<float> w = random_weights(128, 16, 1);
  const QuantScheme s = scheme(Format::GptqV2, 4, 32, false, true);
  const QuantizedLinear a = quantize(w, 128, 16, s, 11), b = quantize(w, 128, 16, s, 11), c = quantize(w, 128, 16, s, 12);
  EXPECT_EQ(a.g_idx, b.g_idx);
  EXPECT_EQ(a.qweight, b.qweight);
  EXPECT_EQ(a.scales, b.scales);
  EXPECT_NE(a.g_idx, c.g_idx);
}

TEST(Quantize, PlainSchemeHasPositionalGIdx) {
  const QuantizedLinear g = quantize(random_weights(128, 16, 1), 128, 16, scheme(Format::GptqV1, 4, 32, true));
  for (int k = 0; k < 128; ++k) EXPECT_EQ(g.g_idx[k], k / 32);
  const QuantizedLinear a = quantize(random_weights(128, 16, 1), 128, 16, scheme(Format::Awq, 4, 32, false));
  EXPECT_TRUE(a.g_idx.empty());
}

TEST(Quantize, FinerGroupsAndMoreBitsShrinkTheError) {
  const std::vector<float> w = random_weights(512, 64, 21);
  auto rel = [&](const QuantScheme& s) {
    const std::vector<double> d = dequantize(quantize(w, 512, 64, s));
    double num = 0, den = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      num += (d[i] - w[i]) * (d[i] - w[i]);
      den += double(w[i]) * w[i];
    }
    return std::sqrt(num / den);
  };
  const double g_all = rel(scheme(Format::GptqV2, 4, -1, false)), g32 = rel(scheme(Format::GptqV2, 4, 32, false));
  const double b8 = rel(scheme(Format::GptqV2, 8, 32, false)), b2 = rel(scheme(Format::GptqV2, 2, 32, false));
  EXPECT_LT(g32, g_all);
  EXPECT_LT(b8, g32 / 8);
  EXPECT_GT(b2, g32);
  EXPECT_LT(g32, 0.15);  // 4-bit g32 RTN on Gaussian weights: roughly 0.1
}

TEST(Quantize, RealModelShapeDeepSeekV2LiteExpert) {
  // gate/up: K=H=2048, N=I=1408; down: K=1408, N=2048. GPTQ g128 act-order and AWQ g64.
  const std::vector<float> up = random_weights(2048, 1408, 31);
  check_half_step(up, quantize(up, 2048, 1408, scheme(Format::GptqV1, 4, 128, true, true), 1));
  const std::vector<float> down = random_weights(1408, 2048, 32);
  check_half_step(down, quantize(down, 1408, 2048, scheme(Format::Awq, 4, 64, false)));
}

TEST(QuantizeErrors, BadInputsNameTheValue) {
  const std::vector<float> w = random_weights(64, 16, 1);
  EXPECT_THAT([&] { quantize(w, 64, 8, scheme(Format::GptqV1, 4, 32, true)); },
              ThrowsMessage<Error>(HasSubstr("w has 1024 elements, expected K*N = 64*8 = 512")));
  EXPECT_THAT([&] { quantize(w, 64, 16, scheme(Format::GptqV1, 5, 32, true)); },
              ThrowsMessage<Error>(HasSubstr("bits=5")));
  EXPECT_THAT([&] { quantize(w, 64, 16, scheme(Format::GptqV1, 4, 48, true)); },
              ThrowsMessage<Error>(HasSubstr("K=64 is not a multiple of group_size=48")));
  std::vector<float> bad = w;
  bad[2 * 16 + 3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT([&] { quantize(bad, 64, 16, scheme(Format::GptqV1, 4, 32, true)); },
              ThrowsMessage<Error>(HasSubstr("w[2, 3]=nan is not finite")));
}

TEST(QuantizeErrors, BadPerm) {
  const std::vector<float> w = random_weights(64, 16, 1);
  std::vector<int32_t> perm(64);
  for (int i = 0; i < 64; ++i) perm[i] = i;
  EXPECT_THAT([&] { quantize(w, 64, 16, scheme(Format::GptqV1, 4, 32, true), 0, &perm); },
              ThrowsMessage<Error>(HasSubstr("not act-order")));
  const QuantScheme act = scheme(Format::GptqV1, 4, 32, true, true);
  perm[10] = 3;
  EXPECT_THAT([&] { quantize(w, 64, 16, act, 0, &perm); }, ThrowsMessage<Error>(HasSubstr("perm[10]=3")));
  perm[10] = 64;
  EXPECT_THAT([&] { quantize(w, 64, 16, act, 0, &perm); }, ThrowsMessage<Error>(HasSubstr("perm[10]=64")));
  perm.resize(63);
  EXPECT_THAT([&] { quantize(w, 64, 16, act, 0, &perm); },
              ThrowsMessage<Error>(HasSubstr("perm has 63 elements, expected K=64")));
}

}  // namespace
}  // namespace wna16
