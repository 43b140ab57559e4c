// The kernel and launch-shape choices (dispatch.h): host code only; compiled by nvcc because the
// decode work model reads the kernels' compile-time shapes and occupancy.
#include "cuda/dispatch.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "cuda/sm90_wna16_moe_decode.cuh"
#include "cuda/sm90_wna16_moe_gemm.cuh"
#include "cuda/sm90_wna16_moe_prefill.cuh"
#include "wna16/error.h"
#include "wna16/reference.h"

namespace wna16::cuda {
namespace {

// ---- the kernel table --------------------------------------------------------------------------
// Tokens per routed expert (expected under uniform routing; the shared slices, which take every
// token, do not count) decide the row. Each row's bound is the measurement that set it (H200, int4
// g128 sym, bf16, whole layer, `wna16 bench --config ROW`; docs/perf.md decisions log).
// Each row is chosen up to its bound of tokens per expert (inclusive), the first row whose bound
// the call is within; one bound for plain GEMMs and for GEMMs that gather x through their own
// act-order perm (a negative bound: never).
struct ConfigRow {
  const char* name;
  bool hopper;               // the wgmma kernel: the Hopper path only (portable_path)
  int block_m, block_n;
  bool gathers;              // has the act-order gather of its own (DeviceGemm::perm)
  bool kperm;                // takes k-permuted activations
  bool x_positions;          // GEMM1's x in m-block order (LayerPlan::x_positions)
  double max_plain, max_gather;
  double max_portable;       // plain GEMMs on the portable path (gathering ones keep max_gather)
};
constexpr double kAny = 1e300, kNever = -1.0;
constexpr ConfigRow kConfigs[] = {
    // Decode kernel up to 8.5 tokens per expert (one m-block per expert on average). Against the
    // 32-token wgmma blocks at three per SM (2026-12-02, H200, us m8 / m32w, two rounds): 4-6.4
    // per expert m8 faster (Mixtral M=16 210 / 303, Qwen3-30B-A3B M=96 128 / 170, Qwen1.5-MoE M=96
    // 150 / 170); around the bound either way by 3-5% (8: Mixtral M=32 294 / 311, DeepSeek-V3
    // M=256 2303-2337 / 2236-2244; 8.5 Qwen1.5-MoE M=128 197 / 187; 9 DeepSeek-V2-Lite M=96 162 /
    // 170); 12 m32w faster (DeepSeek-V2-Lite M=128 197 / 174).
    // Narrow layers keep it further while its m-blocks stay few (kNarrowDecodeBlockRatio below).
    // With its own act-order gather (the staged kernels' perm path) up to 8 (one m-block per
    // expert).
    // On the portable path (no wgmma rows) plain GEMMs keep it up to 40 per expert: beyond 8 an
    // expert's m-blocks stream the same weights through L2, which measured faster than the staged
    // m32 kernel (H200, 3866c77: DeepSeek-V3 M=256 6380 -> 2684 us).
    {"m8", false, gemm::CfgM8::BLOCK_M, gemm::CfgM8::BLOCK_N, true, false, false, 8.5, 8.0, 40.0},
    // Staged kernel, 32-token blocks: act-order layers that keep their own gather, 9-40 per expert.
    {"m32", false, gemm::CfgM32::BLOCK_M, gemm::CfgM32::BLOCK_N, true, false, false, kNever, 40.0, kNever},
    // Staged kernel, 64-token blocks: act-order with its own gather above 40 per expert.
    {"m64", false, gemm::CfgM64::BLOCK_M, gemm::CfgM64::BLOCK_N, true, false, false, kNever, kAny, kAny},
    // The wgmma kernel with 32-token blocks, three per SM: 8.5-28 per expert (CfgM32W). Against m64w
    // (2026-12-02, H200, us m32w / m64w): 16 per expert Mixtral M=64 326 / 415, Qwen3-30B-A3B M=256
    // 177 / 214, DeepSeek-V3 M=512 2540-2622 / 3288-3352; 17 Qwen1.5-MoE M=256 213 / 240; 24
    // DeepSeek-V2-Lite M=256 201 / 223; 32 m64w faster (Mixtral M=128 571 / 487: half the experts
    // need a second 32-token block). No act-order gather.
    {"m32w", true, gemm::CfgM32W::BLOCK_M, gemm::CfgM32W::BLOCK_N, false, true, gemm::CfgM32W::BARRIER_FREE, 28.0, kNever, kNever},
    // The wgmma kernel with 64-token blocks, two per SM: 28-60 per expert. Against the staged m64
    // and m144w (2026-12-02, 14fd75e, us m64 / m64w / m144w): DeepSeek-V3 M=1024 (32 per expert)
    // 5651 / 5064 / 6998, Mixtral M=128 (32) 772 / 766 / 903, Qwen3-30B-A3B M=512 (32) 348 / 326 /
    // 449, DeepSeek-V2-Lite M=256 (24) 334 / 329 / 439 and M=512 (48) 430 / 381 / 490; at 64 per
    // expert Qwen3 M=1024 535 / 486 / 531, Mixtral M=256 1119 / 1045 / 1040. No act-order gather.
    // GEMM1's x in m-block order (the barrier-free k-loop in both GEMMs, CfgM64W::BARRIER_FREE):
    // DeepSeek-V3 M=1024 5040 -> 4594 us, Mixtral M=128 758 -> 638, M=256 1040 -> 939 (2026-12-02,
    // f3253ca + the change, H200, two rounds).
    // Up to 80 per expert since m144w's barrier-free loop (a4f9dfb): against it (2026-12-02, H200,
    // 232d1cf, two rounds, us m64w / m144w) 64 per expert Qwen3-30B-A3B M=1024 341-345 / 385, DeepSeek-V3
    // M=2048 5483-5511 / 5824-5874, Mixtral M=256 728 / 712-722; 68 Qwen1.5-MoE M=1024 457-472 / 472-474.
    // Up to 60 since m96w (below).
    {"m64w", true, gemm::CfgM64W::BLOCK_M, gemm::CfgM64W::BLOCK_N, false, true, gemm::CfgM64W::BARRIER_FREE, 60.0, kNever, kNever},
    // The wgmma kernel with 96-token blocks (one per SM, m144w's ring): above 60 to 80 per expert, where m64w
    // takes a second m-block (and dequantises the expert's weights again) for a good part of the
    // experts and m144w pads to 144 columns. 2026-12-03, H200, two rounds, us m64w / m96w / m144w: 64
    // per expert Mixtral M=256 681 / 564 / 667-670, Qwen3-30B-A3B M=1024 354-355 / 346-347 / 383,
    // DeepSeek-V3 M=2048 5520-5524 / 5457-5467 / 5826-5847; 68 Qwen1.5-MoE M=1024 484-490 / 456 / 484-485;
    // 72 DeepSeek-V2-Lite M=768 425-426 / 366 / 415-417; 80 Mixtral M=320 820-826 / 677-688 / 676-677,
    // Qwen3 M=1280 444-446 / 378 / 400-401, DeepSeek-V3 M=2560 6458-6550 / 6350-6356 / 6263-6269; 85
    // Qwen1.5 M=1280 504-505 / 541-543 / 505-507; 96 DeepSeek-V2-Lite M=1024 432 / 497-500 / 436-438,
    // Mixtral M=384 687-691 / 873-895 / 668-669. No act-order gather.
    {"m96w", true, gemm::CfgM96W::BLOCK_M, gemm::CfgM96W::BLOCK_N, false, true, gemm::CfgM96W::BARRIER_FREE, 80.0, kNever, kNever},
    // The wgmma kernel with 144-token blocks (one per SM) above 80 per expert, where m64w dequantises
    // the weights for two or three m-blocks (the same runs, us m64w / m144w): 96 per expert
    // DeepSeek-V2-Lite M=1024 450-452 / 424-425; 128 DeepSeek-V3 M=4096 9070-9332 / 8164-8397, Mixtral
    // M=512 1121-1132 / 899; 136 Qwen1.5-MoE M=2048 815-824 / 712-721; 192 DeepSeek-V2-Lite M=2048
    // 784-785 / 785-794; 256 Qwen3-30B-A3B M=4096 960 / 865 (2026-12-02). No act-order gather.
    {"m144w", true, gemm::CfgM144W::BLOCK_M, gemm::CfgM144W::BLOCK_N, false, true, gemm::CfgM144W::BARRIER_FREE, kAny, kNever, kNever},
};
constexpr int kNumConfigs = int(sizeof(kConfigs) / sizeof(kConfigs[0]));
constexpr int kRowM8 = 0;
static_assert(kConfigs[kRowM8].block_m == gemm::CfgM8::BLOCK_M && !kConfigs[kRowM8].hopper, "the decode kernel's row");

// Narrow layers (GEMM1's weight rows short: K x bits < 16384, not decode_items_long) keep the
// decode kernel beyond its row's bound while its expected 8-token m-blocks, routed and shared
// slices, are at most this many times the 32-token ones of m32w (expected_mblocks). Measured
// with the decode kernel of cf34dc0 (2026-12-03, H200, the builds of aa78173 and 8fa9759, two
// rounds each, us m8 / m32w, the ratio in brackets): faster or level to 2.04 (Qwen3-30B-A3B
// M=144 [1.56] 146 / 174, M=160 [1.70] 156 / 177, M=176 [1.83] 160-177 / 176-178, M=192 [1.95]
// 169 / 178; DeepSeek-V2-Lite M=96 [1.77] 148 / 172, M=107 [1.90] 162-165 / 174, M=117 [2.04]
// 174 / 176; Qwen1.5-MoE M=128 [2.02] 183 / 188),
// slower from 2.18 (DeepSeek-V2-Lite M=128 [2.18] 178 / 176, M=160 [2.54] 217 / 191; Qwen1.5-MoE
// M=150 [2.22] 192-198 / 191-192, M=165 [2.31] 222 / 201: its four shared slices take every
// token, 8 at a time). Wide layers lose from less (Mixtral M=40 [1.71] 334 / 317, DeepSeek-V3
// M=320 [1.78] 2687 / 2452-2539) and keep the row's bound.
constexpr double kNarrowDecodeBlockRatio = 2.1;
static_assert(kConfigs[2].max_gather >= kAny && kConfigs[2].max_portable >= kAny && kConfigs[kNumConfigs - 1].max_plain >= kAny,
              "m64 takes every act-order and every portable call, m144w every plain one, that rows before do not");

constexpr int kRowM64 = 2, kRowM32W = 3;  // the batch-invariant mode's rows
static_assert(kConfigs[kRowM64].block_m == gemm::CfgM64::BLOCK_M && !kConfigs[kRowM64].hopper &&
                  kConfigs[kRowM32W].block_m == gemm::CfgM32W::BLOCK_M && kConfigs[kRowM32W].hopper,
              "the batch-invariant rows");

int g_forced_config = -1;      // force_gemm_config
bool g_forced_portable = false;  // force_portable_path

const ConfigRow& row(int config) {
  if (config < 0 || config >= kNumConfigs) throw Error("GEMM config " + std::to_string(config) + " does not exist");
  return kConfigs[config];
}

}  // namespace

int gemm_config_count() { return kNumConfigs; }
int gemm_config_block_m(int config) { return row(config).block_m; }
int gemm_config_block_n(int config) { return row(config).block_n; }
bool gemm_config_takes_kperm(int config) { return row(config).kperm; }
bool gemm_config_gathers(int config) { return row(config).gathers; }
bool gemm_config_hopper(int config) { return row(config).hopper; }
bool gemm_config_x_positions(int config) { return row(config).x_positions; }
const char* gemm_config_name(int config) { return kConfigs[std::clamp(config, 0, kNumConfigs - 1)].name; }

int choose_gemm_config(int64_t M, int64_t topk, int64_t E, bool staged_gather, bool portable, int64_t narrow_shared) {
  // Expected number of routed experts that receive a token under uniform routing, and tokens per
  // such expert: the MMA's token width should match it (padding is wasted MMA work and registers).
  const double p = std::min(1.0, double(topk) / double(E));
  const double active = std::max(1.0, double(E) * (1.0 - std::pow(1.0 - p, double(M))));
  const double per_expert = double(M) * double(topk) / active;
  for (int c = 0; c < kNumConfigs; ++c) {
    const ConfigRow& r = kConfigs[c];
    if (portable && r.hopper) continue;
    if (per_expert <= (staged_gather ? r.max_gather : portable ? r.max_portable : r.max_plain)) return c;
    if (c == kRowM8 && narrow_shared >= 0 && !staged_gather && !portable && M >= 1 && topk >= 1 && E >= 1) {
      const double S = double(narrow_shared);
      auto blocks = [&](int64_t bm) { return expected_mblocks(M, topk, E, bm) + S * double((M + bm - 1) / bm); };
      if (blocks(gemm::CfgM8::BLOCK_M) <= kNarrowDecodeBlockRatio * blocks(gemm::CfgM32W::BLOCK_M)) return c;
    }
  }
  return staged_gather || portable ? 2 : kNumConfigs - 1;  // unreachable: m64 / m144w take every call the rows before do not
}

void force_gemm_config(int config) {
  if (config != -1) (void)row(config);
  g_forced_config = config;
}

bool hopper_path_available() {
  static const bool available = [] {
    // The wgmma kernel's image (sm_90a) decides with the compute capability: a build for sm_80
    // only runs the portable kernels on a Hopper GPU as well.
    return device_compute_capability() >= 90 && gemm::prefill_has_wgmma();
  }();
  return available;
}
bool portable_path() { return g_forced_portable || !hopper_path_available(); }
void force_portable_path(bool on) { g_forced_portable = on; }
const char* gpu_path_name() { return portable_path() ? "portable" : "hopper"; }
int device_compute_capability() { return gemm::device_info().cc; }
std::string unsupported_gpu_message(int cc) {
  return "the CUDA backend needs a GPU of compute capability 8.0 or newer; this one has " + std::to_string(cc / 10) +
         "." + std::to_string(cc % 10);
}

// ---- the layer call ----------------------------------------------------------------------------
bool layer_gathers(const LayerShape& s, int64_t M) {
  const int64_t k2 = s.k + s.S;
  return s.g1->perm && !s.g1->perm_up && M * k2 * s.H + s.H < (int64_t(1) << 31);
}

bool layer_pre_parts(const LayerShape& s, int64_t M, int config) {
  return s.S > 0 && M <= kPreScratchMaxM && config == 0 && shared_slice_parts_pay(*s.g1, M);
}

LayerPlan plan_layer_call(const LayerShape& s, int64_t M, DType act) {
  LayerPlan p;
  const int64_t k2 = s.k + s.S;
  const DeviceGemm& g1 = *s.g1;
  p.gather = layer_gathers(s, M);
  const bool staged_gather = (g1.perm && !p.gather) || g1.perm_up;
  p.config = choose_gemm_config(M, s.k, s.E, staged_gather, portable_path(), decode_items_long(g1) ? -1 : s.S);
  // Distinct gate and up act-order orders keep two x copies per stage: int8 m64 needs 112 KB, above
  // the 99 KB per block of sm_86 / sm_89; m32 (76 KB) runs those calls there.
  if (g1.perm_up && g1.bits == 8 && p.config == 2 &&
      gemm::Smem<gemm::CfgM64, 8>::bytes(2) > gemm::device_info().max_smem_optin)
    p.config = 1;
  static_assert(gemm::Smem<gemm::CfgM32, 8>::bytes(2) <= 99 * 1024, "m32 holds int8's two x copies on every sm_80+ GPU");
  if (g_forced_config >= 0) {
    if (staged_gather && !gemm_config_gathers(g_forced_config))
      throw Error(std::string("forced GEMM config ") + gemm_config_name(g_forced_config) +
                  " has no act-order gather, which this layer needs at M=" + std::to_string(M));
    p.config = g_forced_config;
  }
  if (s.batch_invariant) {
    // One arithmetic per token whatever M: the wgmma rows dequantise and accumulate a token's
    // column alike (m32w, m64w, m96w and m144w give the same bits), the decode kernel does not (raw codes,
    // per-group scales, K splits); the staged gather and the portable path take m64 at every M.
    // GEMM2 then runs unsplit (below) and the router on one kernel and split (the layer).
    p.config = portable_path() || staged_gather ? kRowM64 : row(p.config).hopper ? p.config : kRowM32W;
  }
  if (portable_path() && row(p.config).hopper)
    throw Error(std::string("GEMM config ") + row(p.config).name + " runs on the Hopper path only; this call takes the portable path (" +
                (g_forced_portable ? "forced" : "compute capability " + std::to_string(device_compute_capability())) + ")");
  const bool decode = p.config == 0;
  // Shared rows gathered before the routing: wide layers (DeepSeek-V3) up to 16 tokens. Narrower
  // layers lost more to the extra launch than the run-ahead gave. DeepSeek-V3 act-order M=1
  // 73.3 -> 69.1 us.
  p.shared_rows_first = s.S > 0 && decode && M <= 16 && p.gather && decode_items_long(g1);
  // The GEMMs route one token themselves: Mixtral M=1 57.0 -> 55.1 us. With 128 experts (one lane
  // ranking four) it lost 4.8 us at Qwen3-30B-A3B M=1, hence E <= 32.
  p.gemm_routes = M == 1 && s.S == 0 && decode && s.softmax_topk && s.E <= 32 && !p.gather &&
                  decode_routes_token(g1) && decode_routes_token(*s.g2);
  // One token: the routing kernel, where it runs, writes the align tables (one launch and one grid
  // wait fewer).
  p.route_align = M == 1 && k2 <= 32;
  p.pre_parts = layer_pre_parts(s, M, p.config);
  // The routing kernel's release: late where GEMM1's shared-slice parts need the router's
  // zero-fill before their own wait (early measured 1.5-2 us slower at DeepSeek-V3 M=1) and up to
  // 16 tokens (Qwen1.5-MoE, DeepSeek-V2-Lite, Qwen3-30B-A3B at M=4 / 16: 2-7% faster; Qwen1.5 /
  // Qwen3 M=1 4-5%), except one token on a wide layer (K * bits >= 16384), where GEMM1's launch
  // overlapping the routing kernel is worth more (Mixtral M=1 +2.3% with late). Above 16 tokens
  // early: late read DeepSeek-V3 M=64 / 256, Mixtral M=64 and Qwen1.5-MoE M=64 7-13% slower.
  const bool wide_one_token = M == 1 && decode_items_long(g1);
  p.late_release = p.shared_rows_first || p.pre_parts || (!wide_one_token && M <= 16);
  // Shared slices' m-blocks before GEMM1's wait for the routing chain (their weights stream while
  // it runs); act-order only where their rows were gathered before the routing.
  p.pre_wait = s.S > 0 && decode && ((!g1.perm && !g1.perm_up) || p.shared_rows_first);
  // Prefill: k-permuted x and intermediate, one 16-byte copy per token row instead of four.
  p.kperm = gemm_config_takes_kperm(p.config);
  p.x_positions = p.kperm && !p.gather && gemm_config_x_positions(p.config);
  // The m-block handoff between the decode GEMMs where GEMM1's items nearly fill the resident
  // blocks (mb_handoff_pays).
  const bool g1_perm = !p.gather && (g1.perm || g1.perm_up);
  if (decode && !g1_perm && !s.g2->perm) {
    GemmRun r;
    r.act = act;
    r.config = p.config;
    r.topk = int(k2);
    r.num_slots = M * k2;
    r.max_blocks = max_align_blocks(M * k2, s.E + s.S, gemm_config_block_m(p.config));
    r.pre_wait_slices = p.pre_wait ? s.S : 0;
    DeviceGemm plain = g1;
    plain.perm = plain.perm_up = nullptr;
    p.handoff = mb_handoff_pays(plain, r);
  }
  // GEMM2 writes one row per slot and split: at most gemm2_part_rows of them.
  p.gemm2_splits = s.batch_invariant ? 1 : int(std::min<int64_t>(choose_splits(*s.g2, p.config, act, M, k2),
                                         std::max<int64_t>(1, gemm2_part_rows(M, k2) / std::max<int64_t>(1, M * k2))));
  return p;
}

int64_t gemm2_part_rows(int64_t M, int64_t k2) {
  // Splits pay only while the m-blocks are too few to fill the device: up to 32 (choose_splits'
  // bound) for a few tokens, none from kSplitTokens tokens; non-decreasing in M.
  constexpr int64_t kSplitTokens = 256;
  return k2 * std::max(M, std::min(kSplitTokens, 32 * M));
}

// ---- the GEMM work shape -----------------------------------------------------------------------
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
// expected_mblocks() (one block per active expert plus the spill over-counted when experts get
// fewer than bm tokens and picked the wrong K split: Mixtral M=16 233 -> 219 us with the exact
// model). Staged kernels: one block per distinct expert plus (slots - active) / bm.
int64_t estimate_mblocks(int64_t M, int64_t topk, int64_t E, int64_t bm) {
  const int64_t slots = M * topk;
  if (bm == gemm::kDecodeBM && M >= 1 && topk >= 1 && E >= 1)
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
// NOTE: 1.7 is the main loop's instruction ratio (nvcc -ptx), not a measurement.
constexpr double kDecode4TileChunkCost = 1.7;
struct DecodeShape {
  int kw = 1;
  double cost = 0;
};
// only_kw != 0: that in-block K split only.
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
                               std::pair<int, int> ppw_range) {
  DecodeChoice best{{1, 1e300}, 1};
  for (int ppw = ppw_range.first; ppw <= ppw_range.second; ++ppw) {
    const DecodeShape s = best_decode_kw(mblocks, pairs, splits, kc_per_split, resident, ppw, 0);
    if (s.cost < best.shape.cost * (1 - 1e-9)) best = {s, ppw};
  }
  return best;
}
}  // namespace

