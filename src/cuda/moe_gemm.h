// The fused grouped W4A16 / W8A16 MoE GEMM: host-side packing and the launch interface. No CUDA
// types here, so g++-compiled code (the layer, the tests) can include it.
//
// ---- Packed weight layout (built once at load on the device, device_pack.h) -----------------
// The index arithmetic lives in moe_gemm_layout.h, shared by the device packer and the host one
// below (pack_kernel_linear, the tests' oracle).
// One "kernel expert" e is a routed expert or a slice of the shared expert(s). A GEMM computes, for
// the tokens routed to e, out[t, n] = sum_k x[t, k] * W_e[k, n]. The kernel runs mma.sync
// m16n8k16 with SWAPPED operands: the 16-row A operand is W^T (16 output channels n x 16 inputs k),
// the 8-wide B operand is the tokens' activations (16 k x 8 tokens), so one token fills an MMA
// column rather than a 16-row tile.
//
// W is cut into tiles of 16 n-rows x 64 k ("chunks"). Inside a chunk the k axis is PERMUTED so that
// each lane's activations are contiguous: the lane with tig = lane % 4 owns real k in
// [16*tig, 16*tig + 16), and for the MMA k-step j (0..3) the mma column pair
// {2*tig, 2*tig+1} holds real k 16*tig + 4*j + {0, 1} and {2*tig+8, 2*tig+9} holds 16*tig+4*j+{2,3}.
// The same map is applied to A (weights, here) and to B (the kernel reads 16 contiguous bytes of
// activations per lane), so the product is unchanged.
//
// Words (uint32) per lane per chunk, lane = 4*g + tig, rows g and g+8 of the tile:
//  - int4: 4 words, word j = MMA k-step j; nibble i (bits 4i..4i+3) is MMA register r = i & 3,
//          element e = i >> 2: row = g + 8*(r & 1), k = 16*tig + 4*j + 2*(r >> 1) + e. So (w >> 4r) & 0x000f000f gives MMA register r's two
//          codes in its two 16-bit halves (the lop3 magic-number conversion needs no shuffles).
//  - int8: 8 words, for step j: word 2j = bytes {(g,k0),(g,k0+1),(g+8,k0),(g+8,k0+1)},
//          word 2j+1 = the same at k0+2, k0+3 (k0 = 16*tig + 4*j); prmt picks byte pairs.
// Storage: qweight[e][k/64][nt][u][lane][4 words] with u in [0, bits/4): each warp-wide 16-byte
// load reads 512 contiguous bytes. nt runs over NT n-tiles, N padded with zero tiles to a multiple
// of 8 tiles (128 rows) so any block width of the tile table divides it.
// Scales: scales[e][grp][nt][g] = f16 bits of s(row g) | s(row g+8) << 16 (the f16 value of the
// checkpoint; a BF16 checkpoint scale is rounded to f16). zeros: the same shape with the integer
// zero points z(row g) | z(row g+8) << 16, present only when some zero differs from 2^(bits-1).
// Dequantisation, two modes (same packed data):
//  - per weight (prefill config, group_len 32, int8 with bf16): (q - z) is an exact small integer
//    in the activation dtype, times s rounds once (folding q*s - z*s per weight would round z*s
//    separately);
//  - deferred (decode configs, group_len a multiple of 64): the MMA takes the exact magic + q codes
//    and the fp32 partial sums of a group become s * (sum (magic+q) x - (magic+z) * sum x), the
//    tokens' row sums coming from one extra MMA with an all-ones A operand: the same q*s - z*s
//    fold, applied once per group and row instead of once per weight.
//
// GEMM1 (gate/up, K = H, N = 2*I): tiles come in pairs, tile 2p = gate columns, tile 2p+1 = up
// columns, for the same 16 intermediate columns 16p..16p+15, so the lane that holds gate[c] also
// holds up[c] and the epilogue writes silu(gate)*up. Intermediate columns are stored in the order
// of the down projection's act-order permutation, so GEMM2 reads them with no gather.
// Act-order: K of GEMM1 is sorted by g_idx once here; perm[e][k] (and perm_up when the up
// projection's g_idx differs from the gate's) says which channel of x the kernel gathers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "wna16/half.h"

