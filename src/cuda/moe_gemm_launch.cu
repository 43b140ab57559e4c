// Host launcher of the fused MoE GEMM: argument checks (naming the bad value), the tile-config and
// split-K choice, and the dispatch to the per-bit-width instantiations.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "cuda/cuda_check.h"
#include "cuda/moe_gemm.h"
#include "cuda/sm90_wna16_moe_decode.cuh"
#include "cuda/sm90_wna16_moe_prefill.cuh"
#include "wna16/error.h"
#include "wna16/reference.h"

namespace wna16::cuda {
namespace gemm {

DeviceInfo device_info() {
  static DeviceInfo info;
  static std::once_flag once;
  std::call_once(once, [] {
    int dev = 0;
    WNA16_CUDA_CHECK(cudaGetDevice(&dev));
    WNA16_CUDA_CHECK(cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, dev));
    WNA16_CUDA_CHECK(cudaDeviceGetAttribute(&info.max_smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  });
  return info;
}

}  // namespace gemm

namespace {
struct ConfigRow {
  const char* name;
  int block_m;
  int block_n;
};
// Mirrors the tile table in sm90_wna16_moe_gemm.cuh (static_asserts below keep them in step).
constexpr ConfigRow kConfigs[] = {
    {"m8", gemm::CfgM8::BLOCK_M, gemm::CfgM8::BLOCK_N},
    {"m32", gemm::CfgM32::BLOCK_M, gemm::CfgM32::BLOCK_N},
    {"m64", gemm::CfgM64::BLOCK_M, gemm::CfgM64::BLOCK_N},
    {"m144w", gemm::CfgM144W::BLOCK_M, gemm::CfgM144W::BLOCK_N},  // wgmma prefill kernel, no act-order
};
constexpr int kConfigM144W = 3;
constexpr int kNumConfigs = int(sizeof(kConfigs) / sizeof(kConfigs[0]));
static_assert(kConfigs[0].block_m < kConfigs[1].block_m && kConfigs[1].block_m < kConfigs[2].block_m &&
                  kConfigs[2].block_m < kConfigs[3].block_m,
              "configs are ordered by BLOCK_M; the largest sizes the workspace");
}  // namespace

int gemm_config_count() { return kNumConfigs; }
int gemm_config_block_m(int config) {
  if (config < 0 || config >= kNumConfigs) throw Error("GEMM config " + std::to_string(config) + " does not exist");
  return kConfigs[config].block_m;
}
bool gemm_config_takes_kperm(int config) { return config == kConfigM144W; }
const char* gemm_config_name(int config) { return kConfigs[std::clamp(config, 0, kNumConfigs - 1)].name; }

int choose_gemm_config(int64_t M, int64_t topk, int64_t E, bool act_order) {
  // Expected number of experts that receive a token under uniform routing, and tokens per such
  // expert: the MMA's token width should match it (padding is wasted MMA work and registers).
  const double p = std::min(1.0, double(topk) / double(E));
  const double active = std::max(1.0, double(E) * (1.0 - std::pow(1.0 - p, double(M))));
  const double per_expert = double(M) * double(topk) / active;
  // The decode kernel (8-token m-blocks) up to 40 tokens per expert without act-order: beyond 8
  // an expert's m-blocks stream the same weights (L2 shares them when they run together), which
  // measured faster than the staged m32 kernel (H200, docs/perf.md: DeepSeek-V3 M=256 6380 ->
  // 2684 us) and than a decode kernel with 16-token m-blocks. A/B switch for the bound:
  // WNA16_DECODE_MAX_TOKENS=<tokens per expert> (8: the staged kernel from 9 tokens).
  static const double decode_max = [] {
    const char* v = std::getenv("WNA16_DECODE_MAX_TOKENS");
    return v && *v ? std::atof(v) : 40.0;
  }();
  if (per_expert <= decode_max && !act_order) return 0;
  if (per_expert <= 8.0) return 0;
  if (per_expert <= 40.0) return 1;
  // The wgmma kernel (144-token m-blocks) from 64 tokens per expert; it has no act-order gather.
  // Measured against the staged kernel (H200, docs/perf.md session 16), us staged / wgmma: at 64-72
  // tokens per expert faster or level (Mixtral M=256 1127 / 1048; DeepSeek-V2-Lite M=720 608 /
  // 561, M=768 657 / 571; Qwen3-30B-A3B M=1024 541 / 537; Qwen1.5-MoE M=1024 655 / 654), at 48-52
  // slower (Mixtral M=208 929 / 1010; Qwen3 M=768 391 / 496; DeepSeek-V2-Lite M=512 431 / 492).
  // A/B and tuning switches: WNA16_NO_WGMMA_PREFILL (never m144w), WNA16_PREFILL_MIN_TOKENS=<tokens
  // per expert> (96 until session 16).
  static const bool no_wgmma = std::getenv("WNA16_NO_WGMMA_PREFILL") != nullptr;
  static const double min_tokens = [] {
    const char* v = std::getenv("WNA16_PREFILL_MIN_TOKENS");
    return v && *v ? std::atof(v) : 64.0;
  }();
  if (per_expert >= min_tokens && !act_order && !no_wgmma) return kConfigM144W;
  return 2;
}

int resident_blocks(int bits, int config, DType act) {
  const int bps = bits == 4 ? gemm::launch_w4(nullptr, config, act, 0, nullptr)
                            : gemm::launch_w8(nullptr, config, act, 0, nullptr);
  return bps * gemm::device_info().sms;
}

double expected_mblocks(int64_t M, int64_t topk, int64_t E, int64_t bm) {
  if (M < 1 || topk < 1 || E < 1 || bm < 1)
    throw Error("expected_mblocks: M=" + std::to_string(M) + " topk=" + std::to_string(topk) + " E=" +
                std::to_string(E) + " bm=" + std::to_string(bm) + " must all be >= 1");
  const double p = std::min(1.0, double(topk) / double(E));
  if (p >= 1.0) return double(E) * double((M + bm - 1) / bm);
  // sum over n of P(n) ceil(n / bm), over mean +- 12 standard deviations (the rest is < 1e-30).
  const double mean = double(M) * p, sd = std::sqrt(double(M) * p * (1.0 - p));
  const int64_t lo = std::max<int64_t>(0, int64_t(mean - 12.0 * sd) - 1);
  const int64_t hi = std::min<int64_t>(M, int64_t(mean + 12.0 * sd) + 2);
  const double lgm = std::lgamma(double(M) + 1.0), lp = std::log(p), lq = std::log1p(-p);
  double blocks = 0.0;
  for (int64_t n = lo; n <= hi; ++n) {
    const double lpmf = lgm - std::lgamma(double(n) + 1.0) - std::lgamma(double(M - n) + 1.0) + double(n) * lp +
                        double(M - n) * lq;
    blocks += std::exp(lpmf) * double((n + bm - 1) / bm);
  }
  return double(E) * blocks;
}

namespace {
// The m-blocks the align step is expected to produce; the real count is only known on the device.
// Decode kernel (bm = 8): the expectation of the sum over experts of ceil(tokens / bm),
// expected_mblocks(). Staged kernels, and the decode kernel under the A/B switch
// WNA16_DECODE_MBLOCKS=spill: one block per distinct expert plus (slots - active) / bm, which
// over-counts when experts get fewer than bm tokens (Mixtral M=16, 4 per expert: 11 for 8) and made
// the decode work model pick the wrong K split there (docs/perf.md, session 5: 233 -> 219 us).
int64_t estimate_mblocks(int64_t M, int64_t topk, int64_t E, int64_t bm) {
  static const bool spill_model = [] {
    const char* v = std::getenv("WNA16_DECODE_MBLOCKS");
    const std::string t = v ? v : "";
    if (!t.empty() && t != "exact" && t != "spill")
      throw Error("WNA16_DECODE_MBLOCKS=" + t + " is not exact or spill");
    return t == "spill";
  }();
  const bool exact = bm == gemm::kDecodeBM && !spill_model;
  const int64_t slots = M * topk;
  if (exact && M >= 1 && topk >= 1 && E >= 1)
    return std::max<int64_t>(1, std::llround(expected_mblocks(M, topk, E, bm)));
  const double p = std::min(1.0, double(topk) / double(std::max<int64_t>(1, E)));
  const int64_t active = int64_t(std::ceil(double(E) * (1.0 - std::pow(1.0 - p, double(M)))));
  const int64_t spill = std::max<int64_t>(0, slots - active) / bm;  // blocks beyond one per active expert
  return std::max<int64_t>(1, std::min<int64_t>(active + spill, (slots + bm - 1) / bm + E));
}

// Decode kernel: the critical path, in units of one tile pair's k-chunk (1 KB of int4), of a work
// shape on a persistent grid: rounds of resident blocks x (chunks per warp x a chunk's time + the
// ring's fill, paid again by every item). ppw = 2 (the 4-tile variant): a warp's chunk is two
// pairs' chunks, which take kDecode4TileChunkCost pair chunks of time (its instructions per chunk
// over the pair kernel's; the per-warp rate is bound by the warp's own instruction stream), and a
// block covers twice the pairs (units of 2 pairs; kw = 1 blocks may hang over N).
// NOTE: 1.7 is the main loop's instruction ratio (nvcc -ptx, see docs/perf.md), not a measurement.
constexpr double kDecode4TileChunkCost = 1.7;
struct DecodeShape {
  int kw = 1;
  double cost = 0;
};
// only_kw != 0: that in-block K split only (the A/B switch WNA16_DECODE_KW).
DecodeShape best_decode_kw(int64_t mblocks, int64_t pairs, int64_t splits, int64_t kc_per_split, int64_t resident,
                           int ppw, int only_kw) {
  DecodeShape best{1, 1e300};
  const int64_t units = (pairs + ppw - 1) / ppw;
  const double chunk = ppw == 2 ? kDecode4TileChunkCost : 1.0;
  for (int kw : {1, 2, 4}) {
    if (only_kw != 0) {
      if (kw != only_kw) continue;
    } else if (kw > 1 && kc_per_split < 2 * kw) {
      break;  // keep >= 2 chunks (one g128 group) per warp
    }
    const int64_t units_per_block = gemm::kDecodeWarps / kw;
    const int64_t blocks = mblocks * ((units + units_per_block - 1) / units_per_block) * splits;
    const int64_t rounds = (blocks + resident - 1) / resident;
    const double cost = double(rounds) * (double(kc_per_split) / kw * chunk + gemm::kDecodePF);
    if (cost < best.cost * (1 - 1e-9)) best = {kw, cost};
  }
  return best;
}
// The pairs per warp (1 or 2) the decode kernel may run this GEMM with: {lo, hi}. Int4 only has 2.
std::pair<int, int> decode_ppw_range(const DeviceGemm& w, int decode_4tiles) {
  if (w.bits != 4 || decode_4tiles == kDecodePairs) return {1, 1};
  return decode_4tiles == kDecode4Tiles ? std::pair{2, 2} : std::pair{1, 2};
}
// The best shape over the allowed pairs per warp (ties: one pair, the measured kernel).
struct DecodeChoice {
  DecodeShape shape;
  int ppw = 1;
};
DecodeChoice best_decode_shape(int64_t mblocks, int64_t pairs, int64_t splits, int64_t kc_per_split, int64_t resident,
                               std::pair<int, int> ppw_range, int only_kw) {
  DecodeChoice best{{1, 1e300}, 1};
  for (int ppw = ppw_range.first; ppw <= ppw_range.second; ++ppw) {
    const DecodeShape s = best_decode_kw(mblocks, pairs, splits, kc_per_split, resident, ppw, only_kw);
    if (s.cost < best.shape.cost * (1 - 1e-9)) best = {s, ppw};
  }
  return best;
}
// The A/B switch WNA16_DECODE_KW (read once): {GEMM1's pin, GEMM2's pin}, 0 = the model's choice.
std::pair<int, int> decode_kw_pins() {
  static const std::pair<int, int> pins = [] {
    const char* v = std::getenv("WNA16_DECODE_KW");
    return parse_decode_kw_pin(v ? v : "");
  }();
  return pins;
}
// WNA16_TRACE_GEMM=1: every distinct launch shape once, on stderr (which config, split and decode
// work shape the host chose), for reading A/B results against the model.
void trace_launch(const DeviceGemm& w, const GemmRun& r, const gemm::KParams& kp) {
  static const bool on = [] {
    const char* v = std::getenv("WNA16_TRACE_GEMM");
    return v && *v && *v != '0';
  }();
  if (!on) return;
  char line[256];
  std::snprintf(line, sizeof line,
                "[wna16 gemm] %s K=%lld N=%lld E=%lld slots=%lld config=%s splits=%d kc_per_split=%d kw=%d pairs/warp=%d "
                "shared-slice parts=%d\n",
                r.epilogue == GemmEpilogue::SiluMul ? "GEMM1" : "GEMM2", (long long)w.K, (long long)w.N, (long long)w.E,
                (long long)r.num_slots, kConfigs[r.config].name, kp.splits, kp.kc_per_split, kp.decode_kw, kp.decode_ppw,
                kp.pre_slices > 0 ? kp.pre_parts : 0);
  static std::mutex mu;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> lock(mu);
  if (seen.insert(line).second) std::fputs(line, stderr);
}

// The decode kernel's work shape for run r of w (the split given) on the expected m-blocks, and
// its expected work items against the resident blocks. fill (GEMM1 with the m-block handoff): where
// the model's shape leaves more than 1/10 of the resident blocks idle in its only round, the
// cheapest modelled finer K split (same tile pairs per warp) that fills at least one round instead;
// GEMM2 runs in the slots its partial second round leaves. Measured (docs/perf.md, session 5):
// Mixtral M=1 62.2 -> 59.1 us (kw 2 -> 4); one pair per warp instead of two, the other way to more
// items, lost 1.4 us at Qwen1.5-MoE and DeepSeek-V2-Lite M=1. A/B switch: WNA16_NO_HANDOFF_FILL=1.
struct DecodePlan {
  int kw = 1, ppw = 1;
  double items = 0;
  int64_t resident = 1;
};
// A tight bound on the m-blocks the align step can produce: every active expert pads at most one
// partial block, so blocks <= ceil(slots / BLOCK_M) + min(E, slots) (usually far below max_blocks,
// which assumes every expert padded); mb_count where the run names its m-blocks.
int64_t upper_mblocks(const DeviceGemm& w, const GemmRun& r) {
  const int64_t bm = gemm_config_block_m(r.config);
  const int64_t tight = (r.num_slots + bm - 1) / bm + std::min<int64_t>(w.E, r.num_slots);
  return r.mb_count >= 0 ? r.mb_count : std::min<int64_t>(r.max_blocks, tight);
}
// The m-blocks of the shared slices run ahead of the align step (GemmRun::pre_wait_slices):
// ceil(tokens / BLOCK_M) per slice.
int64_t pre_wait_mblocks(const GemmRun& r) {
  const int64_t bm = gemm_config_block_m(r.config);
  return r.topk > 0 ? int64_t(r.pre_wait_slices) * ((r.num_slots / r.topk + bm - 1) / bm) : 0;
}

DecodePlan plan_decode(const DeviceGemm& w, const GemmRun& r, int splits, int kc_per_split, bool fill) {
  const int64_t bm = gemm_config_block_m(r.config);
  const int64_t upper = upper_mblocks(w, r);
  const int64_t mblocks_all =
      r.mb_count >= 0 ? r.mb_count : std::min(upper, estimate_mblocks(r.num_slots / r.topk, r.topk, w.E, bm));
  // The shared slices' m-blocks run ahead of the wait for the align step, during the routing
  // chain (GemmRun::pre_wait_slices): where they are at most a quarter of the m-blocks, plan the
  // rounds after the wait on the others (DeepSeek-V3 M=1: 8 of 9, so 512 items of two tile pairs
  // per warp fill one round of 528 blocks). A/B switch: WNA16_NO_PRE_WAIT_PLAN=1.
  static const bool no_pre_plan = std::getenv("WNA16_NO_PRE_WAIT_PLAN") != nullptr;
  int64_t mblocks = mblocks_all;
  if (r.pre_wait_slices > 0 && !no_pre_plan) {
    const int64_t pre = pre_wait_mblocks(r);
    if (4 * pre <= mblocks_all) mblocks = std::max<int64_t>(1, mblocks_all - pre);
  }
  const int only_kw = r.epilogue == GemmEpilogue::SiluMul ? decode_kw_pins().first : decode_kw_pins().second;
  DecodePlan plan;
  plan.resident = resident_blocks(w.bits, r.config, r.act);
  const DecodeChoice c = best_decode_shape(mblocks, w.NT / 2, splits, kc_per_split, plan.resident,
                                           decode_ppw_range(w, r.decode_4tiles), only_kw);
  plan.ppw = c.ppw;
  plan.kw = r.decode_kw != 0 ? r.decode_kw : c.shape.kw;
  auto items = [&](int ppw, int kw) {
    const int64_t units = w.NT / (2 * ppw), per_block = gemm::kDecodeWarps / kw;
    return double(mblocks) * double((units + per_block - 1) / per_block) * splits;
  };
  plan.items = items(plan.ppw, plan.kw);
  static const bool no_fill = std::getenv("WNA16_NO_HANDOFF_FILL") != nullptr;
  if (fill && !no_fill && only_kw == 0 && r.decode_kw == 0 && plan.items < 0.9 * double(plan.resident)) {
    double best = 1e300;
    const int model_kw = plan.kw;
    for (int kw : {2, 4}) {
      if (kw <= model_kw || items(plan.ppw, kw) < double(plan.resident) || kc_per_split < 2 * kw) continue;
      const double cost = best_decode_kw(mblocks, w.NT / 2, splits, kc_per_split, plan.resident, plan.ppw, kw).cost;
      if (cost < best * (1 - 1e-9)) best = cost, plan.kw = kw;
    }
    plan.items = items(plan.ppw, plan.kw);
  }
  return plan;
}
}  // namespace

bool decode_items_long(const DeviceGemm& g) { return g.K * g.bits >= 16384; }

namespace {
// A/B switches for measurements (results are the same either way): WNA16_NO_DEFER=1 (per-weight
// dequantisation everywhere), WNA16_NO_STATIC_GROUPS=1 (group bookkeeping at run time).
bool defer_allowed() {
  static const bool no_defer = std::getenv("WNA16_NO_DEFER") != nullptr;
  return !no_defer;
}
bool static_groups_allowed() {
  static const bool no_static = std::getenv("WNA16_NO_STATIC_GROUPS") != nullptr;
  return !no_static;
}
}  // namespace

bool decode_routes_token(const DeviceGemm& g) {
  // The kernel variant exists for int4 with static groups of kDecodeRouteCpg chunks (group 128),
  // which launch_moe_gemm takes for such weights on the decode kernel (make_kparams).
  const int64_t kc = g.K / PackedGemm::kChunkK;
  return g.bits == 4 && !g.perm && !g.perm_up && defer_allowed() && static_groups_allowed() &&
         g.group_len == gemm::kDecodeRouteCpg * PackedGemm::kChunkK && kc % gemm::kDecodeRouteCpg == 0;
}

namespace {
// An integer A/B switch: the value of environment variable `name` (a whole number in [lo, hi]),
// or `fallback` when it is unset or empty. Throws Error naming the value otherwise.
int64_t env_int(const char* name, int64_t lo, int64_t hi, int64_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  if (*end != '\0' || n < lo || n > hi)
    throw Error(std::string(name) + "=" + v + " is not " + std::to_string(lo) + ".." + std::to_string(hi));
  return n;
}
}  // namespace

bool shared_slice_parts_pay(const DeviceGemm& g1, int64_t tokens) {
  const bool static_group =
      g1.group_len % PackedGemm::kChunkK == 0 && gemm::decode_static_cpg<4>(int(g1.group_len / PackedGemm::kChunkK));
  return tokens == 1 && g1.bits == 4 && static_group && !g1.perm && !g1.perm_up && decode_items_long(g1);
}

int handoff_pairs_per_slot(int64_t pairs) {
  static const int64_t slots = env_int("WNA16_HANDOFF_SLOTS", 1, kHandoffSlots, kHandoffSlots);
  if (pairs < 1) throw Error("handoff: pairs=" + std::to_string(pairs) + " is not positive");
  const int64_t per = (pairs + slots - 1) / slots;
  return int((per + 1) / 2 * 2);
}

bool mb_handoff_pays(const DeviceGemm& g1, const GemmRun& r1) {
  if (r1.config != 0 || g1.perm || g1.perm_up || r1.num_slots < 1) return false;
  // Measured (docs/perf.md, session 5): GEMM2 gains where GEMM1's items nearly fill the resident
  // blocks or more (a last partial round, or uneven SMs, leave slots it can use: DeepSeek-V3 M=1
  // 1152 items on 528 blocks, 75.2 -> 72.9 us; Qwen3 M=16 492, 78.6 -> 76.5), and loses about 1 us
  // below (Qwen3 M=1 384 items, 21.6 -> 22.5; DeepSeek-V2-Lite M=1 352, 27.3 -> 28.0), where every
  // m-block is done at once and the releases only add their fences. The shape is GEMM1's with the
  // handoff (plan_decode's fill: Mixtral M=1 448 -> 896 items).
  const DecodePlan plan = plan_decode(g1, r1, 1, int(g1.K / PackedGemm::kChunkK), true);
  return plan.items >= 0.9 * double(plan.resident);
}

std::pair<int, int> parse_decode_kw_pin(const std::string& v) {
  auto one = [&](const std::string& t) {
    if (t != "0" && t != "1" && t != "2" && t != "4")
      throw Error("WNA16_DECODE_KW=" + v + ": '" + t + "' is not 0 (the model's choice), 1, 2 or 4");
    return std::stoi(t);
  };
  if (v.empty()) return {0, 0};
  const size_t comma = v.find(',');
  if (comma == std::string::npos) return {one(v), one(v)};
  return {one(v.substr(0, comma)), one(v.substr(comma + 1))};
}

int decode_4tiles_default() {
  static const int mode = [] {
    const char* v = std::getenv("WNA16_DECODE_4TILES");
    const std::string s = v ? v : "";
    if (s == "0") return kDecodePairs;
    if (s == "1") return kDecode4Tiles;
    if (!s.empty() && s != "auto") throw Error("WNA16_DECODE_4TILES=" + s + " is not 0, 1 or auto");
    return kDecodeTilesAuto;
  }();
  return mode;
}

int choose_splits(const DeviceGemm& w, int config, DType act, int64_t M, int64_t topk, int decode_4tiles) {
  // Work items = m-blocks x n-blocks x splits run on a persistent grid of the resident blocks.
  // The m-block count is only known on the device: estimate it (distinct experts + the tokens'
  // own blocks). Split K so the items fill the resident blocks once, never a little more (a
  // second, nearly empty round would double the time of an issue-bound decode step).
  const int64_t est_mblocks = estimate_mblocks(M, topk, w.E, gemm_config_block_m(config));
  const int64_t resident = resident_blocks(w.bits, config, act);
  const int64_t kc = w.K / PackedGemm::kChunkK;
  if (config == 0 && !w.perm) {
    // Decode kernel: the split (with its best in-block K split) of the shortest critical path;
    // ties go to fewer splits (fewer atomics).
    int best = 1;
    double best_cost = 1e300;
    for (int64_t sp = 1; sp <= 8 && (sp == 1 || kc / sp >= 8); ++sp) {
      const int64_t per = (kc + sp - 1) / sp;
      const double cost =
          best_decode_shape(est_mblocks, w.NT / 2, sp, per, resident, decode_ppw_range(w, decode_4tiles),
                            decode_kw_pins().second)
              .shape.cost;
      if (cost < best_cost * (1 - 1e-9)) best_cost = cost, best = int(sp);
    }
    return best;
  }
  const int64_t nb = w.NT / (kConfigs[config].block_n / 16);
  const int64_t items = est_mblocks * nb;
  int64_t splits = std::max<int64_t>(1, resident / std::max<int64_t>(1, items));
  splits = std::min<int64_t>(splits, std::max<int64_t>(1, kc / 4));  // keep >= 4 chunks per split
  return int(std::clamp<int64_t>(splits, 1, 32));
}

void launch_moe_gemm(const DeviceGemm& w, const GemmRun& r, Stream stream) {
  if (w.bits != 4 && w.bits != 8) throw Error("bits=" + std::to_string(w.bits) + " is not supported (4 or 8)");
  if (r.act != DType::BF16 && r.act != DType::F16)
    throw Error(std::string("activation dtype ") + dtype_name(r.act) + " is not supported (f16 or bf16)");
  if (w.K % PackedGemm::kChunkK != 0)
    throw Error("K=" + std::to_string(w.K) + " is not a multiple of " + std::to_string(PackedGemm::kChunkK));
  if (w.NT % PackedGemm::kTilePad != 0 || w.NT * 16 < w.N)
    throw Error("packed n-tiles NT=" + std::to_string(w.NT) + " do not cover N=" + std::to_string(w.N));
  if (w.group_len <= 0 || w.group_len % 16 != 0 || w.K % w.group_len != 0)
    throw Error("group length " + std::to_string(w.group_len) + " is not a multiple of 16 dividing K=" +
                std::to_string(w.K));
  if (r.config < 0 || r.config >= kNumConfigs) throw Error("GEMM config " + std::to_string(r.config) + " does not exist");
  if (r.config == kConfigM144W && (w.perm || w.perm_up))
    throw Error(std::string("GEMM config ") + kConfigs[r.config].name + " has no act-order gather (perm): use config m64");
  if ((r.x_kperm || r.out_kperm) && r.config != kConfigM144W)
    throw Error(std::string("GEMM config ") + kConfigs[r.config].name +
                " reads and writes activations in natural k order: x_kperm / out_kperm are for m144w only");
  if (r.out_kperm && (r.epilogue != GemmEpilogue::SiluMul || (w.N / 2) % 64 != 0))
    throw Error("out_kperm needs the SiluMul epilogue and an output width (N/2 = " + std::to_string(w.N / 2) +
                ") that is a multiple of 64");
  if (r.x_kperm && (reinterpret_cast<uintptr_t>(r.x) % 16 != 0 || r.x_stride % 8 != 0))
    throw Error("x_kperm needs x 16-byte aligned and x_stride (" + std::to_string(r.x_stride) + ") a multiple of 8");
  if ((r.mb_done || r.item_claim) && (r.config != 0 || w.perm || w.perm_up))
    throw Error(std::string("the m-block handoff (mb_done) is for the decode kernel (config m8 without act-order), not ") +
                kConfigs[r.config].name + (w.perm || w.perm_up ? " with act-order" : ""));
  if (r.epilogue == GemmEpilogue::WeightedSum && r.mb_done && (r.mb_done_target < 1 || !r.item_claim))
    throw Error("GEMM2's m-block handoff needs mb_done_target >= 1 (is " + std::to_string(r.mb_done_target) +
                ") and an item_claim counter");
  if (r.pre_wait_slices != 0 &&
      (r.pre_wait_slices < 0 || r.pre_wait_slices > r.topk || r.pre_wait_slices > w.E || r.config != 0 || w.perm ||
       w.perm_up || r.epilogue != GemmEpilogue::SiluMul || !r.overlap_previous || !r.wait_first || r.mb_begin != 0 ||
       r.mb_count >= 0))
    throw Error("pre_wait_slices=" + std::to_string(r.pre_wait_slices) +
                " needs 0 < S <= topk (" + std::to_string(r.topk) + ") and <= E (" + std::to_string(w.E) +
                "), the decode kernel (config m8 without act-order), the SiluMul epilogue, overlap_previous and "
                "wait_first, over all m-blocks (mb_begin 0, mb_count < 0)");
  if (r.pre_wait_slices > 0 && pre_wait_mblocks(r) * w.NT >= (int64_t(1) << 31))
    throw Error("pre_wait_slices=" + std::to_string(r.pre_wait_slices) + " with " + std::to_string(r.num_slots / r.topk) +
                " tokens: the shared slices' work items exceed the kernel's 2^31 range");
  if (r.route_logits &&
      (r.config != 0 || w.perm || w.perm_up || r.route_E < 1 || r.route_E > 32 || r.route_topk < 1 ||
       r.route_topk > r.route_E || r.topk != r.route_topk || r.num_slots != r.topk || r.mb_begin != 0 ||
       r.mb_count >= 0 || r.pre_wait_slices != 0))
    throw Error("route_logits (one token routed in the GEMM) with E=" + std::to_string(r.route_E) + ", top_k=" +
                std::to_string(r.route_topk) + ", topk=" + std::to_string(r.topk) + ", num_slots=" +
                std::to_string(r.num_slots) + ": needs the decode kernel (config m8 without act-order), one token "
                "(num_slots == topk == top_k <= E <= 32), all m-blocks and no shared slices run ahead");
  if (r.route_logits && !decode_routes_token(w))
    throw Error("route_logits: the decode kernel routes a token itself for int4 weights in groups of 128 only (bits " +
                std::to_string(w.bits) + ", group length " + std::to_string(w.group_len) + ", K=" + std::to_string(w.K) +
                ")");
  if (r.x_per_slot && (r.epilogue != GemmEpilogue::SiluMul || w.perm || w.perm_up))
    throw Error("x_per_slot (x already gathered per slot) is for GEMM1 (SiluMul) without a perm of its own");
  if (r.epilogue == GemmEpilogue::SiluMul && (w.N % 32 != 0))
    throw Error("gate/up GEMM N=" + std::to_string(w.N) + " (2*I) is not a multiple of 32");
  if (r.epilogue == GemmEpilogue::SiluMul && r.splits != 1)
    throw Error("split-K=" + std::to_string(r.splits) + " is not possible before the SiLU epilogue");
  if (r.splits < 1) throw Error("split-K=" + std::to_string(r.splits) + " must be >= 1");
  if (r.num_slots < 0 || r.num_slots >= (int64_t(1) << 31) || r.topk < 1)
    throw Error("num_slots=" + std::to_string(r.num_slots) + " / topk=" + std::to_string(r.topk) + " out of range");
  if (!w.qweight || !w.scales || !r.x || !r.out || !r.sorted_ids || !r.expert_ids ||
      (r.mb_count < 0 && !r.num_tokens_post_padded) || (r.epilogue == GemmEpilogue::WeightedSum && !r.topk_weights))
    throw Error("launch_moe_gemm: a required device pointer is null");
  {
    // The staged and prefill kernels index x with 32-bit element offsets.
    const int64_t x_rows = r.epilogue != GemmEpilogue::SiluMul ? r.max_blocks * gemm_config_block_m(r.config)
                           : r.x_per_slot                       ? r.num_slots
                                                                : r.num_slots / std::max(1, r.topk);
    if (x_rows * r.x_stride + w.K >= (int64_t(1) << 31))
      throw Error("x of " + std::to_string(x_rows) + " rows x " + std::to_string(r.x_stride) +
                  " elements is above the kernels' 2^31 element index range");
  }
  if (r.x_rows < 0 || (r.x_rows > 0 && r.epilogue == GemmEpilogue::WeightedSum &&
                        r.x_rows < max_padded_slots(r.num_slots, w.E, gemm_config_block_m(r.config))))
    throw Error("x_rows=" + std::to_string(r.x_rows) + " is below the align step's bound on the padded rows (" +
                std::to_string(max_padded_slots(r.num_slots, w.E, gemm_config_block_m(r.config))) + ")");
  if (w.E * w.G * w.NT * 8 >= (int64_t(1) << 31))
    throw Error("scale table of " + std::to_string(w.E * w.G * w.NT * 8) + " words is above the kernel's 2^31 index range");
  if (r.num_slots == 0 || r.mb_count == 0) return;

  gemm::KParams kp{};
  kp.qweight = static_cast<const uint4*>(w.qweight);
  kp.scales = w.scales;
  kp.zeros = w.zeros;
  kp.perm = w.perm;
  kp.perm_up = w.perm_up;
  kp.qw_stride = (w.K / PackedGemm::kChunkK) * w.NT * 32 * (w.bits / 4);
  kp.meta_stride = w.G * w.NT * 8;
  kp.K = int(w.K);
  kp.N = int(w.N);
  kp.NT = int(w.NT);
  kp.group_len = int(w.group_len);
  kp.KC = int(w.K / PackedGemm::kChunkK);
  kp.default_zero = (1u << (w.bits - 1)) * 0x10001u;
  kp.G = int(w.G);
  kp.x = r.x;
  kp.x_stride = r.x_stride;
  kp.out = r.out;
  kp.out_stride = r.epilogue == GemmEpilogue::SiluMul ? w.N / 2 : w.N;
  kp.topk_weights = r.topk_weights;
  kp.topk = r.topk;
  kp.x_div = r.x_per_slot ? 1 : r.topk;
  kp.num_slots = int(r.num_slots);
  kp.sorted_ids = r.sorted_ids;
  kp.expert_ids = r.expert_ids;
  kp.ntpp = r.num_tokens_post_padded;
  kp.mb_begin = int(r.mb_begin);
  kp.mb_count = int(r.mb_count);
  kp.kc_per_split = int((kp.KC + r.splits - 1) / r.splits);
  kp.splits = (kp.KC + kp.kc_per_split - 1) / kp.kc_per_split;  // no empty split
  kp.epilogue = r.epilogue == GemmEpilogue::SiluMul ? 0 : 1;
  kp.x_kperm = r.x_kperm ? 1 : 0;
  kp.out_kperm = r.out_kperm ? 1 : 0;
  kp.x_rows = r.epilogue == GemmEpilogue::WeightedSum ? r.x_rows : 0;  // 0: extent unknown
  kp.mb_done = r.mb_done;
  kp.mb_done_target = r.mb_done_target;
  kp.mb_done_pps = r.mb_done ? handoff_pairs_per_slot(r.epilogue == GemmEpilogue::SiluMul ? w.NT / 2 : r.mb_done_target) : 1;
  kp.item_claim = r.epilogue == GemmEpilogue::WeightedSum ? r.item_claim : nullptr;
  // GEMM2 with handoff slots: split-major items, so the first claims read the first slots.
  kp.split_major = kp.item_claim && r.mb_done && kp.mb_done_pps < r.mb_done_target ? 1 : 0;
  kp.defer_ok = defer_allowed() && w.group_len % PackedGemm::kChunkK == 0 && !(w.bits == 8 && r.act == DType::BF16);
  kp.chunks_per_group = kp.defer_ok ? int(w.group_len / PackedGemm::kChunkK) : 1;
  auto log2_or_neg = [](int64_t v) {
    int sh = 0;
    while ((int64_t(1) << sh) < v) ++sh;
    return (int64_t(1) << sh) == v ? sh : -1;
  };
  kp.cpg_shift = log2_or_neg(kp.chunks_per_group);
  kp.static_groups = 0;
  if (static_groups_allowed() && r.config == 0 && !w.perm && kp.defer_ok &&
      (w.bits == 4 ? gemm::decode_static_cpg<4>(kp.chunks_per_group) : gemm::decode_static_cpg<8>(kp.chunks_per_group)) &&
      kp.KC % kp.chunks_per_group == 0) {
    // The decode kernel's static-group variants want whole groups per split (fewer splits if need be).
    const int cpg = kp.chunks_per_group;
    kp.kc_per_split = (kp.kc_per_split + cpg - 1) / cpg * cpg;
    kp.splits = (kp.KC + kp.kc_per_split - 1) / kp.kc_per_split;
    kp.static_groups = 1;
  }
  kp.group_shift = log2_or_neg(w.group_len);
  const int64_t upper = upper_mblocks(w, r);  // fewer blocks that only exit
  static const bool no_pdl = std::getenv("WNA16_NO_GEMM_PDL") != nullptr;  // A/B switch
  kp.pdl = r.overlap_previous && !no_pdl ? (r.wait_first ? 2 : 1) : 0;
  kp.pre_slices = kp.pdl == 2 ? r.pre_wait_slices : 0;  // a plain launch has nothing to run ahead of
  kp.pre_parts = 1;
  kp.pre_kc = kp.kc_per_split;
  kp.route_logits = r.route_logits;
  kp.route_E = r.route_E;
  kp.route_topk = r.route_topk;
  kp.route_renorm = r.route_renormalize ? 1 : 0;
  if (r.config == 0 && !w.perm) {
    // Decode kernel: the work shape (warps per unit along K, pairs per warp where the variant is
    // allowed) of the shortest modelled critical path on the expected m-blocks.
    if (r.decode_kw != 0 && r.decode_kw != 1 && r.decode_kw != 2 && r.decode_kw != 4)
      throw Error("decode_kw=" + std::to_string(r.decode_kw) + " is not 1, 2 or 4");
    if (r.decode_4tiles < kDecodePairs || r.decode_4tiles > kDecodeTilesAuto)
      throw Error("decode_4tiles=" + std::to_string(r.decode_4tiles) + " is not 0, 1 or 2");
    const DecodePlan plan =
        plan_decode(w, r, kp.splits, kp.kc_per_split, r.epilogue == GemmEpilogue::SiluMul && r.mb_done != nullptr);
    kp.decode_ppw = plan.ppw;
    kp.decode_kw = plan.kw;
    // The shared slices' items in K parts (GemmRun::pre_scratch): as many parts as keep all of
    // them in one round of the resident blocks (at most one per block: the kernel's release
    // bookkeeping), each part at least one group per warp, and at most kPreMaxParts: fewer warps
    // then stream the shared slices while the routing chain runs, each for longer, and the
    // chain's round trips wait less behind them (measured, docs/perf.md session 12: DeepSeek-V3
    // M=1 0.3-0.85 us faster with 4 parts than with 8). A/B switch WNA16_PRE_PARTS=N (1..8).
    // The kernel has parts for int4 static groups only.
    const int64_t units = w.NT / (2 * plan.ppw), per_block = gemm::kDecodeWarps / plan.kw;
    const int64_t pre_base = pre_wait_mblocks(r) * ((units + per_block - 1) / per_block);
    if (kp.pre_slices > 0 && r.pre_scratch && r.pre_count && w.bits == 4 && kp.static_groups) {
      constexpr int64_t kPreMaxParts = 4;
      static const int64_t parts_cap = env_int("WNA16_PRE_PARTS", 1, 8, kPreMaxParts);
      const int64_t group = kp.chunks_per_group;
      const int64_t parts = std::min<int64_t>({plan.resident / pre_base, kp.KC / (plan.kw * group), parts_cap});
      if (parts > 1) {
        const int64_t kc = (kp.KC + parts - 1) / parts;
        kp.pre_kc = int((kc + group - 1) / group * group);
        kp.pre_parts = int((kp.KC + kp.pre_kc - 1) / kp.pre_kc);
        kp.pre_scratch = r.pre_scratch;
        kp.pre_count = r.pre_count;
      }
    }
    if (kp.pre_slices > 0) {
      kp.pre_base = int(pre_base * kp.splits);
      kp.pre_total = kp.pre_base * kp.pre_parts;
    }
  }
  trace_launch(w, r, kp);
  auto s = static_cast<cudaStream_t>(stream);
  if (w.bits == 4) gemm::launch_w4(&kp, r.config, r.act, upper, s);
  else gemm::launch_w8(&kp, r.config, r.act, upper, s);
}

void prepare_moe_gemm(int bits) {
  if (bits != 4 && bits != 8) throw Error("bits=" + std::to_string(bits) + " is not supported (4 or 8)");
  for (int c = 0; c < kNumConfigs; ++c)
    for (DType act : {DType::BF16, DType::F16}) {
      if (bits == 4) gemm::launch_w4(nullptr, c, act, 0, nullptr);
      else gemm::launch_w8(nullptr, c, act, 0, nullptr);
    }
}

}  // namespace wna16::cuda
