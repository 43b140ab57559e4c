// Table, JSON, CSV and floor summary of the CUDA benchmark (see bench_report.h).
#include "bench/cuda/bench_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "wna16/error.h"

namespace wna16::cuda::bench {
namespace {

bool finite(double v) { return std::isfinite(v); }

std::string num(double v, const char* f = "%.4g") {
  if (!finite(v)) return "-";
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

std::string json_num(double v) {
  if (!finite(v)) return "null";
  char b[64];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}

std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    switch (c) {
      case '"': o += "\\\""; break;
      case '\\': o += "\\\\"; break;
      case '\n': o += "\\n"; break;
      case '\t': o += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char b[8];
          std::snprintf(b, sizeof b, "\\u%04x", c);
          o += b;
        } else {
          o += c;
        }
    }
  }
  return o + "\"";
}

std::string csv_str(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string o = "\"";
  for (char c : s) o += (c == '"') ? std::string("\"\"") : std::string(1, c);
  return o + "\"";
}

std::string timing_json(const Timing& t) {
  std::ostringstream o;
  o << "{\"median_us\": " << json_num(t.median_us) << ", \"p10_us\": " << json_num(t.p10_us)
    << ", \"p90_us\": " << json_num(t.p90_us) << ", \"reps\": " << t.reps << ", \"calls_per_rep\": " << t.calls
    << ", \"graph\": " << (t.graph ? "true" : "false") << "}";
  return o.str();
}

const CaseResult* find_case(const Report& r, const std::string& preset, int64_t M) {
  for (const auto& c : r.cases)
    if (c.preset == preset && c.M == M) return &c;
  return nullptr;
}

const char* verdict(bool ok) { return ok ? "PASS" : "BELOW"; }

}  // namespace

double floor_us(const CaseResult& c, const Ceilings& ceil) {
  const double t_bw = c.bytes / (ceil.read_gbs * 1e9);
  const double t_tc = c.flops / (ceil.gemm_tflops * 1e12);
  return finite(t_bw) && finite(t_tc) ? std::max(t_bw, t_tc) * 1e6 : kNaN;
}

Derived derive(const CaseResult& c, const Ceilings& ceil) {
  Derived d;
  const double t = c.ours.median_us * 1e-6;
  if (!finite(t) || t <= 0) return d;
  d.tflops = c.flops / t * 1e-12;
  d.gbs = c.bytes / t * 1e-9;
  const double t_bw = c.bytes / (ceil.read_gbs * 1e9);
  const double t_tc = c.flops / (ceil.gemm_tflops * 1e12);
  d.bound = t_bw >= t_tc ? "memory" : "compute";
  d.pct = floor_us(c, ceil) * 1e-6 / t * 100.0;  // the floor of the binding ceiling over the measured time
  d.pct_bw = d.gbs / ceil.read_gbs * 100.0;
  d.x_loop = c.loop.median_us / c.ours.median_us;
  d.x_cublas = c.cublas.median_us / c.ours.median_us;
  return d;
}

