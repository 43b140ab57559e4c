// The MoE families beyond the first five: GLM-4.5 (glm4_moe), Qwen3-Next (qwen3_next), DeepSeek-V3
// under another model_type (deepseek_v32), and Llama 4, refused by name. For each accepted family:
// its published config in the transformers 4.x and 5.x spellings, dense-layer placement, the shared
// expert, the routing, the bench preset, and a synth'd checkpoint through inspect and run --check.
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
using OJ = nlohmann::ordered_json;
constexpr auto parse = test::parse_config;
constexpr auto parse_error = test::config_error;

// MoE-relevant keys of the published config.json files (Hugging Face Hub).
const char* kGlm45Air = R"({"architectures":["Glm4MoeForCausalLM"],"model_type":"glm4_moe","hidden_size":4096,
  "intermediate_size":10944,"moe_intermediate_size":1408,"n_routed_experts":128,"n_shared_experts":1,
  "num_experts_per_tok":8,"n_group":1,"topk_group":1,"routed_scaling_factor":1.0,"norm_topk_prob":true,
  "first_k_dense_replace":1,"num_hidden_layers":46,"num_nextn_predict_layers":1,"partial_rotary_factor":0.5,
  "use_qk_norm":false})";
const char* kGlm45 = R"({"architectures":["Glm4MoeForCausalLM"],"model_type":"glm4_moe","hidden_size":5120,
  "intermediate_size":12288,"moe_intermediate_size":1536,"n_routed_experts":160,"n_shared_experts":1,
  "num_experts_per_tok":8,"n_group":1,"topk_group":1,"routed_scaling_factor":2.5,"norm_topk_prob":true,
  "first_k_dense_replace":3,"num_hidden_layers":92,"num_nextn_predict_layers":1,"use_qk_norm":true})";
const char* kQwen3Next = R"({"architectures":["Qwen3NextForCausalLM"],"model_type":"qwen3_next","hidden_size":2048,
  "intermediate_size":5120,"moe_intermediate_size":512,"shared_expert_intermediate_size":512,"num_experts":512,
  "num_experts_per_tok":10,"norm_topk_prob":true,"decoder_sparse_step":1,"mlp_only_layers":[],
  "num_hidden_layers":48,"full_attention_interval":4})";

// ---- GLM-4.5 ----------------------------------------------------------------------------------

TEST(Glm4Moe, PublishedConfigIsThePreset) {
  const ModelConfig c = parse(kGlm45Air);
  EXPECT_EQ(c.arch, Arch::Glm4Moe);
  expect_same_spec(c.layer_spec(1), preset("glm-4.5-air"));
  const MoeLayerSpec s = c.layer_spec(45);
  EXPECT_EQ(s.routing.method, RoutingMethod::NoauxTc);
  EXPECT_EQ(s.shared_kind, SharedExpertKind::Plain);
  EXPECT_EQ(s.shared_inter, 1408);
  const MoeLayerSpec big = parse(kGlm45).layer_spec(3);
  EXPECT_EQ(big.routing.num_experts, 160);
  EXPECT_EQ(big.routing.routed_scaling_factor, 2.5);
  EXPECT_EQ(big.inter, 1536);
  EXPECT_EQ(big.shared_inter, 1536);
}

TEST(Glm4Moe, DenseLayersAndMtp) {
  const ModelConfig c = parse(kGlm45);
  for (int L = 0; L < 3; ++L) EXPECT_EQ(c.layer_kind(L), LayerKind::Dense) << L;
  EXPECT_EQ(c.layer_kind(3), LayerKind::Moe);
  EXPECT_EQ(c.layer_kind(91), LayerKind::Moe);
  EXPECT_EQ(c.layer_kind(92), LayerKind::Mtp);  // the MTP layer the checkpoints ship as model.layers.92
  EXPECT_EQ(c.total_layers(), 93);
  EXPECT_NE(c.moe_layer_rule().find("first_k_dense_replace=3"), std::string::npos) << c.moe_layer_rule();
  EXPECT_EQ(c.mlp_prefix(5), "model.layers.5.mlp");
  try {
    c.layer_spec(2);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("glm4_moe"), std::string::npos) << e.what();
  }
}

