// ferry/stages/interleave.hpp: interleave(cycle, {.workers, .block}) reads `cycle` files at
// once and interleaves their records, `block` at a time from each, in a fixed order.
//
//   from_files({"shards/*.tfrecord"}, ferry::tfrecord{}) | ferry::shard(n, i)
//     | ferry::interleave(4, {.workers = 4, .block = 16}) | ferry::batch(256)
//
// Only directly after from_files (and shard): it reads the file list itself. Slot s of the
// cycle reads files s, s + cycle, s + 2*cycle, ... back to back; the output takes `block`
// records from slot 0, then slot 1, ..., skipping slots whose files are all read. The
// order depends only on the files and (cycle, block), never on thread timing, so
// save/restore is exact (the state is each slot's file, offset and record count). This
// differs from tf.data, which hands a finished slot the next unread file: that order
// would depend on which slot ends first.
//
// Threads: with .workers = w > 0, w threads read ahead (slot s on thread s % w), each
// slot buffering up to .buffer records (and about 4 read chunks of bytes) while the
// consumer takes the run it collected before (so at most 2 x .buffer per slot): records
// pass between threads in runs, one lock and at most one wake-up per run, not per record,
// and a reader publishes at once when the consumer waits on its slot; with
// .workers = 0 everything runs on the thread calling next(). on_skip runs on the reading
// thread. Errors: as from_files (error_policy raise: the error reaches next() at the
// record's place in the order, skip: counted in skipped()). Anything else thrown while
// reading (on_skip throwing, std::bad_alloc) reaches next() the same way, never
// std::terminate; the slot then goes on with its next file (or, after on_skip, its next
// record). npy/IDX: every file's rows must match those of the first file in the list
// whose header reads, as from_files requires; a file that differs is a format_error
// naming it (offset 0) at its place in the order, whatever the thread timing. The
// destructor and rewind() stop and join the threads at once, even mid-epoch. Throws
// config_error for cycle == 0 or block == 0.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <memory_resource>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ferry/error.hpp"
#include "ferry/observe/hooks.hpp"
#include "ferry/source.hpp"
#include "ferry/sources/from_files.hpp"

namespace ferry {

struct interleave_options {
  std::size_t workers = 2;   // reading threads; 0 reads on the consumer's thread
  std::size_t block = 1;     // records taken from a slot before moving to the next
  std::size_t buffer = 64;   // records each slot may read ahead (workers > 0)
};

namespace detail {

template <class Up>
class interleave_source : public source_interface<interleave_source<Up>> {
  struct pos {
    std::uint64_t ord = 0;  // index into the slot's files
    bool open = false;
    std::uint64_t offset = 0, rec = 0;
  };
  struct entry {
    std::optional<record> rec;
    std::exception_ptr err;
    bool end = false;
    pos after;
  };
  struct slot {
    std::vector<std::string> files;
    std::unique_ptr<file_reader> reader;
    pos at;                       // producer's position
    std::optional<pos> pending;   // a restored position to seek to
    bool producing_done = false;  // producer reached the end
    std::deque<entry> q;          // published by the slot's reader, under m_
    std::size_t q_bytes = 0;
    std::deque<entry> local;      // consumer side: a run taken from q at once, no lock per record
    bool active = true;           // consumer side: not yet ended
    pos consumed;                 // consumer side: after the last record taken
    std::uint64_t skipped = 0;
    std::exception_ptr broken;    // a worker could not queue an entry (std::bad_alloc)
  };

 public:
  using value_type = record;

  interleave_source(Up up, std::size_t cycle, interleave_options o)
      : up_(std::move(up)), cycle_(cycle), o_(o),
        pool_(std::make_shared<chunk_pool>(std::max<std::size_t>(up_.options().chunk_bytes, 64))) {
    reset_slots();
  }
  interleave_source(interleave_source&& other) noexcept(false)
      : up_((other.stop_threads(), std::move(other.up_))), cycle_(other.cycle_), o_(other.o_), pool_(other.pool_) {
    slots_ = std::move(other.slots_);
    layout_ = std::move(other.layout_);
    layout_known_ = other.layout_known_;
    cur_ = other.cur_;
    in_block_ = other.in_block_;
  }
  interleave_source& operator=(interleave_source&&) = delete;
  ~interleave_source() { stop_threads(); }

