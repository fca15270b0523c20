// ferry/distributed.hpp: a training job of many processes, launched by mpirun or srun:
// who this process is, which devices it owns, and how it fails.
//
//   int main(int argc, char** argv) {
//     ferry::distributed_context ctx(argc, argv);          // MPI_Init_thread, once
//     return ferry::abort_on_exception([&] {
//       auto files = ... | ferry::shard(ctx.world_size(), ctx.rank());
//       ferry::train::mirrored_trainer<ferry::train::host_backend, ferry::mpi_communicator>
//           t(cfg, opts, ferry::one_replica_per_process(ctx));
//       ...
//       return 0;
//     });
//   }
//
// The context (one per process, made on the main thread before any other thread uses MPI):
//   world_size(), rank()      MPI_COMM_WORLD's size and this process's rank
//   local_rank(), local_size() this process's place among the ranks of its node: from
//                              MPI_Comm_split_type(MPI_COMM_TYPE_SHARED), which works the
//                              same under mpirun, srun and any launcher (the launchers'
//                              own variables, OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID
//                              and SLURM_LOCALID (when srun started the task), are only a
//                              cross-check: a disagreement is a config_error)
//   local_devices()            the CUDA devices this rank owns: devices_per_rank of them,
//                              [local_rank * k, local_rank * k + k), or [0, k) when the
//                              launcher already limited each rank to its own k devices
//                              (srun --gpus-per-task, CUDA_VISIBLE_DEVICES per rank);
//                              empty with no usable device (host replicas)
//   world()                    an mpi_communicator over every rank
// It calls MPI_Init_thread (MPI_THREAD_SERIALIZED: MPI is called from one thread at a
// time) unless MPI is already initialised, and MPI_Finalize in its destructor if it
// initialised MPI.
//
// Failure: one rank's exception must end the whole job, never leave the other ranks
// waiting forever in a collective. abort_on_exception(fn) runs fn; if it throws, it
// prints "rank R: <what()>" on stderr and calls MPI_Abort(MPI_COMM_WORLD, 1), which makes
// mpirun/srun kill every rank and exit non-zero. The context also installs a terminate
// handler that does the same for an exception escaping any thread. (That MPI_Abort may
// come while another thread is inside an MPI call, which MPI_THREAD_SERIALIZED does not
// promise to allow; the job is ending either way, and with Open MPI it ends cleanly:
// tests/mpi, mpi_abort_thread.) A library below MPI_THREAD_SERIALIZED is a config_error.
//
// Throws config_error for bad options (devices_per_rank < 0, too few devices on the node),
// ferry::error when an MPI call fails. Runs no user code except abort_on_exception's fn,
// on the calling thread.
//
// Build: needs MPI (see ferry/collective/mpi.hpp); without mpi.h this header declares
// nothing. nccl_communicators() is there when the target also has FERRY_WITH_CUDART and
// nccl.h.
#pragma once

#include "ferry/collective/mpi.hpp"

#if defined(FERRY_HAVE_MPI)

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/cuda/runtime.hpp"
#include "ferry/error.hpp"

#if defined(FERRY_WITH_CUDART) && __has_include(<nccl.h>)
#include "ferry/collective/nccl.hpp"
#define FERRY_HAVE_NCCL_BOOTSTRAP 1
#endif

