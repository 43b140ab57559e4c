// The fused grouped W4A16 / W8A16 MoE GEMM (device code + templated launcher). One launch covers
// every expert: work items are (m-block of the align output, n-block, k-split); a persistent grid
// walks them, and the number of m-blocks is read on the device from num_tokens_post_padded, so
// blocks past the padded count never start work and the launch is capturable in a CUDA graph.
// Weight layout and operand roles: see moe_gemm.h. Instantiated per bit width in
// sm90_wna16_moe_gemm_w{4,8}.cu.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/sm90_wna16_moe_common.cuh"

namespace wna16::cuda::gemm {

template <class CFG, int BITS>
struct Smem {
  static constexpr int U = BITS / 4;  // 16-byte words per lane per chunk
  static constexpr int kXRow = 9;     // 16-byte units per token row: 8 + 1 pad (no bank conflicts)
  static constexpr int kWBytes = CFG::NTB * U * 32 * 16;
  static constexpr int kXBytes = CFG::BLOCK_M * kXRow * 16;
  static constexpr int kMetaBytes = CFG::NTB * 32 * 4;
  static constexpr int stage_bytes(int xcopies) { return kWBytes + xcopies * kXBytes + 2 * kMetaBytes; }
  static constexpr int bytes(int xcopies) { return CFG::STAGES * stage_bytes(xcopies); }
};

template <class CFG, class T, int BITS>
__global__ void __launch_bounds__(CFG::THREADS) wna16_moe_gemm_kernel(const KParams p) {
  using S = Smem<CFG, BITS>;
  constexpr int U = S::U, BM = CFG::BLOCK_M, NTB = CFG::NTB, WN = CFG::WN, WM = CFG::WM;
  constexpr int STAGES = CFG::STAGES, THREADS = CFG::THREADS;
  // int8 codes do not fit bf16's magic-number trick: that pair always scales per weight.
  constexpr bool kCanDefer = CFG::DEFER && !(BITS == 8 && std::is_same_v<T, __nv_bfloat16>);
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int s_src[BM];   // x row feeding each token column; -1: padding
  __shared__ int s_slot[BM];  // slot (token * topk + choice) of each column; -1: padding
  __shared__ float s_wt[BM];  // weighted sum: routing weight of each column

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tig = lane & 3;
  const int xcopies = p.perm_up != nullptr ? 2 : 1;
  const int stage_bytes = S::stage_bytes(xcopies);
  const bool defer = kCanDefer && p.defer_ok;
  const int num_mb = p.mb_count >= 0 ? p.mb_count : (__ldg(p.ntpp) / BM);
  const int nb_count = p.NT / NTB;
  const int64_t total = int64_t(num_mb) * nb_count * p.splits;
  const T* x = static_cast<const T*>(p.x);

  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const WorkItem it = decode_item(p, item, nb_count);
    const int split = it.split, nb = it.nb, mb = it.mb, expert = it.expert;
    __syncthreads();  // the previous item is done with s_src / s_slot and every stage buffer
    const int nvalid = fill_row_tables<BM>(p, mb, tid, s_slot, s_src, s_wt);
    if (expert < 0 || nvalid == 0) continue;  // uniform across the block
    const int nact = (nvalid + 7) / 8;        // 8-token MMA columns holding at least one token
    const int kc0 = split * p.kc_per_split;
    const int kc_end = min(p.KC, kc0 + p.kc_per_split);
    const int nk = kc_end - kc0;
    if (nk <= 0) continue;

    const uint4* wexp = p.qweight + int64_t(expert) * p.qw_stride + int64_t(nb) * NTB * U * 32;
    const int64_t wstride = int64_t(p.NT) * U * 32;  // uint4 per k-chunk
    const int mstride = p.NT * 8;                    // meta words per group
    const int64_t meta_base = int64_t(expert) * p.meta_stride + int64_t(nb) * NTB * 8;
    const int32_t* perm_e = p.perm ? p.perm + int64_t(expert) * p.K : nullptr;
    const int32_t* perm_up_e = p.perm_up ? p.perm_up + int64_t(expert) * p.K : nullptr;
    // Deferred mode flushes (and needs the scales of) the last chunk of each group and of the split.
    auto group_ends = [&](int kc) {
      if (kc + 1 == kc_end) return true;
      if (p.G == 1) return kc + 1 == p.KC;
      return p.cpg_shift >= 0 ? ((kc + 1) & ((1 << p.cpg_shift) - 1)) == 0 : (kc + 1) % p.chunks_per_group == 0;
    };
    // Per-thread load state, computed once per item so a stage costs a few adds per copy: the
    // x rows this thread copies (row base + its 16-byte unit; null: padding row) and the
    // offsets of its scale/zero entries.
    constexpr int NW = (NTB * U * 32 + THREADS - 1) / THREADS;
    constexpr int NXE = (BM * 8 + THREADS - 1) / THREADS;
    constexpr int NME = (NTB * 32 + THREADS - 1) / THREADS;
    // NOTE: 32-bit element offsets (the launcher checks that they fit) keep the register count
    // of the 64-token config below its spill point.
    int xoff[NXE];  // x element offset of this thread's row and unit, -1: padding row
#pragma unroll
    for (int e = 0; e < NXE; ++e) {
      const int i = tid + e * THREADS;
      const int r = i >> 3;
      xoff[e] = (i < BM * 8 && r < nvalid) ? s_src[r] * int(p.x_stride) + (i & 7) * 8 : -1;
    }
    int moff[NME];  // meta word offset of this thread's entries (group 0)
#pragma unroll
    for (int e = 0; e < NME; ++e) {
      const int i = tid + e * THREADS, ntl = i >> 5, ln = i & 31;
      moff[e] = int(meta_base) + ntl * 8 + (ln >> 2);
    }

    auto load_stage = [&](int kc, int st) {
      unsigned char* sb = smem + st * stage_bytes;
      uint4* sw = reinterpret_cast<uint4*>(sb);
      // Weights: for one k-chunk the block's NTB tiles are contiguous in memory.
      const uint4* wsrc = wexp + int64_t(kc) * wstride;
#pragma unroll
      for (int e = 0; e < NW; ++e) {
        const int i = tid + e * THREADS;
        if ((NTB * U * 32) % THREADS == 0 || i < NTB * U * 32) cp_async16(sw + i, wsrc + i);
      }
      // Activations: the valid rows of BM x 64 k (eight 16-byte units). Padding rows are not
      // loaded: they only feed MMA columns whose results are discarded.
      uint4* sx = reinterpret_cast<uint4*>(sb + S::kWBytes);
#pragma unroll
      for (int e = 0; e < NXE; ++e) {
        if (xoff[e] < 0) continue;
        const int i = tid + e * THREADS;
        const int dst = (i >> 3) * S::kXRow + (i & 7);
        if (perm_e == nullptr) {
          cp_async16(sx + dst, x + xoff[e] + kc * 64);
        } else {
          // Act-order: gather the channels in sorted-g_idx order (synchronous; the stage being
          // written is not read until after the next barrier). Up tiles may have their own order.
          const int k = kc * 64 + (i & 7) * 8;
          const unsigned short* xr = reinterpret_cast<const unsigned short*>(x + xoff[e] - (i & 7) * 8);
          for (int c = 0; c < xcopies; ++c) {
            const int32_t* pm = (c == 0 ? perm_e : perm_up_e) + k;
            uint32_t v[4] = {0u, 0u, 0u, 0u};
#pragma unroll
            for (int q = 0; q < 8; ++q) v[q >> 1] |= uint32_t(__ldg(xr + __ldg(pm + q))) << (16 * (q & 1));
            sx[c * BM * S::kXRow + dst] = make_uint4(v[0], v[1], v[2], v[3]);
          }
        }
      }
      // Scales (and zeros) of each lane's group for this chunk: lane tig covers k in
      // [64*kc + 16*tig, +16), always inside one group (group_len is a multiple of 16).
      if (!defer || group_ends(kc)) {
        uint32_t* ss = reinterpret_cast<uint32_t*>(sb + S::kWBytes + xcopies * S::kXBytes);
        uint32_t* sz = ss + NTB * 32;
        const int grp0 = p.G == 1 ? 0 : (p.cpg_shift >= 0 ? kc >> p.cpg_shift : kc / p.chunks_per_group);
#pragma unroll
        for (int e = 0; e < NME; ++e) {
          const int i = tid + e * THREADS;
          if ((NTB * 32) % THREADS != 0 && i >= NTB * 32) continue;
          int grp = grp0;
          if (!defer) {
            const int k = kc * 64 + ((tid + e * THREADS) & 3) * 16;
            grp = p.G == 1 ? 0 : (p.group_shift >= 0 ? k >> p.group_shift : k / p.group_len);
          }
          const int off = moff[e] + grp * mstride;
          cp_async4(ss + i, p.scales + off);
          if (p.zeros) cp_async4(sz + i, p.zeros + off);
        }
      }
    };

    float acc[WN][WM][4];
#pragma unroll
    for (int i = 0; i < WN; ++i)
#pragma unroll
      for (int t = 0; t < WM; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][t][e] = 0.0f;
    // Deferred mode: this group's raw partial sums and the tokens' row sums (per activation copy).
    // NOTE: two named row-sum arrays (not xs[copy]) keep every index a compile-time constant:
    // the copy is a run-time value, and a run-time index would move the array to local memory.
    float tmp[kCanDefer ? WN : 1][kCanDefer ? WM : 1][4];
    float xs0[kCanDefer ? WM : 1][2], xs1[kCanDefer ? WM : 1][2];
    if constexpr (kCanDefer) {
#pragma unroll
      for (int i = 0; i < WN; ++i)
#pragma unroll
        for (int t = 0; t < WM; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) tmp[i][t][e] = 0.0f;
#pragma unroll
      for (int t = 0; t < WM; ++t) xs0[t][0] = xs0[t][1] = xs1[t][0] = xs1[t][1] = 0.0f;
    }

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < nk) load_stage(kc0 + s, s);
      cp_async_commit();
    }

    for (int kt = 0; kt < nk; ++kt) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // stage kt visible to all; everyone is past stage kt-1 (its buffer is reused)
      {
        const int nx = kt + STAGES - 1;
        if (nx < nk) load_stage(kc0 + nx, nx % STAGES);
        cp_async_commit();
      }
      const unsigned char* sb = smem + (kt % STAGES) * stage_bytes;
      const uint4* sw = reinterpret_cast<const uint4*>(sb);
      const uint4* sx = reinterpret_cast<const uint4*>(sb + S::kWBytes);
      const uint32_t* ss = reinterpret_cast<const uint32_t*>(sb + S::kWBytes + xcopies * S::kXBytes);
      const uint32_t* sz = ss + NTB * 32;

      uint32_t wq[WN][4 * U];
