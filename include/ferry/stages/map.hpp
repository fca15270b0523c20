// ferry/stages/map.hpp: map(fn, {.workers, .ordered}) replaces each element e by fn(e).
//
//   src | ferry::map([](record r) { return decode(r); })                      // inline
//   src | ferry::map(decode, {.workers = 4})                                  // 4 threads, in order
//   src | ferry::map(decode, {.workers = 4, .ordered = false})                // as they finish
//
// Threads: with workers == 1, fn runs on the thread that calls next(). With workers > 1,
// fn runs on the stage's worker threads (started by the first next()), at most `window`
// elements ahead of the consumer; the upstream's next() is called on those workers too,
// one at a time, under a lock.
// Order: ordered (the default) hands elements out in upstream order, so a parallel map
// gives the same sequence as a sequential one; ordered = false hands them out as they
// finish (less waiting behind a slow element, order not reproducible).
// Errors: if fn throws on element k, the consumer's next() for element k throws
// ferry::element_error ("map: user function threw at element k: ...") with the original
// exception nested (std::rethrow_if_nested); ferry's own errors pass through unchanged.
// The elements after k are still available to a consumer that catches and goes on.
// An exception from upstream reaches the consumer unchanged at its position and ends the
// epoch.
// Shutdown: the destructor and rewind() stop the workers and join them, waiting only for
// fn calls already running.
// Checkpoints: exact for ordered maps: save() records the upstream position at the start
// of the current window of `window` elements plus an offset; restore() re-reads (but does
// not re-map) at most `window` elements. An unordered parallel map cannot be resumed
// exactly: save() throws config_error.
// Throws config_error for workers == 0.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/error.hpp"
#include "ferry/memory/buffer.hpp"
#include "ferry/observe/hooks.hpp"
#include "ferry/source.hpp"

namespace ferry {

struct map_options {
  std::size_t workers = 1;   // threads running fn; 1 runs it inline on the consumer's thread
  bool ordered = true;       // hand out elements in upstream order
  std::size_t window = 0;    // elements in flight ahead of the consumer; 0 means 4 × workers
};

namespace detail {

template <source Up, class F>
class map_source : public source_interface<map_source<Up, F>> {
  using In = value_t<Up>;
  using Out = std::remove_cvref_t<std::invoke_result_t<F&, In&&>>;
  static_assert(!std::is_void_v<Out>,
                "ferry::map: the function must return the new element; to drop elements use "
                "ferry::filter");
  static constexpr bool resumable = resumable_source<Up>;
  static constexpr std::uint64_t none = std::numeric_limits<std::uint64_t>::max();

  struct slot {
    std::optional<Out> value;
    std::exception_ptr error;
    bool from_upstream = false;
    bool ready = false;
  };
  // Heap-allocated so the pipeline object can move while workers run.
  struct core {
    core(Up u, F f) : up(std::move(u)), fn(std::move(f)) {}
    Up up;
    F fn;
    std::mutex pull_m;  // serialises upstream next(); taken before m
    std::mutex m;
    std::condition_variable space, ready;
    std::vector<slot> ring;                              // ordered: element seq at seq % window
    std::deque<std::pair<std::uint64_t, slot>> done;    // unordered: in finishing order
    std::deque<std::pair<std::uint64_t, pipeline_state>> anchors;  // upstream state before seq
    std::uint64_t next_pull = 0, next_out = 0, end_seq = none;
    bool ended = false, stop = false;
    observe::stage_counters stats;
    [[no_unique_address]] observe::upstream_probe<Up> probe;
  };

 public:
  using value_type = Out;

  map_source(Up up, F fn, map_options o)
      : c_(std::make_unique<core>(std::move(up), std::move(fn))), o_(o) {
    if (o_.window == 0) o_.window = 4 * o_.workers;
    if (o_.window < o_.workers) o_.window = o_.workers;
  }
  map_source(map_source&&) noexcept = default;
  map_source& operator=(map_source&& o) noexcept {
    if (this != &o) {
      halt();
      c_ = std::move(o.c_);
      threads_ = std::move(o.threads_);
      o_ = o.o_;
      started_ = o.started_;
      skip_ = o.skip_;
      base_ = o.base_;
      scratch_ = std::move(o.scratch_);
    }
    return *this;
  }
  ~map_source() { halt(); }

  std::optional<Out> next() {
    return observe::observed_next(c_->stats, "map", [&] { return next_impl(); });
  }

  // Inline maps over a bulk upstream: pull a run of inputs, map them in one loop.
  std::size_t next_bulk(std::span<Out> out)
    requires bulk_source<Up>
  {
    if (o_.workers != 1) {
      std::size_t k = 0;
      while (k < out.size())
        if (auto e = next()) out[k++] = std::move(*e);
        else break;
      return k;
    }
    return observe::observed_bulk(c_->stats, "map", out, [&] { return bulk_inline(out); });
  }

