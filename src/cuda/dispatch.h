// Which kernel, tile config and launch shape runs a problem: the one place that decides. The layer
// (cuda_moe_layer.cpp) asks plan_layer_call() once per call and launches what the plan says; the
// GEMM launcher (moe_gemm_launch.cu) asks choose_splits / plan_decode for the work shape. Each
// rule carries the measurement that chose it (H200; the decisions log in docs/perf.md has the
// rest). No CUDA types here, so g++-compiled code (the layer, the tests) can include it.
#pragma once
#include <cstdint>
#include <string>

#include "cuda/moe_gemm.h"
#include "wna16/half.h"

namespace wna16::cuda {

// ---- the kernel table --------------------------------------------------------------------------
// Rows (the workspace is sized for every one): m8 the decode kernel (weights streamed
// straight into registers), m32 / m64 the staged mma.sync kernel (the only one with the act-order
// gather of its own), m32w / m64w / m144w the Hopper wgmma kernel (no act-order gather).
int gemm_config_count();
int gemm_config_block_m(int config);
int gemm_config_block_n(int config);
// Whether the config's kernel takes k-permuted activations (GemmRun::x_kperm / out_kperm): the wgmma configs.
bool gemm_config_takes_kperm(int config);
// Whether GEMM1 on the config reads x k-permuted in m-block order (GemmRun::x_by_position): m32w, m64w.
bool gemm_config_x_positions(int config);
// Whether the config's kernel can gather x through a perm (GemmRun / DeviceGemm::perm).
bool gemm_config_gathers(int config);
// Whether the config's kernel is the Hopper path's (wgmma), never run on the portable path.
bool gemm_config_hopper(int config);
const char* gemm_config_name(int config);
// The tile config for M tokens routed to E routed experts with topk choices each (shared slices
// not counted). staged_gather: the GEMM gathers x through its own perm (the configs without that
// gather are never chosen then). portable: the portable path's rows only (the mma.sync ones: m8 up
// to 40 per expert and m64 above for plain GEMMs, the act-order bounds for gathering ones); the
// layer passes portable_path(). narrow_shared >= 0: GEMM1's weight rows are short (K x bits < 16384,
// not decode_items_long), with that many shared slices; there the decode kernel runs while its
// m-blocks stay few (dispatch.cu, kNarrowDecodeBlockRatio). -1: a wide layer.
int choose_gemm_config(int64_t M, int64_t topk, int64_t E, bool staged_gather, bool portable = false,
                       int64_t narrow_shared = -1);
// Measurement hook of the benchmarks (`wna16 bench --config NAME`, the timing smoke), never set by
// the library itself: every layer call runs this row instead of the table's choice, where the row
// can run the call (a row without the act-order gather is refused for a GEMM that needs it, naming
// both). -1 (the default): the table. Set it before the calls, not during them.
void force_gemm_config(int config);

// ---- the GPU path ------------------------------------------------------------------------------
// "hopper": the sm_90 kernels and launch features (the wgmma rows of the table, tensor copies,
// thread-block clusters, programmatic dependent launch); "portable": the mma.sync rows (m8, m32,
// m64) and plain launches, on every GPU from sm_80. The current device decides (Hopper needs
// compute capability 9.0 and this build's sm_90a image); force_portable_path(true) runs the
// portable path on a Hopper GPU too (`wna16 bench / verify --portable`: the H200 tests it). Set it
// before building layers, not during their calls.
bool portable_path();
// Whether this GPU and build can run the Hopper path at all (compute capability 9.0 and the sm_90a
// image), whatever force_portable_path says: the tests that launch the wgmma rows directly ask it.
bool hopper_path_available();
void force_portable_path(bool on);
const char* gpu_path_name();  // "hopper" or "portable"
// The current device's compute capability as 10 * major + minor; a GPU below 8.0 is refused by the
// CUDA layer with a message naming it.
int device_compute_capability();
// The refusal of a GPU below sm_80 (compute capability cc, 10 * major + minor), one wording for
// the layer's constructor and the GEMM preparation.
std::string unsupported_gpu_message(int cc);

// ---- the layer call ----------------------------------------------------------------------------
// What the layer knows of itself at build time.
struct LayerShape {
  int64_t H = 0, I = 0;
  int E = 0, k = 0;        // routed experts, routed choices per token
  int S = 0;               // shared-expert slices (kernel experts 0..S-1, taken by every token)
  bool softmax_topk = false;  // RoutingMethod::SoftmaxTopK
  const DeviceGemm* g1 = nullptr;  // gate/up, with its act-order perm (perm_up when distinct)
  const DeviceGemm* g2 = nullptr;  // down
  // Batch-invariant mode (CudaMoeLayer::set_batch_invariant): a token's output bits do not depend
  // on the other tokens of the call: one arithmetic per token at every M (see plan_layer_call).
  bool batch_invariant = false;
};

// Everything a call of M tokens does differently from another, decided here.
struct LayerPlan {
  int config = 0;  // tile config of both GEMMs
  // Act-order with one k order per expert for gate and up: x gathered once per slot into its
  // expert's k order (launch_gather_slots); GEMM1 then runs the plain kernels on g1 without perm.
  bool gather = false;
  // One token on a layer such as Mixtral: both decode GEMMs route the token from the router logits
  // (GemmRun::route_logits); no routing or align kernel runs.
  bool gemm_routes = false;
  // Act-order on a wide layer with shared slices: the shared slices' rows are gathered between the
  // router and the routing, so GEMM1's shared-slice items run ahead of the routing chain.
  bool shared_rows_first = false;
  // One token: the routing kernel, where it runs, writes the align tables itself (no align launch).
  bool route_align = false;
  // The routing kernel releases its programmatic dependents only when done (late) instead of at
  // its start (early).
  bool late_release = false;
  // GEMM1 (decode kernel) runs the shared slices' m-blocks before it waits for the routing chain
  // (GemmRun::pre_wait_slices = S), and in K parts over more blocks (GemmRun::pre_scratch).
  bool pre_wait = false;
  bool pre_parts = false;
  // Prefill: x and the intermediate travel k-permuted (GemmRun::x_kperm / out_kperm).
  bool kperm = false;
  // GEMM1's x k-permuted in m-block order (launch_kperm_positions, GemmRun::x_by_position): both
  // GEMMs' token tiles by tensor copies (no act-order gather).
  bool x_positions = false;
  // Both GEMMs on the decode kernel: GEMM2 starts on each m-block once GEMM1 has stored it
  // (GemmRun::mb_done). Needs the align bound on m-blocks: see plan_layer_call.
  bool handoff = false;
  int gemm2_splits = 1;  // split-K of GEMM2, splits x M x k2 <= gemm2_part_rows(M, k2)
};

// The rows of GEMM2's per-slot output (GemmRun WeightedSum: one per slot and K split) that a call of
// M tokens with k2 slots each may write; non-decreasing in M, so a workspace for max_m tokens holds
// those of every smaller call.
int64_t gemm2_part_rows(int64_t M, int64_t k2);

// Tokens up to which a call may run GEMM1's shared-slice parts (its workspace holds their scratch).
constexpr int64_t kPreScratchMaxM = 1;
// Whether the act-order gather runs at M tokens (its rows stay inside the kernels' 32-bit index).
bool layer_gathers(const LayerShape& s, int64_t M);
// Whether a call of M tokens on config runs GEMM1's shared-slice parts (and so its workspace
// holds their scratch).
bool layer_pre_parts(const LayerShape& s, int64_t M, int config);
// The plan of a call of M tokens.
LayerPlan plan_layer_call(const LayerShape& s, int64_t M, DType act);

// ---- the GEMM work shape -----------------------------------------------------------------------
// Split-K for the WeightedSum GEMM so that the work items fill the resident blocks once.
// decode_4tiles: the decode kernel's variant (GemmRun::decode_4tiles) the split is for.
int choose_splits(const DeviceGemm& w, int config, DType act, int64_t M, int64_t topk,
                  int decode_4tiles = kDecodeTilesAuto);
// Blocks of the kernel of config (bits, act) resident on the whole device (occupancy x SMs).
int resident_blocks(int bits, int config, DType act);
// The decode kernel's work shape for run r of w: warps per tile unit along K (kw), tile pairs per
// warp (ppw), the expected work items and the resident blocks. fill: GEMM1 with the m-block
// handoff, which prefers a finer K split that fills one round of the resident blocks.
struct DecodePlan {
  int kw = 1, ppw = 1;
  double items = 0;
  int64_t resident = 1;
};
DecodePlan plan_decode(const DeviceGemm& w, const GemmRun& r, int splits, int kc_per_split, bool fill);
// GEMM1's shared-slice items in K parts: how many parts (1: none) for `base` items per part
// round, K chunks KC, groups of cpg chunks, warps per unit kw, resident blocks.
int64_t shared_slice_parts(int64_t base, int64_t KC, int64_t cpg, int kw, int64_t resident);
// A tight bound on the m-blocks the align step can produce for run r (mb_count where it names them).
int64_t upper_mblocks(const DeviceGemm& w, const GemmRun& r);
// The m-blocks of the shared slices run ahead of the align step: ceil(tokens / BLOCK_M) per slice.
int64_t pre_wait_mblocks(const GemmRun& r);
// The m-block handoff's tile pairs per counter slot (GemmRun::mb_done) of GEMM1's `pairs` (NT / 2):
// even, so that a warp's unit of two pairs never straddles two slots.
int handoff_pairs_per_slot(int64_t pairs);
// Whether the m-block handoff is expected to pay for GEMM1 run r1 of g1 (the decode kernel; false
// for any other kernel).
bool mb_handoff_pays(const DeviceGemm& g1, const GemmRun& r1);
// Whether a decode work item of g (64 weight columns over all of K) carries at least 128 KiB of
// weights (K * bits >= 16384): long enough to outlast the one-token routing chain.
bool decode_items_long(const DeviceGemm& g);
// Whether the decode kernel can route one token itself on g (GemmRun::route_logits): int4 in
// groups of 128 without act-order, the variant that exists.
bool decode_routes_token(const DeviceGemm& g);
// Whether GEMM1 (g1) at `tokens` tokens should run its shared slices' items in K parts.
bool shared_slice_parts_pay(const DeviceGemm& g1, int64_t tokens);
// Expected m-blocks of bm tokens when M tokens each pick topk distinct experts of E uniformly:
// E * E[ceil(n / bm)], n ~ Binomial(M, topk / E). Throws Error naming the value for any argument < 1.
double expected_mblocks(int64_t M, int64_t topk, int64_t E, int64_t bm);

}  // namespace wna16::cuda
