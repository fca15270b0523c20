// ferry/stage.hpp: the base every ferry stage and source is built on. It owns the
// upstream(s), the stage's counters and the probe, and supplies the whole pull protocol
// (source.hpp) as the default that is right for a stage passing elements on one to one.
// A stage writes only what differs; what it cannot do it says in one visible place.
//
//   template <ferry::source Up, class P>
//   class filter_source : public ferry::stage<filter_source<Up, P>, Up> {
//     friend ferry::stage<filter_source, Up>;      // the base calls the private hooks
//    public:
//     static constexpr char name[] = "filter";     // report() rows, checkpoint tags, errors
//     filter_source(Up up, P p) : ferry::stage<filter_source, Up>(std::move(up)), p_(std::move(p)) {}
//    private:
//     std::optional<value_t<Up>> pull();          // required: the next element, or the end
//     void save_words(state_writer&) const;       // its own position words (with restore_words)
//     void restore_words(state_reader&);
//     void start_epoch();                         // after the upstream's rewind()
//   };
//
// What the base supplies (each only where the upstreams can do it too):
//   next()                 pull() with the moved-from check, counted and timed for report()
//   next_bulk(out)         when the stage has pull_bulk(out)      (batch() fills in runs)
//   next_borrowed(out, n)  when the stage has pull_borrowed(out, n) (records as views)
//   next_view(n)           when the stage has pull_view(n)         (contiguous sources)
//   rewind()               halt() if the stage has threads, every upstream's rewind(),
//                          then start_epoch(); a source (no upstream) is rewindable when
//                          it has start_epoch(). One that throws (a file that cannot be
//                          reopened) marks every stage it throws through, as a failed
//                          restore does: their threads are stopped and no epoch started,
//                          so a next() would wait for nothing or read on from anywhere;
//                          a rewind() that succeeds clears it. An upstream that throws
//                          and stays usable (not marked: cache_on_device then streams)
//                          counts as rewound: the stage starts its epoch, then throws.
//                          before_rewind(), where the stage has it, runs after halt()
//                          and before the upstreams' rewind: what it resets is reset
//                          even when that throws (lockstep's epoch state).
//   save(w) / restore(r)   the checkpoint rule, once: every upstream's words first (or
//                          the stage's save_upstream(w), for a stage that is ahead of its
//                          upstream, with restore_upstream(r) when the stage holds its
//                          upstreams itself), then the stage's tag, its configuration words
//                          (config(f), calling f(name, value) for each parameter a
//                          restore must match, f(name, hash, true) for a fingerprint: a
//                          restore into another configuration is a config_error naming
//                          it), then save_words(w).
//                          restore() calls before_restore() first (a stage with threads
//                          refuses once started, or stops them). A restore that throws
//                          (another configuration, a damaged or foreign state) leaves the
//                          stages it reached restored and the rest not, so every stage it
//                          throws through is marked: next() and the other pulls, and save(),
//                          then throw config_error until rewind() (which restarts every
//                          stage's epoch) or a restore() that succeeds. restore_state marks
//                          the pipeline too when it refuses a state longer than the
//                          pipeline's. A stage built over a marked pipeline is marked.
//                          A pull refused so, in a pipeline that joins collectives,
//                          first calls refused_pull() on the stages below that have it,
//                          down a chain of one-upstream stages (lockstep joins its
//                          step's all-reduce, flagged as failed).
//   batch_size()           the upstream's, for distribute(): a stage of one upstream whose
//                          elements keep their type keeps batches whole unless it says
//                          `static constexpr bool changes_batch_size = true;`. Several
//                          upstreams: their common size, 0 (unknown) when they differ.
//                          A stage that collates batches (batch, padded_batch, pack,
//                          bucket_by_sequence_length) says so with `collation&
//                          collates()`: its rows per batch are its batch_size().
//   replicas()             distribute()'s replicas per step, passed on by a stage of one
//                          upstream whose elements keep their type (take, filter, prefetch
//                          over host replicas' steps), for lockstep()'s empty steps
//   set_buffer_resource(r) kept by a stage that collates (collates().resource: where it
//                          collates from), else handed to every upstream
//   visit_stages(v)        the upstreams' rows, then this stage's (report_mode(),
//                          report_threads() and report_counters() when the stage has
//                          threads of its own; add_report_row(v) when its row is made of
//                          counters of two threads)
// Opt-outs, each a visible line in the stage:
//   static constexpr bool changes_batch_size = true;   no batch_size()
//   static constexpr bool cannot_save = true;          no save()/restore()
//   static constexpr bool usable_when_start_epoch_throws = true;
//                                                      not marked when its own
//                                                      start_epoch() throws in rewind()
// A source (no upstream) must have save_words/restore_words unless it cannot save.
//
// Storage: stage<> keeps the upstream inside the stage object; threaded_stage<> keeps it in
// a heap block, so the stage can move while its threads hold the upstream's address, and
// the block's address never changes (moves and move-assignments swap blocks). join_stage<>
// takes several upstreams (zip, concatenate), source_base<> none.
//
// Moved from: every protocol member of a moved-from stage throws config_error naming the
// stage (a pipeline moved into the next stage must be used through that one), and so does
// building a stage over it; live() says which. The moved-from check and the failed-restore
// mark are one byte, tested once per element (check_live()).
//
// Throws: what the stage's own members throw; config_error as above. Runs user code only
// through the stage's members, on the thread that calls them.
#pragma once

