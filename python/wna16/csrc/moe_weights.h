// torch.classes.wna16.MoeWeights: one MoE layer packed once for a backend (the library's
// MoeBackendLayer, which repacks the checkpoint tensors into its kernel layout at construction),
// plus its spec. Built by torch.ops.wna16.pack (checkpoint-layout tensors) or
// torch.ops.wna16.load_checkpoint_layer (a Hugging Face directory, the library's loader); every op
// of torch.ops.wna16 takes it. The helpers below are shared by the per-dispatch-key op files
// (ops_cpu.cpp, and ops_cuda.cpp where Torch has CUDA).
#pragma once
#include <torch/custom_class.h>
#include <torch/library.h>

#include <memory>
#include <string>

#include "wna16/backend.h"
#include "wna16/moe.h"
#ifdef WNA16_TORCH_CUDA
#include "wna16/cuda.h"
#endif

namespace wna16::torch_ext {

struct MoeWeights : torch::CustomClassHolder {
  MoeLayerSpec spec;
  Device device = Device::Cpu;
  bool has_router = true;  // false: packed without a router; moe_layer (which routes) refuses it
  std::string scheme;      // e.g. "gptq 4-bit g128 sym", for describe()
  bool batch_invariant = false;  // set_batch_invariant (the CPU backend always is)
  std::unique_ptr<MoeBackendLayer> layer;  // the CPU backend (device cpu)
#ifdef WNA16_TORCH_CUDA
  // device cuda: the layer's device entry points (torch's stream, a caching-allocator workspace),
  // on the GPU that was current when the weights were packed.
  std::unique_ptr<cuda::CudaMoeLayer> cuda_layer;
  int cuda_device = -1;
#endif

  std::string describe() const;
};
using MoeWeightsPtr = c10::intrusive_ptr<MoeWeights>;

// Repacks mw for w.device into w (layer, or cuda_layer where the extension has CUDA).
void build_layer(MoeWeights& w, const MoeLayerWeights& mw);
#ifdef WNA16_TORCH_CUDA
int current_cuda_device();  // ops_cuda.cpp
#endif

// The activation dtype of a tensor: BF16, F16 or F32 (F32 is computed in BF16, as `wna16 run`
// does). Throws c10::TypeError naming `who`, the argument (`what`) and the dtype otherwise.
DType act_dtype(const at::Tensor& x, const char* who, const char* what = "x");

// Checks the arguments of moe / moe_out / moe_layer (shapes, dtypes, devices, the ids' range) and
// throws c10 errors naming the argument and value. ids/weights may be undefined (moe_layer).
// check_id_values: also look for ids outside [0, E) (a device-to-host copy for CUDA tensors, so
// the CUDA kernel skips it while a CUDA graph is being captured).
void check_moe_args(const at::Tensor& x, const at::Tensor* topk_ids, const at::Tensor* topk_weights,
                    const MoeWeights& w, const char* who, bool check_id_values = true);
// Checks out= against x: same shape, dtype and device, contiguous.
void check_out(const at::Tensor& x, const at::Tensor& out, const char* who);

// The class and the device-free ops (pack, load_checkpoint_layer, layer_tolerance) and the schemas
// of the tensor ops are defined once, in ops.cpp.

}  // namespace wna16::torch_ext
