// ferry/sources/from_range.hpp: an in-memory range as a source (tf.data's
// from_tensor_slices).
//
//   auto src = ferry::from_range(std::vector<int>{1, 2, 3});   // owns the vector
//   auto src = ferry::from_range(std::span(big_array));        // views it: keep it alive
//
// Each next() yields a copy of the next element; rewind() starts again from the first.
// Runs on the thread that calls next(). Throws nothing itself, but restore() throws
// config_error for a state past the range's end.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <ranges>
#include <string>
#include <utility>

#include "ferry/error.hpp"
#include "ferry/source.hpp"

namespace ferry {
namespace detail {

template <std::ranges::random_access_range R>
class range_source : public source_interface<range_source<R>> {
 public:
  using value_type = std::ranges::range_value_t<R>;

  explicit range_source(R r) : r_(std::move(r)) {}

  std::optional<value_type> next() {
    if (i_ >= static_cast<std::uint64_t>(std::ranges::size(r_))) return std::nullopt;
    return std::optional<value_type>(std::ranges::begin(r_)[i_++]);
  }
  std::size_t next_bulk(std::span<value_type> out) {
    const std::uint64_t left = static_cast<std::uint64_t>(std::ranges::size(r_)) - i_;
    const std::size_t n = out.size() < left ? out.size() : static_cast<std::size_t>(left);
    std::copy_n(std::ranges::begin(r_) + i_, n, out.begin());
    i_ += n;
    return n;
  }
  std::span<const value_type> next_view(std::size_t max)
    requires std::ranges::contiguous_range<const R>
  {
    const std::uint64_t left = static_cast<std::uint64_t>(std::ranges::size(r_)) - i_;
    const std::size_t n = max < left ? max : static_cast<std::size_t>(left);
    std::span<const value_type> v(std::ranges::data(r_) + i_, n);
    i_ += n;
    return v;
  }
  void rewind() { i_ = 0; }
  void save(state_writer& w) const {
    w.tag("from_range");
    w.put(i_);
  }
  // Throws config_error for a state past this range's end (saved from a longer range).
  void restore(state_reader& r) {
    r.expect("from_range");
    const std::uint64_t i = r.get();
    if (i > size())
      throw config_error("restore_state: from_range: the state is at element " + std::to_string(i) +
                         ", past the end of this range of " + std::to_string(size()) +
                         " (saved from a longer one?)");
    i_ = i;
  }
  std::uint64_t size() const { return std::ranges::size(r_); }

 private:
  R r_;
  std::uint64_t i_ = 0;
};

}  // namespace detail

struct from_range_t {
  template <std::ranges::random_access_range R>
    requires std::ranges::sized_range<R>
  auto operator()(R&& r) const {
    return detail::range_source<std::remove_cvref_t<R>>(std::forward<R>(r));
  }
};
inline constexpr from_range_t from_range{};

}  // namespace ferry
