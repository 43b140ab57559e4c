// The wgmma kernel's instantiations for config m144w (sm90_wna16_moe_prefill.cuh).
#include "cuda/sm90_wna16_moe_prefill.cuh"

namespace wna16::cuda::gemm {
WNA16_PREFILL_INSTANTIATE_CONFIG(CfgM144W)
}  // namespace wna16::cuda::gemm
