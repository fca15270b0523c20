// ferry/stages/shuffle.hpp: shuffle(buffer, seed) reorders elements within windows of
// `buffer` elements, with a new order every epoch.
//
//   from_files(...) | ferry::shuffle(10'000, 42) | ferry::repeat(10)
//
// How: it fills a window of `buffer` elements, permutes it (Fisher-Yates) with a generator
// seeded from (seed, epoch, window number), and hands the window out; then the next. The
// order is a function of (seed, epoch, upstream order) alone, so it is the same whatever
// the thread count, and a new permutation each epoch (rewind() advances the epoch).
//
// Why windows and not tf.data's sliding buffer: an element stays in a window for at most
// `buffer` pulls, so save() records only the upstream position at the window's start and
// the offset inside it; restore() re-reads at most one window. A sliding buffer would have
// to store its contents (or replay the epoch) to resume. For global mixing, combine with
// file-order shuffling and interleave, as with tf.data.
//
// Memory: at most `buffer` elements held. Throws config_error for buffer == 0. Runs on
// the calling thread; upstream errors propagate unchanged.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "ferry/detail/random.hpp"
#include "ferry/error.hpp"
#include "ferry/memory/buffer.hpp"
#include "ferry/observe/hooks.hpp"
#include "ferry/source.hpp"

namespace ferry {
namespace detail {

template <source Up>
class shuffle_source : public source_interface<shuffle_source<Up>> {
 public:
  using value_type = value_t<Up>;
  shuffle_source(Up up, std::size_t buffer, std::uint64_t seed)
      : up_(std::move(up)), cap_(buffer), seed_(seed) {}

  std::optional<value_type> next() {
    return observe::observed_next(stats_, "shuffle", [&]() -> std::optional<value_type> {
      if (pos_ >= win_.size() && !fill()) return std::nullopt;
      return std::optional<value_type>(std::move(win_[pos_++]));
    });
  }

  // The next epoch: a new permutation.
  void rewind()
    requires rewindable_source<Up>
  {
    up_.rewind();
    ++epoch_;
    window_ = 0;
    win_.clear();
    pos_ = 0;
    ended_ = false;
  }
  std::uint64_t epoch() const { return epoch_; }

  void save(state_writer& w) const
    requires resumable_source<Up>
  {
    const bool mid = pos_ < win_.size();
    if (mid)
      w.put_words(start_.words);  // upstream as it was at this window's start
    else
      up_.save(w);
    w.tag("shuffle");
    w.put(epoch_);
    w.put(mid ? window_ - 1 : window_);
    w.put(mid ? pos_ : 0);
  }
  void restore(state_reader& r)
    requires resumable_source<Up>
  {
    up_.restore(r);
    r.expect("shuffle");
    epoch_ = r.get();
    window_ = r.get();
    const std::uint64_t skip = r.get();
    win_.clear();
    pos_ = 0;
    if (skip) {  // re-read the window we were in, then skip what was handed out
      fill();
      pos_ = static_cast<std::size_t>(skip) < win_.size() ? skip : win_.size();
    }
  }
  bool set_buffer_resource(const std::shared_ptr<std::pmr::memory_resource>& r) {
    return forward_buffer_resource(up_, r);
  }
  void visit_stages(observe::stage_visitor& v) const {
    probe_.visit(up_, v);
    v.add("shuffle", stats_, observe::stage_mode::inline_stage, 1);
  }

 private:
  bool fill() {
    win_.clear();
    pos_ = 0;
    if (ended_) return false;
    if constexpr (resumable_source<Up>) {
      start_.words.clear();
      state_writer w(start_);
      up_.save(w);
    }
    while (win_.size() < cap_) {
      std::optional<value_type> e = probe_.pull(up_);
      if (!e) {
        ended_ = true;
        break;
      }
      win_.push_back(std::move(*e));
    }
    splitmix64 g(mix_seed({seed_, epoch_, window_++}));
    for (std::size_t i = win_.size(); i > 1; --i) {
      const std::size_t j = g.below(i);
      if (j != i - 1) std::swap(win_[i - 1], win_[j]);
    }
    return !win_.empty();
  }

  Up up_;
  std::size_t cap_;
  std::uint64_t seed_;
  std::uint64_t epoch_ = 0;
  std::uint64_t window_ = 0;  // windows filled this epoch
  std::vector<value_type> win_;
  std::size_t pos_ = 0;
  bool ended_ = false;
  pipeline_state start_;  // upstream position at the current window's start
  observe::stage_counters stats_;
  [[no_unique_address]] observe::upstream_probe<Up> probe_;
};

}  // namespace detail

struct shuffle_t {
  template <source S>
  auto operator()(S&& s, std::size_t buffer, std::uint64_t seed) const {
    detail::require_rvalue_source<S>();
    check(buffer);
    return detail::shuffle_source<std::remove_cvref_t<S>>(std::forward<S>(s), buffer, seed);
  }
  auto operator()(std::size_t buffer, std::uint64_t seed) const {
    check(buffer);
    return make_closure(
        [buffer, seed]<class S>(S&& s) { return shuffle_t{}(std::forward<S>(s), buffer, seed); });
  }

 private:
  static void check(std::size_t buffer) {
    if (buffer == 0)
      throw config_error("shuffle: the buffer must hold at least 1 element (got 0; 1 means no shuffling)");
  }
};
inline constexpr shuffle_t shuffle{};

}  // namespace ferry
