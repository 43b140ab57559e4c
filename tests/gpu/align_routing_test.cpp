// GPU align and routing kernels against the CPU reference (wna16/reference.h): align bit for bit,
// routing ids exactly and weights within 1e-6 relative. Outputs are poisoned before every launch;
// graph capture then replay with new inputs must equal the eager call.
#include "gpu/gpu_test_util.h"

#ifdef WNA16_HAVE_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "bench/cuda/align_bench.h"
#include "cuda/moe_layer_kernels.h"
#include "test_util.h"
#include "wna16/cuda_kernels.h"
#include "wna16/error.h"
#include "wna16/half.h"
#include "wna16/reference.h"

using namespace wna16;
using wna16::gpu_test::cases;
using wna16::gpu_test::DevBuf;
using wna16::gpu_test::first_mismatch;
using wna16::gpu_test::kPoison;
using wna16::gpu_test::under_sanitizer;

namespace {

using test::error_of;

// ---- align ------------------------------------------------------------------------------------

struct AlignBuffers {
  DevBuf<int32_t> ids, sorted, experts, post;
  AlignBuffers(int64_t num_slots, int E, int block_m)
      : ids(size_t(num_slots)),
        sorted(size_t(max_padded_slots(num_slots, E, block_m))),
        experts(size_t(max_align_blocks(num_slots, E, block_m))),
        post(1) {}
  void poison() {
    sorted.poison();
    experts.poison();
    post.poison();
  }
};

void launch_align_on(AlignBuffers& b, int64_t num_slots, int E, int block_m, cudaStream_t s,
                     const cuda::AlignTuning* tuning = nullptr) {
  if (tuning)
    cuda::launch_align_tuned(b.ids.p, num_slots, E, block_m, b.sorted.p, b.experts.p, b.post.p, *tuning, s);
  else
    cuda::launch_align(b.ids.p, num_slots, E, block_m, b.sorted.p, b.experts.p, b.post.p, s);
}

// Every kernel variant the micro-benchmark compares; each must be bit-exact.
std::vector<cuda::AlignTuning> align_tunings() {
  using T = cuda::AlignTuning;
  return {T{.match_any = false, .slots_per_cta = 4096, .plain_single = false, .pdl = false, .name = "ballot/4096"},
          T{.match_any = true, .slots_per_cta = 4096, .plain_single = false, .pdl = false, .name = "match/4096"},
          T{.match_any = false, .slots_per_cta = 2048, .plain_single = false, .pdl = false, .name = "ballot/2048"},
          T{.match_any = true, .slots_per_cta = 2048, .plain_single = false, .pdl = false, .name = "match/2048"},
          T{.match_any = false, .slots_per_cta = 8192, .plain_single = false, .pdl = false, .name = "ballot/8192"},
          T{.match_any = false, .slots_per_cta = 1024, .plain_single = false, .pdl = false, .name = "ballot/1024"},
          T{.match_any = false, .slots_per_cta = 4096, .plain_single = true, .pdl = false, .name = "ballot/4096/plain1"},
          T{.match_any = false, .slots_per_cta = 4096, .plain_single = false, .pdl = true, .name = "ballot/4096/pdl"},
          T{.match_any = true, .slots_per_cta = 2048, .plain_single = false, .pdl = true, .name = "match/2048/pdl"},
          T{.match_any = false, .slots_per_cta = 2048, .plain_single = false, .pdl = true, .name = "ballot/2048/pdl"},
          T{.match_any = false, .slots_per_cta = 1024, .plain_single = false, .pdl = true, .name = "ballot/1024/pdl"},
          // Scattered straight to global memory (the path of CTAs whose slots do not fit the staging buffer).
          T{.match_any = false, .slots_per_cta = 2048, .plain_single = false, .pdl = true, .stage = false,
            .name = "ballot/2048/pdl/unstaged"},
          T{.match_any = true, .slots_per_cta = 4096, .plain_single = false, .pdl = false, .stage = false,
            .name = "match/4096/unstaged"},
          // The cluster kernel also where the small path would take over (num_slots <= 1024).
          T{.match_any = false, .slots_per_cta = 2048, .plain_single = false, .pdl = true, .small_max_slots = 0,
            .name = "ballot/2048/pdl/nosmall"},
          T{.match_any = true, .slots_per_cta = 2048, .plain_single = true, .pdl = false, .small_max_slots = 0,
            .name = "match/2048/plain1/nosmall"},
          T{.match_any = false, .slots_per_cta = 64, .plain_single = false, .pdl = true, .small_max_slots = 0,
            .name = "ballot/64/pdl/nosmall"},
          // The small path with match_any, without PDL, and with a low threshold.
          T{.match_any = true, .slots_per_cta = 2048, .plain_single = false, .pdl = true, .small_max_slots = 1024,
            .name = "match/small"},
          T{.match_any = false, .slots_per_cta = 2048, .plain_single = false, .pdl = false, .small_max_slots = 100,
            .name = "ballot/small100/nopdl"}};
}

// Compares the device outputs with align_reference; returns an empty string when equal.
std::string compare_align(const AlignBuffers& b, const std::vector<int32_t>& ids, int E, int block_m) {
  const AlignResult ref = align_reference(ids.data(), int64_t(ids.size()), E, block_m);
  const auto sorted = b.sorted.download();
  const auto experts = b.experts.download();
  const auto post = b.post.download();
  char buf[256];
  if (post[0] != ref.num_tokens_post_padded) {
    std::snprintf(buf, sizeof buf, "num_tokens_post_padded %d, expected %d", post[0], ref.num_tokens_post_padded);
    return buf;
  }
  if (int64_t i = first_mismatch(sorted, ref.sorted_token_ids); i >= 0) {
    std::snprintf(buf, sizeof buf, "sorted_token_ids[%lld] = %d, expected %d (length %zu)", (long long)i,
                  sorted[size_t(i)], ref.sorted_token_ids[size_t(i)], sorted.size());
    return buf;
  }
  if (int64_t i = first_mismatch(experts, ref.expert_ids); i >= 0) {
    std::snprintf(buf, sizeof buf, "expert_ids[%lld] = %d, expected %d (length %zu)", (long long)i,
                  experts[size_t(i)], ref.expert_ids[size_t(i)], experts.size());
    return buf;
  }
  return "";
}

enum class Dist { Uniform, EvenExpertsOnly, OneExpert, LastExpert, Skewed, Ascending, DistinctPerToken };
const char* dist_name(Dist d) {
  switch (d) {
    case Dist::Uniform: return "uniform";
    case Dist::EvenExpertsOnly: return "even-experts-only";
    case Dist::OneExpert: return "one-expert";
    case Dist::LastExpert: return "last-expert";
    case Dist::Skewed: return "skewed";
    case Dist::Ascending: return "ascending";
    case Dist::DistinctPerToken: return "distinct-per-token";
  }
  return "?";
}

std::vector<int32_t> make_ids(Dist d, int64_t n, int E, std::mt19937_64& rng) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  std::uniform_int_distribution<int32_t> any(0, E - 1);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const int32_t one = any(rng);
  for (int64_t s = 0; s < n; ++s) {
    int32_t v = 0;
    switch (d) {
      case Dist::Uniform: v = any(rng); break;
      case Dist::EvenExpertsOnly: v = (any(rng) / 2) * 2; break;  // odd experts get no slot
      case Dist::OneExpert: v = one; break;
      case Dist::LastExpert: v = E - 1; break;
      case Dist::Skewed: v = std::min<int32_t>(E - 1, int32_t(E * std::pow(u(rng), 4.0))); break;
      case Dist::Ascending: v = int32_t(s * E / std::max<int64_t>(n, 1)); break;
      case Dist::DistinctPerToken: v = any(rng); break;  // fixed below
    }
    ids[size_t(s)] = v;
  }
  if (d == Dist::DistinctPerToken) {  // top_k = min(8, E) distinct experts per token, as routing gives
    const int k = std::min(8, E);
    for (int64_t t = 0; t * k < n; ++t) {
      for (int j = 0; j < k && t * k + j < n; ++j) {
        int32_t v;
        bool seen;
        do {  // rejection: at most 8 draws out of E, cheap even for E = 8
          v = any(rng);
          seen = false;
          for (int i = 0; i < j; ++i) seen = seen || ids[size_t(t * k + i)] == v;
        } while (seen);
        ids[size_t(t * k + j)] = v;
      }
    }
  }
  return ids;
}

