// ferry/collective/nccl.hpp: NCCL communicators over the local GPUs, one rank per GPU;
// the communicator of GPU replicas. Plain C API: compiles with g++ when the target links
// cudart (FERRY_WITH_CUDART) and NCCL (nccl.h, libnccl); needs no nvcc.
//
//   auto comms = ferry::nccl_communicator::local({0, 1});   // ncclCommInitAll
//   comms[r].set_stream(replica_stream);                     // on replica r's thread
//   comms[r].all_reduce_average(device_grads);               // enqueued on that stream
//
// Collectives are enqueued on the communicator's stream and return at once (stream
// order is the synchronisation, as with any CUDA work); barrier() synchronises the stream.
// When one thread drives several ranks it must bracket their calls with group_start() /
// group_end() (NCCL's rule); the trainer gives every GPU replica its own thread instead.
//
// Across processes and nodes (issue 6): rank 0 makes an id, every process receives it
// (ferry::nccl_communicators in ferry/distributed.hpp broadcasts it over MPI) and joins:
//
//   ncclUniqueId id = ...;                                    // same bytes on every rank
//   auto comms = ferry::nccl_communicator::join(id, nranks, first_rank, {0, 1});
//
// nccl_device_exchange: this process's communicators as a ferry::device_exchange (grouped
// ncclSend/ncclRecv), for cache_on_device's row exchange between GPUs.
//
// Asynchronous errors: a peer that dies or a broken network shows up late, as an async
// error of the communicator, not as a failed call. check_async() throws it (and aborts
// the communicator); barrier() polls it while it waits (as mirrored_trainer's waits
// do), so a lost peer ends in an error rather than a hang. abort() ends the
// communicator's unfinished collectives (a peer that failed will never join them), so the
// streams drain and nothing hangs at shutdown; the trainer calls it on every communicator
// when a replica fails. After either, every call
// throws ferry::error saying the communicator was aborted.
//
// Threads: every call runs on the calling thread, and leaves that thread's current CUDA
// device as it found it (each call sets its communicator's device for itself).
//
// Errors: a failed NCCL call throws ferry::nccl_error (a ferry::error) naming the call, the
// NCCL rank and clique size, the device, the host and the status; a failed CUDA call throws
// ferry::cuda_error (call, device, host, status), its call naming the NCCL rank too.
#pragma once

#include <string>
#include <utility>

#include "ferry/config.hpp"
#include "ferry/cuda/error.hpp"
#include "ferry/error.hpp"

namespace ferry {

// A failed NCCL call: the message names the call, the NCCL rank of its communicator and the
// clique's size (when the call has one), the device, the host and the status, e.g.
// "ncclAllReduce failed for NCCL rank 3 of 8 on device 1 of node7: status 6 (remote
// process exited or there was a network error)". Defined without NCCL too, so code that
// catches it compiles in CPU-only builds.
class nccl_error : public error {
 public:
  // rank, nranks, device: -1 when the call has none (ncclGetUniqueId, ncclCommInitAll).
  nccl_error(std::string call, int rank, int nranks, int device, int status, const std::string& status_text)
      : error(call + " failed" +
              (rank >= 0 ? " for NCCL rank " + std::to_string(rank) + " of " + std::to_string(nranks) : std::string()) +
              " on " + (device >= 0 ? "device " + std::to_string(device) + " of " : std::string()) +
              cuda_error::host_name() + ": status " + std::to_string(status) + " (" + status_text + ")"),
        call_(std::move(call)), rank_(rank), device_(device), status_(status) {}
  // The NCCL call, e.g. "ncclAllReduce".
  const std::string& call() const noexcept { return call_; }
  // The communicator's NCCL rank (-1: none).
  int rank() const noexcept { return rank_; }
  // The communicator's CUDA device (-1: none).
  int device() const noexcept { return device_; }
  // The ncclResult_t value.
  int status() const noexcept { return status_; }

