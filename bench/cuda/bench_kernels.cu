// Device helpers of the CUDA benchmark (see bench_kernels.h). Written for clarity: none of these is
// timed as part of a layer, except the read stream and the GEMM, which define the ceilings.
#include "bench/cuda/bench_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <vector>

#include "bench/cuda/device_timing.h"
#include "cuda/cuda_check.h"
#include "wna16/error.h"

namespace wna16::cuda::bench {

void throw_cublas_error(cublasStatus_t s, const char* expr, const char* file, int line) {
  throw Error(std::string("cuBLAS error: ") + cublasGetStatusString(s) + " (" + expr + ") at " + file + ":" +
              std::to_string(line));
}

cudaDataType_t cuda_type(DType t) {
  if (t == DType::BF16) return CUDA_R_16BF;
  if (t == DType::F16) return CUDA_R_16F;
  throw Error(std::string("bench: activation dtype ") + dtype_name(t) + " is not a 16-bit type (bf16 or f16)");
}

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ uint64_t hash64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__device__ __forceinline__ uint16_t to_half_bits(float v, bool bf16) {
  return bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v)) : __half_as_ushort(__float2half_rn(v));
}

__global__ void fill_random_half_kernel(uint16_t* p, size_t n, bool bf16, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t h = hash64(seed * 0x9e3779b97f4a7c15ull + i);
    const float u = float(h >> 40) * (1.0f / 16777216.0f);  // [0, 1), 24 bits
    p[i] = to_half_bits((2.0f * u - 1.0f) * scale, bf16);
  }
}

__global__ void half_to_float_kernel(const uint16_t* src, bool bf16, float* dst, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = bf16 ? __bfloat162float(__ushort_as_bfloat16(src[i])) : __half2float(__ushort_as_half(src[i]));
}

__device__ __forceinline__ int group_of(const int32_t* g_idx, int64_t k, int64_t group_len) {
  return g_idx ? g_idx[k] : int(k / group_len);
}

// GPTQ: qweight [K/pack, N] packed along K. One thread per (word row r, column n), r fastest, so a
// thread writes `pack` consecutive k of out row n and neighbouring threads continue that run.
__global__ void dequant_gptq_t_kernel(DeviceLinear w, bool v1, bool bf16, uint16_t* out) {
  const int pack = 32 / w.bits;
  const uint32_t mask = (1u << w.bits) - 1u;
  const int64_t rows = w.K / pack;
  const int64_t total = rows * w.N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i % rows, n = i / rows;
    const uint32_t word = uint32_t(w.qweight[r * w.N + n]);
    for (int j = 0; j < pack; ++j) {
      const int64_t k = r * pack + j;
      const int g = group_of(w.g_idx, k, w.group_len);
      const uint32_t zw = uint32_t(w.qzeros[int64_t(g) * (w.N / pack) + n / pack]);
      const int z = int((zw >> (w.bits * (n % pack))) & mask) + (v1 ? 1 : 0);  // v1 stores zero-1
      const int q = int((word >> (w.bits * j)) & mask);
      // s is f16-exact and |q - z| < 2^9: the product is exact in fp32, rounded once below.
      out[n * w.K + k] = to_half_bits(w.scales[int64_t(g) * w.N + n] * float(q - z), bf16);
    }
  }
}

// AWQ: qweight [K, N/8] packed along N with the [0,2,4,6,1,3,5,7] interleave: column 8c+j lives in
// nibble kReverse[j]. One thread per (k, word column c), k fastest, so stores to out rows coalesce.
__global__ void dequant_awq_t_kernel(DeviceLinear w, bool bf16, uint16_t* out) {
  constexpr int kReverse[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  const int64_t cols = w.N / 8;
  const int64_t total = w.K * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t k = i % w.K, c = i / w.K;
    const uint32_t word = uint32_t(w.qweight[k * cols + c]);
    const int g = group_of(w.g_idx, k, w.group_len);
    const uint32_t zw = uint32_t(w.qzeros[int64_t(g) * cols + c]);
    for (int j = 0; j < 8; ++j) {
      const int64_t n = 8 * c + j;
      const int q = int((word >> (4 * kReverse[j])) & 15u);
      const int z = int((zw >> (4 * kReverse[j])) & 15u);
      out[n * w.K + k] = to_half_bits(w.scales[int64_t(g) * w.N + n] * float(q - z), bf16);
    }
  }
}

