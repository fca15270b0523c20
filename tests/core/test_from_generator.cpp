// from_generator: elements are f(0), f(1), ...; a throwing f is an element_error naming the
// index (as map's), and both forms skip that index and go on; resume is exact.
#include <doctest/doctest.h>

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/doubles.hpp"
#include "ferry/ferry.hpp"

using ferry_test::drain;

namespace {
struct boom : std::runtime_error {
  using std::runtime_error::runtime_error;
};
constexpr std::uint64_t n = 20;

// Both forms, failing at the indices in `fails`; the optional form ends at n.
auto counted(std::vector<std::uint64_t> fails) {
  return ferry::from_generator(n, [fails](std::uint64_t i) {
    for (auto f : fails)
      if (i == f) throw boom("no element " + std::to_string(i));
    return i * 7;
  });
}
auto open_ended(std::vector<std::uint64_t> fails) {
  return ferry::from_generator([fails](std::uint64_t i) -> std::optional<std::uint64_t> {
    for (auto f : fails)
      if (i == f) throw boom("no element " + std::to_string(i));
    if (i >= n) return std::nullopt;
    return i * 7;
  });
}

// Drains `p`, checking each error is an element_error naming its index with the original
// nested; returns the elements and the failed indices.
template <class S>
std::pair<std::vector<std::uint64_t>, std::vector<std::uint64_t>> drain_checked(S& p) {
  std::vector<std::uint64_t> got, failed;
  for (int guard = 0; guard < 1000; ++guard) {
    try {
      auto e = p.next();
      if (!e) break;
      got.push_back(*e);
    } catch (const ferry::element_error& e) {
      failed.push_back(e.element());
      const std::string what = e.what();
      CHECK(what.find("from_generator") != std::string::npos);
      CHECK(what.find("element " + std::to_string(e.element())) != std::string::npos);
      bool nested_is_boom = false;
      try {
        std::rethrow_if_nested(e);
      } catch (const boom& b) {
        nested_is_boom = std::string(b.what()) == "no element " + std::to_string(e.element());
      }
      CHECK(nested_is_boom);
    }
  }
  return {got, failed};
}

template <class Make>
void check_form(Make make) {
  for (const std::vector<std::uint64_t>& fails :
       std::vector<std::vector<std::uint64_t>>{{}, {0}, {5}, {5, 6}, {19}, {0, 10, 19}}) {
    CAPTURE(fails.size());
    auto p = make(fails);
    auto [got, failed] = drain_checked(p);
    std::vector<std::uint64_t> expect;
    for (std::uint64_t i = 0; i < n; ++i)
      if (std::find(fails.begin(), fails.end(), i) == fails.end()) expect.push_back(i * 7);
    CHECK(got == expect);  // each failed index skipped, nothing else lost or repeated
    CHECK(failed == fails);
    // Resume from every point, right after an error included.
    for (std::size_t k = 0; k <= n; ++k) {
      CAPTURE(k);
      auto q = make(fails);
      std::vector<std::uint64_t> part, part_failed;
      for (std::size_t events = 0; events < k; ++events) {
        try {
          auto e = q.next();
          if (!e) break;
          part.push_back(*e);
        } catch (const ferry::element_error& e) {
          part_failed.push_back(e.element());
        }
      }
      auto r = make(fails);
      ferry::restore_state(r, ferry::save_state(q));
      auto [rest, rest_failed] = drain_checked(r);
      part.insert(part.end(), rest.begin(), rest.end());
      part_failed.insert(part_failed.end(), rest_failed.begin(), rest_failed.end());
      CHECK(part == expect);
      CHECK(part_failed == fails);
    }
  }
}
}  // namespace

TEST_CASE("from_generator(n, f): a throwing f is an element_error; the index is skipped") {
  check_form([](std::vector<std::uint64_t> f) { return counted(std::move(f)); });
}

TEST_CASE("from_generator(f) with optional results: the same errors, the same skipping") {
  check_form([](std::vector<std::uint64_t> f) { return open_ended(std::move(f)); });
}

TEST_CASE("from_generator: ferry's own errors pass through unchanged") {
  auto p = ferry::from_generator(5, [](std::uint64_t i) {
    if (i == 2) throw ferry::format_error("gen.bin", 2, "a bad record");
    return i;
  });
  REQUIRE(p.next());
  REQUIRE(p.next());
  CHECK_THROWS_AS(p.next(), ferry::format_error);
  CHECK(p.next() == std::uint64_t(3));
}

TEST_CASE("from_generator | batch (the bulk path): the error names its index, then it goes on") {
  auto q = ferry::from_generator(100, [](std::uint64_t i) {
             if (i == 42) throw boom("no element 42");
             return i;
           }) |
           ferry::batch(16);
  std::vector<std::uint64_t> got;
  int errors = 0;
  for (;;) {
    try {
      auto b = q.next();
      if (!b) break;
      for (auto x : b->field()) got.push_back(x);
    } catch (const ferry::element_error& e) {
      ++errors;
      CHECK(e.element() == 42);
    }
  }
  CHECK(errors == 1);
  // The batch being built ([32, 48)) goes with the error (documented); the rest follows.
  std::vector<std::uint64_t> expect;
  for (std::uint64_t i = 0; i < 100; ++i)
    if (i < 32 || i > 42) expect.push_back(i);
  CHECK(got == expect);
}
