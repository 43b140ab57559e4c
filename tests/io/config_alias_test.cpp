// config.json key spellings: every alternative spelling in the alias table (src/io/model_config.cpp)
// parses to the same ModelConfig as the canonical key; two spellings that disagree are refused
// naming both; a missing field names its alternatives; aliases stay within their family; a synth'd
// checkpoint re-saved with the transformers 5 spelling still opens with the same layer specs;
// model_type aliases (kimi_k2) run as their base architecture.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "io_test_util.h"
#include "wna16/checkpoint.h"
#include "wna16/error.h"

namespace wna16 {
namespace {

using test::expect_same_spec;
using test::rename_key;
using test::with_key;
using test::without_key;
constexpr auto parse = test::parse_config;
constexpr auto parse_error = test::config_error;

using OJ = nlohmann::ordered_json;

// MoE-relevant keys of published configs, canonical (transformers 4.x / original repo) spelling.
const char* kMixtral8x7B = R"({"model_type":"mixtral","hidden_size":4096,"intermediate_size":14336,
  "num_hidden_layers":32,"num_local_experts":8,"num_experts_per_tok":2})";
const char* kQwen3_30B = R"({"model_type":"qwen3_moe","hidden_size":2048,"intermediate_size":6144,
  "moe_intermediate_size":768,"num_experts":128,"num_experts_per_tok":8,"norm_topk_prob":true,
  "decoder_sparse_step":1,"mlp_only_layers":[],"num_hidden_layers":48})";
const char* kDsV2Lite = R"({"model_type":"deepseek_v2","hidden_size":2048,"intermediate_size":10944,
  "moe_intermediate_size":1408,"n_routed_experts":64,"n_shared_experts":2,"num_experts_per_tok":6,
  "topk_method":"greedy","routed_scaling_factor":1.0,"norm_topk_prob":false,"scoring_func":"softmax",
  "first_k_dense_replace":1,"moe_layer_freq":1,"num_hidden_layers":27})";
const char* kDsV3 = R"({"model_type":"deepseek_v3","hidden_size":7168,"intermediate_size":18432,
  "moe_intermediate_size":2048,"n_routed_experts":256,"n_shared_experts":1,"num_experts_per_tok":8,
  "topk_method":"noaux_tc","n_group":8,"topk_group":4,"routed_scaling_factor":2.5,"norm_topk_prob":true,
  "scoring_func":"sigmoid","first_k_dense_replace":3,"moe_layer_freq":1,"num_hidden_layers":61,
  "num_nextn_predict_layers":1})";

// Same architecture, sizes, routing and layer layout; the spec of every MoE layer equal.
void expect_same_config(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.arch, b.arch);
  EXPECT_EQ(a.hidden, b.hidden);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.dense_inter, b.dense_inter);
  EXPECT_EQ(a.moe_inter, b.moe_inter);
  EXPECT_EQ(a.num_experts, b.num_experts);
  EXPECT_EQ(a.top_k, b.top_k);
  EXPECT_EQ(a.norm_topk_prob, b.norm_topk_prob);
  EXPECT_EQ(a.shared_expert_inter, b.shared_expert_inter);
  EXPECT_EQ(a.n_shared_experts, b.n_shared_experts);
  EXPECT_EQ(a.topk_method, b.topk_method);
  EXPECT_EQ(a.scoring_func, b.scoring_func);
  EXPECT_EQ(a.num_nextn_predict_layers, b.num_nextn_predict_layers);
  ASSERT_EQ(a.total_layers(), b.total_layers());
  for (int64_t L = 0; L < a.total_layers(); ++L) {
    ASSERT_EQ(a.layer_kind(L), b.layer_kind(L)) << "layer " << L;
    if (a.is_moe(L)) expect_same_spec(a.layer_spec(L), b.layer_spec(L));
  }
}

