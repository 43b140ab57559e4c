// Helpers of the CPU backend tests: fresh random activations, poisoned outputs, and the comparison
// of a backend forward with the float64 reference.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/isa.h"
#include "wna16/backend.h"
#include "wna16/half.h"
#include "wna16/reference.h"

namespace wna16::cpu_test {

// The ISA builds this machine can run (every test covers each of them); the first call prints the
// ones it cannot, so a log shows which paths were not exercised.
inline std::vector<cpu::Isa> isas_under_test() {
  static const bool printed = [] {
    for (cpu::Isa isa : {cpu::Isa::Scalar, cpu::Isa::Avx2, cpu::Isa::Avx512Vnni})
      if (!cpu::isa_supported(isa)) std::printf("[  SKIPPED ] CPU ISA %s: not supported by this CPU\n", cpu::isa_name(isa));
    return true;
  }();
  (void)printed;
  return cpu::supported_isas();
}

// N(0, 1) activations rounded to `act`: raw bytes of dtype act, and the float values.
struct Activations {
  std::vector<uint16_t> bits;
  std::vector<float> values;
};

inline Activations random_activations(int64_t n, DType act, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  Activations a;
  a.bits.resize(size_t(n));
  a.values.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    const float v = nd(rng);
    a.bits[size_t(i)] = act == DType::BF16 ? float_to_bf16(v) : float_to_f16(v);
    a.values[size_t(i)] = act == DType::BF16 ? bf16_to_float(a.bits[size_t(i)]) : f16_to_float(a.bits[size_t(i)]);
  }
  return a;
}

inline std::vector<float> to_float(const std::vector<uint16_t>& bits, DType act) {
  std::vector<float> f(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) f[i] = act == DType::BF16 ? bf16_to_float(bits[i]) : f16_to_float(bits[i]);
  return f;
}

// Runs layer on x (poisoning the output with NaN first) and returns the relative Frobenius error
// against moe_reference.
inline double error_vs_reference(MoeBackendLayer& layer, const MoeLayerSpec& spec, const MoeLayerWeights& w,
                                 const Activations& x, int64_t M, DType act) {
  std::vector<uint16_t> out(static_cast<size_t>(M * spec.hidden), 0xFFFF);  // NaN in bf16 and f16
  layer.forward_host(x.bits.data(), out.data(), M, act);
  const std::vector<double> ref = moe_reference(spec, w, x.values.data(), M);
  const std::vector<float> got = to_float(out, act);
  return rel_error(got.data(), ref.data(), M * spec.hidden);
}

}  // namespace wna16::cpu_test
