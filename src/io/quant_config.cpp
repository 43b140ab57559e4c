// Quantization configs: config.json's quantization_config, AutoGPTQ/GPTQModel quantize_config.json
// and old AutoAWQ quant_config.json, with every key variant and GPTQModel `dynamic` overrides.
#include <algorithm>

#include "io/config_util.h"
#include "io/quant_util.h"
#include "wna16/checkpoint.h"
#include "wna16/error.h"

namespace wna16 {

using io::check_bits;
using io::check_group;
using io::lower;

QuantConfig parse_quant_config(const std::string& text, const std::string& origin, const std::string& kind) {
  using J = nlohmann::ordered_json;
  J j = io::parse_json_strict<J>(text, origin);
  if (!j.is_object()) throw Error(origin + ": quantization config is not a JSON object");
  const std::string path = kind == "quantization_config" ? "quantization_config." : "";
  io::Obj o(j, origin, path);
  QuantConfig q;
  q.origin = kind == "quantization_config" ? origin + " quantization_config" : origin;

  std::string method;
  if (o.has("quant_method")) {
    method = lower(o.req_str("quant_method"));
  } else if (kind == "quant_config.json" || o.has("w_bit")) {
    method = "awq";  // old AutoAWQ files carry no quant_method
  } else if (kind == "quantize_config.json") {
    method = "gptq";  // AutoGPTQ's quantize_config.json predates quant_method
  } else {
    throw Error(o.where("quant_method") + " is missing");
  }
  if (method == "gptq") {
    q.method = QuantMethod::Gptq;
  } else if (method == "awq") {
    q.method = QuantMethod::Awq;
  } else if (method == "compressed-tensors") {
    q.method = QuantMethod::CompressedTensors;
    io::parse_compressed_tensors(o, origin, path, q);
    return q;
  } else {
    throw Error(o.where("quant_method") + " = " + io::quoted(method) +
                " is not supported: wna16 runs GPTQ (\"gptq\"), AWQ (\"awq\") and compressed-tensors"
                " (\"compressed-tensors\", pack-quantized) checkpoints");
  }

  const std::string bits_key = o.has("bits") ? "bits" : "w_bit";
  const int64_t bits = o.req_int(bits_key, -1000000, 1000000);
  check_bits(bits, q.method, o.where(bits_key));
  const std::string group_key = o.has("group_size") ? "group_size" : "q_group_size";
  const int64_t group = o.req_int(group_key, -1000000, 1 << 20);
  check_group(group, o.where(group_key));

  q.scheme.bits = int(bits);
  q.scheme.group_size = int(group);
  q.modules_to_not_convert = o.opt_str_list("modules_to_not_convert");

  if (q.method == QuantMethod::Gptq) {
    q.scheme.act_order = o.opt_bool("desc_act", false);
    q.scheme.sym = o.opt_bool("sym", true);
    q.static_groups = o.opt_bool("static_groups", false);
    if (o.opt_bool("is_marlin_format", false))
      throw Error(o.where("is_marlin_format") +
                  " = true: the Marlin-repacked GPTQ layout is not supported; use the original gptq checkpoint");
    const std::string fkey = o.has("checkpoint_format") ? "checkpoint_format" : "format";
    const std::string fmt = lower(o.opt_str(fkey, "gptq"));
    if (fmt == "gptq") {
      q.scheme.format = Format::GptqV1;
    } else if (fmt == "gptq_v2") {
      q.scheme.format = Format::GptqV2;
    } else {
      throw Error(o.where(fkey) + " = " + io::quoted(fmt) +
                  " is not supported: wna16 reads the \"gptq\" and \"gptq_v2\" layouts" +
                  (fmt == "marlin" ? " (\"marlin\" is a kernel-specific repacking of the weights)" : ""));
    }
    if (const auto* d = o.get("dynamic")) {
      if (!d->is_object()) throw Error(o.where("dynamic") + " is not an object of regex -> overrides");
      for (auto it = d->begin(); it != d->end(); ++it) {
        DynamicRule r;
        r.pattern = it.key();
        std::string re = r.pattern;
        if (re.rfind("-:", 0) == 0) {
          r.negative = true;
          re = re.substr(2);
        } else if (re.rfind("+:", 0) == 0) {
          re = re.substr(2);
        }
        const std::string where = o.where("dynamic") + "[" + io::quoted(r.pattern) + "]";
        // Python re syntax, linear-time matching; refusals name the pattern (where) and the construct.
        r.re = ModulePattern::compile(re, where);
        if (!it.value().is_object()) throw Error(where + " is not an object of overrides");
        io::Obj ov(it.value(), origin, path + "dynamic[" + io::quoted(r.pattern) + "].");
        if (auto b = ov.maybe_int("bits", -1000000, 1000000)) {
          check_bits(*b, q.method, ov.where("bits"));
          r.bits = int(*b);
        }
        if (auto g = ov.maybe_int("group_size", -1000000, 1 << 20)) {
          check_group(*g, ov.where("group_size"));
          r.group_size = int(*g);
        }
        r.desc_act = ov.maybe_bool("desc_act");
        r.sym = ov.maybe_bool("sym");
        q.dynamic.push_back(std::move(r));
      }
    }
  } else {
    q.scheme.format = Format::Awq;
    q.scheme.sym = false;  // AWQ always stores zero points
    q.scheme.act_order = false;
    q.zero_point = o.opt_bool("zero_point", true);
    if (!q.zero_point)
      throw Error(o.where("zero_point") + " = false: symmetric AWQ (no qzeros) is not supported; wna16 runs AWQ gemm with zero points");
    const std::string vkey = o.has("version") ? "version" : "format";
    const std::string ver = lower(o.opt_str(vkey, "gemm"));
    if (ver != "gemm")
      throw Error(o.where(vkey) + " = " + io::quoted(ver) +
                  " is not supported: wna16 reads the AWQ \"gemm\" layout (gemv, gemv_fast and marlin pack the weights differently)");
  }
  return q;
}

std::optional<QuantScheme> QuantConfig::scheme_for(const std::string& module) const {
  if (method == QuantMethod::None) return std::nullopt;
  if (method == QuantMethod::CompressedTensors) {
    for (const auto& t : ct_ignore)
      if (t.match_rank(module)) return std::nullopt;
    // compressed-tensors' priority: exact name, then regex, then class name; ties by target text.
    const CtGroup* best = nullptr;
    const ModuleTarget* best_t = nullptr;
    int best_rank = 0;
    for (const auto& g : ct_groups)
      for (const auto& t : g.targets) {
        const int r = t.match_rank(module);
        if (r && (!best || r < best_rank || (r == best_rank && t.text < best_t->text))) {
          best = &g;
          best_t = &t;
          best_rank = r;
        }
      }
    if (!best) return std::nullopt;
    return best->scheme;
  }
  for (const auto& m : modules_to_not_convert)
    if (!m.empty() && module.find(m) != std::string::npos) return std::nullopt;
  QuantScheme s = scheme;
  for (const auto& r : dynamic) {
    if (!r.re.matches(module)) continue;
    if (r.negative) return std::nullopt;
    if (r.bits) s.bits = *r.bits;
    if (r.group_size) s.group_size = *r.group_size;
    if (r.desc_act) s.act_order = *r.desc_act;
    if (r.sym) s.sym = *r.sym;
    break;
  }
  return s;
}

std::string QuantConfig::describe() const {
  if (method == QuantMethod::None) return "none (no quantization config)";
  if (method == QuantMethod::CompressedTensors) return io::describe_compressed_tensors(*this) + " (from " + origin + ")";
  std::string s = std::string(method == QuantMethod::Gptq ? "gptq" : "awq") + " " + std::to_string(scheme.bits) +
                  "-bit, group_size " + std::to_string(scheme.group_size);
  if (method == QuantMethod::Gptq) {
    s += std::string(", layout ") + format_name(scheme.format) + (scheme.sym ? ", sym" : ", asym") +
         (scheme.act_order ? ", desc_act" : "") + (static_groups ? ", static_groups" : "");
  } else {
    s += ", gemm, zero_point";
  }
  if (!modules_to_not_convert.empty()) {
    s += ", modules_to_not_convert [";
    for (size_t i = 0; i < modules_to_not_convert.size(); ++i) s += (i ? ", " : "") + modules_to_not_convert[i];
    s += "]";
  }
  if (!dynamic.empty()) s += ", " + std::to_string(dynamic.size()) + " dynamic rule(s)";
  return s + " (from " + origin + ")";
}

}  // namespace wna16
