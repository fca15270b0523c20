// ferry/stages/filter.hpp: filter(pred) keeps the elements for which pred(element) is true.
//
//   src | ferry::filter([](const rec& r) { return r.label != 0; })
//
// Threads: pred runs on the thread that calls next() (a map or prefetch worker when those
// sit downstream). filter starts no thread of its own.
//
// Errors: if pred throws on upstream element k (counting every element filter pulled this
// epoch, kept or not), next() throws ferry::element_error ("filter: user function threw
// at element k: ...") with the original exception nested (std::rethrow_if_nested);
// ferry's own errors pass through unchanged. Element k is dropped; a consumer that
// catches and goes on gets the elements after it. Upstream errors propagate unchanged,
// and the next call goes on with whatever upstream gives next.
// Compile-time errors: a pred that cannot take the element as const E&, or whose result
// does not convert to bool, is a static_assert naming E (detail::
// filter_predicate_cannot_take<E, P>, filter_predicate_result_is_not_bool<E, Result>).
//
// Memory: one element at a time, the one pred is looking at; nothing is buffered.
//
// Checkpoints: save() records the upstream's state, filter's tag and the count of upstream
// elements pulled this epoch (so an error after a restore names the same k); restore()
// throws config_error when the state has another stage at that place (another pipeline
// shape).
#pragma once

#include <concepts>
#include <cstdint>
#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

#include "ferry/error.hpp"
#include "ferry/stage.hpp"

namespace ferry {
namespace detail {

template <source Up, class P>
class filter_source : public stage<filter_source<Up, P>, Up> {
  using base = stage<filter_source<Up, P>, Up>;
  friend base;

 public:
  static constexpr char name[] = "filter";
  filter_source(Up up, P p) : base(std::move(up)), p_(std::move(p)) {}

 private:
  std::optional<value_t<Up>> pull() {
    while (std::optional<value_t<Up>> e = this->pull_up()) {
      const std::uint64_t k = n_++;
      bool keep;
      try {
        keep = p_(std::as_const(*e));
      } catch (...) {
        rethrow_element(std::current_exception(), name, k);
      }
      if (keep) return e;
    }
    return std::nullopt;
  }
  void start_epoch() { n_ = 0; }
  void save_words(state_writer& w) const { w.put(n_); }
  void restore_words(state_reader& r) { n_ = r.get(); }

  P p_;
  std::uint64_t n_ = 0;  // upstream elements pulled this epoch: names the element in errors
};

// Compile errors naming the element type E (source.hpp says how).
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

}  // namespace detail

// The type of ferry::filter: filter(src, pred), or filter(pred) for `src | filter(pred)`.
struct filter_t : stage_adaptor<filter_t> {
  // stage_adaptor's argument check: any predicate is accepted here (its signature is
  // checked by make, at compile time).
  template <class P>
  static void check(const P&) {}
  // Builds the stage over s (stage_adaptor calls it); pred must be callable as
  // pred(const E&) -> bool.
  template <source S, class P>
  static auto make(S&& s, P p) {
    using E = value_t<S>;
    // A misuse stops here, so the stage below is not instantiated with it.
    if constexpr (!std::invocable<P&, const E&>)
      return typename detail::filter_predicate_cannot_take<E, P>::error_above{};
    else if constexpr (!std::predicate<P&, const E&>)
      return typename detail::filter_predicate_result_is_not_bool<E, std::invoke_result_t<P&, const E&>>::error_above{};
    else
      return detail::filter_source<std::remove_cvref_t<S>, P>(std::forward<S>(s), std::move(p));
  }
};
// filter(pred): keeps the elements for which pred(element) is true (see the file's top).
inline constexpr filter_t filter{};

}  // namespace ferry
