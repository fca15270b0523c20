// ferry/stages/detail/map_ring.hpp: where an ordered parallel map's workers leave their
// results (map_options::ordered, the default), and how its consumer takes them in order.
// map_workers.hpp runs the workers; map.hpp documents what users see.
//
// Element seq lives at seq % window in the ring. A worker writes its run's values (or
// errors) straight into the ring without the lock, as no one else touches those places
// until it publishes the run (run_end under the engine's lock); the consumer moves them
// out from there. So an element is moved once on each side, with one lock per run.
// Threads: make() and upstream_error() on the worker that claimed the place; publish(),
// ready() and collect() under the engine's lock; next(), next_into() and bulk() on the
// consumer's thread. Throws: allocate() what the allocator throws; the consumer calls
// rethrow each element's error at its place.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "ferry/error.hpp"

namespace ferry::detail {

template <class Out>
struct map_ring {
  enum : std::uint8_t { ok, fn_threw, upstream_threw };  // what a place holds

  std::vector<std::optional<Out>> vals;
  std::vector<std::exception_ptr> errs;
  std::vector<std::uint8_t> kind;
  std::vector<std::uint64_t> run_end;  // at a published run's first place: the seq past it
  std::uint64_t cons = 0;  // consumer: the next seq to hand out; [cons, next_out) are taken
  std::size_t window = 1;

  // The ring's places, at the first pull of an epoch; throws what the allocator throws.
  void allocate(std::size_t w) {
    window = w;
    vals.clear();  // not assign(n, nullopt): that copies, and results may be move-only
    vals.resize(w);
    errs.assign(w, nullptr);
    kind.assign(w, ok);
    run_end.assign(w, 0);
  }
  void clear() noexcept {
    vals.clear();
    errs.clear();
    kind.clear();
    run_end.clear();
    cons = 0;
  }

  // Worker: fn's result (or its exception) at place `at`.
  template <class G>
  bool make(std::size_t at, G&& g) {  // false: g threw (kept for the consumer)
    try {
      vals[at].emplace(g());
      kind[at] = ok;
      return true;
    } catch (...) {
      errs[at] = std::current_exception();
      kind[at] = fn_threw;
      return false;
    }
  }
  void upstream_error(std::size_t at, std::exception_ptr e) {
    errs[at] = std::move(e);
    kind[at] = upstream_threw;
  }
  // Under the lock: the run [first, first + made) is the consumer's.
  void publish(std::uint64_t first, std::uint64_t made) {
    if (made) run_end[first % window] = first + made;
  }
  // Under the lock: the run starting at next_out is published. A stale entry from an
  // earlier lap of the ring ends at or before next_out (a run is at most window long).
  bool ready(std::uint64_t next_out) const { return run_end[next_out % window] > next_out; }
  void collect(std::uint64_t& next_out) const {
    while (ready(next_out)) next_out = run_end[next_out % window];
  }
  bool empty(std::uint64_t next_out) const { return cons == next_out; }

  // The consumer's side. E: the engine, giving take_ready(), hand_out(n) and next_out().
  template <class E>
  std::optional<Out> next(E& e, std::uint64_t base) {
    if (cons == e.next_out() && !e.take_ready()) return std::nullopt;
    const std::uint64_t seq = cons++;
    const std::size_t i = static_cast<std::size_t>(seq % window);
    const std::uint8_t k = kind[i];
    std::exception_ptr err;
    std::optional<Out> v;
    if (k == ok) {
      v.emplace(std::move(*vals[i]));
      vals[i].reset();
    } else {
      err = std::exchange(errs[i], nullptr);  // no reference stays in the ring
    }
    e.hand_out(1);  // only after the place is read: a worker may refill it after this
    if (k == upstream_threw) std::rethrow_exception(err);
    if (k == fn_threw) rethrow_element(err, "map", base + seq);
    return v;
  }

  // The next element handed to sink where it lies in the ring. False at the end.
  template <class E, class Sink>
  bool next_into(E& e, Sink& sink, std::uint64_t base) {
    if (cons == e.next_out() && !e.take_ready()) return false;
    const std::size_t i = static_cast<std::size_t>(cons % window);
    if (kind[i] != ok) {
      next(e, base);  // an error at the front: throws as next() would
      return false;
    }
    ++cons;
    auto give_back = [&] {  // after sink, even if it throws: the place is free for a worker
      vals[i].reset();
      e.hand_out(1);
    };
    try {
      sink(*vals[i]);
    } catch (...) {
      give_back();
      throw;
    }
    give_back();
    return true;
  }

  // Runs of ready elements moved straight into `out`, each run counted as handed out at
  // once. An element whose fn threw goes through next(), which throws as next() would.
  template <class E>
  std::size_t bulk(E& e, std::span<Out> out, std::uint64_t base) {
    std::size_t k = 0;
    while (k < out.size()) {
      if (cons == e.next_out() && !e.take_ready()) break;
      const std::uint64_t end = std::min<std::uint64_t>(e.next_out(), cons + (out.size() - k));
      std::uint64_t seq = cons;
      std::size_t i = static_cast<std::size_t>(seq % window);
      for (; seq < end && kind[i] == ok; ++seq) {
        out[k++] = std::move(*vals[i]);
        vals[i].reset();  // what the value held goes now, not a lap later
        if (++i == window) i = 0;
      }
      const std::uint64_t took = seq - cons;
      cons = seq;
      if (took) e.hand_out(took);  // after the moves: workers may refill those places
      if (k < out.size() && cons < e.next_out()) next(e, base);  // an error at the front: throws
    }
    return k;
  }
};

}  // namespace ferry::detail
