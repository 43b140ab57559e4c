// torch.ops.wna16: the library's MoE layer as PyTorch custom ops.
//
//   pack(...) -> MoeWeights                 checkpoint-layout tensors of E experts, packed once
//   load_checkpoint_layer(path, layer, device) -> MoeWeights   a Hugging Face directory's layer
//   moe(x, topk_ids, topk_weights, weights) -> Tensor            routing decided by the caller
//   moe_out(x, topk_ids, topk_weights, weights, *, out) -> ()    the same into a given tensor
//   moe_layer(x, weights) -> Tensor                              the whole layer, router included
//   layer_tolerance(dtype) -> float                              backend.h's layer_tolerance
//
// This file holds the schemas, the custom class, the device-free ops (catch-all kernels) and the
// Meta kernels (shape and dtype only; torch < 2.4, else python/wna16/_fake.py). Each device's kernels live in their own file and register
// with TORCH_LIBRARY_IMPL(wna16, <key>, m): ops_cpu.cpp (CPU) and ops_cuda.cpp (CUDA, where Torch
// has CUDA; ops_cuda_pending.cpp, an error naming the missing build, where it has not).
#include <ATen/ATen.h>
#include <torch/version.h>

// The C++ Meta kernels serve torch < 2.4; newer torch takes the shape functions from Python
// (torch.library.register_fake, _fake.py), which torch.compile's fake weights object needs and which
// a C++ Meta kernel would forbid.
#define WNA16_CPP_META (TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 4))

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "moe_weights.h"
#include "wna16/checkpoint.h"
#include "wna16/error.h"
#include "wna16/quant.h"

namespace wna16::torch_ext {

std::string MoeWeights::describe() const {
  std::string s = "MoeWeights(" + std::string(device_name(device)) + ", hidden=" + std::to_string(spec.hidden) +
                  ", inter=" + std::to_string(spec.inter) + ", experts=" + std::to_string(spec.routing.num_experts) +
                  ", top_k=" + std::to_string(spec.routing.top_k) + ", routing=" + routing_name(spec.routing.method);
  if (spec.shared_kind != SharedExpertKind::None)
    s += std::string(", shared=") + (spec.shared_kind == SharedExpertKind::Plain ? "plain" : "sigmoid_gated") + "(" +
         std::to_string(spec.shared_inter) + ")";
  if (!has_router) s += ", no router";
  return s + ", " + scheme + ")";
}

DType act_dtype(const at::Tensor& x, const char* who, const char* what) {
  TORCH_CHECK_VALUE(x.defined(), who, ": ", what, " is undefined (None); expected a tensor");
  switch (x.scalar_type()) {
    case at::kBFloat16: return DType::BF16;
    case at::kHalf: return DType::F16;
    case at::kFloat: return DType::F32;
    default: break;
  }
  TORCH_CHECK_TYPE(false, who, ": ", what, " has dtype ", x.scalar_type(), "; expected bfloat16, float16 or float32");
}

namespace {

std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

}  // namespace

void check_moe_args(const at::Tensor& x, const at::Tensor* ids, const at::Tensor* wts, const MoeWeights& w,
                    const char* who, bool check_id_values) {
  act_dtype(x, who);
  const int64_t H = w.spec.hidden, E = w.spec.routing.num_experts;
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == H, who, ": x has shape ", shape_str(x), "; expected [M, ", H,
                    "] (the layer's hidden size)");
  if (!ids) return;
  TORCH_CHECK_VALUE(ids->defined() && wts->defined(), who, ": topk_ids or topk_weights is undefined (None)");
  TORCH_CHECK_TYPE(ids->scalar_type() == at::kInt || ids->scalar_type() == at::kLong, who, ": topk_ids has dtype ",
                   ids->scalar_type(), "; expected int32 or int64");
  TORCH_CHECK_TYPE(at::isFloatingType(wts->scalar_type()), who, ": topk_weights has dtype ", wts->scalar_type(),
                   "; expected a floating type (computed in float32)");
  TORCH_CHECK_VALUE(ids->dim() == 2 && ids->size(0) == x.size(0), who, ": topk_ids has shape ", shape_str(*ids),
                    "; expected [M, top_k] with M=", x.size(0), " (x's rows)");
  TORCH_CHECK_VALUE(ids->size(1) >= 1 && ids->size(1) <= E, who, ": topk_ids has shape ", shape_str(*ids),
                    "; top_k must be in [1, ", E, "] (the layer's experts)");
  TORCH_CHECK_VALUE(wts->sizes() == ids->sizes(), who, ": topk_weights has shape ", shape_str(*wts),
                    "; expected ", shape_str(*ids), " (topk_ids' shape)");
  TORCH_CHECK_VALUE(ids->device() == x.device() && wts->device() == x.device(), who, ": x is on ", x.device(),
                    ", topk_ids on ", ids->device(), ", topk_weights on ", wts->device(), "; expected one device");
  if (!check_id_values || ids->is_meta() || ids->numel() == 0) return;
  // The first id out of range, named by position (the library checks again, by the same rule),
  // looked for in a host copy (one device-to-host copy for CUDA ids).
  const at::Tensor h = ids->to(at::kCPU, at::kLong).contiguous();
  const int64_t* v = h.data_ptr<int64_t>();
  for (int64_t i = 0; i < h.numel(); ++i)
    TORCH_CHECK_VALUE(v[i] >= 0 && v[i] < E, who, ": topk_ids[", i / h.size(1), ", ", i % h.size(1), "]=", v[i],
                      " is outside [0, ", E, ") (the layer's experts)");
}