::wna16::bench::PlotInput plot_input(const Report& r) {
  namespace plot = ::wna16::bench;
  plot::PlotInput in;
  in.title = "wna16 bench --device cuda: " + r.scheme + ", " + r.act +
             (r.routing == "uniform" ? "" : ", routing " + r.routing);
  in.provenance = r.date + ", " + r.ceil.gpu + ", commit " + r.commit;
  if (!r.switches.empty() && r.switches != "none") in.provenance += ", " + r.switches;
  in.ceilings = {"read " + num(r.ceil.read_gbs, "%.0f") + " GB/s",
                 "cuBLAS bf16 " + num(r.ceil.gemm_tflops, "%.0f") + " TFLOP/s"};
  for (const PresetInfo& p : r.presets) {
    plot::PlotPreset pp;
    pp.name = p.name;
    pp.shape = p.shape;
    plot::PlotSeries ours{"wna16", {}}, loop{"per-expert loop", {}}, cublas{"cuBLAS " + r.act + " GEMMs (dequantised)", {}};
    bool any_loop = false, any_cublas = false;
    for (const CaseResult& c : r.cases) {
      if (c.preset != p.name) continue;
      ours.points.push_back({c.M, c.ours.median_us});
      loop.points.push_back({c.M, c.loop.median_us});
      cublas.points.push_back({c.M, c.cublas.median_us});
      any_loop = any_loop || finite(c.loop.median_us);
      any_cublas = any_cublas || finite(c.cublas.median_us);
      pp.floor.push_back({c.M, floor_us(c, r.ceil)});
    }
    if (ours.points.empty()) continue;
    pp.series.push_back(std::move(ours));
    if (any_loop) pp.series.push_back(std::move(loop));
    if (any_cublas) pp.series.push_back(std::move(cublas));
    in.presets.push_back(std::move(pp));
  }
  return in;
}

void print_table(const Report& r) {
  std::printf("\nwna16 CUDA benchmark: %s, %s activations, routing %s | %s | %s | commit %s | switches: %s\n",
              r.scheme.c_str(), r.act.c_str(), r.routing.c_str(), r.ceil.gpu.c_str(), r.date.c_str(), r.commit.c_str(),
              r.switches.c_str());
  std::printf("ceilings measured in this run: read stream %.0f GB/s (%.1f GB buffer), cuBLAS bf16 %d^3 %.0f TFLOP/s\n",
              r.ceil.read_gbs, double(r.ceil.read_buffer_bytes) / 1e9, r.ceil.gemm_n, r.ceil.gemm_tflops);
  std::printf("us: median per layer call (graph replays, cold L2); spread: p10..p90 in %% of the median;\n"
              "%% ceil: floor time of the binding ceiling (bytes and FLOPs of each call's own routing) /\n"
              "measured time; x loop: per-expert-loop time / ours; x cuBLAS: %s / ours;\n"
              "experts: routed experts with a token; max/e, mean/e: tokens on the busiest / an average one\n\n",
              r.cublas_baseline_desc.c_str());
  std::printf("%-18s %5s %10s %7s %8s %8s %7s %7s %7s %8s %7s %7s %7s\n", "preset", "M", "us", "spread", "TFLOP/s",
              "GB/s", "bound", "% ceil", "x loop", "x cuBLAS", "experts", "max/e", "mean/e");
  std::string last;
  for (const auto& c : r.cases) {
    if (!last.empty() && last != c.preset) std::printf("\n");
    last = c.preset;
    const Derived d = derive(c, r.ceil);
    std::string spread = "-";
    if (finite(c.ours.median_us) && c.ours.median_us > 0)
      spread = num((c.ours.p90_us - c.ours.p10_us) / c.ours.median_us * 100.0, "%.1f%%");
    std::printf("%-18s %5lld %10s %7s %8s %8s %7s %7s %7s %8s %7s %7s %7s%s%s\n", c.preset.c_str(),
                static_cast<long long>(c.M), num(c.ours.median_us, "%.2f").c_str(), spread.c_str(),
                num(d.tflops, "%.1f").c_str(), num(d.gbs, "%.0f").c_str(), finite(d.pct) ? d.bound : "-",
                num(d.pct, "%.1f").c_str(), num(d.x_loop, "%.2f").c_str(), num(d.x_cublas, "%.2f").c_str(),
                num(c.experts_avg, "%.1f").c_str(), num(c.tokens_max_avg, "%.1f").c_str(),
                num(c.tokens_mean_avg, "%.1f").c_str(), c.correct ? "" : "  FAILED",
                c.note.empty() ? "" : ("  (" + c.note + ")").c_str());
  }
  for (const auto& p : r.presets)
    if (!p.error.empty()) std::printf("%-18s ERROR: %s\n", p.name.c_str(), p.error.c_str());
  if (finite(r.align.us))
    std::printf("\nalign E=%d, %lld slots, block_m=%d: %.2f us (%s)\n", r.align.E, static_cast<long long>(r.align.slots),
                r.align.block_m, r.align.us, r.align.source.c_str());
}