TEST(Glm4Moe, Glm4MoeConfigDefaults) {
  // Absent keys take Glm4MoeConfig's defaults: n_shared_experts 1, first_k_dense_replace 1,
  // routed_scaling_factor 1.0, norm_topk_prob true, n_group = topk_group = 1, no MTP layer.
  const ModelConfig c = parse(R"({"model_type":"glm4_moe","hidden_size":256,"moe_intermediate_size":128,
    "n_routed_experts":16,"num_experts_per_tok":4,"num_hidden_layers":3})");
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.layer_kind(0), LayerKind::Dense);
  EXPECT_EQ(c.layer_kind(1), LayerKind::Moe);
  EXPECT_EQ(c.total_layers(), 3);
  const MoeLayerSpec s = c.layer_spec(1);
  EXPECT_EQ(s.routing.routed_scaling_factor, 1.0);
  EXPECT_TRUE(s.routing.renormalize);
  EXPECT_EQ(s.routing.n_group, 1);
  EXPECT_EQ(s.shared_inter, 128);
  // n_shared_experts 0: no shared expert.
  EXPECT_EQ(parse(with_key(kGlm45Air, "n_shared_experts", 0)).layer_spec(1).shared_kind, SharedExpertKind::None);
}

// transformers 5 Glm4MoeConfig.attribute_map {"num_local_experts": "n_routed_experts"}
TEST(Glm4Moe, Transformers5Spelling) {
  const ModelConfig want = parse(kGlm45Air);
  const ModelConfig v5 = parse(rename_key(kGlm45Air, "n_routed_experts", "num_local_experts"));
  EXPECT_EQ(v5.num_experts, 128);
  expect_same_spec(v5.layer_spec(1), want.layer_spec(1));
  const std::string msg = parse_error(with_key(kGlm45Air, "num_local_experts", 64));
  EXPECT_NE(msg.find("n_routed_experts = 128 and num_local_experts = 64 disagree"), std::string::npos) << msg;
  const std::string missing = parse_error(without_key(kGlm45Air, "n_routed_experts"));
  EXPECT_NE(missing.find("n_routed_experts (or num_local_experts) is missing"), std::string::npos) << missing;
  // DeepSeek-V3's other 5.x alias is not Glm4MoeConfig's: num_mtp_layers stays an unknown key.
  EXPECT_EQ(parse(with_key(without_key(kGlm45Air, "num_nextn_predict_layers"), "num_mtp_layers", 1)).total_layers(), 46);
}

TEST(Glm4Moe, BadValuesAreNamed) {
  std::string msg = parse_error(with_key(kGlm45Air, "n_group", 3));
  EXPECT_NE(msg.find("n_group=3"), std::string::npos) << msg;
  msg = parse_error(with_key(kGlm45Air, "routed_scaling_factor", "2.5"));
  EXPECT_NE(msg.find("routed_scaling_factor = \"2.5\" is not a number"), std::string::npos) << msg;
}

// ---- Qwen3-Next -------------------------------------------------------------------------------

TEST(Qwen3Next, PublishedConfigIsThePreset) {
  const ModelConfig c = parse(kQwen3Next);
  EXPECT_EQ(c.arch, Arch::Qwen3Next);
  expect_same_spec(c.layer_spec(0), preset("qwen3-next-80b-a3b"));
  const MoeLayerSpec s = c.layer_spec(47);
  EXPECT_EQ(s.routing.method, RoutingMethod::SoftmaxTopK);
  EXPECT_TRUE(s.routing.renormalize);
  EXPECT_EQ(s.shared_kind, SharedExpertKind::SigmoidGated);
  EXPECT_EQ(s.shared_inter, 512);
  // Qwen3NextConfig's default norm_topk_prob is true (Qwen2-MoE's and Qwen3-MoE's: false).
  EXPECT_TRUE(parse(without_key(kQwen3Next, "norm_topk_prob")).layer_spec(0).routing.renormalize);
}

TEST(Qwen3Next, DenseLayerPlacement) {
  const ModelConfig c = parse(with_key(with_key(kQwen3Next, "decoder_sparse_step", 2), "mlp_only_layers", OJ::array({3})));
  EXPECT_EQ(c.layer_kind(0), LayerKind::Dense);
  EXPECT_EQ(c.layer_kind(1), LayerKind::Moe);
  EXPECT_EQ(c.layer_kind(3), LayerKind::Dense);  // in mlp_only_layers
  EXPECT_EQ(c.layer_kind(5), LayerKind::Moe);
  EXPECT_EQ(c.total_layers(), 48);  // the mtp.* weights are not decoder layers
  EXPECT_EQ(c.mlp_prefix(1), "model.layers.1.mlp");
}

TEST(Qwen3Next, Transformers5SpellingIsTheSame) {
  // Qwen3NextConfig declares no attribute_map in 4.x or 5.x: the keys are num_experts etc. in both,
  // and a num_local_experts key is not read as the expert count.
  const std::string msg = parse_error(rename_key(kQwen3Next, "num_experts", "num_local_experts"));
  EXPECT_NE(msg.find("dir/config.json: num_experts is missing"), std::string::npos) << msg;
  const std::string shared = parse_error(without_key(kQwen3Next, "shared_expert_intermediate_size"));
  EXPECT_NE(shared.find("shared_expert_intermediate_size is missing"), std::string::npos) << shared;
}

