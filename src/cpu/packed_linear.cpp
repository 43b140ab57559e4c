// Repacking UnpackedLinear into the CPU layout described in packed_linear.h.
#include "cpu/packed_linear.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>

#include "wna16/error.h"
#include "wna16/half.h"

namespace wna16::cpu {

AlignedBytes aligned_bytes(size_t n) {
  const size_t rounded = (std::max<size_t>(n, 1) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  if (!p) throw Error("cpu backend: out of memory allocating " + std::to_string(rounded) + " bytes");
  std::memset(p, 0, rounded);
  return AlignedBytes(static_cast<uint8_t*>(p));
}

bool PackedLinear::same_k_order(const PackedLinear& o) const {
  return K == o.K && Kp == o.Kp && identity_k == o.identity_k && kmap == o.kmap &&
         group_kstart == o.group_kstart && group_len == o.group_len && xblock_kstart == o.xblock_kstart;
}

int64_t PackedLinear::checkpoint_bytes() const {
  const int64_t G = num_groups();
  return K * N * bits / 8 + G * N * 2 + (uniform_zero ? 0 : G * N * bits / 8);
}

PackedLinear pack_linear(const UnpackedLinear& u) {
  const int64_t K = u.K, N = u.N, G = u.groups;
  auto fail = [&](const std::string& what) {
    throw Error("cpu backend: linear [K=" + std::to_string(K) + ", N=" + std::to_string(N) + "]: " + what);
  };
  if (u.bits != 4 && u.bits != 8)
    fail("bits=" + std::to_string(u.bits) + " is not supported (the CPU kernels take 4 or 8)");
  if (K <= 0 || N <= 0 || G <= 0) fail("groups=" + std::to_string(G) + " (all of K, N, groups must be positive)");
  if (int64_t(u.q.size()) != K * N) fail("q has " + std::to_string(u.q.size()) + " codes, expected K*N");
  if (int64_t(u.zeros.size()) != G * N || int64_t(u.scales.size()) != G * N)
    fail("zeros/scales have " + std::to_string(u.zeros.size()) + "/" + std::to_string(u.scales.size()) +
         " values, expected groups*N=" + std::to_string(G * N));
  if (int64_t(u.g_idx.size()) != K) fail("g_idx has " + std::to_string(u.g_idx.size()) + " entries, expected K");
  if (!u.bias.empty() && int64_t(u.bias.size()) != N) fail("bias has " + std::to_string(u.bias.size()) + " values");
  const int qmax = (1 << u.bits) - 1;
  for (int64_t k = 0; k < K; ++k)
    if (u.g_idx[size_t(k)] < 0 || u.g_idx[size_t(k)] >= G)
      fail("g_idx[" + std::to_string(k) + "]=" + std::to_string(u.g_idx[size_t(k)]) + " is outside [0, " +
           std::to_string(G) + ")");
  for (size_t i = 0; i < u.zeros.size(); ++i)
    if (u.zeros[i] < 0 || u.zeros[i] > qmax + 1)  // GPTQ v1 can encode zero 2^b
      fail("zero point " + std::to_string(u.zeros[i]) + " at [" + std::to_string(int64_t(i) / N) + ", " +
           std::to_string(int64_t(i) % N) + "] is outside [0, " + std::to_string(qmax + 1) + "]");

  PackedLinear p;
  p.bits = u.bits;
  p.K = K;
  p.N = N;
  p.NB = (N + kBlockN - 1) / kBlockN;
  p.bias = u.bias;

  // Kernel K order: channels sorted by group (stable), each group padded to a multiple of 4.
  std::vector<int32_t> order(static_cast<size_t>(K));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return u.g_idx[size_t(a)] < u.g_idx[size_t(b)]; });
  std::vector<int32_t> group_of;  // original group of each kernel group
  for (int64_t i = 0; i < K;) {
    const int32_t g = u.g_idx[size_t(order[size_t(i)])];
    int64_t j = i;
    while (j < K && u.g_idx[size_t(order[size_t(j)])] == g) ++j;
    p.group_kstart.push_back(int64_t(p.kmap.size()));
    for (int64_t t = i; t < j; ++t) p.kmap.push_back(order[size_t(t)]);
    while (p.kmap.size() % kStepK) p.kmap.push_back(-1);
    p.group_len.push_back(int64_t(p.kmap.size()) - p.group_kstart.back());
    group_of.push_back(g);
    i = j;
  }
  p.Kp = int64_t(p.kmap.size());
  for (size_t gi = 0; gi < p.group_len.size(); ++gi) {
    p.group_xblock.push_back(p.num_xblocks());
    const int64_t end = p.group_kstart[gi] + p.group_len[gi];
    for (int64_t k = p.group_kstart[gi]; k < end; k += kXBlock) {
      p.xblock_kstart.push_back(k);
      p.xblock_len.push_back(std::min<int64_t>(kXBlock, end - k));
    }
  }
  p.group_xblock.push_back(p.num_xblocks());
  p.identity_k = p.Kp == K;
  for (int64_t k = 0; p.identity_k && k < K; ++k) p.identity_k = p.kmap[size_t(k)] == k;
  if (p.identity_k) p.kmap.clear();

