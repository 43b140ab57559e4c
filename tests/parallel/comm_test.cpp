// The in-process communicator: all-reduce in rank order (the same bits on every rank), all-to-all
// with uneven and empty sizes, split into sub-communicators, many ranks, and failures that must
// neither hang nor pass silently.
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <vector>

#include "wna16/comm.h"
#include "wna16/error.h"

namespace wna16 {
namespace {

TEST(InProcessComm, AllReduceAddsInRankOrderAndEveryRankGetsTheSameBits) {
  InProcessWorld world(3);
  // 1e8 + 1 rounds back to 1e8 in float: only rank order ((1e8 + 1) - 1e8) gives 0 in element 0;
  // element 1 is an ordinary sum.
  const float first[3] = {1e8f, 1.f, -1e8f};
  std::vector<std::vector<float>> got(3);
  world.run([&](Communicator& c) {
    std::vector<float> v = {first[c.rank()], float(c.rank() + 1) * 0.5f};
    c.all_reduce_sum(v.data(), 2);
    got[size_t(c.rank())] = v;
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(got[size_t(r)][0], 0.f) << "rank " << r;
    EXPECT_EQ(got[size_t(r)][1], 3.f) << "rank " << r;
  }
}

TEST(InProcessComm, AllReduceManyRanksRepeatedly) {
  constexpr int kRanks = 48;
  InProcessWorld world(kRanks);
  std::atomic<int> bad{0};
  world.run([&](Communicator& c) {
    for (int round = 0; round < 5; ++round) {
      const int64_t n = 1000 + round * 37;  // not divisible by the rank count
      std::vector<float> v(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) v[size_t(i)] = float(c.rank() * 3 + i % 7 + round);
      c.all_reduce_sum(v.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        float want = 0;
        for (int r = 0; r < kRanks; ++r) want += float(r * 3 + i % 7 + round);
        if (v[size_t(i)] != want) ++bad;
      }
      c.barrier();
    }
  });
  EXPECT_EQ(bad.load(), 0);
}

// Rank r sends (r * 5 + p * 3) % 11 bytes to peer p (zero for some pairs), byte i = r * 16 + p + i.
std::vector<uint8_t> message(int from, int to) {
  std::vector<uint8_t> m(size_t((from * 5 + to * 3) % 11));
  for (size_t i = 0; i < m.size(); ++i) m[i] = uint8_t(from * 16 + to + int(i));
  return m;
}

TEST(InProcessComm, AllToAllWithUnevenAndEmptySizes) {
  for (int ranks : {1, 2, 3, 7, 16}) {
    InProcessWorld world(ranks);
    std::atomic<int> bad{0};
    world.run([&](Communicator& c) {
      std::vector<std::vector<uint8_t>> send;
      for (int p = 0; p < c.size(); ++p) send.push_back(message(c.rank(), p));
      const auto got = exchange_bytes(c, send);
      for (int p = 0; p < c.size(); ++p)
        if (got[size_t(p)] != message(p, c.rank())) ++bad;
    });
    EXPECT_EQ(bad.load(), 0) << ranks << " ranks";
  }
}

TEST(InProcessComm, ExchangeCountsIsATransposition) {
  InProcessWorld world(4);
  std::vector<std::vector<int64_t>> got(4);
  world.run([&](Communicator& c) {
    std::vector<int64_t> counts;
    for (int p = 0; p < 4; ++p) counts.push_back(c.rank() * 10 + p);
    got[size_t(c.rank())] = exchange_counts(c, counts);
  });
  for (int r = 0; r < 4; ++r)
    for (int p = 0; p < 4; ++p) EXPECT_EQ(got[size_t(r)][size_t(p)], p * 10 + r);
}

TEST(InProcessComm, SplitMakesIndependentGroupsRankedByKey) {
  // 6 ranks as 3 groups of 2 (color = rank / 2) and 2 groups of 3 (color = rank % 2), keys reversed.
  InProcessWorld world(6);
  std::vector<float> sums_a(6), sums_b(6);
  std::vector<int> rank_a(6), size_b(6);
  world.run([&](Communicator& c) {
    auto a = c.split(c.rank() / 2, -c.rank());
    auto b = c.split(c.rank() % 2, c.rank());
    float va = float(c.rank()), vb = float(c.rank());
    a->all_reduce_sum(&va, 1);
    b->all_reduce_sum(&vb, 1);
    sums_a[size_t(c.rank())] = va;
    sums_b[size_t(c.rank())] = vb;
    rank_a[size_t(c.rank())] = a->rank();
    size_b[size_t(c.rank())] = b->size();
  });
  for (int r = 0; r < 6; ++r) {
    EXPECT_EQ(sums_a[size_t(r)], float(4 * (r / 2) + 1)) << r;   // (2g) + (2g + 1)
    EXPECT_EQ(sums_b[size_t(r)], r % 2 == 0 ? 6.f : 9.f) << r;  // 0+2+4, 1+3+5
    EXPECT_EQ(rank_a[size_t(r)], r % 2 == 0 ? 1 : 0) << r;      // key -rank: the higher rank first
    EXPECT_EQ(size_b[size_t(r)], 3) << r;
  }
}

TEST(InProcessComm, SplitCommunicatorsSurviveAcrossRuns) {
  InProcessWorld world(4);
  std::vector<std::unique_ptr<Communicator>> sub(4);
  world.run([&](Communicator& c) { sub[size_t(c.rank())] = c.split(c.rank() % 2, c.rank()); });
  std::vector<float> v(4);
  world.run([&](Communicator& c) {
    float x = float(c.rank() + 1);
    sub[size_t(c.rank())]->all_reduce_sum(&x, 1);
    v[size_t(c.rank())] = x;
  });
  EXPECT_EQ(v, (std::vector<float>{4.f, 6.f, 4.f, 6.f}));
}

TEST(InProcessComm, AFailingRankFailsTheRunWithoutHangingTheOthers) {
  InProcessWorld world(4);
  try {
    world.run([&](Communicator& c) {
      if (c.rank() == 2) throw Error("boom");
      float x = 1;
      c.all_reduce_sum(&x, 1);  // ranks 0, 1, 3 wait here for rank 2
    });
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "rank 2: boom");
  }
  try {
    world.run([](Communicator&) {});
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot be reused"), std::string::npos) << e.what();
  }
}

TEST(InProcessComm, MismatchedCallsAreErrorsNamingTheValues) {
  {
    InProcessWorld world(2);
    try {
      world.run([&](Communicator& c) {
        std::vector<float> v(size_t(3 + c.rank()));
        c.all_reduce_sum(v.data(), int64_t(v.size()));
      });
      FAIL() << "expected an Error";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), "rank 0: all_reduce_sum: rank 0 has n=3, rank 1 has n=4");
    }
  }
  {
    InProcessWorld world(2);
    try {
      world.run([&](Communicator& c) {
        const int64_t send_bytes[2] = {4, 4}, offsets[2] = {0, 0}, recv_bytes[2] = {4, 2};
        uint8_t send[4] = {}, recv[8] = {};
        c.all_to_all_v(send, send_bytes, offsets, recv, recv_bytes, offsets);
      });
      FAIL() << "expected an Error";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), "rank 0: all_to_all_v: rank 0 expects 2 bytes from rank 1, which sends 4");
    }
  }
  for (int bad : {0, -1, 1025}) {
    try {
      InProcessWorld world(bad);
      FAIL() << "expected an Error for " << bad;
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), "in-process world size " + std::to_string(bad) + " is outside [1, 1024]");
    }
  }
}

}  // namespace
}  // namespace wna16
