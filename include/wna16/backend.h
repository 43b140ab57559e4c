// A loaded MoE layer on a backend (CPU or CUDA), behind one interface, so the CLI, the checkpoint
// runner and the tests drive every backend the same way.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "wna16/error.h"
#include "wna16/half.h"
#include "wna16/moe.h"

namespace wna16 {

enum class Device { Cpu, Cuda };
const char* device_name(Device d);
Device parse_device(const std::string& s);  // "cpu" | "cuda"; throws Error naming s

// True when this build has CUDA and a usable GPU (compute capability 8.0 or newer) is present (never
// throws).
bool cuda_available();
// The CLI default: cuda when cuda_available(), else cpu.
Device default_device();
// The CUDA layers' kernel path: "hopper" (sm_90 with this build's sm_90a image) or "portable" (the
// mma.sync kernels without clusters or dependent launches, every GPU from sm_80). The GPU decides;
// use_cuda_portable_path(true) runs the portable path on a Hopper GPU too (testing it there). Set
// it before building CUDA layers. Without a CUDA build or a usable GPU: "none"; forcing the portable
// path without a CUDA build throws Error.
void use_cuda_portable_path(bool on);
const char* cuda_path_name();
// The usable GPUs (0 without a CUDA build or GPU), and the calling thread's GPU: CUDA layers are
// built and run on the thread's current GPU. set_cuda_device throws Error naming an ordinal
// outside [0, cuda_device_count()).
int cuda_device_count();
void set_cuda_device(int ordinal);

class MoeBackendLayer {
 public:
  virtual ~MoeBackendLayer() = default;
  virtual Device device() const = 0;
  // x: host [M, H] of `dtype` (F16 or BF16; F32 is accepted and rounded to BF16 by the CPU
  // backend), out: host [M, H] of the same dtype. Synchronous convenience path.
  virtual void forward_host(const void* x, void* out, int64_t M, DType dtype) = 0;
  // Batch invariance (CudaMoeLayer::set_batch_invariant): a token's output bits independent of the
  // other tokens of its call. The CPU backend always is (its order of additions per token never
  // depends on M): there it changes nothing.
  virtual void set_batch_invariant(bool) {}
  // The layer without its router, for callers that route themselves (an inference engine):
  // out[m] = sum_j topk_weights[m, j] * expert_{topk_ids[m, j]}(x[m]) (+ the shared expert, as in
  // forward_host). topk_ids / topk_weights: host [M, top_k], 1 <= top_k <= E (not necessarily the
  // spec's top_k), checked with check_routing (reference.h). x, out, dtype as in forward_host.
  // The CPU backend implements it; the default throws Error naming the device. Inline on purpose:
  // every virtual of this class is inline or pure, so backends in other libraries (wna16_cuda)
  // need nothing from the dispatch library (which links them) to link.
  virtual void forward_routed_host(const void*, const int32_t*, const float*, int, void*, int64_t, DType) {
    throw Error(std::string("forward_routed_host (caller-owned routing) is not implemented by the ") +
                (device() == Device::Cpu ? "cpu" : "cuda") + " backend yet");
  }
};

// Repacks the weights once (act-order permutation applied here, never per call).
// Throws Error for anything the backend does not support, naming the value.
std::unique_ptr<MoeBackendLayer> make_cpu_layer(const MoeLayerSpec& spec, const MoeLayerWeights& w);
// Throws Error when the build has no CUDA or no GPU is present.
std::unique_ptr<MoeBackendLayer> make_cuda_layer(const MoeLayerSpec& spec, const MoeLayerWeights& w);
std::unique_ptr<MoeBackendLayer> make_layer(Device d, const MoeLayerSpec& spec, const MoeLayerWeights& w);

// Relative Frobenius error allowed against the float64 reference for a backend computing with
// `act` activations (the intermediate silu(gate)*up is rounded to `act` between the two GEMMs).
// The one place tolerances live.
double layer_tolerance(DType act);

}  // namespace wna16
