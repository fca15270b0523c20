// ferry/detail/producer.hpp: the one producer engine behind every stage that makes
// elements on a thread of its own (prefetch, distribute's staging thread): a thread that
// calls make() until the end of the epoch and queues what it makes, at most `depth` ahead
// of the consumer.
//
// - Started by start() (the stage calls it at its first pull); halt() stops and joins it
//   at once, waiting only for a make() in progress; the destructor halts. rewind() and
//   restore() of the stage halt, then start again at the next pull.
// - Errors keep their place: an exception from make() is queued as that item and re-thrown
//   by the consumer's take() after the items before it; the thread goes on. An exception
//   of the engine's own (std::bad_alloc queueing an item) ends the epoch after the queue.
// - Positions: with a saver, the thread records the upstream's state after each make(),
//   and take() keeps the one of the last item handed out (position()): a checkpoint then
//   re-reads what was queued, never stores it. An upstream that cannot be saved (a
//   config_error from save: an unordered map) still flows; save_error() says why.
// - Moves are safe mid-epoch: the queue and the thread's state live in a heap block;
//   make() and the saver must refer to what does not move (the stage's heap block).
//   Move assignment halts the thread being replaced first.
// - The producer sleeps when the queue is full until the consumer has taken it down to
//   `refill_at` items (depth - 1: any room; depth / 2: woken once per half queue, not per
//   item, for a consumer whose every futex wake-up counts); the consumer spins briefly
//   before it sleeps on an empty queue (a futex sleep and wake would cost more than a wait
//   of a few microseconds), unless set_spin(0) says items are slow to make.
// - Waits are counted in the stage's counters when stats are on: the consumer's in
//   wait_up, the producer's in wait_down (of the counters the stage passes).
// - The thread must not wait for the device: pinned blocks it lets go are handed up by the
//   consumer's take() and halt(): freed there, or passed to the consumer's own consumer when
//   it is one of ferry's threads too (ferry/detail/deferred_frees.hpp).
// Runs make() (and through it the upstream's user code) on the producer thread. Throws
// from start() what starting a thread throws (none is left running then).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>

#include "ferry/detail/deferred_frees.hpp"
#include "ferry/detail/holds_ahead.hpp"
#include "ferry/detail/spin.hpp"
#include "ferry/error.hpp"
#include "ferry/observe/hooks.hpp"
#include "ferry/state.hpp"

namespace ferry::detail {

struct producer_names {
  const char* thread;         // "ferry prefetch"
  const char* consumer_wait;  // trace name of the consumer's wait for an item
  const char* producer_wait;  // trace name of the producer's wait for room
};

template <class T>
class producer {
  struct item {
    std::optional<T> value;  // nullopt and no error: the end of the epoch
    std::exception_ptr error;
    pipeline_state state;  // the upstream's position after this item (with a saver)
    bool has_state = false;
  };
  struct core {
    std::mutex m;
    std::condition_variable not_empty, not_full;
    std::deque<item> q;
    std::atomic<std::size_t> queued{0};  // q.size(), readable without the lock
    std::size_t depth = 1, refill_at = 0;
    bool stop = false;
    bool producer_sleeps = false;  // under m: the consumer wakes it once half the queue is free
    std::exception_ptr failure;    // the engine's own failure (queueing): ends the epoch
    std::string save_error;        // why the upstream cannot be saved (written once, under m)
    observe::stage_counters* consumer_stats = nullptr;
    observe::stage_counters* producer_stats = nullptr;
    producer_names names{};
    deferred_pinned_list deferred;  // pinned blocks the thread let go (deferred_frees.hpp)
  };
  static constexpr int default_spin = 2000;  // a few microseconds of pause

 public:
  producer() = default;
  producer(producer&&) noexcept = default;
  producer& operator=(producer&& o) noexcept {
    if (this != &o) {
      halt();
      c_ = std::move(o.c_);
      th_ = std::move(o.th_);
      last_ = std::move(o.last_);
      has_last_ = o.has_last_;
      finished_ = o.finished_;
      spin_ = o.spin_;
    }
    return *this;
  }
  ~producer() { halt(); }

  // How long take() spins on an empty queue before it sleeps (pause instructions): 0 for
  // items that take far longer to make than a sleep and a wake-up (a 1 MiB read), where
  // spinning would only hold a core the producer needs.
  void set_spin(int iterations) noexcept { spin_ = iterations; }

  bool started() const noexcept { return th_.joinable() || finished_; }
  bool finished() const noexcept { return finished_; }

  // Starts the thread. make() returns the next item (nullopt: the end) or throws;
  // save(pipeline_state&) records the upstream's position (pass nullptr for none), here
  // first (the position before the first item) and then after each item. The counters
  // passed must outlive the producer (the stage's heap block).
  template <class Make, class Save>
  void start(std::size_t depth, std::size_t refill_at, producer_names names, observe::stage_counters* consumer_stats,
             observe::stage_counters* producer_stats, Make make, Save save) {
    halt();
    if (!c_) c_ = std::make_unique<core>();
    core& c = *c_;
    c.q.clear();
    c.queued.store(0, std::memory_order_relaxed);
    c.depth = depth ? depth : 1;
    c.refill_at = refill_at < c.depth ? refill_at : c.depth - 1;
    c.stop = false;
    c.producer_sleeps = false;
    c.failure = nullptr;
    c.consumer_stats = consumer_stats;
    c.producer_stats = producer_stats;
    c.names = names;
    finished_ = false;
    if constexpr (!std::is_null_pointer_v<Save>) {  // the position before the first item
      save(last_);
      has_last_ = true;
    }
    try {
      th_ = std::thread([p = c_.get(), make = std::move(make), save = std::move(save)]() mutable {
        run(*p, make, save);
      });
    } catch (const std::exception& e) {  // no thread to be had: said by the stage's name
      throw error(std::string(names.thread) + ": could not start its thread: " + e.what());
    }
  }

