// Router logits (fp32 accumulation) and the shared-expert slots (the activation-movement kernels:
// activation_kernels.cu).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <string>

#include "cuda/cluster.cuh"
#include "cuda/cuda_check.h"
#include "cuda/dispatch.h"
#include "cuda/moe_layer_kernels.h"
#include "cuda/pdl.cuh"
#include "cuda/sm90_wna16_moe_common.cuh"  // gemm::Act<T>::mma
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
  const int64_t nthreads = int64_t(gridDim.x) * gridDim.y * gridDim.z * blockDim.x;
  const int64_t id = ((int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = id; i < n4; i += nthreads) p[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// Four router weights at p (a multiple of 4 elements in): fp32 in one 16-byte load; bf16 (a router
// whose every value is exact in bf16, as real checkpoints store it) in one 8-byte load, half the
// bytes for the same fp32 values.
template <class R>
__device__ __forceinline__ float4 load_router4(const R* p) {
  if constexpr (std::is_same_v<R, float>) {
    return __ldg(reinterpret_cast<const float4*>(p));
  } else {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                       __uint_as_float(u.y & 0xffff0000u));
  }
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

template <class T, class R, bool kVecX>
__global__ void __launch_bounds__(kSmallThreads)
    router_small_kernel(const T* __restrict__ x, int M, int H, const R* __restrict__ router, int E, int E_ext,
                        float* __restrict__ logits, float* __restrict__ gate_logit, float4* __restrict__ zero,
                        int64_t zero_n4) {
  // The routing kernel (launched with programmatic dependent launch) may get resident now; it
  // waits for this grid's completion before reading the logits.
  pdl_launch_dependents();
  const int e = blockIdx.x, m0 = blockIdx.y * kSmallM;
  const int mt = min(kSmallM, M - m0);
  const R* row = router + int64_t(e) * H;
  float acc[kSmallM] = {};
  for (int h0 = 0; h0 < H; h0 += kSmallThreads * 4 * kSmallBatch) {
    float4 r[kSmallBatch];
#pragma unroll
    for (int b = 0; b < kSmallBatch; ++b) {
      const int h = h0 + (b * kSmallThreads + int(threadIdx.x)) * 4;
      r[b] = h < H ? load_router4(row + h) : make_float4(0.f, 0.f, 0.f, 0.f);
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

// ---- router, M <= 64: H split over a cluster, every router byte read once ---------------------
// Grid (C, tiles), cluster (C, 1, 1): CTA (c, t) takes router rows [t*R, t*R + R) over the H slice
// [c*Hs, c*Hs + Hs) and all M tokens; the C partial sums of a logit meet in distributed shared
// memory and are added in cluster-rank order (deterministic). The CTA's 8 warps are WR row groups
// x WH = 8 / WR parts of the slice; warp (wr, wh) holds rows wr + WR*i (i < RW) of its part in
// registers (all loads issued at once: one DRAM round trip), x's slice is copied to shared memory
// (cp.async, raw 16-bit) once per CTA, and the lanes' partial sums of MC = 16 / RW tokens x RW
// rows are combined by one reduce-scatter butterfly (31 shuffles for 16 sums, not 160).
// DeepSeek-V3 (E=256, H=7168): R = 16, Hs = 896, 16 x 8 = 128 CTAs, 57 KB of router each.
// Mixtral (E=8, H=4096): R = 1, Hs = 512 split over 8 warps, 8 x 8 = 64 CTAs.
constexpr int kSplitThreads = 256;
constexpr int kSplitWarps = kSplitThreads / 32;
constexpr int kSplitCluster = 8;   // portable cluster size
constexpr int kSplitMaxM = 64;
// Below this the one-row-per-block kernel is faster (H200, ncu, DeepSeek-V3 M=1: 5.5 us against
// 9.4 for the split kernel; M=16: 20 against 13.7; the crossover in between is not measured).
constexpr int kSplitMinM = 8;
constexpr int kSplitG = 8;         // float4 router granules per lane and row (a warp part <= 1024 h)

__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(d), "l"(gmem) : "memory");
}

template <class T>
__device__ __forceinline__ void unpack4(uint2 u, float (&f)[4]) {
  const uint32_t w[2] = {u.x, u.y};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if constexpr (std::is_same_v<T, __half>) {
      const __half2 h = *reinterpret_cast<const __half2*>(&w[i]);
      const float2 v = __half22float2(h);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    } else {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
}

// v[0..16) summed over the 32 lanes; afterwards lane l holds the sum of v[idx(l)] in v[0], with
// idx(l) = bits 4..1 of l (lanes 2j and 2j+1 hold the same value).
template <int N>
__device__ __forceinline__ void reduce_scatter_step(float (&v)[16], int lane) {
  if constexpr (N >= 1) {
    constexpr int off = 2 * N;  // 16, 8, 4, 2 for N = 8, 4, 2, 1
    const bool up = lane & off;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float send = up ? v[i] : v[i + N];
      const float keep = up ? v[i + N] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
    }
    reduce_scatter_step<N / 2>(v, lane);
  }
}
__device__ __forceinline__ void reduce_scatter16(float (&v)[16], int lane) {
  reduce_scatter_step<8>(v, lane);
  v[0] += __shfl_xor_sync(0xffffffffu, v[0], 1);
}

template <class T, class R, int RW>
__global__ void __launch_bounds__(kSplitThreads, 1)
    router_split_kernel(const T* __restrict__ x, int M, int H, const R* __restrict__ router, int E, int E_ext,
                        int Hs, int WR, float* __restrict__ logits, float* __restrict__ gate_logit,
                        float4* __restrict__ zero, int64_t zero_n4) {
  // The routing kernel (launched with programmatic dependent launch) may get resident now; it
  // waits for this grid's completion before reading the logits.
  pdl_launch_dependents();
  constexpr int MC = 16 / RW;  // tokens per pass: RW x MC = 16 sums per lane
  extern __shared__ __align__(16) unsigned char smem[];
  const ClusterView cluster;
  const int C = cluster.size();
  const int c = cluster.rank();
  const int RN = WR * RW, WH = kSplitWarps / WR;  // router rows per CTA
  unsigned short* xs = reinterpret_cast<unsigned short*>(smem);                  // [M][Hs]
  float* part = reinterpret_cast<float*>(smem + size_t(M) * Hs * 2);             // [WH][M][RN]
  float* red = part + size_t(WH) * M * RN;                                       // [M][RN]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wr = warp % WR, wh = warp / WR;
  const int h0 = c * Hs;
  const int hn = max(0, min(Hs, H - h0));   // valid length of the slice (a multiple of 4)
  const int sub = Hs / WH;                  // a multiple of 4
  const int hs0 = wh * sub;                 // this warp's part of the slice
  const int subn = max(0, min(sub, hn - hs0));
  const int ng = subn / 4, nq = (ng + 31) / 32;
  const int row0 = blockIdx.y * RN + wr;

  // 1. Router rows into registers: every load of the thread issued before the first use. Invalid
  //    granules load a clamped (valid) address and are zeroed, so there is no branch between loads.
  float4 rr[RW][kSplitG];
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    const int row = row0 + WR * i;
    const int64_t base = int64_t(row) * H + h0 + hs0;
#pragma unroll
    for (int q = 0; q < kSplitG; ++q) {
      const int g = q * 32 + lane;
      const bool ok = row < E_ext && g < ng;
      const float4 v = load_router4(router + (ok ? base + 4 * g : 0));
      rr[i][q] = ok ? v : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  // 2. x's slice into shared memory, asynchronously; the tail past the end of H is zeroed (the
  //    router there is zero, but garbage could be NaN).
  const int gs = Hs / 4, gv = hn / 4;
  for (int i = tid; i < M * gs; i += kSplitThreads) {
    const int m = i / gs, g = i - m * gs;
    unsigned short* d = xs + size_t(m) * Hs + 4 * g;
    if (g < gv) cp_async8(d, x + int64_t(m) * H + h0 + 4 * g);
    else *reinterpret_cast<uint2*>(d) = make_uint2(0u, 0u);
  }
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  zero_fill(zero, zero_n4);  // after the loads are in flight: the stores only take issue slots
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncthreads();

  // 3. Partial dot products, MC tokens at a time; one reduce-scatter per pass.
  const int gmax = max(sub / 4 - 1, 0);
  for (int m0 = 0; m0 < M; m0 += MC) {
    float acc[RW * MC];
#pragma unroll
    for (int v = 0; v < RW * MC; ++v) acc[v] = 0.f;
#pragma unroll
    for (int q = 0; q < kSplitG; ++q) {
      if (q >= nq) continue;  // warp-uniform
      const int g = min(q * 32 + lane, gmax);  // lanes past the part read a valid, zero-weighted x
#pragma unroll
      for (int mm = 0; mm < MC; ++mm) {
        const int m = min(m0 + mm, M - 1);  // rows past M are computed and dropped: no branch
        float f[4];
        unpack4<T>(*reinterpret_cast<const uint2*>(xs + size_t(m) * Hs + hs0 + 4 * g), f);
#pragma unroll
        for (int i = 0; i < RW; ++i) {
          float a = acc[i * MC + mm];
          a = fmaf(rr[i][q].x, f[0], a);
          a = fmaf(rr[i][q].y, f[1], a);
          a = fmaf(rr[i][q].z, f[2], a);
          a = fmaf(rr[i][q].w, f[3], a);
          acc[i * MC + mm] = a;
        }
      }
    }
    reduce_scatter16(acc, lane);
    const int vi = (lane >> 1) & 15;
    const int i = vi / MC, mm = vi % MC;
    if ((lane & 1) == 0 && m0 + mm < M) part[(size_t(wh) * M + m0 + mm) * RN + wr + WR * i] = acc[0];
  }
  __syncthreads();
  // 4. The CTA's sum over its warp parts, then the cluster's over the slices (rank order).
  for (int i = tid; i < M * RN; i += kSplitThreads) {
    float v = 0.f;
    for (int w = 0; w < WH; ++w) v += part[size_t(w) * M * RN + i];
    red[i] = v;
  }
  cluster.sync();
  for (int i = c * kSplitThreads + tid; i < M * RN; i += C * kSplitThreads) {
    float v[kSplitCluster];
#pragma unroll
    for (int r = 0; r < kSplitCluster; ++r) v[r] = r < C ? *cluster.map(red + i, r) : 0.f;
    float s = 0.f;
#pragma unroll
    for (int r = 0; r < kSplitCluster; ++r) s += v[r];
    const int m = i / RN, row = blockIdx.y * RN + i % RN;
    if (row < E) logits[int64_t(m) * E + row] = s;
    else if (row < E_ext) gate_logit[m] = s;
  }
  cluster.sync();  // a CTA's shared memory must outlive the other CTAs' reads of it
}

// ---- router, many tokens: TM x TE output tiles through shared memory, 4 x 4 per thread -----------
// TE = 64 experts x TM = 64 tokens, or TE = 16 x TM = 256 for few experts (Mixtral's 8 would leave
// 7/8 of a 64-wide tile idle). H is split over a cluster of KS CTAs (grid z) so that even a few
// tiles keep most SMs busy (Mixtral M=256 is one tile); the KS partial tiles meet in distributed
// shared memory and are added in cluster-rank order, so the logits are deterministic.
constexpr int kTileK = 32, kTileThreads = 256, kTileMaxSplit = 8;

template <class T, class R, int TE>
__global__ void __launch_bounds__(kTileThreads)
    router_tiled_kernel(const T* __restrict__ x, int M, int H, const R* __restrict__ router, int E, int E_ext,
                        int k_per_split, float* __restrict__ logits, float* __restrict__ gate_logit,
                        float4* __restrict__ zero, int64_t zero_n4) {
  constexpr int TM = 64 * 64 / TE;
  constexpr int TX = TE / 4;  // threads along the experts
  static_assert(TM / 4 * TX == kTileThreads, "4 x 4 outputs per thread cover the tile");
  pdl_launch_dependents();  // see router_small_kernel
  zero_fill(zero, zero_n4);
  // [k][token] and [k][expert] operand tiles; after the k loop the CTA's partial tile [TM][TE].
  constexpr int kXs = kTileK * (TM + 4), kRs = kTileK * (TE + 4);
  static_assert(kXs + kRs >= TM * TE, "the partial tile fits in the operand tiles");
  __shared__ __align__(16) float buf[kXs + kRs];
  float (*xs)[TM + 4] = reinterpret_cast<float (*)[TM + 4]>(buf);
  float (*rs)[TE + 4] = reinterpret_cast<float (*)[TE + 4]>(buf + kXs);
  const int m0 = blockIdx.y * TM, e0 = blockIdx.x * TE;
  const int k_begin = blockIdx.z * k_per_split, k_end = min(H, k_begin + k_per_split);
  const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
  float acc[4][4] = {};
  for (int k0 = k_begin; k0 < k_end; k0 += kTileK) {
    // 4 consecutive k of one row per load (H is a multiple of 4).
    for (int i = threadIdx.x; i < TM * kTileK / 4; i += kTileThreads) {
      const int row = i / (kTileK / 4), kq = (i % (kTileK / 4)) * 4;
      float4 xv = make_float4(0.f, 0.f, 0.f, 0.f);
      if (m0 + row < M && k0 + kq < k_end) {
        const T* xr = x + int64_t(m0 + row) * H + k0 + kq;
        xv = make_float4(to_f(xr[0]), to_f(xr[1]), to_f(xr[2]), to_f(xr[3]));
      }
      xs[kq + 0][row] = xv.x;
      xs[kq + 1][row] = xv.y;
      xs[kq + 2][row] = xv.z;
      xs[kq + 3][row] = xv.w;
    }
    for (int i = threadIdx.x; i < TE * kTileK / 4; i += kTileThreads) {
      const int row = i / (kTileK / 4), kq = (i % (kTileK / 4)) * 4;
      float4 rv = make_float4(0.f, 0.f, 0.f, 0.f);
      if (e0 + row < E_ext && k0 + kq < k_end)
        rv = load_router4(router + int64_t(e0 + row) * H + k0 + kq);
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
  // The partial tile into shared memory (the loop ended on a barrier: the operand tiles are free),
  // then CTA `rank` adds outputs rank, rank + KS*threads, ... over the cluster in rank order.
  float* part = buf;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) part[(ty * 4 + i) * TE + tx * 4 + j] = acc[i][j];
  const ClusterView cluster;
  const int KS = cluster.size(), rank = cluster.rank();
  cluster.sync();
  for (int o = rank * kTileThreads + threadIdx.x; o < TM * TE; o += KS * kTileThreads) {
    const int m = m0 + o / TE, e = e0 + o % TE;
    if (m >= M || e >= E_ext) continue;
    float v = 0.f;
    for (int r = 0; r < KS; ++r) v += *cluster.map(part + o, r);
    if (e < E) logits[int64_t(m) * E + e] = v;
    else gate_logit[m] = v;
  }
  cluster.sync();  // a CTA's shared memory must outlive the other CTAs' reads of it
}

// The SM count of the device current at the first call (cached).
int sm_count() {
  static std::atomic<int> cached{0};
  int sms = cached.load(std::memory_order_relaxed);
  if (sms == 0) {
    int dev = 0;
    WNA16_CUDA_CHECK(cudaGetDevice(&dev));
    WNA16_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    cached.store(sms, std::memory_order_relaxed);
  }
  return sms;
}

// The split router's shape for (M, H, E_ext): rows per CTA so that about one CTA per SM is busy
// (16 row tiles x 8 slices on 132 SMs), and whether it fits (a warp part <= 1024 h, shared memory).
struct SplitPlan {
  bool ok = false;
  int RW = 1, WR = 8, R = 8, tiles = 1, Hs = 0;
  size_t smem = 0;
};
constexpr size_t kSplitMaxSmem = 200 * 1024;

SplitPlan plan_split(int64_t M, int64_t H, int E_ext) {
  SplitPlan p;
  const int sms = sm_count();
  const int target_tiles = std::max(1, sms / kSplitCluster);
  const int rows = (E_ext + target_tiles - 1) / target_tiles;
  if (rows <= 1) { p.WR = 1; p.RW = 1; }
  else if (rows <= 2) { p.WR = 2; p.RW = 1; }
  else if (rows <= 4) { p.WR = 4; p.RW = 1; }
  else if (rows <= 8) { p.WR = 8; p.RW = 1; }
  else if (rows <= 16) { p.WR = 8; p.RW = 2; }
  else { p.WR = 8; p.RW = 4; }
  p.R = p.WR * p.RW;
  p.tiles = (E_ext + p.R - 1) / p.R;
  const int64_t per = (H + kSplitCluster - 1) / kSplitCluster;
  p.Hs = int((per + 31) / 32 * 32);
  const int WH = kSplitWarps / p.WR;
  p.smem = size_t(M) * p.Hs * 2 + size_t(WH + 1) * M * p.R * 4;
  p.ok = p.Hs / WH <= 32 * 4 * kSplitG && p.smem <= kSplitMaxSmem && p.tiles <= 65535;
  return p;
}

// cudaFuncAttributeMaxDynamicSharedMemorySize for split-router instantiation `slot` (12 of them),
// once per device. NOTE: may run inside a stream capture: not stream work, so relaxed mode.
void allow_split_smem(const void* fn, int slot) {
  constexpr int kMaxDevices = 64;
  static std::array<std::array<std::atomic<bool>, 12>, kMaxDevices> done{};
  int dev = 0;
  WNA16_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) throw Error("router: device ordinal " + std::to_string(dev) + " is too large");
  std::atomic<bool>& d = done[size_t(dev)][size_t(slot)];
  if (d.load(std::memory_order_acquire)) return;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  const cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSplitMaxSmem));
  cudaThreadExchangeStreamCaptureMode(&mode);
  WNA16_CUDA_CHECK(e);
  d.store(true, std::memory_order_release);
}

// ---- router, many tokens, many experts: tensor cores ---------------------------------------------
// logits = x . router^T with mma.sync m16n8k16 (bf16 in, fp32 accumulate). The fp32 router row
// is cut into three bf16 pieces r = r0 + r1 + r2 (8 + 8 + 8 significant bits: exact, and bf16
// has fp32's exponent range), so every product x * r_i is exact in fp32 and the sum keeps fp32's
// precision; f16 x is cut into x0 + x1 (bf16, exact: 11 = 8 + 3 bits) and the x1 * r2 term,
// 2^-24 of the product, is dropped. Each output is one thread's accumulator over K in a fixed
// order: deterministic. Tile 64 tokens x 64 experts x 32 k, 4 warps of 32 x 32; the next k-tile's
// global loads are in registers while the current one is multiplied.
constexpr int kMmaTM = 64, kMmaTE = 64, kMmaTK = 32, kMmaThreads = 128;
constexpr int kMmaPitch = kMmaTK + 8;  // bf16 per smem row: 80 bytes, conflict-free fragment loads

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
// v = p0 + p1 (+ p2) in bf16, each piece the rounding of what the earlier ones leave.
__device__ __forceinline__ void split_bf16(float v, float& p0, float& p1, float& p2) {
  p0 = __bfloat162float(__float2bfloat16_rn(v));
  const float r1 = v - p0;  // exact
  p1 = __bfloat162float(__float2bfloat16_rn(r1));
  p2 = r1 - p1;  // exact, and exactly a bf16 for fp32 v (8 bits left)
}

template <class T, class R>
__global__ void __launch_bounds__(kMmaThreads) router_mma_kernel(const T* __restrict__ x, int M, int H,
                                                                 const R* __restrict__ router, int E, int E_ext,
                                                                 int k_per_split, float* __restrict__ logits,
                                                                 float* __restrict__ gate_logit,
                                                                 float4* __restrict__ zero, int64_t zero_n4) {
  constexpr bool kF16 = std::is_same_v<T, __half>;
  constexpr int XP = kF16 ? 2 : 1;                       // pieces of x
  constexpr int RP = std::is_same_v<R, float> ? 3 : 1;  // pieces of the router (a bf16 router is one)
  pdl_launch_dependents();  // see router_small_kernel
  zero_fill(zero, zero_n4);
  // The operand tiles, and after the k loop the CTA's partial tile when H is split (grid z).
  constexpr int kOpBytes = (XP * kMmaTM + RP * kMmaTE) * kMmaPitch * 2;
  constexpr int kPartBytes = kMmaTM * kMmaTE * 4;
  __shared__ __align__(16) unsigned char smem[kOpBytes > kPartBytes ? kOpBytes : kPartBytes];
  auto& xs = *reinterpret_cast<__nv_bfloat16 (*)[XP][kMmaTM][kMmaPitch]>(smem);
  auto& rs = *reinterpret_cast<__nv_bfloat16 (*)[RP][kMmaTE][kMmaPitch]>(smem + XP * kMmaTM * kMmaPitch * 2);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.y * kMmaTM, e0 = blockIdx.x * kMmaTE;
  const int k_begin = blockIdx.z * k_per_split, k_end = min(H, k_begin + k_per_split);
  // Loader: thread tid copies 16 k of row tid / 2 (tokens and experts), k offset 16 * (tid & 1).
  const int lr = tid >> 1, lk = 16 * (tid & 1);
  const bool x_ok = m0 + lr < M, r_ok = e0 + lr < E_ext;
  const T* xrow = x + int64_t(x_ok ? m0 + lr : 0) * H + lk;
  const R* rrow = router + int64_t(r_ok ? e0 + lr : 0) * H + lk;
  uint4 xv[2];
  float4 rv[4];
  auto load = [&](int k0) {  // the k-tile at k0 into registers (zeros past M, E_ext, the split's end)
    const bool kx = k0 + lk < k_end;  // H and the split bounds are multiples of 16 on this path
#pragma unroll
    for (int i = 0; i < 2; ++i)
      xv[i] = x_ok && kx ? __ldg(reinterpret_cast<const uint4*>(xrow + k0) + i) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < 4; ++i)
      rv[i] = r_ok && kx ? load_router4(rrow + k0 + 4 * i) : make_float4(0.f, 0.f, 0.f, 0.f);
  };
  auto store = [&] {
    if constexpr (!kF16) {
      *reinterpret_cast<uint4*>(&xs[0][lr][lk]) = xv[0];
      *reinterpret_cast<uint4*>(&xs[0][lr][lk + 8]) = xv[1];
    } else {
      const __half* h = reinterpret_cast<const __half*>(xv);
      uint32_t w0[8], w1[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        float a0, a1, a2, b0, b1, b2;
        split_bf16(__half2float(h[2 * i]), a0, a1, a2);
        split_bf16(__half2float(h[2 * i + 1]), b0, b1, b2);
        w0[i] = pack_bf16(a0, b0);
        w1[i] = pack_bf16(a1, b1);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        *reinterpret_cast<uint4*>(&xs[0][lr][lk + 8 * i]) = make_uint4(w0[4 * i], w0[4 * i + 1], w0[4 * i + 2], w0[4 * i + 3]);
        *reinterpret_cast<uint4*>(&xs[1][lr][lk + 8 * i]) = make_uint4(w1[4 * i], w1[4 * i + 1], w1[4 * i + 2], w1[4 * i + 3]);
      }
    }
    const float* f = reinterpret_cast<const float*>(rv);
    uint32_t q[3][8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      float a0, a1, a2, b0, b1, b2;
      split_bf16(f[2 * i], a0, a1, a2);
      split_bf16(f[2 * i + 1], b0, b1, b2);
      q[0][i] = pack_bf16(a0, b0);
      q[1][i] = pack_bf16(a1, b1);
      q[2][i] = pack_bf16(a2, b2);
    }
#pragma unroll
    for (int p = 0; p < RP; ++p)
#pragma unroll
      for (int i = 0; i < 2; ++i)
        *reinterpret_cast<uint4*>(&rs[p][lr][lk + 8 * i]) = make_uint4(q[p][4 * i], q[p][4 * i + 1], q[p][4 * i + 2], q[p][4 * i + 3]);
  };
  auto mma = gemm::Act<__nv_bfloat16>::mma;  // the GEMM kernels' bf16 m16n8k16, fp32 accumulate
  const int wm = (warp & 1) * 32, wn = (warp >> 1) * 32;
  float acc[2][4][4] = {};
  load(k_begin);
  for (int k0 = k_begin; k0 < k_end; k0 += kMmaTK) {
    __syncthreads();  // the previous tile's fragments are read
    store();
    __syncthreads();
    if (k0 + kMmaTK < k_end) load(k0 + kMmaTK);
#pragma unroll
    for (int kk = 0; kk < kMmaTK; kk += 16) {
      auto w32 = [](const __nv_bfloat16* q) { return *reinterpret_cast<const uint32_t*>(q); };
      uint32_t a[XP][2][4];
#pragma unroll
      for (int p = 0; p < XP; ++p)
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          const int r = wm + 16 * mi + g;
          a[p][mi][0] = w32(&xs[p][r][kk + 2 * t]);
          a[p][mi][1] = w32(&xs[p][r + 8][kk + 2 * t]);
          a[p][mi][2] = w32(&xs[p][r][kk + 2 * t + 8]);
          a[p][mi][3] = w32(&xs[p][r + 8][kk + 2 * t + 8]);
        }
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int c = wn + 8 * ni + g;
        uint32_t b[RP][2];
#pragma unroll
        for (int p = 0; p < RP; ++p) {
          b[p][0] = w32(&rs[p][c][kk + 2 * t]);
          b[p][1] = w32(&rs[p][c][kk + 2 * t + 8]);
        }
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          // Small terms first, so the large ones are added to an accumulator that holds them.
          // (A bf16 router has no pieces 1 and 2: their products, exact zeros, are skipped.)
          if constexpr (kF16) {
            if constexpr (RP == 3) mma(acc[mi][ni], a[1][mi], b[1][0], b[1][1]);
            mma(acc[mi][ni], a[1][mi], b[0][0], b[0][1]);
          }
          if constexpr (RP == 3) {
            mma(acc[mi][ni], a[0][mi], b[2][0], b[2][1]);
            mma(acc[mi][ni], a[0][mi], b[1][0], b[1][1]);
          }
          mma(acc[mi][ni], a[0][mi], b[0][0], b[0][1]);
        }
      }
    }
  }
  // C fragment: rows (tokens) g, g + 8 of each 16; columns (experts) 2t, 2t + 1 of each 8.
  const ClusterView cluster;
  const int KS = cluster.size(), rank = cluster.rank();
  auto put = [&](int m, int e, float v) {
    if (m >= M || e >= E_ext) return;
    if (e < E) logits[int64_t(m) * E + e] = v;
    else gate_logit[m] = v;
  };
  if (KS == 1) {
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          put(m0 + wm + 16 * mi + g + 8 * (r >> 1), e0 + wn + 8 * ni + 2 * t + (r & 1), acc[mi][ni][r]);
    return;
  }
  // H split over the KS CTAs of a cluster: the partial tiles meet in distributed shared memory and
  // are added in rank order (deterministic), CTA `rank` summing outputs rank, rank + KS*threads, ...
  float* part = reinterpret_cast<float*>(smem);
  __syncthreads();  // every warp is done reading the operand tiles
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        part[(wm + 16 * mi + g + 8 * (r >> 1)) * kMmaTE + wn + 8 * ni + 2 * t + (r & 1)] = acc[mi][ni][r];
  cluster.sync();
  for (int o = rank * kMmaThreads + tid; o < kMmaTM * kMmaTE; o += KS * kMmaThreads) {
    float v = 0.f;
    for (int q = 0; q < KS; ++q) v += *cluster.map(part + o, q);
    put(m0 + o / kMmaTE, e0 + o % kMmaTE, v);
  }
  cluster.sync();  // a CTA's shared memory must outlive the other CTAs' reads of it
}

