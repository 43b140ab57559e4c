// The activation-movement kernels of the layer (moe_layer_kernels.h): the act-order gather per
// slot, x k-permuted in m-block order for the wgmma kernel, and the top-k sum into the output.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda/cuda_check.h"
#include "cuda/dispatch.h"
#include "cuda/moe_gemm.h"  // kperm_pos
#include "cuda/moe_layer_kernels.h"
#include "cuda/pdl.cuh"
#include "wna16/error.h"

namespace wna16::cuda {
namespace {

// ---- act-order gather (launch_gather_slots) -------------------------------------------------------
// Block (s, piece): kGatherPerThread elements of slot s's row per thread, all perm loads and then
// all x loads in flight together (one chain of two round trips per block, short at one token).
constexpr int kGatherThreads = 256;
constexpr int kGatherPerThread = 8;
constexpr int kGatherPiece = kGatherThreads * kGatherPerThread;  // elements of a row per block

// Slots j_begin <= j < j_end of each token (block x: token and j); ids null: slot j's expert is
// j - j_begin, and the kernel reads nothing the chain writes, so it waits for the previous kernel
// only at its end (the chain's completion order stays intact).
template <bool kKperm>
__global__ void __launch_bounds__(kGatherThreads)
    gather_slots_kernel(const uint16_t* __restrict__ x, int64_t H, const int32_t* __restrict__ ids, int k2,
                        int j_begin, int j_end, int n_perm, const int32_t* __restrict__ perm,
                        uint16_t* __restrict__ out) {
  // The next kernel may get resident now; the slot ids come from the previous one.
  pdl_launch_dependents();
  if (ids) pdl_wait();
  const int nj = j_end - j_begin;
  const int j_slot = j_begin + int(blockIdx.x % nj);
  const int64_t s = int64_t(blockIdx.x / nj) * k2 + j_slot;
  const int id = ids ? __ldg(ids + s) : j_slot - j_begin;
  const int e = min(max(id, 0), n_perm - 1);  // ids are in range; a clamp costs nothing
  const uint16_t* xr = x + (s / k2) * H;
  const int32_t* pr = perm + int64_t(e) * H;
  uint16_t* o = out + s * H;
  const int64_t j0 = int64_t(blockIdx.y) * kGatherPiece + threadIdx.x;
  int32_t src[kGatherPerThread];
#pragma unroll
  for (int i = 0; i < kGatherPerThread; ++i) {
    const int64_t j = j0 + i * kGatherThreads;
    src[i] = j < H ? __ldg(pr + j) : 0;
  }
  uint16_t v[kGatherPerThread];
#pragma unroll
  for (int i = 0; i < kGatherPerThread; ++i) v[i] = xr[min(max(src[i], 0), int(H - 1))];
#pragma unroll
  for (int i = 0; i < kGatherPerThread; ++i) {
    const int64_t j = j0 + i * kGatherThreads;
    if (j < H) o[kKperm ? kperm_pos(j) : j] = v[i];
  }
  if (!ids) pdl_wait();
}

// Positions in order, 64-element chunks. kVec: a warp moves 4 consecutive chunks at a time, lane
// l unit l % 8 of chunk l / 8, through shared memory so that the 16-byte loads and stores of a
// warp cover 512 contiguous bytes (word 8w + u goes to word 4u + w; one thread per chunk with
// eight 16-byte accesses 128 bytes apart per warp instruction ran at a third of the write
// bandwidth: 163 us for DeepSeek-V3 M=1024's 132 MB, 2026-12-02 ncu). Else one thread per chunk,
// element by element (x with only 2-byte alignment).
constexpr int kKpermThreads = 256, kKpermPitch = 40;  // words per staged chunk: 8 * chunk + unit spreads the banks
template <bool kVec>
__global__ void __launch_bounds__(kKpermThreads)
    kperm_positions_kernel(const uint16_t* __restrict__ x, int64_t H, const int32_t* __restrict__ sorted,
                           const int32_t* __restrict__ ntpp, int num_slots, int x_div, int64_t rows,
                           uint16_t* __restrict__ y) {
  const int64_t cpr = H / 64;
  const int64_t n_chunks = (sorted ? min(rows, int64_t(__ldg(ntpp))) : rows) * cpr;
  // The chunk's source row, or null for a padding position (not written: it only feeds discarded
  // accumulator columns).
  auto source = [&](int64_t i) -> const uint16_t* {
    const int64_t pos = i / cpr, c = i - pos * cpr;
    const int slot = sorted ? __ldg(sorted + pos) : int(pos);
    if (slot < 0 || slot >= num_slots) return nullptr;
    return x + int64_t(slot / x_div) * H + c * 64;
  };
  if constexpr (kVec) {
    __shared__ uint32_t stage[kKpermThreads / 32][4 * kKpermPitch];
    const int lane = threadIdx.x & 31, ch = lane >> 3, u = lane & 7;
    uint32_t* sw = stage[threadIdx.x >> 5];
    const int64_t warps = int64_t(gridDim.x) * (kKpermThreads / 32);
    for (int64_t w0 = (blockIdx.x * int64_t(kKpermThreads) + threadIdx.x) / 32; w0 * 4 < n_chunks; w0 += warps) {
      const int64_t i = w0 * 4 + ch;
      const uint16_t* src = i < n_chunks ? source(i) : nullptr;
      if (src) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(src) + u);
        *reinterpret_cast<uint4*>(sw + ch * kKpermPitch + 4 * u) = v;
      }
      __syncwarp();
      if (src) {
        const uint32_t* c = sw + ch * kKpermPitch + u;
        reinterpret_cast<uint4*>(y + i * 64)[u] = make_uint4(c[0], c[8], c[16], c[24]);
      }
      __syncwarp();  // the staging words are read before the next round writes them
    }
  } else {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n_chunks; i += int64_t(gridDim.x) * blockDim.x) {
      const uint16_t* src = source(i);
      if (!src) continue;
      uint16_t* dst = y + i * 64;
      for (int k = 0; k < 64; ++k) {
        const int rp = k >> 1;
        dst[2 * (4 * (rp & 7) + (rp >> 3)) + (k & 1)] = src[k];
      }
    }
  }
}

