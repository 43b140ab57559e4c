// In a build without CUDA the GPU suite still reports, as one skipped test with a reason.
#include "gpu/gpu_test_util.h"

#ifndef WNA16_HAVE_CUDA
TEST(Gpu, SkippedWithoutCudaBuild) {
  GTEST_SKIP() << "this build has no CUDA backend (nvcc not found at configure time): GPU tests skipped";
}
#endif
