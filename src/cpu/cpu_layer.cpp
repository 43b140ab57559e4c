// make_cpu_layer: the CPU backend entry point.
// NOTE: interim: forwards to the scalar baseline until the SIMD backend lands.
#include "cpu/scalar_baseline.h"
#include "wna16/backend.h"

namespace wna16 {

std::unique_ptr<MoeBackendLayer> make_cpu_layer(const MoeLayerSpec& spec, const MoeLayerWeights& w) {
  return cpu::make_scalar_baseline(spec, w);
}

}  // namespace wna16
