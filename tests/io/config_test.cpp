// config.json and quantization-config parsing: the published configs of the real models, layer
// rules, routing mapping, every key variant and every refusal (with its message).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>

#include "io_test_util.h"
#include "wna16/checkpoint.h"
#include "wna16/error.h"

namespace wna16 {
namespace {

using test::expect_same_spec;

// The MoE-relevant keys of the published config.json files (values as on the Hugging Face hub).
const char* kMixtral = R"({"architectures":["MixtralForCausalLM"],"model_type":"mixtral","hidden_size":4096,
  "intermediate_size":14336,"num_hidden_layers":32,"num_local_experts":8,"num_experts_per_tok":2,
  "sliding_window":null,"torch_dtype":"bfloat16"})";
const char* kQwen15 = R"({"model_type":"qwen2_moe","hidden_size":2048,"intermediate_size":5632,
  "moe_intermediate_size":1408,"shared_expert_intermediate_size":5632,"num_experts":60,"num_experts_per_tok":4,
  "norm_topk_prob":false,"decoder_sparse_step":1,"num_hidden_layers":24})";
const char* kQwen3 = R"({"model_type":"qwen3_moe","hidden_size":2048,"intermediate_size":6144,
  "moe_intermediate_size":768,"num_experts":128,"num_experts_per_tok":8,"norm_topk_prob":true,
  "decoder_sparse_step":1,"mlp_only_layers":[],"num_hidden_layers":48})";
const char* kDsV2Lite = R"({"model_type":"deepseek_v2","hidden_size":2048,"intermediate_size":10944,
  "moe_intermediate_size":1408,"n_routed_experts":64,"n_shared_experts":2,"num_experts_per_tok":6,
  "topk_method":"greedy","n_group":1,"topk_group":1,"routed_scaling_factor":1.0,"norm_topk_prob":false,
  "scoring_func":"softmax","first_k_dense_replace":1,"moe_layer_freq":1,"num_hidden_layers":27})";
const char* kDsV3 = R"({"model_type":"deepseek_v3","hidden_size":7168,"intermediate_size":18432,
  "moe_intermediate_size":2048,"n_routed_experts":256,"n_shared_experts":1,"num_experts_per_tok":8,
  "topk_method":"noaux_tc","n_group":8,"topk_group":4,"routed_scaling_factor":2.5,"norm_topk_prob":true,
  "scoring_func":"sigmoid","first_k_dense_replace":3,"moe_layer_freq":1,"num_hidden_layers":61,
  "num_nextn_predict_layers":1})";

TEST(ModelConfig, RealConfigsMatchThePresets) {
  expect_same_spec(parse_model_config(kMixtral, "c").layer_spec(0), preset("mixtral-8x7b"));
  expect_same_spec(parse_model_config(kQwen15, "c").layer_spec(0), preset("qwen1.5-moe-a2.7b"));
  expect_same_spec(parse_model_config(kQwen3, "c").layer_spec(47), preset("qwen3-30b-a3b"));
  expect_same_spec(parse_model_config(kDsV2Lite, "c").layer_spec(1), preset("deepseek-v2-lite"));
  expect_same_spec(parse_model_config(kDsV3, "c").layer_spec(3), preset("deepseek-v3"));
}

