// Hugging Face model directories of GPTQ/AWQ MoE models: config.json and quantization config
// parsing, per-layer loading into MoeLayerSpec + MoeLayerWeights, synthetic checkpoints in the
// exact Hugging Face layout, and the hidden-states files `wna16 run` reads and writes.
// See docs/checkpoints.md for the decisions taken here (dense expert linears, F32 inputs, ...).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "wna16/half.h"
#include "wna16/moe.h"
#include "wna16/quant.h"
#include "wna16/safetensors.h"

namespace wna16 {

// ---- config.json ----------------------------------------------------------------------------

enum class Arch { Mixtral, Qwen2Moe, Qwen3Moe, DeepseekV2, DeepseekV3, Glm4Moe, Qwen3Next };
const char* arch_name(Arch a);  // the Hugging Face model_type: "mixtral", "qwen2_moe", ...
// model_type -> architecture, including models built on another family's (kimi_k2 -> DeepseekV3);
// throws Error listing the supported ones, or naming the feature of a known family the layer
// cannot compute (llama4: the router score scales the expert's input).
Arch parse_arch(const std::string& model_type);
std::vector<std::string> arch_names();
// Family traits shared by several architectures.
bool arch_has_correction_bias(Arch a);  // DeepSeek-V3, GLM-4.5: gate.e_score_correction_bias (noaux_tc)
bool arch_has_mtp(Arch a);              // DeepSeek-V3, GLM-4.5: num_nextn_predict_layers after the last layer
bool arch_is_deepseek_like(Arch a);     // DeepSeek-V2/V3, GLM-4.5: first_k_dense_replace, shared_experts

enum class LayerKind { Dense, Moe, Mtp };  // Mtp: DeepSeek-V3 / GLM-4.5 multi-token-prediction layer (MoE)
const char* layer_kind_name(LayerKind k);

struct ModelConfig {
  std::string origin;          // "DIR/config.json"
  Arch arch = Arch::Mixtral;
  std::string model_type;      // as written: "kimi_k2" runs as Arch::DeepseekV3
  int64_t hidden = 0;          // hidden_size
  int64_t num_layers = 0;      // num_hidden_layers
  int64_t dense_inter = 0;     // intermediate_size (dense MLP; Mixtral: the expert width)
  int64_t moe_inter = 0;       // routed expert width (Mixtral: intermediate_size)
  int num_experts = 0;
  int top_k = 0;
  bool norm_topk_prob = true;
  // Qwen
  int64_t shared_expert_inter = 0;  // Qwen2-MoE / Qwen3-Next shared_expert_intermediate_size (0: none)
  int decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  // DeepSeek
  int n_shared_experts = 0;
  std::string topk_method;     // greedy | group_limited_greedy | noaux_tc
  std::string scoring_func;    // softmax | sigmoid
  int n_group = 1, topk_group = 1;
  double routed_scaling_factor = 1.0;
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  int64_t num_nextn_predict_layers = 0;  // DeepSeek-V3 / GLM-4.5 MTP layers after the last decoder layer

  // Layers that exist: num_layers (+ MTP layers for DeepSeek-V3 and GLM-4.5).
  int64_t total_layers() const { return num_layers + (arch_has_mtp(arch) ? num_nextn_predict_layers : 0); }
  LayerKind layer_kind(int64_t layer) const;  // throws Error for a layer out of range
  bool is_moe(int64_t layer) const { return layer_kind(layer) != LayerKind::Dense; }
  // "model.layers.L.block_sparse_moe" (Mixtral) or "model.layers.L.mlp".
  std::string mlp_prefix(int64_t layer) const;
  RoutingConfig routing() const;
  // The MoE layer's spec; throws Error if `layer` is a dense layer, naming the rule.
  MoeLayerSpec layer_spec(int64_t layer) const;
  std::string moe_layer_rule() const;  // e.g. "MoE iff L >= first_k_dense_replace=1"
};

// Parses config.json text; `origin` names the file in errors. Throws Error naming the key and value.
ModelConfig parse_model_config(const std::string& text, const std::string& origin);

// ---- quantization config --------------------------------------------------------------------

enum class QuantMethod { None, Gptq, Awq, CompressedTensors };

// A module-name pattern from a checkpoint's config (a Python `re` regular expression), compiled by
// an engine that matches in time linear in the name and the pattern, without backtracking, so an
// untrusted config can neither crash nor hang the loader (the engine stays out of this header).
// Python syntax without a linear-time equivalent is refused with a message naming the pattern:
// backreferences (\1, (?P=name)), lookahead and lookbehind, atomic groups, possessive repeats.
// Counted repetitions are bounded (at most 1000, nested ones multiplied). Copies share one compiled
// automaton; matching is const and safe from several threads.
class ModulePattern {
 public:
  static constexpr size_t kMaxLength = 1000;  // longest pattern accepted, in bytes