// Each thread keeps 4 independent 16-byte loads in flight per iteration; __ldcs marks them
// streaming (evict-first) since every byte is read once.
__global__ void read_stream_kernel(const uint4* __restrict__ p, size_t n, unsigned* sink) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  unsigned acc = 0;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = __ldcs(p + i), b = __ldcs(p + i + stride), c = __ldcs(p + i + 2 * stride), d = __ldcs(p + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    const uint4 a = __ldcs(p + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  // NOTE: a store the compiler cannot prove dead keeps every load; it practically never happens.
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

int grid_for(size_t work) {
  static int sms = [] {
    int dev = 0, n = 0;
    WNA16_CUDA_CHECK(cudaGetDevice(&dev));
    WNA16_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }();
  const size_t blocks = (work + kThreads - 1) / kThreads;
  return int(std::max<size_t>(1, std::min<size_t>(blocks, size_t(sms) * 16)));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Times `body` `reps` times after one warm-up; returns the per-run milliseconds.
template <class F>
std::vector<double> time_runs(int reps, cudaStream_t s, F body) {
  body();
  WNA16_CUDA_CHECK(cudaStreamSynchronize(s));
  return event_times_ms(s, reps, body);
}

}  // namespace

void fill_random_half(void* p, size_t n, DType t, uint64_t seed, float scale, cudaStream_t s) {
  if (n == 0) return;
  (void)cuda_type(t);
  fill_random_half_kernel<<<grid_for(n), kThreads, 0, s>>>(static_cast<uint16_t*>(p), n, t == DType::BF16, seed, scale);
  WNA16_CUDA_CHECK_LAUNCH();
}

void half_to_float(const void* src, DType t, float* dst, size_t n, cudaStream_t s) {
  if (n == 0) return;
  (void)cuda_type(t);
  half_to_float_kernel<<<grid_for(n), kThreads, 0, s>>>(static_cast<const uint16_t*>(src), t == DType::BF16, dst, n);
  WNA16_CUDA_CHECK_LAUNCH();
}

void dequantize_transposed(const DeviceLinear& w, DType t, void* out, cudaStream_t s) {
  (void)cuda_type(t);
  if (w.bits != 4 && w.bits != 8) throw Error("bench: dequantize bits=" + std::to_string(w.bits) + " (4 or 8)");
  auto* o = static_cast<uint16_t*>(out);
  if (w.format == Format::Awq) {
    if (w.bits != 4) throw Error("bench: AWQ is 4-bit only, got bits=" + std::to_string(w.bits));
    dequant_awq_t_kernel<<<grid_for(size_t(w.K * (w.N / 8))), kThreads, 0, s>>>(w, t == DType::BF16, o);
  } else {
    const size_t work = size_t(w.K / (32 / w.bits) * w.N);
    dequant_gptq_t_kernel<<<grid_for(work), kThreads, 0, s>>>(w, w.format == Format::GptqV1, t == DType::BF16, o);
  }
  WNA16_CUDA_CHECK_LAUNCH();
}

double measure_read_gbs(size_t bytes, int reps, cudaStream_t s) {
  const size_t n = bytes / sizeof(uint4);
  void* buf = nullptr;
  unsigned* sink = nullptr;
  WNA16_CUDA_CHECK(cudaMalloc(&buf, n * sizeof(uint4)));
  WNA16_CUDA_CHECK(cudaMalloc(&sink, sizeof(unsigned)));
  double gbs = 0;
  try {
    fill_random_half(buf, n * sizeof(uint4) / 2, DType::BF16, 7, 1.0f, s);
    int dev = 0, sms = 0, per_sm = 0;
    WNA16_CUDA_CHECK(cudaGetDevice(&dev));
    WNA16_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    constexpr int kStreamThreads = 512;
    WNA16_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, read_stream_kernel, kStreamThreads, 0));
    const int grid = sms * std::max(1, per_sm);
    auto ms = time_runs(reps, s, [&] {
      read_stream_kernel<<<grid, kStreamThreads, 0, s>>>(static_cast<const uint4*>(buf), n, sink);
      WNA16_CUDA_CHECK_LAUNCH();
    });
    gbs = double(n * sizeof(uint4)) / (median(ms) * 1e-3) * 1e-9;
  } catch (...) {
    cudaFree(buf);
    cudaFree(sink);
    throw;
  }
  WNA16_CUDA_CHECK(cudaFree(buf));
  WNA16_CUDA_CHECK(cudaFree(sink));
  return gbs;
}

double measure_cublas_bf16_tflops(cublasHandle_t h, int n, int reps, cudaStream_t s) {
  const size_t elems = size_t(n) * size_t(n);
  void *a = nullptr, *b = nullptr, *c = nullptr;
  WNA16_CUDA_CHECK(cudaMalloc(&a, elems * 2));
  WNA16_CUDA_CHECK(cudaMalloc(&b, elems * 2));
  WNA16_CUDA_CHECK(cudaMalloc(&c, elems * 2));
  double tflops = 0;
  try {
    fill_random_half(a, elems, DType::BF16, 11, 1.0f, s);
    fill_random_half(b, elems, DType::BF16, 12, 1.0f, s);
    WNA16_CUBLAS_CHECK(cublasSetStream(h, s));
    const float alpha = 1.0f, beta = 0.0f;
    auto ms = time_runs(reps, s, [&] {
      // TN, the layout of torch's F.linear: C[n, m] = sum_k A[k, n] B[k, m] in column-major terms.
      WNA16_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n,
                                      &beta, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    });
    tflops = 2.0 * double(n) * n * n / (median(ms) * 1e-3) * 1e-12;
  } catch (...) {
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    throw;
  }
  WNA16_CUDA_CHECK(cudaFree(a));
  WNA16_CUDA_CHECK(cudaFree(b));
  WNA16_CUDA_CHECK(cudaFree(c));
  return tflops;
}

}  // namespace wna16::cuda::bench
