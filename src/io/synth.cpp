// Synthetic checkpoints in the exact Hugging Face layout AutoGPTQ / GPTQModel / AutoAWQ /
// llm-compressor (compressed-tensors pack-quantized) write:
// config.json with quantization_config (+ quantize_config.json for GPTQ), sharded safetensors
// model-0000i-of-0000n.safetensors + model.safetensors.index.json, per-expert tensor names,
// fp16 routers. Only MLP tensors are written: attention, norms, embeddings and lm_head are
// omitted (wna16 never reads them); the dense layer 0 of DeepSeek and GLM-4.5 gets a small
// quantized dense MLP.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>

#include "io/json_util.h"
#include "io/quant_util.h"
#include "wna16/checkpoint.h"
#include "wna16/error.h"

namespace wna16 {

namespace fs = std::filesystem;

namespace {

struct SynthShape {
  int64_t hidden = 256;
  int64_t dense_inter = 384;  // DeepSeek dense layer / Qwen mlp_only layers
  int64_t moe_inter = 128;
  int experts = 8, top_k = 2;
  int64_t shared_inter = 0;   // Qwen2-MoE, Qwen3-Next
  int n_shared = 0;           // DeepSeek, GLM-4.5
};

// Small sizes valid for every format: H=256 and I=128 are multiples of 128 (group size), of 8
// (4-bit GPTQ packing along K) and of 8 (AWQ packing along N).
SynthShape shape_for(Arch a) {
  SynthShape s;
  switch (a) {
    case Arch::Mixtral: s.moe_inter = 256; s.dense_inter = 256; s.experts = 8; s.top_k = 2; break;
    case Arch::Qwen2Moe: s.experts = 8; s.top_k = 2; s.shared_inter = 256; break;
    case Arch::Qwen3Moe: s.experts = 16; s.top_k = 4; break;
    case Arch::DeepseekV2: s.experts = 16; s.top_k = 4; s.n_shared = 2; break;
    case Arch::DeepseekV3: s.experts = 16; s.top_k = 4; s.n_shared = 1; break;
    case Arch::Glm4Moe: s.experts = 16; s.top_k = 4; s.n_shared = 1; break;
    case Arch::Qwen3Next: s.experts = 16; s.top_k = 4; s.shared_inter = 128; break;
  }
  return s;
}

const char* hf_architecture(Arch a) {
  switch (a) {
    case Arch::Mixtral: return "MixtralForCausalLM";
    case Arch::Qwen2Moe: return "Qwen2MoeForCausalLM";
    case Arch::Qwen3Moe: return "Qwen3MoeForCausalLM";
    case Arch::DeepseekV2: return "DeepseekV2ForCausalLM";
    case Arch::DeepseekV3: return "DeepseekV3ForCausalLM";
    case Arch::Glm4Moe: return "Glm4MoeForCausalLM";
    case Arch::Qwen3Next: return "Qwen3NextForCausalLM";
  }
  return "?";
}

using OJ = nlohmann::ordered_json;

// llm-compressor's quantization_config for one weight-only group on every Linear (its W4A16 /
// W8A16 presets, with this checkpoint's options); `ignore` names each unquantized Linear, as
// compressed-tensors consolidates it on save.
OJ ct_quant_json(const SynthOptions& o, const std::vector<std::string>& ignore) {
  OJ w;
  w["actorder"] = o.desc_act ? OJ("group") : o.actorder_weight ? OJ("weight") : OJ(nullptr);
  w["block_structure"] = nullptr;
  w["dynamic"] = false;
  w["group_size"] = o.group_size > 0 ? OJ(o.group_size) : OJ(nullptr);
  w["num_bits"] = o.bits;
  w["observer"] = "minmax";
  w["observer_kwargs"] = OJ::object();
  w["strategy"] = o.group_size > 0 ? "group" : "channel";
  w["symmetric"] = !o.asym;
  w["type"] = "int";
  OJ g;
  g["format"] = "pack-quantized";
  g["input_activations"] = nullptr;
  g["output_activations"] = nullptr;
  g["targets"] = OJ::array({"Linear"});
  g["weights"] = w;
  OJ q;
  q["config_groups"]["group_0"] = g;
  q["format"] = "pack-quantized";
  q["global_compression_ratio"] = nullptr;
  q["ignore"] = ignore;
  q["kv_cache_scheme"] = nullptr;
  q["quant_method"] = "compressed-tensors";
  q["quantization_status"] = "compressed";
  q["sparsity_config"] = OJ::object();
  q["transform_config"] = OJ::object();
  q["version"] = "0.12.2";
  return q;
}

OJ quant_json(const SynthOptions& o, bool for_quantize_config_json) {
  OJ q;
  if (o.format == Format::Awq) {
    q["quant_method"] = "awq";
    q["zero_point"] = true;
    q["group_size"] = o.group_size;
    q["bits"] = o.bits;
    q["version"] = "gemm";
    // AutoAWQ's substring rule: "gate" keeps Mixtral's router (block_sparse_moe.gate) in fp16;
    // for the others it would also match gate_proj, so they list nothing (routers are not
    // quantized by AutoAWQ anyway: they are not in its per-layer linear list).
    q["modules_to_not_convert"] = o.arch == Arch::Mixtral ? OJ::array({"gate"}) : OJ(nullptr);
    return q;
  }
  q["bits"] = o.bits;
  q["group_size"] = o.group_size;
  q["damp_percent"] = 0.01;
  q["desc_act"] = o.desc_act;
  q["static_groups"] = false;
  q["sym"] = !o.asym;
  q["true_sequential"] = true;
  if (for_quantize_config_json) {
    q["model_name_or_path"] = nullptr;
    q["model_file_base_name"] = "model";
  }
  q["quant_method"] = "gptq";
  q["checkpoint_format"] = o.format == Format::GptqV2 ? "gptq_v2" : "gptq";
  return q;
}

OJ config_json(const SynthOptions& o, const SynthShape& s) {
  OJ c;
  c["architectures"] = OJ::array({hf_architecture(o.arch)});
  c["model_type"] = arch_name(o.arch);
  c["hidden_size"] = s.hidden;
  c["intermediate_size"] = s.dense_inter;
  c["num_hidden_layers"] = o.layers;
  c["num_attention_heads"] = 4;
  c["num_key_value_heads"] = 4;
  c["vocab_size"] = 1024;
  c["max_position_embeddings"] = 4096;
  c["rms_norm_eps"] = 1e-6;
  c["hidden_act"] = "silu";
  c["tie_word_embeddings"] = false;
  c["torch_dtype"] = o.compressed_tensors ? "bfloat16" : "float16";
  switch (o.arch) {
    case Arch::Mixtral:
      c["num_local_experts"] = s.experts;
      c["num_experts_per_tok"] = s.top_k;
      c["router_aux_loss_coef"] = 0.02;
      c["rope_theta"] = 1e6;
      c["sliding_window"] = nullptr;
      break;
    case Arch::Qwen2Moe:
    case Arch::Qwen3Moe:
    case Arch::Qwen3Next:
      c["moe_intermediate_size"] = s.moe_inter;
      if (o.arch != Arch::Qwen3Moe) c["shared_expert_intermediate_size"] = s.shared_inter;
      c["num_experts"] = s.experts;
      c["num_experts_per_tok"] = s.top_k;
      // Qwen1.5-MoE: false; Qwen3-30B-A3B and Qwen3-Next-80B-A3B: true
      c["norm_topk_prob"] = o.arch != Arch::Qwen2Moe;
      c["decoder_sparse_step"] = 1;
      c["mlp_only_layers"] = OJ::array();
      c["router_aux_loss_coef"] = 0.001;
      break;
    case Arch::DeepseekV2:
    case Arch::DeepseekV3: {
      const bool v3 = o.arch == Arch::DeepseekV3;
      c["moe_intermediate_size"] = s.moe_inter;
      c["n_routed_experts"] = s.experts;
      c["n_shared_experts"] = s.n_shared;
      c["num_experts_per_tok"] = s.top_k;
      c["topk_method"] = v3 ? "noaux_tc" : "group_limited_greedy";
      c["n_group"] = 4;
      c["topk_group"] = 2;
      c["routed_scaling_factor"] = v3 ? 2.5 : 16.0;  // DeepSeek-V3 / DeepSeek-V2 values
      c["norm_topk_prob"] = v3;
      c["scoring_func"] = v3 ? "sigmoid" : "softmax";
      c["first_k_dense_replace"] = 1;
      c["moe_layer_freq"] = 1;
      if (v3) c["num_nextn_predict_layers"] = 0;  // the MTP layer is not synthesised
      c["aux_loss_alpha"] = 0.001;
      break;
    }
    case Arch::Glm4Moe:
      // GLM-4.5's keys (Glm4MoeConfig): no topk_method / scoring_func; groups as DeepSeek-V3.
      c["moe_intermediate_size"] = s.moe_inter;
      c["n_routed_experts"] = s.experts;
      c["n_shared_experts"] = s.n_shared;
      c["num_experts_per_tok"] = s.top_k;
      c["n_group"] = 4;
      c["topk_group"] = 2;
      c["routed_scaling_factor"] = 2.5;  // GLM-4.5 (GLM-4.5-Air: 1.0)
      c["norm_topk_prob"] = true;
      c["first_k_dense_replace"] = 1;
      c["num_nextn_predict_layers"] = 0;  // the MTP layer is not synthesised
      c["partial_rotary_factor"] = 0.5;
      c["use_qk_norm"] = false;
      break;
  }
  if (!o.compressed_tensors) c["quantization_config"] = quant_json(o, false);
  return c;
}

class Writer {
 public:
  Writer(const SynthOptions& o, std::mt19937_64& rng) : o_(o), rng_(rng) {}
  std::vector<TensorToWrite> tensors;

