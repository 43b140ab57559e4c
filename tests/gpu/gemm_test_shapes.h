// Host-side GEMM shapes and config lookups shared by the MoE GEMM tests (moe_gemm_test.cpp,
// moe_gemm_host_test.cpp).
#pragma once
#ifdef WNA16_HAVE_CUDA
#include <cstdint>
#include <string>

#include "cuda/dispatch.h"
#include "cuda/moe_gemm.h"

namespace wna16::cuda {

// Host-side only (runs without a GPU too): no CUDA call happens before the refusal.
// A valid 2-expert int4 GEMM shape whose pointers are a host dummy: for the host-only tests of
// launch_moe_gemm's checks, which must throw before anything is launched.
inline DeviceGemm tiny_host_gemm(const int* dummy) {
  DeviceGemm d;
  d.bits = 4;
  d.E = 2;
  d.K = 64;
  d.N = 128;
  d.NT = 8;
  d.group_len = 64;
  d.G = 1;
  d.qweight = dummy;
  d.scales = reinterpret_cast<const uint32_t*>(dummy);
  return d;
}
// A host-only GEMM of the given shape (N = NT * 16, groups of `group` along K) for the launcher's
// predicates and refusals: its pointers are never dereferenced.
inline DeviceGemm host_gemm_shape(const int* dummy, int bits, int64_t E, int64_t K, int64_t N, int64_t group) {
  DeviceGemm d = tiny_host_gemm(dummy);
  d.bits = bits, d.E = E, d.K = K, d.N = N, d.NT = N / 16, d.group_len = group, d.G = K / group;
  return d;
}

inline int config_named(const char* name) {
  for (int c = 0; c < gemm_config_count(); ++c)
    if (std::string(gemm_config_name(c)) == name) return c;
  return -1;
}

}  // namespace wna16::cuda
#endif
