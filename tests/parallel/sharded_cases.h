// The sharded layer's test cases, shared by the CPU tests (tests/parallel) and the CUDA ones
// (tests/gpu): small shapes with every routing method, every format, the plans, and one check
// against the float64 reference and the unsharded layer of the same backend.
#pragma once
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/cpu_test_util.h"
#include "wna16/backend.h"
#include "wna16/error.h"
#include "wna16/parallel.h"

namespace wna16::sharded_test {

using cpu_test::random_activations;
using cpu_test::to_float;

struct Variant {
  const char* name;
  MoeLayerSpec spec;
};

// Small shapes with every routing method; I = 128 and the shared widths split into whole groups of
// 32 for tp up to 4, E = 8 for ep up to 4.
inline std::vector<Variant> variants() {
  auto make = [](const char* name, RoutingMethod m, int k, bool renorm, SharedExpertKind shared) {
    MoeLayerSpec s;
    s.name = name;
    s.hidden = 128;
    s.inter = 128;
    s.routing.method = m;
    s.routing.num_experts = 8;
    s.routing.top_k = k;
    s.routing.renormalize = renorm;
    s.shared_kind = shared;
    s.shared_inter = shared == SharedExpertKind::None ? 0 : 256;
    return Variant{name, s};
  };
  std::vector<Variant> v;
  v.push_back(make("softmax renorm, gated shared (Qwen2-MoE)", RoutingMethod::SoftmaxTopK, 2, true,
                   SharedExpertKind::SigmoidGated));
  v.push_back(make("softmax no renorm (Qwen1.5-MoE)", RoutingMethod::SoftmaxTopK, 4, false, SharedExpertKind::SigmoidGated));
  v.push_back(make("softmax, no shared (Mixtral, Qwen3)", RoutingMethod::SoftmaxTopK, 2, true, SharedExpertKind::None));
  Variant v2 = make("group-limited greedy, plain shared (DeepSeek-V2)", RoutingMethod::GroupLimitedGreedy, 3, false,
                    SharedExpertKind::Plain);
  v2.spec.routing.n_group = 4;
  v2.spec.routing.topk_group = 2;
  v2.spec.routing.routed_scaling_factor = 1.5;
  v.push_back(v2);
  Variant v3 = make("noaux_tc, plain shared (DeepSeek-V3)", RoutingMethod::NoauxTc, 3, true, SharedExpertKind::Plain);
  v3.spec.routing.n_group = 4;
  v3.spec.routing.topk_group = 2;
  v3.spec.routing.routed_scaling_factor = 2.5;
  v.push_back(v3);
  return v;
}

inline std::vector<QuantScheme> formats() {
  return {{Format::GptqV1, 4, 32, true, false},  {Format::GptqV1, 4, 32, true, true},  {Format::GptqV1, 8, 32, false, false},
          {Format::GptqV2, 4, 32, false, true},  {Format::GptqV2, 8, -1, true, false}, {Format::Awq, 4, 32, false, false}};
}

inline const std::vector<ParallelPlan> kPlans = {{2, 1}, {1, 2}, {2, 2}, {4, 1}, {1, 4}, {1, 1}};

// Sharded vs unsharded: the same weights and inputs, the sums in another order. Far below the
// reference tolerance (a wrong slice, group or routing weight gives 1e-2 and more). On CUDA each
// rank's expert rows are rounded to the activation dtype before the tp ranks' partials are added
// (one rounding more than the unsharded layer's per-slot rows): twice the bound.
inline double reassociation_bound(DType act, Device d = Device::Cpu) {
  return (act == DType::BF16 ? 4e-3 : 1e-3) * (d == Device::Cuda ? 2 : 1);
}

// One rank matches the unsharded layer bit for bit (on CUDA it is the device-resident rank: the
// same kernels, the fp32 sum rounded once).
inline void check(Device device, const Variant& v, const QuantScheme& q, const ParallelPlan& plan, DType act, bool routed,
                  uint64_t seed, CommKind comm = CommKind::InProcess) {
  const MoeLayerSpec& spec = v.spec;
  const std::string what = std::string(device_name(device)) + ", " + v.name + ", " + q.describe() + ", " +
                           plan.describe() + ", " + dtype_name(act) + (routed ? ", caller routing" : "") + ", " +
                           comm_kind_name(comm);
  const MoeLayerWeights w = random_layer(spec, q, seed);
  auto sharded = make_threaded_sharded_layer(device, plan, spec, w, comm);
  auto plain = make_layer(device, spec, w);
  for (int64_t M : {1, 5, 33}) {
    const int64_t n = M * spec.hidden;
    const auto x = random_activations(n, act, seed + uint64_t(M));
    std::vector<uint16_t> got(static_cast<size_t>(n), 0xFFFF), want(static_cast<size_t>(n), 0xFFFF);
    std::vector<double> ref;
    if (routed) {
      // Any expert, repeats allowed, negative weights too: the routed path must not assume softmax.
      // top_k 3 (the CPU takes any); the layer's on CUDA (the unsharded CUDA layer takes only it).
      const int k = device == Device::Cpu ? 3 : spec.routing.top_k;
      std::mt19937_64 rng(seed + 7);
      Routing r;
      r.M = M;
      r.top_k = k;
      for (int64_t i = 0; i < M * k; ++i) {
        r.ids.push_back(int32_t(rng() % uint64_t(spec.routing.num_experts)));
        r.weights.push_back(float(int(rng() % 200) - 50) / 100.f);
      }
      sharded->forward_routed_host(x.bits.data(), r.ids.data(), r.weights.data(), k, got.data(), M, act);
      plain->forward_routed_host(x.bits.data(), r.ids.data(), r.weights.data(), k, want.data(), M, act);
      ref = moe_reference_routed(spec, w, x.values.data(), M, r);
    } else {
      sharded->forward_host(x.bits.data(), got.data(), M, act);
      plain->forward_host(x.bits.data(), want.data(), M, act);
      ref = moe_reference(spec, w, x.values.data(), M);
    }
    const std::vector<float> g = to_float(got, act), u = to_float(want, act);
    EXPECT_LE(rel_error(g.data(), ref.data(), n), layer_tolerance(act)) << what << ", M=" << M;
    if (plan.world() == 1) {
      EXPECT_EQ(got, want) << what << ", M=" << M << ": one rank must match the unsharded layer bit for bit";
    } else {
      std::vector<double> ud(u.begin(), u.end());
      EXPECT_LE(rel_error(g.data(), ud.data(), n), reassociation_bound(act, device)) << what << ", M=" << M;
    }
  }
}

}  // namespace wna16::sharded_test