void check_out(const at::Tensor& x, const at::Tensor& out, const char* who) {
  TORCH_CHECK_TYPE(out.scalar_type() == x.scalar_type(), who, ": out has dtype ", out.scalar_type(),
                   "; expected x's dtype ", x.scalar_type());
  TORCH_CHECK_VALUE(out.sizes() == x.sizes(), who, ": out has shape ", shape_str(out), "; expected x's shape ",
                    shape_str(x));
  TORCH_CHECK_VALUE(out.device() == x.device(), who, ": out is on ", out.device(), "; expected x's device ",
                    x.device());
  TORCH_CHECK_VALUE(out.is_contiguous(), who, ": out (strides ", out.strides(), ") must be contiguous");
}

void build_layer(MoeWeights& w, const MoeLayerWeights& mw) {
#ifdef WNA16_TORCH_CUDA
  if (w.device == Device::Cuda) {
    w.cuda_device = current_cuda_device();
    w.cuda_layer = std::make_unique<cuda::CudaMoeLayer>(w.spec, mw);
    return;
  }
#endif
  w.layer = make_layer(w.device, w.spec, mw);  // validates every tensor against the spec, repacks once
}

namespace {

// ---- pack -------------------------------------------------------------------------------------

// Checks of pack's list arguments, shared by the host and the device packing.
void require_2d(const at::Tensor& t, const std::string& what, int64_t i) {
  TORCH_CHECK_VALUE(t.defined() && t.dim() == 2, "wna16.pack: ", what, "[", i, "] has shape ",
                    t.defined() ? shape_str(t) : std::string("(undefined)"), "; expected a 2-D tensor");
}
void require_int32(const at::Tensor& t, const std::string& what, int64_t i) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "wna16.pack: ", what, "[", i,
                   "] has dtype ", t.scalar_type(), "; expected int32");
}
// K and N of a checkpoint qweight: AWQ [K, N/8] packed along N, GPTQ [K*bits/32, N] along K.
std::pair<int64_t, int64_t> checkpoint_kn(const QuantScheme& q, const at::Tensor& qw) {
  if (q.format == Format::Awq) return {qw.size(0), qw.size(1) * 32 / q.bits};
  return {qw.size(0) * 32 / q.bits, qw.size(1)};
}

at::Tensor cpu_2d(const at::Tensor& t, const std::string& what, int64_t i) {
  require_2d(t, what, i);
  return t.to(at::kCPU).contiguous();
}

std::vector<int32_t> int32_values(const at::Tensor& t, const std::string& what, int64_t i) {
  require_int32(t, what, i);
  const at::Tensor c = t.to(at::kCPU).to(at::kInt).contiguous();
  return std::vector<int32_t>(c.data_ptr<int32_t>(), c.data_ptr<int32_t>() + c.numel());
}

