// Uses an installed wna16 through its public headers only: the "small" preset with random int4
// GPTQ weights, one forward of 4 bf16 tokens on the CPU backend (and on CUDA when a GPU is there),
// compared with the float64 reference. Prints PASSED or FAILED; exits non-zero on failure.
#include <cstdio>
#include <random>
#include <vector>

#include "wna16/backend.h"
#include "wna16/half.h"
#include "wna16/moe.h"
#include "wna16/reference.h"

int main() {
  using namespace wna16;
  const MoeLayerSpec spec = preset("small");
  const MoeLayerWeights w = random_layer(spec, QuantScheme{}, 42);  // int4 gptq g128 sym
  const int64_t M = 4, n = M * spec.hidden;
  const size_t size = static_cast<size_t>(n);
  std::vector<uint16_t> x(size), out(size);
  std::vector<float> xf(size), got(size);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (size_t i = 0; i < x.size(); ++i) xf[i] = bf16_to_float(x[i] = float_to_bf16(normal(rng)));
  const std::vector<double> ref = moe_reference(spec, w, xf.data(), M);

  bool ok = true;
  for (Device d : {Device::Cpu, Device::Cuda}) {
    if (d == Device::Cuda && !cuda_available()) continue;
    make_layer(d, spec, w)->forward_host(x.data(), out.data(), M, DType::BF16);
    for (size_t i = 0; i < out.size(); ++i) got[i] = bf16_to_float(out[i]);
    const double err = rel_error(got.data(), ref.data(), n), tol = layer_tolerance(DType::BF16);
    ok = ok && err <= tol;
    std::printf("%s %s M=%lld: rel error %.2e, tolerance %.1e\n", device_name(d), spec.name.c_str(),
                static_cast<long long>(M), err, tol);
  }
  std::printf("%s\n", ok ? "PASSED" : "FAILED");
  return ok ? 0 : 1;
}