namespace wna16::cuda {

using Stream = void*;

// One linear of one kernel expert in kernel order (k already sorted for act-order, n already in
// the tile order described above), the packer's input.
struct KernelLinear {
  int64_t K = 0, N = 0;       // N here is the padded width: NT * 16
  int64_t group_len = 0;      // kernel group length along k (K for group_size -1)
  std::vector<uint8_t> q;     // [K, N] codes
  std::vector<float> scales;  // [K / group_len, N]
  std::vector<int32_t> zeros; // [K / group_len, N]
};

// All kernel experts of one GEMM, packed.
struct PackedGemm {
  int bits = 4;
  int64_t E = 0, K = 0, N = 0;  // N: real output width (GEMM1: 2*I)
  int64_t NT = 0;               // padded n-tiles (multiple of kTilePad)
  int64_t group_len = 0, G = 0;
  bool has_zeros = false;
  std::vector<uint32_t> qweight;  // E * qweight_words_per_expert()
  std::vector<uint32_t> scales;   // E * G * NT * 8
  std::vector<uint32_t> zeros;    // same, or empty
  std::vector<int32_t> perm;      // GEMM1 act-order: [E][K] channel gathered at sorted k; or empty
  std::vector<int32_t> perm_up;   // [E][K] for the up tiles when their order differs; or empty

