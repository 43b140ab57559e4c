// `wna16 inspect`, `wna16 synth`, `wna16 run`, `wna16 dequantize`: Hugging Face GPTQ/AWQ MoE checkpoints.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <random>

#include "commands.h"
#include "wna16/backend.h"
#include "wna16/checkpoint.h"
#include "wna16/error.h"
#include "wna16/half.h"
#include "wna16/reference.h"

namespace wna16::cli {

namespace {

std::string human_bytes(uint64_t b) {
  char buf[64];
  if (b >= (uint64_t(1) << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", double(b) / double(uint64_t(1) << 30));
  else if (b >= (uint64_t(1) << 20)) std::snprintf(buf, sizeof buf, "%.2f MiB", double(b) / double(1 << 20));
  else if (b >= 1024) std::snprintf(buf, sizeof buf, "%.1f KiB", double(b) / 1024.0);
  else std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(b));
  return buf;
}

// "0-2, 5" for a sorted list of layer indices.
std::string ranges(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size();) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    s += (s.empty() ? "" : ", ") + std::to_string(v[i]) + (j > i ? "-" + std::to_string(v[j]) : "");
    i = j + 1;
  }
  return s.empty() ? "none" : s;
}

// Module kind of a linear: its name without "model.layers.L." and with the expert index as '*'.
std::string module_role(const std::string& module) {
  std::string s = module;
  const std::string layers = "model.layers.";
  if (s.rfind(layers, 0) == 0) {
    const size_t dot = s.find('.', layers.size());
    if (dot != std::string::npos) s = s.substr(dot + 1);
  }
  const std::string experts = ".experts.";
  if (size_t at = s.find(experts); at != std::string::npos) {
    const size_t begin = at + experts.size();
    size_t end = begin;
    while (end < s.size() && s[end] >= '0' && s[end] <= '9') ++end;
    if (end > begin) s.replace(begin, end - begin, "*");
  }
  return s;
}

std::string routing_str(const ModelConfig& c) {
  const RoutingConfig r = c.routing();
  char buf[256];
  switch (r.method) {
    case RoutingMethod::SoftmaxTopK:
      std::snprintf(buf, sizeof buf, "softmax top-%d%s", r.top_k, r.renormalize ? ", renormalised" : ", not renormalised");
      break;
    case RoutingMethod::GroupLimitedGreedy:
      std::snprintf(buf, sizeof buf, "%s: softmax, %d group(s) keep %d, top-%d, %s", c.topk_method.c_str(), r.n_group,
                    r.topk_group, r.top_k,
                    r.renormalize ? "renormalised" : ("scaled by routed_scaling_factor " + std::to_string(r.routed_scaling_factor)).c_str());
      break;
    case RoutingMethod::NoauxTc:
      std::snprintf(buf, sizeof buf, "noaux_tc: sigmoid + e_score_correction_bias, %d groups keep %d (top-2 sum), top-%d, %s, x %.4g",
                    r.n_group, r.topk_group, r.top_k, r.renormalize ? "renormalised" : "not renormalised",
                    r.routed_scaling_factor);
      break;
  }
  return buf;
}

// ---- inspect -------------------------------------------------------------------------------

int run_inspect(const std::string& dir) {
  const Checkpoint ck = Checkpoint::open(dir);
  const ModelConfig& c = ck.config();
  std::printf("checkpoint: %s\n", dir.c_str());
  std::printf("architecture: %s%s\n", arch_name(c.arch),
              c.model_type == arch_name(c.arch) ? "" : (" (model_type " + c.model_type + ")").c_str());
  std::printf("hidden_size: %lld, layers: %lld\n", static_cast<long long>(c.hidden), static_cast<long long>(c.num_layers));

  std::vector<int64_t> dense, moe, mtp;
  for (int64_t L = 0; L < c.total_layers(); ++L) {
    switch (c.layer_kind(L)) {
      case LayerKind::Dense: dense.push_back(L); break;
      case LayerKind::Moe: moe.push_back(L); break;
      case LayerKind::Mtp: mtp.push_back(L); break;
    }
  }
  std::printf("layers: MoE %s; dense %s%s%s  (%s)\n", ranges(moe).c_str(), ranges(dense).c_str(),
              mtp.empty() ? "" : "; multi-token-prediction ", mtp.empty() ? "" : ranges(mtp).c_str(),
              c.moe_layer_rule().c_str());
  std::printf("experts: %d routed, top-%d, width %lld", c.num_experts, c.top_k, static_cast<long long>(c.moe_inter));
  if (!moe.empty() || !mtp.empty()) {
    const MoeLayerSpec spec = c.layer_spec(moe.empty() ? mtp[0] : moe[0]);
    if (spec.shared_kind == SharedExpertKind::Plain)
      std::printf("; shared: %d expert(s), fused width %lld, added", c.n_shared_experts, static_cast<long long>(spec.shared_inter));
    else if (spec.shared_kind == SharedExpertKind::SigmoidGated)
      std::printf("; shared: width %lld, gated by sigmoid(shared_expert_gate x)", static_cast<long long>(spec.shared_inter));
    else
      std::printf("; shared: none");
  }
  std::printf("\nrouting: %s\n", routing_str(c).c_str());
  std::printf("quantization config: %s\n", ck.quant().describe().c_str());
  std::printf("tensors: %zu in %s\n", ck.tensors().names().size(), ck.tensors().layout().c_str());

  // Per module kind: how each is stored, over every layer.
  std::map<std::string, std::map<std::string, int>> kinds;
  std::vector<std::string> problems;
  std::vector<LayerInfo> infos;
  for (int64_t L = 0; L < c.total_layers(); ++L) {
    LayerInfo li = ck.describe_layer(L);
    for (const auto& lin : li.linears) {
      const std::string how = !lin.present ? "missing" : lin.storage.empty() ? "unreadable (see problems)" : lin.storage;
      std::string kind = std::string(li.kind == LayerKind::Dense ? "dense layers: " : "") + module_role(lin.module);
      kinds[kind][how]++;
    }
    for (const auto& p : li.problems) problems.push_back("layer " + std::to_string(L) + ": " + p);
    infos.push_back(std::move(li));
  }
  std::printf("modules (kind: storage x count over all layers):\n");
  for (const auto& [kind, hows] : kinds) {
    std::printf("  %-40s", kind.c_str());
    bool first = true;
    for (const auto& [how, n] : hows) {
      std::printf("%s%s x %d", first ? "" : "; ", how.c_str(), n);
      first = false;
    }
    std::printf("\n");
  }
  std::printf("per layer:\n");
  for (const auto& li : infos) {
    if (li.kind == LayerKind::Dense) {
      std::printf("  layer %-4lld dense  %s%s\n", static_cast<long long>(li.layer), human_bytes(li.bytes).c_str(),
                  li.present ? "" : " (MLP tensors not in the checkpoint)");
    } else if (!li.present) {
      std::printf("  layer %-4lld %-5s  absent (no tensors)\n", static_cast<long long>(li.layer), layer_kind_name(li.kind));
    } else {
      std::printf("  layer %-4lld %-5s  %s, %s per routed expert\n", static_cast<long long>(li.layer),
                  layer_kind_name(li.kind), human_bytes(li.bytes).c_str(), human_bytes(li.expert_bytes).c_str());
    }
  }
  if (problems.empty()) {
    std::printf("problems: none\nPASSED\n");
    return 0;
  }
  std::printf("problems (%zu):\n", problems.size());
  const size_t shown = std::min<size_t>(problems.size(), 50);
  for (size_t i = 0; i < shown; ++i) std::printf("  %s\n", problems[i].c_str());
  if (shown < problems.size()) std::printf("  ... and %zu more\n", problems.size() - shown);
  std::printf("FAILED\n");
  return 1;
}

// ---- synth -------------------------------------------------------------------------------

struct SynthFlags {
  std::string dir, arch, format, actorder;
  int bits = 4, group_size = 128;
  bool desc_act = false, asym = false;
  int64_t layers = 2;
  uint64_t max_shard_size = 256 * 1024;
  uint64_t seed = 1;
  std::string example_input;
  int64_t tokens = 17;
  std::string input_dtype = "bf16";
};

DType parse_act_dtype(const std::string& s) {
  if (s == "bf16") return DType::BF16;
  if (s == "f16" || s == "fp16") return DType::F16;
  if (s == "f32" || s == "fp32") return DType::F32;
  throw Error("unknown dtype '" + s + "' (expected bf16, f16 or f32)");
}

int run_synth(const SynthFlags& f) {
  SynthOptions o;
  o.dir = f.dir;
  o.arch = parse_arch(f.arch);
  o.compressed_tensors = f.format == "compressed-tensors";
  if (!o.compressed_tensors) o.format = parse_format(f.format);
  o.bits = f.bits;
  o.group_size = f.group_size;
  o.desc_act = f.desc_act;
  if (!f.actorder.empty()) {
    if (!o.compressed_tensors) throw Error("--actorder is a compressed-tensors option (--format compressed-tensors); GPTQ uses --desc-act");
    if (f.actorder != "group" && f.actorder != "weight") throw Error("--actorder '" + f.actorder + "' is not group or weight");
    o.desc_act = o.desc_act || f.actorder == "group";
    o.actorder_weight = f.actorder == "weight";
  }
  o.asym = f.asym;
  o.layers = f.layers;
  o.max_shard_size = f.max_shard_size;
  o.seed = f.seed;
  if (!f.example_input.empty() && (f.tokens < 0 || f.tokens > (1 << 20)))
    throw Error("--tokens " + std::to_string(f.tokens) + " is out of range [0, 1048576]");
  const DType in_dtype = parse_act_dtype(f.input_dtype);
  const SynthResult r = synth_checkpoint(o);
  std::printf("synth: wrote %s: %s %s %d-bit g%d%s%s, %lld layers (MoE: %s), %s of tensors\n", f.dir.c_str(),
              arch_name(o.arch), o.compressed_tensors ? "compressed-tensors" : format_name(o.format), o.bits, o.group_size,
              o.desc_act ? (o.compressed_tensors ? " actorder group" : " desc_act") : o.actorder_weight ? " actorder weight" : "",
              o.asym || (o.format == Format::Awq && !o.compressed_tensors) ? " asym" : " sym", static_cast<long long>(o.layers),
              ranges(r.moe_layers).c_str(), human_bytes(r.total_bytes).c_str());
  for (const auto& file : r.files) std::printf("  %s\n", file.c_str());
  if (!f.example_input.empty()) {
    const Checkpoint ck = Checkpoint::open(f.dir);
    HiddenStates h;
    h.dtype = in_dtype;
    h.shape = {f.tokens, ck.config().hidden};
    std::mt19937_64 rng(f.seed ^ 0x9e3779b97f4a7c15ull);
    std::normal_distribution<double> nd(0.0, 1.0);
    h.values.resize(size_t(f.tokens * ck.config().hidden));
    for (auto& v : h.values) v = round_to(in_dtype, float(nd(rng)));
    write_hidden_states(f.example_input, h);
    std::printf("synth: wrote %s: hidden_states [%lld, %lld] %s\n", f.example_input.c_str(),
                static_cast<long long>(f.tokens), static_cast<long long>(ck.config().hidden), dtype_name(in_dtype));
  }
  return 0;
}

// ---- run ---------------------------------------------------------------------------------

struct RunFlags {
  std::string dir, input, output, device;
  int64_t layer = -1;
  bool check = false;
  bool batch_invariant = false;
  PlanFlags plan;
};

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

int run_run(const RunFlags& f) {
  auto t0 = std::chrono::steady_clock::now();
  const Checkpoint ck = Checkpoint::open(f.dir);
  const ModelConfig& c = ck.config();
  const MoeLayerSpec spec = c.layer_spec(f.layer);
  const ParallelPlan plan = f.plan.plan();
  if (plan.world() > 1) check_plan(plan, spec);
  const HiddenStates in = read_hidden_states(f.input);
  if (in.cols() != c.hidden)
    throw Error(f.input + ": hidden_states has shape [" + std::to_string(in.rows()) + ", " + std::to_string(in.cols()) +
                "] but the model's hidden_size is " + std::to_string(c.hidden));
  const Device dev = f.device.empty() ? default_device() : parse_device(f.device);
  f.plan.check_device(dev);
  std::vector<std::string> notes;
  const MoeLayerWeights w = ck.load_layer(f.layer, &notes);
  for (const auto& n : notes) std::printf("note: %s\n", n.c_str());
  const double load_ms = ms_since(t0);

  // NOTE: F32 inputs are computed with BF16 activations (the kernels take 16-bit activations);
  // the F32 output then holds bf16-rounded values. F16 and BF16 run as they are.
  const DType act = in.dtype == DType::F16 ? DType::F16 : DType::BF16;
  const int64_t M = in.rows(), H = c.hidden;
  std::vector<float> x(in.values.size());
  std::vector<uint16_t> x16(in.values.size()), y16(in.values.size());
  for (size_t i = 0; i < x.size(); ++i) {
    x16[i] = act == DType::F16 ? float_to_f16(in.values[i]) : float_to_bf16(in.values[i]);
    x[i] = act == DType::F16 ? f16_to_float(x16[i]) : bf16_to_float(x16[i]);
  }
  HiddenStates out;
  out.dtype = in.dtype;
  out.shape = in.shape;
  out.values.assign(x.size(), 0.0f);
  double fwd_ms = 0;
  if (M > 0) {
    auto layer = f.plan.make(dev, spec, w);
    layer->set_batch_invariant(f.batch_invariant);
    auto t1 = std::chrono::steady_clock::now();
    layer->forward_host(x16.data(), y16.data(), M, act);
    fwd_ms = ms_since(t1);
    for (size_t i = 0; i < y16.size(); ++i) out.values[i] = act == DType::F16 ? f16_to_float(y16[i]) : bf16_to_float(y16[i]);
  }
  write_hidden_states(f.output, out);
  std::printf("run: %s layer %lld (%s), %lld tokens x %lld, %s activations on %s: load %.1f ms, forward %.2f ms -> %s\n",
              arch_name(c.arch), static_cast<long long>(f.layer), layer_kind_name(c.layer_kind(f.layer)), static_cast<long long>(M),
              static_cast<long long>(H), dtype_name(act),
              (device_name(dev) + (plan.world() > 1 ? ", sharded " + plan.describe() + " (one thread per rank)" : "")).c_str(),
              load_ms, fwd_ms, f.output.c_str());
  if (!f.check) return 0;
  if (M == 0) {
    std::printf("check: no tokens, nothing to compare: PASSED\n");
    return 0;
  }
  const std::vector<double> ref = moe_reference(spec, w, x.data(), M);
  const double err = rel_error(out.values.data(), ref.data(), int64_t(ref.size()));
  const double tol = layer_tolerance(act);
  const bool ok = err <= tol;
  std::printf("check: rel_error %.3e vs the float64 reference (tolerance %.1e for %s activations): %s\n", err, tol,
              dtype_name(act), ok ? "PASSED" : "FAILED");
  if (!ok) throw CLI::RuntimeError(1);
  return 0;
}

const CommandRegistrar kRegistrar([](CLI::App& root) {
  {
    auto dir = std::make_shared<std::string>();
    auto* sub = root.add_subcommand("inspect", "describe a Hugging Face GPTQ/AWQ MoE checkpoint and check its tensors");
    sub->add_option("DIR", *dir, "model directory (config.json + safetensors)")->required();
    sub->callback([dir] {
      if (int rc = run_inspect(*dir); rc != 0) throw CLI::RuntimeError(rc);
    });
  }
  {
    auto f = std::make_shared<SynthFlags>();
    auto* sub = root.add_subcommand("synth", "write a small random GPTQ/AWQ MoE checkpoint in the Hugging Face layout");
    sub->add_option("DIR", f->dir, "output directory (must not exist or be empty)")->required();
    sub->add_option("--arch", f->arch, "model_type: mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3, glm4_moe, qwen3_next")->required();
    sub->add_option("--format", f->format, "gptq, gptq_v2, awq or compressed-tensors (pack-quantized, as llm-compressor writes)")->required();
    sub->add_option("--bits", f->bits, "4 or 8 (AWQ: 4)")->capture_default_str();
    sub->add_option("--group-size", f->group_size, "group size (-1 = whole K)")->capture_default_str();
    sub->add_flag("--desc-act", f->desc_act, "GPTQ act-order (non-monotonic g_idx); compressed-tensors: actorder group");
    sub->add_option("--actorder", f->actorder, "compressed-tensors actorder: group (weight_g_idx written) or weight (no g_idx)");
    sub->add_flag("--asym", f->asym, "asymmetric GPTQ (stored zero points; AWQ always is)");
    sub->add_option("--layers", f->layers, "number of decoder layers")->capture_default_str();
    sub->add_option("--max-shard-size", f->max_shard_size, "bytes per safetensors shard")->capture_default_str();
    sub->add_option("--seed", f->seed, "random seed")->capture_default_str();
    sub->add_option("--example-input", f->example_input, "also write random hidden_states for `run` to this file");
    sub->add_option("--tokens", f->tokens, "rows of --example-input")->capture_default_str();
    sub->add_option("--input-dtype", f->input_dtype, "dtype of --example-input: bf16, f16 or f32")->capture_default_str();
    sub->callback([f] { run_synth(*f); });
  }
  {
    auto dir = std::make_shared<std::string>(), out = std::make_shared<std::string>();
    auto* sub = root.add_subcommand("dequantize", "write a bf16 copy of a quantized checkpoint (Hugging Face layout)");
    sub->add_option("DIR", *dir, "quantized model directory")->required();
    sub->add_option("OUT", *out, "output directory (must not exist or be empty)")->required();
    sub->callback([dir, out] {
      const DequantizeResult r = dequantize_checkpoint(*dir, *out);
      std::printf("wrote %s: %lld quantized linears dequantized to bf16, %lld tensors copied, %zu files, %s of tensors\n",
                  out->c_str(), static_cast<long long>(r.dequantized), static_cast<long long>(r.copied), r.files.size(),
                  human_bytes(r.total_bytes).c_str());
    });
  }
  {
    auto f = std::make_shared<RunFlags>();
    auto* sub = root.add_subcommand("run", "run one MoE layer of a checkpoint on hidden states from a safetensors file");
    sub->add_option("DIR", f->dir, "model directory")->required();
    sub->add_option("--layer", f->layer, "layer index (must be a MoE layer)")->required();
    sub->add_option("--input", f->input, "safetensors file with hidden_states [M, H] (F32, F16 or BF16)")->required();
    sub->add_option("--output", f->output, "safetensors file to write hidden_states to (same shape and dtype)")->required();
    sub->add_option("--device", f->device, "cpu or cuda (default: cuda when a GPU is present, else cpu)");
    sub->add_flag("--check", f->check, "compare with the float64 reference; fail if out of tolerance");
    sub->add_flag("--batch-invariant", f->batch_invariant,
                  "a token's output bits independent of the other tokens of the input (slower on CUDA)");
    f->plan.add_to(*sub);
    sub->callback([f] { run_run(*f); });
  }
});

}  // namespace

}  // namespace wna16::cli
