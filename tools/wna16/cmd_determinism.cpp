// wna16 determinism: runs a random layer of a preset's shape repeatedly on a backend and compares
// the outputs bit for bit, with no reference (so it reaches the M of a serving batch):
//  - run to run: each M's batch --repeat times, every run against the first;
//  - batch invariance: each M's batch is the first M tokens of the largest one, so its rows must
//    equal that batch's first M rows; and sampled tokens run alone must equal their rows there.
// Ends with PASSED or FAILED (exit 1); a difference names the run or token, and the largest
// absolute difference.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "commands.h"
#include "wna16/error.h"
#include "wna16/half.h"
#include "wna16/moe.h"
#include "wna16/reference.h"

namespace wna16::cli {
namespace {

struct DeterminismArgs {
  int repeat = 20;
  bool batch_invariance = true;
};

struct Check {
  int64_t M;
  std::string what, detail;
  bool pass;
};

void run_determinism(const CommonOptions& o, const DeterminismArgs& a) {
  if (a.repeat < 2 || a.repeat > 100000)
    throw Error("--repeat " + std::to_string(a.repeat) + " is outside [2, 100000]");
  const MoeLayerSpec spec = preset(o.model);
  const QuantScheme scheme = o.scheme();
  const DType act = o.act_dtype();
  const Device dev = o.resolved_device();
  std::vector<int64_t> ms = o.token_counts({1, 3, 16, 64});
  std::sort(ms.begin(), ms.end());
  ms.erase(std::unique(ms.begin(), ms.end()), ms.end());
  const int64_t H = spec.hidden, Mmax = ms.back();

  std::printf("wna16 determinism: %s, weights %s, activations %s, device %s, seed %llu\n", spec.name.c_str(),
              scheme.describe().c_str(), dtype_name(act), device_name(dev), static_cast<unsigned long long>(o.seed));
  if (dev == Device::Cuda) std::printf("  kernel path %s%s\n", cuda_path_name(), o.batch_invariant ? ", batch-invariant mode" : "");
  std::fflush(stdout);
  const MoeLayerWeights w = random_layer(spec, scheme, o.seed);
  const std::unique_ptr<MoeBackendLayer> layer = make_layer(dev, spec, w);
  layer->set_batch_invariant(o.batch_invariant);

  // One batch of Mmax tokens, N(0, 1) in the activation dtype; every M is a prefix of it.
  std::vector<uint16_t> x(static_cast<size_t>(Mmax * H));
  std::mt19937_64 rng(o.seed * 7919ull + 17);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& v : x) v = act == DType::F16 ? float_to_f16(nd(rng)) : float_to_bf16(nd(rng));
  auto forward = [&](const uint16_t* xs, int64_t M) {
    std::vector<uint16_t> out(static_cast<size_t>(M * H), 0xFFFF);  // poisoned: a row left unwritten differs
    layer->forward_host(xs, out.data(), M, act);
    return out;
  };
  const std::vector<uint16_t> full = forward(x.data(), Mmax);

  std::vector<Check> checks;
  char buf[160];
  for (const int64_t M : ms) {
    const std::vector<uint16_t> first = M == Mmax ? full : forward(x.data(), M);
    int differing = 0, first_run = -1;
    double worst = 0;
    for (int r = 1; r < a.repeat; ++r) {
      const BitDiff d = compare_bits(forward(x.data(), M).data(), first.data(), M, H, act);
      if (d.first_row >= 0) {
        if (first_run < 0) first_run = r;
        ++differing;
        worst = std::max(worst, d.max_abs);
      }
    }
    if (differing == 0) std::snprintf(buf, sizeof buf, "%d runs bit-identical", a.repeat);
    else std::snprintf(buf, sizeof buf, "%d of %d runs differ from run 0 (first: run %d), max |diff| %.3g", differing,
                       a.repeat - 1, first_run, worst);
    checks.push_back({M, "run to run", buf, differing == 0});
    if (a.batch_invariance && M < Mmax) {
      const BitDiff d = compare_bits(first.data(), full.data(), M, H, act);
      const int64_t t = d.first_row;
      const double md = d.max_abs;
      if (t < 0) std::snprintf(buf, sizeof buf, "rows equal the first %lld of the M=%lld batch", static_cast<long long>(M),
                               static_cast<long long>(Mmax));
      else std::snprintf(buf, sizeof buf, "token %lld differs from the M=%lld batch, max |diff| %.3g",
                         static_cast<long long>(t), static_cast<long long>(Mmax), md);
      checks.push_back({M, "in batch", buf, t < 0});
    }
  }
  if (a.batch_invariance && Mmax > 1) {
    // Tokens alone: the first, the middle and the last of the largest batch.
    int bad = 0;
    std::string detail;
    double worst = 0;
    for (const int64_t t : {int64_t(0), Mmax / 2, Mmax - 1}) {
      const BitDiff d = compare_bits(forward(x.data() + t * H, 1).data(), full.data() + t * H, 1, H, act);
      if (d.first_row >= 0) {
        if (bad++ == 0) detail = "token " + std::to_string(t);
        worst = std::max(worst, d.max_abs);
      }
    }
    if (bad == 0) std::snprintf(buf, sizeof buf, "tokens 0, %lld, %lld alone equal their rows of the M=%lld batch",
                                static_cast<long long>(Mmax / 2), static_cast<long long>(Mmax - 1),
                                static_cast<long long>(Mmax));
    else std::snprintf(buf, sizeof buf, "%d of 3 tokens alone differ (first: %s), max |diff| %.3g", bad, detail.c_str(),
                       worst);
    checks.push_back({1, "alone", buf, bad == 0});
  }

  std::printf("\n%6s  %-10s  %-6s  %s\n", "M", "check", "result", "detail");
  bool ok = true;
  for (const Check& c : checks) {
    ok = ok && c.pass;
    std::printf("%6lld  %-10s  %-6s  %s\n", static_cast<long long>(c.M), c.what.c_str(), c.pass ? "PASS" : "FAIL",
                c.detail.c_str());
  }
  std::printf("%s\n", ok ? "PASSED" : "FAILED");
  std::fflush(stdout);
  if (!ok) throw CLI::RuntimeError(1);
}

const CommandRegistrar registrar([](CLI::App& root) {
  auto opts = std::make_shared<CommonOptions>();
  auto args = std::make_shared<DeterminismArgs>();
  CLI::App* cmd = root.add_subcommand(
      "determinism",
      "run a random layer of a preset's shape repeatedly on a backend and compare the outputs bit for bit: run to "
      "run, and each token against the same token in other batch sizes and alone; ends with PASSED or FAILED");
  opts->add_to(*cmd);
  cmd->add_option("--repeat", args->repeat, "runs per M compared with the first (2 to 100000)")->capture_default_str();
  cmd->add_flag("--batch-invariance,!--no-batch-invariance", args->batch_invariance,
                "also compare each M's rows with the largest batch's and three tokens run alone (default on)");
  cmd->footer("--m defaults to 1,3,16,64; every M is a prefix of one batch of the largest M. No reference is run: "
              "`wna16 verify` checks the values.");
  cmd->callback([opts, args] { run_determinism(*opts, *args); });
});

}  // namespace
}  // namespace wna16::cli
