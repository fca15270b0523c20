// ferry/stages/interleave.hpp: interleave(fn, {.workers, .block, .cycle}) turns each
// upstream element into a source with fn and hands out the elements of `cycle` of them at
// once, `block` at a time from each, in a fixed order (tf.data's interleave); and its file
// fast path, from_files(...) | interleave(cycle, {.workers, .block}).
//
//   ferry::from_range(shard_paths)
//     | ferry::interleave([](const std::string& p) { return ferry::from_files({p}, ferry::tfrecord{}); },
//                         {.workers = 4, .block = 16, .cycle = 4})
//   ferry::from_files({"shards/*.tfrecord"}, ferry::tfrecord{}) | ferry::shard(n, i)
//     | ferry::interleave(4, {.workers = 4, .block = 16}) | ferry::batch(256)
//
// Order (the fn form, tf.data's): slot s of the cycle holds one element's source; at slot
// s's turn it takes up to `block` elements from it, then the turn moves to s + 1 (mod
// cycle). A slot whose source ends passes its turn on and, at its next turn, takes the
// next upstream element (fn(e)); once the upstream has ended, empty slots are skipped and
// the epoch ends when every slot is empty. The order is a function of the elements alone,
// never of thread timing.
//
// The file fast path (directly after from_files, and shard): slot s of the cycle reads
// files s, s + cycle, s + 2*cycle, ... back to back, with readers of its own that pass
// records between threads in runs of views into the read chunks (one lock, one chunk
// reference per chunk, not per record); batch() of records takes them through
// next_borrowed. This order differs from the fn form's: a slot does not take the next
// unread file when it ends, so its readers can read ahead across files.
// stages/detail/interleave_files.hpp says more of how.
//
// Threads: fn form: with .workers > 0, each open slot's source runs on a thread of its own
// (detail/producer.hpp), up to .buffer elements ahead of the consumer (.buffer is 1024 by
// default: lower it for large elements); the upstream and fn run on the consumer's thread.
// With .workers = 0 everything runs on the consumer's thread. The destructor, rewind() and
// restore_state stop and join the slots' threads, each waiting for a next() of its source
// in progress. File path: with .workers = w > 0, w threads read the slots' files ahead
// (slot s on thread s % w), and on_skip runs on the reading thread; with .workers = 0
// everything runs on the thread calling next(), which reads only the records it takes.
// The destructor and rewind() stop and join the readers once each has finished the
// record it is reading (a reader waiting on a pipe sees the stop within 50 ms).
//
// Errors: throws config_error for cycle == 0, cycle > 65536 or block == 0, and for .workers
// over slot sources of distribute()'s steps; over steps, a compile-time error (it would
// hold steps ahead: detail/is_step.hpp). fn form: an
// upstream error, or fn throwing (element_error naming interleave and the upstream
// element), reaches the consumer at that slot's turn, which it keeps; the next call takes
// the upstream element after it. A slot source's error reaches the consumer at its place
// in that source's elements, and the slot goes on after it. File path: as from_files
// (error_policy raise: the error reaches next() at the record's place in the order; skip:
// counted in skipped()); anything else thrown while reading (on_skip throwing,
// std::bad_alloc) reaches next() the same way, and the slot goes on with its next file (or
// record); a reader that cannot queue what it read (std::bad_alloc) stops its slot, whose
// turns then throw that error until rewind() or restore_state.
//
// Memory: fn form: `cycle` sources open at once (and their read-ahead); the anchor's
// words. File path: each slot buffers up to .buffer records (and about 4 read chunks of
// bytes) while the consumer takes the run collected before, so at most 2 x .buffer
// records per slot.
//
// Checkpoints: fn form (upstream and slot sources resumable): positions, not elements: the
// upstream's position before the oldest open slot's element (an anchor), then each slot's
// distance from it in upstream pulls and its source's own state, the turn and the count
// taken in it. A restore re-reads the upstream from the anchor (fn called again for the
// open slots only) and restores each slot's source: the upstream elements pulled since
// the oldest open slot was opened (cheap when they are paths). Restoring another cycle or
// block is refused, as is a damaged state (config_error). An upstream that cannot be saved
// when a slot opens (an unordered parallel map) does not stop the elements: save() throws
// its refusal while that slot is the oldest open. The re-read is bounded: save() throws
// config_error while the oldest open slot's element is more than 2^24 upstream pulls back
// (one slot's source outlasting millions of the others'), and a restore refuses a state
// claiming more, or slots no save writes (two at one upstream element, one at or past
// the pulls, none at the anchor). The re-read happens at the first next(): there, an
// upstream pull that opened a slot when the state was saved and throws now, or fn or a
// slot's restore throwing, reaches the caller and marks the stage as a failed restore
// (next() and save() throw config_error until rewind() or a restore that succeeds)
// rather than going on without that slot. File path: from_files' own state
// (its epoch and file list) first, then cycle and block (another cycle or block is a
// config_error naming both), the turn and each slot's file, offset and record count; a
// damaged state is a config_error. A pipe cannot be read again from a saved position.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/detail/holds_ahead.hpp"
#include "ferry/detail/is_step.hpp"
#include "ferry/detail/producer.hpp"
#include "ferry/error.hpp"
#include "ferry/stage.hpp"
#include "ferry/stages/detail/interleave_files.hpp"
#include "ferry/stages/detail/interleave_table.hpp"