namespace {

// The layer-time targets of the serving-regime and decode work (docs/perf.md section 1), us per
// layer call for int4 GPTQ g128 sym, bf16, uniform routing: "must" is the bar, "aim" the roofline
// direction (the tables of the serving-regime and decode work items).
struct TimeTarget {
  const char* group;
  const char* preset;
  int64_t M;
  double must_us, aim_us;
};
constexpr TimeTarget kTimeTargets[] = {
    {"serving", "deepseek-v3", 256, 1800, 1500},      {"serving", "deepseek-v3", 1024, 2500, 1700},
    {"serving", "deepseek-v3", 4096, 8000, 5500},     {"serving", "deepseek-v3", 8192, 14000, 10000},
    {"serving", "mixtral-8x7b", 64, 300, 200},        {"serving", "mixtral-8x7b", 256, 650, 400},
    {"serving", "mixtral-8x7b", 1024, 1700, 1100},    {"serving", "mixtral-8x7b", 4096, 4700, 4000},
    {"serving", "qwen3-30b-a3b", 256, 150, 100},      {"serving", "qwen3-30b-a3b", 1024, 360, 220},
    {"serving", "qwen3-30b-a3b", 4096, 900, 600},     {"serving", "qwen1.5-moe-a2.7b", 256, 190, 120},
    {"serving", "deepseek-v2-lite", 256, 185, 120},   {"decode", "deepseek-v3", 1, 55, 50},
    {"decode", "deepseek-v3", 16, 530, 500},          {"decode", "mixtral-8x7b", 1, 48, 44},
    {"decode", "mixtral-8x7b", 4, 135, 125},          {"decode", "mixtral-8x7b", 16, 195, 180},
    {"decode", "qwen3-30b-a3b", 1, 11, 8},            {"decode", "qwen3-30b-a3b", 16, 55, 48},
    {"decode", "qwen1.5-moe-a2.7b", 1, 13, 10},       {"decode", "deepseek-v2-lite", 1, 13, 10},
};
// The serving-regime bar against cuBLAS bf16 on dequantised weights, at these token counts.
constexpr double kMinXCublas = 0.9, kAimXCublas = 1.0;
constexpr int64_t kXCublasMs[] = {64, 256, 1024, 4096, 8192};

}  // namespace

int print_targets(const Report& r) {
  const bool scheme_ok = r.scheme == "gptq 4-bit g128 sym" && r.act == "bf16" && r.routing == "uniform";
  std::printf("\nLayer-time targets (int4 GPTQ g128 sym, bf16, uniform routing; us per layer call):\n");
  if (!scheme_ok) {
    std::printf("  not applicable to this run (%s, %s, routing %s)\n", r.scheme.c_str(), r.act.c_str(), r.routing.c_str());
    return 0;
  }
  int missed = 0, shown = 0;
  for (const TimeTarget& t : kTimeTargets) {
    const CaseResult* c = find_case(r, t.preset, t.M);
    if (!c || !finite(c->ours.median_us)) continue;
    ++shown;
    const double us = c->ours.median_us;
    const bool ok = us <= t.must_us;
    missed += !ok;
    std::printf("  %-8s %-18s M=%-5lld %9.1f us   must %6.0f  aim %6.0f   %s%s\n", t.group, t.preset,
                static_cast<long long>(t.M), us, t.must_us, t.aim_us, ok ? "PASS" : "FAIL",
                us <= t.aim_us ? " (aim met)" : "");
  }
  for (const CaseResult& c : r.cases) {
    if (std::find(std::begin(kXCublasMs), std::end(kXCublasMs), c.M) == std::end(kXCublasMs)) continue;
    const Derived d = derive(c, r.ceil);
    if (!finite(d.x_cublas)) continue;
    ++shown;
    const bool ok = d.x_cublas >= kMinXCublas;
    missed += !ok;
    std::printf("  x cuBLAS %-18s M=%-5lld %9.2f x    must %6.2f  aim %6.2f   %s%s\n", c.preset.c_str(),
                static_cast<long long>(c.M), d.x_cublas, kMinXCublas, kAimXCublas, ok ? "PASS" : "FAIL",
                d.x_cublas >= kAimXCublas ? " (aim met)" : "");
  }
  if (shown == 0) std::printf("  none of the target rows was measured in this run\n");
  return missed;
}