#include <cstddef>
#include <concepts>
#include <cstdint>
#include <exception>
#include <memory>
#include <memory_resource>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "ferry/error.hpp"
#include "ferry/memory/buffer.hpp"
#include "ferry/observe/hooks.hpp"
#include "ferry/source.hpp"

namespace ferry {

struct borrowed_records;

// What a stage that collates batches holds, and hands the base through `collation&
// collates()`: the rows a batch has (the base's batch_size(), for distribute()) and the
// memory it collates from, a buffer_pool of its own until distribute() hands it its pinned
// pool (the base's set_buffer_resource).
struct collation {
  std::size_t rows = 0;  // rows per batch (a short last batch may have fewer)
  std::shared_ptr<std::pmr::memory_resource> resource;  // never null
  // rows only bounds a batch's rows: batches are short by design (bucket_by_sequence_length
  // with batch sizes that differ; `budget`: under a token budget, rows = max_tokens).
  // distribute() refuses to drop (or, under a budget, pad) them (batch_size_kind()).
  bool bound = false, budget = false;
  // resource null: a buffer_pool of the stage's own. Throws std::bad_alloc.
  collation(std::size_t n, std::shared_ptr<std::pmr::memory_resource> r)
      : rows(n), resource(r ? std::move(r) : std::make_shared<buffer_pool>()) {}
};

namespace detail {

enum class upstream_storage { in_place, heap };

// The opt-outs, read only when asked for (the stage is complete by then).
template <class D>
concept says_changes_batch_size = requires { requires D::changes_batch_size; };
template <class D>
concept says_cannot_save = requires { requires D::cannot_save; };
// A stage whose next() joins a collective on every rank (lockstep) says
// `static constexpr bool joins_collective = true;`.
template <class D>
concept says_joins_collective = requires { requires D::joins_collective; };
// Whether S's next() joins a collective: S says so, or a stage below it does (through a
// stage_base's joins_collectives()). Such a source must be pulled by the rank's own thread,
// as often on every rank: never from a thread that reads ahead (prefetch, map's workers).
template <class S>
constexpr bool joins_collectives() {
  if constexpr (requires { S::joins_collectives(); })
    return S::joins_collectives();
  else
    return says_joins_collective<S>;
}

// Whether pulling s joins a collective, asked of the object: what joins_collectives<S>()
// says, or what s says at run time (a stage whose options decide it, cache_on_device with
// .ranks or .devices; an any_source, whose held pipeline's type is not S).
template <class S>
bool joins_collectives_now(const S& s) noexcept {
  if constexpr (joins_collectives<S>())
    return true;
  else if constexpr (requires { { s.joins_collectives_at_run_time() } -> std::convertible_to<bool>; })
    return s.joins_collectives_at_run_time();
  else
    return false;
}

[[noreturn, gnu::cold, gnu::noinline]] inline void throw_moved_from(const char* stage) {
  throw config_error(std::string(stage) +
                     ": used after it was moved from (a pipeline moved into the next stage, or into "
                     "another variable, is used through that one)");
}

// What a stage can be used for: everything, nothing (moved from), or everything but pulls
// and save() (a restore threw through it: see the file's top). One byte, so that
// check_live() stays one compare per element.
enum class stage_state : std::uint8_t { ready, moved_from, restore_failed };

[[noreturn, gnu::cold, gnu::noinline]] inline void throw_unusable(const char* stage, stage_state s) {
  if (s == stage_state::moved_from) throw_moved_from(stage);
  throw config_error(std::string(stage) +
                     ": a restore or rewind() of this pipeline failed part way (some of its stages "
                     "took the new position, others not, so its elements would be neither the "
                     "state's nor a fresh epoch's): rewind() it, or restore a state that matches "
                     "it, before next() or save_state()");
}

// Whether a restore into u failed part way (a ferry stage says so through its hidden
// friend; any other source never).
template <class U>
bool restore_failed_in(const U& u) noexcept {
  if constexpr (requires { { ferry_restore_failed(u) } -> std::same_as<bool>; })
    return ferry_restore_failed(u);
  else
    return false;
}

// Tells the pipeline u that a pull of it is refused (a restore or rewind() failed part way
// at or above it): a stage that joins a collective on each pull (lockstep) joins it once,
// flagged, so that the other ranks do not wait for this one. Through ferry stages and an
// any_source's held pipeline, upstreams first (the order their pulls would run); a cold
// path. Throws what the collective throws.
template <class U>
void tell_refused_pull(U& u) {
  if constexpr (requires { ferry_refused_pull(u); }) ferry_refused_pull(u);
}

// u.rewind(). When it throws and u is a ferry stage that stays usable (not marked:
// cache_on_device gives its cache up and streams), the error goes to `kept` (the first
// one) and the caller goes on as after a rewind; otherwise (marked, or a source that
// cannot say) it propagates.
template <class U>
void rewind_upstream(U& u, std::exception_ptr& kept) {
  try {
    u.rewind();
  } catch (...) {
    if constexpr (requires { { ferry_restore_failed(u) } -> std::same_as<bool>; })
      if (!ferry_restore_failed(u)) {
        if (!kept) kept = std::current_exception();
        return;
      }
    throw;
  }
}

// A pipeline handed to a stage (or an any_source) must be live: a moved-from stage's
// members throw, but a stage reading it through its probe does not ask (a live stage's
// upstream is live), so it is refused where it is handed over, once.
template <class U>
U&& live_or_throw(U&& u) {
  if constexpr (requires { { u.live() } -> std::same_as<bool>; requires requires { std::remove_cvref_t<U>::name; }; })
    if (!u.live()) throw_moved_from(std::remove_cvref_t<U>::name);
  return std::forward<U>(u);
}

// A value the stage states (a seed, a shard index) is named with both values; a
// fingerprint (of a file list, a format) only by what differs.
[[noreturn, gnu::cold, gnu::noinline]] inline void throw_config_mismatch(const char* stage, const char* what,
                                                                         std::uint64_t saved, std::uint64_t mine,
                                                                         bool fingerprint) {
  const std::string diff = fingerprint ? std::string("the state was saved with another ") + what
                                       : std::string("the state was saved with ") + what + " = " +
                                             std::to_string(saved) + ", this pipeline has " + what + " = " +
                                             std::to_string(mine);
  throw config_error("restore_state: " + std::string(stage) + ": " + diff +
                     " (a checkpoint of another configuration would repeat or lose elements)");
}

template <class Derived, class Value, upstream_storage S, class... Ups>
class stage_base : public source_interface<Derived> {
  struct node {
    // Tagged: an untagged node(Ups...) would be a candidate for node(node&&) too, and an
    // upstream that converts from any source (any_source) would then ask whether node is
    // a source, which asks whether node moves: a constraint that depends on itself.
    explicit node(std::in_place_t, Ups... u) : ups(std::move(u)...) {}
    std::tuple<Ups...> ups;
    observe::stage_counters stats;
    [[no_unique_address]] std::tuple<observe::upstream_probe<Ups>...> probes;
  };
  static constexpr bool heap = S == upstream_storage::heap;
  using holder = std::conditional_t<heap, std::unique_ptr<node>, node>;
  static constexpr std::size_t n_ups = sizeof...(Ups);
  template <std::size_t I>
  using up_t = std::tuple_element_t<I, std::tuple<Ups...>>;

