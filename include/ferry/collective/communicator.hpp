// ferry/collective/communicator.hpp: the `communicator` concept, the one interface the
// mirrored trainer uses to keep replicas identical.
//
// A communicator is one rank's handle on a group of `size()` ranks. Every rank of the
// group calls the same collectives in the same order (that is the caller's contract; the
// trainer guarantees it by giving every replica the same number of steps):
//
//   c.rank(), c.size()             this rank's index in [0, size), the group size
//   c.all_reduce_sum(span)         in place: every rank ends with the element-wise sum
//   c.all_reduce_average(span)     in place: the sum divided by size()
//   c.broadcast(span, root)        in place: every rank ends with root's values
//   c.barrier()                    returns once every rank has entered it
//
// Implementations (one header each, each optional):
//   thread_communicator   (thread_collective.hpp)  N replica threads of one process
//   nccl_communicator     (nccl.hpp)               one rank per local GPU (FERRY_WITH_CUDART
//                                                  + nccl.h); spans are device memory
//   mpi_communicator      (mpi.hpp, issue 6)       one rank per process across nodes:
//                                                  MPI_Allreduce / MPI_Bcast / MPI_Barrier
//                                                  on a private duplicate of the job's
//                                                  communicator (MPI_Comm_dup). It only
//                                                  has to satisfy this concept; the
//                                                  trainer needs no change.
//
// Threads: a rank's collectives are called by the one thread that drives that rank (the
// trainer's replica thread); they run no user code.
//
// Memory: spans are wherever the backend's buffers live (host for threads and MPI, device
// for NCCL). A communicator says which with `static constexpr ferry::span_memory memory`
// (span_memory_of<C>; host when it says nothing), and mirrored_trainer refuses at compile
// time a backend whose memory is the other kind (NCCL handed host buffers, or a thread
// all-reduce handed device pointers, would fail or read garbage at run time).
// Collectives throw ferry::error (or a subclass) on failure; a failed collective leaves
// the group unusable.
#pragma once

#include <concepts>
#include <cstddef>
#include <span>

namespace ferry {

// Where a communicator's spans must be: host memory, device memory, or either (a
// communicator that touches none, solo_communicator).
enum class span_memory { host, device, any };

// C::memory when C declares it, else span_memory::host (see Memory above).
template <class C>
inline constexpr span_memory span_memory_of = [] {
  if constexpr (requires { { C::memory } -> std::convertible_to<span_memory>; })
    return span_memory(C::memory);
  else
    return span_memory::host;
}();

template <class C>
concept communicator = requires(C& c, const C& cc, std::span<float> s, int root) {
  { cc.rank() } -> std::convertible_to<int>;
  { cc.size() } -> std::convertible_to<int>;
  c.all_reduce_sum(s);
  c.all_reduce_average(s);
  c.broadcast(s, root);
  c.barrier();
};

// A group of one: every collective is the identity. The trainer's 1-replica fast path.
class solo_communicator {
 public:
  static constexpr span_memory memory = span_memory::any;  // it touches no memory

  // Always 0.
  int rank() const noexcept { return 0; }
  // Always 1.
  int size() const noexcept { return 1; }
  // Leaves the values as they are (the sum over one rank).
  void all_reduce_sum(std::span<float>) noexcept {}
  // Leaves the values as they are (the average over one rank).
  void all_reduce_average(std::span<float>) noexcept {}
  // Leaves the values as they are (this rank is the root).
  void broadcast(std::span<float>, int) noexcept {}
  // Returns at once.
  void barrier() noexcept {}
};
static_assert(communicator<solo_communicator>);

}  // namespace ferry