int print_summary(const Report& r) {
  int below = print_targets(r);
  std::printf("\nFloors of the CUDA issue (defined for int4 g128 bf16; this run: %s, %s):\n", r.scheme.c_str(),
              r.act.c_str());
  for (const char* p : {"deepseek-v3", "mixtral-8x7b"})
    for (int64_t M : {int64_t(1), int64_t(16)}) {
      const CaseResult* c = find_case(r, p, M);
      if (!c || !finite(c->ours.median_us)) {
        std::printf("  %-13s M=%-5lld %% of read bandwidth >= 70 (aim 85): not measured\n", p, static_cast<long long>(M));
        continue;
      }
      const Derived d = derive(*c, r.ceil);
      const bool ok = d.pct_bw >= 70.0;
      below += !ok;
      std::printf("  %-13s M=%-5lld %5.1f%% of read bandwidth (%.0f of %.0f GB/s)   floor 70%%, aim 85%%   %s\n", p,
                  static_cast<long long>(M), d.pct_bw, d.gbs, r.ceil.read_gbs, verdict(ok));
    }
  if (const CaseResult* c = find_case(r, "deepseek-v3", 4096); c && finite(c->ours.median_us)) {
    const Derived d = derive(*c, r.ceil);
    const bool ok = d.tflops >= 300.0;
    below += !ok;
    std::printf("  deepseek-v3   M=4096  %5.0f TFLOP/s (%.0f%% of cuBLAS bf16 %.0f)   floor 300, aim near cuBLAS   %s\n",
                d.tflops, d.tflops / r.ceil.gemm_tflops * 100.0, r.ceil.gemm_tflops, verdict(ok));
  } else {
    std::printf("  deepseek-v3   M=4096  TFLOP/s >= 300: not measured\n");
  }
  for (int64_t M : {int64_t(1), int64_t(4), int64_t(16), int64_t(64)}) {
    const CaseResult* c = find_case(r, "deepseek-v3", M);
    const Derived d = c ? derive(*c, r.ceil) : Derived{};
    if (!finite(d.x_loop)) {
      std::printf("  deepseek-v3   M=%-5lld single launch vs per-expert loop >= 3x: not measured\n", static_cast<long long>(M));
      continue;
    }
    const bool ok = d.x_loop >= 3.0;
    below += !ok;
    std::printf("  deepseek-v3   M=%-5lld %5.2fx faster than the per-expert loop          floor 3x   %s\n",
                static_cast<long long>(M), d.x_loop, verdict(ok));
  }
  if (finite(r.align.us)) {
    const bool ok = r.align.us < 10.0;
    below += !ok;
    std::printf("  align E=%d %lld slots: %.2f us                                floor < 10 us   %s\n", r.align.E,
                static_cast<long long>(r.align.slots), r.align.us, verdict(ok));
  } else {
    std::printf("  align E=256 32768 slots < 10 us: not measured\n");
  }
  bool all_ok = true;
  for (const auto& p : r.presets) all_ok = all_ok && p.passed && p.error.empty();
  std::printf("Correctness of every benchmarked layer and baseline vs the float64 reference: %s\n",
              all_ok ? "PASSED" : "FAILED");
  for (const auto& p : r.presets)
    if (!p.passed || !p.error.empty())
      std::printf("  FAILED %s: %s\n", p.name.c_str(), !p.error.empty() ? p.error.c_str() : "see the check lines above");
  return below;
}

