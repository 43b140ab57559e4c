// compressed-tensors pack-quantized checkpoints (llm-compressor): what load_layer returns is
// checked against an independent decoding of the raw weight_packed / weight_scale /
// weight_zero_point / weight_g_idx bytes (the layout of compressed-tensors' pack_quantized.py,
// written out here a second time), over sym/asym, group/channel, actorder none/group/weight and
// 4/8 bits; then the config rules: strategies, actorder spellings, targets and ignore matching.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "io_test_util.h"
#include "wna16/checkpoint.h"
#include "wna16/error.h"
#include "wna16/reference.h"

namespace wna16 {
namespace {

using test::ScratchDir;

// compressed-tensors: weight_packed [N, K*b/32] holds q + 2^(b-1) of the signed code q, value i of
// a word at bits [b*i, b*i+b); weight_zero_point [N*b/32, G] packs the (offset) zero points along
// N the same way; w[n, k] = scale[n, g(k)] * (q - zp), with symmetric zp = 0.
std::vector<double> decode_ct(const Checkpoint& ck, const std::string& m, int64_t K, int64_t N, int b, int64_t group) {
  auto get = [&](const std::string& n) { return ck.tensors().find(m + "." + n); };
  auto pk = get("weight_packed"), sc = get("weight_scale"), zp = get("weight_zero_point"), gi = get("weight_g_idx");
  EXPECT_TRUE(pk.file && sc.file) << m;
  const std::vector<int32_t> packed = read_i32(*pk.file, *pk.info);
  const std::vector<float> scale = read_floats(*sc.file, *sc.info);
  const std::vector<int32_t> zeros = zp.file ? read_i32(*zp.file, *zp.info) : std::vector<int32_t>{};
  const std::vector<int32_t> g_idx = gi.file ? read_i32(*gi.file, *gi.info) : std::vector<int32_t>{};
  const int pack = 32 / b, offset = 1 << (b - 1);
  const int64_t G = group > 0 ? K / group : 1;
  const uint32_t mask = (1u << b) - 1;
  std::vector<double> w(size_t(K * N));  // [K, N], as dequantize() returns it
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t g = !g_idx.empty() ? g_idx[size_t(k)] : group > 0 ? k / group : 0;
      const int q = int((uint32_t(packed[size_t(n * (K / pack) + k / pack)]) >> (b * (k % pack))) & mask) - offset;
      const int z = zeros.empty() ? 0 : int((uint32_t(zeros[size_t((n / pack) * G + g)]) >> (b * (n % pack))) & mask) - offset;
      w[size_t(k * N + n)] = double(scale[size_t(n * G + g)]) * double(q - z);
    }
  return w;
}

struct CtCase {
  const char* name;
  int bits, group;
  bool asym;
  const char* actorder;  // "", "group", "weight"
};

class CtLoad : public ::testing::TestWithParam<CtCase> {};

TEST_P(CtLoad, LoadedLayerEqualsIndependentDecodeAndRuns) {
  const CtCase& c = GetParam();
  ScratchDir d;
  SynthOptions o = test::synth_opts(d / "m", Arch::Qwen2Moe, Format::GptqV2, c.bits, std::string(c.actorder) == "group", c.asym);
  o.compressed_tensors = true;
  o.actorder_weight = std::string(c.actorder) == "weight";
  o.group_size = c.group;
  synth_checkpoint(o);
  const Checkpoint ck = Checkpoint::open(o.dir);
  EXPECT_EQ(ck.quant().method, QuantMethod::CompressedTensors);
  const std::string pre = "model.layers.1.mlp.";
  const auto expert0 = pre + "experts.0.";
  auto pk = ck.tensors().find(expert0 + "gate_proj.weight_packed");
  ASSERT_TRUE(pk.file);
  EXPECT_EQ(bool(ck.tensors().find(expert0 + "gate_proj.weight_zero_point").file), c.asym);
  EXPECT_EQ(bool(ck.tensors().find(expert0 + "gate_proj.weight_g_idx").file), std::string(c.actorder) == "group");
  auto shape = ck.tensors().find(expert0 + "down_proj.weight_shape");
  ASSERT_TRUE(shape.file);
  EXPECT_EQ(shape.info->dtype, StDtype::I64);

  const MoeLayerSpec spec = ck.config().layer_spec(1);
  const MoeLayerWeights w = ck.load_layer(1);
  struct Lin {
    std::string module;
    const QuantizedLinear* q;
  };
  const Lin lins[] = {{expert0 + "gate_proj", &w.experts[0].gate}, {expert0 + "down_proj", &w.experts[0].down},
                      {pre + "experts.5.up_proj", &w.experts[5].up}, {pre + "shared_expert.down_proj", &w.shared->down}};
  for (const auto& l : lins) {
    SCOPED_TRACE(l.module);
    EXPECT_EQ(l.q->scheme.sym, !c.asym);
    // one group (K = group_size) makes any g_idx trivial: no act-order left to apply
    EXPECT_EQ(l.q->scheme.act_order, std::string(c.actorder) == "group" && l.q->K > c.group);
    EXPECT_EQ(dequantize(*l.q), decode_ct(ck, l.module, l.q->K, l.q->N, c.bits, c.group));
  }
  LayerInfo li = ck.describe_layer(1);
  EXPECT_TRUE(li.problems.empty()) << li.problems.front();
  EXPECT_NE(li.linears[1].storage.find("compressed-tensors " + std::to_string(c.bits) + "-bit"), std::string::npos)
      << li.linears[1].storage;
  EXPECT_EQ(li.linears[0].storage, "dense BF16");  // the router, in ignore

  const std::string x = d / "x.safetensors", y = d / "y.safetensors";
  test::write_random_input(x, 9, spec.hidden, DType::BF16);
  auto r = test::run_cli("run " + o.dir + " --layer 1 --input " + x + " --output " + y + " --device cpu --check");
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("PASSED"), std::string::npos) << r.out;
}

