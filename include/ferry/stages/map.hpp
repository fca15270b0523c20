// ferry/stages/map.hpp: map(fn, {.workers, .ordered}) replaces each element e by fn(e).
//
//   src | ferry::map([](record r) { return decode(r); })                      // inline
//   src | ferry::map(decode, {.workers = 4})                                  // 4 threads, in order
//   src | ferry::map(decode, {.workers = 4, .ordered = false})                // as they finish
//   src | ferry::map(decode, {.workers = ferry::autotune})                    // it picks how many
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
// Order: ordered (the default) hands elements out in upstream order, so a parallel map
// gives the same sequence as a sequential one; ordered = false hands them out as they
// finish (less waiting behind a slow element, order not reproducible).
// Errors: if fn throws on element k, the consumer's next() for element k throws
// ferry::element_error ("map: user function threw at element k: ...") with the original
// exception nested (std::rethrow_if_nested); ferry's own errors pass through unchanged.
// The elements after k are still available to a consumer that catches and goes on
// (batch loses the batch it was building). One exception: an inline map that batch()
// drives in bulk over a contiguous source pulls and maps the batch's run as one unit, so
// the throw loses that whole run and the consumer goes on after it.
// An exception from upstream reaches the consumer unchanged at its position, and the next
// call goes on after it (the workers go on pulling), as prefetch does. A std::bad_alloc on
// a worker outside fn and upstream (its buffers) ends the epoch instead, after the elements
// the other workers published; the elements in flight are lost. (An ordered map moves fn's
// result straight into its place in the ring, so a move of the result that throws counts
// as fn's error for that element.)
// Shutdown: the destructor and rewind() stop the workers and join them, waiting only for
// fn calls already running.
// Checkpoints: exact for ordered maps: save() records the upstream position at the start
// of the current window of `window` elements plus an offset; restore() re-reads (but does
// not re-map) at most `window` elements. An unordered parallel map cannot be resumed
// exactly: save() throws config_error.
// Throws config_error for workers == 0, and for max_workers set without autotune.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/detail/spin.hpp"
#include "ferry/error.hpp"
#include "ferry/memory/buffer.hpp"
#include "ferry/observe/hooks.hpp"
#include "ferry/source.hpp"

namespace ferry {

// map_options::workers value: the stage chooses how many threads run fn (see above).
inline constexpr std::size_t autotune = static_cast<std::size_t>(-1);

struct map_options {
  std::size_t workers = 1;   // threads running fn; 1 runs it inline on the consumer's thread
  bool ordered = true;       // hand out elements in upstream order
  std::size_t window = 0;    // elements read ahead of the consumer; 0: 16384, or 4 MiB of large elements
  std::size_t max_workers = 0;  // autotune's ceiling; 0: std::thread::hardware_concurrency()
};

namespace detail {

// The autotuner's decision, one call per period: a pure function of what the period
// measured, so it is tested apart from the clock. Hill-climbing on the rate the workers
// produce, both ways, where a worker "pays" if it adds a quarter of what one more worker
// could (1/a of the rate at a workers; a quarter, because a VM's rates swing), and at
// least 3% (so noise cannot keep adding workers when each adds little):
// - down: every 16 steady periods, whatever else happens, park one; keep it parked unless
//   it paid, else bring it back and wait twice as long (up to 512) before the next test;
// - up: while the consumer waits for the map, add a worker; keep it if it pays; else park
//   it again and wait twice as many periods (up to 64) before the next try;
// - shed: the consumer hardly waits and the workers mostly wait for room: park one.
// The period after every change settles and is not judged. Rates are compared as means
// of two periods: the two before a change (one, for a new tuner) against the two after.
struct autotune_sample {
  double rate = 0;           // elements the workers produced per second
  double consumer_wait = 0;  // fraction of the period the consumer waited for elements
  double worker_wait = 0;    // fraction of the active workers' time spent waiting for room
};
struct autotune_state {
  static constexpr unsigned max_backoff = 64, first_down = 16, max_down = 512, judge_periods = 2;
  static constexpr double share = 0.25, floor = 0.03;
  enum class phase : unsigned char { steady, judge_up, judge_down };
  phase ph = phase::steady;
  unsigned settle = 1;         // periods still to discard (a new tuner: thread start-up)
  double last_rate = 0;        // the last steady period's rate at this count (0: none yet)
  double base_rate = 0;        // the mean rate before the change being judged
  double judged_sum = 0;       // rates of the periods judged so far
  unsigned judged = 0;
  std::size_t from = 0;        // the count before that change
  unsigned backoff = 1, hold = 0;                    // up: periods to wait after a useless worker
  unsigned down_every = first_down, since_down = 0;  // down: steady periods between tests

