// ferry/stages/distribute.hpp: distribute(replicas, {.remainder}) splits each global batch
// into one batch per replica: tf.distribute's experimental_distribute_dataset for C++.
//
//   auto steps = std::move(src) | ferry::batch(256) | ferry::prefetch(2)
//              | ferry::distribute(ferry::host_replicas{4}, {.remainder = ferry::remainder_policy::pad});
//   auto steps = ... | ferry::distribute(ferry::cuda::devices{0, 1});   // ferry/cuda/devices.hpp
//   for (auto& step : steps)
//     for (std::size_t r = 0; r < step.replicas(); ++r) {
//       auto& rb = step[r];   // rb.field<0>(), rb.size(), rb.valid(), rb.device(), rb.stream()
//     }
//
// Splitting. A global batch of G rows goes to R replicas as R contiguous slices of G / R
// rows: replica r gets rows [r*G/R, (r+1)*G/R). G is distribute_options::global_batch, or
// the upstream batch stage's size (batch_size()), seen through the stages that pass
// batches on unchanged (prefetch, take, repeat, filter, shard), or else, when neither is
// known (e.g. a map() after batch()), it is inferred from the size of the first batch.
// Inference is wrong when that first batch is short (a dataset or shard with fewer than
// G rows): set global_batch when the pipeline hides batch(). A later batch larger than an
// inferred G proves it was wrong, and is a config_error saying so. G not divisible by R
// is a config_error; so is a batch larger than G, and under remainder_policy::drop a
// global_batch option larger than the upstream batch stage's size (every batch would be
// dropped). Fixed fields are split by rows; so are
// padded fields (padded_batch, bucket_by_sequence_length, pack: each replica's rows of L
// values and their lengths); a ragged field (batch() of vectors or strings) gives each
// replica its rows' values and their offsets rebased to start at 0
// (replica_batch::field<I>() is a ragged_view of them).
//
// The last batch (any batch shorter than G, m rows) follows remainder_policy; every
// replica always gets the same NUMBER of steps, so collective training never hangs:
//   drop     the short batch is skipped (the default: every step is full).
//   pad      it is padded to G rows with zero-valued rows (a value-initialised T, so the
//            element type must be default-constructible): every replica's slice has
//            size() == G/R, and valid() says how many leading rows are real; rows at and
//            after valid() are zeros (replicas past the data get valid() == 0).
//   partial  the m rows are split as evenly as possible: replica r gets m/R rows, plus
//            one for r < m%R, contiguous and in order; size() == valid(); a replica may
//            get 0 rows (empty spans, but still a step).
//
// Backends are chosen by the tag, found by argument-dependent lookup of
// make_distribute_backend(tag) (the way Thrust picks a system):
//   host_replicas{n}   n replicas in host memory: zero-copy views of the host batch, so
//                      the whole API runs and is tested without a GPU. device() == -1,
//                      stream() == nullptr. A step's data lives as long as the step.
//   cuda::devices{...} one replica per listed device: see ferry/cuda/devices.hpp for the
//                      copies, streams and the release contract.
//
// Order: steps come in upstream order; within a step replica r holds the r-th slice.
// rewind() forwards to the upstream and starts the step count again.
//
// Threads: runs on the thread calling next(), and so does everything upstream that has no
// thread of its own, unless distribute_options::staging_thread is set for a backend that
// copies (CUDA): then one thread of distribute's own, started by the first next(), pulls
// the upstream (user functions of stages without threads run on it), makes the steps and
// enqueues their copies, up to steps_ahead ready; the consumer's next() takes a ready step,
// releases the one before and orders its streams after the copies. The destructor,
// rewind() and restore() stop that thread and join it at once (waiting only for a step
// being made).
//
// Errors: config_error as above, and when distribute() is called: pad with an element
// type that is not default-constructible, or steps_ahead out of range (0 or 1; 1 to 64
// with staging_thread); onto devices, a next() called where a stage holds what it pulls
// (prefetch's thread, map's workers, interleave's slot threads, shuffle filling a window)
// throws config_error before making a step: a device step is valid only until the next
// one is asked for (detail/holds_ahead.hpp); at the first next(), drop over batches short
// by design (bucket_by_sequence_length with differing batch sizes or a token budget), or
// pad under a token budget, is a config_error (use partial); cuda_error from the CUDA backend. Upstream
// errors propagate unchanged; one met while making a step ahead (or on the staging thread) is thrown by
// the next() that would have returned that step, so errors come in the same place in the
// sequence.
//
// Memory: before the first pull, distribute hands the backend's batch memory (the
// process-wide pinned pool for CUDA, a private pool for host replicas, or
// distribute_options::host_resource) up the pipeline with set_buffer_resource, so batch()
// collates straight into it and each row is written once and copied to the GPU from there.
// Besides the step the consumer holds, at most one step is made ahead (steps_ahead = 1),
// or up to steps_ahead with the staging thread.
//
// Checkpoints: save() records the upstream's position after the last step handed out (a
// step made ahead is not part of it: a restore makes it again), then distribute's tag and
// the number of steps handed out this epoch and an inferred G (restored with it, not
// inferred again from the batch after the saved position); it throws config_error when the
// upstream cannot be saved (an unordered map). restore() drops the steps made ahead
// (stopping the staging thread) and restores the upstream, the step count and an inferred
// G; a state of another shape, or whose inferred G differs from a global_batch option, is
// a config_error.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <memory_resource>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/cuda/nvtx.hpp"
#include "ferry/cuda/stream_handle.hpp"
#include "ferry/detail/holds_ahead.hpp"
#include "ferry/detail/producer.hpp"
#include "ferry/error.hpp"
#include "ferry/memory/buffer.hpp"
#include "ferry/memory/pinned.hpp"
#include "ferry/observe/hooks.hpp"
#include "ferry/stage.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/detail/distribute_plan.hpp"
#include "ferry/stages/detail/step_ahead.hpp"
#include "ferry/step.hpp"

