// run_cuda_bench of a build without the CUDA backend (CMake compiles this file instead of
// bench/cuda/ when nvcc was not found or WNA16_ENABLE_CUDA is off).
#include "bench/bench.h"
#include "wna16/error.h"

namespace wna16 {

int run_cuda_bench(const BenchOptions&) {
  throw Error("this build of wna16 has no CUDA backend (nvcc was not found at configure time); use --device cpu");
}

}  // namespace wna16