  // A period is long enough to judge at 50 ms with 64 elements, or with fewer over longer
  // (a slow fn): rates from a handful of elements are mostly noise.
  static bool period_done(double seconds, std::uint64_t elements) {
    return seconds >= 0.05 && (elements >= 64 || (seconds >= 1 && elements >= 8) || (seconds >= 10 && elements >= 1));
  }
  // Does going from `fewer` workers at rate `low` to one more at rate `high` pay?
  static bool pays(double low, double high, std::size_t fewer) {
    return high >= low * (1 + std::max(share / double(fewer), floor));
  }

  std::size_t decide(const autotune_sample& m, std::size_t active, std::size_t max) {
    if (settle > 0) {
      --settle;
      return active;
    }
    auto settle_at = [&](std::size_t to) {
      ph = phase::steady;
      settle = 1;
      last_rate = 0;
      return to;
    };
    double base;  // the mean of the last two periods at this count
    if (ph != phase::steady) {
      judged_sum += m.rate;
      if (++judged < judge_periods) return active;
      const double after = judged_sum / judged;
      if (ph == phase::judge_up) {
        if (!pays(base_rate, after, from)) {
          backoff = std::min(backoff * 2, max_backoff);
          hold = backoff;
          return settle_at(from);
        }
        backoff = 1;  // it paid: keep it (and go on below: one more if the consumer still waits)
      } else {
        if (pays(after, base_rate, active)) {  // the parked worker paid: bring it back
          down_every = std::min(down_every * 2, max_down);
          hold = backoff;  // and no up-probe at once: that count was just tested
          return settle_at(from);
        }
        down_every = first_down;  // it did not pay: it stays parked, and the next
        backoff = std::min(backoff * 2, max_backoff);  // try to add one waits longer
        hold = backoff;
      }
      ph = phase::steady;
      base = after;
    } else {
      base = last_rate > 0 ? (last_rate + m.rate) / 2 : m.rate;
    }
    last_rate = m.rate;
    auto change = [&](phase p, std::size_t to) {
      base_rate = base;
      from = active;
      judged_sum = 0;
      judged = 0;
      since_down = 0;
      settle_at(to);
      ph = p;
      return to;
    };
    if (active > 1 && ++since_down >= down_every) return change(phase::judge_down, active - 1);
    if (hold > 0) {
      --hold;
      return active;
    }
    if (m.consumer_wait > 0.05 && active < max) return change(phase::judge_up, active + 1);
    if (active > 1 && m.consumer_wait < 0.01 && m.worker_wait > 0.5) {  // plainly too many
      hold = backoff;
      since_down = 0;
      return settle_at(active - 1);
    }
    return active;
  }
};

template <source Up, class F>
class map_source : public source_interface<map_source<Up, F>> {
  using In = value_t<Up>;
  using Out = std::remove_cvref_t<std::invoke_result_t<F&, In&&>>;
  static_assert(!std::is_void_v<Out>,
                "ferry::map: the function must return the new element; to drop elements use "
                "ferry::filter");
  static constexpr bool resumable = resumable_source<Up>;
  static constexpr std::uint64_t none = std::numeric_limits<std::uint64_t>::max();
  static constexpr int spin_rounds = 64;
  using clock = std::chrono::steady_clock;
  static constexpr std::chrono::milliseconds tune_poll{20};  // while the consumer waits
  // A run should take long enough to amortise a thread sleep and wake (tens of µs on a VM).
  static constexpr double target_run_seconds = 200e-6;

