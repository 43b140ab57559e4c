// EXPERIMENT: the wgmma kernel's instantiations for config m16w4 (sm90_wna16_moe_prefill.cuh).
#include "cuda/sm90_wna16_moe_prefill.cuh"

namespace wna16::cuda::gemm {
WNA16_PREFILL_INSTANTIATE_CONFIG(CfgM16W4)
}  // namespace wna16::cuda::gemm