  void visit_stages(observe::stage_visitor& v) const {
    c_->probe.visit(c_->up, v);
    if (o_.workers == 1)
      v.add("map", c_->stats, observe::stage_mode::inline_stage, 1);
    else
      v.add("map", c_->stats, observe::stage_mode::threaded_stage, o_.workers);
  }

 private:
  std::optional<Out> next_impl() {
    skip_pending();
    if (o_.workers == 1) return next_inline();
    if (!started_) start();
    slot s;
    std::uint64_t seq;
    {
      std::unique_lock lk(c_->m);
      if (o_.ordered) {
        slot& head = c_->ring[c_->next_out % o_.window];
        auto have = [&] { return head.ready || (c_->ended && c_->next_out >= c_->end_seq); };
        if (!have()) {
          observe::wait_timer wt;
          wt.start();
          c_->ready.wait(lk, have);
          wt.stop(c_->stats.wait_up, "map: wait upstream");
        }
        if (!head.ready) return std::nullopt;
        s = std::move(head);
        head = slot{};
        seq = c_->next_out++;
        auto& a = c_->anchors;
        while (a.size() >= 2 && a[1].first <= c_->next_out) a.pop_front();
      } else {
        auto have = [&] { return !c_->done.empty() || (c_->ended && c_->next_out >= c_->end_seq); };
        if (!have()) {
          observe::wait_timer wt;
          wt.start();
          c_->ready.wait(lk, have);
          wt.stop(c_->stats.wait_up, "map: wait upstream");
        }
        if (c_->done.empty()) return std::nullopt;
        seq = c_->done.front().first;
        s = std::move(c_->done.front().second);
        c_->done.pop_front();
        ++c_->next_out;
      }
    }
    c_->space.notify_all();
    if (s.error) {
      if (s.from_upstream) std::rethrow_exception(s.error);
      rethrow_element(s.error, "map", base_ + seq);
    }
    return std::move(s.value);
  }

  std::size_t bulk_inline(std::span<Out> out) {
    skip_pending();
    std::size_t n, i = 0;
    if constexpr (std::is_same_v<In, Out>) {
      n = c_->probe.pull_bulk(c_->up, out);
    } else {
      scratch_.resize(out.size());
      n = c_->probe.pull_bulk(c_->up, std::span<In>(scratch_));
    }
    try {
      if constexpr (std::is_same_v<In, Out>)  // map in place: no second pass
        for (; i < n; ++i) out[i] = std::invoke(c_->fn, std::move(out[i]));
      else
        for (; i < n; ++i) out[i] = std::invoke(c_->fn, std::move(scratch_[i]));
    } catch (...) {
      // The run was pulled as one unit (a batch's worth): the error names the element,
      // and a consumer that goes on continues after the run.
      const std::uint64_t k = base_ + i;
      base_ += n;
      rethrow_element(std::current_exception(), "map", k);
    }
    base_ += n;
    return n;
  }

 public:
  void rewind()
    requires rewindable_source<Up>
  {
    halt();
    reset();
    base_ = 0;
    skip_ = 0;
    c_->up.rewind();
  }

  void save(state_writer& w) const
    requires resumable
  {
    std::uint64_t skip = skip_, index = base_;
    if (!started_) {
      c_->up.save(w);
      if (o_.workers == 1) index = base_;  // inline: base_ counts handed-out elements
    } else {
      if (!o_.ordered)
        throw config_error("map: an unordered parallel map cannot be checkpointed exactly; "
                           "use .ordered = true to save_state()");
      std::lock_guard pl(c_->pull_m);
      std::lock_guard lk(c_->m);
      const std::uint64_t target = c_->next_out;
      const auto& a = c_->anchors;
      auto it = std::find_if(a.rbegin(), a.rend(), [&](const auto& p) { return p.first <= target; });
      if (it != a.rend()) {
        w.put_words(it->second.words);
        skip = target - it->first;
      } else {  // nothing pulled at or before target yet: upstream is exactly there
        c_->up.save(w);
        skip = 0;
      }
      index = base_ + target;
    }
    w.tag("map");
    w.put(skip);
    w.put(index);
  }
  void restore(state_reader& r)
    requires resumable
  {
    if (started_) throw config_error("map: restore_state must come before the first next()");
    c_->up.restore(r);
    r.expect("map");
    skip_ = r.get();
    base_ = r.get();
  }
  bool set_buffer_resource(const std::shared_ptr<std::pmr::memory_resource>& r) {
    return forward_buffer_resource(c_->up, r);
  }

 private:
  // After restore: re-read (not re-map) the elements of the window already handed out.
  void skip_pending() {
    while (skip_ > 0) {
      --skip_;
      if (!c_->up.next()) skip_ = 0;
    }
  }

