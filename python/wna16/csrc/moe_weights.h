// torch.classes.wna16.MoeWeights: one MoE layer packed once for a backend (the library's
// MoeBackendLayer, which repacks the checkpoint tensors into its kernel layout at construction),
// plus its spec. Built by torch.ops.wna16.pack (checkpoint-layout tensors) or
// torch.ops.wna16.load_checkpoint_layer (a Hugging Face directory, the library's loader); every op
// of torch.ops.wna16 takes it. The helpers below are shared by the per-dispatch-key op files
// (ops_cpu.cpp now; a CUDA file registers its kernels beside them later).
#pragma once
#include <torch/custom_class.h>
#include <torch/library.h>

#include <memory>
#include <string>

#include "wna16/backend.h"
#include "wna16/moe.h"

namespace wna16::torch_ext {

struct MoeWeights : torch::CustomClassHolder {
  MoeLayerSpec spec;
  Device device = Device::Cpu;
  bool has_router = true;  // false: packed without a router; moe_layer (which routes) refuses it
  std::string scheme;      // e.g. "gptq 4-bit g128 sym", for describe()
  std::unique_ptr<MoeBackendLayer> layer;

  std::string describe() const;
};
using MoeWeightsPtr = c10::intrusive_ptr<MoeWeights>;

// The activation dtype of a tensor: BF16, F16 or F32 (F32 is computed in BF16, as `wna16 run`
// does). Throws c10::TypeError naming `who`, the argument (`what`) and the dtype otherwise.
DType act_dtype(const at::Tensor& x, const char* who, const char* what = "x");

// Checks the arguments of moe / moe_out / moe_layer (shapes, dtypes, devices, the ids' range) and
// throws c10 errors naming the argument and value. ids/weights may be undefined (moe_layer).
void check_moe_args(const at::Tensor& x, const at::Tensor* topk_ids, const at::Tensor* topk_weights,
                    const MoeWeights& w, const char* who);
// Checks out= against x: same shape, dtype and device, contiguous.
void check_out(const at::Tensor& x, const at::Tensor& out, const char* who);

// The class and the device-free ops (pack, load_checkpoint_layer, layer_tolerance) and the schemas
// of the tensor ops are defined once, in ops.cpp.

}  // namespace wna16::torch_ext