INSTANTIATE_TEST_SUITE_P(Schemes, CtLoad,
                         ::testing::Values(CtCase{"w4_sym_g128", 4, 128, false, ""}, CtCase{"w4_asym_g128", 4, 128, true, ""},
                                           CtCase{"w4_sym_channel", 4, -1, false, ""}, CtCase{"w4_asym_channel", 4, -1, true, ""},
                                           CtCase{"w4_sym_actorder_group", 4, 64, false, "group"},
                                           CtCase{"w4_asym_actorder_group", 4, 128, true, "group"},
                                           CtCase{"w4_asym_actorder_weight", 4, 128, true, "weight"},
                                           CtCase{"w8_sym_channel", 8, -1, false, ""}, CtCase{"w8_asym_g32", 8, 32, true, ""},
                                           CtCase{"w8_sym_actorder_group", 8, 128, false, "group"}),
                         [](const ::testing::TestParamInfo<CtCase>& p) { return std::string(p.param.name); });

// The quantization_config block llm-compressor writes for W4A16, with `weights` and the top level
// patched by the test.
nlohmann::ordered_json ct_config(const nlohmann::ordered_json& weights = {}, const nlohmann::ordered_json& top = {}) {
  nlohmann::ordered_json w = {{"actorder", nullptr}, {"block_structure", nullptr}, {"dynamic", false},
                              {"group_size", 128},   {"num_bits", 4},             {"observer", "minmax"},
                              {"observer_kwargs", nlohmann::ordered_json::object()}, {"strategy", "group"},
                              {"symmetric", true},   {"type", "int"}};
  if (!weights.is_null()) w.update(weights);
  nlohmann::ordered_json q = {
      {"config_groups", {{"group_0", {{"input_activations", nullptr}, {"output_activations", nullptr}, {"targets", {"Linear"}}, {"weights", w}}}}},
      {"format", "pack-quantized"},
      {"global_compression_ratio", nullptr},
      {"ignore", {"lm_head", "re:.*mlp.gate$"}},
      {"kv_cache_scheme", nullptr},
      {"quant_method", "compressed-tensors"},
      {"quantization_status", "compressed"}};
  if (!top.is_null()) q.update(top);
  return q;
}

QuantConfig parse(const nlohmann::ordered_json& j) { return parse_quant_config(j.dump(), "config.json", "quantization_config"); }

void expect_refused(const nlohmann::ordered_json& j, const std::string& msg) {
  try {
    parse(j);
    ADD_FAILURE() << "accepted: " << j.dump();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(msg), std::string::npos) << e.what();
  }
}

