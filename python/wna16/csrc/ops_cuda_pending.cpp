// CUDA dispatch of torch.ops.wna16 in a build without it (a Torch without CUDA, or a library built
// without CUDA; ops_cuda.cpp is the real one): a CUDA tensor gets this error, naming the build,
// instead of the dispatcher's generic "could not run ... with the CUDA backend".
#include <ATen/ATen.h>

#include "moe_weights.h"

namespace wna16::torch_ext {
namespace {

[[noreturn]] void pending(const char* op) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, op, ": this build of the extension has no CUDA kernels (built against a "
                                         "Torch without CUDA, or without the library's CUDA backend); "
                                         "CPU tensors only");
}

at::Tensor moe_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&, MoeWeightsPtr) { pending("wna16.moe"); }
void moe_out_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&, MoeWeightsPtr, at::Tensor&) {
  pending("wna16.moe_out");
}
at::Tensor moe_layer_cuda(const at::Tensor&, MoeWeightsPtr) { pending("wna16.moe_layer"); }

}  // namespace

TORCH_LIBRARY_IMPL(wna16, CUDA, m) {
  m.impl("moe", &moe_cuda);
  m.impl("moe_out", &moe_out_cuda);
  m.impl("moe_layer", &moe_layer_cuda);
}

}  // namespace wna16::torch_ext