#pragma unroll
      for (int i = 0; i < WN; ++i) {
        const int ntl = warp * WN + i;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const uint4 v = sw[(ntl * U + u) * 32 + lane];
          put_words(&wq[i][4 * u], v);
        }
      }

      if (kCanDefer && defer) {
        if constexpr (kCanDefer) {
          const uint32_t one = ones2<T>();
          const uint32_t ones[4] = {one, one, one, one};
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            // B operand: token row (t*8 + g), 16-byte unit (2*tig + h) = real k 16*tig + 8*h .. +8,
            // i.e. MMA k-steps 2h (words 0,1) and 2h+1 (words 2,3).
            uint4 xb[WM];
#pragma unroll
            for (int i = 0; i < WN; ++i) {
              const int c = (xcopies == 2 && (i & 1)) ? 1 : 0;
              if (i == 0 || xcopies == 2) {
#pragma unroll
                for (int t = 0; t < WM; ++t)
                  if (WM == 1 || t < nact) xb[t] = sx[c * BM * S::kXRow + (t * 8 + g) * S::kXRow + 2 * tig + h];
                if (i < 2) {  // row sums of this copy (the zero-point correction); i == 1: up copy
#pragma unroll
                  for (int t = 0; t < WM; ++t)
                    if (WM == 1 || t < nact) {
                      float(&xr)[2] = i == 0 ? xs0[t] : xs1[t];
                      float d[4] = {xr[0], xr[1], 0.f, 0.f};
                      Act<T>::mma(d, ones, xb[t].x, xb[t].y);
                      Act<T>::mma(d, ones, xb[t].z, xb[t].w);
                      xr[0] = d[0];
                      xr[1] = d[1];
                    }
                }
              }
#pragma unroll
              for (int jj = 0; jj < 2; ++jj) {
                uint32_t a[4];
                raw_codes<T, BITS>(wq[i], 2 * h + jj, a);
#pragma unroll
                for (int t = 0; t < WM; ++t)
                  if (WM == 1 || t < nact) Act<T>::mma(tmp[i][t], a, jj ? xb[t].z : xb[t].x, jj ? xb[t].w : xb[t].y);
              }
            }
          }
          if (group_ends(kc0 + kt)) {
            // acc += s * (sum (magic + q) x - (magic + z) * sum x) = s * sum (q - z) x, per row.
#pragma unroll
            for (int i = 0; i < WN; ++i) {
              const int ntl = warp * WN + i;
              const bool up_copy = xcopies == 2 && (i & 1);
              const uint32_t sw32 = ss[ntl * 32 + lane];
              const uint32_t zw = p.zeros ? sz[ntl * 32 + lane] : p.default_zero;
              const float s_lo = f16_lo(sw32), s_hi = f16_hi(sw32);
              const float zc_lo = magic_value<T>() + float(zw & 0xffffu), zc_hi = magic_value<T>() + float(zw >> 16);
#pragma unroll
              for (int t = 0; t < WM; ++t) {
                const float x0 = up_copy ? xs1[t][0] : xs0[t][0], x1 = up_copy ? xs1[t][1] : xs0[t][1];
                acc[i][t][0] = fmaf(s_lo, fmaf(-zc_lo, x0, tmp[i][t][0]), acc[i][t][0]);
                acc[i][t][1] = fmaf(s_lo, fmaf(-zc_lo, x1, tmp[i][t][1]), acc[i][t][1]);
                acc[i][t][2] = fmaf(s_hi, fmaf(-zc_hi, x0, tmp[i][t][2]), acc[i][t][2]);
                acc[i][t][3] = fmaf(s_hi, fmaf(-zc_hi, x1, tmp[i][t][3]), acc[i][t][3]);
                tmp[i][t][0] = tmp[i][t][1] = tmp[i][t][2] = tmp[i][t][3] = 0.f;
              }
            }
#pragma unroll
            for (int t = 0; t < WM; ++t) xs0[t][0] = xs0[t][1] = xs1[t][0] = xs1[t][1] = 0.f;
          }
        }
      } else {
        TileMeta<T, BITS> meta[WN];
#pragma unroll
        for (int i = 0; i < WN; ++i) {
          const int ntl = warp * WN + i;
          meta[i].load(ss[ntl * 32 + lane], p.zeros ? sz[ntl * 32 + lane] : p.default_zero);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint4 xb[WM];
#pragma unroll
          for (int i = 0; i < WN; ++i) {
            if (i == 0 || xcopies == 2) {
              // Up tiles of GEMM1 with their own act-order read the second activation copy.
              const int c = (xcopies == 2 && (i & 1)) ? 1 : 0;
#pragma unroll
              for (int t = 0; t < WM; ++t)
                if (WM == 1 || t < nact) xb[t] = sx[c * BM * S::kXRow + (t * 8 + g) * S::kXRow + 2 * tig + h];
            }
#pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
              uint32_t a[4];
              dequant<T, BITS>(wq[i], 2 * h + jj, meta[i], a);
#pragma unroll
              for (int t = 0; t < WM; ++t)
                if (WM == 1 || t < nact) Act<T>::mma(acc[i][t], a, jj ? xb[t].z : xb[t].x, jj ? xb[t].w : xb[t].y);
            }
          }
        }
      }
    }
    cp_async_wait<0>();

    // ---- epilogue: C rows are weight rows (g, g+8), columns are tokens (2*tig, 2*tig+1) ----
    if (p.epilogue == 0) {
      // Tiles (2p, 2p+1) = gate, up of intermediate columns 16p + g and 16p + g + 8.
#pragma unroll
      for (int pr = 0; pr < WN / 2; ++pr) {
        const int pair = (nb * NTB + warp * WN) / 2 + pr;
        const int c_lo = pair * 16 + g, c_hi = c_lo + 8;
        if (c_lo >= p.N / 2) continue;
#pragma unroll
        for (int t = 0; t < WM; ++t) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = t * 8 + 2 * tig + e;
            if (t < nact && s_slot[col] >= 0) {
              char* row = static_cast<char*>(p.out) + (int64_t(mb) * BM + col) * p.out_stride * int64_t(sizeof(T));
              Act<T>::store(row + c_lo * sizeof(T), silu(acc[2 * pr][t][e]) * acc[2 * pr + 1][t][e]);
              if (c_hi < p.N / 2)
                Act<T>::store(row + c_hi * sizeof(T), silu(acc[2 * pr][t][2 + e]) * acc[2 * pr + 1][t][2 + e]);
            }
          }
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < WN; ++i) {
        const int n_lo = (nb * NTB + warp * WN + i) * 16 + g;
        if (n_lo >= p.N) continue;
#pragma unroll
        for (int t = 0; t < WM; ++t) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = t * 8 + 2 * tig + e;
            const int slot = t < nact ? s_slot[col] : -1;
            if (slot >= 0) {
              const float w = s_wt[col];
              T* orow = static_cast<T*>(p.out) + (int64_t(split) * p.num_slots + slot) * p.out_stride;  // the slot's row of this split
              Act<T>::store(orow + n_lo, w * acc[i][t][e]);
              Act<T>::store(orow + n_lo + 8, w * acc[i][t][2 + e]);
            }
          }
        }
      }
    }
  }
}