void write_json(const Report& r, const std::string& path) {
  std::ofstream f(path);
  if (!f) throw Error("bench: cannot write JSON to '" + path + "'");
  f << "{\n  \"tool\": \"wna16 bench --device cuda\",\n";
  f << "  \"date\": " << json_str(r.date) << ",\n  \"commit\": " << json_str(r.commit) << ",\n";
  f << "  \"switches\": " << json_str(r.switches) << ",\n";
  f << "  \"command\": " << json_str(r.command) << ",\n  \"scheme\": " << json_str(r.scheme) << ",\n";
  f << "  \"activations\": " << json_str(r.act) << ",\n  \"routing\": " << json_str(r.routing) << ",\n";
  f << "  \"gpu\": {\"name\": " << json_str(r.ceil.gpu) << ", \"sm_count\": " << r.ceil.sm_count
    << ", \"compute_capability\": \"" << r.ceil.cc_major << "." << r.ceil.cc_minor << "\", \"l2_bytes\": " << r.ceil.l2_bytes
    << ", \"memory_bytes\": " << r.ceil.mem_bytes << "},\n";
  f << "  \"ceilings\": {\"read_stream_gbs\": " << json_num(r.ceil.read_gbs)
    << ", \"read_stream_buffer_bytes\": " << r.ceil.read_buffer_bytes
    << ", \"cublas_bf16_tflops\": " << json_num(r.ceil.gemm_tflops) << ", \"cublas_bf16_n\": " << r.ceil.gemm_n << "},\n";
  f << "  \"baselines\": {\"loop\": \"CudaMoeLayer::forward_per_expert_loop (eager; one GEMM launch per expert with "
       "tokens)\", \"cublas\": "
    << json_str(r.cublas_baseline_desc) << "},\n";
  f << "  \"presets\": [\n";
  for (size_t i = 0; i < r.presets.size(); ++i) {
    const auto& p = r.presets[i];
    f << "    {\"name\": " << json_str(p.name) << ", \"shape\": " << json_str(p.shape) << ", \"weight_sets\": " << p.weight_sets
      << ", \"weights_gb\": " << json_num(p.weights_gb) << ", \"device_weights_gb\": " << json_num(p.device_weights_gb)
      << ", \"gen_s\": " << json_num(p.gen_s) << ", \"load_s\": " << json_num(p.load_s) << ", \"check_s\": "
      << json_num(p.check_s) << ", \"bf16_s\": " << json_num(p.bf16_s) << ", \"tolerance\": " << json_num(p.tolerance)
      << ", \"passed\": " << (p.passed && p.error.empty() ? "true" : "false") << ", \"error\": " << json_str(p.error)
      << ", \"checks\": [";
    for (size_t j = 0; j < p.checks.size(); ++j) f << (j ? ", " : "") << json_str(p.checks[j]);
    f << "]}" << (i + 1 < r.presets.size() ? "," : "") << "\n";
  }
  f << "  ],\n  \"cases\": [\n";
  for (size_t i = 0; i < r.cases.size(); ++i) {
    const auto& c = r.cases[i];
    const Derived d = derive(c, r.ceil);
    f << "    {\"preset\": " << json_str(c.preset) << ", \"M\": " << c.M << ", \"us\": " << json_num(c.ours.median_us)
      << ", \"tflops\": " << json_num(d.tflops) << ", \"gbs\": " << json_num(d.gbs) << ", \"bound\": "
      << json_str(finite(d.pct) ? d.bound : "") << ", \"pct_of_ceiling\": " << json_num(d.pct)
      << ", \"pct_of_read_bw\": " << json_num(d.pct_bw) << ", \"x_loop\": " << json_num(d.x_loop)
      << ", \"x_cublas\": " << json_num(d.x_cublas) << ", \"flops\": " << json_num(c.flops) << ", \"bytes\": "
      << json_num(c.bytes) << ", \"routing\": " << json_str(r.routing)
      << ", \"experts_avg\": " << json_num(c.experts_avg)
      << ", \"tokens_per_expert_max\": " << json_num(c.tokens_max_avg)
      << ", \"tokens_per_expert_mean\": " << json_num(c.tokens_mean_avg) << ", \"correct\": "
      << (c.correct ? "true" : "false") << ", \"note\": " << json_str(c.note) << ",\n     \"ours\": " << timing_json(c.ours)
      << ", \"loop\": " << timing_json(c.loop) << ", \"cublas\": " << timing_json(c.cublas) << "}"
      << (i + 1 < r.cases.size() ? "," : "") << "\n";
  }
  f << "  ],\n  \"align\": {\"E\": " << r.align.E << ", \"slots\": " << r.align.slots << ", \"block_m\": " << r.align.block_m
    << ", \"us\": " << json_num(r.align.us) << ", \"source\": " << json_str(r.align.source) << "}\n}\n";
  if (!f) throw Error("bench: error while writing JSON to '" + path + "'");
}

