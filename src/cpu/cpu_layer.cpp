// The SIMD CPU backend: make_cpu_layer. One forward, per chunk of at most kMaxChunkTokens tokens:
//
//   A  activations -> float (rounded to the compute dtype) and, when every gate/up linear has the
//      same kernel K order (no act-order), one prepared row per token (kernels.h: XRow)
//   B  router logits, fp32 from float64 accumulation (so expert ids match route_reference), and
//      the sigmoid gate of a Qwen2-style shared expert
//   -  routing: route_reference itself (exact same ids and weights), then the align step: slots
//      grouped by expert, ascending slot ids within an expert (align_reference's order)
//   C  act-order only: each expert's gate/up rows gathered into that linear's K order
//   D  gate+up: tasks (expert, token range, 64-column block of I); h = silu(g) * u rounded to
//      the activation dtype, as a GPU writes it between its two GEMMs
//   E  h rows prepared for each expert's down projection
//   F  down: tasks (expert, token range, 64-column block of H) -> y per slot
//   G  out[m] = sum_j weight[m, j] * y[m, j] (+ gate * shared(x)), rounded to the output dtype
//
// Work split: tasks are 64-column blocks of one expert's linear, so at M = 1 the (experts x
// blocks) tasks spread every active weight byte over all threads, each byte read once; at large M
// each task also loops over the expert's tokens (up to 2 per decoded weight vector in the AVX-512
// kernel, 4 in the AVX2 one), reusing the block's weights from L2, and token ranges are split
// further only when there are too few blocks.
#include "cpu/cpu_layer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cpu/act_io.h"
#include "cpu/align.h"
#include "cpu/thread_pool.h"
#include "common/knobs.h"
#include "cpu/xprep.h"
#include "wna16/error.h"
#include "wna16/reference.h"

