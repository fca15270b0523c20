// ferry/stages/detail/diagnostics.hpp: the compile errors of the stages that take a user
// function (map, filter, flat_map) or join two sources (concatenate), one struct per mistake. Each is a static_assert whose
// struct name and first template argument (the element type E) are what the compiler
// shows first; the adaptor returns `typename X<E, F>::error_above{}` instead of building
// the stage, so the error is the first and nearly the only one (source.hpp says how;
// tests/compile_fail checks each). Nothing here runs.
#pragma once

#include <concepts>
#include <functional>
#include <ranges>
#include <type_traits>

#include "ferry/source.hpp"

namespace ferry::detail {

// map(fn): fn cannot take E&&, or returns void.
template <class E, class F>
struct map_function_cannot_take {
  static_assert(always_false<E, F>,
                "ferry::map: the function cannot be called with the upstream's element, E&& (E is the "
                "first type of map_function_cannot_take<E, F> above): take it as E, const E& or E&&");
};
template <class E, class F>
struct map_function_returns_void {
  static_assert(always_false<E, F>,
                "ferry::map: the function returns void; it must return the new element (to drop "
                "elements, use ferry::filter)");
};

// filter(pred): pred cannot take const E&, or its result is not a bool.
template <class E, class P>
struct filter_predicate_cannot_take {
  static_assert(always_false<E, P>,
                "ferry::filter: the predicate cannot be called with the upstream's element as const E& (E "
                "is the first type of filter_predicate_cannot_take<E, P> above): take it as const E& or E");
};
template <class E, class Result>
struct filter_predicate_result_is_not_bool {
  static_assert(always_false<E, Result>,
                "ferry::filter: the predicate's result does not convert to bool (its type is the second "
                "of filter_predicate_result_is_not_bool<E, Result> above)");
};

// flat_map(fn): fn cannot take E&, or returns no range.
template <class E, class F>
struct flat_map_function_cannot_take {
  static_assert(always_false<E, F>,
                "ferry::flat_map: the function cannot be called with the upstream's element as an lvalue, "
                "E& (E is the first type of flat_map_function_cannot_take<E, F> above): take it as const "
                "E& or E&");
};
template <class E, class Result>
struct flat_map_function_must_return_a_range {
  static_assert(always_false<E, Result>,
                "ferry::flat_map: the function must return a range of the elements to hand out (a "
                "std::vector, a std::array, a view...), not the second type of "
                "flat_map_function_must_return_a_range<E, Result> above; to make one element of each, "
                "use ferry::map");
};

// The first misuse of P over E for filter (fn_adaptor's Misuse), void when P fits. Naming a
// struct does not instantiate it: only its error_above does.
template <class E, class P>
struct filter_misuse {
  static auto pick() {
    if constexpr (!std::invocable<P&, const E&>)
      return std::type_identity<filter_predicate_cannot_take<E, P>>{};
    else if constexpr (!std::predicate<P&, const E&>)
      return std::type_identity<filter_predicate_result_is_not_bool<E, std::invoke_result_t<P&, const E&>>>{};
    else
      return std::type_identity<void>{};
  }
  using type = typename decltype(pick())::type;
};
// The same for flat_map.
template <class E, class F>
struct flat_map_misuse {
  static auto pick() {
    if constexpr (!std::invocable<F&, E&>)
      return std::type_identity<flat_map_function_cannot_take<E, F>>{};
    else if constexpr (!std::ranges::input_range<std::remove_reference_t<std::invoke_result_t<F&, E&>>>)
      return std::type_identity<flat_map_function_must_return_a_range<E, std::invoke_result_t<F&, E&>>>{};
    else
      return std::type_identity<void>{};
  }
  using type = typename decltype(pick())::type;
};

// concatenate(a, b): the two sources hand out different types.
template <class A, class B>
struct concatenate_sources_differ_in_value_type {
  static_assert(always_false<A, B>,
                "ferry::concatenate: both sources must have the same value_type (the two types of "
                "concatenate_sources_differ_in_value_type<A, B> above); map one to the other's type "
                "first (b | ferry::map(...))");
};
// concatenate's misuse (join_adaptor's Misuse), void when A and B are one type.
template <class A, class B>
struct concatenate_misuse {
  using type = std::conditional_t<std::same_as<A, B>, void, concatenate_sources_differ_in_value_type<A, B>>;
};

}  // namespace ferry::detail
