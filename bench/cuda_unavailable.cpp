// run_cuda_bench and run_cuda_sharded_bench of a build without the CUDA backend (CMake compiles this file instead of
// bench/cuda/ when nvcc was not found or WNA16_ENABLE_CUDA is off).
#include "bench/bench.h"
#include "wna16/error.h"

namespace wna16 {

int run_cuda_bench(const BenchOptions&) {
  throw Error("this build of wna16 has no CUDA backend (nvcc was not found at configure time); use --device cpu");
}

int run_cuda_sharded_bench(const BenchOptions& o, const ParallelPlan&, CommKind) { return run_cuda_bench(o); }

}  // namespace wna16
