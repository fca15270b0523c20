// ferry/collective/thread_collective.hpp: collectives among N threads of one process, the
// communicator of host replicas.
//
//   ferry::thread_group g(4);                 // shared by the 4 replica threads
//   auto c = g.communicator(r);               // on replica thread r
//   c.all_reduce_average(grads);              // every thread calls it, same length
//
// all_reduce: each rank posts its buffer, then rank r sums slice r of every buffer in rank
// order 0..N-1 and writes the sum into slice r of every buffer (a reduce-scatter and an
// all-gather in one pass, no staging copy). Every rank ends with bit-identical values, and
// the result does not depend on thread timing. Two barriers per call; no allocation.
//
// Failure: if one thread fails (its replica threw), abort() (on the group or any of its
// communicators, from any thread) wakes every thread waiting to enter a collective and makes
// it throw ferry::error (naming its rank and who aborted) instead of waiting forever; every
// later collective throws the same until reset(). Once every rank has posted its buffer
// the collective is finished, abort or not: each rank reads and writes the others' buffers
// until the last is done (memory only, nothing that can fail), and one that threw then
// would free its buffer under the others. A thread that was waiting to enter when abort()
// was called (its barrier not complete) throws even if reset() runs before it wakes, so reset() may be called as soon
// as the caller knows the threads it cares about are out; but only whoever drives every
// rank can know that no rank is still on its way into the aborted collective (a rank that
// enters after the reset waits for peers that have left): see mirrored_trainer.
// Lengths: all_reduce buffers must all have the same length (config_error otherwise, on
// every rank); in broadcast, only the ranks whose length differs from the root's throw
// config_error (the others, the root included, return with their copy done).
//
// Thread safety: a thread_group is shared by its N threads; each thread_communicator is
// used by one thread. Runs no user code.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "ferry/collective/communicator.hpp"
#include "ferry/error.hpp"

namespace ferry {

class thread_communicator;

// The shared state of N threads' collectives; each thread takes its communicator(rank).
class thread_group {
 public:
  // Throws config_error for size < 1.
  explicit thread_group(int size)
      : n_(size), bufs_(size > 0 ? static_cast<std::size_t>(size) : 0),
        lens_(size > 0 ? static_cast<std::size_t>(size) : 0) {
    if (size < 1)
      throw config_error("thread_group: the group needs at least 1 thread (got " +
                         std::to_string(size) + ")");
  }
  thread_group(const thread_group&) = delete;
  thread_group& operator=(const thread_group&) = delete;

  // The number of threads N.
  int size() const noexcept { return n_; }
  // Rank `rank`'s handle, for the thread that drives it; throws config_error for a rank
  // outside [0, N).
  inline thread_communicator communicator(int rank);

  // Wakes every waiter; every later collective throws (until reset()). Called when a member
  // thread fails; the error the others throw says it came from the group, not a rank.
  void abort() noexcept { abort_by(-1); }
  // Whether abort() was called since the last reset().
  bool aborted() const noexcept {
    std::lock_guard lk(m_);
    return aborted_;
  }
  // Threads waiting at the barrier now, blocked until the rest arrive (a diagnostic: how
  // many of the group reached the current collective).
  int waiting() const noexcept {
    std::lock_guard lk(m_);
    return waiting_;
  }
  // Makes the group usable again after abort(). Threads that were waiting at the abort
  // still throw, whenever they wake; every rank must be out of the aborted collective (or
  // not yet in it, and then expected to make no call of it: see the file's top).
  void reset() noexcept {
    std::lock_guard lk(m_);
    aborted_ = false;
  }

  // A reusable generation barrier that abort() can break; throws ferry::error after abort().
  void barrier() { barrier(-1); }

 private:
  friend class thread_communicator;

