// Synthetic checkpoint tensors for the CUDA benchmark; see bench_weights.h for why not random_layer.
#include "bench/cuda/bench_weights.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "common/splitmix64.h"
#include "wna16/error.h"
#include "wna16/half.h"
#include "wna16/quant.h"

namespace wna16::cuda::bench {
namespace {

// One stream per linear so the result does not depend on the thread count.
struct Rng : SplitMix64 {
  using SplitMix64::SplitMix64;
  double normal() {  // Box-Muller; one value per call is plenty here
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
};

uint64_t mix(uint64_t a, uint64_t b) { return Rng(a * 0x2545f4914f6cdd1dull ^ b).next(); }

// Zero-point code as the format stores it: GPTQ v1 keeps zero-1, v2 and AWQ the zero itself.
uint32_t stored_zero(Format f, uint32_t zero) { return f == Format::GptqV1 ? zero - 1 : zero; }

struct LinearTask {
  QuantizedLinear* out;
  int64_t K, N;
  uint64_t seed;
  uint64_t order_seed;  // act-order: the channel order's stream
};

void fill_linear(const LinearTask& t, const QuantScheme& s) {
  const int b = s.bits;
  const int per_word = 32 / b;
  const uint32_t code_mask = (1u << b) - 1u;
  const int64_t G = s.num_groups(t.K);
  QuantizedLinear& q = *t.out;
  q.scheme = s;
  q.K = t.K;
  q.N = t.N;
  Rng rng(t.seed);

  // qweight: every bit pattern is a valid set of codes for 4- and 8-bit packing, whichever axis
  // (GPTQ: along K; AWQ: along N with its nibble interleave) the format packs.
  const int64_t qw_words = t.K * t.N / per_word;
  q.qweight.resize(size_t(qw_words));
  for (size_t i = 0; i < q.qweight.size(); i += 2) {  // two words per 64-bit draw
    const uint64_t r = rng.next();
    q.qweight[i] = int32_t(uint32_t(r));
    if (i + 1 < q.qweight.size()) q.qweight[i + 1] = int32_t(uint32_t(r >> 32));
  }

  // qzeros: [G, N/per_word] words in both formats.
  const int64_t qz_words = G * t.N / per_word;
  q.qzeros.resize(size_t(qz_words));
  const uint32_t sym_zero = 1u << (b - 1);
  for (auto& w : q.qzeros) {
    uint32_t word = 0;
    uint64_t r = rng.next();
    for (int j = 0; j < per_word; ++j) {
      // asym: real zero in [1, 2^b - 1] so GPTQ v1 (zero-1) can store it; sym: the fixed midpoint.
      uint32_t zero = s.sym ? sym_zero : 1u + uint32_t((r >> (8 * j)) % code_mask);
      word |= (stored_zero(s.format, zero) & code_mask) << (b * j);
    }
    w = int32_t(word);
  }

  // scales: f16-exact, positive, spread over [0.5, 1.5) x c with c = sqrt(12) / (2^b sqrt(K)):
  // (q - z) over 2^b uniform codes has a standard deviation of about 2^b / sqrt(12).
  const double c = std::sqrt(12.0) / (double(1u << b) * std::sqrt(double(t.K)));
  q.scales.resize(size_t(G * t.N));
  for (auto& v : q.scales) v = f16_to_float(float_to_f16(float(c * (0.5 + rng.uniform()))));

  q.g_idx.clear();
  if (s.act_order && s.group_size != -1) {
    // GPTQ desc_act: channels quantized in a seeded random order; g_idx[perm[i]] = i / group_len.
    const std::vector<int32_t> perm = seeded_perm(t.K, t.order_seed);
    q.g_idx.resize(size_t(t.K));
    const int64_t gl = s.group_len(t.K);
    for (int64_t i = 0; i < t.K; ++i) q.g_idx[size_t(perm[size_t(i)])] = int32_t(i / gl);
  }
  q.bias.clear();
}

// Gate and up share their channel order, as in GPTQ checkpoints: desc_act orders the channels by
// the Hessian of the linear's input, and the two read the same input.
void add_expert_tasks(ExpertWeights& e, int64_t H, int64_t I, uint64_t seed, std::vector<LinearTask>& tasks) {
  tasks.push_back({&e.gate, H, I, mix(seed, 1), mix(seed, 4)});
  tasks.push_back({&e.up, H, I, mix(seed, 2), mix(seed, 4)});
  tasks.push_back({&e.down, I, H, mix(seed, 3), mix(seed, 5)});
}

// Runs f(i) for i in [0, n) on all cores (dynamic scheduling).
template <class F>
void parallel_for(size_t n, F f) {
  const unsigned n_threads = std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(), unsigned(n)));
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < n_threads; ++t)
    pool.emplace_back([&] {
      for (size_t i; (i = next.fetch_add(1)) < n;) f(i);
    });
  for (auto& th : pool) th.join();
}

}  // namespace