  struct slot {  // unordered: a finished element, queued in `done`
    std::optional<Out> value;
    std::exception_ptr error;
    bool from_upstream = false;
  };
  enum : std::uint8_t { ok, fn_threw, upstream_threw };  // ordered: what a ring place holds
  // Heap-allocated so the pipeline object can move while workers run.
  struct core {
    core(Up u, F f) : up(std::move(u)), fn(std::move(f)) {}
    Up up;
    F fn;
    std::mutex pull_m;  // serialises upstream next(); taken before m
    std::mutex m;
    std::condition_variable space, ready;
    std::condition_variable park;          // autotune: workers numbered >= active wait here
    std::atomic<std::size_t> active{0};    // workers that may claim runs (changed under m)
    std::atomic<std::uint64_t> room_wait_ns{0};  // workers' total wait for room (autotune)
    // Ordered: element seq lives at seq % window. A worker writes its run's values (or
    // errors) straight into the ring without the lock, as no one else touches those
    // places until it publishes the run (run_end under m); the consumer moves them out
    // from there. So an element is moved once on each side, with one lock per run.
    std::vector<std::optional<Out>> vals;
    std::vector<std::exception_ptr> errs;
    std::vector<std::uint8_t> kind;       // what seq % window holds: a value, or an error (which)
    std::vector<std::uint64_t> run_end;   // at a published run's first place: the seq past it
    std::deque<std::pair<std::uint64_t, slot>> done;    // unordered: in finishing order
    std::deque<std::pair<std::uint64_t, pipeline_state>> anchors;  // upstream state before seq
    // next_out: elements the consumer has taken from the ring (published runs) or from done
    // (into its local queue);
    // handed: elements it has handed out (what bounds the read-ahead).
    std::uint64_t next_pull = 0, next_out = 0, end_seq = none;
    std::atomic<std::uint64_t> handed{0};  // written by the consumer without the lock
    bool ended = false, stop = false;
    std::exception_ptr failure;  // a worker failed outside fn and upstream (out of memory)
    int workers_alive = 0;       // workers that may still publish
    int consumer_waiting = 0;                // notify only when someone sleeps
    std::atomic<int> workers_waiting{0};
    std::atomic<std::uint64_t> published{0};  // runs published by workers (for spinning)
    std::uint64_t next_out_seen = 0;           // consumer's last view of `published`
    observe::stage_counters stats;
    [[no_unique_address]] observe::upstream_probe<Up> probe;
  };

 public:
  using value_type = Out;

  map_source(Up up, F fn, map_options o)
      : c_(std::make_unique<core>(std::move(up), std::move(fn))), o_(o) {
    if (o_.workers == autotune) {  // max_workers threads, of which the tuner lets some work
      tuned_ = true;
      o_.workers = o_.max_workers ? o_.max_workers : std::max(1u, std::thread::hardware_concurrency());
    }
    c_->active = tuned_ ? 1 : o_.workers;  // kept across epochs; what report() shows (any thread)
    // Default: enough in flight for each worker to claim runs long enough (~200 µs) to
    // amortise a thread wake-up even for cheap fns: 16384 elements, or fewer when they are
    // large (4 MiB of Out at most; the ring's slots are allocated up front). A deep window matters when workers fill every core:
    // the consumer then runs only when they block. (With 1024, a 0.1 µs fn on 2 workers ran
    // at 0.26x a threaded loop, bound by sleeps and wake-ups; with 16384, 0.6x.)
    if (o_.window == 0)
      o_.window = std::clamp<std::size_t>((std::size_t(4) << 20) / sizeof(Out), 4 * o_.workers,
                                          std::max<std::size_t>(16384, 4 * o_.workers));
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
      local_ = std::move(o.local_);
      cons_ = o.cons_;
      tuned_ = o.tuned_;
      tu_ = o.tu_;
    }
    return *this;
  }
  ~map_source() { halt(); }

  std::optional<Out> next() {
    // The inline path apart: merged into next_impl, its result went through the parallel
    // path's locals (a store-forwarding stall: 14 ns instead of 2 per element).
    if (o_.workers == 1)
      return observe::observed_next(c_->stats, "map", [&] {
        skip_pending();
        return next_inline();
      });
    return observe::observed_next(c_->stats, "map", [&] { return next_impl(); });
  }