  // What the stage has, asked here (the stage is complete by then, and befriends its base).
  template <class D = Derived>
  static constexpr bool has_pull_bulk() {
    return requires(D& d, std::span<Value> s) { d.pull_bulk(s); };
  }
  template <class Out, class D = Derived>
  static constexpr bool has_pull_borrowed() {
    return requires(D& d, Out& o, std::size_t m) { d.pull_borrowed(o, m); };
  }
  template <class D = Derived>
  static constexpr bool has_pull_view() {
    return requires(D& d, std::size_t m) { d.pull_view(m); };
  }
  template <class D = Derived>
  static constexpr bool has_start_epoch() {
    return requires(D& d) { d.start_epoch(); };
  }
  template <class D = Derived>
  static constexpr bool keeps_usable_on_start_epoch_error() {
    return requires { requires D::usable_when_start_epoch_throws; };
  }
  template <class D = Derived>
  static constexpr bool has_config() {
    return requires(const D& d) { d.config([](const char*, std::uint64_t, bool = false) {}); };
  }
  template <class D = Derived>
  static constexpr bool has_words() {
    constexpr bool s = requires(const D& d, state_writer& w) { d.save_words(w); };
    constexpr bool r = requires(D& d, state_reader& rd) { d.restore_words(rd); };
    static_assert(s == r, "ferry stage: save_words and restore_words come together");
    return s;
  }
  template <class D = Derived>
  static constexpr bool can_rewind() {
    if constexpr (n_ups == 0)
      return has_start_epoch<D>();
    else
      return (rewindable_source<Ups> && ...);
  }
  template <class D = Derived>
  static constexpr bool can_save() {
    if constexpr (says_cannot_save<D>) {
      return false;
    } else if constexpr (n_ups == 0) {
      static_assert(has_words<D>(),
                    "ferry source: write save_words/restore_words (its position), or say "
                    "`static constexpr bool cannot_save = true;`");
      return true;
    } else {
      return (resumable_source<Ups> && ...);
    }
  }
  template <class D = Derived>
  static constexpr bool collates_batches() {
    return requires(D& d) { { d.collates() } -> std::same_as<collation&>; };
  }
  template <class D = Derived>
  static constexpr bool forwards_replicas() {
    if constexpr (n_ups != 1)
      return false;
    else
      return std::same_as<value_t<up_t<0>>, Value> &&
             requires(const up_t<0>& u) { { u.replicas() } -> std::convertible_to<std::size_t>; };
  }
  template <class D = Derived>
  static constexpr bool forwards_batch_size() {
    if constexpr (n_ups == 0 || says_changes_batch_size<D> || collates_batches<D>())
      return false;
    else
      return ((sized_batches<Ups> && std::same_as<value_t<Ups>, Value>) && ...);
  }

 public:
  using value_type = Value;

