// ferry/stages/detail/interleave_files.hpp: interleave's file-level fast path, for
// `from_files(...) | interleave(cycle, opts)`: it reads the file list itself, each slot's
// files with a file_reader of its own, and passes records between threads in runs of views
// into the read chunks. stages/interleave.hpp documents what users see; this is how.
//
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
// consumer takes the run it collected before (so at most 2 x .buffer per slot). Records
// pass between threads in runs, as views into the read chunks with one chunk reference
// per chunk, not per record: one lock and at most one wake-up per run. batch() of records
// takes them through next_borrowed, with no reference per record. When the consumer waits
// on a slot, that slot's reader serves it first and publishes its run once it holds
// .buffer / 2 records or 50 us have passed since the wait began, checked after each record
// it reads: a consumer faster than its readers is not woken per record. So a record read
// just before the reader blocks in read(2) (a pipe, a slow network file) waits for the
// next record, and a reader blocked on one slot's file holds up its other slots: give
// slow sources a reader each (.workers = cycle). With .workers = 0 everything runs on the
// thread calling next(), which reads only the records it takes. on_skip runs on the
// reading thread. Errors: as from_files (error_policy raise: the error reaches next() at
// the record's place in the order, skip: counted in skipped()). Anything else thrown
// while reading (on_skip throwing, std::bad_alloc) reaches next() the same way, never
// std::terminate; the slot then goes on with its next file (or, after on_skip, its next
// record); but when a reader cannot even queue what it read (std::bad_alloc), that slot
// stops and every next() reaching it throws that error until rewind() or restore_state.
// Epochs: rewind() starts the next one, and with from_files' shuffle_files the slots read
// that epoch's order of files; the state holds the epoch. npy/IDX: every file's rows must
// match those of the first file in the list (as given) whose header reads, as from_files
// requires; a file that differs is a format_error naming it (offset 0) at its place in
// the order, whatever the thread timing. The destructor and rewind() stop and join the
// threads, even mid-epoch, once each has finished the record it is reading; a reader
// waiting for a pipe's data (a FIFO whose writer is slow, or never came: opening one does
// not wait) sees the stop within 50 ms (byte_stream::set_cancel). A pipe cannot be read
// again from a saved position: after a stop mid-file (rewind, restore, a move) its slot
// fails to seek.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <memory_resource>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "ferry/detail/deferred_frees.hpp"
#include "ferry/error.hpp"
#include "ferry/observe/hooks.hpp"
#include "ferry/stage.hpp"
#include "ferry/sources/from_files.hpp"

namespace ferry {
namespace detail {

// What interleave(cycle, interleave_options) hands the file-level machine.
struct interleave_params {
  std::size_t workers = 2;
  std::size_t block = 1;
  std::size_t buffer = 1024;
};

template <class Up>
class interleave_files_source : public stage<interleave_files_source<Up>, Up, record> {
  friend stage<interleave_files_source, Up, record>;
  struct pos {
    std::uint64_t ord = 0;  // index into the slot's files
    bool open = false;
    std::uint64_t offset = 0, rec = 0;
  };
  // One record read ahead: a view into a chunk the run holds, its origin and the
  // slot's position after it (what save() records once the consumer has taken it).
  struct item {
    std::span<const std::byte> bytes;
    std::uint64_t offset;                // the record's frame in its file
    std::uint64_t ord, after_offset, after_rec;
    std::uint32_t head;                  // frame header bytes before the payload
    std::uint32_t owner;                 // index into run::owners
  };
  // Records a slot's reader passes to the consumer at once: one reference per chunk, not
  // per record, so no reference count moves between threads per record. What follows the
  // records, if anything: an error at its place (`after` is the position past it), or
  // the slot's end.
  struct run {
    std::vector<item> items;
    std::vector<std::shared_ptr<chunk>> owners;
    std::size_t taken = 0;  // consumer side
    std::size_t bytes = 0;
    std::exception_ptr err;
    bool end = false;
    pos after;
    bool spent() const { return taken == items.size() && !err && !end; }
    // Empties it for reuse (the vectors keep their capacity); keep_owner: holds on to the
    // last chunk, which the next record most likely shares.
    void clear(bool keep_owner = false) {
      items.clear();
      if (keep_owner && owners.size() > 1) owners.erase(owners.begin(), owners.end() - 1);
      else if (!keep_owner) owners.clear();
      taken = bytes = 0;
      err = nullptr;
      end = false;
    }
  };
  struct slot {
    std::vector<std::string> files;
    std::unique_ptr<file_reader> reader;
    pos at;                       // producer's position
    std::optional<pos> pending;   // a restored position to seek to
    bool producing_done = false;  // producer reached the end
    std::deque<run> q;            // published by the slot's reader, under m_
    std::size_t q_items = 0, q_bytes = 0;
    std::deque<run> local;        // consumer side: the runs taken from q at once
    std::vector<run> spent;       // consumer side: emptied runs, back to free at the next take
    std::vector<run> free;        // under m_: emptied runs a reader reuses (no allocation)
    run own;                      // workers = 0: the one run, reused
    bool active = true;           // consumer side: not yet ended
    pos consumed;                 // consumer side: after the last record taken
    std::uint64_t skipped = 0;
    std::exception_ptr broken;    // a worker could not queue a run (std::bad_alloc)
  };

