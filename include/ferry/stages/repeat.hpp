// ferry/stages/repeat.hpp: repeat(n) plays the upstream dataset n times; repeat() forever.
//
//   src | ferry::shuffle(1024, seed) | ferry::repeat(3)   // three epochs, three orders
//
// Between epochs it calls upstream.rewind(), so a shuffle upstream draws a new order.
// An empty dataset ends at once (never spins). Needs a rewindable upstream (a compile
// error otherwise).
//
// Epochs: each epoch of repeat(n) is n epochs of the upstream, also when rewind() comes
// part way: it rewinds the upstream once for each pass left (a rewind reads nothing), so
// after rewind() the upstream is at the epoch it would reach after a whole epoch. A stage
// above that reads ahead (map's workers, prefetch) may have started passes the consumer
// never saw; without this, a shuffle below would start the next epoch at an order that
// depended on how far its threads had read. repeat() (forever) has no passes left to
// count: after a rewind() part way, under such a stage, its upstream's next epoch depends
// on how far it was read (save and restore a state for an exact place); so does
// repeat(n) for n over 4096, which counts no passes either.
//
// Threads: runs on the thread that calls next(), which also runs the upstream's rewind()
// between passes; repeat runs no user code and starts no thread.
//
// Errors: repeat(n) throws config_error for n below -1 (-1 repeats forever, as tf.data's
// repeat(-1)), and restore() refuses a state it cannot resume
// (Checkpoints). An upstream exception reaches the consumer unchanged; the next call goes
// on in the same epoch. An epoch that threw is not empty, even with no element (a file
// that failed to open this time): repeat goes on to the next epoch rather than end early.
//
// Memory: no element is held: a pass count and whether this pass has seen anything.
//
// Checkpoints: save() records the upstream's state, then the number of completed passes
// and whether the current pass has seen an element or an error; restore() resumes in that
// pass. A state past this repeat's n (saved from a repeat of a larger n) or damaged is a
// config_error naming the pass.
#pragma once

#include <cstdint>
#include <exception>
#include <limits>
#include <optional>
#include <utility>

#include "ferry/stage.hpp"

namespace ferry {
namespace detail {

inline constexpr char repeat_name[] = "repeat";  // count_adaptor's Name
inline constexpr std::uint64_t repeat_forever = std::numeric_limits<std::uint64_t>::max();  // repeat()'s n

template <source Up>
class repeat_source : public stage<repeat_source<Up>, Up> {
  friend stage<repeat_source, Up>;
  static_assert(rewindable_source<Up>,
                "ferry::repeat: the upstream must be rewindable (have rewind()) to be played again; every "
                "ferry source and stage is");

 public:
  static constexpr char name[] = "repeat";
  repeat_source(Up up, std::uint64_t n) : stage<repeat_source, Up>(std::move(up)), n_(n) {}

  // The number of completed passes over the upstream dataset.
  std::uint64_t epoch() const { return epoch_; }

 private:
  std::optional<value_t<Up>> pull() {
    while (epoch_ < n_) {
      const bool seen = seen_in_epoch_;
      seen_in_epoch_ = true;  // an element, or data that failed: not an empty dataset
      if (std::optional<value_t<Up>> e = this->pull_up()) return e;
      if (!seen) {  // an empty epoch: the dataset is empty, stop
        epoch_ = n_;
        break;
      }
      if (++epoch_ < n_) {
        seen_in_epoch_ = false;
        std::exception_ptr kept;
        try {
          rewind_upstream(this->up(), kept);
        } catch (...) {  // the upstream is marked, or cannot say: so is this stage (stage.hpp)
          ferry_mark_restore_failed(*this);
          throw;
        }
        if (kept) std::rethrow_exception(kept);  // the upstream goes on (streams): so does the pass
      }
    }
    return std::nullopt;
  }
  // After the base's upstream rewind(): the passes this epoch did not reach (see the top).
  void start_epoch() {
    if (n_ <= max_padded && epoch_ < n_)
      for (std::uint64_t k = n_ - 1 - epoch_; k > 0; --k) this->up().rewind();
    epoch_ = 0;
    seen_in_epoch_ = false;
  }
  void save_words(state_writer& w) const {
    w.put(epoch_);
    w.put(seen_in_epoch_);
  }
  // Throws config_error for a state past this repeat's n (saved from a repeat of a larger n).
  void restore_words(state_reader& r) {
    const std::uint64_t epoch = r.get();
    seen_in_epoch_ = r.get_flag(name);
    if (epoch > n_)
      throw config_error("restore_state: repeat: the state is at pass " + std::to_string(epoch) + " of this repeat(" +
                         std::to_string(n_) + ") (saved from a repeat of a larger n?)");
    epoch_ = epoch;
  }

  // Above this n, a rewind() part way counts no passes, as repeat() (a repeat(10^9) meant
  // as "forever" would otherwise rewind its upstream a billion times).
  static constexpr std::uint64_t max_padded = std::uint64_t(1) << 12;
  std::uint64_t n_;
  std::uint64_t epoch_ = 0;
  bool seen_in_epoch_ = false;
};

}  // namespace detail

// repeat(n) or repeat(src, n): plays the upstream n times; repeat(): forever (see the
// file's top).
inline constexpr count_adaptor<detail::repeat_source, detail::repeat_name, detail::repeat_forever> repeat{};

}  // namespace ferry