namespace ferry {

namespace detail {
// The rank for messages: MPI_COMM_WORLD's rank while MPI is up, else -1.
inline int world_rank_or_minus_one() noexcept {
  int init = 0, fin = 0, r = -1;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// Prints "rank R: msg" and ends the job: MPI_Abort when MPI is up, else _Exit(code).
// Only the first failing thread reports; a second one (say, terminate while the first is
// inside MPI_Abort) stays silent rather than muddle the message.
[[noreturn]] inline void abort_job(const char* msg, int code = 1) noexcept {
  static std::atomic<bool> reported{false};
  const int r = world_rank_or_minus_one();
  if (!reported.exchange(true)) {
    std::fprintf(stderr, "rank %d: %s\n", r, msg);
    std::fflush(stderr);
  }
  if (r >= 0) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort does not return; this covers "no MPI"
}

inline void terminate_handler() noexcept {
  if (std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      abort_job((std::string("uncaught exception: ") + x.what()).c_str());
    } catch (...) {
      abort_job("uncaught exception of unknown type");
    }
  }
  abort_job("std::terminate called");
}

// The launcher's local rank from its environment, or -1: Open MPI's, MPICH's and Intel
// MPI's (hydra) own variable first, then Slurm's only where srun started this very task
// (SLURM_PROCID is this rank): under mpiexec inside an allocation every rank inherits its
// node's proxy's SLURM_LOCALID (0), which would refuse every other local rank.
inline int launcher_local_rank(int world_rank) noexcept {
  const auto number = [](const char* v) -> long {
    const char* s = std::getenv(v);
    if (!s) return -1;
    char* end = nullptr;
    const long x = std::strtol(s, &end, 10);
    return end != s && *end == '\0' && x >= 0 ? x : -1;
  };
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"})
    if (const long x = number(v); x >= 0) return static_cast<int>(x);
  if (const long x = number("SLURM_LOCALID"); x >= 0 && number("SLURM_PROCID") == world_rank)
    return static_cast<int>(x);
  return -1;
}
}  // namespace detail

// Runs fn() and returns its result; if it throws, prints "rank R: <what>" on stderr and
// aborts the whole job (MPI_Abort(MPI_COMM_WORLD, 1)). Never returns after a throw.
template <class F>
decltype(auto) abort_on_exception(F&& fn) noexcept {
  try {
    return std::forward<F>(fn)();
  } catch (const std::exception& e) {
    detail::abort_job(e.what());
  } catch (...) {
    detail::abort_job("exception of unknown type");
  }
}

struct distributed_options {
  int devices_per_rank = 1;        // CUDA devices each rank drives (0: host replicas only)
  bool install_terminate = true;   // std::set_terminate(abort the job with this rank's name)
};

// Computes the devices a rank owns (see the header comment); exposed for tests.
// Throws config_error when the node has too few devices for its ranks.
inline std::vector<int> pick_local_devices(int local_rank, int local_size, int per_rank,
                                           int visible) {
  if (per_rank < 0) throw config_error("distributed_context: devices_per_rank must be >= 0");
  if (per_rank == 0 || visible == 0) return {};
  int first = local_rank * per_rank;
  if (visible == per_rank) first = 0;  // the launcher gave each rank only its own devices
  else if (first + per_rank > visible)
    throw config_error("distributed_context: local rank " + std::to_string(local_rank) + " of " +
                       std::to_string(local_size) + " needs devices " + std::to_string(first) +
                       ".." + std::to_string(first + per_rank - 1) + " but this node shows " +
                       std::to_string(visible) + " (launch fewer ranks per node, or lower "
                       "devices_per_rank)");
  std::vector<int> d(static_cast<std::size_t>(per_rank));
  for (int i = 0; i < per_rank; ++i) d[static_cast<std::size_t>(i)] = first + i;
  return d;
}

class distributed_context {
 public:
  distributed_context(int& argc, char**& argv, distributed_options o = {}) { init(&argc, &argv, o); }
  explicit distributed_context(distributed_options o = {}) { init(nullptr, nullptr, o); }
  distributed_context(const distributed_context&) = delete;
  distributed_context& operator=(const distributed_context&) = delete;
  ~distributed_context() {
    world_.reset();
    if (local_ != MPI_COMM_NULL) MPI_Comm_free(&local_);
    if (owns_mpi_) {
      int fin = 0;
      MPI_Finalized(&fin);
      if (!fin) MPI_Finalize();
    }
  }

  int world_size() const noexcept { return size_; }
  int rank() const noexcept { return rank_; }
  int local_rank() const noexcept { return local_rank_; }
  int local_size() const noexcept { return local_size_; }
  const std::vector<int>& local_devices() const noexcept { return devices_; }
  const std::string& host() const noexcept { return host_; }
  mpi_communicator& world() noexcept { return *world_; }
  // Ranks of this node (MPI_COMM_TYPE_SHARED), for node-local collectives.
  MPI_Comm local_comm() const noexcept { return local_; }

 private:
  void init(int* argc, char*** argv, const distributed_options& o) {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (fin) throw config_error("distributed_context: MPI was already finalised");
    if (!init) {
      int provided = 0;
      detail::mpi_check(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided),
                        "MPI_Init_thread");
      if (provided < MPI_THREAD_SERIALIZED) {  // the trainer's threads may make the calls
        MPI_Finalize();
        throw config_error("distributed_context: this MPI library gives thread level " + std::to_string(provided) +
                           ", below MPI_THREAD_SERIALIZED, which ferry needs (MPI calls come from one "
                           "thread at a time, not always the main one)");
      }
      owns_mpi_ = true;
    }
    if (o.install_terminate) std::set_terminate(detail::terminate_handler);
    world_ = std::make_unique<mpi_communicator>(MPI_COMM_WORLD);
    rank_ = world_->rank();
    size_ = world_->size();
    detail::mpi_check(MPI_Comm_split_type(world_->native(), MPI_COMM_TYPE_SHARED, rank_,
                                          MPI_INFO_NULL, &local_),
                      "MPI_Comm_split_type");
    detail::mpi_check(MPI_Comm_rank(local_, &local_rank_), "MPI_Comm_rank");
    detail::mpi_check(MPI_Comm_size(local_, &local_size_), "MPI_Comm_size");
    const int env = detail::launcher_local_rank(rank_);
    if (env >= 0 && env != local_rank_)
      throw config_error("distributed_context: the launcher says local rank " +
                         std::to_string(env) + ", MPI's shared-memory split says " +
                         std::to_string(local_rank_) + " (rank " + std::to_string(rank_) + ")");
    char name[MPI_MAX_PROCESSOR_NAME];
    int len = 0;
    if (MPI_Get_processor_name(name, &len) == MPI_SUCCESS) host_.assign(name, std::size_t(len));
    devices_ = pick_local_devices(local_rank_, local_size_, o.devices_per_rank,
                                  cuda::device_count());
  }

