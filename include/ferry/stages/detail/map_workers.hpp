// ferry/stages/detail/map_workers.hpp: map's parallel machine (workers > 1 or autotune):
// worker threads that claim runs of upstream elements, map them and publish them, either
// into an ordered ring (map_ring.hpp: elements handed out in upstream order) or into a
// queue in finishing order (map_queue.hpp: ordered = false); the autotuner
// (map_autotune.hpp) sets how many work; map_core.hpp holds the block they share and the
// workers' loop. map.hpp documents what users see; this is how.
//
// Runs: a worker claims a run of consecutive elements (pulled under the upstream lock),
// maps them outside any lock, and publishes the run under one lock: synchronisation costs
// once per run, not per element. The run length adapts so a run takes about 200 us of fn
// time (1 element for slow fns, up to window / (2 x workers) for cheap ones).
// Read-ahead: at most `window` elements pulled past what the consumer was handed.
// Checkpoints (ordered only): every `window` elements a worker records the upstream's words
// before the pull (an anchor); save() gives the newest anchor at or before what was handed
// out and how many to re-read after it.
// Threads: workers run fn and the upstream's next(); the consumer side (next, bulk,
// next_into, take_ready, the tuner) runs on the thread calling map's next(). No exception
// leaves a worker: one from outside fn and the upstream (std::bad_alloc) becomes the epoch's
// last error, for the consumer.
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
#include <span>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/detail/deferred_frees.hpp"
#include "ferry/detail/spin.hpp"
#include "ferry/error.hpp"
#include "ferry/observe/hooks.hpp"
#include "ferry/source.hpp"
#include "ferry/stages/detail/map_autotune.hpp"
#include "ferry/stages/detail/map_core.hpp"

namespace ferry::detail {

// Puller: pulls the upstream through the stage's probe (threaded_stage's puller), and gives
// the upstream itself for saves. F lives in the machine's heap block; the inline path
// calls it through fn().
template <class Puller, class F, class In, class Out>
class map_workers {
  using core = map_core<Puller, F, In, Out>;  // map_core.hpp: the block and the workers' loop
  static constexpr bool resumable = core::resumable;
  static constexpr std::uint64_t none = core::none;
  static constexpr int spin_rounds = 64;
  using clock = std::chrono::steady_clock;
  static constexpr std::chrono::milliseconds tune_poll{20};  // while the consumer waits

 public:
  map_workers(Puller pull, F f, observe::stage_counters* stats, const map_machine_options& o, bool tuned)
      : c_(std::make_unique<core>(pull, std::move(f), stats)), o_(o), tuned_(tuned) {
    c_->active = tuned_ ? 1 : o_.workers;  // kept across epochs; what report() shows (any thread)
  }
  map_workers(map_workers&&) noexcept = default;
  map_workers& operator=(map_workers&& o) noexcept {
    if (this != &o) {
      halt();
      c_ = std::move(o.c_);
      threads_ = std::move(o.threads_);
      o_ = o.o_;
      started_ = o.started_;
      tuned_ = o.tuned_;
      tu_ = o.tu_;
    }
    return *this;
  }
  ~map_workers() { halt(); }

  F& fn() noexcept { return c_->fn; }
  bool started() const noexcept { return started_; }
  std::size_t active() const noexcept { return c_->active.load(); }

  // The next element; its error re-thrown at its place: fn's as element_error naming
  // base + seq, the upstream's unchanged.
  std::optional<Out> next(std::uint64_t base) {
    if (!started_) start();
    hand_up(c_->deferred);  // pinned blocks the workers let go (deferred_frees.hpp)
    return o_.ordered ? c_->ring.next(*this, base) : c_->queue.next(*this, base);
  }

  // Ordered: the next element handed to sink where it lies in the ring. False at the end.
  template <class Sink>
  bool next_into(Sink& sink, std::uint64_t base) {
    if (!started_) start();
    hand_up(c_->deferred);
    return c_->ring.next_into(*this, sink, base);
  }

  // Moves runs of ready elements straight into `out`; an element whose fn threw throws
  // exactly as out.size() next() calls would.
  std::size_t bulk(std::span<Out> out, std::uint64_t base) {
    if (!started_) start();
    hand_up(c_->deferred);
    return o_.ordered ? c_->ring.bulk(*this, out, base) : c_->queue.bulk(*this, out, base);
  }