  std::vector<float> normal(size_t n, double stddev) {
    std::normal_distribution<double> d(0.0, stddev);
    std::vector<float> v(n);
    for (auto& x : v) x = float(d(rng_));
    return v;
  }

  // With --desc-act, a channel order for linears that read the same input: GPTQ orders a linear's
  // input channels by the Hessian of its input, so gate and up (w1 and w3) share one order. Empty
  // without act-order.
  std::vector<int32_t> input_order(int64_t K) {
    return o_.desc_act ? seeded_perm(K, rng_()) : std::vector<int32_t>{};
  }

  // A quantized linear K -> N with HF tensor names under `module`; order: its act-order channel
  // order (input_order), else one of its own.
  void linear(const std::string& module, int64_t K, int64_t N, const std::vector<int32_t>& order = {}) {
    QuantScheme s;
    s.format = o_.compressed_tensors ? Format::GptqV2 : o_.format;  // v2: zero points as compressed-tensors stores them
    s.bits = o_.bits;
    s.group_size = o_.group_size;
    s.sym = s.format == Format::Awq ? false : !o_.asym;
    s.act_order = o_.desc_act;
    QuantizedLinear q;
    try {
      q = quantize(normal(size_t(K * N), 1.0 / std::sqrt(double(K))), K, N, s, rng_(), order.empty() ? nullptr : &order);
    } catch (const Error& e) {
      throw Error("synth: " + module + " (K=" + std::to_string(K) + ", N=" + std::to_string(N) + ", " + s.describe() +
                  "): " + e.what());
    }
    const int64_t G = s.num_groups(K);
    if (o_.compressed_tensors) {
      ct_tensors(module, q, G);
    } else if (s.format == Format::Awq) {
      tensors.push_back(tensor_i32(module + ".qweight", {K, N / 8}, q.qweight));
      tensors.push_back(tensor_i32(module + ".qzeros", {G, N / 8}, q.qzeros));
      tensors.push_back(tensor_f16(module + ".scales", {G, N}, q.scales));
    } else {
      std::vector<int32_t> g = q.g_idx;
      if (g.empty()) {  // AutoGPTQ always writes g_idx, k / group_size without act-order
        const int64_t glen = s.group_len(K);
        for (int64_t k = 0; k < K; ++k) g.push_back(int32_t(k / glen));
      }
      tensors.push_back(tensor_i32(module + ".qweight", {K * s.bits / 32, N}, q.qweight));
      tensors.push_back(tensor_i32(module + ".qzeros", {G, N * s.bits / 32}, q.qzeros));
      tensors.push_back(tensor_f16(module + ".scales", {G, N}, q.scales));
      tensors.push_back(tensor_i32(module + ".g_idx", {K}, g));
    }
  }

