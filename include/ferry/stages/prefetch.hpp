// ferry/stages/prefetch.hpp: prefetch(depth) runs the upstream pipeline on its own thread,
// keeping up to `depth` elements (usually batches) ready for the consumer.
//
//   ... | ferry::batch(256) | ferry::prefetch(2)
//
// Threads: one producer thread, started by the first next(); everything upstream (sources,
// filter and batch, user functions of stages without their own threads) runs on it.
// Memory: at most depth + 2 elements alive (depth queued, one being built, one held by
// the consumer).
// Errors: an exception thrown upstream is re-thrown, unchanged, by the consumer's next()
// at its place, after the elements produced before it; the producer goes on, so the next
// next() gives what upstream gives after the error (as without prefetch: a consumer that
// catches and goes on loses nothing prefetch held). A std::bad_alloc from queueing an
// element on the producer thread ends the epoch instead (that element is lost).
// Shutdown: the destructor (and rewind()) stops the producer and joins it at once, even
// mid-epoch; it waits only for an upstream next() call already in progress.
// Checkpoints: save() records the upstream position after the last element handed to the
// consumer (captured by the producer with each element), so queued elements are re-read
// after restore, never stored.
// Throws config_error for depth == 0.
#pragma once

#include <concepts>
#include <cstddef>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ferry/detail/producer_state.hpp"
#include "ferry/detail/spin.hpp"
#include "ferry/error.hpp"
#include "ferry/memory/buffer.hpp"
#include "ferry/observe/hooks.hpp"
#include "ferry/source.hpp"

namespace ferry {
namespace detail {

template <source Up>
class prefetch_source : public source_interface<prefetch_source<Up>> {
  using T = value_t<Up>;
  static constexpr bool resumable = resumable_source<Up>;
  static constexpr int spin_iterations = 2000;  // a few microseconds of pause

  struct item {
    std::optional<T> value;
    std::exception_ptr error;
    pipeline_state state;  // upstream position after `value` or `error` (resumable upstreams only)
    bool has_state = false;
  };
  // Heap-allocated so the pipeline object can move while the thread runs.
  struct core {
    core(Up u, std::size_t d) : up(std::move(u)), depth(d) {}
    Up up;
    std::size_t depth;
    std::mutex m;
    std::condition_variable not_empty, not_full;
    std::deque<item> q;
    std::atomic<std::size_t> queued{0};  // q.size(), readable without the lock
    bool stop = false;
    std::exception_ptr failure;  // queueing itself failed (out of memory): ends the epoch
    std::string save_error;  // why the upstream cannot be saved (written once, under m)
    observe::stage_counters stats;
    [[no_unique_address]] observe::upstream_probe<Up> probe;
  };

 public:
  using value_type = T;

  prefetch_source(Up up, std::size_t depth)
      : c_(std::make_unique<core>(std::move(up), depth)) {}
  prefetch_source(prefetch_source&&) noexcept = default;
  prefetch_source& operator=(prefetch_source&& o) noexcept {
    if (this != &o) {
      halt();
      c_ = std::move(o.c_);
      th_ = std::move(o.th_);
      started_ = o.started_;
      finished_ = o.finished_;
      last_ = std::move(o.last_);
    }
    return *this;
  }
  ~prefetch_source() { halt(); }

  std::optional<T> next() {
    return observe::observed_next(c_->stats, "prefetch", [&] { return next_impl(); });
  }
  void visit_stages(observe::stage_visitor& v) const {
    c_->probe.visit(c_->up, v);
    v.add("prefetch", c_->stats, observe::stage_mode::threaded_stage, 1);
  }

