// QuantScheme: names, group arithmetic and the bad-scheme errors (each message names the value).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "formats/formats_test_util.h"
#include "wna16/error.h"
#include "wna16/quant.h"

namespace wna16 {
namespace {

using test::scheme;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

TEST(FormatName, RoundTripsThroughParse) {
  for (Format f : {Format::GptqV1, Format::GptqV2, Format::Awq}) EXPECT_EQ(parse_format(format_name(f)), f);
  EXPECT_STREQ(format_name(Format::GptqV1), "gptq");
  EXPECT_STREQ(format_name(Format::GptqV2), "gptq_v2");
  EXPECT_STREQ(format_name(Format::Awq), "awq");
}

TEST(FormatName, ParseIsCaseInsensitiveAndAcceptsV1Alias) {
  EXPECT_EQ(parse_format("AWQ"), Format::Awq);
  EXPECT_EQ(parse_format("GPTQ_V2"), Format::GptqV2);
  EXPECT_EQ(parse_format("gptq_v1"), Format::GptqV1);
}

TEST(FormatName, UnknownFormatNamesTheInput) {
  EXPECT_THAT([] { parse_format("marlin"); },
              ThrowsMessage<Error>(AllOf(HasSubstr("'marlin'"), HasSubstr("gptq, gptq_v2 or awq"))));
  EXPECT_THAT([] { parse_format(""); }, ThrowsMessage<Error>(HasSubstr("''")));
}

TEST(QuantScheme, NumGroupsAndGroupLen) {
  QuantScheme s = scheme(Format::GptqV1, 4, 128, true);
  EXPECT_EQ(s.num_groups(4096), 32);
  EXPECT_EQ(s.group_len(4096), 128);
  EXPECT_EQ(s.num_groups(100), 1);  // ceil
  EXPECT_EQ(s.num_groups(129), 2);
  s.group_size = -1;
  EXPECT_EQ(s.num_groups(4096), 1);
  EXPECT_EQ(s.group_len(4096), 4096);
  s.group_size = 0;
  EXPECT_THAT([&] { s.num_groups(64); }, ThrowsMessage<Error>(HasSubstr("group_size=0")));
}

TEST(QuantScheme, DescribeNamesEveryField) {
  EXPECT_EQ(scheme(Format::GptqV1, 4, 128, true, true).describe(), "gptq 4-bit g128 sym act-order");
  EXPECT_EQ(scheme(Format::Awq, 4, 64, false).describe(), "awq 4-bit g64 asym");
  EXPECT_EQ(scheme(Format::GptqV2, 8, -1, true).describe(), "gptq_v2 8-bit g-1 sym");
}

TEST(QuantScheme, ValidAcceptsRealModelShapes) {
  // Mixtral GPTQ (g -1, act-order), DeepSeek-V2-Lite GPTQ g128 / AWQ g64, Qwen1.5 I=1408, N=576.
  EXPECT_NO_THROW(scheme(Format::GptqV1, 4, -1, true, true).validate(4096, 14336));
  EXPECT_NO_THROW(scheme(Format::GptqV1, 4, 128, true, true).validate(2048, 1408));
  EXPECT_NO_THROW(scheme(Format::GptqV1, 4, 128, true, true).validate(1408, 2048));
  EXPECT_NO_THROW(scheme(Format::Awq, 4, 64, false).validate(1408, 576));
  EXPECT_NO_THROW(scheme(Format::GptqV2, 8, 128, true).validate(7168, 2048));
  EXPECT_NO_THROW(scheme(Format::GptqV1, 3, 128, true).validate(4096, 14336));
  EXPECT_NO_THROW(scheme(Format::GptqV1, 2, 64, false).validate(2048, 768));
}

TEST(QuantSchemeErrors, BitsFiveIsRejected) {
  EXPECT_THAT([] { scheme(Format::GptqV1, 5, 128, true).validate(256, 256); },
              ThrowsMessage<Error>(AllOf(HasSubstr("bits=5"), HasSubstr("2, 3, 4 or 8"))));
  EXPECT_THAT([] { scheme(Format::GptqV2, 16, 128, true).validate(256, 256); },
              ThrowsMessage<Error>(HasSubstr("bits=16")));
}

TEST(QuantSchemeErrors, AwqIsFourBitOnly) {
  EXPECT_THAT([] { scheme(Format::Awq, 8, 128, false).validate(256, 256); },
              ThrowsMessage<Error>(AllOf(HasSubstr("bits=8"), HasSubstr("4-bit only"))));
  EXPECT_THAT([] { scheme(Format::Awq, 3, 128, false).validate(256, 256); },
              ThrowsMessage<Error>(HasSubstr("bits=3")));
}

TEST(QuantSchemeErrors, AwqHasNoActOrder) {
  EXPECT_THAT([] { scheme(Format::Awq, 4, 128, false, true).validate(256, 256); },
              ThrowsMessage<Error>(HasSubstr("act-order")));
}

TEST(QuantSchemeErrors, GroupSizeZeroOrBelowMinusOne) {
  EXPECT_THAT([] { scheme(Format::GptqV1, 4, 0, true).validate(256, 256); },
              ThrowsMessage<Error>(HasSubstr("group_size=0")));
  EXPECT_THAT([] { scheme(Format::Awq, 4, -2, false).validate(256, 256); },
              ThrowsMessage<Error>(HasSubstr("group_size=-2")));
}

TEST(QuantSchemeErrors, GroupSizeNotDividingK) {
  EXPECT_THAT([] { scheme(Format::GptqV1, 4, 128, true).validate(10944, 2048); },
              ThrowsMessage<Error>(HasSubstr("K=10944 is not a multiple of group_size=128")));
  EXPECT_THAT([] { scheme(Format::Awq, 4, 64, false).validate(100, 64); },
              ThrowsMessage<Error>(HasSubstr("K=100 is not a multiple of group_size=64")));
}

TEST(QuantSchemeErrors, NNotAMultipleOfThePacking) {
  EXPECT_THAT([] { scheme(Format::Awq, 4, 64, false).validate(128, 100); },
              ThrowsMessage<Error>(HasSubstr("N=100 is not a multiple of 8")));
  EXPECT_THAT([] { scheme(Format::GptqV1, 4, 64, true).validate(128, 12); },
              ThrowsMessage<Error>(HasSubstr("N=12 is not a multiple of 8")));
  EXPECT_THAT([] { scheme(Format::GptqV2, 2, 64, true).validate(128, 24); },
              ThrowsMessage<Error>(HasSubstr("N=24 is not a multiple of 16")));
  EXPECT_THAT([] { scheme(Format::GptqV1, 3, 64, true).validate(128, 48); },
              ThrowsMessage<Error>(HasSubstr("N=48 is not a multiple of 32")));
}

TEST(QuantSchemeErrors, KNotAMultipleOfThePacking) {
  // g -1 so the group rule is not what fires.
  EXPECT_THAT([] { scheme(Format::GptqV1, 3, -1, true).validate(48, 64); },
              ThrowsMessage<Error>(HasSubstr("K=48 is not a multiple of 32")));
  EXPECT_THAT([] { scheme(Format::GptqV1, 4, -1, true).validate(12, 64); },
              ThrowsMessage<Error>(HasSubstr("K=12 is not a multiple of 8")));
  EXPECT_THAT([] { scheme(Format::GptqV2, 8, -1, true).validate(6, 64); },
              ThrowsMessage<Error>(HasSubstr("K=6 is not a multiple of 4")));
  // AWQ packs along N only: any K works.
  EXPECT_NO_THROW(scheme(Format::Awq, 4, -1, false).validate(6, 64));
}

TEST(QuantSchemeErrors, NonPositiveDimensions) {
  EXPECT_THAT([] { scheme(Format::GptqV1, 4, -1, true).validate(0, 64); }, ThrowsMessage<Error>(HasSubstr("K=0")));
  EXPECT_THAT([] { scheme(Format::GptqV1, 4, -1, true).validate(64, -8); },
              ThrowsMessage<Error>(HasSubstr("N=-8")));
}

}  // namespace
}  // namespace wna16
