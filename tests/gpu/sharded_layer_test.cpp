// The sharded layer on CUDA (rank r on GPU r mod the GPUs present, so every plan runs on one GPU):
// the device-resident ranks of tensor- and expert-parallel plans against the float64 reference
// and the unsharded CUDA layer (tests/parallel/sharded_cases.h; one rank bit for bit); shards whose down rows were cut inside a group (a down
// group length below gate/up's); and the NCCL communicator with as many ranks as there are GPUs.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "parallel/sharded_cases.h"
#include "wna16/comm.h"

// A build without CUDA has none of these (tests/parallel covers the refusals there).
#ifdef WNA16_HAVE_CUDA
namespace wna16 {
namespace {

using namespace sharded_test;

#define SKIP_WITHOUT_GPU() \
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU: the CUDA sharded layer is not run"

// Inside a rank's function a failed ASSERT would return early and leave the other ranks waiting in
// a collective: throw instead (the world then aborts every rank and run() rethrows).
#define RANK_REQUIRE(cond)                                                    \
  do {                                                                        \
    if (!(cond)) throw Error(std::string("rank check failed: ") + #cond);      \
  } while (0)

// A world of one rank per GPU over NCCL, or the reason there is none (libnccl.so.2 not found).
std::unique_ptr<World> nccl_world(std::string* why) {
  try {
    return make_nccl_world(cuda_device_count());
  } catch (const Error& e) {
    *why = e.what();
    return nullptr;
  }
}

// tp = 4 would cut the variants' I = 128 into 32 columns, below the CUDA layer's 64 (refused below).
const std::vector<ParallelPlan> kCudaPlans = {{2, 1}, {1, 2}, {2, 2}, {1, 4}, {1, 1}};

// The device-resident ranks on device buffers: forward_device of each rank of tp = 2 and of ep = 2
// (one GPU, in-process communicator: the partial staged through the host) against forward_host.
class DeviceBuffers : public testing::TestWithParam<ParallelPlan> {};
INSTANTIATE_TEST_SUITE_P(ShardedCudaLayer, DeviceBuffers, testing::Values(ParallelPlan{2, 1}, ParallelPlan{1, 2}));
TEST_P(DeviceBuffers, MatchHostBuffers) {
  SKIP_WITHOUT_GPU();
  const ParallelPlan plan = GetParam();
  const Variant v = variants()[0];
  const MoeLayerWeights w = random_layer(v.spec, formats()[0], 9);
  const int64_t M = 21, n = M * v.spec.hidden;
  const auto x = random_activations(n, DType::BF16, 3);
  InProcessWorld world(2);
  std::vector<std::vector<uint16_t>> dev(2), host(2);
  world.run([&](Communicator& c) {
    set_cuda_device(c.rank() % cuda_device_count());
    auto rank = make_sharded_layer(Device::Cuda, plan, v.spec, w, c);
    RANK_REQUIRE(rank->runs_on_device());
    void *xd = nullptr, *od = nullptr;
    RANK_REQUIRE(cudaMalloc(&xd, size_t(n) * 2) == cudaSuccess);
    RANK_REQUIRE(cudaMalloc(&od, size_t(n) * 2) == cudaSuccess);
    RANK_REQUIRE(cudaMemcpy(xd, x.bits.data(), size_t(n) * 2, cudaMemcpyHostToDevice) == cudaSuccess);
    rank->forward_device(xd, od, M, DType::BF16, nullptr);
    dev[size_t(c.rank())].resize(size_t(n));
    RANK_REQUIRE(cudaMemcpy(dev[size_t(c.rank())].data(), od, size_t(n) * 2, cudaMemcpyDeviceToHost) == cudaSuccess);
    EXPECT_EQ(rank->last_stats().all_reduce_bytes, n * 4);
    cudaFree(xd);
    cudaFree(od);
    host[size_t(c.rank())].resize(size_t(n));
    rank->forward_host(x.bits.data(), host[size_t(c.rank())].data(), M, DType::BF16);
  });
  EXPECT_EQ(dev[0], dev[1]);
  EXPECT_EQ(dev[0], host[0]);
}

TEST(ShardedCudaLayer, EveryRoutingVariantUnderEveryPlan) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 10;
  for (const ParallelPlan& plan : kCudaPlans)
    for (const Variant& v : variants())
      if (v.spec.routing.num_experts / plan.ep >= v.spec.routing.top_k)  // else refused (below)
        check(Device::Cuda, v, formats()[0], plan, DType::BF16, false, seed++);
}

TEST(ShardedCudaLayer, EveryFormatAndCallerRouting) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 100;
  for (const ParallelPlan& plan : {ParallelPlan{2, 2}, ParallelPlan{1, 2}})
    for (const QuantScheme& q : formats()) {
      check(Device::Cuda, variants()[4], q, plan, seed % 2 ? DType::F16 : DType::BF16, false, seed);
      ++seed;
    }
  for (const Variant& v : {variants()[0], variants()[3]}) check(Device::Cuda, v, formats()[1], {2, 2}, DType::F16, true, seed++);
}

// The small preset (I = 128) at group size 128 with tp = 2: each rank's down rows are one group of
// 64, gate/up keep groups of 128 (two group lengths in one CUDA layer).
TEST(ShardedCudaLayer, DownGroupsShorterThanGateUp) {
  SKIP_WITHOUT_GPU();
  const Variant v{"small preset", preset("small")};
  uint64_t seed = 300;
  for (const ParallelPlan& plan : {ParallelPlan{2, 1}, ParallelPlan{2, 2}})
    for (const QuantScheme& q : {QuantScheme{Format::GptqV1, 4, 128, true, false}, QuantScheme{Format::GptqV1, 4, 128, true, true},
                                 QuantScheme{Format::GptqV1, 8, 128, false, false}, QuantScheme{Format::Awq, 4, 128, false, false}}) {
      check(Device::Cuda, v, q, plan, seed % 2 ? DType::F16 : DType::BF16, false, seed);
      ++seed;
    }
}

TEST(ShardedCudaLayer, RefusesWidthsTheKernelsCannotTake) {
  SKIP_WITHOUT_GPU();
  const Variant v = variants()[2];
  const MoeLayerWeights w = random_layer(v.spec, formats()[0], 7);
  try {
    make_threaded_sharded_layer(Device::Cuda, {4, 1}, v.spec, w);
    FAIL() << "tp=4 leaves 32 columns per expert";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert width I=32 is not a multiple of 64"), std::string::npos) << e.what();
  }
  const Variant v4 = variants()[4];  // top_k 3 of 8 experts
  const MoeLayerWeights w4 = random_layer(v4.spec, formats()[0], 8);
  try {
    make_threaded_sharded_layer(Device::Cuda, {1, 4}, v4.spec, w4);
    FAIL() << "ep=4 leaves 2 experts per group";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ep=4 leaves 2 experts per group, fewer than top_k=3"), std::string::npos)
        << e.what();
  }
}

// A world of one rank per GPU over NCCL; the tests skip (with the reason) without a GPU or where
// libnccl.so.2 cannot be loaded.
class NcclWorld : public testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    n_ = cuda_device_count();
    std::string why;
    world_ = nccl_world(&why);
    if (!world_) GTEST_SKIP() << why;
  }
  int n_ = 0;
  std::unique_ptr<World> world_;
};

