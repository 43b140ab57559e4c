// `wna16 bench`: times the fused MoE layer per preset and token count on the chosen backend
// (run_cpu_bench / run_cuda_bench, bench.h), with the machine's ceiling and the baselines measured
// in the same run. Table on stdout, --json / --csv / --plot files on request, PASSED/FAILED and exit code
// from the correctness check of each benchmarked layer.
#include <string>
#include <vector>

#include "bench/bench.h"
#include "commands.h"
#include "wna16/error.h"

namespace wna16::cli {
namespace {

struct BenchArgs {
  CommonOptions common;
  PlanFlags plan;
  std::string json, csv, plot, config, routing = "uniform";
  double min_seconds = 0;
};

std::vector<std::string> split_models(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t comma = s.find(',', pos);
    const std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    if (!item.empty()) out.push_back(item);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

const CommandRegistrar reg([](CLI::App& root) {
  auto args = std::make_shared<BenchArgs>();
  CLI::App* app = root.add_subcommand(
      "bench", "time the MoE layer per preset and M: us, GB/s and % of the measured bandwidth, FLOP/s, speedups");
  args->common.add_to(*app);
  args->plan.add_to(*app);
  app->add_option("--json", args->json, "write the results as JSON to this path");
  app->add_option("--csv", args->csv, "write the results as CSV to this path");
  app->add_option("--plot", args->plot,
                  "draw time and % of the roofline against M per preset, with the baselines, as SVG (FILE.svg)");
  app->add_option("--min-seconds", args->min_seconds, "timed seconds per case (0 = backend default)");
  app->add_option("--config", args->config,
                  "CUDA, for measurements: run every call on this kernel-table row (m8, m32, m64, m32w, m64w, m96w, m144w) "
                  "instead of the table's choice");
  app->add_option("--routing", args->routing,
                  "expert popularity the generated inputs impose on the layer's own routing: uniform (default) or "
                  "zipf:S (pick probability of the expert of rank r ~ r^-S over a random order of the experts; "
                  "each row's floor counts its own routing)");
  app->callback([app, args] {
    const CommonOptions& c = args->common;
    BenchOptions o;
    // Without --model, every preset except "small"; --model takes one name or a comma list.
    if (app->get_option("--model")->count() > 0) o.models = split_models(c.model);
    for (const auto& m : o.models) (void)preset(m);  // unknown names fail before any work
    o.ms = c.m;
    o.scheme = c.scheme();
    o.act = c.act_dtype();
    o.json_path = args->json;
    o.csv_path = args->csv;
    o.plot_path = args->plot;
    o.min_seconds = args->min_seconds;
    o.gemm_config = args->config;
    o.routing = bench::parse_routing(args->routing);
    o.batch_invariant = c.batch_invariant;
    const bool cuda = c.resolved_device() == Device::Cuda;
    if (!cuda && !o.gemm_config.empty())
      throw Error("bench --config " + o.gemm_config + ": kernel-table rows are the CUDA backend's (use --device cuda)");
    const ParallelPlan plan = args->plan.plan();
    const CommKind comm = parse_comm_kind(args->plan.comm);
    if (plan.world() > 1 || comm == CommKind::Nccl) {
      if (!cuda) throw Error("bench --tp/--ep/--comm nccl: the sharded benchmark is the CUDA backend's (use --device cuda)");
      const int rc = run_cuda_sharded_bench(o, plan, comm);
      if (rc != 0) throw CLI::RuntimeError(rc);
      return;
    }
    const int rc = cuda ? run_cuda_bench(o) : run_cpu_bench(o);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
});

}  // namespace
}  // namespace wna16::cli