  // Whether next() joins a collective (the stage says joins_collective, or an upstream's
  // does): see detail::joins_collectives.
  template <class D = Derived>
  static constexpr bool joins_collectives() {
    if constexpr (says_joins_collective<D>)
      return true;
    else
      return (detail::joins_collectives<Ups>() || ...);
  }
  // The same, asked at run time: also true when the stage says so from its options
  // (`bool joins_collective_now() const noexcept`, e.g. cache_on_device with .ranks) or an
  // upstream does (an any_source holding lockstep). prefetch and map's workers refuse such
  // an upstream with config_error at construction.
  bool joins_collectives_at_run_time() const noexcept {
    if constexpr (joins_collectives())
      return true;
    else {
      if (!live()) return false;  // no upstream to ask (its members throw anyway)
      if constexpr (requires(const Derived& d) { { d.joins_collective_now() } -> std::same_as<bool>; })
        if (self().joins_collective_now()) return true;
      return [&]<std::size_t... I>(std::index_sequence<I...>) {
        return (detail::joins_collectives_now(std::get<I>(n().ups)) || ...);
      }(std::make_index_sequence<n_ups>{});
    }
  }
  // False once moved from (then every other member throws config_error naming the stage).
  bool live() const noexcept { return state_ != stage_state::moved_from; }

  // Whether a restore into the pipeline failed part way (not for users: found by
  // argument-dependent lookup, for a stage built over it).
  friend bool ferry_restore_failed(const stage_base& s) noexcept { return s.state_ == stage_state::restore_failed; }
  // restore_state's hook (not for users): marks the pipeline so, when restore_state
  // refuses a state longer than the pipeline's after every stage has taken its words.
  friend void ferry_mark_restore_failed(stage_base& s) noexcept {
    if (s.state_ == stage_state::ready) s.state_ = stage_state::restore_failed;
  }
  // tell_refused_pull's walk (not for users): the upstreams', then this stage's
  // refused_pull() where it has one.
  friend void ferry_refused_pull(stage_base& s) { s.walk_refused_pull(); }

  // A small element's optional comes back in registers, which GCC builds through the stack
  // when next() is a call (a store-forwarding stall per element: from_range | map over
  // uint32, pulled element by element, 10 ns instead of 4): inlined at every call.
  [[gnu::always_inline]] std::optional<Value> next()
    requires(std::is_trivially_copyable_v<Value> && sizeof(std::optional<Value>) <= 16)
  {
    return next_body();
  }
  std::optional<Value> next()
    requires(!(std::is_trivially_copyable_v<Value> && sizeof(std::optional<Value>) <= 16))
  {
    return next_body();
  }

 private:
  // next() as the downstream stage's probe calls it: without the moved-from check, which
  // the downstream has made (a stage's upstream moves with it, so a live stage's upstream
  // is live). One load and branch fewer per element and stage (bench_overhead's typed
  // element-by-element next()).
  template <class>
  friend struct observe::upstream_probe;
  [[gnu::always_inline]] std::optional<Value> next_from_downstream() {
    return observe::observed_next(n().stats, Derived::name, [&] { return self().pull(); });
  }

  [[gnu::always_inline]] std::optional<Value> next_body() {
    static_assert(source<Derived>,
                  "ferry stage: the stage must stay a source (do not hide the base's public value_type)");
    check_pull();
    return observe::observed_next(n().stats, Derived::name, [&] { return self().pull(); });
  }

 public:
  std::size_t next_bulk(std::span<Value> out)
    requires(has_pull_bulk())
  {
    check_pull();
    return observe::observed_bulk(n().stats, Derived::name, out, [&] { return self().pull_bulk(out); });
  }

  template <class Out = borrowed_records>
  std::size_t next_borrowed(Out& out, std::size_t max)
    requires(has_pull_borrowed<Out>())
  {
    check_pull();
    return observe::observed_borrow(n().stats, Derived::name, out, [&] { return self().pull_borrowed(out, max); });
  }

  std::span<const Value> next_view(std::size_t max)
    requires(has_pull_view())
  {
    check_pull();
    return observe::observed_view(n().stats, Derived::name,
                                  [&]() -> std::span<const Value> { return self().pull_view(max); });
  }

  // Also the way back from a failed restore: every stage's epoch starts again. Throws what
  // the upstreams' rewind() and start_epoch() throw, and marks the stage then (see the
  // file's top).
  void rewind()
    requires(can_rewind())
  {
    check_not_moved();
    std::exception_ptr kept;  // an upstream's error that left it usable: thrown after this epoch starts
    try {
      if constexpr (requires(Derived& d) { d.halt(); }) self().halt();
      if constexpr (requires(Derived& d) { d.before_rewind(); }) self().before_rewind();
      each_up([&](auto& u) { rewind_upstream(u, kept); });
      if constexpr (has_start_epoch() && !keeps_usable_on_start_epoch_error()) self().start_epoch();
    } catch (...) {
      state_ = stage_state::restore_failed;
      throw;
    }
    rewound();
    // A stage that stays usable when its start_epoch throws says what it serves then.
    if constexpr (has_start_epoch() && keeps_usable_on_start_epoch_error()) self().start_epoch();
    if (kept) std::rethrow_exception(kept);
  }

