// wna16: command-line entry. Subcommands live in cmd_*.cpp and register themselves.
#include <cstdio>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "commands.h"
#include "wna16/error.h"

namespace wna16::cli {

std::vector<CommandSetup>& command_registry() {
  static std::vector<CommandSetup> registry;
  return registry;
}

void CommonOptions::add_to(CLI::App& app) {
  app.add_option("--model", model, "model preset: " + [] {
    std::string s;
    for (const auto& n : preset_names()) s += (s.empty() ? "" : ", ") + n;
    return s;
  }())->capture_default_str();
  app.add_option("--format", format, "weight format: gptq, gptq_v2 or awq")->capture_default_str();
  app.add_option("--bits", bits, "weight bits: 4 or 8")->capture_default_str();
  app.add_option("--group-size", group_size, "quantization group size (-1 = whole K)")->capture_default_str();
  app.add_flag("--asym", asym, "asymmetric quantization (zero points); AWQ always is");
  app.add_flag("--desc-act", desc_act, "GPTQ act-order (non-monotonic g_idx)");
  app.add_option("--device", device, "cpu or cuda (default: cuda when a GPU is present, else cpu)");
  app.add_option("--dtype", dtype, "activation dtype: bf16 or f16")->capture_default_str();
  app.add_option("--m", m, "token counts, comma separated")->delimiter(',');
  app.add_option("--seed", seed, "random seed")->capture_default_str();
  app.add_flag("--portable", portable,
               "CUDA: run the portable kernel path (mma.sync, no clusters or dependent launches; every GPU from "
               "sm_80) even on a Hopper GPU");
  app.add_flag("--batch-invariant", batch_invariant,
               "a token's output bits independent of the other tokens of its call (CUDA: one kernel arithmetic at "
               "every M, slower; the CPU backend always is); bench: timed beside the default mode");
}

QuantScheme CommonOptions::scheme() const {
  QuantScheme s;
  s.format = parse_format(format);
  s.bits = bits;
  s.group_size = group_size;
  s.sym = s.format == Format::Awq ? false : !asym;
  s.act_order = desc_act;
  if (s.format == Format::Awq && desc_act) throw Error("--desc-act is a GPTQ option; AWQ has no act-order");
  return s;
}

void PlanFlags::add_to(CLI::App& app) {
  app.add_option("--tp", tp, "tensor-parallel ranks: each expert's width split tp ways (one thread per rank)")
      ->capture_default_str();
  app.add_option("--ep", ep, "expert-parallel groups: the routed experts split ep ways (one thread per rank)")
      ->capture_default_str();
  app.add_option("--comm", comm,
                 "how the ranks exchange data: inprocess (host memory; on cuda rank r runs on GPU r mod the GPUs "
                 "present) or nccl (cuda only, one GPU per rank)")
      ->capture_default_str();
}

ParallelPlan PlanFlags::plan() const {
  const ParallelPlan p{tp, ep};
  p.validate();
  (void)parse_comm_kind(comm);  // an unknown --comm fails before any work
  return p;
}

void PlanFlags::check_device(Device d) const {
  if (parse_comm_kind(comm) == CommKind::Nccl && d != Device::Cuda)
    throw Error("--comm nccl moves device memory between GPUs: it needs --device cuda");
}

std::unique_ptr<MoeBackendLayer> PlanFlags::make(Device d, const MoeLayerSpec& spec, const MoeLayerWeights& w) const {
  const ParallelPlan p = plan();
  const CommKind c = parse_comm_kind(comm);
  return p.world() == 1 ? make_layer(d, spec, w) : make_threaded_sharded_layer(d, p, spec, w, c);
}

Device CommonOptions::resolved_device() const {
  const Device d = device.empty() ? default_device() : parse_device(device);
  if (portable && d != Device::Cuda) throw Error("--portable is a CUDA kernel path; the device is " + std::string(device_name(d)));
  if (portable) use_cuda_portable_path(true);  // before any CUDA layer is built
  return d;
}

std::vector<int64_t> CommonOptions::token_counts(std::vector<int64_t> dflt) const {
  const std::vector<int64_t> ms = m.empty() ? std::move(dflt) : m;
  for (int64_t v : ms)
    if (v < 1 || v > 65536) throw Error("--m " + std::to_string(v) + " is outside [1, 65536]");
  return ms;
}

DType CommonOptions::act_dtype() const {
  if (dtype == "bf16") return DType::BF16;
  if (dtype == "f16" || dtype == "fp16") return DType::F16;
  throw Error("unknown --dtype '" + dtype + "' (expected bf16 or f16)");
}

std::vector<int64_t> parse_int_list(const std::string& s) {
  std::vector<int64_t> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    try {
      size_t used = 0;
      long long v = std::stoll(item, &used);
      if (used != item.size()) throw std::invalid_argument(item);
      out.push_back(v);
    } catch (const std::exception&) {
      throw Error("'" + item + "' in list '" + s + "' is not an integer");
    }
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

}  // namespace wna16::cli

int main(int argc, char** argv) {
  CLI::App app{"wna16: fused MoE layers over GPTQ/AWQ int4/int8 weights (CPU and CUDA backends)", "wna16"};
  app.require_subcommand(1);
  for (auto& setup : wna16::cli::command_registry()) setup(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const wna16::Error& e) {
    std::fprintf(stderr, "wna16: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "wna16: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