 private:
  std::string call_;
  int rank_, device_, status_;
};

}  // namespace ferry

#if defined(FERRY_WITH_CUDART)

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdio>
#include <thread>
#include <span>
#include <vector>

#include "ferry/collective/communicator.hpp"
#include "ferry/collective/device_exchange.hpp"
#include "ferry/cuda/stream.hpp"
#include "ferry/cuda/stream_handle.hpp"

namespace ferry {

namespace detail {
// Throws nccl_error for a failed call of NCCL rank `rank` of `nranks` on `device` (-1: none).
inline void nccl_check(ncclResult_t r, const char* call, int rank = -1, int nranks = -1, int device = -1) {
  if (r != ncclSuccess) throw nccl_error(call, rank, nranks, device, static_cast<int>(r), ncclGetErrorString(r));
}
// Throws cuda_error for a failed CUDA call made at `line` of this file for NCCL rank `rank`
// of `nranks` on `device` (named: the current device may be another when cudaSetDevice
// failed). A line argument, not std::source_location: clang 14 with libstdc++ has none.
inline void cuda_check_nccl(cudaError_t r, const char* call, int rank, int nranks, int device, int line) {
  if (r == cudaSuccess) return;
  throw cuda::detail::make_cuda_error(
      r, std::string(call) + " for NCCL rank " + std::to_string(rank) + " of " + std::to_string(nranks), device,
      __FILE__, line);
}
}  // namespace detail

// Every call puts the calling thread's current device back when it ends, however it ends
// (cuda::device_restore): the current device is the thread's own, and a call that sets its
// communicator's device must not move the caller's, whose next cudaMalloc or launch would
// go elsewhere.
class nccl_communicator {
 public:
  static constexpr span_memory memory = span_memory::device;  // device()'s memory, enqueued on the stream

  // One communicator per listed device, rank i on devices[i] (ncclCommInitAll).
  // Throws config_error for an empty list or a device listed twice (NCCL does not support
  // two ranks on one device: it may hang; distribute allows {0, 0}, a trainer over NCCL
  // does not), nccl_error (naming the devices) when NCCL fails.
  static std::vector<nccl_communicator> local(const std::vector<int>& devices) {
    if (devices.empty()) throw config_error("nccl_communicator::local: no devices given");
    for (std::size_t i = 0; i < devices.size(); ++i)
      for (std::size_t j = 0; j < i; ++j)
        if (devices[i] == devices[j])
          throw config_error("nccl_communicator::local: device " + std::to_string(devices[i]) +
                             " is listed twice (NCCL supports one rank per device)");
    std::vector<ncclComm_t> raw(devices.size());
    const cuda::device_restore keep;
    const ncclResult_t r = ncclCommInitAll(raw.data(), static_cast<int>(devices.size()), devices.data());
    if (r != ncclSuccess) detail::nccl_check(r, ("ncclCommInitAll (devices " + list(devices) + ")").c_str());
    std::vector<nccl_communicator> out;
    out.reserve(devices.size());
    for (std::size_t i = 0; i < devices.size(); ++i)
      out.push_back(nccl_communicator(raw[i], devices[i], static_cast<int>(i),
                                      static_cast<int>(devices.size())));
    return out;
  }

  // A fresh id for a new clique (rank 0 makes it; the others receive its bytes). Throws
  // nccl_error.
  static ncclUniqueId unique_id() {
    ncclUniqueId id{};
    detail::nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    return id;
  }

