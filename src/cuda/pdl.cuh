// Programmatic dependent launch (PDL): a kernel launched with programmatic stream serialization
// may start while the grid before it still runs; pdl_wait() blocks until that grid has completed
// and its memory is visible, pdl_launch_dependents() lets the next grid start early. The PTX exists
// from sm_90; below it (the portable path) both are no-ops, and the launcher does not ask for PDL,
// so kernels start in stream order and the wait has nothing to wait for.
#pragma once

namespace wna16::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace wna16::cuda
