// Host launcher of the fused MoE GEMM: argument checks (naming the bad value), the kernel
// parameters, and the dispatch to the per-bit-width instantiations. The choices (tile config,
// split-K, the decode work shape) are dispatch.h's.
#include <cuda_runtime.h>

#include <mutex>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/dispatch.h"
#include "cuda/moe_gemm.h"
#include "cuda/sm90_wna16_moe_decode.cuh"
#include "cuda/sm90_wna16_moe_gemm.cuh"
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
    int major = 0, minor = 0;
    WNA16_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    WNA16_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    info.cc = 10 * major + minor;
  });
  return info;
}

}  // namespace gemm

int launch_moe_gemm(const DeviceGemm& w, const GemmRun& r, Stream stream) {
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
  if (r.config < 0 || r.config >= gemm_config_count())
    throw Error("GEMM config " + std::to_string(r.config) + " does not exist");
  if (!gemm_config_gathers(r.config) && (w.perm || w.perm_up))
    throw Error(std::string("GEMM config ") + gemm_config_name(r.config) + " has no act-order gather (perm): use config m64");
  if ((r.x_kperm || r.out_kperm) && !gemm_config_takes_kperm(r.config))
    throw Error(std::string("GEMM config ") + gemm_config_name(r.config) +
                " reads and writes activations in natural k order: x_kperm / out_kperm are for the wgmma configs (m32w, m64w, m96w, m144w)");
  if (r.out_kperm && (r.epilogue != GemmEpilogue::SiluMul || (w.N / 2) % 64 != 0))
    throw Error("out_kperm needs the SiluMul epilogue and an output width (N/2 = " + std::to_string(w.N / 2) +
                ") that is a multiple of 64");
  if (r.x_kperm && (reinterpret_cast<uintptr_t>(r.x) % 16 != 0 || r.x_stride % 8 != 0))
    throw Error("x_kperm needs x 16-byte aligned and x_stride (" + std::to_string(r.x_stride) + ") a multiple of 8");
  if ((r.mb_done || r.item_claim) && (r.config != 0 || w.perm || w.perm_up))
    throw Error(std::string("the m-block handoff (mb_done) is for the decode kernel (config m8 without act-order), not ") +
                gemm_config_name(r.config) + (w.perm || w.perm_up ? " with act-order" : ""));
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
  if (r.x_by_position && (r.epilogue != GemmEpilogue::SiluMul || !r.x_kperm || r.x_per_slot || w.perm || w.perm_up))
    throw Error("x_by_position (x in m-block order) is for GEMM1 (SiluMul) with x_kperm, without x_per_slot or a perm");
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
  if (!r.x_by_position) {
    // The staged and prefill kernels index x with 32-bit element offsets (x_by_position: tensor
    // copies, by row coordinates).
    const int64_t x_rows = r.epilogue != GemmEpilogue::SiluMul ? r.max_blocks * gemm_config_block_m(r.config)
                           : r.x_per_slot                       ? r.num_slots
                                                                : r.num_slots / std::max(1, r.topk);
    if (x_rows * r.x_stride + w.K >= (int64_t(1) << 31))
      throw Error("x of " + std::to_string(x_rows) + " rows x " + std::to_string(r.x_stride) +
                  " elements is above the kernels' 2^31 element index range");
  }
  const bool x_rows_bound = (r.x_rows > 0 && r.epilogue == GemmEpilogue::WeightedSum) || r.x_by_position;
  if (r.x_rows < 0 || (x_rows_bound && r.x_rows < max_padded_slots(r.num_slots, w.E, gemm_config_block_m(r.config))))
    throw Error("x_rows=" + std::to_string(r.x_rows) + " is below the align step's bound on the padded rows (" +
                std::to_string(max_padded_slots(r.num_slots, w.E, gemm_config_block_m(r.config))) + ")");
  if (w.E * w.G * w.NT * 8 >= (int64_t(1) << 31))
    throw Error("scale table of " + std::to_string(w.E * w.G * w.NT * 8) + " words is above the kernel's 2^31 index range");
  if (r.num_slots == 0 || r.mb_count == 0) return 1;  // nothing is written

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
  kp.x_rows = r.epilogue == GemmEpilogue::WeightedSum || r.x_by_position ? r.x_rows : 0;  // 0: extent unknown
  kp.x_pos = r.x_by_position ? 1 : 0;
  kp.mb_done = r.mb_done;
  kp.mb_done_target = r.mb_done_target;
  kp.mb_done_pps = r.mb_done ? handoff_pairs_per_slot(r.epilogue == GemmEpilogue::SiluMul ? w.NT / 2 : r.mb_done_target) : 1;
  kp.item_claim = r.epilogue == GemmEpilogue::WeightedSum ? r.item_claim : nullptr;
  // GEMM2 with handoff slots: split-major items, so the first claims read the first slots.
  kp.split_major = kp.item_claim && r.mb_done && kp.mb_done_pps < r.mb_done_target ? 1 : 0;
  kp.defer_ok = w.group_len % PackedGemm::kChunkK == 0 && !(w.bits == 8 && r.act == DType::BF16);
  kp.chunks_per_group = kp.defer_ok ? int(w.group_len / PackedGemm::kChunkK) : 1;
  auto log2_or_neg = [](int64_t v) {
    int sh = 0;
    while ((int64_t(1) << sh) < v) ++sh;
    return (int64_t(1) << sh) == v ? sh : -1;
  };
  kp.cpg_shift = log2_or_neg(kp.chunks_per_group);
  kp.static_groups = 0;
  if (r.config == 0 && !w.perm && kp.defer_ok &&
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
  kp.pdl = r.overlap_previous ? (r.wait_first ? 2 : 1) : 0;
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
    // The shared slices' items in K parts (GemmRun::pre_scratch; shared_slice_parts decides how
    // many). The kernel has parts for int4 static groups only.
    const int64_t units = w.NT / (2 * plan.ppw), per_block = gemm::kDecodeWarps / plan.kw;
    const int64_t pre_base = pre_wait_mblocks(r) * ((units + per_block - 1) / per_block);
    if (kp.pre_slices > 0 && r.pre_scratch && r.pre_count && w.bits == 4 && kp.static_groups) {
      const int64_t group = kp.chunks_per_group;
      const int64_t parts = shared_slice_parts(pre_base, kp.KC, group, plan.kw, plan.resident);
      if (parts > 1) {
        const int64_t kc = (kp.KC + parts - 1) / parts;
        kp.pre_kc = int((kc + group - 1) / group * group);
        kp.pre_parts = int((kp.KC + kp.pre_kc - 1) / kp.pre_kc);
        kp.pre_scratch = r.pre_scratch;
        kp.pre_part_stride = pre_part_floats(r.num_slots / r.topk, r.pre_wait_slices, kp.NT);
        kp.pre_count = r.pre_count;
      }
    }
    if (kp.pre_slices > 0) {
      kp.pre_base = int(pre_base * kp.splits);
      kp.pre_total = kp.pre_base * kp.pre_parts;
    }
  }
  auto s = static_cast<cudaStream_t>(stream);
  if (w.bits == 4) gemm::launch_w4(&kp, r.config, r.act, upper, s);
  else gemm::launch_w8(&kp, r.config, r.act, upper, s);
  return kp.splits;
}

void prepare_moe_gemm(int bits) {
  if (bits != 4 && bits != 8) throw Error("bits=" + std::to_string(bits) + " is not supported (4 or 8)");
  const int cc = device_compute_capability();
  if (cc < 80) throw Error(unsupported_gpu_message(cc));
  // The path is decided here, at layer construction, never inside a stream capture (its first
  // answer reads a device symbol).
  const bool portable = portable_path();
  for (int c = 0; c < gemm_config_count(); ++c)
    for (DType act : {DType::BF16, DType::F16}) {
      if (portable && gemm_config_hopper(c)) continue;
      if (bits == 4) gemm::launch_w4(nullptr, c, act, 0, nullptr);
      else gemm::launch_w8(nullptr, c, act, 0, nullptr);
    }
}

}  // namespace wna16::cuda