// ---- DeepSeek-V3 under another model_type; Llama 4 ---------------------------------------------

TEST(Families, DeepseekV32RunsAsDeepseekV3) {
  const char* v32 = R"({"architectures":["DeepseekV32ForCausalLM"],"model_type":"deepseek_v32","hidden_size":7168,
    "intermediate_size":18432,"moe_intermediate_size":2048,"n_routed_experts":256,"n_shared_experts":1,
    "num_experts_per_tok":8,"topk_method":"noaux_tc","n_group":8,"topk_group":4,"routed_scaling_factor":2.5,
    "norm_topk_prob":true,"scoring_func":"sigmoid","first_k_dense_replace":3,"moe_layer_freq":1,
    "num_hidden_layers":61,"num_nextn_predict_layers":1,"index_topk":2048})";
  const ModelConfig c = parse(v32);
  EXPECT_EQ(c.arch, Arch::DeepseekV3);
  EXPECT_EQ(c.model_type, "deepseek_v32");
  expect_same_spec(c.layer_spec(3), preset("deepseek-v3"));
  EXPECT_EQ(c.layer_kind(61), LayerKind::Mtp);
}

TEST(Families, Llama4IsRefusedNamingTheFeature) {
  const char* scout = R"({"architectures":["Llama4ForConditionalGeneration"],"model_type":"llama4",
    "text_config":{"model_type":"llama4_text","hidden_size":5120,"intermediate_size":8192,
    "intermediate_size_mlp":16384,"num_local_experts":16,"num_experts_per_tok":1,"interleave_moe_layer_step":1,
    "num_hidden_layers":48}})";
  for (const std::string& text : {std::string(scout), OJ::parse(scout)["text_config"].dump()}) {
    const std::string msg = parse_error(text);
    EXPECT_NE(msg.find("dir/config.json: model_type \"llama4"), std::string::npos) << msg;
    EXPECT_NE(msg.find("scales each routed expert's input by its sigmoid router score"), std::string::npos) << msg;
  }
  test::ScratchDir d;
  auto r = test::run_cli("synth " + (d / "m") + " --arch llama4 --format gptq");
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("llama4"), std::string::npos) << r.err;
}

TEST(Families, UnknownModelTypeListsTheNewFamilies) {
  const std::string msg = parse_error(with_key(kGlm45Air, "model_type", "glm5"));
  EXPECT_NE(msg.find("glm4_moe"), std::string::npos) << msg;
  EXPECT_NE(msg.find("qwen3_next"), std::string::npos) << msg;
  EXPECT_NE(msg.find("deepseek_v32 (as deepseek_v3)"), std::string::npos) << msg;
}

// ---- synth'd checkpoints ----------------------------------------------------------------------

TEST(Families, SynthCheckpointsHaveTheHubTensorNames) {
  struct Want {
    Arch arch;
    std::vector<std::string> present, absent;
  };
  const Want wants[] = {
      {Arch::Glm4Moe,
       {"model.layers.0.mlp.gate_proj.qweight", "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.experts.15.down_proj.qweight",
        "model.layers.1.mlp.shared_experts.up_proj.qweight"},
       {"model.layers.1.mlp.shared_expert_gate.weight"}},
      {Arch::Qwen3Next,
       {"model.layers.0.mlp.gate.weight", "model.layers.1.mlp.experts.15.gate_proj.qweight",
        "model.layers.1.mlp.shared_expert.down_proj.qweight", "model.layers.1.mlp.shared_expert_gate.weight"},
       {"model.layers.1.mlp.gate.e_score_correction_bias"}},
  };
  for (const Want& w : wants) {
    SCOPED_TRACE(arch_name(w.arch));
    test::ScratchDir d;
    synth_checkpoint(test::synth_opts(d.path(), w.arch, Format::GptqV1));
    const Checkpoint ck = Checkpoint::open(d.path());
    for (const auto& n : w.present) EXPECT_TRUE(ck.tensors().has(n)) << n;
    for (const auto& n : w.absent) EXPECT_FALSE(ck.tensors().has(n)) << n;
    EXPECT_TRUE(ck.describe_layer(1).problems.empty());
  }
}

TEST(Families, Glm4CheckpointResavedWithTransformers5SpellingRuns) {
  test::ScratchDir d;
  SynthOptions o = test::synth_opts(d / "m", Arch::Glm4Moe, Format::GptqV2);
  o.compressed_tensors = true;
  synth_checkpoint(o);
  const std::string cfg = o.dir + "/config.json";
  test::write_file(cfg, OJ::parse(rename_key(test::read_file(cfg), "n_routed_experts", "num_local_experts")).dump(2));
  test::expect_inspects_and_runs(o.dir, d.path(), "architecture: glm4_moe");
}

}  // namespace
}  // namespace wna16
