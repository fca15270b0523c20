// ferry/observe/hooks.hpp: what stages use to count and time themselves. Users want
// ferry/stats.hpp (the report) and ferry/trace.hpp (Chrome trace files) instead.
//
// One process-wide switch word, read with one relaxed load per stage call: while stats
// and tracing are off (the default) a stage does nothing else, so the cost is one
// predictable branch. Build with -DFERRY_NO_STATS to compile every hook out.
// The environment variables FERRY_STATS=1 and FERRY_NVTX=1 turn stats / NVTX ranges on at
// start-up without a code change.
//
// Counters are relaxed atomics written by one thread at a time (the thread running the
// stage; stages whose upstream moves between threads hand it over under a lock), so
// reading them for a report from any thread, while the pipeline runs, is race-free.
// Times are in ticks of a cheap clock (the TSC on x86-64: about 15 ns a read, against
// 40 ns for steady_clock on a VM), converted to nanoseconds only when reported.
// Throws nothing; runs on whichever thread runs the stage.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

// What stages count and time themselves with (stats.hpp and trace.hpp read it).
namespace ferry::observe {

enum : unsigned {
  stats_bit = 1u,  // count and time every stage
  trace_bit = 2u,  // also record trace events (a tracing session is open)
  nvtx_bit = 4u,   // emit NVTX ranges on the CUDA path (ferry/cuda/nvtx.hpp)
};

namespace detail {
inline unsigned flags_from_env() noexcept {
  unsigned f = 0;
  auto set = [](const char* name) {
    const char* v = std::getenv(name);
    return v && *v && std::strcmp(v, "0") != 0;
  };
  if (set("FERRY_STATS")) f |= stats_bit;
  if (set("FERRY_NVTX")) f |= nvtx_bit;
  return f;
}
inline std::atomic<unsigned> flags{flags_from_env()};
}  // namespace detail

// True while stats or tracing are on: the one branch every stage call takes.
inline bool on() noexcept {
#if defined(FERRY_NO_STATS)
  return false;
#else
  return (detail::flags.load(std::memory_order_relaxed) & (stats_bit | trace_bit)) != 0;
#endif
}
// True while a tracing session is open (ferry/trace.hpp): record() events then.
inline bool tracing() noexcept {
#if defined(FERRY_NO_STATS)
  return false;
#else
  return (detail::flags.load(std::memory_order_relaxed) & trace_bit) != 0;
#endif
}
// True while NVTX ranges are on (FERRY_NVTX=1, or set_bit(nvtx_bit, true)).
inline bool nvtx_on() noexcept { return (detail::flags.load(std::memory_order_relaxed) & nvtx_bit) != 0; }
// Turns one switch (stats_bit, trace_bit, nvtx_bit) on or off for the whole process, from
// any thread; stats.hpp and trace.hpp call it for the user.
inline void set_bit(unsigned bit, bool v) noexcept {
  if (v)
    detail::flags.fetch_or(bit, std::memory_order_relaxed);
  else
    detail::flags.fetch_and(~bit, std::memory_order_relaxed);
}

// ---- the clock -------------------------------------------------------------------------

// A time from now(): TSC cycles on x86-64, steady_clock counts elsewhere (ns_per_tick()
// converts).
using ticks = std::uint64_t;

// The current tick: cheap enough to read around every observed call.
inline ticks now() noexcept {
#if (defined(__x86_64__) || defined(__i386__)) && !defined(__CUDA_ARCH__)
  return __builtin_ia32_rdtsc();  // invariant TSC on every x86-64 made since 2008
#else
  return static_cast<ticks>(std::chrono::steady_clock::now().time_since_epoch().count());
#endif
}

// Nanoseconds per tick, measured once (about 2 ms, on first use: at report or trace time).
inline double ns_per_tick() noexcept {
#if (defined(__x86_64__) || defined(__i386__)) && !defined(__CUDA_ARCH__)
  static const double r = [] {
    using clk = std::chrono::steady_clock;
    const auto c0 = clk::now();
    const ticks t0 = now();
    while (clk::now() - c0 < std::chrono::milliseconds(2)) {
    }
    const auto c1 = clk::now();
    const ticks t1 = now();
    const double ns = std::chrono::duration<double, std::nano>(c1 - c0).count();
    return t1 > t0 ? ns / double(t1 - t0) : 1.0;
  }();
  return r;
#else
  return 1e9 * double(std::chrono::steady_clock::period::num) / double(std::chrono::steady_clock::period::den);
#endif
}

// ---- counters --------------------------------------------------------------------------

// A relaxed atomic that copies (stages are movable values). add() is for one writer at a
// time (a plain load and store, no locked instruction); add_shared() for several.
class counter {
 public:
  counter() = default;
  // Copies the value (a relaxed load), so a stage holding counters can move.
  counter(const counter& o) noexcept : v_(o.get()) {}
  // Takes o's value (relaxed).
  counter& operator=(const counter& o) noexcept {
    v_.store(o.get(), std::memory_order_relaxed);
    return *this;
  }
  // Adds d; for the one thread writing this counter now.
  void add(std::uint64_t d) noexcept { v_.store(v_.load(std::memory_order_relaxed) + d, std::memory_order_relaxed); }
  // Adds d atomically; for counters several threads add to.
  void add_shared(std::uint64_t d) noexcept { v_.fetch_add(d, std::memory_order_relaxed); }
  // Sets the value (reset, first and last ticks).
  void set(std::uint64_t v) noexcept { v_.store(v, std::memory_order_relaxed); }
  // The value, from any thread.
  std::uint64_t get() const noexcept { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<std::uint64_t> v_{0};
};

// Everything one stage records. Times in ticks.
struct stage_counters {
  counter elements;   // elements handed downstream
  counter bytes;      // their payload bytes
  counter incl;       // time inside this stage's next()/next_bulk(), upstream calls included
  counter work;       // time on the stage's own worker threads doing its work (map's fn, reads)
  counter wait_up;    // consumer side: blocked in next() with nothing ready (threaded stages)
  counter wait_down;  // worker side: blocked because the output queue was full (threaded stages)
  counter first;      // start of the first observed call (0: none yet)
  counter last;       // end of the last observed call
  // Zeroes every counter (reset_stats).
  void reset() noexcept {
    for (counter* c : {&elements, &bytes, &incl, &work, &wait_up, &wait_down, &first, &last}) c->set(0);
  }
};

// How a stage relates to its upstream, for working out its own ("self") time:
//   inline_stage   calls upstream inside its next(), on the same thread: self = incl - upstream's incl
//                  (with several upstreams, zip or sample_from: minus all of theirs, see
//                  stage_visitor::add)
//   threaded_stage runs upstream (or its work) on its own threads: self = incl - wait_up + work
//   source_stage   has no observed upstream: self = incl
enum class stage_mode { inline_stage, threaded_stage, source_stage };

// A snapshot of one stage's counters, upstream first (what report() is computed from).
struct raw_stage {
  const char* kind = "";  // the stage's name ("map", "batch"; "source" for a probe)
  stage_mode mode = stage_mode::inline_stage;  // how its own time is worked out
  std::size_t threads = 1;  // threads doing its work (map's workers), for busy fractions
  // The stage_counters' values of the same names, read once (ticks for times).
  std::uint64_t elements = 0, bytes = 0, incl = 0, work = 0, wait_up = 0, wait_down = 0, first = 0, last = 0;
  std::uint64_t upstreams_incl = 0;  // with joined: the upstreams' incl summed
  bool joined = false;               // several upstreams: self = incl - upstreams_incl
};

// Passed up the pipeline by visit_stages(v): each stage first forwards it to its upstream,
// then adds itself, so stages arrive in pipeline order.
class stage_visitor {
 public:
  // reset = true: each stage's add() zeroes its counters instead of recording them
  // (reset_stats).
  explicit stage_visitor(bool reset = false) : reset_(reset) {}
  // A stage adds itself after its upstream: a snapshot of c, or c zeroed when resetting.
  void add(const char* kind, const stage_counters& c, stage_mode m, std::size_t threads) {
    if (reset_) {
      const_cast<stage_counters&>(c).reset();
      return;
    }
    stages_.push_back(raw_stage{kind, m, threads ? threads : 1, c.elements.get(), c.bytes.get(), c.incl.get(),
                                c.work.get(), c.wait_up.get(), c.wait_down.get(), c.first.get(), c.last.get()});
  }
  // An inline stage with several upstreams (zip, sample_from) visits each, summing
  // upstream_incl(n) with n = stages().size() taken before that visit, then adds itself
  // here: its own time is its time minus all its upstreams' (not only the last one's).
  void add_joined(const char* kind, const stage_counters& c, std::uint64_t upstreams_incl) {
    add(kind, c, stage_mode::inline_stage, 1);
    if (!reset_) {
      stages_.back().upstreams_incl = upstreams_incl;
      stages_.back().joined = true;
    }
  }
  // The inclusive time of the upstream visited since stages().size() was n: its last stage's.
  std::uint64_t upstream_incl(std::size_t n) const noexcept {
    return stages_.size() > n ? stages_.back().incl : 0;
  }
  // The snapshots so far, in pipeline order (source first).
  const std::vector<raw_stage>& stages() const noexcept { return stages_; }
  // Whether this visit zeroes counters (reset_stats) rather than records them.
  bool resetting() const noexcept { return reset_; }