namespace ferry {

// distribute()'s options, a braced list: distribute(tag, {.remainder = remainder_policy::pad}).
struct distribute_options {
  remainder_policy remainder = remainder_policy::drop;  // the last, short batch
  // Global batch size G; 0 means: ask batch() upstream (through pass-through stages), else
  // infer it from the first batch's size (wrong if that batch is short: set it then).
  std::size_t global_batch = 0;
  // Where batch() collates; null means the backend's default (pinned pool for CUDA).
  std::shared_ptr<std::pmr::memory_resource> host_resource = nullptr;
  // Backends that copy (CUDA): 1 makes step k+1 (its copies enqueued) when handing out
  // step k, so the copy runs beside step k's compute even when the consumer waits for
  // each step's result on the host (a trainer reading its loss); 0 makes each step when
  // asked for. Anything else is a config_error, also for host replicas, which copy
  // nothing: there a valid value has no effect (one set of options serves both backends).
  std::size_t steps_ahead = 1;
  // Backends that copy (CUDA): make steps on a thread of distribute's own (tf.data's
  // prefetch_to_device), up to steps_ahead (1 to 64; 4 is a good start) ready ahead, so
  // the consumer's next() does no copy work: it releases the step before, orders its
  // streams after the copies and takes the next step. For a consumer thread that is the
  // bottleneck (a small model's launches): its next() fell from 16 to a few microseconds
  // on an H200 (docs/distribute.md). Everything upstream then runs on that thread. Host
  // replicas copy nothing: there it has no effect, but steps_ahead is checked as above.
  bool staging_thread = false;
};


namespace detail {

template <source Up, class Backend>
class distribute_source
    : public threaded_stage<distribute_source<Up, Backend>, Up, step<typename value_t<Up>::element_type>> {
  using in_t = value_t<Up>;
  static_assert(is_batch_of<in_t>::value,
                "ferry::distribute: the upstream must yield batches: put batch(global_size) "
                "(and prefetch) before distribute()");
  using T = typename in_t::element_type;
  friend threaded_stage<distribute_source, Up, step<T>>;
  static constexpr bool backend_copies = requires { Backend::copies_to_devices; };
  static constexpr bool resumable = resumable_source<Up>;

 public:
  using value_type = step<T>;
  static constexpr char name[] = "distribute";
  // Steps change the element type: no batch() size goes past distribute.
  static constexpr bool changes_batch_size = true;

 private:
  // What making a step touches besides the upstream. On the heap, so the stage can move
  // while the staging thread (which holds a pointer to it) runs.
  struct shared {
    shared(Backend b, distribute_options opt) : be(std::move(b)), o(std::move(opt)) {}
    Backend be;
    distribute_options o;
    std::shared_ptr<std::pmr::memory_resource> res;
    std::vector<replica_slice> slices;
    std::atomic<std::size_t> global{0};
    std::atomic<std::uint64_t> dropped{0};
    std::uint64_t index = 0;  // steps made this epoch
    std::atomic<bool> inferred{false};  // G came from the first batch (a save on the consumer's
                                        // thread may read it while the staging thread sets it)
    observe::stage_counters stager_stats;  // the staging thread's making of steps
  };

 public:
  distribute_source(Up up, Backend be, distribute_options o)
      : threaded_stage<distribute_source, Up, step<T>>(std::move(up)), s_(std::make_unique<shared>(std::move(be), std::move(o))) {
    const distribute_options& opt = s_->o;
    check_distribute_options(opt.remainder, std::is_default_constructible_v<T>, opt.global_batch, replicas(),
                             opt.staging_thread, opt.steps_ahead);
  }
  distribute_source(distribute_source&&) noexcept = default;
  ~distribute_source() {
    p_.halt();  // the staging thread's queued steps go first, then the step made ahead
    ahead_.drop();
    release_previous();
  }

  std::size_t replicas() const noexcept { return s_->be.replicas(); }
  // The global batch size, once known (0 before the first batch when it has to be inferred).
  std::size_t global_batch() const noexcept { return s_->global.load(std::memory_order_relaxed); }
  // Whether an upstream batch stage took distribute's memory (false: batches come from
  // wherever upstream puts them; for CUDA that may be pageable memory, copied slower).
  bool collates_into_distribute_memory() const noexcept { return hooked_; }
  // Short batches skipped under remainder_policy::drop, over this stage's life.
  std::uint64_t dropped() const noexcept { return s_->dropped.load(std::memory_order_relaxed); }
  const std::shared_ptr<std::pmr::memory_resource>& host_resource() const noexcept { return s_->res; }
  Backend& backend() noexcept { return s_->be; }

 private:
  bool staging() const noexcept { return backend_copies && s_->o.staging_thread; }
  // report()'s row. Inline: this stage's counters. With the staging thread, two threads'
  // counters make it: the consumer's (steps handed out, its time in next(), its waits for
  // the staging thread) and, as work, the staging thread's time making steps net of its
  // pulls from upstream (the upstream's row, just added, is that thread's time in it).
  // Only the staging thread's inclusive time, as before, counted the whole upstream as
  // distribute's own, which then took the bottleneck from the stage that was.
  void add_report_row(observe::stage_visitor& v) const {
    if (!staging()) return v.add(name, this->stats(), observe::stage_mode::inline_stage, 1);
    if (v.resetting()) {
      v.add(name, this->stats(), observe::stage_mode::threaded_stage, 1);
      v.add(name, s_->stager_stats, observe::stage_mode::threaded_stage, 1);
      return;
    }
    const std::uint64_t up = v.stages().empty() ? 0 : v.stages().back().incl, made = s_->stager_stats.incl.get();
    observe::stage_counters row = this->stats();
    row.work.set(made > up ? made - up : 0);
    row.wait_down = s_->stager_stats.wait_down;
    v.add(name, row, observe::stage_mode::threaded_stage, 1);
  }

  std::optional<value_type> pull() {
    if constexpr (backend_copies)
      if (holds_ahead) refuse_holder();
    if (!started_) start();
    if (staging()) return next_staged();
    auto pull_up = [this] { return this->pull_up(); };
    if (!backend_copies || s_->o.steps_ahead == 0) {
      // Made before the previous step is released, so the new step's blocks are not the
      // ones the consumer's work on the previous step still reads.
      std::optional<value_type> st = make_next(*s_, pull_up);
      release_previous();
      if (st) hand_out(*st);
      return st;
    }
    return ahead_.template next<resumable>([&] { return make_next(*s_, pull_up); }, [&] { release_previous(); },
                                           [&](value_type& st) { hand_out(st); },
                                           [&](state_writer& w) {
                                             if constexpr (resumable) this->up().save(w);
                                           });
  }

  // staging_thread: steps come made from the queue; the consumer only releases the step
  // before, orders its streams after the copies (hand_out) and takes the next one.
  std::optional<value_type> next_staged() {
    release_previous();  // the consumer has enqueued its work on the step before
    std::optional<value_type> st = p_.take();  // an error made there is thrown here, in place
    if (!st) return std::nullopt;
    handed_ = st->index() + 1;
    hand_out(*st);
    return st;
  }

  // The step becomes the consumer's: it is released at the next request. A backend that
  // copies orders the consumer's stream after the copies now (not when the step was made,
  // which with a step made ahead would put them before the consumer's work on the step
  // before, and serialise copy and compute).
  void hand_out(value_type& st) {
    last_ = step_access::lease(st);
    if constexpr (requires { s_->be.hand_out(st); }) s_->be.hand_out(st);
  }

  // Pulls the next batch (skipping dropped ones) and has the backend make its step. Runs on
  // the consumer's thread, or on the staging thread.
  template <class Pull>
  static std::optional<value_type> make_next(shared& c, Pull& pull) {
    const std::size_t R = c.be.replicas();
    for (;;) {
      std::optional<in_t> b = pull();
      if (!b) return std::nullopt;
      const std::size_t m = b->size();
      if (m == 0) continue;
      const std::size_t global = settle_global_batch(c.global, c.inferred, m, R);
      c.slices.resize(R);
      if (!plan_slices(m, global, c.o.remainder, c.slices)) {
        c.dropped.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      if (m < global && c.o.remainder == remainder_policy::pad) {
        if constexpr (std::is_default_constructible_v<T>) b = pad_batch(c.res, global, *b);
      }
      auto host = std::make_shared<const in_t>(std::move(*b));
      cuda::nvtx_range range("ferry distribute: copy to replicas");
      value_type st = c.be.template make_step<T>(std::move(host), c.slices, global / R, c.index);
      ++c.index;  // counts steps made, not attempts
      return st;
    }
  }

  // Stops the staging thread and joins it (it waits only for a step being made); the
  // steps it made ahead go.
  void halt() noexcept { p_.halt(); }
  void start_epoch() {
    drop_ahead();
    s_->index = 0;
    handed_ = 0;
  }
  void drop_ahead() noexcept {
    p_.reset();
    ahead_.drop();
    release_previous();
    started_ = false;
  }

  // The upstream position after the last step handed out (a step made ahead is not part
  // of it: a restore makes it again).
  void save_upstream(state_writer& w) const {
    if (staging() && started_) {
      if (std::string e = p_.save_error(); !e.empty()) throw config_error(e);
      w.put_words(p_.position().words);
      return;
    }
    if (ahead_.ahead())
      w.put_words(ahead_.position().words);  // upstream has been pulled one batch further
    else
      this->up().save(w);
  }
  // The step index, its top bit set to say a second word follows: the global batch size
  // when it was inferred from the first batch (0 otherwise). A restore must not infer it
  // again from the batch after the saved position, the short last one perhaps (which then
  // went out as a full step, or did not divide among the replicas). States of one word
  // (saved before) restore as before.
  static constexpr std::uint64_t with_global = std::uint64_t(1) << 63;
  void save_words(state_writer& w) const {
    const std::uint64_t index = staging() && started_ ? handed_ : ahead_.holds_step() ? s_->index - 1 : s_->index;
    w.put(index | with_global);
    w.put(s_->inferred.load(std::memory_order_relaxed) ? s_->global.load(std::memory_order_relaxed) : 0);
  }
  void before_restore() noexcept { drop_ahead(); }  // steps made from the position being left go
  void restore_words(state_reader& r) {
    const std::uint64_t word = r.get();
    const std::uint64_t inferred = word & with_global ? r.get() : 0;
    if (inferred != 0) {
      if (s_->o.global_batch != 0 && s_->o.global_batch != inferred)
        throw_config_mismatch(name, "global_batch", inferred, s_->o.global_batch, false);
      check_global_batch(inferred, replicas(), global_batch_from::inferred);
      s_->global.store(inferred, std::memory_order_relaxed);
      s_->inferred.store(true, std::memory_order_relaxed);
    }
    s_->index = handed_ = word & ~with_global;
  }

  void start() {
    shared& c = *s_;
    if (!c.res) {  // once: batch() keeps the resource it was given across epochs
      c.res = c.o.host_resource ? c.o.host_resource : c.be.default_host_resource();
      hooked_ = forward_buffer_resource(this->up(), c.res);
    }
    if (c.global.load(std::memory_order_relaxed) == 0) c.global.store(c.o.global_batch, std::memory_order_relaxed);
    if constexpr (sized_batches<Up>) {
      const std::size_t b = this->up().batch_size();  // 0: unknown (any_source)
      // Under drop, an option above batch()'s size would make every batch short: all
      // dropped without a word. (pad and partial keep every row: steps of G with padding,
      // or short steps, may be meant. Below it is fine: a token budget's size is max_tokens.)
      if (c.o.remainder == remainder_policy::drop && c.o.global_batch > b && b != 0)
        throw config_error("distribute: distribute_options::global_batch is " + std::to_string(c.o.global_batch) +
                           ", more than the upstream batch stage's batch_size() of " + std::to_string(b) +
                           ": under remainder_policy::drop every batch would be short and dropped; give them one "
                           "size (or pad or partial to keep short batches)");
      // Batches short by design (bucket_by_sequence_length's differing sizes or token
      // budget): drop would drop nearly all of them without a word (a budget's G is
      // max_tokens, which no batch of rows x L <= max_tokens reaches), and pad would make
      // each max_tokens rows of its width (one long row: max_tokens x L values).
      if constexpr (requires { this->up().batch_size_kind(); }) {
        if (c.o.global_batch == 0) {  // G is that bound (an explicit global_batch is the user's choice)
          const auto [bound, budget] = this->up().batch_size_kind();
          if (bound && c.o.remainder == remainder_policy::drop)
            throw config_error("distribute: the upstream's batches differ in size by design "
                               "(bucket_by_sequence_length " +
                               std::string(budget ? "under a token budget" : "with batch sizes that differ") +
                               "; its batch_size() of " + std::to_string(b) + " is their bound): under "
                               "remainder_policy::drop every shorter one would be dropped without a word; use "
                               "remainder_policy::partial (each replica its share of every batch)");
          if (budget && c.o.remainder == remainder_policy::pad)
            throw config_error("distribute: under a token budget (bucket_by_sequence_length's max_tokens = " +
                               std::to_string(b) + ") remainder_policy::pad would pad every batch to " +
                               std::to_string(b) + " rows of its width; use remainder_policy::partial");
        }
      }
      if (c.global.load(std::memory_order_relaxed) == 0 && b != 0) {
        check_global_batch(b, c.be.replicas(), global_batch_from::upstream);
        c.global.store(b, std::memory_order_relaxed);
      }
    }
    if (!staging()) {
      started_ = true;
      return;
    }
    if constexpr (requires { c.be.set_staging_depth(std::size_t{1}); }) c.be.set_staging_depth(c.o.steps_ahead);
    // The producer's thread must not wait for the device: its pinned frees go to the
    // consumer's next() (deferred_frees.hpp), as its device frees do.
    auto make = [sh = s_.get(), pull = this->upstream_puller()]() mutable {
      return observe::observed_next(sh->stager_stats, name, [&] { return make_next(*sh, pull); });
    };
    // Counted only once its thread runs: a thread that could not be made is thrown by this
    // next(), and the next one tries again instead of waiting on an empty queue.
    p_.start(c.o.steps_ahead, c.o.steps_ahead / 2, names, &this->stats(), &c.stager_stats, std::move(make),
             this->upstream_saver());
    started_ = true;
  }

  // A stage above holds steps while it pulls more (holds_ahead.hpp): its steps' blocks would
  // be reused under it. Refused before any step is made.
  [[noreturn]] static void refuse_holder() {
    std::string who = holds_ahead;
    if (who.rfind("ferry ", 0) == 0) who = who.substr(6) + "'s thread";
    throw config_error("distribute onto devices is pulled by " + who +
                       ", which holds steps while it pulls more; but a device step is valid only until the next one "
                       "is asked for (its device blocks are reused then), so nothing may hold steps ahead: put that "
                       "stage before distribute() (distribute_options::staging_thread makes steps ahead itself)");
  }

  void release_previous() noexcept {
    if (auto l = last_.lock()) l->release();
    last_.reset();
  }

  static constexpr producer_names names{"ferry distribute", "distribute: wait staging thread",
                                        "distribute: wait consumer"};
  std::unique_ptr<shared> s_;
  producer<value_type> p_;  // the staging thread (staging_thread only)
  std::weak_ptr<step_lease> last_;
  step_ahead<value_type> ahead_;  // steps_ahead = 1 without the staging thread
  std::uint64_t handed_ = 0;  // steps handed out this epoch (staging_thread)
  bool started_ = false;
  bool hooked_ = false;
};

}  // namespace detail

// The type of ferry::distribute: distribute(src, tag, options), or distribute(tag, options)
// for `src | distribute(tag)`. The tag (host_replicas, cuda::devices) picks the backend.
struct distribute_t {
  // Builds the stage over src (moved in); throws config_error for bad options.
  template <source S, class Tag>
    requires requires(const Tag& t) { make_distribute_backend(t); }
  auto operator()(S&& s, const Tag& tag, distribute_options o = {}) const {
    detail::require_rvalue_source<S>();
    using Be = decltype(make_distribute_backend(tag));
    return detail::distribute_source<std::remove_cvref_t<S>, Be>(
        std::forward<S>(s), make_distribute_backend(tag), std::move(o));
  }
  // A closure for `src | distribute(tag, options)`; the options are checked when it is
  // applied.
  template <class Tag>
    requires(!source<Tag>) && requires(const Tag& t) { make_distribute_backend(t); }
  auto operator()(const Tag& tag, distribute_options o = {}) const {
    return make_closure([tag, o]<class S>(S&& s) { return distribute_t{}(std::forward<S>(s), tag, o); });
  }
};
// distribute(tag, options): splits each global batch into one batch per replica (see the
// file's top).
inline constexpr distribute_t distribute{};

}  // namespace ferry
