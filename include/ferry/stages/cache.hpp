// ferry/stages/cache.hpp: cache() keeps the first complete pass over its upstream and
// plays it back on every later pass, without running the upstream again (tf.data's
// cache()): decode once, train many epochs.
//
//   from_files(paths, idx{}) | map(decode, {.workers = 2}) | cache()     // in memory
//       | shuffle(4096, seed) | batch(256) | repeat(10)
//   ... | cache("/scratch/train.ferrycache")                              // in a file
//   ... | cache("/scratch/train.ferrycache", {.key = "decode v2"})
//
// A pass is kept only when it is whole: it ran to the upstream's end with no upstream
// error and no failed write. A pass cut short (rewind() before the end, a consumer that
// stopped) or one in which the upstream threw is handed on as it comes and then dropped,
// and the next pass fills the cache again, so a bad record never leaves a hole in every
// later epoch. Put the stages whose order should change each epoch (shuffle) after
// cache(): the kept pass is replayed in its order. Records (ferry::record) are handed out
// with the pass count as their epoch (record::set_epoch), so a random crop after cache()
// (image/random_crop.hpp, keyed on it) changes every pass.
//
// The file: written as "<path>.partial-<random id>", synced and renamed to <path> when the
// pass is whole, so <path> always holds a whole pass. The writer holds an flock on it; a
// pass that starts filling removes the "<path>.partial-*" files nobody holds that were
// last written over a minute ago (a killed writer's), so crashed runs leave no dead
// passes on the disk (file systems without locks keep them). A later run (or another pipeline)
// that finds <path> with the same element type and key reads it and never pulls its
// upstream. The file is not tied to the upstream's contents: change `key` (or remove the
// file) when the data or the stages before cache() change. One file per pipeline: ranks
// that shard give each rank its own path. Anything at <path> that is not a regular file,
// not a ferry cache, or one of another element type or key is never opened for reading
// (when not a regular file) and never replaced: a config_error, restored or not.
//
// Threads: runs on the calling thread, user code (the upstream's, a cache_codec)
// included; cache(path) reads its file with read_threads I/O threads that run no user
// code and are joined when the pass's reader closes or the pipeline is destroyed.
//
// Errors: upstream exceptions pass through unchanged (that pass is then not kept).
// cache(path): config_error at once for an empty path or a directory; io_error (path,
// offset, errno) when the partial file cannot be created or written: that error comes
// after the element it was writing (nothing is lost) and the pass goes on uncached;
// config_error as above (on every next() until the file or the pipeline changes);
// format_error (path, offset) for a damaged cache file: found when opening it, the same
// pass fills the cache anew from the upstream; found while replaying, that pass ends at
// the damaged element (the error says where) and the next pass refills the cache from the
// upstream. Ending the pass there loses the rest of that epoch, which the error reports:
// getting it back would need the upstream moved back to the pass's start, which only a
// fresh pipeline (a restore) can do.
//
// Memory: cache() keeps every element of the pass in memory: the whole dataset, after the
// stages before it (records from from_files keep their read chunks; decode first, or
// cache to a file). cache(path) streams the pass to a file and reads it back through
// from_files' reader (1 MiB chunks, read ahead): bounded memory, for datasets larger than
// memory (elements need a cache_codec, see ferry/cache_codec.hpp).
//
// Checkpoints: save() records the upstream's position when the pass's fill began (for a
// file from an earlier run, the upstream's own, untouched position), the number of
// elements and of upstream errors handed out this pass, the file offset while replaying,
// whether the pass ended at a damaged file, and the pass count. Restoring a replay position of
// cache(path) seeks in the file, when it still holds the pass that was replayed (each pass
// written has an id in its header, saved with the position). Otherwise (in memory,
// mid-fill, the file gone or rewritten since) the fresh pipeline refills from that
// upstream position and skips the elements already handed out (and the upstream errors
// among them): the content and the order after the restore are exactly those of the run
// that saved, at the price of re-reading up to one pass, the only stage whose restore
// re-reads more than a window (a rewind() before the refill of a kept pass ends reads the
// rest of it, not handed out, and replays it). The exception is a file from an earlier run
// that is gone or rewritten at the restore: what it held cannot be read again, and the
// refill is this upstream's first pass. A state of cache() does not restore into
// cache(path), nor the other way (config_error).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "ferry/cache_codec.hpp"
#include "ferry/detail/cache_store.hpp"
#include "ferry/sources/record.hpp"
#include "ferry/stage.hpp"
#include "ferry/state.hpp"

