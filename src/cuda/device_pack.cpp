// The device packer's host side (device_pack.h): plan each batch on the host, hand its tables to
// the executor, run the items, turn the first error key into the host path's message.
#include "cuda/device_pack.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "cuda/cuda_check.h"
#include "wna16/error.h"
#include "wna16/half.h"

namespace wna16::cuda {
namespace {

constexpr const char* kWhich[3] = {"gate", "up", "down"};

const DeviceQuantizedLinear& linear(const DeviceExpertWeights& w, int which) {
  return which == 0 ? w.gate : which == 1 ? w.up : w.down;
}

int32_t scales_type(DType t) {
  switch (t) {
    case DType::F16: return devpack::kScalesF16;
    case DType::BF16: return devpack::kScalesBF16;
    case DType::F32: return devpack::kScalesF32;
  }
  throw Error("scales dtype is not f16, bf16 or f32");
}

devpack::SrcLinear src_linear(const DeviceQuantizedLinear& L, int32_t id) {
  devpack::SrcLinear s;
  s.qweight = L.qweight;
  s.qzeros = L.qzeros;
  s.scales = L.scales;
  s.K = L.K;
  s.N = L.N;
  s.G = L.scheme.num_groups(L.K);
  s.awq = L.scheme.format == Format::Awq;
  s.zero_add = L.scheme.format == Format::GptqV1 ? 1 : 0;
  s.scales_type = scales_type(L.scales_dtype);
  s.sym = L.scheme.sym;
  s.id = id;
  return s;
}

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

}  // namespace

// ---- CudaPackExecutor ---------------------------------------------------------------------------

void* CudaPackExecutor::scratch(size_t bytes) {
  // Every run() ends synchronised, so nothing still reads the old tables.
  if (scratch_.bytes < bytes) scratch_.alloc(bytes);
  return scratch_.p;
}

void CudaPackExecutor::to_device(void* dst, const void* src, size_t bytes) {
  if (bytes) WNA16_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, st_));
}

void CudaPackExecutor::to_host(void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  WNA16_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, st_));
  WNA16_CUDA_CHECK(cudaStreamSynchronize(st_));
}

unsigned long long CudaPackExecutor::run(const devpack::PackBatch& b, const devpack::CheckBatch& c) {
  if (!err_.p) err_.alloc(sizeof(unsigned long long));
  auto* err = static_cast<unsigned long long*>(err_.p);
  WNA16_CUDA_CHECK(cudaMemsetAsync(err, 0xFF, sizeof(unsigned long long), st_));  // kNoError
  launch_device_pack(b, c, err, st_);
  unsigned long long key = devpack::kNoError;
  WNA16_CUDA_CHECK(cudaMemcpyAsync(&key, err, sizeof key, cudaMemcpyDeviceToHost, st_));
  WNA16_CUDA_CHECK(cudaStreamSynchronize(st_));
  return key;
}

// ---- LayerPacker --------------------------------------------------------------------------------

LayerPacker::LayerPacker(const LayerPackShape& shape, const Targets& out, PackExecutor& ex)
    : shape_(shape), out_(out), ex_(ex) {
  h_perm_.assign(size_t(shape.E2 * shape.H), 0);
  h_perm_up_.assign(size_t(shape.E2 * shape.H), 0);
}

void LayerPacker::pack_shared(const DeviceExpertWeights& shared) {
  if (shape_.S == 0) return;
  const std::vector<Source> sources = {{&shared, "shared expert", 3 * shape_.E}};
  std::vector<KernelExpert> kes;
  for (int s = 0; s < shape_.S; ++s) kes.push_back({s, 0, int64_t(s) * shape_.I, shape_.shared_inter});
  pack(sources, kes);
}

void LayerPacker::pack_routed(int e0, const DeviceExpertWeights* experts, int n) {
  if (n <= 0) return;
  std::vector<Source> sources;
  std::vector<KernelExpert> kes;
  for (int j = 0; j < n; ++j) {
    sources.push_back({experts + j, fmt::format("expert {}", e0 + j), 3 * (e0 + j)});
    kes.push_back({shape_.S + e0 + j, j, 0, shape_.I});
  }
  pack(sources, kes);
}

