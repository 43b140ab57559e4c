// EXPERIMENT: the wgmma kernel's instantiations for config m16w (sm90_wna16_moe_prefill.cuh).
#include "cuda/sm90_wna16_moe_prefill.cuh"

namespace wna16::cuda::gemm {
WNA16_PREFILL_INSTANTIATE_CONFIG(CfgM16W)
}  // namespace wna16::cuda::gemm
