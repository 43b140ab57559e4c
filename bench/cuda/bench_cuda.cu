// `wna16 bench --device cuda`: the whole MoE layer per model preset and token count, against the
// two ceilings measured in the same run (read stream, cuBLAS bf16) and two baselines (the
// per-expert loop, cuBLAS bf16 GEMMs on dequantized weights). See docs/perf.md for the method and
// ../shared/docs/performance.md for the floors.
//
// Method, per preset:
//  1. Synthetic checkpoint tensors (bench_weights.h), loaded into L copies of CudaMoeLayer, L
//     chosen so the copies total many times the L2 size (1 for DeepSeek-V3's 5.8 GB).
//  2. A pool of P random token rows (--routing zipf:S: skewed through the inputs, routing_skew.h);
//     the routing of every row is computed once (fp32 logits on the device, route_reference on the
//     host) to count the tokens per expert of each call: the floor of that call's own routing.
//  3. Correctness: the layer and the loop baseline at M=1 and at the largest M against
//     moe_reference on a few rows (poisoned outputs); FAILED and a non-zero exit on any miss.
//  4. Per M: a CUDA graph of G layer calls rotating over (weight set, input slice), so consecutive
//     calls touch different experts and the L2 stays cold; median over replays / G.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <unistd.h>  // environ

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench.h"
#include "bench/cuda/align_bench.h"
#include "bench/cuda/bench_kernels.h"
#include "bench/cuda/bench_report.h"
#include "bench/cuda/bench_weights.h"
#include "bench/cuda/device_timing.h"
#include "bench/plot_svg.h"
#include "bench/provenance.h"
#include "bench/routing_skew.h"
#include "cuda/cuda_check.h"
#include "cuda/dispatch.h"
#include "wna16/backend.h"
#include "wna16/cuda.h"
#include "wna16/cuda_kernels.h"
#include "wna16/error.h"
#include "wna16/reference.h"

namespace wna16::cuda::bench {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

const std::vector<int64_t> kDefaultMs = {1, 4, 16, 64, 256, 1024, 4096, 8192};
constexpr double kDefaultCaseSeconds = 0.1;  // timed replays per variant and case (adaptive count)
constexpr int kMaxCalls = 16;                // layer calls per graph: the rotation length
constexpr double kColdFactor = 8.0;          // bytes touched per replay >= this x L2 where possible
constexpr int kMaxWeightSets = 8;
constexpr double kWeightSetsBudget = 8e9;    // bytes of rotated weight copies per preset
constexpr int kAlignE = 256;
constexpr int64_t kAlignSlots = 32768;
constexpr int kAlignBlockM = 64;

uint64_t name_seed(const std::string& s) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (char c : s) h = (h ^ uint8_t(c)) * 1099511628211ull;
  return h;
}

struct Ctx {
  explicit Ctx(const BenchOptions& o) : opts(o), act(o.act) {}
  const BenchOptions& opts;
  DType act;
  size_t act_size = 2;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  Ceilings ceil;
  double budget_s = kDefaultCaseSeconds;
};

// The shape facts of a preset the benchmark counts with.
struct Shape {
  int E = 0, k = 0;
  int64_t H = 0, I = 0, Is = 0;  // Is: shared expert width (0 = none)
  int64_t expert_bytes = 0, shared_bytes = 0, fixed_bytes = 0;  // fixed: router (+ shared gate), read every call
  explicit Shape(const MoeLayerSpec& spec, const QuantScheme& sc) {
    E = spec.routing.num_experts;
    k = spec.routing.top_k;
    H = spec.hidden;
    I = spec.inter;
    Is = spec.shared_kind == SharedExpertKind::None ? 0 : spec.shared_inter;
    expert_bytes = 2 * linear_stored_bytes(H, I, sc) + linear_stored_bytes(I, H, sc);
    shared_bytes = Is ? 2 * linear_stored_bytes(H, Is, sc) + linear_stored_bytes(Is, H, sc) : 0;
    // The router as bf16 is the least any implementation reads (the spec stores it in fp32).
    fixed_bytes = int64_t(E) * H * 2 + (spec.shared_kind == SharedExpertKind::SigmoidGated ? H * 2 : 0);
  }
  int64_t set_bytes() const { return E * expert_bytes + shared_bytes; }
  ::wna16::bench::CostModel cost(size_t act_size) const {
    return {expert_bytes, shared_bytes + fixed_bytes, H, I, Is, int64_t(act_size)};
  }
};

// The rotation for one M: call i uses weight set i % sets and input slice i % slices (rows
// [slice*M, slice*M + M) of the pool). Counts of tokens per expert for each slice used, and the
// floor's bytes and FLOPs of those routings (call_cost), averaged over the calls.
struct Schedule {
  int64_t M = 0;
  int calls = 0;
  int64_t slices = 0;
  std::vector<std::vector<int>> counts;  // [slice][expert]
  double bytes_avg = 0, flops_avg = 0, experts_avg = 0, tokens_max_avg = 0, tokens_mean_avg = 0;
  int slice_of(int i) const { return int(i % slices); }
};