 public:
  static constexpr char name[] = "interleave";

  interleave_files_source(Up up, std::size_t cycle, interleave_params o)
      : stage<interleave_files_source, Up, record>(std::move(up)), cycle_(cycle), o_(o),
        pool_(std::make_shared<chunk_pool>(std::max<std::size_t>(this->up().options().chunk_bytes, 64))) {
    reset_slots();
  }
  // The readers hold `this`: they stop before the move (and start again at the next pull).
  interleave_files_source(interleave_files_source&& other) noexcept(false)
      : stage<interleave_files_source, Up, record>((other.stop_threads(), std::move(other))), cycle_(other.cycle_), o_(other.o_), pool_(other.pool_) {
    slots_ = std::move(other.slots_);
    for (slot& s : slots_)
      if (s.reader) s.reader->set_cancel(&stop_);  // this object's flag now
    layout_ = std::move(other.layout_);
    layout_known_ = other.layout_known_;
    cur_ = other.cur_;
    in_block_ = other.in_block_;
  }
  interleave_files_source& operator=(interleave_files_source&&) = delete;
  ~interleave_files_source() { stop_threads(); }

  // from_files only lists the files here; interleave does the reading itself, so its row
  // stands for both.
  void visit_stages(observe::stage_visitor& v) const {
    if (!this->live()) return;
    if (o_.workers == 0)
      v.add(name, this->stats(), observe::stage_mode::source_stage, 1);
    else
      v.add(name, this->stats(), observe::stage_mode::threaded_stage,
            std::min(o_.workers, std::max<std::size_t>(slots_.size(), 1)));
  }

 private:
  std::optional<record> pull() { return next_impl(); }
  // The borrowing_source fast path (source.hpp), which batch() of records takes: the next
  // records as views, each chunk's reference taken once, not once per record. Throws as
  // next() does; the records appended before a throw stay in `out`.
  std::size_t pull_borrowed(borrowed_records& out, std::size_t max) { return borrow(out, max); }

