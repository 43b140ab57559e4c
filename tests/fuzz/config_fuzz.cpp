// libFuzzer target: config.json (model config, layer rules, MoE specs) and the quantization config
// parsers in their three key variants (quantization_config, quantize_config.json, quant_config.json),
// and the matching of every GPTQModel `dynamic` pattern and compressed-tensors target / ignore entry
// they compiled against a few module names.
// Seeds: tests/data/fuzz/config. Run by scripts/fuzz.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "wna16/checkpoint.h"
#include "wna16/error.h"

namespace {

const std::vector<std::string>& module_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v = {"model.layers.0.mlp.experts.0.gate_proj", "model.layers.3.mlp.shared_expert.up_proj",
                                  "model.layers.61.block_sparse_moe.experts.7.w2", "", "x"};
    std::string longer;  // a 10,000-character name: a backtracking engine would hang on it
    while (longer.size() < 10000) longer += "model.layers.12.mlp.experts.255.down_proj.";
    v.push_back(longer);
    return v;
  }();
  return names;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const wna16::ModelConfig c = wna16::parse_model_config(text, "fuzz/config.json");
    (void)c.moe_layer_rule();
    for (int64_t L = 0; L < c.total_layers() && L < 8; ++L) {
      (void)c.mlp_prefix(L);
      try {
        (void)c.layer_spec(L);
      } catch (const wna16::Error&) {
      }
    }
  } catch (const wna16::Error&) {
  }
  for (const char* kind : {"quantization_config", "quantize_config.json", "quant_config.json"}) {
    try {
      const wna16::QuantConfig q = wna16::parse_quant_config(text, "fuzz/config.json", kind);
      (void)q.describe();
      // Matching is fuzzed too: every compiled `dynamic` pattern against a few module names (one of
      // them long), directly and through scheme_for's first-match-wins walk. RE2 matches in linear
      // time, so a hostile pattern cannot turn into a timeout here.
      for (const std::string& name : module_names()) {
        for (const auto& r : q.dynamic) (void)r.re.matches(name);
        for (const auto& t : q.ct_ignore) (void)t.match_rank(name);
        for (const auto& g : q.ct_groups)
          for (const auto& t : g.targets) (void)t.match_rank(name);
        try {
          (void)q.scheme_for(name);
        } catch (const wna16::Error&) {
        }
      }
    } catch (const wna16::Error&) {
    }
  }
  return 0;
}
