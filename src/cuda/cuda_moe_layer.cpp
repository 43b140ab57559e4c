// CudaMoeLayer: the MoE layer packed once into the fused GEMM layout (moe_gemm.h) on the device
// (device_pack.h, from host or device checkpoint tensors) and the per-call pipeline on one stream:
//   router logits (fp32; also zeroes the GEMMs' counters; plain launch)
//   -> routing (also appends the shared-expert slots) -> align (route_and_align; for one token
//      the routing kernel writes the align tables itself, and where the plan says gemm_routes the GEMMs
//      route the token themselves from the logits instead); programmatic dependent launches
//   -> act-order only: x gathered per slot in each slot's expert's k order (launch_gather_slots)
//   -> GEMM1 (gate/up, SiLU*up, intermediate in act dtype; a programmatic dependent of align that
//      waits for it first, but at decode runs the shared slices' m-blocks before that wait)
//   -> GEMM2 (x routing weight, one row in act per slot and K split; programmatic dependent of GEMM1)
//   -> the top-k sum in fp32, in a fixed order, cast to act (launch_slot_sum_out; programmatic
//      dependent of GEMM2: waits for its completion before reading). No atomics add floats
//      anywhere, so every run gives the same bits.
// No allocation and no host synchronisation inside forward(); it can be captured in a CUDA graph.
//
// Kernel experts: the shared expert(s) cut into S = ceil(shared_inter/I) slices of width I (SwiGLU
// is elementwise along I and down is linear in it, so the slices' outputs add up to the shared
// MLP's), then the E routed experts (kernel expert S + e). Every token takes the S slices as extra
// choices with weight 1 (Plain) or sigmoid(x . shared_gate) (SigmoidGated). Columns past
// shared_inter in the last slice are zero (scale 0 for gate/up: silu(0)*0 = 0). Shared slices
// first: their m-blocks lead the align output at positions known before routing, so the decode
// GEMM1 runs them while the routing chain still runs (GemmRun::pre_wait_slices).
// Which kernels run and how (tile config, gathers, run-ahead, handoff, split-K) is the plan of the
// call (dispatch.h, plan_layer_call); this file carries it out.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "common/knobs.h"
#include "cuda/cuda_check.h"
#include "cuda/dev_buf.h"
#include "cuda/device_pack.h"
#include "cuda/dispatch.h"
#include "cuda/moe_gemm.h"
#include "cuda/moe_layer_kernels.h"
#include "wna16/backend.h"
#include "wna16/cuda.h"
#include "wna16/cuda_kernels.h"
#include "wna16/error.h"
#include "wna16/quant.h"
#include "wna16/reference.h"

namespace wna16::cuda {
namespace {

int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// WNA16_CUDA_DEBUG_SYNC=1: synchronise after every stage of forward() and name the stage that
// failed (a debugging aid; it breaks graph capture, so it is off by default).
bool debug_sync() {
  static const bool on = knobs::cuda_debug_sync();
  return on;
}
// WNA16_DIAG_STAGES=N (a timing diagnostic, never for results): forward() launches only its first
// N stages (1 router logits, 2 routing, 3 align, 4 GEMM1, 5 GEMM2, 6 the cast) and leaves the output
// unwritten, so a benchmark of N and N-1 stages times what stage N adds on the critical path.
bool diag_skip(int stage) {
  static const int stages = knobs::diag_stages();
  return stage > stages;
}

void stage_done(const char* what, cudaStream_t st) {
  if (!debug_sync()) return;
  const cudaError_t e = cudaStreamSynchronize(st);
  if (e != cudaSuccess) throw Error(std::string("CUDA error after ") + what + ": " + cudaGetErrorString(e));
}

struct Workspace {
  int64_t logits = 0, gate = 0, ids = 0, w = 0, ids2 = 0, w2 = 0, sorted = 0, eids = 0, ntpp = 0, inter = 0,
          part = 0, handoff = 0, pre_scratch = 0, pre_count = 0, zero_end = 0, xperm = 0, xgather = 0, total = 0;
  int64_t max_padded = 0, max_blocks = 0;
};

}  // namespace

struct CudaMoeLayer::Impl {
  MoeLayerSpec spec;
  int64_t H = 0, I = 0;
  int E = 0, k = 0, S = 0, E2 = 0, k2 = 0;
  bool gated = false;
  int bits = 4;
  DevBuf qw1, sc1, zr1, perm1, permup1, qw2, sc2, zr2, router, bias;
  DType router_dtype = DType::F32;  // F32 or BF16 (build)
  DeviceGemm g1, g2;
  // Act-order with one k order per expert for gate and up (as GPTQ writes them: the two read the
  // same input, whose Hessian orders the channels): x is gathered per slot in that order
  // (launch_gather_slots) and GEMM1 runs g1_gathered, the same weights without the perm, on the
  // kernels of plain checkpoints (the decode kernel with its handoff, the wgmma prefill kernel).
  // Distinct gate and up orders keep the staged kernels' own gather.
  DeviceGemm g1_gathered;
  LayerShape shape;  // what dispatch.h decides from (points at g1, g2)
  size_t weight_bytes = 0;

