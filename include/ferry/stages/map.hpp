// ferry/stages/map.hpp: map(fn, {.workers, .ordered}) replaces each element e by fn(e).
//
//   src | ferry::map([](record r) { return decode(r); })                      // inline
//   src | ferry::map(decode, {.workers = 4})                                  // 4 threads, in order
//   src | ferry::map(decode, {.workers = 4, .ordered = false})                // as they finish
//   src | ferry::map(decode, {.workers = ferry::autotune})                    // it picks how many
//
// Order: ordered (the default) hands elements out in upstream order, so a parallel map
// gives the same sequence as a sequential one; ordered = false hands them out as they
// finish (less waiting behind a slow element, order not reproducible).
//
// Threads: with workers == 1, fn runs on the thread that calls next(). With workers > 1,
// fn runs on the stage's worker threads (started by the first next()), at most `window`
// elements ahead of the consumer; the upstream's next() is called on those workers too,
// one at a time, under a lock.
// Autotune (workers = ferry::autotune, as tf.data's AUTOTUNE): the stage starts
// max_workers threads (default: the hardware threads) and lets one work. On the consumer's
// thread, inside next(), it measures periods of at least 50 ms (and 64 elements) and
// hill-climbs on the rate the workers produce: while the consumer waits, it adds a worker
// and keeps it if it pays (adds a quarter of what one more worker could, and 3%); every 16
// periods it parks one and keeps it parked unless it paid; when the workers mostly wait for
// room (the consumer is the bottleneck) it parks one, so a stage that is not the limit
// does not hold cores. The count learned is kept for the next epoch (not in checkpoints:
// a new pipeline restored from one climbs again from one worker). Elements, order, errors and checkpoints are
// those of a fixed worker count; only the speed depends on the count chosen. With a
// ceiling of 1, fn runs inline.
// Shutdown: the destructor and rewind() stop the workers and join them, waiting for fn
// calls already running and for an upstream next() a worker is in (a worker pulls under
// a lock, so one pull at most: a source blocked in it, a FIFO with no writer, holds the
// join as long).
//
// Errors: throws config_error for workers == 0, for more than 1024 workers or
// max_workers, for a window over 2^32, for max_workers set without autotune, and for
// workers other than 1 over lockstep() (they would read its collective steps ahead) or
// over distribute()'s steps (they would hold steps ahead: detail/is_step.hpp). The
// first next() of a parallel map throws ferry::error when its ring or a worker thread
// cannot be had (none is left running; the next next() tries again).
// If fn throws on element k (k counts the epoch's places, an upstream error holding one,
// at any worker count), the consumer's next() for element k throws
// ferry::element_error ("map: user function threw at element k: ...") with the original
// exception nested (std::rethrow_if_nested); ferry's own errors pass through unchanged.
// The elements after k are still available to a consumer that catches and goes on
// (batch loses the batch it was building). One exception: an inline map (workers = 1)
// that batch() drives in bulk over a bulk source (from_range, from_generator, a stage
// that passes runs on, an any_source over one) pulls and maps the batch's run as one
// unit, so the throw loses that whole run, the elements after k in it too, and the
// consumer goes on after it: there, and only there, what a consumer that goes on after an
// error gets depends on the worker count.
// An exception from upstream reaches the consumer unchanged at its position, and the next
// call goes on after it (the workers go on pulling), as prefetch does. A std::bad_alloc on
// a worker outside fn and upstream (its buffers) ends the epoch instead, after the elements
// the other workers published; the elements in flight are lost. (An ordered map moves fn's
// result straight into its place in the ring, so a move of the result that throws counts
// as fn's error for that element.)
// Compile-time errors: a fn that cannot take the element as E&&, or that returns void, is
// a static_assert naming E and fn's type (detail::map_function_cannot_take<E, F>,
// map_function_returns_void<E, F>), the first error and nearly the only one.
//
// Memory: inline, the element being mapped (and, driven in bulk by batch(), a run's
// inputs in a vector reused from run to run). Parallel: at most `window` elements read
// ahead of the consumer (default 16384, fewer when results are large: 4 MiB of them at
// most, and never fewer than 4 per worker); an ordered map allocates its ring of `window`
// result slots up front, at the first next().
//
// Checkpoints: exact for ordered maps: save() records the upstream position at the start
// of the current window of `window` elements plus an offset, and the index of the next
// element (which names elements in errors); restore() re-reads (but does not re-map) at
// most `window` elements. An unordered parallel map cannot be resumed exactly: save()
// throws config_error. An ordered parallel map takes that upstream position every window
// as it reads; an upstream that cannot be saved (an unordered map, a prefetch after its
// error) leaves the elements untouched, and save() throws the upstream's refusal. restore() must come before the first next(), and a state that
// re-reads more than this map's window (saved with a larger window) is refused; both are
// config_errors.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/detail/holds_ahead.hpp"
#include "ferry/detail/is_step.hpp"
#include "ferry/error.hpp"
#include "ferry/stage.hpp"
#include "ferry/stages/detail/diagnostics.hpp"
#include "ferry/stages/detail/map_workers.hpp"

