// CPU kernels of torch.ops.wna16: the library's CPU backend (MoeBackendLayer::forward_host and
// forward_routed_host) on host tensors. No computation of its own: arguments are checked, made
// contiguous in the dtypes the backend takes (F32 activations go through BF16, as `wna16 run`
// does), and handed over.
#include <ATen/ATen.h>

#include "moe_weights.h"
#include "wna16/error.h"

namespace wna16::torch_ext {
namespace {

void require_cpu(const at::Tensor& x, const MoeWeights& w, const char* who) {
  TORCH_CHECK_VALUE(x.device().is_cpu(), who, ": x is on ", x.device(), "; the CPU kernel takes CPU tensors");
  TORCH_CHECK_VALUE(w.device == Device::Cpu, who, ": the weights were packed for ", device_name(w.device),
                    "; x is on the CPU (pack with device=\"cpu\")");
}

// Runs the layer on x into out16 (BF16 or F16, contiguous, x's shape); ids/wts undefined = route.
void run(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts, MoeWeights& w, at::Tensor& out16,
         const char* who) {
  const int64_t M = x.size(0);
  if (M == 0) return;
  const DType act = out16.scalar_type() == at::kHalf ? DType::F16 : DType::BF16;
  const at::Tensor x16 = x.to(out16.scalar_type()).contiguous();
  try {
    if (ids.defined()) {
      const at::Tensor i32 = ids.to(at::kInt).contiguous();
      const at::Tensor f32 = wts.to(at::kFloat).contiguous();
      w.layer->forward_routed_host(x16.data_ptr(), i32.data_ptr<int32_t>(), f32.data_ptr<float>(),
                                   int(ids.size(1)), out16.data_ptr(), M, act);
    } else {
      w.layer->forward_host(x16.data_ptr(), out16.data_ptr(), M, act);
    }
  } catch (const Error& e) {
    TORCH_CHECK_VALUE(false, who, ": ", e.what());
  }
}

at::ScalarType compute_type(const at::Tensor& x) {
  return x.scalar_type() == at::kHalf ? at::kHalf : at::kBFloat16;
}

at::Tensor forward(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts, MoeWeights& w,
                   const char* who) {
  at::Tensor out16 = at::empty(x.sizes(), x.options().dtype(compute_type(x)));
  run(x, ids, wts, w, out16, who);
  return x.scalar_type() == out16.scalar_type() ? out16 : out16.to(x.scalar_type());
}

at::Tensor moe_cpu(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts, MoeWeightsPtr w) {
  check_moe_args(x, &ids, &wts, *w, "wna16.moe");
  require_cpu(x, *w, "wna16.moe");
  return forward(x, ids, wts, *w, "wna16.moe");
}

void moe_out_cpu(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts, MoeWeightsPtr w,
                 at::Tensor& out) {
  check_moe_args(x, &ids, &wts, *w, "wna16.moe_out");
  check_out(x, out, "wna16.moe_out");
  require_cpu(x, *w, "wna16.moe_out");
  if (out.scalar_type() == compute_type(x)) {
    run(x, ids, wts, *w, out, "wna16.moe_out");  // straight into out
  } else {
    out.copy_(forward(x, ids, wts, *w, "wna16.moe_out"));  // F32: computed in BF16
  }
}

at::Tensor moe_layer_cpu(const at::Tensor& x, MoeWeightsPtr w) {
  check_moe_args(x, nullptr, nullptr, *w, "wna16.moe_layer");
  require_cpu(x, *w, "wna16.moe_layer");
  TORCH_CHECK_VALUE(w->has_router, "wna16.moe_layer: the weights were packed without a router (router=None); "
                                   "route with wna16.moe(x, topk_ids, topk_weights, weights) instead");
  return forward(x, at::Tensor(), at::Tensor(), *w, "wna16.moe_layer");
}

}  // namespace

TORCH_LIBRARY_IMPL(wna16, CPU, m) {
  m.impl("moe", &moe_cpu);
  m.impl("moe_out", &moe_out_cpu);
  m.impl("moe_layer", &moe_layer_cpu);
}

}  // namespace wna16::torch_ext