  // Scales: f16 when every one is exactly an f16 (always, for GPTQ/AWQ files), else f32.
  p.scale_fmt = ScaleFmt::F16;
  for (float s : u.scales)
    if (!(f16_to_float(float_to_f16(s)) == s)) {
      p.scale_fmt = ScaleFmt::F32;
      break;
    }
  p.zero = u.zeros[0];
  p.uniform_zero = std::all_of(u.zeros.begin(), u.zeros.end(), [&](int32_t z) { return z == p.zero; });

  int64_t bytes = 0;
  for (int64_t len : p.group_len) bytes += p.header_bytes() + len / kStepK * p.step_bytes();
  p.block_bytes = (bytes + 63) / 64 * 64;
  p.data = aligned_bytes(size_t(p.NB * p.block_bytes));

  auto code = [&](int64_t kp, int64_t n) -> uint32_t {
    if (n >= N) return 0;
    const int32_t k = p.identity_k ? int32_t(kp) : p.kmap[size_t(kp)];
    if (k < 0) return 0;
    const uint32_t c = u.q[size_t(k * N + n)];
    if (int(c) > qmax) fail("code " + std::to_string(c) + " at [" + std::to_string(k) + ", " + std::to_string(n) +
                            "] does not fit " + std::to_string(u.bits) + " bits");
    return c;
  };
  for (int64_t nb = 0; nb < p.NB; ++nb) {
    uint8_t* out = p.data.get() + nb * p.block_bytes;
    for (size_t gi = 0; gi < p.group_len.size(); ++gi) {
      const int64_t g = group_of[gi];
      for (int c = 0; c < kBlockN; ++c) {
        const int64_t n = nb * kBlockN + c;
        const float s = n < N ? u.scales[size_t(g * N + n)] : 0.f;
        if (p.scale_fmt == ScaleFmt::F16) {
          const uint16_t h = float_to_f16(s);
          std::memcpy(out + 2 * c, &h, 2);
        } else {
          std::memcpy(out + 4 * c, &s, 4);
        }
        if (!p.uniform_zero) {
          const uint16_t z = n < N ? uint16_t(u.zeros[size_t(g * N + n)]) : 0;
          if (p.zero_bytes() == 2)
            std::memcpy(out + p.scale_bytes() + 2 * c, &z, 2);
          else
            out[p.scale_bytes() + c] = uint8_t(z);
        }
      }
      out += p.header_bytes();
      const int64_t k_begin = p.group_kstart[gi];
      for (int64_t k0 = k_begin; k0 < k_begin + p.group_len[gi]; k0 += kStepK) {
        for (int tile = 0; tile < kTilesPerBlock; ++tile) {
          for (int j = 0; j < kTileN; ++j) {
            const int64_t n = nb * kBlockN + tile * kTileN + j;
            for (int i = 0; i < 4; ++i) {
              const uint32_t a = code(k0 + i, n), b = code(k0 + 4 + i, n);
              if (u.bits == 4) {
                out[4 * j + i] = uint8_t(a | b << 4);
              } else {
                out[4 * j + i] = uint8_t(a);
                out[64 + 4 * j + i] = uint8_t(b);
              }
            }
          }
          out += p.tile_bytes();
        }
      }
    }
  }
  return p;
}

}  // namespace wna16::cpu
