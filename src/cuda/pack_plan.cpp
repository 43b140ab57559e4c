// Host-side packing decisions (pack_plan.h).
#include "cuda/pack_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <optional>

#include "wna16/error.h"

namespace wna16::cuda {

LayerPackShape plan_layer_shape(const MoeLayerSpec& s,
                                const std::vector<std::pair<std::string, QuantScheme>>& schemes) {
  LayerPackShape p;
  p.H = s.hidden;
  p.I = s.inter;
  p.E = s.routing.num_experts;
  const bool has_shared = s.shared_kind != SharedExpertKind::None;
  p.shared_inter = has_shared ? s.shared_inter : 0;
  p.S = has_shared ? int((s.shared_inter + p.I - 1) / p.I) : 0;
  p.E2 = p.E + p.S;
  if (p.E2 > 1024)
    throw Error(fmt::format("E={} experts plus {} shared slices is above the supported 1024", p.E, p.S));
  if (p.H % 64 != 0) throw Error(fmt::format("hidden H={} is not a multiple of 64 (the kernel's k chunk)", p.H));
  if (p.I % 64 != 0) throw Error(fmt::format("expert width I={} is not a multiple of 64 (the kernel's k chunk)", p.I));
  if (schemes.empty()) throw Error("the layer has no quantized linears");
  // One bit width for every linear (the kernels are compiled per bit width) and one group length
  // per GEMM: gate/up share GEMM1's, down has GEMM2's. They may differ: a tensor-parallel shard
  // whose down rows were cut inside a group has shorter down groups (slice_group_len, parallel.h).
  const QuantScheme& sch = schemes.front().second;
  p.bits = sch.bits;
  if (p.bits != 4 && p.bits != 8)
    throw Error(fmt::format("bits={} is not supported by the CUDA backend (4 or 8)", p.bits));
  const auto is_down = [](const std::string& what) { return what.size() >= 4 && what.compare(what.size() - 4, 4, "down") == 0; };
  std::optional<int> gs_of[2];  // [0]: gate/up (GEMM1), [1]: down (GEMM2)
  for (const auto& [what, q] : schemes) {
    if (q.bits != p.bits)
      throw Error(fmt::format("{}: bits={} differs from the layer's bits={}", what, q.bits, p.bits));
    const int gemm = is_down(what) ? 1 : 0;
    if (!gs_of[gemm]) gs_of[gemm] = q.group_size;
    if (q.group_size != *gs_of[gemm])
      throw Error(fmt::format("{}: group_size={} differs from the layer's {} group_size={}", what, q.group_size,
                              gemm ? "down" : "gate/up", *gs_of[gemm]));
    if (!q.sym) p.has_zeros = true;
  }
  for (int gemm = 0; gemm < 2; ++gemm) {
    const int gs = gs_of[gemm].value_or(-1);
    if (gs != -1 && (gs % 16 != 0))
      throw Error(fmt::format("{} group_size={} is not supported (a multiple of 16, or -1)", gemm ? "down" : "gate/up", gs));
  }
  const int gs1 = gs_of[0].value_or(-1), gs2 = gs_of[1].value_or(-1);
  if (gs1 != -1 && p.H % gs1 != 0)
    throw Error(fmt::format("hidden H={} is not a multiple of the gate/up group_size={}", p.H, gs1));
  if (gs2 != -1 && p.I % gs2 != 0)
    throw Error(fmt::format("expert width I={} is not a multiple of group_size={}", p.I, gs2));
  p.gl1 = gs1 == -1 ? p.H : gs1;
  p.gl2 = gs2 == -1 ? p.I : gs2;
  p.g1.init(p.bits, 0, p.H, 2 * p.I, p.gl1, p.has_zeros);
  p.g2.init(p.bits, 0, p.I, p.H, p.gl2, p.has_zeros);
  return p;
}

std::vector<int32_t> act_order_perm(const std::vector<int32_t>& g_idx) {
  // A non-decreasing g_idx (every checkpoint without act-order) sorts to the identity.
  if (std::is_sorted(g_idx.begin(), g_idx.end())) return {};
  std::vector<int32_t> p(g_idx.size());
  std::iota(p.begin(), p.end(), 0);
  std::stable_sort(p.begin(), p.end(), [&](int32_t a, int32_t b) { return g_idx[size_t(a)] < g_idx[size_t(b)]; });
  return p;
}

std::vector<int32_t> checked_g_idx(const int32_t* raw, int64_t K, const QuantScheme& s, const std::string& what) {
  const int64_t G = s.num_groups(K), len = s.group_len(K);
  std::vector<int32_t> g(static_cast<size_t>(K));
  if (!raw) {
    for (int64_t k = 0; k < K; ++k) g[size_t(k)] = int32_t(k / len);
    return g;
  }
  for (int64_t k = 0; k < K; ++k) {
    if (raw[k] < 0 || raw[k] >= G)
      throw Error(fmt::format("{}: g_idx[{}]={} is out of range [0, {})", what, k, raw[k], G));
    g[size_t(k)] = raw[k];
  }
  if (!s.act_order)
    for (int64_t k = 0; k < K; ++k)
      if (g[size_t(k)] != int32_t(k / len))
        throw Error(fmt::format("{}: g_idx[{}]={} but scheme {} is not act-order (expected {})", what, k,
                                g[size_t(k)], s.describe(), k / len));
  return g;
}

namespace {

// Kernel group kg of a kernel linear gathers source rows whose g_idx must all agree; returns the
// source group of each kernel group (-1: padding rows only).
std::vector<int32_t> group_of(const std::vector<int32_t>& g_idx, const std::vector<int32_t>& rowmap, int64_t klen,
                              int64_t gl, const std::string& name, const char* what) {
  std::vector<int32_t> grp(size_t(klen / gl), -1);
  for (int64_t kk = 0; kk < klen; ++kk) {
    const int64_t r = rowmap[size_t(kk)];
    if (r < 0) continue;
    int32_t& gk = grp[size_t(kk / gl)];
    const int32_t gsrc = g_idx[size_t(r)];
    if (gk < 0) gk = gsrc;
    else if (gk != gsrc)
      throw Error(fmt::format("{} {}: act-order groups are not contiguous runs of {} channels after sorting by "
                              "g_idx (channel {} is in group {}, expected {})",
                              name, what, gl, r, gsrc, gk));
  }
  return grp;
}

}  // namespace

KernelExpertMap map_kernel_expert(const SourceExpertOrder& src, const LayerPackShape& p, int64_t slice0, int64_t Isrc,
                                  const std::string& name) {
  KernelExpertMap m;
  const int64_t H = p.H, I = p.I;
  m.rows_g.resize(size_t(H));
  m.rows_u.resize(size_t(H));
  const std::vector<int32_t>&pg = src.perm[0], &pu = src.perm[1], &pd = src.perm[2];
  for (int64_t kk = 0; kk < H; ++kk) {
    m.rows_g[size_t(kk)] = pg.empty() ? int32_t(kk) : pg[size_t(kk)];
    m.rows_u[size_t(kk)] = pu.empty() ? int32_t(kk) : pu[size_t(kk)];
  }
  // Intermediate column c of this kernel expert = down's sorted row slice0 + c (or padding).
  m.inter.resize(size_t(I));
  for (int64_t c = 0; c < I; ++c) {
    const int64_t gc = slice0 + c;
    m.inter[size_t(c)] = gc >= Isrc ? -1 : pd.empty() ? int32_t(gc) : pd[size_t(gc)];
  }
  m.grp_g = group_of(src.g_idx[0], m.rows_g, H, p.gl1, name, "gate");
  m.grp_u = group_of(src.g_idx[1], m.rows_u, H, p.gl1, name, "up");
  m.grp_d = group_of(src.g_idx[2], m.inter, I, p.gl2, name, "down");
  return m;
}

}  // namespace wna16::cuda