namespace ferry {

// interleave()'s options, a braced list in this order: interleave(fn, {.block = 16, .cycle = 4}).
struct interleave_options {
  std::size_t workers = 2;   // threads: fn form, one per open slot (0: none); files: readers
  std::size_t block = 1;     // elements taken from a slot before the turn moves on
  std::size_t buffer = 1024; // elements each slot may read ahead (workers > 0)
  std::size_t cycle = 0;     // fn form: slots open at once (0: 4); the file form takes it positionally
};

namespace detail {

template <class Up, class F>
using interleave_inner_t = std::remove_cvref_t<std::invoke_result_t<F&, value_t<Up>&&>>;

template <source Up, class F>
// threaded_stage: the slots' threads write the stage's counters, which must not move with
// the stage (a pipeline moved mid-epoch, into an any_source or the next stage).
class interleave_source
    : public threaded_stage<interleave_source<Up, F>, Up, value_t<interleave_inner_t<Up, F>>> {
  using S = interleave_inner_t<Up, F>;
  static_assert(source<S>, "ferry::interleave: fn must return a source (a pipeline) for each upstream element");
  static_assert(!is_step_v<value_t<Up>>,
                "ferry::interleave over distribute()'s steps: its open slots would hold several, and a device "
                "replica's step is valid only until the next one is asked for; interleave before distribute()");
  using T = value_t<S>;
  friend threaded_stage<interleave_source, Up, T>;
  static constexpr bool resumable = resumable_source<Up> && resumable_source<S>;

  // One open slot. The source lives at a fixed address: its thread (if any) pulls it.
  struct slot {
    explicit slot(S s) : src(std::move(s)) {}
    S src;
    producer<T> p;  // declared after src: its thread stops before src goes
    std::uint64_t distance = 0;  // upstream pulls from the anchor to this slot's element
    pipeline_state anchor;       // the upstream's words before this slot's element was pulled
    std::exception_ptr anchor_error;  // ... or why the upstream could not save them (a save throws it)
    pipeline_state restored;     // a restored position, for the first pull (workers)
  };

 public:
  static constexpr char name[] = "interleave";
  static constexpr bool changes_batch_size = true;  // elements come from other sources
  static constexpr bool cannot_save = !resumable;

  // Throws config_error for slot sources of steps with workers (see the file's top).
  interleave_source(Up up, F fn, interleave_options o)
      : threaded_stage<interleave_source, Up, T>(std::move(up)), fn_(std::move(fn)), o_(o), slots_(o.cycle) {
    if (o.workers > 0 && is_step_v<T>)
      throw config_error("interleave: workers over sources of distribute()'s steps: the readers would hold steps "
                         "ahead, and a device replica's step is valid only until its pipeline's next one is asked "
                         "for (its blocks are reused then); use .workers = 0, or interleave before distribute()");
  }

 private:
  std::optional<T> pull() {
    if (replay_) replay();
    for (;;) {
      std::unique_ptr<slot>& s = slots_[cur_];
      if (s) {
        std::optional<T> e = o_.workers ? take(*s) : s->src.next();  // an error keeps the turn
        if (e) {
          if (++in_block_ >= o_.block) advance();
          return e;
        }
        s.reset();  // ended: the turn moves on; the next turn here opens a new one
        advance();
      } else if (!up_ended_) {
        open(cur_);  // an upstream error or fn's keeps the turn
      } else {
        if (std::none_of(slots_.begin(), slots_.end(), [](const auto& x) { return bool(x); })) return std::nullopt;
        advance();
      }
    }
  }

  void advance() {
    in_block_ = 0;
    cur_ = (cur_ + 1) % slots_.size();
  }

  // The next upstream element's source into slot i (nothing at the upstream's end).
  void open(std::size_t i) {
    pipeline_state before;
    std::exception_ptr refused;  // the upstream cannot be saved now: only a save throws it
    if constexpr (resumable) {
      try {
        state_writer w(before);
        this->up().save(w);
      } catch (...) {
        refused = std::current_exception();
      }
    }
    const std::uint64_t k = pulls_++;  // an upstream error counts: it holds its place
    std::optional<value_t<Up>> e = this->pull_up();
    if (!e) {
      --pulls_;
      up_ended_ = true;
      return;
    }
    std::unique_ptr<slot> s;
    try {
      const in_user_code<T> user;  // fn runs user code (holds_ahead.hpp); its source is pulled after
      s = std::make_unique<slot>(std::invoke(fn_, std::move(*e)));
    } catch (...) {
      rethrow_element(std::current_exception(), name, k);
    }
    s->distance = k;
    s->anchor = std::move(before);
    s->anchor_error = std::move(refused);
    slots_[i] = std::move(s);
  }

  // workers > 0: the slot's elements come from its thread.
  std::optional<T> take(slot& s) {
    if (!s.p.started()) {
      if constexpr (resumable) {
        s.p.start(o_.buffer, o_.buffer - 1, names, &this->stats(), &this->stats(), [src = &s.src] { return src->next(); },
                  [src = &s.src](pipeline_state& st) {
                    st.words.clear();
                    state_writer w(st);
                    src->save(w);
                  });
      } else {
        s.p.start(o_.buffer, o_.buffer - 1, names, &this->stats(), &this->stats(), [src = &s.src] { return src->next(); },
                  nullptr);
      }
    }
    return s.p.take();
  }

  void halt() noexcept {
    for (auto& s : slots_)
      if (s) s->p.halt();
  }
  void start_epoch() {
    for (auto& s : slots_) s.reset();
    cur_ = in_block_ = 0;
    pulls_ = 0;
    up_ended_ = replay_ = false;
  }
  observe::stage_mode report_mode() const {
    return o_.workers ? observe::stage_mode::threaded_stage : observe::stage_mode::inline_stage;
  }
  std::size_t report_threads() const { return o_.workers ? slots_.size() : 1; }

  template <class G>
  void config(G&& g) const {
    g("cycle", slots_.size());
    g("block", o_.block);
  }
  // The anchor: the upstream before the oldest open slot's element (or where it is now).
  const slot* oldest() const {
    const slot* o = nullptr;
    for (const auto& s : slots_)
      if (s && (!o || s->distance < o->distance)) o = s.get();
    return o;
  }
  void save_upstream(state_writer& w) const {
    if (replay_) return w.put_words(replay_anchor_.words);  // restored, not yet replayed
    if (const slot* o = oldest()) {
      if (o->anchor_error) std::rethrow_exception(o->anchor_error);
      pipeline_state scratch;
      ask_save(this->up(), scratch);  // the anchor may predate the upstream's refusal
      w.put_words(o->anchor.words);
    } else
      this->up().save(w);
  }
  // The turn, then per slot: open?, its distance from the anchor, its source's words
  // (count first); then the upstream pulls from the anchor to now, whether it ended, and
  // the pulls before the anchor.
  void save_words(state_writer& w) const {
    if (replay_) return replay_table_.write(w, slots_.size());
    const slot* o = oldest();
    const std::uint64_t base_k = o ? o->distance : pulls_;
    if (pulls_ - base_k > interleave_table::max_since)
      throw config_error("interleave: cannot save now: the oldest open slot's element is " +
                         std::to_string(pulls_ - base_k) + " upstream pulls back, and a restore re-reads "
                         "at most " + std::to_string(interleave_table::max_since) +
                         " (one slot's source outlasting very many of the others'); save when it has ended");
    interleave_table t{cur_, in_block_, {}, pulls_ - base_k, up_ended_, base_k};
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      const auto& s = slots_[i];
      if (!s) continue;
      interleave_table::open_slot& os = t.open.emplace_back(interleave_table::open_slot{i, s->distance - base_k, {}});
      if (o_.workers && s->p.started()) {
        if (std::string e = s->p.save_error(); !e.empty()) throw config_error(e);
        os.words = s->p.position();
      } else {
        state_writer sw(os.words);
        s->src.save(sw);
      }
    }
    t.write(w, slots_.size());
  }
  void before_restore() noexcept {
    halt();
    start_epoch();
  }
  // Reads and checks the slot table; the first pull replays it (replay()).
  void restore_words(state_reader& r) {
    replay_table_ = interleave_table::read(r, slots_.size(), o_.block);
    replay_anchor_.words.clear();
    if constexpr (resumable_source<Up>) {
      state_writer aw(replay_anchor_);
      this->up().save(aw);
    }
    replay_ = true;
  }