  // The next element handed to sink(Out&) where it lies, not moved out first; false at the
  // end of the epoch. Throws as next() does (sink's own exceptions propagate, the element
  // counted as taken). For a consumer that copies each element somewhere anyway (batch's
  // collation), with stats off: an inline map hands fn's result as made, an ordered
  // parallel map the element in its ring, each saving a move (a copy of the whole element
  // for arrays); other maps go through next(). Runs on the caller's thread; so does sink.
  template <class Sink>
  bool next_into(Sink&& sink) {
    if (o_.workers == 1 && !observe::on()) {  // inline: fn's result made where sink sees it
      skip_pending();
      std::optional<In> e = c_->probe.pull(c_->up);
      if (!e) return false;
      Out v = apply_inline(std::move(*e));
      sink(v);
      return true;
    }
    if (o_.workers == 1 || !o_.ordered || observe::on()) {
      std::optional<Out> e = next();
      if (!e) return false;
      sink(*e);
      return true;
    }
    skip_pending();
    if (!started_) start();
    if (cons_ == c_->next_out && !take_ready()) return false;
    const std::size_t i = static_cast<std::size_t>(cons_ % o_.window);
    if (c_->kind[i] != ok) {
      next_impl();  // an error at the front: throws as next() would
      return false;
    }
    ++cons_;
    auto give_back = [&] {  // after sink, even if it throws: the place is free for a worker
      c_->vals[i].reset();
      hand_out(1);
    };
    try {
      sink(*c_->vals[i]);
    } catch (...) {
      give_back();
      throw;
    }
    give_back();
    return true;
  }

  // Parallel maps: take runs of mapped elements at once. Inline maps over a bulk upstream:
  // pull a run of inputs, map them in one loop. Otherwise element by element.
  std::size_t next_bulk(std::span<Out> out) {
    if (o_.workers != 1)
      return observe::observed_bulk(c_->stats, "map", out, [&] { return bulk_parallel(out); });
    if constexpr (bulk_source<Up>) {
      return observe::observed_bulk(c_->stats, "map", out, [&] { return bulk_inline(out); });
    } else {
      std::size_t k = 0;
      while (k < out.size())
        if (auto e = next()) out[k++] = std::move(*e);
        else break;
      return k;
    }
  }

  void visit_stages(observe::stage_visitor& v) const {
    c_->probe.visit(c_->up, v);
    if (o_.workers == 1)
      v.add("map", c_->stats, observe::stage_mode::inline_stage, 1);
    else
      v.add("map", c_->stats, observe::stage_mode::threaded_stage,
            c_->active.load());
  }

 private:
  std::optional<Out> next_impl() {
    skip_pending();
    if (o_.workers == 1) return next_inline();
    if (!started_) start();
    if (o_.ordered) {
      if (cons_ == c_->next_out && !take_ready()) return std::nullopt;
      const std::uint64_t seq = cons_++;
      const std::size_t i = static_cast<std::size_t>(seq % o_.window);
      const std::uint8_t kind = c_->kind[i];
      std::exception_ptr err;
      std::optional<Out> v;
      if (kind == ok) {
        v.emplace(std::move(*c_->vals[i]));
        c_->vals[i].reset();
      } else {
        err = std::exchange(c_->errs[i], nullptr);  // no reference stays in the ring
      }
      hand_out(1);  // only after the place is read: a worker may refill it after this
      if (kind == upstream_threw) std::rethrow_exception(err);
      if (kind == fn_threw) rethrow_element(err, "map", base_ + seq);
      return v;
    }
    if (local_.empty() && !take_ready()) return std::nullopt;
    auto [seq, s] = std::move(local_.front());
    local_.pop_front();
    hand_out(1);
    if (s.error) {
      if (s.from_upstream) std::rethrow_exception(s.error);
      rethrow_element(s.error, "map", base_ + seq);
    }
    return std::move(s.value);
  }

  // Counts n more elements as handed out, which frees room in the window; wakes workers
  // waiting for room once a quarter of it is free. No lock per call: `handed` is atomic.
  // A worker registers as waiting before it re-checks for room (both seq_cst), so either
  // it sees this increment or we see it waiting; taking the lock before notifying closes
  // the gap before its wait().
  void hand_out(std::uint64_t n) {
    const std::uint64_t h = c_->handed.fetch_add(n) + n;
    bool wake = false;
    if (c_->workers_waiting.load() > 0) {
      std::lock_guard lk(c_->m);
      const std::uint64_t free = h + o_.window - std::min(c_->next_pull, h + o_.window);
      wake = free >= std::max<std::uint64_t>(1, o_.window / 4);
    }
    if (wake) c_->space.notify_all();
    if (tuned_ && (tu_.countdown -= std::int64_t(n)) <= 0) {
      tu_.countdown = tuner::poll_every;
      std::lock_guard lk(c_->m);
      tune(clock::now());
    }
  }

