// The broken-file corpus, generated in code from a good synthetic checkpoint: every case must give
// a clear error (the message is checked), exit code 2 (an error, not a crash), and leave an
// existing output file byte for byte as it was. `inspect` must flag every problem it can see from
// the headers alone, and never crash. Run this suite under ASan+UBSan too (docs/checkpoints.md).
#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>

#include "io_test_util.h"
#include "wna16/checkpoint.h"
#include "wna16/error.h"

namespace wna16 {
namespace {

using test::ScratchDir;
using Tensors = std::vector<TensorToWrite>;

// Expert linear every tensor case breaks: Mixtral down projection, K = I = 256, N = H = 256.
const std::string kMod = "model.layers.1.block_sparse_moe.experts.2.w2";
const std::string kRouter = "model.layers.1.block_sparse_moe.gate.weight";
// The first linear the loader reads: where a config-wide contradiction is found (K = N = 256).
const std::string kFirst = "model.layers.1.block_sparse_moe.experts.0.w1";

enum class Inspect { Fails, Passes, Skip };

struct BrokenCase {
  std::string name;
  std::function<void(const std::string& dir, const std::string& input)> mutate;
  std::string message;  // must appear in stderr
  Inspect inspect = Inspect::Fails;
  Arch arch = Arch::Mixtral;
  bool sharded = false;
  int64_t layer = 1;
  std::string inspect_message = "";  // what inspect must print, when not `message`
  bool ct = false;  // a compressed-tensors checkpoint (asym, actorder group: every tensor kind present)
};

void PrintTo(const BrokenCase& c, std::ostream* os) { *os << c.name; }

// ---- mutation helpers -------------------------------------------------------------------------

void edit_tensors(const std::string& file, const std::function<void(Tensors&)>& fn) {
  Tensors ts = test::load_all(file);
  fn(ts);
  write_safetensors(file, ts);
}

TensorToWrite& must(Tensors& ts, const std::string& name) {
  TensorToWrite* t = test::find_tensor(ts, name);
  if (!t) throw std::runtime_error("test setup: no tensor " + name);
  return *t;
}

void drop_prefix(Tensors& ts, const std::string& prefix) {
  ts.erase(std::remove_if(ts.begin(), ts.end(), [&](const TensorToWrite& t) { return t.name.rfind(prefix, 0) == 0; }),
           ts.end());
}

// Raw byte surgery on a safetensors file: header text and data.
struct RawFile {
  std::string header, data;
  static RawFile read(const std::string& path) {
    std::string b = test::read_file(path);
    uint64_t n = 0;
    std::memcpy(&n, b.data(), 8);
    return RawFile{b.substr(8, n), b.substr(8 + n)};
  }
  void write(const std::string& path, int64_t declared = -1) const { test::write_file(path, test::st_bytes(header, data, declared)); }
};

// Rewrites the header JSON of `path` through fn (offsets etc. are not recomputed).
void edit_header(const std::string& path, const std::function<void(nlohmann::json&)>& fn) {
  RawFile r = RawFile::read(path);
  auto j = nlohmann::json::parse(r.header);
  fn(j);
  r.header = j.dump();
  r.write(path);
}

void edit_config(const std::string& dir, const std::string& from, const std::string& to) {
  std::string c = test::read_file(dir + "/config.json");
  const size_t at = c.find(from);
  if (at == std::string::npos) throw std::runtime_error("test setup: config.json has no " + from);
  c.replace(at, from.size(), to);
  test::write_file(dir + "/config.json", c);
}

std::string model(const std::string& dir) { return dir + "/model.safetensors"; }

// The shard model.safetensors.index.json places `tensor` in.
std::string shard_of(const std::string& dir, const std::string& tensor) {
  auto j = nlohmann::json::parse(test::read_file(dir + "/model.safetensors.index.json"));
  return j["weight_map"][tensor].get<std::string>();
}

// Rewrites config.json's quantization_config through fn.
void edit_qc(const std::string& dir, const std::function<void(nlohmann::ordered_json&)>& fn) {
  auto j = nlohmann::ordered_json::parse(test::read_file(dir + "/config.json"));
  fn(j["quantization_config"]);
  test::write_file(dir + "/config.json", j.dump(2));
}

// compressed-tensors: tensors that contradict the format or the config (kMod: K = N = 256, 2 groups).
void add_ct_cases(std::vector<BrokenCase>& v) {
  auto add = [&](BrokenCase c) {
    c.ct = true;
    v.push_back(std::move(c));
  };
  add({"ct_missing_weight_shape", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { drop_prefix(ts, kMod + ".weight_shape"); });
       }, "missing tensor " + kMod + ".weight_shape (next to "});
  add({"ct_weight_shape_contradicts_config", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) {
           const int64_t v[2] = {256, 512};
           std::memcpy(must(ts, kMod + ".weight_shape").data.data(), v, 16);
         });
       }, kMod + ".weight_shape = [256, 512] but the config gives this linear [out, in] = [256, 256]"});
  add({"ct_packed_dim_mismatch", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { must(ts, kMod + ".weight_packed").shape = {32, 256}; });
       }, kMod + ".weight_packed has shape [32, 256] but K=256, N=256 at 4 bits (compressed-tensors, [out, in*bits/32], "
          "packed along the input) needs [256, 32]"});
  add({"ct_packed_wrong_dtype", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { must(ts, kMod + ".weight_packed").dtype = StDtype::U32; });
       }, kMod + ".weight_packed has dtype U32, expected I32"});
  add({"ct_scale_wrong_dtype", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { must(ts, kMod + ".weight_scale").dtype = StDtype::I16; });
       }, kMod + ".weight_scale has dtype I16, expected F16, BF16 or F32"});
  add({"ct_zero_point_packed_along_input", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { must(ts, kMod + ".weight_zero_point").shape = {2, 32}; });
       }, kMod + ".weight_zero_point has shape [2, 32] but K=256 with group_size=128 (2 groups) at 4 bits "
          "(compressed-tensors, packed along the output) needs [32, 2]"});
  add({"ct_missing_zero_point", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { drop_prefix(ts, kMod + ".weight_zero_point"); });
       }, "missing tensor " + kMod + ".weight_zero_point ("});
  add({"ct_missing_g_idx", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { drop_prefix(ts, kMod + ".weight_g_idx"); });
       }, "missing tensor " + kMod + ".weight_g_idx ("});
  add({"ct_g_idx_out_of_range", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) {
           const int32_t bad = 7;
           std::memcpy(must(ts, kMod + ".weight_g_idx").data.data() + 4 * 9, &bad, 4);
         });
       }, kMod + ".weight_g_idx[9] = 7 is not a group index in [0, 2)", Inspect::Passes});
  add({"ct_packed_and_qweight", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { ts.push_back(tensor_i32(kMod + ".qweight", {32, 256}, std::vector<int32_t>(8192))); });
       }, "has both .qweight and .weight_packed"});
  // -- compressed-tensors config that contradicts the tensors
  add({"ct_config_symmetric_vs_zero_point", [](auto& d, auto&) {
         edit_qc(d, [](auto& q) { q["config_groups"]["group_0"]["weights"]["symmetric"] = true; });
       }, kFirst + ".weight_zero_point is present but " });
  add({"ct_config_bits_vs_packed", [](auto& d, auto&) {
         edit_qc(d, [](auto& q) { q["config_groups"]["group_0"]["weights"]["num_bits"] = 8; });
       }, kFirst + ".weight_packed has shape [256, 32] but K=256, N=256 at 8 bits"});
  add({"ct_config_group_size_vs_scale", [](auto& d, auto&) {
         edit_qc(d, [](auto& q) { q["config_groups"]["group_0"]["weights"]["group_size"] = 64; });
       }, kFirst + ".weight_scale has shape [256, 2] but K=256 with group_size=64 (4 groups) ([out, groups]) needs [256, 4]"});
  add({"ct_config_no_actorder_vs_g_idx", [](auto& d, auto&) {
         edit_qc(d, [](auto& q) { q["config_groups"]["group_0"]["weights"]["actorder"] = "weight"; });
       }, kFirst + ".weight_g_idx is present but "});
  add({"ct_config_ignores_packed_module", [](auto& d, auto&) {
         edit_qc(d, [](auto& q) { q["ignore"].push_back("re:.*experts\\.2\\.w2$"); });
       }, "leaves module " + kMod + " unquantized (in ignore, or no config_groups target matches it)"});
  add({"ct_config_targets_dense_router", [](auto& d, auto&) { edit_qc(d, [](auto& q) { q["ignore"] = {"lm_head"}; }); },
       kRouter + " is dense, but "});
  add({"ct_config_weight_only", [](auto& d, auto&) {
         edit_qc(d, [](auto& q) { q["config_groups"]["group_0"]["input_activations"] = {{"num_bits", 8}, {"type", "int"}}; });
       }, "config_groups.group_0.input_activations = {\"num_bits\":8,\"type\":\"int\"} is not supported"});
  add({"ct_config_format", [](auto& d, auto&) {
         edit_qc(d, [](auto& q) { q["config_groups"]["group_0"]["format"] = "naive-quantized"; });
       }, "quantization_config.config_groups.group_0.format = \"naive-quantized\" is not supported"});
  add({"ct_config_gptq_method", [](auto& d, auto&) {
         edit_qc(d, [](auto& q) { q = {{"quant_method", "gptq"}, {"bits", 4}, {"group_size", 128}}; });
       }, kFirst + ".weight_packed is compressed-tensors pack-quantized, but the quantization config is gptq"});
}

