// tests/core/take_skip.hpp: what take's and skip's tests share: a counting bulk source
// that fails where told, the oracles (first(n), drop(n), naive), events as strings, and
// a resume check at every event.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
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

// What a consumer that goes on after errors sees: values (a batch as "[a,b,]"), and
// "!<what>" for each error.
inline std::string show(std::uint64_t x) { return std::to_string(x); }
template <class B>
  requires requires(const B& b) { b.field(); }
std::string show(const B& b) {
  std::string s = "[";
  for (auto x : b.field()) s += std::to_string(x) + ",";
  return s + "]";
}
template <class S>
std::optional<std::string> event(S& s) {
  try {
    auto e = s.next();
    if (!e) return std::nullopt;
    return show(*e);
  } catch (const std::exception& e) {
    return std::string("!") + e.what();
  }
}
template <class S>
std::vector<std::string> events(S& s) {
  std::vector<std::string> out;
  for (std::size_t guard = 0; guard < 100000; ++guard) {
    auto e = event(s);
    if (!e) break;
    out.push_back(*e);
  }
  return out;
}

// The upstream's events: elements 0..size-1, each failing one replaced by its error.
inline std::vector<std::string> naive(std::uint64_t size, const std::vector<std::uint64_t>& fails) {
  std::vector<std::string> out;
  for (std::uint64_t i = 0; i < size; ++i)
    out.push_back(std::find(fails.begin(), fails.end(), i) != fails.end() ? "!failed at " + std::to_string(i)
                                                                          : std::to_string(i));
  return out;
}

// Saves after every event of make()'s run (through bytes, as a checkpoint file would),
// restores into a fresh make(), and checks the events then equal the uninterrupted run's.
template <class Make>
void resumes_everywhere(Make make) {
  auto ref = make();
  const auto whole = events(ref);
  for (std::size_t k = 0; k <= whole.size(); ++k) {
    CAPTURE(k);
    auto p = make();
    std::vector<std::string> got;
    for (std::size_t i = 0; i < k; ++i) got.push_back(*event(p));
    auto q = make();
    ferry::restore_state(q, ferry::pipeline_state::from_bytes(ferry::save_state(p).to_bytes()));
    auto rest = events(q);
    got.insert(got.end(), rest.begin(), rest.end());
    CHECK(got == whole);
  }
}

}  // namespace ferry_test
