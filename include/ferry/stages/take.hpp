// ferry/stages/take.hpp: take(n) ends the epoch after n elements.
//
//   src | ferry::take(1000)
//
// Pulls at most n elements from upstream (never one more). Runs on the calling thread;
// throws nothing itself. An upstream exception reaches the consumer unchanged and does
// not count toward n (no element was taken); the next call goes on.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>

#include "ferry/memory/buffer.hpp"
#include "ferry/observe/hooks.hpp"
#include "ferry/source.hpp"

namespace ferry {
namespace detail {

template <source Up>
class take_source : public source_interface<take_source<Up>> {
 public:
  using value_type = value_t<Up>;
  take_source(Up up, std::uint64_t n) : up_(std::move(up)), n_(n) {}

  std::optional<value_type> next() {
    return observe::observed_next(stats_, "take", [&]() -> std::optional<value_type> {
      if (taken_ >= n_) return std::nullopt;
      std::optional<value_type> e = probe_.pull(up_);
      if (e) ++taken_;
      return e;
    });
  }
  std::size_t next_bulk(std::span<value_type> out)
    requires bulk_source<Up>
  {
    return observe::observed_bulk(stats_, "take", out, [&] {
      const std::uint64_t left = n_ - taken_;
      const std::size_t k = probe_.pull_bulk(up_, out.first(out.size() < left ? out.size() : left));
      taken_ += k;
      return k;
    });
  }
  void rewind()
    requires rewindable_source<Up>
  {
    up_.rewind();
    taken_ = 0;
  }
  void save(state_writer& w) const
    requires resumable_source<Up>
  {
    up_.save(w);
    w.tag("take");
    w.put(taken_);
  }
  void restore(state_reader& r)
    requires resumable_source<Up>
  {
    up_.restore(r);
    r.expect("take");
    taken_ = r.get();
  }
  // batch()'s size, passed on for distribute() (batches go through unchanged).
  std::size_t batch_size() const requires sized_batches<Up> { return up_.batch_size(); }
  bool set_buffer_resource(const std::shared_ptr<std::pmr::memory_resource>& r) {
    return forward_buffer_resource(up_, r);
  }
  void visit_stages(observe::stage_visitor& v) const {
    probe_.visit(up_, v);
    v.add("take", stats_, observe::stage_mode::inline_stage, 1);
  }

 private:
  Up up_;
  std::uint64_t n_;
  std::uint64_t taken_ = 0;
  observe::stage_counters stats_;
  [[no_unique_address]] observe::upstream_probe<Up> probe_;
};

}  // namespace detail

struct take_t {
  template <source S>
  auto operator()(S&& s, std::uint64_t n) const {
    detail::require_rvalue_source<S>();
    return detail::take_source<std::remove_cvref_t<S>>(std::forward<S>(s), n);
  }
  auto operator()(std::uint64_t n) const {
    return make_closure([n]<class S>(S&& s) { return take_t{}(std::forward<S>(s), n); });
  }
};
inline constexpr take_t take{};

}  // namespace ferry