  void save(state_writer& w) const
    requires(can_save())
  {
    check_live();
    if constexpr (requires(const Derived& d) { d.save_upstream(w); })
      self().save_upstream(w);
    else
      each_up([&](const auto& u) { u.save(w); });
    w.tag(tag());
    if constexpr (has_config())
      self().config([&](const char*, std::uint64_t v, bool = false) { w.put(v); });
    if constexpr (has_words()) self().save_words(w);
  }

  // Throws what the upstreams' and the stage's restore throw; then the stage is marked
  // (see the file's top) until rewind() or a restore() that succeeds.
  void restore(state_reader& r)
    requires(can_save())
  {
    check_not_moved();
    try {
      if constexpr (requires(Derived& d) { d.before_restore(); }) self().before_restore();
      if constexpr (requires(Derived& d) { d.restore_upstream(r); })
        self().restore_upstream(r);
      else
        each_up([&](auto& u) { u.restore(r); });
      r.expect(tag());
      if constexpr (has_config())
        self().config([&](const char* what, std::uint64_t mine, bool fingerprint = false) {
          const std::uint64_t saved = r.get();
          if (saved != mine) throw_config_mismatch(Derived::name, what, saved, mine, fingerprint);
        });
      if constexpr (has_words()) self().restore_words(r);
    } catch (...) {
      state_ = stage_state::restore_failed;
      throw;
    }
    state_ = stage_state::ready;
  }

  std::size_t batch_size() const
    requires(forwards_batch_size())
  {
    check_not_moved();
    if constexpr (n_ups == 1) {
      return std::get<0>(n().ups).batch_size();
    } else {
      std::size_t common = std::get<0>(n().ups).batch_size();
      each_up([&](const auto& u) {
        if (u.batch_size() != common) common = 0;
      });
      return common;
    }
  }
  std::size_t replicas() const
    requires(forwards_replicas())
  {
    check_not_moved();
    return std::get<0>(n().ups).replicas();
  }
  // A stage that collates: its rows per batch. (collates() is not const: the same hook
  // takes distribute's pool.)
  std::size_t batch_size() const
    requires(collates_batches())
  {
    check_not_moved();
    return const_cast<Derived&>(self()).collates().rows;
  }
  // Whether batch_size() only bounds the rows, and whether it is a token budget's
  // (collation::bound, budget), for distribute(); {false, false} where no stage says.
  std::pair<bool, bool> batch_size_kind() const
    requires(collates_batches())
  {
    check_not_moved();
    const collation& c = const_cast<Derived&>(self()).collates();
    return {c.bound, c.budget};
  }
  std::pair<bool, bool> batch_size_kind() const
    requires(forwards_batch_size())
  {
    check_not_moved();
    std::pair<bool, bool> k{false, false};
    each_up([&](const auto& u) {
      if constexpr (requires { u.batch_size_kind(); }) {
        const auto [bound, budget] = u.batch_size_kind();
        k.first = k.first || bound, k.second = k.second || budget;
      }
    });
    return k;
  }

  bool set_buffer_resource(const std::shared_ptr<std::pmr::memory_resource>& r) {
    check_not_moved();
    if constexpr (collates_batches()) {  // distribute's pinned pool
      if (r) self().collates().resource = r;
      return true;
    }
    bool took = false;
    each_up([&](auto& u) { took = forward_buffer_resource(u, r) || took; });  // every upstream gets it
    return took;
  }

  void visit_stages(observe::stage_visitor& v) const {
    if (!live()) return;
    if constexpr (n_ups == 0) {
      v.add(Derived::name, n().stats, observe::stage_mode::source_stage, 1);
    } else if constexpr (n_ups == 1) {
      std::get<0>(n().probes).visit(std::get<0>(n().ups), v);
      if constexpr (requires(const Derived& d) { d.add_report_row(v); }) {  // a row of its own making
        self().add_report_row(v);
        return;
      }
      observe::stage_mode mode = observe::stage_mode::inline_stage;
      std::size_t threads = 1;
      const observe::stage_counters* counters = &n().stats;
      if constexpr (requires(const Derived& d) { d.report_mode(); }) mode = self().report_mode();
      if constexpr (requires(const Derived& d) { d.report_threads(); }) threads = self().report_threads();
      if constexpr (requires(const Derived& d) { d.report_counters(); }) counters = &self().report_counters();
      v.add(Derived::name, *counters, mode, threads);
    } else {
      std::uint64_t up_incl = 0;
      [&]<std::size_t... I>(std::index_sequence<I...>) {
        ((up_incl += visit_one<I>(v)), ...);
      }(std::make_index_sequence<n_ups>{});
      v.add_joined(Derived::name, n().stats, up_incl);  // its own time net of every upstream's
    }
  }

  // pull_up() for a stage's threads: a callable that pulls through the heap block's
  // probe, valid while the block lives (however the stage moves). Public only because
  // nvcc's front end refuses a protected member returning a nested type from a derived
  // class template; not for users.
  struct puller {
    node* n;
    std::optional<value_t<up_t<0>>> operator()() const { return std::get<0>(n->probes).pull(std::get<0>(n->ups)); }
    up_t<0>& upstream() const noexcept { return std::get<0>(n->ups); }
  };
  puller upstream_puller() noexcept
    requires(heap)
  {
    return puller{h_.get()};
  }
  // save() of the upstream into a pipeline_state, for a stage's threads (nullptr when the
  // upstream cannot be saved): what detail::producer records after each pull.
  auto upstream_saver() noexcept
    requires(heap)
  {
    if constexpr (resumable_source<up_t<0>>)
      return [u = &std::get<0>(h_->ups)](pipeline_state& s) {
        s.words.clear();
        state_writer w(s);
        u->save(w);
      };
    else
      return nullptr;
  }