  ModulePattern() = default;  // matches nothing
  // Compiles `regex` (Python `re` syntax). Throws Error starting with `where` (the file and key the
  // pattern came from) and naming the construct or limit that refused it.
  static ModulePattern compile(std::string_view regex, const std::string& where);

  // Python re.match(regex, module) is not None: a match anchored at the start of `module`, free to
  // end anywhere. Linear time in module.size().
  bool matches(std::string_view module) const;
  const std::string& source() const;  // the pattern as given to compile()

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

// One GPTQModel `dynamic` entry: regex (Python re.match: anchored at the start of the module name)
// -> overrides. "-:" prefix: matching modules are not quantized; "+:" or no prefix: overrides apply.
struct DynamicRule {
  std::string pattern;  // as written in the file, prefix included
  bool negative = false;
  ModulePattern re;     // the pattern without its prefix, compiled
  std::optional<int> bits, group_size;
  std::optional<bool> desc_act, sym;
};

// A compressed-tensors `targets` or `ignore` entry, matched as compressed-tensors does: "re:" + a
// Python regex (re.match, anchored at the start), else an exact module name or a torch class name
// (every module wna16 loads is an nn.Linear, so "Linear" and "Module" match all of them).
struct ModuleTarget {
  std::string text;  // as written
  bool regex = false;
  ModulePattern re;  // regex only
  // 0: no match; else the match's priority as compressed-tensors ranks it: 1 exact name,
  // 2 regex, 3 class name (a lower rank wins).
  int match_rank(const std::string& module) const;
};

// One compressed-tensors config group (pack-quantized, weight-only): what it targets and the
// weight scheme. scheme.format is GptqV2: the loader converts these tensors to that layout.
struct CtGroup {
  std::string name;  // "group_0"
  std::vector<ModuleTarget> targets;
  QuantScheme scheme;
  std::string actorder;  // "" (none), "group" (weight_g_idx stored) or "weight" (no g_idx)
};

struct QuantConfig {
  std::string origin;        // "config.json quantization_config", "quantize_config.json", ...
  QuantMethod method = QuantMethod::None;
  QuantScheme scheme;        // the defaults: format, bits, group_size, sym, act_order (= desc_act)
  bool static_groups = false;
  bool zero_point = true;    // AWQ
  std::vector<std::string> modules_to_not_convert;  // substring match
  std::vector<DynamicRule> dynamic;                 // first match wins, in file order
  std::vector<CtGroup> ct_groups;                   // compressed-tensors config_groups, in file order
  std::vector<ModuleTarget> ct_ignore;              // compressed-tensors ignore list
  std::string describe() const;

  // The scheme the config prescribes for module `name` ("model.layers.1.mlp.experts.0.gate_proj"),
  // or nullopt when the config leaves it unquantized (modules_to_not_convert, a "-:" rule, a
  // compressed-tensors ignore entry, or no compressed-tensors target matching it).
  // Throws Error for an override the kernels cannot run (bits not 4/8), naming rule and value.
  std::optional<QuantScheme> scheme_for(const std::string& module) const;
};

// Parses a quantization config object given as JSON text. `kind` selects the key variants:
// "quantization_config" (inside config.json), "quantize_config.json" (AutoGPTQ/GPTQModel) or
// "quant_config.json" (old AutoAWQ: w_bit, q_group_size). Refuses GPTQ "marlin" (and any layout
// but gptq/gptq_v2), AWQ versions other than gemm, bits other than 4/8 (AWQ: 4), compressed-tensors
// formats other than pack-quantized and anything but int weight-only groups, naming the value.
QuantConfig parse_quant_config(const std::string& text, const std::string& origin, const std::string& kind);

// ---- checkpoints ----------------------------------------------------------------------------

// How one linear of a layer is stored.
struct LinearInfo {
  std::string module;          // "model.layers.1.mlp.experts.3.gate_proj"
  bool present = false;        // false: neither .qweight nor .weight exists
  bool quantized = false;      // .qweight (or compressed-tensors .weight_packed) present
  QuantScheme scheme;          // quantized only (act_order/sym as the config says; load refines)
  std::string storage;         // present only: "gptq 4-bit g128 sym", "compressed-tensors 4-bit g128 asym", "dense BF16"
  std::string dense_dtype;     // dense only: "F16", "BF16", ...
  int64_t K = 0, N = 0;
  uint64_t bytes = 0;          // all of the module's tensors in the file(s)
};

struct LayerInfo {
  int64_t layer = 0;
  LayerKind kind = LayerKind::Dense;
  bool present = true;              // false: no MLP tensors at all (an omitted MTP or dense layer)
  std::vector<LinearInfo> linears;  // MoE: router, experts (gate, up, down), shared, shared gate; dense: the MLP
  uint64_t bytes = 0;               // every tensor under the layer's MLP prefix
  uint64_t expert_bytes = 0;        // bytes of one routed expert (expert 0)
  std::vector<std::string> problems;
};

class Checkpoint {
 public:
  // Reads config.json, the quantization config and the tensor index of `dir`. Throws Error.
  static Checkpoint open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const ModelConfig& config() const { return config_; }
  const QuantConfig& quant() const { return quant_; }
  const TensorStore& tensors() const { return *store_; }

