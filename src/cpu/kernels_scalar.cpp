// Portable scalar kernels over the packed layout: the fallback, and the readable statement of
// what the SIMD builds compute.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu/kernels.h"
#include "wna16/half.h"

namespace wna16::cpu {

void gemm_block_scalar(const PackedLinear& L, int64_t nb, const XRow* rows, int m, float* out) {
  const BlockView v = block_view(L, nb);
  for (int t = 0; t < m; ++t) {
    float* o = out + int64_t(t) * kBlockN;
    for (int c = 0; c < kBlockN; ++c) o[c] = 0.f;
    const float* x = rows[t].f;
    const uint8_t* p = v.data;
    for (int64_t gi = 0; gi < v.groups; ++gi) {
      const uint8_t* hdr = p;
      p += v.header_bytes;
      float acc[kBlockN] = {};
      const int64_t k_end = v.group_kstart[gi] + v.group_len[gi];
      for (int64_t k0 = v.group_kstart[gi]; k0 < k_end; k0 += kStepK) {
        for (int tile = 0; tile < kTilesPerBlock; ++tile, p += v.tile_bytes)
          for (int j = 0; j < kTileN; ++j) {
            float sum = 0.f;
            for (int i = 0; i < 4; ++i) {
              // Bytes 4j+i hold channels k0+i and k0+4+i of column j (packed_linear.h).
              const uint32_t b = p[4 * j + i];
              const uint32_t qa = v.bits == 4 ? (b & 15u) : b;
              const uint32_t qb = v.bits == 4 ? (b >> 4) : uint32_t(p[64 + 4 * j + i]);
              sum += x[k0 + i] * float(qa) + x[k0 + 4 + i] * float(qb);
            }
            acc[tile * kTileN + j] += sum;
          }
      }
      // Scale and zero point once per group and column: s * (sum x q - z * sum x).
      const float xs = rows[t].xs[gi];
      for (int c = 0; c < kBlockN; ++c) {
        float s;
        if (v.scales_f16) {
          uint16_t h;
          std::memcpy(&h, hdr + 2 * c, 2);
          s = f16_to_float(h);
        } else {
          std::memcpy(&s, hdr + 4 * c, 4);
        }
        int32_t zi = v.zero;
        if (!v.uniform_zero) {
          uint16_t z16 = hdr[v.scale_bytes + c];
          if (v.zeros_u16) std::memcpy(&z16, hdr + v.scale_bytes + 2 * c, 2);
          zi = z16;
        }
        const float z = float(zi);
        o[c] += s * (acc[c] - z * xs);
      }
    }
  }
}

void router_scalar(const float* x, const float* w, int64_t H, int64_t E, float* logits) {
  for (int64_t e = 0; e < E; ++e) {
    double acc = 0;
    for (int64_t h = 0; h < H; ++h) acc += double(x[h]) * double(w[e * H + h]);
    logits[e] = float(acc);
  }
}

void quantize_block_scalar(const float* v, int64_t n, int terms, int8_t* const* q, float* scale, float* sum) {
  // Round to nearest even without a libm call: adding 1.5 * 2^23 leaves the integer part in the
  // mantissa (exact for |v| < 2^22).
  constexpr float kRound = 12582912.f;
  float mx = 0.f;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, std::fabs(v[i]));
  const float inv = mx > 0.f ? 127.f / mx : 0.f;
  *scale = mx / 127.f;
  float s[3] = {0.f, 0.f, 0.f};  // integer sums, exact in float (|sum| <= 64 * 127)
  for (int64_t i = 0; i < n; ++i) {
    // Each term is the rounded remainder of the previous one, in units 254x finer; the
    // remainders are exact in float (|rem - m| <= 1/2 with m the nearest integer).
    float rem = std::min(std::max(v[i] * inv, -127.f), 127.f);
    for (int t = 0; t < terms; ++t) {
      const float m = std::min(std::max((rem + kRound) - kRound, -127.f), 127.f);
      q[t][i] = int8_t(m);
      s[t] += m;
      rem = (rem - m) * kTermRatio;
    }
  }
  *sum = float(double(s[0]) + double(s[1]) / kTermRatio + double(s[2]) / (double(kTermRatio) * kTermRatio));
}

uint64_t stream_sum_scalar(const uint64_t* p, int64_t n) {
  uint64_t s = 0;
  for (int64_t i = 0; i < n; ++i) s += p[i];
  return s;
}

double fma_loop_scalar(int64_t iters) {
  // Plain float multiply-adds in 8 chains (the compiler may fuse or vectorise them: this is the
  // rate portable code gets).
  float acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = 1.f + 1e-3f * float(i);
  for (int64_t it = 0; it < iters; ++it)
    for (float& a : acc) a = a * 0.999999f + 1e-7f;
  volatile float sink = acc[0] + acc[7];
  (void)sink;
  return 2.0 * 8 * double(iters);
}

}  // namespace wna16::cpu