 protected:
  // Throws config_error when an upstream was moved from (see live_or_throw).
  // A stage over a pipeline whose restore failed part way is marked as it is.
  explicit stage_base(Ups... ups)
    requires(!heap)
      : h_(std::in_place, live_or_throw(std::move(ups))...) {
    inherit_restore_failed();
  }
  explicit stage_base(Ups... ups)
    requires(heap)
      : h_(std::make_unique<node>(std::in_place, live_or_throw(std::move(ups))...)) {
    inherit_restore_failed();
  }

  stage_base(stage_base&& o) noexcept(heap || (std::is_nothrow_move_constructible_v<Ups> && ...))
      : h_(std::move(o.h_)), state_(std::exchange(o.state_, stage_state::moved_from)) {}
  // Heap blocks are swapped, never freed here: a stage's threads (stopped by its own
  // members' assignment, after this one) still read the block they were started on.
  stage_base& operator=(stage_base&& o) noexcept(heap || (std::is_nothrow_move_assignable_v<Ups> && ...)) {
    if (this != &o) {
      if constexpr (heap)
        std::swap(h_, o.h_);
      else
        h_ = std::move(o.h_);
      state_ = std::exchange(o.state_, stage_state::moved_from);
    }
    return *this;
  }
  stage_base(const stage_base&) = delete;
  stage_base& operator=(const stage_base&) = delete;
  ~stage_base() = default;

  template <std::size_t I = 0>
  up_t<I>& up() noexcept {
    return std::get<I>(n().ups);
  }
  template <std::size_t I = 0>
  const up_t<I>& up() const noexcept {
    return std::get<I>(n().ups);
  }
  // Pulls through the probe, which counts and times an upstream that does not count itself.
  template <std::size_t I = 0>
  std::optional<value_t<up_t<I>>> pull_up() {
    return std::get<I>(n().probes).pull(std::get<I>(n().ups));
  }
  template <std::size_t I = 0, class T>
  std::size_t pull_up_bulk(std::span<T> out) {
    return std::get<I>(n().probes).pull_bulk(std::get<I>(n().ups), out);
  }
  template <std::size_t I = 0>
  auto pull_up_view(std::size_t max) {
    return std::get<I>(n().probes).pull_view(std::get<I>(n().ups), max);
  }
  template <std::size_t I = 0, class Out>
  std::size_t pull_up_borrowed(Out& out, std::size_t max) {
    return std::get<I>(n().probes).pull_borrowed(std::get<I>(n().ups), out, max);
  }
  observe::stage_counters& stats() noexcept { return n().stats; }
  const observe::stage_counters& stats() const noexcept { return n().stats; }
  // Before a pull or save(): one compare (moved from, or a restore failed part way).
  void check_live() const {
    if (state_ != stage_state::ready) [[unlikely]]
      throw_unusable(Derived::name, state_);
  }
  // Before a pull: check_live(), and a pull refused after a failed restore or rewind()
  // tells a stage below that joins a collective each pull (lockstep), which joins it
  // flagged: the other ranks throw at that step instead of waiting for this rank.
  [[gnu::always_inline]] void check_pull() {
    if (state_ != stage_state::ready) [[unlikely]]
      refuse_pull();
  }
  // (A member: the stage befriends its base, not the base's friends.) Through stages of one
  // upstream only: a join (zip, concatenate) pulls one side or both, which the walk cannot
  // tell, and joining a collective the other ranks do not would hang this rank.
  void walk_refused_pull() {
    if constexpr (n_ups == 1) each_up([](auto& u) { tell_refused_pull(u); });
    if constexpr (requires(Derived& d) { d.refused_pull(); }) self().refused_pull();
  }
  [[noreturn, gnu::cold, gnu::noinline]] void refuse_pull() {
    if (state_ == stage_state::restore_failed && joins_collectives_at_run_time()) ferry_refused_pull(*this);
    throw_unusable(Derived::name, state_);
  }
  // Before anything else (rewind(), restore(), the configuration queries): the moved-from
  // check alone.
  void check_not_moved() const {
    if (state_ == stage_state::moved_from) [[unlikely]]
      throw_moved_from(Derived::name);
  }
  // After a rewind() of the stage's own (cache's): usable again, as after the base's.
  void rewound() noexcept {
    if (state_ == stage_state::restore_failed) state_ = stage_state::ready;
  }
 private:
  // The checkpoint tag: the stage's name, or its state_tag when one stage name has forms
  // whose states must not mix (cache in memory and in a file).
  static constexpr const char* tag() noexcept {
    if constexpr (requires { Derived::state_tag; })
      return Derived::state_tag;
    else
      return Derived::name;
  }
  Derived& self() noexcept { return static_cast<Derived&>(*this); }
  const Derived& self() const noexcept { return static_cast<const Derived&>(*this); }
  node& n() noexcept {
    if constexpr (heap)
      return *h_;
    else
      return h_;
  }
  const node& n() const noexcept {
    if constexpr (heap)
      return *h_;
    else
      return h_;
  }
  template <class F>
  void each_up(F&& f) {
    std::apply([&](auto&... u) { (f(u), ...); }, n().ups);
  }
  template <class F>
  void each_up(F&& f) const {
    std::apply([&](const auto&... u) { (f(u), ...); }, n().ups);
  }
  template <std::size_t I>
  std::uint64_t visit_one(observe::stage_visitor& v) const {
    const std::size_t before = v.stages().size();
    std::get<I>(n().probes).visit(std::get<I>(n().ups), v);
    return v.upstream_incl(before);
  }