// ---- host side ---------------------------------------------------------------------------------

// Once per instantiation: raise the dynamic shared-memory limit and remember the occupancy for
// one and two activation copies (a persistent grid of exactly the blocks that fit). Done at layer
// construction too, so a first forward() inside a graph capture only launches.
template <class CFG, class T, int BITS>
const int* prepare_config() {
  using S = Smem<CFG, BITS>;
  static int blocks_per_sm[3] = {0, 0, 0};
  static std::once_flag once;
  std::call_once(once, [] {
    auto kern = wna16_moe_gemm_kernel<CFG, T, BITS>;
    const DeviceInfo di = device_info();
    if (S::bytes(1) > di.max_smem_optin)
      throw Error("tile config needs " + std::to_string(S::bytes(1)) + " bytes of shared memory; the device allows " +
                  std::to_string(di.max_smem_optin));
    // Two activation copies (act-order with distinct gate and up orders) where they fit: not on
    // GPUs with 99 KB per block (sm_86 / sm_89) for int8 m64 (the layer's plan takes m32 there,
    // dispatch.cu; launch_config refuses a forced m64).
    const int xmax = S::bytes(2) <= di.max_smem_optin ? 2 : 1;
    WNA16_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, S::bytes(xmax)));
    for (int xc = 1; xc <= xmax; ++xc) {
      int n = 0;
      WNA16_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kern, CFG::THREADS, S::bytes(xc)));
      if (n < 1) throw Error("tile config cannot be resident on this device");
      blocks_per_sm[xc] = n;
    }
  });
  return blocks_per_sm;
}

