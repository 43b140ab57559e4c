// Helpers shared by the test folders (every test executable has tests/ on its include path).
#pragma once
#include <string>

#include "wna16/error.h"
#include "wna16/moe.h"
#include "wna16/quant.h"

namespace wna16::test {

// The message of the wna16::Error that f() throws, or "<no error>" when it throws none.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

inline QuantScheme scheme(Format f, int bits, int g, bool sym, bool act_order = false) {
  QuantScheme s;
  s.format = f;
  s.bits = bits;
  s.group_size = g;
  s.sym = sym;
  s.act_order = act_order;
  return s;
}

inline RoutingConfig routing(RoutingMethod m, int E, int k, bool renorm, int n_group = 1, int topk_group = 1,
                             double scale = 1.0) {
  RoutingConfig c;
  c.method = m;
  c.num_experts = E;
  c.top_k = k;
  c.renormalize = renorm;
  c.n_group = n_group;
  c.topk_group = topk_group;
  c.routed_scaling_factor = scale;
  return c;
}

}  // namespace wna16::test
