// run_cpu_bench: `wna16 bench --device cpu`.
//
// Method (see ../shared/docs/performance.md):
//  - The machine's read bandwidth is measured in the same run: a multi-threaded streaming sum over
//    a buffer of max(4 x LLC, 1 GiB). "%BW" uses the best pass of the whole run as 100%
//    (conservative); "%adj" divides each call's GB/s by the pass streamed just before it (the
//    cache eviction pass), which cancels most of the load from other processes on a shared box.
//  - Layers: random packed codes and random f16 scales generated directly per linear (the RTN
//    quantizer is too slow for the big presets), packed into the checkpoint format by pack(), then
//    loaded by the backend like any checkpoint. Before timing, the benchmarked layer is checked
//    against the float64 reference on a few tokens (PASS/FAIL, non-zero exit on failure).
//  - Each timed call gets fresh activations (rotating among 4 random sets, so routing varies) and
//    runs after the same eviction buffer has been streamed, so every weight comes from DRAM as it
//    does when a model's layers are run one after another.
//  - The compute ceiling too: a register-only fp32 FMA loop of the layer's ISA on every thread
//    (5 passes at the start, one after each case); "%FMA" = GFLOP/s / the best pass of the run,
//    "%FMAadj" = GFLOP/s / the pass right after the case (the same load from other processes).
//  - Bytes per call: the checkpoint-form bytes (codes, f16 scales, zeros unless symmetric) of the
//    experts that received tokens, the shared expert and the fp32 router, plus activations in and
//    out. FLOPs: 2 M (k 3 I H + 3 I_shared H). Median time, min/max as the spread.
//  - --routing zipf:S skews the generated router and activations (bench/routing_skew.h); per row,
//    the tokens on the busiest and on an average active expert, from the reference routing of
//    each input set (the bytes stay the layer's own count of the experts it ran).
//  - Baselines in the same run: the float64 reference (small M only) and the single-threaded
//    scalar per-expert loop (scalar_baseline.h, M <= 16).
//  - --plot FILE.svg: time against M per preset, those baselines and the read-stream floor
//    (bench/plot_svg.h).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "bench/bench.h"
#include "bench/cpu/scalar_baseline.h"
#include "bench/plot_svg.h"
#include "bench/provenance.h"
#include "bench/routing_skew.h"
#include "cpu/cpu_layer.h"
#include "cpu/kernels.h"
#include "cpu/thread_pool.h"
#include "wna16/error.h"
#include "wna16/reference.h"

namespace wna16 {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
double process_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

constexpr int64_t kRefMaxM = 4;                     // float64 reference timed up to this M
constexpr int64_t kBaselineMaxM = 16;               // scalar baseline timed up to this M
constexpr double kBaselineMaxCodes = 3e9;           // skip the baseline above this many codes (1 byte each)
const std::vector<int64_t> kDefaultMs = {1, 4, 16, 64, 256};

// ---- the machine ----------------------------------------------------------------------------
std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t c = line.find(':');
      return c == std::string::npos ? line : line.substr(c + 2);
    }
  return "unknown CPU";
}

int64_t llc_bytes() {
  long v = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (v > 0) return v;
  std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index3/size");
  std::string s;
  if (f >> s && !s.empty()) {
    const int64_t n = std::atoll(s.c_str());
    return s.back() == 'K' ? n << 10 : s.back() == 'M' ? n << 20 : n;
  }
  return 32ll << 20;
}

// Streams buf with every pool thread (one contiguous slice each); returns GB/s.
volatile uint64_t g_sink;
double stream_read(const uint64_t* buf, int64_t words) {
  cpu::ThreadPool& pool = cpu::thread_pool();
  const int T = pool.size();
  std::vector<uint64_t> sums(size_t(T), 0);
  const auto t0 = Clock::now();
  const cpu::StreamSumFn sum = cpu::kernels(cpu::default_isa()).stream_sum;
  pool.run(T, [&](int64_t t, int) {
    const int64_t b = words * t / T, e = words * (t + 1) / T;
    sums[size_t(t)] = sum(buf + b, e - b);
  });
  const double s = since(t0);
  uint64_t all = 0;
  for (uint64_t v : sums) all += v;
  g_sink = all;
  return double(words) * 8 / s / 1e9;
}

