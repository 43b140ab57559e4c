// Router logits (fp32 accumulation), shared-expert slots and the output cast.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/moe_layer_kernels.h"
#include "wna16/error.h"

namespace wna16::cuda {
namespace {

template <class T>
__device__ __forceinline__ float to_f(T v);
template <>
__device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// The layer's fp32 output accumulator is zeroed here, by every block of the router launch (one
// graph node fewer than a separate memset; GEMM2 runs after this kernel on the same stream).
__device__ __forceinline__ void zero_fill(float4* p, int64_t n4) {
  const int64_t nthreads = int64_t(gridDim.x) * gridDim.y * blockDim.x;
  const int64_t id = (int64_t(blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = id; i < n4; i += nthreads) p[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// ---- router, few tokens: every weight row is read once, the H axis spread over a whole block ----
// One router row per block (DeepSeek-V3: 256 blocks, ~2 per SM, the 7.3 MB read spread over the
// whole GPU). Each thread issues all its row loads of a batch (kSmallBatch float4, 32 KB of row
// per block) before the first use, so one DRAM round trip covers H <= 8192.
// NOTE: a plain `#pragma unroll 8` loop with a run-time trip count of 7 ran entirely in the
// remainder loop: one dependent DRAM round trip per float4.
constexpr int kSmallThreads = 256;
constexpr int kSmallBatch = 8;  // float4 row loads in flight per thread
constexpr int kSmallM = 8;      // tokens per block
constexpr int kSmallMaxM = 32;  // above this the tiled kernel re-reads the router far less

// x[0..3] as floats; kVec: one 8-byte load (x 8-byte aligned, H a multiple of 4).
template <class T, bool kVec>
__device__ __forceinline__ void load_x4(const T* p, float (&f)[4]) {
  if constexpr (kVec) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
    const uint32_t w[2] = {u.x, u.y};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const unsigned short lo = static_cast<unsigned short>(w[i] & 0xffffu), hi = static_cast<unsigned short>(w[i] >> 16);
      if constexpr (std::is_same_v<T, __half>) {
        f[2 * i] = __half2float(__ushort_as_half(lo));
        f[2 * i + 1] = __half2float(__ushort_as_half(hi));
      } else {
        f[2 * i] = __bfloat162float(__ushort_as_bfloat16(lo));
        f[2 * i + 1] = __bfloat162float(__ushort_as_bfloat16(hi));
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = to_f(p[i]);
  }
}

template <class T, bool kVecX>
__global__ void __launch_bounds__(kSmallThreads)
    router_small_kernel(const T* __restrict__ x, int M, int H, const float* __restrict__ router, int E, int E_ext,
                        float* __restrict__ logits, float* __restrict__ gate_logit, float4* __restrict__ zero,
                        int64_t zero_n4) {
  // The routing kernel (launched with programmatic dependent launch) may get resident now; it
  // waits for this grid's completion before reading the logits.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int e = blockIdx.x, m0 = blockIdx.y * kSmallM;
  const int mt = min(kSmallM, M - m0);
  const float* row = router + int64_t(e) * H;
  float acc[kSmallM] = {};
  for (int h0 = 0; h0 < H; h0 += kSmallThreads * 4 * kSmallBatch) {
    float4 r[kSmallBatch];
#pragma unroll
    for (int b = 0; b < kSmallBatch; ++b) {
      const int h = h0 + (b * kSmallThreads + int(threadIdx.x)) * 4;
      r[b] = h < H ? __ldg(reinterpret_cast<const float4*>(row + h)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int m = 0; m < kSmallM; ++m) {
      if (m >= mt) break;
      const T* xr = x + int64_t(m0 + m) * H;
#pragma unroll
      for (int b = 0; b < kSmallBatch; ++b) {
        const int h = h0 + (b * kSmallThreads + int(threadIdx.x)) * 4;
        if (h < H) {
          float v[4];
          load_x4<T, kVecX>(xr + h, v);
          acc[m] += r[b].x * v[0] + r[b].y * v[1] + r[b].z * v[2] + r[b].w * v[3];
        }
      }
    }
  }
  zero_fill(zero, zero_n4);  // after the loads are in flight: the stores only take issue slots
  __shared__ float part[kSmallThreads / 32][kSmallM];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int m = 0; m < kSmallM; ++m) {
    float v = acc[m];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) part[warp][m] = v;
  }
  __syncthreads();
  if (threadIdx.x < kSmallM) {
    const int m = threadIdx.x;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kSmallThreads / 32; ++w) v += part[w][m];
    if (m < mt) {
      if (e < E) logits[int64_t(m0 + m) * E + e] = v;
      else gate_logit[m0 + m] = v;
    }
  }
}

// ---- router, many tokens: 64 x 64 output tiles through shared memory, 4 x 4 per thread ----------
constexpr int kTile = 64, kTileK = 32, kTileThreads = 256;

template <class T>
__global__ void __launch_bounds__(kTileThreads)
    router_tiled_kernel(const T* __restrict__ x, int M, int H, const float* __restrict__ router, int E, int E_ext,
                        float* __restrict__ logits, float* __restrict__ gate_logit, float4* __restrict__ zero,
                        int64_t zero_n4) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // see router_small_kernel
  zero_fill(zero, zero_n4);
  __shared__ __align__(16) float xs[kTileK][kTile + 4];  // [k][token]
  __shared__ __align__(16) float rs[kTileK][kTile + 4];  // [k][expert]
  const int m0 = blockIdx.y * kTile, e0 = blockIdx.x * kTile;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[4][4] = {};
  for (int k0 = 0; k0 < H; k0 += kTileK) {
    // 64 rows x 32 k of each operand: 8 elements per thread, 4 consecutive k at a time.
    for (int i = threadIdx.x; i < kTile * kTileK / 4; i += kTileThreads) {
      const int row = i / (kTileK / 4), kq = (i % (kTileK / 4)) * 4;
      const bool kin = k0 + kq < H;
      float4 xv = make_float4(0.f, 0.f, 0.f, 0.f), rv = xv;
      if (m0 + row < M && kin) {
        const T* xr = x + int64_t(m0 + row) * H + k0 + kq;
        xv = make_float4(to_f(xr[0]), to_f(xr[1]), to_f(xr[2]), to_f(xr[3]));
      }
      if (e0 + row < E_ext && kin) rv = __ldg(reinterpret_cast<const float4*>(router + int64_t(e0 + row) * H + k0 + kq));
      xs[kq + 0][row] = xv.x;
      xs[kq + 1][row] = xv.y;
      xs[kq + 2][row] = xv.z;
      xs[kq + 3][row] = xv.w;
      rs[kq + 0][row] = rv.x;
      rs[kq + 1][row] = rv.y;
      rs[kq + 2][row] = rv.z;
      rs[kq + 3][row] = rv.w;
    }
    __syncthreads();
#pragma unroll 8
    for (int k = 0; k < kTileK; ++k) {
      const float4 a = *reinterpret_cast<const float4*>(&xs[k][ty * 4]);
      const float4 b = *reinterpret_cast<const float4*>(&rs[k][tx * 4]);
      const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = m0 + ty * 4 + i;
    if (m >= M) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int e = e0 + tx * 4 + j;
      if (e < E) logits[int64_t(m) * E + e] = acc[i][j];
      else if (e < E_ext) gate_logit[m] = acc[i][j];
    }
  }
}

__global__ void append_shared_kernel(const int32_t* __restrict__ ids, const float* __restrict__ w,
                                     const float* __restrict__ gate_logit, int64_t M, int k, int S, int E,
                                     int32_t* __restrict__ ids2, float* __restrict__ w2) {
  const int k2 = k + S;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < M * k2; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = i / k2;
    const int j = int(i % k2);
    if (j < k) {
      ids2[i] = ids[m * k + j];
      w2[i] = w[m * k + j];
    } else {
      ids2[i] = E + (j - k);
      w2[i] = gate_logit ? 1.0f / (1.0f + expf(-gate_logit[m])) : 1.0f;
    }
  }
}

template <class T>
__global__ void cast_kernel(const float4* __restrict__ acc, T* __restrict__ out, int64_t n4) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 v = acc[i];
    T* o = out + 4 * i;
    if constexpr (std::is_same_v<T, __half>) {
      reinterpret_cast<__half2*>(o)[0] = __floats2half2_rn(v.x, v.y);
      reinterpret_cast<__half2*>(o)[1] = __floats2half2_rn(v.z, v.w);
    } else {
      reinterpret_cast<__nv_bfloat162*>(o)[0] = __floats2bfloat162_rn(v.x, v.y);
      reinterpret_cast<__nv_bfloat162*>(o)[1] = __floats2bfloat162_rn(v.z, v.w);
    }
  }
}