template <class CFG, class T, int BITS>
void launch_config(const KParams& kp, int64_t upper_mblocks, cudaStream_t stream) {
  using S = Smem<CFG, BITS>;
  const int xcopies = kp.perm_up ? 2 : 1;
  const int bps = prepare_config<CFG, T, BITS>()[xcopies];
  if (bps == 0)
    throw Error("act-order with distinct gate and up channel orders needs " + std::to_string(S::bytes(2)) +
                " bytes of shared memory per block for " + std::to_string(BITS) + "-bit weights; this GPU allows " +
                std::to_string(device_info().max_smem_optin));
  const int64_t nb_count = kp.NT / CFG::NTB;
  const int64_t upper = upper_mblocks * nb_count * kp.splits;
  // Up to 4 waves of resident blocks: one item per block, so the hardware block scheduler balances
  // uneven SMs; beyond that a persistent loop (>= 4 items per block, tail <= 1/4).
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(upper, 4 * int64_t(device_info().sms) * bps));
  wna16_moe_gemm_kernel<CFG, T, BITS><<<dim3(unsigned(grid)), dim3(CFG::THREADS), S::bytes(xcopies), stream>>>(kp);
  WNA16_CUDA_CHECK_LAUNCH();
}

// The decode kernel (sm90_wna16_moe_decode.cuh, included by the instantiating files).
template <class T, int BITS>
int prepare_decode();
template <class T, int BITS>
void launch_decode(const KParams& kp, int64_t upper_mblocks, cudaStream_t stream);