// The fp32 FMA peak of the ISA the layer uses: every pool thread runs the register-only FMA loop
// (kernels.h: FmaLoopFn) for about 50 ms; returns GFLOP/s.
double fma_peak(const cpu::Kernels& k) {
  cpu::ThreadPool& pool = cpu::thread_pool();
  const int T = pool.size();
  int64_t iters = 1 << 16;
  for (;;) {  // size the loop so one pass takes about 50 ms
    const auto t0 = Clock::now();
    k.fma_loop(iters);
    if (since(t0) > 0.05 || iters > (int64_t(1) << 40)) break;
    iters *= 4;
  }
  std::vector<double> flops(size_t(T), 0);
  const auto t0 = Clock::now();
  pool.run(T, [&](int64_t t, int) { flops[size_t(t)] = k.fma_loop(iters); });
  const double s = since(t0);
  double all = 0;
  for (double f : flops) all += f;
  return all / s / 1e9;
}

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// ---- random layers in checkpoint form ----------------------------------------------------------
struct SplitMix {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return double(next() >> 11) * (1.0 / 9007199254740992.0); }
};

// Uniform random codes, f16 scales ~ 1/(sqrt(K) 2^(b-1)) so weights are O(1/sqrt(K)), zeros
// 2^(b-1) (sym) or uniform in [1, 2^b - 1] (storable by every format), act-order g_idx from a
// random permutation (as GPTQ's desc_act produces).
QuantizedLinear random_quantized(int64_t K, int64_t N, const QuantScheme& q, uint64_t seed) {
  q.validate(K, N);
  SplitMix rng{seed};
  UnpackedLinear u;
  u.bits = q.bits;
  u.K = K;
  u.N = N;
  u.groups = q.num_groups(K);
  const int levels = 1 << q.bits;
  u.q.resize(size_t(K * N));
  for (size_t i = 0; i < u.q.size(); i += 8) {
    const uint64_t r = rng.next();
    for (size_t j = 0; j < 8 && i + j < u.q.size(); ++j) u.q[i + j] = uint8_t((r >> (8 * j)) & uint64_t(levels - 1));
  }
  u.zeros.resize(size_t(u.groups * N));
  for (auto& z : u.zeros) z = q.sym ? levels / 2 : 1 + int32_t(rng.next() % uint64_t(levels - 1));
  u.scales.resize(u.zeros.size());
  const double s0 = 1.0 / (std::sqrt(double(K)) * (levels / 2));
  for (auto& s : u.scales) s = f16_to_float(float_to_f16(float(s0 * (0.5 + rng.uniform()))));
  u.g_idx.resize(size_t(K));
  const int64_t len = q.group_len(K);
  if (q.act_order) {
    std::vector<int32_t> perm(static_cast<size_t>(K));
    for (int64_t i = 0; i < K; ++i) perm[size_t(i)] = int32_t(i);
    for (int64_t i = K - 1; i > 0; --i) std::swap(perm[size_t(i)], perm[size_t(rng.next() % uint64_t(i + 1))]);
    for (int64_t i = 0; i < K; ++i) u.g_idx[size_t(perm[size_t(i)])] = int32_t(i / len);
  } else {
    for (int64_t k = 0; k < K; ++k) u.g_idx[size_t(k)] = int32_t(k / len);
  }
  return pack(u, q);
}

std::vector<float> normals(int64_t n, double sd, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, sd);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = float(nd(rng));
  return v;
}

