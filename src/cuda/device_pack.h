// Packing a MoE layer for the CUDA kernels on the device: checkpoint-layout tensors (GPTQ v1/v2,
// AWQ; 4/8 bit; sym/asym; act-order) in GPU memory -> the packed arrays of moe_gemm.h, the same
// bytes as the host packer (pack_kernel_linear over the KernelLinears the layer used to build).
// The host decides the small data-dependent things (pack_plan.h: act-order orders from a copy of
// g_idx, group maps, their checks); the device writes the weight, scale and zero words
// (device_pack_kernels.h) and checks scales and sym zeros, reporting the first offending element.
// This is the one path of CudaMoeLayer, from host or device tensors.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <vector>

#include "cuda/dev_buf.h"
#include "cuda/device_pack_kernels.h"
#include "cuda/pack_plan.h"
#include "wna16/cuda.h"

namespace wna16::cuda {

// Where a LayerPacker's memory operations and work items run: the device (CudaPackExecutor), or
// the host in the tests (the same items over host memory).
class PackExecutor {
 public:
  virtual ~PackExecutor() = default;
  // Memory for one batch's tables, valid until the next call.
  virtual void* scratch(size_t bytes) = 0;
  virtual void to_device(void* dst, const void* src, size_t bytes) = 0;
  virtual void to_host(void* dst, const void* src, size_t bytes) = 0;
  // Runs every item of c and b; returns the smallest error key of c's items (devpack::kNoError: none).
  virtual unsigned long long run(const devpack::PackBatch& b, const devpack::CheckBatch& c) = 0;
};

// Launches the checks and the four packing kernels on st (device_pack.cu); *err must hold
// devpack::kNoError before, the smallest error key after.
void launch_device_pack(const devpack::PackBatch& b, const devpack::CheckBatch& c, unsigned long long* err,
                        cudaStream_t st);

class CudaPackExecutor final : public PackExecutor {
 public:
  explicit CudaPackExecutor(cudaStream_t st) : st_(st) {}
  void* scratch(size_t bytes) override;
  void to_device(void* dst, const void* src, size_t bytes) override;
  void to_host(void* dst, const void* src, size_t bytes) override;
  unsigned long long run(const devpack::PackBatch& b, const devpack::CheckBatch& c) override;

 private:
  cudaStream_t st_;
  DevBuf scratch_, err_;
};

// Packs kernel experts batch by batch into the layer's arrays (E2 kernel experts each).
class LayerPacker {
 public:
  struct Targets {
    uint32_t *qw1 = nullptr, *sc1 = nullptr, *zr1 = nullptr, *qw2 = nullptr, *sc2 = nullptr, *zr2 = nullptr;
  };
  LayerPacker(const LayerPackShape& shape, const Targets& out, PackExecutor& ex);
  // Kernel experts 0..S-1, the shared expert's slices. Throws Error naming the expert, tensor,
  // element and value that a check refuses (the host path's messages).
  void pack_shared(const DeviceExpertWeights& shared);
  // Routed experts e0 .. e0+n-1 (kernel experts S+e0 ..).
  void pack_routed(int e0, const DeviceExpertWeights* experts, int n);
  // GEMM1's act-order gather tables [E2][H] (PackedGemm::perm / perm_up): empty when every kernel
  // expert reads x in order (perm) or gate and up share one order (perm_up).
  std::vector<int32_t> perm() const { return any_perm_ ? h_perm_ : std::vector<int32_t>(); }
  std::vector<int32_t> perm_up() const { return any_dual_ ? h_perm_up_ : std::vector<int32_t>(); }

 private:
  struct Source {
    const DeviceExpertWeights* w;
    std::string name;  // "expert 3", "shared expert"
    int first_id;      // error-key id of its gate (up +1, down +2)
  };
  struct KernelExpert {
    int e2;
    int src;  // index into the batch's sources
    int64_t slice0, Isrc;
  };
  void pack(const std::vector<Source>& sources, const std::vector<KernelExpert>& kes);
  [[noreturn]] void report(unsigned long long key, const std::vector<Source>& sources);

  LayerPackShape shape_;
  Targets out_;
  PackExecutor& ex_;
  std::vector<int32_t> h_perm_, h_perm_up_;
  bool any_perm_ = false, any_dual_ = false;
};

// The packed arrays CudaMoeLayer runs on.
struct PackedLayerArrays {
  DevBuf qw1, sc1, zr1, qw2, sc2, zr2, perm1, permup1;
};

// Checks a device layer's counts and shapes against spec, as MoeLayerWeights::validate does for
// host tensors (same messages); the values are checked while packing.
void validate_device_weights(const MoeLayerSpec& spec, const DeviceMoeLayerWeights& w);
// Every linear's (name, scheme), for plan_layer_shape.
std::vector<std::pair<std::string, QuantScheme>> layer_schemes(const MoeLayerWeights& w);
std::vector<std::pair<std::string, QuantScheme>> layer_schemes(const DeviceMoeLayerWeights& w);

// Packs a layer from tensors on the current device, on st; returns after synchronising st.
PackedLayerArrays pack_layer_on_device(const LayerPackShape& shape, const DeviceMoeLayerWeights& w, cudaStream_t st);
// The same from host tensors: uploaded a batch of experts at a time (bounded staging memory).
PackedLayerArrays pack_layer_on_device(const LayerPackShape& shape, const MoeLayerWeights& w, cudaStream_t st);

}  // namespace wna16::cuda