  std::optional<record> next_impl() {
    std::optional<record> out;
    step(1, [&](run& r, std::size_t) {
      const item& it = r.items[r.taken];
      const std::shared_ptr<chunk>& c = r.owners[it.owner];
      out.emplace(std::shared_ptr<const std::byte>(c, it.bytes.data()), it.bytes.size(), c->file.get(), it.offset,
                  it.head, this->up().epoch());
      return std::size_t(1);
    });
    return out;
  }
  std::size_t borrow(borrowed_records& out, std::size_t max) {
    std::size_t n = 0;
    while (n < max) {
      const std::size_t k = step(max - n, [&](run& r, std::size_t want) {
        const std::size_t end = r.taken + want;
        out.views.reserve(out.views.size() + want);  // no throw below: each record is handed out once
        out.owners.reserve(out.owners.size() + want);
        for (std::size_t i = r.taken; i < end; ++i) out.add(r.owners[r.items[i].owner], r.items[i].bytes);
        return want;
      });
      if (k == 0) break;
      n += k;
    }
    return n;
  }
  // Takes up to `max` records of the current turn (at least one, unless the epoch has
  // ended: then 0) through take(run, count), which hands them out and returns how many it
  // did; moves the turn on after `block`. An error in the slot's order is thrown here.
  template <class Take>
  std::size_t step(std::size_t max, const Take& take) {
    if (o_.workers > 0 && threads_.empty() && !all_done()) start_threads();
    for (;;) {
      if (all_done()) return 0;
      slot& s = slots_[cur_];
      run& r = front(cur_, std::min(max, o_.block - in_block_));
      if (r.taken < r.items.size()) {
        const std::size_t k = take(r, std::min({max, o_.block - in_block_, r.items.size() - r.taken}));
        r.taken += k;
        const item& last = r.items[r.taken - 1];
        s.consumed = pos{last.ord, true, last.after_offset, last.after_rec};
        if (r.spent()) pop(s);
        if ((in_block_ += k) >= o_.block) advance();
        return k;
      }
      if (r.end) {
        pop(s);
        s.active = false;
        advance();
        continue;
      }
      s.consumed = r.after;
      std::exception_ptr e = std::move(r.err);
      pop(s);
      std::rethrow_exception(e);  // takes no turn: the order matches skip's
    }
  }

 private:
  // rewind(): stop the readers; then from_files starts its next epoch (with shuffle_files,
  // the slots read its new order of files).
  void halt() noexcept { stop_threads(); }
  void start_epoch() { reset_slots(); }

