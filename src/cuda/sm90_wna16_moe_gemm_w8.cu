// Instantiations of the fused MoE GEMM for 8-bit weights (both activation types, every tile
// config of the table).
#include "cuda/sm90_wna16_moe_decode.cuh"
#include "cuda/sm90_wna16_moe_gemm.cuh"

namespace wna16::cuda::gemm {

int launch_w8(const KParams* kp, int config, DType act, int64_t upper_mblocks, cudaStream_t s) {
  return launch_bits<8>(kp, config, act, upper_mblocks, s);
}

}  // namespace wna16::cuda::gemm