void check_align_case(int64_t n, int E, int block_m, Dist d, std::mt19937_64& rng, cudaStream_t s,
                      const cuda::AlignTuning* tuning = nullptr) {
  const auto ids = make_ids(d, n, E, rng);
  AlignBuffers b(n, E, block_m);
  b.ids.upload(ids);
  b.poison();
  launch_align_on(b, n, E, block_m, s, tuning);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaStreamSynchronize(s));
  const std::string err = compare_align(b, ids, E, block_m);
  EXPECT_EQ(err, "") << "E=" << E << " block_m=" << block_m << " num_slots=" << n << " ids=" << dist_name(d)
                     << " tuning=" << (tuning ? tuning->name : "default");
}

class AlignGpu : public gpu_test::StreamTest {
 protected:
  std::mt19937_64 rng_{20261130};
};

TEST_F(AlignGpu, MatchesReferenceAcrossExpertsBlockSizesAndSlots) {
  WNA16_REQUIRE_GPU();
  for (int E : cases<int>({1, 8, 64, 256, 512}, {1, 64, 512}))
    for (int block_m : cases<int>({1, 8, 16, 64, 128}, {1, 16, 128}))
      for (int64_t n : cases<int64_t>({1, 5, 100, 1000, 4099, 32768, 100003, 262144}, {1, 100, 4099}))
        check_align_case(n, E, block_m, Dist::Uniform, rng_, stream_);
}

TEST_F(AlignGpu, ZeroTokenExpertsOneExpertAndSkew) {
  WNA16_REQUIRE_GPU();
  for (Dist d : {Dist::EvenExpertsOnly, Dist::OneExpert, Dist::LastExpert, Dist::Skewed, Dist::Ascending,
                 Dist::DistinctPerToken})
    for (int E : cases<int>({1, 8, 64, 256, 512}, {1, 256}))
      for (int block_m : cases<int>({1, 16, 128}, {16}))
        for (int64_t n : cases<int64_t>({1, 3, 17 * 8, 4096, 65537}, {3, 17 * 8, 4096}))
          check_align_case(n, E, block_m, d, rng_, stream_);
}

TEST_F(AlignGpu, ThousandExpertsAndOddBlockSizes) {
  WNA16_REQUIRE_GPU();
  for (int E : cases<int>({3, 60, 160, 1000, 1024}, {3, 1000}))
    for (int block_m : cases<int>({2, 3, 48, 256}, {3, 256}))
      for (int64_t n : cases<int64_t>({7, 8192, 300001}, {7, 4099}))
        check_align_case(n, E, block_m, Dist::Uniform, rng_, stream_);
}

TEST_F(AlignGpu, EveryTuningMatchesReference) {
  WNA16_REQUIRE_GPU();
  // E = 9, 65, 257: one past the id widths of the ballot variants (3, 6, 8 bits).
  for (const cuda::AlignTuning& t : align_tunings())
    for (int E : cases<int>({1, 8, 9, 64, 65, 256, 257, 512, 1024}, {9, 65, 257, 1024}))
      for (int block_m : cases<int>({1, 16, 128}, {16}))
        for (int64_t n : cases<int64_t>({1, 100, 4099, 32768, 262144}, {100, 4099}))
          for (Dist d : cases<Dist>({Dist::Uniform, Dist::OneExpert, Dist::Skewed}, {Dist::Skewed}))
            check_align_case(n, E, block_m, d, rng_, stream_, &t);
}

