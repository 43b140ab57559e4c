// Micro-benchmark of launch_align for the benchmark driver and the GPU tests.
#pragma once
#include <cstdint>

#include "cuda/align_tuning.h"

namespace wna16::cuda {

// Microseconds per launch_align call on the current device: uniform random expert ids (fixed seed)
// over num_slots slots, warm-up, then a CUDA graph of back-to-back launches replayed many times,
// timed with CUDA events; the median replay divided by the launches in it. The ids stay in L2, as
// they do in the layer (routing writes them just before). Allocates and frees its own buffers.
double bench_align_us(int E, int64_t num_slots, int block_m);
// The same with a given tuning of the kernel (src/cuda/align_tuning.h).
double bench_align_us(int E, int64_t num_slots, int block_m, const AlignTuning& tuning);
// The same timing of an empty kernel of the align kernel's shape: the launch floor.
double bench_align_noop_us(int n_cta, bool cluster);

}  // namespace wna16::cuda
