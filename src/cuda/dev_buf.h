// A device allocation that owns its memory (the CUDA layer's weights, the backend adapter's
// buffers). Host code only.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "cuda/cuda_check.h"

namespace wna16::cuda {

struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  DevBuf() = default;
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf(DevBuf&& o) noexcept : p(o.p), bytes(o.bytes) {
    o.p = nullptr;
    o.bytes = 0;
  }
  DevBuf& operator=(DevBuf&& o) noexcept {
    if (this != &o) {
      if (p) cudaFree(p);
      p = o.p;
      bytes = o.bytes;
      o.p = nullptr;
      o.bytes = 0;
    }
    return *this;
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  void alloc(size_t n) {
    if (p) cudaFree(p);
    p = nullptr;
    bytes = n;
    if (n) WNA16_CUDA_CHECK(cudaMalloc(&p, n));
  }
  template <class V>
  void upload(const std::vector<V>& v) {
    alloc(v.size() * sizeof(V));
    if (bytes) WNA16_CUDA_CHECK(cudaMemcpy(p, v.data(), bytes, cudaMemcpyHostToDevice));
  }
};

}  // namespace wna16::cuda