TEST(CtConfig, SchemesStrategiesAndActorderSpellings) {
  QuantConfig q = parse(ct_config());
  EXPECT_EQ(q.method, QuantMethod::CompressedTensors);
  ASSERT_EQ(q.ct_groups.size(), 1u);
  EXPECT_EQ(q.ct_groups[0].scheme.bits, 4);
  EXPECT_EQ(q.ct_groups[0].scheme.group_size, 128);
  EXPECT_TRUE(q.ct_groups[0].scheme.sym);
  EXPECT_NE(q.describe().find("compressed-tensors pack-quantized, group_0: 4-bit group 128 sym on [Linear]"), std::string::npos)
      << q.describe();
  // strategy inferred from group_size as quant_args.py does: -1 is channel
  EXPECT_EQ(parse(ct_config({{"strategy", nullptr}, {"group_size", -1}})).ct_groups[0].scheme.group_size, -1);
  EXPECT_EQ(parse(ct_config({{"strategy", "CHANNEL"}, {"group_size", nullptr}, {"num_bits", 8}})).ct_groups[0].scheme.bits, 8);
  const std::pair<nlohmann::ordered_json, std::string> orders[] = {
      {true, "group"}, {false, ""}, {"group", "group"}, {"dynamic", "group"}, {"Weight", "weight"}, {"static", "weight"}, {nullptr, ""}};
  for (const auto& [v, want] : orders) {
    const QuantConfig a = parse(ct_config({{"actorder", v}}));
    EXPECT_EQ(a.ct_groups[0].actorder, want) << v.dump();
    EXPECT_EQ(a.ct_groups[0].scheme.act_order, want == "group") << v.dump();
  }
  EXPECT_FALSE(parse(ct_config({{"symmetric", false}})).ct_groups[0].scheme.sym);
  // per-group format under a mixed-precision top level
  auto mixed = ct_config({}, {{"format", "mixed-precision"}});
  mixed["config_groups"]["group_0"]["format"] = "pack-quantized";
  EXPECT_EQ(parse(mixed).ct_groups.size(), 1u);
}

TEST(CtConfig, RefusalsNameKeyAndValue) {
  expect_refused(ct_config({}, {{"format", "int-quantized"}}), "quantization_config.format = \"int-quantized\" is not supported");
  expect_refused(ct_config({}, {{"format", "marlin-24"}}), "\"marlin-24\" is not supported");
  expect_refused(ct_config({}, {{"format", nullptr}}), "quantization_config.format is missing");
  expect_refused(ct_config({}, {{"format", "mixed-precision"}}), "config_groups.group_0.format is missing");
  expect_refused(ct_config({}, {{"quantization_status", "frozen"}}), "quantization_status = \"frozen\" is not supported");
  expect_refused(ct_config({}, {{"config_groups", nlohmann::ordered_json::object()}}), "config_groups = {} is not a non-empty object");
  expect_refused(ct_config({}, {{"transform_config", {{"config_groups", {{"u", 1}}}}}}), "transform_config");
  expect_refused(ct_config({}, {{"sparsity_config", {{"format", "sparse-24-bitmask"}}}}), "sparsity_config.format = \"sparse-24-bitmask\"");
  expect_refused(ct_config({{"type", "float"}}), "group_0.weights.type = \"float\" is not supported");
  expect_refused(ct_config({{"num_bits", 3}}), "group_0.weights.num_bits = 3");
  expect_refused(ct_config({{"strategy", "tensor"}}), "weights.strategy = \"tensor\" is not supported");
  expect_refused(ct_config({{"strategy", "block"}}), "weights.strategy = \"block\" is not supported");
  expect_refused(ct_config({{"strategy", "group"}, {"group_size", nullptr}}), "strategy = \"group\" needs a positive group_size");
  expect_refused(ct_config({{"strategy", "channel"}, {"group_size", 128}}), "group_size = 128 contradicts strategy \"channel\"");
  expect_refused(ct_config({{"strategy", "channel"}, {"group_size", -1}, {"actorder", "group"}}), "needs strategy \"group\"");
  expect_refused(ct_config({{"actorder", "random"}}), "actorder = \"random\" is not an activation ordering");
  expect_refused(ct_config({{"dynamic", true}}), "weights.dynamic = true is not supported");
  auto act = ct_config();
  act["config_groups"]["group_0"]["input_activations"] = {{"num_bits", 8}, {"type", "int"}};
  expect_refused(act, "group_0.input_activations = {\"num_bits\":8,\"type\":\"int\"} is not supported: wna16 runs weight-only");
  auto dup = ct_config();
  dup["config_groups"]["group_1"] = dup["config_groups"]["group_0"];
  expect_refused(dup, "group_1.targets repeats \"Linear\"");
  auto bad_re = ct_config({}, {{"ignore", {"re:(a)\\1"}}});
  expect_refused(bad_re, "quantization_config.ignore[\"re:(a)\\1\"]: backreferences");
}

