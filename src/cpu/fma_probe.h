// The benchmark's compute-ceiling probe (kernels.h: FmaLoopFn), one body for every SIMD build.
// NOTE: include it inside a kernel file's target region (after its push), so that the template is
// compiled for that file's ISA; Ops is a struct of that file's intrinsics.
#pragma once
#include <cstdint>
#include <cstring>

namespace wna16::cpu {
namespace {

// Independent FMA chains: latency 4-5 cycles x 2 FMA ports needs at least 10 in flight.
constexpr int kFmaChains = 12;

// Ops: the vector type V of fp32 lanes, set1(float), fma(a, b, c) = a * b + c, add(a, b).
template <class Ops>
double fma_probe(int64_t iters) {
  using V = typename Ops::V;
  V acc[kFmaChains];
  for (int i = 0; i < kFmaChains; ++i) acc[i] = Ops::set1(1.f + 1e-3f * float(i));
  const V a = Ops::set1(0.999999f), b = Ops::set1(1e-7f);
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < kFmaChains; ++i) acc[i] = Ops::fma(acc[i], a, b);
  V s = acc[0];
  for (int i = 1; i < kFmaChains; ++i) s = Ops::add(s, acc[i]);
  float first;
  std::memcpy(&first, &s, sizeof first);
  volatile float sink = first;  // keeps the loop alive
  (void)sink;
  return 2.0 * double(sizeof(V) / sizeof(float)) * kFmaChains * double(iters);
}

}  // namespace
}  // namespace wna16::cpu
