// ferry/stages/skip.hpp: skip(n) drops the first n elements of every epoch and hands on
// the rest; take(n)'s complement.
//
//   src | ferry::take(1000)   // the validation split
//   src | ferry::skip(1000)   // the training split: everything after it
//
// Every epoch (every pass after rewind()) drops its own first n elements; skip(0) hands
// everything on, and an epoch of n elements or fewer is empty (not an error).
//
// Threads: runs on the thread that calls next(); skip runs no user code and starts no
// thread.
//
// Errors: skip throws nothing itself, but restore() refuses a state it cannot resume
// (Checkpoints). An upstream exception reaches the consumer unchanged, at its position,
// and does not count toward n (no element was skipped); the next call goes on. next()
// skips element by element, so this holds exactly. next_bulk() (batch() pulling a run)
// skips in runs, into the caller's own buffer (no allocation): if the upstream throws
// inside a run being skipped, skip cannot tell how many of that run's elements the
// upstream used up before the error (they go with it, as any bulk run's do: batch() drops
// the batch it was building), so it counts none of them. It may then drop more than n,
// never fewer: an element among the first n is never handed on.
//
// Memory: no element is held: skipped elements are dropped as they come, and next_bulk()
// skips in runs pulled into the caller's own buffer (no allocation).
//
// Checkpoints: the upstream's state, then how many elements this epoch skipped so far;
// a restore mid-skip drops only the rest of the n. A state that skipped more than this
// skip's n (saved from a skip of a larger n) is a config_error naming both.
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
class skip_source : public stage<skip_source<Up>, Up> {
  using base = stage<skip_source<Up>, Up>;
  friend base;

 public:
  static constexpr char name[] = "skip";
  skip_source(Up up, std::uint64_t n) : base(std::move(up)), n_(n) {}

 private:
  std::optional<value_t<Up>> pull() {
    while (skipped_ < n_) {
      if (!this->pull_up()) return std::nullopt;  // the epoch ended inside the first n
      ++skipped_;
    }
    return this->pull_up();
  }
  // Skips in runs of out.size(), pulled into `out` itself, then fills it.
  std::size_t pull_bulk(std::span<value_t<Up>> out)
    requires bulk_source<Up>
  {
    if (out.empty()) return 0;
    while (skipped_ < n_) {
      const std::uint64_t left = n_ - skipped_;
      const std::size_t want = out.size() < left ? out.size() : static_cast<std::size_t>(left);
      const std::size_t k = this->pull_up_bulk(out.first(want));
      skipped_ += k;
      if (k < want) return 0;  // the epoch ended inside the first n
    }
    return this->pull_up_bulk(out);
  }
  void start_epoch() { skipped_ = 0; }
  void save_words(state_writer& w) const { w.put(skipped_); }
  // Throws config_error for a state that skipped more than n.
  void restore_words(state_reader& r) { skipped_ = r.get_count(n_, name, "skipped", "drops"); }

  std::uint64_t n_;
  std::uint64_t skipped_ = 0;  // elements dropped this epoch (at most n_)
};

}  // namespace detail

// skip(n) or skip(src, n): drops the first n elements of every epoch (see the file's top).
inline constexpr count_adaptor<detail::skip_source> skip{};

}  // namespace ferry