namespace ferry {

// map()'s options, a braced list: map(fn, {.workers = 4, .ordered = false}).
struct map_options {
  std::size_t workers = 1;   // threads running fn; 1 runs it inline on the consumer's thread
  bool ordered = true;       // hand out elements in upstream order
  std::size_t window = 0;    // elements read ahead of the consumer; 0: 16384, or 4 MiB of large elements
  std::size_t max_workers = 0;  // autotune's ceiling; 0: std::thread::hardware_concurrency()
};

// map_options::workers value: the stage chooses how many threads run fn (see above).
inline constexpr std::size_t autotune = static_cast<std::size_t>(-1);

namespace detail {

template <class F, class In>
using map_result_t = std::remove_cvref_t<std::invoke_result_t<F&, In&&>>;

template <source Up, class F>
class map_source : public threaded_stage<map_source<Up, F>, Up, map_result_t<F, value_t<Up>>> {
  using In = value_t<Up>;
  using Out = map_result_t<F, In>;
  friend threaded_stage<map_source, Up, Out>;
  using workers_t = map_workers<typename threaded_stage<map_source, Up, Out>::puller, F, In, Out>;

 public:
  static constexpr char name[] = "map";
  // fn may return batches of another size (or the same type cut otherwise).
  static constexpr bool changes_batch_size = true;

  map_source(Up up, F fn, map_options o)
      : threaded_stage<map_source, Up, Out>(std::move(up)), o_(resolve(o)),
        w_(this->upstream_puller(), std::move(fn), &this->stats(), {o_.workers, o_.ordered, o_.window},
           o.workers == autotune) {}

  // The next element handed to sink(Out&) where it lies, not moved out first; false at the
  // end of the epoch. Throws as next() does (sink's own exceptions propagate, the element
  // counted as taken). For a consumer that copies each element somewhere anyway (batch's
  // collation), with stats off: an inline map hands fn's result as made, an ordered
  // parallel map the element in its ring, each saving a move (a copy of the whole element
  // for arrays); other maps go through next(). Runs on the caller's thread; so does sink.
  template <class Sink>
  bool next_into(Sink&& sink) {
    this->check_live();
    if (o_.workers == 1 && !observe::on()) {  // inline: fn's result made where sink sees it
      skip_pending();
      std::optional<In> e = pull_counted();
      if (!e) return false;
      Out v = apply_inline(std::move(*e));
      sink(v);
      return true;
    }
    if (o_.workers == 1 || !o_.ordered || observe::on()) {
      std::optional<Out> e = this->next();
      if (!e) return false;
      sink(*e);
      return true;
    }
    skip_pending();
    return w_.next_into(sink, base_);
  }

 private:
  static map_options resolve(map_options o) {
    if (o.workers == autotune)  // max_workers threads, of which the tuner lets some work
      o.workers = o.max_workers ? o.max_workers : std::max(1u, std::thread::hardware_concurrency());
    // Default: enough in flight for each worker to claim runs long enough (~200 us) to
    // amortise a thread wake-up even for cheap fns: 16384 elements, or fewer when they are
    // large (4 MiB of Out at most; the ring's slots are allocated up front). A deep window
    // matters when workers fill every core: the consumer then runs only when they block.
    // (With 1024, a 0.1 us fn on 2 workers ran at 0.26x a threaded loop, bound by sleeps
    // and wake-ups; with 16384, 0.6x.)
    if (o.window == 0)
      o.window = std::clamp<std::size_t>((std::size_t(4) << 20) / sizeof(Out), 4 * o.workers,
                                         std::max<std::size_t>(16384, 4 * o.workers));
    if (o.window < o.workers) o.window = o.workers;
    return o;
  }

