// Caller-owned routing (CudaMoeLayer::forward_routed): the slot tables the routing kernel would
// write, built from the caller's top-k ids and weights, plus the zero-fill the router launch does.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/moe_layer_kernels.h"
#include "wna16/cuda_kernels.h"
#include "wna16/error.h"

namespace wna16::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(float v) { return v; }

// One warp per token: its k routed slots (ids offset by S, the shared slices' kernel experts
// coming first) and its S shared slots (weight 1, or sigmoid(x . gate_row)). An id outside
// [0, E) contributes nothing (weight 0 on expert 0): the device cannot refuse it without a host
// round trip, so the host-facing entry points check the ids before they launch.
template <class T, class R>
__global__ void __launch_bounds__(kThreads)
    given_slots_kernel(const T* __restrict__ x, int M, int H, const int32_t* __restrict__ ids,
                       const float* __restrict__ wts, int k, int E, int S, const R* __restrict__ gate_row,
                       int32_t* __restrict__ ids2, float* __restrict__ w2, float4* __restrict__ zero, int64_t zero_n4) {
  const int64_t tid = int64_t(blockIdx.x) * kThreads + threadIdx.x, nthreads = int64_t(gridDim.x) * kThreads;
  for (int64_t i = tid; i < zero_n4; i += nthreads) zero[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  const int lane = threadIdx.x & 31, k2 = k + S;
  for (int64_t m = tid >> 5; m < M; m += nthreads >> 5) {
    float g = 1.f;
    if (gate_row && S > 0) {
      float dot = 0.f;
      for (int h = lane; h < H; h += 32) dot += to_f32(x[m * H + h]) * to_f32(gate_row[h]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      g = 1.f / (1.f + __expf(-dot));
    }
    for (int j = lane; j < k2; j += 32) {
      int32_t id = j - k;  // shared slice j - k
      float w = g;
      if (j < k) {
        const int32_t e = ids[m * k + j];
        const bool ok = e >= 0 && e < E;
        id = (ok ? e : 0) + S;
        w = ok ? wts[m * k + j] : 0.f;
      }
      ids2[m * k2 + j] = id;
      w2[m * k2 + j] = w;
    }
  }
}

}  // namespace

void launch_given_slots(const void* x, DType act, int64_t M, int64_t H, const int32_t* ids, const float* weights,
                        int k, int E, int S, const void* gate_row, DType gate_dtype, int32_t* ids2, float* w2,
                        float* zero, int64_t zero_n, Stream stream) {
  if (zero_n % 4 != 0) throw Error("given routing: zero_n=" + std::to_string(zero_n) + " is not a multiple of 4");
  if (act != DType::BF16 && act != DType::F16)
    throw Error(std::string("given routing: activation dtype ") + dtype_name(act) + " is not supported");
  if (gate_row && gate_dtype != DType::F32 && gate_dtype != DType::BF16)
    throw Error(std::string("given routing: gate dtype ") + dtype_name(gate_dtype) + " is not supported (f32, bf16)");
  if (k < 1 || E < 1 || S < 0 || M < 0 || M >= (int64_t(1) << 31) || H < 1 || H >= (int64_t(1) << 31))
    throw Error("given routing: k=" + std::to_string(k) + ", E=" + std::to_string(E) + ", S=" + std::to_string(S) +
                ", M=" + std::to_string(M) + " or H=" + std::to_string(H) + " is out of range");
  if (M == 0 && zero_n == 0) return;
  const int64_t work = std::max((M * 32 + kThreads - 1) / kThreads, (zero_n / 4 + kThreads - 1) / kThreads);
  const unsigned blocks = unsigned(std::clamp<int64_t>(work, 1, 8192));
  auto s = static_cast<cudaStream_t>(stream);
  auto run = [&](auto tag, auto rtag) {
    using T = decltype(tag);
    using R = decltype(rtag);
    given_slots_kernel<T, R><<<blocks, kThreads, 0, s>>>(static_cast<const T*>(x), int(M), int(H), ids, weights, k, E,
                                                         S, static_cast<const R*>(gate_row), ids2, w2,
                                                         reinterpret_cast<float4*>(zero), zero_n / 4);
  };
  const bool bf16_gate = gate_dtype == DType::BF16;
  if (act == DType::BF16) bf16_gate ? run(__nv_bfloat16{}, __nv_bfloat16{}) : run(__nv_bfloat16{}, float{});
  else bf16_gate ? run(__half{}, __nv_bfloat16{}) : run(__half{}, float{});
  WNA16_CUDA_CHECK_LAUNCH();
}

namespace {
__global__ void local_expert_ids_kernel(const int32_t* __restrict__ ids, int64_t n, int begin, int end,
                                        int32_t* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t e = ids[i];
    out[i] = e >= begin && e < end ? e - begin : -1;
  }
}
}  // namespace

void launch_local_expert_ids(const int32_t* ids, int64_t n, int begin, int end, int32_t* out, Stream stream) {
  if (n < 0 || begin < 0 || end < begin)
    throw Error("local expert ids: n=" + std::to_string(n) + " or the range [" + std::to_string(begin) + ", " +
                std::to_string(end) + ") is invalid");
  if (n == 0) return;
  if (!ids || !out) throw Error("local expert ids: a device pointer is null");
  const int grid = int(std::min<int64_t>((n + kThreads - 1) / kThreads, 1024));
  local_expert_ids_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(ids, n, begin, end, out);
  WNA16_CUDA_CHECK_LAUNCH();
}

}  // namespace wna16::cuda