// A router kernel over (E_ext / TE) x (M / TM) tiles with H split over KS <= 8 CTAs of one cluster
// (grid z) until the tiles x KS cover the SMs kRouterCtasPerSm times, keeping >= 8 k-steps of KSTEP
// per CTA; both the tiled and the tensor-core kernels take these arguments. Several CTAs per SM:
// each CTA's k-loop waits on its own loads (one register-staged tile), so the SM needs several of
// them in flight (ncu, DeepSeek-V3 M=4096, one CTA per tile: 305 us, 7.7 warps per SM, issue 17%).
constexpr int kRouterCtasPerSm = 8;
template <class T, class R, class Kernel>
void launch_router_split_h(Kernel kern, int TE, int TM, int KSTEP, int threads, const T* x, int64_t M, int64_t H,
                           const R* router, int E, int E_ext, float* logits, float* gate_logit, float* zero,
                           int64_t zero_n, cudaStream_t s, bool fixed_split = false) {
  const int64_t tiles = int64_t((E_ext + TE - 1) / TE) * ((M + TM - 1) / TM);
  // fixed_split (batch invariance): the split, and so each logit's order of additions, from H alone.
  int KS = fixed_split ? kTileMaxSplit
                       : int(std::clamp<int64_t>((kRouterCtasPerSm * sm_count() + tiles - 1) / tiles, 1, kTileMaxSplit));
  KS = int(std::min<int64_t>(KS, std::max<int64_t>(1, H / (8 * KSTEP))));
  if (portable_path()) KS = 1;  // no clusters: one CTA per tile
  const int k_per_split = int((H + KS * KSTEP - 1) / (KS * KSTEP) * KSTEP);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = unsigned(KS);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned((E_ext + TE - 1) / TE), unsigned((M + TM - 1) / TM), unsigned(KS));
  cfg.blockDim = dim3(unsigned(threads));
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = portable_path() ? 0 : 1;  // the cluster shape (KS = 1 there)
  WNA16_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, x, int(M), int(H), router, E, E_ext, k_per_split, logits, gate_logit,
                                      reinterpret_cast<float4*>(zero), zero_n / 4));
}

