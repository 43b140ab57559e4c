// Backend dispatch: picks the CPU or CUDA implementation of a MoE layer.
#include "wna16/backend.h"

#include <string>

#include "wna16/error.h"

namespace wna16 {

const char* device_name(Device d) { return d == Device::Cpu ? "cpu" : "cuda"; }

Device parse_device(const std::string& s) {
  if (s == "cpu") return Device::Cpu;
  if (s == "cuda") return Device::Cuda;
  throw Error("unknown device '" + s + "' (expected cpu or cuda)");
}

Device default_device() { return cuda_available() ? Device::Cuda : Device::Cpu; }

std::unique_ptr<MoeBackendLayer> make_layer(Device d, const MoeLayerSpec& spec, const MoeLayerWeights& w) {
  return d == Device::Cuda ? make_cuda_layer(spec, w) : make_cpu_layer(spec, w);
}

double layer_tolerance(DType act) {
  // Weights are exact after dequantisation; the error comes from the activations' dtype: fp32
  // accumulation of bf16/fp16 products, and the silu(gate)*up intermediate rounded to `act`.
  switch (act) {
    case DType::BF16: return 1.5e-2;  // bf16 has 8 significant bits: ~4e-3 per rounding
    case DType::F16: return 3e-3;     // 11 significant bits
    case DType::F32: return 1e-4;
  }
  return 1e-2;
}

#ifndef WNA16_HAVE_CUDA
bool cuda_available() { return false; }
void use_cuda_portable_path(bool on) {
  if (on) throw Error("the portable CUDA path: this build of wna16 has no CUDA backend");
}
const char* cuda_path_name() { return "none"; }
int cuda_device_count() { return 0; }
void set_cuda_device(int ordinal) {
  throw Error("GPU ordinal " + std::to_string(ordinal) + ": this build of wna16 has no CUDA backend");
}
std::unique_ptr<MoeBackendLayer> make_cuda_layer(const MoeLayerSpec&, const MoeLayerWeights&) {
  throw Error("this build of wna16 has no CUDA backend (nvcc was not found at configure time); use --device cpu");
}
#endif

}  // namespace wna16