  // Metadata-only check of one layer (names, dtypes, shapes; no tensor data read): what inspect
  // prints. Never throws for a broken layer: problems are listed.
  LayerInfo describe_layer(int64_t layer) const;

  // Loads a MoE layer: router, correction bias, experts, shared expert(s) and shared gate.
  // Validates every tensor (dtype, shape, g_idx values) and throws Error naming file, tensor
  // and value. Dense expert linears (.weight) are quantized on load to GPTQ 8-bit (see
  // docs/checkpoints.md); `notes` receives one line per such decision.
  MoeLayerWeights load_layer(int64_t layer, std::vector<std::string>* notes = nullptr) const;

  // Every quantized linear of the checkpoint, any layer or kind (tensors ending in .qweight or
  // .weight_packed, that suffix removed), sorted.
  std::vector<std::string> quantized_modules() const;
  // One quantized linear by module name, K and N read from its stored shapes, validated as
  // load_layer validates (shapes, dtypes, g_idx, zero points; the file and tensor named).
  QuantizedLinear load_quantized_linear(const std::string& module) const;

 private:
  std::string dir_;
  ModelConfig config_;
  QuantConfig quant_;
  std::unique_ptr<TensorStore> store_;
};

// The scheme dense expert linears are quantized to on load (GPTQ 8-bit sym, the largest group
// size in {128, 64, 32} dividing K, else one group).
QuantScheme dense_fallback_scheme(int64_t K);

// ---- synthetic checkpoints -------------------------------------------------------------------

struct SynthOptions {
  std::string dir;
  Arch arch = Arch::Mixtral;
  Format format = Format::GptqV1;
  int bits = 4;
  int group_size = 128;
  bool desc_act = false;
  bool asym = false;
  // compressed-tensors pack-quantized, as llm-compressor writes it (format is then unused; bf16
  // model). desc_act means actorder "group" (weight_g_idx written); actorder_weight writes
  // actorder "weight" (channels quantized in activation order, groups k / group_size, no g_idx).
  bool compressed_tensors = false;
  bool actorder_weight = false;
  int64_t layers = 2;
  uint64_t max_shard_size = 256 * 1024;  // bytes per shard (HF's rule: a tensor never splits)
  uint64_t seed = 1;
};

struct SynthResult {
  std::vector<std::string> files;  // written, relative to dir
  std::vector<int64_t> moe_layers;
  uint64_t total_bytes = 0;
};

// Writes a small random model: config.json (+ quantize_config.json for GPTQ), shards named
// model-0000i-of-0000n.safetensors with model.safetensors.index.json (a single model.safetensors
// when everything fits one shard). Refuses a non-empty existing directory.
SynthResult synth_checkpoint(const SynthOptions& opt);

// ---- dequantized copies ----------------------------------------------------------------------

struct DequantizeResult {
  std::vector<std::string> files;  // written, relative to OUT
  int64_t dequantized = 0;         // quantized linears written as BF16 .weight
  int64_t copied = 0;              // other tensors, copied unchanged
  uint64_t total_bytes = 0;        // tensor data written
};

// Writes a BF16 copy of the quantized checkpoint `dir` to `out` (a new or empty directory): every
// quantized linear dequantized to `.weight` [out, in] in BF16, every other tensor copied, each
// output shard holding the tensors of the input shard of the same name (index.json rewritten when
// the input has one), config.json without quantization_config (torch_dtype bfloat16), other files
// copied except the quantization configs. Streams one tensor at a time. Writes under a temporary
// directory renamed onto `out` at the end: on any error `out` is left as it was. Throws Error
// naming the file and tensor at fault (a linear that fails validation, an orphan .scales, ...).
DequantizeResult dequantize_checkpoint(const std::string& dir, const std::string& out);

// ---- hidden-states files ---------------------------------------------------------------------

struct HiddenStates {
  DType dtype = DType::BF16;
  std::vector<int64_t> shape;  // [M, H] or [B, S, H]
  std::vector<float> values;   // exactly the file's values
  int64_t rows() const;        // product of all but the last dim
  int64_t cols() const { return shape.empty() ? 0 : shape.back(); }
};
// Reads the tensor "hidden_states" (F32, F16 or BF16; rank 2 or 3). Throws Error naming the file.
HiddenStates read_hidden_states(const std::string& path);
// Writes "hidden_states" with the given dtype (values are rounded to it), atomically.
void write_hidden_states(const std::string& path, const HiddenStates& h);

}  // namespace wna16
