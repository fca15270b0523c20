// ferry/detail/is_step.hpp: whether an element type is distribute()'s step<T>, without
// step.hpp's includes: the stages after distribute check their upstream with it, and a
// parallel map and interleave refuse steps with it (they would hold steps ahead; see
// detail/holds_ahead.hpp for why that is refused). No threads; throws nothing.
#pragma once

#include <type_traits>

namespace ferry {

template <class T>
class step;

namespace detail {

// Whether S is a step<T> (the stages after distribute check their upstream with it).
template <class S>
struct is_step : std::false_type {};
template <class T>
struct is_step<step<T>> : std::true_type {
  using element = T;
};
template <class S>
inline constexpr bool is_step_v = is_step<std::remove_cvref_t<S>>::value;

}  // namespace detail
}  // namespace ferry
