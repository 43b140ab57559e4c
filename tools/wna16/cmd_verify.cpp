// `wna16 verify`: builds a random layer of a preset's shape in the chosen scheme and checks, for
// each token count M, the float64 reference against (a) an independent float32 path written here
// (own dequantisation from the unpacked codes, float matmuls, same routing) and (b) the chosen
// backend. Prints a table and ends with PASSED or FAILED (exit 1).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <exception>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "wna16/error.h"
#include "wna16/half.h"
#include "wna16/reference.h"

namespace wna16::cli {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A stage's wall time and process CPU time (all threads): on a shared machine the two differ a lot.
struct Stage {
  Clock::time_point wall = Clock::now();
  std::clock_t cpu = std::clock();
  void report(const std::string& what) const {
    std::printf("  %s: %.2f s (cpu %.2f s)\n", what.c_str(), seconds_since(wall),
                double(std::clock() - cpu) / CLOCKS_PER_SEC);
  }
};

// float32 vs float64 differ only by float32 rounding of sums over K <= 14336 terms: ~1e-6 in
// practice. A real bug (wrong zero, wrong group, wrong routing weight) shows as 1e-3 or more.
constexpr double kF32Tolerance = 1e-5;

// ---- the independent float32 path ----------------------------------------------------------

// Dequantised to float from the canonical codes: W[k, n] = s[g(k), n] * (q[k, n] - z[g(k), n]).
std::vector<float> f32_dequant(const QuantizedLinear& l) {
  const UnpackedLinear u = unpack(l);
  std::vector<float> w(static_cast<size_t>(u.K * u.N));
  for (int64_t k = 0; k < u.K; ++k) {
    const int64_t g = u.g_idx[size_t(k)];
    for (int64_t n = 0; n < u.N; ++n)
      w[size_t(k * u.N + n)] =
          u.scales[size_t(g * u.N + n)] * float(int32_t(u.q[size_t(k * u.N + n)]) - u.zeros[size_t(g * u.N + n)]);
  }
  return w;
}

// y[m, :] = x[m, :] . W (+ bias), float accumulation.
std::vector<float> f32_linear(const QuantizedLinear& l, const std::vector<float>& x, int64_t M) {
  const std::vector<float> w = f32_dequant(l);
  std::vector<float> y(static_cast<size_t>(M * l.N), 0.f);
  for (int64_t m = 0; m < M; ++m) {
    float* yr = y.data() + m * l.N;
    for (int64_t k = 0; k < l.K; ++k) {
      const float xv = x[size_t(m * l.K + k)];
      const float* wr = w.data() + k * l.N;
      for (int64_t n = 0; n < l.N; ++n) yr[n] += xv * wr[n];
    }
    for (size_t n = 0; n < l.bias.size(); ++n) yr[n] += l.bias[n];
  }
  return y;
}

std::vector<float> f32_mlp(const ExpertWeights& e, const std::vector<float>& x, int64_t M) {
  const std::vector<float> g = f32_linear(e.gate, x, M), u = f32_linear(e.up, x, M);
  std::vector<float> h(g.size());
  for (size_t i = 0; i < h.size(); ++i) h[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  return f32_linear(e.down, h, M);
}

std::vector<float> f32_layer(const MoeLayerSpec& spec, const MoeLayerWeights& w, const std::vector<float>& x,
                             int64_t M, const Routing& r) {
  const int64_t H = spec.hidden;
  std::vector<float> out(static_cast<size_t>(M * H), 0.f);
  for (int e = 0; e < spec.routing.num_experts; ++e) {
    std::vector<int64_t> rows;
    std::vector<float> weight, xe;
    for (int64_t s = 0; s < M * r.top_k; ++s)
      if (r.ids[size_t(s)] == e) {
        rows.push_back(s / r.top_k);
        weight.push_back(r.weights[size_t(s)]);
        xe.insert(xe.end(), x.begin() + (s / r.top_k) * H, x.begin() + (s / r.top_k + 1) * H);
      }
    if (rows.empty()) continue;
    const std::vector<float> y = f32_mlp(w.experts[size_t(e)], xe, int64_t(rows.size()));
    for (size_t t = 0; t < rows.size(); ++t)
      for (int64_t h = 0; h < H; ++h) out[size_t(rows[t] * H + h)] += weight[t] * y[t * size_t(H) + size_t(h)];
  }
  if (spec.shared_kind != SharedExpertKind::None) {
    const std::vector<float> y = f32_mlp(*w.shared, x, M);
    for (int64_t m = 0; m < M; ++m) {
      float gate = 1.f;
      if (spec.shared_kind == SharedExpertKind::SigmoidGated) {
        float a = 0;
        for (int64_t h = 0; h < H; ++h) a += x[size_t(m * H + h)] * w.shared_gate[size_t(h)];
        gate = 1.f / (1.f + std::exp(-a));
      }
      for (int64_t h = 0; h < H; ++h) out[size_t(m * H + h)] += gate * y[size_t(m * H + h)];
    }
  }
  return out;
}

// ---- activations -----------------------------------------------------------------------------

std::vector<uint16_t> to_bits(const float* x, int64_t n, DType t) {
  std::vector<uint16_t> b(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) b[size_t(i)] = t == DType::F16 ? float_to_f16(x[i]) : float_to_bf16(x[i]);
  return b;
}

float from_bits(uint16_t v, DType t) { return t == DType::F16 ? f16_to_float(v) : bf16_to_float(v); }

std::string describe(const MoeLayerSpec& s) {
  std::string d = "H=" + std::to_string(s.hidden) + " I=" + std::to_string(s.inter) + " E=" +
                  std::to_string(s.routing.num_experts) + " top-" + std::to_string(s.routing.top_k) + " " +
                  routing_name(s.routing.method);
  if (s.routing.method != RoutingMethod::SoftmaxTopK && s.routing.n_group > 1)
    d += " (groups " + std::to_string(s.routing.topk_group) + "/" + std::to_string(s.routing.n_group) + ")";
  d += s.routing.renormalize ? " renorm" : " no-renorm";
  if (s.routing.routed_scaling_factor != 1.0) {
    char buf[32];
    std::snprintf(buf, sizeof buf, " x%g", s.routing.routed_scaling_factor);
    d += buf;
  }
  if (s.shared_kind == SharedExpertKind::Plain) d += ", shared " + std::to_string(s.shared_inter);
  if (s.shared_kind == SharedExpertKind::SigmoidGated) d += ", sigmoid-gated shared " + std::to_string(s.shared_inter);
  return d;
}

struct Row {
  int64_t M;
  std::string path;
  double err = INFINITY, tol = 0, ms = 0;
  std::string note;  // an error message when the path could not run
  bool pass() const { return note.empty() && err <= tol; }
};

void run_verify(const CommonOptions& o, const PlanFlags& pf) {
  const MoeLayerSpec spec = preset(o.model);
  const ParallelPlan plan = pf.plan();
  if (plan.world() > 1) check_plan(plan, spec);
  const QuantScheme scheme = o.scheme();
  const DType act = o.act_dtype();
  const Device dev = o.resolved_device();
  pf.check_device(dev);
  const std::vector<int64_t> ms = o.token_counts({1, 7, 33});
  const int64_t H = spec.hidden;

  std::printf("wna16 verify: %s (%s)\n", spec.name.c_str(), describe(spec).c_str());
  std::printf("  weights %s, activations %s, device %s, seed %llu\n", scheme.describe().c_str(), dtype_name(act),
              device_name(dev), static_cast<unsigned long long>(o.seed));
  if (dev == Device::Cuda) std::printf("  kernel path %s\n", cuda_path_name());
  if (plan.world() > 1)
    std::printf("  sharded %s in this process: one thread per rank, over the %s communicator\n", plan.describe().c_str(),
                pf.comm.c_str());

  Stage stage;
  const MoeLayerWeights w = random_layer(spec, scheme, o.seed);
  stage.report("random layer");
  if (plan.world() > 1) check_plan(plan, spec, w);  // a bad plan is refused (exit 2), not a FAIL row

  // Fresh x per M, N(0, 1) rounded to the activation dtype; all M stacked into one batch for the
  // two host paths (every token's output depends on its own row only), split again for the table.
  std::vector<int64_t> offset;
  std::vector<float> x;
  for (size_t i = 0; i < ms.size(); ++i) {
    std::mt19937_64 rng(o.seed * 1000003ull + i);
    std::normal_distribution<float> nd(0.f, 1.f);
    offset.push_back(int64_t(x.size()) / H);
    for (int64_t j = 0; j < ms[i] * H; ++j) x.push_back(round_to(act, nd(rng)));
  }
  const int64_t total = int64_t(x.size()) / H;

  stage = Stage();
  const std::vector<float> logits = router_logits_reference(spec, w, x.data(), total);
  const Routing routing = route_reference(spec.routing, logits.data(), total,
                                          w.correction_bias.empty() ? nullptr : w.correction_bias.data());
  // The float64 reference and the float32 path are independent: run them side by side.
  std::vector<double> ref;
  Routing ref_routing;
  std::exception_ptr ref_failure;
  std::thread ref_thread([&] {
    try {
      ref = moe_reference(spec, w, x.data(), total, &ref_routing);
    } catch (...) {
      ref_failure = std::current_exception();
    }
  });
  const std::vector<float> f32 = f32_layer(spec, w, x, total, routing);
  ref_thread.join();
  if (ref_failure) std::rethrow_exception(ref_failure);
  if (ref_routing.ids != routing.ids || ref_routing.weights != routing.weights)
    throw Error("internal: moe_reference routed differently from route_reference on the same logits");
  stage.report("float64 reference + float32 path (" + std::to_string(total) + " tokens)");

  std::vector<Row> rows;
  for (size_t i = 0; i < ms.size(); ++i) {
    const int64_t n = ms[i] * H, at = offset[size_t(i)] * H;
    rows.push_back({ms[i], "float32", rel_error(f32.data() + at, ref.data() + at, n), kF32Tolerance, 0, ""});
  }

  stage = Stage();
  std::unique_ptr<MoeBackendLayer> layer;
  std::string make_error;
  try {
    layer = pf.make(dev, spec, w);
    layer->set_batch_invariant(o.batch_invariant);
  } catch (const Error& e) {
    make_error = e.what();
  }
  stage.report(std::string(device_name(dev)) + " backend setup");
  for (size_t i = 0; i < ms.size(); ++i) {
    const int64_t M = ms[i], n = M * H, at = offset[size_t(i)] * H;
    Row row{M, device_name(dev), INFINITY, layer_tolerance(act), 0, make_error};
    if (layer) {
      const std::vector<uint16_t> xb = to_bits(x.data() + at, n, act);
      std::vector<uint16_t> ob(static_cast<size_t>(n), 0);
      try {
        const auto t0 = Clock::now();
        layer->forward_host(xb.data(), ob.data(), M, act);
        row.ms = seconds_since(t0) * 1e3;
        std::vector<float> out(static_cast<size_t>(n));
        for (int64_t j = 0; j < n; ++j) out[size_t(j)] = from_bits(ob[size_t(j)], act);
        row.err = rel_error(out.data(), ref.data() + at, n);
      } catch (const Error& e) {
        row.note = e.what();
      }
    }
    rows.push_back(row);
  }

  std::printf("\n%6s  %-8s  %11s  %9s  %10s  %s\n", "M", "path", "rel error", "tolerance", "time (ms)", "result");
  bool ok = true;
  for (size_t j = 0; j < rows.size(); ++j) {
    // float32 rows first, then the backend's, interleaved per M for reading.
    const size_t i = (j % 2 == 0) ? j / 2 : ms.size() + j / 2;
    const Row& r = rows[i];
    ok = ok && r.pass();
    char time_str[32] = "-";
    if (r.ms > 0) std::snprintf(time_str, sizeof time_str, "%.2f", r.ms);
    std::printf("%6lld  %-8s  %11.3e  %9.1e  %10s  %s%s\n", static_cast<long long>(r.M), r.path.c_str(), r.err, r.tol,
                time_str, r.pass() ? "PASS" : "FAIL", r.note.empty() ? "" : ("  (" + r.note + ")").c_str());
  }
  std::printf("%s\n", ok ? "PASSED" : "FAILED");
  std::fflush(stdout);
  if (!ok) throw CLI::RuntimeError(1);
}

const CommandRegistrar registrar([](CLI::App& root) {
  auto opts = std::make_shared<CommonOptions>();
  CLI::App* cmd = root.add_subcommand(
      "verify",
      "check a random layer of a preset's shape on a backend against the float64 reference "
      "(and the reference against an independent float32 path); ends with PASSED or FAILED");
  auto plan = std::make_shared<PlanFlags>();
  opts->add_to(*cmd);
  plan->add_to(*cmd);
  cmd->footer("--m defaults to 1,7,33. With --tp/--ep the backend row is the sharded layer, its ranks run as threads "
              "of this process over the communicator --comm names (on cuda with inprocess, rank r on GPU r mod the "
              "GPUs present).");
  cmd->callback([opts, plan] { run_verify(*opts, *plan); });
});

}  // namespace
}  // namespace wna16::cli
