// Shared by the GPU tests: skip cleanly (with a message) where no GPU is present, and check every
// CUDA call with file:line.
#pragma once
#include <gtest/gtest.h>

#ifdef WNA16_HAVE_CUDA
#include <cuda_runtime.h>

#define WNA16_REQUIRE_GPU()                                                              \
  do {                                                                                   \
    int n_ = 0;                                                                          \
    if (cudaGetDeviceCount(&n_) != cudaSuccess || n_ == 0) {                             \
      cudaGetLastError();                                                                \
      GTEST_SKIP() << "no CUDA GPU present: GPU test skipped (run scripts/gpu-check on a GPU machine)"; \
    }                                                                                    \
  } while (0)

#define CUDA_OK(expr)                                                                    \
  do {                                                                                   \
    cudaError_t e_ = (expr);                                                             \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_) << " at "     \
                               << __FILE__ << ":" << __LINE__;                           \
  } while (0)
#endif