  std::optional<record> next() {
    return observe::observed_next(stats_, "interleave", [&] { return next_impl(); });
  }
  void visit_stages(observe::stage_visitor& v) const {
    // from_files only lists the files here; interleave does the reading itself.
    if (o_.workers == 0)
      v.add("interleave", stats_, observe::stage_mode::source_stage, 1);
    else
      v.add("interleave", stats_, observe::stage_mode::threaded_stage, std::min(o_.workers, std::max<std::size_t>(slots_.size(), 1)));
  }

 private:
  std::optional<record> next_impl() {
    if (o_.workers > 0 && threads_.empty() && !all_done()) start_threads();
    for (;;) {
      if (all_done()) return std::nullopt;
      slot& s = slots_[cur_];
      entry e = take(cur_);
      if (e.end) {
        s.active = false;
        advance();
        continue;
      }
      s.consumed = e.after;
      if (e.err) std::rethrow_exception(e.err);  // takes no turn: the order matches skip's
      if (++in_block_ >= o_.block) advance();
      return std::move(e.rec);
    }
  }


 public:
  void rewind() {
    stop_threads();
    reset_slots();
  }

  void save(state_writer& w) const {
    w.tag("interleave");
    w.put(hash_files(up_.files()));
    w.put(cycle_);
    w.put(o_.block);
    w.put(cur_);
    w.put(in_block_);
    for (const slot& s : slots_) {
      w.put(s.active);
      w.put(s.consumed.ord);
      w.put(s.consumed.open);
      w.put(s.consumed.offset);
      w.put(s.consumed.rec);
    }
  }
  // Throws config_error for a state from another file list, cycle or block.
  void restore(state_reader& r) {
    r.expect("interleave");
    if (r.get() != hash_files(up_.files()) || r.get() != cycle_ || r.get() != o_.block)
      throw config_error("restore_state: interleave: the state was saved with other files, cycle or block");
    stop_threads();
    reset_slots();
    // Read and check everything before taking any of it: a refused state leaves the stage
    // at the start of the epoch, as reset_slots() made it, never half restored.
    const std::uint64_t cur = r.get(), in_block = r.get();
    if (cur >= slots_.size() && !slots_.empty()) throw config_error("restore_state: interleave: bad slot");
    std::vector<std::pair<bool, pos>> got(slots_.size());
    for (std::size_t j = 0; j < slots_.size(); ++j) {
      got[j].first = r.get() != 0;
      pos& p = got[j].second;
      p.ord = r.get();
      p.open = r.get() != 0;
      p.offset = r.get();
      p.rec = r.get();
      if (p.ord > slots_[j].files.size())
        throw config_error("restore_state: interleave: slot " + std::to_string(j) + " is at file " +
                           std::to_string(p.ord) + " of " + std::to_string(slots_[j].files.size()));
    }
    cur_ = static_cast<std::size_t>(cur);
    in_block_ = static_cast<std::size_t>(in_block);
    for (std::size_t j = 0; j < slots_.size(); ++j) {
      slot& s = slots_[j];
      const pos& p = got[j].second;
      s.active = got[j].first;
      s.consumed = s.at = p;
      s.producing_done = !s.active;
      if (p.open) s.pending = p;
    }
  }
  bool set_buffer_resource(const std::shared_ptr<std::pmr::memory_resource>&) { return false; }

  // Records skipped under error_policy::skip (counted when read, possibly ahead).
  std::uint64_t skipped() const {
    std::lock_guard lk(m_);
    std::uint64_t n = 0;
    for (const slot& s : slots_) n += s.skipped;
    return n;
  }
  const std::vector<std::string>& files() const { return up_.files(); }

