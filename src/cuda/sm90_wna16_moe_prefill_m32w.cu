// Instantiations of the wgmma kernel with config m32w (sm90_wna16_moe_common.cuh), 4- and 8-bit
// weights, both activation types: one translation unit per config, so that they build in parallel.
#include "cuda/sm90_wna16_moe_prefill.cuh"

namespace wna16::cuda::gemm {

#define WNA16_PREFILL_INSTANTIATE(T, B)    \
  template int prepare_prefill<CfgM32W, T, B>(); \
  template void launch_prefill<CfgM32W, T, B>(const KParams&, int64_t, cudaStream_t);
WNA16_PREFILL_INSTANTIATE(__half, 4)
WNA16_PREFILL_INSTANTIATE(__nv_bfloat16, 4)
WNA16_PREFILL_INSTANTIATE(__half, 8)
WNA16_PREFILL_INSTANTIATE(__nv_bfloat16, 8)
#undef WNA16_PREFILL_INSTANTIATE

}  // namespace wna16::cuda::gemm
