// `wna16 bench`: the per-backend benchmark drivers the CLI calls. Not part of the installed
// library: built as the wna16_bench target (bench/), linked by the CLI and the tests.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "bench/routing_skew.h"
#include "wna16/half.h"
#include "wna16/parallel.h"
#include "wna16/quant.h"

namespace wna16 {

struct BenchOptions {
  std::vector<std::string> models;  // preset names; empty = all presets except "small"
  std::vector<int64_t> ms;          // token counts; empty = backend default list
  QuantScheme scheme;               // default int4 gptq g128 sym
  DType act = DType::BF16;
  std::string json_path;            // write results as JSON here when non-empty
  std::string csv_path;             // and/or CSV
  std::string plot_path;            // and/or an SVG plot of time and % of the roofline against M
  double min_seconds = 0.0;         // time budget per case hint (0 = backend default)
  // CUDA only, a measurement flag: every layer call runs this row of the kernel table
  // (src/cuda/dispatch.h: m8, m32, m64, m32w, m64w, m96w, m144w) instead of the table's choice. Empty: the table.
  std::string gemm_config;
  // Expert popularity the generated inputs impose on the layer's own routing (bench/routing_skew.h).
  bench::RoutingOption routing;
  // CUDA: also time every row with the layer in batch-invariant mode (CudaMoeLayer::
  // set_batch_invariant), printed beside the default mode's time.
  bool batch_invariant = false;
};

// Both print a table to stdout and return 0 on success (non-zero if a correctness check of the
// benchmarked layer failed).
int run_cpu_bench(const BenchOptions& opts);   // bench/cpu
int run_cuda_bench(const BenchOptions& opts);  // bench/cuda; throws Error when built without CUDA
// The sharded layer of a plan against one GPU (bench/cuda/sharded_bench.cpp).
int run_cuda_sharded_bench(const BenchOptions& opts, const ParallelPlan& plan, CommKind comm);

}  // namespace wna16
