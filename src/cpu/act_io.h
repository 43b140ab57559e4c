// Activation I/O shared by the CPU backend and its scalar baseline: host buffers of bf16, f16 or
// f32 to float (bf16 semantics for f32 input, as backend.h promises) and back.
#pragma once
#include <cstdint>
#include <cstring>

#include "wna16/error.h"
#include "wna16/half.h"

namespace wna16::cpu {

// The dtype the layer computes in: F32 input is rounded to BF16 and computed as BF16.
inline DType compute_dtype(DType io) { return io == DType::F32 ? DType::BF16 : io; }

// Element i of a host activation buffer as a float already rounded to the compute dtype.
inline float load_act(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::BF16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::F16: return f16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::F32: return round_to(DType::BF16, static_cast<const float*>(p)[i]);
  }
  return 0.f;
}

// Stores v into element i of an output buffer of dtype t (rounded to nearest even for 16-bit).
inline void store_act(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::BF16: static_cast<uint16_t*>(p)[i] = float_to_bf16(v); break;
    case DType::F16: static_cast<uint16_t*>(p)[i] = float_to_f16(v); break;
    case DType::F32: static_cast<float*>(p)[i] = v; break;
  }
}

inline void check_forward_args(const void* x, const void* out, int64_t M, const char* who) {
  if (M < 0) throw Error(std::string(who) + ": M=" + std::to_string(M) + " is negative");
  if (M > 0 && (!x || !out)) throw Error(std::string(who) + ": null x or out for M=" + std::to_string(M));
}

}  // namespace wna16::cpu
