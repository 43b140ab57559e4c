// The in-process communicator: the ranks are threads of this process, a collective is a
// rendezvous (barrier), reads of the peers' buffers straight from shared memory, and a barrier
// again before anyone may reuse a buffer. Sums run in rank order, so results are reproducible and
// the same on every rank. A rank that fails wakes every waiter (they throw) so no run() hangs.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "wna16/comm.h"
#include "wna16/error.h"
#include "parallel/rank_threads.h"

namespace wna16 {

namespace {

struct Group;

}  // namespace

struct InProcessWorld::State {
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::vector<std::weak_ptr<Group>> groups;  // every group of this world, to wake on failure
  void abort();
  void add(const std::shared_ptr<Group>& g) {
    std::lock_guard<std::mutex> lock(mu);
    groups.push_back(g);
  }
};

namespace {

// What one rank deposits for a collective (valid between its first and last barrier).
struct Slot {
  float* reduce = nullptr;
  int64_t n = 0;
  const uint8_t* send = nullptr;
  const int64_t *send_bytes = nullptr, *send_offsets = nullptr;
  int color = 0, key = 0;
};

struct Group {
  Group(int n, std::shared_ptr<InProcessWorld::State> w) : size(n), world(std::move(w)), slots(size_t(n)) {}
  const int size;
  const std::shared_ptr<InProcessWorld::State> world;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  std::vector<Slot> slots;
  std::vector<float> sum;                        // all_reduce_sum's result, filled chunk by chunk
  std::map<int, std::shared_ptr<Group>> splits;  // color -> new group, during one split()

  void barrier() {
    std::unique_lock<std::mutex> lock(mu);
    if (world->failed) throw PeerFailed("in-process communicator");
    const uint64_t gen = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    cv.wait(lock, [&] { return generation != gen || world->failed; });
    if (generation == gen) throw PeerFailed("in-process communicator");
  }
};

class InProcessComm final : public Communicator {
 public:
  InProcessComm(std::shared_ptr<Group> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->size; }

  void all_reduce_sum(float* data, int64_t n) override {
    if (n < 0) throw Error("all_reduce_sum: n=" + std::to_string(n) + " is negative");
    Slot& mine = g_->slots[size_t(rank_)];
    mine.reduce = data;
    mine.n = n;
    {
      std::lock_guard<std::mutex> lock(g_->mu);  // NOTE: resized before the first barrier only
      if (int64_t(g_->sum.size()) < n) g_->sum.resize(static_cast<size_t>(n));
    }
    g_->barrier();
    for (int p = 0; p < size(); ++p)
      if (g_->slots[size_t(p)].n != n)
        throw Error("all_reduce_sum: rank " + std::to_string(rank_) + " has n=" + std::to_string(n) + ", rank " +
                    std::to_string(p) + " has n=" + std::to_string(g_->slots[size_t(p)].n));
    // Each rank sums one contiguous chunk over all ranks, in rank order.
    const int64_t begin = n * rank_ / size(), end = n * (rank_ + 1) / size();
    for (int64_t i = begin; i < end; ++i) {
      float s = g_->slots[0].reduce[i];
      for (int p = 1; p < size(); ++p) s += g_->slots[size_t(p)].reduce[i];
      g_->sum[size_t(i)] = s;
    }
    g_->barrier();
    if (n > 0) std::memcpy(data, g_->sum.data(), size_t(n) * sizeof(float));
    g_->barrier();  // nobody resizes or refills sum while a peer still copies it
  }

  void all_to_all_v(const void* send, const int64_t* send_bytes, const int64_t* send_offsets, void* recv,
                    const int64_t* recv_bytes, const int64_t* recv_offsets) override {
    Slot& mine = g_->slots[size_t(rank_)];
    mine.send = static_cast<const uint8_t*>(send);
    mine.send_bytes = send_bytes;
    mine.send_offsets = send_offsets;
    g_->barrier();
    for (int p = 0; p < size(); ++p) {
      const Slot& peer = g_->slots[size_t(p)];
      const int64_t bytes = peer.send_bytes[rank_];
      if (bytes != recv_bytes[p])
        throw Error("all_to_all_v: rank " + std::to_string(rank_) + " expects " + std::to_string(recv_bytes[p]) +
                    " bytes from rank " + std::to_string(p) + ", which sends " + std::to_string(bytes));
      if (bytes > 0)
        std::memcpy(static_cast<uint8_t*>(recv) + recv_offsets[p], peer.send + peer.send_offsets[rank_], size_t(bytes));
    }
    g_->barrier();  // senders keep their buffers until every peer has copied
  }

  void barrier() override { g_->barrier(); }

  std::unique_ptr<Communicator> split(int color, int key) override {
    Slot& mine = g_->slots[size_t(rank_)];
    mine.color = color;
    mine.key = key;
    g_->barrier();
    std::vector<std::pair<int, int>> members;  // (key, old rank) of this color
    for (int p = 0; p < size(); ++p)
      if (g_->slots[size_t(p)].color == color) members.push_back({g_->slots[size_t(p)].key, p});
    std::sort(members.begin(), members.end());
    const int new_rank = int(std::find(members.begin(), members.end(), std::make_pair(key, rank_)) - members.begin());
    std::shared_ptr<Group> group;
    {
      std::lock_guard<std::mutex> lock(g_->mu);
      std::shared_ptr<Group>& made = g_->splits[color];
      if (!made) {
        made = std::make_shared<Group>(int(members.size()), g_->world);
        g_->world->add(made);
      }
      group = made;
    }
    g_->barrier();
    if (rank_ == 0) {
      std::lock_guard<std::mutex> lock(g_->mu);  // the next split starts after its first barrier
      g_->splits.clear();
    }
    return std::make_unique<InProcessComm>(std::move(group), new_rank);
  }