  // next_bulk with workers: moves runs of ready elements straight into `out`, counting
  // each run as handed out at once. An element whose fn threw goes through next_impl(),
  // which throws exactly as out.size() next() calls would.
  std::size_t bulk_parallel(std::span<Out> out) {
    skip_pending();
    if (!started_) start();
    std::size_t k = 0;
    if (o_.ordered) {
      while (k < out.size()) {
        if (cons_ == c_->next_out && !take_ready()) break;
        const std::uint64_t end = std::min<std::uint64_t>(c_->next_out, cons_ + (out.size() - k));
        std::uint64_t seq = cons_;
        std::size_t i = static_cast<std::size_t>(seq % o_.window);
        for (; seq < end && c_->kind[i] == ok; ++seq) {
          out[k++] = std::move(*c_->vals[i]);
          c_->vals[i].reset();  // what the value held goes now, not a lap later
          if (++i == o_.window) i = 0;
        }
        const std::uint64_t took = seq - cons_;
        cons_ = seq;
        if (took) hand_out(took);  // after the moves: workers may refill those places
        if (k < out.size() && cons_ < c_->next_out) next_impl();  // an error at the front: throws
      }
      return k;
    }
    while (k < out.size()) {
      if (local_.empty() && !take_ready()) break;
      std::size_t took = 0;
      while (k < out.size() && !local_.empty() && !local_.front().second.error) {
        out[k++] = std::move(*local_.front().second.value);
        local_.pop_front();
        ++took;
      }
      if (took) hand_out(took);
      if (k < out.size() && !local_.empty()) next_impl();  // an error at the front: throws
    }
    return k;
  }

  // Moves every element that is ready (in order, for ordered maps) into local_, under one
  // lock; waits if none is. False at the end of the epoch.
  bool take_ready() {
    // Before sleeping, give a worker that is about to publish a moment (spin, then yield
    // the core to it): a futex sleep and wake per run costs more than the wait itself.
    // The whole wait, spin included, counts as waiting on upstream.
    observe::wait_timer wt;
    bool waited = false;
    if (c_->published.load(std::memory_order_acquire) == c_->next_out_seen) {
      waited = true;
      wt.start();
      if (tuned_) tu_.begin_wait(clock::now());
      for (int i = 0; i < spin_rounds && c_->published.load(std::memory_order_acquire) == c_->next_out_seen; ++i) {
        if (i < spin_rounds / 2)
          for (int k = 0; k < 16; ++k) cpu_relax();
        else
          std::this_thread::yield();
      }
    }
    std::unique_lock lk(c_->m);
    // A failed worker's error is thrown once no worker can publish an element before it.
    auto failed = [&] { return c_->failure && c_->workers_alive == 0; };
    auto have = [&] {
      if (failed()) return true;
      if (o_.ordered) return run_ready() || (c_->ended && c_->next_out >= c_->end_seq);
      return !c_->done.empty() || (c_->ended && c_->next_out >= c_->end_seq);
    };
    if (tuned_) {
      const auto now = clock::now();
      if (!waited && !have()) tu_.begin_wait(now);
      tune(now);
    }
    if (!have()) {
      if (!waited) wt.start();
      waited = true;
      ++c_->consumer_waiting;
      if (!tuned_) {
        c_->ready.wait(lk, have);
      } else {  // the tuner also runs while the consumer starves: a slow fn ramps up
        while (!c_->ready.wait_for(lk, tune_poll, have)) tune(clock::now());
      }
      --c_->consumer_waiting;
    }
    if (waited) wt.stop(c_->stats.wait_up, "map: wait upstream");
    if (tuned_ && tu_.waiting) tu_.end_wait(clock::now());
    {  // keep the newest anchor at or before `handed`, and later ones
      auto& a = c_->anchors;
      const std::uint64_t h = c_->handed.load();
      while (a.size() >= 2 && a[1].first <= h) a.pop_front();
    }
    c_->next_out_seen = c_->published.load(std::memory_order_relaxed);
    if (o_.ordered) {
      while (run_ready()) c_->next_out = c_->run_end[c_->next_out % o_.window];
    } else {
      while (!c_->done.empty()) {
        local_.push_back(std::move(c_->done.front()));
        c_->done.pop_front();
        ++c_->next_out;
      }
    }
    const bool none = o_.ordered ? cons_ == c_->next_out : local_.empty();
    if (none && failed()) {
      c_->end_seq = c_->next_out;  // `ended` is set: later calls see the end of the epoch
      std::rethrow_exception(std::exchange(c_->failure, nullptr));
    }
    return !none;
  }

