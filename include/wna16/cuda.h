// The whole MoE layer on the GPU: routing -> align -> GEMM1 (+SiLU*up) -> GEMM2 (x routing weight)
// -> top-k sum, over weights repacked once at load. One entry point taking a stream; no host
// synchronisation; capturable in a CUDA graph. Only available when WNA16_HAVE_CUDA.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

#include "wna16/backend.h"
#include "wna16/cuda_kernels.h"

namespace wna16::cuda {

class CudaMoeLayer {
 public:
  // Validates and repacks the weights, uploads them to the current device. Throws Error naming
  // any unsupported value (bits, group size, shape) before anything is launched.
  CudaMoeLayer(const MoeLayerSpec& spec, const MoeLayerWeights& w);
  ~CudaMoeLayer();
  CudaMoeLayer(const CudaMoeLayer&) = delete;
  CudaMoeLayer& operator=(const CudaMoeLayer&) = delete;

  // Bytes of device workspace forward() needs for up to max_m tokens (queryable, explicit).
  size_t workspace_bytes(int64_t max_m) const;
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

}  // namespace wna16::cuda