void LayerPacker::pack(const std::vector<Source>& sources, const std::vector<KernelExpert>& kes) {
  const LayerPackShape& p = shape_;
  const int64_t H = p.H, I = p.I;
  // Host: g_idx (a few hundred KB per layer) -> act-order orders and group maps, with their checks.
  std::vector<SourceExpertOrder> orders(sources.size());
  std::vector<int32_t> raw;
  for (size_t si = 0; si < sources.size(); ++si)
    for (int w = 0; w < 3; ++w) {
      const DeviceQuantizedLinear& L = linear(*sources[si].w, w);
      if (L.g_idx) {
        raw.resize(size_t(L.K));
        ex_.to_host(raw.data(), L.g_idx, size_t(L.K) * 4);
      }
      orders[si].g_idx[w] = checked_g_idx(L.g_idx ? raw.data() : nullptr, L.K, L.scheme,
                                          sources[si].name + "." + kWhich[w]);
      orders[si].perm[w] = act_order_perm(orders[si].g_idx[w]);
    }
  const size_t n = kes.size();
  std::vector<KernelExpertMap> maps;
  maps.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const KernelExpert& ke = kes[i];
    if (ke.e2 != kes[0].e2 + int(i)) throw Error("LayerPacker: a batch's kernel experts must be consecutive");
    maps.push_back(map_kernel_expert(orders[size_t(ke.src)], p, ke.slice0, ke.Isrc, sources[size_t(ke.src)].name));
    const KernelExpertMap& m = maps.back();
    std::copy(m.rows_g.begin(), m.rows_g.end(), h_perm_.begin() + ke.e2 * H);
    std::copy(m.rows_u.begin(), m.rows_u.end(), h_perm_up_.begin() + ke.e2 * H);
    const SourceExpertOrder& o = orders[size_t(ke.src)];
    if (!o.perm[0].empty() || !o.perm[1].empty()) any_perm_ = true;
    if (m.rows_g != m.rows_u) any_dual_ = true;
  }

  // One scratch block: the batch's linears, the checks' linears, the maps, then their int tables.
  const size_t lin_off = 0, chk_off = lin_off + 3 * n * sizeof(devpack::SrcLinear);
  const size_t maps_off = chk_off + 3 * sources.size() * sizeof(devpack::SrcLinear);
  const size_t tab_off = align_up(maps_off + n * sizeof(devpack::ExpertMaps), 16);
  size_t ints = 0;
  for (size_t i = 0; i < n; ++i) {
    const SourceExpertOrder& o = orders[size_t(kes[i].src)];
    ints += (o.perm[0].empty() ? 0 : H) + (o.perm[1].empty() ? 0 : H) + I + 2 * (H / p.gl1) + I / p.gl2;
  }
  const size_t total = tab_off + ints * 4;
  std::vector<unsigned char> host(total);
  char* dev = static_cast<char*>(ex_.scratch(total));
  auto* lin = reinterpret_cast<devpack::SrcLinear*>(host.data() + lin_off);
  auto* chk = reinterpret_cast<devpack::SrcLinear*>(host.data() + chk_off);
  auto* mp = reinterpret_cast<devpack::ExpertMaps*>(host.data() + maps_off);
  size_t at = tab_off;
  auto put = [&](const std::vector<int32_t>& v) -> const int32_t* {
    std::memcpy(host.data() + at, v.data(), v.size() * 4);
    const auto* d = reinterpret_cast<const int32_t*>(dev + at);
    at += v.size() * 4;
    return d;
  };
  int64_t per = 0;
  for (size_t si = 0; si < sources.size(); ++si)
    for (int w = 0; w < 3; ++w) {
      const DeviceQuantizedLinear& L = linear(*sources[si].w, w);
      chk[3 * si + size_t(w)] = src_linear(L, sources[si].first_id + w);
      per = std::max(per, chk[3 * si + size_t(w)].G * L.N);
    }
  if (per >= (int64_t(1) << 40)) throw Error(fmt::format("a linear of {} scales is too large to pack", per));
  for (size_t i = 0; i < n; ++i) {
    const Source& s = sources[size_t(kes[i].src)];
    const SourceExpertOrder& o = orders[size_t(kes[i].src)];
    for (int w = 0; w < 3; ++w) lin[3 * i + size_t(w)] = src_linear(linear(*s.w, w), s.first_id + w);
    devpack::ExpertMaps& m = mp[i];
    m = devpack::ExpertMaps{};
    if (!o.perm[0].empty()) m.rows_g = put(maps[i].rows_g);
    if (!o.perm[1].empty()) m.rows_u = put(maps[i].rows_u);
    m.inter = put(maps[i].inter);
    m.grp_g = put(maps[i].grp_g);
    m.grp_u = put(maps[i].grp_u);
    m.grp_d = put(maps[i].grp_d);
  }
  ex_.to_device(dev, host.data(), total);

  devpack::PackBatch b;
  b.bits = p.bits;
  b.has_zeros = p.has_zeros;
  b.H = H;
  b.I = I;
  b.gl1 = p.gl1;
  b.gl2 = p.gl2;
  b.NT1 = p.g1.NT;
  b.NT2 = p.g2.NT;
  b.G1 = p.g1.G;
  b.G2 = p.g2.G;
  b.n = int(n);
  b.e2_first = kes[0].e2;
  b.lin = reinterpret_cast<const devpack::SrcLinear*>(dev + lin_off);
  b.maps = reinterpret_cast<const devpack::ExpertMaps*>(dev + maps_off);
  b.qw1 = out_.qw1;
  b.sc1 = out_.sc1;
  b.zr1 = out_.zr1;
  b.qw2 = out_.qw2;
  b.sc2 = out_.sc2;
  b.zr2 = out_.zr2;
  devpack::CheckBatch c;
  c.bits = p.bits;
  c.n = int(3 * sources.size());
  c.per = per;
  c.lin = reinterpret_cast<const devpack::SrcLinear*>(dev + chk_off);
  const unsigned long long key = ex_.run(b, c);
  if (key != devpack::kNoError) report(key, sources);
}

