// The device packer's kernels: one thread per work item of device_pack_kernels.h, grid-stride.
// Load-time only and far from any roofline (a DeepSeek-V3 layer is ~6 GB in, ~6 GB out), so plain
// and simple: one item writes one lane's 16-byte group(s) or one scale/zero word.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/cuda_check.h"
#include "cuda/device_pack.h"
#include "cuda/device_pack_kernels.h"

namespace wna16::cuda {
namespace {

using namespace devpack;

enum PackOp { kOpQweight1, kOpQweight2, kOpMeta1, kOpMeta2 };
constexpr int kThreads = 256;

template <int Op>
__global__ void __launch_bounds__(kThreads) pack_items_kernel(const PackBatch b, int64_t count) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t it = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; it < count; it += stride) {
    if constexpr (Op == kOpQweight1) pack_qweight1(b, it);
    else if constexpr (Op == kOpQweight2) pack_qweight2(b, it);
    else if constexpr (Op == kOpMeta1) pack_meta1(b, it);
    else pack_meta2(b, it);
  }
}

// Keeps the smallest key: the first offending element in the order error_key defines.
__global__ void __launch_bounds__(kThreads) check_items_kernel(const CheckBatch c, int64_t count,
                                                               unsigned long long* err) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  unsigned long long best = kNoError;
  for (int64_t it = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; it < count; it += stride) {
    const unsigned long long k = check_item(c, it);
    best = k < best ? k : best;
  }
  if (best != kNoError) atomicMin(err, best);
}

// Enough blocks to fill the device a few times over; the loops stride over the rest.
unsigned grid_for(int64_t count, int sms) {
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  return unsigned(std::clamp<int64_t>(blocks, 1, int64_t(sms) * 16));
}

template <int Op>
void launch_op(const PackBatch& b, int64_t count, int sms, cudaStream_t st) {
  if (count <= 0) return;
  pack_items_kernel<Op><<<grid_for(count, sms), kThreads, 0, st>>>(b, count);
  WNA16_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_device_pack(const PackBatch& b, const CheckBatch& c, unsigned long long* err, cudaStream_t st) {
  int dev = 0, sms = 0;
  WNA16_CUDA_CHECK(cudaGetDevice(&dev));
  WNA16_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int64_t checks = check_items(c);
  if (checks > 0) {
    check_items_kernel<<<grid_for(checks, sms), kThreads, 0, st>>>(c, checks, err);
    WNA16_CUDA_CHECK_LAUNCH();
  }
  launch_op<kOpQweight1>(b, qweight1_items(b), sms, st);
  launch_op<kOpQweight2>(b, qweight2_items(b), sms, st);
  launch_op<kOpMeta1>(b, meta1_items(b), sms, st);
  launch_op<kOpMeta2>(b, meta2_items(b), sms, st);
}

}  // namespace wna16::cuda
