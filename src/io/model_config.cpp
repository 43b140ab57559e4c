// config.json -> ModelConfig for the supported MoE architectures (keys: formats.md; accepted
// spellings of a key: the alias table below and docs/checkpoints.md).
#include <algorithm>

#include "io/config_util.h"
#include "wna16/checkpoint.h"
#include "wna16/error.h"

namespace wna16 {

namespace {

struct ArchRow {
  Arch a;
  const char* name;
};
constexpr ArchRow kArchs[] = {
    {Arch::Mixtral, "mixtral"},
    {Arch::Qwen2Moe, "qwen2_moe"},
    {Arch::Qwen3Moe, "qwen3_moe"},
    {Arch::DeepseekV2, "deepseek_v2"},
    {Arch::DeepseekV3, "deepseek_v3"},
    {Arch::Glm4Moe, "glm4_moe"},
    {Arch::Qwen3Next, "qwen3_next"},
};

// model_type values of models built on another family's architecture: same config keys, tensor
// names and routing. Kimi-K2 (Moonshot) is DeepseekV3ForCausalLM saved with model_type "kimi_k2"
// so that engines can tell the two apart (its deployment guide; engines without kimi_k2 are told
// to set model_type to deepseek_v3).
struct ModelTypeAlias {
  const char* model_type;
  Arch arch;
};
// DeepSeek-V3.2-Exp (DeepseekV32ForCausalLM, model_type "deepseek_v32") changes the attention
// (a sparse indexer) and keeps DeepSeek-V3's MoE keys, routing and tensor names.
constexpr ModelTypeAlias kModelTypeAliases[] = {
    {"kimi_k2", Arch::DeepseekV3},
    {"deepseek_v32", Arch::DeepseekV3},
};

// Known MoE families whose layer the kernels cannot compute as the model does: refused by name
// rather than computed some other way.
struct RefusedFamily {
  const char* model_type;
  const char* feature;
};
constexpr RefusedFamily kRefusedFamilies[] = {
    // transformers' Llama4TextMoe: sigmoid of the top-k router logits multiplies each expert's
    // INPUT (routed_in = hidden_states * router_scores); the layer weights expert outputs.
    {"llama4", "Llama 4's MoE scales each routed expert's input by its sigmoid router score "
               "(the layer applies routing weights to expert outputs)"},
    {"llama4_text", "Llama 4's MoE scales each routed expert's input by its sigmoid router score "
                    "(the layer applies routing weights to expert outputs)"},
};

// Alternative spellings of config.json keys, per architecture: the one place they are resolved.
// The canonical key is the one transformers 4.x and the model's original repository write; an
// alternative is accepted when a config class maps it onto that field. Each row names its source.
// Checked and found to need no row: Qwen2MoeConfig and Qwen3NextConfig (transformers 4.x and
// 5.x: no attribute_map), Glm4MoeConfig 4.x (no attribute_map),
// DeepSeek's own configuration_deepseek.py (writes the canonical keys), and top_k /
// num_experts_per_token / num_shared_experts / a renamed expert width, which none of the five
// families' config classes declares.
struct KeyAlias {
  Arch arch;
  const char* canonical;
  const char* alternative;
};
constexpr KeyAlias kKeyAliases[] = {
    // transformers 5 MixtralConfig.attribute_map {"num_experts": "num_local_experts"}
    {Arch::Mixtral, "num_local_experts", "num_experts"},
    // transformers 5 Qwen3MoeConfig.attribute_map {"num_experts": "num_local_experts"}: 4.x writes
    // num_experts, 5.x saves num_local_experts
    {Arch::Qwen3Moe, "num_experts", "num_local_experts"},
    // transformers 5 DeepseekV2Config.attribute_map {"num_experts": "n_routed_experts"}
    {Arch::DeepseekV2, "n_routed_experts", "num_experts"},
    // transformers 5 DeepseekV3Config.attribute_map {"num_local_experts": "n_routed_experts",
    // "num_mtp_layers": "num_nextn_predict_layers"}
    {Arch::DeepseekV3, "n_routed_experts", "num_local_experts"},
    {Arch::DeepseekV3, "num_nextn_predict_layers", "num_mtp_layers"},
    // transformers 5 Glm4MoeConfig.attribute_map {"num_local_experts": "n_routed_experts"}
    {Arch::Glm4Moe, "n_routed_experts", "num_local_experts"},
};

// Every spelling of `canonical` accepted for `a`, the canonical one first.
std::vector<std::string> key_spellings(Arch a, const char* canonical) {
  std::vector<std::string> keys{canonical};
  for (const auto& r : kKeyAliases)
    if (r.arch == a && std::string(r.canonical) == canonical) keys.push_back(r.alternative);
  return keys;
}

// Bound on any width read from a config, so a hostile file cannot ask for absurd allocations.
constexpr int64_t kMaxDim = int64_t(1) << 20;

}  // namespace

bool arch_has_correction_bias(Arch a) { return a == Arch::DeepseekV3 || a == Arch::Glm4Moe; }
bool arch_has_mtp(Arch a) { return a == Arch::DeepseekV3 || a == Arch::Glm4Moe; }
bool arch_is_deepseek_like(Arch a) { return a == Arch::DeepseekV2 || a == Arch::DeepseekV3 || a == Arch::Glm4Moe; }

const char* arch_name(Arch a) {
  for (const auto& r : kArchs)
    if (r.a == a) return r.name;
  return "?";
}

std::vector<std::string> arch_names() {
  std::vector<std::string> v;
  for (const auto& r : kArchs) v.push_back(r.name);
  return v;
}

Arch parse_arch(const std::string& model_type) {
  for (const auto& r : kArchs)
    if (model_type == r.name) return r.a;
  for (const auto& r : kModelTypeAliases)
    if (model_type == r.model_type) return r.arch;
  for (const auto& r : kRefusedFamilies)
    if (model_type == r.model_type)
      throw Error("model_type " + io::quoted(model_type) + " is not supported: " + r.feature +
                  "; the kernels do not compute that");
  std::string known;
  for (const auto& r : kArchs) known += std::string(known.empty() ? "" : ", ") + r.name;
  for (const auto& r : kModelTypeAliases) known += std::string(", ") + r.model_type + " (as " + arch_name(r.arch) + ")";
  throw Error("model_type " + io::quoted(model_type) + " is not a supported MoE architecture (supported: " + known + ")");
}

const char* layer_kind_name(LayerKind k) {
  switch (k) {
    case LayerKind::Dense: return "dense";
    case LayerKind::Moe: return "moe";
    case LayerKind::Mtp: return "mtp";
  }
  return "?";
}

ModelConfig parse_model_config(const std::string& text, const std::string& origin) {
  auto j = io::parse_json_strict<nlohmann::ordered_json>(text, origin);
  io::Obj o(j, origin, "");
  ModelConfig c;
  c.origin = origin;
  if (!j.is_object()) throw Error(origin + ": not a JSON object");
  const std::string mt = o.req_str("model_type");
  c.model_type = mt;
  try {
    c.arch = parse_arch(mt);
  } catch (const Error& e) {
    throw Error(origin + ": " + e.what());
  }
  // Every key is read through the alias table: K gives its spellings for this architecture, P the
  // spelling present (refusing two that disagree).
  auto K = [&](const char* canonical) { return key_spellings(c.arch, canonical); };
  auto P = [&](const char* canonical) { return o.pick(K(canonical)); };
  c.hidden = o.req_int_any(K("hidden_size"), 1, kMaxDim);
  c.num_layers = o.req_int_any(K("num_hidden_layers"), 1, 1 << 16);
  switch (c.arch) {
    case Arch::Mixtral:
      c.dense_inter = o.req_int_any(K("intermediate_size"), 1, kMaxDim);
      c.moe_inter = c.dense_inter;
      c.num_experts = int(o.req_int_any(K("num_local_experts"), 1, 1 << 20));
      c.top_k = int(o.req_int_any(K("num_experts_per_tok"), 1, 1 << 20));
      c.norm_topk_prob = true;  // Mixtral always renormalises the top-k softmax weights
      break;
    case Arch::Qwen2Moe:
    case Arch::Qwen3Moe:
    case Arch::Qwen3Next:
      c.dense_inter = o.opt_int(P("intermediate_size"), 0, 0, kMaxDim);
      c.moe_inter = o.req_int_any(K("moe_intermediate_size"), 1, kMaxDim);
      c.num_experts = int(o.req_int_any(K("num_experts"), 1, 1 << 20));
      c.top_k = int(o.req_int_any(K("num_experts_per_tok"), 1, 1 << 20));
      // transformers' defaults: false for Qwen2-MoE and Qwen3-MoE, true for Qwen3-Next
      c.norm_topk_prob = o.opt_bool(P("norm_topk_prob"), c.arch == Arch::Qwen3Next);
      c.decoder_sparse_step = int(o.opt_int(P("decoder_sparse_step"), 1, 1, 1 << 20));
      c.mlp_only_layers = o.opt_int_list(P("mlp_only_layers"));
      // Qwen3-Next's sparse block is Qwen2-MoE's: a shared expert behind a sigmoid gate.
      if (c.arch != Arch::Qwen3Moe)
        c.shared_expert_inter = o.req_int_any(K("shared_expert_intermediate_size"), 0, kMaxDim);
      break;
    case Arch::DeepseekV2:
    case Arch::DeepseekV3: {
      const bool v3 = c.arch == Arch::DeepseekV3;
      c.dense_inter = o.opt_int(P("intermediate_size"), 0, 0, kMaxDim);
      c.moe_inter = o.req_int_any(K("moe_intermediate_size"), 1, kMaxDim);
      c.num_experts = int(o.req_int_any(K("n_routed_experts"), 1, 1 << 20));
      c.top_k = int(o.req_int_any(K("num_experts_per_tok"), 1, 1 << 20));
      c.n_shared_experts = int(o.opt_int(P("n_shared_experts"), 0, 0, 1 << 20));
      c.topk_method = o.opt_str(P("topk_method"), v3 ? "noaux_tc" : "greedy");
      // NOTE: DeepSeek's own configuration_deepseek.py defaults to the misspelt "gready".
      if (c.topk_method == "gready") c.topk_method = "greedy";
      c.scoring_func = o.opt_str(P("scoring_func"), v3 ? "sigmoid" : "softmax");
      c.routed_scaling_factor = o.opt_double(P("routed_scaling_factor"), v3 ? 2.5 : 1.0);
      c.norm_topk_prob = o.opt_bool(P("norm_topk_prob"), v3);
      c.first_k_dense_replace = o.opt_int(P("first_k_dense_replace"), v3 ? 3 : 0, 0, 1 << 16);
      c.moe_layer_freq = o.opt_int(P("moe_layer_freq"), 1, 1, 1 << 16);
      if (v3) c.num_nextn_predict_layers = o.opt_int(P("num_nextn_predict_layers"), 0, 0, 16);
      const bool grouped = c.topk_method == "group_limited_greedy" || c.topk_method == "noaux_tc";
      c.n_group = int(o.opt_int(P("n_group"), grouped && v3 ? 8 : 1, 1, 1 << 20));
      c.topk_group = int(o.opt_int(P("topk_group"), grouped && v3 ? 4 : 1, 1, 1 << 20));
      if (!v3) {
        if (c.topk_method != "greedy" && c.topk_method != "group_limited_greedy")
          throw Error(origin + ": topk_method " + io::quoted(c.topk_method) +
                      " is not supported for deepseek_v2 (expected greedy or group_limited_greedy)");
        if (c.scoring_func != "softmax")
          throw Error(origin + ": scoring_func " + io::quoted(c.scoring_func) +
                      " is not supported for deepseek_v2 (expected softmax)");
        if (c.topk_method == "greedy") c.n_group = c.topk_group = 1;  // plain top-k
      } else {
        if (c.topk_method != "noaux_tc")
          throw Error(origin + ": topk_method " + io::quoted(c.topk_method) +
                      " is not supported for deepseek_v3 (expected noaux_tc)");
        if (c.scoring_func != "sigmoid")
          throw Error(origin + ": scoring_func " + io::quoted(c.scoring_func) +
                      " is not supported for deepseek_v3 (expected sigmoid)");
      }
      break;
    }
    case Arch::Glm4Moe:
      // Glm4MoeConfig: DeepSeek-V3's router (sigmoid, e_score_correction_bias, groups, scaling)
      // without topk_method / scoring_func keys; its own defaults.
      c.dense_inter = o.opt_int(P("intermediate_size"), 0, 0, kMaxDim);
      c.moe_inter = o.req_int_any(K("moe_intermediate_size"), 1, kMaxDim);
      c.num_experts = int(o.req_int_any(K("n_routed_experts"), 1, 1 << 20));
      c.top_k = int(o.req_int_any(K("num_experts_per_tok"), 1, 1 << 20));
      c.n_shared_experts = int(o.opt_int(P("n_shared_experts"), 1, 0, 1 << 20));
      c.topk_method = "noaux_tc";
      c.scoring_func = "sigmoid";
      c.routed_scaling_factor = o.opt_double(P("routed_scaling_factor"), 1.0);
      c.norm_topk_prob = o.opt_bool(P("norm_topk_prob"), true);
      c.first_k_dense_replace = o.opt_int(P("first_k_dense_replace"), 1, 0, 1 << 16);
      c.num_nextn_predict_layers = o.opt_int(P("num_nextn_predict_layers"), 0, 0, 16);
      c.n_group = int(o.opt_int(P("n_group"), 1, 1, 1 << 20));
      c.topk_group = int(o.opt_int(P("topk_group"), 1, 1, 1 << 20));
      break;
  }
  if (c.top_k > c.num_experts)
    throw Error(origin + ": num_experts_per_tok=" + std::to_string(c.top_k) + " is more than the " +
                std::to_string(c.num_experts) + " experts");
  try {
    c.routing().validate();
  } catch (const Error& e) {
    throw Error(origin + ": routing: " + e.what());
  }
  return c;
}

LayerKind ModelConfig::layer_kind(int64_t L) const {
  if (L < 0 || L >= total_layers())
    throw Error("layer " + std::to_string(L) + " does not exist: " + origin + " has " + std::to_string(num_layers) +
                " layers (0.." + std::to_string(total_layers() - 1) + ")");
  switch (arch) {
    case Arch::Mixtral: return LayerKind::Moe;
    case Arch::Qwen2Moe:
    case Arch::Qwen3Moe:
    case Arch::Qwen3Next: {
      bool mlp_only = std::find(mlp_only_layers.begin(), mlp_only_layers.end(), L) != mlp_only_layers.end();
      return !mlp_only && (L + 1) % decoder_sparse_step == 0 ? LayerKind::Moe : LayerKind::Dense;
    }
    case Arch::DeepseekV2:
    case Arch::DeepseekV3:
    case Arch::Glm4Moe:
      if (L >= num_layers) return LayerKind::Mtp;
      return L >= first_k_dense_replace && L % moe_layer_freq == 0 ? LayerKind::Moe : LayerKind::Dense;
  }
  return LayerKind::Dense;
}

std::string ModelConfig::moe_layer_rule() const {
  switch (arch) {
    case Arch::Mixtral: return "every layer is MoE";
    case Arch::Qwen2Moe:
    case Arch::Qwen3Moe:
    case Arch::Qwen3Next: {
      std::string s = "MoE iff (L+1) % decoder_sparse_step=" + std::to_string(decoder_sparse_step) + " == 0";
      if (!mlp_only_layers.empty()) {
        s += " and L not in mlp_only_layers [";
        for (size_t i = 0; i < mlp_only_layers.size(); ++i) s += (i ? ", " : "") + std::to_string(mlp_only_layers[i]);
        s += "]";
      }
      return s;
    }
    case Arch::DeepseekV2:
    case Arch::DeepseekV3:
    case Arch::Glm4Moe: {
      std::string s = "MoE iff L >= first_k_dense_replace=" + std::to_string(first_k_dense_replace);
      if (moe_layer_freq != 1) s += " and L % moe_layer_freq=" + std::to_string(moe_layer_freq) + " == 0";
      if (arch_has_mtp(arch) && num_nextn_predict_layers > 0)
        s += "; layers " + std::to_string(num_layers) + ".." + std::to_string(total_layers() - 1) +
             " are multi-token-prediction (MoE)";
      return s;
    }
  }
  return "";
}

std::string ModelConfig::mlp_prefix(int64_t L) const {
  return "model.layers." + std::to_string(L) + (arch == Arch::Mixtral ? ".block_sparse_moe" : ".mlp");
}

RoutingConfig ModelConfig::routing() const {
  RoutingConfig r;
  r.num_experts = num_experts;
  r.top_k = top_k;
  switch (arch) {
    case Arch::Mixtral:
    case Arch::Qwen2Moe:
    case Arch::Qwen3Moe:
    case Arch::Qwen3Next:
      r.method = RoutingMethod::SoftmaxTopK;
      r.renormalize = arch == Arch::Mixtral ? true : norm_topk_prob;
      break;
    case Arch::DeepseekV2:
      // "greedy" is the grouped method with one group: softmax, top-k, then DeepSeek-V2's
      // "renormalise if norm_topk_prob and top_k > 1, else scale" rule.
      r.method = RoutingMethod::GroupLimitedGreedy;
      r.n_group = n_group;
      r.topk_group = topk_group;
      r.renormalize = norm_topk_prob && top_k > 1;
      r.routed_scaling_factor = routed_scaling_factor;
      break;
    case Arch::DeepseekV3:
    case Arch::Glm4Moe:
      r.method = RoutingMethod::NoauxTc;
      r.n_group = n_group;
      r.topk_group = topk_group;
      r.renormalize = norm_topk_prob;
      r.routed_scaling_factor = routed_scaling_factor;
      break;
  }
  return r;
}

MoeLayerSpec ModelConfig::layer_spec(int64_t L) const {
  if (!is_moe(L))
    throw Error("layer " + std::to_string(L) + " of " + origin + " is a dense MLP layer, not MoE (" + arch_name(arch) +
                ": " + moe_layer_rule() + ")");
  MoeLayerSpec s;
  s.name = std::string(arch_name(arch)) + " layer " + std::to_string(L);
  s.hidden = hidden;
  s.inter = moe_inter;
  s.routing = routing();
  if ((arch == Arch::Qwen2Moe || arch == Arch::Qwen3Next) && shared_expert_inter > 0) {
    s.shared_kind = SharedExpertKind::SigmoidGated;
    s.shared_inter = shared_expert_inter;
  } else if (arch_is_deepseek_like(arch) && n_shared_experts > 0) {
    s.shared_kind = SharedExpertKind::Plain;
    s.shared_inter = moe_inter * n_shared_experts;
  }
  return s;
}

}  // namespace wna16