  // Ordered, with c_->m held: the run starting at next_out is published. A stale entry
  // from an earlier lap of the ring ends at or before next_out (a run is at most window
  // long), so it does not count.
  bool run_ready() const { return c_->run_end[c_->next_out % o_.window] > c_->next_out; }

  // Autotune, on the consumer's thread with c_->m held (park's waiters check `active`
  // under it): once a period is long enough, measure it and let autotune_state decide.
  // Called from take_ready (also every 20 ms while the consumer waits) and every 256
  // elements handed out (a consumer that works through a deep local_ queue).
  void tune(clock::time_point now) {
    // A period runs on across epochs (their gaps left out), so short epochs still add up.
    const double dt = tu_.carry_s + std::chrono::duration<double>(now - tu_.period_start).count();
    const std::uint64_t made = tu_.carry_n + (c_->next_pull - tu_.pulled0);
    tu_.last_seen = now;
    tu_.last_pulled = c_->next_pull;
    if (!autotune_state::period_done(dt, made)) return;
    if (tu_.waiting) tu_.end_wait(now), tu_.begin_wait(now);
    const std::uint64_t room = c_->room_wait_ns.load();
    const std::size_t a = c_->active.load();
    autotune_sample m;
    // Production (elements the workers pulled to map), not what the consumer took: a
    // consumer draining a full window would make a period look faster than the workers.
    m.rate = double(made) / dt;
    m.consumer_wait = std::min(1.0, tu_.waited_s / dt);
    // A room wait is counted when it ends, so a long one can land in a later period.
    m.worker_wait = std::min(1.0, double(room - tu_.room0) * 1e-9 / (dt * double(a)));
    const std::size_t next = tu_.state.decide(m, a, o_.workers);
    if (next != a) {
      c_->active.store(next);
      if (next > a) c_->park.notify_all();
    }
    tu_.period_start = now;
    tu_.pulled0 = c_->next_pull;
    tu_.carry_s = 0;
    tu_.carry_n = 0;
    tu_.room0 = room;
    tu_.waited_s = 0;
  }