  // After restore: the upstream sits at the anchor. Pull to where it was (swallowing the
  // errors among those pulls: the consumer had them), opening each saved slot's source
  // from its element again and restoring its position. A pull that opened a slot when the
  // state was saved and throws now (a file that changed, a read that failed), or fn or the
  // slot's restore throwing, leaves that slot's elements nowhere: the error goes out and
  // the stage is marked as a failed restore (stage.hpp), not read on without them.
  void replay() {
    replay_ = false;
    try {
      replay_table();
    } catch (...) {
      ferry_mark_restore_failed(*this);
      throw;
    }
  }
  void replay_table() {
    interleave_table& t = replay_table_;
    cur_ = static_cast<std::size_t>(t.cur);
    in_block_ = static_cast<std::size_t>(t.in_block);
    // The open slots by distance (distinct, each below t.since: read() checked).
    std::vector<interleave_table::open_slot*> by_distance;
    by_distance.reserve(t.open.size());
    for (interleave_table::open_slot& s : t.open) by_distance.push_back(&s);
    std::sort(by_distance.begin(), by_distance.end(), [](const auto* a, const auto* b) { return a->distance < b->distance; });
    auto next_open = by_distance.begin();
    for (std::uint64_t k = 0; k < t.since; ++k) {
      interleave_table::open_slot* opens = next_open != by_distance.end() && (*next_open)->distance == k ? *next_open : nullptr;
      if (opens) ++next_open;
      pipeline_state before;  // a slot's anchor: only for the pulls that open one
      if constexpr (resumable)
        if (opens) {
          state_writer w(before);
          this->up().save(w);
        }
      std::optional<value_t<Up>> e;
      if (opens)
        e = this->pull_up();
      else
        try {
          e = this->pull_up();
        } catch (...) {
          continue;  // handed out before the save
        }
      if (!e) throw config_error("restore_state: interleave: the upstream ended before the state's position");
      if (opens) {
        auto sl = [&] {
          const in_user_code<T> user;  // fn runs user code (holds_ahead.hpp)
          return std::make_unique<slot>(std::invoke(fn_, std::move(*e)));
        }();
        if constexpr (resumable) restore_state(sl->src, opens->words);
        sl->distance = t.base + k;
        sl->anchor = std::move(before);
        slots_[opens->slot] = std::move(sl);
      }
    }
    pulls_ = t.base + t.since;
    up_ended_ = t.ended;
    replay_table_ = {};
  }