std::vector<BrokenCase> cases() {
  std::vector<BrokenCase> v;
  auto add = [&](BrokenCase c) { v.push_back(std::move(c)); };
  // -- safetensors structure
  add({"truncated_shard", [](auto& d, auto&) {
         std::string b = test::read_file(model(d));
         test::write_file(model(d), b.substr(0, b.size() - 100));
       }, "8 + header", Inspect::Fails});
  add({"shorter_than_8_bytes", [](auto& d, auto&) { test::write_file(model(d), "abc"); }, "too short for the 8-byte header length"});
  add({"header_length_past_end", [](auto& d, auto&) {
         RawFile r = RawFile::read(model(d));
         r.write(model(d), int64_t(r.header.size() + r.data.size() + 1));
       }, "runs past the end of the file"});
  add({"header_length_over_limit", [](auto& d, auto&) {
         RawFile r = RawFile::read(model(d));
         r.write(model(d), 100000001);
       }, "over the limit of 100000000 bytes"});
  add({"header_invalid_json", [](auto& d, auto&) {
         RawFile r = RawFile::read(model(d));
         r.header[r.header.size() / 2] = '}';
         r.write(model(d));
       }, "invalid JSON"});
  add({"header_invalid_utf8", [](auto& d, auto&) {
         RawFile r = RawFile::read(model(d));
         r.header.replace(r.header.find("\"model."), 2, "\"\xc3\x28");
         r.write(model(d));
       }, "invalid JSON"});
  add({"header_duplicate_tensor", [](auto& d, auto&) {
         RawFile r = RawFile::read(model(d));
         const std::string key = "\"" + kRouter + "\"";
         const size_t at = r.header.find(key);
         const size_t end = r.header.find('}', at);
         r.header.insert(1, r.header.substr(at, end - at + 1) + ",");
         r.write(model(d));
       }, "duplicate key \"" + kRouter + "\""});
  add({"offsets_overlap", [](auto& d, auto&) {
         edit_header(model(d), [](nlohmann::json& j) {
           auto& o = j[kMod + ".qweight"]["data_offsets"];
           o[0] = o[0].get<uint64_t>() - 4;
           o[1] = o[1].get<uint64_t>() - 4;
         });
       }, "(an overlap)"});
  add({"offsets_gap", [](auto& d, auto&) {
         edit_header(model(d), [](nlohmann::json& j) {
           auto& o = j[kMod + ".qweight"]["data_offsets"];
           o[0] = o[0].get<uint64_t>() + 4;
           o[1] = o[1].get<uint64_t>() + 4;
         });
       }, "(a gap)"});
  add({"offsets_size_mismatch", [](auto& d, auto&) {
         edit_header(model(d), [](nlohmann::json& j) { j[kMod + ".scales"]["shape"] = {3, 256}; });
       }, "needs 1536"});
  add({"unknown_dtype", [](auto& d, auto&) {
         edit_header(model(d), [](nlohmann::json& j) { j[kMod + ".qweight"]["dtype"] = "Q4_K"; });
       }, "unknown safetensors dtype \"Q4_K\""});
  // -- tensors that contradict the format or the config
  add({"qweight_wrong_dtype", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { must(ts, kMod + ".qweight").dtype = StDtype::F32; });
       }, kMod + ".qweight has dtype F32, expected I32"});
  add({"qweight_wrong_shape", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { must(ts, kMod + ".qweight").shape = {64, 128}; });
       }, kMod + ".qweight has shape [64, 128] but K=256, N=256 at 4 bits (GPTQ, packed along K) needs [32, 256]"});
  add({"qzeros_wrong_shape", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { must(ts, kMod + ".qzeros").shape = {1, 64}; });
       }, kMod + ".qzeros has shape [1, 64]"});
  add({"qzeros_wrong_dtype", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { must(ts, kMod + ".qzeros").dtype = StDtype::U32; });
       }, "has dtype U32, expected I32"});
  add({"scales_wrong_dtype", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { must(ts, kMod + ".scales").dtype = StDtype::I16; });
       }, kMod + ".scales has dtype I16, expected F16, BF16 or F32"});
  add({"scales_wrong_shape", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { must(ts, kMod + ".scales").shape = {1, 512}; });
       }, kMod + ".scales has shape [1, 512] but K=256 with group_size=128 (2 groups) needs [2, 256]"});
  add({"scales_nan", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) {
           auto& s = must(ts, kMod + ".scales");
           s.data[10] = 0x00;
           s.data[11] = 0x7e;  // f16 NaN
         });
       }, "holds a non-finite scale at flat index 5", Inspect::Passes});
  add({"g_idx_wrong_dtype", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { must(ts, kMod + ".g_idx").dtype = StDtype::F32; });
       }, kMod + ".g_idx has dtype F32, expected I32"});
  add({"g_idx_wrong_shape", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { must(ts, kMod + ".g_idx").shape = {128, 2}; });
       }, kMod + ".g_idx has shape [128, 2] but K=256 needs [256]"});
  add({"g_idx_out_of_range", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) {
           auto& g = must(ts, kMod + ".g_idx");
           const int32_t bad = 7;
           std::memcpy(g.data.data() + 4 * 9, &bad, 4);
         });
       }, kMod + ".g_idx[9] = 7 is not a group index in [0, 2)", Inspect::Passes});
  add({"missing_expert", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { drop_prefix(ts, "model.layers.1.block_sparse_moe.experts.5."); });
       }, "missing linear model.layers.1.block_sparse_moe.experts.5.w1: neither"});
  add({"missing_scales", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { drop_prefix(ts, kMod + ".scales"); });
       }, "missing tensor " + kMod + ".scales"});
  add({"missing_router", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { drop_prefix(ts, kRouter); });
       }, "missing linear model.layers.1.block_sparse_moe.gate"});
  add({"router_wrong_shape", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { must(ts, kRouter).shape = {256, 8}; });
       }, kRouter + " has shape [256, 8] but a dense linear with K=256 inputs and N=8 outputs needs [8, 256]"});
  add({"router_wrong_dtype", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { must(ts, kRouter).dtype = StDtype::I16; });
       }, kRouter + " has dtype I16"});
  add({"qweight_and_weight", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { ts.push_back(tensor_f16(kMod + ".weight", {256, 256}, std::vector<float>(65536))); });
       }, "has both .qweight and .weight"});
  add({"v3_missing_correction_bias", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { drop_prefix(ts, "model.layers.1.mlp.gate.e_score_correction_bias"); });
       }, "e_score_correction_bias", Inspect::Fails, Arch::DeepseekV3});
  add({"v3_correction_bias_wrong_shape", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { must(ts, "model.layers.1.mlp.gate.e_score_correction_bias").shape = {4, 4}; });
       }, "e_score_correction_bias has shape [4, 4] but 16 experts needs [16]", Inspect::Fails, Arch::DeepseekV3});
  add({"glm4_missing_correction_bias", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { drop_prefix(ts, "model.layers.1.mlp.gate.e_score_correction_bias"); });
       }, "e_score_correction_bias", Inspect::Fails, Arch::Glm4Moe});
  add({"glm4_missing_shared_experts", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { drop_prefix(ts, "model.layers.1.mlp.shared_experts.up_proj"); });
       }, "model.layers.1.mlp.shared_experts.up_proj", Inspect::Fails, Arch::Glm4Moe});
  add({"qwen3_next_missing_shared_expert_gate", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { drop_prefix(ts, "model.layers.1.mlp.shared_expert_gate"); });
       }, "model.layers.1.mlp.shared_expert_gate", Inspect::Fails, Arch::Qwen3Next});
  add({"qwen3_next_shared_expert_gate_wrong_shape", [](auto& d, auto&) {
         edit_tensors(model(d), [](Tensors& ts) { must(ts, "model.layers.1.mlp.shared_expert_gate.weight").shape = {256, 1}; });
       }, "model.layers.1.mlp.shared_expert_gate.weight has shape [256, 1]", Inspect::Fails, Arch::Qwen3Next});
  // -- config that contradicts the tensors
  add({"config_group_size_vs_scales", [](auto& d, auto&) { edit_config(d, "\"group_size\": 128", "\"group_size\": 64"); },
       ".scales has shape [2, 256] but K=256 with group_size=64 (4 groups) needs [4, 256]"});
  add({"config_bits_vs_qweight", [](auto& d, auto&) { edit_config(d, "\"bits\": 4", "\"bits\": 8"); },
       ".qweight has shape [32, 256] but K=256, N=256 at 8 bits"});
  add({"config_hidden_size", [](auto& d, auto&) { edit_config(d, "\"hidden_size\": 256", "\"hidden_size\": 512"); },
       "but the model's hidden_size is 512", Inspect::Fails, Arch::Mixtral, false, 1,
       kRouter + " has shape [8, 256] but a dense linear with K=512 inputs and N=8 outputs needs [8, 512]"});
  add({"config_excludes_quantized_module", [](auto& d, auto&) {
         edit_config(d, "\"quant_method\": \"gptq\"", "\"quant_method\": \"gptq\", \"modules_to_not_convert\": [\"experts\"]");
       }, "the config contradicts the tensors"});
  add({"config_num_experts", [](auto& d, auto&) { edit_config(d, "\"num_local_experts\": 8", "\"num_local_experts\": 9"); },
       kRouter + " has shape [8, 256] but a dense linear with K=256 inputs and N=9 outputs needs [9, 256]"});
  add({"config_invalid_json", [](auto& d, auto&) { edit_config(d, "\"model_type\"", "\"model_type\" \"x\""); }, "invalid JSON"});
  add({"config_duplicate_key", [](auto& d, auto&) { edit_config(d, "\"model_type\"", "\"hidden_size\": 1, \"model_type\""); },
       "duplicate key \"hidden_size\""});
  add({"config_unknown_arch", [](auto& d, auto&) { edit_config(d, "\"model_type\": \"mixtral\"", "\"model_type\": \"llama\""); },
       "\"llama\" is not a supported MoE architecture"});
  add({"config_gptq_marlin", [](auto& d, auto&) {
         edit_config(d, "\"checkpoint_format\": \"gptq\"", "\"checkpoint_format\": \"marlin\"");
       }, "quantization_config.checkpoint_format = \"marlin\" is not supported"});
  add({"config_awq_gemv", [](auto& d, auto&) {
         edit_qc(d, [](auto& q) { q = {{"quant_method", "awq"}, {"zero_point", true}, {"group_size", 128}, {"bits", 4}, {"version", "gemv"}}; });
       }, "quantization_config.version = \"gemv\" is not supported"});
  add({"config_bits_3", [](auto& d, auto&) { edit_config(d, "\"bits\": 4", "\"bits\": 3"); },
       "quantization_config.bits = 3 is a valid GPTQ width, but wna16's kernels support 4 and 8 bits only"});
  add({"config_missing", [](auto& d, auto&) { test::fs::remove(d + "/config.json"); }, "no config.json"});
  // -- sharded checkpoints
  add({"index_missing_shard", [](auto& d, auto&) { test::fs::remove(d + "/" + shard_of(d, kRouter)); },
       "\", which does not exist", Inspect::Fails, Arch::Mixtral, true});
  add({"index_wrong_shard", [](auto& d, auto&) {
         std::string idx = test::read_file(d + "/model.safetensors.index.json");
         const std::string from = "\"" + kRouter + "\": \"" + shard_of(d, kRouter) + "\"";
         const std::string to = "\"" + kRouter + "\": \"" + shard_of(d, kMod + ".qweight") + "\"";
         idx.replace(idx.find(from), from.size(), to);
         test::write_file(d + "/model.safetensors.index.json", idx);
       }, "but that file has no such tensor", Inspect::Fails, Arch::Mixtral, true});
  add({"index_invalid_json", [](auto& d, auto&) { test::write_file(d + "/model.safetensors.index.json", "{\"weight_map\":"); },
       "invalid JSON", Inspect::Fails, Arch::Mixtral, true});
  add({"shard_truncated", [](auto& d, auto&) {
         const std::string p = d + "/" + shard_of(d, kMod + ".qweight");
         std::string b = test::read_file(p);
         test::write_file(p, b.substr(0, b.size() / 2));
       }, "must be the file length", Inspect::Fails, Arch::Mixtral, true});
  // -- the run inputs
  add({"input_missing", [](auto&, auto& x) { test::fs::remove(x); }, "cannot open", Inspect::Skip});
  add({"input_no_hidden_states", [](auto&, auto& x) { write_safetensors(x, {tensor_f32("x", {1, 256}, std::vector<float>(256))}); },
       "no tensor named \"hidden_states\" (found: x)", Inspect::Skip});
  add({"input_wrong_width", [](auto&, auto& x) { test::write_random_input(x, 3, 128, DType::BF16); },
       "hidden_states has shape [3, 128] but the model's hidden_size is 256", Inspect::Skip});
  add({"input_wrong_dtype", [](auto&, auto& x) { write_safetensors(x, {tensor_i32("hidden_states", {1, 256}, std::vector<int32_t>(256))}); },
       "hidden_states has dtype I32, expected F32, F16 or BF16", Inspect::Skip});
  add({"input_rank_1", [](auto&, auto& x) { write_safetensors(x, {tensor_f32("hidden_states", {256}, std::vector<float>(256))}); },
       "expected [M, H] or [B, S, H]", Inspect::Skip});
  add({"input_nan", [](auto&, auto& x) {
         std::vector<float> v(512, 0.5f);
         v[300] = std::nanf("");
         write_safetensors(x, {tensor_f32("hidden_states", {2, 256}, v)});
       }, "non-finite value at flat index 300", Inspect::Skip});
  add({"input_truncated", [](auto&, auto& x) {
         std::string b = test::read_file(x);
         test::write_file(x, b.substr(0, b.size() - 2));
       }, "must be the file length", Inspect::Skip});
  // -- the layer
  BrokenCase dense{"layer_is_dense", [](auto&, auto&) {}, "layer 0 of", Inspect::Skip, Arch::DeepseekV3};
  dense.layer = 0;
  add(dense);
  BrokenCase range{"layer_out_of_range", [](auto&, auto&) {}, "layer 7 does not exist", Inspect::Skip};
  range.layer = 7;
  add(range);
  add_ct_cases(v);
  return v;
}

