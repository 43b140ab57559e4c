// The plain baseline the CPU backend is measured against in `wna16 bench`: one thread, scalar
// dequantisation inside straightforward loops, one expert after another. Also a second, independent
// implementation the tests can compare the fast backend with.
#pragma once
#include <memory>

#include "wna16/backend.h"

namespace wna16::cpu {

std::unique_ptr<MoeBackendLayer> make_scalar_baseline(const MoeLayerSpec& spec, const MoeLayerWeights& w);

}  // namespace wna16::cpu