  static constexpr producer_names names{"ferry interleave slot", "interleave: wait upstream",
                                        "interleave: wait downstream"};
  F fn_;
  interleave_options o_;
  std::vector<std::unique_ptr<slot>> slots_;
  std::size_t cur_ = 0, in_block_ = 0;
  std::uint64_t pulls_ = 0;  // upstream pulls this epoch (errors included)
  bool up_ended_ = false;
  bool replay_ = false;             // restored: replay() at the first pull
  interleave_table replay_table_;   // the restored slot table
  pipeline_state replay_anchor_;    // the upstream at the anchor (for a save before replaying)
};

inline std::size_t check_interleave_args(int_arg cycle_arg, std::size_t block) {
  const std::uint64_t cycle = cycle_arg.count("interleave", "cycle");
  if (cycle == 0) throw config_error("interleave: cycle must be at least 1 (got 0)");
  if (cycle > (std::size_t(1) << 16))
    throw config_error("interleave: cycle = " + std::to_string(cycle) + " sources open at once; at most 65536");
  if (block == 0) throw config_error("interleave: block must be at least 1 (got 0)");
  return static_cast<std::size_t>(cycle);
}

template <class F>
concept not_a_count = !std::is_arithmetic_v<std::remove_cvref_t<F>>;

}  // namespace detail

