// Instantiations of the wgmma kernel (configs m32w, m64w and m144w) for 8-bit weights, both activation types.
#include "cuda/sm90_wna16_moe_prefill.cuh"

namespace wna16::cuda::gemm {

#define WNA16_PREFILL_INSTANTIATE(C, T)   \
  template int prepare_prefill<C, T, 8>(); \
  template void launch_prefill<C, T, 8>(const KParams&, int64_t, cudaStream_t);
WNA16_PREFILL_INSTANTIATE(CfgM64W, __half)
WNA16_PREFILL_INSTANTIATE(CfgM64W, __nv_bfloat16)
WNA16_PREFILL_INSTANTIATE(CfgM32W, __half)
WNA16_PREFILL_INSTANTIATE(CfgM32W, __nv_bfloat16)
WNA16_PREFILL_INSTANTIATE(CfgM144W, __half)
WNA16_PREFILL_INSTANTIATE(CfgM144W, __nv_bfloat16)
#undef WNA16_PREFILL_INSTANTIATE

}  // namespace wna16::cuda::gemm