MoeLayerWeights bench_layer(const MoeLayerSpec& spec, const QuantScheme& q, uint64_t seed) {
  const int64_t H = spec.hidden, E = spec.routing.num_experts;
  MoeLayerWeights w;
  w.router = normals(E * H, 1.0 / std::sqrt(double(H)), seed);
  if (spec.routing.method == RoutingMethod::NoauxTc) w.correction_bias = normals(E, 0.1, seed + 1);
  if (spec.shared_kind == SharedExpertKind::SigmoidGated) w.shared_gate = normals(H, 1.0 / std::sqrt(double(H)), seed + 2);
  w.experts.resize(size_t(E));
  const bool shared = spec.shared_kind != SharedExpertKind::None;
  if (shared) w.shared.emplace();
  cpu::thread_pool().run(E + (shared ? 1 : 0), [&](int64_t e, int) {
    ExpertWeights& ex = e < E ? w.experts[size_t(e)] : *w.shared;
    const int64_t I = e < E ? spec.inter : spec.shared_inter;
    const uint64_t s = seed * 1000003 + uint64_t(e) * 3;
    ex.gate = random_quantized(H, I, q, s + 10);
    ex.up = random_quantized(H, I, q, s + 11);
    ex.down = random_quantized(I, H, q, s + 12);
  });
  return w;
}

// Activations of dtype act (N(0,1)): bits, and their float values for the reference.
struct Act {
  std::vector<uint16_t> bits;
  std::vector<float> values;
};
Act random_act(int64_t n, DType act, uint64_t seed) {
  Act a;
  a.values = normals(n, 1.0, seed);
  a.bits.resize(a.values.size());
  for (size_t i = 0; i < a.values.size(); ++i) {
    a.bits[i] = act == DType::F16 ? float_to_f16(a.values[i]) : float_to_bf16(a.values[i]);
    a.values[i] = act == DType::F16 ? f16_to_float(a.bits[i]) : bf16_to_float(a.bits[i]);
  }
  return a;
}

// --routing: the skew's x[:, 0] on both forms of rows x [rows, H].
Act skewed(Act a, const bench::RoutingSkew& s, int64_t H, DType act) {
  const int64_t rows = int64_t(a.values.size()) / H;
  bench::skew_activations(s, a.values.data(), rows, H);
  bench::skew_activations(s, a.bits.data(), rows, H, act);
  return a;
}

double error_vs_reference(MoeBackendLayer& layer, const MoeLayerSpec& spec, const MoeLayerWeights& w,
                          const bench::RoutingSkew& skew, int64_t M, DType act, uint64_t seed) {
  const Act x = skewed(random_act(M * spec.hidden, act, seed), skew, spec.hidden, act);
  std::vector<uint16_t> out(x.bits.size(), 0xFFFF);  // NaN poison
  layer.forward_host(x.bits.data(), out.data(), M, act);
  std::vector<float> got(out.size());
  for (size_t i = 0; i < out.size(); ++i) got[i] = act == DType::F16 ? f16_to_float(out[i]) : bf16_to_float(out[i]);
  const std::vector<double> ref = moe_reference(spec, w, x.values.data(), M);
  return rel_error(got.data(), ref.data(), M * spec.hidden);
}

struct CaseResult {
  std::string model;
  int64_t M = 0;
  double us = 0, us_min = 0, us_max = 0;
  int reps = 0;
  double experts = 0;  // mean routed experts with tokens
  double tokens_max = 0, tokens_mean = 0;  // tokens on the busiest / an average active expert (mean over calls)
  double mbytes = 0;   // mean MB read per call
  double gbs = 0, pct_bw = 0, gflops = 0, pct_fma = 0;
  double pct_fma_adj = 0;  // GFLOP/s / the FMA pass run right after the case (same machine load)
  double pct_adj = 0;  // median over calls of GB/s / the stream GB/s measured just before it
  // Process CPU time / (wall x threads) over the case's timed loop (calls and eviction passes,
  // all of which use every thread). NOTE: not per call: the kernel charges other threads' time at
  // scheduler ticks, which undercounts calls of a few milliseconds.
  double cpu_share = 0;
  double ref_us = NAN, base_us = NAN;
  double check_err = 0;
  bool pass = true;
};

