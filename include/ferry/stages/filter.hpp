// ferry/stages/filter.hpp: filter(pred) keeps the elements for which pred(element) is true.
//
//   src | ferry::filter([](const rec& r) { return r.label != 0; })
//
// pred runs on the thread that calls next() (a map or prefetch worker when those sit
// downstream).
// Errors: if pred throws on upstream element k (counting every element filter pulled this
// epoch, kept or not), next() throws ferry::element_error ("filter: user function threw
// at element k: ...") with the original exception nested (std::rethrow_if_nested);
// ferry's own errors pass through unchanged. Element k is dropped; a consumer that
// catches and goes on gets the elements after it. Upstream errors propagate unchanged,
// and the next call goes on with whatever upstream gives next.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

#include "ferry/error.hpp"
#include "ferry/memory/buffer.hpp"
#include "ferry/observe/hooks.hpp"
#include "ferry/source.hpp"

namespace ferry {
namespace detail {

template <source Up, class P>
class filter_source : public source_interface<filter_source<Up, P>> {
 public:
  using value_type = value_t<Up>;
  filter_source(Up up, P p) : up_(std::move(up)), p_(std::move(p)) {}

  std::optional<value_type> next() {
    return observe::observed_next(stats_, "filter", [&]() -> std::optional<value_type> {
      while (std::optional<value_type> e = probe_.pull(up_)) {
        const std::uint64_t k = n_++;
        bool keep;
        try {
          keep = p_(std::as_const(*e));
        } catch (...) {
          rethrow_element(std::current_exception(), "filter", k);
        }
        if (keep) return e;
      }
      return std::nullopt;
    });
  }
  void rewind()
    requires rewindable_source<Up>
  {
    up_.rewind();
    n_ = 0;
  }
  void save(state_writer& w) const
    requires resumable_source<Up>
  {
    up_.save(w);
    w.tag("filter");
    w.put(n_);
  }
  void restore(state_reader& r)
    requires resumable_source<Up>
  {
    up_.restore(r);
    r.expect("filter");
    n_ = r.get();
  }
  // batch()'s size, passed on for distribute() (batches go through unchanged).
  std::size_t batch_size() const requires sized_batches<Up> { return up_.batch_size(); }
  bool set_buffer_resource(const std::shared_ptr<std::pmr::memory_resource>& r) {
    return forward_buffer_resource(up_, r);
  }
  void visit_stages(observe::stage_visitor& v) const {
    probe_.visit(up_, v);
    v.add("filter", stats_, observe::stage_mode::inline_stage, 1);
  }

 private:
  Up up_;
  P p_;
  std::uint64_t n_ = 0;  // upstream elements pulled this epoch: names the element in errors
  observe::stage_counters stats_;
  [[no_unique_address]] observe::upstream_probe<Up> probe_;
};

}  // namespace detail

struct filter_t {
  template <source S, class P>
    requires std::predicate<P&, const value_t<S>&>
  auto operator()(S&& s, P p) const {
    detail::require_rvalue_source<S>();
    return detail::filter_source<std::remove_cvref_t<S>, P>(std::forward<S>(s), std::move(p));
  }
  template <class P>
  auto operator()(P p) const {
    return make_closure([p]<class S>(S&& s) { return filter_t{}(std::forward<S>(s), p); });
  }
};
inline constexpr filter_t filter{};

}  // namespace ferry