int grid_for(int64_t n, int threads) {
  return int(std::clamp<int64_t>((n + threads - 1) / threads, 1, 4096));
}

}  // namespace

void launch_router_logits(const void* x, DType act, int64_t M, int64_t H, const float* router, int E, int E_ext,
                          float* logits, float* gate_logit, float* zero, int64_t zero_n, Stream stream) {
  if (zero_n % 4 != 0) throw Error("router: zero_n=" + std::to_string(zero_n) + " is not a multiple of 4");
  if (H % 4 != 0) throw Error("router: H=" + std::to_string(H) + " is not a multiple of 4");
  if (E_ext != E && E_ext != E + 1) throw Error("router: E_ext=" + std::to_string(E_ext) + " must be E or E+1");
  if (act != DType::BF16 && act != DType::F16)
    throw Error(std::string("router: activation dtype ") + dtype_name(act) + " is not supported");
  if (M <= 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xt = static_cast<const T*>(x);
    if (M <= kSmallMaxM) {
      const dim3 grid(unsigned(E_ext), unsigned((M + kSmallM - 1) / kSmallM));
      if (reinterpret_cast<uintptr_t>(x) % 8 == 0)
        router_small_kernel<T, true><<<grid, kSmallThreads, 0, s>>>(xt, int(M), int(H), router, E, E_ext, logits,
                                                                    gate_logit, reinterpret_cast<float4*>(zero),
                                                                    zero_n / 4);
      else
        router_small_kernel<T, false><<<grid, kSmallThreads, 0, s>>>(xt, int(M), int(H), router, E, E_ext, logits,
                                                                     gate_logit, reinterpret_cast<float4*>(zero),
                                                                     zero_n / 4);
    } else {
      dim3 grid((E_ext + kTile - 1) / kTile, unsigned((M + kTile - 1) / kTile));
      router_tiled_kernel<T><<<grid, kTileThreads, 0, s>>>(xt, int(M), int(H), router, E, E_ext, logits, gate_logit,
                                                            reinterpret_cast<float4*>(zero), zero_n / 4);
    }
  };
  if (act == DType::BF16) run(__nv_bfloat16{});
  else run(__half{});
  WNA16_CUDA_CHECK_LAUNCH();
}