  // The checkpoint: from_files' own (its epoch and file list) first, as for any stage,
  // then the turn and each slot's file, offset and record count.
  template <class F>
  void config(F&& f) const {
    f("cycle", cycle_);
    f("block", o_.block);
  }
  void save_words(state_writer& w) const {
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
  void before_restore() noexcept { stop_threads(); }
  // Throws config_error for a damaged state (a slot past its files, a bad turn).
  void restore_words(state_reader& r) {
    reset_slots();  // from_files is at the saved epoch: its order of files
    // Read and check everything before taking any of it: a refused state leaves the stage
    // at the start of the epoch, as reset_slots() made it, never half restored.
    const std::uint64_t cur = r.get(), in_block = r.get();
    if ((cur >= slots_.size() && !slots_.empty()) || in_block >= o_.block)
      throw config_error("restore_state: interleave: bad slot or turn");
    std::vector<std::pair<bool, pos>> got(slots_.size());
    for (std::size_t j = 0; j < slots_.size(); ++j) {
      const std::uint64_t active = r.get();
      got[j].first = active != 0;
      pos& p = got[j].second;
      p.ord = r.get();
      const std::uint64_t open = r.get();
      p.open = open != 0;
      p.offset = r.get();
      p.rec = r.get();
      if (p.ord > slots_[j].files.size() || active > 1 || open > 1 || (p.open && p.ord >= slots_[j].files.size()))
        throw config_error("restore_state: interleave: slot " + std::to_string(j) + " is at file " +
                           std::to_string(p.ord) + " of " + std::to_string(slots_[j].files.size()));
    }
    // The turn is always an active slot's, until every slot has ended (advance()).
    bool any_active = false;
    for (const auto& g : got) any_active = any_active || g.first;
    if (any_active && !got[cur].first) throw config_error("restore_state: interleave: bad slot or turn");
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

 public:
  // Records skipped under error_policy::skip (counted when read, possibly ahead).
  std::uint64_t skipped() const {
    std::lock_guard lk(m_);
    std::uint64_t n = 0;
    for (const slot& s : slots_) n += s.skipped;
    return n;
  }
  const std::vector<std::string>& files() const { return this->up().files(); }

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
    const auto& files = this->up().files();
    const std::size_t n = std::min(cycle_, files.size());
    slots_.resize(n);
    for (std::size_t j = 0; j < files.size(); ++j) slots_[j % n].files.push_back(files[j]);
    for (slot& s : slots_) {
      s.reader = std::make_unique<file_reader>(this->up().format(), this->up().options(), pool_);
      s.reader->set_cancel(&stop_);  // stop_threads() ends a wait for a pipe's data
    }
    cur_ = 0;
    in_block_ = 0;
  }

  // Reads slot s's next records into r (no lock held: only one thread produces for a
  // slot) until it holds max_items records or max_bytes bytes, or enough() says so after a
  // record; or until what follows ends it: the slot's end, or an error at its place.
  // Whatever reading throws becomes such an error.
  template <class Enough>
  void produce(slot& s, run& r, std::size_t max_items, std::size_t max_bytes, const Enough& enough);  // interleave_files_read.hpp
  // An exception at s's place (s.at already past it): true when it ends the run, false
  // when it is a ferry error skipped under error_policy::skip.
  bool failed(slot& s, run& r, std::exception_ptr err);  // interleave_files_read.hpp
  // Counts the skip, then reports it; on_skip throwing ends the run with that exception
  // (true; the skip stays counted and reading goes on after it).
  bool note_skip(slot& s, run& r, const skipped_record& bad);  // interleave_files_read.hpp
  // npy/IDX: the row layout every file must match (from_files::reference_layout): taken
  // from the list, not from whichever slot opens a file first, so the file refused never
  // depends on thread timing. Probed once, by the first reader to need it.
  std::optional<array_meta> layout() {
    std::lock_guard lk(layout_m_);
    if (!layout_known_) {
      layout_ = this->up().reference_layout();
      layout_known_ = true;
    }
    return layout_;
  }

  // Slot i's current run, with a record or what follows them left in it: the run taken
  // before, or else everything its reader has published, at once (one lock, one wake-up
  // of the readers if one waits for room). With workers = 0, reads here the `want`
  // records the turn takes now (no further: a slow pipe must not delay them).
  run& front(std::size_t i, std::size_t want);  // interleave_files_read.hpp
  // Drops slot s's current run; its chunk references go here, on the consumer's thread.
  void pop(slot& s);  // interleave_files_read.hpp

  bool has_room(const slot& s) const {
    return !s.producing_done && !s.broken && s.q_items < std::max<std::size_t>(o_.buffer, 1) &&
           (s.q.empty() || s.q_bytes < 4 * pool_->chunk_bytes());
  }
  // A reader reads a run of records for one slot (as many as its room allows) outside the
  // lock, then publishes it under one lock with at most one wake-up. The run ends early
  // at the slot's end, at an error, at stop, past the byte bound, or when the consumer
  // waits on one of this reader's slots (so a slow file, a pipe, never holds back what is
  // already read, nor another slot's turn).
  void worker(std::size_t t);  // interleave_files_read.hpp
  // Throws what allocating or starting a thread throws, with none left running (the next
  // next() tries again).
  void start_threads();  // interleave_files_read.hpp
  void stop_threads() noexcept;  // interleave_files_read.hpp

  std::size_t cycle_;
  interleave_params o_;
  std::shared_ptr<chunk_pool> pool_;
  std::vector<slot> slots_;
  std::mutex layout_m_;
  std::optional<array_meta> layout_;  // see layout()
  bool layout_known_ = false;
  std::size_t cur_ = 0, in_block_ = 0;
  mutable std::mutex m_;
  std::condition_variable not_empty_;
  struct reader_wait {
    std::condition_variable cv;  // a reader waits here for room in one of its slots
    bool waiting = false;        // under m_
  };
  std::unique_ptr<reader_wait[]> readers_;
  std::atomic<bool> stop_{false};  // written under m_; readers also check it between reads
  static constexpr std::size_t no_slot = std::size_t(-1);
  std::atomic<std::size_t> waiting_for_{no_slot};  // the slot the consumer waits on
  std::atomic<std::chrono::steady_clock::rep> waiting_since_{0};  // and since when
  int consumer_waiting_ = 0;  // under m_: whether a publish must wake the consumer
  std::size_t threads_count_ = 0;
  detail::deferred_pinned_list deferred_;  // pinned blocks the readers let go (deferred_frees.hpp)
  std::vector<std::thread> threads_;
};

template <class S>
concept interleavable = requires(S& s) {
  s.files();
  s.format();
  s.options();
  s.list_hash();
  s.epoch();
  s.set_epoch(std::uint64_t{});
  s.rewind();
};

}  // namespace detail
}  // namespace ferry

#include "ferry/stages/detail/interleave_files_read.hpp"  // the reading side's members
