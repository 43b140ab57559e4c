// Packing on the device (cuda/device_pack.h) against the host packer (host_pack_oracle.h), bit for
// bit: GPTQ v1/v2 and AWQ, 4 and 8 bit, sym (with and without a qzeros tensor) and asym,
// act-order (gate and up with one order and with two), group sizes 32/64/128/-1, shared experts cut
// into several slices with padding, N not a multiple of 256, f16/bf16/f32 scales over their whole
// finite range; random words on fresh seeds (printed). The refusals name the expert, tensor,
// element and value, with the host path's messages. The same work items also run on the CPU
// (DevicePackHost), so everything but the launch is checked without a GPU. Last, the time to pack
// a DeepSeek-V3 layer from device tensors (printed, not asserted).
#include "gpu/gpu_test_util.h"

#ifdef WNA16_HAVE_CUDA
#include <gmock/gmock.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda/device_pack.h"
#include "cuda/device_pack_kernels.h"
#include "cuda/moe_gemm_layout.h"
#include "formats/packing.h"
#include "gpu/host_pack_oracle.h"
#include "test_util.h"
#include "wna16/cuda.h"
#include "wna16/error.h"
#include "wna16/half.h"
#include "wna16/reference.h"

namespace wna16::cuda {
namespace {

using gpu_test::first_mismatch;
using ::testing::HasSubstr;
using ::testing::StartsWith;
constexpr uint32_t kPoisonWord = 0xA5A5A5A5u;

uint64_t fresh_seed() {
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ rd();
}

// ---- layers under test ----------------------------------------------------------------------------

struct Case {
  Format format = Format::GptqV1;
  int bits = 4, group = 128;
  bool sym = true, act_order = false;
  DType scales = DType::F16;         // dtype of the device tensors' scales
  bool shared_orders = false;        // act-order: up takes gate's g_idx
  bool null_sym_zeros = false;       // sym: no qzeros tensor
  SharedExpertKind shared = SharedExpertKind::Plain;
  std::string name() const {
    return scheme().describe() + " scales " + dtype_name(scales) +
           (shared_orders ? " one order" : "") + (null_sym_zeros ? " no qzeros" : "") +
           (shared == SharedExpertKind::None ? " no shared" : " shared");
  }
  QuantScheme scheme() const { return test::scheme(format, bits, group, sym, act_order); }
};

Case make_case(Format f, int bits, int g, bool sym, bool act, DType scales = DType::F16) {
  return Case{.format = f, .bits = bits, .group = g, .sym = sym, .act_order = act, .scales = scales};
}

std::vector<Case> all_cases() {
  std::vector<Case> v;
  int i = 0;
  for (Format f : {Format::GptqV1, Format::GptqV2, Format::Awq})
    for (int bits : {4, 8})
      for (bool sym : {true, false})
        for (bool act : {false, true})
          for (int g : {32, 64, 128, -1}) {
            if (f == Format::Awq && (bits == 8 || act)) continue;
            Case c = make_case(f, bits, g, sym, act, i % 3 == 0 ? DType::F16 : i % 3 == 1 ? DType::BF16 : DType::F32);
            c.shared_orders = act && i % 2 == 0;
            c.null_sym_zeros = sym && i % 4 == 1;
            c.shared = i % 5 == 0 ? SharedExpertKind::None : i % 5 == 1 ? SharedExpertKind::SigmoidGated
                                                                        : SharedExpertKind::Plain;
            v.push_back(c);
            ++i;
          }
  return v;
}

// H not a multiple of 256 (with g128 not of 16 tiles either: GEMM2 pads n-tiles); three shared
// slices, the last half padding (with g128 a kernel group of padding rows only).
MoeLayerSpec spec_of(const Case& c) {
  MoeLayerSpec s;
  s.name = "pack";
  s.hidden = c.group == 128 ? 384 : 320;
  s.inter = 256;
  s.routing.num_experts = 3;
  s.routing.top_k = 2;
  s.shared_kind = c.shared;
  s.shared_inter = c.shared == SharedExpertKind::None ? 0 : 640;
  return s;
}

// A finite value of dtype t with random bits (any sign, subnormals, the largest exponents).
float random_scale(DType t, std::mt19937_64& rng) {
  for (;;) {
    const uint32_t r = uint32_t(rng());
    if (t == DType::F16 && (r & 0x7c00u) != 0x7c00u) return f16_to_float(uint16_t(r));
    if (t == DType::BF16 && (r & 0x7f80u) != 0x7f80u) return bf16_to_float(uint16_t(r));
    if (t == DType::F32 && (r & 0x7f800000u) != 0x7f800000u) return bits_to_float(r);
  }
}

// random_layer's structure (schemes, act-order g_idx) with random code words, random zero words
// where the scheme is asym, and random scales exact in c.scales.
MoeLayerWeights random_words_layer(const Case& c, const MoeLayerSpec& spec, uint64_t seed) {
  MoeLayerWeights w = random_layer(spec, c.scheme(), seed);
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  auto mutate = [&](ExpertWeights& e) {
    for (QuantizedLinear* q : {&e.gate, &e.up, &e.down}) {
      for (int32_t& v : q->qweight) v = int32_t(uint32_t(rng()));
      if (!q->scheme.sym)
        for (int32_t& v : q->qzeros) v = int32_t(uint32_t(rng()));
      for (float& s : q->scales) s = random_scale(c.scales, rng);
    }
    if (c.shared_orders) e.up.g_idx = e.gate.g_idx;
  };
  for (ExpertWeights& e : w.experts) mutate(e);
  if (w.shared) mutate(*w.shared);
  return w;
}

// The layer's checkpoint tensors as DeviceMoeLayerWeights, in host memory (the CPU run of the
// items) or copied to the device; scales stored as `scales`.
struct LayerTensors {
  std::vector<std::vector<unsigned char>> host;
  std::vector<void*> dev;
  DeviceMoeLayerWeights w;
  LayerTensors() = default;
  LayerTensors(const LayerTensors&) = delete;
  LayerTensors& operator=(const LayerTensors&) = delete;
  ~LayerTensors() {
    for (void* p : dev) cudaFree(p);
  }
};

std::unique_ptr<LayerTensors> tensors_of(const MoeLayerWeights& w, DType scales, bool null_sym_zeros,
                                         bool on_device) {
  auto t = std::make_unique<LayerTensors>();
  auto add = [&](const void* data, size_t bytes) -> const void* {
    const auto* b = static_cast<const unsigned char*>(data);
    t->host.emplace_back(b, b + bytes);
    if (!on_device) return t->host.back().data();
    void* d = nullptr;
    if (cudaMalloc(&d, std::max<size_t>(bytes, 4)) != cudaSuccess) throw Error("cudaMalloc failed");
    t->dev.push_back(d);
    if (cudaMemcpy(d, data, bytes, cudaMemcpyHostToDevice) != cudaSuccess) throw Error("cudaMemcpy failed");
    return d;
  };
  auto linear = [&](const QuantizedLinear& q) {
    DeviceQuantizedLinear d;
    d.scheme = q.scheme;
    d.K = q.K;
    d.N = q.N;
    d.qweight = static_cast<const int32_t*>(add(q.qweight.data(), q.qweight.size() * 4));
    if (!(null_sym_zeros && q.scheme.sym))
      d.qzeros = static_cast<const int32_t*>(add(q.qzeros.data(), q.qzeros.size() * 4));
    d.scales_dtype = scales;
    if (scales == DType::F32) {
      d.scales = add(q.scales.data(), q.scales.size() * 4);
    } else {
      std::vector<uint16_t> h(q.scales.size());
      for (size_t i = 0; i < h.size(); ++i) h[i] = scales == DType::F16 ? float_to_f16(q.scales[i]) : float_to_bf16(q.scales[i]);
      d.scales = add(h.data(), h.size() * 2);
    }
    if (!q.g_idx.empty()) d.g_idx = static_cast<const int32_t*>(add(q.g_idx.data(), q.g_idx.size() * 4));
    return d;
  };
  auto expert = [&](const ExpertWeights& e) { return DeviceExpertWeights{linear(e.gate), linear(e.up), linear(e.down)}; };
  t->w.router = w.router;
  t->w.correction_bias = w.correction_bias;
  t->w.shared_gate = w.shared_gate;
  for (const ExpertWeights& e : w.experts) t->w.experts.push_back(expert(e));
  if (w.shared) t->w.shared = expert(*w.shared);
  // A pageable cudaMemcpy may return before its DMA lands, and the packer's stream may be a
  // non-blocking one: the uploads complete here, as the layer's contract asks of its caller.
  if (on_device && cudaDeviceSynchronize() != cudaSuccess) throw Error("cudaDeviceSynchronize failed");
  return t;
}

// ---- running the items on the host ------------------------------------------------------------------

class HostPackExecutor final : public PackExecutor {
 public:
  void* scratch(size_t bytes) override {
    buf_.assign(bytes, 0);
    return buf_.data();
  }
  void to_device(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void to_host(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  unsigned long long run(const devpack::PackBatch& b, const devpack::CheckBatch& c) override {
    unsigned long long best = devpack::kNoError;
    for (int64_t i = 0; i < devpack::check_items(c); ++i) best = std::min(best, devpack::check_item(c, i));
    for (int64_t i = 0; i < devpack::qweight1_items(b); ++i) devpack::pack_qweight1(b, i);
    for (int64_t i = 0; i < devpack::qweight2_items(b); ++i) devpack::pack_qweight2(b, i);
    for (int64_t i = 0; i < devpack::meta1_items(b); ++i) devpack::pack_meta1(b, i);
    for (int64_t i = 0; i < devpack::meta2_items(b); ++i) devpack::pack_meta2(b, i);
    return best;
  }

 private:
  std::vector<unsigned char> buf_;
};

struct HostArrays {
  std::vector<uint32_t> qw1, sc1, zr1, qw2, sc2, zr2;
  std::vector<int32_t> perm, perm_up;
};

// The device path's plan and items over host memory; routed experts in two batches (e0 > 0 too).
HostArrays pack_on_host(const MoeLayerSpec& spec, const DeviceMoeLayerWeights& w) {
  validate_device_weights(spec, w);
  const LayerPackShape p = plan_layer_shape(spec, layer_schemes(w));
  HostArrays a;
  const size_t m1 = size_t(p.E2 * p.g1.meta_words_per_expert()), m2 = size_t(p.E2 * p.g2.meta_words_per_expert());
  a.qw1.assign(size_t(p.E2 * p.g1.qweight_words_per_expert()), kPoisonWord);
  a.qw2.assign(size_t(p.E2 * p.g2.qweight_words_per_expert()), kPoisonWord);
  a.sc1.assign(m1, kPoisonWord);
  a.sc2.assign(m2, kPoisonWord);
  if (p.has_zeros) {
    a.zr1.assign(m1, kPoisonWord);
    a.zr2.assign(m2, kPoisonWord);
  }
  LayerPacker::Targets t{a.qw1.data(), a.sc1.data(), a.zr1.empty() ? nullptr : a.zr1.data(),
                         a.qw2.data(), a.sc2.data(), a.zr2.empty() ? nullptr : a.zr2.data()};
  HostPackExecutor ex;
  LayerPacker packer(p, t, ex);
  if (w.shared) packer.pack_shared(*w.shared);
  const int E = int(w.experts.size());
  packer.pack_routed(0, w.experts.data(), 1);
  packer.pack_routed(1, w.experts.data() + 1, E - 1);
  a.perm = packer.perm();
  a.perm_up = packer.perm_up();
  return a;
}

template <class T>
std::vector<T> download(const DevBuf& b) {
  std::vector<T> v(b.bytes / sizeof(T));
  if (b.bytes) {
    EXPECT_EQ(cudaMemcpy(v.data(), b.p, b.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return v;
}

// Downloads the arrays, then poisons them: a later allocation that reuses the memory must not find
// the same bytes already in place.
HostArrays download_and_poison(PackedLayerArrays& a) {
  HostArrays h{download<uint32_t>(a.qw1), download<uint32_t>(a.sc1), download<uint32_t>(a.zr1),
               download<uint32_t>(a.qw2), download<uint32_t>(a.sc2), download<uint32_t>(a.zr2),
               download<int32_t>(a.perm1), download<int32_t>(a.permup1)};
  for (DevBuf* b : {&a.qw1, &a.sc1, &a.zr1, &a.qw2, &a.sc2, &a.zr2, &a.perm1, &a.permup1})
    if (b->bytes) {
      EXPECT_EQ(cudaMemset(b->p, gpu_test::kPoison, b->bytes), cudaSuccess);
    }
  return h;
}

template <class T>
void expect_same(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  const int64_t i = first_mismatch(got, want);
  if (i < 0) return;
  if (got.size() != want.size()) {
    ADD_FAILURE() << what << ": " << got.size() << " words, expected " << want.size();
    return;
  }
  ADD_FAILURE() << what << ": word " << i << " is 0x" << std::hex << got[size_t(i)] << ", expected 0x"
                << want[size_t(i)] << std::dec;
}

void expect_same(const HostArrays& got, const host_oracle::HostPackedLayer& want) {
  expect_same(got.qw1, want.g1.qweight, "GEMM1 qweight");
  expect_same(got.sc1, want.g1.scales, "GEMM1 scales");
  expect_same(got.zr1, want.g1.zeros, "GEMM1 zeros");
  expect_same(got.qw2, want.g2.qweight, "GEMM2 qweight");
  expect_same(got.sc2, want.g2.scales, "GEMM2 scales");
  expect_same(got.zr2, want.g2.zeros, "GEMM2 zeros");
  expect_same(got.perm, want.g1.perm, "perm");
  expect_same(got.perm_up, want.g1.perm_up, "perm_up");
}

// ---- refusals -----------------------------------------------------------------------------------------

struct BadCase {
  const char* what;
  Case c;
  std::function<void(MoeLayerWeights&)> spoil;
  std::string message;  // how the message starts (all of it where the seed does not matter)
};

std::vector<BadCase> bad_cases() {
  std::vector<BadCase> v;
  v.push_back({"sym zero (v1 4-bit)", make_case(Format::GptqV1, 4, 128, true, false),
               [](MoeLayerWeights& w) { w.experts[1].up.qzeros[0] = int32_t(0x77773777); },
               "expert 1.up: scheme gptq 4-bit g128 sym is sym but qzeros[0, 3] holds zero 4 (expected 8)"});
  v.push_back({"sym zero (v1 8-bit, shared expert)", make_case(Format::GptqV1, 8, 64, true, false, DType::BF16),
               [](MoeLayerWeights& w) { w.shared->gate.qzeros[1] = int32_t(0x7f7f007f); },
               "shared expert.gate: scheme gptq 8-bit g64 sym is sym but qzeros[0, 5] holds zero 1 (expected 128)"});
  v.push_back({"non-contiguous act-order groups", make_case(Format::GptqV2, 4, 64, false, true),
               [](MoeLayerWeights& w) {
                 std::vector<int32_t>& g = w.experts[2].down.g_idx;
                 *std::find(g.begin(), g.end(), 0) = 1;  // group 1 gets 65 channels, group 0 63
               },
               "expert 2 down: act-order groups are not contiguous runs of 64 channels after sorting by g_idx "
               "(channel "});
  v.push_back({"non-finite scale", make_case(Format::Awq, 4, 32, false, false, DType::F32),
               [](MoeLayerWeights& w) { w.experts[0].gate.scales[size_t(1 * 256 + 5)] = INFINITY; },
               "expert 0.gate: scales[1, 5]=inf is not finite"});
  v.push_back({"NaN scale (bf16, shared expert)", make_case(Format::GptqV1, 4, 32, false, false, DType::BF16),
               [](MoeLayerWeights& w) { w.shared->down.scales[size_t(2 * 320 + 7)] = NAN; },
               "shared expert.down: scales[2, 7]=nan is not finite"});
  v.push_back({"g_idx out of range", make_case(Format::GptqV1, 8, 32, true, true),
               [](MoeLayerWeights& w) { w.experts[1].down.g_idx[3] = 99; },
               "expert 1.down: g_idx[3]=99 is out of range [0, 8)"});
  v.push_back({"g_idx of a scheme without act-order", make_case(Format::GptqV2, 4, 64, false, false),
               [](MoeLayerWeights& w) { w.experts[0].gate.g_idx[70] = 0; },
               "expert 0.gate: g_idx[70]=0 but scheme gptq_v2 4-bit g64 asym is not act-order (expected 1)"});
  return v;
}

// ---- host-only: the shared arithmetic, and every item on the CPU ------------------------------------

TEST(DevicePackLayout, F16ConversionMatchesHalfH) {
  // Every bf16 value, every f32 whose low 13 bits are a rounding edge, and random f32.
  auto check = [](uint32_t u) {
    const uint16_t want = float_to_f16(bits_to_float(u)), got = layout::f16_bits_from_f32_bits(u);
    if (want != got) ADD_FAILURE() << "f32 0x" << std::hex << u << ": 0x" << got << ", expected 0x" << want;
    return want == got;
  };
  for (uint32_t hi = 0; hi < (1u << 19); ++hi)
    for (uint32_t lo : {0x0u, 0x1u, 0xfffu, 0x1000u, 0x1001u, 0x1fffu, 0x0800u, 0x17ffu})
      if (!check(hi << 13 | lo)) return;
  std::mt19937_64 rng(fresh_seed());
  for (int i = 0; i < 4000000; ++i)
    if (!check(uint32_t(rng()))) return;
}

TEST(DevicePackLayout, AwqNibbleMatchesTheFormat) {
  for (int j = 0; j < 16; ++j) EXPECT_EQ(layout::awq_nibble(j), detail::kAwqReverse[j % 8]) << j;
}

TEST(DevicePackHost, MatchesHostPackerBitForBit) {
  const uint64_t seed0 = fresh_seed();
  std::printf("DevicePackHost seed %llu\n", static_cast<unsigned long long>(seed0));
  uint64_t seed = seed0;
  for (const Case& c : all_cases()) {
    SCOPED_TRACE(c.name() + " seed " + std::to_string(seed));
    const MoeLayerSpec spec = spec_of(c);
    const MoeLayerWeights w = random_words_layer(c, spec, seed++);
    const host_oracle::HostPackedLayer want = host_oracle::host_pack_layer(spec, w);
    const auto t = tensors_of(w, c.scales, c.null_sym_zeros, false);
    expect_same(pack_on_host(spec, t->w), want);
    if (HasFailure()) return;
  }
}

// Each bad case's spoiled layer, refused by the host oracle with the case's message; then
// check(b, spec, w, message) holds the path under test to the oracle's exact message.
template <class Check>
void each_refusal(uint64_t seed, Check&& check) {
  for (const BadCase& b : bad_cases()) {
    SCOPED_TRACE(std::string(b.what) + " seed " + std::to_string(seed));
    const MoeLayerSpec spec = spec_of(b.c);
    MoeLayerWeights w = random_layer(spec, b.c.scheme(), seed);
    b.spoil(w);
    const std::string host = test::error_of([&] { host_oracle::host_pack_layer(spec, w); });
    EXPECT_THAT(host, StartsWith(b.message));
    check(b, spec, w, host);
  }
}

TEST(DevicePackHost, RefusalsNameTheValue) {
  each_refusal(fresh_seed(), [](const BadCase& b, const MoeLayerSpec& spec, const MoeLayerWeights& w,
                                const std::string& host) {
    const auto t = tensors_of(w, b.c.scales, false, false);
    EXPECT_EQ(test::error_of([&] { pack_on_host(spec, t->w); }), host);
  });
}

// ---- on the GPU ---------------------------------------------------------------------------------------

TEST(DevicePack, MatchesHostPackerBitForBit) {
  WNA16_REQUIRE_GPU();
  const uint64_t seed0 = fresh_seed();
  std::printf("DevicePack seed %llu\n", static_cast<unsigned long long>(seed0));
  uint64_t seed = seed0;
  cudaStream_t st = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  for (const Case& c : all_cases()) {
    SCOPED_TRACE(c.name() + " seed " + std::to_string(seed));
    const MoeLayerSpec spec = spec_of(c);
    const MoeLayerWeights w = random_words_layer(c, spec, seed++);
    const host_oracle::HostPackedLayer want = host_oracle::host_pack_layer(spec, w);
    const LayerPackShape p = plan_layer_shape(spec, layer_schemes(w));
    {
      PackedLayerArrays a = pack_layer_on_device(p, w, nullptr);  // the C++ loader's path
      expect_same(download_and_poison(a), want);
    }
    {
      const auto t = tensors_of(w, c.scales, c.null_sym_zeros, true);
      validate_device_weights(spec, t->w);
      PackedLayerArrays a = pack_layer_on_device(p, t->w, st);  // the PyTorch op's path
      expect_same(download_and_poison(a), want);
    }
    if (HasFailure()) break;
  }
  CUDA_OK(cudaStreamDestroy(st));
}

TEST(DevicePack, RefusalsNameTheValue) {
  WNA16_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  each_refusal(seed, [](const BadCase& b, const MoeLayerSpec& spec, const MoeLayerWeights& w, const std::string& host) {
    EXPECT_EQ(test::error_of([&] { CudaMoeLayer layer(spec, w); }), host);
    const auto t = tensors_of(w, b.c.scales, false, true);
    EXPECT_EQ(test::error_of([&] { CudaMoeLayer layer(spec, t->w); }), host);
  });
  // Shapes and pointers are checked before anything runs.
  const Case c;
  const MoeLayerSpec spec = spec_of(c);
  const MoeLayerWeights w = random_layer(spec, c.scheme(), seed);
  auto t = tensors_of(w, DType::F16, false, true);
  t->w.experts[2].down.N = 128;
  EXPECT_EQ(test::error_of([&] { CudaMoeLayer layer(spec, t->w); }),
            "expert 2.down is [K=256, N=128], expected [K=256, N=384]");
  t->w.experts[2].down.N = 384;
  t->w.experts[1].up.qzeros = nullptr;
  t->w.experts[1].up.scheme.sym = false;
  EXPECT_THAT(test::error_of([&] { CudaMoeLayer layer(spec, t->w); }),
              HasSubstr("expert 1.up: qzeros is null but the scheme gptq 4-bit g128 asym stores zero points"));
}

// The layer built from device tensors computes what the layer built from host tensors does.
TEST(DevicePack, LayerFromDeviceTensorsRunsAsFromHostTensors) {
  WNA16_REQUIRE_GPU();
  struct L {
    Format f;
    int bits, g;
    bool sym, act;
    SharedExpertKind shared;
    int64_t shared_inter;
  };
  for (const L& l : {L{Format::GptqV1, 4, 128, true, true, SharedExpertKind::Plain, 384},
                     L{Format::Awq, 4, 64, false, false, SharedExpertKind::SigmoidGated, 320},
                     L{Format::GptqV2, 8, -1, false, false, SharedExpertKind::None, 0}}) {
    MoeLayerSpec spec;
    spec.name = "pack-layer";
    spec.hidden = 256;
    spec.inter = 128;
    spec.routing.num_experts = 8;
    spec.routing.top_k = 2;
    spec.shared_kind = l.shared;
    spec.shared_inter = l.shared_inter;
    const QuantScheme q = test::scheme(l.f, l.bits, l.g, l.sym, l.act);
    SCOPED_TRACE(q.describe());
    const MoeLayerWeights w = random_layer(spec, q, 7);
    const auto t = tensors_of(w, DType::F16, false, true);
    const CudaMoeLayer from_host(spec, w), from_dev(spec, t->w);
    EXPECT_EQ(from_host.weight_bytes(), from_dev.weight_bytes());
    for (int64_t M : {1, 40, 300}) {
      std::mt19937_64 rng{uint64_t(M)};
      std::normal_distribution<float> nd(0.f, 1.f);
      std::vector<uint16_t> x(size_t(M * spec.hidden));
      std::vector<float> xf(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        x[i] = float_to_bf16(nd(rng));
        xf[i] = bf16_to_float(x[i]);
      }
      const std::vector<double> ref = moe_reference(spec, w, xf.data(), M);
      std::vector<float> out[2];
      int i = 0;
      for (const CudaMoeLayer* layer : {&from_host, &from_dev}) {
        gpu_test::DevBuf<uint16_t> dx(x.size()), dout(x.size());
        gpu_test::DevBuf<unsigned char> ws(layer->workspace_bytes(M));
        dx.upload(x);
        dout.poison();
        layer->forward(dx.p, dout.p, M, DType::BF16, ws.p, ws.n, nullptr);
        CUDA_OK(cudaDeviceSynchronize());
        for (uint16_t h : dout.download()) out[i].push_back(bf16_to_float(h));
        EXPECT_LT(rel_error(out[i].data(), ref.data(), M * spec.hidden), layer_tolerance(DType::BF16)) << "M=" << M;
        ++i;
      }
      // fp32 atomics sum the top-k in any order: equal up to the last bf16 bit, not bit for bit.
      std::vector<double> host_out(out[0].begin(), out[0].end());
      EXPECT_LT(rel_error(out[1].data(), host_out.data(), M * spec.hidden), 1e-2) << "M=" << M;
    }
  }
}

// The figure: one DeepSeek-V3 layer (256 routed experts + 1 shared, H=7168, I=2048, GPTQ
// int4 g128 sym, random codes) packed from tensors already on the GPU. Printed, not asserted.
TEST(DevicePack, DeepSeekV3LayerSeconds) {
  WNA16_REQUIRE_GPU();
  if (gpu_test::under_sanitizer()) GTEST_SKIP() << "6 GB of tensors: not under a sanitizer";
  const MoeLayerSpec spec = preset("deepseek-v3");
  const int64_t H = spec.hidden, I = spec.inter, E = spec.routing.num_experts, G1 = H / 128, G2 = I / 128;
  const QuantScheme q = test::scheme(Format::GptqV1, 4, 128, true);
  // Four distinct experts' random words, repeated: the time does not depend on the values.
  constexpr int kDistinct = 4;
  std::mt19937_64 rng(fresh_seed());
  std::vector<int32_t> qw((size_t(H / 8 * I) * 2 + size_t(I / 8 * H)) * kDistinct);
  for (int32_t& v : qw) v = int32_t(uint32_t(rng()));
  std::vector<uint16_t> sc(size_t(G1 * I * 2 + G2 * H) * kDistinct);
  for (uint16_t& v : sc) v = float_to_f16(0.001f + 0.01f * float(rng() % 1000) / 1000.f);
  const std::vector<int32_t> zeros(size_t(G1 * I / 8 * 2 + G2 * H / 8), int32_t(0x77777777));
  std::vector<int32_t> gidx(size_t(H + H + I));
  for (int64_t k = 0; k < H; ++k) gidx[size_t(k)] = gidx[size_t(H + k)] = int32_t(k / 128);
  for (int64_t k = 0; k < I; ++k) gidx[size_t(2 * H + k)] = int32_t(k / 128);

  const int64_t experts = E + 1;  // the shared expert last
  const size_t qw_e = size_t(H / 8 * I * 2 + I / 8 * H), sc_e = size_t(G1 * I * 2 + G2 * H);
  gpu_test::DevBuf<int32_t> d_qw(qw_e * size_t(experts)), d_z(zeros.size()), d_g(gidx.size());
  gpu_test::DevBuf<uint16_t> d_sc(sc_e * size_t(experts));
  ASSERT_TRUE(d_qw.p && d_sc.p);
  for (int64_t e = 0; e < experts; ++e) {
    const size_t src = size_t(e % kDistinct);
    CUDA_OK(cudaMemcpy(d_qw.p + qw_e * size_t(e), qw.data() + qw_e * src, qw_e * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_sc.p + sc_e * size_t(e), sc.data() + sc_e * src, sc_e * 2, cudaMemcpyHostToDevice));
  }
  d_z.upload(zeros);
  d_g.upload(gidx);
  DeviceMoeLayerWeights dw;
  dw.router.assign(size_t(E * H), 0.01f);
  dw.correction_bias.assign(size_t(E), 0.f);
  auto expert = [&](int64_t e) {
    const int32_t* qwp = d_qw.p + qw_e * size_t(e);
    const uint16_t* scp = d_sc.p + sc_e * size_t(e);
    auto lin = [&](int64_t K, int64_t N, const int32_t* w, const uint16_t* s, const int32_t* z, const int32_t* g) {
      DeviceQuantizedLinear d;
      d.scheme = q;
      d.K = K;
      d.N = N;
      d.qweight = w;
      d.qzeros = z;
      d.scales = s;
      d.scales_dtype = DType::F16;
      d.g_idx = g;
      return d;
    };
    return DeviceExpertWeights{lin(H, I, qwp, scp, d_z.p, d_g.p),
                               lin(H, I, qwp + H / 8 * I, scp + G1 * I, d_z.p + G1 * I / 8, d_g.p + H),
                               lin(I, H, qwp + 2 * (H / 8 * I), scp + 2 * G1 * I, d_z.p + 2 * G1 * I / 8, d_g.p + 2 * H)};
  };
  for (int64_t e = 0; e < E; ++e) dw.experts.push_back(expert(e));
  dw.shared = expert(E);
  CUDA_OK(cudaDeviceSynchronize());
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {  // the first pays the kernels' first launch
    const auto t0 = std::chrono::steady_clock::now();
    const CudaMoeLayer layer(spec, dw);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("DeepSeek-V3 layer (256 experts + shared, GPTQ int4 g128 sym) packed from device tensors: %.3f s "
                "(%zu bytes packed)\n", s, layer.weight_bytes());
    best = std::min(best, s);
  }
  std::printf("DeepSeek-V3 device pack: best of 3 %.3f s (the issue asks under 0.5 s)\n", best);

  // The C++ loader's path: the same layer from host tensors (uploaded, then packed on the device).
  MoeLayerWeights hw;
  hw.router = dw.router;
  hw.correction_bias = dw.correction_bias;
  auto host_expert = [&](int64_t e) {
    const size_t src = size_t(e % kDistinct);
    const int32_t* qwp = qw.data() + qw_e * src;
    const uint16_t* scp = sc.data() + sc_e * src;
    auto lin = [&](int64_t K, int64_t N, const int32_t* w, const uint16_t* s, const int32_t* z, const int32_t* g) {
      QuantizedLinear l;
      l.scheme = q;
      l.K = K;
      l.N = N;
      l.qweight.assign(w, w + K / 8 * N);
      l.qzeros.assign(z, z + K / 128 * N / 8);
      l.scales.resize(size_t(K / 128 * N));
      for (size_t i = 0; i < l.scales.size(); ++i) l.scales[i] = f16_to_float(s[i]);
      l.g_idx.assign(g, g + K);
      return l;
    };
    return ExpertWeights{lin(H, I, qwp, scp, zeros.data(), gidx.data()),
                         lin(H, I, qwp + H / 8 * I, scp + G1 * I, zeros.data() + G1 * I / 8, gidx.data() + H),
                         lin(I, H, qwp + 2 * (H / 8 * I), scp + 2 * G1 * I, zeros.data() + 2 * G1 * I / 8,
                             gidx.data() + 2 * H)};
  };
  for (int64_t e = 0; e < E; ++e) hw.experts.push_back(host_expert(e));
  hw.shared = host_expert(E);
  const auto t0 = std::chrono::steady_clock::now();
  const CudaMoeLayer layer(spec, hw);
  std::printf("DeepSeek-V3 layer from host tensors (validate, upload, pack on the device): %.3f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

}  // namespace
}  // namespace wna16::cuda
#endif
