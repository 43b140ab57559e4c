// The MoE GEMM launcher's host-side decisions and refusals, no GPU needed (no CUDA call happens
// before a refusal): the kernel table by tokens per expert, the decode work model, the k-permuted
// layout, the act-order and index-range refusals, the handoff and one-token routing predicates.
#include "gpu/gemm_test_shapes.h"
#include "gpu/gpu_test_util.h"
#include "test_util.h"

#ifdef WNA16_HAVE_CUDA
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/dispatch.h"
#include "cuda/moe_gemm.h"
#include "wna16/error.h"

namespace wna16::cuda {
namespace {

TEST(MoeGemm, PrefillRefusesActOrder) {
  const int config = config_named("m144w");
  ASSERT_GE(config, 0);
  EXPECT_EQ(choose_gemm_config(8192, 8, 256, false), config);  // DeepSeek-V3 prefill: ~256 per expert
  EXPECT_EQ(choose_gemm_config(1024, 2, 8, false), config);     // Mixtral: 256 per expert
  EXPECT_EQ(choose_gemm_config(512, 2, 8, false), config);      // 128 per expert
  EXPECT_NE(choose_gemm_config(320, 2, 8, false), config);      // 80 per expert, the bound: m64w
  EXPECT_FALSE(gemm_config_gathers(config));
  EXPECT_NE(choose_gemm_config(8192, 8, 256, true), config);
  int dummy = 0;
  DeviceGemm d = tiny_host_gemm(&dummy);
  d.perm = &dummy;
  GemmRun r;
  r.config = config;
  {
    const std::string err = test::error_of([&] { launch_moe_gemm(d, r, nullptr); });
    EXPECT_NE(err.find("m144w"), std::string::npos) << err;
  }
}

// The kernel table by tokens per expert (host-only): the decode kernel (m8) up to 8.5 without
// act-order (8 with it; narrow layers further, by m-block count), the staged m32 kernel for
// act-order with its own gather up to 40 and m64 above; without it the wgmma kernel, m32w up to
// 28, m64w to 60, m96w to 80, m144w above.
TEST(MoeGemm, ChoosesTheKernelTableRowByTokensPerExpert) {
  const int m8 = config_named("m8"), m32 = config_named("m32"), m64 = config_named("m64"),
            m32w = config_named("m32w"), m64w = config_named("m64w"), m96w = config_named("m96w"),
            m144w = config_named("m144w");
  EXPECT_EQ(choose_gemm_config(1, 2, 8, false), m8);
  EXPECT_EQ(choose_gemm_config(32, 2, 8, false), m8);        // Mixtral: 8 per expert
  EXPECT_EQ(choose_gemm_config(256, 8, 256, false), m8);     // DeepSeek-V3: 8.002 per active expert
  EXPECT_EQ(choose_gemm_config(48, 2, 8, false), m32w);      // Mixtral: 12 per expert
  EXPECT_EQ(choose_gemm_config(64, 2, 8, false), m32w);      // Mixtral: 16 per expert
  EXPECT_EQ(choose_gemm_config(512, 8, 256, false), m32w);   // DeepSeek-V3: 16 per expert
  EXPECT_EQ(choose_gemm_config(1024, 8, 256, false), m64w);  // DeepSeek-V3: 32 per expert
  // Narrow layers (short weight rows, their shared slices given) keep the decode kernel while its
  // expected m-blocks are at most 2.1 times m32w's; act-order gathers and the portable path keep
  // their own bounds.
  EXPECT_EQ(choose_gemm_config(160, 8, 128, false, false, 0), m8);     // Qwen3-30B-A3B: 10 per expert, 1.70
  EXPECT_EQ(choose_gemm_config(160, 8, 128, false, false, -1), m32w);  // the same tokens on a wide layer
  EXPECT_EQ(choose_gemm_config(256, 8, 128, false, false, 0), m32w);   // 16 per expert, 2.43
  EXPECT_EQ(choose_gemm_config(107, 6, 64, false, false, 2), m8);      // DeepSeek-V2-Lite: 10 per expert, 1.90
  EXPECT_EQ(choose_gemm_config(128, 6, 64, false, false, 2), m32w);    // 12 per expert, 2.18
  EXPECT_EQ(choose_gemm_config(150, 4, 60, false, false, 4), m32w);    // Qwen1.5-MoE: 10 per expert, 2.22
  EXPECT_EQ(choose_gemm_config(160, 8, 128, true, false, 0), m32);     // act-order gather: to 8
  EXPECT_EQ(choose_gemm_config(512, 8, 128, false, true, 0), m8);      // portable: to 40
  EXPECT_EQ(choose_gemm_config(64, 2, 8, true), m32);
  EXPECT_NE(choose_gemm_config(256, 2, 8, false), m8);   // Mixtral: 64 per expert
  // E = 1, top-1: tokens per expert = M.
  for (bool gather : {false, true}) {
    EXPECT_EQ(choose_gemm_config(8, 1, 1, gather), m8);
    EXPECT_EQ(choose_gemm_config(9, 1, 1, gather), gather ? m32 : m32w);
    EXPECT_EQ(choose_gemm_config(28, 1, 1, gather), gather ? m32 : m32w);
    EXPECT_EQ(choose_gemm_config(29, 1, 1, gather), gather ? m32 : m64w);
    EXPECT_EQ(choose_gemm_config(40, 1, 1, gather), gather ? m32 : m64w);
    EXPECT_EQ(choose_gemm_config(41, 1, 1, gather), gather ? m64 : m64w);
    EXPECT_EQ(choose_gemm_config(60, 1, 1, gather), gather ? m64 : m64w);
    EXPECT_EQ(choose_gemm_config(61, 1, 1, gather), gather ? m64 : m96w);
    EXPECT_EQ(choose_gemm_config(80, 1, 1, gather), gather ? m64 : m96w);
    EXPECT_EQ(choose_gemm_config(81, 1, 1, gather), gather ? m64 : m144w);
    EXPECT_EQ(choose_gemm_config(100000, 1, 1, gather), gather ? m64 : m144w);
  }
  for (int c = 0; c < gemm_config_count(); ++c) EXPECT_EQ(config_named(gemm_config_name(c)), c);
  EXPECT_THROW(gemm_config_block_m(gemm_config_count()), Error);
}

// The portable path (forced here; below sm_90 the device decides): the mma.sync rows only, by the
// act-order rows' bounds, gathering or not.
TEST(MoeGemm, PortablePathChoosesTheMmaSyncRows) {
  const int m8 = config_named("m8"), m32 = config_named("m32"), m64 = config_named("m64");
  // Plain GEMMs: the decode kernel up to 40 tokens per expert, m64 above.
  EXPECT_EQ(choose_gemm_config(8, 1, 1, false, true), m8);
  EXPECT_EQ(choose_gemm_config(40, 1, 1, false, true), m8);
  EXPECT_EQ(choose_gemm_config(41, 1, 1, false, true), m64);
  EXPECT_EQ(choose_gemm_config(100000, 1, 1, false, true), m64);
  // GEMMs with their own act-order gather: the same rows as on the Hopper path.
  for (bool portable : {false, true}) {
    EXPECT_EQ(choose_gemm_config(8, 1, 1, true, portable), m8);
    EXPECT_EQ(choose_gemm_config(9, 1, 1, true, portable), m32);
    EXPECT_EQ(choose_gemm_config(40, 1, 1, true, portable), m32);
    EXPECT_EQ(choose_gemm_config(41, 1, 1, true, portable), m64);
    EXPECT_EQ(choose_gemm_config(100000, 1, 1, true, portable), m64);
  }
  for (int64_t M = 1; M <= 65536; M *= 2)
    EXPECT_FALSE(gemm_config_hopper(choose_gemm_config(M, 8, 256, false, true))) << "M=" << M;
  EXPECT_TRUE(gemm_config_hopper(config_named("m144w")));
  EXPECT_FALSE(gemm_config_hopper(m64));
  // Forced (the bench's and verify's --portable), the path needs no device to answer.
  force_portable_path(true);
  EXPECT_TRUE(portable_path());
  EXPECT_STREQ(gpu_path_name(), "portable");
  force_portable_path(gpu_test::kPortablePath);  // as the run set it (scripts/gpu-check --portable)
}

// The expected m-block count of the decode work model (host-only): exact small cases, a Monte
// Carlo estimate of uniform top-k routing, and refusal of sizes below 1.
TEST(MoeGemm, ExpectedMblocksMatchesSampling) {
  EXPECT_NEAR(expected_mblocks(1, 2, 8, 8), 2.0, 1e-9);      // one token: topk blocks
  EXPECT_NEAR(expected_mblocks(16, 8, 8, 8), 16.0, 1e-9);    // every expert gets all 16 tokens
  EXPECT_NEAR(expected_mblocks(5, 1, 1, 8), 1.0, 1e-9);
  std::mt19937_64 rng(5);
  struct C { int64_t M, k, E, bm; };
  for (const C c : {C{16, 2, 8, 8}, C{64, 9, 257, 8}, C{200, 8, 128, 8}, C{1000, 6, 64, 32}}) {
    double sum = 0;
    const int trials = 400;
    for (int t = 0; t < trials; ++t) {
      std::vector<int64_t> n(size_t(c.E), 0);
      for (int64_t m = 0; m < c.M; ++m) {
        std::vector<int64_t> pick;
        while (int64_t(pick.size()) < c.k) {
          const int64_t e = int64_t(rng() % uint64_t(c.E));
          if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
        }
        for (int64_t e : pick) ++n[size_t(e)];
      }
      for (int64_t v : n) sum += double((v + c.bm - 1) / c.bm);
    }
    const double sampled = sum / trials, model = expected_mblocks(c.M, c.k, c.E, c.bm);
    EXPECT_NEAR(model, sampled, 0.02 * sampled + 0.5) << "M=" << c.M << " topk=" << c.k << " E=" << c.E;
  }
  EXPECT_THROW(expected_mblocks(0, 2, 8, 8), Error);
  {
    const std::string err = test::error_of([&] { expected_mblocks(4, 2, 8, 0); });
    EXPECT_NE(err.find("bm=0"), std::string::npos) << err;
  }
}

// The k-permuted activation layout (host-only): a bijection inside each 64-element chunk that keeps
// element pairs together and stores real pair 8w + u at pair position 4u + w; and the launcher
// refuses it outside m144w, on a misaligned x, or on a GEMM2 output.
TEST(MoeGemm, KpermLayoutAndRefusals) {
  std::vector<int> seen(128, 0);
  for (int64_t k = 0; k < 128; ++k) {
    const int64_t p = kperm_pos(k);
    ASSERT_EQ(p / 64, k / 64) << "k=" << k << " left its chunk";
    ++seen[size_t(p)];
    const int64_t rp = (k % 64) / 2, u = rp % 8, w = rp / 8;
    EXPECT_EQ(p % 64, 2 * (4 * u + w) + k % 2) << "k=" << k;
  }
  for (int v : seen) EXPECT_EQ(v, 1);
  int dummy[8] = {};
  const DeviceGemm d = tiny_host_gemm(dummy);
  GemmRun r;
  r.epilogue = GemmEpilogue::SiluMul;
  r.x = dummy;
  r.out = dummy;
  r.sorted_ids = dummy;
  r.expert_ids = dummy;
  r.num_tokens_post_padded = dummy;
  r.topk = 1;
  r.num_slots = 1;
  r.x_stride = 64;
  r.x_kperm = true;
  auto refusal = [&](const GemmRun& run) {
    return test::error_of([&] { launch_moe_gemm(d, run, nullptr); });
  };
  r.config = config_named("m64");
  EXPECT_NE(refusal(r).find("for the wgmma configs (m32w, m64w, m96w, m144w)"), std::string::npos) << refusal(r);
  r.config = config_named("m144w");
  r.x = reinterpret_cast<const char*>(dummy) + 2;
  EXPECT_NE(refusal(r).find("16-byte aligned"), std::string::npos) << refusal(r);
  r.x = dummy;
  r.x_stride = 60;
  EXPECT_NE(refusal(r).find("x_stride (60)"), std::string::npos) << refusal(r);
  r.x_stride = 64;
  r.x_kperm = false;
  r.out_kperm = true;
  r.epilogue = GemmEpilogue::WeightedSum;
  EXPECT_NE(refusal(r).find("out_kperm needs the SiluMul epilogue"), std::string::npos) << refusal(r);
}

// The staged and prefill kernels index x with 32-bit element offsets: a GEMM whose x would not fit
// is refused before launch, naming the sizes (host-only: runs without a GPU too).
TEST(MoeGemm, RefusesXBeyondIndexRange) {
  int dummy = 0;
  const DeviceGemm d = tiny_host_gemm(&dummy);
  GemmRun r;
  r.config = 2;
  r.epilogue = GemmEpilogue::SiluMul;
  r.x = &dummy;
  r.out = &dummy;
  r.sorted_ids = &dummy;
  r.expert_ids = &dummy;
  r.num_tokens_post_padded = &dummy;
  r.topk = 1;
  r.num_slots = int64_t(1) << 30;  // 2^30 token rows of 64 elements
  r.x_stride = 64;
  {
    const std::string err = test::error_of([&] { launch_moe_gemm(d, r, nullptr); });
    EXPECT_NE(err.find("2^31 element index range"), std::string::npos) << err;
  }
}

// The handoff's slots (handoff_pairs_per_slot): an even number of tile pairs each (a warp's unit of
// two pairs never straddles two slots), every pair of GEMM1 in one of the kHandoffSlots counters of
// its m-block, none of them empty but the ones past the last pair. Host only.
TEST(MoeGemm, HandoffSlotsHoldEveryPair) {
  for (int64_t pairs : {1, 2, 3, 7, 8, 16, 17, 64, 128, 895, 896, 1024, 7168}) {
    const int64_t pps = handoff_pairs_per_slot(pairs);
    EXPECT_EQ(pps % 2, 0) << pairs << " pairs";
    EXPECT_LT((pairs - 1) / pps, kHandoffSlots) << pairs << " pairs: the last pair is past the counters";
    EXPECT_GE(pps * kHandoffSlots, pairs) << pairs << " pairs";
  }
  EXPECT_THROW(handoff_pairs_per_slot(0), Error);
}

// GEMM2's per-slot rows (gemm2_part_rows): at least one per slot, room for 32 K splits at a few
// tokens, and never fewer for more tokens, so a workspace sized for max_m tokens holds every
// smaller call's rows. Host only.
TEST(MoeGemm, Gemm2PartRowsGrowWithM) {
  for (int64_t k2 : {1, 2, 9}) {
    int64_t prev = 0;
    for (int64_t M = 0; M <= 4096; ++M) {
      const int64_t rows = gemm2_part_rows(M, k2);
      EXPECT_GE(rows, M * k2) << "M=" << M << " k2=" << k2;
      EXPECT_GE(rows, prev) << "M=" << M << " k2=" << k2 << ": fewer rows than for M-1";
      if (M >= 1 && M <= 8) {
        EXPECT_GE(rows, 32 * M * k2) << "M=" << M << ": no room for 32 splits";
      }
      prev = rows;
    }
  }
}

// Where the layer runs GEMM1's shared-slice items in K parts (shared_slice_parts_pay): one token,
// int4 with groups of 64-256, K * bits >= 16384. DeepSeek-V3 (K=7168) yes; Qwen1.5-MoE (K=2048)
// no; never at 4 tokens, int8, groups of 32 or per channel, or act-order. Host only.
TEST(MoeGemm, SharedSlicePartsWhereItemsAreLong) {
  int dummy[8] = {};
  auto shape = [&](int bits, int64_t K, int64_t group) { return host_gemm_shape(dummy, bits, 9, K, 4096, group); };
  EXPECT_TRUE(shared_slice_parts_pay(shape(4, 7168, 128), 1));
  EXPECT_TRUE(shared_slice_parts_pay(shape(4, 4096, 64), 1));
  EXPECT_FALSE(shared_slice_parts_pay(shape(4, 7168, 128), 4));
  EXPECT_FALSE(shared_slice_parts_pay(shape(4, 2048, 128), 1));
  EXPECT_FALSE(shared_slice_parts_pay(shape(8, 7168, 128), 1));
  EXPECT_FALSE(shared_slice_parts_pay(shape(4, 7168, 32), 1));
  EXPECT_FALSE(shared_slice_parts_pay(shape(4, 7168, 7168), 1));
  DeviceGemm act_order = shape(4, 7168, 128);
  act_order.perm = dummy;
  EXPECT_FALSE(shared_slice_parts_pay(act_order, 1));
}

// Where the decode kernel routes one token itself (decode_routes_token: int4 in groups of 128,
// no act-order, whole groups along K), and launch_moe_gemm refusing route_logits elsewhere, naming
// the value, before anything is launched. Host only.
TEST(MoeGemm, RoutesOneTokenOnlyWhereTheVariantExists) {
  int dummy[8] = {};
  auto shape = [&](int bits, int64_t K, int64_t group) { return host_gemm_shape(dummy, bits, 8, K, 256, group); };
  EXPECT_TRUE(decode_routes_token(shape(4, 4096, 128)));
  EXPECT_FALSE(decode_routes_token(shape(4, 4096, 64)));
  EXPECT_FALSE(decode_routes_token(shape(4, 4096, 4096)));
  EXPECT_FALSE(decode_routes_token(shape(8, 4096, 128)));
  EXPECT_FALSE(decode_routes_token(shape(4, 192, 64)));
  DeviceGemm act_order = shape(4, 4096, 128);
  act_order.perm = dummy;
  EXPECT_FALSE(decode_routes_token(act_order));

  const float logits[8] = {};
  auto run = [&](int E, int topk, int64_t slots) {
    GemmRun r;
    r.topk = topk;
    r.num_slots = slots;
    r.sorted_ids = r.expert_ids = r.num_tokens_post_padded = dummy;
    r.max_blocks = 64;
    r.x = r.out = dummy;
    r.x_stride = 4096;
    r.route_logits = logits;
    r.route_E = E;
    r.route_topk = topk;
    return r;
  };
  auto refusal = [](const DeviceGemm& w, const GemmRun& r) {
    return test::error_of([&] { launch_moe_gemm(w, r, nullptr); });
  };
  const DeviceGemm w = shape(4, 4096, 128);
  EXPECT_NE(refusal(w, run(33, 2, 2)).find("E=33"), std::string::npos) << refusal(w, run(33, 2, 2));
  EXPECT_NE(refusal(w, run(8, 2, 4)).find("num_slots=4"), std::string::npos) << "two tokens";
  EXPECT_NE(refusal(w, run(2, 3, 3)).find("top_k=3"), std::string::npos) << "top_k > E";
  EXPECT_NE(refusal(shape(8, 4096, 128), run(8, 2, 2)).find("bits 8"), std::string::npos) << "int8";
  EXPECT_NE(refusal(shape(4, 4096, 64), run(8, 2, 2)).find("group length 64"), std::string::npos) << "group 64";
}

}  // namespace
}  // namespace wna16::cuda
#endif