 private:
  bool all_done() const {
    for (const slot& s : slots_)
      if (s.active) return false;
    return true;
  }
  void advance() {
    in_block_ = 0;
    for (std::size_t k = 1; k <= slots_.size(); ++k) {
      const std::size_t c = (cur_ + k) % slots_.size();
      if (slots_[c].active) {
        cur_ = c;
        return;
      }
    }
  }
  void reset_slots() {
    slots_.clear();
    const auto& files = up_.files();
    const std::size_t n = std::min(cycle_, files.size());
    slots_.resize(n);
    for (std::size_t j = 0; j < files.size(); ++j) slots_[j % n].files.push_back(files[j]);
    for (slot& s : slots_) s.reader = std::make_unique<file_reader>(up_.format(), up_.options(), pool_);
    cur_ = 0;
    in_block_ = 0;
  }

  // Reads the next entry of slot s (no lock held: only one thread produces for a slot).
  // Whatever reading throws becomes an entry at the slot's place.
  entry produce(slot& s) {
    const from_files_options& opt = up_.options();
    file_reader& rd = *s.reader;
    for (;;) {
      if (!rd.is_open()) {
        if (s.at.ord >= s.files.size()) return entry{std::nullopt, nullptr, true, s.at};
        try {
          std::optional<array_meta> first = layout();
          rd.open(s.files[s.at.ord], first);
          if (s.pending) rd.seek(s.pending->offset, s.pending->rec);
          s.pending.reset();
        } catch (...) {
          rd.close();  // seek may have thrown with the file open
          s.pending.reset();
          s.at = pos{s.at.ord + 1, false, 0, 0};
          if (auto e = failed(s, std::current_exception())) return std::move(*e);
          continue;
        }
      }
      record r;
      skipped_record bad;
      frame_status st;
      try {
        st = rd.next(r, bad);
      } catch (...) {
        // The framing is lost (or, for anything but a ferry error, cannot be trusted):
        // the rest of this file is, as in from_files.
        rd.close();
        s.at = pos{s.at.ord + 1, false, 0, 0};
        if (auto e = failed(s, std::current_exception())) return std::move(*e);
        continue;
      }
      if (st == frame_status::end) {
        rd.close();
        s.at = pos{s.at.ord + 1, false, 0, 0};
        continue;
      }
      s.at = pos{s.at.ord, true, rd.offset(), rd.records()};
      if (st == frame_status::record) return entry{std::move(r), nullptr, false, s.at};
      if (opt.on_error == error_policy::raise)
        return entry{std::nullopt, std::make_exception_ptr(format_error(bad.path, bad.offset, bad.reason)), false, s.at};
      if (auto e = note_skip(s, bad)) return std::move(*e);
    }
  }
  // What an exception at s's place (s.at already past it) becomes: the entry carrying it
  // to the consumer, or nullopt when it is a ferry error skipped under error_policy::skip.
  std::optional<entry> failed(slot& s, std::exception_ptr err) {
    if (up_.options().on_error == error_policy::skip) {
      try {
        std::rethrow_exception(err);
      } catch (const ferry::error& e) {
        return note_skip(s, describe(e));
      } catch (...) {  // not a format or I/O error: never skipped, as in from_files
      }
    }
    return entry{std::nullopt, std::move(err), false, s.at};
  }
  // Counts the skip, then reports it; on_skip throwing gives the entry carrying that
  // exception (the skip stays counted and reading goes on after it).
  std::optional<entry> note_skip(slot& s, const skipped_record& r) {
    {
      std::lock_guard lk(m_);
      ++s.skipped;
    }
    try {
      log_skip(up_.options(), r);
    } catch (...) {
      return entry{std::nullopt, std::current_exception(), false, s.at};
    }
    return std::nullopt;
  }
  // npy/IDX: the row layout every file must match (from_files::reference_layout): taken
  // from the list, not from whichever slot opens a file first, so the file refused never
  // depends on thread timing. Probed once, by the first reader to need it.
  std::optional<array_meta> layout() {
    std::lock_guard lk(layout_m_);
    if (!layout_known_) {
      layout_ = up_.reference_layout();
      layout_known_ = true;
    }
    return layout_;
  }

