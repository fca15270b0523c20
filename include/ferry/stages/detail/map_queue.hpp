// ferry/stages/detail/map_queue.hpp: where an unordered parallel map's workers leave their
// results (map_options::ordered = false), in the order they finish, and how its consumer
// takes them. map_workers.hpp runs the workers; map.hpp documents what users see.
//
// A worker maps its run into a vector of its own (outs), then moves the run into `done`
// under the engine's lock, once per run; the consumer moves all of `done` into its own
// queue (local) under one lock and hands them out from there without it.
// Threads: publish(), ready() and collect() under the engine's lock; next() and bulk() on
// the consumer's thread. Throws: the consumer calls rethrow each element's error at its
// place (fn's as element_error, the upstream's unchanged).
#pragma once

#include <cstdint>
#include <deque>
#include <exception>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "ferry/error.hpp"

namespace ferry::detail {

template <class Out>
struct map_queue {
  struct slot {  // a finished element
    std::optional<Out> value;
    std::exception_ptr error;
    bool from_upstream = false;
  };
  std::deque<std::pair<std::uint64_t, slot>> done;   // under the lock, in finishing order
  std::deque<std::pair<std::uint64_t, slot>> local;  // the consumer's: taken, not handed out

  void clear() noexcept {
    done.clear();
    local.clear();
  }

  // Worker: fn's result (or its exception) into its run's slot s.
  template <class G>
  static bool make(slot& s, G&& g) {  // false: g threw (kept for the consumer)
    try {
      s.value.emplace(g());
      return true;
    } catch (...) {
      s.error = std::current_exception();
      return false;
    }
  }
  static void upstream_error(slot& s, std::exception_ptr e) {
    s.error = std::move(e);
    s.from_upstream = true;
  }
  // Under the lock: the worker's run, elements first .. first + outs.size().
  void publish(std::uint64_t first, std::vector<slot>& outs) {
    for (std::size_t i = 0; i < outs.size(); ++i) done.emplace_back(first + i, std::move(outs[i]));
  }
  bool ready(std::uint64_t) const { return !done.empty(); }
  void collect(std::uint64_t& next_out) {
    while (!done.empty()) {
      local.push_back(std::move(done.front()));
      done.pop_front();
      ++next_out;
    }
  }
  bool empty(std::uint64_t) const { return local.empty(); }

  // The consumer's side. E: the engine, giving take_ready() and hand_out(n).
  template <class E>
  std::optional<Out> next(E& e, std::uint64_t base) {
    if (local.empty() && !e.take_ready()) return std::nullopt;
    auto [seq, s] = std::move(local.front());
    local.pop_front();
    e.hand_out(1);
    if (s.error) {
      if (s.from_upstream) std::rethrow_exception(s.error);
      rethrow_element(s.error, "map", base + seq);
    }
    return std::move(s.value);
  }

  template <class E>
  std::size_t bulk(E& e, std::span<Out> out, std::uint64_t base) {
    std::size_t k = 0;
    while (k < out.size()) {
      if (local.empty() && !e.take_ready()) break;
      std::size_t took = 0;
      while (k < out.size() && !local.empty() && !local.front().second.error) {
        out[k++] = std::move(*local.front().second.value);
        local.pop_front();
        ++took;
      }
      if (took) e.hand_out(took);
      if (k < out.size() && !local.empty()) next(e, base);  // an error at the front: throws
    }
    return k;
  }
};

}  // namespace ferry::detail