  // This process's ranks of a clique of `nranks` spread over processes: rank first + i on
  // devices[i] (ncclCommInitRank for each, in one group). Every process of the clique
  // must call it with the same id and nranks. Throws config_error for an empty device
  // list, a device listed twice or ranks outside [0, nranks); cuda_error when a device
  // cannot be made current (checked for every device before any rank joins: a rank
  // added to the group without its siblings would make ncclGroupEnd wait for them
  // forever); nccl_error when NCCL fails. The peers in other processes still wait for
  // this process's ranks: ferry::nccl_communicators agrees on success first.
  static std::vector<nccl_communicator> join(const ncclUniqueId& id, int nranks, int first,
                                             const std::vector<int>& devices) {
    const int k = static_cast<int>(devices.size());
    if (k == 0) throw config_error("nccl_communicator::join: no devices given");
    if (first < 0 || first + k > nranks)
      throw config_error("nccl_communicator::join: ranks " + std::to_string(first) + ".." +
                         std::to_string(first + k - 1) + " do not fit a clique of " +
                         std::to_string(nranks));
    for (std::size_t i = 0; i < devices.size(); ++i)
      for (std::size_t j = 0; j < i; ++j)
        if (devices[i] == devices[j])
          throw config_error("nccl_communicator::join: device " + std::to_string(devices[i]) +
                             " is listed twice (NCCL supports one rank per device)");
    const cuda::device_restore keep;
    for (std::size_t i = 0; i < devices.size(); ++i)
      detail::cuda_check_nccl(cudaSetDevice(devices[i]), "cudaSetDevice", first + static_cast<int>(i), nranks,
                              devices[i], __LINE__);
    std::vector<ncclComm_t> raw(devices.size(), nullptr);
    detail::nccl_check(ncclGroupStart(), "ncclGroupStart");
    ncclResult_t st = ncclSuccess;
    int failed = first;  // the rank the error names
    for (std::size_t i = 0; i < raw.size() && st == ncclSuccess; ++i) {
      failed = first + static_cast<int>(i);
      // Every device was made current just above; a failure now could only come from a
      // device lost meanwhile, and then the group is broken whatever we do.
      if (cudaSetDevice(devices[i]) != cudaSuccess) {
        (void)cudaGetLastError();
        st = ncclUnhandledCudaError;
        break;
      }
      st = ncclCommInitRank(&raw[i], nranks, id, failed);
    }
    const ncclResult_t end = ncclGroupEnd();
    if (st != ncclSuccess || end != ncclSuccess) {
      for (ncclComm_t c : raw)
        if (c) ncclCommAbort(c);
      detail::nccl_check(st, "ncclCommInitRank", failed, nranks, devices[static_cast<std::size_t>(failed - first)]);
      detail::nccl_check(end, ("ncclGroupEnd after ncclCommInitRank of NCCL ranks " + std::to_string(first) + ".." +
                               std::to_string(first + k - 1) + " of " + std::to_string(nranks) + " (devices " +
                               list(devices) + ")").c_str());
    }
    std::vector<nccl_communicator> out;
    out.reserve(devices.size());
    for (std::size_t i = 0; i < raw.size(); ++i)
      out.push_back(nccl_communicator(raw[i], devices[i], first + static_cast<int>(i), nranks));
    return out;
  }

  nccl_communicator(nccl_communicator&& o) noexcept
      : comm_(std::exchange(o.comm_, nullptr)), dev_(o.dev_), rank_(o.rank_), size_(o.size_),
        stream_(o.stream_), scratch_(std::exchange(o.scratch_, nullptr)), aborted_(o.aborted_) {}
  nccl_communicator& operator=(nccl_communicator&& o) noexcept {
    if (this != &o) {
      release();
      comm_ = std::exchange(o.comm_, nullptr);
      dev_ = o.dev_;
      rank_ = o.rank_;
      size_ = o.size_;
      stream_ = o.stream_;
      scratch_ = std::exchange(o.scratch_, nullptr);
      aborted_ = o.aborted_;
    }
    return *this;
  }
  nccl_communicator(const nccl_communicator&) = delete;
  nccl_communicator& operator=(const nccl_communicator&) = delete;
  ~nccl_communicator() { release(); }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  int device() const noexcept { return dev_; }
  // The stream collectives are enqueued on (default: the legacy default stream).
  void set_stream(cuda_stream stream) noexcept { stream_ = stream; }

