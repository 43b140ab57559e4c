// The MoE layer: its shape and routing (MoeLayerSpec), its weights (MoeLayerWeights), the model
// presets, and a seeded random layer generator used by tests, `verify` and `bench`.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "wna16/quant.h"

namespace wna16 {

enum class RoutingMethod {
  SoftmaxTopK,         // Mixtral, Qwen: softmax over E, top-k, optional renormalisation
  GroupLimitedGreedy,  // DeepSeek-V2: softmax; group score = max in group; keep topk_group groups
  NoauxTc,             // DeepSeek-V3: sigmoid; select on s + bias; group score = sum of top-2
};
const char* routing_name(RoutingMethod m);

struct RoutingConfig {
  RoutingMethod method = RoutingMethod::SoftmaxTopK;
  int num_experts = 8;
  int top_k = 2;
  bool renormalize = true;             // norm_topk_prob (Mixtral: always true)
  int n_group = 1;                     // grouped methods only; num_experts % n_group == 0
  int topk_group = 1;                  // groups kept
  double routed_scaling_factor = 1.0;  // NoauxTc: always applied; GroupLimitedGreedy: applied
                                       // only when !renormalize (DeepSeek-V2 semantics)
  void validate() const;               // throws Error naming the bad value
};

enum class SharedExpertKind {
  None,
  Plain,           // DeepSeek: output += shared(x)
  SigmoidGated,    // Qwen2-MoE: output += sigmoid(x . shared_gate) * shared(x)
};

struct MoeLayerSpec {
  std::string name = "small";
  int64_t hidden = 256;        // H
  int64_t inter = 128;         // I, width of one routed expert
  RoutingConfig routing;       // num_experts and top_k live here
  SharedExpertKind shared_kind = SharedExpertKind::None;
  int64_t shared_inter = 0;    // width of the shared expert(s) MLP (all shared experts fused)
  void validate() const;
};

// SwiGLU expert: out = down( silu(gate(x)) * up(x) ). gate/up: K=H, N=I. down: K=I, N=H.
struct ExpertWeights {
  QuantizedLinear gate, up, down;
};

struct MoeLayerWeights {
  std::vector<float> router;           // [E, H] (torch layout of gate.weight), fp32
  std::vector<float> correction_bias;  // [E], NoauxTc only (e_score_correction_bias)
  std::vector<ExpertWeights> experts;  // E routed experts
  std::optional<ExpertWeights> shared; // shared expert(s), if spec.shared_kind != None
  std::vector<float> shared_gate;      // [H], SigmoidGated only
  // Throws Error if counts or shapes contradict spec (naming expert, tensor and sizes).
  void validate(const MoeLayerSpec& spec) const;
};

// Presets: "small" (default, fast on a CPU), "mixtral-8x7b", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b",
// "deepseek-v2-lite", "deepseek-v3". Throws Error listing the known names for an unknown one.
MoeLayerSpec preset(const std::string& name);
std::vector<std::string> preset_names();

// Random layer: weights ~ N(0, 1/sqrt(K)) quantized with `scheme` (per linear), router and
// shared_gate ~ N(0, 1/sqrt(H)) (so unit-variance activations give O(1) logits), bias ~ N(0, 0.1).
// Deterministic for a seed, whatever the number of threads it uses.
MoeLayerWeights random_layer(const MoeLayerSpec& spec, const QuantScheme& scheme, uint64_t seed);

}  // namespace wna16