TEST(ModelConfig, LayerKinds) {
  auto v2 = parse_model_config(kDsV2Lite, "c");
  EXPECT_EQ(v2.layer_kind(0), LayerKind::Dense);
  EXPECT_EQ(v2.layer_kind(1), LayerKind::Moe);
  EXPECT_EQ(v2.layer_kind(26), LayerKind::Moe);
  EXPECT_THROW(v2.layer_kind(27), Error);
  auto v3 = parse_model_config(kDsV3, "c");
  for (int L = 0; L < 3; ++L) EXPECT_EQ(v3.layer_kind(L), LayerKind::Dense);
  EXPECT_EQ(v3.layer_kind(3), LayerKind::Moe);
  EXPECT_EQ(v3.layer_kind(60), LayerKind::Moe);
  EXPECT_EQ(v3.layer_kind(61), LayerKind::Mtp);  // the multi-token-prediction layer
  EXPECT_EQ(v3.total_layers(), 62);
  try {
    v3.layer_spec(2);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dense MLP layer"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("first_k_dense_replace=3"), std::string::npos) << e.what();
  }
  auto q = parse_model_config(R"({"model_type":"qwen2_moe","hidden_size":64,"moe_intermediate_size":32,
    "shared_expert_intermediate_size":0,"num_experts":4,"num_experts_per_tok":2,"num_hidden_layers":6,
    "decoder_sparse_step":2,"mlp_only_layers":[3]})", "c");
  std::vector<LayerKind> kinds;
  for (int L = 0; L < 6; ++L) kinds.push_back(q.layer_kind(L));
  EXPECT_EQ(kinds, (std::vector<LayerKind>{LayerKind::Dense, LayerKind::Moe, LayerKind::Dense, LayerKind::Dense,
                                           LayerKind::Dense, LayerKind::Moe}));
  EXPECT_EQ(q.layer_spec(1).shared_kind, SharedExpertKind::None);  // width 0: no shared expert
  auto v2f = parse_model_config(R"({"model_type":"deepseek_v2","hidden_size":64,"moe_intermediate_size":32,
    "n_routed_experts":4,"num_experts_per_tok":2,"num_hidden_layers":6,"first_k_dense_replace":1,"moe_layer_freq":2})", "c");
  EXPECT_EQ(v2f.layer_kind(1), LayerKind::Dense);
  EXPECT_EQ(v2f.layer_kind(2), LayerKind::Moe);
  EXPECT_EQ(v2f.mlp_prefix(2), "model.layers.2.mlp");
  EXPECT_EQ(parse_model_config(kMixtral, "c").mlp_prefix(5), "model.layers.5.block_sparse_moe");
}

TEST(ModelConfig, DeepseekV2RoutingVariants) {
  // DeepSeek-V2 (full): group_limited_greedy, no renormalisation, scaled by 16.
  auto c = parse_model_config(R"({"model_type":"deepseek_v2","hidden_size":5120,"moe_intermediate_size":1536,
    "n_routed_experts":160,"n_shared_experts":2,"num_experts_per_tok":6,"topk_method":"group_limited_greedy",
    "n_group":8,"topk_group":3,"routed_scaling_factor":16.0,"norm_topk_prob":false,"num_hidden_layers":60,
    "first_k_dense_replace":1})", "c");
  auto r = c.routing();
  EXPECT_EQ(r.method, RoutingMethod::GroupLimitedGreedy);
  EXPECT_EQ(r.n_group, 8);
  EXPECT_EQ(r.topk_group, 3);
  EXPECT_FALSE(r.renormalize);
  EXPECT_DOUBLE_EQ(r.routed_scaling_factor, 16.0);
  // DeepSeek's own default spelling "gready" is greedy; top-1 never renormalises (V2 rule).
  auto g = parse_model_config(R"({"model_type":"deepseek_v2","hidden_size":64,"moe_intermediate_size":32,
    "n_routed_experts":4,"num_experts_per_tok":1,"topk_method":"gready","norm_topk_prob":true,"num_hidden_layers":2})", "c");
  EXPECT_EQ(g.routing().n_group, 1);
  EXPECT_FALSE(g.routing().renormalize);
}