// A short version of the above for compute-sanitizer runs.
TEST_F(AlignGpu, EveryTuningSmall) {
  WNA16_REQUIRE_GPU();
  for (const cuda::AlignTuning& t : align_tunings())
    for (int E : {8, 256, 1024})
      for (int64_t n : cases<int64_t>({100, 32768}, {100, 4099}))
        check_align_case(n, E, 16, Dist::Uniform, rng_, stream_, &t);
}

TEST_F(AlignGpu, TwoToThe24Slots) {
  WNA16_REQUIRE_GPU();
  // (Under a sanitizer 2^15 slots: the same multi-CTA cluster path, past the one-CTA sizes.)
  const int64_t n = under_sanitizer() ? int64_t(1) << 15 : int64_t(1) << 24;
  check_align_case(n, 1024, 128, Dist::Uniform, rng_, stream_);
  check_align_case(n, 256, 1, Dist::DistinctPerToken, rng_, stream_);
}

TEST_F(AlignGpu, NoSlots) {
  WNA16_REQUIRE_GPU();
  // num_slots = 0: every entry is the sentinel 0, every block -1, the padded total 0.
  for (int block_m : {1, 16}) {
    AlignBuffers b(0, 8, block_m);
    b.poison();
    launch_align_on(b, 0, 8, block_m, stream_);
    CUDA_OK(cudaStreamSynchronize(stream_));
    EXPECT_EQ(compare_align(b, {}, 8, block_m), "") << "block_m=" << block_m;
  }
}

// The small path (one plain CTA, num_slots <= kAlignSmallMaxSlots) and both sides of its threshold:
// 0 and 1 slot, warp boundaries, E up to 1024 (also not a multiple of 32), zero-token experts,
// every slot on one expert, the decode shapes (top_k + shared distinct experts per token).
TEST_F(AlignGpu, SmallPathAroundThreshold) {
  WNA16_REQUIRE_GPU();
  const int64_t T = cuda::kAlignSmallMaxSlots;
  for (int E : cases<int>({1, 3, 8, 9, 33, 65, 256, 257, 1000, 1024}, {1, 9, 257, 1024}))
    for (int block_m : cases<int>({1, 8, 16, 32, 64}, {1, 16}))
      for (int64_t n : cases<int64_t>({0, 1, 2, 9, 31, 32, 33, 144, 511, T - 1, T, T + 1, T + 100},
                                      {0, 1, 31, 33, T - 1, T, T + 1}))
        for (Dist d : cases<Dist>({Dist::Uniform, Dist::OneExpert, Dist::LastExpert, Dist::EvenExpertsOnly,
                                   Dist::Ascending, Dist::DistinctPerToken},
                                  {Dist::Uniform, Dist::OneExpert, Dist::DistinctPerToken}))
          check_align_case(n, E, block_m, d, rng_, stream_);
}

// A tuning threshold inside the small range: the last small and the first cluster size.
TEST_F(AlignGpu, SmallPathTuningThreshold) {
  WNA16_REQUIRE_GPU();
  for (int limit : {1, 32, 100, 1024}) {
    const cuda::AlignTuning t{.small_max_slots = limit, .name = "small-threshold"};
    for (int E : {8, 257, 1024})
      for (int64_t n : {int64_t(limit) - 1, int64_t(limit), int64_t(limit) + 1})
        for (Dist d : {Dist::Uniform, Dist::OneExpert})
          check_align_case(n, E, 16, d, rng_, stream_, &t);
  }
  const cuda::AlignTuning bad{.small_max_slots = 5000};
  AlignBuffers b(16, 8, 4);
  EXPECT_NE(error_of([&] { launch_align_on(b, 16, 8, 4, stream_, &bad); }).find("small_max_slots=5000"),
            std::string::npos);
}

// Every align code path with small inputs, fast enough to run under
// `compute-sanitizer --tool racecheck` (and memcheck, synccheck): the small path, the cluster
// kernel as one CTA (cluster and plain launch), and as a cluster of several CTAs, staged or not.
TEST_F(AlignGpu, RacecheckSmall) {
  WNA16_REQUIRE_GPU();
  using T = cuda::AlignTuning;
  const std::vector<T> paths = {
      T{.name = "default (small path)"},
      T{.match_any = true, .name = "small path, match_any"},
      T{.slots_per_cta = 2048, .pdl = true, .small_max_slots = 0, .name = "one CTA, cluster launch"},
      T{.slots_per_cta = 2048, .plain_single = true, .pdl = false, .small_max_slots = 0, .name = "one CTA, plain"},
      T{.slots_per_cta = 64, .pdl = true, .small_max_slots = 0, .name = "cluster of several CTAs"},
      T{.match_any = true, .slots_per_cta = 64, .pdl = false, .small_max_slots = 0, .name = "cluster, match_any"},
      T{.slots_per_cta = 64, .pdl = true, .stage = false, .small_max_slots = 0, .name = "cluster, unstaged"}};
  // E = 600: the 1024-thread cluster kernel (E > 512).
  for (const T& t : paths)
    for (int E : {9, 257, 600})
      for (int64_t n : {int64_t(0), int64_t(37), int64_t(300)})
        check_align_case(n, E, 16, Dist::Uniform, rng_, stream_, &t);
}