void LayerPacker::report(unsigned long long key, const std::vector<Source>& sources) {
  const int kind = int(key >> 62);
  const int32_t id = int32_t((key >> 40) & 0x3fffffu);
  const int64_t elem = int64_t(key & ((1ull << 40) - 1));
  for (const Source& s : sources) {
    if (id < s.first_id || id >= s.first_id + 3) continue;
    const int w = id - s.first_id;
    const DeviceQuantizedLinear& L = linear(*s.w, w);
    const std::string what = s.name + "." + kWhich[w];
    const int64_t g = elem / L.N, col = elem % L.N;
    if (kind == devpack::kErrScale) {
      uint32_t raw = 0;
      const size_t sz = dtype_size(L.scales_dtype);
      ex_.to_host(&raw, static_cast<const char*>(L.scales) + elem * int64_t(sz), sz);
      const float v = L.scales_dtype == DType::F32    ? bits_to_float(raw)
                      : L.scales_dtype == DType::BF16 ? bf16_to_float(uint16_t(raw))
                                                      : f16_to_float(uint16_t(raw));
      throw Error(fmt::format("{}: scales[{}, {}]={} is not finite", what, g, col, v));
    }
    // A sym scheme's zero that is not 2^(bits-1): read back its word and decode it as unpack() does.
    const int bits = L.scheme.bits, per = 32 / bits;
    const bool awq = L.scheme.format == Format::Awq;
    const int64_t word = awq ? g * (L.N / 8) + col / 8 : g * (L.N / per) + col / per;
    int32_t v = 0;
    ex_.to_host(&v, L.qzeros + word, 4);
    const int shift = awq ? 4 * layout::awq_nibble(col) : bits * int(col % per);
    const int32_t z = int32_t((uint32_t(v) >> shift) & ((1u << bits) - 1u)) +
                      (L.scheme.format == Format::GptqV1 ? 1 : 0);
    throw Error(fmt::format("{}: scheme {} is sym but qzeros[{}, {}] holds zero {} (expected {})", what,
                            L.scheme.describe(), g, col, z, 1 << (bits - 1)));
  }
  throw Error(fmt::format("device packing reported error key {:#x} for no linear of the batch", key));
}

// ---- validation and the two entry points ----------------------------------------------------------

