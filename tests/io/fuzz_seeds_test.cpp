// Writes the fuzz seed corpus (tests/data/fuzz/{safetensors,config}) when WNA16_WRITE_FUZZ_SEEDS
// names a directory; skipped otherwise. The committed seeds were written by
//   WNA16_WRITE_FUZZ_SEEDS=tests/data/fuzz build-io/wna16_io_tests --gtest_filter='FuzzSeeds.*'
// Seeds stay tiny (a few hundred bytes) so libFuzzer spends its time on the header and JSON.
#include <gtest/gtest.h>

#include <cstdlib>
#include <nlohmann/json.hpp>

#include "io_test_util.h"
#include "wna16/checkpoint.h"

namespace wna16 {
namespace {

using test::st_bytes;

TEST(FuzzSeeds, Write) {
  const char* root = std::getenv("WNA16_WRITE_FUZZ_SEEDS");
  if (!root) GTEST_SKIP() << "set WNA16_WRITE_FUZZ_SEEDS=DIR to write the fuzz seeds";
  const std::string st_dir = std::string(root) + "/safetensors", cfg_dir = std::string(root) + "/config";
  test::fs::create_directories(st_dir);
  test::fs::create_directories(cfg_dir);

  // -- safetensors: small valid files in the shapes a GPTQ / AWQ checkpoint uses, then broken ones.
  const std::string pre = "model.layers.1.mlp.experts.0.gate_proj";
  write_safetensors(st_dir + "/gptq_linear.safetensors",
                    {tensor_i32(pre + ".qweight", {2, 8}, std::vector<int32_t>(16, 0x12345678)),
                     tensor_i32(pre + ".qzeros", {1, 1}, {0x77777777}), tensor_f16(pre + ".scales", {1, 8}, std::vector<float>(8, 0.01f)),
                     tensor_i32(pre + ".g_idx", {16}, std::vector<int32_t>(16, 0)),
                     tensor_bf16("model.layers.1.mlp.gate.weight", {2, 16}, std::vector<float>(32, 0.5f)),
                     tensor_f32("model.layers.1.mlp.gate.e_score_correction_bias", {2}, {0.1f, -0.1f})},
                    {{"format", "pt"}});
  write_safetensors(st_dir + "/awq_linear.safetensors",
                    {tensor_i32("w.qweight", {8, 1}, std::vector<int32_t>(8, -1)), tensor_i32("w.qzeros", {1, 1}, {0x01234567}),
                     tensor_f16("w.scales", {1, 8}, std::vector<float>(8, 0.5f))});
  write_safetensors(st_dir + "/ct_linear.safetensors",  // compressed-tensors pack-quantized, asym, actorder group
                    {tensor_i32(pre + ".weight_packed", {8, 2}, std::vector<int32_t>(16, 0x12345678)),
                     tensor_bf16(pre + ".weight_scale", {8, 1}, std::vector<float>(8, 0.01f)),
                     tensor_i32(pre + ".weight_zero_point", {1, 1}, {0x01234567}),
                     tensor_i32(pre + ".weight_g_idx", {16}, std::vector<int32_t>(16, 0)),
                     TensorToWrite{pre + ".weight_shape", StDtype::I64, {2}, {8, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0}}},
                    {{"format", "pt"}});
  write_safetensors(st_dir + "/hidden_states.safetensors", {tensor_bf16("hidden_states", {2, 4}, std::vector<float>(8, 1.0f))});
  write_safetensors(st_dir + "/empty.safetensors", {});
  test::write_file(st_dir + "/unaligned.safetensors",
                   st_bytes(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"y":{"dtype":"F4","shape":[2],"data_offsets":[4,5]}})",
                            std::string(5, '\x01')));
  test::write_file(st_dir + "/zero_size.safetensors",
                   st_bytes(R"( {"a":{"dtype":"F64","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"U8","shape":[1,1],"data_offsets":[0,1]}} )", "z"));
  test::write_file(st_dir + "/broken_overlap.safetensors",
                   st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                            std::string(8, '\0')));
  test::write_file(st_dir + "/broken_gap.safetensors",
                   st_bytes(R"({"a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"I32","shape":[1],"data_offsets":[8,12]}})",
                            std::string(12, '\0')));
  test::write_file(st_dir + "/broken_duplicate.safetensors",
                   st_bytes(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", "ab"));
  test::write_file(st_dir + "/broken_overflow.safetensors",
                   st_bytes(R"({"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", std::string(8, '\0')));
  test::write_file(st_dir + "/broken_header_past_end.safetensors", st_bytes("{}", "", 4096));
  test::write_file(st_dir + "/broken_metadata.safetensors", st_bytes(R"({"__metadata__":{"format":3}})"));

  // -- configs: synth's config.json (with quantization_config) per architecture and format, the
  // published configs of the real models, and the quantization config file variants.
  const std::pair<Arch, Format> combos[] = {{Arch::Mixtral, Format::Awq}, {Arch::Qwen2Moe, Format::GptqV1},
                                            {Arch::Qwen3Moe, Format::GptqV2}, {Arch::DeepseekV2, Format::GptqV1},
                                            {Arch::DeepseekV3, Format::Awq}, {Arch::Glm4Moe, Format::GptqV2},
                                            {Arch::Qwen3Next, Format::GptqV1}};
  for (const auto& [arch, fmt] : combos) {
    test::ScratchDir d;
    SynthOptions o = test::synth_opts(d / "m", arch, fmt, 4, fmt == Format::GptqV1, fmt == Format::GptqV2);
    o.layers = 1;
    synth_checkpoint(o);
    test::write_file(cfg_dir + "/" + arch_name(arch) + "_" + format_name(fmt) + ".json", test::read_file(d / "m/config.json"));
  }
  test::write_file(cfg_dir + "/deepseek_v3_real.json", R"({"model_type":"deepseek_v3","hidden_size":7168,"intermediate_size":18432,
"moe_intermediate_size":2048,"n_routed_experts":256,"n_shared_experts":1,"num_experts_per_tok":8,"topk_method":"noaux_tc",
"n_group":8,"topk_group":4,"routed_scaling_factor":2.5,"norm_topk_prob":true,"scoring_func":"sigmoid","first_k_dense_replace":3,
"moe_layer_freq":1,"num_hidden_layers":61,"num_nextn_predict_layers":1})");
  test::write_file(cfg_dir + "/kimi_k2_real.json", R"({"model_type":"kimi_k2","hidden_size":7168,"intermediate_size":18432,
"moe_intermediate_size":2048,"n_routed_experts":384,"n_shared_experts":1,"num_experts_per_tok":8,"topk_method":"noaux_tc",
"n_group":1,"topk_group":1,"routed_scaling_factor":2.827,"norm_topk_prob":true,"scoring_func":"sigmoid","first_k_dense_replace":1,
"moe_layer_freq":1,"num_hidden_layers":61,"num_nextn_predict_layers":0})");
  test::write_file(cfg_dir + "/glm4_moe_air_real.json", R"({"model_type":"glm4_moe","hidden_size":4096,"intermediate_size":10944,
"moe_intermediate_size":1408,"num_local_experts":128,"n_shared_experts":1,"num_experts_per_tok":8,"n_group":1,"topk_group":1,
"routed_scaling_factor":1.0,"norm_topk_prob":true,"first_k_dense_replace":1,"num_hidden_layers":46,"num_nextn_predict_layers":1})");
  test::write_file(cfg_dir + "/qwen3_next_real.json", R"({"model_type":"qwen3_next","hidden_size":2048,"intermediate_size":5120,
"moe_intermediate_size":512,"shared_expert_intermediate_size":512,"num_experts":512,"num_experts_per_tok":10,"norm_topk_prob":true,
"decoder_sparse_step":1,"mlp_only_layers":[],"num_hidden_layers":48,"full_attention_interval":4})");
  test::write_file(cfg_dir + "/deepseek_v32_real.json", R"({"model_type":"deepseek_v32","hidden_size":7168,"moe_intermediate_size":2048,
"n_routed_experts":256,"n_shared_experts":1,"num_experts_per_tok":8,"topk_method":"noaux_tc","n_group":8,"topk_group":4,
"routed_scaling_factor":2.5,"scoring_func":"sigmoid","first_k_dense_replace":3,"num_hidden_layers":61,"index_topk":2048})");
  test::write_file(cfg_dir + "/broken_llama4.json", R"({"model_type":"llama4","text_config":{"model_type":"llama4_text",
"hidden_size":5120,"intermediate_size":8192,"num_local_experts":16,"num_experts_per_tok":1,"interleave_moe_layer_step":1}})");
  test::write_file(cfg_dir + "/qwen2_moe_sparse_step.json", R"({"model_type":"qwen2_moe","hidden_size":64,"moe_intermediate_size":32,
"shared_expert_intermediate_size":64,"num_experts":4,"num_experts_per_tok":2,"num_hidden_layers":6,"decoder_sparse_step":2,
"mlp_only_layers":[3],"norm_topk_prob":null})");
  test::write_file(cfg_dir + "/quantize_config_gptq.json", R"({"bits":4,"group_size":128,"damp_percent":0.01,"desc_act":true,
"static_groups":false,"sym":true,"true_sequential":true,"model_name_or_path":null,"model_file_base_name":"model"})");
  test::write_file(cfg_dir + "/quant_config_awq.json", R"({"zero_point":true,"q_group_size":64,"w_bit":4,"version":"GEMM"})");
  test::write_file(cfg_dir + "/gptqmodel_dynamic.json", R"({"quant_method":"gptq","bits":4,"group_size":128,"format":"gptq_v2",
"dynamic":{"-:.*\\.shared_expert\\..*":{},"+:.*\\.experts\\.[0-9]+\\.down_proj":{"bits":8,"group_size":64},".*gate":{"desc_act":true}}})");
  test::write_file(cfg_dir + "/awq_modules_to_not_convert.json", R"({"quant_method":"awq","zero_point":true,"group_size":128,
"bits":4,"version":"gemm","modules_to_not_convert":["gate","model.layers.0."]})");
  {  // compressed-tensors: a whole config.json from synth, and quantization_config objects alone
    test::ScratchDir d;
    SynthOptions o = test::synth_opts(d / "m", Arch::Qwen2Moe, Format::GptqV2, 4, true, true);
    o.compressed_tensors = true;
    o.layers = 1;
    synth_checkpoint(o);
    const std::string cfg = test::read_file(d / "m/config.json");
    test::write_file(cfg_dir + "/qwen2_moe_compressed_tensors.json", cfg);
    test::write_file(cfg_dir + "/ct_quantization_config.json",
                     nlohmann::ordered_json::parse(cfg)["quantization_config"].dump());
  }
  test::write_file(cfg_dir + "/ct_groups_regex_ignore.json", R"({"quant_method":"compressed-tensors","format":"mixed-precision",
"quantization_status":"compressed","ignore":["lm_head","re:.*mlp\.gate$","model.layers.0.mlp.experts.1.up_proj"],
"config_groups":{"group_0":{"format":"pack-quantized","targets":["Linear"],"weights":{"num_bits":4,"symmetric":true,
"strategy":"group","group_size":128,"actorder":"weight"}},"group_1":{"format":"pack-quantized","targets":["re:.*down_proj$"],
"weights":{"num_bits":8,"symmetric":false,"strategy":"channel","actorder":null,"type":"INT"}},"group_2":{"format":"pack-quantized",
"targets":["model.layers.0.mlp.experts.0.gate_proj"],"weights":{"num_bits":4,"group_size":32,"actorder":true}}}})");
  test::write_file(cfg_dir + "/broken_ct_int_quantized.json", R"({"quant_method":"compressed-tensors","format":"int-quantized",
"config_groups":{"group_0":{"targets":["Linear"],"weights":{"num_bits":8,"strategy":"channel"},"input_activations":{"num_bits":8,
"strategy":"token","dynamic":true}}}})");
  test::write_file(cfg_dir + "/broken_marlin.json", R"({"quant_method":"gptq","bits":4,"group_size":128,"checkpoint_format":"marlin"})");
}

}  // namespace
}  // namespace wna16
