// The SIMD CPU backend's layer class (private: the public entry is make_cpu_layer in backend.h).
// Exposed to the tests and the benchmark, which pick the ISA and read per-call statistics.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "cpu/packed_linear.h"
#include "wna16/backend.h"

namespace wna16::cpu {

struct PackedExpert {
  PackedLinear gate, up, down;
};

// What the last forward touched (for the benchmark's bandwidth accounting).
struct ForwardStats {
  int64_t active_experts = 0;  // routed experts that received at least one token (summed over chunks)
  int64_t weight_bytes = 0;    // checkpoint-form bytes of their weights + the shared expert + router
};

class CpuMoeLayer final : public MoeBackendLayer {
 public:
  CpuMoeLayer(const MoeLayerSpec& spec, const MoeLayerWeights& w, Isa isa);
  Device device() const override { return Device::Cpu; }
  void forward_host(const void* x, void* out, int64_t M, DType dtype) override;
  void forward_routed_host(const void* x, const int32_t* topk_ids, const float* topk_weights, int top_k, void* out,
                           int64_t M, DType dtype) override;
  // forward_routed_host with the output kept in float (out [M, H] F32) while x stays in `dtype`:
  // the weighted sums before their rounding, for callers that add partial outputs (the sharded
  // layer of src/parallel adds them across ranks and rounds once).
  void forward_routed_f32(const void* x, const int32_t* topk_ids, const float* topk_weights, int top_k, float* out,
                          int64_t M, DType dtype);

  Isa isa() const { return kernels_->isa; }
  const ForwardStats& last_stats() const { return stats_; }
  // Bytes of one expert's weights in checkpoint form (codes + f16 scales + zeros if asymmetric).
  int64_t expert_bytes(int64_t e) const;
  int64_t shared_bytes() const;

 private:
  struct Entry;  // one expert with tokens in the current chunk
  // out_dtype: dtype, or F32 for forward_routed_f32.
  void forward(const void* x, void* out, int64_t M, DType dtype, DType out_dtype, const int32_t* ids,
               const float* wts, int k);
  void forward_chunk(const void* x, void* out, int64_t M, DType dtype, DType out_dtype, const int32_t* ids,
                     const float* wts, int k);

  MoeLayerSpec spec_;
  const Kernels* kernels_;
  std::vector<float> router_, correction_bias_, shared_gate_;
  std::vector<PackedExpert> experts_;  // E routed, then the shared one if any
  bool shared_x_order_ = true;         // every gate/up has the kernel K order of experts_[0].gate
  int64_t max_inter_ = 0;

  std::mutex mu_;  // forward_host is serialised per layer (scratch below)
  ForwardStats stats_;
  std::vector<float> xf_, logits_, shared_g_, hbuf_, ybuf_, tmp_;
  std::vector<uint8_t> xprep_, hprep_;
};

std::unique_ptr<CpuMoeLayer> make_cpu_layer_isa(const MoeLayerSpec& spec, const MoeLayerWeights& w, Isa isa);

}  // namespace wna16::cpu