namespace ferry {

// cache(path)'s options, a braced list: cache(path, {.key = "decode v2"}).
struct cache_options {
  // Stored in the file's header; a file written with another key is refused. Name what
  // the cached data depends on (a decode version, a dataset date).
  std::string key;
  // Reading the file back: 1 MiB chunks filled ahead by I/O threads, as in
  // from_files_options (read_ahead 0: every read(2) on the consumer's thread).
  std::size_t read_ahead = 4;
  std::size_t read_threads = 1;  // I/O threads filling those chunks (they run no user code)
};

namespace detail {

template <source Up, class Store>
class cache_source : public stage<cache_source<Up, Store>, Up> {
  friend stage<cache_source, Up>;

 public:
  using value_type = value_t<Up>;
  static constexpr char name[] = "cache";
  static constexpr const char* state_tag = Store::state_tag;  // a memory state never restores into a file cache
  cache_source(Up up, Store store) : stage<cache_source, Up>(std::move(up)), store_(std::move(store)) {}

  // The next pass: replays a kept pass from its first element; otherwise drops what the
  // pass kept so far and rewinds the upstream. (Not the base's rewind: a replay leaves the
  // upstream where it is.)
  // Also the way back from a failed restore, as the base's rewind() is.
  void rewind()
    requires rewindable_source<Up>
  {
    this->check_not_moved();
    try {
      next_pass();
      // A restore that failed in the upstream marked it; where the pass replays without it
      // (a kept pass), it starts its epoch again all the same.
      if (restore_failed_in(this->up())) this->up().rewind();
    } catch (...) {  // a replay that cannot be opened, an upstream's rewind: marked, as the base's
      ferry_mark_restore_failed(*this);
      throw;
    }
    ++pass_;  // (a rewind that threw began no pass: the one that recovers counts it once)
    this->rewound();
  }

  // True once a whole pass is kept (later passes do not run the upstream).
  bool cached() const noexcept { return phase_ == phase::replay && !broken_; }

 private:
  // rewind()'s work.
  void next_pass() {
    // A restored position in a kept pass: that pass is this job's, so the next one replays
    // it, read from the file or rebuilt from the upstream's restored position (the fill's
    // start) when nothing holds it, from its first element.
    if (resume_ && resume_replay_) {
      resume_index_ = resume_offset_ = resume_errors_ = 0;
      return;
    }
    // Rebuilding such a pass: the rest of it is read into the store (not handed out), so
    // that the next pass replays it as the saved job would (an upstream error or a failed
    // write on the way: not kept, the next pass fills from the upstream's next epoch).
    if (rebuilding_ && phase_ == phase::fill && !ended_ && keep_ && finish_rebuild()) {
      reset_pass();
      phase_ = phase::replay;
      if (store_.open_replay(0, 0)) return;
      phase_ = phase::fill;
    }
    const bool replay = phase_ == phase::replay && !broken_;
    reset_pass();
    if (replay && store_.open_replay(0, 0)) return;
    phase_ = phase::fill;
    store_.discard();
    fill_start_.words.clear();
    this->up().rewind();
  }

  std::optional<value_type> pull() { return next_impl(); }

