// The NCCL world (comm.h): one rank per GPU of this process, one thread per rank. NCCL is loaded
// with dlopen at the first make_nccl_world, so a build (and CI) needs only nccl.h, and a machine
// without NCCL gets an Error naming the library, not a link failure. Host buffers are staged
// through the rank's GPU: a copy in, the NCCL call, a copy out, all on the communicator's stream,
// then a wait that also watches the world's failure flag (a peer that failed never joins the
// collective: the waiters throw once it has aborted every communicator).
#include "wna16/backend.h"
#include "wna16/comm.h"
#include "wna16/error.h"
#include "parallel/rank_threads.h"

#if defined(WNA16_HAVE_CUDA) && __has_include(<nccl.h>)
#define WNA16_NCCL 1
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>
#include <vector>
#endif

namespace wna16 {

#ifdef WNA16_NCCL
namespace {

constexpr int kMinNcclVersion = 21800;  // ncclCommSplit

// The entry points used, typed from nccl.h.
struct NcclApi {
  decltype(&ncclGetVersion) GetVersion;
  decltype(&ncclGetErrorString) GetErrorString;
  decltype(&ncclCommInitAll) CommInitAll;
  decltype(&ncclCommSplit) CommSplit;
  decltype(&ncclCommDestroy) CommDestroy;
  decltype(&ncclCommAbort) CommAbort;
  decltype(&ncclCommUserRank) CommUserRank;
  decltype(&ncclCommCount) CommCount;
  decltype(&ncclAllReduce) AllReduce;
  decltype(&ncclSend) Send;
  decltype(&ncclRecv) Recv;
  decltype(&ncclGroupStart) GroupStart;
  decltype(&ncclGroupEnd) GroupEnd;
};

const NcclApi& nccl() {
  static const NcclApi api = [] {
    void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h) h = dlopen("libnccl.so", RTLD_NOW | RTLD_LOCAL);
    if (!h)
      throw Error(std::string("NCCL: libnccl.so.2 could not be loaded (") + dlerror() +
                  "); install NCCL or put the folder that holds it on LD_LIBRARY_PATH");
    NcclApi a{};
    auto sym = [&](auto& fn, const char* name) {
      void* p = dlsym(h, name);
      if (!p) throw Error(std::string("NCCL: libnccl.so.2 has no ") + name);
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    sym(a.GetVersion, "ncclGetVersion");
    sym(a.GetErrorString, "ncclGetErrorString");
    int v = 0;
    a.GetVersion(&v);
    if (v < kMinNcclVersion)
      throw Error("NCCL: the loaded libnccl is version " + std::to_string(v) + "; 2.18 or newer is needed (ncclCommSplit)");
    sym(a.CommInitAll, "ncclCommInitAll");
    sym(a.CommSplit, "ncclCommSplit");
    sym(a.CommDestroy, "ncclCommDestroy");
    sym(a.CommAbort, "ncclCommAbort");
    sym(a.CommUserRank, "ncclCommUserRank");
    sym(a.CommCount, "ncclCommCount");
    sym(a.AllReduce, "ncclAllReduce");
    sym(a.Send, "ncclSend");
    sym(a.Recv, "ncclRecv");
    sym(a.GroupStart, "ncclGroupStart");
    sym(a.GroupEnd, "ncclGroupEnd");
    return a;
  }();
  return api;
}

void check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw Error(std::string("NCCL ") + what + ": " + nccl().GetErrorString(r));
}
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("NCCL communicator, ") + what + ": " + cudaGetErrorString(e));
}

// Restores the calling thread's GPU (building or destroying a rank's objects selects its GPU).
struct DeviceGuard {
  int saved = 0;
  DeviceGuard() { cudaGetDevice(&saved); }
  ~DeviceGuard() { cudaSetDevice(saved); }
};

// What a world's communicators share: the failure flag and every NCCL communicator made, to abort.
struct NcclState {
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::vector<ncclComm_t> comms;
  void add(ncclComm_t c) {
    std::lock_guard<std::mutex> lock(mu);
    comms.push_back(c);
  }
  void abort() {
    std::lock_guard<std::mutex> lock(mu);
    if (failed.exchange(true)) return;
    for (ncclComm_t c : comms) nccl().CommAbort(c);
  }
};

// A device buffer of the rank's GPU, grown on demand.
struct Scratch {
  void* p = nullptr;
  size_t bytes = 0;
  void* need(size_t n) {
    if (n <= bytes) return p;
    if (p) cudaFree(p);
    p = nullptr;
    check(cudaMalloc(&p, n), "cudaMalloc of a staging buffer");
    bytes = n;
    return p;
  }
  ~Scratch() {
    if (p) cudaFree(p);
  }
};