std::string config_error(const std::string& text) {
  try {
    parse_model_config(text, "dir/config.json");
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

TEST(ModelConfig, Refusals) {
  auto has = [](const std::string& msg, const std::string& text) {
    EXPECT_NE(msg.find(text), std::string::npos) << msg;
    EXPECT_NE(msg.find("dir/config.json"), std::string::npos) << msg;
  };
  has(config_error(R"({"model_type":"llama","hidden_size":64})"), "\"llama\" is not a supported MoE architecture");
  has(config_error(R"({"hidden_size":64})"), "model_type is missing");
  has(config_error(R"({"model_type":"mixtral","hidden_size":"64"})"), "hidden_size = \"64\" is not an integer");
  has(config_error(R"({"model_type":"mixtral","hidden_size":64,"num_hidden_layers":2,"intermediate_size":32,
    "num_local_experts":2,"num_experts_per_tok":3})"), "num_experts_per_tok=3 is more than the 2 experts");
  has(config_error(R"({"model_type":"mixtral","hidden_size":64,"num_hidden_layers":2,"intermediate_size":32,
    "num_local_experts":2})"), "num_experts_per_tok is missing");
  has(config_error(R"({"model_type":"deepseek_v3","hidden_size":64,"moe_intermediate_size":32,"n_routed_experts":8,
    "num_experts_per_tok":2,"num_hidden_layers":2,"topk_method":"greedy"})"), "expected noaux_tc");
  has(config_error(R"({"model_type":"deepseek_v2","hidden_size":64,"moe_intermediate_size":32,"n_routed_experts":8,
    "num_experts_per_tok":2,"num_hidden_layers":2,"scoring_func":"sigmoid"})"), "expected softmax");
  has(config_error(R"({"model_type":"mixtral","hidden_size":-4})"), "out of range");
  has(config_error("{\"model_type\":\"mixtral\",\"model_type\":\"mixtral\"}"), "duplicate key");
  has(config_error("not json"), "invalid JSON");
}

// ---- quantization config --------------------------------------------------------------------

QuantConfig qc(const std::string& text, const std::string& kind = "quantization_config") {
  return parse_quant_config(text, "dir/config.json", kind);
}

std::string quant_error(const std::string& text, const std::string& kind = "quantization_config") {
  try {
    qc(text, kind);
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

TEST(QuantConfig, GptqVariants) {
  auto q = qc(R"({"quant_method":"gptq","bits":4,"group_size":-1,"desc_act":true,"sym":true,"damp_percent":0.1})");
  EXPECT_EQ(q.method, QuantMethod::Gptq);
  EXPECT_EQ(q.scheme.format, Format::GptqV1);
  EXPECT_EQ(q.scheme.bits, 4);
  EXPECT_EQ(q.scheme.group_size, -1);
  EXPECT_TRUE(q.scheme.act_order);
  EXPECT_TRUE(q.scheme.sym);
  auto v2 = qc(R"({"quant_method":"gptq","bits":8,"group_size":128,"sym":false,"checkpoint_format":"gptq_v2"})");
  EXPECT_EQ(v2.scheme.format, Format::GptqV2);
  EXPECT_EQ(v2.scheme.bits, 8);
  EXPECT_FALSE(v2.scheme.sym);
  EXPECT_FALSE(v2.scheme.act_order);
  // GPTQModel's quantize_config.json spells it "format"; AutoGPTQ's old file has no quant_method.
  EXPECT_EQ(qc(R"({"bits":4,"group_size":64,"format":"gptq_v2"})", "quantize_config.json").scheme.format, Format::GptqV2);
  EXPECT_EQ(qc(R"({"bits":4,"group_size":128})", "quantize_config.json").method, QuantMethod::Gptq);
  EXPECT_NE(quant_error(R"({"bits":4,"group_size":128})"), "");  // config.json needs quant_method
}

TEST(QuantConfig, AwqVariants) {
  auto q = qc(R"({"quant_method":"awq","zero_point":true,"group_size":128,"bits":4,"version":"GEMM",
    "modules_to_not_convert":["gate"]})");
  EXPECT_EQ(q.method, QuantMethod::Awq);
  EXPECT_EQ(q.scheme.format, Format::Awq);
  EXPECT_FALSE(q.scheme.sym);
  // AutoAWQ's substring rule: "gate" also matches gate_proj.
  EXPECT_FALSE(q.scheme_for("model.layers.0.block_sparse_moe.gate").has_value());
  EXPECT_FALSE(q.scheme_for("model.layers.0.mlp.experts.0.gate_proj").has_value());
  EXPECT_TRUE(q.scheme_for("model.layers.0.block_sparse_moe.experts.0.w1").has_value());
  // Old AutoAWQ quant_config.json keys.
  auto old = qc(R"({"zero_point":true,"q_group_size":64,"w_bit":4,"version":"gemm"})", "quant_config.json");
  EXPECT_EQ(old.method, QuantMethod::Awq);
  EXPECT_EQ(old.scheme.group_size, 64);
  EXPECT_EQ(old.scheme.bits, 4);
}

TEST(QuantConfig, DynamicOverrides) {
  auto q = qc(R"({"quant_method":"gptq","bits":4,"group_size":128,"sym":true,"desc_act":false,
    "dynamic":{"-:.*\\.shared_expert\\..*":{},
               "+:.*\\.experts\\.1\\..*":{"bits":8,"group_size":64},
               ".*\\.experts\\.2\\..*":{"desc_act":true,"sym":false},
               ".*":{"bits":8}}})");
  ASSERT_EQ(q.dynamic.size(), 4u);
  EXPECT_FALSE(q.scheme_for("model.layers.0.mlp.shared_expert.up_proj").has_value());
  auto e1 = q.scheme_for("model.layers.0.mlp.experts.1.up_proj");
  ASSERT_TRUE(e1);
  EXPECT_EQ(e1->bits, 8);
  EXPECT_EQ(e1->group_size, 64);
  auto e2 = q.scheme_for("model.layers.0.mlp.experts.2.up_proj");
  ASSERT_TRUE(e2);
  EXPECT_EQ(e2->bits, 4) << "first matching rule wins, file order";
  EXPECT_TRUE(e2->act_order);
  EXPECT_FALSE(e2->sym);
  // re.match anchors at the start: "experts" alone does not match a name starting with "model".
  auto r = qc(R"({"quant_method":"gptq","bits":4,"group_size":128,"dynamic":{"-:experts":{}}})");
  EXPECT_TRUE(r.scheme_for("model.layers.0.mlp.experts.0.up_proj").has_value());
}

TEST(QuantConfig, Refusals) {
  auto has = [](const std::string& msg, const std::string& text) {
    EXPECT_NE(msg.find(text), std::string::npos) << msg;
    EXPECT_NE(msg.find("dir/config.json"), std::string::npos) << msg;
  };
  has(quant_error(R"({"quant_method":"gptq","bits":4,"group_size":128,"checkpoint_format":"marlin"})"),
      "checkpoint_format = \"marlin\" is not supported");
  has(quant_error(R"({"quant_method":"gptq","bits":4,"group_size":128,"is_marlin_format":true})"), "Marlin");
  has(quant_error(R"({"quant_method":"awq","bits":4,"group_size":128,"version":"gemv"})"), "version = \"gemv\" is not supported");
  has(quant_error(R"({"quant_method":"awq","bits":4,"group_size":128,"version":"GEMV_FAST"})"), "\"gemv_fast\"");
  has(quant_error(R"({"quant_method":"awq","bits":4,"group_size":128,"version":"marlin"})"), "\"marlin\"");
  has(quant_error(R"({"quant_method":"awq","bits":8,"group_size":128})"), "4-bit only");
  has(quant_error(R"({"quant_method":"awq","bits":4,"group_size":128,"zero_point":false})"), "zero_point = false");
  has(quant_error(R"({"quant_method":"gptq","bits":3,"group_size":128})"), "bits = 3");
  has(quant_error(R"({"quant_method":"gptq","bits":3,"group_size":128})"), "support 4 and 8 bits only");
  has(quant_error(R"({"quant_method":"gptq","bits":16,"group_size":128})"), "bits = 16");
  has(quant_error(R"({"quant_method":"gptq","bits":4,"group_size":0})"), "group_size = 0");
  has(quant_error(R"({"quant_method":"fp8"})"), "quant_method = \"fp8\" is not supported");
  has(quant_error(R"({"quant_method":"gptq","bits":4,"group_size":128,"dynamic":{"+:(":{}}})"), "not a regular expression");
  has(quant_error(R"({"quant_method":"gptq","bits":4,"group_size":128,"dynamic":{"a{1000}{1000}":{}}})"), "counted repetitions");
  has(quant_error(R"({"quant_method":"gptq","bits":4,"group_size":128,"dynamic":{".*":{"bits":2}}})"), "bits = 2");
  // Found by the config fuzzer: libstdc++'s regex compiler overflows on a huge backreference number.
  has(quant_error(R"({"quant_method":"gptq","bits":4,"group_size":128,"dynamic":{"-:a\\66666666666666666666":{}}})"),
      "backreferences");
}

// Found by the config fuzzer (scripts/fuzz 900 on 3866c77; tests/data/fuzz/config/
// regress_regex_repeat_count_overflow.json): a `dynamic` key with "{7777...5554" and no closing
// brace overflowed a long inside libstdc++'s std::regex compiler (UBSan). RE2 reads the unclosed
// brace as literal text, as Python re does; the rule's value (64) is then refused, naming the pattern.
TEST(QuantConfig, RegexRepeatCountOverflowInput) {
  const std::string input = R"({"quant_meth/ot":"gptq","bits":4,"group_size":835,"dynamic":{"-]j.*\\.shared_expk,z,,,,,,{77777777777777777555555545554":64,"moe_intermediate_size":64,
"shared_expert_intermediate_size":65,"numYexpe777777at[":{"desc_ac!":true}}})";
  EXPECT_NE(quant_error(input).find("quant_method is missing"), std::string::npos) << quant_error(input);
  const std::string msg = quant_error(input, "quantize_config.json");
  EXPECT_NE(msg.find("shared_expk,z,,,,,,{77777777777777777555555545554\"] is not an object of overrides"), std::string::npos) << msg;
  // With overrides, the same pattern (no "-:" prefix: a positive rule) compiles and matches its
  // braces literally, from the start.
  auto q = qc(R"({"quant_method":"gptq","bits":4,"group_size":128,
    "dynamic":{"-]j.*\\.shared_expk,z,,,,,,{77777777777777777555555545554":{"bits":8}}})");
  EXPECT_EQ(q.scheme_for("-]jx.y.shared_expk,z,,,,,,{77777777777777777555555545554.up_proj")->bits, 8);
  EXPECT_EQ(q.scheme_for("-]jx.y.shared_expk,z,,,,,,{7777777777777777755555554555").value().bits, 4);
  EXPECT_EQ(q.scheme_for("model.-]jx.y.shared_expk,z,,,,,,{77777777777777777555555545554").value().bits, 4);
}

