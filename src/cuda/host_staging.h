// Host buffers in and out around a device launch, synchronous: the CUDA backend adapter and the
// sharded CUDA rank (the CLI, the checkpoint runner and the tests call them with host memory).
// f32 input is rounded to bf16 and f32 output widened from it, as the CPU backend does. Host code only.
#pragma once
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/dev_buf.h"
#include "wna16/error.h"
#include "wna16/half.h"

namespace wna16::cuda {

class HostStaging {
 public:
  explicit HostStaging(int64_t hidden) : H_(hidden) {}

  // x (host, dtype [M, H]) -> device; launch(x_dev, out_dev, act); device -> out (host, dtype).
  template <class Launch>
  void run(const void* x, void* out, int64_t M, DType dtype, Launch&& launch) {
    if (M < 0) throw Error(fmt::format("M={} is negative", M));
    const DType act = dtype == DType::F32 ? DType::BF16 : dtype;
    const size_t n = size_t(M * H_);
    std::vector<uint16_t> xin;
    const void* xsrc = x;
    if (dtype == DType::F32) {
      xin.resize(n);
      const float* xf = static_cast<const float*>(x);
      for (size_t i = 0; i < n; ++i) xin[i] = float_to_bf16(xf[i]);
      xsrc = xin.data();
    }
    if (M > cap_) {
      cap_ = std::max<int64_t>(M, 2 * cap_);
      x_.alloc(size_t(cap_ * H_ * 2));
      out_.alloc(size_t(cap_ * H_ * 2));
    }
    if (n) WNA16_CUDA_CHECK(cudaMemcpy(x_.p, xsrc, n * 2, cudaMemcpyHostToDevice));
    launch(static_cast<const void*>(x_.p), out_.p, act);
    WNA16_CUDA_CHECK(cudaGetLastError());
    WNA16_CUDA_CHECK(cudaDeviceSynchronize());
    if (dtype == DType::F32) {
      std::vector<uint16_t> o(n);
      if (n) WNA16_CUDA_CHECK(cudaMemcpy(o.data(), out_.p, n * 2, cudaMemcpyDeviceToHost));
      float* of = static_cast<float*>(out);
      for (size_t i = 0; i < n; ++i) of[i] = bf16_to_float(o[i]);
    } else if (n) {
      WNA16_CUDA_CHECK(cudaMemcpy(out, out_.p, n * 2, cudaMemcpyDeviceToHost));
    }
  }

  // The caller's routing ([slots] ids and weights, host) on the device, valid until the next call.
  void stage_routing(const int32_t* ids, const float* wts, size_t slots) {
    ids_.alloc(slots * 4);
    wts_.alloc(slots * 4);
    if (!slots) return;
    WNA16_CUDA_CHECK(cudaMemcpy(ids_.p, ids, slots * 4, cudaMemcpyHostToDevice));
    WNA16_CUDA_CHECK(cudaMemcpy(wts_.p, wts, slots * 4, cudaMemcpyHostToDevice));
  }
  const int32_t* ids() const { return static_cast<const int32_t*>(ids_.p); }
  const float* wts() const { return static_cast<const float*>(wts_.p); }

 private:
  int64_t H_;
  int64_t cap_ = 0;
  DevBuf x_, out_, ids_, wts_;
};

}  // namespace wna16::cuda