std::string fmt_or_na(double v, const char* f) {
  if (!std::isfinite(v)) return "n/a";
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

// "E8 k2 H256 I128", with " shared N" when the preset has a shared expert.
std::string shape_of(const MoeLayerSpec& spec) {
  char b[128];
  std::snprintf(b, sizeof b, "E%d k%d H%lld I%lld", spec.routing.num_experts, spec.routing.top_k,
                static_cast<long long>(spec.hidden), static_cast<long long>(spec.inter));
  std::string s = b;
  if (spec.shared_kind != SharedExpertKind::None) s += " shared " + std::to_string(spec.shared_inter);
  return s;
}

// The --plot figure: per preset our layer, then the baselines timed in the same run (the scalar
// per-expert loop and the float64 reference, at the M they were timed), and the read-stream floor
// per M (the bytes of the %BW column over the best read bandwidth of the run; no compute ceiling).
bench::PlotInput plot_input(std::vector<bench::PlotPreset> presets, const std::vector<CaseResult>& results, double bw) {
  bench::PlotInput in;
  in.ceilings = {"read " + fmt_or_na(bw, "%.1f") + " GB/s (best stream pass of the run)"};
  for (bench::PlotPreset& p : presets) {
    bench::PlotSeries ours{"wna16", {}}, scalar{"scalar per-expert loop (1 thread)", {}}, ref{"float64 reference", {}};
    for (const CaseResult& r : results) {
      if (r.model != p.name) continue;
      ours.points.push_back({r.M, r.us});
      if (std::isfinite(r.base_us)) scalar.points.push_back({r.M, r.base_us});
      if (std::isfinite(r.ref_us)) ref.points.push_back({r.M, r.ref_us});
      p.floor.push_back({r.M, 1e3 * r.mbytes / bw});  // MB / (GB/s) = ms
    }
    p.series.push_back(std::move(ours));
    for (bench::PlotSeries* b : {&scalar, &ref})
      if (!b->points.empty()) p.series.push_back(std::move(*b));
  }
  in.presets = std::move(presets);
  return in;
}

}  // namespace