// A pattern that makes a backtracking engine take exponential time on a long name runs in linear
// time: RE2 builds an automaton and never backtracks.
TEST(QuantConfig, DynamicMatchingIsLinearTime) {
  auto q = qc(R"({"quant_method":"gptq","bits":4,"group_size":128,"dynamic":{"(.*)*x":{"bits":8}}})");
  for (const char last : {'a', 'x'}) {
    std::string name(10000, 'a');
    name.back() = last;
    const auto t0 = std::chrono::steady_clock::now();
    const auto s = q.scheme_for(name);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("(.*)*x against a 10,000-character name ending in '%c': %.3f ms\n", last, ms);
    EXPECT_LT(ms, 10.0);
    ASSERT_TRUE(s);
    EXPECT_EQ(s->bits, last == 'x' ? 8 : 4);
  }
}

ModulePattern pat(const std::string& re) { return ModulePattern::compile(re, "rule " + re); }

std::string pattern_error(const std::string& re) {
  try {
    pat(re);
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

// Python re.match semantics: anchored at the start only, Python spellings RE2 reads differently
// rewritten, constructs without linear-time matching refused naming the pattern and the construct.
TEST(ModulePattern, PythonReMatch) {
  EXPECT_FALSE(ModulePattern().matches("anything"));
  EXPECT_EQ(pat("model").source(), "model");
  EXPECT_TRUE(pat("model").matches("model.layers.0.mlp"));  // free to end anywhere
  EXPECT_FALSE(pat("experts").matches("model.layers.0.mlp.experts.0.up_proj"));  // anchored at 0
  EXPECT_TRUE(pat(R"(.*\.experts\.\d+\.(gate|up)_proj$)").matches("model.layers.1.mlp.experts.12.up_proj"));
  EXPECT_FALSE(pat(R"(.*\.experts\.\d+\.(gate|up)_proj$)").matches("model.layers.1.mlp.experts.12.down_proj"));
  EXPECT_TRUE(pat(R"((?P<layer>model\.layers\.[0-9]+)\..*)").matches("model.layers.7.mlp"));
  EXPECT_TRUE(pat("(?i)MODEL").matches("model.x"));
  // \Z is Python's end of string (RE2 spells it \z).
  EXPECT_TRUE(pat(R"(.*experts\.0\Z)").matches("model.experts.0"));
  EXPECT_FALSE(pat(R"(.*experts\.0\Z)").matches("model.experts.0.up_proj"));
  // {,n} is Python's {0,n} (RE2 alone would read the braces literally).
  EXPECT_TRUE(pat("a{,2}b").matches("aab"));
  EXPECT_TRUE(pat("a{,2}b").matches("b"));
  EXPECT_FALSE(pat("a{,2}b").matches("aaab"));
  EXPECT_FALSE(pat("a{,2}b").matches("a{,2}b"));
  EXPECT_TRUE(pat("[{,2}]").matches(","));  // inside a class, literal
  EXPECT_TRUE(pat(R"(\101)").matches("A"));  // three octal digits: a character in both
  EXPECT_TRUE(pat("a{").matches("a{"));       // an unclosed brace is literal, as in Python
  EXPECT_TRUE(pat("[(?=]x").matches("=x"));   // "(?=" inside a class is no lookahead

  auto refused = [](const std::string& re, const std::string& what) {
    const std::string msg = pattern_error(re);
    EXPECT_NE(msg.find("rule " + re + ": "), std::string::npos) << re << " -> " << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << re << " -> " << msg;
  };
  refused(R"((a)\1)", "backreferences (here \\1)");
  refused(R"((a)\12)", "backreferences (here \\12)");
  refused(R"((?P<e>a)(?P=e))", "backreferences (here (?P=...))");
  refused(".*(?=gate)", "the lookahead (?=...)");
  refused(".*(?!gate)", "the lookahead (?!...)");
  refused("(?<=a)b", "the lookbehind (?<=...)");
  refused("(?<!a)b", "the lookbehind (?<!...)");
  refused("(?>a)", "the atomic group");
  refused("(a)?(?(1)b|c)", "the conditional group");
  refused("a*+", "a repetition applied to a repetition");
  refused("a{1000}{1000}", "counted repetitions");
  refused("a{1001}", "counted repetitions");
  refused("(", "not a regular expression");
  refused("(?x)a b", "not a regular expression");
  refused(R"(\477)", "above \\377");
  refused(std::string(1001, 'a'), "pattern longer than 1000 characters");
  EXPECT_NE(pattern_error("a\xff").find("not valid UTF-8"), std::string::npos) << pattern_error("a\xff");
}

}  // namespace
}  // namespace wna16