  std::size_t bulk_inline(std::span<Out> out) {
    skip_pending();
    std::size_t n, i = 0;
    std::span<const In> view;
    if constexpr (view_source<Up>) {  // read the source's memory directly: one pass
      view = c_->probe.pull_view(c_->up, out.size());
      n = view.size();
    } else if constexpr (std::is_same_v<In, Out>) {
      n = c_->probe.pull_bulk(c_->up, out);
    } else {
      scratch_.resize(out.size());
      n = c_->probe.pull_bulk(c_->up, std::span<In>(scratch_));
    }
    try {
      if constexpr (view_source<Up>)
        for (; i < n; ++i) out[i] = std::invoke(c_->fn, In(view[i]));
      else if constexpr (std::is_same_v<In, Out>)  // map in place: no second pass
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
      const std::uint64_t target = c_->handed;
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
  // An upstream error among them was handed out before the save: it counts as its
  // element and is not thrown again.
  void skip_pending() {
    while (skip_ > 0) {
      --skip_;
      try {
        if (!c_->up.next()) skip_ = 0;
      } catch (...) {
      }
    }
  }

  std::optional<Out> next_inline() {
    std::optional<In> e = c_->probe.pull(c_->up);
    if (!e) return std::nullopt;
    return std::optional<Out>(apply_inline(std::move(*e)));
  }
  // fn on the next input, on this thread; its exception rethrown as element_error.
  Out apply_inline(In&& x) {
    const std::uint64_t k = base_++;
    try {
      return std::invoke(c_->fn, std::move(x));
    } catch (...) {
      rethrow_element(std::current_exception(), "map", k);
    }
  }

  void start() {
    started_ = true;
    if (o_.ordered) {
      c_->vals.clear();  // not assign(n, nullopt): that copies, and results may be move-only
      c_->vals.resize(o_.window);
      c_->errs.assign(o_.window, nullptr);
      c_->kind.assign(o_.window, ok);
      c_->run_end.assign(o_.window, 0);
    }
    if (tuned_) {  // a new period; the learned count and backoffs carry over from last epoch
      // The open period goes on: what the last epoch added to it until its last look
      // (pulled0..last_pulled over period_start..last_seen) is carried, the gap is not.
      if (tu_.last_seen > tu_.period_start) {
        tu_.carry_s += std::chrono::duration<double>(tu_.last_seen - tu_.period_start).count();
        tu_.carry_n += tu_.last_pulled - tu_.pulled0;
      }
      tu_.countdown = tuner::poll_every;
      tu_.period_start = tu_.last_seen = clock::now();
      tu_.pulled0 = tu_.last_pulled = 0;  // next_pull starts again from 0
      tu_.waiting = false;
    }
    threads_.reserve(o_.workers);
    for (std::size_t i = 0; i < o_.workers; ++i)
      threads_.emplace_back([c = c_.get(), o = o_, i] { work(*c, o, i); });
  }

  // A worker claims a run of consecutive elements (pulled under the upstream lock), maps
  // them, and publishes them under one lock: synchronisation costs once per run, not per
  // element. The run length adapts so a run takes about 200 µs of fn time (1 for slow fns,
  // up to window / workers for cheap ones), so cheap maps are not bound by thread wake-ups
  // and slow ones still spread across every worker.
  // No exception may leave a thread: one from outside fn and upstream (std::bad_alloc
  // from a buffer or from publishing) becomes the epoch's last error, for the consumer.
  static void work(core& c, const map_options o, std::size_t index) {
    {
      std::lock_guard lk(c.m);
      ++c.workers_alive;
    }
    try {
      work_loop(c, o, index);
    } catch (...) {
      std::lock_guard lk(c.m);
      if (!c.failure) c.failure = std::current_exception();
      c.ended = true;  // no new runs
    }
    {
      std::lock_guard lk(c.m);
      --c.workers_alive;
    }
    c.ready.notify_all();
    c.space.notify_all();
    c.park.notify_all();
  }

  static void work_loop(core& c, const map_options o, const std::size_t index) {
    observe::name_this_thread("ferry map worker");
    const std::uint64_t window = o.window;
    std::uint64_t run = 1;
    std::vector<In> ins;
    std::vector<slot> outs;
    std::vector<std::pair<std::uint64_t, pipeline_state>> anchors;
    for (;;) {
      {
        std::unique_lock lk(c.m);
        // Room counts elements handed to the consumer, so at most `window` are read ahead.
        auto room = [&] { return c.stop || c.ended || c.next_pull < c.handed + window; };
        auto working = [&] { return c.stop || c.ended || index < c.active.load(); };
        // Autotune parks the workers numbered at or above `active` (never worker 0), also
        // one parked while it waited for room.
        while (c.park.wait(lk, working), !room()) {
          observe::wait_timer wt;
          wt.start();
          const auto r0 = clock::now();
          ++c.workers_waiting;  // before the re-check in wait(): see the consumer's comment
          c.space.wait(lk, room);
          --c.workers_waiting;
          c.room_wait_ns.fetch_add(
              std::uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - r0).count()));
          wt.stop(c.stats.wait_down, "map: wait downstream", /*shared=*/true);
        }
        if (c.stop || c.ended) return;
      }
      // Half the window per working thread: each can compute one run while another waits
      // to be taken.
      const std::uint64_t run_cap = std::max<std::uint64_t>(1, window / (2 * std::max<std::size_t>(1, c.active.load())));
      std::unique_lock pl(c.pull_m);
      std::uint64_t first, want;
      {
        std::lock_guard lk(c.m);
        if (c.stop || c.ended) return;
        if (c.next_pull >= c.handed + window) continue;  // another worker took the space
        first = c.next_pull;
        want = std::min(run, c.handed + window - c.next_pull);
      }
      ins.clear();
      anchors.clear();
      std::exception_ptr uerr;
      bool end = false;
      try {
        for (std::uint64_t k = 0; k < want; ++k) {
          if constexpr (resumable) {
            if (o.ordered && (first + k) % window == 0) {
              pipeline_state st;
              state_writer w(st);
              c.up.save(w);
              anchors.emplace_back(first + k, std::move(st));
            }
          }
          std::optional<In> e = c.probe.pull(c.up);
          if (!e) {
            end = true;
            break;
          }
          ins.push_back(std::move(*e));
        }
      } catch (...) {
        uerr = std::current_exception();
      }
      const std::uint64_t got = ins.size();
      {
        std::lock_guard lk(c.m);
        for (auto& a : anchors) c.anchors.push_back(std::move(a));
        c.next_pull = first + got + (uerr ? 1 : 0);  // an upstream error holds its place
        if (end) {
          c.ended = true;
          c.end_seq = c.next_pull;
        }
      }
      pl.unlock();

      const bool timed = observe::on();
      const auto w0 = std::chrono::steady_clock::now();
      if (!o.ordered) {
        outs.clear();
        outs.resize(got + (uerr ? 1 : 0));
      }
      // Ordered: places first .. first+got (+1 for an upstream error) are this worker's
      // until it publishes: their last elements were handed out before it claimed them.
      std::size_t at = static_cast<std::size_t>(first % window);
      for (std::uint64_t i = 0; i < got; ++i) {
        const observe::ticks t0 = timed ? observe::now() : 0;
        if (o.ordered) {
          try {
            c.vals[at].emplace(std::invoke(c.fn, std::move(ins[i])));
            c.kind[at] = ok;
          } catch (...) {
            c.errs[at] = std::current_exception();
            c.kind[at] = fn_threw;
          }
          if (++at == window) at = 0;
        } else {
          try {
            outs[i].value.emplace(std::invoke(c.fn, std::move(ins[i])));
          } catch (...) {
            outs[i].error = std::current_exception();
          }
        }
        if (timed) {
          const observe::ticks t1 = observe::now();
          c.stats.work.add_shared(t1 - t0);
          if (observe::tracing()) observe::record("map: fn", t0, t1);
        }
      }
      if (got) {  // adapt the run length toward ~200 µs of fn time
        const double per = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count() / got;
        const double ideal = per > 0 ? target_run_seconds / per : double(run_cap);
        run = std::clamp<std::uint64_t>(ideal >= double(run_cap) ? run_cap : std::uint64_t(ideal), 1, run_cap);
      }
      const std::uint64_t made = got + (uerr ? 1 : 0);  // an upstream error holds a place
      if (uerr) {  // no reference stays here: the consumer takes the last
        if (o.ordered) {
          c.errs[at] = std::move(uerr);
          c.kind[at] = upstream_threw;
        } else {
          outs[got].error = std::move(uerr);
          outs[got].from_upstream = true;
        }
      }
      bool wake_consumer;
      {
        std::lock_guard lk(c.m);
        if (o.ordered) {
          if (made) c.run_end[first % window] = first + made;
        } else {
          for (std::uint64_t i = 0; i < made; ++i) c.done.emplace_back(first + i, std::move(outs[i]));
        }
        wake_consumer = c.consumer_waiting > 0 || c.ended;
        c.published.fetch_add(1, std::memory_order_release);
      }
      if (wake_consumer) c.ready.notify_all();
      if (end) {
        c.space.notify_all();  // other workers waiting for space see `ended`
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
    c_->park.notify_all();
    for (auto& t : threads_)
      if (t.joinable()) t.join();
    threads_.clear();
  }

  void reset() {
    c_->vals.clear();
    c_->errs.clear();
    c_->kind.clear();
    c_->run_end.clear();
    c_->done.clear();
    c_->anchors.clear();
    c_->next_pull = c_->next_out = 0;
    c_->handed = 0;
    c_->end_seq = none;
    c_->failure = nullptr;
    local_.clear();
    cons_ = 0;
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
  std::deque<std::pair<std::uint64_t, slot>> local_;  // unordered: taken from done, not yet handed out
  std::uint64_t cons_ = 0;  // ordered: the next seq to hand out; [cons_, next_out) are taken
  bool tuned_ = false;  // workers = autotune
  struct tuner {
    autotune_state state;
    clock::time_point period_start{}, wait_start{};
    bool waiting = false;
    double waited_s = 0;  // the consumer's wait for elements in this period
    std::uint64_t pulled0 = 0, room0 = 0;
    // The open period's share from earlier epochs, and where this epoch's last look was.
    double carry_s = 0;
    std::uint64_t carry_n = 0, last_pulled = 0;
    clock::time_point last_seen{};
    static constexpr std::int64_t poll_every = 256;  // elements handed out between clock reads
    std::int64_t countdown = poll_every;
    void begin_wait(clock::time_point t) { waiting = true, wait_start = t; }
    void end_wait(clock::time_point t) {
      waiting = false;
      waited_s += std::chrono::duration<double>(t - wait_start).count();
    }
  } tu_;
};

inline void check_map_args(const map_options& o) {
  if (o.workers == 0)
    throw config_error("map: workers must be at least 1 (got 0); 1 runs the function inline");
  if (o.max_workers != 0 && o.workers != autotune)
    throw config_error("map: max_workers is autotune's ceiling; set workers = ferry::autotune to use it (got workers = " +
                       std::to_string(o.workers) + ")");
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