  // abort() by `rank` (-1: through the group), named in the others' errors.
  void abort_by(int rank) noexcept {
    {
      std::lock_guard lk(m_);
      if (!aborted_) aborted_by_ = rank;  // the first abort names the culprit, not the echoes
      aborted_ = true;
      ++aborts_;     // the threads waiting now throw when they wake, even after a reset()
      waiting_ = 0;  // and no longer count towards the next barrier
    }
    cv_.notify_all();
  }

  // The error of `rank` (-1: a caller of thread_group::barrier()) in an aborted collective.
  error aborted_error(int rank) const {
    const std::string who = rank < 0 ? std::string("thread_group") : "thread_group rank " +
                            std::to_string(rank) + " of " + std::to_string(n_);
    const std::string by = aborted_by_ < 0 ? std::string("thread_group::abort()") :
                           "rank " + std::to_string(aborted_by_);
    return error(who + ": the collective was aborted by " + by + " (a replica failed)");
  }

  // The barrier of rank `rank` (-1 when unknown: thread_group::barrier()), which abort()
  // breaks until it completes.
  void barrier(int rank) {
    std::unique_lock lk(m_);
    if (aborted_) throw aborted_error(rank);
    // aborts_, not aborted_: a reset() before this thread wakes must not send it back to
    // sleep waiting for peers that already left.
    const std::uint64_t gen = gen_, aborts = aborts_;
    if (++waiting_ == n_) {
      waiting_ = 0;
      completed_ = {gen, aborts};
      ++gen_;
      lk.unlock();
      cv_.notify_all();
      return;
    }
    cv_.wait(lk, [&] { return gen_ != gen || aborts_ != aborts; });
    // Completed with this thread in it (before any abort): the others are past it, into
    // this thread's buffer, so it goes on even if an abort came since. Nothing completes
    // after that until this thread arrives again, so completed_ still says so. Otherwise
    // aborted: after abort() and reset(), fresh arrivals may complete a barrier of this
    // generation without this thread, which their aborts_ tells apart.
    if (completed_.gen == gen && completed_.aborts == aborts) return;
    throw aborted_error(rank);
  }

  // The barrier that ends a collective, after every rank posted its buffer: abort() does not
  // break it (each rank is past the first barrier, and gets here after memory work alone).
  void exit_barrier() noexcept {
    std::unique_lock lk(m_);
    const std::uint64_t gen = exit_gen_;
    if (++exit_waiting_ == n_) {
      exit_waiting_ = 0;
      ++exit_gen_;
      lk.unlock();
      cv_.notify_all();
      return;
    }
    cv_.wait(lk, [&] { return exit_gen_ != gen; });
  }

  void all_reduce(int rank, std::span<float> s, bool average) {
    // rank is in [0, n_) (communicator() checked it), n_ >= 1 (the constructor did)
    const auto r = static_cast<std::size_t>(rank), n = static_cast<std::size_t>(n_);
    bufs_[r] = s.data();
    lens_[r] = s.size();
    barrier(rank);
    for (std::size_t q = 0; q < n; ++q)
      if (lens_[q] != s.size()) {
        const std::size_t theirs = lens_[q];  // read before the barrier: after it rank q may post its next call's
        exit_barrier();  // let every rank see the mismatch before anyone reposts
        throw config_error("thread_group::all_reduce: ranks passed buffers of different "
                           "lengths (" + std::to_string(theirs) + " on rank " +
                           std::to_string(q) + ", " + std::to_string(s.size()) + " on rank " +
                           std::to_string(rank) + ")");
      }
    if (n_ == 1) return;  // the sum (and mean) of one buffer is itself
    const std::size_t len = s.size();
    const std::size_t lo = len * r / n, hi = len * (r + 1) / n;
    const float scale = average ? 1.0f / static_cast<float>(n_) : 1.0f;
    // Whole-slice passes (they vectorize), adding in rank order 0..N-1 as before.
    float* const acc = bufs_[0];
    for (std::size_t q = 1; q < n; ++q) {
      const float* const b = bufs_[q];
      for (std::size_t i = lo; i < hi; ++i) acc[i] += b[i];
    }
    if (average)
      for (std::size_t i = lo; i < hi; ++i) acc[i] *= scale;
    if (hi > lo)  // (an empty buffer may be null)
      for (std::size_t q = 1; q < n; ++q)
        std::memcpy(bufs_[q] + lo, acc + lo, (hi - lo) * sizeof(float));
    exit_barrier();  // nobody returns (and reuses or frees its buffer) while others still read or write it
  }

