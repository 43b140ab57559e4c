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
// Timed replays of the graph, the median of which is taken (the GPU tests take 1 under a sanitizer,
// where timings mean nothing and every launch is slow).
constexpr int kAlignBenchReplays = 25;
// The same with a given tuning of the kernel (src/cuda/align_tuning.h); replays >= 1.
double bench_align_us(int E, int64_t num_slots, int block_m, const AlignTuning& tuning,
                      int replays = kAlignBenchReplays);
// The same timing of an empty kernel of the align kernel's shape: the launch floor.
double bench_align_noop_us(int n_cta, bool cluster, int replays = kAlignBenchReplays);

}  // namespace wna16::cuda
