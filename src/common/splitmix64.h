// splitmix64: a tiny, fast, well-mixed generator for seeded random weights and inputs. Each
// tensor takes its own stream derived from (seed, id), so results never depend on thread count.
#pragma once
#include <cstdint>

namespace wna16 {

struct SplitMix64 {
  uint64_t s;
  explicit SplitMix64(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }  // [0, 1)
};

}  // namespace wna16
