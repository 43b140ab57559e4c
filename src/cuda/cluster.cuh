// Thread-block clusters where the GPU has them (sm_90 and newer), a cluster of one CTA below: the
// kernels that split work over a cluster (the router's H split, the align kernel) take this view,
// and their launchers ask for clusters only where the device has them (cluster_launch_ok), so the
// same kernel source builds and runs on sm_80 and sm_89 as a single CTA per cluster.
#pragma once
#include <cooperative_groups.h>

namespace wna16::cuda {

struct ClusterView {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cooperative_groups::cluster_group g = cooperative_groups::this_cluster();
  __device__ int size() const { return static_cast<int>(g.num_blocks()); }
  __device__ int rank() const { return static_cast<int>(g.block_rank()); }
  __device__ void sync() const { g.sync(); }
  // p in CTA r's shared memory.
  template <class T>
  __device__ T* map(T* p, int r) const { return g.map_shared_rank(p, r); }
  // Split barrier: arrive (relaxed: orders nothing by itself), then wait.
  __device__ void arrive_relaxed() const { asm volatile("barrier.cluster.arrive.relaxed;\n" ::: "memory"); }
  __device__ void wait() const { asm volatile("barrier.cluster.wait;\n" ::: "memory"); }
#else
  __device__ int size() const { return 1; }
  __device__ int rank() const { return 0; }
  __device__ void sync() const { __syncthreads(); }
  template <class T>
  __device__ T* map(T* p, int) const { return p; }
  __device__ void arrive_relaxed() const {}
  __device__ void wait() const { __syncthreads(); }
#endif
};

}  // namespace wna16::cuda