  static constexpr int64_t kChunkK = 64;  // k per packed chunk
  static constexpr int64_t kTilePad = 8;  // n-tiles padded to a multiple of this
  int64_t qweight_words_per_expert() const { return (K / kChunkK) * NT * 32 * 4 * (bits / 4); }
  int64_t meta_words_per_expert() const { return G * NT * 8; }
  void init(int bits, int64_t E, int64_t K, int64_t N, int64_t group_len, bool has_zeros);
};

// Packs kernel expert e (K, N, group_len must match pg) into pg's arrays, on the host: the oracle
// of the device packer. Thread-safe for distinct e.
void pack_kernel_linear(const KernelLinear& lin, int64_t e, PackedGemm& pg);

// ---- launch ----------------------------------------------------------------------------------
struct DeviceGemm {
  int bits = 4;
  int64_t E = 0, K = 0, N = 0, NT = 0, group_len = 0, G = 0;
  const void* qweight = nullptr;
  const uint32_t* scales = nullptr;
  const uint32_t* zeros = nullptr;   // null: symmetric, zero = 2^(bits-1)
  const int32_t* perm = nullptr;     // GEMM1 act-order only
  const int32_t* perm_up = nullptr;  // GEMM1 act-order with a distinct up order only
};

enum class GemmEpilogue {
  SiluMul,       // GEMM1: inter[padded_pos, c] = act(silu(gate) * up); x rows = token = slot / topk
  // GEMM2: out[split, slot, n] = act(topk_weight[slot] * acc of K split `split`), rounded to the
  // activation dtype as a model's own expert output is (plain stores: every row of every split the
  // launch runs is written once); x rows = padded_pos. The token's output is the fp32 sum over its
  // slots and splits in a fixed order (launch_slot_sum_out): no atomics, so the same bits on every run.
  WeightedSum,
};

struct GemmRun {
  GemmEpilogue epilogue = GemmEpilogue::SiluMul;
  DType act = DType::BF16;
  int config = 0;                 // row of the kernel table (dispatch.h)
  const void* x = nullptr;        // act [rows, K]
  int64_t x_stride = 0;           // elements between rows
  // SiluMul: x has one row per slot (an act-order gather's output, launch_gather_slots: already in
  // each slot's expert's k order) instead of one per token; w then takes no perm.
  bool x_per_slot = false;
  void* out = nullptr;            // SiluMul: act [max_padded, N/2]; WeightedSum: act [splits, num_slots, N]
  const float* topk_weights = nullptr;  // WeightedSum: [num_slots]
  int topk = 1;                   // slots per token
  int64_t num_slots = 0;          // M * topk; also the align sentinel
  const int32_t* sorted_ids = nullptr;
  const int32_t* expert_ids = nullptr;
  const int32_t* num_tokens_post_padded = nullptr;
  int64_t max_blocks = 0;         // expert_ids capacity (grid bound)
  int64_t mb_begin = 0;           // first m-block
  int64_t mb_count = -1;          // < 0: all m-blocks, count read on the device from num_tokens_post_padded
  int splits = 1;                 // split-K (WeightedSum only; launch_moe_gemm returns the splits it ran, <= this)
  int decode_kw = 0;              // decode kernel (config m8): warps per tile unit along K, 1/2/4; 0: chosen
  // Decode kernel, int4: kDecodePairs (0): a warp owns one gate/up tile pair; kDecode4Tiles (1):
  // two adjacent pairs (4 tiles); kDecodeTilesAuto (2): per GEMM, the shape the critical-path model
  // predicts faster (the default; the layer's choice). Int8 always runs one pair per warp.
  int decode_4tiles = 2;  // kDecodeTilesAuto
  // Launch as a programmatic dependent of the previous kernel in the stream: the decode kernel
  // streams its first weights while that kernel finishes and waits for it before reading x.
  // Ignored (a plain launch) by the staged kernels, which read x from the start.
  bool overlap_previous = false;
  // With overlap_previous: the previous kernel also wrote the routing tables (sorted_ids,
  // expert_ids, num_tokens_post_padded): wait for it before anything; only the launch latency and
  // the blocks' start overlap it.
  bool wait_first = false;
  // The wgmma configs only (m32w, m64w, m96w, m144w; refused elsewhere): x's K axis is stored k-permuted (kperm_pos), so the
  // prefill kernel copies token rows with 16-byte copies instead of 4-byte ones; out_kperm: GEMM1
  // (SiluMul) writes its output k-permuted (the input of an m144w GEMM2). x must then be 16-byte
  // aligned with x_stride a multiple of 8.
  bool x_kperm = false;
  bool out_kperm = false;
  // WeightedSum with x_kperm, or x_by_position: the rows of x that are allocated (0: unknown). With
  // it the prefill kernel copies each chunk of an m-block's token tile as one tensor copy (rows
  // past it: zeros) and its k-loop runs without block barriers.
  int64_t x_rows = 0;
  // SiluMul on a wgmma config with x_kperm: x holds one row per position of the align output (row
  // mb * BLOCK_M + c feeds token column c of m-block mb, as GEMM2's intermediate does;
  // launch_kperm_positions writes it), x_rows >= the align step's bound on the padded rows.
  bool x_by_position = false;
  // M-block handoff between the two decode-kernel GEMMs of a layer call (config m8 without
  // act-order, refused elsewhere): GEMM1 (SiluMul) adds the tile pairs whose intermediate it has
  // stored to mb_done[mb * kHandoffSlots + pair / handoff_pairs_per_slot(NT / 2)]; GEMM2
  // (WeightedSum, a programmatic dependent of GEMM1; mb_done_target = GEMM1's NT / 2) waits only
  // for the slots of the m-block that its k-chunks read, instead of waiting for the whole GEMM1
  // grid, and takes its work items after the first (blockIdx.x) in order from the counter
  // item_claim (ordered so that the items claimed first read the slots GEMM1 stores first), so
  // blocks that start during GEMM1's tail take more of them. mb_done (max_blocks * kHandoffSlots
  // entries) and item_claim must be zero before GEMM1 starts.
  int32_t* mb_done = nullptr;
  int mb_done_target = 0;
  int32_t* item_claim = nullptr;
  // Decode-kernel GEMM1 (SiluMul, config m8 without act-order) with overlap_previous and
  // wait_first, over all m-blocks (mb_begin 0, mb_count < 0): kernel experts 0..S-1 (S =
  // pre_wait_slices <= topk) are slices of a shared expert that every token takes as its last S
  // choices (slot t * topk + topk - S + s), so the align step lays them out first, ceil(M / 8)
  // m-blocks each with the tokens in order. The kernel computes those m-blocks' tables itself and
  // runs them before griddepcontrol.wait, while the routing chain before it still runs; it waits
  // before the other m-blocks and before any mb_done release. x must be complete before the
  // previous kernels started (the layer's input). 0: off.
  int pre_wait_slices = 0;
  // With pre_wait_slices: each shared-slice item split along K into parts run by different blocks
  // (more blocks busy during the routing chain), where the launcher finds the parts fit one round
  // of the resident blocks. Each part stores its partial sums in its own part of pre_scratch
  // (kPreMaxParts x [S * ceil(M / 8) * 8] token columns x NT * 16 floats) and counts itself in
  // pre_count (S * ceil(M / 8) * NT / 2 ints); the last part of a tile unit adds the parts in part
  // order (the same sum on every run) and applies the epilogue. pre_count must be zero when GEMM1's
  // first block starts (not just before its wait). Null: one part (the whole K) per item.
  float* pre_scratch = nullptr;
  int32_t* pre_count = nullptr;
  // One token on the decode kernel (num_slots == topk == route_topk, all m-blocks, no shared
  // slices run ahead, no perm): the token's route_E <= 32 fp32 router logits, complete before the
  // previous kernel's grid ends. The kernel then routes the token itself, softmax top-k
  // (+- renormalise) with the routing kernel's order (route_one_token), and reads neither the
  // align tables nor topk_weights: the layer launches no routing kernel. Null: off.
  const float* route_logits = nullptr;
  int route_E = 0;
  int route_topk = 0;
  bool route_renormalize = true;
};
// The shared-slice parts' scratch sizes for GEMM1 (N = 2I, NT its n-tiles) at M tokens, S slices:
// one part's floats (pre_part_floats) and all parts' (pre_scratch_floats).
constexpr int kPreMaxParts = 4;
inline int64_t pre_part_floats(int64_t M, int S, int64_t NT) { return int64_t(S) * ((M + 7) / 8) * 8 * NT * 16; }
inline int64_t pre_scratch_floats(int64_t M, int S, int64_t NT) { return kPreMaxParts * pre_part_floats(M, S, NT); }
inline int64_t pre_count_ints(int64_t M, int S, int64_t NT) { return int64_t(S) * ((M + 7) / 8) * (NT / 2); }

// The prefill kernel's k-permuted activation layout: inside each 64-element chunk of a row, the
// 32 element pairs are stored as an 8 x 4 transpose (real pair 8w + u at pair position 4u + w),
// the order in which its wgmma B operand wants the packed weights' k (the A fragment above).
// Element k of a row sits at kperm_pos(k).
constexpr int64_t kperm_pos(int64_t k) {
  const int64_t rp = (k & 63) >> 1;
  return (k & ~int64_t(63)) + 2 * (4 * (rp & 7) + (rp >> 3)) + (k & 1);
}

constexpr int kDecodePairs = 0, kDecode4Tiles = 1, kDecodeTilesAuto = 2;  // GemmRun::decode_4tiles
// The m-block handoff's counters per m-block (GemmRun::mb_done); each counts
// handoff_pairs_per_slot (dispatch.h) of GEMM1's tile pairs.
constexpr int kHandoffSlots = 8;
// The handoff block of a layer call: handoff_counters(max_blocks) counters (GemmRun::mb_done), then
// GEMM2's item counter (GemmRun::item_claim) at that offset; all zero before GEMM1 starts.
constexpr int64_t handoff_counters(int64_t max_blocks) { return max_blocks * kHandoffSlots; }

// Sets the kernels' shared-memory limits and reads their occupancy (no launch); launch_moe_gemm
// does it on first use otherwise. Call before capturing a graph.
void prepare_moe_gemm(int bits);
// Throws Error naming the bad value before anything is launched. Returns the K splits it ran
// (WeightedSum: the rows of `out` it writes are [splits, num_slots]; <= r.splits, none empty).
int launch_moe_gemm(const DeviceGemm& w, const GemmRun& r, Stream stream);

}  // namespace wna16::cuda