namespace wna16::cpu {

const Kernels& kernels(Isa isa) {
  static const Kernels scalar{Isa::Scalar, gemm_block_scalar, router_scalar, stream_sum_scalar, fma_loop_scalar};
  static const Kernels avx2{Isa::Avx2, gemm_block_avx2, router_avx2, stream_sum_avx2, fma_loop_avx2};
  static const Kernels avx512{Isa::Avx512Vnni, gemm_block_avx512vnni, router_avx512, stream_sum_avx512,
                              fma_loop_avx512};
  if (!isa_supported(isa)) throw Error(std::string("CPU ISA ") + isa_name(isa) + " is not supported by this CPU");
  switch (isa) {
    case Isa::Scalar:
      return scalar;
    case Isa::Avx2:
      return avx2;
    case Isa::Avx512Vnni:
      return avx512;
  }
  return scalar;
}

namespace {

constexpr int64_t kMaxChunkTokens = 4096;  // bounds the per-slot scratch (h and y rows)
constexpr int kRowsPerCall = 64;           // token rows handed to one kernel call
constexpr int64_t kRouterExperts = 16;     // experts per router task
constexpr int64_t kTasksPerThread = 8;     // GEMM tasks per thread and phase (load balance vs stream length)
constexpr int64_t kStreamTokens = 4;       // a block's weight stream costs about this many tokens' compute

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

// WNA16_CPU_TRACE=1 prints each phase's wall time per forward chunk to stderr (for tuning).
struct PhaseTrace {
  bool on = knobs::cpu_trace();
  std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
  std::string line;
  void mark(const char* phase) {
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    char buf[64];
    std::snprintf(buf, sizeof buf, " %s %.0f", phase, std::chrono::duration<double, std::micro>(now - last).count());
    line += buf;
    last = now;
  }
  ~PhaseTrace() {
    if (on) std::fprintf(stderr, "cpu forward us:%s\n", line.c_str());
  }
};

}  // namespace

// One expert with tokens in this chunk: positions [begin, begin + count) of the slot order.
struct CpuMoeLayer::Entry {
  int64_t expert;  // index into experts_ (E = the shared expert)
  int64_t begin, count;
};

CpuMoeLayer::CpuMoeLayer(const MoeLayerSpec& spec, const MoeLayerWeights& w, Isa isa)
    : spec_(spec), kernels_(&kernels(isa)) {
  w.validate(spec);
  router_ = w.router;
  correction_bias_ = w.correction_bias;
  shared_gate_ = w.shared_gate;
  const int64_t E = spec.routing.num_experts;
  experts_.resize(size_t(E + (w.shared ? 1 : 0)));
  // Repacking is independent per expert: spread it over the pool.
  thread_pool().run(int64_t(experts_.size()), [&](int64_t e, int) {
    const ExpertWeights& src = e < E ? w.experts[size_t(e)] : *w.shared;
    const std::string who = e < E ? "expert " + std::to_string(e) : std::string("shared expert");
    try {
      experts_[size_t(e)] =
          PackedExpert{pack_linear(unpack(src.gate)), pack_linear(unpack(src.up)), pack_linear(unpack(src.down))};
    } catch (const Error& err) {
      throw Error(who + ": " + err.what());
    }
  });
  for (const auto& ex : experts_) {
    shared_x_order_ = shared_x_order_ && ex.gate.same_k_order(experts_[0].gate) && ex.up.same_k_order(experts_[0].gate);
    max_inter_ = std::max(max_inter_, ex.gate.N);
  }
}

int64_t CpuMoeLayer::expert_bytes(int64_t e) const {
  const PackedExpert& x = experts_.at(size_t(e));
  return x.gate.checkpoint_bytes() + x.up.checkpoint_bytes() + x.down.checkpoint_bytes();
}

int64_t CpuMoeLayer::shared_bytes() const {
  return int64_t(experts_.size()) > spec_.routing.num_experts ? expert_bytes(spec_.routing.num_experts) : 0;
}

void CpuMoeLayer::forward_host(const void* x, void* out, int64_t M, DType dtype) {
  forward(x, out, M, dtype, dtype, nullptr, nullptr, spec_.routing.top_k);
}

void CpuMoeLayer::forward_routed_host(const void* x, const int32_t* topk_ids, const float* topk_weights, int top_k,
                                      void* out, int64_t M, DType dtype) {
  check_routing(spec_.routing, topk_ids, topk_weights, M, top_k, "cpu forward_routed_host");
  forward(x, out, M, dtype, dtype, topk_ids, topk_weights, top_k);
}

void CpuMoeLayer::forward_routed_f32(const void* x, const int32_t* topk_ids, const float* topk_weights, int top_k,
                                     float* out, int64_t M, DType dtype) {
  check_routing(spec_.routing, topk_ids, topk_weights, M, top_k, "cpu forward_routed_f32");
  forward(x, out, M, dtype, DType::F32, topk_ids, topk_weights, top_k);
}

void CpuMoeLayer::forward(const void* x, void* out, int64_t M, DType dtype, DType out_dtype, const int32_t* ids,
                          const float* wts, int k) {
  check_forward_args(x, out, M, "cpu forward");
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = {};
  const int64_t H = spec_.hidden;
  for (int64_t m0 = 0; m0 < M; m0 += kMaxChunkTokens) {
    const int64_t mc = std::min(kMaxChunkTokens, M - m0);
    forward_chunk(static_cast<const uint8_t*>(x) + m0 * H * int64_t(dtype_size(dtype)),
                  static_cast<uint8_t*>(out) + m0 * H * int64_t(dtype_size(out_dtype)), mc, dtype, out_dtype,
                  ids ? ids + m0 * k : nullptr, wts ? wts + m0 * k : nullptr, k);
  }
}

// ids/wts: the caller's routing [M, k], or null to route with the layer's router.
void CpuMoeLayer::forward_chunk(const void* x, void* out, int64_t M, DType dtype, DType out_dtype,
                                const int32_t* ids, const float* wts, int k) {
  ThreadPool& pool = thread_pool();
  const int threads = pool.size();
  const DType act = compute_dtype(dtype);
  const int64_t H = spec_.hidden, E = spec_.routing.num_experts;
  const bool has_shared = int64_t(experts_.size()) > E;
  const int64_t routed_slots = M * k, S = routed_slots + (has_shared ? M : 0);
  PhaseTrace trace;

  // ---- A: activations to float, and the shared prepared rows --------------------------------
  xf_.resize(size_t(M * H));
  const RowLayout xrow = row_layout_for(experts_[0].gate, kernels_->isa, act);
  if (shared_x_order_) xprep_.resize(size_t(M * xrow.stride));
  const int64_t tok_chunk = std::max<int64_t>(1, std::min<int64_t>(64, (M + threads * 4 - 1) / (threads * 4)));
  pool.run((M + tok_chunk - 1) / tok_chunk, [&](int64_t c, int) {
    for (int64_t m = c * tok_chunk; m < std::min(M, (c + 1) * tok_chunk); ++m) {
      for (int64_t h = 0; h < H; ++h) xf_[size_t(m * H + h)] = load_act(x, dtype, m * H + h);
      if (shared_x_order_) prep_row(experts_[0].gate, xrow, &xf_[size_t(m * H)], &xprep_[size_t(m * xrow.stride)]);
    }
  });

  trace.mark("A");
  // ---- B: router logits (none with the caller's routing) (+ shared expert gate) -------------
  if (!ids) {
    logits_.resize(size_t(M * E));
    const int64_t r_tok = 64, r_tasks_e = (E + kRouterExperts - 1) / kRouterExperts;
    pool.run(((M + r_tok - 1) / r_tok) * r_tasks_e, [&](int64_t t, int) {
      const int64_t e0 = (t % r_tasks_e) * kRouterExperts, ne = std::min(kRouterExperts, E - e0);
      const int64_t mb = (t / r_tasks_e) * r_tok;
      for (int64_t m = mb; m < std::min(M, mb + r_tok); ++m)
        kernels_->router(&xf_[size_t(m * H)], &router_[size_t(e0 * H)], H, ne, &logits_[size_t(m * E + e0)]);
    });
  }
  shared_g_.assign(size_t(M), 1.f);
  if (spec_.shared_kind == SharedExpertKind::SigmoidGated)
    for (int64_t m = 0; m < M; ++m) {
      double d = 0;
      for (int64_t h = 0; h < H; ++h) d += double(xf_[size_t(m * H + h)]) * double(shared_gate_[size_t(h)]);
      shared_g_[size_t(m)] = float(1.0 / (1.0 + std::exp(-d)));
    }

  trace.mark("B");
  // ---- routing and align ---------------------------------------------------------------------
  Routing r;
  if (ids) {
    r.M = M;
    r.top_k = k;
    r.ids.assign(ids, ids + M * k);
    r.weights.assign(wts, wts + M * k);
  } else {
    r = route_reference(spec_.routing, logits_.data(), M, correction_bias_.empty() ? nullptr : correction_bias_.data());
  }
  // block_m = 1: slot ids grouped by expert, ascending within each; expert_ids[i] is slot i's.
  const AlignResult al = align_slots(r.ids.data(), routed_slots, int(E), 1);
  std::vector<int64_t> slot_order(static_cast<size_t>(S));
  for (int64_t p = 0; p < routed_slots; ++p) slot_order[size_t(p)] = al.sorted_token_ids[size_t(p)];
  std::vector<Entry> entries;
  for (int64_t p = 0; p < routed_slots;) {
    int64_t q = p;
    while (q < routed_slots && al.expert_ids[size_t(q)] == al.expert_ids[size_t(p)]) ++q;
    entries.push_back({al.expert_ids[size_t(p)], p, q - p});
    p = q;
  }
  if (has_shared) {
    for (int64_t m = 0; m < M; ++m) slot_order[size_t(routed_slots + m)] = routed_slots + m;
    entries.push_back({E, routed_slots, M});
  }
  stats_.active_experts += int64_t(entries.size()) - (has_shared ? 1 : 0);
  for (const Entry& en : entries) stats_.weight_bytes += expert_bytes(en.expert);
  stats_.weight_bytes += E * H * 4;
  auto token_of = [&](int64_t slot) { return slot < routed_slots ? slot / k : slot - routed_slots; };

  trace.mark("route");
  // ---- C: act-order rows for gate/up (two per position: gate, up) ---------------------------
  int64_t gu_stride = 0;
  if (!shared_x_order_) {
    for (const auto& ex : experts_)
      gu_stride = std::max({gu_stride, row_layout_for(ex.gate, kernels_->isa, act).stride,
                            row_layout_for(ex.up, kernels_->isa, act).stride});
    xprep_.resize(size_t(S * 2 * gu_stride));
    pool.run(int64_t(entries.size()), [&](int64_t i, int) {
      const Entry& en = entries[size_t(i)];
      const PackedExpert& ex = experts_[size_t(en.expert)];
      const RowLayout lg = row_layout_for(ex.gate, kernels_->isa, act), lu = row_layout_for(ex.up, kernels_->isa, act);
      for (int64_t p = en.begin; p < en.begin + en.count; ++p) {
        const float* xs = &xf_[size_t(token_of(slot_order[size_t(p)]) * H)];
        prep_row(ex.gate, lg, xs, &xprep_[size_t((2 * p) * gu_stride)]);
        prep_row(ex.up, lu, xs, &xprep_[size_t((2 * p + 1) * gu_stride)]);
      }
    });
  }

  trace.mark("C");
  // Tasks (entry, token range, column block); token ranges split only when blocks are too few.
  // Tasks: (entry, token range, run of consecutive column blocks). A run is one contiguous byte
  // stream (column blocks are stored back to back), long enough that the prefetchers reach full
  // speed; runs and token ranges are sized so each thread gets about kTasksPerThread tasks.
  struct Task {
    int64_t entry, t0, t1, nb0, nb1;
  };
  // Runs are sized by work, not by block count: a block of an expert with n tokens costs about
  // K (n + kStreamTokens), so an expert with many tokens (the shared one gets all M) is cut into
  // short runs and no single task holds a large part of the phase. Costliest tasks go first so
  // the dynamic schedule ends on small ones.
  auto make_tasks = [&](bool down) {
    auto linear = [&](const Entry& en) -> const PackedLinear& {
      const PackedExpert& ex = experts_[size_t(en.expert)];
      return down ? ex.down : ex.gate;
    };
    auto block_cost = [&](const Entry& en) { return double(linear(en).Kp) * double(en.count + kStreamTokens); };
    int64_t blocks = 0;
    double cost = 0;
    for (const Entry& en : entries) {
      blocks += linear(en).NB;
      cost += block_cost(en) * double(linear(en).NB);
    }
    const int64_t want = kTasksPerThread * threads;
    const double per_task = cost / double(want);
    const int64_t split = std::max<int64_t>(1, (want + blocks - 1) / std::max<int64_t>(blocks, 1));
    std::vector<Task> tasks;
    std::vector<double> task_cost;
    for (int64_t i = 0; i < int64_t(entries.size()); ++i) {
      const Entry& en = entries[size_t(i)];
      const int64_t nbs = linear(en).NB;
      const int64_t run = std::max<int64_t>(1, std::llround(per_task / block_cost(en)));
      const int64_t tb = std::max<int64_t>(4, ((en.count + split - 1) / split + 3) / 4 * 4);
      for (int64_t nb = 0; nb < nbs; nb += run)
        for (int64_t t0 = 0; t0 < en.count; t0 += tb) {
          tasks.push_back({i, t0, std::min(en.count, t0 + tb), nb, std::min(nbs, nb + run)});
          task_cost.push_back(double(tasks.back().nb1 - nb) * double(linear(en).Kp) *
                              double(tasks.back().t1 - t0 + kStreamTokens));
        }
    }
    std::vector<size_t> order(tasks.size());
    for (size_t j = 0; j < order.size(); ++j) order[j] = j;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return task_cost[a] > task_cost[b]; });
    std::vector<Task> sorted;
    sorted.reserve(tasks.size());
    for (size_t j : order) sorted.push_back(tasks[j]);
    return sorted;
  };
  tmp_.resize(size_t(threads) * 2 * kRowsPerCall * kBlockN);

  // ---- D: gate + up, SwiGLU, rounded intermediate --------------------------------------------
  hbuf_.resize(size_t(S * max_inter_));
  {
    const std::vector<Task> tasks = make_tasks(false);
    pool.run(int64_t(tasks.size()), [&](int64_t ti, int worker) {
      const Task& t = tasks[size_t(ti)];
      const Entry& en = entries[size_t(t.entry)];
      const PackedExpert& ex = experts_[size_t(en.expert)];
      float* g = &tmp_[size_t(worker) * 2 * kRowsPerCall * kBlockN];
      float* u = g + kRowsPerCall * kBlockN;
      const RowLayout lg = row_layout_for(ex.gate, kernels_->isa, act), lu = row_layout_for(ex.up, kernels_->isa, act);
      XRow rg[kRowsPerCall], ru[kRowsPerCall];
      for (int64_t nb = t.nb0; nb < t.nb1; ++nb) {
        const int64_t I = ex.gate.N, n0 = nb * kBlockN, nn = std::min<int64_t>(kBlockN, I - n0);
        for (int64_t c0 = t.t0; c0 < t.t1; c0 += kRowsPerCall) {
          const int rows = int(std::min<int64_t>(kRowsPerCall, t.t1 - c0));
          for (int i = 0; i < rows; ++i) {
            const int64_t p = en.begin + c0 + i;
            if (shared_x_order_) {
              const uint8_t* row = &xprep_[size_t(token_of(slot_order[size_t(p)]) * xrow.stride)];
              rg[i] = ru[i] = view_row(xrow, row);
            } else {
              rg[i] = view_row(lg, &xprep_[size_t((2 * p) * gu_stride)]);
              ru[i] = view_row(lu, &xprep_[size_t((2 * p + 1) * gu_stride)]);
            }
          }
          kernels_->gemm_block(ex.gate, nb, rg, rows, g);
          kernels_->gemm_block(ex.up, nb, ru, rows, u);
          for (int i = 0; i < rows; ++i) {
            float* h = &hbuf_[size_t((en.begin + c0 + i) * max_inter_ + n0)];
            for (int64_t c = 0; c < nn; ++c) {
              float gv = g[i * kBlockN + c], uv = u[i * kBlockN + c];
              if (!ex.gate.bias.empty()) gv += ex.gate.bias[size_t(n0 + c)];
              if (!ex.up.bias.empty()) uv += ex.up.bias[size_t(n0 + c)];
              h[c] = round_to(act, silu(gv) * uv);
            }
          }
        }
      }
    });
  }

  trace.mark("D");
  // ---- E: h rows in each down projection's K order -------------------------------------------
  int64_t h_stride = 0;
  for (const auto& ex : experts_) h_stride = std::max(h_stride, row_layout_for(ex.down, kernels_->isa, act).stride);
  hprep_.resize(size_t(S * h_stride));
  pool.run(int64_t(entries.size()), [&](int64_t i, int) {
    const Entry& en = entries[size_t(i)];
    const PackedExpert& ex = experts_[size_t(en.expert)];
    const RowLayout ld = row_layout_for(ex.down, kernels_->isa, act);
    for (int64_t p = en.begin; p < en.begin + en.count; ++p)
      prep_row(ex.down, ld, &hbuf_[size_t(p * max_inter_)], &hprep_[size_t(p * h_stride)]);
  });

  trace.mark("E");
  // ---- F: down projection -> y per slot ------------------------------------------------------
  ybuf_.resize(size_t(S * H));
  {
    const std::vector<Task> tasks = make_tasks(true);
    pool.run(int64_t(tasks.size()), [&](int64_t ti, int worker) {
      const Task& t = tasks[size_t(ti)];
      const Entry& en = entries[size_t(t.entry)];
      const PackedExpert& ex = experts_[size_t(en.expert)];
      float* y = &tmp_[size_t(worker) * 2 * kRowsPerCall * kBlockN];
      const RowLayout ld = row_layout_for(ex.down, kernels_->isa, act);
      XRow rd[kRowsPerCall];
      for (int64_t nb = t.nb0; nb < t.nb1; ++nb) {
        const int64_t n0 = nb * kBlockN, nn = std::min<int64_t>(kBlockN, H - n0);
        for (int64_t c0 = t.t0; c0 < t.t1; c0 += kRowsPerCall) {
          const int rows = int(std::min<int64_t>(kRowsPerCall, t.t1 - c0));
          for (int i = 0; i < rows; ++i) rd[i] = view_row(ld, &hprep_[size_t((en.begin + c0 + i) * h_stride)]);
          kernels_->gemm_block(ex.down, nb, rd, rows, y);
          for (int i = 0; i < rows; ++i) {
            float* dst = &ybuf_[size_t(slot_order[size_t(en.begin + c0 + i)] * H + n0)];
            for (int64_t c = 0; c < nn; ++c)
              dst[c] = y[i * kBlockN + c] + (ex.down.bias.empty() ? 0.f : ex.down.bias[size_t(n0 + c)]);
          }
        }
      }
    });
  }

  trace.mark("F");
  // ---- G: weighted top-k sum (+ shared expert), rounded to the output dtype -----------------
  pool.run((M + tok_chunk - 1) / tok_chunk, [&](int64_t c, int) {
    std::vector<float> acc(static_cast<size_t>(H));
    for (int64_t m = c * tok_chunk; m < std::min(M, (c + 1) * tok_chunk); ++m) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int j = 0; j < k; ++j) {
        const float wj = r.weights[size_t(m * k + j)];
        const float* y = &ybuf_[size_t((m * k + j) * H)];
        for (int64_t h = 0; h < H; ++h) acc[size_t(h)] += wj * y[h];
      }
      if (has_shared) {
        const float gs = shared_g_[size_t(m)];
        const float* y = &ybuf_[size_t((routed_slots + m) * H)];
        for (int64_t h = 0; h < H; ++h) acc[size_t(h)] += gs * y[h];
      }
      for (int64_t h = 0; h < H; ++h) store_act(out, out_dtype, m * H + h, acc[size_t(h)]);
    }
  });
  trace.mark("G");
}

std::unique_ptr<CpuMoeLayer> make_cpu_layer_isa(const MoeLayerSpec& spec, const MoeLayerWeights& w, Isa isa) {
  return std::make_unique<CpuMoeLayer>(spec, w, isa);
}

}  // namespace wna16::cpu

namespace wna16 {

std::unique_ptr<MoeBackendLayer> make_cpu_layer(const MoeLayerSpec& spec, const MoeLayerWeights& w) {
  return cpu::make_cpu_layer_isa(spec, w, cpu::default_isa());
}

}  // namespace wna16