namespace {

void check_device_linear(const DeviceQuantizedLinear& l, const std::string& what, int64_t K, int64_t N) {
  if (l.K != K || l.N != N)
    throw Error(fmt::format("{} is [K={}, N={}], expected [K={}, N={}]", what, l.K, l.N, K, N));
  try {
    l.scheme.validate(K, N);
    if (!l.qweight || !l.scales) throw Error("qweight or scales is null");
    if (!l.qzeros && !l.scheme.sym)
      throw Error(fmt::format("qzeros is null but the scheme {} stores zero points", l.scheme.describe()));
    if (l.g_idx && l.scheme.format == Format::Awq) throw Error("g_idx is given but AWQ has no g_idx");
    if (!l.g_idx && l.scheme.act_order && l.scheme.group_size != -1)
      throw Error(fmt::format("g_idx is empty but the scheme is act-order ({})", l.scheme.describe()));
  } catch (const Error& e) {
    throw Error(what + ": " + e.what());
  }
}

void check_device_expert(const DeviceExpertWeights& e, const std::string& what, int64_t H, int64_t I) {
  check_device_linear(e.gate, what + ".gate", H, I);
  check_device_linear(e.up, what + ".up", H, I);
  check_device_linear(e.down, what + ".down", I, H);
}

template <class W>
std::vector<std::pair<std::string, QuantScheme>> schemes_of(const W& w) {
  std::vector<std::pair<std::string, QuantScheme>> v;
  for (size_t e = 0; e < w.experts.size(); ++e)
    for (int k = 0; k < 3; ++k) {
      const auto& ex = w.experts[e];
      v.emplace_back(fmt::format("expert {} {}", e, kWhich[k]),
                     (k == 0 ? ex.gate : k == 1 ? ex.up : ex.down).scheme);
    }
  if (w.shared)
    for (int k = 0; k < 3; ++k)
      v.emplace_back(fmt::format("shared expert {}", kWhich[k]),
                     (k == 0 ? w.shared->gate : k == 1 ? w.shared->up : w.shared->down).scheme);
  return v;
}

PackedLayerArrays alloc_arrays(const LayerPackShape& p) {
  PackedLayerArrays a;
  const size_t m1 = size_t(p.E2 * p.g1.meta_words_per_expert() * 4), m2 = size_t(p.E2 * p.g2.meta_words_per_expert() * 4);
  a.qw1.alloc(size_t(p.E2 * p.g1.qweight_words_per_expert() * 4));
  a.sc1.alloc(m1);
  a.qw2.alloc(size_t(p.E2 * p.g2.qweight_words_per_expert() * 4));
  a.sc2.alloc(m2);
  if (p.has_zeros) {
    a.zr1.alloc(m1);
    a.zr2.alloc(m2);
  }
  return a;
}

LayerPacker::Targets targets(PackedLayerArrays& a) {
  LayerPacker::Targets t;
  t.qw1 = static_cast<uint32_t*>(a.qw1.p);
  t.sc1 = static_cast<uint32_t*>(a.sc1.p);
  t.zr1 = static_cast<uint32_t*>(a.zr1.p);
  t.qw2 = static_cast<uint32_t*>(a.qw2.p);
  t.sc2 = static_cast<uint32_t*>(a.sc2.p);
  t.zr2 = static_cast<uint32_t*>(a.zr2.p);
  return t;
}

void finish(PackedLayerArrays& a, const LayerPacker& packer) {
  a.perm1.upload(packer.perm());
  a.permup1.upload(packer.perm_up());
}

}  // namespace

std::vector<std::pair<std::string, QuantScheme>> layer_schemes(const MoeLayerWeights& w) { return schemes_of(w); }
std::vector<std::pair<std::string, QuantScheme>> layer_schemes(const DeviceMoeLayerWeights& w) {
  return schemes_of(w);
}

void validate_device_weights(const MoeLayerSpec& spec, const DeviceMoeLayerWeights& w) {
  spec.validate();
  const int64_t H = spec.hidden, E = spec.routing.num_experts;
  if (int64_t(w.router.size()) != E * H)
    throw Error(fmt::format("router has {} values, expected [E={}, H={}] = {}", w.router.size(), E, H, E * H));
  if (spec.routing.method == RoutingMethod::NoauxTc ? int64_t(w.correction_bias.size()) != E
                                                    : !w.correction_bias.empty() && int64_t(w.correction_bias.size()) != E)
    throw Error(fmt::format("correction_bias has {} values, expected E={}", w.correction_bias.size(), E));
  if (int64_t(w.experts.size()) != E)
    throw Error(fmt::format("layer has {} experts, spec says num_experts={}", w.experts.size(), E));
  for (int64_t e = 0; e < E; ++e) check_device_expert(w.experts[size_t(e)], fmt::format("expert {}", e), H, spec.inter);
  if ((spec.shared_kind != SharedExpertKind::None) != w.shared.has_value())
    throw Error(w.shared ? "layer has shared expert weights but the spec has no shared expert"
                         : "spec '" + spec.name + "' has a shared expert but the layer has no shared weights");
  if (w.shared) check_device_expert(*w.shared, "shared expert", H, spec.shared_inter);
  const size_t want_gate = spec.shared_kind == SharedExpertKind::SigmoidGated ? size_t(H) : 0;
  if (w.shared_gate.size() != want_gate)
    throw Error(fmt::format("shared_gate has {} values, expected {}", w.shared_gate.size(), want_gate));
}

