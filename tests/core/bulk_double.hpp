// tests/core/bulk_double.hpp: what take's and skip's tests share: a counting bulk source
// that fails where told, and the oracle's first(n) / drop(n).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ferry/source.hpp"
#include "ferry/state.hpp"

namespace ferry_test {

template <class T>
std::vector<T> drop(const std::vector<T>& v, std::uint64_t n) {
  return n >= v.size() ? std::vector<T>{} : std::vector<T>(v.begin() + static_cast<std::ptrdiff_t>(n), v.end());
}
template <class T>
std::vector<T> first(const std::vector<T>& v, std::uint64_t n) {
  return n >= v.size() ? v : std::vector<T>(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(n));
}

// A bulk source of 0..n-1 that counts its calls. At a failing index both next() and
// next_bulk() use the element up and throw "failed at <i>"; a bulk run's elements before
// it go with the error (as from_generator's do). Rewindable and resumable.
class bulk_double : public ferry::source_interface<bulk_double> {
 public:
  struct calls {
    std::uint64_t next = 0, bulk = 0;
  };
  using value_type = std::uint64_t;
  explicit bulk_double(std::uint64_t n, std::vector<std::uint64_t> fails = {})
      : n_(n), fails_(std::move(fails)), calls_(std::make_shared<calls>()) {}
  std::optional<value_type> next() {
    ++calls_->next;
    if (i_ >= n_) return std::nullopt;
    return get(i_++);
  }
  std::size_t next_bulk(std::span<value_type> out) {
    ++calls_->bulk;
    std::size_t k = 0;
    while (k < out.size() && i_ < n_) out[k++] = get(i_++);
    return k;
  }
  void rewind() { i_ = 0; }
  void save(ferry::state_writer& w) const {
    w.tag("bulk_double");
    w.put(i_);
  }
  void restore(ferry::state_reader& r) {
    r.expect("bulk_double");
    i_ = r.get();
  }
  std::shared_ptr<calls> counts() const { return calls_; }

 private:
  std::uint64_t get(std::uint64_t i) const {
    if (std::find(fails_.begin(), fails_.end(), i) != fails_.end())
      throw std::runtime_error("failed at " + std::to_string(i));
    return i;
  }
  std::uint64_t n_;
  std::vector<std::uint64_t> fails_;
  std::shared_ptr<calls> calls_;
  std::uint64_t i_ = 0;
};

}  // namespace ferry_test