class BrokenCorpus : public ::testing::TestWithParam<BrokenCase> {};

TEST_P(BrokenCorpus, ClearErrorNoCrashOutputUntouched) {
  const BrokenCase& c = GetParam();
  ScratchDir d;
  const std::string dir = d / "model", x = d / "x.safetensors", out_dir = d / "out", y = out_dir + "/y.safetensors";
  SynthOptions o = test::synth_opts(dir, c.arch, Format::GptqV1, 4, /*desc_act=*/true, /*asym=*/c.ct, c.sharded);
  o.compressed_tensors = c.ct;
  synth_checkpoint(o);
  test::write_random_input(x, 3, 256, DType::BF16);
  test::fs::create_directory(out_dir);
  test::write_file(y, "an existing output that must survive");
  c.mutate(dir, x);

  auto r = test::run_cli("run " + test::shell_quote(dir) + " --layer " + std::to_string(c.layer) + " --input " +
                         test::shell_quote(x) + " --output " + test::shell_quote(y) + " --device cpu --check");
  EXPECT_EQ(r.exit_code, 2) << "expected a clean error (exit 2)\nstdout:\n" << r.out << "\nstderr:\n" << r.err;
  EXPECT_NE(r.err.find("wna16: error: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(c.message), std::string::npos) << "expected \"" << c.message << "\" in:\n" << r.err;
  EXPECT_EQ(test::read_file(y), "an existing output that must survive");
  EXPECT_EQ(test::list_dir(out_dir), std::vector<std::string>{"y.safetensors"}) << "no temporary file left behind";

  if (c.inspect == Inspect::Skip) return;
  auto i = test::run_cli("inspect " + test::shell_quote(dir));
  ASSERT_GE(i.exit_code, 0) << "inspect crashed:\n" << i.err;
  if (c.inspect == Inspect::Fails) {
    EXPECT_NE(i.exit_code, 0) << "inspect missed the problem:\n" << i.out;
    EXPECT_LE(i.exit_code, 2);
    const std::string want = c.inspect_message.empty() ? c.message : c.inspect_message;
    EXPECT_NE((i.out + i.err).find(want), std::string::npos) << "inspect output lacks \"" << want << "\":\n" << i.out << i.err;
  } else {
    EXPECT_EQ(i.exit_code, 0) << "data-only problem, invisible to the header check:\n" << i.out << i.err;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, BrokenCorpus, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<BrokenCase>& p) { return p.param.name; });

}  // namespace
}  // namespace wna16