 private:
  bool reset_;
  std::vector<raw_stage> stages_;
};

template <class S>
concept observable = requires(const S& s, stage_visitor& v) { s.visit_stages(v); };

// ---- bytes of an element ---------------------------------------------------------------

// An element's payload bytes for the report: a batch's payload, a contiguous range's
// bytes (record, vector), sizeof for trivially copyable types, else 0.
template <class T>
std::uint64_t bytes_of(const T& x) noexcept {
  if constexpr (requires { { x.payload_bytes() } -> std::convertible_to<std::uint64_t>; })
    return x.payload_bytes();  // batch_of
  else if constexpr (requires { { x.host_batch().payload_bytes() } -> std::convertible_to<std::uint64_t>; })
    return x.host_batch().payload_bytes();  // a distribute step
  else if constexpr (std::ranges::contiguous_range<const T> && std::ranges::sized_range<const T>)
    return std::ranges::size(x) * sizeof(std::ranges::range_value_t<const T>);  // record, vector
  else if constexpr (std::is_trivially_copyable_v<T>)
    return sizeof(T);
  else
    return 0;
}
// The payload bytes of a run of elements (next_bulk's), as the sum of bytes_of of each.
template <class T>
std::uint64_t bytes_of(std::span<const T> xs) noexcept {
  if constexpr (std::is_trivially_copyable_v<T> && !std::ranges::contiguous_range<T> &&
                !requires(const T& x) { x.payload_bytes(); })
    return xs.size() * sizeof(T);
  else {
    std::uint64_t s = 0;
    for (const T& x : xs) s += bytes_of(x);
    return s;
  }
}

// ---- trace events ----------------------------------------------------------------------

// One span of a trace: what ran, on which thread, from when to when.
struct trace_event {
  const char* name;  // a string literal: the stage kind or "<kind>: <activity>"
  std::uint32_t tid;  // ferry's number for the thread (names in trace_buffer::thread_names)
  bool threw;  // the call ended by throwing (written as " (threw)" after the name)
  ticks t0, t1;  // start and end
};
static_assert(sizeof(trace_event) <= 32, "docs/observe.md: events of 32 bytes");

// The open tracing session's buffer (ferry/trace.hpp owns it): a fixed array filled
// lock-free; events past its end are counted as dropped.
struct trace_buffer {
  std::vector<trace_event> events;  // sized when the session opens; never grows
  std::atomic<std::size_t> next{0};  // the next free place (may pass the end)
  std::atomic<std::uint64_t> dropped{0};  // events that found no place
  std::uint64_t generation = 0;  // which session: threads name themselves once per session
  std::mutex names_m;  // guards thread_names
  std::vector<std::pair<std::uint32_t, std::string>> thread_names;  // (tid, name) of each thread seen
};

namespace detail {
inline std::atomic<trace_buffer*> trace_buf{nullptr};
inline std::atomic<int> trace_writers{0};  // writers inside record(): the session waits for 0
inline std::atomic<std::uint32_t> next_tid{1};
struct thread_info {
  std::uint32_t tid = next_tid.fetch_add(1, std::memory_order_relaxed);
  const char* name = nullptr;
  std::uint64_t seen_generation = 0;
};
inline thread_info& this_thread_info() noexcept {
  thread_local thread_info t;
  return t;
}
}  // namespace detail

// Names the calling thread in traces (a string literal: "ferry prefetch", ...).
inline void name_this_thread(const char* name) noexcept { detail::this_thread_info().name = name; }

// Records one event into the open session, if any (threw: the call ended by throwing).
// Only called while tracing() is true.
inline void record(const char* name, ticks t0, ticks t1, bool threw = false) noexcept {
  detail::trace_writers.fetch_add(1, std::memory_order_seq_cst);
  if (trace_buffer* b = detail::trace_buf.load(std::memory_order_seq_cst)) {
    detail::thread_info& ti = detail::this_thread_info();
    if (ti.seen_generation != b->generation) {
      ti.seen_generation = b->generation;
      try {
        std::lock_guard lk(b->names_m);
        b->thread_names.emplace_back(ti.tid, ti.name ? ti.name : "thread " + std::to_string(ti.tid));
      } catch (...) {  // out of memory for a name: the events still count
      }
    }
    const std::size_t i = b->next.fetch_add(1, std::memory_order_relaxed);
    if (i < b->events.size())
      b->events[i] = trace_event{.name = name, .tid = ti.tid, .threw = threw, .t0 = t0, .t1 = t1};
    else
      b->dropped.fetch_add(1, std::memory_order_relaxed);
  }
  detail::trace_writers.fetch_sub(1, std::memory_order_seq_cst);
}

// ---- what stages call ------------------------------------------------------------------

// Adds the span [t0, t1) to c's inclusive time and first/last ticks.
inline void note_span(stage_counters& c, ticks t0, ticks t1) noexcept {
  c.incl.add(t1 - t0);
  if (c.first.get() == 0) c.first.set(t0);
  c.last.set(t1);
}

// After an observed call that threw: its time counts, and the trace shows the call ended
// by throwing, so a failed run's trace says which stage failed and when.
inline void note_throw(stage_counters& c, const char* kind, ticks t0) noexcept {
  const ticks t1 = now();
  note_span(c, t0, t1);
  if (tracing()) record(kind, t0, t1, true);
}

// After an observed next(): count the element, its bytes, the time; trace it.
template <class Opt>
void note_next(stage_counters& c, const char* kind, ticks t0, const Opt& e) noexcept {
  const ticks t1 = now();
  if (e) {
    c.elements.add(1);
    c.bytes.add(bytes_of(*e));
  }
  note_span(c, t0, t1);
  if (tracing()) record(kind, t0, t1);
}

// After an observed call that handed on `elements` elements of `bytes` bytes: counts them
// and the time since t0; traces it.
inline void note_count(stage_counters& c, const char* kind, ticks t0, std::uint64_t elements,
                       std::uint64_t bytes) noexcept {
  const ticks t1 = now();
  c.elements.add(elements);
  c.bytes.add(bytes);
  note_span(c, t0, t1);
  if (tracing()) record(kind, t0, t1);
}

// After an observed next_bulk() or next_view() that gave `out`: note_count of its elements.
template <class T>
void note_bulk(stage_counters& c, const char* kind, ticks t0, std::span<const T> out) noexcept {
  note_count(c, kind, t0, out.size(), bytes_of(out));
}

#if defined(__GNUC__)
// The hooks' fast path: always inlined into the stage's call.
#define FERRY_OBSERVE_INLINE [[gnu::always_inline]] inline
// The measured path: out of line and cold, so the fast path stays small.
#define FERRY_OBSERVE_COLD [[gnu::noinline, gnu::cold]]
#else
// The hooks' fast path (no attribute to force inlining on this compiler).
#define FERRY_OBSERVE_INLINE inline
// The measured path (no attribute to keep it out of line on this compiler).
#define FERRY_OBSERVE_COLD
#endif

// f() begun at t0, with note_throw when it throws (then rethrown): the measured paths' call.
template <class F>
decltype(auto) call_noting_throw(stage_counters& c, const char* kind, ticks t0, F& f) {
  try {
    return f();
  } catch (...) {
    note_throw(c, kind, t0);
    throw;
  }
}

// The measured paths live out of line, so a stage's next() stays as small (and as
// inlinable into its downstream) as it was without hooks.
template <class F>
FERRY_OBSERVE_COLD auto observed_next_slow(stage_counters& c, const char* kind, F& f) {
  const ticks t0 = now();
  auto e = call_noting_throw(c, kind, t0, f);
  note_next(c, kind, t0, e);
  return e;
}
// observed_borrow's measured path: counts the views f() appended and their bytes.
template <class Out, class F>
FERRY_OBSERVE_COLD std::size_t observed_borrow_slow(stage_counters& c, const char* kind, Out& out, F& f) {
  const ticks t0 = now();
  const std::size_t first = out.views.size(), n = call_noting_throw(c, kind, t0, f);
  std::uint64_t bytes = 0;
  for (std::size_t i = first; i < first + n; ++i) bytes += out.views[i].size();
  note_count(c, kind, t0, n, bytes);
  return n;
}
// observed_bulk's measured path: counts the elements f() wrote into out.
template <class T, class F>
FERRY_OBSERVE_COLD std::size_t observed_bulk_slow(stage_counters& c, const char* kind, std::span<T> out, F& f) {
  const ticks t0 = now();
  const std::size_t n = call_noting_throw(c, kind, t0, f);
  note_bulk(c, kind, t0, std::span<const T>(out.data(), n));
  return n;
}

// observed_view's measured path: counts the elements of the span f() returned.
template <class F>
FERRY_OBSERVE_COLD auto observed_view_slow(stage_counters& c, const char* kind, F& f) {
  const ticks t0 = now();
  auto v = call_noting_throw(c, kind, t0, f);
  note_bulk(c, kind, t0, std::span<const typename decltype(v)::element_type>(v));
  return v;
}

// Runs f() (a next() body) and, when stats are on, counts and times it for stage `kind`.
template <class F>
FERRY_OBSERVE_INLINE auto observed_next(stage_counters& c, const char* kind, F&& f) {
  if (!on()) [[likely]]
    return f();
  return observed_next_slow(c, kind, f);
}
// The same for a next_bulk() body writing into `out`.
template <class T, class F>
FERRY_OBSERVE_INLINE std::size_t observed_bulk(stage_counters& c, const char* kind, std::span<T> out, F&& f) {
  if (!on()) [[likely]]
    return f();
  return observed_bulk_slow(c, kind, out, f);
}
// The same for a next_borrowed() body appending views to `out` (borrowed_records).
template <class Out, class F>
FERRY_OBSERVE_INLINE std::size_t observed_borrow(stage_counters& c, const char* kind, Out& out, F&& f) {
  if (!on()) [[likely]]
    return f();
  return observed_borrow_slow(c, kind, out, f);
}

// The same for a next_view() body returning a span.
template <class F>
FERRY_OBSERVE_INLINE auto observed_view(stage_counters& c, const char* kind, F&& f) {
  if (!on()) [[likely]]
    return f();
  return observed_view_slow(c, kind, f);
}

// Time spent blocked: measured only when stats are on and the wait really blocks.
struct wait_timer {
  ticks t0 = 0;  // when the wait began
  bool active = false;  // start() measured (stats were on)
  // Call before blocking: notes the time when stats are on.
  void start() noexcept {
    if (on()) {
      t0 = now();
      active = true;
    }
  }
  // Adds the wait to `into` (shared: several threads may add). Returns the end tick.
  void stop(counter& into, const char* trace_name, bool shared = false) noexcept {
    if (!active) return;
    const ticks t1 = now();
    if (shared)
      into.add_shared(t1 - t0);
    else
      into.add(t1 - t0);
    if (tracing()) record(trace_name, t0, t1);
    active = false;
  }
};

// Held by a stage for its upstream. When the upstream is observable it is empty and
// forwards; otherwise (a plain source such as from_range or a user's own) it counts and
// times the upstream from here, reporting it as a stage of kind "source".
template <class Up>
struct upstream_probe {
  stage_counters c;  // the plain source's counters, reported as kind "source"