Schedule make_schedule(const Shape& sh, const std::vector<int32_t>& ids, int64_t P, int64_t M, int sets, int64_t l2,
                       size_t act_size) {
  Schedule s;
  s.M = M;
  s.slices = std::max<int64_t>(1, P / M);
  auto slice_counts = [&](int64_t slice) {
    return ::wna16::bench::expert_counts(ids.data() + slice * M * sh.k, M, sh.k, sh.E);
  };
  const ::wna16::bench::CostModel model = sh.cost(act_size);
  const double b0 = ::wna16::bench::call_cost(slice_counts(0), M, model).bytes;
  s.calls = int(std::clamp(std::ceil(kColdFactor * double(l2) / b0), 2.0, double(kMaxCalls)));
  s.calls = std::max(s.calls, sets);
  const int64_t used_slices = std::min<int64_t>(s.slices, s.calls);
  for (int64_t i = 0; i < used_slices; ++i) s.counts.push_back(slice_counts(i));
  for (int i = 0; i < s.calls; ++i) {
    const ::wna16::bench::CallCost c = ::wna16::bench::call_cost(s.counts[size_t(s.slice_of(i))], M, model);
    s.bytes_avg += c.bytes / s.calls;
    s.flops_avg += c.flops / s.calls;
    s.experts_avg += double(c.active) / s.calls;
    s.tokens_max_avg += double(c.max_tokens) / s.calls;
    s.tokens_mean_avg += c.mean_tokens / s.calls;
  }
  return s;
}

// Routing of every pool row: fp32 logits on the device (x in act dtype, router fp32), top-k by
// route_reference. Only used to count the experts each call touches and to size the cuBLAS
// baseline's per-expert GEMMs; the layer routes on its own.
std::vector<int32_t> pool_routing(Ctx& cx, const MoeLayerSpec& spec, const MoeLayerWeights& w, const DevBuf& xd, int64_t P) {
  const int E = spec.routing.num_experts;
  const int64_t H = spec.hidden;
  DevBuf xf(size_t(P * H) * sizeof(float)), rd(w.router.size() * sizeof(float)), lg(size_t(P * E) * sizeof(float));
  half_to_float(xd.get(), cx.act, xf.get<float>(), size_t(P * H), cx.stream);
  WNA16_CUDA_CHECK(cudaMemcpyAsync(rd.get(), w.router.data(), rd.size(), cudaMemcpyHostToDevice, cx.stream));
  const float one = 1.0f, zero = 0.0f;
  WNA16_CUBLAS_CHECK(cublasSetStream(cx.cublas, cx.stream));
  // logits[p, e] = sum_h x[p, h] router[e, h]: column-major C (E x P) = router^T-as-(E x H) * x (H x P).
  WNA16_CUBLAS_CHECK(cublasSgemm(cx.cublas, CUBLAS_OP_T, CUBLAS_OP_N, E, int(P), int(H), &one, rd.get<float>(), int(H),
                                 xf.get<float>(), int(H), &zero, lg.get<float>(), E));
  std::vector<float> logits(size_t(P * E));
  WNA16_CUDA_CHECK(cudaMemcpyAsync(logits.data(), lg.get(), lg.size(), cudaMemcpyDeviceToHost, cx.stream));
  WNA16_CUDA_CHECK(cudaStreamSynchronize(cx.stream));
  const float* bias = w.correction_bias.empty() ? nullptr : w.correction_bias.data();
  return route_reference(spec.routing, logits.data(), P, bias).ids;
}

using Layers = std::vector<std::unique_ptr<CudaMoeLayer>>;

// Correctness of the benchmarked layer and of the loop baseline: M=1 (row 0) and M=Mc (rows 0,
// Mc/2, Mc-1) against moe_reference of those rows. The float64 reference is slow for the big
// presets (~15 s a row for DeepSeek-V3), so it runs on host threads while the GPU is timed: the
// outputs are captured first, compared when the reference is done, and a miss still fails the run.
std::vector<int64_t> check_rows(int64_t Mc) {
  std::vector<int64_t> rows = {0};
  if (Mc > 2) rows.push_back(Mc / 2);
  if (Mc > 1) rows.push_back(Mc - 1);
  return rows;
}

// Each token's output depends on that token alone, so the reference runs one row per thread.
std::vector<std::future<std::vector<double>>> start_reference(const MoeLayerSpec& spec, const MoeLayerWeights& w,
                                                              const std::vector<uint16_t>& xh, DType act,
                                                              const std::vector<int64_t>& rows) {
  std::vector<std::future<std::vector<double>>> f;
  for (int64_t r : rows)
    f.push_back(std::async(std::launch::async, [&spec, &w, &xh, act, r] {
      const std::vector<float> x = to_float(xh.data() + r * spec.hidden, size_t(spec.hidden), act);
      return moe_reference(spec, w, x.data(), 1);
    }));
  return f;
}

struct CheckRun {
  std::string label;     // "ours M=1"
  size_t n_rows = 0;     // rows compared (the first n of check_rows)
  std::vector<uint16_t> got;
  std::string error;     // the call threw
};

std::vector<CheckRun> check_forwards(Ctx& cx, int64_t H, const Layers& layers, const DevBuf& xd, int64_t Mc,
                                     const DevBuf& ws, const DevBuf& out) {
  const std::vector<int64_t> rows = check_rows(Mc);
  std::vector<int64_t> check_ms = {1};
  if (Mc > 1) check_ms.push_back(Mc);
  std::vector<CheckRun> runs;
  for (const bool loop : {false, true})
    for (const int64_t M : check_ms) {
      CheckRun r;
      r.label = std::string(loop ? "loop" : "ours") + " M=" + std::to_string(M);
      r.n_rows = M == 1 ? 1 : rows.size();
      try {
        // Poison: 0xFFFF is a NaN in both bf16 and f16, so an unwritten element fails the check.
        WNA16_CUDA_CHECK(cudaMemsetAsync(out.get(), 0xFF, size_t(M * H) * cx.act_size, cx.stream));
        if (loop)
          layers[0]->forward_per_expert_loop(xd.get(), out.get(), M, cx.act, ws.get(), ws.size(), cx.stream);
        else
          layers[0]->forward(xd.get(), out.get(), M, cx.act, ws.get(), ws.size(), cx.stream);
        WNA16_CUDA_CHECK_LAUNCH();
        WNA16_CUDA_CHECK(cudaStreamSynchronize(cx.stream));
        r.got.resize(r.n_rows * size_t(H));
        for (size_t i = 0; i < r.n_rows; ++i)
          WNA16_CUDA_CHECK(cudaMemcpy(r.got.data() + i * H, out.bytes_at(size_t(rows[i] * H) * cx.act_size),
                                      size_t(H) * cx.act_size, cudaMemcpyDeviceToHost));
      } catch (const std::exception& e) {
        r.error = e.what();
      }
      runs.push_back(std::move(r));
    }
  return runs;
}