// Not a stage_adaptor: its options are a braced list, which a template parameter pack
// cannot take.
struct interleave_t {
  // The fn form.
  template <source S, detail::not_a_count F>
  auto operator()(S&& s, F fn, interleave_options o = {}) const {
    detail::require_rvalue_source<S>();
    static_assert(std::invocable<F&, value_t<S>&&>,
                  "ferry::interleave: fn must be callable with the upstream's element (E&&, const E& or E) "
                  "and return a source");
    if (o.cycle == 0) o.cycle = 4;
    detail::check_interleave_args(o.cycle, o.block);
    return detail::interleave_source<std::remove_cvref_t<S>, F>(std::forward<S>(s), std::move(fn), o);
  }
  // The fn form's closure, for `src | interleave(fn, options)`; checks the options now.
  template <detail::not_a_count F>
    requires(!source<F>)
  auto operator()(F fn, interleave_options o = {}) const {
    if (o.cycle == 0) o.cycle = 4;
    detail::check_interleave_args(o.cycle, o.block);
    return make_closure([fn, o]<class S>(S&& s) { return interleave_t{}(std::forward<S>(s), fn, o); });
  }
  // The file fast path.
  template <source S>
  auto operator()(S&& s, int_arg cycle_arg, interleave_options o = {}) const {
    detail::require_rvalue_source<S>();
    static_assert(detail::interleavable<std::remove_cvref_t<S>>,
                  "ferry::interleave(cycle) reads files itself: use it directly after from_files (and shard); "
                  "for other sources, interleave(fn, {.cycle = n}) with fn making a source of each element");
    const std::size_t cycle = detail::check_interleave_args(cycle_arg, o.block);
    return detail::interleave_files_source<std::remove_cvref_t<S>>(std::forward<S>(s), cycle,
                                                                  detail::interleave_params{o.workers, o.block, o.buffer});
  }
  // The file fast path's closure, for `from_files(...) | interleave(cycle, options)`.
  auto operator()(int_arg cycle_arg, interleave_options o = {}) const {
    const std::size_t cycle = detail::check_interleave_args(cycle_arg, o.block);
    return make_closure([cycle, o]<class S>(S&& s) { return interleave_t{}(std::forward<S>(s), cycle, o); });
  }
};
// interleave(fn, options) or interleave(cycle, options): elements of several sources at
// once, in a fixed order (see the file's top).
inline constexpr interleave_t interleave{};

}  // namespace ferry