  // The routing's slot ids (kernel experts, shared slices included): [M, k2].
  int32_t* slot_ids(char* ws, const Workspace& L) const {
    return reinterpret_cast<int32_t*>(ws + (S > 0 ? L.ids2 : L.ids));
  }
  // When the plan gathers: x gathered per slot into the workspace (k-permuted for the prefill kernel
  // with kperm), after the routing chain; GEMM1 then reads these rows (GemmRun::x_per_slot). Each
  // token's slots [0, j_end) (default all; the routed ones when shared_rows_first).
  const void* gather_x(const void* x, int64_t M, char* ws, const Workspace& L, bool kperm, cudaStream_t st,
                       int j_end = -1) const {
    launch_gather_slots(x, M, H, slot_ids(ws, L), k2, g1.perm, E2, ws + L.xgather, kperm, st, 0, j_end);
    return ws + L.xgather;
  }
  Workspace layout(int64_t M, int config) const {
    Workspace ws;
    const int64_t block_m = gemm_config_block_m(config);
    const bool gathers = layer_gathers(shape, M);
    const int64_t slots = M * k2;
    ws.max_padded = max_padded_slots(slots, E2, block_m);
    ws.max_blocks = max_align_blocks(slots, E2, block_m);
    int64_t off = 0;
    auto take = [&](int64_t bytes) {
      const int64_t o = off;
      off = align_up(off + bytes, 256);
      return o;
    };
    ws.logits = take(M * E * 4);
    ws.gate = take(M * 4);
    ws.ids = take(M * k * 4);
    ws.w = take(M * k * 4);
    ws.ids2 = take(slots * 4);
    ws.w2 = take(slots * 4);
    ws.sorted = take(ws.max_padded * 4);
    ws.eids = take(ws.max_blocks * 4);
    ws.ntpp = take(4);
    ws.inter = take(ws.max_padded * I * 2);
    // The decode GEMMs' m-block handoff (GemmRun::mb_done): kHandoffSlots counters per m-block,
    // then the item counter; zeroed by the router launch (from here to zero_end).
    ws.handoff = take((handoff_counters(ws.max_blocks) + 1) * 4);
    // Decode with shared slices: GEMM1's shared-slice K parts (GemmRun::pre_scratch / pre_count,
    // the counts zeroed by the router too), where the plan runs them.
    const bool parts = layer_pre_parts(shape, M, config);
    if (parts) ws.pre_count = take(pre_count_ints(M, S, g1.NT) * 4);
    ws.zero_end = off;
    if (parts) ws.pre_scratch = take(pre_scratch_floats(M, S, g1.NT) * 4);
    // GEMM2's rows (2-byte act), one per slot and K split (every one it may write: gemm2_part_rows).
    ws.part = take(gemm2_part_rows(M, k2) * H * 2);
    // The wgmma configs' x: k-permuted rows in m-block order (launch_kperm_positions); with the
    // act-order gather, x's rows per slot instead (k-permuted for the wgmma configs).
    ws.xgather = gathers ? take(slots * H * 2) : off;
    ws.xperm = gathers || !gemm_config_takes_kperm(config) ? off
               : take((gemm_config_x_positions(config) ? ws.max_padded : M) * H * 2);
    ws.total = off;
    return ws;
  }