// Waits for the reference and compares; returns false on any miss.
bool finish_check(Ctx& cx, std::vector<std::future<std::vector<double>>>& ref_f, const std::vector<CheckRun>& runs,
                  PresetInfo& info) {
  std::vector<std::vector<double>> ref;
  for (auto& f : ref_f) ref.push_back(f.get());
  const double tol = layer_tolerance(cx.act);
  info.tolerance = tol;
  bool ok = true;
  for (const CheckRun& r : runs) {
    double err = INFINITY;
    if (r.error.empty()) {
      std::vector<double> want;
      for (size_t i = 0; i < r.n_rows; ++i) want.insert(want.end(), ref[i].begin(), ref[i].end());
      const std::vector<float> g = to_float(r.got.data(), r.got.size(), cx.act);
      err = rel_error(g.data(), want.data(), int64_t(g.size()));
    }
    const bool pass = err <= tol;
    ok = ok && pass;
    char line[768];
    std::snprintf(line, sizeof line, "%s rows %zu rel err %.3e (tol %.1e) %s%s%s", r.label.c_str(), r.n_rows, err, tol,
                  pass ? "PASSED" : "FAILED", r.error.empty() ? "" : ": threw ", r.error.c_str());
    info.checks.push_back(line);
    std::printf("[bench] %s check: %s\n", info.name.c_str(), line);
  }
  return ok;
}