int64_t upper_mblocks(const DeviceGemm& w, const GemmRun& r) {
  const int64_t bm = gemm_config_block_m(r.config);
  const int64_t tight = (r.num_slots + bm - 1) / bm + std::min<int64_t>(w.E, r.num_slots);
  return r.mb_count >= 0 ? r.mb_count : std::min<int64_t>(r.max_blocks, tight);
}

int64_t pre_wait_mblocks(const GemmRun& r) {
  const int64_t bm = gemm_config_block_m(r.config);
  return r.topk > 0 ? int64_t(r.pre_wait_slices) * ((r.num_slots / r.topk + bm - 1) / bm) : 0;
}

// fill (GEMM1 with the m-block handoff): where the model's shape leaves more than 1/10 of the
// resident blocks idle in its only round, the cheapest modelled finer K split (same tile pairs per
// warp) that fills at least one round instead; GEMM2 runs in the slots its partial second round
// leaves. Mixtral M=1 62.2 -> 59.1 us (kw 2 -> 4); one pair per warp instead of two, the other way
// to more items, lost 1.4 us at Qwen1.5-MoE and DeepSeek-V2-Lite M=1.
DecodePlan plan_decode(const DeviceGemm& w, const GemmRun& r, int splits, int kc_per_split, bool fill) {
  const int64_t bm = gemm_config_block_m(r.config);
  const int64_t upper = upper_mblocks(w, r);
  const int64_t mblocks_all =
      r.mb_count >= 0 ? r.mb_count : std::min(upper, estimate_mblocks(r.num_slots / r.topk, r.topk, w.E, bm));
  // The shared slices' m-blocks run ahead of the wait for the align step, during the routing
  // chain: where they are at most a quarter of the m-blocks, plan the rounds after the wait on the
  // others (DeepSeek-V3 M=1: 8 of 9, so 512 items of two tile pairs per warp fill one round of 528).
  int64_t mblocks = mblocks_all;
  if (r.pre_wait_slices > 0) {
    const int64_t pre = pre_wait_mblocks(r);
    if (4 * pre <= mblocks_all) mblocks = std::max<int64_t>(1, mblocks_all - pre);
  }
  DecodePlan plan;
  plan.resident = resident_blocks(w.bits, r.config, r.act);
  const DecodeChoice c =
      best_decode_shape(mblocks, w.NT / 2, splits, kc_per_split, plan.resident, decode_ppw_range(w, r.decode_4tiles));
  plan.ppw = c.ppw;
  plan.kw = r.decode_kw != 0 ? r.decode_kw : c.shape.kw;
  auto items = [&](int ppw, int kw) {
    const int64_t units = w.NT / (2 * ppw), per_block = gemm::kDecodeWarps / kw;
    return double(mblocks) * double((units + per_block - 1) / per_block) * splits;
  };
  plan.items = items(plan.ppw, plan.kw);
  if (fill && r.decode_kw == 0 && plan.items < 0.9 * double(plan.resident)) {
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

// As many parts as keep all shared-slice items in one round of the resident blocks (at most one
// per block: the kernel's release bookkeeping), each part at least one group per warp, and at most
// kPreMaxParts: fewer warps then stream the shared slices while the routing chain runs, each for
// longer, and the chain's round trips wait less behind them (DeepSeek-V3 M=1 0.3-0.85 us faster
// with 4 parts than with 8).
int64_t shared_slice_parts(int64_t base, int64_t KC, int64_t cpg, int kw, int64_t resident) {
  return std::max<int64_t>(1, std::min<int64_t>({resident / std::max<int64_t>(1, base), KC / (kw * cpg), kPreMaxParts}));
}

bool decode_items_long(const DeviceGemm& g) { return g.K * g.bits >= 16384; }

bool decode_routes_token(const DeviceGemm& g) {
  // The kernel variant exists for int4 with static groups of kDecodeRouteCpg chunks (group 128),
  // which launch_moe_gemm takes for such weights on the decode kernel.
  const int64_t kc = g.K / PackedGemm::kChunkK;
  return g.bits == 4 && !g.perm && !g.perm_up && g.group_len == gemm::kDecodeRouteCpg * PackedGemm::kChunkK &&
         kc % gemm::kDecodeRouteCpg == 0;
}

// One token, int4 with groups of 64, 128 or 256 (the kernel's static-group variants), no
// act-order, and decode_items_long: DeepSeek-V3 (K=7168) gains; Qwen1.5-MoE and DeepSeek-V2-Lite
// (K=2048), and DeepSeek-V3 at 4 tokens, lose.
bool shared_slice_parts_pay(const DeviceGemm& g1, int64_t tokens) {
  const bool static_group =
      g1.group_len % PackedGemm::kChunkK == 0 && gemm::decode_static_cpg<4>(int(g1.group_len / PackedGemm::kChunkK));
  return tokens == 1 && g1.bits == 4 && static_group && !g1.perm && !g1.perm_up && decode_items_long(g1);
}

int handoff_pairs_per_slot(int64_t pairs) {
  if (pairs < 1) throw Error("handoff: pairs=" + std::to_string(pairs) + " is not positive");
  const int64_t per = (pairs + kHandoffSlots - 1) / kHandoffSlots;
  return int((per + 1) / 2 * 2);
}

bool mb_handoff_pays(const DeviceGemm& g1, const GemmRun& r1) {
  if (r1.config != 0 || g1.perm || g1.perm_up || r1.num_slots < 1) return false;
  // GEMM2 gains where GEMM1's items nearly fill the resident blocks or more (a last partial round,
  // or uneven SMs, leave slots it can use: DeepSeek-V3 M=1 1152 items on 528 blocks, 75.2 -> 72.9
  // us; Qwen3 M=16 492, 78.6 -> 76.5), and loses about 1 us below (Qwen3 M=1 384 items, 21.6 ->
  // 22.5; DeepSeek-V2-Lite M=1 352, 27.3 -> 28.0), where every m-block is done at once and the
  // releases only add their fences. The shape is GEMM1's with the handoff (plan_decode's fill).
  const DecodePlan plan = plan_decode(g1, r1, 1, int(g1.K / PackedGemm::kChunkK), true);
  return plan.items >= 0.9 * double(plan.resident);
}

int choose_splits(const DeviceGemm& w, int config, DType act, int64_t M, int64_t topk, int decode_4tiles) {
  // Work items = m-blocks x n-blocks x splits run on a persistent grid of the resident blocks.
  // The m-block count is only known on the device: estimate it. Split K so the items fill the
  // resident blocks once, never a little more (a second, nearly empty round would double the time
  // of an issue-bound decode step).
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
          best_decode_shape(est_mblocks, w.NT / 2, sp, per, resident, decode_ppw_range(w, decode_4tiles)).shape.cost;
      if (cost < best_cost * (1 - 1e-9)) best_cost = cost, best = int(sp);
    }
    return best;
  }
  const int64_t nb = w.NT / (gemm_config_block_n(config) / 16);
  const int64_t items = est_mblocks * nb;
  int64_t splits = std::max<int64_t>(1, resident / std::max<int64_t>(1, items));
  splits = std::min<int64_t>(splits, std::max<int64_t>(1, kc / 4));  // keep >= 4 chunks per split
  return int(std::clamp<int64_t>(splits, 1, 32));
}

}  // namespace wna16::cuda