  // `s` is device memory on device().
  void all_reduce_sum(std::span<float> s) { reduce(s, ncclSum); }
  void all_reduce_average(std::span<float> s) { reduce(s, ncclAvg); }
  void broadcast(std::span<float> s, int root) {
    live("ncclBroadcast");
    const cuda::device_restore keep;
    cuda_check(cudaSetDevice(dev_), "cudaSetDevice", __LINE__);
    check(ncclBroadcast(s.data(), s.data(), s.size(), ncclFloat, root, comm_, stream_), "ncclBroadcast");
  }
  // Every rank's queued work, collectives included, is done when barrier() returns.
  void barrier() {
    live("barrier");
    const cuda::device_restore keep;
    cuda_check(cudaSetDevice(dev_), "cudaSetDevice", __LINE__);
    if (!scratch_) cuda_check(cudaMalloc(&scratch_, sizeof(float)), "cudaMalloc", __LINE__);
    check(ncclAllReduce(scratch_, scratch_, 1, ncclFloat, ncclSum, comm_, stream_), "ncclAllReduce (barrier)");
    // Poll instead of cudaStreamSynchronize: a peer that failed leaves the all-reduce
    // waiting forever, and only the communicator's async error says so.
    for (;;) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) cuda_check(q, "cudaStreamQuery", __LINE__);
      check_async();
      std::this_thread::yield();
    }
    check_async();
  }

  // Throws the communicator's asynchronous error, if any, after aborting the
  // communicator (NCCL's rule: a communicator with an async error is unusable).
  void check_async() {
    live("ncclCommGetAsyncError");
    ncclResult_t a = ncclSuccess;
    check(ncclCommGetAsyncError(comm_, &a), "ncclCommGetAsyncError");
    if (a != ncclSuccess && a != ncclInProgress) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
      aborted_ = true;
      check(a, "an earlier NCCL collective (asynchronous error)");
    }
  }

  // Ends the communicator: ncclCommAbort, which stops its uncompleted collectives. Call it
  // when no thread is inside a call on this communicator. Idempotent; never throws.
  void abort() noexcept {
    if (!comm_) return;
    const cuda::device_restore keep;
    cudaSetDevice(dev_);
    ncclCommAbort(comm_);
    comm_ = nullptr;
    aborted_ = true;
  }
  bool aborted() const noexcept { return aborted_; }

  // Point to point (bytes, device memory on device()), enqueued on `stream`: inside
  // group_start() / group_end(), matched with the peer's call in order (NCCL's rule).
  void send_bytes(const void* p, std::size_t bytes, int peer, cuda_stream stream) {
    live("ncclSend");
    const cuda::device_restore keep;
    cuda_check(cudaSetDevice(dev_), "cudaSetDevice", __LINE__);
    check(ncclSend(p, bytes, ncclUint8, peer, comm_, stream), "ncclSend");
  }
  void recv_bytes(void* p, std::size_t bytes, int peer, cuda_stream stream) {
    live("ncclRecv");
    const cuda::device_restore keep;
    cuda_check(cudaSetDevice(dev_), "cudaSetDevice", __LINE__);
    check(ncclRecv(p, bytes, ncclUint8, peer, comm_, stream), "ncclRecv");
  }

  static void group_start() { detail::nccl_check(ncclGroupStart(), "ncclGroupStart"); }
  static void group_end() { detail::nccl_check(ncclGroupEnd(), "ncclGroupEnd"); }

 private:
  nccl_communicator(ncclComm_t c, int dev, int rank, int size)
      : comm_(c), dev_(dev), rank_(rank), size_(size) {}
  void live(const char* call) const {
    if (!comm_)
      throw error("nccl_communicator (NCCL rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
                  " on device " + std::to_string(dev_) + " of " + cuda_error::host_name() + "): " + call +
                  " on a communicator that was aborted after an earlier failure");
  }
  // This communicator's checks: the errors name its rank and device.
  void check(ncclResult_t r, const char* call) const { detail::nccl_check(r, call, rank_, size_, dev_); }
  void cuda_check(cudaError_t r, const char* call, int line) const {
    detail::cuda_check_nccl(r, call, rank_, size_, dev_, line);
  }
  void reduce(std::span<float> s, ncclRedOp_t op) {
    live("ncclAllReduce");
    const cuda::device_restore keep;
    cuda_check(cudaSetDevice(dev_), "cudaSetDevice", __LINE__);
    check(ncclAllReduce(s.data(), s.data(), s.size(), ncclFloat, op, comm_, stream_), "ncclAllReduce");
  }
  static std::string list(const std::vector<int>& v) {
    std::string s;
    for (int x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
    return s;
  }
  void release() noexcept {
    if (scratch_) cudaFree(scratch_);
    if (comm_) ncclCommDestroy(comm_);
    scratch_ = nullptr;
    comm_ = nullptr;
  }

  ncclComm_t comm_ = nullptr;
  int dev_ = 0, rank_ = 0, size_ = 1;
  cudaStream_t stream_ = nullptr;
  float* scratch_ = nullptr;
  bool aborted_ = false;
};