  // Takes the packed weights (device_pack.h) and uploads the router.
  void build(const MoeLayerSpec& s, const LayerPackShape& p, PackedLayerArrays&& packed,
             const std::vector<float>& router_w, const std::vector<float>& shared_gate,
             const std::vector<float>& correction_bias);
  // skip_routing: the GEMMs route the token themselves (gemm_routes): the router only.
  void route_and_align(const void* x, int64_t M, DType act, char* ws, const Workspace& L, const LayerPlan& plan,
                       cudaStream_t st, bool skip_routing) const;
  void check_call(const void* x, const void* out, int64_t M, DType act, const void* workspace, size_t workspace_size,
                  Workspace* L, LayerPlan* plan) const;
  // What both forward paths share: the checks, then router -> routing -> align on the stream.
  struct Call {
    Workspace L;
    LayerPlan plan;
    cudaStream_t st = nullptr;
    char* ws = nullptr;
    void* part = nullptr;      // GEMM2's rows per slot and split (act)
    const float* w2 = nullptr;  // routing weights of every slot (shared slices included)
  };
  // The caller's routing (forward_routed): device [M, k] ids and weights.
  struct Given {
    const int32_t* ids = nullptr;
    const float* weights = nullptr;
  };
  // Returns false (nothing launched) for M = 0. gemm_routing: the caller's GEMMs route the token
  // themselves where the plan says so (forward does; the per-expert loop needs the tables).
  // given: the caller's routing replaces the router and the routing kernel.
  bool begin_call(const void* x, const void* out, int64_t M, DType act, void* workspace, size_t workspace_size,
                  Stream stream, Call* c, bool gemm_routing, const Given* given = nullptr) const {
    check_call(x, out, M, act, workspace, workspace_size, &c->L, &c->plan);
    if (M == 0) return false;
    c->st = static_cast<cudaStream_t>(stream);
    c->ws = static_cast<char*>(workspace);
    c->part = c->ws + c->L.part;
    c->w2 = reinterpret_cast<const float*>(c->ws + (S > 0 ? c->L.w2 : c->L.w));
    if (given) {
      // No router logits and no routing kernel to take the tables from.
      c->plan.gemm_routes = c->plan.route_align = false;
      given_and_align(x, M, act, *given, c->ws, c->L, c->plan, c->st);
    } else {
      route_and_align(x, M, act, c->ws, c->L, c->plan, c->st, gemm_routing && c->plan.gemm_routes);
    }
    return true;
  }
  void given_and_align(const void* x, int64_t M, DType act, const Given& g, char* ws, const Workspace& L,
                       const LayerPlan& plan, cudaStream_t st) const;
  // GEMM1 -> GEMM2 -> cast, after begin_call (forward and forward_routed).
  void run_gemms(const void* x, void* out, int64_t M, DType act, const Call& c, bool out_f32 = false) const;
  // The GEMM launch fields both stages share: the align outputs in the workspace drive the grid.
  GemmRun align_driven_run(DType act, int config, int64_t M, char* ws, const Workspace& L) const {
    GemmRun r;
    r.act = act;
    r.config = config;
    r.topk = k2;
    r.num_slots = M * k2;
    r.sorted_ids = reinterpret_cast<const int32_t*>(ws + L.sorted);
    r.expert_ids = reinterpret_cast<const int32_t*>(ws + L.eids);
    r.num_tokens_post_padded = reinterpret_cast<const int32_t*>(ws + L.ntpp);
    r.max_blocks = L.max_blocks;
    return r;
  }
  // GEMM1: x (gathered by slot) times gate|up, SiLU(gate)*up into the intermediate buffer.
  void set_gemm1(GemmRun& r, const void* x, char* ws, const Workspace& L) const {
    r.epilogue = GemmEpilogue::SiluMul;
    r.x = x;
    r.x_stride = H;
    r.out = ws + L.inter;
  }
  // GEMM2: intermediate times down, scaled by the slot's routing weight, one row per slot and split.
  void set_gemm2(GemmRun& r, void* part, const float* w2, char* ws, const Workspace& L) const {
    r.epilogue = GemmEpilogue::WeightedSum;
    r.x = ws + L.inter;
    r.x_stride = I;
    r.x_rows = L.max_padded;  // the intermediate's allocated rows
    r.out = part;
    r.topk_weights = w2;
  }
};

void CudaMoeLayer::Impl::build(const MoeLayerSpec& s, const LayerPackShape& p, PackedLayerArrays&& packed,
                               const std::vector<float>& router_w, const std::vector<float>& shared_gate,
                               const std::vector<float>& correction_bias) {
  spec = s;
  H = p.H;
  I = p.I;
  E = p.E;
  k = s.routing.top_k;
  gated = s.shared_kind == SharedExpertKind::SigmoidGated;
  S = p.S;
  E2 = p.E2;
  k2 = k + S;
  bits = p.bits;
  const PackedGemm &shape1 = p.g1, &shape2 = p.g2;
  qw1 = std::move(packed.qw1);
  sc1 = std::move(packed.sc1);
  zr1 = std::move(packed.zr1);
  qw2 = std::move(packed.qw2);
  sc2 = std::move(packed.sc2);
  zr2 = std::move(packed.zr2);
  perm1 = std::move(packed.perm1);
  permup1 = std::move(packed.permup1);
  // Router (+ the shared-expert gate as one more row): in bf16 when every value is exact in bf16
  // (real checkpoints store the router in bf16), which reads half the bytes for the same logits;
  // else fp32.
  std::vector<float> r(router_w);
  if (gated) r.insert(r.end(), shared_gate.begin(), shared_gate.end());
  const bool exact_bf16 = std::all_of(r.begin(), r.end(), [](float v) { return (float_to_bits(v) & 0xffffu) == 0; });
  if (exact_bf16) {
    std::vector<uint16_t> rb(r.size());
    std::transform(r.begin(), r.end(), rb.begin(), float_to_bf16);  // exact: the low halves are zero
    router.upload(rb);
    router_dtype = DType::BF16;
  } else {
    router.upload(r);
  }
  if (s.routing.method == RoutingMethod::NoauxTc) bias.upload(correction_bias);

  auto fill = [&](DeviceGemm& d, const PackedGemm& shp, const DevBuf& q, const DevBuf& sc, const DevBuf& zr) {
    d.bits = bits;
    d.E = E2;
    d.K = shp.K;
    d.N = shp.N;
    d.NT = shp.NT;
    d.group_len = shp.group_len;
    d.G = shp.G;
    d.qweight = q.p;
    d.scales = static_cast<const uint32_t*>(sc.p);
    d.zeros = static_cast<const uint32_t*>(zr.p);
  };
  fill(g1, shape1, qw1, sc1, zr1);
  fill(g2, shape2, qw2, sc2, zr2);
  g1.perm = static_cast<const int32_t*>(perm1.p);
  g1.perm_up = static_cast<const int32_t*>(permup1.p);
  g1_gathered = g1;
  g1_gathered.perm = g1_gathered.perm_up = nullptr;
  shape.H = H;
  shape.I = I;
  shape.E = E;
  shape.k = k;
  shape.S = S;
  shape.softmax_topk = s.routing.method == RoutingMethod::SoftmaxTopK;
  shape.g1 = &g1;
  shape.g2 = &g2;
  weight_bytes = qw1.bytes + sc1.bytes + zr1.bytes + perm1.bytes + permup1.bytes + qw2.bytes + sc2.bytes + zr2.bytes +
                 router.bytes + bias.bytes;
}

void CudaMoeLayer::Impl::check_call(const void* x, const void* out, int64_t M, DType act, const void* workspace,
                                    size_t workspace_size, Workspace* L, LayerPlan* plan) const {
  if (act != DType::BF16 && act != DType::F16)
    throw Error(std::string("activation dtype ") + dtype_name(act) + " is not supported by the CUDA layer (f16, bf16)");
  if (M < 0) throw Error(fmt::format("M={} is negative", M));
  if (M * k2 >= (int64_t(1) << 30)) throw Error(fmt::format("M={} tokens x {} slots is too large", M, k2));
  if (M > 0) *plan = plan_layer_call(shape, M, act);
  *L = layout(M, plan->config);
  if (M > 0 && (!x || !out)) throw Error("forward: x or out is null");
  if (size_t(L->total) > workspace_size || (M > 0 && !workspace))
    throw Error(fmt::format("forward: workspace of {} bytes is smaller than the {} bytes needed for M={}",
                            workspace_size, L->total, M));
  // The kernels move 16-byte vectors (cp.async, tensor maps) through x, out and the workspace: an
  // address off that grid would fault on the device instead of failing here.
  for (auto [name, p] : {std::pair<const char*, const void*>{"x", x}, {"out", out}, {"workspace", workspace}})
    if (M > 0 && reinterpret_cast<uintptr_t>(p) % 16 != 0)
      throw Error(fmt::format("forward: {} at {} is not 16-byte aligned", name, p));
}

// Router logits (plain launch: fully ordered after whatever came before, which may still read the
// counters it zeroes), then routing with the shared-expert slots appended -> align, both with
// programmatic dependent launch. Each programmatic launch waits (griddepcontrol.wait) in every
// thread before its first global access, so each completes only after its predecessor did; GEMM1,
// a programmatic dependent that waits first, starts after the align step completed, and by then
// the router's zero-fill of the counters is complete too.
// NOTE: a kernel fusing routing and align at small slot counts (one launch fewer) measured no
// faster end to end on the H200 and was removed (docs/perf.md).
void CudaMoeLayer::Impl::route_and_align(const void* x, int64_t M, DType act, char* ws, const Workspace& L,
                                         const LayerPlan& plan, cudaStream_t st, bool skip_routing) const {
  const int block_m = gemm_config_block_m(plan.config);
  auto* logits = reinterpret_cast<float*>(ws + L.logits);
  auto* gate = reinterpret_cast<float*>(ws + L.gate);
  const int64_t zero_n = (L.zero_end - L.handoff) / 4;  // handoff, the shared-slice parts' counts
  launch_router_logits(x, act, M, H, router.p, router_dtype, E, gated ? E + 1 : E, logits, gate,
                       reinterpret_cast<float*>(ws + L.handoff), zero_n, st, shape.batch_invariant);
  stage_done("router logits", st);
  if (diag_skip(2) || skip_routing) return;
  // A programmatic dependent of the router that reads only x: its gather overlaps the router.
  if (plan.shared_rows_first) {
    launch_gather_slots(x, M, H, nullptr, k2, g1.perm, E2, ws + L.xgather, false, st, k, k2);
    stage_done("act-order gather (shared slices)", st);
  }
  // With shared slices the routing writes [M, k + S] straight into ids2 / w2 (no append kernel).
  int32_t* ids2 = slot_ids(ws, L);
  auto* w2 = reinterpret_cast<float*>(ws + (S > 0 ? L.w2 : L.w));
  // One token: the routing kernel writes the align tables too (one launch and one grid-completion
  // wait fewer before GEMM1).
  RoutingAlignOut align;
  if (plan.route_align) {
    align.sorted = reinterpret_cast<int32_t*>(ws + L.sorted);
    align.expert_ids = reinterpret_cast<int32_t*>(ws + L.eids);
    align.ntpp = reinterpret_cast<int32_t*>(ws + L.ntpp);
    align.block_m = block_m;
    align.max_padded = L.max_padded;
    align.max_blocks = L.max_blocks;
  }
  // The release (late: when done; early: at its start) is the plan's (dispatch.h).
  launch_routing_with_shared(spec.routing, logits, M, static_cast<const float*>(bias.p), gated ? gate : nullptr, S,
                             ids2, w2, st, align, plan.late_release);
  stage_done("routing", st);
  if (diag_skip(3) || align.sorted) return;
  launch_align(ids2, M * k2, E2, block_m, reinterpret_cast<int32_t*>(ws + L.sorted),
               reinterpret_cast<int32_t*>(ws + L.eids), reinterpret_cast<int32_t*>(ws + L.ntpp), st);
  stage_done("align", st);
}

CudaMoeLayer::CudaMoeLayer(const MoeLayerSpec& spec, const MoeLayerWeights& w) : impl_(std::make_unique<Impl>()) {
  spec.validate();
  w.validate(spec);
  const LayerPackShape p = plan_layer_shape(spec, layer_schemes(w));
  impl_->build(spec, p, pack_layer_on_device(p, w, nullptr), w.router, w.shared_gate, w.correction_bias);
  prepare_moe_gemm(impl_->bits);
}

CudaMoeLayer::CudaMoeLayer(const MoeLayerSpec& spec, const DeviceMoeLayerWeights& w, Stream stream)
    : impl_(std::make_unique<Impl>()) {
  validate_device_weights(spec, w);
  const LayerPackShape p = plan_layer_shape(spec, layer_schemes(w));
  impl_->build(spec, p, pack_layer_on_device(p, w, static_cast<cudaStream_t>(stream)), w.router, w.shared_gate,
               w.correction_bias);
  prepare_moe_gemm(impl_->bits);
}
CudaMoeLayer::~CudaMoeLayer() = default;

size_t CudaMoeLayer::workspace_bytes(int64_t max_m) const {
  if (max_m < 0) throw Error(fmt::format("max_m={} is negative", max_m));
  // The largest BLOCK_M almost always needs the most (padding grows with it, the block table
  // shrinks): take the maximum over the configs to be exact.
  int64_t total = 0;
  for (int c = 0; c < gemm_config_count(); ++c) total = std::max<int64_t>(total, impl_->layout(max_m, c).total);
  // Up to kPreScratchMaxM tokens the decode layout also holds the shared-slice parts' scratch,
  // which larger M do not: a call with fewer tokens than max_m may need more.
  total = std::max<int64_t>(total, impl_->layout(std::min(max_m, kPreScratchMaxM), 0).total);
  return size_t(total);
}

size_t CudaMoeLayer::weight_bytes() const { return impl_->weight_bytes; }

void CudaMoeLayer::set_batch_invariant(bool on) { impl_->shape.batch_invariant = on; }
bool CudaMoeLayer::batch_invariant() const { return impl_->shape.batch_invariant; }

// The caller's slots (a plain launch that also zero-fills what the router launch would), then
// align as after the routing kernel.
void CudaMoeLayer::Impl::given_and_align(const void* x, int64_t M, DType act, const Given& g, char* ws,
                                         const Workspace& L, const LayerPlan& plan, cudaStream_t st) const {
  const int64_t zero_n = (L.zero_end - L.handoff) / 4;
  const void* gate_row =
      gated ? static_cast<const char*>(router.p) + int64_t(E) * H * (router_dtype == DType::BF16 ? 2 : 4) : nullptr;
  int32_t* ids2 = slot_ids(ws, L);
  launch_given_slots(x, act, M, H, g.ids, g.weights, k, E, S, gate_row, router_dtype, ids2,
                     reinterpret_cast<float*>(ws + (S > 0 ? L.w2 : L.w)), reinterpret_cast<float*>(ws + L.handoff), zero_n,
                     st);
  stage_done("given routing", st);
  if (plan.shared_rows_first) {
    launch_gather_slots(x, M, H, nullptr, k2, g1.perm, E2, ws + L.xgather, false, st, k, k2);
    stage_done("act-order gather (shared slices)", st);
  }
  launch_align(ids2, M * k2, E2, gemm_config_block_m(plan.config), reinterpret_cast<int32_t*>(ws + L.sorted),
               reinterpret_cast<int32_t*>(ws + L.eids), reinterpret_cast<int32_t*>(ws + L.ntpp), st);
  stage_done("align", st);
}

void CudaMoeLayer::forward(const void* x, void* out, int64_t M, DType act, void* workspace, size_t workspace_size,
                           Stream stream) const {
  Impl::Call c;
  if (impl_->begin_call(x, out, M, act, workspace, workspace_size, stream, &c, true)) impl_->run_gemms(x, out, M, act, c);
}

void CudaMoeLayer::forward_routed(const void* x, const int32_t* topk_ids, const float* topk_weights, int top_k,
                                  void* out, int64_t M, DType act, void* workspace, size_t workspace_size,
                                  Stream stream) const {
  if (top_k != impl_->k)
    throw Error(fmt::format("forward_routed: top_k={} differs from the layer's top_k={} (the CUDA backend takes the "
                            "layer's)",
                            top_k, impl_->k));
  if (M > 0 && (!topk_ids || !topk_weights)) throw Error("forward_routed: topk_ids or topk_weights is null");
  const Impl::Given g{topk_ids, topk_weights};
  Impl::Call c;
  if (impl_->begin_call(x, out, M, act, workspace, workspace_size, stream, &c, false, &g))
    impl_->run_gemms(x, out, M, act, c);
}

void CudaMoeLayer::forward_f32(const void* x, const int32_t* topk_ids, const float* topk_weights, int top_k,
                               float* out, int64_t M, DType act, void* workspace, size_t workspace_size,
                               Stream stream) const {
  Impl::Call c;
  if (!topk_ids) {
    if (impl_->begin_call(x, out, M, act, workspace, workspace_size, stream, &c, true))
      impl_->run_gemms(x, out, M, act, c, true);
    return;
  }
  if (top_k != impl_->k)
    throw Error(fmt::format("forward_f32: top_k={} differs from the layer's top_k={}", top_k, impl_->k));
  if (M > 0 && !topk_weights) throw Error("forward_f32: topk_weights is null");
  const Impl::Given g{topk_ids, topk_weights};
  if (impl_->begin_call(x, out, M, act, workspace, workspace_size, stream, &c, false, &g))
    impl_->run_gemms(x, out, M, act, c, true);
}

void CudaMoeLayer::Impl::run_gemms(const void* x, void* out, int64_t M, DType act, const Call& c, bool out_f32) const {
  const Impl& d = *this;
  const Workspace& L = c.L;
  const LayerPlan& plan = c.plan;
  const cudaStream_t st = c.st;
  char* ws = c.ws;
  GemmRun r = d.align_driven_run(act, plan.config, M, ws, L);
  if (diag_skip(4)) return;

  d.set_gemm1(r, x, ws, L);
  if (plan.gemm_routes) {  // route_and_align ran the router only
    r.route_logits = reinterpret_cast<const float*>(ws + L.logits);
    r.route_E = int(d.E);
    r.route_topk = int(d.k);
    r.route_renormalize = d.spec.routing.renormalize;
  }
  // The wgmma configs (kperm): x and the intermediate travel k-permuted; with x_positions x in
  // m-block order (launch_kperm_positions: one pass writing each slot's row), so that every
  // chunk's token tile is one tensor copy; else token rows (or, with the act-order gather, slot
  // rows) by 16-byte copies from every thread.
  const DeviceGemm& gemm1 = plan.gather ? d.g1_gathered : d.g1;
  if (plan.gather) {  // route_and_align gathered the shared slices' rows already where shared_rows_first
    r.x = d.gather_x(x, M, ws, L, plan.kperm, st, plan.shared_rows_first ? d.k : -1);
    stage_done("act-order gather", st);
    r.x_per_slot = true;
  } else if (plan.x_positions) {
    launch_kperm_positions(x, d.H, r.sorted_ids, r.num_tokens_post_padded, r.num_slots, int(d.k2), L.max_padded,
                           ws + L.xperm, st);
    stage_done("k-permuted x in m-block order", st);
    r.x = ws + L.xperm;
    r.x_by_position = true;
    r.x_rows = L.max_padded;
  } else if (plan.kperm) {
    launch_kperm_positions(x, d.H, nullptr, nullptr, M, 1, M, ws + L.xperm, st);  // rows as they are
    stage_done("k-permuted x", st);
    r.x = ws + L.xperm;
  }
  if (plan.kperm) r.x_kperm = r.out_kperm = true;
  // A programmatic dependent of the align step that waits for it first: its launch and start
  // overlap the align step's tail.
  r.overlap_previous = r.wait_first = true;
  // The decode kernel runs the shared slices' m-blocks (kernel experts 0..S-1, laid out first,
  // tables known from M) before it waits for the align step: their weights stream while the
  // routing chain runs (GemmRun::pre_wait_slices).
  if (plan.pre_wait) {
    r.pre_wait_slices = d.S;
    if (plan.pre_parts) {
      r.pre_scratch = reinterpret_cast<float*>(ws + L.pre_scratch);
      r.pre_count = reinterpret_cast<int32_t*>(ws + L.pre_count);
    }
  }
  // Both GEMMs on the decode kernel: GEMM2 starts on each m-block as soon as GEMM1 has stored it
  // (GemmRun::mb_done), so it runs in the slots GEMM1's last partial round leaves idle.
  if (plan.handoff) r.mb_done = reinterpret_cast<int32_t*>(ws + L.handoff);
  launch_moe_gemm(gemm1, r, st);
  stage_done("GEMM1 (gate/up)", st);
  if (diag_skip(5)) return;

  r.wait_first = false;
  r.x_per_slot = false;
  r.pre_wait_slices = 0;
  r.pre_scratch = nullptr;
  r.pre_count = nullptr;
  r.out_kperm = false;  // GEMM2 writes rows in natural order; its input (the intermediate) is k-permuted with kperm
  r.x_by_position = false;  // GEMM2's input is in m-block order by construction
  d.set_gemm2(r, c.part, c.w2, ws, L);
  r.splits = plan.gemm2_splits;
  r.overlap_previous = true;  // GEMM2's weights do not depend on GEMM1: stream them during its tail
  if (plan.handoff) {
    r.mb_done_target = int(gemm1.NT / 2);
    r.item_claim = reinterpret_cast<int32_t*>(ws + L.handoff) + handoff_counters(L.max_blocks);
  }
  const int splits = launch_moe_gemm(d.g2, r, st);
  stage_done("GEMM2 (down)", st);
  if (diag_skip(6)) return;

  // A programmatic dependent of GEMM2 (which releases its dependents early): the sum's set-up
  // overlaps GEMM2's tail and its griddepcontrol.wait waits for GEMM2's completion and flush.
  launch_slot_sum_out(c.part, splits, M, int(d.k2), d.H, out, act, st, out_f32);
  stage_done("top-k sum", st);
}

void CudaMoeLayer::forward_per_expert_loop(const void* x, void* out, int64_t M, DType act, void* workspace,
                                           size_t workspace_size, Stream stream) const {
  const Impl& d = *impl_;
  Impl::Call c;
  if (!d.begin_call(x, out, M, act, workspace, workspace_size, stream, &c, false)) return;
  const Workspace& L = c.L;
  const LayerPlan& plan = c.plan;
  const int bm = gemm_config_block_m(plan.config);
  // The loop pattern needs the per-expert block ranges on the host.
  int32_t ntpp = 0;
  std::vector<int32_t> eids(size_t(L.max_blocks));
  WNA16_CUDA_CHECK(cudaMemcpyAsync(&ntpp, c.ws + L.ntpp, 4, cudaMemcpyDeviceToHost, c.st));
  WNA16_CUDA_CHECK(cudaMemcpyAsync(eids.data(), c.ws + L.eids, eids.size() * 4, cudaMemcpyDeviceToHost, c.st));
  WNA16_CUDA_CHECK(cudaStreamSynchronize(c.st));
  // Device-written counts index host arrays below: checked first (an align step that did not run,
  // e.g. under WNA16_DIAG_STAGES, leaves whatever the workspace held).
  if (ntpp < 0 || ntpp % bm != 0 || ntpp / bm > L.max_blocks)
    throw Error(fmt::format("per-expert loop: the align step's padded token count {} is not a multiple of {} "
                            "within {} blocks (did the align step run?)",
                            ntpp, bm, L.max_blocks));
  GemmRun r = d.align_driven_run(act, plan.config, M, c.ws, L);
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first block, block count) per expert
  const int64_t nblocks = ntpp / bm;
  for (int64_t b = 0; b < nblocks;) {
    int64_t e = b;
    while (e < nblocks && eids[size_t(e)] == eids[size_t(b)]) ++e;
    runs.emplace_back(b, e - b);
    b = e;
  }
  const bool gather = plan.gather;  // as forward(): the config was chosen for it
  // route_and_align gathered the shared slices' rows already where shared_rows_first.
  const void* x1 = gather ? d.gather_x(x, M, c.ws, L, false, c.st, plan.shared_rows_first ? d.k : -1) : x;
  for (const auto& [b0, nb] : runs) {
    d.set_gemm1(r, x1, c.ws, L);
    r.x_per_slot = gather;
    r.mb_begin = b0;
    r.mb_count = nb;
    r.splits = 1;
    launch_moe_gemm(gather ? d.g1_gathered : d.g1, r, c.st);
  }
  r.x_per_slot = false;
  int splits = 1;  // the same for every launch (it depends on the weights and r.splits only)
  for (const auto& [b0, nb] : runs) {
    d.set_gemm2(r, c.part, c.w2, c.ws, L);
    r.mb_begin = b0;
    r.mb_count = nb;
    r.splits = plan.gemm2_splits;
    splits = launch_moe_gemm(d.g2, r, c.st);
  }
  // After the last GEMM2 launch (plain launches here) the sum, a programmatic dependent: its
  // griddepcontrol.wait waits for that launch, which ran after every launch before it.
  launch_slot_sum_out(c.part, splits, M, int(d.k2), d.H, out, act, c.st);
}

}  // namespace wna16::cuda