// The checks every alias gets: alternative alone = canonical; both, equal = accepted; both,
// different = refused naming both keys and values.
void check_alias(const std::string& canonical_text, const std::string& canonical, const std::string& alternative,
                 int other_value) {
  SCOPED_TRACE(canonical + " / " + alternative);
  const ModelConfig want = parse(canonical_text);
  const std::string alt_text = rename_key(canonical_text, canonical, alternative);
  ASSERT_EQ(alt_text.find("\"" + canonical + "\""), std::string::npos);
  expect_same_config(parse(alt_text), want);

  const int64_t v = OJ::parse(canonical_text)[canonical].get<int64_t>();
  expect_same_config(parse(with_key(canonical_text, alternative, v)), want);

  const std::string msg = parse_error(with_key(canonical_text, alternative, other_value));
  EXPECT_NE(msg.find("dir/config.json: " + canonical + " = " + std::to_string(v)), std::string::npos) << msg;
  EXPECT_NE(msg.find(alternative + " = " + std::to_string(other_value)), std::string::npos) << msg;
  EXPECT_NE(msg.find("disagree"), std::string::npos) << msg;
  // The other order of keys in the file gives the same refusal (both named).
  const std::string msg2 = parse_error(with_key(alt_text, canonical, other_value));
  EXPECT_NE(msg2.find(alternative + " = " + std::to_string(v)), std::string::npos) << msg2;
  EXPECT_NE(msg2.find(canonical + " = " + std::to_string(other_value)), std::string::npos) << msg2;
}

void expect_missing(const std::string& text, const std::string& named) {
  const std::string msg = parse_error(text);
  EXPECT_NE(msg.find("dir/config.json: " + named + " is missing"), std::string::npos) << msg;
}

void check_missing(const std::string& canonical_text, const std::string& canonical, const std::string& named) {
  expect_missing(without_key(canonical_text, canonical), named);
}

// ---- one test per alias ---------------------------------------------------------------------

// transformers 5 MixtralConfig.attribute_map {"num_experts": "num_local_experts"}
TEST(ConfigAlias, MixtralNumExperts) {
  check_alias(kMixtral8x7B, "num_local_experts", "num_experts", 16);
  check_missing(kMixtral8x7B, "num_local_experts", "num_local_experts (or num_experts)");
  EXPECT_EQ(parse(rename_key(kMixtral8x7B, "num_local_experts", "num_experts")).num_experts, 8);
}

// transformers 5 Qwen3MoeConfig.attribute_map {"num_experts": "num_local_experts"}: what 5.x saves.
TEST(ConfigAlias, Qwen3MoeNumLocalExperts) {
  check_alias(kQwen3_30B, "num_experts", "num_local_experts", 64);
  check_missing(kQwen3_30B, "num_experts", "num_experts (or num_local_experts)");
  const ModelConfig c = parse(rename_key(kQwen3_30B, "num_experts", "num_local_experts"));
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.top_k, 8);
  EXPECT_EQ(c.moe_inter, 768);
  expect_same_spec(c.layer_spec(47), preset("qwen3-30b-a3b"));
}

// transformers 5 DeepseekV2Config.attribute_map {"num_experts": "n_routed_experts"}
TEST(ConfigAlias, DeepseekV2NumExperts) {
  check_alias(kDsV2Lite, "n_routed_experts", "num_experts", 160);
  check_missing(kDsV2Lite, "n_routed_experts", "n_routed_experts (or num_experts)");
  const ModelConfig c = parse(rename_key(kDsV2Lite, "n_routed_experts", "num_experts"));
  EXPECT_EQ(c.num_experts, 64);
  expect_same_spec(c.layer_spec(1), preset("deepseek-v2-lite"));
}

// transformers 5 DeepseekV3Config.attribute_map {"num_local_experts": "n_routed_experts"}
TEST(ConfigAlias, DeepseekV3NumLocalExperts) {
  check_alias(kDsV3, "n_routed_experts", "num_local_experts", 128);
  check_missing(kDsV3, "n_routed_experts", "n_routed_experts (or num_local_experts)");
  const ModelConfig c = parse(rename_key(kDsV3, "n_routed_experts", "num_local_experts"));
  EXPECT_EQ(c.num_experts, 256);
  expect_same_spec(c.layer_spec(3), preset("deepseek-v3"));
}

// transformers 5 DeepseekV3Config.attribute_map {"num_mtp_layers": "num_nextn_predict_layers"}
TEST(ConfigAlias, DeepseekV3NumMtpLayers) {
  check_alias(kDsV3, "num_nextn_predict_layers", "num_mtp_layers", 2);
  const ModelConfig c = parse(rename_key(kDsV3, "num_nextn_predict_layers", "num_mtp_layers"));
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  EXPECT_EQ(c.total_layers(), 62);
  EXPECT_EQ(c.layer_kind(61), LayerKind::Mtp);
  // Optional: neither spelling present keeps the default (no MTP layer).
  EXPECT_EQ(parse(without_key(kDsV3, "num_nextn_predict_layers")).num_nextn_predict_layers, 0);
}

