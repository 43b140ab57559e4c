// The host packing path (host_pack_oracle.h): the layer's former per-expert repack, one kernel
// expert after another, kept independent of the device packer's plan (its own orders and maps).
#ifdef WNA16_HAVE_CUDA
#include "gpu/host_pack_oracle.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "cuda/device_pack.h"
#include "cuda/pack_plan.h"
#include "wna16/error.h"
#include "wna16/quant.h"

namespace wna16::cuda::host_oracle {
namespace {

std::vector<int32_t> act_order_perm_of(const UnpackedLinear& u) {
  std::vector<int32_t> p(size_t(u.K));
  std::iota(p.begin(), p.end(), 0);
  std::stable_sort(p.begin(), p.end(), [&](int32_t a, int32_t b) { return u.g_idx[size_t(a)] < u.g_idx[size_t(b)]; });
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i] != int32_t(i)) return p;
  return {};
}

UnpackedLinear unpack_named(const QuantizedLinear& q, const std::string& what) {
  try {
    return unpack(q);
  } catch (const Error& e) {
    throw Error(what + ": " + e.what());
  }
}

}  // namespace

HostPackedLayer host_pack_layer(const MoeLayerSpec& spec, const MoeLayerWeights& w) {
  spec.validate();
  w.validate(spec);
  const LayerPackShape p = plan_layer_shape(spec, layer_schemes(w));
  const int64_t H = p.H, I = p.I, gl1 = p.gl1, gl2 = p.gl2;
  const int bits = p.bits, S = p.S, E2 = p.E2;
  const bool has_zeros = p.has_zeros;
  HostPackedLayer out;
  out.g1.init(bits, E2, H, 2 * I, gl1, has_zeros);
  out.g2.init(bits, E2, I, H, gl2, has_zeros);
  std::vector<int32_t> h_perm(size_t(E2 * H)), h_perm_up(size_t(E2 * H));
  bool any_perm = false, any_dual = false;
  const int zsym = 1 << (bits - 1);

  for (int e2 = 0; e2 < E2; ++e2) {
    const bool routed = e2 >= S;
    const ExpertWeights& src = routed ? w.experts[size_t(e2 - S)] : *w.shared;
    const std::string name = routed ? fmt::format("expert {}", e2 - S) : std::string("shared expert");
    const int64_t slice0 = routed ? 0 : int64_t(e2) * I;  // first intermediate column of the slice
    const UnpackedLinear ug = unpack_named(src.gate, name + ".gate"), uu = unpack_named(src.up, name + ".up"),
                         ud = unpack_named(src.down, name + ".down");
    const int64_t Isrc = ug.N;  // I, or shared_inter
    const std::vector<int32_t> pg = act_order_perm_of(ug), pu = act_order_perm_of(uu), pd = act_order_perm_of(ud);
    auto inter_src = [&](int64_t c) -> int64_t {
      const int64_t gc = slice0 + c;
      if (gc >= Isrc) return -1;
      return pd.empty() ? gc : pd[size_t(gc)];
    };
    auto group_of = [&](const UnpackedLinear& u, const std::vector<int32_t>& rowmap, int64_t klen, int64_t gl,
                        const char* what) {
      std::vector<int32_t> grp(size_t(klen / gl), -1);
      for (int64_t kk = 0; kk < klen; ++kk) {
        const int64_t r = rowmap[size_t(kk)];
        if (r < 0) continue;
        int32_t& gk = grp[size_t(kk / gl)];
        const int32_t gsrc = u.g_idx[size_t(r)];
        if (gk < 0) gk = gsrc;
        else if (gk != gsrc)
          throw Error(fmt::format("{} {}: act-order groups are not contiguous runs of {} channels after sorting by "
                                  "g_idx (channel {} is in group {}, expected {})",
                                  name, what, gl, r, gsrc, gk));
      }
      return grp;
    };

    // GEMM1: K = H (sorted per gate / up order), tiles (2p, 2p+1) = gate, up of columns 16p..
    {
      KernelLinear kl;
      kl.K = H;
      kl.N = p.g1.NT * 16;
      kl.group_len = gl1;
      kl.q.assign(size_t(kl.K * kl.N), 0);
      kl.scales.assign(size_t((H / gl1) * kl.N), 0.f);
      kl.zeros.assign(size_t((H / gl1) * kl.N), 0);
      std::vector<int32_t> rows_g(static_cast<size_t>(H)), rows_u(static_cast<size_t>(H));
      for (int64_t kk = 0; kk < H; ++kk) {
        rows_g[size_t(kk)] = pg.empty() ? int32_t(kk) : pg[size_t(kk)];
        rows_u[size_t(kk)] = pu.empty() ? int32_t(kk) : pu[size_t(kk)];
      }
      const std::vector<int32_t> grp_g = group_of(ug, rows_g, H, gl1, "gate");
      const std::vector<int32_t> grp_u = group_of(uu, rows_u, H, gl1, "up");
      std::vector<int64_t> col_src(size_t(2 * I));  // source column of kernel column n, -1: padding
      for (int64_t n = 0; n < 2 * I; ++n) col_src[size_t(n)] = inter_src((n / 32) * 16 + n % 16);
      for (int64_t kk = 0; kk < H; ++kk) {
        const uint8_t* rg = ug.q.data() + rows_g[size_t(kk)] * ug.N;
        const uint8_t* ru = uu.q.data() + rows_u[size_t(kk)] * uu.N;
        uint8_t* dst = kl.q.data() + kk * kl.N;
        for (int64_t n = 0; n < 2 * I; ++n) {
          const int64_t sc = col_src[size_t(n)];
          if (sc >= 0) dst[n] = ((n / 16) % 2 ? ru : rg)[sc];
        }
      }
      for (int64_t n = 0; n < 2 * I; ++n) {
        const bool up = (n / 16) % 2 == 1;
        const int64_t sc = col_src[size_t(n)];
        if (sc < 0) continue;  // padding column: scale 0
        const UnpackedLinear& u = up ? uu : ug;
        const std::vector<int32_t>& grp = up ? grp_u : grp_g;
        for (int64_t kg = 0; kg < H / gl1; ++kg) {
          kl.scales[size_t(kg * kl.N + n)] = u.scales[size_t(grp[size_t(kg)] * u.N + sc)];
          kl.zeros[size_t(kg * kl.N + n)] = u.zeros[size_t(grp[size_t(kg)] * u.N + sc)];
        }
      }
      pack_kernel_linear(kl, e2, out.g1);
      std::copy(rows_g.begin(), rows_g.end(), h_perm.begin() + e2 * H);
      std::copy(rows_u.begin(), rows_u.end(), h_perm_up.begin() + e2 * H);
      if (!pg.empty() || !pu.empty()) any_perm = true;
      if (rows_g != rows_u) any_dual = true;
    }
    // GEMM2: K = I (this slice of down's sorted rows), N = H
    {
      KernelLinear kl;
      kl.K = I;
      kl.N = p.g2.NT * 16;
      kl.group_len = gl2;
      kl.q.assign(size_t(kl.K * kl.N), 0);
      kl.scales.assign(size_t((I / gl2) * kl.N), 0.f);
      kl.zeros.assign(size_t((I / gl2) * kl.N), 0);
      std::vector<int32_t> rows(static_cast<size_t>(I));
      for (int64_t c = 0; c < I; ++c) rows[size_t(c)] = int32_t(inter_src(c));
      const std::vector<int32_t> grp = group_of(ud, rows, I, gl2, "down");
      for (int64_t kg = 0; kg < I / gl2; ++kg) {
        if (grp[size_t(kg)] < 0) continue;  // a group of padding rows only: scale 0
        for (int64_t n = 0; n < H; ++n) {
          kl.scales[size_t(kg * kl.N + n)] = ud.scales[size_t(grp[size_t(kg)] * H + n)];
          kl.zeros[size_t(kg * kl.N + n)] = ud.zeros[size_t(grp[size_t(kg)] * H + n)];
        }
      }
      for (int64_t c = 0; c < I; ++c) {
        const int64_t r = rows[size_t(c)];
        uint8_t* dst = kl.q.data() + c * kl.N;
        if (r >= 0) {
          std::memcpy(dst, ud.q.data() + r * H, size_t(H));
        } else {
          const int64_t kg = c / gl2;  // padding row: code = zero point where it fits
          for (int64_t n = 0; n < H; ++n) {
            const int32_t z = has_zeros ? kl.zeros[size_t(kg * kl.N + n)] : zsym;
            dst[n] = uint8_t(z < (1 << bits) ? z : 0);
          }
        }
      }
      pack_kernel_linear(kl, e2, out.g2);
    }
  }
  if (any_perm) out.g1.perm = h_perm;
  if (any_dual) out.g1.perm_up = h_perm_up;
  return out;
}

}  // namespace wna16::cuda::host_oracle
#endif
