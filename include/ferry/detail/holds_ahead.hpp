// ferry/detail/holds_ahead.hpp: which of ferry's stages, if any, holds what it pulls on this
// thread while it pulls more (prefetch's and interleave's producer threads, map's workers,
// shuffle filling a window), so that distribute() onto devices can refuse to be pulled
// there.
//
// Why: a device replica's step is valid only until the next one is asked for (its device
// blocks go back to the pool for the next copies), so a stage that holds steps ahead would
// hand out steps whose memory already holds later rows. distribute checks this flag in
// every next(), whatever the element type above it (a step wrapped by zip or map is caught
// too), before it makes a step. Host replicas' steps own their rows and are not refused.
//
// The mark is the thread's, so it is cleared while user code runs there (in_user_code): a
// map function that builds and drains a device pipeline of its own (one training run per
// worker) holds nothing of ours. A function whose result is a step (or a standard wrapper of
// one) keeps the mark: it may have pulled that step from distribute, to be held above.
// No CUDA header; never throws.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/detail/is_step.hpp"

namespace ferry::detail {

// The holding stage's thread name ("ferry prefetch", "ferry map worker", "shuffle"), or null.
inline thread_local const char* holds_ahead = nullptr;

// How many holding_ahead scopes are open in the process: when none is, in_user_code skips
// the thread_local (a call to __tls_get_addr per element in a shared library).
inline std::atomic<std::size_t> holding_scopes{0};

// Marks this thread as holding ahead for a scope (a producer thread's or a map worker's
// life, shuffle's window fill); restores the mark it found, so a shuffle on prefetch's
// thread leaves prefetch's.
class holding_ahead {
 public:
  explicit holding_ahead(const char* stage) noexcept : saved_(holds_ahead) {
    holding_scopes.fetch_add(1, std::memory_order_relaxed);
    holds_ahead = stage;
  }
  holding_ahead(const holding_ahead&) = delete;
  holding_ahead& operator=(const holding_ahead&) = delete;
  ~holding_ahead() {
    holds_ahead = saved_;
    holding_scopes.fetch_sub(1, std::memory_order_relaxed);
  }

 private:
  const char* saved_;
};

// Whether a user function's result may carry a step: a step, or one inside the standard
// wrappers (optional, pair, tuple, vector, array).
template <class T>
struct may_hold_step : std::bool_constant<is_step_v<T>> {};
template <class T>
struct may_hold_step<std::optional<T>> : may_hold_step<T> {};
template <class A, class B>
struct may_hold_step<std::pair<A, B>> : std::bool_constant<may_hold_step<A>::value || may_hold_step<B>::value> {};
template <class... T>
struct may_hold_step<std::tuple<T...>> : std::bool_constant<(may_hold_step<T>::value || ...)> {};
template <class T, class A>
struct may_hold_step<std::vector<T, A>> : may_hold_step<T> {};
template <class T, std::size_t N>
struct may_hold_step<std::array<T, N>> : may_hold_step<T> {};

// Clears the mark for the scope of a user function (map's fn, a generator, filter's
// predicate, flat_map's and interleave's fn, a length_fn) that yields Yield; restores it
// after, on a throw too. Keeps it when Yield may hold a step (see the file's top). A step
// inside a type of the user's own is not seen: a function that pulls another pipeline's
// steps and hides them there is the user's own reading ahead (distribute.md's release
// contract). A user's source or lazy range is pulled as ferry's stages are: it keeps the mark.
template <class Yield>
class in_user_code {
  static constexpr bool clears = !may_hold_step<std::remove_cvref_t<Yield>>::value;

 public:
  in_user_code() noexcept {
    if constexpr (clears) {
      // A thread with a mark opened a scope itself, so none open means no mark here.
      if (holding_scopes.load(std::memory_order_relaxed) == 0) return;
      saved_ = holds_ahead;
      if (saved_) holds_ahead = nullptr;
    }
  }
  in_user_code(const in_user_code&) = delete;
  in_user_code& operator=(const in_user_code&) = delete;
  ~in_user_code() {
    if constexpr (clears)
      if (saved_) holds_ahead = saved_;
  }

 private:
  const char* saved_ = nullptr;
};

// f() as user code yielding Yield (in_user_code), for a per-element hot path: with no
// holding scope open in the process, one relaxed load and no guard object.
template <class Yield, class F>
decltype(auto) as_user_code(F&& f) {
  if (holding_scopes.load(std::memory_order_relaxed) == 0) [[likely]]
    return std::forward<F>(f)();
  const in_user_code<Yield> user;
  return std::forward<F>(f)();
}

}  // namespace ferry::detail