// The collectives against their definition, then the sharded layer.
TEST_F(NcclWorld, CollectivesAndShardedLayer) {
  const int n = n_;
  world_->run([&](Communicator& c) {
    EXPECT_EQ(c.size(), n);
    std::vector<float> v(1000);
    for (size_t i = 0; i < v.size(); ++i) v[i] = float(c.rank() + 1) * float(i);
    c.all_reduce_sum(v.data(), int64_t(v.size()));
    const float ranks = float(n * (n + 1) / 2);
    for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(v[i], ranks * float(i)) << i;
    // Every rank sends peer p the bytes (rank, p, 0..rank+p).
    std::vector<std::vector<uint8_t>> send(static_cast<size_t>(n));
    for (int p = 0; p < n; ++p)
      for (int i = 0; i < c.rank() + p + 1; ++i) send[size_t(p)].push_back(uint8_t(16 * c.rank() + p + i));
    const auto got = exchange_bytes(c, send);
    for (int p = 0; p < n; ++p) {
      RANK_REQUIRE(int(got[size_t(p)].size()) == p + c.rank() + 1);
      for (int i = 0; i < p + c.rank() + 1; ++i) EXPECT_EQ(got[size_t(p)][size_t(i)], uint8_t(16 * p + c.rank() + i));
    }
    // Device memory, stream-ordered.
    RANK_REQUIRE(c.device_buffers());
    float* d = nullptr;
    RANK_REQUIRE(cudaMalloc(&d, 256 * sizeof(float)) == cudaSuccess);
    std::vector<float> h(256, float(c.rank() + 1));
    RANK_REQUIRE(cudaMemcpy(d, h.data(), 256 * 4, cudaMemcpyHostToDevice) == cudaSuccess);
    c.all_reduce_sum_device(d, 256, nullptr);
    RANK_REQUIRE(cudaMemcpy(h.data(), d, 256 * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
    cudaFree(d);
    for (float f : h) EXPECT_EQ(f, ranks);
    auto sub = c.split(c.rank() % 2, c.rank());
    std::vector<float> one{1.f};
    sub->all_reduce_sum(one.data(), 1);
    EXPECT_EQ(one[0], float(sub->size()));
    c.barrier();
  });
  // The sharded layer over NCCL: ep = the GPUs present (tp = 1 and ep = 1 on a single GPU).
  check(Device::Cuda, variants()[4], formats()[0], {1, n}, DType::BF16, false, 400, CommKind::Nccl);
  if (n >= 2) check(Device::Cuda, variants()[0], formats()[0], {2, n / 2}, DType::BF16, false, 401, CommKind::Nccl);
}

// A rank that throws ends every other rank's wait in an Error, not a hang.
TEST_F(NcclWorld, AFailingRankDoesNotHangTheOthers) {
  const int n = n_;
  try {
    world_->run([&](Communicator& c) {
      if (c.rank() == n - 1) throw Error("boom");
      std::vector<float> v(16, 1.f);
      c.all_reduce_sum(v.data(), 16);
    });
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "rank " + std::to_string(n - 1) + ": boom");
  }
}

}  // namespace
}  // namespace wna16
#endif  // WNA16_HAVE_CUDA