  // The inline path apart, behind one test (inline, nothing to re-read); the rest is a call
  // of its own, so the inline path keeps its few registers (erased next(): 4.7 instead of
  // 5.3 ns an element, measured). A small result comes back from the call packed in a
  // register and is rebuilt here, so GCC merges it with the inline path's in registers
  // instead of through the stack (a store-forwarding stall on every element of the inline
  // path: 8 to 14 ns instead of 2 to 3).
  std::optional<Out> pull() {
    if (o_.workers == 1 && skip_ == 0) [[likely]] return next_inline();
    if constexpr (std::is_trivially_copyable_v<Out> && sizeof(Out) <= 8) {
      std::optional<Out> r = pull_rest();
      if (!r) return std::nullopt;
      return std::optional<Out>(*r);
    } else {
      return pull_rest();
    }
  }
  [[gnu::noinline]] std::optional<Out> pull_rest() {
    skip_pending();
    if (o_.workers == 1) return next_inline();
    return w_.next(base_);
  }
  // Parallel maps: take runs of mapped elements at once. Inline maps over a bulk upstream:
  // pull a run of inputs, map them in one loop. Otherwise element by element.
  std::size_t pull_bulk(std::span<Out> out) {
    skip_pending();
    if (o_.workers != 1) return w_.bulk(out, base_);
    if constexpr (bulk_source<Up>) {
      return bulk_inline(out);
    } else {
      std::size_t k = 0;
      while (k < out.size())
        if (auto e = next_inline()) out[k++] = std::move(*e);
        else break;
      return k;
    }
  }

  std::size_t bulk_inline(std::span<Out> out) {
    std::size_t n, i = 0;
    std::span<const In> view;
    if constexpr (view_source<Up>) {  // read the source's memory directly: one pass
      view = this->pull_up_view(out.size());
      n = view.size();
    } else if constexpr (std::is_same_v<In, Out>) {
      n = this->pull_up_bulk(out);
    } else {
      scratch_.resize(out.size());
      n = this->pull_up_bulk(std::span<In>(scratch_));
    }
    F& fn = w_.fn();
    try {
      const in_user_code<Out> user;  // fn may build a device pipeline of its own (holds_ahead.hpp)
      if constexpr (view_source<Up>)
        for (; i < n; ++i) out[i] = std::invoke(fn, In(view[i]));
      else if constexpr (std::is_same_v<In, Out>)  // map in place: no second pass
        for (; i < n; ++i) out[i] = std::invoke(fn, std::move(out[i]));
      else
        for (; i < n; ++i) out[i] = std::invoke(fn, std::move(scratch_[i]));
    } catch (...) {
      // The run was pulled as one unit (a batch's worth): the error names the element,
      // and a consumer that goes on continues after the run.
      const std::uint64_t k = base_ + i;
      base_ += n;
      rethrow_element(std::current_exception(), name, k);
    }
    base_ += n;
    return n;
  }

  std::optional<Out> next_inline() {
    std::optional<In> e = pull_counted();
    if (!e) return std::nullopt;
    return std::optional<Out>(apply_inline(std::move(*e)));
  }
  // The upstream's next; an upstream error holds its place in the element count, as on the
  // parallel path, so errors and saved indices name the same element at any worker count.
  std::optional<In> pull_counted() {
    try {
      return this->pull_up();
    } catch (...) {
      ++base_;
      throw;
    }
  }
  // fn on the next input, on this thread; its exception rethrown as element_error.
  Out apply_inline(In&& x) {
    const std::uint64_t k = base_++;
    try {  // fn may build a device pipeline of its own (holds_ahead.hpp)
      return as_user_code<Out>([&]() -> Out { return std::invoke(w_.fn(), std::move(x)); });
    } catch (...) {
      rethrow_element(std::current_exception(), name, k);
    }
  }

  // After restore: re-read (not re-map) the elements of the window already handed out.
  // An upstream error among them was handed out before the save: it counts as its
  // element and is not thrown again.
  void skip_pending() {
    while (skip_ > 0) [[unlikely]] {
      --skip_;
      try {
        if (!this->up().next()) skip_ = 0;
      } catch (...) {
      }
    }
  }

  void halt() noexcept { w_.halt(); }
  void start_epoch() {
    w_.reset();
    base_ = 0;
    skip_ = 0;
  }
  observe::stage_mode report_mode() const {
    return o_.workers == 1 ? observe::stage_mode::inline_stage : observe::stage_mode::threaded_stage;
  }
  std::size_t report_threads() const { return o_.workers == 1 ? 1 : w_.active(); }

