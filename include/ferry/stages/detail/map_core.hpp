// ferry/stages/detail/map_core.hpp: the block map's workers and its consumer share
// (map_workers.hpp holds the consumer's side), and the workers' side: the loop each worker
// thread runs. map_workers.hpp says how the machine works as a whole.
//
// Threads: work() is a worker thread's body: it pulls runs of upstream elements (under
// pull_m), runs fn on them outside any lock, and publishes them (under m) into the ordered
// ring or the unordered queue. No exception leaves it: one from outside fn and the
// upstream (std::bad_alloc) becomes the epoch's last error, for the consumer.
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
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/detail/deferred_frees.hpp"
#include "ferry/detail/holds_ahead.hpp"
#include "ferry/observe/hooks.hpp"
#include "ferry/source.hpp"
#include "ferry/stages/detail/map_queue.hpp"
#include "ferry/stages/detail/map_ring.hpp"
#include "ferry/state.hpp"

namespace ferry::detail {

// What the machine runs with, resolved by map.hpp from the user's map_options.
struct map_machine_options {
  std::size_t workers = 2;  // threads
  bool ordered = true;      // the ring, or the queue
  std::size_t window = 16;  // elements read ahead of the consumer
};

// What map's workers and its consumer share (the machine's heap block), and the workers'
// loop. Puller, F, In, Out: as map_workers'.
template <class Puller, class F, class In, class Out>
struct map_core {
  using Up = std::remove_reference_t<decltype(std::declval<const Puller&>().upstream())>;
  static constexpr bool resumable = resumable_source<Up>;
  static constexpr std::uint64_t none = std::numeric_limits<std::uint64_t>::max();
  using clock = std::chrono::steady_clock;
  // A run should take long enough to amortise a thread sleep and wake (tens of us on a VM).
  static constexpr double target_run_seconds = 200e-6;
  using slot = typename map_queue<Out>::slot;

  map_core(Puller p, F f, observe::stage_counters* s) : pull(p), fn(std::move(f)), stats(s) {}
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
  // An anchor the upstream refused to save (an unordered map, a prefetch after an error):
  // no more anchors this epoch, and save_position() throws it. Never an element's error:
  // the pull after it goes on. Written and read under pull_m.
  std::exception_ptr anchor_error;
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
  deferred_pinned_list deferred;  // pinned blocks the workers let go (deferred_frees.hpp)
  std::uint64_t next_out_seen = 0;           // consumer's last view of `published`

static void work(map_core& c, const map_machine_options o, std::size_t index) {
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

static void work_loop(map_core& c, const map_machine_options o, const std::size_t index) {
  observe::name_this_thread("ferry map worker");
  pinned_frees_to = &c.deferred;  // this thread must not wait for the device (deferred_frees.hpp)
  const holding_ahead holds("ferry map worker");  // it holds what it pulls (holds_ahead.hpp)
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
          if (o.ordered && (first + k) % window == 0 && !c.anchor_error) {
            try {
              pipeline_state st;
              state_writer w(st);
              c.pull.upstream().save(w);
              anchors.emplace_back(first + k, std::move(st));
            } catch (...) {
              c.anchor_error = std::current_exception();
            }
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
      auto apply = [&] {
        const in_user_code<Out> user;  // fn may build a device pipeline of its own (holds_ahead.hpp)
        return std::invoke(c.fn, std::move(ins[i]));
      };
      bool made_ok;
      if (o.ordered) {
        made_ok = c.ring.make(at, apply);
        if (++at == window) at = 0;
      } else {
        made_ok = map_queue<Out>::make(outs[i], apply);
      }
      if (timed) {
        const observe::ticks t1 = observe::now();
        c.stats->work.add_shared(t1 - t0);
        if (observe::tracing()) observe::record("map: fn", t0, t1, !made_ok);
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
};

}  // namespace ferry::detail
