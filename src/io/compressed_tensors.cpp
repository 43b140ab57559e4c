// compressed-tensors quantization configs (llm-compressor's `quant_method: compressed-tensors`):
// config_groups of int weight-only schemes in the pack-quantized format, `targets` and `ignore`
// matched as compressed-tensors matches them (src/compressed_tensors/utils/match.py: "re:" is
// Python re.match, anything else an exact module name or a torch class name).
#include <set>

#include "io/config_util.h"
#include "io/quant_util.h"
#include "wna16/checkpoint.h"
#include "wna16/error.h"

namespace wna16 {

int ModuleTarget::match_rank(const std::string& module) const {
  if (regex) return re.matches(module) ? 2 : 0;
  if (text == module) return 1;
  // Every module wna16 asks about is an nn.Linear, whose class chain is Linear -> Module.
  return text == "Linear" || text == "Module" ? 3 : 0;
}

namespace io {

namespace {

constexpr const char* kPacked = "pack-quantized";

std::vector<ModuleTarget> compile_targets(const Obj& o, const std::string& key) {
  std::vector<ModuleTarget> out;
  for (const std::string& t : o.opt_str_list(key)) {
    ModuleTarget m;
    m.text = t;
    if (t.rfind("re:", 0) == 0) {
      m.regex = true;
      m.re = ModulePattern::compile(t.substr(3), o.where(key) + "[" + io::quoted(t) + "]");
    }
    out.push_back(std::move(m));
  }
  return out;
}

// A format name compressed-tensors writes, refused unless it is pack-quantized.
void check_format(const Obj& o, const std::string& key, const std::string& fmt) {
  if (fmt == kPacked) return;
  throw Error(o.where(key) + " = " + io::quoted(fmt) +
              " is not supported: wna16 reads the compressed-tensors \"pack-quantized\" format (int4/int8 weights packed"
              " into int32, weight-only W4A16/W8A16)");
}

// The "weights" QuantizationArgs of a group; defaults and rules as compressed-tensors' quant_args.py.
void parse_weights(const Obj& w, CtGroup& g) {
  const int64_t bits = w.opt_int("num_bits", 8, -1000000, 1000000);  // compressed-tensors' default is 8
  check_bits(bits, QuantMethod::CompressedTensors, w.where("num_bits"));
  const std::string type = lower(w.opt_str("type", "int"));
  if (type != "int")
    throw Error(w.where("type") + " = " + io::quoted(type) + " is not supported: wna16 runs integer weights (\"int\")");
  const bool sym = w.opt_bool("symmetric", true);
  const std::optional<int64_t> group = w.maybe_int("group_size", -1000000, 1 << 20);
  if (group) check_group(*group, w.where("group_size"));
  std::string strategy = lower(w.opt_str("strategy", ""));
  if (strategy.empty()) strategy = !group ? "tensor" : *group > 0 ? "group" : "channel";  // as quant_args.py infers it
  int group_size = -1;
  if (strategy == "group") {
    if (!group || *group <= 0)
      throw Error(w.where("strategy") + " = \"group\" needs a positive group_size (got " +
                  (group ? std::to_string(*group) : std::string("none")) + ")");
    group_size = int(*group);
  } else if (strategy == "channel") {
    if (group && *group > 0)
      throw Error(w.where("group_size") + " = " + std::to_string(*group) + " contradicts strategy \"channel\" (one scale per output)");
  } else {
    throw Error(w.where("strategy") + " = " + io::quoted(strategy) +
                " is not supported: wna16 runs the \"group\" and \"channel\" strategies");
  }
  if (const auto* a = w.get("actorder")) {
    if (a->is_boolean()) {
      g.actorder = a->get<bool>() ? "group" : "";  // quant_args.py: true means "group"
    } else if (a->is_string()) {
      const std::string v = lower(a->get<std::string>());
      if (v == "group" || v == "dynamic") g.actorder = "group";  // "dynamic" is an alias of "group"
      else if (v == "weight" || v == "static") g.actorder = "weight";  // "static" is an alias of "weight"
      else
        throw Error(w.where("actorder") + " = " + io::quoted(v) + " is not an activation ordering (group, weight, dynamic, static)");
    } else {
      throw Error(w.where("actorder") + " = " + w.value_str(*a) + " is not a string, true, false or null");
    }
    if (!g.actorder.empty() && strategy != "group")
      throw Error(w.where("actorder") + " = " + io::quoted(g.actorder) + " needs strategy \"group\" (got " + io::quoted(strategy) + ")");
  }
  if (const auto* d = w.get("dynamic"); d && !(d->is_boolean() && !d->get<bool>()))
    throw Error(w.where("dynamic") + " = " + w.value_str(*d) +
                " is not supported: pack-quantized weights have static scales (dynamic must be false)");
  g.scheme.format = Format::GptqV2;  // the loader converts to GPTQ v2: the real zero point, no -1
  g.scheme.bits = int(bits);
  g.scheme.group_size = group_size;
  g.scheme.sym = sym;
  g.scheme.act_order = g.actorder == "group";
}

}  // namespace

void parse_compressed_tensors(const Obj& o, const std::string& origin, const std::string& path, QuantConfig& q) {
  const std::string fmt = lower(o.opt_str("format", ""));
  if (fmt.empty()) throw Error(o.where("format") + " is missing (compressed-tensors writes \"pack-quantized\" for W4A16/W8A16)");
  if (fmt != "mixed-precision") check_format(o, "format", fmt);  // mixed-precision: each group names its own
  const std::string status = lower(o.opt_str("quantization_status", "compressed"));
  if (status != "compressed")
    throw Error(o.where("quantization_status") + " = " + io::quoted(status) +
                " is not supported: wna16 reads compressed checkpoints (\"compressed\"), whose weights are packed");
  if (const auto* sp = o.get("sparsity_config"); sp && sp->is_object() && !sp->empty()) {
    Obj s(*sp, origin, path + "sparsity_config.");
    const std::string sf = lower(s.opt_str("format", "dense"));
    if (sf != "dense")
      throw Error(s.where("format") + " = " + io::quoted(sf) + " is not supported: wna16 reads dense (not sparse-compressed) weights");
  }
  if (const auto* t = o.get("transform_config"); t && !(t->is_object() && t->empty()))
    throw Error(o.where("transform_config") + " = " + o.value_str(*t) +
                " is not supported: wna16 does not apply compressed-tensors transforms (rotations) to the weights");

  const auto* groups = o.get("config_groups");
  if (!groups) throw Error(o.where("config_groups") + " is missing");
  if (!groups->is_object() || groups->empty())
    throw Error(o.where("config_groups") + " = " + o.value_str(*groups) + " is not a non-empty object of groups");
  std::set<std::string> seen;
  for (auto it = groups->begin(); it != groups->end(); ++it) {
    const std::string gpath = path + "config_groups." + it.key() + ".";
    if (!it.value().is_object()) throw Error(o.where("config_groups") + "." + it.key() + " is not an object");
    Obj g(it.value(), origin, gpath);
    CtGroup grp;
    grp.name = it.key();
    if (g.has("format")) check_format(g, "format", lower(g.req_str("format")));
    else if (fmt != kPacked) throw Error(g.where("format") + " is missing (the top-level format is \"" + fmt + "\")");
    for (const char* act : {"input_activations", "output_activations"})
      if (const auto* a = g.get(act))
        throw Error(g.where(act) + " = " + g.value_str(*a) +
                    " is not supported: wna16 runs weight-only schemes (W4A16/W8A16); activations stay 16-bit");
    const auto* w = g.get("weights");
    if (!w || !w->is_object()) throw Error(g.where("weights") + " is missing or not an object (a weight-only scheme needs it)");
    parse_weights(Obj(*w, origin, gpath + "weights."), grp);
    grp.targets = compile_targets(g, "targets");
    if (grp.targets.empty()) throw Error(g.where("targets") + " is missing or empty");
    for (const auto& t : grp.targets)
      if (!seen.insert(t.text).second)
        throw Error(g.where("targets") + " repeats " + io::quoted(t.text) + ", already a target of another group: which scheme applies is ambiguous");
    q.ct_groups.push_back(std::move(grp));
  }
  q.ct_ignore = compile_targets(o, "ignore");
  q.scheme = q.ct_groups.front().scheme;
}

std::string describe_compressed_tensors(const QuantConfig& q) {
  std::string s = "compressed-tensors pack-quantized";
  for (const auto& g : q.ct_groups) {
    s += ", " + g.name + ": " + std::to_string(g.scheme.bits) + "-bit " +
         (g.scheme.group_size > 0 ? "group " + std::to_string(g.scheme.group_size) : std::string("channel")) +
         (g.scheme.sym ? " sym" : " asym") + (g.actorder.empty() ? "" : " actorder " + g.actorder) + " on [";
    for (size_t i = 0; i < g.targets.size(); ++i) s += (i ? ", " : "") + g.targets[i].text;
    s += "]";
  }
  if (!q.ct_ignore.empty()) {
    s += ", ignore [";
    for (size_t i = 0; i < q.ct_ignore.size(); ++i) s += (i ? ", " : "") + q.ct_ignore[i].text;
    s += "]";
  }
  return s;
}

}  // namespace io
}  // namespace wna16
