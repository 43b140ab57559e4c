// Shared by the GPU tests: skip cleanly (with a message) where no GPU is present, check every
// CUDA call with file:line, and shrink the largest case lists under compute-sanitizer.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

namespace wna16::gpu_test {
// WNA16_TEST_UNDER_SANITIZER=1 (scripts/gpu-check sets it for its compute-sanitizer runs): the
// tests whose full case lists take minutes under racecheck run reduced lists instead, which still
// reach every code path (kernel variant, tuning, threshold) at smaller sizes.
inline bool under_sanitizer() {
  const char* v = std::getenv("WNA16_TEST_UNDER_SANITIZER");
  return v && *v && *v != '0';
}
// full, or reduced under a sanitizer.
template <class T>
std::vector<T> cases(std::vector<T> full, std::vector<T> reduced) {
  return under_sanitizer() ? reduced : full;
}
}  // namespace wna16::gpu_test

#ifdef WNA16_HAVE_CUDA
#include <cuda_runtime.h>

#include "wna16/backend.h"

namespace wna16::gpu_test {
// WNA16_TEST_PORTABLE_PATH=1 (scripts/gpu-check --portable): the CUDA layers and launches of every
// test take the portable kernel path (set at start-up, before any test builds a layer), so a
// Hopper GPU runs the tests on the path of the GPUs below sm_90.
inline const bool kPortablePath = [] {
  const char* v = std::getenv("WNA16_TEST_PORTABLE_PATH");
  const bool on = v && *v && *v != '0';
  if (on) use_cuda_portable_path(true);
  return on;
}();
}  // namespace wna16::gpu_test

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

namespace wna16::gpu_test {
// A fixture that owns one stream where a GPU is present (tests still start with
// WNA16_REQUIRE_GPU). NOTE: a blocking stream, so that each launch is ordered after the uploads and
// poison memsets, which run on the legacy default stream (a non-blocking stream raced them).
class StreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return;
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
};
}  // namespace wna16::gpu_test

namespace wna16::gpu_test {
constexpr unsigned char kPoison = 0xA5;  // int32 0xA5A5A5A5 < 0 and fp32 -2.9e-16: never a valid output

// A device buffer that frees itself; n may be 0.
template <typename T>
struct DevBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t count) : n(count) {
    if (cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)) != cudaSuccess) {
      p = nullptr;
      ADD_FAILURE() << "cudaMalloc of " << count * sizeof(T) << " bytes failed";
    }
  }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  void poison() { EXPECT_EQ(cudaMemset(p, kPoison, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess); }
  void upload(const std::vector<T>& v) {
    ASSERT_EQ(v.size(), n);
    if (n) {
      EXPECT_EQ(cudaMemcpy(p, v.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  std::vector<T> download() const {
    std::vector<T> v(n);
    if (n) {
      EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return v;
  }
};

// Index of the first difference, or -1.
template <typename T>
int64_t first_mismatch(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return int64_t(i);
  return -1;
}
}  // namespace wna16::gpu_test
#endif
