// ferry/stages/shuffle.hpp: shuffle(buffer, seed) reorders elements within windows of
// `buffer` elements, with a new order every epoch.
//
//   from_files(...) | ferry::shuffle(10'000, 42) | ferry::repeat(10)
//
// How: it fills a window of `buffer` elements, permutes it (Fisher-Yates) with a generator
// seeded from (seed, epoch, window number), and hands the window out; then the next. The
// order is a function of (seed, epoch, upstream order) alone, so it is the same whatever
// the thread count, and a new permutation each epoch (rewind() advances the epoch).
//
// Why windows and not tf.data's sliding buffer: an element stays in a window for at most
// `buffer` pulls, so save() records only the upstream position at the window's start and
// the offset inside it; restore() re-reads at most one window. A sliding buffer would have
// to store its contents (or replay the epoch) to resume. For global mixing, combine with
// file-order shuffling and interleave, as with tf.data.
//
// Threads: runs on the thread that calls next() (restore() re-reads a window on the
// thread that calls it); shuffle runs no user code and starts no thread.
//
// Errors: throws config_error for buffer == 0, negative or ferry::autotune (a seed may be
// any integer); after distribute() onto devices (buffer > 1), next() throws the
// config_error distribute throws when shuffle pulls it (a device step is valid only until
// the next one is asked for: detail/holds_ahead.hpp; shuffle the rows before
// distribute()). An exception from upstream ends the window early. The elements pulled
// before it are shuffled as a (shorter) window and handed out first; then next() re-throws
// the exception unchanged, at the same position as in the upstream sequence (as many
// elements before it); then a new window starts. A consumer that catches and goes on gets
// every other element exactly once. Why the error ends the window instead of the window
// filling on past it: a checkpoint re-reads the window from its start, and that re-read
// must not run into the error again. (Windows are shorter only where errors are.)
//
// Memory: at most `buffer` elements held (the window), and the upstream's state words at
// the window's start.
//
// Checkpoints: save() records the upstream position at the window's start, then the
// buffer size and seed, the epoch, the window number, the window's length and the offset
// inside it; restore() re-reads exactly that many elements (never reaching an error that
// ended the window), and the upstream's end when it ended the window, as the saving run's
// upstream saw it (cache() keeps a pass only once it has seen its end). A deterministic upstream error (a missing file) then fails again at
// the same position after restore, so resume is exact at any point, between an error and
// the next element included. A state saved with another buffer or seed (which would hand
// out another order) is a config_error naming both values, as is a damaged one. Over an
// upstream that cannot be saved (an unordered parallel map) the data flows, and save() is
// the config_error saying why.
#pragma once

#include <cstdint>
#include <exception>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ferry/detail/holds_ahead.hpp"
#include "ferry/detail/random.hpp"
#include "ferry/error.hpp"
#include "ferry/stage.hpp"

namespace ferry {
namespace detail {

template <source Up>
class shuffle_source : public stage<shuffle_source<Up>, Up> {
  friend stage<shuffle_source, Up>;
  using T = value_t<Up>;

 public:
  static constexpr char name[] = "shuffle";
  shuffle_source(Up up, std::size_t buffer, std::uint64_t seed)
      : stage<shuffle_source, Up>(std::move(up)), cap_(buffer), seed_(seed) {}

  std::uint64_t epoch() const { return epoch_; }

 private:
  std::optional<T> pull() {
    if (pos_ >= win_.size()) {
      if (pending_) {  // the window it ended is handed out: the error's turn
        win_.clear();
        pos_ = 0;
        std::rethrow_exception(std::exchange(pending_, nullptr));
      }
      if (!fill(cap_)) return std::nullopt;
    }
    return std::optional<T>(std::move(win_[pos_++]));
  }

  // The next epoch: a new permutation.
  void start_epoch() {
    ++epoch_;
    window_ = 0;
    win_.clear();
    pos_ = 0;
    ended_ = false;
    pending_ = nullptr;
  }