// The wgmma kernel, configs m32w, m64w, m96w and m144w (sm90_wna16_moe_prefill.cuh), explicitly
// instantiated in sm90_wna16_moe_prefill_<config>.cu.
template <class C, class T, int BITS>
int prepare_prefill();
template <class C, class T, int BITS>
void launch_prefill(const KParams& kp, int64_t upper_mblocks, cudaStream_t stream);
#define WNA16_PREFILL_EXTERN(C, T, B)                 \
  extern template int prepare_prefill<C, T, B>();     \
  extern template void launch_prefill<C, T, B>(const KParams&, int64_t, cudaStream_t);
#define WNA16_PREFILL_EXTERN_BITS(C, B) WNA16_PREFILL_EXTERN(C, __half, B) WNA16_PREFILL_EXTERN(C, __nv_bfloat16, B)
WNA16_PREFILL_EXTERN_BITS(CfgM32W, 4)
WNA16_PREFILL_EXTERN_BITS(CfgM32W, 8)
WNA16_PREFILL_EXTERN_BITS(CfgM64W, 4)
WNA16_PREFILL_EXTERN_BITS(CfgM64W, 8)
WNA16_PREFILL_EXTERN_BITS(CfgM96W, 4)
WNA16_PREFILL_EXTERN_BITS(CfgM96W, 8)
WNA16_PREFILL_EXTERN_BITS(CfgM144W, 4)
WNA16_PREFILL_EXTERN_BITS(CfgM144W, 8)
#undef WNA16_PREFILL_EXTERN_BITS
#undef WNA16_PREFILL_EXTERN

