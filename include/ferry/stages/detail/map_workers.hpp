// ferry/stages/detail/map_workers.hpp: map's parallel machine (workers > 1 or autotune):
// worker threads that claim runs of upstream elements, map them and publish them, either
// into an ordered ring (map_ring.hpp: elements handed out in upstream order) or into a
// queue in finishing order (map_queue.hpp: ordered = false); the autotuner
// (map_autotune.hpp) sets how many work. map.hpp documents what users see; this is how.
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

#include "ferry/detail/spin.hpp"
#include "ferry/error.hpp"
#include "ferry/observe/hooks.hpp"
#include "ferry/source.hpp"
#include "ferry/stages/detail/map_autotune.hpp"
#include "ferry/stages/detail/map_queue.hpp"
#include "ferry/stages/detail/map_ring.hpp"

namespace ferry::detail {

// What the machine runs with, resolved by map.hpp from the user's map_options.
struct map_machine_options {
  std::size_t workers = 2;  // threads
  bool ordered = true;      // the ring, or the queue
  std::size_t window = 16;  // elements read ahead of the consumer
};

// Puller: pulls the upstream through the stage's probe (threaded_stage's puller), and gives
// the upstream itself for saves. F lives in the machine's heap block; the inline path
// calls it through fn().
template <class Puller, class F, class In, class Out>
class map_workers {
  using Up = std::remove_reference_t<decltype(std::declval<const Puller&>().upstream())>;
  static constexpr bool resumable = resumable_source<Up>;
  static constexpr std::uint64_t none = std::numeric_limits<std::uint64_t>::max();
  static constexpr int spin_rounds = 64;
  using clock = std::chrono::steady_clock;
  static constexpr std::chrono::milliseconds tune_poll{20};  // while the consumer waits
  // A run should take long enough to amortise a thread sleep and wake (tens of us on a VM).
  static constexpr double target_run_seconds = 200e-6;

  using slot = typename map_queue<Out>::slot;
  struct core {
    core(Puller p, F f, observe::stage_counters* s) : pull(p), fn(std::move(f)), stats(s) {}
    Puller pull;
    F fn;
    observe::stage_counters* stats;
    std::mutex pull_m;  // serialises upstream next(); taken before m
    std::mutex m;
    std::condition_variable space, ready;
    std::condition_variable park;          // autotune: workers numbered >= active wait here
    std::atomic<std::size_t> active{0};    // workers that may claim runs (changed under m)
    std::atomic<std::uint64_t> room_wait_ns{0};  // workers' total wait for room (autotune)
    map_ring<Out> ring;    // ordered
    map_queue<Out> queue;  // unordered
    std::deque<std::pair<std::uint64_t, pipeline_state>> anchors;  // upstream state before seq
    // next_out: elements the consumer has taken from the ring (published runs) or from done
    // (into its local queue); handed: elements it has handed out (what bounds the read-ahead).
    std::uint64_t next_pull = 0, next_out = 0, end_seq = none;
    std::atomic<std::uint64_t> handed{0};  // written by the consumer without the lock
    bool ended = false, stop = false;
    std::exception_ptr failure;  // a worker failed outside fn and upstream (out of memory)
    int workers_alive = 0;       // workers that may still publish
    int consumer_waiting = 0;                // notify only when someone sleeps
    std::atomic<int> workers_waiting{0};
    std::atomic<std::uint64_t> published{0};  // runs published by workers (for spinning)
    std::uint64_t next_out_seen = 0;           // consumer's last view of `published`
  };

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
    return o_.ordered ? c_->ring.next(*this, base) : c_->queue.next(*this, base);
  }

  // Ordered: the next element handed to sink where it lies in the ring. False at the end.
  template <class Sink>
  bool next_into(Sink& sink, std::uint64_t base) {
    if (!started_) start();
    return c_->ring.next_into(*this, sink, base);
  }

  // Moves runs of ready elements straight into `out`; an element whose fn threw throws
  // exactly as out.size() next() calls would.
  std::size_t bulk(std::span<Out> out, std::uint64_t base) {
    if (!started_) start();
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
    std::lock_guard lk(c_->m);
    const std::uint64_t target = c_->handed;
    const auto& a = c_->anchors;
    auto it = std::find_if(a.rbegin(), a.rend(), [&](const auto& p) { return p.first <= target; });
    if (it != a.rend()) {
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
  }

  // halt(), and a new epoch: what was read ahead goes.
  void reset() noexcept {
    halt();
    c_->ring.clear();
    c_->queue.clear();
    c_->anchors.clear();
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
        threads_.emplace_back([c = c_.get(), o = o_, i] { work(*c, o, i); });
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

  static void work(core& c, const map_machine_options o, std::size_t index) {
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

  static void work_loop(core& c, const map_machine_options o, const std::size_t index) {
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
          ++c.workers_waiting;  // before the re-check in wait(): see hand_out()
          c.space.wait(lk, room);
          --c.workers_waiting;
          c.room_wait_ns.fetch_add(
              std::uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - r0).count()));
          wt.stop(c.stats->wait_down, "map: wait downstream", /*shared=*/true);
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
              c.pull.upstream().save(w);
              anchors.emplace_back(first + k, std::move(st));
            }
          }
          std::optional<In> e = c.pull();
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
        auto apply = [&] { return std::invoke(c.fn, std::move(ins[i])); };
        if (o.ordered) {
          c.ring.make(at, apply);
          if (++at == window) at = 0;
        } else {
          map_queue<Out>::make(outs[i], apply);
        }
        if (timed) {
          const observe::ticks t1 = observe::now();
          c.stats->work.add_shared(t1 - t0);
          if (observe::tracing()) observe::record("map: fn", t0, t1);
        }
      }
      if (got) {  // adapt the run length toward ~200 us of fn time
        const double per = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count() / static_cast<double>(got);
        const double ideal = per > 0 ? target_run_seconds / per : double(run_cap);
        run = std::clamp<std::uint64_t>(ideal >= double(run_cap) ? run_cap : std::uint64_t(ideal), 1, run_cap);
      }
      const std::uint64_t made = got + (uerr ? 1 : 0);  // an upstream error holds a place
      if (uerr) {  // no reference stays here: the consumer takes the last
        if (o.ordered)
          c.ring.upstream_error(at, std::move(uerr));
        else
          map_queue<Out>::upstream_error(outs[got], std::move(uerr));
      }
      bool wake_consumer;
      {
        std::lock_guard lk(c.m);
        if (o.ordered)
          c.ring.publish(first, made);
        else
          c.queue.publish(first, outs);
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

  std::unique_ptr<core> c_;
  map_machine_options o_;
  std::vector<std::thread> threads_;
  bool started_ = false;
  bool tuned_ = false;      // workers = autotune
  map_tuner tu_;
};

}  // namespace ferry::detail
