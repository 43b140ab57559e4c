// Quantization-config key spellings (the kQuantKeys table in src/io/quant_config.cpp): each
// alternative spelling alone parses to the same scheme as the canonical key; the configs GPTQModel,
// AutoAWQ and AutoRound write with several spellings at once are accepted; spellings that disagree
// are refused naming both; a missing field names every spelling.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "wna16/checkpoint.h"
#include "wna16/error.h"

namespace wna16 {
namespace {

using OJ = nlohmann::ordered_json;

const OJ kGptq = {{"quant_method", "gptq"}, {"bits", 4}, {"group_size", 128}, {"desc_act", false}, {"sym", true},
                  {"checkpoint_format", "gptq_v2"}};
const OJ kAwq = {{"quant_method", "awq"}, {"bits", 4}, {"group_size", 64}, {"zero_point", true}, {"version", "gemm"}};

QuantConfig parse(const OJ& j) { return parse_quant_config(j.dump(), "config.json", "quantization_config"); }

std::string parse_error(const OJ& j) {
  try {
    parse(j);
  } catch (const Error& e) {
    return e.what();
  }
  return "(accepted)";
}

// `j` with key `from` renamed to `to` holding `value` (the same value when null).
OJ rename(OJ j, const std::string& from, const std::string& to, const OJ& value = nullptr) {
  const OJ v = value.is_null() ? j.at(from) : value;
  j.erase(from);
  j[to] = v;
  return j;
}

// describe() names method, bits, group size, layout, sym, desc_act and zero_point: all a spelling sets.
void expect_same(const QuantConfig& a, const QuantConfig& b) { EXPECT_EQ(a.describe(), b.describe()); }

TEST(QuantAlias, WBitForBits) {  // AutoAWQ quant_config.json, GPTQModel synonym
  expect_same(parse(rename(kAwq, "bits", "w_bit")), parse(kAwq));
  expect_same(parse(rename(kGptq, "bits", "w_bit", 8)), parse(rename(kGptq, "bits", "bits", 8)));
}

TEST(QuantAlias, WbitsForBits) {  // GPTQModel synonym (QQQ)
  expect_same(parse(rename(kGptq, "bits", "wbits", 8)), parse(rename(kGptq, "bits", "bits", 8)));
}

TEST(QuantAlias, QGroupSizeForGroupSize) {  // AutoAWQ quant_config.json, GPTQModel synonym
  expect_same(parse(rename(kAwq, "group_size", "q_group_size")), parse(kAwq));
  expect_same(parse(rename(kGptq, "group_size", "q_group_size", 32)), parse(rename(kGptq, "group_size", "group_size", 32)));
}

TEST(QuantAlias, FormatForCheckpointFormat) {  // GPTQModel before checkpoint_format
  const QuantConfig q = parse(rename(kGptq, "checkpoint_format", "format"));
  expect_same(q, parse(kGptq));
  EXPECT_EQ(q.scheme.format, Format::GptqV2);
  EXPECT_EQ(parse(rename(kGptq, "checkpoint_format", "format", "gptq")).scheme.format, Format::GptqV1);
}

TEST(QuantAlias, VersionForFormat) {  // AutoAWQ / AwqConfig; GPTQModel maps version -> format for any method
  expect_same(parse(rename(kGptq, "checkpoint_format", "version")), parse(kGptq));
  expect_same(parse(rename(kAwq, "version", "format")), parse(kAwq));
  expect_same(parse(rename(kAwq, "version", "checkpoint_format", "GEMM")), parse(kAwq));
  EXPECT_NE(parse_error(rename(kAwq, "version", "checkpoint_format", "gemv_fast")).find("quantization_config.checkpoint_format = \"gemv_fast\" is not supported"),
            std::string::npos);
}

TEST(QuantAlias, ZeroPointForSymNegated) {  // AutoAWQ; GPTQModel's negated synonym
  const QuantConfig asym = parse(rename(kGptq, "sym", "zero_point", true));
  EXPECT_FALSE(asym.scheme.sym);
  expect_same(asym, parse(rename(kGptq, "sym", "sym", false)));
  expect_same(parse(rename(kGptq, "sym", "zero_point", false)), parse(kGptq));
  expect_same(parse(rename(kAwq, "zero_point", "sym", false)), parse(kAwq));
  EXPECT_NE(parse_error(rename(kAwq, "zero_point", "sym", true)).find("quantization_config.sym = true: symmetric AWQ (no qzeros) is not supported"),
            std::string::npos);
}

// What the tools write with several spellings at once.
TEST(QuantAlias, ToolsWritingSeveralSpellings) {
  OJ gptqmodel = kGptq;  // GPTQModel to_dict, GPTQ: checkpoint_format and format
  gptqmodel["format"] = "gptq_v2";
  expect_same(parse(gptqmodel), parse(kGptq));
  OJ gptqmodel_awq = kAwq;  // GPTQModel to_dict, AWQ: checkpoint_format, format, version, zero_point
  gptqmodel_awq["checkpoint_format"] = "gemm";
  gptqmodel_awq["format"] = "gemm";
  expect_same(parse(gptqmodel_awq), parse(kAwq));
  OJ autoround_awq = kAwq;  // AutoRound's AWQ export: sym beside zero_point = not sym, version "gemm"
  autoround_awq["sym"] = false;
  autoround_awq["version"] = "GEMM";
  expect_same(parse(autoround_awq), parse(kAwq));
}

TEST(QuantAlias, DisagreeingSpellingsRefusedNamingBoth) {
  OJ bits = kGptq;
  bits["w_bit"] = 8;
  EXPECT_NE(parse_error(bits).find("quantization_config.bits = 4 and w_bit = 8 disagree (two spellings of one field)"), std::string::npos)
      << parse_error(bits);
  OJ sym = kGptq;
  sym["zero_point"] = true;  // zero points stored, yet sym
  EXPECT_NE(parse_error(sym).find("quantization_config.sym = true and zero_point = true disagree (two spellings of one field, one of them negated)"),
            std::string::npos)
      << parse_error(sym);
  OJ fmt = kGptq;
  fmt["format"] = "gptq";
  EXPECT_NE(parse_error(fmt).find("quantization_config.checkpoint_format = \"gptq_v2\" and format = \"gptq\" disagree"), std::string::npos)
      << parse_error(fmt);
  OJ group = kAwq;
  group["q_group_size"] = 128;
  EXPECT_NE(parse_error(group).find("group_size = 64 and q_group_size = 128 disagree"), std::string::npos) << parse_error(group);
}

TEST(QuantAlias, MissingFieldNamesEverySpelling) {
  OJ j = kGptq;
  j.erase("bits");
  EXPECT_NE(parse_error(j).find("quantization_config.bits (or w_bit or wbits) is missing"), std::string::npos) << parse_error(j);
  j = kAwq;
  j.erase("group_size");
  EXPECT_NE(parse_error(j).find("quantization_config.group_size (or q_group_size) is missing"), std::string::npos) << parse_error(j);
}

}  // namespace
}  // namespace wna16