  // Takes slot i's next entry: from the run taken before, or else everything its reader
  // has published, at once (one lock, one wake-up of the readers if one waits for room).
  entry take(std::size_t i) {
    slot& s = slots_[i];
    if (o_.workers == 0) return produce(s);
    if (s.local.empty()) {
      std::unique_lock lk(m_);
      if (s.q.empty()) {  // the consumer waits for the readers
        observe::wait_timer wt;
        wt.start();
        waiting_for_.store(i, std::memory_order_relaxed);  // its reader publishes at once
        ++consumer_waiting_;
        not_empty_.wait(lk, [&] { return !s.q.empty() || s.broken; });
        --consumer_waiting_;
        waiting_for_.store(no_slot, std::memory_order_relaxed);
        wt.stop(stats_.wait_up, "interleave: wait upstream");
        if (s.q.empty()) std::rethrow_exception(s.broken);  // until rewind()
      }
      s.local.swap(s.q);  // s.local was empty: s.q is now
      s.q_bytes = 0;
      const bool wake = readers_waiting_ > 0;
      lk.unlock();
      if (wake) not_full_.notify_all();
    }
    entry e = std::move(s.local.front());
    s.local.pop_front();
    return e;
  }

  bool has_room(const slot& s) const {
    return !s.producing_done && !s.broken && s.q.size() < std::max<std::size_t>(o_.buffer, 1) &&
           (s.q.empty() || s.q_bytes < 4 * pool_->chunk_bytes());
  }
  // A reader reads a run of entries for one slot (as many as its room allows) outside the
  // lock, then publishes them under one lock with at most one wake-up. The run ends early
  // at the slot's end, at stop, past the byte bound, or when the consumer waits on one of
  // this reader's slots (so a slow file, a pipe, never holds back what is already read,
  // nor another slot's turn).
  void worker(std::size_t t) {
    observe::name_this_thread("ferry interleave reader");
    const std::size_t w = threads_count_;
    const std::size_t cap = std::max<std::size_t>(o_.buffer, 1), byte_cap = 4 * pool_->chunk_bytes();
    std::vector<entry> run;
    for (;;) {
      std::size_t pick = slots_.size(), want = 0, bytes_left = 0;
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
          ++readers_waiting_;
          not_full_.wait(lk, room);
          --readers_waiting_;
          wt.stop(stats_.wait_down, "interleave: wait downstream", /*shared=*/true);
        }
        if (stop_.load(std::memory_order_relaxed)) return;
        // The slot with the fewest buffered entries first: the consumer needs them in turn.
        for (std::size_t s = t; s < slots_.size(); s += w)
          if (has_room(slots_[s]) && (pick == slots_.size() || slots_[s].q.size() < slots_[pick].q.size())) pick = s;
        want = cap - slots_[pick].q.size();
        bytes_left = byte_cap > slots_[pick].q_bytes ? byte_cap - slots_[pick].q_bytes : 1;
      }
      run.clear();
      std::size_t bytes = 0;
      bool end = false;
      while (run.size() < want) {
        const bool timed = observe::on();
        const observe::ticks t0 = timed ? observe::now() : 0;
        entry e;
        try {
          e = produce(slots_[pick]);
        } catch (...) {  // building the entry itself failed (std::bad_alloc): the consumer gets that
          e = entry{std::nullopt, std::current_exception(), false, slots_[pick].at};
        }
        if (timed) {
          const observe::ticks t1 = observe::now();
          stats_.work.add_shared(t1 - t0);
          if (observe::tracing()) observe::record("interleave: read", t0, t1);
        }
        end = e.end;
        bytes += e.rec ? e.rec->size() : 0;
        try {
          run.push_back(std::move(e));
        } catch (...) {  // no room to hold it: the slot stops rather than skip it silently
          std::lock_guard lk(m_);
          slots_[pick].broken = std::current_exception();
          break;
        }
        if (end || bytes >= bytes_left || stop_.load(std::memory_order_relaxed)) break;
        // The consumer waits on one of this reader's slots: this one (publish what it
        // has), or another (a slow file here must not hold it back).
        if (const std::size_t wf = waiting_for_.load(std::memory_order_relaxed); wf != no_slot && wf % w == t) break;
      }
      bool wake;
      {
        std::lock_guard lk(m_);
        slot& s = slots_[pick];
        try {
          for (entry& e : run) {
            const std::size_t b = e.rec ? e.rec->size() : 0;
            s.q.push_back(std::move(e));
            s.q_bytes += b;
          }
          if (end) s.producing_done = true;
        } catch (...) {  // entries lost: the slot stops rather than skip them silently
          s.broken = std::current_exception();
        }
        wake = consumer_waiting_ > 0;
      }
      if (wake) not_empty_.notify_all();
    }
  }
  void start_threads() {
    stop_.store(false, std::memory_order_relaxed);
    threads_count_ = std::min(o_.workers, slots_.size());
    for (std::size_t t = 0; t < threads_count_; ++t) threads_.emplace_back([this, t] { worker(t); });
  }
  void stop_threads() noexcept {
    {
      std::lock_guard lk(m_);
      stop_.store(true, std::memory_order_relaxed);
    }
    not_full_.notify_all();
    for (auto& th : threads_) th.join();
    threads_.clear();
    // Entries read ahead are dropped; producers restart from the consumed positions.
    for (slot& s : slots_) {
      s.q.clear();
      s.local.clear();
      s.q_bytes = 0;
      s.broken = nullptr;
      if (s.reader) s.reader->close();
      s.at = s.consumed;
      s.producing_done = !s.active;
      if (s.consumed.open) s.pending = s.consumed;
      else s.pending.reset();
    }
  }