  // A dense 16-bit tensor in the model's dtype (bf16 for compressed-tensors, as llm-compressor saves).
  TensorToWrite model_dtype(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& v) const {
    return o_.compressed_tensors ? tensor_bf16(name, std::move(shape), v) : tensor_f16(name, std::move(shape), v);
  }

 private:
  // The GPTQ v2 linear q in compressed-tensors' pack-quantized layout: the same fields, word
  // matrices transposed to [out, ...] (formats.md), scales in bf16, weight_shape [out, in] as I64.
  void ct_tensors(const std::string& module, const QuantizedLinear& q, int64_t G) {
    const int64_t K = q.K, N = q.N, b = q.scheme.bits;
    tensors.push_back(tensor_i32(module + ".weight_packed", {N, K * b / 32}, io::transpose(q.qweight, K * b / 32, N)));
    tensors.push_back(tensor_bf16(module + ".weight_scale", {N, G}, io::transpose(q.scales, G, N)));
    std::vector<uint8_t> shape(16);
    const int64_t dims[2] = {N, K};
    std::memcpy(shape.data(), dims, 16);
    tensors.push_back(TensorToWrite{module + ".weight_shape", StDtype::I64, {2}, std::move(shape)});
    if (!q.scheme.sym)
      tensors.push_back(tensor_i32(module + ".weight_zero_point", {N * b / 32, G}, io::transpose(q.qzeros, G, N * b / 32)));
    if (o_.desc_act) tensors.push_back(tensor_i32(module + ".weight_g_idx", {K}, q.g_idx));
  }

