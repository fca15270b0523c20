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

#include "ferry/detail/holds_ahead.hpp"
#include "ferry/error.hpp"
#include "ferry/stage.hpp"
#include "ferry/stages/detail/diagnostics.hpp"

namespace ferry {
namespace detail {

template <source Up, class P>
class filter_source : public stage<filter_source<Up, P>, Up> {
  friend stage<filter_source, Up>;

 public:
  static constexpr char name[] = "filter";
  filter_source(Up up, P p) : stage<filter_source, Up>(std::move(up)), p_(std::move(p)) {}

 private:
  std::optional<value_t<Up>> pull() {
    while (std::optional<value_t<Up>> e = this->pull_up()) {
      const std::uint64_t k = n_++;
      bool keep;
      try {
        keep = as_user_code<bool>([&]() -> bool { return p_(std::as_const(*e)); });  // user code (holds_ahead.hpp)
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

}  // namespace detail

// filter(pred) or filter(src, pred): keeps the elements for which pred(element) is true;
// pred(const E&) -> bool (see the file's top).
inline constexpr fn_adaptor<detail::filter_source, detail::filter_misuse> filter{};

}  // namespace ferry
