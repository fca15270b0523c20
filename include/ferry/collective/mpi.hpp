// ferry/collective/mpi.hpp: the MPI communicator: one rank per process, across nodes;
// the communicator of host replicas in different processes (mpirun / srun).
//
//   ferry::mpi_communicator world;                    // a private duplicate of MPI_COMM_WORLD
//   world.all_reduce_average(host_grads);             // MPI_Allreduce(MPI_IN_PLACE, ..., MPI_SUM)
//   const auto n = world.all_reduce_min(local_steps); // integers: MIN / MAX / SUM
//   world.all_to_all_bytes(send, counts, recv, rcounts, row_bytes);  // rows between ranks
//                                                     // (rank_exchange_over: cache_on_device)
//
// Satisfies ferry::communicator, so mirrored_trainer<host_backend, mpi_communicator> trains
// one replica per process with no change to the trainer (see docs/multi_node.md).
//
// The communicator owns a duplicate of the MPI communicator it is given (MPI_Comm_dup), so
// its collectives never match a user's own messages, and sets MPI_ERRORS_RETURN on it: a
// failing MPI call throws ferry::error naming the call and MPI's error string instead of
// MPI's default of killing the job without a word. MPI must be initialised (see
// ferry/distributed.hpp) before one is made and still initialised when it is destroyed.
//
// Spans are host memory. Every rank must call the same collectives in the same order with
// the same lengths (MPI's contract; a length mismatch is undefined in MPI, so it is not
// checked here: the trainer's buffers have the same size everywhere by construction).
// Buffers longer than INT_MAX elements are reduced in pieces.
//
// Threads: one communicator is used by one thread at a time; MPI itself must have been
// initialised with at least MPI_THREAD_SERIALIZED if different threads take turns.
// Runs no user code. Not copyable; movable.
//
// Build: the target needs MPI's headers and library (Meson: dependency('mpi', language:
// 'cpp'), plus -DOMPI_SKIP_MPICXX=1). Without mpi.h on the include path this header
// declares nothing (FERRY_HAVE_MPI stays undefined), so a build without MPI still compiles
// every header.
#pragma once

#if __has_include(<mpi.h>)
#define FERRY_HAVE_MPI 1

#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1  // Open MPI's deprecated C++ bindings: not wanted, not linked
#endif
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ferry/collective/communicator.hpp"
#include "ferry/error.hpp"

namespace ferry {

namespace detail {
inline void mpi_check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) len = 0;
  throw error(std::string("MPI: ") + call + " failed: " +
              (len > 0 ? std::string(msg, static_cast<std::size_t>(len)) : "error " + std::to_string(rc)));
}
inline void require_mpi(const char* who) {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin)
    throw config_error(std::string(who) +
                       ": MPI is not initialised (make a ferry::distributed_context first)");
}
}  // namespace detail

class mpi_communicator {
 public:
  static constexpr span_memory memory = span_memory::host;  // see the file's top

  // A duplicate of `comm` (default MPI_COMM_WORLD). Throws config_error when MPI is not
  // initialised, ferry::error when MPI_Comm_dup fails.
  explicit mpi_communicator(MPI_Comm comm = MPI_COMM_WORLD) {
    detail::require_mpi("mpi_communicator");
    detail::mpi_check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    detail::mpi_check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    detail::mpi_check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }
  mpi_communicator(mpi_communicator&& o) noexcept
      : comm_(std::exchange(o.comm_, MPI_COMM_NULL)), rank_(o.rank_), size_(o.size_) {}
  mpi_communicator& operator=(mpi_communicator&& o) noexcept {
    if (this != &o) {
      release();
      comm_ = std::exchange(o.comm_, MPI_COMM_NULL);
      rank_ = o.rank_;
      size_ = o.size_;
    }
    return *this;
  }
  mpi_communicator(const mpi_communicator&) = delete;
  mpi_communicator& operator=(const mpi_communicator&) = delete;
  ~mpi_communicator() { release(); }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  MPI_Comm native() const noexcept { return comm_; }

  // The communicator concept (host floats, in place).
  void all_reduce_sum(std::span<float> s) { reduce(s.data(), s.size(), MPI_FLOAT, MPI_SUM); }
  void all_reduce_average(std::span<float> s) {
    all_reduce_sum(s);
    const float k = 1.0f / static_cast<float>(size_);
    for (float& x : s) x *= k;
  }
  void broadcast(std::span<float> s, int root) {
    check_root(root, "broadcast");
    for (std::size_t off = 0; off < s.size(); off += piece)
      detail::mpi_check(MPI_Bcast(s.data() + off, count(s.size() - off), MPI_FLOAT, root, comm_),
                        "MPI_Bcast");
  }
  void barrier() { detail::mpi_check(MPI_Barrier(comm_), "MPI_Barrier"); }

  // Bytes from root to every rank (e.g. an ncclUniqueId).
  void broadcast_bytes(std::span<std::byte> s, int root) {
    check_root(root, "broadcast_bytes");
    for (std::size_t off = 0; off < s.size(); off += piece)
      detail::mpi_check(MPI_Bcast(s.data() + off, count(s.size() - off), MPI_BYTE, root, comm_),
                        "MPI_Bcast");
  }