  std::optional<Out> next_inline() {
    std::optional<In> e = c_->probe.pull(c_->up);
    if (!e) return std::nullopt;
    const std::uint64_t k = base_++;
    try {
      return std::optional<Out>(std::invoke(c_->fn, std::move(*e)));
    } catch (...) {
      rethrow_element(std::current_exception(), "map", k);
    }
  }

  void start() {
    started_ = true;
    c_->ring.assign(o_.window, slot{});
    threads_.reserve(o_.workers);
    for (std::size_t i = 0; i < o_.workers; ++i)
      threads_.emplace_back([c = c_.get(), o = o_] { work(*c, o); });
  }

  static void work(core& c, const map_options o) {
    observe::name_this_thread("ferry map worker");
    const std::uint64_t window = o.window;
    for (;;) {
      {
        std::unique_lock lk(c.m);
        auto room = [&] { return c.stop || c.ended || c.next_pull < c.next_out + window; };
        if (!room()) {
          observe::wait_timer wt;
          wt.start();
          c.space.wait(lk, room);
          wt.stop(c.stats.wait_down, "map: wait downstream", /*shared=*/true);
        }
        if (c.stop || c.ended) return;
      }
      std::unique_lock pl(c.pull_m);
      std::uint64_t seq;
      {
        std::lock_guard lk(c.m);
        if (c.stop || c.ended) return;
        if (c.next_pull >= c.next_out + window) continue;  // another worker took the space
        seq = c.next_pull;
      }
      pipeline_state anchor;
      const bool take_anchor = resumable && o.ordered && seq % window == 0;
      std::optional<In> e;
      std::exception_ptr uerr;
      try {
        if constexpr (resumable) {
          if (take_anchor) {
            state_writer w(anchor);
            c.up.save(w);
          }
        }
        e = c.probe.pull(c.up);
      } catch (...) {
        uerr = std::current_exception();
      }
      {
        std::lock_guard lk(c.m);
        if (take_anchor) c.anchors.emplace_back(seq, std::move(anchor));
        if (!e && !uerr) {
          c.ended = true;
          c.end_seq = seq;
        } else {
          c.next_pull = seq + 1;
          if (uerr) {
            c.ended = true;
            c.end_seq = seq + 1;
          }
        }
      }
      pl.unlock();
      if (!e && !uerr) {
        c.ready.notify_all();
        c.space.notify_all();
        return;
      }
      slot s;
      if (uerr) {
        s.error = uerr;
        s.from_upstream = true;
      } else {
        const bool timed = observe::on();
        const observe::ticks t0 = timed ? observe::now() : 0;
        try {
          s.value.emplace(std::invoke(c.fn, std::move(*e)));
        } catch (...) {
          s.error = std::current_exception();
        }
        if (timed) {
          const observe::ticks t1 = observe::now();
          c.stats.work.add_shared(t1 - t0);
          if (observe::tracing()) observe::record("map: fn", t0, t1);
        }
      }
      s.ready = true;
      {
        std::lock_guard lk(c.m);
        if (o.ordered)
          c.ring[seq % window] = std::move(s);
        else
          c.done.emplace_back(seq, std::move(s));
      }
      c.ready.notify_all();
      if (uerr) {
        c.space.notify_all();
        return;
      }
    }
  }

  void halt() noexcept {
    if (!c_) return;
    {
      std::lock_guard lk(c_->m);
      c_->stop = true;
    }
    c_->space.notify_all();
    c_->ready.notify_all();
    for (auto& t : threads_)
      if (t.joinable()) t.join();
    threads_.clear();
  }

  void reset() {
    c_->ring.clear();
    c_->done.clear();
    c_->anchors.clear();
    c_->next_pull = c_->next_out = 0;
    c_->end_seq = none;
    c_->ended = c_->stop = false;
    started_ = false;
  }

  std::unique_ptr<core> c_;
  map_options o_;
  std::vector<std::thread> threads_;
  bool started_ = false;
  std::uint64_t skip_ = 0;  // upstream elements to re-read after restore
  std::uint64_t base_ = 0;  // epoch index of element seq 0 (inline: of the next element)
  std::vector<In> scratch_;  // next_bulk's inputs, reused
};

inline void check_map_args(const map_options& o) {
  if (o.workers == 0)
    throw config_error("map: workers must be at least 1 (got 0); 1 runs the function inline");
}

}  // namespace detail

struct map_t {
  template <source S, class F>
    requires std::invocable<F&, value_t<S>&&>
  auto operator()(S&& s, F fn, map_options o = {}) const {
    detail::require_rvalue_source<S>();
    detail::check_map_args(o);
    return detail::map_source<std::remove_cvref_t<S>, F>(std::forward<S>(s), std::move(fn), o);
  }
  template <class F>
    requires(!source<F>)
  auto operator()(F fn, map_options o = {}) const {
    detail::check_map_args(o);
    return make_closure([fn, o]<class S>(S&& s) { return map_t{}(std::forward<S>(s), fn, o); });
  }
};
inline constexpr map_t map{};

}  // namespace ferry
