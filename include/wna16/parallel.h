// A MoE layer sharded over several ranks: tensor parallel (TP: every rank of an expert group holds
// a slice of each expert's intermediate width; partial outputs are summed by one all-reduce) times
// expert parallel (EP: each expert group holds E/ep of the routed experts; tokens travel to the
// groups that own their experts and the weighted results travel back). docs/parallel.md.
//
// The functions here decide the plan (which rows, which experts, what travels where) for every
// backend; a backend's sharded layer runs it over a Communicator (comm.h).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "wna16/backend.h"
#include "wna16/comm.h"
#include "wna16/moe.h"

namespace wna16 {

struct ParallelPlan {
  int tp = 1;  // ranks splitting each expert's intermediate width
  int ep = 1;  // expert groups splitting the routed experts
  int world() const { return tp * ep; }
  // rank = ep_rank * tp + tp_rank: the tp ranks of one expert group are neighbours (one NVLink
  // island on a real machine carries the all-reduce).
  int tp_rank(int rank) const { return rank % tp; }
  int ep_rank(int rank) const { return rank / tp; }
  std::string describe() const;  // "tp=2 x ep=2 (4 ranks)"

  // tp >= 1, ep >= 1 and, when world_size > 0, tp * ep == world_size; throws Error naming them.
  void validate(int world_size = 0) const;
};

// Checks the plan against a layer and its weights: the plan itself, E divisible by ep, the routed
// and shared widths divisible by tp, and each rank's slice of every linear representable in the
// checkpoint's format: whole packed words (GPTQ packs K by 32/bits, qzeros and AWQ pack N by 8)
// and, for down projections, the slice's groups (slice_group_len) valid for the format; naming the
// expert, the linear, the rank's rows and the values. A cut inside a quantization group is fine:
// the slice gets a smaller group length (below).
void check_plan(const ParallelPlan& plan, const MoeLayerSpec& spec, const MoeLayerWeights& w);
// The spec-only part (no weights): plan, E % ep, I % tp, shared width % tp.
void check_plan(const ParallelPlan& plan, const MoeLayerSpec& spec);

// What one rank holds.
struct ShardLayout {
  int rank = 0, tp_rank = 0, ep_rank = 0;
  int expert_begin = 0, expert_end = 0;  // routed experts [begin, end), global ids
  // Its slice of each routed expert's width and of the shared expert's width, as positions in the
  // width's act-order order (act-order down projections: channels sorted by group, stable; the
  // plain order otherwise), so a slice is whole groups of the down projection.
  int64_t inter_begin = 0, inter_end = 0;
  int64_t shared_begin = 0, shared_end = 0;  // the shared expert is replicated over expert groups
};
ShardLayout shard_layout(const ParallelPlan& plan, const MoeLayerSpec& spec, int rank);

// The expert group that owns routed expert e.
int expert_owner(const ParallelPlan& plan, const MoeLayerSpec& spec, int expert);

// Tokens of a batch of M that expert group g starts with (and gets the outputs of): contiguous,
// the first M % ep groups one more. Every tp rank of the group has the same tokens.
struct TokenRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
TokenRange token_range(const ParallelPlan& plan, int64_t M, int ep_rank);

// The intermediate channel order of one expert under TP: position p of the width holds channel
// order[p]. The down projection's channels sorted by g_idx (stable) when it is act-order, so that
// a contiguous slice of positions is whole groups; the identity otherwise. gate/up columns and
// down rows are cut with the same order, which leaves silu(gate x) * up x . down unchanged.
std::vector<int32_t> inter_order(const QuantizedLinear& down);

// The group length of a rank's slice of a down projection: rows at positions [begin, end) of
// inter_order(down), where each original group is one contiguous run. The largest length that
// divides the group size and every run's part inside the slice (for groups of g channels:
// gcd(g, begin mod g, end mod g); g itself when the cuts fall on group starts), so that each of the slice's groups lies in one original group and takes its scale
// and zero: the slice dequantizes to exactly the full rows. -1 when down's group_size is -1 (one
// group over the width stays one group over the slice). shard_weights cuts with this length.
int64_t slice_group_len(const QuantizedLinear& down, int64_t begin, int64_t end);

// The weights rank `rank` holds, packed from the full checkpoint tensors: routed experts
// [expert_begin, expert_end) and the shared expert, each cut to the rank's slice of its width
// (gate/up: those columns, down: those rows in groups of slice_group_len, each with the scale and
// zero of the original group it lies in). The router,
// correction bias and shared gate are not sharded (every rank routes its own tokens) and stay in
// `full`. With tp == 1 experts are copied as they are. Calls check_plan. with_shared false: the
// shared expert is left out (a rank that cuts it its own way).
struct ShardWeights {
  std::vector<ExpertWeights> experts;   // expert_end - expert_begin
  std::optional<ExpertWeights> shared;  // the rank's slice, if the layer has one
};
ShardWeights shard_weights(const ParallelPlan& plan, const MoeLayerSpec& spec, const MoeLayerWeights& full, int rank,
                           bool with_shared = true);

// An expert cut to positions [begin, end) of its width in inter_order, as shard_weights cuts a
// rank's slice (keep_bias: the down bias stays, for one rank of those whose partials are summed);
// errors start with "<who>: ".
ExpertWeights slice_expert_width(const ExpertWeights& e, int64_t begin, int64_t end, bool keep_bias,
                                 const std::string& who);

// Bytes of an expert's tensors as stored (qweight, qzeros, g_idx, f16 scales): what a rank's
// weight_bytes() adds up.
int64_t expert_stored_bytes(const ExpertWeights& e);

// The same linear with groups of len rows, each taking the scale and zero of the group it lies in
// (len must divide the group size; no act-order): what a backend with one group length per GEMM
// needs when a rank's routed down slices were cut into shorter groups than its shared expert's.
QuantizedLinear regroup_rows(const QuantizedLinear& down, int64_t len, const std::string& who);

// Dispatch: what the tokens of one rank send to each expert group. A token goes once to every
// group that owns at least one of its experts, with its choices there (group-local expert ids and
// routing weights, in top-k order). Combine: each group returns, per token received and in the
// order received, one float row: the weighted sum of its choices' outputs (its tp slice only);
// the source adds the rows of groups 0, 1, ..., ep-1, then the shared expert's slice, then the tp
// ranks' partial rows are summed by one all-reduce in rank order.
struct DispatchPlan {
  struct ToGroup {
    std::vector<int32_t> tokens;        // local token indices, ascending
    std::vector<int32_t> choice_begin;  // tokens.size() + 1 offsets into experts / weights
    std::vector<int32_t> experts;       // group-local expert ids
    std::vector<float> weights;
  };
  std::vector<ToGroup> groups;  // ep entries
};
DispatchPlan plan_dispatch(const ParallelPlan& plan, const MoeLayerSpec& spec, const int32_t* topk_ids,
                           const float* topk_weights, int64_t M, int top_k);

// Bytes one rank moved in its last forward (sent; the in-process communicator copies them).
struct CommStats {
  int64_t dispatch_bytes = 0, combine_bytes = 0, all_reduce_bytes = 0;
};

// One rank's part of a sharded layer. Every call is collective over the world communicator.
class ShardedMoeLayer {
 public:
  virtual ~ShardedMoeLayer() = default;
  virtual const ShardLayout& layout() const = 0;
  // x, out: this rank's tokens [M, H], dtype as MoeBackendLayer: on the CPU its expert group's
  // (token_range; the same on the group's tp ranks), on CUDA the whole batch (every rank takes
  // and returns all of it). The ranks that share tokens get the same output bits.
  virtual void forward_host(const void* x, void* out, int64_t M, DType dtype) = 0;
  // Routing decided by the caller (topk_ids / topk_weights [M, top_k], global expert ids).
  virtual void forward_routed_host(const void* x, const int32_t* topk_ids, const float* topk_weights, int top_k,
                                   void* out, int64_t M, DType dtype) = 0;
  virtual int64_t weight_bytes() const = 0;  // this rank's expert weights, checkpoint form
  virtual const CommStats& last_stats() const = 0;
  // x, out: device [M, H] of act (f16, bf16) on the rank's GPU, the whole batch, ordered on
  // `stream` (a cudaStream_t), with no host round trip where the communicator has device buffers
  // (NCCL). The CUDA ranks have it (runs_on_device); the CPU ones throw.
  virtual bool runs_on_device() const { return false; }
  virtual void forward_device(const void*, void*, int64_t, DType, void*) {
    throw Error("forward_device: a CPU rank has no device path");
  }
};

// The sharded layer of rank world.rank(), its experts on `device` (CUDA: the calling thread's
// current GPU); world.size() must equal plan.world(). Collective (splits the world into tp and ep
// communicators). CUDA: the device-resident rank (sharded_cuda.cpp: it routes on the GPU and
// all-reduces device memory over NCCL); the CPU: the rank routes, dispatches and combines in host
// memory.
std::unique_ptr<ShardedMoeLayer> make_sharded_layer(Device device, const ParallelPlan& plan, const MoeLayerSpec& spec,
                                                    const MoeLayerWeights& full, Communicator& world);

// Every rank of a plan inside this process, one thread per rank over a World of `comm`'s kind
// (comm.h: in-process, or NCCL with one GPU per rank), behind MoeBackendLayer: forward_host splits
// the batch over the expert groups (token_range), runs all ranks and gathers the outputs (checking
// that the tp ranks of each group agree bit for bit). On CUDA rank r runs on GPU r % (the GPUs
// present), so every plan also runs on one GPU. What `wna16 verify|run|bench --tp --ep [--comm]`
// and the tests run.
std::unique_ptr<MoeBackendLayer> make_threaded_sharded_layer(Device device, const ParallelPlan& plan,
                                                             const MoeLayerSpec& spec, const MoeLayerWeights& full,
                                                             CommKind comm = CommKind::InProcess);

}  // namespace wna16
