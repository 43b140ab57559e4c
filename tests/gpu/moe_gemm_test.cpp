// The fused MoE GEMM on its own, against a float64 host computation on the same codes: align from
// align_reference (host), random codes packed straight into the kernel layout, every tile config,
// int4 / int8, f16 / bf16, with and without zero points, several group lengths, odd token counts,
// experts with no tokens, and outputs poisoned with NaN.
#include "gpu/gemm_test_shapes.h"
#include "gpu/gpu_test_util.h"
#include "test_util.h"

#ifdef WNA16_HAVE_CUDA
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/dispatch.h"
#include "cuda/moe_gemm.h"
#include "cuda/moe_layer_kernels.h"
#include "wna16/cuda_kernels.h"
#include "wna16/error.h"
#include "wna16/backend.h"
#include "wna16/half.h"
#include "wna16/reference.h"

namespace wna16::cuda {
namespace {

struct DeviceArray {
  void* p = nullptr;
  explicit DeviceArray(size_t bytes) {
    if (cudaMalloc(&p, bytes ? bytes : 4) != cudaSuccess) p = nullptr;
  }
  ~DeviceArray() { cudaFree(p); }
  template <class V>
  void put(const std::vector<V>& v) {
    cudaMemcpy(p, v.data(), v.size() * sizeof(V), cudaMemcpyHostToDevice);
  }
  template <class V>
  std::vector<V> get(size_t n) const {
    std::vector<V> v(n);
    cudaMemcpy(v.data(), p, n * sizeof(V), cudaMemcpyDeviceToHost);
    return v;
  }
};

uint16_t to_act(DType t, float f) { return t == DType::BF16 ? float_to_bf16(f) : float_to_f16(f); }
float from_act(DType t, uint16_t h) { return t == DType::BF16 ? bf16_to_float(h) : f16_to_float(h); }

// Random kernel-ordered linears of E experts, their dense float64 weights, and the packed form.
struct RandomGemm {
  PackedGemm pg;
  std::vector<double> W;  // [E][K][N] in kernel column order
  RandomGemm(int bits, int64_t E, int64_t K, int64_t N, int64_t gl, bool zeros, uint64_t seed) {
    pg.init(bits, E, K, N, gl, zeros);
    W.assign(size_t(E * K * N), 0.0);
    std::mt19937_64 rng(seed);
    const int qmax = (1 << bits) - 1;
    for (int64_t e = 0; e < E; ++e) {
      KernelLinear kl;
      kl.K = K;
      kl.N = pg.NT * 16;
      kl.group_len = gl;
      kl.q.assign(size_t(K * kl.N), 0);
      kl.scales.assign(size_t((K / gl) * kl.N), 0.f);
      kl.zeros.assign(size_t((K / gl) * kl.N), 1 << (bits - 1));
      for (auto& q : kl.q) q = uint8_t(rng() % uint64_t(qmax + 1));
      for (auto& s : kl.scales)  // f16-exact scales ~ 1/sqrt(K) / 2^(bits-1)
        s = f16_to_float(float_to_f16(float((0.5 + double(rng() % 1000) / 1000.0) / std::sqrt(double(K)) /
                                            double(1 << (bits - 2)))));
      if (zeros)
        for (auto& z : kl.zeros) z = int32_t(rng() % uint64_t(qmax + 1));
      pack_kernel_linear(kl, e, pg);
      for (int64_t k = 0; k < K; ++k)
        for (int64_t n = 0; n < N; ++n) {
          const size_t g = size_t((k / gl) * kl.N + n);
          W[size_t((e * K + k) * N + n)] =
              double(kl.scales[g]) * (double(kl.q[size_t(k * kl.N + n)]) - double(kl.zeros[g]));
        }
    }
  }
};

struct GemmCase {
  int bits;
  DType act;
  int64_t gl;  // group length; K means one group
  bool zeros;
  int config;
  int64_t M;
  int decode_kw = 0;  // decode kernel's warps per tile pair along K; 0: the launcher's choice
  int splits = 0;     // GEMM2 split-K; 0: choose_splits
  bool diag = false;  // print the first mismatching (position, column) entries and a histogram
  bool tiles4 = false;  // decode kernel: the 4-tile variant (two tile pairs per warp; int4 only)
  bool kperm = false;   // m144w: x and the intermediate k-permuted (GemmRun::x_kperm / out_kperm)
  // With kperm: GEMM1's x in m-block order and GEMM2's intermediate extent (GemmRun::x_by_position,
  // x_rows: tensor copies of the token tiles in both GEMMs).
  bool x_extent = false;
  bool handoff = false;  // decode kernel: the m-block handoff counters (GemmRun::mb_done, item_claim)
  // Decode GEMM1: S shared slices (kernel experts 0..S-1, every token's last S choices) run ahead
  // of the wait for the align step (GemmRun::pre_wait_slices), which runs on the GPU right before.
  int pre_wait = 0;
  // With pre_wait: the shared-slice items in K parts on several blocks (GemmRun::pre_scratch /
  // pre_count, zeroed first); the case checks that parts ran (their sums are left in the scratch).
  bool pre_parts = false;
};

std::string describe(const GemmCase& c) {
  return "int" + std::to_string(c.bits) + " " + dtype_name(c.act) + " group " + std::to_string(c.gl) +
         (c.zeros ? " asym" : " sym") + " config " + gemm_config_name(c.config) + " M=" + std::to_string(c.M) +
         " kw=" + std::to_string(c.decode_kw) + " splits=" + std::to_string(c.splits) + (c.tiles4 ? " 4-tile" : "") +
         (c.kperm ? " k-permuted" : "") + (c.x_extent ? " x-extent" : "") + (c.handoff ? " handoff" : "") +
         (c.pre_wait ? " pre-wait S=" + std::to_string(c.pre_wait) : "") + (c.pre_parts ? " K parts" : "");
}

// Routes M tokens to `topk` distinct experts among the first E-2 (the last two get nothing).
std::vector<int32_t> random_ids(int64_t M, int topk, int E, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(size_t(M * topk));
  for (int64_t m = 0; m < M; ++m)
    for (int j = 0; j < topk; ++j) {
      int32_t e;
      bool dup;
      do {
        e = int32_t(rng() % uint64_t(E - 2));
        dup = false;
        for (int i = 0; i < j; ++i) dup |= ids[size_t(m * topk + i)] == e;
      } while (dup);
      ids[size_t(m * topk + j)] = e;
    }
  return ids;
}

// Diagnostics for a layout bug: entries whose error exceeds 5% of the reference's RMS (plus 2% of
// the entry), the first few with their coordinates, and how the bad ones spread over the token
// column inside the m-block (mod 128, in groups of 8) and the output column (mod 16).
struct Coord {
  int64_t pos, token, expert, col;  // padded position (-1: GEMM2), token, expert (-1: summed), column
};
void print_mismatches(const char* what, const std::vector<double>& got, const std::vector<double>& ref,
                      const std::vector<Coord>& at, int bm) {
  double rms = 0;
  for (double v : ref) rms += v * v;
  rms = std::sqrt(rms / double(std::max<size_t>(1, ref.size())));
  int64_t bad = 0;
  int64_t by_tok8[16] = {}, by_col16[16] = {};
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = std::fabs(got[i] - ref[i]);
    if (!(d <= 0.05 * rms + 0.02 * std::fabs(ref[i]))) {
      if (bad < 12)
        std::printf("  %s mismatch: pos %lld token %lld expert %lld col %lld (block col %lld): got %.6g ref %.6g\n", what,
                    (long long)at[i].pos, (long long)at[i].token, (long long)at[i].expert, (long long)at[i].col,
                    (long long)(at[i].pos >= 0 ? at[i].pos % bm : -1), got[i], ref[i]);
      ++bad;
      if (at[i].pos >= 0) ++by_tok8[(at[i].pos % bm) / 8 % 16];
      ++by_col16[at[i].col % 16];
    }
  }
  std::printf("  %s: %lld of %zu entries bad (ref rms %.4g)\n", what, (long long)bad, got.size(), rms);
  if (bad == 0) return;
  std::printf("  %s bad by block token column / 8:", what);
  for (int64_t v : by_tok8) std::printf(" %lld", (long long)v);
  std::printf("\n  %s bad by output column %% 16:", what);
  for (int64_t v : by_col16) std::printf(" %lld", (long long)v);
  std::printf("\n");
}

void run_gemm_case(const GemmCase& c) {
  SCOPED_TRACE(describe(c));
  const int E = 6, S = c.pre_wait, topk = 2 + S;
  // H = 576: 36 output tiles in GEMM2, padded to 40 (exercises the n-tile padding); group 128
  // needs K a multiple of 128, so that case uses H = 384, I = 256 (group 256: H = 512).
  const int64_t H = c.gl == 128 ? 384 : c.gl == 256 ? 512 : 576, I = c.gl >= 128 ? 256 : 192;
  const int64_t M = c.M, slots = M * topk;
  const int64_t gl1 = c.gl == 0 ? H : c.gl, gl2 = c.gl == 0 ? I : c.gl;
  const int bm = gemm_config_block_m(c.config);
  RandomGemm g1(c.bits, E, H, 2 * I, gl1, c.zeros, 11 + uint64_t(c.bits));
  RandomGemm g2(c.bits, E, I, H, gl2, c.zeros, 29 + uint64_t(c.bits));
  // Two routed choices (kernel experts S.., as the layer numbers them) and the S shared slices.
  std::vector<int32_t> ids = random_ids(M, 2, E - S, uint64_t(M) * 7 + 1);
  if (S > 0) {
    std::vector<int32_t> routed = ids;
    ids.clear();
    for (int64_t m = 0; m < M; ++m) {
      for (int j = 0; j < 2; ++j) ids.push_back(routed[size_t(m * 2 + j)] + S);
      for (int s2 = 0; s2 < S; ++s2) ids.push_back(s2);
    }
  }
  const AlignResult al = align_reference(ids.data(), slots, E, bm);
  std::mt19937_64 rng(uint64_t(M) + 99);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> x(size_t(M * H));
  for (auto& v : x) v = to_act(c.act, nd(rng));
  std::vector<float> tw(static_cast<size_t>(slots));
  for (auto& v : tw) v = 0.25f + float(rng() % 100) / 100.f;

  DeviceArray d_q1(g1.pg.qweight.size() * 4), d_s1(g1.pg.scales.size() * 4), d_z1(g1.pg.zeros.size() * 4);
  DeviceArray d_q2(g2.pg.qweight.size() * 4), d_s2(g2.pg.scales.size() * 4), d_z2(g2.pg.zeros.size() * 4);
  d_q1.put(g1.pg.qweight), d_s1.put(g1.pg.scales), d_z1.put(g1.pg.zeros);
  d_q2.put(g2.pg.qweight), d_s2.put(g2.pg.scales), d_z2.put(g2.pg.zeros);
  DeviceArray d_x(x.size() * 2), d_sorted(al.sorted_token_ids.size() * 4), d_eids(al.expert_ids.size() * 4),
      d_ntpp(4), d_tw(tw.size() * 4);
  // pos(k): where element k of a row is stored (k-permuted for the kperm cases).
  auto pos_of = [&](int64_t k) { return c.kperm ? kperm_pos(k) : k; };
  std::vector<uint16_t> x_dev(x.size());
  for (int64_t t = 0; t < M; ++t)
    for (int64_t k = 0; k < H; ++k) x_dev[size_t(t * H + pos_of(k))] = x[size_t(t * H + k)];
  d_x.put(x_dev), d_sorted.put(al.sorted_token_ids), d_eids.put(al.expert_ids), d_tw.put(tw);
  d_ntpp.put(std::vector<int32_t>{al.num_tokens_post_padded});
  const int64_t max_padded = int64_t(al.sorted_token_ids.size());
  // GEMM2's rows (act): one per slot and K split (at most 32 splits), NaN-poisoned: every row of
  // the splits it ran must be written.
  const int64_t out_n = 32 * slots * H;
  DeviceArray d_inter(size_t(max_padded * I * 2)), d_out(size_t(out_n * 2));
  CUDA_OK(cudaMemset(d_inter.p, 0xFF, size_t(max_padded * I * 2)));  // NaN poison
  CUDA_OK(cudaMemset(d_out.p, 0xFF, size_t(out_n * 2)));

  auto dev = [&](const RandomGemm& g, DeviceArray& q, DeviceArray& s, DeviceArray& z) {
    DeviceGemm d;
    d.bits = c.bits;
    d.E = E;
    d.K = g.pg.K;
    d.N = g.pg.N;
    d.NT = g.pg.NT;
    d.group_len = g.pg.group_len;
    d.G = g.pg.G;
    d.qweight = q.p;
    d.scales = static_cast<const uint32_t*>(s.p);
    d.zeros = c.zeros ? static_cast<const uint32_t*>(z.p) : nullptr;
    return d;
  };
  GemmRun r;
  r.act = c.act;
  r.config = c.config;
  r.topk = topk;
  r.num_slots = slots;
  r.sorted_ids = static_cast<const int32_t*>(d_sorted.p);
  r.expert_ids = static_cast<const int32_t*>(d_eids.p);
  r.num_tokens_post_padded = static_cast<const int32_t*>(d_ntpp.p);
  r.max_blocks = int64_t(al.expert_ids.size());
  r.decode_kw = c.decode_kw;
  r.decode_4tiles = c.tiles4 ? kDecode4Tiles : kDecodePairs;
  r.epilogue = GemmEpilogue::SiluMul;
  r.x = d_x.p;
  r.x_stride = H;
  r.out = d_inter.p;
  r.x_kperm = r.out_kperm = c.kperm;
  // Handoff counters: kHandoffSlots per m-block, then GEMM2's item counter; poisoned past them.
  const int64_t nmb = al.num_tokens_post_padded / bm;
  const int64_t n_counters = handoff_counters(r.max_blocks);
  DeviceArray d_handoff(size_t(n_counters + 2) * 4);
  std::vector<int32_t> handoff0(size_t(n_counters + 2), 0);
  handoff0.back() = 0x5eed;
  d_handoff.put(handoff0);
  if (c.handoff) r.mb_done = static_cast<int32_t*>(d_handoff.p);
  if (S > 0) {
    // The tables come from the GPU align step, GEMM1 its programmatic dependent: the shared slices'
    // items run while it may still write them (poisoned first).
    DeviceArray d_ids(ids.size() * 4);
    d_ids.put(ids);
    CUDA_OK(cudaMemset(d_sorted.p, 0xFF, al.sorted_token_ids.size() * 4));
    CUDA_OK(cudaMemset(d_eids.p, 0xFF, al.expert_ids.size() * 4));
    CUDA_OK(cudaMemset(d_ntpp.p, 0xFF, 4));
    cudaStream_t st = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    launch_align(static_cast<const int32_t*>(d_ids.p), slots, E, bm, static_cast<int32_t*>(d_sorted.p),
                 static_cast<int32_t*>(d_eids.p), static_cast<int32_t*>(d_ntpp.p), st);
    r.overlap_previous = r.wait_first = true;
    r.pre_wait_slices = S;
    const int64_t scr_n = pre_scratch_floats(M, S, g1.pg.NT), cnt_n = pre_count_ints(M, S, g1.pg.NT);
    DeviceArray d_pre_scr(size_t(scr_n) * 4), d_pre_cnt(size_t(cnt_n) * 4);
    if (c.pre_parts) {
      CUDA_OK(cudaMemset(d_pre_scr.p, 0xFF, size_t(scr_n) * 4));  // NaN poison: each part stores its own
      CUDA_OK(cudaMemset(d_pre_cnt.p, 0, size_t(cnt_n) * 4));
      CUDA_OK(cudaDeviceSynchronize());
      r.pre_scratch = static_cast<float*>(d_pre_scr.p);
      r.pre_count = static_cast<int32_t*>(d_pre_cnt.p);
    }
    launch_moe_gemm(dev(g1, d_q1, d_s1, d_z1), r, st);
    CUDA_OK(cudaStreamSynchronize(st));
    CUDA_OK(cudaStreamDestroy(st));
    r.overlap_previous = r.wait_first = false;
    r.pre_wait_slices = 0;
    r.pre_scratch = nullptr;
    r.pre_count = nullptr;
    if (c.pre_parts && c.bits == 8) {
      // int8 has no parts variant: the launcher leaves the scratch alone.
      const std::vector<int32_t> cnt = d_pre_cnt.get<int32_t>(size_t(cnt_n));
      EXPECT_TRUE(std::all_of(cnt.begin(), cnt.end(), [](int32_t v) { return v == 0; })) << "int8 ran parts";
    } else if (c.pre_parts) {
      // Every unit of every shared m-block counted the same number of parts (> 1), and the parts'
      // sums are in the scratch.
      const std::vector<int32_t> cnt = d_pre_cnt.get<int32_t>(size_t(cnt_n));
      const std::vector<float> scr = d_pre_scr.get<float>(size_t(scr_n));
      int32_t parts = 0;
      for (int32_t v : cnt) parts = std::max(parts, v);
      EXPECT_GT(parts, 1) << "the shared-slice items ran in one part";
      int64_t units_counted = 0;
      for (int32_t v : cnt) {
        ASSERT_TRUE(v == 0 || v == parts) << "a unit counted " << v << " of " << parts << " parts";
        units_counted += v == parts;
      }
      EXPECT_GT(units_counted, 0);
      EXPECT_TRUE(std::any_of(scr.begin(), scr.end(), [](float v) { return std::isfinite(v) && v != 0.f; }))
          << "no partial sums";
    }
    ASSERT_EQ(d_sorted.get<int32_t>(al.sorted_token_ids.size()), al.sorted_token_ids) << "GPU align";
  } else {
    // k-permuted with extents: GEMM1's x too in m-block order (launch_kperm_positions from the
    // natural rows; padding rows NaN-poisoned: they feed token columns that must be discarded),
    // so both GEMMs run the k-loop of tensor copies without block barriers.
    const bool pos = c.kperm && c.x_extent;
    DeviceArray d_xnat(pos ? x.size() * 2 : 16), d_xpos(pos ? size_t(max_padded * H * 2) : 16);
    if (pos) {
      d_xnat.put(x);
      CUDA_OK(cudaMemset(d_xpos.p, 0xFF, size_t(max_padded * H * 2)));
      launch_kperm_positions(d_xnat.p, H, r.sorted_ids, r.num_tokens_post_padded, slots, topk, max_padded, d_xpos.p,
                             nullptr);
      r.x = d_xpos.p;
      r.x_by_position = true;
      r.x_rows = max_padded;
    }
    launch_moe_gemm(dev(g1, d_q1, d_s1, d_z1), r, nullptr);
    CUDA_OK(cudaDeviceSynchronize());  // before d_xpos goes
    r.x_by_position = false;
    r.x_rows = 0;
  }
  CUDA_OK(cudaDeviceSynchronize());
  if (c.handoff) {
    // Every real m-block was released once per tile pair of GEMM1 (NT / 2), each pair in its slot
    // (handoff_pairs_per_slot pairs per slot); no other word moved.
    const std::vector<int32_t> h = d_handoff.get<int32_t>(size_t(n_counters + 2));
    const int64_t pairs = g1.pg.NT / 2, pps = handoff_pairs_per_slot(pairs);
    for (int64_t mb = 0; mb < r.max_blocks; ++mb)
      for (int64_t q = 0; q < kHandoffSlots; ++q) {
        const int64_t want = mb < nmb ? std::clamp<int64_t>(pairs - q * pps, 0, pps) : 0;
        ASSERT_EQ(h[size_t(mb * kHandoffSlots + q)], want) << "handoff count of m-block " << mb << " slot " << q;
      }
    ASSERT_EQ(h[size_t(n_counters)], 0) << "GEMM2's item counter moved during GEMM1";
    ASSERT_EQ(h.back(), 0x5eed) << "write past the handoff counters";
  }

  // GEMM1 check: every valid padded position holds silu(gate)*up of its token and expert.
  const std::vector<uint16_t> inter = d_inter.get<uint16_t>(size_t(max_padded * I));
  std::vector<double> ref1, got1;
  std::vector<Coord> at1;
  std::vector<uint16_t> inter_in(size_t(max_padded * I), 0);  // GEMM2's input: GPU result, rows in order
  for (int64_t pos = 0; pos < al.num_tokens_post_padded; ++pos) {
    const int32_t slot = al.sorted_token_ids[size_t(pos)];
    if (slot >= slots) continue;
    const int64_t t = slot / topk, e = al.expert_ids[size_t(pos / bm)];
    for (int64_t cidx = 0; cidx < I; ++cidx) {
      const int64_t ng = (cidx / 16) * 32 + cidx % 16, nu = ng + 16;  // gate / up kernel columns
      double gsum = 0, usum = 0;
      for (int64_t k = 0; k < H; ++k) {
        const double xv = from_act(c.act, x[size_t(t * H + k)]);
        gsum += xv * g1.W[size_t((e * H + k) * 2 * I + ng)];
        usum += xv * g1.W[size_t((e * H + k) * 2 * I + nu)];
      }
      ref1.push_back(gsum / (1.0 + std::exp(-gsum)) * usum);
      const uint16_t h = inter[size_t(pos * I + pos_of(cidx))];
      got1.push_back(from_act(c.act, h));
      if (c.diag) at1.push_back({pos, t, e, cidx});
      inter_in[size_t(pos * I + pos_of(cidx))] = h;
    }
  }
  ASSERT_FALSE(ref1.empty());
  if (c.diag) print_mismatches("GEMM1", got1, ref1, at1, bm);
  for (double v : got1) ASSERT_TRUE(std::isfinite(v)) << "unwritten (NaN-poisoned) intermediate";
  const double tol = layer_tolerance(c.act);
  std::vector<float> got1f(got1.begin(), got1.end());
  EXPECT_LT(rel_error(got1f.data(), ref1.data(), int64_t(ref1.size())), tol) << "GEMM1";

  // GEMM2 on the GPU's intermediate: out[t] = sum over its slots of weight * inter[pos] . W_down.
  d_inter.put(inter_in);
  r.epilogue = GemmEpilogue::WeightedSum;
  r.out_kperm = false;  // GEMM2 reads the k-permuted intermediate (x_kperm stays)
  r.x = d_inter.p;
  r.x_stride = I;
  r.x_rows = c.x_extent ? max_padded : 0;
  r.out = d_out.p;
  r.topk_weights = static_cast<const float*>(d_tw.p);
  const DeviceGemm dg2 = dev(g2, d_q2, d_s2, d_z2);
  r.splits = c.splits > 0 ? c.splits : choose_splits(dg2, c.config, c.act, M, topk, r.decode_4tiles);
  if (c.handoff) {
    r.mb_done_target = int(g1.pg.NT / 2);
    r.item_claim = static_cast<int32_t*>(d_handoff.p) + n_counters;
  }
  const int splits = launch_moe_gemm(dg2, r, nullptr);
  ASSERT_TRUE(splits >= 1 && splits <= r.splits) << "GEMM2 ran " << splits << " of " << r.splits << " splits";
  CUDA_OK(cudaDeviceSynchronize());
  if (c.handoff) {
    // Every item a block started claimed the block's next one: at least one claim per m-block.
    const int32_t claims = d_handoff.get<int32_t>(size_t(n_counters + 1)).back();
    EXPECT_GE(claims, nmb) << "GEMM2 item claims";
  }
  // Each token's output: its slots' rows of every split, added in slot and split order (as
  // launch_slot_sum_out does).
  const std::vector<uint16_t> rows = d_out.get<uint16_t>(size_t(splits * slots * H));
  std::vector<float> out(size_t(M * H), 0.f);
  for (int64_t slot = 0; slot < slots; ++slot)
    for (int sp = 0; sp < splits; ++sp)
      for (int64_t n = 0; n < H; ++n) {
        const float v = float(from_act(c.act, rows[size_t((sp * slots + slot) * H + n)]));
        ASSERT_TRUE(std::isfinite(v)) << "GEMM2 left row " << slot << " of split " << sp << " unwritten";
        out[size_t((slot / topk) * H + n)] += v;
      }
  std::vector<double> ref2(size_t(M * H), 0.0);
  for (int64_t pos = 0; pos < al.num_tokens_post_padded; ++pos) {
    const int32_t slot = al.sorted_token_ids[size_t(pos)];
    if (slot >= slots) continue;
    const int64_t t = slot / topk, e = al.expert_ids[size_t(pos / bm)];
    for (int64_t n = 0; n < H; ++n) {
      double s = 0;
      for (int64_t k = 0; k < I; ++k)
        s += double(from_act(c.act, inter_in[size_t(pos * I + pos_of(k))])) * g2.W[size_t((e * I + k) * H + n)];
      ref2[size_t(t * H + n)] += double(tw[size_t(slot)]) * s;
    }
  }
  if (c.diag) {
    std::vector<double> got2(out.begin(), out.end());
    std::vector<Coord> at2;
    for (int64_t t = 0; t < M; ++t)
      for (int64_t n = 0; n < H; ++n) at2.push_back({-1, t, -1, n});
    print_mismatches("GEMM2", got2, ref2, at2, bm);
  }
  EXPECT_LT(rel_error(out.data(), ref2.data(), M * H), tol) << "GEMM2 (splits " << r.splits << ")";
}

TEST(MoeGemm, EveryConfigBitsDtypeAndGroup) {
  WNA16_REQUIRE_GPU();
  const int64_t Ms[] = {1, 3, 17, 118};
  // 144-token m-blocks (config m144w; 4 experts get tokens, ~M/2 each): 300 -> a full block (the
  // 144-column wgmma) and a block of ~6 (several m-blocks per expert), 190 -> ~95, 97 -> ~48,
  // 41 -> ~20 (a 16- or 32-token wgmma).
  const int64_t MsPrefill[] = {300, 190, 97, 41};
  const int64_t gls[] = {32, 64, 128, 0};
  int i = 0, j = 0;
  for (int bits : {4, 8})
    for (DType act : {DType::BF16, DType::F16})
      for (int config = 0; config < gemm_config_count(); ++config) {
        // Rotate group lengths / zero points through the cases to keep the suite fast.
        if (gemm_config_hopper(config) && !hopper_path_available()) continue;  // no wgmma below sm_90a
        if (gemm_config_takes_kperm(config)) {  // the wgmma prefill config
          run_gemm_case({bits, act, gls[j % 4], (j % 2) != 0, config, MsPrefill[j % 4]});
          ++j;
          continue;
        }
        GemmCase c{bits, act, gls[i % 4], (i % 3) != 0, config, Ms[i % 4]};
        ++i;
        run_gemm_case(c);
        if (config == 0 && bits == 4) {  // the decode kernel's 4-tile variant too
          c.tiles4 = true;
          run_gemm_case(c);
        }
      }
}

// The wgmma kernel (configs m32w, m64w, m96w and m144w) with diagnostics: on a mismatch it prints the first bad
// (padded position, token, column) entries and how the bad ones spread over the token column of
// the m-block and the output column, so a fragment / swizzle / k-permutation bug shows its pattern
// from one GPU run. Token counts: several m-blocks per expert, one and both 64-token halves, a
// 16-token tail; int4 and int8, bf16 and f16, sym and asym, per-lane groups (32) and long ones.
TEST(MoeGemm, PrefillWgmmaDiagnostics) {
  WNA16_REQUIRE_GPU();
  if (!hopper_path_available())
    GTEST_SKIP() << "the wgmma kernel needs sm_90a; this GPU has compute capability " << device_compute_capability();
  for (const char* name : {"m32w", "m64w", "m96w", "m144w"}) {
    const int config = config_named(name);
    ASSERT_GE(config, 0) << "config " << name << " is not in the table";
    const struct {
      int bits;
      DType act;
      int64_t gl;
      bool zeros;
      int64_t M;
    } cases[] = {
        {4, DType::BF16, 64, false, 300}, {4, DType::F16, 32, true, 190}, {8, DType::BF16, 128, true, 97},
        {8, DType::F16, 0, false, 257},   {4, DType::BF16, 0, true, 9},
    };
    for (const auto& k : cases)
      for (int mode = 0; mode < 3; ++mode) {  // natural x (4-byte token copies), k-permuted x (16-byte),
                                              // k-permuted in m-block order with extents (one tensor
                                              // copy per chunk in both GEMMs, no block barriers)
        GemmCase c{k.bits, k.act, k.gl, k.zeros, config, k.M};
        c.diag = true;
        c.kperm = mode > 0;
        c.x_extent = mode == 2;
        std::printf("[ prefill ] %s\n", describe(c).c_str());
        run_gemm_case(c);
        c.splits = 3;  // split-K of GEMM2 (atomics of partial sums)
        std::printf("[ prefill ] %s\n", describe(c).c_str());
        run_gemm_case(c);
      }
  }
}

// launch_kperm_positions against kperm_pos: y[p] = x[slot / x_div] k-permuted for the positions
// below *ntpp with a valid slot; padding positions (sentinel, -1) and those past *ntpp keep their
// poison. A 16-byte aligned x (vector path) and a 2-byte aligned one (element path).
TEST(MoeGemm, KpermPositionsKernel) {
  WNA16_REQUIRE_GPU();
  const int64_t M = 37, H = 448, x_div = 3, num_slots = M * x_div, rows = 64, ntpp = 56;
  std::vector<uint16_t> x(size_t(M * H + 8));
  std::mt19937_64 rng(3);
  for (auto& v : x) v = uint16_t(rng());
  std::vector<int32_t> sorted(static_cast<size_t>(rows));
  for (auto& v : sorted) {
    const uint64_t u = rng() % 8;
    v = u == 0 ? int32_t(num_slots) : u == 1 ? -1 : int32_t(rng() % uint64_t(num_slots));
  }
  DeviceArray dx(x.size() * 2), dy(size_t(rows * H) * 2), ds(sorted.size() * 4), dn(4);
  dx.put(x);
  ds.put(sorted);
  dn.put(std::vector<int32_t>{int32_t(ntpp)});
  for (int64_t shift : {0, 1}) {  // elements: x + 1 is 2-byte aligned only
    CUDA_OK(cudaMemset(dy.p, 0xA5, size_t(rows * H) * 2));
    cuda::launch_kperm_positions(static_cast<const uint16_t*>(dx.p) + shift, H, static_cast<const int32_t*>(ds.p),
                                 static_cast<const int32_t*>(dn.p), num_slots, int(x_div), rows, dy.p, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> y = dy.get<uint16_t>(size_t(rows * H));
    int64_t bad = 0, written = 0;
    for (int64_t p = 0; p < rows; ++p) {
      const int32_t slot = sorted[size_t(p)];
      const bool valid = p < ntpp && slot >= 0 && slot < num_slots;
      written += valid;
      for (int64_t k = 0; k < H; ++k) {
        const uint16_t want = valid ? x[size_t((slot / x_div) * H + k + shift)] : uint16_t(0xA5A5);
        bad += y[size_t(p * H + kperm_pos(k))] != want;
      }
    }
    EXPECT_EQ(bad, 0) << "shift " << shift;
    EXPECT_GT(written, 20);
  }
  const auto* s = static_cast<const int32_t*>(ds.p);
  const auto* n = static_cast<const int32_t*>(dn.p);
  EXPECT_NE(test::error_of([&] { cuda::launch_kperm_positions(dx.p, 100, s, n, num_slots, 3, rows, dy.p, nullptr); })
                .find("H=100"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { cuda::launch_kperm_positions(dx.p, H, s, n, num_slots, 0, rows, dy.p, nullptr); })
                .find("x_div=0"),
            std::string::npos);
}

// The act-order gather (launch_gather_slots): out[s, j] = x[s / k2, perm[ids[s], j]], at
// kperm_pos(j) for the prefill kernel's rows, from x with 2-byte alignment only, for rows longer
// than one block's piece; refusals name the value.
TEST(MoeGemm, GatherSlotsKernel) {
  WNA16_REQUIRE_GPU();
  const int64_t M = 5, H = 2496;  // two pieces of 2048 per row, the second partial
  const int k2 = 3, n_perm = 7;
  std::mt19937_64 rng(5);
  std::vector<uint16_t> x(size_t(M * H + 1));
  for (auto& v : x) v = uint16_t(rng());
  std::vector<int32_t> ids(size_t(M * k2)), perm(size_t(n_perm * H));
  for (auto& v : ids) v = int32_t(rng() % n_perm);
  for (int e = 0; e < n_perm; ++e) {
    int32_t* p = perm.data() + e * H;
    std::iota(p, p + H, 0);
    std::shuffle(p, p + H, rng);
  }
  DeviceArray dx(x.size() * 2), dids(ids.size() * 4), dperm(perm.size() * 4), dout(size_t(M * k2 * H) * 2);
  dx.put(x);
  dids.put(ids);
  dperm.put(perm);
  for (const bool kperm : {false, true})
    for (int64_t shift : {0, 1}) {
      CUDA_OK(cudaMemset(dout.p, 0xA5, size_t(M * k2 * H) * 2));
      cuda::launch_gather_slots(static_cast<const uint16_t*>(dx.p) + shift, M, H, static_cast<const int32_t*>(dids.p),
                                k2, static_cast<const int32_t*>(dperm.p), n_perm, dout.p, kperm, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<uint16_t> out = dout.get<uint16_t>(size_t(M * k2 * H));
      int64_t bad = 0;
      for (int64_t sl = 0; sl < M * k2; ++sl)
        for (int64_t j = 0; j < H; ++j) {
          const uint16_t want = x[size_t((sl / k2) * H + perm[size_t(ids[size_t(sl)] * H + j)] + shift)];
          bad += out[size_t(sl * H + (kperm ? kperm_pos(j) : j))] != want;
        }
      EXPECT_EQ(bad, 0) << "kperm " << kperm << " shift " << shift;
    }
  // A slot range of each token, with ids (from the routing) or without (slot j takes expert
  // j - j_begin, the shared slices); the other slots stay untouched.
  for (const bool with_ids : {false, true})
    for (const auto& [jb, je] : {std::pair{1, 3}, std::pair{0, 2}, std::pair{2, 3}}) {
      CUDA_OK(cudaMemset(dout.p, 0xA5, size_t(M * k2 * H) * 2));
      cuda::launch_gather_slots(dx.p, M, H, with_ids ? static_cast<const int32_t*>(dids.p) : nullptr, k2,
                                static_cast<const int32_t*>(dperm.p), n_perm, dout.p, false, nullptr, jb, je);
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<uint16_t> out = dout.get<uint16_t>(size_t(M * k2 * H));
      int64_t bad = 0;
      for (int64_t sl = 0; sl < M * k2; ++sl) {
        const int j = int(sl % k2);
        const int e = with_ids ? ids[size_t(sl)] : j - jb;
        for (int64_t c = 0; c < H; ++c) {
          const uint16_t got = out[size_t(sl * H + c)];
          bad += j >= jb && j < je ? got != x[size_t((sl / k2) * H + perm[size_t(e * H + c)])] : got != 0xA5A5;
        }
      }
      EXPECT_EQ(bad, 0) << "slots [" << jb << ", " << je << ") ids " << with_ids;
    }
  {
    const std::string err = test::error_of([&] {
      cuda::launch_gather_slots(dx.p, M, H, nullptr, k2, static_cast<const int32_t*>(dperm.p), 1, dout.p, false, nullptr,
                                0, 2);
    });
    EXPECT_NE(err.find("n_perm=1"), std::string::npos) << err;
  }
  auto refusal = [&](int64_t m, int64_t h, int k, bool kp) {
    return test::error_of([&] {
      cuda::launch_gather_slots(dx.p, m, h, static_cast<const int32_t*>(dids.p), k, static_cast<const int32_t*>(dperm.p),
                                n_perm, dout.p, kp, nullptr);
    });
  };
  EXPECT_NE(refusal(M, 100, k2, true).find("H (100)"), std::string::npos);
  EXPECT_NE(refusal(M, H, 0, false).find("k2=0"), std::string::npos);
  EXPECT_NE(refusal(-1, H, k2, false).find("M=-1"), std::string::npos);
}

TEST(MoeGemm, AllGroupLengthsInt4Bf16) {
  WNA16_REQUIRE_GPU();
  for (int64_t gl : {32, 64, 128, 0})
    for (bool z : {false, true})
      for (bool tiles4 : {false, true}) {
        GemmCase c{4, DType::BF16, gl, z, 0, 5};
        c.tiles4 = tiles4;  // the decode kernel's 4-tile variant too
        run_gemm_case(c);
      }
}

// The decode kernel (config m8 without act-order) with every in-block K split and a forced
// split-K across blocks: slices that end mid-group, empty slices (K = 192: 3 chunks for 4 warps),
// static groups of 1, 2 and 4 chunks (group 64, 128, 256) and run-time ones (one group of K), the
// per-weight path (group 32, and int8 with bf16), and M = 9 (two m-blocks on one expert).
// Every int4 case also runs the 4-tile variant (two tile pairs per warp): its kw = 1 blocks hang
// over N here (GEMM1 6 units of 2 pairs, GEMM2 10: blocks of 4 units), its static groups of 4
// chunks span two turns of its 2-chunk ring (group 256); int8 ignores the flag (one pair per warp).
TEST(MoeGemm, DecodeKernelEveryKSplit) {
  WNA16_REQUIRE_GPU();
  int i = 0;
  for (int bits : {4, 8})
    for (DType act : {DType::BF16, DType::F16})
      for (int kw : {1, 2, 4})
        for (int splits : {0, 3}) {
          const int64_t gls[] = {128, 64, 32, 0, 256};
          const int64_t Ms[] = {1, 3, 9};
          GemmCase c{bits, act, gls[i % 5], (i % 3) == 1, 0, Ms[i % 3], kw, splits};
          ++i;
          run_gemm_case(c);
          if (bits == 4 || (kw == 1 && splits == 0)) {  // int8: a few cases prove the flag is ignored
            c.tiles4 = true;
            run_gemm_case(c);
          }
        }
}

// The decode GEMMs' m-block handoff (GemmRun::mb_done): GEMM1 releases each m-block once per tile
// pair, GEMM2 takes its items from the counter and waits per m-block; results as without it. (The
// layer tests run it concurrently: GEMM2 as a programmatic dependent of GEMM1.)
TEST(MoeGemm, DecodeHandoffCountsAndClaims) {
  WNA16_REQUIRE_GPU();
  for (bool tiles4 : {false, true})
    for (int kw : {1, 2, 4})
      for (int64_t M : {1, 9}) {
        GemmCase c{4, kw == 2 ? DType::F16 : DType::BF16, 128, kw == 4, 0, M, kw, M == 9 ? 3 : 0};
        c.tiles4 = tiles4;
        c.handoff = true;
        run_gemm_case(c);
      }
  GemmCase c8{8, DType::BF16, 64, false, 0, 3, 0, 0};
  c8.handoff = true;
  run_gemm_case(c8);
}

// GEMM1 runs the shared slices' m-blocks before it waits for the align step (GemmRun::
// pre_wait_slices), their tables computed from M: the same intermediate as from the align tables,
// and each m-block's handoff count complete (the releases follow the wait).
TEST(MoeGemm, DecodeRunsSharedSlicesAheadOfTheWait) {
  WNA16_REQUIRE_GPU();
  for (int S : {1, 2})
    for (int64_t M : {1, 3, 17})
      for (bool tiles4 : {false, true}) {
        GemmCase c{4, M == 3 ? DType::F16 : DType::BF16, 128, M == 17, 0, M, 0, 0};
        c.tiles4 = tiles4;
        c.handoff = M != 3;
        c.pre_wait = S;
        run_gemm_case(c);
      }
  GemmCase c8{8, DType::BF16, 64, false, 0, 3, 2, 0};
  c8.pre_wait = 1;
  c8.handoff = true;
  run_gemm_case(c8);
  // The shared-slice items in K parts (GemmRun::pre_scratch): static groups of 1 and 2 chunks,
  // one and two tile pairs per warp, K over 1 or 2 warps; int8 (no parts variant) ignores them.
  for (int64_t M : {1, 3, 17})
    for (bool tiles4 : {false, true}) {
      GemmCase c{4, M == 3 ? DType::F16 : DType::BF16, M == 17 ? 128 : 64, M == 3, 0, M, M == 3 ? 2 : 1, 0};
      c.tiles4 = tiles4;
      c.handoff = true;
      c.pre_wait = M == 17 ? 2 : 1;
      c.pre_parts = true;
      run_gemm_case(c);
    }
  GemmCase c8p{8, DType::BF16, 64, false, 0, 3, 1, 0};
  c8p.pre_wait = 1;
  c8p.handoff = true;
  c8p.pre_parts = true;
  run_gemm_case(c8p);
}

// Where the layer turns the handoff on (mb_handoff_pays): GEMM1's expected decode work items
// against 9/10 of the resident blocks. DeepSeek-V3 M=1 (9 kernel experts, 128 tile pairs, K split
// over 4 warps: 1152 items) and Mixtral M=1 (896 in the filling shape) pay, Qwen3-30B-A3B M=1 (8
// experts, 48 pairs: 384 at most) does not on the H200 (528 resident blocks); never for act-order
// or the staged configs.
TEST(MoeGemm, HandoffWhereGemm1FillsTheGpu) {
  WNA16_REQUIRE_GPU();
  int dummy[8] = {};
  auto shape = [&](int64_t E, int64_t K, int64_t N) { return host_gemm_shape(dummy, 4, E, K, N, 128); };
  auto run = [](int64_t M, int topk, int config) {
    GemmRun r;
    r.config = config;
    r.topk = topk;
    r.num_slots = M * topk;
    r.max_blocks = 1 << 20;
    return r;
  };
  const int64_t resident = resident_blocks(4, 0, DType::BF16);
  const DeviceGemm ds = shape(257, 7168, 4096), qw = shape(128, 2048, 1536);
  EXPECT_EQ(mb_handoff_pays(ds, run(1, 9, 0)), 1152 >= 0.9 * double(resident)) << resident << " resident blocks";
  EXPECT_EQ(mb_handoff_pays(qw, run(1, 8, 0)), 384 >= 0.9 * double(resident)) << resident << " resident blocks";
  // Mixtral M=1: the model's shape (K over 2 warps, 2 pairs per warp) is 448 items, one round with
  // idle blocks; with the handoff GEMM1 splits K over 4 warps instead: 896 items.
  const DeviceGemm mx = shape(8, 4096, 28672);
  EXPECT_EQ(mb_handoff_pays(mx, run(1, 2, 0)), 896 >= 0.9 * double(resident)) << resident << " resident blocks";
  EXPECT_FALSE(mb_handoff_pays(ds, run(1, 9, config_named("m64"))));
  DeviceGemm act_order = ds;
  act_order.perm = dummy;
  EXPECT_FALSE(mb_handoff_pays(act_order, run(1, 9, 0)));
}

TEST(MoeGemm, RefusesBadShapes) {
  WNA16_REQUIRE_GPU();
  DeviceGemm d;
  d.bits = 3;
  GemmRun r;
  {
    const std::string err = test::error_of([&] { launch_moe_gemm(d, r, nullptr); });
    EXPECT_NE(err.find("bits=3"), std::string::npos) << err;
  }
  d.bits = 4;
  d.K = 100;
  {
    const std::string err = test::error_of([&] { launch_moe_gemm(d, r, nullptr); });
    EXPECT_NE(err.find("K=100 is not a multiple of 64"), std::string::npos) << err;
  }
}

}  // namespace
}  // namespace wna16::cuda
#endif
