// ferry/stages/take.hpp: take(n) hands on the first n elements of every epoch, then ends
// it; skip(n)'s complement.
//
//   src | ferry::take(1000)   // the validation split
//   src | ferry::skip(1000)   // the training split: everything after it
//
// Pulls at most n elements from upstream (never one more), and once n are taken it calls
// the upstream no more until rewind(): take(0) never pulls at all (nor starts a parallel
// map's workers upstream). Every epoch (every pass after rewind()) hands on its own first
// n.
//
// Threads: runs on the thread that calls next(); take runs no user code and starts no
// thread.
//
// Errors: take throws nothing itself, but restore() refuses a state it cannot resume
// (Checkpoints). An upstream exception reaches the consumer unchanged, at its position,
// and does not count toward n (no element was taken); the next call goes on. next() takes
// element by element, so this holds exactly: take(n) and skip(n) over the same
// (deterministic) upstream hand on, between them, every element once. next_bulk()
// (batch() pulling a run) takes in runs of at most what is left of n, into the caller's
// own buffer: if the upstream throws inside a run, take cannot tell how many of that
// run's elements the upstream used up before the error (they go with it, as any bulk
// run's do: batch() drops the batch it was building), so it counts all it may have: the
// run less one, as the error is no element (next_bulk stops at an error as next() calls
// would). It may then hand on fewer than n, never more: an element after the first n is
// never handed on, so take(n) never shares one with skip(n), which errs the other way. A
// run of one is exact.
//
// Memory: no element is held: a count of what was taken, and next_bulk() runs go straight
// into the caller's buffer.
//
// Checkpoints: the upstream's state, then how many elements this epoch took so far (with
// what a failed run counted); a restore hands on only the rest of the n. A state that took
// more than this take's n (saved from a take of a larger n) is a config_error naming both.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "ferry/error.hpp"
#include "ferry/stage.hpp"

namespace ferry {
namespace detail {

template <source Up>
class take_source : public stage<take_source<Up>, Up> {
  using base = stage<take_source<Up>, Up>;
  friend base;

 public:
  static constexpr char name[] = "take";
  take_source(Up up, std::uint64_t n) : base(std::move(up)), n_(n) {}

 private:
  std::optional<value_t<Up>> pull() {
    if (taken_ >= n_) return std::nullopt;
    std::optional<value_t<Up>> e = this->pull_up();
    if (e) ++taken_;
    return e;
  }
  // Pulls one run of at most what is left of n, into `out` itself.
  std::size_t pull_bulk(std::span<value_t<Up>> out)
    requires bulk_source<Up>
  {
    if (out.empty() || taken_ >= n_) return 0;  // n taken: the upstream is not called
    const std::uint64_t left = n_ - taken_;
    const std::size_t want = out.size() < left ? out.size() : static_cast<std::size_t>(left);
    std::size_t k;
    try {
      k = this->pull_up_bulk(out.first(want));
    } catch (...) {
      taken_ += want - 1;  // all the run may have used up, the error not (see the header)
      throw;
    }
    taken_ += k;
    return k;
  }
  void start_epoch() { taken_ = 0; }
  void save_words(state_writer& w) const { w.put(taken_); }
  // Throws config_error for a state that took more than n.
  void restore_words(state_reader& r) { taken_ = r.get_count(n_, name, "took", "hands on"); }

  std::uint64_t n_;
  std::uint64_t taken_ = 0;  // elements handed on this epoch, or counted for a failed run (at most n_)
};

}  // namespace detail

// take(n) or take(src, n): the first n elements of every epoch (see the file's top).
inline constexpr count_adaptor<detail::take_source> take{};

}  // namespace ferry