  void inherit_restore_failed() noexcept {
    bool failed = false;
    each_up([&](const auto& u) { failed = failed || restore_failed_in(u); });
    if (failed) state_ = stage_state::restore_failed;
  }

  holder h_;
  stage_state state_ = stage_state::ready;
};

template <class... A>
struct first_is_source : std::false_type {};
template <class A0, class... A>
struct first_is_source<A0, A...> : std::bool_constant<source<A0>> {};

}  // namespace detail

// An integer argument of a stage (batch(n), prefetch(depth), take(n), shard(count, index),
// shuffle's seed, ...), of any integral type, with its sign kept: a std::size_t parameter
// would turn batch(-1) into a batch of 2^64 - 1 rows and prefetch(-1) (tf.data's AUTOTUNE)
// into an unbounded queue, with no error. A stage reads a count or size with count(), which
// refuses a negative value, and a seed with bits(), which takes any value modulo 2^64.
// Converting throws nothing; count() throws config_error.
class int_arg {
 public:
  // Any integer of at most 64 bits but bool (batch(true) is a mistake, not a size; an
  // __int128 would lose its high bits).
  template <std::integral I>
    requires(!std::same_as<std::remove_cv_t<I>, bool> && sizeof(I) <= sizeof(std::uint64_t))
  constexpr int_arg(I v) noexcept  // NOLINT(google-explicit-constructor): stands for the integer
      : bits_(static_cast<std::uint64_t>(v)), negative_(std::is_signed_v<I> && v < 0) {}
  // An unscoped enum's constant (`enum { batch_size = 64 };`), as the integer it converts
  // to; a scoped enum does not convert, and is refused as elsewhere.
  template <class E>
    requires(std::is_enum_v<E> && std::is_convertible_v<E, std::underlying_type_t<E>> &&
             !std::same_as<std::underlying_type_t<E>, bool>)
  constexpr int_arg(E v) noexcept  // NOLINT(google-explicit-constructor)
      : int_arg(static_cast<std::underlying_type_t<E>>(v)) {}

  // Whether the value given was negative.
  constexpr bool negative() const noexcept { return negative_; }
  // The value as a signed integer (for a message; wraps above 2^63 - 1).
  constexpr std::int64_t value() const noexcept { return static_cast<std::int64_t>(bits_); }
  // The value modulo 2^64 (a seed: every value is one).
  constexpr std::uint64_t bits() const noexcept { return bits_; }
  // The value as a count or size; throws config_error "<stage>: <what> must not be
  // negative (got -3)" for a negative one.
  std::uint64_t count(std::string_view stage, std::string_view what) const {
    if (negative_)
      throw config_error(std::string(stage) + ": " + std::string(what) + " must not be negative (got " +
                         std::to_string(value()) + ")");
    return bits_;
  }

 private:
  std::uint64_t bits_;
  bool negative_;
};

// The callable a stage is used through (`inline constexpr shard_t shard{};`): shard(src, n, i)
// builds the stage, shard(n, i) returns a closure for `src | shard(n, i)`. A stage's `_t` derives
// from stage_adaptor<itself> and writes two static members: check(args...), which refuses
// bad arguments (config_error) and whose parameters are what the closure form accepts, and
// make(src, args...), which checks them too and builds the stage. Bad arguments throw where
// they are written, in either form. The closure holds copies of the arguments.
template <class Derived>
struct stage_adaptor {
  // take(src, n): builds the stage over src (moved in); throws config_error for bad
  // arguments. Constrained by check(), which takes the same arguments: asking for make()
  // would instantiate its body to deduce its type, and a misuse it reports
  // (tests/compile_fail/) would come out as "no match for call" after it. D: Derived,
  // named through a parameter so that clang looks it up at the call, when Derived is
  // complete (clang 14 otherwise finds no check() in it).
  template <source S, class... A, class D = Derived>
    requires requires(const A&... a) { D::check(a...); }
  auto operator()(S&& s, A&&... a) const {
    if constexpr (std::is_lvalue_reference_v<S>)
      return typename detail::pipeline_is_an_lvalue<S>::error_above{};
    else
      return Derived::make(std::forward<S>(s), std::forward<A>(a)...);
  }
  // take(n): checks the arguments now (config_error), then returns a closure holding
  // copies of them, for `src | take(n)`.
  template <class... A, class D = Derived>
    requires(!detail::first_is_source<A...>::value) && requires(const A&... a) { D::check(a...); }
  auto operator()(A... a) const {
    Derived::check(a...);
    return make_closure([... a = std::move(a)]<class S>(S&& s) { return Derived{}(std::forward<S>(s), a...); });
  }
};

// count_adaptor's Default when the count must be given.
inline constexpr std::uint64_t no_default_count = 0;
// The stage_adaptor of a stage built from a count alone, Stage<S>(src, n), every n >= 0
// valid: take(n), skip(n), repeat(n). -1 means every element, as in tf.data: take(-1) takes
// all, skip(-1) skips all, repeat(-1) repeats forever. With Default, the count may be left
// out (repeat()). Name: the stage's name, for errors.
template <template <class> class Stage, const char* Name, std::uint64_t Default = no_default_count>
struct count_adaptor : stage_adaptor<count_adaptor<Stage, Name, Default>> {
  // Throws config_error for a count below -1.
  static void check(int_arg n) { (void)count(n); }
  // The count left out: valid only with a Default.
  static void check()
    requires(Default != no_default_count)
  {}
  // Builds the stage over s (stage_adaptor calls it); checks as check() does.
  template <source S>
  static auto make(S&& s, int_arg n = Default) {
    return Stage<std::remove_cvref_t<S>>(std::forward<S>(s), count(n));
  }