 private:
  std::optional<T> next_impl() {
    if (finished_) return std::nullopt;
    if (!started_) start();
    item it;
    std::exception_ptr failed;
    observe::wait_timer wt;  // the consumer waits on an empty queue: upstream is slower
    if (c_->queued.load(std::memory_order_acquire) == 0) wt.start();
    // A short spin before sleeping: when the producer is about to deliver, a futex
    // sleep and wake would cost more than the wait itself (microseconds per batch).
    for (int i = 0; i < spin_iterations && c_->queued.load(std::memory_order_acquire) == 0; ++i)
      detail::cpu_relax();
    {
      std::unique_lock lk(c_->m);
      c_->not_empty.wait(lk, [&] { return !c_->q.empty() || c_->failure; });
      if (!c_->q.empty()) {
        it = std::move(c_->q.front());
        c_->q.pop_front();
        c_->queued.store(c_->q.size(), std::memory_order_release);
      } else {
        failed = std::exchange(c_->failure, nullptr);
      }
    }
    wt.stop(c_->stats.wait_up, "prefetch: wait upstream");
    c_->not_full.notify_one();
    if (failed) {  // the producer could not queue (out of memory): it has stopped
      finished_ = true;
      halt();
      std::rethrow_exception(failed);
    }
    if (it.error) {  // in place; the producer goes on after it
      if constexpr (resumable)
        if (it.has_state) last_ = std::move(it.state);
      std::rethrow_exception(it.error);
    }
    if (!it.value) {
      finished_ = true;
      halt();
      if constexpr (resumable) last_ = std::move(it.state);
      return std::nullopt;
    }
    if constexpr (resumable) last_ = std::move(it.state);
    return std::move(it.value);
  }

 public:
  void rewind()
    requires rewindable_source<Up>
  {
    halt();
    c_->q.clear();
    c_->queued = 0;
    c_->failure = nullptr;
    c_->stop = false;
    started_ = finished_ = false;
    c_->up.rewind();
  }
  void save(state_writer& w) const
    requires resumable
  {
    if (started_) {
      std::lock_guard lk(c_->m);
      if (!c_->save_error.empty()) throw config_error(c_->save_error);
      w.put_words(last_.words);
    } else
      c_->up.save(w);
    w.tag("prefetch");
  }
  void restore(state_reader& r)
    requires resumable
  {
    if (started_) throw config_error("prefetch: restore_state must come before the first next()");
    c_->up.restore(r);
    r.expect("prefetch");
  }
  // batch()'s size, passed on for distribute() (batches go through unchanged).
  std::size_t batch_size() const requires sized_batches<Up> { return c_->up.batch_size(); }
  bool set_buffer_resource(const std::shared_ptr<std::pmr::memory_resource>& r) {
    return forward_buffer_resource(c_->up, r);
  }

 private:
  void start() {
    if constexpr (resumable) {
      last_.words.clear();
      state_writer w(last_);
      c_->up.save(w);
    }
    started_ = true;
    th_ = std::thread([c = c_.get()] { produce(*c); });
  }

  static void produce(core& c) {
    observe::name_this_thread("ferry prefetch");
    for (;;) {
      item it;
      try {
        it.value = c.probe.pull(c.up);
      } catch (...) {
        it.error = std::current_exception();
      }
      if constexpr (resumable) save_after_pull(c.up, it.state, it.has_state, it.error, c.save_error, c.m);
      bool last = !it.error && !it.value;  // the end; after an error upstream goes on
      {
        std::unique_lock lk(c.m);
        auto room = [&] { return c.stop || c.q.size() < c.depth; };
        if (!room()) {  // the queue is full: the consumer is slower
          observe::wait_timer wt;
          wt.start();
          c.not_full.wait(lk, room);
          wt.stop(c.stats.wait_down, "prefetch: wait downstream");
        }
        if (c.stop) return;
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

  void halt() noexcept {
    if (!c_) return;
    {
      std::lock_guard lk(c_->m);
      c_->stop = true;
    }
    c_->not_full.notify_all();
    if (th_.joinable()) th_.join();
  }

  std::unique_ptr<core> c_;
  std::thread th_;
  bool started_ = false;
  bool finished_ = false;
  pipeline_state last_;  // upstream position after the last element handed out
};

}  // namespace detail

struct prefetch_t {
  template <source S>
  auto operator()(S&& s, std::size_t depth) const {
    detail::require_rvalue_source<S>();
    check(depth);
    return detail::prefetch_source<std::remove_cvref_t<S>>(std::forward<S>(s), depth);
  }
  auto operator()(std::size_t depth) const {
    check(depth);
    return make_closure([depth]<class S>(S&& s) { return prefetch_t{}(std::forward<S>(s), depth); });
  }

 private:
  static void check(std::size_t depth) {
    if (depth == 0)
      throw config_error("prefetch: depth must be at least 1 (got 0); drop the stage to run inline");
  }
};
inline constexpr prefetch_t prefetch{};

}  // namespace ferry