// The top-k sum (launch_slot_sum_out). A programmatic dependent of the layer's GEMM2: launched
// while GEMM2 still runs, it waits (griddepcontrol.wait: GEMM2's completion and memory flush) before
// its first global access. Every thread waits, so the grid completes only after GEMM2 did.
// The order of additions, the same at every M: partial q (q < 8) adds rows q, q + 8, ... in turn;
// the result is ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)). LANES = 8: one lane per partial
// (all loads in flight at once: a few tokens' call is a latency chain), added by a butterfly of
// shuffles (a + b == b + a: both lanes of a pair hold the same sum); LANES = 1: one thread per
// 8-element piece, the same additions in registers (many tokens: an eighth of the instructions).
constexpr int kSumParts = 8;
template <class T>
__device__ __forceinline__ void add8(float (&s)[8], const uint4& v) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] += float(e[i]);
}
template <class T, int LANES, class O>
__global__ void slot_sum_kernel(const uint4* __restrict__ part, int splits, int64_t M, int k2, int H8, int64_t plane8,
                                uint4* __restrict__ out) {
  pdl_wait();
  const int q = threadIdx.x % LANES, n = k2 * splits;
  const int h = int((blockIdx.x * blockDim.x + threadIdx.x) / LANES);  // this thread's piece of a row
  if (int((blockIdx.x * blockDim.x + (threadIdx.x & ~31u)) / LANES) >= H8) return;  // the whole warp
  for (int64_t t = blockIdx.y; t < M; t += gridDim.y) {  // warp-uniform (the shuffles need every lane)
    float s[kSumParts / LANES][8] = {};
    if (h < H8) {
      const uint4* rows = part + t * k2 * H8 + h;
      auto row = [&](int r) {  // row r = slot j, split sp
        const int j = splits == 1 ? r : r / splits, sp = r - j * splits;
        return __ldcs(rows + sp * plane8 + int64_t(j) * H8);
      };
      if constexpr (LANES == kSumParts) {
#pragma unroll 4
        for (int r = q; r < n; r += kSumParts) add8<T>(s[0], row(r));
      } else {
        for (int r0 = 0; r0 < n; r0 += kSumParts)
#pragma unroll
          for (int p = 0; p < kSumParts; ++p)
            if (r0 + p < n) add8<T>(s[p], row(r0 + p));
      }
    }
    float v[8];
    if constexpr (LANES == kSumParts) {
#pragma unroll
      for (int m = kSumParts / 2; m > 0; m >>= 1)
#pragma unroll
        for (int i = 0; i < 8; ++i) s[0][i] += __shfl_xor_sync(0xffffffffu, s[0][i], m);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = s[0][i];
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = ((s[0][i] + s[4][i]) + (s[2][i] + s[6][i])) + ((s[1][i] + s[5][i]) + (s[3][i] + s[7][i]));
    }
    if (h < H8 && q == 0) {
      if constexpr (std::is_same_v<O, float>) {  // fp32 out (forward_f32): two 16-byte stores
        out[2 * (t * H8 + h)] = make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
        out[2 * (t * H8 + h) + 1] = make_uint4(__float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]), __float_as_uint(v[7]));
      } else {
        uint4 o;
        T* e = reinterpret_cast<T*>(&o);
#pragma unroll
        for (int i = 0; i < 8; ++i) e[i] = T(v[i]);
        out[t * H8 + h] = o;
      }
    }
  }
}

