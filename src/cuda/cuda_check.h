// Every CUDA runtime call is checked; a failure throws wna16::Error with the call, the error string
// and file:line (host code only).
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "wna16/error.h"

namespace wna16::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t e, const char* expr, const char* file, int line) {
  throw Error(std::string("CUDA error: ") + cudaGetErrorString(e) + " (" + expr + ") at " + file + ":" +
              std::to_string(line));
}

}  // namespace wna16::cuda

#define WNA16_CUDA_CHECK(expr)                                                          \
  do {                                                                                  \
    cudaError_t wna16_err_ = (expr);                                                    \
    if (wna16_err_ != cudaSuccess) ::wna16::cuda::throw_cuda_error(wna16_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// After a launch: catches bad configurations at once (asynchronous faults surface at the next sync).
#define WNA16_CUDA_CHECK_LAUNCH() WNA16_CUDA_CHECK(cudaGetLastError())
