// ferry/stages/skip.hpp: skip(n) drops the first n elements of every epoch and hands on
// the rest; take(n)'s complement.
//
//   src | ferry::take(1000)   // the validation split
//   src | ferry::skip(1000)   // the training split: everything after it
//
// Every epoch (every pass after rewind()) drops its own first n elements; skip(0) hands
// everything on, and an epoch of n elements or fewer is empty (not an error). Runs on the
// calling thread; throws nothing itself.
// Errors: an upstream exception reaches the consumer unchanged, at its position, and does
// not count toward n (no element was skipped); the next call goes on. next() skips
// element by element, so this holds exactly. next_bulk() (batch() pulling a run) skips
// in runs, into the caller's own buffer (no allocation): if the upstream throws inside a
// run being skipped, skip cannot tell how many of that run's elements the upstream used
// up before the error (they go with it, as any bulk run's do: batch() drops the batch it
// was building), so it counts none of them. It may then drop more than n, never fewer:
// an element among the first n is never handed on.
// Checkpoints: the upstream's state, then how many elements this epoch skipped so far;
// a restore mid-skip drops only the rest of the n. A state that skipped more than this
// skip's n (saved from a skip of a larger n) is a config_error naming both.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "ferry/error.hpp"
#include "ferry/memory/buffer.hpp"
#include "ferry/observe/hooks.hpp"
#include "ferry/source.hpp"

namespace ferry {
namespace detail {

template <source Up>
class skip_source : public source_interface<skip_source<Up>> {
 public:
  using value_type = value_t<Up>;
  skip_source(Up up, std::uint64_t n) : up_(std::move(up)), n_(n) {}

  std::optional<value_type> next() {
    return observe::observed_next(stats_, "skip", [&]() -> std::optional<value_type> {
      while (skipped_ < n_) {
        if (!probe_.pull(up_)) return std::nullopt;  // the epoch ended inside the first n
        ++skipped_;
      }
      return probe_.pull(up_);
    });
  }
  // Skips in runs of out.size(), pulled into `out` itself, then fills it.
  std::size_t next_bulk(std::span<value_type> out)
    requires bulk_source<Up>
  {
    return observe::observed_bulk(stats_, "skip", out, [&]() -> std::size_t {
      if (out.empty()) return 0;
      while (skipped_ < n_) {
        const std::uint64_t left = n_ - skipped_;
        const std::size_t want = out.size() < left ? out.size() : static_cast<std::size_t>(left);
        const std::size_t k = probe_.pull_bulk(up_, out.first(want));
        skipped_ += k;
        if (k < want) return 0;  // the epoch ended inside the first n
      }
      return probe_.pull_bulk(up_, out);
    });
  }
  void rewind()
    requires rewindable_source<Up>
  {
    up_.rewind();
    skipped_ = 0;
  }
  void save(state_writer& w) const
    requires resumable_source<Up>
  {
    up_.save(w);
    w.tag("skip");
    w.put(skipped_);
  }
  // Throws config_error for a state that skipped more than n.
  void restore(state_reader& r)
    requires resumable_source<Up>
  {
    up_.restore(r);
    r.expect("skip");
    const std::uint64_t skipped = r.get();
    if (skipped > n_)
      throw config_error("restore_state: skip: the state skipped " + std::to_string(skipped) +
                         " elements, more than this skip(" + std::to_string(n_) +
                         ") drops (saved from a skip of a larger n?)");
    skipped_ = skipped;
  }
  // batch()'s size, passed on for distribute() (batches go through unchanged).
  std::size_t batch_size() const requires sized_batches<Up> { return up_.batch_size(); }
  bool set_buffer_resource(const std::shared_ptr<std::pmr::memory_resource>& r) {
    return forward_buffer_resource(up_, r);
  }
  void visit_stages(observe::stage_visitor& v) const {
    probe_.visit(up_, v);
    v.add("skip", stats_, observe::stage_mode::inline_stage, 1);
  }

 private:
  Up up_;
  std::uint64_t n_;
  std::uint64_t skipped_ = 0;  // elements dropped this epoch (at most n_)
  observe::stage_counters stats_;
  [[no_unique_address]] observe::upstream_probe<Up> probe_;
};

}  // namespace detail

struct skip_t {
  template <source S>
  auto operator()(S&& s, std::uint64_t n) const {
    detail::require_rvalue_source<S>();
    return detail::skip_source<std::remove_cvref_t<S>>(std::forward<S>(s), n);
  }
  auto operator()(std::uint64_t n) const {
    return make_closure([n]<class S>(S&& s) { return skip_t{}(std::forward<S>(s), n); });
  }
};
inline constexpr skip_t skip{};

}  // namespace ferry
