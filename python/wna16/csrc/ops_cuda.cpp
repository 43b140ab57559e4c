// CUDA kernels of torch.ops.wna16 (built where Torch has CUDA): the library's CudaMoeLayer device
// entry points (forward, forward_routed) on PyTorch's current stream, with the workspace from
// PyTorch's caching allocator, so the ops run inside torch.cuda.CUDAGraph capture (no host
// synchronisation then: the ids' range check, a device-to-host copy, runs only outside capture).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include "moe_weights.h"
#include "wna16/error.h"

namespace wna16::torch_ext {

int current_cuda_device() {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}

namespace {

void require_cuda(const at::Tensor& x, const MoeWeights& w, const char* who) {
  TORCH_CHECK_VALUE(x.is_cuda(), who, ": x is on ", x.device(), "; the CUDA kernel takes CUDA tensors");
  TORCH_CHECK_VALUE(w.cuda_layer != nullptr, who, ": the weights were packed for ", device_name(w.device), "; x is on ",
                    x.device(), " (pack with device=\"cuda\")");
  TORCH_CHECK_VALUE(x.device().index() == w.cuda_device, who, ": x is on ", x.device(),
                    "; the weights were packed on cuda:", w.cuda_device);
}

bool capturing(cudaStream_t st) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(st, &status));
  return status != cudaStreamCaptureStatusNone;
}

// The kernels move 16-byte vectors through x and out: a view off that grid is copied.
at::Tensor aligned(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

at::ScalarType compute_type(const at::Tensor& x) { return x.scalar_type() == at::kHalf ? at::kHalf : at::kBFloat16; }

// Runs the layer on x into out16 (compute dtype, contiguous, 16-byte aligned, x's shape) on the
// current stream; ids/wts undefined: the layer routes.
void run(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts, MoeWeights& w, at::Tensor& out16,
         const char* who) {
  const int64_t M = x.size(0);
  if (M == 0) return;
  const DType act = out16.scalar_type() == at::kHalf ? DType::F16 : DType::BF16;
  const at::Tensor x16 = aligned(x.to(out16.scalar_type()));
  const cudaStream_t st = at::cuda::getCurrentCUDAStream(x.device().index()).stream();
  const size_t ws_bytes = w.cuda_layer->workspace_bytes(M);
  const at::Tensor ws = at::empty({int64_t(ws_bytes)}, x.options().dtype(at::kByte));
  try {
    if (ids.defined()) {
      const at::Tensor i32 = ids.to(at::kInt).contiguous(), f32 = wts.to(at::kFloat).contiguous();
      w.cuda_layer->forward_routed(x16.data_ptr(), i32.data_ptr<int32_t>(), f32.data_ptr<float>(), int(ids.size(1)),
                                   out16.data_ptr(), M, act, ws.data_ptr(), ws_bytes, st);
    } else {
      w.cuda_layer->forward(x16.data_ptr(), out16.data_ptr(), M, act, ws.data_ptr(), ws_bytes, st);
    }
  } catch (const Error& e) {
    TORCH_CHECK_VALUE(false, who, ": ", e.what());
  }
}

at::Tensor forward(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts, MoeWeights& w, const char* who) {
  at::Tensor out16 = at::empty(x.sizes(), x.options().dtype(compute_type(x)));
  run(x, ids, wts, w, out16, who);
  return x.scalar_type() == out16.scalar_type() ? out16 : out16.to(x.scalar_type());
}

void check_routed(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts, const MoeWeights& w,
                  const char* who) {
  require_cuda(x, w, who);
  const c10::cuda::CUDAGuard guard(x.device());
  check_moe_args(x, &ids, &wts, w, who, !capturing(at::cuda::getCurrentCUDAStream(x.device().index()).stream()));
}

at::Tensor moe_cuda(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts, MoeWeightsPtr w) {
  check_routed(x, ids, wts, *w, "wna16.moe");
  const c10::cuda::CUDAGuard guard(x.device());
  return forward(x, ids, wts, *w, "wna16.moe");
}

void moe_out_cuda(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts, MoeWeightsPtr w,
                  at::Tensor& out) {
  check_routed(x, ids, wts, *w, "wna16.moe_out");
  check_out(x, out, "wna16.moe_out");
  const c10::cuda::CUDAGuard guard(x.device());
  if (out.scalar_type() == compute_type(x) && reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0) {
    run(x, ids, wts, *w, out, "wna16.moe_out");  // straight into out
  } else {
    out.copy_(forward(x, ids, wts, *w, "wna16.moe_out"));  // F32 (computed in BF16) or a misaligned out
  }
}

at::Tensor moe_layer_cuda(const at::Tensor& x, MoeWeightsPtr w) {
  check_moe_args(x, nullptr, nullptr, *w, "wna16.moe_layer");
  require_cuda(x, *w, "wna16.moe_layer");
  TORCH_CHECK_VALUE(w->has_router, "wna16.moe_layer: the weights were packed without a router (router=None); "
                                   "route with wna16.moe(x, topk_ids, topk_weights, weights) instead");
  const c10::cuda::CUDAGuard guard(x.device());
  return forward(x, at::Tensor(), at::Tensor(), *w, "wna16.moe_layer");
}

}  // namespace

TORCH_LIBRARY_IMPL(wna16, CUDA, m) {
  m.impl("moe", &moe_cuda);
  m.impl("moe_out", &moe_out_cuda);
  m.impl("moe_layer", &moe_layer_cuda);
}

}  // namespace wna16::torch_ext
