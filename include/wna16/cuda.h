// The whole MoE layer on the GPU: routing -> align -> GEMM1 (+SiLU*up) -> GEMM2 (x routing weight)
// -> top-k sum, over weights repacked once at load. One entry point taking a stream; no host
// synchronisation; capturable in a CUDA graph. Only available when WNA16_HAVE_CUDA.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "wna16/backend.h"
#include "wna16/cuda_kernels.h"
#include "wna16/quant.h"

namespace wna16::cuda {

// One linear's checkpoint tensors in device memory, row-major and contiguous, in the layouts of
// QuantizedLinear (quant.h): GPTQ qweight int32 [K*bits/32, N], qzeros int32 [G, N*bits/32],
// g_idx int32 [K]; AWQ qweight int32 [K, N/8], qzeros [G, N/8]; scales [G, N].
struct DeviceQuantizedLinear {
  QuantScheme scheme;
  int64_t K = 0, N = 0;
  const int32_t* qweight = nullptr;
  const int32_t* qzeros = nullptr;  // null only for a sym scheme: every zero 2^(bits-1)
  const void* scales = nullptr;
  DType scales_dtype = DType::F16;  // F16, BF16 or F32; rounded to f16 as the host path does
  const int32_t* g_idx = nullptr;   // null: k / group_len (not allowed for act-order with a group size)
};
struct DeviceExpertWeights {
  DeviceQuantizedLinear gate, up, down;
};
// MoeLayerWeights (moe.h) with the experts' tensors on the device; the small tensors on the host.
struct DeviceMoeLayerWeights {
  std::vector<float> router;           // [E, H]
  std::vector<float> correction_bias;  // [E], NoauxTc only
  std::vector<DeviceExpertWeights> experts;
  std::optional<DeviceExpertWeights> shared;
  std::vector<float> shared_gate;      // [H], SigmoidGated only
};

class CudaMoeLayer {
 public:
  // Validates and repacks the weights, uploads them to the current device. Throws Error naming
  // any unsupported value (bits, group size, shape) before anything is launched.
  // The checkpoint tensors are uploaded (a batch of experts at a time) and packed on the device.
  CudaMoeLayer(const MoeLayerSpec& spec, const MoeLayerWeights& w);
  // The same layer from checkpoint tensors already on the current device (no host copy of the
  // weights): packed on `stream`, which must be ordered after the work that wrote them; returns
  // after synchronising it, so they may be freed then. Same checks and error messages.
  CudaMoeLayer(const MoeLayerSpec& spec, const DeviceMoeLayerWeights& w, Stream stream = nullptr);
  ~CudaMoeLayer();
  CudaMoeLayer(const CudaMoeLayer&) = delete;
  CudaMoeLayer& operator=(const CudaMoeLayer&) = delete;

  // Bytes of device workspace forward() needs for up to max_m tokens (queryable, explicit).
  size_t workspace_bytes(int64_t max_m) const;
  // Every call gives the same output bits on every run (no float is added by an atomic). With
  // batch invariance on, a token's output bits also do not depend on the other tokens of its
  // call (their number or values): one kernel arithmetic per token at every M (the router on one
  // kernel and split, the wgmma GEMM rows on Hopper or m64 elsewhere, GEMM2 without K splits),
  // at a cost in speed (docs/perf.md). Off by default; set it between calls, not during them.
  void set_batch_invariant(bool on);
  bool batch_invariant() const;
  // x, out: device [M, H] of act (F16 or BF16). workspace: device, >= workspace_bytes(M) bytes.
  // All three 16-byte aligned (as cudaMalloc and any row of a PyTorch tensor give them); a
  // misaligned one is refused (Error) before anything is launched.
  void forward(const void* x, void* out, int64_t M, DType act, void* workspace, size_t workspace_size,
               Stream stream) const;
  // The layer without its router, for callers that route themselves (an inference engine):
  // out[m] = sum_j topk_weights[m, j] * expert_{topk_ids[m, j]}(x[m]) (+ the shared expert, as in
  // forward). topk_ids: device int32 [M, top_k] in [0, E); topk_weights: device fp32 [M, top_k];
  // top_k must equal the layer's (Error otherwise). x, out, workspace as in forward; same stream
  // rules (no host synchronisation, capturable). The ids are not checked on the device (that
  // would need a host round trip): an id outside [0, E) adds nothing to its token's output.
  void forward_routed(const void* x, const int32_t* topk_ids, const float* topk_weights, int top_k, void* out,
                      int64_t M, DType act, void* workspace, size_t workspace_size, Stream stream) const;
  // forward (topk_ids null) or forward_routed (the caller's routing) with out as fp32 [M, H]: the
  // top-k sum before its rounding to act, e.g. a tensor-parallel rank's partial output, added over
  // the ranks before one rounding (cast_f32_to). Same checks, stream rules and workspace.
  void forward_f32(const void* x, const int32_t* topk_ids, const float* topk_weights, int top_k, float* out, int64_t M,
                   DType act, void* workspace, size_t workspace_size, Stream stream) const;
  // Baseline for the benchmark only: the same math with one GEMM launch per expert that received
  // tokens (the per-expert-loop pattern the single launch replaces). May synchronise the stream.
  void forward_per_expert_loop(const void* x, void* out, int64_t M, DType act, void* workspace,
                               size_t workspace_size, Stream stream) const;
  // Bytes of weights (incl. scales/zeros) resident on the device.
  size_t weight_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// out[i] = in[i] rounded to act (f16 or bf16), n a multiple of 4, on `stream`.
void cast_f32_to(const float* in, void* out, int64_t n, DType act, Stream stream);

}  // namespace wna16::cuda