  // The next item: waits for it; re-throws its error at its place. nullopt at the end
  // (the thread has ended then). Consumer's thread.
  std::optional<T> take() {
    if (finished_) return std::nullopt;
    core& c = *c_;
    hand_up(c.deferred);  // pinned blocks the thread let go (deferred_frees.hpp)
    item it;
    std::exception_ptr failed;
    observe::wait_timer wt;  // an empty queue: the producer is slower
    if (c.queued.load(std::memory_order_acquire) == 0) {
      wt.start();
      for (int i = 0; i < spin_ && c.queued.load(std::memory_order_acquire) == 0; ++i) cpu_relax();
    }
    bool wake = false;
    {
      std::unique_lock lk(c.m);
      c.not_empty.wait(lk, [&] { return !c.q.empty() || c.failure; });
      if (!c.q.empty()) {
        it = std::move(c.q.front());
        c.q.pop_front();
        c.queued.store(c.q.size(), std::memory_order_release);
        if (c.producer_sleeps && c.q.size() <= c.refill_at) {
          c.producer_sleeps = false;
          wake = true;
        }
      } else {
        failed = std::exchange(c.failure, nullptr);
      }
    }
    if (wake) c.not_full.notify_one();
    if (c.consumer_stats) wt.stop(c.consumer_stats->wait_up, c.names.consumer_wait);
    if (failed) {  // the producer could not queue (out of memory): it has stopped
      finished_ = true;
      halt();
      std::rethrow_exception(failed);
    }
    if (it.has_state) {
      last_ = std::move(it.state);
      has_last_ = true;
    }
    if (it.error) std::rethrow_exception(it.error);  // in place; the producer goes on after it
    if (!it.value) {
      finished_ = true;
      halt();
    }
    return std::move(it.value);
  }

  // Stops the thread and joins it; drops what was queued. Never throws.
  void halt() noexcept {
    if (!c_ || !th_.joinable()) return;
    {
      std::lock_guard lk(c_->m);
      c_->stop = true;
    }
    c_->not_full.notify_all();
    th_.join();
    c_->q.clear();
    c_->queued.store(0, std::memory_order_relaxed);
    hand_up(c_->deferred);  // what the thread let go after the consumer's last take()
  }
  // halt(), and forget the epoch: the next start() begins afresh.
  void reset() noexcept {
    halt();
    finished_ = false;
    has_last_ = false;
    last_.words.clear();
  }

  // The upstream's position after the last item handed out (with a saver), if any item
  // was; set_position() gives the one before the first.
  bool has_position() const noexcept { return has_last_; }
  const pipeline_state& position() const noexcept { return last_; }
  void set_position(pipeline_state s) {
    last_ = std::move(s);
    has_last_ = true;
  }
  // Why the upstream cannot be saved (empty: it can). Any thread.
  std::string save_error() const {
    if (!c_) return {};
    std::lock_guard lk(c_->m);
    return c_->save_error;
  }

 private:
  template <class Make, class Save>
  static void run(core& c, Make& make, Save& save) {
    observe::name_this_thread(c.names.thread);
    pinned_frees_to = &c.deferred;  // this thread must not wait for the device (deferred_frees.hpp)
    const holding_ahead holds(c.names.thread);  // it holds what it pulls (holds_ahead.hpp)
    for (;;) {
      item it;
      try {
        it.value = make();
      } catch (...) {
        it.error = std::current_exception();
      }
      if constexpr (!std::is_null_pointer_v<Save>) record_position(c, save, it);
      bool last = !it.error && !it.value;  // the end; after an error the upstream goes on
      {
        std::unique_lock lk(c.m);
        if (!c.stop && c.q.size() >= c.depth) {  // full: the consumer is slower
          observe::wait_timer wt;
          wt.start();
          c.producer_sleeps = true;
          c.not_full.wait(lk, [&] { return c.stop || !c.producer_sleeps; });
          c.producer_sleeps = false;
          // Shared: interleave's slot threads all count into their stage's counters.
          if (c.producer_stats) wt.stop(c.producer_stats->wait_down, c.names.producer_wait, /*shared=*/true);
        }
        if (c.stop) return;  // `it` goes here (a made step's blocks go back)
        try {
          c.q.push_back(std::move(it));
        } catch (...) {  // out of memory for the queue: the consumer gets it after the queue
          c.failure = std::current_exception();
          last = true;
        }
        c.queued.store(c.q.size(), std::memory_order_release);
      }
      c.not_empty.notify_one();
      if (last) return;
    }
  }

  // The upstream's position after the item. An upstream that cannot be saved at all
  // (config_error) is noted once and the data still flows; any other failure (no memory
  // to say it; an upstream that cannot say where it is after its error, such as zip)
  // becomes the item's error when it has none, and the position before stands.
  template <class Save>
  static void record_position(core& c, Save& save, item& it) noexcept {
    if (!c.save_error.empty()) return;  // written only by this thread
    try {
      save(it.state);
      it.has_state = true;
    } catch (const config_error& e) {
      try {
        std::lock_guard lk(c.m);
        c.save_error = e.what();
      } catch (...) {  // no memory for the message: the item fails instead
        if (!it.error) it.error = std::current_exception();
      }
    } catch (...) {
      it.state.words.clear();
      if (!it.error) it.error = std::current_exception();
    }
  }

  std::unique_ptr<core> c_;
  std::thread th_;
  pipeline_state last_;
  bool has_last_ = false;
  bool finished_ = false;
  int spin_ = default_spin;
};

}  // namespace ferry::detail
