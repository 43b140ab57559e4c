// Packing one kernel-ordered linear into the MMA fragment layout described in moe_gemm.h, on the
// host: the test oracle of the device packer (device_pack.h). Both use moe_gemm_layout.h.
#include <fmt/format.h>

#include "cuda/moe_gemm.h"
#include "cuda/moe_gemm_layout.h"
#include "wna16/error.h"

namespace wna16::cuda {

void PackedGemm::init(int bits_, int64_t E_, int64_t K_, int64_t N_, int64_t group_len_, bool has_zeros_) {
  if (bits_ != 4 && bits_ != 8) throw Error(fmt::format("bits={} is not supported by the CUDA kernels (4 or 8)", bits_));
  if (K_ % kChunkK != 0) throw Error(fmt::format("K={} is not a multiple of {}", K_, kChunkK));
  if (N_ % 16 != 0) throw Error(fmt::format("N={} is not a multiple of 16", N_));
  if (group_len_ % 16 != 0 || K_ % group_len_ != 0)
    throw Error(fmt::format("group length {} must be a multiple of 16 dividing K={}", group_len_, K_));
  bits = bits_;
  E = E_;
  K = K_;
  N = N_;
  NT = (N / 16 + kTilePad - 1) / kTilePad * kTilePad;
  group_len = group_len_;
  G = K / group_len;
  has_zeros = has_zeros_;
  qweight.assign(size_t(E * qweight_words_per_expert()), 0u);
  scales.assign(size_t(E * meta_words_per_expert()), 0u);
  if (has_zeros) zeros.assign(size_t(E * meta_words_per_expert()), 0u);
  else zeros.clear();
}

void pack_kernel_linear(const KernelLinear& lin, int64_t e, PackedGemm& pg) {
  if (lin.K != pg.K || lin.N != pg.NT * 16 || lin.group_len != pg.group_len)
    throw Error(fmt::format("pack_kernel_linear: linear K={} N={} group {} does not match the packed GEMM "
                            "(K={} padded N={} group {})",
                            lin.K, lin.N, lin.group_len, pg.K, pg.NT * 16, pg.group_len));
  const int64_t K = pg.K, Np = pg.NT * 16, NT = pg.NT, G = pg.G;
  const int64_t KC = K / PackedGemm::kChunkK;
  const int U = pg.bits / 4;  // 16-byte words per lane per chunk
  uint32_t* qw = pg.qweight.data() + e * pg.qweight_words_per_expert();
  auto code = [&](int64_t k, int64_t n) -> uint32_t { return lin.q[size_t(k * Np + n)]; };
  for (int64_t kc = 0; kc < KC; ++kc) {
    for (int64_t nt = 0; nt < NT; ++nt) {
      for (int lane = 0; lane < 32; ++lane) {
        uint32_t words[8];
        layout::lane_words(pg.bits, kc, nt, lane, code, words);
        for (int u = 0; u < U; ++u)
          for (int w = 0; w < 4; ++w) qw[layout::qweight_word(kc, nt, u, lane, NT, U) + w] = words[u * 4 + w];
      }
    }
  }
  uint32_t* sc = pg.scales.data() + e * pg.meta_words_per_expert();
  uint32_t* zr = pg.has_zeros ? pg.zeros.data() + e * pg.meta_words_per_expert() : nullptr;
  for (int64_t grp = 0; grp < G; ++grp)
    for (int64_t nt = 0; nt < NT; ++nt)
      for (int g = 0; g < 8; ++g) {
        const int64_t lo = nt * 16 + g, hi = lo + 8;
        const size_t o = size_t(layout::meta_word(grp, nt, g, NT));
        sc[o] = uint32_t(float_to_f16(lin.scales[size_t(grp * Np + lo)])) |
                uint32_t(float_to_f16(lin.scales[size_t(grp * Np + hi)])) << 16;
        if (zr) zr[o] = uint32_t(lin.zeros[size_t(grp * Np + lo)]) | uint32_t(lin.zeros[size_t(grp * Np + hi)]) << 16;
      }
}

}  // namespace wna16::cuda
