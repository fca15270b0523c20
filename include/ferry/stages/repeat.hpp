// ferry/stages/repeat.hpp: repeat(n) plays the upstream dataset n times; repeat() forever.
//
//   src | ferry::shuffle(1024, seed) | ferry::repeat(3)   // three epochs, three orders
//
// Between epochs it calls upstream.rewind(), so a shuffle upstream draws a new order.
// An empty dataset ends at once (never spins). Needs a rewindable upstream. Runs on the
// calling thread; throws nothing itself.
// Errors: an upstream exception reaches the consumer unchanged; the next call goes on in
// the same epoch. An epoch that threw is not empty, even with no element (a file that
// failed to open this time): repeat goes on to the next epoch rather than end early.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <utility>

#include "ferry/memory/buffer.hpp"
#include "ferry/observe/hooks.hpp"
#include "ferry/source.hpp"

namespace ferry {
namespace detail {

template <source Up>
class repeat_source : public source_interface<repeat_source<Up>> {
 public:
  using value_type = value_t<Up>;
  repeat_source(Up up, std::uint64_t n) : up_(std::move(up)), n_(n) {}

  std::optional<value_type> next() {
    return observe::observed_next(stats_, "repeat", [&] { return next_impl(); });
  }
  // The number of completed passes over the upstream dataset.
  std::uint64_t epoch() const { return epoch_; }

  void rewind() {
    up_.rewind();
    epoch_ = 0;
    seen_in_epoch_ = false;
  }
  void save(state_writer& w) const
    requires resumable_source<Up>
  {
    up_.save(w);
    w.tag("repeat");
    w.put(epoch_);
    w.put(seen_in_epoch_);
  }
  void restore(state_reader& r)
    requires resumable_source<Up>
  {
    up_.restore(r);
    r.expect("repeat");
    epoch_ = r.get();
    seen_in_epoch_ = r.get() != 0;
  }
  // batch()'s size, passed on for distribute() (batches go through unchanged).
  std::size_t batch_size() const requires sized_batches<Up> { return up_.batch_size(); }
  bool set_buffer_resource(const std::shared_ptr<std::pmr::memory_resource>& r) {
    return forward_buffer_resource(up_, r);
  }
  void visit_stages(observe::stage_visitor& v) const {
    probe_.visit(up_, v);
    v.add("repeat", stats_, observe::stage_mode::inline_stage, 1);
  }

 private:
  std::optional<value_type> next_impl() {
    while (epoch_ < n_) {
      std::optional<value_type> e;
      try {
        e = probe_.pull(up_);
      } catch (...) {
        seen_in_epoch_ = true;  // data that failed is not an empty dataset
        throw;
      }
      if (e) {
        seen_in_epoch_ = true;
        return e;
      }
      if (!seen_in_epoch_) {  // an empty epoch: the dataset is empty, stop
        epoch_ = n_;
        break;
      }
      if (++epoch_ < n_) {
        up_.rewind();
        seen_in_epoch_ = false;
      }
    }
    return std::nullopt;
  }

  Up up_;
  std::uint64_t n_;
  std::uint64_t epoch_ = 0;
  bool seen_in_epoch_ = false;
  observe::stage_counters stats_;
  [[no_unique_address]] observe::upstream_probe<Up> probe_;
};

}  // namespace detail

struct repeat_t {
  static constexpr std::uint64_t forever = std::numeric_limits<std::uint64_t>::max();

  template <source S>
  auto operator()(S&& s, std::uint64_t n = forever) const {
    detail::require_rvalue_source<S>();
    static_assert(rewindable_source<S>,
                  "ferry::repeat: the upstream must be rewindable (have rewind()) to be "
                  "played again; every ferry source and stage is");
    return detail::repeat_source<std::remove_cvref_t<S>>(std::forward<S>(s), n);
  }
  auto operator()(std::uint64_t n = forever) const {
    return make_closure([n]<class S>(S&& s) { return repeat_t{}(std::forward<S>(s), n); });
  }
};
inline constexpr repeat_t repeat{};

}  // namespace ferry