static_assert(communicator<nccl_communicator>);

// A device_exchange over this process's communicators of one clique (consecutive ranks, in
// order: its replicas'): each all_to_all is one group of ncclSend/ncclRecv, every peer
// included (zero counts too, which NCCL 2.12.10 and later allow), the rank's own part too.
// Holds a reference: the communicators must outlive it. Throws config_error (constructor)
// for no communicators or ranks that are not consecutive, nccl_error when NCCL fails
// (the group is closed first).
class nccl_device_exchange final : public device_exchange {
 public:
  explicit nccl_device_exchange(std::span<nccl_communicator> comms) : comms_(comms) {
    if (comms_.empty()) throw config_error("nccl_device_exchange: no communicators");
    for (std::size_t i = 1; i < comms_.size(); ++i)
      if (comms_[i].rank() != comms_[0].rank() + int(i) || comms_[i].size() != comms_[0].size())
        throw config_error("nccl_device_exchange: the communicators are not consecutive ranks of one clique (rank " +
                           std::to_string(comms_[i].rank()) + " after " + std::to_string(comms_[i - 1].rank()) + ")");
  }
  int size() const override { return comms_[0].size(); }
  int first() const override { return comms_[0].rank(); }
  int local() const override { return int(comms_.size()); }
  int device(int i) const override { return comms_[std::size_t(i)].device(); }
  void all_to_all(std::span<const device_all_to_all_part> parts) override {
    if (parts.size() != comms_.size())
      throw config_error("nccl_device_exchange: " + std::to_string(parts.size()) + " parts for " +
                         std::to_string(comms_.size()) + " ranks");
    nccl_communicator::group_start();
    try {
      for (std::size_t i = 0; i < parts.size(); ++i) {
        const device_all_to_all_part& x = parts[i];
        std::uint64_t so = 0, ro = 0;
        for (int p = 0; p < size(); ++p) {
          if (x.send_at) so = x.send_at[p];
          if (x.recv_at) ro = x.recv_at[p];
          comms_[i].send_bytes(x.send + so, std::size_t(x.send_bytes[p]), p, x.stream);
          comms_[i].recv_bytes(x.recv + ro, std::size_t(x.recv_bytes[p]), p, x.stream);
          so += x.send_bytes[p];
          ro += x.recv_bytes[p];
        }
      }
    } catch (...) {
      (void)ncclGroupEnd();
      throw;
    }
    nccl_communicator::group_end();
  }
  // Aborts every communicator (nccl_communicator::abort): the trainer's too, when they are
  // the same (they should be: see device_exchange.hpp).
  void abort() noexcept override {
    for (nccl_communicator& c : comms_) c.abort();
  }

 private:
  std::span<nccl_communicator> comms_;
};

}  // namespace ferry

#endif  // FERRY_WITH_CUDART
