// Results of `wna16 bench --device cuda` and their presentation: the stdout table, JSON, CSV and
// the summary against the floors of the CUDA issue. Host-only; no CUDA headers.
#pragma once
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "bench/plot_svg.h"

namespace wna16::cuda::bench {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Device facts and the two ceilings, measured in the same run as the layers.
struct Ceilings {
  std::string gpu;
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;
  int64_t l2_bytes = 0;
  int64_t mem_bytes = 0;
  double read_gbs = kNaN;        // read-only stream over a multi-GB buffer, GB/s (1e9)
  int64_t read_buffer_bytes = 0;
  double gemm_tflops = kNaN;     // cublasGemmEx bf16 n^3, fp32 accumulation
  int gemm_n = 0;
};

// Median and spread of per-call microseconds.
struct Timing {
  double median_us = kNaN, p10_us = kNaN, p90_us = kNaN;
  int reps = 0;    // timed replays
  int calls = 0;   // layer calls per replay (the rotation across inputs / weight sets)
  bool graph = false;
};

struct CaseResult {
  std::string preset;
  int64_t M = 0;
  Timing ours, loop, cublas;
  Timing invariant;          // ours in batch-invariant mode (BenchOptions::batch_invariant), else empty
  // Per call, from its realized routing (routing_skew.h call_cost), averaged over the rotation:
  double flops = 0;          // 2*slots*3*I*H (+ shared expert); slots = M*k
  double bytes = 0;          // experts with tokens + shared + router + x/out
  double experts_avg = 0;    // distinct routed experts that received tokens
  double tokens_max_avg = 0, tokens_mean_avg = 0;  // tokens on the busiest / an average active expert
  bool correct = true;       // the preset's correctness check passed
  std::string note;          // an error or a fallback, when there is one
};

struct PresetInfo {
  std::string name;
  std::string shape;          // "E256 k8 H7168 I2048 shared 2048"
  int weight_sets = 1;        // copies rotated to keep L2 cold
  double weights_gb = 0;      // stored bytes of one set (checkpoint format)
  double device_weights_gb = 0;  // CudaMoeLayer::weight_bytes() of one set
  double gen_s = 0, load_s = 0, check_s = 0, bf16_s = 0;
  std::vector<std::string> checks;  // "ours M=1 rel 3.1e-3", ...
  double tolerance = 0;
  bool passed = true;
  std::string error;          // set when the preset could not be benchmarked at all
};

struct AlignRow {
  double us = kNaN;
  int E = 256;
  int64_t slots = 32768;
  int block_m = 0;
  std::string source;  // which timer produced it
};

struct Report {
  std::string date, commit, command, scheme, act;
  std::string routing = "uniform";  // --routing, as RoutingOption::name() writes it
  std::string switches;  // the WNA16_* variables set for the run (A/B switches), "none" if none
  std::string cublas_baseline_desc;
  Ceilings ceil;
  std::vector<PresetInfo> presets;
  std::vector<CaseResult> cases;
  AlignRow align;
};

// Derived numbers of one case (against the ceilings of the run).
struct Derived {
  double tflops = kNaN, gbs = kNaN, pct = kNaN, pct_bw = kNaN, x_loop = kNaN, x_cublas = kNaN;
  const char* bound = "?";
};
Derived derive(const CaseResult& c, const Ceilings& ceil);
// The roofline floor of one case, microseconds: max(bytes / read ceiling, FLOPs / cuBLAS ceiling),
// the time that "% ceil" divides by the measured one. NaN when a ceiling is unknown.
double floor_us(const CaseResult& c, const Ceilings& ceil);

// The --plot figure of a run (bench/plot_svg.h): per preset our layer, then the per-expert loop
// and the cuBLAS baseline against M (NaN where a case failed), and floor_us per M. A preset
// without any case is left out; a baseline without any measured M too.
::wna16::bench::PlotInput plot_input(const Report& r);

void print_table(const Report& r);
// The layer-time targets (serving regime and decode: must and aim, us) and the x cuBLAS bar of
// the serving regime, for the cases the run measured, with PASS / FAIL; only for the targets'
// scheme (int4 GPTQ g128 sym, bf16, uniform routing). Returns the rows that miss their must.
int print_targets(const Report& r);
// print_targets, then the floors of the CUDA issue and the correctness verdict. Returns the rows
// below their bar (informational; correctness decides the exit code).
int print_summary(const Report& r);
void write_json(const Report& r, const std::string& path);  // throws Error when the file can't be written
void write_csv(const Report& r, const std::string& path);

}  // namespace wna16::cuda::bench