  // Mid-window, or a window ended by an error not yet re-thrown (restore must stop before
  // the error, which then comes again from upstream): from the window's start.
  bool mid() const { return pos_ < win_.size() || pending_; }
  void save_upstream(state_writer& w) const {
    if (!save_error_.empty()) throw config_error(save_error_);
    if (mid()) {
      ask_save(this->up(), scratch_);  // start_ may predate the upstream's refusal (an unordered map)
      w.put_words(start_.words);  // upstream as it was at this window's start
    } else {
      this->up().save(w);
    }
  }
  // A restore into another buffer or seed would hand out another order: refused.
  template <class F>
  void config(F&& f) const {
    f("buffer", cap_);
    f("seed", seed_);
  }
  // window_ >= 1 when mid(), as fill() counted the window.
  // The length's top bit: the upstream's end ended the window (a restore pulls it again,
  // as the upstream saw it: cache() keeps a pass only at its end).
  static constexpr std::uint64_t ended_bit = std::uint64_t(1) << 63;
  void save_words(state_writer& w) const {
    const bool m = mid();
    w.put(epoch_);
    w.put(m ? window_ - 1 : window_);
    w.put(m ? pos_ : 0);
    w.put(m ? win_.size() | (ended_ && !pending_ ? ended_bit : 0) : 0);
  }
  void restore_words(state_reader& r) {
    const std::uint64_t epoch = r.get(), window = r.get(), skip = r.get(), word = r.get();
    const std::uint64_t len = word & ~ended_bit;
    const bool at_end = (word & ended_bit) != 0;
    if (len > cap_ || skip > len || (at_end && len == cap_))
      throw config_error("restore_state: shuffle: a damaged state (offset " + std::to_string(skip) +
                         " in a window of " + std::to_string(len) + ", buffer " + std::to_string(cap_) + ")");
    epoch_ = epoch;
    window_ = window;
    win_.clear();
    pos_ = 0;
    ended_ = false;
    pending_ = nullptr;
    if (len) {  // re-read the window we were in (no further), then skip what was handed out
      fill(static_cast<std::size_t>(len) + (at_end ? 1 : 0));  // at_end: the upstream's end too
      pos_ = static_cast<std::size_t>(skip) < win_.size() ? skip : win_.size();
    }
  }

  // Pulls the next window (at most `limit` elements) and permutes it. An upstream error
  // ends it early: kept in pending_ for next() to throw after the window, or thrown at
  // once when the window is empty (so window_ counts only windows handed out).
  bool fill(std::size_t limit) {
    win_.clear();
    pos_ = 0;
    if (ended_) return false;
    if constexpr (resumable_source<Up>) {
      start_.words.clear();
      if (save_error_.empty()) {
        state_writer w(start_);
        try {
          this->up().save(w);
        } catch (const config_error& e) {  // an upstream that cannot be saved (an unordered map):
          save_error_ = e.what();           // the data flows, save() says why
        }
      }
    }
    try {
      // A window of more than one holds what it pulls (distribute onto devices refuses).
      std::optional<holding_ahead> holds;
      if (limit > 1) holds.emplace("shuffle");
      while (win_.size() < limit) {
        std::optional<T> e = this->pull_up();
        if (!e) {
          ended_ = true;
          break;
        }
        win_.push_back(std::move(*e));
      }
    } catch (...) {
      if (win_.empty()) throw;
      pending_ = std::current_exception();
    }
    splitmix64 g(mix_seed({seed_, epoch_, window_++}));
    permute(win_, g);
    return !win_.empty();
  }

  std::size_t cap_;
  std::uint64_t seed_;
  std::uint64_t epoch_ = 0;
  std::uint64_t window_ = 0;  // windows filled this epoch
  std::vector<T> win_;
  std::size_t pos_ = 0;
  bool ended_ = false;
  std::exception_ptr pending_;  // an upstream error that ended the window, thrown after it
  pipeline_state start_;  // upstream position at the current window's start
  std::string save_error_;  // why the upstream cannot be saved, once a window's start found it
  mutable pipeline_state scratch_;  // save() asks the upstream into it (capacity reused)
};

}  // namespace detail

// The type of ferry::shuffle: shuffle(src, buffer, seed), or shuffle(buffer, seed) for
// `src | shuffle(buffer, seed)`.
struct shuffle_t : stage_adaptor<shuffle_t> {
  // stage_adaptor's argument check: throws config_error for buffer == 0, negative or
  // ferry::autotune. The seed is any integer (a negative one modulo 2^64).
  static void check(int_arg buffer, int_arg /*seed*/) { (void)checked(buffer); }
  // Builds the stage over s (stage_adaptor calls it); checks as check() does.
  template <source S>
  static auto make(S&& s, int_arg buffer, int_arg seed) {
    return detail::shuffle_source<std::remove_cvref_t<S>>(std::forward<S>(s), checked(buffer), seed.bits());
  }

 private:
  static std::size_t checked(int_arg buffer) {
    const std::uint64_t b = buffer.count("shuffle", "the buffer");
    if (b == 0) throw config_error("shuffle: the buffer must hold at least 1 element (got 0; 1 means no shuffling)");
    // ferry::autotune is SIZE_MAX: as a buffer, every element of the dataset held at once.
    if (b == std::numeric_limits<std::size_t>::max())
      throw config_error("shuffle: ferry::autotune (SIZE_MAX) is not a buffer size: shuffle has no autotune; pass the "
                         "dataset's size to shuffle it whole in memory, or use ferry::global_shuffle");
    return static_cast<std::size_t>(b);
  }
};
// shuffle(buffer, seed): reorders elements within windows of `buffer`, anew each epoch
// (see the file's top).
inline constexpr shuffle_t shuffle{};

}  // namespace ferry
