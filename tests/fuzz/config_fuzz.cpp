// libFuzzer target: config.json (model config, layer rules, MoE specs) and the quantization config
// parsers in their three key variants (quantization_config, quantize_config.json, quant_config.json).
// Seeds: tests/data/fuzz/config. Run by scripts/fuzz.
#include <cstddef>
#include <cstdint>
#include <string>

#include "wna16/checkpoint.h"
#include "wna16/error.h"

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
      // NOTE: scheme_for() runs the `dynamic` regexes; std::regex backtracks, so a hostile pattern
      // can take exponential time on a long name. Only the parsers are fuzzed here.
    } catch (const wna16::Error&) {
    }
  }
  return 0;
}