std::vector<float> float_values(const at::Tensor& t, const std::string& what) {
  TORCH_CHECK_TYPE(at::isFloatingType(t.scalar_type()), "wna16.pack: ", what, " has dtype ", t.scalar_type(),
                   "; expected float16, bfloat16 or float32");
  const at::Tensor c = t.to(at::kCPU).to(at::kFloat).contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

QuantizedLinear linear_from(const QuantScheme& q, const at::TensorList qweight, const at::TensorList scales,
                            const at::TensorList qzeros, const at::TensorList g_idx, int64_t i) {
  QuantizedLinear l;
  l.scheme = q;
  const at::Tensor qw = cpu_2d(qweight[size_t(i)], "qweight", i);
  const at::Tensor sc = cpu_2d(scales[size_t(i)], "scales", i);
  const at::Tensor qz = cpu_2d(qzeros[size_t(i)], "qzeros", i);
  std::tie(l.K, l.N) = checkpoint_kn(q, qw);
  l.qweight = int32_values(qw, "qweight", i);
  l.qzeros = int32_values(qz, "qzeros", i);
  l.scales = float_values(sc, "scales[" + std::to_string(i) + "]");
  if (!g_idx.empty() && g_idx[size_t(i)].defined() && g_idx[size_t(i)].numel() > 0) {
    TORCH_CHECK_VALUE(g_idx[size_t(i)].dim() == 1, "wna16.pack: g_idx[", i, "] has shape ",
                      shape_str(g_idx[size_t(i)]), "; expected [K]");
    l.g_idx = int32_values(g_idx[size_t(i)], "g_idx", i);
  }
  return l;
}

RoutingMethod parse_routing(const std::string& s) {
  for (RoutingMethod m : {RoutingMethod::SoftmaxTopK, RoutingMethod::GroupLimitedGreedy, RoutingMethod::NoauxTc})
    if (s == routing_name(m)) return m;
  TORCH_CHECK_VALUE(false, "wna16.pack: routing '", s, "' is unknown (expected softmax_topk, group_limited_greedy or noaux_tc)");
}

SharedExpertKind parse_shared(const std::string& s) {
  if (s == "none") return SharedExpertKind::None;
  if (s == "plain") return SharedExpertKind::Plain;
  if (s == "sigmoid_gated") return SharedExpertKind::SigmoidGated;
  TORCH_CHECK_VALUE(false, "wna16.pack: shared_kind '", s, "' is unknown (expected none, plain or sigmoid_gated)");
}

MoeWeightsPtr pack(at::TensorList qweight, at::TensorList scales, at::TensorList qzeros, at::TensorList g_idx,
                   std::string format, int64_t bits, int64_t group_size, bool sym, bool desc_act, int64_t hidden,
                   int64_t inter, int64_t top_k, c10::optional<at::Tensor> router, std::string routing,
                   bool renormalize, int64_t n_group, int64_t topk_group, double routed_scaling_factor,
                   c10::optional<at::Tensor> correction_bias, std::string shared_kind, int64_t shared_inter,
                   c10::optional<at::Tensor> shared_gate, std::string device) {
  auto w = c10::make_intrusive<MoeWeights>();
  try {
    QuantScheme q;
    q.format = parse_format(format);
    q.bits = int(bits);
    q.group_size = int(group_size);
    q.sym = sym;
    q.act_order = desc_act;
    q.validate(hidden, inter);  // bits, group size, format first: they decide how shapes are read
    MoeLayerSpec& s = w->spec;
    s.name = "torch";
    s.hidden = hidden;
    s.inter = inter;
    s.shared_kind = parse_shared(shared_kind);
    s.shared_inter = shared_inter;
    const size_t n = qweight.size(), shared = s.shared_kind == SharedExpertKind::None ? 0 : 3;
    TORCH_CHECK_VALUE(n >= 3 + shared && (n - shared) % 3 == 0, "wna16.pack: ", n,
                      " qweight tensors; expected 3 per expert (gate, up, down)",
                      shared ? " and 3 for the shared expert last" : "");
    TORCH_CHECK_VALUE(scales.size() == n && qzeros.size() == n && (g_idx.empty() || g_idx.size() == n),
                      "wna16.pack: ", n, " qweight, ", scales.size(), " scales, ", qzeros.size(), " qzeros and ",
                      g_idx.size(), " g_idx tensors; expected the same count (g_idx: or none)");
    s.routing.method = parse_routing(routing);
    s.routing.num_experts = int((n - shared) / 3);
    s.routing.top_k = int(top_k);
    s.routing.renormalize = renormalize;
    s.routing.n_group = int(n_group);
    s.routing.topk_group = int(topk_group);
    s.routing.routed_scaling_factor = routed_scaling_factor;
    s.validate();
    const int64_t E = s.routing.num_experts;

    MoeLayerWeights mw;
    w->has_router = router.has_value() && router->defined();
    if (w->has_router) {
      TORCH_CHECK_VALUE(router->dim() == 2 && router->size(0) == E && router->size(1) == hidden,
                        "wna16.pack: router has shape ", shape_str(*router), "; expected [", E, ", ", hidden, "]");
      mw.router = float_values(*router, "router");
    } else {
      mw.router.assign(size_t(E * hidden), 0.f);  // unused: moe() takes the caller's routing
    }
    if (correction_bias && correction_bias->defined()) mw.correction_bias = float_values(*correction_bias, "correction_bias");
    if (shared_gate && shared_gate->defined()) mw.shared_gate = float_values(*shared_gate, "shared_gate");
    w->scheme = q.describe();
    w->device = parse_device(device);
#ifdef WNA16_TORCH_CUDA
    if (w->device == Device::Cuda) {
      // The checkpoint tensors go to the GPU as they are (int32 words, scales in their own f16 /
      // bf16 / f32) and are packed there: no host copy of the weights.
      const at::Device gpu(at::kCUDA, static_cast<c10::DeviceIndex>(current_cuda_device()));
      std::vector<at::Tensor> keep;  // the GPU tensors the layer reads while it packs
      auto on_gpu = [&](const at::Tensor& t, at::ScalarType type) {
        keep.push_back(t.to(gpu, type).contiguous());
        return keep.back().data_ptr();
      };
      auto elements = [](const at::Tensor& t, const std::string& what, const char* name, int64_t rows, int64_t cols) {
        if (t.numel() != rows * cols)
          throw Error(what + ": " + name + " has " + std::to_string(t.numel()) + " elements, expected " +
                      std::to_string(rows * cols) + " ([" + std::to_string(rows) + ", " + std::to_string(cols) + "])");
      };
      auto linear = [&](int64_t i) {
        const int64_t e = i / 3, which = i % 3;
        const std::string what = (e < E ? "expert " + std::to_string(e) : std::string("shared expert")) + "." +
                                 (which == 0 ? "gate" : which == 1 ? "up" : "down");
        const at::Tensor &qw = qweight[size_t(i)], &sc = scales[size_t(i)], &qz = qzeros[size_t(i)];
        require_2d(qw, "qweight", i);
        require_2d(sc, "scales", i);
        require_2d(qz, "qzeros", i);
        require_int32(qw, "qweight", i);
        require_int32(qz, "qzeros", i);
        TORCH_CHECK_TYPE(at::isFloatingType(sc.scalar_type()), "wna16.pack: scales[", i, "] has dtype ",
                         sc.scalar_type(), "; expected float16, bfloat16 or float32");
        cuda::DeviceQuantizedLinear d;
        d.scheme = q;
        std::tie(d.K, d.N) = checkpoint_kn(q, qw);
        const int64_t width = e < E ? inter : shared_inter;
        const int64_t K = which == 2 ? width : hidden, N = which == 2 ? hidden : width;
        if (d.K != K || d.N != N)
          throw Error(what + " is [K=" + std::to_string(d.K) + ", N=" + std::to_string(d.N) + "], expected [K=" +
                      std::to_string(K) + ", N=" + std::to_string(N) + "]");
        try {
          q.validate(K, N);
        } catch (const Error& err) {
          throw Error(what + ": " + err.what());
        }
        const int64_t G = q.num_groups(K);
        elements(qz, what, "qzeros", G, q.format == Format::Awq ? N / 8 : N * q.bits / 32);
        elements(sc, what, "scales", G, N);
        d.qweight = static_cast<const int32_t*>(on_gpu(qw, at::kInt));
        d.qzeros = static_cast<const int32_t*>(on_gpu(qz, at::kInt));
        const at::ScalarType st = sc.scalar_type() == at::kHalf || sc.scalar_type() == at::kBFloat16
                                      ? sc.scalar_type() : at::kFloat;
        d.scales = on_gpu(sc, st);
        d.scales_dtype = st == at::kHalf ? DType::F16 : st == at::kBFloat16 ? DType::BF16 : DType::F32;
        if (!g_idx.empty() && g_idx[size_t(i)].defined() && g_idx[size_t(i)].numel() > 0) {
          const at::Tensor& gi = g_idx[size_t(i)];
          TORCH_CHECK_VALUE(gi.dim() == 1, "wna16.pack: g_idx[", i, "] has shape ", shape_str(gi), "; expected [K]");
          require_int32(gi, "g_idx", i);
          if (gi.numel() != K)
            throw Error(what + ": g_idx has " + std::to_string(gi.numel()) + " elements, expected K=" + std::to_string(K));
          d.g_idx = static_cast<const int32_t*>(on_gpu(gi, at::kInt));
        }
        return d;
      };
      cuda::DeviceMoeLayerWeights dw;
      dw.router = std::move(mw.router);
      dw.correction_bias = std::move(mw.correction_bias);
      dw.shared_gate = std::move(mw.shared_gate);
      for (int64_t e = 0; e < E; ++e) dw.experts.push_back({linear(3 * e), linear(3 * e + 1), linear(3 * e + 2)});
      if (shared) dw.shared = cuda::DeviceExpertWeights{linear(3 * E), linear(3 * E + 1), linear(3 * E + 2)};
      // The layer packs on the legacy default stream: first wait for the current stream, which wrote
      // or copied the tensors, by reading one element back (a synchronous copy on that stream).
      (void)keep.front().flatten().slice(0, 0, 1).cpu();
      w->cuda_device = current_cuda_device();
      w->cuda_layer = std::make_unique<cuda::CudaMoeLayer>(w->spec, dw);
      return w;
    }
#endif
    auto expert = [&](int64_t e) {
      return ExpertWeights{linear_from(q, qweight, scales, qzeros, g_idx, 3 * e),
                           linear_from(q, qweight, scales, qzeros, g_idx, 3 * e + 1),
                           linear_from(q, qweight, scales, qzeros, g_idx, 3 * e + 2)};
    };
    for (int64_t e = 0; e < E; ++e) mw.experts.push_back(expert(e));
    if (shared) mw.shared = expert(E);
    build_layer(*w, mw);
  } catch (const Error& e) {
    TORCH_CHECK_VALUE(false, "wna16.pack: ", e.what());
  }
  return w;
}

MoeWeightsPtr load_checkpoint_layer(std::string path, int64_t layer, std::string device) {
  auto w = c10::make_intrusive<MoeWeights>();
  try {
    const Checkpoint ck = Checkpoint::open(path);
    w->spec = ck.config().layer_spec(layer);
    const MoeLayerWeights mw = ck.load_layer(layer);
    w->scheme = mw.experts.empty() ? std::string() : mw.experts[0].gate.scheme.describe();
    w->device = parse_device(device);
    build_layer(*w, mw);
  } catch (const Error& e) {
    TORCH_CHECK_VALUE(false, "wna16.load_checkpoint_layer: ", e.what());
  }
  return w;
}

double tolerance(at::ScalarType dtype) {
  TORCH_CHECK_TYPE(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat, "wna16.layer_tolerance: ",
                   dtype, " is not an activation dtype (bfloat16, float16 or float32)");
  return layer_tolerance(dtype == at::kHalf ? DType::F16 : DType::BF16);  // F32 is computed in BF16
}

// ---- Meta kernels: shape and dtype only (torch < 2.4) -------------------------------------------
#if WNA16_CPP_META

at::Tensor moe_meta(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts, MoeWeightsPtr w) {
  check_moe_args(x, &ids, &wts, *w, "wna16.moe");
  return at::empty_like(x, at::MemoryFormat::Contiguous);
}

void moe_out_meta(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts, MoeWeightsPtr w,
                  at::Tensor& out) {
  check_moe_args(x, &ids, &wts, *w, "wna16.moe_out");
  check_out(x, out, "wna16.moe_out");
}

at::Tensor moe_layer_meta(const at::Tensor& x, MoeWeightsPtr w) {
  check_moe_args(x, nullptr, nullptr, *w, "wna16.moe_layer");
  return at::empty_like(x, at::MemoryFormat::Contiguous);
}
#endif

}  // namespace

