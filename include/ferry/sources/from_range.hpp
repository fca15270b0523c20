// ferry/sources/from_range.hpp: an in-memory range as a source (tf.data's
// from_tensor_slices).
//
//   auto src = ferry::from_range(std::vector<int>{1, 2, 3});   // owns the vector
//   auto src = ferry::from_range(std::span(big_array));        // views it: keep it alive
//
// Each next() yields a copy of the next element; rewind() starts again from the first.
//
// Threads: runs on the thread that calls next() (a map or prefetch worker when those sit
// downstream); from_range starts no thread and calls no user function (only the range's
// own element copies and iterator operations).
//
// Errors: throws nothing itself, but restore() throws config_error for a state past the
// range's end. What copying an element throws propagates.
//
// Memory: the range, moved in (a view refers to memory the caller keeps alive), and the
// index of the next element.
//
// Checkpoints: save() records the index of the next element; restore() throws
// config_error for an index past this range's end (a state saved from a longer range).
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <ranges>
#include <string>
#include <utility>

#include "ferry/error.hpp"
#include "ferry/stage.hpp"

namespace ferry {
namespace detail {

template <std::ranges::random_access_range R>
class range_source : public source_base<range_source<R>, std::ranges::range_value_t<R>> {
  friend source_base<range_source, std::ranges::range_value_t<R>>;
  using T = std::ranges::range_value_t<R>;
  using D = std::ranges::range_difference_t<R>;  // i_ <= size() fits it

 public:
  static constexpr char name[] = "from_range";
  explicit range_source(R r) : r_(std::move(r)) {}

  std::uint64_t size() const { return std::ranges::size(r_); }

 private:
  std::optional<T> pull() {
    if (i_ >= size()) return std::nullopt;
    return std::optional<T>(std::ranges::begin(r_)[static_cast<D>(i_++)]);
  }
  std::size_t pull_bulk(std::span<T> out) {
    const std::uint64_t left = size() - i_;
    const std::size_t n = out.size() < left ? out.size() : static_cast<std::size_t>(left);
    std::copy_n(std::ranges::begin(r_) + static_cast<D>(i_), n, out.begin());
    i_ += n;
    return n;
  }
  std::span<const T> pull_view(std::size_t max)
    requires std::ranges::contiguous_range<const R>
  {
    const std::uint64_t left = size() - i_;
    const std::size_t n = max < left ? max : static_cast<std::size_t>(left);
    std::span<const T> v(std::ranges::data(r_) + i_, n);
    i_ += n;
    return v;
  }
  void start_epoch() { i_ = 0; }
  void save_words(state_writer& w) const { w.put(i_); }
  // Throws config_error for a state past this range's end (saved from a longer range).
  void restore_words(state_reader& r) {
    const std::uint64_t i = r.get();
    if (i > size())
      throw config_error("restore_state: from_range: the state is at element " + std::to_string(i) +
                         ", past the end of this range of " + std::to_string(size()) +
                         " (saved from a longer one?)");
    i_ = i;
  }

  R r_;
  std::uint64_t i_ = 0;
};

}  // namespace detail

// The type of ferry::from_range.
struct from_range_t {
  // A source over r: an owning range (a vector) is moved or copied in, a view (std::span)
  // refers to the caller's memory.
  template <std::ranges::random_access_range R>
    requires std::ranges::sized_range<R>
  auto operator()(R&& r) const {
    return detail::range_source<std::remove_cvref_t<R>>(std::forward<R>(r));
  }
};
// from_range(r): an in-memory random-access range as a source (see the file's top).
inline constexpr from_range_t from_range{};

}  // namespace ferry