  // up.next(), counted and timed.
  auto pull(Up& up) { return observed_next(c, "source", [&] { return up.next(); }); }
  // up.next_bulk(out), counted and timed.
  template <class T>
  std::size_t pull_bulk(Up& up, std::span<T> out) {
    return observed_bulk(c, "source", out, [&] { return up.next_bulk(out); });
  }
  // up.next_view(max), counted and timed.
  auto pull_view(Up& up, std::size_t max) {
    return observed_view(c, "source", [&] { return up.next_view(max); });
  }
  // up.next_borrowed(out, max), counted and timed.
  template <class Out>
  std::size_t pull_borrowed(Up& up, Out& out, std::size_t max) {
    return observed_borrow(c, "source", out, [&] { return up.next_borrowed(out, max); });
  }
  // Adds the plain source's row to the report.
  void visit(const Up&, stage_visitor& v) const { v.add("source", c, stage_mode::source_stage, 1); }
};
// The probe of a ferry stage (observable: it counts itself): empty, forwards every call.
template <observable Up>
struct upstream_probe<Up> {
  // up.next(), less its moved-from check where up is a ferry stage (stage.hpp's
  // next_from_downstream: a live stage's upstream is live).
  auto pull(Up& up) {
    if constexpr (requires { up.next_from_downstream(); })
      return up.next_from_downstream();
    else
      return up.next();
  }
  // up.next_bulk(out).
  template <class T>
  std::size_t pull_bulk(Up& up, std::span<T> out) {
    return up.next_bulk(out);
  }
  // up.next_view(max).
  auto pull_view(Up& up, std::size_t max) { return up.next_view(max); }
  // up.next_borrowed(out, max).
  template <class Out>
  std::size_t pull_borrowed(Up& up, Out& out, std::size_t max) {
    return up.next_borrowed(out, max);
  }
  // The upstream's own rows (its visit_stages).
  void visit(const Up& up, stage_visitor& v) const { up.visit_stages(v); }
};

}  // namespace ferry::observe