TEST_F(AlignGpu, GraphReplayWithNewIdsEqualsEager) {
  WNA16_REQUIRE_GPU();
  const int E = 256, block_m = 64;
  // (Under a sanitizer 2048 slots, above the one-CTA small path, and one distribution.)
  const int64_t n = under_sanitizer() ? 2048 : 4096 * 8;
  std::vector<cuda::AlignTuning> tunings = align_tunings();
  tunings.insert(tunings.begin(), cuda::kAlignDefaultTuning);
  for (const cuda::AlignTuning& t : tunings) {
    AlignBuffers g(n, E, block_m), e(n, E, block_m);
    auto first = make_ids(Dist::DistinctPerToken, n, E, rng_);
    g.ids.upload(first);
    g.poison();
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
    launch_align_on(g, n, E, block_m, stream_, &t);
    launch_align_on(g, n, E, block_m, stream_, &t);  // twice: kernel-to-kernel edges (pdl) in the graph too
    CUDA_OK(cudaStreamEndCapture(stream_, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphLaunch(exec, stream_));
    CUDA_OK(cudaStreamSynchronize(stream_));
    EXPECT_EQ(compare_align(g, first, E, block_m), "") << "first replay, tuning " << t.name;
    for (Dist d : cases<Dist>({Dist::Uniform, Dist::OneExpert, Dist::EvenExpertsOnly}, {Dist::Uniform})) {
      const auto ids = make_ids(d, n, E, rng_);
      g.ids.upload(ids);
      g.poison();
      CUDA_OK(cudaGraphLaunch(exec, stream_));
      e.ids.upload(ids);
      e.poison();
      launch_align_on(e, n, E, block_m, stream_, &t);
      CUDA_OK(cudaStreamSynchronize(stream_));
      EXPECT_EQ(g.sorted.download(), e.sorted.download()) << dist_name(d) << " " << t.name;
      EXPECT_EQ(g.experts.download(), e.experts.download()) << dist_name(d) << " " << t.name;
      EXPECT_EQ(g.post.download(), e.post.download()) << dist_name(d) << " " << t.name;
      EXPECT_EQ(compare_align(g, ids, E, block_m), "") << "replay, " << dist_name(d) << " " << t.name;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

TEST_F(AlignGpu, RefusesBadArgumentsNamingTheValue) {
  WNA16_REQUIRE_GPU();
  AlignBuffers b(16, 8, 4);
  auto call = [&](int64_t n, int E, int bm) { cuda::launch_align(b.ids.p, n, E, bm, b.sorted.p, b.experts.p, b.post.p, stream_); };
  EXPECT_NE(error_of([&] { call(16, 0, 4); }).find("E=0"), std::string::npos);
  EXPECT_NE(error_of([&] { call(16, -3, 4); }).find("E=-3"), std::string::npos);
  EXPECT_NE(error_of([] { cuda::bench_align_us(8, 16, 4, cuda::kAlignDefaultTuning, 0); }).find("replays=0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { call(16, 2000, 4); }).find("E=2000"), std::string::npos);
  EXPECT_NE(error_of([&] { call(16, 8, 0); }).find("block_m=0"), std::string::npos);
  EXPECT_NE(error_of([&] { call(-1, 8, 4); }).find("num_slots=-1"), std::string::npos);
  EXPECT_NE(error_of([&] { call(int64_t(1) << 31, 8, 4); }).find("num_slots=2147483648"), std::string::npos);
  EXPECT_NE(error_of([&] {
              cuda::launch_align(nullptr, 16, 8, 4, b.sorted.p, b.experts.p, b.post.p, stream_);
            }).find("topk_ids is null"),
            std::string::npos);
  CUDA_OK(cudaStreamSynchronize(stream_));
}

TEST(AlignGpuBench, PrintsMicroseconds) {
  WNA16_REQUIRE_GPU();
  // (Under a sanitizer one timed replay per case: the timings mean nothing there.)
  const int replays = under_sanitizer() ? 1 : cuda::kAlignBenchReplays;
  std::printf("[align bench] largest cluster: %d CTAs\n", cuda::align_max_cluster_size());
  for (int n_cta : {1, 8, 16}) {
    if (n_cta > cuda::align_max_cluster_size()) continue;
    std::printf("[align bench] empty kernel, %d x 1024 threads, cluster: %.2f us\n", n_cta,
                cuda::bench_align_noop_us(n_cta, true, replays));
  }
  std::printf("[align bench] empty kernel, 1 x 1024 threads, plain: %.2f us\n",
              cuda::bench_align_noop_us(1, false, replays));
  struct Case { int E; int64_t n; int bm; };
  // (Under a sanitizer the timings mean nothing: two small cases, each tuning, checked outputs.)
  const std::vector<Case> bench_cases = cases<Case>(
      {{256, 32768, 16}, {256, 32768, 64}, {256, 32768, 128}, {8, 2, 16}, {256, 8, 16}, {256, 4096, 16},
       {128, 8192, 64}, {8, 8192, 16}, {512, 262144, 64}, {512, 262144, 128}, {1024, 262144, 128}},
      {{8, 2, 16}, {256, 300, 16}});
  std::printf("[align bench] us per call (graph replay, median)\n[align bench] %-22s", "E/num_slots/block_m");
  const auto tunings = align_tunings();
  for (const auto& t : tunings) std::printf(" %19s", t.name);
  std::printf("\n");
  for (const Case& c : bench_cases) {
    char label[64];
    std::snprintf(label, sizeof label, "%d/%lld/%d", c.E, (long long)c.n, c.bm);
    std::printf("[align bench] %-22s", label);
    for (const auto& t : tunings) {
      const double us = cuda::bench_align_us(c.E, c.n, c.bm, t, replays);
      std::printf(" %19.2f", us);
      EXPECT_GT(us, 0.0);
    }
    std::printf("\n");
  }
  if (under_sanitizer()) return;
  const double big = cuda::bench_align_us(256, int64_t(1) << 24, 128);
  std::printf("[align bench] default tuning, E=256 num_slots=16777216 block_m=128: %.2f us\n", big);
  EXPECT_GT(big, 0.0);
}

// ---- routing ----------------------------------------------------------------------------------

using test::routing;

std::string describe(const RoutingConfig& c) {
  return std::string(routing_name(c.method)) + " E=" + std::to_string(c.num_experts) + " k=" + std::to_string(c.top_k) +
         " renorm=" + std::to_string(c.renormalize) + " n_group=" + std::to_string(c.n_group) +
         " topk_group=" + std::to_string(c.topk_group) + " scale=" + std::to_string(c.routed_scaling_factor);
}

// The logits as the GPU reads them (dtype) and as fp32 values for the reference (the same numbers).
struct Logits {
  std::vector<float> f32;        // what the reference sees
  std::vector<uint16_t> half16;  // bf16 or fp16 bits, when dtype is not F32
};

float rounded(DType t, float v) { return round_to(t, v); }

// NOTE on near-ties: softmax and group_limited_greedy choose on the logits themselves (exp is
// monotonic), so fp32 and double agree exactly on any data, exact ties included. noaux_tc chooses on
// sigmoid(l) + bias, which fp32 rounds differently than double (a few 1e-7): a token whose keys
// (or group scores) come within 2e-6 (4e-6) of each other is redrawn, so a boundary can never sit
// inside the rounding noise. Exact ties for noaux_tc are tested on their own (integer logits, no bias).
bool noaux_well_separated(const float* l, const float* bias, int E, int n_group) {
  std::vector<double> key(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) key[size_t(e)] = 1.0 / (1.0 + std::exp(-double(l[e]))) + double(bias[e]);
  const int per = E / n_group;
  std::vector<double> gs;
  for (int g = 0; g < n_group; ++g) {
    std::vector<double> grp(key.begin() + g * per, key.begin() + (g + 1) * per);
    std::sort(grp.rbegin(), grp.rend());
    gs.push_back(grp[0] + grp[1]);
  }
  std::sort(key.begin(), key.end());
  for (size_t i = 1; i < key.size(); ++i)
    if (key[i] - key[i - 1] < 2e-6) return false;
  std::sort(gs.begin(), gs.end());
  for (size_t i = 1; i < gs.size(); ++i)
    if (gs[i] - gs[i - 1] < 4e-6) return false;
  return true;
}

Logits make_logits(const RoutingConfig& c, DType dtype, int64_t M, const std::vector<float>& bias, std::mt19937_64& rng) {
  const int E = c.num_experts;
  std::normal_distribution<float> nd(0.f, c.method == RoutingMethod::NoauxTc ? 1.f : 2.f);
  Logits L;
  L.f32.resize(size_t(M * E));
  for (int64_t m = 0; m < M; ++m) {
    float* row = L.f32.data() + m * E;
    for (int tries = 0;; ++tries) {
      for (int e = 0; e < E; ++e) row[e] = rounded(dtype, nd(rng));
      if (c.method != RoutingMethod::NoauxTc || noaux_well_separated(row, bias.data(), E, c.n_group)) break;
      if (tries > 10000) {
        ADD_FAILURE() << "could not draw well-separated noaux_tc logits for " << describe(c);
        break;
      }
    }
  }
  if (dtype != DType::F32) {
    L.half16.resize(L.f32.size());
    for (size_t i = 0; i < L.f32.size(); ++i)
      L.half16[i] = dtype == DType::BF16 ? float_to_bf16(L.f32[i]) : float_to_f16(L.f32[i]);
  }
  return L;
}

std::vector<float> make_bias(int E, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.f, 0.1f);
  std::vector<float> b(static_cast<size_t>(E));
  for (auto& v : b) v = nd(rng);
  return b;
}

struct RoutingRun {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// Uploads, poisons the outputs, launches on the stream (or captures and replays when graph), downloads.
RoutingRun run_routing(const RoutingConfig& c, DType dtype, int64_t M, const Logits& L, const std::vector<float>& bias,
                       cudaStream_t s) {
  const int E = c.num_experts, k = c.top_k;
  DevBuf<float> lf(dtype == DType::F32 ? size_t(M * E) : 0);
  DevBuf<uint16_t> lh(dtype == DType::F32 ? 0 : size_t(M * E));
  DevBuf<float> db{size_t(E)};
  DevBuf<int32_t> ids(size_t(M * k));
  DevBuf<float> w(size_t(M * k));
  if (dtype == DType::F32) lf.upload(L.f32); else lh.upload(L.half16);
  db.upload(bias);
  ids.poison();
  w.poison();
  const void* logits = dtype == DType::F32 ? static_cast<const void*>(lf.p) : static_cast<const void*>(lh.p);
  cuda::launch_routing(c, logits, dtype, M, c.method == RoutingMethod::NoauxTc ? db.p : nullptr, ids.p, w.p, s);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  return {ids.download(), w.download()};
}

void expect_routing_matches(const RoutingConfig& c, DType dtype, int64_t M, const Logits& L,
                            const std::vector<float>& bias, const RoutingRun& got, const std::string& what) {
  const Routing ref = route_reference(c, L.f32.data(), M, bias.data());
  int bad = 0;
  for (int64_t i = 0; i < M * c.top_k && bad < 5; ++i) {
    const float rw = ref.weights[size_t(i)], gw = got.weights[size_t(i)];
    const bool id_ok = got.ids[size_t(i)] == ref.ids[size_t(i)];
    const bool w_ok = std::fabs(double(gw) - double(rw)) <= 1e-6 * std::fabs(double(rw));
    if (!id_ok || !w_ok) {
      ++bad;
      ADD_FAILURE() << what << " " << describe(c) << " dtype=" << dtype_name(dtype) << " M=" << M << ": token "
                    << i / c.top_k << " choice " << i % c.top_k << ": id " << got.ids[size_t(i)] << " weight " << gw
                    << ", expected id " << ref.ids[size_t(i)] << " weight " << rw;
    }
  }
}

std::vector<RoutingConfig> routing_configs() {
  using RM = RoutingMethod;
  return {
      routing(RM::SoftmaxTopK, 8, 2, true),                  // Mixtral
      routing(RM::SoftmaxTopK, 60, 4, false),                // Qwen1.5-MoE
      routing(RM::SoftmaxTopK, 128, 8, true),                // Qwen3-30B-A3B
      routing(RM::SoftmaxTopK, 1, 1, true),
      routing(RM::SoftmaxTopK, 33, 5, false),                // E just past one warp
      routing(RM::SoftmaxTopK, 512, 16, false),
      routing(RM::SoftmaxTopK, 1024, 32, true),
      routing(RM::GroupLimitedGreedy, 64, 6, false, 1, 1, 1.0),     // DeepSeek-V2-Lite (greedy)
      routing(RM::GroupLimitedGreedy, 160, 6, false, 8, 3, 16.0),   // DeepSeek-V2
      routing(RM::GroupLimitedGreedy, 160, 6, true, 8, 3, 16.0),
      routing(RM::GroupLimitedGreedy, 512, 16, true, 16, 4, 1.0),
      routing(RM::NoauxTc, 256, 8, true, 8, 4, 2.5),                // DeepSeek-V3
      routing(RM::NoauxTc, 256, 8, false, 8, 4, 2.5),
      routing(RM::NoauxTc, 64, 6, true, 1, 1, 1.0),
      routing(RM::NoauxTc, 512, 16, true, 16, 8, 1.5),
      routing(RM::NoauxTc, 96, 4, true, 32, 2, 1.0),                 // 32 groups of 3
      routing(RM::GroupLimitedGreedy, 96, 4, true, 3, 2, 1.0),      // 3 groups: 8 lanes each, 8 idle
      routing(RM::NoauxTc, 160, 6, true, 5, 2, 2.0),                // 5 groups of 32, E not a power of 2
      routing(RM::NoauxTc, 1024, 32, true, 4, 2, 1.0),              // widest: 32 values per lane, k = 32
  };
}

class RoutingGpu : public gpu_test::StreamTest {
 protected:
  // Every routing variant and logit dtype on fresh random logits (and bias) for each M.
  void expect_random_routing_matches(std::initializer_list<int64_t> Ms, const char* what) {
    for (const RoutingConfig& c : routing_configs())
      for (DType dtype : {DType::F32, DType::BF16, DType::F16})
        for (int64_t M : Ms) {
          const auto bias = make_bias(c.num_experts, rng_);
          const Logits L = make_logits(c, dtype, M, bias, rng_);
          const RoutingRun got = run_routing(c, dtype, M, L, bias, stream_);
          expect_routing_matches(c, dtype, M, L, bias, got, what);
        }
  }
  std::mt19937_64 rng_{7};
};

TEST_F(RoutingGpu, EveryVariantAndDtypeMatchesReference) {
  WNA16_REQUIRE_GPU();
  expect_random_routing_matches({1, 3, 17, 118, 1024}, "random");
}

TEST_F(RoutingGpu, ExactTiesGoToTheLowerIndex) {
  WNA16_REQUIRE_GPU();
  // Integer logits in {0..3} (plenty of exact ties, no near-ties) and all-equal rows; no bias, so
  // noaux_tc's keys tie exactly too.
  for (const RoutingConfig& c : routing_configs()) {
    const int E = c.num_experts;
    const int64_t M = 64;
    std::vector<float> bias(size_t(E), 0.f);
    Logits L;
    L.f32.resize(size_t(M * E));
    std::uniform_int_distribution<int> small(0, 3);
    for (int64_t m = 0; m < M; ++m)
      for (int e = 0; e < E; ++e) L.f32[size_t(m * E + e)] = m < 4 ? 1.5f : float(small(rng_));
    const RoutingRun got = run_routing(c, DType::F32, M, L, bias, stream_);
    expect_routing_matches(c, DType::F32, M, L, bias, got, "ties");
    // An all-equal row picks 0..k-1 (lowest groups first for the grouped methods).
    for (int j = 0; j < c.top_k; ++j) EXPECT_EQ(got.ids[size_t(j)], j) << describe(c);
  }
}

TEST_F(RoutingGpu, GraphReplayWithNewLogitsEqualsEager) {
  WNA16_REQUIRE_GPU();
  const RoutingConfig c = routing(RoutingMethod::NoauxTc, 256, 8, true, 8, 4, 2.5);
  const int64_t M = 118;
  const auto bias = make_bias(256, rng_);
  DevBuf<float> logits(size_t(M * 256)), db(256), w(size_t(M * 8));
  DevBuf<int32_t> ids(size_t(M * 8));
  db.upload(bias);
  logits.upload(make_logits(c, DType::F32, M, bias, rng_).f32);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  cuda::launch_routing(c, logits.p, DType::F32, M, db.p, ids.p, w.p, stream_);
  CUDA_OK(cudaStreamEndCapture(stream_, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 3; ++rep) {
    const Logits L = make_logits(c, DType::F32, M, bias, rng_);
    logits.upload(L.f32);
    ids.poison();
    w.poison();
    CUDA_OK(cudaGraphLaunch(exec, stream_));
    CUDA_OK(cudaStreamSynchronize(stream_));
    const RoutingRun replay{ids.download(), w.download()};
    const RoutingRun eager = run_routing(c, DType::F32, M, L, bias, stream_);
    EXPECT_EQ(replay.ids, eager.ids);
    EXPECT_EQ(replay.weights, eager.weights);
    expect_routing_matches(c, DType::F32, M, L, bias, replay, "graph replay");
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// Decode sizes (one block, one to four warps busy) for every method and dtype.
TEST_F(RoutingGpu, SmallMEveryMethod) {
  WNA16_REQUIRE_GPU();
  expect_random_routing_matches({1, 2, 3, 16}, "small M");
}

// Exact ties at decode sizes, DeepSeek-V3 included: integer logits (ties inside and across groups),
// all-equal rows, and rows where only two values occur.
TEST_F(RoutingGpu, SmallMTies) {
  WNA16_REQUIRE_GPU();
  for (const RoutingConfig& c : routing_configs())
    for (int64_t M : {int64_t(1), int64_t(2), int64_t(3), int64_t(16)}) {
      const int E = c.num_experts;
      std::vector<float> bias(size_t(E), 0.f);
      Logits L;
      L.f32.resize(size_t(M * E));
      std::uniform_int_distribution<int> small(0, 3), two(0, 1);
      for (int64_t m = 0; m < M; ++m)
        for (int e = 0; e < E; ++e)
          L.f32[size_t(m * E + e)] = m == 0 ? 0.5f : m % 2 ? float(small(rng_)) : float(two(rng_));
      const RoutingRun got = run_routing(c, DType::F32, M, L, bias, stream_);
      expect_routing_matches(c, DType::F32, M, L, bias, got, "small-M ties");
      for (int j = 0; j < c.top_k; ++j) EXPECT_EQ(got.ids[size_t(j)], j) << describe(c) << " all-equal row";
    }
}

// The best experts all held by one lane (experts l, l + 32, l + 64, ...): the most candidates the
// top-k step can see (k lane maxima, each lane with up to E / 32 candidates). Softmax and
// group_limited only: their ids are exact on any input (noaux_tc near-ties are fp32 rounding).
TEST_F(RoutingGpu, TopChoicesInOneLane) {
  WNA16_REQUIRE_GPU();
  for (const RoutingConfig& c : routing_configs()) {
    if (c.method == RoutingMethod::NoauxTc) continue;
    const int E = c.num_experts;
    const int64_t M = 5;
    const std::vector<float> bias(size_t(E), 0.f);
    Logits L = make_logits(c, DType::F32, M, bias, rng_);
    for (int64_t m = 0; m < M; ++m) {
      const int lane = int(m * 7 % 32);
      // Decreasing along the lane, far above the random values; all equal (ties) when m == 4.
      for (int e = lane, j = 0; e < E; e += 32, ++j) L.f32[size_t(m * E + e)] = m == 4 ? 12.f : 20.f - 0.25f * float(j);
    }
    const RoutingRun got = run_routing(c, DType::F32, M, L, bias, stream_);
    expect_routing_matches(c, DType::F32, M, L, bias, got, "one lane");
  }
}

// The layer's routing launch: [M, top_k + S] with the S shared slices appended (id s, weight 1 or
// sigmoid(gate_logit[m])) and the routed ids offset by S, launched with programmatic dependent launch.
TEST_F(RoutingGpu, SharedSlotsAppended) {
  WNA16_REQUIRE_GPU();
  using RM = RoutingMethod;
  for (const RoutingConfig& c : {routing(RM::NoauxTc, 256, 8, true, 8, 4, 2.5), routing(RM::SoftmaxTopK, 60, 4, false),
                                 routing(RM::GroupLimitedGreedy, 64, 6, false, 1, 1, 1.0)})
    for (int S : {0, 1, 4, 40})
      for (bool gated : {false, true})
        for (int64_t M : {int64_t(1), int64_t(3), int64_t(16), int64_t(118)}) {
          const int E = c.num_experts, k = c.top_k, k2 = k + S;
          const auto bias = make_bias(E, rng_);
          const Logits L = make_logits(c, DType::F32, M, bias, rng_);
          std::vector<float> gate(static_cast<size_t>(M));
          std::normal_distribution<float> nd(0.f, 2.f);
          for (auto& g : gate) g = nd(rng_);
          DevBuf<float> lf(static_cast<size_t>(M * E)), db(static_cast<size_t>(E)), dg(static_cast<size_t>(M)),
              w(static_cast<size_t>(M * k2));
          DevBuf<int32_t> ids(static_cast<size_t>(M * k2));
          lf.upload(L.f32);
          db.upload(bias);
          dg.upload(gate);
          ids.poison();
          w.poison();
          cuda::launch_routing_with_shared(c, lf.p, M, c.method == RM::NoauxTc ? db.p : nullptr, gated ? dg.p : nullptr,
                                           S, ids.p, w.p, stream_);
          CUDA_OK(cudaStreamSynchronize(stream_));
          const auto gi = ids.download();
          const auto gw = w.download();
          RoutingRun routed;
          for (int64_t m = 0; m < M; ++m)
            for (int j = 0; j < k; ++j) {
              routed.ids.push_back(gi[size_t(m * k2 + j)] - S);
              routed.weights.push_back(gw[size_t(m * k2 + j)]);
            }
          const std::string what = "S=" + std::to_string(S) + (gated ? " gated" : "");
          expect_routing_matches(c, DType::F32, M, L, bias, routed, what);
          for (int64_t m = 0; m < M; ++m)
            for (int s2 = 0; s2 < S; ++s2) {
              const double want = gated ? 1.0 / (1.0 + std::exp(-double(gate[size_t(m)]))) : 1.0;
              EXPECT_EQ(gi[size_t(m * k2 + k + s2)], s2) << what << " M=" << M << " m=" << m;
              EXPECT_NEAR(gw[size_t(m * k2 + k + s2)], want, 1e-6 * want) << what << " M=" << M << " m=" << m;
            }
        }
}

// One token: the routing kernel writes the align tables itself (RoutingAlignOut), equal to
// align_reference of the ids it wrote, for every method, shared slices and block size; the
// requests it cannot serve are refused naming the value.
TEST_F(RoutingGpu, OneTokenRoutingWritesTheAlignTables) {
  WNA16_REQUIRE_GPU();
  using RM = RoutingMethod;
  for (const RoutingConfig& c : {routing(RM::NoauxTc, 256, 8, true, 8, 4, 2.5), routing(RM::SoftmaxTopK, 8, 2, true),
                                 routing(RM::SoftmaxTopK, 60, 4, false),
                                 routing(RM::GroupLimitedGreedy, 64, 6, false, 1, 1, 1.0)})
    for (int S : {0, 1, 4})
      for (int block_m : {8, 16, 64})
        for (int rep = 0; rep < 3; ++rep) {
          const int E = c.num_experts, k2 = c.top_k + S;
          const auto bias = make_bias(E, rng_);
          const Logits L = make_logits(c, DType::F32, 1, bias, rng_);
          DevBuf<float> lf(static_cast<size_t>(E)), db(static_cast<size_t>(E)), w(static_cast<size_t>(k2));
          AlignBuffers a(k2, E + S, block_m);
          lf.upload(L.f32);
          db.upload(bias);
          a.ids.poison();
          a.poison();
          cuda::RoutingAlignOut out;
          out.sorted = a.sorted.p;
          out.expert_ids = a.experts.p;
          out.ntpp = a.post.p;
          out.block_m = block_m;
          out.max_padded = int64_t(a.sorted.n);
          out.max_blocks = int64_t(a.experts.n);
          cuda::launch_routing_with_shared(c, lf.p, 1, c.method == RM::NoauxTc ? db.p : nullptr, nullptr, S, a.ids.p,
                                           w.p, stream_, out);
          CUDA_OK(cudaStreamSynchronize(stream_));
          const auto ids = a.ids.download();
          EXPECT_EQ(compare_align(a, ids, E + S, block_m), "")
              << "E=" << E << " k=" << c.top_k << " S=" << S << " block_m=" << block_m;
        }
  const RoutingConfig c = routing(RM::SoftmaxTopK, 8, 2, true);
  DevBuf<float> lf(16), w(16);
  AlignBuffers a(2, 8, 8);
  cuda::RoutingAlignOut out{a.sorted.p, a.experts.p, a.post.p, 8, int64_t(a.sorted.n), int64_t(a.experts.n)};
  auto refused = [&](int64_t M, const cuda::RoutingAlignOut& o, const std::string& what) {
    try {
      cuda::launch_routing_with_shared(c, lf.p, M, nullptr, nullptr, 0, a.ids.p, w.p, stream_, o);
      ADD_FAILURE() << what << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused(2, out, "M=2");
  cuda::RoutingAlignOut small = out;
  small.max_padded -= 1;
  refused(1, small, "max_padded=" + std::to_string(out.max_padded - 1));
}

// The layer's chain routing -> align (both programmatic dependent launches) captured in a graph,
// replayed on new logits: equal to the reference routing and align_reference of its ids.
TEST_F(RoutingGpu, GraphReplayOfRoutingAndAlignChain) {
  WNA16_REQUIRE_GPU();
  const RoutingConfig c = routing(RoutingMethod::NoauxTc, 256, 8, true, 8, 4, 2.5);
  const int E = 256, k = 8, S = 1, k2 = k + S, E2 = E + S, block_m = 16;
  for (int64_t M : {int64_t(1), int64_t(16), int64_t(200)}) {  // small path, small path, cluster
    const int64_t n = M * k2;
    const auto bias = make_bias(E, rng_);
    DevBuf<float> logits(static_cast<size_t>(M * E)), db(static_cast<size_t>(E)), w(static_cast<size_t>(n));
    AlignBuffers a(n, E2, block_m);
    db.upload(bias);
    logits.upload(make_logits(c, DType::F32, M, bias, rng_).f32);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
    cuda::launch_routing_with_shared(c, logits.p, M, db.p, nullptr, S, a.ids.p, w.p, stream_);
    cuda::launch_align(a.ids.p, n, E2, block_m, a.sorted.p, a.experts.p, a.post.p, stream_);
    CUDA_OK(cudaStreamEndCapture(stream_, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 3; ++rep) {
      const Logits L = make_logits(c, DType::F32, M, bias, rng_);
      logits.upload(L.f32);
      a.ids.poison();
      a.poison();
      w.poison();
      CUDA_OK(cudaGraphLaunch(exec, stream_));
      CUDA_OK(cudaStreamSynchronize(stream_));
      const auto ids2 = a.ids.download();
      const Routing ref = route_reference(c, L.f32.data(), M, bias.data());
      std::vector<int32_t> want(static_cast<size_t>(n));
      for (int64_t m = 0; m < M; ++m) {
        for (int j = 0; j < k; ++j) want[size_t(m * k2 + j)] = ref.ids[size_t(m * k + j)] + S;
        want[size_t(m * k2 + k)] = 0;  // the shared slice
      }
      EXPECT_EQ(ids2, want) << "M=" << M << " replay " << rep;
      EXPECT_EQ(compare_align(a, want, E2, block_m), "") << "M=" << M << " replay " << rep;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

TEST_F(RoutingGpu, RefusesBadArgumentsNamingTheValue) {
  WNA16_REQUIRE_GPU();
  DevBuf<float> logits(64), b(64), w(64);
  DevBuf<int32_t> ids(64);
  auto call = [&](const RoutingConfig& c, const float* bias = nullptr) {
    cuda::launch_routing(c, logits.p, DType::F32, 1, bias, ids.p, w.p, stream_);
  };
  using RM = RoutingMethod;
  EXPECT_NE(error_of([&] { call(routing(RM::SoftmaxTopK, 0, 1, true)); }).find("num_experts=0"), std::string::npos);
  EXPECT_NE(error_of([&] { call(routing(RM::SoftmaxTopK, 8, 9, true)); }).find("top_k=9"), std::string::npos);
  EXPECT_NE(error_of([&] { call(routing(RM::GroupLimitedGreedy, 10, 2, true, 3, 1)); }).find("n_group=3"),
            std::string::npos);
  EXPECT_NE(error_of([&] { call(routing(RM::SoftmaxTopK, 2048, 8, true)); }).find("num_experts=2048"),
            std::string::npos);
  EXPECT_NE(error_of([&] { call(routing(RM::SoftmaxTopK, 64, 40, true)); }).find("top_k=40"), std::string::npos);
  EXPECT_NE(error_of([&] { call(routing(RM::NoauxTc, 128, 8, true, 64, 8)); }).find("n_group=64"), std::string::npos);
  EXPECT_NE(error_of([&] { call(routing(RM::NoauxTc, 64, 8, true, 8, 4)); }).find("bias"), std::string::npos);
  EXPECT_NE(error_of([&] {
              cuda::launch_routing(routing(RM::SoftmaxTopK, 8, 2, true), logits.p, DType::F32, -2, nullptr, ids.p,
                                   w.p, stream_);
            }).find("M=-2"),
            std::string::npos);
  CUDA_OK(cudaStreamSynchronize(stream_));
}


}  // namespace

#endif  // WNA16_HAVE_CUDA