int run_cpu_bench(const BenchOptions& o) {
  std::vector<std::string> models = o.models;
  if (models.empty())
    for (const auto& n : preset_names())
      if (n != "small") models.push_back(n);
  const std::vector<int64_t> ms = o.ms.empty() ? kDefaultMs : o.ms;
  for (int64_t m : ms)
    if (m <= 0) throw Error("bench: M=" + std::to_string(m) + " must be positive");
  const DType act = o.act == DType::F32 ? DType::BF16 : o.act;
  const double min_s = o.min_seconds > 0 ? o.min_seconds : 1.0;
  cpu::ThreadPool& pool = cpu::thread_pool();
  const cpu::Isa isa = cpu::default_isa();

  // ---- the ceiling: read bandwidth, measured now ---------------------------------------------
  const int64_t llc = llc_bytes();
  const int64_t evict_bytes = std::max<int64_t>(4 * llc, int64_t(1) << 30);
  const int64_t words = evict_bytes / 8;
  std::unique_ptr<uint64_t[]> evict(new uint64_t[size_t(words)]);
  pool.run(pool.size(), [&](int64_t t, int) {
    for (int64_t i = words * t / pool.size(); i < words * (t + 1) / pool.size(); ++i) evict[size_t(i)] = uint64_t(i);
  });
  std::vector<double> bw_runs;
  for (int i = 0; i < 7; ++i) bw_runs.push_back(stream_read(evict.get(), words));
  const double bw_start = *std::max_element(bw_runs.begin(), bw_runs.end());
  const double bw_med = median(bw_runs);
  double bw_best = bw_start;  // raised by every later eviction pass: the best of the whole run
  // The compute ceiling, measured now too: the best of 5 passes of the ISA's FMA loop.
  double fma_best = 0;
  for (int i = 0; i < 5; ++i) fma_best = std::max(fma_best, fma_peak(cpu::kernels(isa)));

  const std::string machine = cpu_model();
  const std::string commit = bench::git_commit(), date = bench::utc_now();
  std::printf("wna16 bench (cpu): %s, %d threads, ISA %s, LLC %.0f MiB\n", machine.c_str(), pool.size(),
              cpu::isa_name(isa), double(llc) / (1 << 20));
  std::printf("date %s, commit %s, scheme %s, activations %s, routing %s\n", date.c_str(), commit.c_str(),
              o.scheme.describe().c_str(), dtype_name(act), o.routing.name().c_str());
  std::printf("read bandwidth (%d threads, %.0f MiB streamed) at start: best %.2f GB/s, median %.2f GB/s\n",
              pool.size(), double(evict_bytes) / (1 << 20), bw_start, bw_med);
  std::printf("fp32 FMA peak (%s register-only FMA loop, %d threads) at start: %.1f GFLOP/s; %%FMA = GFLOP/s / the\n"
              "best FMA pass of the whole run (sampled again after each case; printed at the end)\n",
              cpu::isa_name(isa), pool.size(), fma_best);
  std::printf("%%BW = GB/s / the best stream pass of the whole run (printed at the end); %%adj = median over calls\n"
              "of GB/s / the stream pass run just before that call (same machine load); cpu%% = process CPU time /\n"
              "(wall x threads) over the case's timed loop (below 100: other processes took the cores)\n");

  std::vector<CaseResult> results;
  std::vector<bench::PlotPreset> plot_presets;  // name and shape; the series are filled at the end
  bool all_pass = true;
  for (const std::string& name : models) {
    const MoeLayerSpec spec = preset(name);
    const int64_t H = spec.hidden, I = spec.inter, k = spec.routing.top_k;
    plot_presets.push_back({name, shape_of(spec), {}, {}});
    auto t_gen = Clock::now();
    MoeLayerWeights w = bench_layer(spec, o.scheme, 1234);
    const bench::RoutingSkew skew = bench::apply_routing(spec, o.routing, w, 1234);
    const double gen_s = since(t_gen);
    auto t_load = Clock::now();
    cpu::CpuMoeLayer layer(spec, w, isa);
    const double load_s = since(t_load);

    // Correctness of exactly this layer, before any timing.
    const double err = error_vs_reference(layer, spec, w, skew, 3, act, 99);
    const bool pass = err <= layer_tolerance(act);
    all_pass = all_pass && pass;
    const double codes = double(spec.routing.num_experts) * 3 * double(H * I) +
                         (spec.shared_kind != SharedExpertKind::None ? 3.0 * double(H * spec.shared_inter) : 0.0);
    std::unique_ptr<MoeBackendLayer> baseline;
    if (codes <= kBaselineMaxCodes && *std::min_element(ms.begin(), ms.end()) <= kBaselineMaxM)
      baseline = cpu::make_scalar_baseline(spec, w);
    std::printf("\n%s: H=%lld I=%lld E=%d k=%lld%s | generate %.1f s, load %.1f s | check vs float64 reference "
                "(M=3): rel err %.2e, tol %.1e: %s\n",
                name.c_str(), (long long)H, (long long)I, spec.routing.num_experts, (long long)k,
                spec.shared_kind == SharedExpertKind::None
                    ? ""
                    : (" shared " + std::to_string(spec.shared_inter)).c_str(),
                gen_s, load_s, err, layer_tolerance(act), pass ? "PASS" : "FAIL");
    std::printf("%6s %10s %19s %8s %8s %8s %6s %5s %8s %6s %11s %8s %11s %8s %7s %7s\n", "M", "us",
                "spread(min-max)", "experts", "MB", "GB/s", "%adj", "cpu%", "GFLOP/s", "%FMA", "ref us", "x ref",
                "scalar us", "x scal", "max/e", "mean/e");

    for (int64_t M : ms) {
      CaseResult r;
      r.model = name;
      r.M = M;
      r.check_err = err;
      r.pass = pass;
      std::vector<Act> xs;
      // Per set, the routing the reference computes for it (its bytes are the layer's own count).
      std::vector<bench::CallCost> routed;
      for (int i = 0; i < 4; ++i) {
        xs.push_back(skewed(random_act(M * H, act, 1000 + uint64_t(M) * 10 + uint64_t(i)), skew, H, act));
        const std::vector<int32_t> ids = bench::route_rows(spec, w, xs.back().values.data(), M);
        const std::vector<int> counts = bench::expert_counts(ids.data(), M, int(k), spec.routing.num_experts);
        routed.push_back(bench::call_cost(counts, M, {}));
      }
      std::vector<uint16_t> out(size_t(M * H));
      const double flops = 2.0 * double(M) *
                           (double(k) * 3 * double(I) * double(H) +
                            (spec.shared_kind != SharedExpertKind::None ? 3.0 * double(spec.shared_inter) * double(H) : 0));
      layer.forward_host(xs[0].bits.data(), out.data(), M, act);  // warm-up (allocates scratch)
      std::vector<double> times, rates, rel;
      double bytes_sum = 0, experts_sum = 0;
      const auto t_case = Clock::now();
      const double cpu_case = process_cpu_seconds();
      for (int rep = 0; rep < 200; ++rep) {
        // Cold caches, as between the layers of a model; the pass is also a bandwidth sample taken
        // under the same machine load as the call that follows.
        const double bw_now = stream_read(evict.get(), words);
        bw_best = std::max(bw_best, bw_now);
        const Act& x = xs[size_t(rep) % xs.size()];
        const auto t0 = Clock::now();
        layer.forward_host(x.bits.data(), out.data(), M, act);
        const double t = since(t0);
        const double bytes = double(layer.last_stats().weight_bytes) + double(M * H * 2 * 2);
        times.push_back(t);
        rates.push_back(bytes / t / 1e9);
        rel.push_back(100.0 * bytes / t / 1e9 / bw_now);
        bytes_sum += bytes;
        experts_sum += double(layer.last_stats().active_experts);
        r.tokens_max += double(routed[size_t(rep) % xs.size()].max_tokens);
        r.tokens_mean += routed[size_t(rep) % xs.size()].mean_tokens;
        if (rep + 1 >= 5 && since(t_case) > min_s) break;
        if (rep + 1 >= 3 && since(t_case) > 10 * min_s) break;
      }
      r.reps = int(times.size());
      r.us = median(times) * 1e6;
      r.us_min = *std::min_element(times.begin(), times.end()) * 1e6;
      r.us_max = *std::max_element(times.begin(), times.end()) * 1e6;
      r.mbytes = bytes_sum / double(r.reps) / 1e6;
      r.experts = experts_sum / double(r.reps);
      r.tokens_max /= double(r.reps);
      r.tokens_mean /= double(r.reps);
      r.gbs = median(rates);
      r.pct_adj = median(rel);
      r.cpu_share = 100.0 * (process_cpu_seconds() - cpu_case) / (since(t_case) * pool.size());
      r.gflops = flops / (r.us * 1e-6) / 1e9;
      // Like the bandwidth, the FMA peak is sampled again after each case: %FMA uses the best pass
      // of the run, %FMAadj this one (taken under about the load the case ran under).
      const double fma_now = fma_peak(cpu::kernels(isa));
      fma_best = std::max(fma_best, fma_now);
      r.pct_fma = 100.0 * r.gflops / fma_best;
      r.pct_fma_adj = 100.0 * r.gflops / fma_now;
      if (M <= kRefMaxM) {
        stream_read(evict.get(), words);
        const auto t0 = Clock::now();
        const std::vector<double> ref = moe_reference(spec, w, xs[0].values.data(), M);
        r.ref_us = since(t0) * 1e6;
      }
      if (baseline && M <= kBaselineMaxM) {
        std::vector<double> bt;
        for (int rep = 0; rep < (M == 1 ? 3 : 1); ++rep) {
          stream_read(evict.get(), words);
          const auto t0 = Clock::now();
          baseline->forward_host(xs[size_t(rep) % xs.size()].bits.data(), out.data(), M, act);
          bt.push_back(since(t0));
        }
        r.base_us = median(bt) * 1e6;
      }
      std::printf("%6lld %10.1f %19s %8.1f %8.2f %8.2f %5.1f%% %4.0f%% %8.1f %5.1f%% %11s %8s %11s %8s %7.1f %7.1f\n",
                  (long long)M, r.us,
                  (fmt_or_na(r.us_min, "%.0f") + "-" + fmt_or_na(r.us_max, "%.0f")).c_str(), r.experts, r.mbytes,
                  r.gbs, r.pct_adj, r.cpu_share, r.gflops, r.pct_fma, fmt_or_na(r.ref_us, "%.0f").c_str(),
                  fmt_or_na(r.ref_us / r.us, "%.1f").c_str(), fmt_or_na(r.base_us, "%.0f").c_str(),
                  fmt_or_na(r.base_us / r.us, "%.1f").c_str(), r.tokens_max, r.tokens_mean);
      std::fflush(stdout);
      results.push_back(r);
    }
  }

  // ---- % of the best bandwidth seen in the whole run (conservative: a max over many passes) -----
  const double bw = bw_best;
  for (CaseResult& r : results) {
    r.pct_bw = 100.0 * r.gbs / bw;
    r.pct_fma = 100.0 * r.gflops / fma_best;
  }
  std::printf("\nISA %s; best read bandwidth over the run: %.2f GB/s (= 100%% of %%BW); fp32 FMA peak %.1f GFLOP/s\n",
              cpu::isa_name(isa), bw, fma_best);
  std::printf("%-20s %6s %10s %8s %7s %7s %8s %6s %8s %5s\n", "model", "M", "us", "GB/s", "%BW", "%adj", "GFLOP/s",
              "%FMA", "%FMAadj", "cpu%");
  for (const CaseResult& r : results)
    std::printf("%-20s %6lld %10.1f %8.2f %6.1f%% %6.1f%% %8.1f %5.1f%% %7.1f%% %4.0f%%\n", r.model.c_str(),
                (long long)r.M, r.us, r.gbs, r.pct_bw, r.pct_adj, r.gflops, r.pct_fma, r.pct_fma_adj, r.cpu_share);

  // ---- JSON / CSV --------------------------------------------------------------------------
  auto num = [](double v) { return std::isfinite(v) ? fmt_or_na(v, "%.6g") : std::string("null"); };
  if (!o.json_path.empty()) {
    std::ofstream f(o.json_path);
    if (!f) throw Error("bench: cannot write --json " + o.json_path);
    f << "{\n  \"device\": \"cpu\",\n  \"machine\": \"" << machine << "\",\n  \"threads\": " << pool.size()
      << ",\n  \"isa\": \"" << cpu::isa_name(isa) << "\",\n  \"date\": \"" << date << "\",\n  \"commit\": \"" << commit
      << "\",\n  \"scheme\": \"" << o.scheme.describe() << "\",\n  \"dtype\": \"" << dtype_name(act)
      << "\",\n  \"routing\": \"" << o.routing.name()
      << "\",\n  \"read_bandwidth_gbs\": " << num(bw) << ",\n  \"read_bandwidth_start_median_gbs\": " << num(bw_med)
      << ",\n  \"fma_peak_gflops\": " << num(fma_best)
      << ",\n  \"cases\": [\n";
    for (size_t i = 0; i < results.size(); ++i) {
      const CaseResult& r = results[i];
      f << "    {\"model\": \"" << r.model << "\", \"M\": " << r.M << ", \"us\": " << num(r.us)
        << ", \"us_min\": " << num(r.us_min) << ", \"us_max\": " << num(r.us_max) << ", \"reps\": " << r.reps
        << ", \"routing\": \"" << o.routing.name() << "\", \"active_experts\": " << num(r.experts)
        << ", \"tokens_per_expert_max\": " << num(r.tokens_max)
        << ", \"tokens_per_expert_mean\": " << num(r.tokens_mean)
        << ", \"mbytes\": " << num(r.mbytes)
        << ", \"gbs\": " << num(r.gbs) << ", \"pct_bw\": " << num(r.pct_bw) << ", \"pct_bw_adjacent\": " << num(r.pct_adj)
        << ", \"cpu_share_pct\": " << num(r.cpu_share) << ", \"gflops\": " << num(r.gflops)
        << ", \"pct_fma\": " << num(r.pct_fma) << ", \"pct_fma_adjacent\": " << num(r.pct_fma_adj)
        << ", \"ref_us\": " << num(r.ref_us) << ", \"speedup_ref\": " << num(r.ref_us / r.us)
        << ", \"scalar_us\": " << num(r.base_us) << ", \"speedup_scalar\": " << num(r.base_us / r.us)
        << ", \"check_rel_err\": " << num(r.check_err) << ", \"pass\": " << (r.pass ? "true" : "false") << "}"
        << (i + 1 < results.size() ? "," : "") << "\n";
    }
    f << "  ]\n}\n";
  }
  if (!o.csv_path.empty()) {
    std::ofstream f(o.csv_path);
    if (!f) throw Error("bench: cannot write --csv " + o.csv_path);
    f << "device,machine,threads,isa,date,commit,scheme,dtype,read_bw_gbs,model,M,us,us_min,us_max,reps,"
         "active_experts,mbytes,gbs,pct_bw,pct_bw_adjacent,cpu_share_pct,gflops,ref_us,speedup_ref,scalar_us,speedup_scalar,check_rel_err,pass,"
         "routing,tokens_per_expert_max,tokens_per_expert_mean,fma_peak_gflops,pct_fma,pct_fma_adjacent\n";
    for (const CaseResult& r : results)
      f << "cpu,\"" << machine << "\"," << pool.size() << "," << cpu::isa_name(isa) << "," << date << "," << commit
        << ",\"" << o.scheme.describe() << "\"," << dtype_name(act) << "," << num(bw) << "," << r.model << "," << r.M
        << "," << num(r.us) << "," << num(r.us_min) << "," << num(r.us_max) << "," << r.reps << ","
        << num(r.experts) << "," << num(r.mbytes) << "," << num(r.gbs) << "," << num(r.pct_bw) << ","
        << num(r.pct_adj) << "," << num(r.cpu_share) << ","
        << num(r.gflops) << "," << num(r.ref_us) << "," << num(r.ref_us / r.us) << "," << num(r.base_us) << ","
        << num(r.base_us / r.us) << "," << num(r.check_err) << "," << (r.pass ? "true" : "false") << ","
        << o.routing.name() << "," << num(r.tokens_max) << "," << num(r.tokens_mean) << "," << num(fma_best) << ","
        << num(r.pct_fma) << "," << num(r.pct_fma_adj) << "\n";
  }
  if (!o.plot_path.empty()) {
    bench::PlotInput plot = plot_input(std::move(plot_presets), results, bw);
    plot.title = std::string("wna16 bench --device cpu: ") + o.scheme.describe() + ", " + dtype_name(act) +
                 (o.routing.uniform() ? "" : ", routing " + o.routing.name());
    plot.provenance = date + ", " + machine + " (" + std::to_string(pool.size()) + " threads, " + cpu::isa_name(isa) +
                      "), commit " + commit;
    bench::write_svg(plot, o.plot_path);
    std::printf("plot: %s\n", o.plot_path.c_str());
  }
  std::printf("\n%s\n", all_pass ? "PASSED" : "FAILED (a benchmarked layer does not match the float64 reference)");
  return all_pass ? 0 : 1;
}

}  // namespace wna16