  void broadcast(int rank, std::span<float> s, int root) {
    if (root < 0 || root >= n_)
      throw config_error("thread_group::broadcast: root " + std::to_string(root) +
                         " is not a rank of a group of " + std::to_string(n_));
    // rank is in [0, n_) (communicator() checked it), root too (just checked)
    const auto r = static_cast<std::size_t>(rank), from = static_cast<std::size_t>(root);
    bufs_[r] = s.data();
    lens_[r] = s.size();
    barrier(rank);
    if (const std::size_t root_len = lens_[from]; root_len != s.size()) {  // before the barrier, as in all_reduce
      exit_barrier();
      throw config_error("thread_group::broadcast: rank " + std::to_string(rank) + " passed " +
                         std::to_string(s.size()) + " floats, the root " + std::to_string(root_len));
    }
    if (rank != root)
      for (std::size_t i = 0; i < s.size(); ++i) s[i] = bufs_[from][i];
    exit_barrier();
  }

  int n_;
  std::vector<float*> bufs_;
  std::vector<std::size_t> lens_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  int waiting_ = 0;
  std::uint64_t gen_ = 0;
  std::uint64_t aborts_ = 0;  // abort() calls ever: what a waiter compares, as aborted_ may be reset
  struct completion {
    std::uint64_t gen = ~std::uint64_t(0), aborts = 0;
  } completed_;  // the last barrier() that completed: its generation, and aborts_ then
  int exit_waiting_ = 0;      // exit_barrier(), apart: abort() leaves it alone
  std::uint64_t exit_gen_ = 0;
  int aborted_by_ = -1;       // the rank of the first abort() since reset() (-1: the group's own)
  bool aborted_ = false;
};

// One rank's handle on a thread_group; satisfies ferry::communicator.
class thread_communicator {
 public:
  static constexpr span_memory memory = span_memory::host;  // the ranks' threads read each other's buffers

  // This rank's index in [0, size()).
  int rank() const noexcept { return rank_; }
  // The group's thread count.
  int size() const noexcept { return g_->size(); }
  // In place, the element-wise sum over every rank (see the file's top); throws
  // config_error for lengths that differ, ferry::error after abort().
  void all_reduce_sum(std::span<float> s) { g_->all_reduce(rank_, s, false); }
  // all_reduce_sum divided by size().
  void all_reduce_average(std::span<float> s) { g_->all_reduce(rank_, s, true); }
  // In place, root's values on every rank; throws config_error on a rank whose length
  // differs from root's, ferry::error after abort().
  void broadcast(std::span<float> s, int root) { g_->broadcast(rank_, s, root); }
  // Returns once every rank has entered it; throws ferry::error after abort().
  void barrier() { g_->barrier(rank_); }
  // The group's abort() and reset(): thread-safe, so a trainer can release the other ranks
  // from the failing rank's thread, holding communicators only (no thread_group). The
  // others' errors name this rank.
  void abort() noexcept { g_->abort_by(rank_); }
  // The group's reset() (see abort()).
  void reset() noexcept { g_->reset(); }

 private:
  friend class thread_group;
  thread_communicator(thread_group* g, int rank) : g_(g), rank_(rank) {}
  thread_group* g_;
  int rank_;
};

inline thread_communicator thread_group::communicator(int rank) {
  if (rank < 0 || rank >= n_)
    throw config_error("thread_group::communicator: rank " + std::to_string(rank) +
                       " is not in [0, " + std::to_string(n_) + ")");
  return thread_communicator(this, rank);
}

static_assert(communicator<thread_communicator>);

}  // namespace ferry
