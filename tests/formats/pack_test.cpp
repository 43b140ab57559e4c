// Pack/unpack: hand-computed golden words for every layout, exact round trips for every
// format x bits x sym x group size x act-order, and the QuantizedLinear / pack errors.
#include <cstdint>
#include <random>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "formats/formats_test_util.h"
#include "wna16/error.h"
#include "wna16/quant.h"

namespace wna16 {
namespace {

using test::random_unpacked;
using test::scheme;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

int32_t w32(uint32_t u) { return int32_t(u); }

// A checkpoint-form layer with zero-filled tensors of the right sizes for (s, K, N).
QuantizedLinear blank(const QuantScheme& s, int64_t K, int64_t N) {
  QuantizedLinear w;
  w.scheme = s;
  w.K = K;
  w.N = N;
  const int64_t G = s.num_groups(K);
  if (s.format == Format::Awq) {
    w.qweight.assign(static_cast<size_t>(K * N / 8), 0);
    w.qzeros.assign(static_cast<size_t>(G * N / 8), 0);
  } else {
    w.qweight.assign(static_cast<size_t>(K * s.bits / 32 * N), 0);
    w.qzeros.assign(static_cast<size_t>(G * N * s.bits / 32), 0);
    w.g_idx.assign(static_cast<size_t>(K), 0);
    for (int64_t k = 0; k < K; ++k) w.g_idx[k] = int32_t(k / s.group_len(K));
  }
  w.scales.assign(static_cast<size_t>(G * N), 1.0f);
  return w;
}

std::vector<uint8_t> column(const UnpackedLinear& u, int64_t n) {
  std::vector<uint8_t> c;
  for (int64_t k = 0; k < u.K; ++k) c.push_back(u.q[k * u.N + n]);
  return c;
}

// ---------------------------------------------------------------- golden values, by hand

TEST(GoldenGptqV1, FourBitWordAndSymZeros) {
  // qweight column 0 = 0x76543210: value k at bits [4k, 4k+4) -> q[k,0] = k.
  // column 1 = 0xFEDCBA98 (negative as int32) -> q[k,1] = 8 + k. qzeros 0x77777777: v1 stores 7 = 8-1.
  QuantizedLinear w = blank(scheme(Format::GptqV1, 4, -1, true), 8, 8);
  w.qweight[0] = w32(0x76543210u);
  w.qweight[1] = w32(0xFEDCBA98u);
  w.qzeros[0] = w32(0x77777777u);
  w.scales[0] = 0.5f;
  w.scales[1] = 0.25f;
  const UnpackedLinear u = unpack(w);
  EXPECT_THAT(column(u, 0), ElementsAre(0, 1, 2, 3, 4, 5, 6, 7));
  EXPECT_THAT(column(u, 1), ElementsAre(8, 9, 10, 11, 12, 13, 14, 15));
  EXPECT_THAT(column(u, 2), ElementsAre(0, 0, 0, 0, 0, 0, 0, 0));
  EXPECT_THAT(u.zeros, ElementsAre(8, 8, 8, 8, 8, 8, 8, 8));
  EXPECT_THAT(u.g_idx, ElementsAre(0, 0, 0, 0, 0, 0, 0, 0));
  // w = s * (q - (stored + 1)): column 0 = 0.5*(k-8), column 1 = 0.25*k.
  const std::vector<double> d = dequantize(w);
  for (int k = 0; k < 8; ++k) {
    EXPECT_EQ(d[k * 8 + 0], 0.5 * (k - 8)) << k;
    EXPECT_EQ(d[k * 8 + 1], 0.25 * k) << k;
    EXPECT_EQ(d[k * 8 + 2], -8.0) << k;
  }
}

TEST(GoldenGptqV1, SymZerosPerBitWidth) {
  // v1 stores 2^(b-1) - 1 in every field; v2 stores 2^(b-1).
  struct Case {
    int bits;
    std::vector<uint32_t> v1, v2;
  };
  const Case cases[] = {
      {2, {0x55555555u}, {0xAAAAAAAAu}},
      {4, {0x77777777u}, {0x88888888u}},
      {8, {0x7F7F7F7Fu}, {0x80808080u}},
      {3, {0xDB6DB6DBu, 0xB6DB6DB6u, 0x6DB6DB6Du}, {0x24924924u, 0x49249249u, 0x92492492u}},
  };
  for (const Case& c : cases) {
    const int64_t N = c.bits == 3 ? 32 : 32 / c.bits, K = c.bits == 3 ? 32 : 32 / c.bits;
    for (Format f : {Format::GptqV1, Format::GptqV2}) {
      const QuantScheme s = scheme(f, c.bits, -1, true);
      const QuantizedLinear w = pack(random_unpacked(s, K, N, 7), s);
      std::vector<int32_t> want;
      for (uint32_t x : f == Format::GptqV1 ? c.v1 : c.v2) want.push_back(w32(x));
      EXPECT_EQ(w.qzeros, want) << c.bits << "-bit " << format_name(f);
    }
  }
}

TEST(GoldenGptq, ThreeBitValuesStraddleWords) {
  // One column of 32 values = 96 bits = 3 words. q[10]=5=0b101 sits at stream bits 30..32: bit 30 of
  // word 0 and bit 0 of word 1; q[21]=6=0b110 at bits 63..65: bit 31 of word 1 (0) and bits 0,1 of
  // word 2. q[0]=3 -> word0 bits 0,1; q[11]=7 -> word1 bits 1..3; q[22]=1 -> word2 bit 2;
  // q[31]=7 -> word2 bits 29..31.
  const QuantScheme s = scheme(Format::GptqV2, 3, -1, false);
  UnpackedLinear u = random_unpacked(s, 32, 32, 1);
  std::fill(u.q.begin(), u.q.end(), 0);
  std::fill(u.zeros.begin(), u.zeros.end(), 0);
  u.q[0 * 32] = 3;
  u.q[10 * 32] = 5;
  u.q[11 * 32] = 7;
  u.q[21 * 32] = 6;
  u.q[22 * 32] = 1;
  u.q[31 * 32] = 7;
  u.zeros[10] = 5;  // qzeros use the same stream along N
  u.zeros[21] = 6;
  const QuantizedLinear w = pack(u, s);
  ASSERT_EQ(w.qweight.size(), 3u * 32u);
  EXPECT_EQ(uint32_t(w.qweight[0 * 32]), 0x40000003u);
  EXPECT_EQ(uint32_t(w.qweight[1 * 32]), 0x0000000Fu);
  EXPECT_EQ(uint32_t(w.qweight[2 * 32]), 0xE0000007u);
  for (int r = 0; r < 3; ++r)
    for (int n = 1; n < 32; ++n) EXPECT_EQ(w.qweight[r * 32 + n], 0) << r << "," << n;
  EXPECT_THAT(w.qzeros, ElementsAre(w32(0x40000000u), w32(0x00000001u), w32(0x00000003u)));
  // And back, from the hand-written words.
  QuantizedLinear h = blank(s, 32, 32);
  h.qweight[0] = w32(0x40000003u);
  h.qweight[32] = w32(0x0000000Fu);
  h.qweight[64] = w32(0xE0000007u);
  h.qzeros = {w32(0x40000000u), 1, 3};
  const UnpackedLinear back = unpack(h);
  EXPECT_EQ(back.q, u.q);
  EXPECT_EQ(back.zeros, u.zeros);
}

TEST(GoldenGptq, EightBitWord) {
  // 0x80FF017F: byte j is value j -> 0x7F, 0x01, 0xFF, 0x80. v2 qzeros 0x80FF0001 -> 1, 0, 255, 128.
  QuantizedLinear w = blank(scheme(Format::GptqV2, 8, -1, false), 4, 4);
  w.qweight[0] = w32(0x80FF017Fu);
  w.qzeros[0] = w32(0x80FF0001u);
  w.scales = {1.0f, 2.0f, 0.5f, 0.125f};
  const UnpackedLinear u = unpack(w);
  EXPECT_THAT(column(u, 0), ElementsAre(127, 1, 255, 128));
  EXPECT_THAT(u.zeros, ElementsAre(1, 0, 255, 128));
  const std::vector<double> d = dequantize(u);
  EXPECT_EQ(d[0 * 4 + 0], 126.0);   // 1.0 * (127 - 1)
  EXPECT_EQ(d[2 * 4 + 0], 254.0);   // 1.0 * (255 - 1)
  EXPECT_EQ(d[0 * 4 + 1], 0.0);     // 2.0 * (0 - 0)
  EXPECT_EQ(d[0 * 4 + 2], -127.5);  // 0.5 * (0 - 255)
  EXPECT_EQ(d[0 * 4 + 3], -16.0);   // 0.125 * (0 - 128)
}

TEST(GoldenGptq, TwoBitWord) {
  // 0xE4 = 0b11'10'01'00: values 0, 1, 2, 3 in the four lowest fields.
  QuantizedLinear w = blank(scheme(Format::GptqV1, 2, -1, true), 16, 16);
  w.qweight[0] = 0xE4;
  w.qzeros[0] = w32(0x55555555u);
  const UnpackedLinear u = unpack(w);
  EXPECT_THAT(column(u, 0), ElementsAre(0, 1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0));
  EXPECT_EQ(u.zeros[5], 2);
}

TEST(GoldenAwq, WordUnpacksThroughTheInterleave) {
  // Nibble i of 0x76543210 is i and holds column ORDER[i] (ORDER = 0,2,4,6,1,3,5,7), so columns
  // 0..7 read 0,4,1,5,2,6,3,7. qzeros 0x13572468: nibbles 8,6,4,2,7,5,3,1 -> columns 8,7,6,5,4,3,2,1.
  QuantizedLinear w = blank(scheme(Format::Awq, 4, -1, false), 1, 8);
  w.qweight[0] = w32(0x76543210u);
  w.qzeros[0] = w32(0x13572468u);
  w.scales = {0.125f, 0.125f, 0.25f, 1, 1, 1, 1, 2};
  const UnpackedLinear u = unpack(w);
  EXPECT_THAT(u.q, ElementsAre(0, 4, 1, 5, 2, 6, 3, 7));
  EXPECT_THAT(u.zeros, ElementsAre(8, 7, 6, 5, 4, 3, 2, 1));
  const std::vector<double> d = dequantize(w);  // (q - z) * s, z as stored
  EXPECT_THAT(d, ElementsAre(-1.0, -0.375, -1.25, 0.0, -2.0, 3.0, 1.0, 12.0));
}

TEST(GoldenAwq, PackPutsColumnJInNibbleReverseJ) {
  // Columns 0..7 holding 0..7 pack to nibbles (col0, col2, col4, col6, col1, col3, col5, col7).
  const QuantScheme s = scheme(Format::Awq, 4, -1, false);
  UnpackedLinear u = random_unpacked(s, 2, 16, 3);
  for (int n = 0; n < 16; ++n) {
    u.q[n] = uint8_t(n % 8);
    u.q[16 + n] = uint8_t(15 - n);
    u.zeros[n] = n < 8 ? 15 : 0;
  }
  const QuantizedLinear w = pack(u, s);
  EXPECT_THAT(w.qweight, ElementsAre(w32(0x75316420u), w32(0x75316420u), w32(0x8ACE9BDFu), w32(0x02461357u)));
  EXPECT_THAT(w.qzeros, ElementsAre(w32(0xFFFFFFFFu), 0));
  EXPECT_TRUE(w.g_idx.empty());
}

TEST(GoldenGptqV1, StoredAllOnesMeansZeroTwoToTheBits) {
  // A v1 field of 0xF reads back as zero 16, as v1 kernels compute (field & 0xF) + 1.
  const QuantScheme v1 = scheme(Format::GptqV1, 4, -1, false);
  QuantizedLinear w = blank(v1, 8, 8);
  w.qzeros[0] = w32(0x7777777Fu);
  w.qweight[0] = w32(0xF0000000u);
  const UnpackedLinear u = unpack(w);
  EXPECT_EQ(u.zeros[0], 16);
  EXPECT_EQ(u.zeros[1], 8);
  const std::vector<double> d = dequantize(u);
  EXPECT_EQ(d[7 * 8], -1.0);   // 15 - 16
  EXPECT_EQ(d[0], -16.0);      // 0 - 16
  EXPECT_EQ(pack(u, v1).qzeros, w.qzeros);  // round trips in v1
  EXPECT_THAT([&] { pack(u, scheme(Format::GptqV2, 4, -1, false)); },
              ThrowsMessage<Error>(AllOf(HasSubstr("zeros[0, 0]=16"), HasSubstr("gptq_v2 4-bit"),
                                         HasSubstr("[0, 15]"))));
}

TEST(Dequantize, MatchesTheFormulaWithActOrderGroups) {
  // g(k) comes from g_idx, not from k / group_len.
  UnpackedLinear u;
  u.bits = 4;
  u.K = 4;
  u.N = 2;
  u.groups = 2;
  u.q = {0, 15, 3, 4, 8, 8, 15, 0};
  u.zeros = {8, 1, 0, 15};
  u.scales = {0.5f, 0.25f, 2.0f, 0.0625f};
  u.g_idx = {1, 0, 0, 1};
  EXPECT_THAT(dequantize(u), ElementsAre(0.0, 0.0,      // g1: 2*(0-0), 0.0625*(15-15)
                                         -2.5, 0.75,    // g0: 0.5*(3-8), 0.25*(4-1)
                                         0.0, 1.75,     // g0: 0.5*(8-8), 0.25*(8-1)
                                         30.0, -0.9375  // g1: 2*(15-0), 0.0625*(0-15)
                                         ));
}

// ---------------------------------------------------------------- round trips

struct Combo {
  Format f;
  int bits;
  int g;
  bool sym, act;
};

std::vector<Combo> all_combos() {
  std::vector<Combo> out;
  for (Format f : {Format::GptqV1, Format::GptqV2, Format::Awq})
    for (int bits : {2, 3, 4, 8})
      for (int g : {-1, 32, 64, 128})
        for (bool sym : {true, false})
          for (bool act : {false, true}) {
            if (f == Format::Awq && (bits != 4 || act)) continue;
            out.push_back({f, bits, g, sym, act});
          }
  return out;
}

TEST(RoundTrip, UnpackOfPackIsIdentityForEveryCombination) {
  int n = 0;
  for (const Combo& c : all_combos()) {
    const QuantScheme s = scheme(c.f, c.bits, c.g, c.sym, c.act);
    SCOPED_TRACE(s.describe());
    const UnpackedLinear u = random_unpacked(s, 256, 64, 100 + n, /*bias=*/n % 2 == 0);
    ++n;
    const QuantizedLinear w = pack(u, s);
    EXPECT_NO_THROW(w.validate());
    test::expect_same(unpack(w), u);
    EXPECT_EQ(dequantize(w), dequantize(u));
  }
  EXPECT_EQ(n, 2 * 4 * 4 * 2 * 2 + 4 * 2);
}

TEST(RoundTrip, PackOfUnpackReproducesArbitraryWords) {
  // Every bit pattern of qweight/qzeros is a valid asym checkpoint; it must come back bit for bit.
  std::mt19937_64 rng(42);
  for (const Combo& c : all_combos()) {
    if (c.sym) continue;
    const QuantScheme s = scheme(c.f, c.bits, c.g, c.sym, c.act);
    SCOPED_TRACE(s.describe());
    QuantizedLinear w = pack(random_unpacked(s, 128, 64, rng()), s);
    for (auto& x : w.qweight) x = int32_t(uint32_t(rng()));
    for (auto& x : w.qzeros) x = int32_t(uint32_t(rng()));
    const QuantizedLinear again = pack(unpack(w), s);
    EXPECT_EQ(again.qweight, w.qweight);
    EXPECT_EQ(again.qzeros, w.qzeros);
    EXPECT_EQ(again.scales, w.scales);
    EXPECT_EQ(again.g_idx, w.g_idx);
  }
}

TEST(RoundTrip, V1AndV2DifferOnlyInTheZeroOffset) {
  for (int bits : {2, 3, 4, 8}) {
    const QuantScheme v1 = scheme(Format::GptqV1, bits, 32, false), v2 = scheme(Format::GptqV2, bits, 32, false);
    UnpackedLinear u = random_unpacked(v2, 64, 64, bits);
    for (auto& z : u.zeros) z = std::max(z, 1);  // representable in both
    const QuantizedLinear a = pack(u, v1), b = pack(u, v2);
    EXPECT_EQ(a.qweight, b.qweight) << bits;
    UnpackedLinear ua = unpack(a), ub = unpack(b);
    EXPECT_EQ(ua.zeros, ub.zeros) << bits;
    EXPECT_NE(a.qzeros, b.qzeros) << bits;
  }
}

TEST(RoundTrip, GptqWithoutGIdxUsesPositionalGroups) {
  const QuantScheme s = scheme(Format::GptqV1, 4, 32, true);
  QuantizedLinear w = pack(random_unpacked(s, 128, 16, 5), s);
  w.g_idx.clear();  // older checkpoints without act-order may omit it
  const UnpackedLinear u = unpack(w);
  for (int k = 0; k < 128; ++k) EXPECT_EQ(u.g_idx[k], k / 32);
}

TEST(RoundTrip, RealModelShapesAwqAndGptq) {
  // DeepSeek-V2-Lite expert: H=2048, I=1408; AWQ g64 and GPTQ g128 act-order.
  for (const QuantScheme& s : {scheme(Format::Awq, 4, 64, false), scheme(Format::GptqV1, 4, 128, true, true)}) {
    SCOPED_TRACE(s.describe());
    const UnpackedLinear u = random_unpacked(s, 1408, 2048, 9);
    test::expect_same(unpack(pack(u, s)), u);
  }
}

// ---------------------------------------------------------------- QuantizedLinear::validate

TEST(ValidateErrors, WrongQweightSize) {
  QuantizedLinear w = blank(scheme(Format::GptqV1, 4, 32, true), 64, 16);
  w.qweight.pop_back();
  EXPECT_THAT([&] { w.validate(); },
              ThrowsMessage<Error>(AllOf(HasSubstr("qweight has 127 elements"), HasSubstr("expected 128 ([8, 16])"))));
  QuantizedLinear a = blank(scheme(Format::Awq, 4, 32, false), 64, 16);
  a.qweight.resize(64 * 16);  // unpacked-sized by mistake
  EXPECT_THAT([&] { a.validate(); },
              ThrowsMessage<Error>(AllOf(HasSubstr("qweight has 1024 elements"), HasSubstr("[64, 2]"))));
}

TEST(ValidateErrors, ZeroPointsWithTheWrongShape) {
  QuantizedLinear w = blank(scheme(Format::GptqV2, 4, 32, false), 64, 16);
  w.qzeros.resize(3);
  EXPECT_THAT([&] { w.validate(); },
              ThrowsMessage<Error>(AllOf(HasSubstr("qzeros has 3 elements"), HasSubstr("expected 4 ([2, 2])"))));
  QuantizedLinear a = blank(scheme(Format::Awq, 4, 32, false), 64, 16);
  a.qzeros.assign(2 * 16, 0);  // unpacked [G, N] instead of packed [G, N/8]
  EXPECT_THAT([&] { a.validate(); }, ThrowsMessage<Error>(HasSubstr("qzeros has 32 elements, expected 4")));
}

TEST(ValidateErrors, WrongScalesOrBiasSize) {
  QuantizedLinear w = blank(scheme(Format::GptqV1, 4, 32, true), 64, 16);
  w.scales.resize(16);
  EXPECT_THAT([&] { w.validate(); }, ThrowsMessage<Error>(HasSubstr("scales has 16 elements, expected 32 ([2, 16])")));
  QuantizedLinear b = blank(scheme(Format::GptqV1, 4, 32, true), 64, 16);
  b.bias.resize(15);
  EXPECT_THAT([&] { b.validate(); }, ThrowsMessage<Error>(HasSubstr("bias has 15 elements, expected N=16")));
}

TEST(ValidateErrors, NonFiniteScale) {
  QuantizedLinear w = blank(scheme(Format::GptqV1, 4, 32, true), 64, 16);
  w.scales[16 + 3] = std::numeric_limits<float>::infinity();
  EXPECT_THAT([&] { w.validate(); }, ThrowsMessage<Error>(HasSubstr("scales[1, 3]=inf")));
}

TEST(ValidateErrors, GIdxValueOutOfRange) {
  QuantizedLinear w = blank(scheme(Format::GptqV1, 4, 16, true, true), 64, 16);
  w.g_idx[5] = 9;
  EXPECT_THAT([&] { w.validate(); }, ThrowsMessage<Error>(HasSubstr("g_idx[5]=9 is out of range [0, 4)")));
  w.g_idx[5] = -1;
  EXPECT_THAT([&] { w.validate(); }, ThrowsMessage<Error>(HasSubstr("g_idx[5]=-1")));
}

TEST(ValidateErrors, GIdxWrongLengthOrMissingOrOnAwq) {
  QuantizedLinear w = blank(scheme(Format::GptqV1, 4, 16, true, true), 64, 16);
  w.g_idx.resize(63);
  EXPECT_THAT([&] { w.validate(); }, ThrowsMessage<Error>(HasSubstr("g_idx has 63 elements, expected K=64")));
  w.g_idx.clear();
  EXPECT_THAT([&] { w.validate(); }, ThrowsMessage<Error>(HasSubstr("g_idx is empty but the scheme is act-order")));
  QuantizedLinear a = blank(scheme(Format::Awq, 4, 16, false), 64, 16);
  a.g_idx.assign(64, 0);
  EXPECT_THAT([&] { a.validate(); }, ThrowsMessage<Error>(HasSubstr("AWQ has no g_idx")));
}

TEST(ValidateErrors, ShuffledGIdxWithoutActOrder) {
  QuantizedLinear w = blank(scheme(Format::GptqV1, 4, 16, true), 64, 16);
  std::swap(w.g_idx[0], w.g_idx[63]);
  EXPECT_THAT([&] { unpack(w); }, ThrowsMessage<Error>(AllOf(HasSubstr("g_idx[0]=3"), HasSubstr("not act-order"))));
}

TEST(ValidateErrors, SchemeErrorsSurfaceThroughValidate) {
  QuantizedLinear w = blank(scheme(Format::GptqV1, 4, 32, true), 64, 16);
  w.scheme.bits = 5;
  EXPECT_THAT([&] { w.validate(); }, ThrowsMessage<Error>(HasSubstr("bits=5")));
  w.scheme.bits = 4;
  w.K = 80;
  EXPECT_THAT([&] { w.validate(); }, ThrowsMessage<Error>(HasSubstr("K=80 is not a multiple of group_size=32")));
}

TEST(UnpackErrors, SymSchemeWithOtherZeros) {
  QuantizedLinear w = blank(scheme(Format::GptqV1, 4, -1, true), 8, 8);
  w.qzeros[0] = w32(0x77777767u);  // field 1 stores 6 -> zero 7
  EXPECT_THAT([&] { unpack(w); },
              ThrowsMessage<Error>(AllOf(HasSubstr("sym"), HasSubstr("qzeros[0, 1] holds zero 7 (expected 8)"))));
}

// ---------------------------------------------------------------- pack errors

TEST(PackErrors, V1CannotStoreZeroZero) {
  const QuantScheme s = scheme(Format::GptqV1, 4, -1, false);
  UnpackedLinear u = random_unpacked(s, 8, 8, 1);
  for (auto& z : u.zeros) z = std::min(z, 15);  // v1 may hold 16; v2 may not
  u.zeros[3] = 0;
  EXPECT_THAT([&] { pack(u, s); }, ThrowsMessage<Error>(AllOf(HasSubstr("zeros[0, 3]=0"), HasSubstr("[1, 16]"),
                                                              HasSubstr("v1 stores zero-1"))));
  EXPECT_NO_THROW(pack(u, scheme(Format::GptqV2, 4, -1, false)));
}

TEST(PackErrors, SymNeedsTheMidZero) {
  const QuantScheme s = scheme(Format::Awq, 4, -1, true);
  UnpackedLinear u = random_unpacked(s, 8, 8, 1);
  u.zeros[2] = 9;
  EXPECT_THAT([&] { pack(u, s); }, ThrowsMessage<Error>(AllOf(HasSubstr("zeros[0, 2]=9"), HasSubstr("expected 8"))));
}

TEST(PackErrors, CodeDoesNotFitTheBits) {
  const QuantScheme s = scheme(Format::GptqV2, 2, -1, false);
  UnpackedLinear u = random_unpacked(s, 16, 16, 1);
  u.q[3 * 16 + 4] = 4;
  EXPECT_THAT([&] { pack(u, s); }, ThrowsMessage<Error>(HasSubstr("q[3, 4]=4 does not fit 2 bits")));
}

TEST(PackErrors, ShapeMismatches) {
  const QuantScheme s = scheme(Format::GptqV2, 4, 32, false);
  UnpackedLinear u = random_unpacked(s, 64, 16, 1);
  EXPECT_THAT([&] { pack(u, scheme(Format::GptqV2, 8, 32, false)); },
              ThrowsMessage<Error>(HasSubstr("bits=4 but the scheme gptq_v2 8-bit g32 asym has bits=8")));
  EXPECT_THAT([&] { pack(u, scheme(Format::GptqV2, 4, 16, false)); },
              ThrowsMessage<Error>(HasSubstr("groups=2 but scheme gptq_v2 4-bit g16 asym with K=64 has 4 groups")));
  UnpackedLinear bad = u;
  bad.zeros.pop_back();
  EXPECT_THAT([&] { pack(bad, s); }, ThrowsMessage<Error>(HasSubstr("zeros has 31 elements, expected 32")));
  bad = u;
  bad.g_idx[7] = 2;
  EXPECT_THAT([&] { pack(bad, scheme(Format::GptqV2, 4, 32, false, true)); },
              ThrowsMessage<Error>(HasSubstr("g_idx[7]=2 is out of range [0, 2)")));
  EXPECT_NO_THROW(pack(u, scheme(Format::Awq, 4, 32, false)));  // the same u fits AWQ
}

TEST(PackErrors, BadSchemeNamesTheValue) {
  const QuantScheme s = scheme(Format::GptqV2, 4, 32, false);
  UnpackedLinear u = random_unpacked(s, 64, 16, 1);
  EXPECT_THAT([&] { pack(u, scheme(Format::GptqV2, 4, 0, false)); }, ThrowsMessage<Error>(HasSubstr("group_size=0")));
  EXPECT_THAT([&] { pack(u, scheme(Format::Awq, 4, 48, false)); },
              ThrowsMessage<Error>(HasSubstr("K=64 is not a multiple of group_size=48")));
}

}  // namespace
}  // namespace wna16