PackedLayerArrays pack_layer_on_device(const LayerPackShape& shape, const DeviceMoeLayerWeights& w, cudaStream_t st) {
  PackedLayerArrays a = alloc_arrays(shape);
  CudaPackExecutor ex(st);
  LayerPacker packer(shape, targets(a), ex);
  if (w.shared) packer.pack_shared(*w.shared);
  packer.pack_routed(0, w.experts.data(), int(w.experts.size()));
  finish(a, packer);
  return a;
}

PackedLayerArrays pack_layer_on_device(const LayerPackShape& shape, const MoeLayerWeights& w, cudaStream_t st) {
  PackedLayerArrays a = alloc_arrays(shape);
  CudaPackExecutor ex(st);
  LayerPacker packer(shape, targets(a), ex);
  // Staging: the checkpoint tensors of as many experts as fit 1 GiB (at least one) at a time; every
  // pack call ends synchronised, so the next batch may overwrite them.
  auto bytes4 = [](size_t n) { return align_up(n * 4, 256); };
  auto linear_bytes = [&](const QuantizedLinear& q) {
    return bytes4(q.qweight.size()) + bytes4(q.qzeros.size()) + bytes4(q.scales.size()) + bytes4(q.g_idx.size());
  };
  auto expert_bytes = [&](const ExpertWeights& x) { return linear_bytes(x.gate) + linear_bytes(x.up) + linear_bytes(x.down); };
  size_t total = w.shared ? expert_bytes(*w.shared) : 0, largest = total;
  for (const ExpertWeights& x : w.experts) {
    total += expert_bytes(x);
    largest = std::max(largest, expert_bytes(x));
  }
  DevBuf staging;
  staging.alloc(std::min(total, std::max(largest, size_t(1) << 30)));
  size_t off = 0;
  auto put = [&](const void* src, size_t n) -> const int32_t* {
    if (n == 0) return nullptr;
    char* dst = static_cast<char*>(staging.p) + off;
    WNA16_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * 4, cudaMemcpyHostToDevice, st));
    off += bytes4(n);
    return reinterpret_cast<const int32_t*>(dst);
  };
  auto stage_linear = [&](const QuantizedLinear& q) {
    DeviceQuantizedLinear d;
    d.scheme = q.scheme;
    d.K = q.K;
    d.N = q.N;
    d.qweight = put(q.qweight.data(), q.qweight.size());
    d.qzeros = put(q.qzeros.data(), q.qzeros.size());
    d.scales = put(q.scales.data(), q.scales.size());
    d.scales_dtype = DType::F32;  // QuantizedLinear keeps the file's values as float
    d.g_idx = put(q.g_idx.data(), q.g_idx.size());
    return d;
  };
  auto stage = [&](const ExpertWeights& x) {
    return DeviceExpertWeights{stage_linear(x.gate), stage_linear(x.up), stage_linear(x.down)};
  };
  if (w.shared) {
    const DeviceExpertWeights d = stage(*w.shared);
    packer.pack_shared(d);
    off = 0;
  }
  std::vector<DeviceExpertWeights> batch;
  int e0 = 0;
  for (int e = 0; e <= int(w.experts.size()); ++e) {
    const bool last = e == int(w.experts.size());
    if (!batch.empty() && (last || off + expert_bytes(w.experts[size_t(e)]) > staging.bytes)) {
      packer.pack_routed(e0, batch.data(), int(batch.size()));
      batch.clear();
      off = 0;
    }
    if (last) break;
    if (batch.empty()) e0 = e;
    batch.push_back(stage(w.experts[size_t(e)]));
  }
  finish(a, packer);
  return a;
}

}  // namespace wna16::cuda