void gemm_tn(cublasHandle_t h, cudaDataType_t t, const void* W, int64_t N, int64_t m, int64_t K, const void* X, int64_t ldx,
             void* Y, int64_t ldy) {
  // Y[m, N] = X[m, K] W^T with W stored [N, K] (torch Linear.weight layout); column-major:
  // C (N x m) = op_T(A: K x N) * B (K x m).
  const float one = 1.0f, zero = 0.0f;
  WNA16_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(m), int(K), &one, W, t, int(K), X, t, int(ldx),
                                  &zero, Y, t, int(ldy), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// cuBLAS bf16 baseline: the same weights dequantized to the activation dtype, one cublasGemmEx per
// expert with tokens for GEMM1 ([m_e, H] x [H, 2I], gate and up in one) and GEMM2 ([m_e, I] x
// [I, H]) (+ the shared expert's two), captured in a graph. GEMMs only: no routing, gather, SiLU or
// top-k sum, so the baseline is favoured.
void bench_cublas(Ctx& cx, const MoeLayerWeights& w, const Shape& sh, int sets,
                  const std::vector<Schedule>& scheds, const DevBuf& xd, std::vector<CaseResult>& cases,
                  PresetInfo& info) {
  const auto t0 = Clock::now();
  const cudaDataType_t ct = cuda_type(cx.act);
  const size_t es = cx.act_size;
  const int64_t w13 = 2 * sh.I * sh.H, w2 = sh.H * sh.I, expert_elems = w13 + w2;
  const int64_t shared_elems = 3 * sh.Is * sh.H;
  const int64_t set_elems = sh.E * expert_elems + shared_elems;
  int64_t maxM = 0;
  for (const auto& s : scheds) maxM = std::max(maxM, s.M);
  const int64_t rows = maxM * sh.k;
  const size_t scratch = size_t(rows * sh.H + rows * 2 * sh.I + rows * sh.H + maxM * 2 * sh.Is + maxM * sh.H) * es;
  size_t free_b = 0, total_b = 0;
  WNA16_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  int copies = sets;
  while (copies > 1 && double(copies * set_elems) * double(es) + double(scratch) > 0.85 * double(free_b)) --copies;
  if (double(set_elems) * double(es) + double(scratch) > 0.9 * double(free_b))
    throw Error("bench: the cuBLAS baseline needs " + std::to_string((set_elems * es + scratch) >> 20) + " MiB, " +
                std::to_string(free_b >> 20) + " MiB free");

  DevBuf wb(size_t(copies * set_elems) * es);
  auto w13_at = [&](int set, int e) { return wb.bytes_at(size_t(set * set_elems + e * expert_elems) * es); };
  auto w2_at = [&](int set, int e) { return wb.bytes_at(size_t(set * set_elems + e * expert_elems + w13) * es); };
  auto sh13_at = [&](int set) { return wb.bytes_at(size_t(set * set_elems + sh.E * expert_elems) * es); };
  auto sh2_at = [&](int set) { return wb.bytes_at(size_t(set * set_elems + sh.E * expert_elems + 2 * sh.Is * sh.H) * es); };

  // Dequantize set 0 on the device from the same checkpoint tensors the layer was built from.
  size_t max_qw = 0, max_qz = 0, max_sc = 0, max_gi = 0;
  auto grow = [&](const QuantizedLinear& q) {
    max_qw = std::max(max_qw, q.qweight.size());
    max_qz = std::max(max_qz, q.qzeros.size());
    max_sc = std::max(max_sc, q.scales.size());
    max_gi = std::max(max_gi, q.g_idx.size());
  };
  for (const auto& e : w.experts) grow(e.gate), grow(e.up), grow(e.down);
  if (w.shared) grow(w.shared->gate), grow(w.shared->up), grow(w.shared->down);
  DevBuf qw(max_qw * 4), qz(max_qz * 4), sc(max_sc * 4), gi(std::max<size_t>(max_gi, 1) * 4);
  auto dequant = [&](const QuantizedLinear& q, char* dst) {
    WNA16_CUDA_CHECK(cudaMemcpyAsync(qw.get(), q.qweight.data(), q.qweight.size() * 4, cudaMemcpyHostToDevice, cx.stream));
    WNA16_CUDA_CHECK(cudaMemcpyAsync(qz.get(), q.qzeros.data(), q.qzeros.size() * 4, cudaMemcpyHostToDevice, cx.stream));
    WNA16_CUDA_CHECK(cudaMemcpyAsync(sc.get(), q.scales.data(), q.scales.size() * 4, cudaMemcpyHostToDevice, cx.stream));
    if (!q.g_idx.empty())
      WNA16_CUDA_CHECK(cudaMemcpyAsync(gi.get(), q.g_idx.data(), q.g_idx.size() * 4, cudaMemcpyHostToDevice, cx.stream));
    DeviceLinear d;
    d.qweight = qw.get<int32_t>();
    d.qzeros = qz.get<int32_t>();
    d.scales = sc.get<float>();
    d.g_idx = q.g_idx.empty() ? nullptr : gi.get<int32_t>();
    d.K = q.K;
    d.N = q.N;
    d.group_len = q.scheme.group_len(q.K);
    d.bits = q.scheme.bits;
    d.format = q.scheme.format;
    dequantize_transposed(d, cx.act, dst, cx.stream);
    WNA16_CUDA_CHECK(cudaStreamSynchronize(cx.stream));  // the staging buffers are reused next
  };
  for (int e = 0; e < sh.E; ++e) {
    const ExpertWeights& x = w.experts[size_t(e)];
    dequant(x.gate, w13_at(0, e));
    dequant(x.up, w13_at(0, e) + size_t(sh.I * sh.H) * es);
    dequant(x.down, w2_at(0, e));
  }
  if (w.shared) {
    dequant(w.shared->gate, sh13_at(0));
    dequant(w.shared->up, sh13_at(0) + size_t(sh.Is * sh.H) * es);
    dequant(w.shared->down, sh2_at(0));
  }
  // The baseline's weights must be the layer's: expert 0's gate, bit for bit against
  // wna16::dequantize rounded once to the activation dtype (the products are exact).
  {
    const QuantizedLinear& g = w.experts[0].gate;
    const std::vector<double> ref = dequantize(g);  // [K=H, N=I]
    std::vector<uint16_t> got(size_t(sh.I * sh.H));
    WNA16_CUDA_CHECK(cudaMemcpy(got.data(), w13_at(0, 0), got.size() * es, cudaMemcpyDeviceToHost));
    int64_t bad = 0;
    for (int64_t n = 0; n < sh.I; ++n)
      for (int64_t kk = 0; kk < sh.H; ++kk) {
        const float want = float(ref[size_t(kk * sh.I + n)]);
        const uint16_t wb16 = cx.act == DType::BF16 ? float_to_bf16(want) : float_to_f16(want);
        bad += got[size_t(n * sh.H + kk)] != wb16;
      }
    if (bad) {
      info.passed = false;
      throw Error("bench: the cuBLAS baseline's dequantized weights differ from wna16::dequantize in " +
                  std::to_string(bad) + " of " + std::to_string(sh.I * sh.H) + " values (expert 0 gate)");
    }
    info.checks.push_back("cuBLAS baseline weights (expert 0 gate) equal wna16::dequantize: PASSED");
  }
  for (int c = 1; c < copies; ++c)
    WNA16_CUDA_CHECK(cudaMemcpyAsync(wb.bytes_at(size_t(c * set_elems) * es), wb.get(), size_t(set_elems) * es,
                                     cudaMemcpyDeviceToDevice, cx.stream));

  // Token rows as if gathered per expert (contents random: the GEMMs' time does not depend on
  // which rows they are), and the per-expert outputs.
  DevBuf xg(size_t(rows * sh.H) * es), y1(size_t(rows * 2 * sh.I) * es), y2(size_t(rows * sh.H) * es);
  DevBuf ys1(size_t(std::max<int64_t>(maxM * 2 * sh.Is, 1)) * es), ys2(size_t(maxM * sh.H) * es);
  fill_random_half(xg.get(), size_t(rows * sh.H), cx.act, 77, 1.0f, cx.stream);
  WNA16_CUDA_CHECK(cudaStreamSynchronize(cx.stream));
  info.bf16_s = seconds_since(t0);
  std::printf("[bench] %s: cuBLAS baseline weights dequantized (%d set(s), %.2f GB) in %.1f s\n", info.name.c_str(), copies,
              double(copies * set_elems) * double(es) / 1e9, info.bf16_s);

  WNA16_CUBLAS_CHECK(cublasSetStream(cx.cublas, cx.stream));
  for (const Schedule& s : scheds) {
    CaseResult* cr = nullptr;
    for (auto& c : cases)
      if (c.M == s.M) cr = &c;
    if (!cr) continue;
    auto enqueue = [&] {
      for (int i = 0; i < s.calls; ++i) {
        const int set = i % copies;
        const int slice = s.slice_of(i);
        const std::vector<int>& cnt = s.counts[size_t(slice)];
        int64_t off = 0;
        for (int e = 0; e < sh.E; ++e) {
          const int64_t m = cnt[size_t(e)];
          if (!m) continue;
          gemm_tn(cx.cublas, ct, w13_at(set, e), 2 * sh.I, m, sh.H, xg.bytes_at(size_t(off * sh.H) * es), sh.H,
                  y1.bytes_at(size_t(off * 2 * sh.I) * es), 2 * sh.I);
          gemm_tn(cx.cublas, ct, w2_at(set, e), sh.H, m, sh.I, y1.bytes_at(size_t(off * 2 * sh.I) * es), 2 * sh.I,
                  y2.bytes_at(size_t(off * sh.H) * es), sh.H);
          off += m;
        }
        if (sh.Is) {
          const char* x = xd.bytes_at(size_t(int64_t(slice) * s.M * sh.H) * es);
          gemm_tn(cx.cublas, ct, sh13_at(set), 2 * sh.Is, s.M, sh.H, x, sh.H, ys1.get(), 2 * sh.Is);
          gemm_tn(cx.cublas, ct, sh2_at(set), sh.H, s.M, sh.Is, ys1.get(), 2 * sh.Is, ys2.get(), sh.H);
        }
      }
    };
    try {
      GraphExec g;
      std::string why;
      const bool graphed = g.capture(cx.stream, enqueue, why);
      if (graphed) {
        cr->cublas = time_calls(cx.stream, s.calls, cx.budget_s, [&] { g.launch(cx.stream); });
      } else {
        cr->cublas = time_calls(cx.stream, s.calls, cx.budget_s, enqueue);
        cr->note += (cr->note.empty() ? "" : "; ") + std::string("cuBLAS eager: ") + why;
      }
      cr->cublas.graph = graphed;
    } catch (const std::exception& e) {
      cr->note += (cr->note.empty() ? "" : "; ") + std::string("cuBLAS: ") + e.what();
    }
  }
}

void bench_preset(Ctx& cx, const std::string& name, const std::vector<int64_t>& ms, PresetInfo& info,
                  std::vector<CaseResult>& cases) {
  const MoeLayerSpec spec = preset(name);
  const QuantScheme& scheme = cx.opts.scheme;
  const Shape sh(spec, scheme);
  {
    char b[256];
    std::snprintf(b, sizeof b, "E%d k%d H%lld I%lld shared %lld, %s", sh.E, sh.k, static_cast<long long>(sh.H),
                  static_cast<long long>(sh.I), static_cast<long long>(sh.Is), routing_name(spec.routing.method));
    info.shape = b;
  }
  info.weights_gb = double(sh.set_bytes()) / 1e9;

  auto t0 = Clock::now();
  MoeLayerWeights w = random_bench_layer(spec, scheme, name_seed(name));
  info.gen_s = seconds_since(t0);
  std::printf("[bench] %s (%s): generated %.2f GB of %s weights in %.1f s\n", name.c_str(), info.shape.c_str(),
              info.weights_gb, scheme.describe().c_str(), info.gen_s);
  t0 = Clock::now();
  const ::wna16::bench::RoutingSkew skew =
      ::wna16::bench::apply_routing(spec, cx.opts.routing, w, name_seed(name) ^ 0x21bf);
  if (!cx.opts.routing.uniform())
    std::printf("[bench] %s: routing %s calibrated in %.1f s\n", name.c_str(), cx.opts.routing.name().c_str(),
                seconds_since(t0));
  std::fflush(stdout);

  // The token pool: P rows, slices of M rows rotate (16 distinct inputs up to M=1024). The
  // reference for the check rows starts now, on host threads, and is collected at the end.
  const int64_t maxM = *std::max_element(ms.begin(), ms.end());
  const int64_t P = std::max<int64_t>(2 * maxM, kMaxCalls * std::min<int64_t>(maxM, 1024));
  std::vector<uint16_t> xh = random_activations(P, sh.H, cx.act, name_seed(name) ^ 0xa5a5);
  ::wna16::bench::skew_activations(skew, xh.data(), P, sh.H, cx.act);
  auto ref_futures = start_reference(spec, w, xh, cx.act, check_rows(maxM));

  // Weight sets rotated so the copies total many times the L2 (bounded in bytes).
  const double l2 = double(cx.ceil.l2_bytes);
  int sets = int(std::clamp(std::ceil(3.0 * kColdFactor * l2 / double(sh.set_bytes())), 1.0, double(kMaxWeightSets)));
  while (sets > 1 && double(sets) * double(sh.set_bytes()) > kWeightSetsBudget) --sets;
  info.weight_sets = sets;

  t0 = Clock::now();
  Layers layers;
  for (int i = 0; i < sets; ++i) layers.push_back(std::make_unique<CudaMoeLayer>(spec, w));
  WNA16_CUDA_CHECK(cudaDeviceSynchronize());
  info.load_s = seconds_since(t0);
  info.device_weights_gb = double(layers[0]->weight_bytes()) / 1e9;
  std::printf("[bench] %s: loaded %d weight set(s) of %.2f GB on the device in %.1f s\n", name.c_str(), sets,
              info.device_weights_gb, info.load_s);
  std::fflush(stdout);

  t0 = Clock::now();
  DevBuf xd(xh.size() * 2);
  WNA16_CUDA_CHECK(cudaMemcpy(xd.get(), xh.data(), xd.size(), cudaMemcpyHostToDevice));
  const std::vector<int32_t> ids = pool_routing(cx, spec, w, xd, P);
  DevBuf ws(layers[0]->workspace_bytes(maxM));
  DevBuf out(size_t(maxM * sh.H) * cx.act_size);

  const std::vector<CheckRun> check_runs = check_forwards(cx, sh.H, layers, xd, maxM, ws, out);
  info.check_s = seconds_since(t0);
  std::printf("[bench] %s: inputs, routing and check launches took %.1f s (workspace %.1f MB); the reference runs meanwhile\n",
              name.c_str(), info.check_s, double(ws.size()) / 1e6);
  std::fflush(stdout);

  std::vector<Schedule> scheds;
  for (int64_t M : ms) {
    const Schedule s = make_schedule(sh, ids, P, M, sets, cx.ceil.l2_bytes, cx.act_size);
    scheds.push_back(s);
    CaseResult c;
    c.preset = name;
    c.M = M;
    c.flops = s.flops_avg;
    c.bytes = s.bytes_avg;
    c.experts_avg = s.experts_avg;
    c.tokens_max_avg = s.tokens_max_avg;
    c.tokens_mean_avg = s.tokens_mean_avg;
    c.correct = info.passed;
    auto call = [&](bool loop, int i) {
      const void* x = xd.bytes_at(size_t(int64_t(s.slice_of(i)) * M * sh.H) * cx.act_size);
      const CudaMoeLayer& L = *layers[size_t(i % sets)];
      if (loop)
        L.forward_per_expert_loop(x, out.get(), M, cx.act, ws.get(), ws.size(), cx.stream);
      else
        L.forward(x, out.get(), M, cx.act, ws.get(), ws.size(), cx.stream);
    };
    // The layer's calls, graph-captured where the capture works.
    auto time_ours = [&](Timing* t, const char* what) {
      try {
        auto enqueue = [&] {
          for (int i = 0; i < s.calls; ++i) call(false, i);
        };
        GraphExec g;
        std::string why;
        const bool graphed = g.capture(cx.stream, enqueue, why);
        if (graphed) {
          *t = time_calls(cx.stream, s.calls, cx.budget_s, [&] { g.launch(cx.stream); });
        } else {
          *t = time_calls(cx.stream, s.calls, cx.budget_s, enqueue);
          c.note = "graph capture refused (" + why + "): eager launches timed";
        }
        t->graph = graphed;
      } catch (const std::exception& e) {
        // A layer that throws on a valid M is a failure, not a missing number.
        c.note = std::string(what) + ": " + e.what();
        info.passed = false;
        info.checks.push_back(std::string(what) + " M=" + std::to_string(M) + " threw while timed: " + e.what());
      }
    };
    time_ours(&c.ours, "ours");
    if (cx.opts.batch_invariant) {
      for (auto& l : layers) l->set_batch_invariant(true);
      time_ours(&c.invariant, "ours batch-invariant");
      for (auto& l : layers) l->set_batch_invariant(false);
      std::printf("[bench] %s M=%lld: batch-invariant %.2f us, default %.2f us (%+.1f%%)\n", name.c_str(),
                  static_cast<long long>(M), c.invariant.median_us, c.ours.median_us,
                  100.0 * (c.invariant.median_us / c.ours.median_us - 1.0));
    }
    try {
      c.loop = time_calls(cx.stream, s.calls, cx.budget_s, [&] {
        for (int i = 0; i < s.calls; ++i) call(true, i);
      });
    } catch (const std::exception& e) {
      c.note += (c.note.empty() ? "" : "; ") + std::string("loop: ") + e.what();
    }
    std::printf("[bench] %s M=%lld: %.2f us (loop %.2f us), %d calls x %d reps, %.1f experts/call, tokens per active "
                "expert max %.1f mean %.1f\n",
                name.c_str(), static_cast<long long>(M), c.ours.median_us, c.loop.median_us, s.calls, c.ours.reps,
                s.experts_avg, s.tokens_max_avg, s.tokens_mean_avg);
    std::fflush(stdout);
    cases.push_back(c);
  }
  layers.clear();  // frees the quantized copies before the bf16 ones are made
  ws = DevBuf();
  out = DevBuf();

  try {
    bench_cublas(cx, w, sh, sets, scheds, xd, cases, info);
  } catch (const std::exception& e) {
    const std::string msg = std::string("cuBLAS baseline: ") + e.what();
    std::printf("[bench] %s: %s\n", name.c_str(), msg.c_str());
    for (auto& c : cases) c.note += (c.note.empty() ? "" : "; ") + msg;
  }
  const auto t_ref = Clock::now();
  info.passed = finish_check(cx, ref_futures, check_runs, info) && info.passed;
  std::printf("[bench] %s: waited %.1f s for the float64 reference\n", name.c_str(), seconds_since(t_ref));
  for (auto& c : cases) c.correct = info.passed;
}

AlignRow bench_align(Ctx& cx) {
  AlignRow row;
  row.E = kAlignE;
  row.slots = kAlignSlots;
  row.block_m = kAlignBlockM;
  constexpr int kInputs = 8;
  std::vector<int32_t> ids(size_t(kAlignSlots) * kInputs);
  uint64_t s = 0x1234567;
  for (auto& v : ids) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    v = int32_t((s >> 33) % kAlignE);
  }
  const int64_t padded = max_padded_slots(kAlignSlots, kAlignE, kAlignBlockM);
  const int64_t blocks = max_align_blocks(kAlignSlots, kAlignE, kAlignBlockM);
  DevBuf d_ids(ids.size() * 4), d_sorted(size_t(padded) * 4), d_eids(size_t(blocks) * 4), d_ntp(4);
  WNA16_CUDA_CHECK(cudaMemcpy(d_ids.get(), ids.data(), d_ids.size(), cudaMemcpyHostToDevice));
  auto launch = [&](int i) {
    launch_align(d_ids.get<int32_t>() + size_t(i) * kAlignSlots, kAlignSlots, kAlignE, kAlignBlockM, d_sorted.get<int32_t>(),
                 d_eids.get<int32_t>(), d_ntp.get<int32_t>(), cx.stream);
  };
  // Correct first: the last input against align_reference, bit for bit.
  WNA16_CUDA_CHECK(cudaMemsetAsync(d_sorted.get(), 0xFF, d_sorted.size(), cx.stream));
  WNA16_CUDA_CHECK(cudaMemsetAsync(d_eids.get(), 0xFF, d_eids.size(), cx.stream));
  launch(kInputs - 1);
  WNA16_CUDA_CHECK_LAUNCH();
  WNA16_CUDA_CHECK(cudaStreamSynchronize(cx.stream));
  const AlignResult ref = align_reference(ids.data() + size_t(kInputs - 1) * kAlignSlots, kAlignSlots, kAlignE, kAlignBlockM);
  std::vector<int32_t> sorted(static_cast<size_t>(padded)), eids(static_cast<size_t>(blocks));
  int32_t ntp = 0;
  WNA16_CUDA_CHECK(cudaMemcpy(sorted.data(), d_sorted.get(), d_sorted.size(), cudaMemcpyDeviceToHost));
  WNA16_CUDA_CHECK(cudaMemcpy(eids.data(), d_eids.get(), d_eids.size(), cudaMemcpyDeviceToHost));
  WNA16_CUDA_CHECK(cudaMemcpy(&ntp, d_ntp.get(), 4, cudaMemcpyDeviceToHost));
  if (sorted != ref.sorted_token_ids || eids != ref.expert_ids || ntp != ref.num_tokens_post_padded)
    throw Error("align check FAILED: launch_align differs from align_reference (E=256, 32768 slots, block_m=" +
                std::to_string(kAlignBlockM) + ")");
  row.us = bench_align_us(kAlignE, kAlignSlots, kAlignBlockM);
  row.source = "bench_align_us (align_bench.h); output checked against align_reference";
  return row;
}