int grid_for(int64_t n, int threads) {
  return int(std::clamp<int64_t>((n + threads - 1) / threads, 1, 4096));
}

}  // namespace

void launch_kperm_positions(const void* x, int64_t H, const int32_t* sorted_ids, const int32_t* ntpp,
                            int64_t num_slots, int x_div, int64_t rows, void* y, Stream stream) {
  if (H <= 0 || H % 64 != 0) throw Error("kperm: H=" + std::to_string(H) + " is not a positive multiple of 64");
  if (reinterpret_cast<uintptr_t>(y) % 16 != 0) throw Error("kperm: the output is not 16-byte aligned");
  if (num_slots < 0 || num_slots >= (int64_t(1) << 31) || x_div < 1 || rows < 0)
    throw Error("kperm: num_slots=" + std::to_string(num_slots) + ", x_div=" + std::to_string(x_div) + " or rows=" +
                std::to_string(rows) + " is out of range");
  if (rows == 0 || num_slots == 0) return;
  if (!x || !y || (sorted_ids && !ntpp)) throw Error("kperm: a required device pointer is null");
  const int threads = kKpermThreads;
  auto s = static_cast<cudaStream_t>(stream);
  const auto* xs = static_cast<const uint16_t*>(x);
  auto* ys = static_cast<uint16_t*>(y);
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0)  // a warp per 4 chunks
    kperm_positions_kernel<true><<<grid_for((rows * (H / 64) + 3) / 4 * 32, threads), threads, 0, s>>>(
        xs, H, sorted_ids, ntpp, int(num_slots), x_div, rows, ys);
  else
    kperm_positions_kernel<false><<<grid_for(rows * (H / 64), threads), threads, 0, s>>>(
        xs, H, sorted_ids, ntpp, int(num_slots), x_div, rows, ys);
  WNA16_CUDA_CHECK_LAUNCH();
}

void launch_gather_slots(const void* x, int64_t M, int64_t H, const int32_t* ids, int k2, const int32_t* perm,
                         int n_perm, void* out, bool kperm, Stream stream, int j_begin, int j_end) {
  if (j_end < 0) j_end = k2;
  if (M < 0 || H < 1 || k2 < 1 || n_perm < 1)
    throw Error("gather: M=" + std::to_string(M) + ", H=" + std::to_string(H) + ", k2=" + std::to_string(k2) +
                " or n_perm=" + std::to_string(n_perm) + " is out of range");
  if (j_begin < 0 || j_end > k2 || j_begin >= j_end)
    throw Error("gather: slots [" + std::to_string(j_begin) + ", " + std::to_string(j_end) + ") of each token's k2=" +
                std::to_string(k2) + " are empty or out of range");
  if (!ids && j_end - j_begin > n_perm)
    throw Error("gather: without ids, slots [" + std::to_string(j_begin) + ", " + std::to_string(j_end) +
                ") take experts 0.." + std::to_string(j_end - j_begin - 1) + ", beyond n_perm=" + std::to_string(n_perm));
  if (kperm && H % 64 != 0) throw Error("gather: k-permuted rows need H (" + std::to_string(H) + ") a multiple of 64");
  if (H > 0x7fffffff) throw Error("gather: H=" + std::to_string(H) + " exceeds the perm's 32-bit indices");
  const int64_t slots = M * (j_end - j_begin);
  if (slots > 0x7fffffff) throw Error("gather: " + std::to_string(slots) + " slots exceed the grid");
  if (slots == 0) return;
  if (!x || !perm || !out) throw Error("gather: a null pointer among x, perm, out");
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(slots), unsigned((H + kGatherPiece - 1) / kGatherPiece));
  cfg.blockDim = dim3(kGatherThreads);
  cfg.stream = static_cast<cudaStream_t>(stream);
  cfg.attrs = attr;
  cfg.numAttrs = portable_path() ? 0 : 1;  // programmatic dependent launch: the Hopper path
  const auto* xs = static_cast<const uint16_t*>(x);
  auto* os = static_cast<uint16_t*>(out);
  if (kperm)
    WNA16_CUDA_CHECK(cudaLaunchKernelEx(&cfg, gather_slots_kernel<true>, xs, H, ids, k2, j_begin, j_end, n_perm, perm, os));
  else
    WNA16_CUDA_CHECK(cudaLaunchKernelEx(&cfg, gather_slots_kernel<false>, xs, H, ids, k2, j_begin, j_end, n_perm, perm, os));
}