// ---- the rules around the table -------------------------------------------------------------

TEST(ConfigAlias, AnAliasIsOnlyAcceptedForItsFamily) {
  // Qwen2MoeConfig declares no attribute_map (transformers 4.x and 5.x): num_experts only.
  const char* qwen15 = R"({"model_type":"qwen2_moe","hidden_size":2048,"intermediate_size":5632,
    "moe_intermediate_size":1408,"shared_expert_intermediate_size":5632,"num_experts":60,
    "num_experts_per_tok":4,"num_hidden_layers":24})";
  const std::string msg = parse_error(rename_key(qwen15, "num_experts", "num_local_experts"));
  EXPECT_NE(msg.find("dir/config.json: num_experts is missing"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("(or"), std::string::npos) << msg;
  // Each family's alternative is not another family's.
  expect_missing(rename_key(kMixtral8x7B, "num_local_experts", "n_routed_experts"),
                 "num_local_experts (or num_experts)");
  expect_missing(rename_key(kQwen3_30B, "num_experts", "n_routed_experts"), "num_experts (or num_local_experts)");
  expect_missing(rename_key(kDsV2Lite, "n_routed_experts", "num_local_experts"), "n_routed_experts (or num_experts)");
  expect_missing(rename_key(kDsV3, "n_routed_experts", "num_experts"), "n_routed_experts (or num_local_experts)");
  // num_mtp_layers means nothing to DeepSeek-V2 (no MTP layers there): ignored like any unknown key.
  EXPECT_EQ(parse(with_key(kDsV2Lite, "num_mtp_layers", 3)).total_layers(), 27);
}

TEST(ConfigAlias, SpellingsWithoutEvidenceStayUnknownKeys) {
  // No config class of the five families maps these; they are ignored like any other unknown key,
  // so a stray one can neither replace nor contradict the canonical field.
  EXPECT_EQ(parse(with_key(kMixtral8x7B, "top_k", 7)).top_k, 2);
  EXPECT_EQ(parse(with_key(kQwen3_30B, "num_experts_per_token", 3)).top_k, 8);
  EXPECT_EQ(parse(with_key(kDsV3, "num_shared_experts", 4)).n_shared_experts, 1);
  expect_missing(rename_key(kMixtral8x7B, "num_experts_per_tok", "top_k"), "num_experts_per_tok");
}

TEST(ConfigAlias, NullSpellingCountsAsAbsent) {
  // A key holding null is absent, so it neither conflicts nor supplies the value.
  const std::string alt = rename_key(kQwen3_30B, "num_experts", "num_local_experts");
  EXPECT_EQ(parse(with_key(alt, "num_experts", nullptr)).num_experts, 128);
  EXPECT_EQ(parse(with_key(kQwen3_30B, "num_local_experts", nullptr)).num_experts, 128);
  expect_missing(with_key(alt, "num_local_experts", nullptr), "num_experts (or num_local_experts)");
}

TEST(ConfigAlias, ABadValueNamesTheSpellingThatHoldsIt) {
  const std::string alt = rename_key(kQwen3_30B, "num_experts", "num_local_experts");
  std::string msg = parse_error(with_key(alt, "num_local_experts", 0));
  EXPECT_NE(msg.find("dir/config.json: num_local_experts = 0 is out of range"), std::string::npos) << msg;
  msg = parse_error(with_key(alt, "num_local_experts", "128"));
  EXPECT_NE(msg.find("num_local_experts = \"128\" is not an integer"), std::string::npos) << msg;
  // Different JSON types are different values, and both are shown.
  msg = parse_error(with_key(kQwen3_30B, "num_local_experts", "128"));
  EXPECT_NE(msg.find("num_experts = 128 and num_local_experts = \"128\" disagree"), std::string::npos) << msg;
  msg = parse_error(with_key(rename_key(kDsV3, "num_nextn_predict_layers", "num_mtp_layers"), "num_mtp_layers", 99));
  EXPECT_NE(msg.find("num_mtp_layers = 99 is out of range"), std::string::npos) << msg;
}