// compressed-tensors' match.py: ignore first; then exact name, then "re:" (re.match, anchored at
// the start, free to end anywhere), then class name; unmatched modules stay unquantized.
TEST(CtConfig, TargetsAndIgnoreMatchLikeCompressedTensors) {
  auto j = ct_config({}, {{"ignore", {"lm_head", "model.layers.1.mlp.experts.3.up_proj", "re:.*mlp\\.gate$", "re:mlp.shared"}}});
  j["config_groups"]["group_1"] = j["config_groups"]["group_0"];
  j["config_groups"]["group_1"]["targets"] = {"re:.*down_proj"};
  j["config_groups"]["group_1"]["weights"]["num_bits"] = 8;
  j["config_groups"]["group_2"] = j["config_groups"]["group_0"];
  j["config_groups"]["group_2"]["targets"] = {"model.layers.1.mlp.experts.0.down_proj"};
  j["config_groups"]["group_2"]["weights"]["group_size"] = 32;
  const QuantConfig q = parse(j);
  const std::string e = "model.layers.1.mlp.experts.";
  EXPECT_EQ(q.scheme_for(e + "1.gate_proj").value().bits, 4);       // class "Linear"
  EXPECT_EQ(q.scheme_for(e + "1.down_proj").value().bits, 8);       // a regex beats a class name
  EXPECT_EQ(q.scheme_for(e + "0.down_proj").value().group_size, 32);  // an exact name beats a regex
  EXPECT_FALSE(q.scheme_for(e + "3.up_proj").has_value());          // exact ignore
  EXPECT_TRUE(q.scheme_for(e + "3.up_proj.x").has_value());         // exact means exact
  EXPECT_FALSE(q.scheme_for("model.layers.1.mlp.gate").has_value());  // "re:.*mlp\.gate$"
  EXPECT_TRUE(q.scheme_for("model.layers.1.mlp.gate_proj").has_value());
  // "re:mlp.shared" is anchored at the start of the name: it matches no model.layers.* module
  EXPECT_TRUE(q.scheme_for("model.layers.1.mlp.shared_expert.up_proj").has_value());
  EXPECT_FALSE(q.scheme_for("mlp.shared_expert.up_proj").has_value());
  // only "re:" targets: modules no target matches are not quantized
  auto only = ct_config();
  only["config_groups"]["group_0"]["targets"] = {"re:.*experts.*"};
  const QuantConfig o = parse(only);
  EXPECT_TRUE(o.scheme_for(e + "2.up_proj").has_value());
  EXPECT_FALSE(o.scheme_for("model.layers.1.mlp.shared_expert.up_proj").has_value());
}

// An ignore list written as "re:" patterns (hand-written recipes) instead of the consolidated names.
TEST(CtCheckpoint, RegexIgnoreListLoads) {
  ScratchDir d;
  SynthOptions o = test::synth_opts(d / "m", Arch::Mixtral, Format::GptqV2);
  o.compressed_tensors = true;
  synth_checkpoint(o);
  auto cfg = nlohmann::ordered_json::parse(test::read_file(o.dir + "/config.json"));
  cfg["quantization_config"]["ignore"] = {"lm_head", "re:.*block_sparse_moe.gate$"};
  test::write_file(o.dir + "/config.json", cfg.dump(2));
  const Checkpoint ck = Checkpoint::open(o.dir);
  EXPECT_TRUE(ck.describe_layer(1).problems.empty());
  EXPECT_EQ(ck.load_layer(1).experts.size(), 8u);
}

}  // namespace
}  // namespace wna16
