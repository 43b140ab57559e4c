// The CUDA layer behind the MoeBackendLayer interface (wna16/backend.h): host buffers in and out,
// synchronous, for the CLI, the checkpoint runner and the tests.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/dev_buf.h"
#include "cuda/dispatch.h"
#include "cuda/host_staging.h"
#include "wna16/backend.h"
#include "wna16/cuda.h"
#include "wna16/error.h"
#include "wna16/half.h"
#include "wna16/reference.h"

namespace wna16::cuda {
namespace {

class CudaBackendLayer final : public MoeBackendLayer {
 public:
  CudaBackendLayer(const MoeLayerSpec& spec, const MoeLayerWeights& w) : spec_(spec), layer_(spec, w), io_(spec.hidden) {}
  Device device() const override { return Device::Cuda; }
  void set_batch_invariant(bool on) override { layer_.set_batch_invariant(on); }

  void forward_host(const void* x, void* out, int64_t M, DType dtype) override {
    io_.run(x, out, M, dtype, [&](const void* xd, void* od, DType act) {
      ensure(M);
      layer_.forward(xd, od, M, act, ws_.p, ws_.bytes, nullptr);
    });
  }

  // The routing is checked on the host (check_routing, as the CPU backend does) before the
  // device sees it.
  void forward_routed_host(const void* x, const int32_t* topk_ids, const float* topk_weights, int top_k, void* out,
                           int64_t M, DType dtype) override {
    check_routing(spec_.routing, topk_ids, topk_weights, M, top_k, "cuda forward_routed_host");
    if (M == 0) return;
    io_.stage_routing(topk_ids, topk_weights, size_t(M) * size_t(top_k));
    io_.run(x, out, M, dtype, [&](const void* xd, void* od, DType act) {
      ensure(M);
      layer_.forward_routed(xd, io_.ids(), io_.wts(), top_k, od, M, act, ws_.p, ws_.bytes, nullptr);
    });
  }

 private:
  void ensure(int64_t M) {
    if (M <= cap_) return;
    cap_ = std::max<int64_t>(M, 2 * cap_);
    ws_.alloc(layer_.workspace_bytes(cap_));
  }
  MoeLayerSpec spec_;
  CudaMoeLayer layer_;
  HostStaging io_;
  int64_t cap_ = 0;
  DevBuf ws_;
};

}  // namespace
}  // namespace wna16::cuda

namespace wna16 {

namespace {
// The current GPU's compute capability (10 * major + minor), 0 without a usable GPU.
int current_gpu_cc() {
  int n = 0, dev = 0, major = 0, minor = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0 || cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return 10 * major + minor;
}
}  // namespace

// A GPU below sm_80 is not usable: the default device is then the CPU.
bool cuda_available() { return current_gpu_cc() >= 80; }

void use_cuda_portable_path(bool on) { cuda::force_portable_path(on); }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

void set_cuda_device(int ordinal) {
  const int n = cuda_device_count();
  if (ordinal < 0 || ordinal >= n)
    throw Error(fmt::format("GPU ordinal {} is out of range ({} GPUs present)", ordinal, n));
  WNA16_CUDA_CHECK(cudaSetDevice(ordinal));
}
const char* cuda_path_name() { return cuda_available() ? cuda::gpu_path_name() : "none"; }

std::unique_ptr<MoeBackendLayer> make_cuda_layer(const MoeLayerSpec& spec, const MoeLayerWeights& w) {
  const int cc = current_gpu_cc();
  if (cc == 0) throw Error("no CUDA GPU is present (cudaGetDeviceCount found none); use --device cpu");
  if (cc < 80) throw Error(cuda::unsupported_gpu_message(cc) + "; use --device cpu");
  return std::make_unique<cuda::CudaBackendLayer>(spec, w);
}

}  // namespace wna16