 private:
  std::shared_ptr<Group> g_;
  int rank_;
};

}  // namespace

void InProcessWorld::State::abort() {
  failed = true;
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& w : groups)
    if (auto g = w.lock()) {
      std::lock_guard<std::mutex> glock(g->mu);  // no waiter can miss the flag between test and wait
      g->cv.notify_all();
    }
}

InProcessWorld::InProcessWorld(int size) : state_(std::make_shared<State>()) {
  if (size < 1 || size > 1024) throw Error("in-process world size " + std::to_string(size) + " is outside [1, 1024]");
  auto group = std::make_shared<Group>(size, state_);
  state_->add(group);
  for (int r = 0; r < size; ++r) ranks_.push_back(std::make_unique<InProcessComm>(group, r));
}

InProcessWorld::~InProcessWorld() = default;

int InProcessWorld::size() const { return int(ranks_.size()); }

void InProcessWorld::run(const std::function<void(Communicator&)>& fn) {
  if (state_->failed) throw Error("in-process world: a rank failed in an earlier run; the world cannot be reused");
  run_rank_threads(size(), [&](int r) { fn(*ranks_[size_t(r)]); }, [&] { state_->abort(); });
}

void run_rank_threads(int n, const std::function<void(int)>& body, const std::function<void()>& on_failure) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  auto guarded = [&](int r) {
    try {
      body(r);
    } catch (...) {
      errors[size_t(r)] = std::current_exception();
      on_failure();
    }
  };
  std::vector<std::thread> threads;
  for (int r = 1; r < n; ++r) threads.emplace_back(guarded, r);
  guarded(0);
  for (auto& t : threads) t.join();
  // The lowest rank that failed on its own (ranks woken by it only report PeerFailed).
  std::exception_ptr first;
  int first_rank = 0;
  for (int r = 0; r < n && !first; ++r) {
    if (!errors[size_t(r)]) continue;
    try {
      std::rethrow_exception(errors[size_t(r)]);
    } catch (const PeerFailed&) {
    } catch (...) {
      first = errors[size_t(r)], first_rank = r;
    }
  }
  for (int r = 0; r < n && !first; ++r)
    if (errors[size_t(r)]) first = errors[size_t(r)], first_rank = r;
  if (!first) return;
  try {
    std::rethrow_exception(first);
  } catch (const std::exception& e) {
    throw Error("rank " + std::to_string(first_rank) + ": " + e.what());
  }
}

CommKind parse_comm_kind(const std::string& s) {
  if (s == "inprocess") return CommKind::InProcess;
  if (s == "nccl") return CommKind::Nccl;
  throw Error("unknown communicator '" + s + "' (expected inprocess or nccl)");
}

const char* comm_kind_name(CommKind k) { return k == CommKind::Nccl ? "nccl" : "inprocess"; }

std::unique_ptr<World> make_world(CommKind kind, int size) {
  if (kind == CommKind::Nccl) return make_nccl_world(size);
  return std::make_unique<InProcessWorld>(size);
}

std::vector<int64_t> exchange_counts(Communicator& comm, const std::vector<int64_t>& send_counts) {
  const int n = comm.size();
  if (int(send_counts.size()) != n)
    throw Error("exchange_counts: " + std::to_string(send_counts.size()) + " counts for " + std::to_string(n) +
                " ranks");
  std::vector<int64_t> recv(static_cast<size_t>(n)), bytes(size_t(n), int64_t(sizeof(int64_t))), offsets(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) offsets[size_t(p)] = p * int64_t(sizeof(int64_t));
  comm.all_to_all_v(send_counts.data(), bytes.data(), offsets.data(), recv.data(), bytes.data(), offsets.data());
  return recv;
}

std::vector<std::vector<uint8_t>> exchange_bytes(Communicator& comm, const std::vector<std::vector<uint8_t>>& send) {
  const int n = comm.size();
  if (int(send.size()) != n)
    throw Error("exchange_bytes: " + std::to_string(send.size()) + " buffers for " + std::to_string(n) + " ranks");
  std::vector<int64_t> send_bytes(static_cast<size_t>(n)), send_off(static_cast<size_t>(n)), recv_off(static_cast<size_t>(n));
  std::vector<uint8_t> flat;
  for (int p = 0; p < n; ++p) {
    send_off[size_t(p)] = int64_t(flat.size());
    send_bytes[size_t(p)] = int64_t(send[size_t(p)].size());
    flat.insert(flat.end(), send[size_t(p)].begin(), send[size_t(p)].end());
  }
  const std::vector<int64_t> recv_bytes = exchange_counts(comm, send_bytes);
  int64_t total = 0;
  for (int p = 0; p < n; ++p) recv_off[size_t(p)] = total, total += recv_bytes[size_t(p)];
  std::vector<uint8_t> recv(static_cast<size_t>(total));
  comm.all_to_all_v(flat.data(), send_bytes.data(), send_off.data(), recv.data(), recv_bytes.data(), recv_off.data());
  std::vector<std::vector<uint8_t>> out(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p)
    out[size_t(p)].assign(recv.begin() + recv_off[size_t(p)], recv.begin() + recv_off[size_t(p)] + recv_bytes[size_t(p)]);
  return out;
}

}  // namespace wna16