class NcclComm final : public Communicator {
 public:
  NcclComm(std::shared_ptr<NcclState> st, ncclComm_t c, int device) : st_(std::move(st)), c_(c), device_(device) {
    DeviceGuard guard;
    check(nccl().CommUserRank(c_, &rank_), "ncclCommUserRank");
    check(nccl().CommCount(c_, &size_), "ncclCommCount");
    check(cudaSetDevice(device_), "cudaSetDevice");
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~NcclComm() override {
    DeviceGuard guard;
    cudaSetDevice(device_);
    if (!st_->failed) nccl().CommDestroy(c_);  // aborted communicators are gone already
    cudaStreamDestroy(stream_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_reduce_sum(float* data, int64_t n) override {
    if (n <= 0) return;
    const size_t bytes = size_t(n) * sizeof(float);
    void* d = send_.need(bytes);
    check(cudaMemcpyAsync(d, data, bytes, cudaMemcpyHostToDevice, stream_), "copy in");
    check(nccl().AllReduce(d, d, size_t(n), ncclFloat32, ncclSum, c_, stream_), "ncclAllReduce");
    check(cudaMemcpyAsync(data, d, bytes, cudaMemcpyDeviceToHost, stream_), "copy out");
    wait();
  }

  void all_to_all_v(const void* send, const int64_t* send_bytes, const int64_t* send_offsets, void* recv,
                    const int64_t* recv_bytes, const int64_t* recv_offsets) override {
    int64_t send_end = 0, recv_end = 0;
    for (int p = 0; p < size_; ++p) {
      if (send_bytes[p] < 0 || recv_bytes[p] < 0 || send_offsets[p] < 0 || recv_offsets[p] < 0)
        throw Error("nccl all_to_all_v: a negative count or offset for peer " + std::to_string(p));
      if (send_bytes[p]) send_end = std::max(send_end, send_offsets[p] + send_bytes[p]);
      if (recv_bytes[p]) recv_end = std::max(recv_end, recv_offsets[p] + recv_bytes[p]);
    }
    auto* ds = static_cast<uint8_t*>(send_.need(size_t(std::max<int64_t>(send_end, 1))));
    auto* dr = static_cast<uint8_t*>(recv_.need(size_t(std::max<int64_t>(recv_end, 1))));
    if (send_end) check(cudaMemcpyAsync(ds, send, size_t(send_end), cudaMemcpyHostToDevice, stream_), "copy in");
    check(nccl().GroupStart(), "ncclGroupStart");
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      if (send_bytes[p]) check(nccl().Send(ds + send_offsets[p], size_t(send_bytes[p]), ncclUint8, p, c_, stream_), "ncclSend");
      if (recv_bytes[p]) check(nccl().Recv(dr + recv_offsets[p], size_t(recv_bytes[p]), ncclUint8, p, c_, stream_), "ncclRecv");
    }
    check(nccl().GroupEnd(), "ncclGroupEnd");
    if (send_bytes[rank_] != recv_bytes[rank_])
      throw Error("nccl all_to_all_v: rank " + std::to_string(rank_) + " sends itself " + std::to_string(send_bytes[rank_]) +
                  " bytes but expects " + std::to_string(recv_bytes[rank_]));
    if (send_bytes[rank_])
      check(cudaMemcpyAsync(dr + recv_offsets[rank_], ds + send_offsets[rank_], size_t(send_bytes[rank_]),
                            cudaMemcpyDeviceToDevice, stream_), "local copy");
    if (recv_end) check(cudaMemcpyAsync(recv, dr, size_t(recv_end), cudaMemcpyDeviceToHost, stream_), "copy out");
    wait();
  }

  bool device_buffers() const override { return true; }
  void all_reduce_sum_device(float* data, int64_t n, void* stream) override {
    if (n <= 0) return;
    check(nccl().AllReduce(data, data, size_t(n), ncclFloat32, ncclSum, c_, static_cast<cudaStream_t>(stream)),
          "ncclAllReduce");
  }

  void barrier() override {
    float one = 1.f;
    all_reduce_sum(&one, 1);
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    if (color < 0) throw Error("nccl split: color " + std::to_string(color) + " is negative");
    ncclComm_t nc = nullptr;
    check(nccl().CommSplit(c_, color, key, &nc, nullptr), "ncclCommSplit");
    st_->add(nc);
    return std::make_unique<NcclComm>(st_, nc, device_);
  }

 private:
  // Until the stream is done; a peer's failure ends the wait (its collective will never complete).
  void wait() {
    for (;;) {
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) check(e, "the stream");
      if (st_->failed) throw PeerFailed("nccl communicator");
      std::this_thread::yield();
    }
  }

  std::shared_ptr<NcclState> st_;
  ncclComm_t c_;
  int device_, rank_ = 0, size_ = 0;
  cudaStream_t stream_ = nullptr;
  Scratch send_, recv_;
};

class NcclWorld final : public World {
 public:
  explicit NcclWorld(int size) : st_(std::make_shared<NcclState>()) {
    std::vector<ncclComm_t> comms(static_cast<size_t>(size));
    std::vector<int> devs(static_cast<size_t>(size));
    for (int r = 0; r < size; ++r) devs[size_t(r)] = r;
    check(nccl().CommInitAll(comms.data(), size, devs.data()), "ncclCommInitAll");
    for (int r = 0; r < size; ++r) {
      st_->add(comms[size_t(r)]);
      ranks_.push_back(std::make_unique<NcclComm>(st_, comms[size_t(r)], r));
    }
  }
  int size() const override { return int(ranks_.size()); }
  void run(const std::function<void(Communicator&)>& fn) override {
    if (st_->failed) throw Error("nccl world: a rank failed in an earlier run; the world cannot be reused");
    run_rank_threads(
        size(),
        [&](int r) {
          check(cudaSetDevice(r), "cudaSetDevice");
          fn(*ranks_[size_t(r)]);
        },
        [&] { st_->abort(); });
  }

 private:
  std::shared_ptr<NcclState> st_;
  std::vector<std::unique_ptr<NcclComm>> ranks_;
};

}  // namespace

std::unique_ptr<World> make_nccl_world(int size) {
  if (size < 1 || size > 1024) throw Error("nccl world: size " + std::to_string(size) + " is outside [1, 1024]");
  const int gpus = cuda_device_count();
  if (size > gpus)
    throw Error("nccl world: " + std::to_string(size) + " ranks need " + std::to_string(size) + " GPUs (one per rank); " +
                std::to_string(gpus) + " present (--comm inprocess runs every rank on the GPUs there are)");
  return std::make_unique<NcclWorld>(size);
}

#else

std::unique_ptr<World> make_nccl_world(int) {
  throw Error("this build of wna16 has no NCCL communicator (built without CUDA, or without nccl.h)");
}

#endif

}  // namespace wna16
