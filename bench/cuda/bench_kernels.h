// Device helpers of the CUDA benchmark only: the two ceilings (read-only stream, cuBLAS bf16 GEMM),
// random fills, and dequantization of checkpoint tensors to bf16/f16 for the cuBLAS baseline.
// None of this is on the layer's path.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "wna16/half.h"
#include "wna16/quant.h"

namespace wna16::cuda::bench {

[[noreturn]] void throw_cublas_error(cublasStatus_t s, const char* expr, const char* file, int line);

#define WNA16_CUBLAS_CHECK(expr)                                                                    \
  do {                                                                                              \
    cublasStatus_t wna16_st_ = (expr);                                                              \
    if (wna16_st_ != CUBLAS_STATUS_SUCCESS)                                                         \
      ::wna16::cuda::bench::throw_cublas_error(wna16_st_, #expr, __FILE__, __LINE__);               \
  } while (0)

// 16-bit activation dtypes as cuBLAS names them.
cudaDataType_t cuda_type(DType t);

// Uniform values in [-scale, scale), rounded to `t` (F16 or BF16): fresh random data, never zeros.
void fill_random_half(void* p, size_t n, DType t, uint64_t seed, float scale, cudaStream_t s);
// 16-bit values -> float.
void half_to_float(const void* src, DType t, float* dst, size_t n, cudaStream_t s);

// One checkpoint linear (device copies of its tensors) dequantized to `t`, written transposed:
// out[n * K + k] = W[k, n] (torch Linear.weight layout, the "T" operand cuBLAS is fastest with).
// Same arithmetic as wna16::dequantize: s * (q - z), exact in fp32, then one rounding to `t`.
struct DeviceLinear {
  const int32_t* qweight = nullptr;
  const int32_t* qzeros = nullptr;
  const float* scales = nullptr;
  const int32_t* g_idx = nullptr;  // null: g(k) = k / group_len
  int64_t K = 0, N = 0, group_len = 0;
  int bits = 4;
  Format format = Format::GptqV1;
};
void dequantize_transposed(const DeviceLinear& w, DType t, void* out, cudaStream_t s);

// Read-only stream over a device buffer of `bytes` (16-byte loads, every SM busy): median GB/s
// (1e9 bytes/s) of `reps` passes after a warm-up.
double measure_read_gbs(size_t bytes, int reps, cudaStream_t s);
// cublasGemmEx bf16 x bf16 -> bf16, fp32 accumulation, n x n x n on random data: median TFLOP/s.
double measure_cublas_bf16_tflops(cublasHandle_t h, int n, int reps, cudaStream_t s);

}  // namespace wna16::cuda::bench