  void save_upstream(state_writer& w) const {
    if (resume_) {  // restored, no next() since: the restored position, unchanged
      this->up().save(w);
      return;
    }
    // The upstream as it was when this pass's fill began (a fresh pipeline refills from
    // there when it has no kept pass), then how far the consumer is.
    if (fill_start_.words.empty()) {
      this->up().save(w);  // no fill began yet: the upstream has not moved
    } else {
      // Mid-fill the upstream is asked again: fill_start_ may predate its refusal (an
      // unordered map saves only before its first next()).
      if (phase_ == phase::fill) ask_save(this->up(), scratch_);
      w.put_words(fill_start_.words);
    }
  }
  void save_words(state_writer& w) const {
    if (resume_) {
      put_own(w, resume_replay_ ? 1 : 0, resume_index_, resume_offset_, resume_errors_, resume_id_);
      return;
    }
    // A fill that rebuilds a restored kept pass is that kept pass (phase 1) at an offset no
    // file holds: restored again, it rebuilds again, and a rewind before its end still
    // replays it (saved as a fill, a second restore forgot the pass was kept).
    const bool replay = phase_ == phase::replay && !broken_;
    const std::uint64_t ph = phase_ == phase::fill ? (rebuilding_ ? 1 : 0) : broken_ ? 2 : 1;
    put_own(w, ph, emitted_ + skip_, replay ? store_.offset() : rebuilding_ ? unseekable : 0, errors_ + swallow_,
            replay ? store_.pass_id() : 0);
  }
  void restore_words(state_reader& r) {
    const std::uint64_t ph = r.get(), index = r.get(), offset = r.get(), errors = r.get(), flags = r.get(),
                        pass = r.get();
    if (ph > 2) throw config_error("restore_state: cache: phase word " + std::to_string(ph) + " is not 0, 1 or 2");
    if (ph != 1 && flags > 1)
      throw config_error("restore_state: cache: a damaged state (flags " + std::to_string(flags) + ")");
    reset_pass();
    phase_ = phase::fill;
    store_.discard();
    fill_start_.words.clear();
    checked_file_ = (flags & 1) != 0;
    pass_ = pass;
    if (ph == 2) {  // the pass had ended at a damaged kept pass: over until rewind()
      phase_ = phase::replay;
      broken_ = true;
      started_ = true;
      save_fill_start();
      return;
    }
    if (ph == 0 && index == 0 && errors == 0 && !checked_file_) return;  // saved before any pass began
    resume_ = true;
    resume_replay_ = ph == 1;
    resume_index_ = index;
    resume_offset_ = offset;
    resume_errors_ = errors;
    resume_id_ = flags >> 1;
  }

  enum class phase { fill, replay };
  static constexpr std::uint64_t unseekable = ~std::uint64_t(0);  // an offset past any file's elements

  // The last word: bit 0 checked_file_; above it, in a replay, the pass id of the file
  // being replayed (0: in memory, or a file written before ids), so that a restore never
  // seeks into another pass written at the same path since.
  void put_own(state_writer& w, std::uint64_t ph, std::uint64_t index, std::uint64_t offset, std::uint64_t errors,
               std::uint64_t id) const {
    for (std::uint64_t x : {ph, index, offset, errors, (id << 1) | std::uint64_t(checked_file_ ? 1 : 0), pass_})
      w.put(x);
  }
  // Records are handed out with the pass count as their epoch (record::set_epoch): a kept
  // pass replays records of the epoch that filled it (or, from a file, none), and a random
  // crop keyed on the epoch would repeat every pass.
  std::optional<value_type> stamped(std::optional<value_type> e) const noexcept {
    if constexpr (std::is_same_v<value_type, record>)
      if (e) e->set_epoch(pass_);
    return e;
  }

  void reset_pass() {
    emitted_ = 0;
    skip_ = 0;
    started_ = false;
    keep_ = true;
    ended_ = false;
    broken_ = false;
    resume_ = false;
    rebuilding_ = false;
    swallow_ = 0;
    errors_ = 0;
    pending_ = nullptr;
  }

