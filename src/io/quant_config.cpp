// Quantization configs: config.json's quantization_config, AutoGPTQ/GPTQModel quantize_config.json
// and old AutoAWQ quant_config.json, with every key variant and GPTQModel `dynamic` overrides.
#include <algorithm>
#include <optional>

#include "io/config_util.h"
#include "io/quant_util.h"
#include "wna16/checkpoint.h"
#include "wna16/error.h"

namespace wna16 {

using io::check_bits;
using io::check_group;
using io::lower;

namespace {

// Every spelling of a GPTQ/AWQ quantization-config field: the one place they are resolved.
// `negated`: the spelling holds the opposite boolean. Sources: GPTQModel's
// QUANT_CONFIG_ARG_SYNONYMS and QUANT_CONFIG_ARG_SYNONYMS_NEGATED (w_bit, wbits, q_group_size,
// version, checkpoint_format -> format; zero_point -> not sym) and its to_dict (GPTQ: checkpoint_format
// and format; AWQ: checkpoint_format, format, version and zero_point), AutoAWQ's quant_config.json
// (w_bit, q_group_size, version, zero_point), AutoRound's AWQ export (sym beside zero_point),
// transformers GPTQConfig (checkpoint_format) and AwqConfig (version).
struct QuantKey {
  const char* field;
  const char* spelling;
  bool negated;
};
constexpr QuantKey kQuantKeys[] = {
    {"bits", "bits", false},
    {"bits", "w_bit", false},
    {"bits", "wbits", false},
    {"group_size", "group_size", false},
    {"group_size", "q_group_size", false},
    {"format", "checkpoint_format", false},
    {"format", "format", false},
    {"format", "version", false},
    {"sym", "sym", false},
    {"sym", "zero_point", true},
};

struct FieldKey {
  std::string key;  // the spelling present
  bool negated = false;
};

// The spelling of `field` present in `o`, if any. Spellings that disagree (strings compared in any
// case, negated booleans flipped) are refused naming both keys and values.
std::optional<FieldKey> find_field(const io::Obj& o, const std::string& field) {
  using J = nlohmann::ordered_json;
  std::optional<FieldKey> found;
  J found_value;
  for (const auto& k : kQuantKeys) {
    const J* v = o.get(k.spelling);
    if (field != k.field || !v) continue;
    J norm = *v;
    if (k.negated && v->is_boolean()) norm = !v->get<bool>();
    if (norm.is_string()) norm = lower(norm.get<std::string>());
    if (!found) {
      found = FieldKey{k.spelling, k.negated};
      found_value = norm;
    } else if (norm != found_value) {
      throw Error(o.where(found->key) + " = " + o.value_str(*o.get(found->key)) + " and " + k.spelling + " = " + o.value_str(*v) +
                  " disagree (two spellings of one field" + (k.negated != found->negated ? ", one of them negated" : "") + ")");
    }
  }
  return found;
}

std::vector<std::string> spellings_of(const std::string& field) {
  std::vector<std::string> v;
  for (const auto& k : kQuantKeys)
    if (field == k.field) v.push_back(k.spelling);
  return v;
}

int64_t req_field_int(const io::Obj& o, const std::string& field, int64_t lo, int64_t hi, std::string* key) {
  const auto f = find_field(o, field);
  if (!f) throw Error(o.where(io::Obj::spellings(spellings_of(field))) + " is missing");
  *key = f->key;
  return o.req_int(f->key, lo, hi);
}

}  // namespace

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

  std::string bits_key, group_key;
  const int64_t bits = req_field_int(o, "bits", -1000000, 1000000, &bits_key);
  check_bits(bits, q.method, o.where(bits_key));
  const int64_t group = req_field_int(o, "group_size", -1000000, 1 << 20, &group_key);
  check_group(group, o.where(group_key));
  const auto fmt_key = find_field(o, "format");
  const auto sym_key = find_field(o, "sym");
  // sym from whichever spelling is present (zero_point: true means asymmetric)
  const bool sym = sym_key ? o.opt_bool(sym_key->key, true) != sym_key->negated : q.method == QuantMethod::Gptq;

  q.scheme.bits = int(bits);
  q.scheme.group_size = int(group);
  q.modules_to_not_convert = o.opt_str_list("modules_to_not_convert");

  if (q.method == QuantMethod::Gptq) {
    q.scheme.act_order = o.opt_bool("desc_act", false);
    q.scheme.sym = sym;
    q.static_groups = o.opt_bool("static_groups", false);
    if (o.opt_bool("is_marlin_format", false))
      throw Error(o.where("is_marlin_format") +
                  " = true: the Marlin-repacked GPTQ layout is not supported; use the original gptq checkpoint");
    const std::string fkey = fmt_key ? fmt_key->key : "checkpoint_format";
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
    const std::string vkey = fmt_key ? fmt_key->key : "version";
    const std::string ver = lower(o.opt_str(vkey, "gemm"));
    if (ver != "gemm")
      throw Error(o.where(vkey) + " = " + io::quoted(ver) +
                  " is not supported: wna16 reads the AWQ \"gemm\" layout (gemv, gemv_fast and marlin pack the weights differently)");
    q.zero_point = !sym;
    if (!q.zero_point)
      throw Error(o.where(sym_key->key) + " = " + o.value_str(*o.get(sym_key->key)) +
                  ": symmetric AWQ (no qzeros) is not supported; wna16 runs AWQ gemm with zero points");
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