  bool owns_mpi_ = false;
  std::unique_ptr<mpi_communicator> world_;
  MPI_Comm local_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1;
  std::vector<int> devices_;
  std::string host_;
};

// The communicators of a host-replica job with one replica per process: a vector of one
// mpi_communicator over every rank, ready for mirrored_trainer's constructor.
inline std::vector<mpi_communicator> one_replica_per_process(distributed_context& ctx) {
  std::vector<mpi_communicator> v;
  v.emplace_back(ctx.world().native());
  return v;
}

#if defined(FERRY_HAVE_NCCL_BOOTSTRAP)
// NCCL across processes and nodes: one nccl_communicator per local device of this rank,
// NCCL ranks numbered rank by rank (rank r's devices follow rank r-1's). Rank 0 makes the
// ncclUniqueId and broadcasts it over MPI; every rank then joins (ncclCommInitRank in a
// group). Collective: every rank must call it. All ranks throw or none: each first checks
// that it owns a device and can make each current, and the ranks agree on that (one
// MPI_Allreduce) before any waits where a rank that threw would never come (MPI_Exscan,
// MPI_Bcast, NCCL's rendezvous); rank 0's ncclGetUniqueId result travels with the id. So
// a job that catches the error (to fall back to host replicas, say) does so on every rank.
// Throws, on the rank at fault: config_error when it owns no device, cuda_error when it
// cannot make one current, nccl_error when ncclGetUniqueId fails; on the others,
// config_error or ferry::error naming that rank. nccl_error or ferry::error when NCCL or
// MPI fails later (a failure inside NCCL's own join still leaves the peers waiting there:
// abort_on_exception ends the job).
inline std::vector<nccl_communicator> nccl_communicators(distributed_context& ctx) {
  const auto& dev = ctx.local_devices();
  mpi_communicator& w = ctx.world();
  std::exception_ptr mine;
  std::int64_t fault = 0;  // 1: no device, 2: a device it cannot make current
  if (dev.empty()) {
    fault = 1;
    mine = std::make_exception_ptr(config_error("nccl_communicators: rank " + std::to_string(ctx.rank()) +
                                                " owns no CUDA device (" +
                                                (cuda::unavailable_reason().empty()
                                                     ? std::string("devices_per_rank is 0")
                                                     : cuda::unavailable_reason()) +
                                                ")"));
  } else {
    const cuda::device_restore keep;
    for (int d : dev)
      if (const cudaError_t e = cudaSetDevice(d); e != cudaSuccess) {
        fault = 2;
        mine = std::make_exception_ptr(cuda::detail::make_cuda_error(
            e, "cudaSetDevice for nccl_communicators on rank " + std::to_string(ctx.rank()), d, __FILE__, __LINE__));
        break;
      }
  }
  // The first rank at fault and why (rank * 4 + fault: the minimum is the lowest rank).
  constexpr std::int64_t none = std::numeric_limits<std::int64_t>::max();
  const std::int64_t worst = w.all_reduce_min(fault ? std::int64_t(ctx.rank()) * 4 + fault : none);
  if (worst != none) {
    if (mine) std::rethrow_exception(mine);
    const std::string who = "nccl_communicators: rank " + std::to_string(worst / 4);
    if (worst % 4 == 1) throw config_error(who + " owns no CUDA device, so no rank joins NCCL");
    throw error(who + " cannot make one of its CUDA devices current (its error says which), so no rank joins NCCL");
  }
  const int first = static_cast<int>(w.exclusive_scan_sum(std::int64_t(dev.size())));
  const int total = static_cast<int>(w.all_reduce_sum(std::int64_t(dev.size())));
  struct {
    ncclUniqueId id;
    std::int32_t made;  // rank 0's ncclGetUniqueId succeeded
  } msg{};
  if (w.rank() == 0) {
    try {
      msg.id = nccl_communicator::unique_id();
      msg.made = 1;
    } catch (...) {
      mine = std::current_exception();  // thrown after the broadcast, which the others wait in
    }
  }
  w.broadcast_bytes(std::as_writable_bytes(std::span(&msg, 1)), 0);
  if (mine) std::rethrow_exception(mine);
  if (!msg.made)
    throw error("nccl_communicators: rank 0 could not make the NCCL id (ncclGetUniqueId failed there; its error "
                "says why), so no rank joins NCCL");
  return nccl_communicator::join(msg.id, total, first, dev);
}
#endif

}  // namespace ferry

#endif  // FERRY_HAVE_MPI