  // The first next() of a pass: a restored position, a file left by an earlier run, or a
  // new fill.
  // Before a fill that may end in a rename over the file, check_destination() refuses a
  // file that is not this cache's (try_reuse() checks the same on the first pass). A
  // config_error leaves everything as it was, so it comes again on the next call.
  void start_pass() {
    if (resume_) {
      store_.check_destination();
      resume_ = false;
      started_ = true;
      if (resume_replay_ && store_.open_replay(resume_index_, resume_offset_, resume_id_)) {
        phase_ = phase::replay;
        emitted_ = resume_index_;
        save_fill_start();
        return;
      }
      // Refill from the pass's start; skip what was handed out, errors included.
      skip_ = resume_index_;
      swallow_ = resume_errors_;
      rebuilding_ = resume_replay_;
    } else if (!checked_file_) {
      bool reuse = false;
      try {
        reuse = store_.try_reuse();
      } catch (const config_error&) {
        throw;  // comes again on the next call
      } catch (const error&) {
        checked_file_ = true;  // damaged or unreadable: said once; this pass fills it anew
        throw;
      }
      checked_file_ = true;
      started_ = true;
      if (reuse) {
        phase_ = phase::replay;
        fill_start_.words.clear();  // the upstream has not moved: its state is its own
        return;
      }
    } else {
      store_.check_destination();
    }
    started_ = true;
    save_fill_start();
    try {
      store_.begin_fill();
    } catch (...) {
      keep_ = false;
      throw;
    }
  }
  void save_fill_start() {
    fill_start_.words.clear();
    if constexpr (resumable_source<Up>) {
      state_writer w(fill_start_);
      this->up().save(w);
    }
  }

  std::optional<value_type> next_impl() {
    if (pending_) std::rethrow_exception(std::exchange(pending_, nullptr));
    if (phase_ == phase::fill && !started_) start_pass();
    if (phase_ == phase::replay) {
      if (broken_) return std::nullopt;
      try {
        std::optional<value_type> e = store_.read();
        if (e) ++emitted_;
        return stamped(std::move(e));
      } catch (...) {
        broken_ = true;  // the rest of this pass is lost to the damage; the next refills
        throw;
      }
    }
    while (!ended_) {
      std::optional<value_type> e;
      try {
        e = this->pull_up();
      } catch (...) {
        drop();  // a pass with an upstream error is not kept
        if (swallow_ > 0) {  // the consumer had this error before the save
          --swallow_;
          ++errors_;
          continue;
        }
        ++errors_;
        throw;
      }
      if (!e) {
        ended_ = true;
        if (keep_ && skip_ == 0 && swallow_ == 0) {
          try {
            store_.commit();
          } catch (...) {
            drop();
            throw;
          }
          phase_ = phase::replay;
          if (!store_.seek_end()) broken_ = true;  // the file went: the next pass refills
        } else {
          drop();
        }
        return std::nullopt;
      }
      if (keep_) {
        try {
          store_.append(*e);
        } catch (...) {
          drop();
          pending_ = std::current_exception();  // after this element: nothing lost
        }
      }
      if (skip_ > 0) {  // handed out before the restore
        --skip_;
        ++emitted_;
        if (pending_) std::rethrow_exception(std::exchange(pending_, nullptr));
        continue;
      }
      swallow_ = 0;  // (only an upstream that changed could leave errors unmet here)
      ++emitted_;
      return stamped(std::move(e));
    }
    return std::nullopt;
  }
  void drop() noexcept {
    keep_ = false;
    store_.discard();
  }
  // The rest of a kept pass being rebuilt, into the store and committed; false (the store
  // discarded) when the upstream throws or a write fails.
  bool finish_rebuild() {
    try {
      while (std::optional<value_type> e = this->pull_up()) store_.append(*e);
      store_.commit();
      return true;
    } catch (...) {
      drop();
      return false;
    }
  }