// ---- a synth'd checkpoint re-saved with the transformers 5 spelling --------------------------

struct Resave {
  Arch arch;
  std::vector<std::pair<std::string, std::string>> renames;  // canonical -> transformers 5 spelling
};

TEST(ConfigAlias, SynthCheckpointResavedWithTransformers5SpellingOpens) {
  const Resave cases[] = {
      {Arch::Mixtral, {{"num_local_experts", "num_experts"}}},
      {Arch::Qwen3Moe, {{"num_experts", "num_local_experts"}}},
      {Arch::DeepseekV2, {{"n_routed_experts", "num_experts"}}},
      {Arch::DeepseekV3, {{"n_routed_experts", "num_local_experts"}, {"num_nextn_predict_layers", "num_mtp_layers"}}},
  };
  for (const Resave& c : cases) {
    SCOPED_TRACE(arch_name(c.arch));
    test::ScratchDir d;
    const SynthResult res = synth_checkpoint(test::synth_opts(d.path(), c.arch, Format::GptqV1));
    ASSERT_FALSE(res.moe_layers.empty());
    const Checkpoint before = Checkpoint::open(d.path());
    const std::string path = d / "config.json";
    std::string text = test::read_file(path);
    for (const auto& [from, to] : c.renames) text = rename_key(text, from, to);
    for (const auto& [from, to] : c.renames) ASSERT_EQ(text.find("\"" + from + "\""), std::string::npos) << from;
    test::write_file(path, OJ::parse(text).dump(2) + "\n");

    const Checkpoint after = Checkpoint::open(d.path());
    expect_same_config(after.config(), before.config());
    for (int64_t L : res.moe_layers) {
      expect_same_spec(after.config().layer_spec(L), before.config().layer_spec(L));
      EXPECT_TRUE(after.describe_layer(L).problems.empty()) << "layer " << L;
    }
  }
}


// Kimi-K2's published config (MoE keys): DeepSeek-V3's architecture under model_type "kimi_k2".
const char* kKimiK2 = R"({"model_type":"kimi_k2","architectures":["DeepseekV3ForCausalLM"],"hidden_size":7168,
  "intermediate_size":18432,"moe_intermediate_size":2048,"n_routed_experts":384,"n_shared_experts":1,
  "num_experts_per_tok":8,"topk_method":"noaux_tc","n_group":1,"topk_group":1,"routed_scaling_factor":2.827,
  "norm_topk_prob":true,"scoring_func":"sigmoid","first_k_dense_replace":1,"moe_layer_freq":1,
  "num_hidden_layers":61,"num_nextn_predict_layers":0})";

TEST(ModelTypeAlias, KimiK2RunsAsDeepseekV3) {
  const ModelConfig k = parse_model_config(kKimiK2, "dir/config.json");
  EXPECT_EQ(k.arch, Arch::DeepseekV3);
  EXPECT_EQ(k.model_type, "kimi_k2");
  const std::string as_v3 = with_key(kKimiK2, "model_type", "deepseek_v3");
  expect_same_spec(k.layer_spec(1), parse_model_config(as_v3, "dir/config.json").layer_spec(1));
  EXPECT_EQ(k.layer_spec(1).routing.num_experts, 384);
  EXPECT_EQ(k.layer_kind(0), LayerKind::Dense);
  // the refusal lists it
  const std::string err = parse_error(with_key(kKimiK2, "model_type", "kimi_k3"));
  EXPECT_NE(err.find("kimi_k2 (as deepseek_v3)"), std::string::npos) << err;
}

TEST(ModelTypeAlias, KimiK2CheckpointInspectsAndRuns) {
  test::ScratchDir d;
  SynthOptions o = test::synth_opts(d / "m", Arch::DeepseekV3, Format::GptqV2);
  o.compressed_tensors = true;  // Kimi-K2-Thinking ships compressed-tensors int4
  synth_checkpoint(o);
  test::write_file(o.dir + "/config.json", with_key(test::read_file(o.dir + "/config.json"), "model_type", "kimi_k2"));
  test::expect_inspects_and_runs(o.dir, d.path(), "architecture: deepseek_v3 (model_type kimi_k2)");
}

}  // namespace
}  // namespace wna16