  Up up_;
  std::size_t cycle_;
  interleave_options o_;
  std::shared_ptr<chunk_pool> pool_;
  std::vector<slot> slots_;
  std::mutex layout_m_;
  std::optional<array_meta> layout_;  // see layout()
  bool layout_known_ = false;
  std::size_t cur_ = 0, in_block_ = 0;
  mutable std::mutex m_;
  std::condition_variable not_empty_, not_full_;
  std::atomic<bool> stop_{false};  // written under m_; readers also check it between reads
  static constexpr std::size_t no_slot = std::size_t(-1);
  std::atomic<std::size_t> waiting_for_{no_slot};  // the slot the consumer waits on
  int consumer_waiting_ = 0, readers_waiting_ = 0;  // under m_: whom a publish or take must wake
  std::size_t threads_count_ = 0;
  std::vector<std::thread> threads_;
  observe::stage_counters stats_;
};

inline void check_interleave_args(std::size_t cycle, const interleave_options& o) {
  if (cycle == 0) throw config_error("interleave: cycle must be at least 1 (got 0)");
  if (o.block == 0) throw config_error("interleave: block must be at least 1 (got 0)");
}

template <class S>
concept interleavable = requires(const S& s) {
  s.files();
  s.format();
  s.options();
};

}  // namespace detail

struct interleave_t {
  template <source S>
  auto operator()(S&& s, std::size_t cycle, interleave_options o = {}) const {
    detail::require_rvalue_source<S>();
    static_assert(detail::interleavable<std::remove_cvref_t<S>>,
                  "ferry::interleave reads files itself: use it directly after from_files (and shard)");
    detail::check_interleave_args(cycle, o);
    return detail::interleave_source<std::remove_cvref_t<S>>(std::forward<S>(s), cycle, o);
  }
  auto operator()(std::size_t cycle, interleave_options o = {}) const {
    detail::check_interleave_args(cycle, o);
    return make_closure([cycle, o]<class S>(S&& s) { return interleave_t{}(std::forward<S>(s), cycle, o); });
  }
};
inline constexpr interleave_t interleave{};

}  // namespace ferry
