// ferry/stages/detail/interleave_files_read.hpp: the reading side of interleave's
// file-level machine (interleave_files.hpp declares it and documents the whole): a slot's
// records read into a run, errors and skips at their place, the consumer's take of a
// slot's runs, the reader threads' loop, and starting and stopping them. Included at the end of interleave_files.hpp.
//
// Threads: worker() is a reader thread's body; produce() runs there, or on the thread
// calling next() with workers = 0. start_threads() and stop_threads() run on the thread
// calling next(), rewind(), restore_state(), a move or the destructor.
#pragma once

#include "ferry/stages/detail/interleave_files.hpp"

namespace ferry {
namespace detail {

template <class Up>
template <class Enough>
void interleave_files_source<Up>::produce(slot& s, run& r, std::size_t max_items, std::size_t max_bytes, const Enough& enough) {
  const from_files_options& opt = this->up().options();
  file_reader& rd = *s.reader;
  for (;;) {
    if (!rd.is_open()) {
      if (s.at.ord >= s.files.size()) {
        r.end = true;
        r.after = s.at;
        return;
      }
      try {
        std::optional<array_meta> first = layout();
        rd.open(s.files[s.at.ord], first);
        if (s.pending) rd.seek(s.pending->offset, s.pending->rec);
        s.pending.reset();
      } catch (...) {
        rd.close();  // seek may have thrown with the file open
        s.pending.reset();
        s.at = pos{s.at.ord + 1, false, 0, 0};
        if (failed(s, r, std::current_exception())) return;
        continue;
      }
    }
    skipped_record bad;
    frame_status st;
    try {
      st = rd.next_with(bad, [&](const std::shared_ptr<chunk>& c, std::span<const std::byte> bytes,
                                 std::uint64_t offset, std::uint32_t head) {
        if (r.owners.empty() || r.owners.back() != c) r.owners.push_back(c);
        r.items.push_back(item{bytes, offset, s.at.ord, 0, 0, head, static_cast<std::uint32_t>(r.owners.size() - 1)});
      });
    } catch (...) {
      // The framing is lost (or, for anything but a ferry error, cannot be trusted):
      // the rest of this file is, as in from_files.
      rd.close();
      s.at = pos{s.at.ord + 1, false, 0, 0};
      if (failed(s, r, std::current_exception())) return;
      continue;
    }
    if (st == frame_status::end) {
      rd.close();
      s.at = pos{s.at.ord + 1, false, 0, 0};
      continue;
    }
    s.at = pos{s.at.ord, true, rd.offset(), rd.records()};
    if (st == frame_status::record) {
      item& it = r.items.back();
      it.after_offset = s.at.offset;
      it.after_rec = s.at.rec;
      r.bytes += it.bytes.size();
      if (r.items.size() >= max_items || r.bytes >= max_bytes || enough()) return;
      continue;
    }
    if (opt.on_error == error_policy::raise) {
      r.err = std::make_exception_ptr(format_error(bad.path, bad.offset, bad.reason));
      r.after = s.at;
      return;
    }
    if (note_skip(s, r, bad)) return;
  }
}

template <class Up>
bool interleave_files_source<Up>::failed(slot& s, run& r, std::exception_ptr err) {
  if (this->up().options().on_error == error_policy::skip) {
    try {
      std::rethrow_exception(err);
    } catch (const ferry::error& e) {
      return note_skip(s, r, describe(e));
    } catch (...) {  // not a format or I/O error: never skipped, as in from_files
    }
  }
  r.err = std::move(err);
  r.after = s.at;
  return true;
}

template <class Up>
bool interleave_files_source<Up>::note_skip(slot& s, run& r, const skipped_record& bad) {
  {
    std::lock_guard lk(m_);
    ++s.skipped;
  }
  try {
    log_skip(this->up().options(), bad);
  } catch (...) {
    r.err = std::current_exception();
    r.after = s.at;
    return true;
  }
  return false;
}

template <class Up>
auto interleave_files_source<Up>::front(std::size_t i, std::size_t want) -> run& {
  slot& s = slots_[i];
  if (o_.workers == 0) {
    if (s.own.taken == s.own.items.size() && !s.own.err && !s.own.end) {
      s.own.clear(/*keep_owner=*/true);
      produce(s, s.own, want, std::size_t(-1), [] { return false; });
    }
    return s.own;
  }
  if (!s.local.empty()) return s.local.front();
  std::unique_lock lk(m_);
  try {
    for (run& r : s.spent)
      if (s.free.size() < 4) s.free.push_back(std::move(r));
  } catch (...) {  // only recycling: dropping them instead is fine
  }
  s.spent.clear();
  if (s.q.empty()) {  // the consumer waits for the readers
    observe::wait_timer wt;
    wt.start();
    waiting_since_.store(std::chrono::steady_clock::now().time_since_epoch().count(), std::memory_order_relaxed);
    waiting_for_.store(i, std::memory_order_release);  // after waiting_since_: its reader publishes soon
    ++consumer_waiting_;
    not_empty_.wait(lk, [&] { return !s.q.empty() || s.broken; });
    --consumer_waiting_;
    waiting_for_.store(no_slot, std::memory_order_relaxed);
    wt.stop(this->stats().wait_up, "interleave: wait upstream");
    if (s.q.empty()) std::rethrow_exception(s.broken);  // until rewind()
  }
  s.local.swap(s.q);  // s.local was empty: s.q is now
  s.q_items = s.q_bytes = 0;
  // Only slot i's reader can use the room: the others sleep on.
  reader_wait& rw = readers_[i % threads_count_];
  const bool wake = rw.waiting;
  lk.unlock();
  if (wake) rw.cv.notify_one();
  return s.local.front();
}

template <class Up>
void interleave_files_source<Up>::pop(slot& s) {
  if (o_.workers == 0) return;  // front() reads into it again
  run& r = s.local.front();
  r.clear();
  try {
    if (s.spent.size() < 4) s.spent.push_back(std::move(r));
  } catch (...) {  // only recycling: dropping it instead is fine
  }
  s.local.pop_front();
}

template <class Up>
void interleave_files_source<Up>::worker(std::size_t t) {
  observe::name_this_thread("ferry interleave reader");
  detail::pinned_frees_to = &deferred_;  // this thread must not wait for the device (deferred_frees.hpp)
  const std::size_t w = threads_count_;
  const std::size_t cap = std::max<std::size_t>(o_.buffer, 1), byte_cap = 4 * pool_->chunk_bytes();
  const std::size_t soon = std::max<std::size_t>(cap / 2, 1);
  for (;;) {
    std::size_t pick = slots_.size(), want = 0, bytes_left = 0;
    run r;
    {
      std::unique_lock lk(m_);
      auto room = [&] {
        if (stop_.load(std::memory_order_relaxed)) return true;
        for (std::size_t s = t; s < slots_.size(); s += w)
          if (has_room(slots_[s])) return true;
        return false;
      };
      if (!room()) {  // every slot of this reader is full: the consumer is slower
        observe::wait_timer wt;
        wt.start();
        readers_[t].waiting = true;
        readers_[t].cv.wait(lk, room);
        readers_[t].waiting = false;
        wt.stop(this->stats().wait_down, "interleave: wait downstream", /*shared=*/true);
      }
      if (stop_.load(std::memory_order_relaxed)) return;
      // The slot the consumer waits on, else the one with the fewest buffered records:
      // the consumer needs them in turn.
      if (const std::size_t wf = waiting_for_.load(std::memory_order_relaxed);
          wf != no_slot && wf % w == t && has_room(slots_[wf]))
        pick = wf;
      else
        for (std::size_t s = t; s < slots_.size(); s += w)
          if (has_room(slots_[s]) && (pick == slots_.size() || slots_[s].q_items < slots_[pick].q_items)) pick = s;
      want = cap - slots_[pick].q_items;
      bytes_left = byte_cap > slots_[pick].q_bytes ? byte_cap - slots_[pick].q_bytes : 1;
      if (!slots_[pick].free.empty()) {
        r = std::move(slots_[pick].free.back());
        slots_[pick].free.pop_back();
      }
    }
    slot& s = slots_[pick];
    const bool timed = observe::on();
    const observe::ticks t0 = timed ? observe::now() : 0;
    try {
      produce(s, r, want, bytes_left, [&] {
        if (stop_.load(std::memory_order_relaxed)) return true;
        const std::size_t wf = waiting_for_.load(std::memory_order_acquire);
        if (wf == no_slot) return false;
        // The consumer waits on another of this reader's slots: a slow file here must
        // not hold it back.
        if (wf != pick) return wf % w == t;
        // It waits on this one: a run of `soon` records, or what was read by 50 us into
        // its wait (a slow file, a pipe). Publishing each record at once would wake it
        // per record when it is faster than the reader.
        if (r.items.size() >= soon) return true;
        const auto since = std::chrono::steady_clock::duration(waiting_since_.load(std::memory_order_relaxed));
        return std::chrono::steady_clock::now().time_since_epoch() - since >= std::chrono::microseconds(50);
      });
    } catch (...) {  // holding what was read failed (std::bad_alloc): the consumer gets that
      r.err = std::current_exception();
      r.after = s.at;
    }
    if (timed) {
      const observe::ticks t1 = observe::now();
      this->stats().work.add_shared(t1 - t0);
      if (observe::tracing()) observe::record("interleave: read", t0, t1, r.err != nullptr);
    }
    bool wake;
    {
      std::lock_guard lk(m_);
      try {
        const std::size_t items = r.items.size(), bytes = r.bytes;
        const bool end = r.end;
        s.q.push_back(std::move(r));
        s.q_items += items;
        s.q_bytes += bytes;
        if (end) s.producing_done = true;
      } catch (...) {  // the run lost: the slot stops rather than skip it silently
        s.broken = std::current_exception();
      }
      // The consumer has what it waited for: publish in full runs again until it next
      // waits (it may take a while to be scheduled).
      if (waiting_for_.load(std::memory_order_relaxed) == pick) waiting_for_.store(no_slot, std::memory_order_relaxed);
      wake = consumer_waiting_ > 0;
    }
    if (wake) not_empty_.notify_all();
  }
}

template <class Up>
void interleave_files_source<Up>::start_threads() {
  const std::size_t n = std::min(o_.workers, slots_.size());
  auto readers = std::make_unique<reader_wait[]>(n);
  threads_.reserve(n);
  stop_.store(false, std::memory_order_relaxed);
  readers_ = std::move(readers);
  threads_count_ = n;  // the readers index slots by it, and stop_threads() wakes that many
  try {
    for (std::size_t t = 0; t < n; ++t) threads_.emplace_back([this, t] { worker(t); });
  } catch (const std::system_error& e) {  // no thread to be had: said by the stage's name
    const std::size_t made = threads_.size();
    stop_threads();
    throw error("interleave: could not start reader thread " + std::to_string(made + 1) + " of " +
                std::to_string(n) + ": " + e.what());
  } catch (...) {
    stop_threads();
    throw;
  }
}

template <class Up>
void interleave_files_source<Up>::stop_threads() noexcept {
  {
    std::lock_guard lk(m_);
    stop_.store(true, std::memory_order_relaxed);
  }
  for (std::size_t t = 0; t < threads_count_; ++t) readers_[t].cv.notify_one();
  for (auto& th : threads_) th.join();
  threads_.clear();
  detail::hand_up(deferred_);  // pinned blocks they let go (read-ahead's, handed up to them)
  // Lowered again: with workers = 0 no start_threads() would, and the consumer's own reads
  // (which share the flag as their cancel) would be cancelled at their first wait on a pipe.
  stop_.store(false, std::memory_order_relaxed);
  // Entries read ahead are dropped; producers restart from the consumed positions.
  for (slot& s : slots_) {
    s.q.clear();
    s.local.clear();
    s.spent.clear();
    s.free.clear();
    s.own = run{};
    s.q_items = s.q_bytes = 0;
    s.broken = nullptr;
    if (s.reader) s.reader->close();
    s.at = s.consumed;
    s.producing_done = !s.active;
    if (s.consumed.open) s.pending = s.consumed;
    else s.pending.reset();
  }
}

}  // namespace detail
}  // namespace ferry