  // Ordered, started: the newest anchor at or before what was handed out, written to w, and
  // returns {elements to re-read after it, elements handed out this epoch}.
  std::pair<std::uint64_t, std::uint64_t> save_position(state_writer& w) const
    requires resumable
  {
    if (!o_.ordered)
      throw config_error("map: an unordered parallel map cannot be checkpointed exactly; "
                         "use .ordered = true to save_state()");
    std::lock_guard pl(c_->pull_m);
    if (c_->anchor_error) std::rethrow_exception(c_->anchor_error);  // the upstream cannot be saved
    std::lock_guard lk(c_->m);
    const std::uint64_t target = c_->handed;
    const auto& a = c_->anchors;
    auto it = std::find_if(a.rbegin(), a.rend(), [&](const auto& p) { return p.first <= target; });
    if (it != a.rend()) {
      pipeline_state scratch;
      ask_save(c_->pull.upstream(), scratch);  // the anchor may predate the upstream's refusal
      w.put_words(it->second.words);
      return {target - it->first, target};
    }
    c_->pull.upstream().save(w);  // nothing pulled at or before target yet: upstream is exactly there
    return {0, target};
  }

  // Stops the workers and joins them, waiting only for fn calls already running.
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
    hand_up(c_->deferred);  // what they let go after the consumer's last call
  }

  // halt(), and a new epoch: what was read ahead goes.
  void reset() noexcept {
    halt();
    c_->ring.clear();
    c_->queue.clear();
    c_->anchors.clear();
    c_->anchor_error = nullptr;
    c_->next_pull = c_->next_out = 0;
    c_->handed = 0;
    c_->end_seq = none;
    c_->failure = nullptr;
    c_->ended = c_->stop = false;
    started_ = false;
  }

 private:
  template <class>
  friend struct map_ring;
  template <class>
  friend struct map_queue;
  std::uint64_t next_out() const noexcept { return c_->next_out; }

  // Throws ferry::error naming the window or the thread that could not be had (none is
  // left running then: the next next() tries again).
  void start() {
    if (o_.ordered) {
      try {
        c_->ring.allocate(o_.window);
      } catch (const std::exception& e) {
        reset();
        throw error("map: the ring of a window of " + std::to_string(o_.window) + " elements (" +
                    std::to_string(o_.window * (sizeof(std::optional<Out>) + 17)) +
                    " bytes) could not be allocated: " + e.what());
      }
    }
    if (tuned_) tu_.new_epoch(clock::now());
    // The workers start parked (active 0), so none pulls an element until every thread
    // runs: a thread that cannot be had then loses nothing.
    const std::size_t active = c_->active.load();
    c_->active.store(0);
    try {
      threads_.reserve(o_.workers);
      for (std::size_t i = 0; i < o_.workers; ++i)
        threads_.emplace_back([c = c_.get(), o = o_, i] { core::work(*c, o, i); });
    } catch (const std::exception& e) {
      const std::size_t made = threads_.size();
      reset();
      c_->active.store(active);
      throw error("map: could not start worker thread " + std::to_string(made + 1) + " of " +
                  std::to_string(o_.workers) + ": " + e.what());
    }
    {
      std::lock_guard lk(c_->m);  // park's waiters check `active` under it
      c_->active.store(active);
    }
    c_->park.notify_all();
    started_ = true;
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
    if (tuned_ && tu_.due(n)) {
      std::lock_guard lk(c_->m);
      tune(clock::now());
    }
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
      const bool r = o_.ordered ? c_->ring.ready(c_->next_out) : c_->queue.ready(c_->next_out);
      return r || (c_->ended && c_->next_out >= c_->end_seq);
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
    if (waited) wt.stop(c_->stats->wait_up, "map: wait upstream");
    if (tuned_ && tu_.waiting) tu_.end_wait(clock::now());
    {  // keep the newest anchor at or before `handed`, and later ones
      auto& a = c_->anchors;
      const std::uint64_t h = c_->handed.load();
      while (a.size() >= 2 && a[1].first <= h) a.pop_front();
    }
    c_->next_out_seen = c_->published.load(std::memory_order_relaxed);
    if (o_.ordered)
      c_->ring.collect(c_->next_out);
    else
      c_->queue.collect(c_->next_out);
    const bool empty = o_.ordered ? c_->ring.empty(c_->next_out) : c_->queue.empty(c_->next_out);
    if (empty && failed()) {
      c_->end_seq = c_->next_out;  // `ended` is set: later calls see the end of the epoch
      std::rethrow_exception(std::exchange(c_->failure, nullptr));
    }
    return !empty;
  }

  // Autotune, on the consumer's thread with c_->m held (park's waiters check `active`
  // under it). Called from take_ready (also every 20 ms while the consumer waits) and
  // every 256 elements handed out (a consumer that works through a deep local_ queue).
  void tune(clock::time_point now) {
    const std::size_t a = c_->active.load();
    const std::size_t next = tu_.look(now, c_->next_pull, c_->room_wait_ns.load(), a, o_.workers);
    if (next != a) {
      c_->active.store(next);
      if (next > a) c_->park.notify_all();
    }
  }

  std::unique_ptr<core> c_;
  map_machine_options o_;
  std::vector<std::thread> threads_;
  bool started_ = false;
  bool tuned_ = false;      // workers = autotune
  map_tuner tu_;
};

}  // namespace ferry::detail
