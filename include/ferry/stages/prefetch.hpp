// ferry/stages/prefetch.hpp: prefetch(depth) runs the upstream pipeline on its own thread,
// keeping up to `depth` elements (usually batches) ready for the consumer.
//
//   ... | ferry::batch(256) | ferry::prefetch(2)
//
// Threads: one producer thread, started by the first next(); everything upstream (sources,
// filter and batch, user functions of stages without their own threads) runs on it.
// Shutdown: the destructor (and rewind()) stops the producer and joins it at once, even
// mid-epoch; it waits only for an upstream next() call already in progress.
//
// Errors: throws config_error for depth == 0, a negative depth and ferry::autotune; over
// lockstep() a compile-time error (its thread would read collective steps ahead); over
// distribute() onto devices, next() throws the config_error distribute throws on its
// thread (a device step is valid only until the next one is asked for:
// detail/holds_ahead.hpp). An
// exception thrown upstream is re-thrown,
// unchanged, by the consumer's next() at its place, after the elements produced before
// it; the producer goes on, so the next next() gives what upstream gives after the error
// (as without prefetch: a consumer that catches and goes on loses nothing prefetch held).
// A std::bad_alloc from queueing an element on the producer thread ends the epoch instead
// (that element is lost). A thread that cannot start is a ferry::error naming it.
//
// Memory: at most depth + 2 elements alive (depth queued, one being built, one held by
// the consumer).
//
// Checkpoints: save() records the upstream position after the last element handed to the
// consumer (captured by the producer with each element), so queued elements are re-read
// after restore, never stored; it throws config_error when the upstream cannot be saved
// (an unordered map upstream). restore() must come before the first next() (config_error
// otherwise).
#pragma once


#include <cstddef>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "ferry/detail/producer.hpp"
#include "ferry/error.hpp"
#include "ferry/stage.hpp"

namespace ferry {
namespace detail {

template <source Up>
class prefetch_source : public threaded_stage<prefetch_source<Up>, Up> {
  friend threaded_stage<prefetch_source, Up>;
  static constexpr bool resumable = resumable_source<Up>;
  // Its thread would read ahead into the next step's collective, which a rank that stops
  // (or is destroyed) never joins: the other ranks' would wait forever.
  static_assert(!joins_collectives<Up>(), "ferry::prefetch after lockstep(): its thread would run lockstep's all-reduce "
                                          "ahead of the consumer, and a rank that stops mid-epoch leaves the others "
                                          "waiting in it; put prefetch before distribute() or lockstep()");

 public:
  static constexpr char name[] = "prefetch";
  // Throws config_error when the upstream joins a collective as seen at run time (an
  // any_source holding lockstep; cache_on_device with .ranks or .devices).
  prefetch_source(Up up, std::size_t depth) : threaded_stage<prefetch_source, Up>(std::move(up)), depth_(depth) {
    if (joins_collectives_now(this->up()))
      throw config_error("prefetch: its upstream joins a collective on every element (lockstep, or cache_on_device "
                         "with .ranks or .devices, here seen at run time): its thread would run the collective "
                         "ahead of the consumer, and a rank that stops mid-epoch leaves the others waiting in it; "
                         "put prefetch before distribute() or lockstep()");
  }

 private:
  std::optional<value_t<Up>> pull() {
    if (!started_) start();
    return p_.take();
  }
  void start() {
    observe::stage_counters* st = &this->stats();
    p_.start(depth_, depth_ - 1, names, st, st, this->upstream_puller(), this->upstream_saver());
    started_ = true;
  }
  void halt() noexcept { p_.halt(); }
  void start_epoch() {
    p_.reset();
    started_ = false;
  }
  // The position after the last element handed to the consumer: queued ones are re-read.
  void save_upstream(state_writer& w) const {
    if (!started_) return this->up().save(w);
    if (std::string e = p_.save_error(); !e.empty()) throw config_error(e);
    w.put_words(p_.position().words);
  }
  void before_restore() const {
    if (started_) throw config_error("prefetch: restore_state must come before the first next()");
  }
  observe::stage_mode report_mode() const { return observe::stage_mode::threaded_stage; }

  static constexpr producer_names names{"ferry prefetch", "prefetch: wait upstream", "prefetch: wait downstream"};
  std::size_t depth_;
  bool started_ = false;
  producer<value_t<Up>> p_;
};

}  // namespace detail

// The type of ferry::prefetch: prefetch(src, depth), or prefetch(depth) for
// `src | prefetch(depth)`.
struct prefetch_t : stage_adaptor<prefetch_t> {
  // stage_adaptor's argument check: throws config_error for depth == 0, a negative depth
  // and ferry::autotune (tf.data's AUTOTUNE, -1, would be an unbounded queue here).
  static void check(int_arg depth) { (void)checked(depth); }
  // Builds the stage over s (stage_adaptor calls it); checks depth as check() does.
  template <source S>
  static auto make(S&& s, int_arg depth) {
    return detail::prefetch_source<std::remove_cvref_t<S>>(std::forward<S>(s), checked(depth));
  }

 private:
  static std::size_t checked(int_arg depth) {
    if (depth.negative() || depth.bits() == std::numeric_limits<std::size_t>::max())
      throw config_error("prefetch: depth must be a number of elements (got " +
                         (depth.negative() ? std::to_string(depth.value()) : std::string("ferry::autotune")) +
                         "): prefetch has no autotune; 2 is usually enough");
    if (depth.bits() == 0)
      throw config_error("prefetch: depth must be at least 1 (got 0); drop the stage to run inline");
    return static_cast<std::size_t>(depth.bits());
  }
};
// prefetch(depth): runs the upstream on a thread of its own, depth elements ahead (see the
// file's top).
inline constexpr prefetch_t prefetch{};

}  // namespace ferry