  Store store_;
  phase phase_ = phase::fill;
  std::uint64_t emitted_ = 0;  // elements of this pass handed out (or skipped after a restore)
  std::uint64_t skip_ = 0;     // elements still to skip after a restore that refills
  bool started_ = false;       // this pass's first next() ran
  bool keep_ = true;           // this fill pass can still be kept
  bool ended_ = false;         // the upstream ended this pass
  bool broken_ = false;        // replay: the kept pass is damaged; nothing more this pass
  bool checked_file_ = false;  // looked for a file left by an earlier run
  bool resume_ = false;        // restored, not yet opened or refilled
  bool resume_replay_ = false;  // ... at a position in a kept pass (seek in the file)
  bool rebuilding_ = false;     // this fill rebuilds a restored kept pass (finished at a rewind)
  std::uint64_t resume_index_ = 0, resume_offset_ = 0;
  std::uint64_t resume_errors_ = 0;
  std::uint64_t resume_id_ = 0;  // the replayed file's pass id, saved (0: none to check)
  std::uint64_t swallow_ = 0;  // upstream errors still to skip after a restore that refills
  std::uint64_t errors_ = 0;   // upstream errors handed on this pass
  std::exception_ptr pending_;  // a failed write, thrown after the element it was writing
  pipeline_state fill_start_;   // the upstream's position when the kept pass began
  std::uint64_t pass_ = 0;      // passes begun before this one (rewinds): records' epoch
  mutable pipeline_state scratch_;  // save() asks the upstream into it (capacity reused)
};

}  // namespace detail

// The type of ferry::cache: cache(src) / cache(src, path, options), or cache() /
// cache(path, options) for `src | cache(...)`.
struct cache_t {
  // In memory.
  template <source S>
  auto operator()(S&& s) const {
    detail::require_rvalue_source<S>();
    using T = value_t<std::remove_cvref_t<S>>;
    static_assert(std::copy_constructible<T>,
                  "ferry::cache: cache() in memory hands out copies of the kept elements; "
                  "the element type must be copyable");
    return detail::cache_source<std::remove_cvref_t<S>, detail::memory_cache_store<T>>(
        std::forward<S>(s), detail::memory_cache_store<T>{});
  }
  // In a file.
  template <source S>
  auto operator()(S&& s, const std::filesystem::path& path, cache_options o = {}) const {
    detail::require_rvalue_source<S>();
    using T = value_t<std::remove_cvref_t<S>>;
    static_assert(cache_codable<T>,
                  "ferry::cache(path): no ferry::cache_codec for the element type; specialize "
                  "it (see ferry/cache_codec.hpp) or cache in memory with cache()");
    if (path.empty()) throw config_error("ferry::cache: the cache file's path is empty");
    if (std::filesystem::is_directory(path))
      throw config_error("ferry::cache: " + path.string() + " is a directory; give a file name in it");
    return detail::cache_source<std::remove_cvref_t<S>, detail::file_cache_store<T>>(
        std::forward<S>(s),
        detail::file_cache_store<T>(path.string(), std::move(o.key), o.read_ahead, o.read_threads));
  }
  // cache(): the in-memory closure, for `src | cache()`.
  auto operator()() const {
    return make_closure([]<class S>(S&& s) { return cache_t{}(std::forward<S>(s)); });
  }
  // cache(path, options): the file closure, for `src | cache(path)`; the path is checked
  // when the closure is applied.
  auto operator()(std::filesystem::path path, cache_options o = {}) const {
    return make_closure([path = std::move(path), o = std::move(o)]<class S>(S&& s) {
      return cache_t{}(std::forward<S>(s), path, o);
    });
  }
};
// cache() / cache(path): keeps the first whole pass and replays it (see the file's top).
inline constexpr cache_t cache{};

}  // namespace ferry