TORCH_LIBRARY(wna16, m) {
  m.class_<MoeWeights>("MoeWeights")
      .def("describe", [](const MoeWeightsPtr& self) { return self->describe(); })
      .def("__repr__", [](const MoeWeightsPtr& self) { return self->describe(); })
      .def("hidden", [](const MoeWeightsPtr& self) { return self->spec.hidden; })
      .def("inter", [](const MoeWeightsPtr& self) { return self->spec.inter; })
      .def("num_experts", [](const MoeWeightsPtr& self) { return int64_t(self->spec.routing.num_experts); })
      .def("top_k", [](const MoeWeightsPtr& self) { return int64_t(self->spec.routing.top_k); })
      .def("has_router", [](const MoeWeightsPtr& self) { return self->has_router; })
      .def("device", [](const MoeWeightsPtr& self) { return std::string(device_name(self->device)); })
      // Batch invariance (CudaMoeLayer::set_batch_invariant): each token's output bits independent of
      // the other tokens of the call, for every op on these weights from then on. The CPU backend
      // always is; on CUDA it costs speed (docs/perf.md). Every call is run-to-run deterministic.
      .def("set_batch_invariant",
           [](const MoeWeightsPtr& self, bool on) {
             self->batch_invariant = on;
#ifdef WNA16_TORCH_CUDA
             if (self->cuda_layer) self->cuda_layer->set_batch_invariant(on);
#endif
           })
      .def("batch_invariant", [](const MoeWeightsPtr& self) { return self->batch_invariant; })
      // torch.compile: Dynamo guards a traced graph on the object's flattened state and traces the
      // ops with a fake object built from it (python/wna16/_fake.py: FakeMoeWeights).
      .def("__obj_flatten__",
           [](const MoeWeightsPtr& self) {
             return std::make_tuple(std::make_tuple(std::string("describe"), self->describe()),
                                    std::make_tuple(std::string("hidden"), int64_t(self->spec.hidden)),
                                    std::make_tuple(std::string("inter"), int64_t(self->spec.inter)),
                                    std::make_tuple(std::string("num_experts"), int64_t(self->spec.routing.num_experts)),
                                    std::make_tuple(std::string("top_k"), int64_t(self->spec.routing.top_k)),
                                    std::make_tuple(std::string("has_router"), self->has_router),
                                    std::make_tuple(std::string("device"), std::string(device_name(self->device))));
           })
      // Identity: the fake-tensor dispatch cache keys an op call on its arguments, this object
      // among them, and compares keys with ==.
      .def("__eq__", [](const MoeWeightsPtr& self, const MoeWeightsPtr& other) { return self.get() == other.get(); })
      // Not serialisable (packed device buffers): a TypeError, which torch.compile's code generation
      // (its benchmark harness pickles graph inputs) and copy.deepcopy handle as "cannot pickle".
      .def_pickle(
          [](const MoeWeightsPtr& self) -> std::string {
            TORCH_CHECK_TYPE(false, "wna16 MoeWeights (", self->describe(),
                             ") cannot be pickled or copied: pack the checkpoint's tensors again");
          },
          [](std::string) -> MoeWeightsPtr {
            TORCH_CHECK_TYPE(false, "wna16 MoeWeights cannot be unpickled: pack the checkpoint's tensors again");
          });

  m.def(
      "pack(Tensor[] qweight, Tensor[] scales, Tensor[] qzeros, Tensor[] g_idx, str format, int bits, "
      "int group_size, bool sym, bool desc_act, int hidden, int inter, int top_k, Tensor? router=None, "
      "str routing=\"softmax_topk\", bool renormalize=True, int n_group=1, int topk_group=1, "
      "float routed_scaling_factor=1.0, Tensor? correction_bias=None, str shared_kind=\"none\", "
      "int shared_inter=0, Tensor? shared_gate=None, str device=\"cpu\") -> __torch__.torch.classes.wna16.MoeWeights",
      &pack);
  m.def(
      "load_checkpoint_layer(str path, int layer, str device=\"cpu\") -> __torch__.torch.classes.wna16.MoeWeights",
      &load_checkpoint_layer);
  m.def("layer_tolerance(ScalarType dtype) -> float", &tolerance);

  m.def("moe(Tensor x, Tensor topk_ids, Tensor topk_weights, __torch__.torch.classes.wna16.MoeWeights weights) -> Tensor");
  m.def(
      "moe_out(Tensor x, Tensor topk_ids, Tensor topk_weights, __torch__.torch.classes.wna16.MoeWeights weights, *, "
      "Tensor(a!) out) -> ()");
  m.def("moe_layer(Tensor x, __torch__.torch.classes.wna16.MoeWeights weights) -> Tensor");
}

#if WNA16_CPP_META
TORCH_LIBRARY_IMPL(wna16, Meta, m) {
  m.impl("moe", &moe_meta);
  m.impl("moe_out", &moe_out_meta);
  m.impl("moe_layer", &moe_layer_meta);
}
#endif

// Inference ops without a backward: torch 1.13 has no autograd fallthrough for Meta (it has for CPU
// and CUDA), so the Meta kernels are reached through an explicit one.
TORCH_LIBRARY_IMPL(wna16, AutogradMeta, m) {
  m.impl("moe", torch::CppFunction::makeFallthrough());
  m.impl("moe_out", torch::CppFunction::makeFallthrough());
  m.impl("moe_layer", torch::CppFunction::makeFallthrough());
}

}  // namespace wna16::torch_ext