// kp == nullptr: only prepare the instantiation. Returns the blocks resident per SM (one copy).
template <int BITS>
int launch_bits(const KParams* kp, int config, DType act, int64_t upper_mblocks, cudaStream_t s) {
  auto by_act = [&](auto cfg) {
    using C = decltype(cfg);
    if (act == DType::BF16) {
      if (kp) launch_config<C, __nv_bfloat16, BITS>(*kp, upper_mblocks, s);
      return prepare_config<C, __nv_bfloat16, BITS>()[1];
    }
    if (kp) launch_config<C, __half, BITS>(*kp, upper_mblocks, s);
    return prepare_config<C, __half, BITS>()[1];
  };
  auto wgmma = [&](auto cfg) {
    // The wgmma kernel (the launcher refuses act-order for it).
    using C = decltype(cfg);
    if (act == DType::BF16) {
      if (kp) launch_prefill<C, __nv_bfloat16, BITS>(*kp, upper_mblocks, s);
      return prepare_prefill<C, __nv_bfloat16, BITS>();
    }
    if (kp) launch_prefill<C, __half, BITS>(*kp, upper_mblocks, s);
    return prepare_prefill<C, __half, BITS>();
  };
  switch (config) {
    case 0:
      // The m8 config runs on the decode kernel unless it needs the act-order gather; prepare
      // both, report the decode kernel's occupancy (the one the split choice is for).
      if (kp && kp->perm) return by_act(CfgM8{});
      if (act == DType::BF16) {
        if (kp) launch_decode<__nv_bfloat16, BITS>(*kp, upper_mblocks, s);
        else by_act(CfgM8{});
        return prepare_decode<__nv_bfloat16, BITS>();
      }
      if (kp) launch_decode<__half, BITS>(*kp, upper_mblocks, s);
      else by_act(CfgM8{});
      return prepare_decode<__half, BITS>();
    case 1: return by_act(CfgM32{});
    case 2: return by_act(CfgM64{});
    case 3: return wgmma(CfgM32W{});
    case 4: return wgmma(CfgM64W{});
    case 5: return wgmma(CfgM96W{});
    default: return wgmma(CfgM144W{});
  }
}

// One translation unit per bit width (compile time: 6 kernels each).
// kp == nullptr: prepare only (shared-memory limit, occupancy).
int launch_w4(const KParams* kp, int config, DType act, int64_t upper_mblocks, cudaStream_t s);
int launch_w8(const KParams* kp, int config, DType act, int64_t upper_mblocks, cudaStream_t s);

}  // namespace wna16::cuda::gemm
