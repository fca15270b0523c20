// A deterministic source whose next() throws at chosen element indices, for testing how
// stages carry upstream errors. Elements are i * scale for i in [0, n); at a failing
// index next() consumes the element and throws std::runtime_error("failed at <i>")
// instead, as a corrupt record or a missing file does. Rewindable and resumable (its
// state is the index), so a restore to before a failing index fails there again.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ferry/source.hpp"

namespace ferry_test {

class failing_source : public ferry::source_interface<failing_source> {
 public:
  using value_type = std::uint64_t;
  failing_source(std::uint64_t n, std::vector<std::uint64_t> fail_at, std::uint64_t scale = 1)
      : n_(n), fail_(std::move(fail_at)), scale_(scale) {}
  std::optional<value_type> next() {
    if (i_ >= n_) return std::nullopt;
    const std::uint64_t i = i_++;
    if (std::find(fail_.begin(), fail_.end(), i) != fail_.end())
      throw std::runtime_error(prefix_ + "failed at " + std::to_string(i));
    return i * scale_;
  }
  void rewind() { i_ = 0; }
  void save(ferry::state_writer& w) const {
    w.tag("failing");
    w.put(i_);
  }
  void restore(ferry::state_reader& r) {
    r.expect("failing");
    i_ = r.get();
  }
  // Names this source in its messages ("b: failed at 3").
  failing_source&& named(std::string name) && {
    prefix_ = std::move(name) + ": ";
    return std::move(*this);
  }

 private:
  std::uint64_t n_;
  std::vector<std::uint64_t> fail_;
  std::uint64_t scale_;
  std::uint64_t i_ = 0;
  std::string prefix_;
};

// Drains `s`, catching and counting errors (a consumer that goes on after an error).
// Returns the elements; `errors` receives each error's message, in order.
template <class S>
std::vector<ferry::value_t<S>> drain_through_errors(S& s, std::vector<std::string>& errors,
                                                    std::size_t max_errors = 100) {
  std::vector<ferry::value_t<S>> out;
  for (;;) {
    try {
      auto e = s.next();
      if (!e) break;
      out.push_back(std::move(*e));
    } catch (const std::exception& e) {
      errors.push_back(e.what());
      if (errors.size() >= max_errors) break;  // a stage that throws forever: stop
    }
  }
  return out;
}

// A consumer that checkpoints mid-epoch through errors: pulls k times from make()'s
// pipeline (values and errors alike), saves, restores into a fresh make() and drains it
// through its errors. Returns everything seen, before and after, which must equal one
// uninterrupted drain: nothing lost, nothing twice.
template <class Make>
auto resumed_through_errors(Make make, std::size_t k, std::vector<std::string>& errors) {
  auto a = make();
  std::vector<ferry::value_t<decltype(a)>> seen;
  for (std::size_t i = 0; i < k; ++i) {
    try {
      if (auto e = a.next()) seen.push_back(std::move(*e));
    } catch (const std::exception& e) {
      errors.push_back(e.what());
    }
  }
  auto b = make();
  ferry::restore_state(b, ferry::save_state(a));
  auto rest = drain_through_errors(b, errors);
  seen.insert(seen.end(), std::make_move_iterator(rest.begin()), std::make_move_iterator(rest.end()));
  return seen;
}

}  // namespace ferry_test