  // Integer reductions of one value: what the step agreement and the tests need.
  std::int64_t all_reduce_min(std::int64_t v) { return reduce1(v, MPI_MIN); }
  std::int64_t all_reduce_max(std::int64_t v) { return reduce1(v, MPI_MAX); }
  std::int64_t all_reduce_sum(std::int64_t v) { return reduce1(v, MPI_SUM); }
  // Sum of the values of ranks 0..rank()-1 (0 on rank 0): a rank's offset.
  std::int64_t exclusive_scan_sum(std::int64_t v) {
    std::int64_t out = 0;
    detail::mpi_check(MPI_Exscan(&v, &out, 1, MPI_INT64_T, MPI_SUM, comm_), "MPI_Exscan");
    return rank_ == 0 ? 0 : out;  // MPI leaves rank 0's result undefined
  }
  // In-place element-wise integer sum (e.g. per-record visit counts).
  void all_reduce_sum(std::span<std::int64_t> s) {
    reduce(s.data(), s.size(), MPI_INT64_T, MPI_SUM);
  }

  // Every rank's `bytes` bytes, rank by rank, into `all` (size() x bytes): MPI_Allgather.
  // Throws ferry::error past INT_MAX bytes a rank.
  void all_gather_bytes(const void* mine, std::size_t bytes, void* all) {
    detail::mpi_check(MPI_Allgather(mine, as_int(bytes, "all_gather_bytes"), MPI_BYTE, all,
                                    as_int(bytes, "all_gather_bytes"), MPI_BYTE, comm_),
                      "MPI_Allgather");
  }
  // Units of `unit` bytes to and from every rank (counts per rank, rank by rank in the
  // buffers): MPI_Alltoallv, in bytes while every rank's buffers hold at most INT_MAX bytes,
  // else over a contiguous type of `unit` bytes (counts and offsets in units; the ranks agree
  // which, by an all-reduce). Throws ferry::error on every rank when a rank's buffer passes
  // INT_MAX units, for a unit of 0.
  void all_to_all_bytes(const void* send, const std::uint64_t* send_counts, void* recv,
                        const std::uint64_t* recv_counts, std::size_t unit) {
    if (unit == 0) throw error("MPI: all_to_all_bytes: a unit of 0 bytes");
    const std::size_t n = std::size_t(size_);
    std::uint64_t so = 0, ro = 0;
    for (std::size_t p = 0; p < n; ++p) so += send_counts[p], ro += recv_counts[p];
    // Every rank picks the same path and fails alike (counts differ by rank): MAX of a code.
    const std::uint64_t most = std::max(so, ro);
    int path = most <= std::uint64_t(INT_MAX) / unit ? 0 : most <= std::uint64_t(INT_MAX) ? 1 : 2;
    detail::mpi_check(MPI_Allreduce(MPI_IN_PLACE, &path, 1, MPI_INT, MPI_MAX, comm_), "MPI_Allreduce");
    if (path == 2)
      throw error("MPI: all_to_all_bytes: a rank trades more than INT_MAX units of " + std::to_string(unit) + " bytes");
    const bool bytes = path == 0;  // MPI_BYTE: the fastest path
    const std::uint64_t scale = bytes ? unit : 1;
    std::vector<int> sc(n), sd(n), rc(n), rd(n);
    so = ro = 0;
    for (std::size_t p = 0; p < n; ++p) {
      sd[p] = as_int(so * scale, "all_to_all_bytes");
      rd[p] = as_int(ro * scale, "all_to_all_bytes");
      sc[p] = as_int(send_counts[p] * scale, "all_to_all_bytes");
      rc[p] = as_int(recv_counts[p] * scale, "all_to_all_bytes");
      so += send_counts[p];
      ro += recv_counts[p];
    }
    MPI_Datatype t = MPI_BYTE;
    if (!bytes) {
      detail::mpi_check(MPI_Type_contiguous(as_int(unit, "all_to_all_bytes"), MPI_BYTE, &t), "MPI_Type_contiguous");
      if (const int status = MPI_Type_commit(&t); status != MPI_SUCCESS) {
        MPI_Type_free(&t);
        detail::mpi_check(status, "MPI_Type_commit");
      }
    }
    const int rc_all = MPI_Alltoallv(send, sc.data(), sd.data(), t, recv, rc.data(), rd.data(), t, comm_);
    if (!bytes) MPI_Type_free(&t);
    detail::mpi_check(rc_all, "MPI_Alltoallv");
  }

 private:
  static constexpr std::size_t piece = std::size_t(1) << 30;  // < INT_MAX elements per call
  static int count(std::size_t left) { return static_cast<int>(std::min(left, piece)); }
  static int as_int(std::uint64_t v, const char* what) {
    if (v > std::uint64_t(INT_MAX))
      throw error(std::string("MPI: ") + what + ": " + std::to_string(v) + " is past INT_MAX (MPI's counts are int)");
    return int(v);
  }

  void reduce(void* data, std::size_t n, MPI_Datatype t, MPI_Op op) {
    int tsize = 0;
    MPI_Type_size(t, &tsize);
    auto* p = static_cast<char*>(data);
    for (std::size_t off = 0; off < n; off += piece)
      detail::mpi_check(MPI_Allreduce(MPI_IN_PLACE, p + off * std::size_t(tsize), count(n - off),
                                      t, op, comm_),
                        "MPI_Allreduce");
  }
  std::int64_t reduce1(std::int64_t v, MPI_Op op) {
    detail::mpi_check(MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT64_T, op, comm_),
                      "MPI_Allreduce");
    return v;
  }
  void check_root(int root, const char* what) const {
    if (root < 0 || root >= size_)
      throw config_error(std::string("mpi_communicator::") + what + ": root " +
                         std::to_string(root) + " is not a rank of a group of " +
                         std::to_string(size_));
  }
  void release() noexcept {
    if (comm_ == MPI_COMM_NULL) return;
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin) MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
};

static_assert(communicator<mpi_communicator>);

}  // namespace ferry

#endif  // __has_include(<mpi.h>)