  // Exact for ordered maps: the upstream at the start of the current window plus an
  // offset (re-read, not re-mapped, at restore). The offset and index go to save_words.
  void save_upstream(state_writer& w) const {
    saved_skip_ = skip_;
    saved_index_ = base_;
    if (!w_.started()) {
      this->up().save(w);
    } else {
      const auto [skip, handed] = w_.save_position(w);
      saved_skip_ = skip;
      saved_index_ = base_ + handed;
    }
  }
  void save_words(state_writer& w) const {
    w.put(saved_skip_);
    w.put(saved_index_);
  }
  void before_restore() const {
    if (w_.started()) throw config_error("map: restore_state must come before the first next()");
  }
  // The re-read is at most one window: a state asking for more (another map's, with a
  // larger window, or crafted) would read on and on (forever over repeat()).
  void restore_words(state_reader& r) {
    const std::uint64_t skip = r.get(), index = r.get();
    if (skip > o_.window)
      throw config_error("restore_state: map: the state re-reads " + std::to_string(skip) +
                         " elements, more than this map's window of " + std::to_string(o_.window) +
                         " (saved with a larger map_options::window? set it as large)");
    skip_ = skip;
    base_ = index;
  }

  map_options o_;
  workers_t w_;
  std::uint64_t skip_ = 0;  // upstream elements to re-read after restore
  std::uint64_t base_ = 0;  // epoch index of element seq 0 (inline: of the next element)
  std::vector<In> scratch_;  // pull_bulk's inputs, reused
  mutable std::uint64_t saved_skip_ = 0, saved_index_ = 0;  // from save_upstream to save_words
};

inline constexpr std::size_t max_map_workers = 1024;

inline void check_map_args(const map_options& o) {
  if (o.workers == 0)
    throw config_error("map: workers must be at least 1 (got 0); 1 runs the function inline");
  if (o.workers != autotune && o.workers > max_map_workers)
    throw config_error("map: workers = " + std::to_string(o.workers) + " threads; at most " +
                       std::to_string(max_map_workers));
  if (o.max_workers > max_map_workers)
    throw config_error("map: max_workers = " + std::to_string(o.max_workers) + " threads; at most " +
                       std::to_string(max_map_workers));
  if (o.window > (std::size_t(1) << 32))
    throw config_error("map: window = " + std::to_string(o.window) + " elements read ahead; at most 2^32");
  if (o.max_workers != 0 && o.workers != autotune)
    throw config_error("map: max_workers is autotune's ceiling; set workers = ferry::autotune to use it (got workers = " +
                       std::to_string(o.workers) + ")");
}

}  // namespace detail

// Not a stage_adaptor: its options are a braced list (map(f, {.workers = 4})), which a
// template parameter pack cannot take.
struct map_t {
  // map(src, fn, options): builds the stage over src (moved in); throws config_error for
  // bad options (see the file's top).
  template <source S, class F>
  auto operator()(S&& s, F fn, map_options o = {}) const {
    using E = value_t<S>;
    // A misuse stops here, so the stage below is not instantiated with it.
    if constexpr (std::is_lvalue_reference_v<S>) {
      return typename detail::pipeline_is_an_lvalue<S>::error_above{};
    } else if constexpr (!std::invocable<F&, E&&>) {
      return typename detail::map_function_cannot_take<E, F>::error_above{};
    } else if constexpr (std::is_void_v<std::invoke_result_t<F&, E&&>>) {
      return typename detail::map_function_returns_void<E, F>::error_above{};
    } else {
      detail::check_map_args(o);
      if (o.workers != 1 && detail::joins_collectives_now(s))  // lockstep, or cache_on_device across ranks
        throw config_error("map: workers after lockstep() (or cache_on_device with .ranks or .devices): the workers "
                           "would run its collective ahead of the consumer, and a rank that stops mid-epoch leaves "
                           "the others waiting in it; use workers = 1 (inline) there, or map before distribute()");
      if (o.workers != 1 && detail::is_step_v<E>)  // the workers would hold steps ahead
        throw config_error("map: workers after distribute(): the workers would hold steps ahead, and a device "
                           "replica's step is valid only until the next one is asked for (its blocks are reused "
                           "then); map steps inline (workers = 1), or map the rows before batch() and distribute()");
      return detail::map_source<std::remove_cvref_t<S>, F>(std::forward<S>(s), std::move(fn), o);
    }
  }
  // map(fn, options): a closure for `src | map(fn)`; checks the options now.
  template <class F>
    requires(!source<F>)
  auto operator()(F fn, map_options o = {}) const {
    detail::check_map_args(o);
    return make_closure([fn, o]<class S>(S&& s) { return map_t{}(std::forward<S>(s), fn, o); });
  }
};
// map(fn, {.workers, .ordered}): replaces each element e by fn(e) (see the file's top).
inline constexpr map_t map{};

}  // namespace ferry
