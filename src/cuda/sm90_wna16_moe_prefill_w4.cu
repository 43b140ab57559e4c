// Instantiations of the wgmma prefill kernel (config m144w) for 4-bit weights, both activation types.
#include "cuda/sm90_wna16_moe_prefill.cuh"

namespace wna16::cuda::gemm {

template int prepare_prefill<__half, 4>();
template int prepare_prefill<__nv_bfloat16, 4>();
template void launch_prefill<__half, 4>(const KParams&, int64_t, cudaStream_t);
template void launch_prefill<__nv_bfloat16, 4>(const KParams&, int64_t, cudaStream_t);

}  // namespace wna16::cuda::gemm