std::vector<uint16_t> random_activations(int64_t rows, int64_t H, DType t, uint64_t seed) {
  if (t != DType::BF16 && t != DType::F16) throw Error(std::string("bench: activations must be bf16 or f16, got ") + dtype_name(t));
  std::vector<uint16_t> x(size_t(rows * H));
  constexpr int64_t kRowsPerTask = 64;
  parallel_for(size_t((rows + kRowsPerTask - 1) / kRowsPerTask), [&](size_t task) {
    for (int64_t r = int64_t(task) * kRowsPerTask; r < std::min(rows, int64_t(task + 1) * kRowsPerTask); ++r) {
      Rng rng(mix(seed, uint64_t(r)));
      uint16_t* row = x.data() + r * H;
      for (int64_t h = 0; h < H; ++h) {
        const float v = float(rng.normal());
        row[h] = t == DType::BF16 ? float_to_bf16(v) : float_to_f16(v);
      }
    }
  });
  return x;
}

int64_t linear_stored_bytes(int64_t K, int64_t N, const QuantScheme& s) {
  const int64_t G = s.num_groups(K);
  int64_t bytes = K * N * s.bits / 8 + G * N * 2;  // packed codes + f16 scales
  if (!s.sym) bytes += G * N * s.bits / 8;          // packed zero points
  return bytes;
}

MoeLayerWeights random_bench_layer(const MoeLayerSpec& spec, const QuantScheme& scheme, uint64_t seed) {
  spec.validate();
  if (scheme.bits != 4 && scheme.bits != 8)
    throw Error("bench: bits=" + std::to_string(scheme.bits) + " is not supported by the CUDA kernels (4 or 8)");
  const int64_t H = spec.hidden, I = spec.inter;
  const int E = spec.routing.num_experts;
  scheme.validate(H, I);
  scheme.validate(I, H);

  MoeLayerWeights w;
  Rng rng(mix(seed, 0x5eed));
  w.router.resize(size_t(E) * size_t(H));
  const double rs = 1.0 / std::sqrt(double(H));
  // Exact in bf16, as the router of a real checkpoint is (the layer then keeps it in bf16).
  for (auto& v : w.router) v = round_to(DType::BF16, float(rng.normal() * rs));
  if (spec.routing.method == RoutingMethod::NoauxTc) {
    w.correction_bias.resize(size_t(E));
    // NOTE: small next to the sigmoid scores' spread (~0.2): a trained bias balances the load, and
    // N(0, 0.1) left ~40 of DeepSeek-V3's 256 experts without a token even at M=8192.
    for (auto& v : w.correction_bias) v = float(rng.normal() * 0.02);
  }

  std::vector<LinearTask> tasks;
  w.experts.resize(size_t(E));
  for (int e = 0; e < E; ++e) add_expert_tasks(w.experts[size_t(e)], H, I, mix(seed, uint64_t(e) + 100), tasks);
  if (spec.shared_kind != SharedExpertKind::None) {
    scheme.validate(H, spec.shared_inter);
    scheme.validate(spec.shared_inter, H);
    w.shared.emplace();
    add_expert_tasks(*w.shared, H, spec.shared_inter, mix(seed, 99), tasks);
    if (spec.shared_kind == SharedExpertKind::SigmoidGated) {
      w.shared_gate.resize(size_t(H));
      for (auto& v : w.shared_gate) v = round_to(DType::BF16, float(rng.normal() * rs));
    }
  }

  // Largest linears first so the threads finish together (Mixtral has only 24 big ones).
  std::sort(tasks.begin(), tasks.end(), [](const LinearTask& a, const LinearTask& b) { return a.K * a.N > b.K * b.N; });
  parallel_for(tasks.size(), [&](size_t i) { fill_linear(tasks[i], scheme); });
  return w;
}

std::vector<float> to_float(const uint16_t* p, size_t n, DType t) {
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = t == DType::BF16 ? bf16_to_float(p[i]) : f16_to_float(p[i]);
  return f;
}

}  // namespace wna16::cuda::bench
