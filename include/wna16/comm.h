// Communication between the ranks of a sharded layer, behind one small interface: an in-process
// implementation over threads (one thread per rank, shared memory) that tests the sharding logic on
// any machine, and later NCCL (one rank per GPU) behind the same calls. docs/parallel.md.
//
// Every call is collective: each rank of the communicator makes the same calls in the same order.
// Buffers are in the memory the implementation works on (host memory for the in-process one;
// device memory for NCCL, which then also takes a stream).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "wna16/error.h"

namespace wna16 {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // data[i] = sum over ranks of data[i], added in rank order 0, 1, ..., size-1 on every rank, so
  // every rank gets the same bits and a rerun gets the same result.
  virtual void all_reduce_sum(float* data, int64_t n) = 0;

  // Personalised exchange: to each peer p, send_bytes[p] bytes starting at send + send_offsets[p];
  // from each peer p, recv_bytes[p] bytes into recv + recv_offsets[p]. recv_bytes[p] must equal
  // what p sends to this rank (exchange_counts tells). Arrays have size() entries; p = rank() is a
  // local copy. NCCL: a grouped ncclSend/ncclRecv.
  virtual void all_to_all_v(const void* send, const int64_t* send_bytes, const int64_t* send_offsets, void* recv,
                            const int64_t* recv_bytes, const int64_t* recv_offsets) = 0;

  virtual void barrier() = 0;

  // Device memory of the rank's GPU, ordered on `stream` (a cudaStream_t): data[i] summed over the
  // ranks, enqueued without a host wait. Only communicators between GPUs have it
  // (device_buffers(): NCCL); the others throw.
  virtual bool device_buffers() const { return false; }
  virtual void all_reduce_sum_device(float*, int64_t, void*) {
    throw Error("this communicator exchanges host memory only (all_reduce_sum_device needs NCCL)");
  }

  // Ranks calling with the same color form a new communicator, ranked by (key, old rank). NCCL:
  // ncclCommSplit.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
};

// counts[p] to each peer p -> what each peer sends to this rank (an all_to_all_v of one int64 each).
std::vector<int64_t> exchange_counts(Communicator& comm, const std::vector<int64_t>& send_counts);

// All-to-all of byte vectors: send[p] goes to peer p; returns what each peer sent here, by peer.
std::vector<std::vector<uint8_t>> exchange_bytes(Communicator& comm, const std::vector<std::vector<uint8_t>>& send);

// The ranks of a world run a function together, one thread per rank per run().
class World {
 public:
  virtual ~World() = default;
  virtual int size() const = 0;
  // Calls fn(communicator of rank r) on one thread per rank and returns when all have returned.
  // When a rank throws, the collectives the others are waiting in (or enter later) throw too, so
  // no rank hangs; the failure of the lowest failing rank is then rethrown here, prefixed with
  // "rank R: ", and the world stays failed (every later run() throws).
  // Communicators made by split() inside fn stay valid for later runs of the same world.
  virtual void run(const std::function<void(Communicator&)>& fn) = 0;
};

// Which communicator a sharded layer runs over: threads exchanging host memory, or NCCL between
// GPUs (one per rank).
enum class CommKind { InProcess, Nccl };
CommKind parse_comm_kind(const std::string& s);  // "inprocess" | "nccl"; throws Error naming s
const char* comm_kind_name(CommKind k);

// A world of `size` ranks inside this process, one thread per rank per run().
class InProcessWorld final : public World {
 public:
  explicit InProcessWorld(int size);  // 1 <= size <= 1024, else Error naming it
  ~InProcessWorld() override;
  InProcessWorld(const InProcessWorld&) = delete;
  InProcessWorld& operator=(const InProcessWorld&) = delete;

  int size() const override;
  void run(const std::function<void(Communicator&)>& fn) override;

  struct State;  // shared by the world's communicators (and those split from them)

 private:
  std::shared_ptr<State> state_;
  std::vector<std::unique_ptr<Communicator>> ranks_;
};

// A world of `size` ranks over NCCL in this process: rank r on GPU r (size <= the GPUs present),
// one thread per rank per run(). The communicators take host buffers like the in-process ones and
// stage them through the rank's GPU (a copy in, the NCCL call on a stream of its own, a copy out);
// all_reduce_sum adds in NCCL's order (the same bits on every rank). libnccl.so.2 is loaded at the
// first call (Error when it is not found, or when this build has no CUDA backend). A failing rank
// aborts every communicator of the world, so the others' waits end in an Error, not a hang.
std::unique_ptr<World> make_nccl_world(int size);
// A world of `size` ranks over the communicator `kind` names (InProcessWorld or make_nccl_world).
std::unique_ptr<World> make_world(CommKind kind, int size);

}  // namespace wna16