void write_csv(const Report& r, const std::string& path) {
  std::ofstream f(path);
  if (!f) throw Error("bench: cannot write CSV to '" + path + "'");
  f << "preset,M,us,us_p10,us_p90,tflops,gbs,bound,pct_of_ceiling,pct_of_read_bw,loop_us,cublas_us,x_loop,x_cublas,"
       "experts_avg,flops,bytes,correct,note,gpu,date,commit,scheme,act,read_gbs,cublas_tflops,routing,"
       "tokens_per_expert_max,tokens_per_expert_mean\n";
  for (const auto& c : r.cases) {
    const Derived d = derive(c, r.ceil);
    f << csv_str(c.preset) << "," << c.M << "," << json_num(c.ours.median_us) << "," << json_num(c.ours.p10_us) << ","
      << json_num(c.ours.p90_us) << "," << json_num(d.tflops) << "," << json_num(d.gbs) << ","
      << (finite(d.pct) ? d.bound : "") << "," << json_num(d.pct) << "," << json_num(d.pct_bw) << ","
      << json_num(c.loop.median_us) << "," << json_num(c.cublas.median_us) << "," << json_num(d.x_loop) << ","
      << json_num(d.x_cublas) << "," << json_num(c.experts_avg) << "," << json_num(c.flops) << "," << json_num(c.bytes)
      << "," << (c.correct ? "true" : "false") << "," << csv_str(c.note) << "," << csv_str(r.ceil.gpu) << ","
      << csv_str(r.date) << "," << csv_str(r.commit) << "," << csv_str(r.scheme) << "," << csv_str(r.act) << ","
      << json_num(r.ceil.read_gbs) << "," << json_num(r.ceil.gemm_tflops) << "," << csv_str(r.routing) << ","
      << json_num(c.tokens_max_avg) << "," << json_num(c.tokens_mean_avg) << "\n";
  }
  if (finite(r.align.us))
    f << "align-E" << r.align.E << "-slots" << r.align.slots << "-bm" << r.align.block_m << ",," << json_num(r.align.us)
      << std::string(15, ',') << "true," << csv_str(r.align.source) << "," << csv_str(r.ceil.gpu) << "," << csv_str(r.date) << ","
      << csv_str(r.commit) << "," << csv_str(r.scheme) << "," << csv_str(r.act) << "," << json_num(r.ceil.read_gbs) << ","
      << json_num(r.ceil.gemm_tflops) << ",,,\n";  // no routing for the align row
  if (!f) throw Error("bench: error while writing CSV to '" + path + "'");
}

}  // namespace wna16::cuda::bench