void launch_append_shared(const int32_t* ids, const float* weights, const float* gate_logit, int64_t M, int k,
                          int S, int E, int32_t* ids2, float* weights2, Stream stream) {
  if (M <= 0) return;
  const int threads = 256;
  append_shared_kernel<<<grid_for(M * (k + S), threads), threads, 0, static_cast<cudaStream_t>(stream)>>>(
      ids, weights, gate_logit, M, k, S, E, ids2, weights2);
  WNA16_CUDA_CHECK_LAUNCH();
}

void launch_cast_out(const float* acc, void* out, DType act, int64_t n, Stream stream) {
  if (n % 4 != 0) throw Error("cast: n=" + std::to_string(n) + " is not a multiple of 4");
  if (n == 0) return;
  const int threads = 256;
  auto s = static_cast<cudaStream_t>(stream);
  const auto* a4 = reinterpret_cast<const float4*>(acc);
  if (act == DType::BF16)
    cast_kernel<__nv_bfloat16><<<grid_for(n / 4, threads), threads, 0, s>>>(a4, static_cast<__nv_bfloat16*>(out), n / 4);
  else
    cast_kernel<__half><<<grid_for(n / 4, threads), threads, 0, s>>>(a4, static_cast<__half*>(out), n / 4);
  WNA16_CUDA_CHECK_LAUNCH();
}

}  // namespace wna16::cuda