  const SynthOptions& o_;
  std::mt19937_64& rng_;
};

std::string shard_name(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return buf;
}

}  // namespace

SynthResult synth_checkpoint(const SynthOptions& o) {
  if (o.compressed_tensors) {
    if (o.desc_act && o.actorder_weight) throw Error("synth: actorder is either \"group\" (--desc-act) or \"weight\", not both");
    if ((o.desc_act || o.actorder_weight) && o.group_size <= 0)
      throw Error("synth: compressed-tensors actorder needs strategy \"group\" (a positive --group-size, got " + std::to_string(o.group_size) + ")");
  } else {
    if (o.actorder_weight) throw Error("synth: actorder \"weight\" is a compressed-tensors option (--format compressed-tensors)");
    if (o.format == Format::Awq && o.bits != 4) throw Error("synth: AWQ is 4-bit only (got --bits " + std::to_string(o.bits) + ")");
    if (o.format == Format::Awq && o.desc_act) throw Error("synth: --desc-act is a GPTQ option; AWQ has no act-order");
  }
  if (o.bits != 4 && o.bits != 8) throw Error("synth: --bits " + std::to_string(o.bits) + " is not supported (4 or 8)");
  if (o.layers < 1 || o.layers > 1000) throw Error("synth: --layers " + std::to_string(o.layers) + " is out of range [1, 1000]");
  if (o.max_shard_size < 1) throw Error("synth: --max-shard-size must be positive");
  std::error_code ec;
  if (fs::exists(o.dir, ec) && !(fs::is_directory(o.dir, ec) && fs::is_empty(o.dir, ec)))
    throw Error("synth: " + o.dir + " exists and is not an empty directory; choose a new one");
  fs::create_directories(o.dir, ec);
  if (ec) throw Error("synth: cannot create " + o.dir + ": " + ec.message());

  const SynthShape s = shape_for(o.arch);
  OJ config = config_json(o, s);
  // Parse our own config back: the layer rules and widths come from the same code `run` uses.
  const ModelConfig cfg = parse_model_config(config.dump(), o.dir + "/config.json");
  if (o.compressed_tensors) {
    std::vector<std::string> ignore;  // the unquantized Linears: routers (and Qwen's shared-expert gate), lm_head
    for (int64_t L = 0; L < o.layers; ++L) {
      if (!cfg.is_moe(L)) continue;
      ignore.push_back(cfg.mlp_prefix(L) + ".gate");
      if (cfg.layer_spec(L).shared_kind == SharedExpertKind::SigmoidGated) ignore.push_back(cfg.mlp_prefix(L) + ".shared_expert_gate");
    }
    ignore.push_back("lm_head");
    config["quantization_config"] = ct_quant_json(o, ignore);
  }
  const std::string config_text = config.dump(2) + "\n";
  // Fails early (before any file is written) on a format the kernels lack.
  parse_quant_config(config["quantization_config"].dump(), o.dir + "/config.json", "quantization_config");

  std::mt19937_64 rng(o.seed);
  Writer w(o, rng);
  SynthResult res;
  for (int64_t L = 0; L < o.layers; ++L) {
    const std::string p = cfg.mlp_prefix(L);
    if (!cfg.is_moe(L)) {
      const std::vector<int32_t> order = w.input_order(s.hidden);
      w.linear(p + ".gate_proj", s.hidden, s.dense_inter, order);
      w.linear(p + ".up_proj", s.hidden, s.dense_inter, order);
      w.linear(p + ".down_proj", s.dense_inter, s.hidden);
      continue;
    }
    res.moe_layers.push_back(L);
    const MoeLayerSpec spec = cfg.layer_spec(L);
    // Router logits ~ N(0, 1) for unit-variance hidden states.
    w.tensors.push_back(w.model_dtype(p + ".gate.weight", {s.experts, s.hidden},
                                   w.normal(size_t(s.experts * s.hidden), 1.0 / std::sqrt(double(s.hidden)))));
    if (arch_has_correction_bias(o.arch))  // DeepSeek-V3 and GLM-4.5 keep this bias in fp32
      w.tensors.push_back(tensor_f32(p + ".gate.e_score_correction_bias", {s.experts}, w.normal(size_t(s.experts), 0.1)));
    const bool mixtral = o.arch == Arch::Mixtral;
    for (int e = 0; e < s.experts; ++e) {
      const std::string ep = p + ".experts." + std::to_string(e) + ".";
      // Module order of the torch state dict: Mixtral w1, w2, w3; the others gate, up, down.
      const std::vector<int32_t> order = w.input_order(spec.hidden);
      if (mixtral) {
        w.linear(ep + "w1", spec.hidden, spec.inter, order);
        w.linear(ep + "w2", spec.inter, spec.hidden);
        w.linear(ep + "w3", spec.hidden, spec.inter, order);
      } else {
        w.linear(ep + "gate_proj", spec.hidden, spec.inter, order);
        w.linear(ep + "up_proj", spec.hidden, spec.inter, order);
        w.linear(ep + "down_proj", spec.inter, spec.hidden);
      }
    }
    if (spec.shared_kind != SharedExpertKind::None) {
      const std::string sp = p + (arch_is_deepseek_like(o.arch) ? ".shared_experts." : ".shared_expert.");
      const std::vector<int32_t> order = w.input_order(spec.hidden);
      w.linear(sp + "gate_proj", spec.hidden, spec.shared_inter, order);
      w.linear(sp + "up_proj", spec.hidden, spec.shared_inter, order);
      w.linear(sp + "down_proj", spec.shared_inter, spec.hidden);
    }
    if (spec.shared_kind == SharedExpertKind::SigmoidGated)
      w.tensors.push_back(w.model_dtype(p + ".shared_expert_gate.weight", {1, s.hidden},
                                     w.normal(size_t(s.hidden), 1.0 / std::sqrt(double(s.hidden)))));
  }

  // Hugging Face's sharding rule: tensors in order; start a new shard when the next tensor would
  // push a non-empty shard past max_shard_size (a tensor is never split).
  std::vector<std::vector<TensorToWrite>> shards(1);
  uint64_t cur = 0, total = 0;
  for (auto& t : w.tensors) {
    const uint64_t b = t.data.size();
    if (cur > 0 && cur + b > o.max_shard_size) {
      shards.emplace_back();
      cur = 0;
    }
    cur += b;
    total += b;
    shards.back().push_back(std::move(t));
  }
  res.total_bytes = total;
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  if (shards.size() == 1) {
    write_safetensors(o.dir + "/model.safetensors", shards[0], meta);
    res.files.push_back("model.safetensors");
  } else {
    nlohmann::json index;
    index["metadata"]["total_size"] = total;
    index["weight_map"] = nlohmann::json::object();
    for (size_t i = 0; i < shards.size(); ++i) {
      const std::string name = shard_name(i, shards.size());
      write_safetensors(o.dir + "/" + name, shards[i], meta);
      for (const auto& t : shards[i]) index["weight_map"][t.name] = name;
      res.files.push_back(name);
    }
    write_file_atomic(o.dir + "/model.safetensors.index.json", index.dump(2) + "\n");
    res.files.push_back("model.safetensors.index.json");
  }
  if (o.format != Format::Awq && !o.compressed_tensors) {
    write_file_atomic(o.dir + "/quantize_config.json", quant_json(o, true).dump(2) + "\n");
    res.files.push_back("quantize_config.json");
  }
  // config.json last: a directory is not loadable until everything else is in place.
  write_file_atomic(o.dir + "/config.json", config_text);
  res.files.push_back("config.json");
  return res;
}

}  // namespace wna16
