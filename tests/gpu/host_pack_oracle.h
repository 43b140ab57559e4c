// The host path of packing a MoE layer for the CUDA kernels, as the layer ran it before packing
// moved to the device: unpack every linear, build each kernel expert's KernelLinear (act-order
// rows sorted, gate/up tiles interleaved, padding) and pack it with pack_kernel_linear. The oracle
// that the device packer (cuda/device_pack.h) must match bit for bit; host only, no GPU.
#pragma once
#include "cuda/moe_gemm.h"
#include "wna16/moe.h"

namespace wna16::cuda::host_oracle {

struct HostPackedLayer {
  PackedGemm g1, g2;  // E2 kernel experts each; g1.perm / perm_up as the layer uploads them (or empty)
};

// Throws Error for what the layer refuses, with the device packer's messages.
HostPackedLayer host_pack_layer(const MoeLayerSpec& spec, const MoeLayerWeights& w);

}  // namespace wna16::cuda::host_oracle