void launch_slot_sum_out(const void* part, int splits, int64_t M, int k2, int64_t H, void* out, DType act,
                         Stream stream, bool out_f32) {
  if (H <= 0 || H % 8 != 0 || splits < 1 || k2 < 1 || M < 0)
    throw Error("top-k sum: H=" + std::to_string(H) + " (a positive multiple of 8), splits=" + std::to_string(splits) +
                ", k2=" + std::to_string(k2) + " or M=" + std::to_string(M) + " is out of range");
  if (reinterpret_cast<uintptr_t>(part) % 16 != 0 || reinterpret_cast<uintptr_t>(out) % 16 != 0)
    throw Error("top-k sum: the rows or the output are not 16-byte aligned");
  if (M == 0) return;
  if (H / 8 >= (int64_t(1) << 28)) throw Error("top-k sum: H=" + std::to_string(H) + " is too large");
  const int threads = 256;
  const int64_t H8 = H / 8;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  // Eight lanes per piece while the pieces are few (a latency chain), one from kSumOneLane pieces
  // on (an eighth of the instructions); the same bits either way. x: the lanes of one token's row;
  // y: tokens.
  constexpr int64_t kSumOneLane = 16384;
  const int lanes = M * H8 >= kSumOneLane ? 1 : kSumParts;
  const int64_t gx = (H8 * lanes + threads - 1) / threads;
  cfg.gridDim = dim3(unsigned(gx), unsigned(std::clamp<int64_t>(M, 1, std::max<int64_t>(1, 16384 / gx))));
  cfg.blockDim = dim3(threads);
  cfg.stream = static_cast<cudaStream_t>(stream);
  cfg.attrs = attr;
  cfg.numAttrs = portable_path() ? 0 : 1;  // programmatic dependent launch: the Hopper path
  const auto* p = static_cast<const uint4*>(part);
  auto* o = static_cast<uint4*>(out);
  const int64_t plane8 = M * k2 * H8;  // one split's rows
  auto launch = [&](auto kernel) {
    WNA16_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, splits, M, k2, int(H8), plane8, o));
  };
  auto by_out = [&](auto t) {
    using T = decltype(t);
    if (out_f32) {
      if (lanes == 1) launch(slot_sum_kernel<T, 1, float>);
      else launch(slot_sum_kernel<T, kSumParts, float>);
    } else {
      if (lanes == 1) launch(slot_sum_kernel<T, 1, T>);
      else launch(slot_sum_kernel<T, kSumParts, T>);
    }
  };
  if (act == DType::BF16) by_out(__nv_bfloat16{});
  else by_out(__half{});
}

namespace {
template <class T>
__global__ void cast_f32_kernel(const float4* __restrict__ in, int64_t n4, uint2* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 v = in[i];
    uint2 o;
    T* e = reinterpret_cast<T*>(&o);
    e[0] = T(v.x), e[1] = T(v.y), e[2] = T(v.z), e[3] = T(v.w);
    out[i] = o;
  }
}
}  // namespace

void cast_f32_to(const float* in, void* out, int64_t n, DType act, Stream stream) {
  if (act != DType::BF16 && act != DType::F16)
    throw Error(std::string("cast_f32_to: dtype ") + dtype_name(act) + " is not f16 or bf16");
  if (n < 0 || n % 4 != 0) throw Error("cast_f32_to: n=" + std::to_string(n) + " is not a multiple of 4");
  if (reinterpret_cast<uintptr_t>(in) % 16 != 0 || reinterpret_cast<uintptr_t>(out) % 8 != 0)
    throw Error("cast_f32_to: in is not 16-byte or out not 8-byte aligned");
  if (n == 0) return;
  const int threads = 256;
  const int grid = grid_for(n / 4, threads);
  auto s = static_cast<cudaStream_t>(stream);
  const auto* i4 = reinterpret_cast<const float4*>(in);
  auto* o2 = static_cast<uint2*>(out);
  if (act == DType::BF16) cast_f32_kernel<__nv_bfloat16><<<grid, threads, 0, s>>>(i4, n / 4, o2);
  else cast_f32_kernel<__half><<<grid, threads, 0, s>>>(i4, n / 4, o2);
  WNA16_CUDA_CHECK_LAUNCH();
}

}  // namespace wna16::cuda