// The tiled router: 16-expert tiles for E_ext <= 16, else 64.
template <class T, class R>
void launch_router_tiled(const T* x, int64_t M, int64_t H, const R* router, int E, int E_ext, float* logits,
                         float* gate_logit, float* zero, int64_t zero_n, cudaStream_t s) {
  const bool narrow = E_ext <= 16;
  const int TE = narrow ? 16 : 64, TM = 64 * 64 / TE;
  if ((M + TM - 1) / TM > 65535) throw Error("router: M=" + std::to_string(M) + " exceeds the tiled router's grid");
  auto kern = narrow ? router_tiled_kernel<T, R, 16> : router_tiled_kernel<T, R, 64>;
  launch_router_split_h(kern, TE, TM, kTileK, kTileThreads, x, M, H, router, E, E_ext, logits, gate_logit, zero, zero_n,
                        s);
}

}  // namespace

void launch_router_logits(const void* x, DType act, int64_t M, int64_t H, const void* router, DType router_dtype,
                          int E, int E_ext, float* logits, float* gate_logit, float* zero, int64_t zero_n,
                          Stream stream, bool batch_invariant) {
  if (zero_n % 4 != 0) throw Error("router: zero_n=" + std::to_string(zero_n) + " is not a multiple of 4");
  if (H % 4 != 0) throw Error("router: H=" + std::to_string(H) + " is not a multiple of 4");
  if (E_ext != E && E_ext != E + 1) throw Error("router: E_ext=" + std::to_string(E_ext) + " must be E or E+1");
  if (act != DType::BF16 && act != DType::F16)
    throw Error(std::string("router: activation dtype ") + dtype_name(act) + " is not supported");
  if (router_dtype != DType::F32 && router_dtype != DType::BF16)
    throw Error(std::string("router: weight dtype ") + dtype_name(router_dtype) + " is not supported (f32, bf16)");
  if (M <= 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  auto run = [&](auto tag, auto rtag) {
    using T = decltype(tag);
    using R = decltype(rtag);
    const T* xt = static_cast<const T*>(x);
    const R* rw = static_cast<const R*>(router);
    const bool mma_ok = E_ext >= 32 && H % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(router) % 16 == 0 && (M + kMmaTM - 1) / kMmaTM <= 65535;
    // The small kernel: (expert, 8 tokens) blocks; vec: 8-byte x loads.
    auto launch_small = [&](bool vec) {
      const dim3 grid(unsigned(E_ext), unsigned((M + kSmallM - 1) / kSmallM));
      auto kern = vec ? router_small_kernel<T, R, true> : router_small_kernel<T, R, false>;
      kern<<<grid, kSmallThreads, 0, s>>>(xt, int(M), int(H), rw, E, E_ext, logits, gate_logit,
                                          reinterpret_cast<float4*>(zero), zero_n / 4);
      WNA16_CUDA_CHECK(cudaGetLastError());
    };
    if (batch_invariant) {  // the same kernel and split at every M (the layer's x is 16-byte aligned)
      if (mma_ok) {
        launch_router_split_h(router_mma_kernel<T, R>, kMmaTE, kMmaTM, kMmaTK, kMmaThreads, xt, M, H, rw, E, E_ext,
                              logits, gate_logit, zero, zero_n, s, true);
        return;
      }
      if ((M + kSmallM - 1) / kSmallM > 65535)
        throw Error("router: M=" + std::to_string(M) + " exceeds the batch-invariant router's grid");
      launch_small(false);
      return;
    }
    // The split kernel spreads H over a cluster of CTAs: the Hopper path only.
    if (M >= kSplitMinM && M <= kSplitMaxM && reinterpret_cast<uintptr_t>(x) % 8 == 0 && !portable_path()) {
      const SplitPlan pl = plan_split(M, H, E_ext);
      if (pl.ok) {
        auto k = pl.RW == 1 ? router_split_kernel<T, R, 1> : pl.RW == 2 ? router_split_kernel<T, R, 2>
                                                                         : router_split_kernel<T, R, 4>;
        allow_split_smem(reinterpret_cast<const void*>(k),
                         (std::is_same_v<R, float> ? 0 : 6) + (std::is_same_v<T, __half> ? 0 : 3) + pl.RW / 2);
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = kSplitCluster;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(kSplitCluster, unsigned(pl.tiles));
        cfg.blockDim = dim3(kSplitThreads);
        cfg.dynamicSmemBytes = pl.smem;
        cfg.stream = s;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        WNA16_CUDA_CHECK(cudaLaunchKernelEx(&cfg, k, xt, int(M), int(H), rw, E, E_ext, pl.Hs, pl.WR, logits,
                                            gate_logit, reinterpret_cast<float4*>(zero), zero_n / 4));
        return;
      }
    }
    // Many tokens and experts: tensor cores (DeepSeek-V3 M=4096: 15 GFLOP that the fp32 tiled
    // kernel took 0.74 ms for; M=1024 265 us there, 2026-12-02 ncu). Needs 16-byte x rows.
    if (M > kSmallMaxM && mma_ok) {
      launch_router_split_h(router_mma_kernel<T, R>, kMmaTE, kMmaTM, kMmaTK, kMmaThreads, xt, M, H, rw, E, E_ext, logits,
                            gate_logit, zero, zero_n, s);
      return;
    }
    // Few experts: the tiled kernel's tiles hold 256 tokens each (Mixtral M=256 took 807 us on one
    // CTA without clusters, and 105 us at M=256 and 1024 with its H split; H200, ncu). The small
    // kernel's (expert, 8 tokens) blocks spread any M over the SMs instead: the batch-invariant
    // mode, whose GEMMs are the default's there, ran Mixtral M=256 / 1024 3-6% faster with it
    // (2026-12-03, H200, 7b78467's sources).
    if (M <= kSmallMaxM || (E_ext < 32 && (M + kSmallM - 1) / kSmallM <= 65535)) {
      launch_small(reinterpret_cast<uintptr_t>(x) % 8 == 0);
    } else {
      launch_router_tiled<T, R>(xt, M, H, rw, E, E_ext, logits, gate_logit, zero, zero_n, s);
    }
  };
  const bool rbf = router_dtype == DType::BF16;
  if (act == DType::BF16) rbf ? run(__nv_bfloat16{}, __nv_bfloat16{}) : run(__nv_bfloat16{}, float{});
  else rbf ? run(__half{}, __nv_bfloat16{}) : run(__half{}, float{});
  WNA16_CUDA_CHECK_LAUNCH();
}

}  // namespace wna16::cuda