 private:
  static std::uint64_t count(int_arg n) {
    if (!n.negative()) return n.bits();
    if (n.value() == -1) return n.bits();  // 2^64 - 1: never reached
    throw config_error(std::string(Name) + ": the count must be at least 0, or -1 for no limit as in tf.data (got " +
                       std::to_string(n.value()) + ")");
  }
};

// The stage_adaptor of a stage built from one user function, Stage<S, F>(src, fn): filter,
// flat_map. Misuse<E, F>'s member `type` names the compile error of fn over elements E (a struct
// whose static_assert says what is wrong; void when fn fits), which make() returns
// instead of building the stage, so that error is the first and nearly the only one.
template <template <class, class> class Stage, template <class, class> class Misuse>
struct fn_adaptor : stage_adaptor<fn_adaptor<Stage, Misuse>> {
  // Any fn is accepted here: its signature is checked by make(), at compile time.
  template <class F>
  static void check(const F&) {}
  // Builds the stage over s (stage_adaptor calls it), or names fn's misuse.
  template <source S, class F>
  static auto make(S&& s, F fn) {
    using misuse = typename Misuse<value_t<S>, F>::type;
    if constexpr (!std::is_void_v<misuse>)
      return typename misuse::error_above{};
    else
      return Stage<std::remove_cvref_t<S>, F>(std::forward<S>(s), std::move(fn));
  }
};

namespace detail {
// zip(b) or concatenate(b) alone (join_adaptor's one-source call).
template <class B>
struct join_takes_both_sources {
  static_assert(always_false<B>,
                "ferry::zip and ferry::concatenate take both sources: f(std::move(a), std::move(b)) "
                "(there is no a | f(b) form)");
};
}  // namespace detail

// No misuse: any two sources join (join_adaptor's default).
template <class A, class B>
struct no_join_misuse {
  using type = void;  // no compile error to name
};

// The type of a stage joining two sources, Stage<A, B>(a, b): zip(a, b), concatenate(a, b).
// Only the call form: a pipe closure would have to carry b, a single-pass source, inside
// what is otherwise a reusable, copyable value, so f(b) alone is refused with a message.
// Misuse<value_t<A>, value_t<B>>'s member `type` names the compile error of joining the
// two (void when they fit; as fn_adaptor's).
template <template <class, class> class Stage, template <class, class> class Misuse = no_join_misuse>
struct join_adaptor {
  // Builds the stage over a and b (both moved in); throws what its constructor throws.
  template <source A, source B>
  auto operator()(A&& a, B&& b) const {
    detail::require_rvalue_source<A>();
    detail::require_rvalue_source<B>();
    using misuse = typename Misuse<value_t<A>, value_t<B>>::type;
    if constexpr (!std::is_void_v<misuse>)
      return typename misuse::error_above{};
    else
      return Stage<std::remove_cvref_t<A>, std::remove_cvref_t<B>>(std::forward<A>(a), std::forward<B>(b));
  }
  // f(b) alone: refused at compile time with a message.
  template <source B>
  auto operator()(B&&) const {
    return typename detail::join_takes_both_sources<B>::error_above{};
  }
};

// One upstream, kept in the stage object: stages that run on the caller's thread.
template <class Derived, source Up, class Value = value_t<Up>>
using stage = detail::stage_base<Derived, Value, detail::upstream_storage::in_place, Up>;

// One upstream in a heap block: stages with threads of their own (prefetch, map, distribute).
template <class Derived, source Up, class Value = value_t<Up>>
using threaded_stage = detail::stage_base<Derived, Value, detail::upstream_storage::heap, Up>;

// Several upstreams (zip, concatenate, sample_from): report() lists each upstream's stages
// in order, then this stage, whose own time excludes all of theirs.
template <class Derived, class Value, source... Ups>
using join_stage = detail::stage_base<Derived, Value, detail::upstream_storage::in_place, Ups...>;

// No upstream: a source (from_range, from_generator, from_files).
template <class Derived, class Value>
using source_base = detail::stage_base<Derived, Value, detail::upstream_storage::in_place>;

}  // namespace ferry