// The WNA16_* variables of this process but WNA16_GIT_COMMIT (the A/B switches a table was
// measured with), sorted; "none" if none.
std::string ab_switches() {
  std::vector<std::string> set;
  for (char** e = environ; e && *e; ++e) {
    const std::string v = *e;
    if (v.rfind("WNA16_", 0) == 0 && v.rfind("WNA16_GIT_COMMIT=", 0) != 0) set.push_back(v);
  }
  std::sort(set.begin(), set.end());
  std::string s;
  for (const auto& v : set) s += (s.empty() ? "" : " ") + v;
  return s.empty() ? "none" : s;
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

}  // namespace

int run(const BenchOptions& opts) {
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    cudaGetLastError();
    throw Error("bench --device cuda: no CUDA GPU present");
  }
  if (opts.act != DType::BF16 && opts.act != DType::F16)
    throw Error(std::string("bench: activations must be bf16 or f16, got ") + dtype_name(opts.act));
  std::vector<std::string> models = opts.models;
  if (models.empty())
    for (const auto& n : preset_names())
      if (n != "small") models.push_back(n);
  std::vector<int64_t> ms = opts.ms.empty() ? kDefaultMs : opts.ms;
  for (int64_t M : ms)
    if (M < 1) throw Error("bench: M=" + std::to_string(M) + " must be >= 1");

  Report rep;
  rep.date = ::wna16::bench::utc_now();
  rep.commit = ::wna16::bench::git_commit();
  rep.switches = ab_switches();
  auto add_switch = [&](const std::string& sw) { rep.switches = (rep.switches == "none" ? "" : rep.switches + " ") + sw; };
  // --config: one kernel-table row for every call (a measurement of that row, not the product).
  int forced = -1;
  if (!opts.gemm_config.empty()) {
    std::string names;
    for (int c = 0; c < cuda::gemm_config_count(); ++c) {
      if (opts.gemm_config == cuda::gemm_config_name(c)) forced = c;
      names += std::string(names.empty() ? "" : ", ") + cuda::gemm_config_name(c);
    }
    if (forced < 0) throw Error("bench --config " + opts.gemm_config + ": no such kernel-table row (" + names + ")");
    add_switch("--config " + opts.gemm_config);
  }
  cuda::force_gemm_config(forced);
  // The kernel path (--portable forces the portable one before this; else the GPU decides).
  if (cuda::portable_path()) add_switch("path portable");
  rep.scheme = opts.scheme.describe();
  rep.act = dtype_name(opts.act);
  rep.routing = opts.routing.name();
  {
    std::vector<std::string> mstr;
    for (int64_t M : ms) mstr.push_back(std::to_string(M));
    const QuantScheme& s = opts.scheme;
    rep.command = "wna16 bench --device cuda --model " + join(models, ",") + " --m " + join(mstr, ",") + " --format " +
                  format_name(s.format) + " --bits " + std::to_string(s.bits) + " --group-size " +
                  std::to_string(s.group_size) + (s.sym || s.format == Format::Awq ? "" : " --asym") +
                  (s.act_order ? " --desc-act" : "") + " --dtype " + rep.act +
                  (opts.gemm_config.empty() ? "" : " --config " + opts.gemm_config) +
                  (cuda::portable_path() ? " --portable" : "") +
                  (opts.routing.uniform() ? "" : " --routing " + rep.routing);
  }
  rep.cublas_baseline_desc =
      std::string("cuBLAS ") + rep.act +
      " GEMMs on dequantized weights (one cublasGemmEx per expert with tokens for GEMM1 and GEMM2 + shared expert, "
      "graph-captured; GEMMs only, no routing/gather/SiLU/top-k sum)";

  Ctx cx(opts);
  cx.act_size = dtype_size(opts.act);
  if (opts.min_seconds > 0) cx.budget_s = opts.min_seconds;
  int dev = 0;
  WNA16_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  WNA16_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  cx.ceil.gpu = prop.name;
  cx.ceil.sm_count = prop.multiProcessorCount;
  cx.ceil.cc_major = prop.major;
  cx.ceil.cc_minor = prop.minor;
  cx.ceil.l2_bytes = prop.l2CacheSize;
  cx.ceil.mem_bytes = int64_t(prop.totalGlobalMem);
  WNA16_CUDA_CHECK(cudaStreamCreateWithFlags(&cx.stream, cudaStreamNonBlocking));
  WNA16_CUBLAS_CHECK(cublasCreate(&cx.cublas));
  // An explicit cuBLAS workspace: nothing is allocated while a graph is being captured.
  DevBuf cublas_ws(size_t(64) << 20);
  WNA16_CUBLAS_CHECK(cublasSetWorkspace(cx.cublas, cublas_ws.get(), cublas_ws.size()));
  WNA16_CUBLAS_CHECK(cublasSetStream(cx.cublas, cx.stream));

  std::printf("[bench] %s (compute capability %d.%d), %d SMs, L2 %.0f MB, %.0f GB; kernel path %s; %s, %s activations, "
              "routing %s; commit %s\n",
              prop.name, prop.major, prop.minor, prop.multiProcessorCount, double(prop.l2CacheSize) / 1e6,
              double(prop.totalGlobalMem) / 1e9, cuda::gpu_path_name(), rep.scheme.c_str(), rep.act.c_str(),
              rep.routing.c_str(), rep.commit.c_str());
  size_t free_b = 0, total_b = 0;
  WNA16_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  cx.ceil.read_buffer_bytes = int64_t(std::min<size_t>(size_t(4) << 30, free_b / 4));
  cx.ceil.read_gbs = measure_read_gbs(size_t(cx.ceil.read_buffer_bytes), 20, cx.stream);
  cx.ceil.gemm_n = 8192;
  cx.ceil.gemm_tflops = measure_cublas_bf16_tflops(cx.cublas, cx.ceil.gemm_n, 20, cx.stream);
  std::printf("[bench] ceilings: read stream %.0f GB/s over %.1f GB; cuBLAS bf16 %d^3 %.0f TFLOP/s\n", cx.ceil.read_gbs,
              double(cx.ceil.read_buffer_bytes) / 1e9, cx.ceil.gemm_n, cx.ceil.gemm_tflops);
  rep.ceil = cx.ceil;

  bool failed = false;
  try {
    rep.align = bench_align(cx);
    std::printf("[bench] align E=%d %lld slots block_m=%d: %.2f us\n", rep.align.E, static_cast<long long>(rep.align.slots),
                rep.align.block_m, rep.align.us);
  } catch (const std::exception& e) {
    rep.align.source = std::string("error: ") + e.what();
    std::printf("[bench] align: %s\n", e.what());
    failed = failed || std::string(e.what()).find("FAILED") != std::string::npos;
  }

  for (const auto& name : models) {
    PresetInfo info;
    info.name = name;
    std::vector<CaseResult> cases;
    try {
      bench_preset(cx, name, ms, info, cases);
    } catch (const std::exception& e) {
      info.error = e.what();
      info.passed = false;
      for (auto& c : cases) c.correct = false;
      std::printf("[bench] %s: ERROR %s\n", name.c_str(), e.what());
    }
    std::fflush(stdout);
    failed = failed || !info.passed || !info.error.empty();
    rep.presets.push_back(info);
    rep.cases.insert(rep.cases.end(), cases.begin(), cases.end());
  }

  cudaStreamSynchronize(cx.stream);
  cublasDestroy(cx.cublas);
  cudaStreamDestroy(cx.stream);

  if (!opts.json_path.empty()) write_json(rep, opts.json_path);
  if (!opts.csv_path.empty()) write_csv(rep, opts.csv_path);
  std::string plot_note;
  if (!opts.plot_path.empty()) {
    const ::wna16::bench::PlotInput plot = plot_input(rep);
    if (plot.presets.empty()) {
      plot_note = "no preset was measured: " + opts.plot_path + " not written";
    } else {
      ::wna16::bench::write_svg(plot, opts.plot_path);
      plot_note = opts.plot_path;
    }
  }
  print_table(rep);
  print_summary(rep);
  if (!opts.json_path.empty() || !opts.csv_path.empty())
    std::printf("results: %s%s%s\n", opts.json_path.c_str(), !opts.json_path.empty() && !opts.csv_path.empty() ? ", " : "",
                opts.csv_path.c_str());
  if (!plot_note.empty()) std::printf("plot: %s\n", plot_note.c_str());
  std::printf("%s\n", failed ? "FAILED" : "PASSED");
  std::fflush(stdout);
  return failed ? 1 : 0;
}

}  // namespace wna16::cuda::bench

namespace wna16 {
int run_cuda_bench(const BenchOptions& opts) { return cuda::bench::run(opts); }
}  // namespace wna16
