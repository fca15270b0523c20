// filter: keeps what the predicate keeps; a throwing predicate is an element_error naming
// the element (as map's); upstream errors pass through and filter goes on; resume is exact.
#include <doctest/doctest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "common/doubles.hpp"
#include "failing_source.hpp"
#include "ferry/ferry.hpp"

using ferry_test::drain;

namespace {
struct boom : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Keeps x % 3 != 0; throws boom on x == k.
auto keep_or_throw(std::uint64_t k) {
  return [k](const std::uint64_t& x) {
    if (x == k) throw boom("bad element " + std::to_string(x));
    return x % 3 != 0;
  };
}
}  // namespace

TEST_CASE("filter equals the naive filter") {
  for (std::uint64_t n : {0, 1, 2, 50}) {
    auto p = ferry::from_generator(n, [](std::uint64_t i) { return i; }) | ferry::filter(keep_or_throw(~0ull));
    std::vector<std::uint64_t> expect;
    for (std::uint64_t i = 0; i < n; ++i)
      if (i % 3 != 0) expect.push_back(i);
    CHECK(drain(p) == expect);
  }
}

TEST_CASE("a throwing predicate is an element_error at its element; the rest follows") {
  constexpr std::uint64_t n = 40;
  for (std::uint64_t k : {0, 1, 3, 20, 39}) {
    CAPTURE(k);
    auto p = ferry::from_generator(n, [](std::uint64_t i) { return i; }) | ferry::filter(keep_or_throw(k));
    std::vector<std::uint64_t> before;
    bool threw = false;
    try {
      while (auto e = p.next()) before.push_back(*e);
    } catch (const ferry::element_error& e) {
      threw = true;
      CHECK(e.element() == k);
      const std::string what = e.what();
      CHECK(what.find("filter") != std::string::npos);
      CHECK(what.find("element " + std::to_string(k)) != std::string::npos);
      CHECK(what.find("bad element " + std::to_string(k)) != std::string::npos);
      bool nested_is_boom = false;
      try {
        std::rethrow_if_nested(e);
      } catch (const boom& b) {
        nested_is_boom = std::string(b.what()) == "bad element " + std::to_string(k);
      }
      CHECK(nested_is_boom);
    }
    CHECK(threw);
    std::vector<std::uint64_t> expect_before, expect_after;
    for (std::uint64_t i = 0; i < n; ++i)
      if (i != k && i % 3 != 0) (i < k ? expect_before : expect_after).push_back(i);
    CHECK(before == expect_before);
    CHECK(drain(p) == expect_after);  // a consumer that goes on loses only element k
  }
}

TEST_CASE("ferry's own errors from the predicate pass through unchanged") {
  auto p = ferry::from_generator(10, [](std::uint64_t i) { return i; }) | ferry::filter([](const std::uint64_t& x) {
             if (x == 4) throw ferry::format_error("f.bin", 4, "a bad record");
             return true;
           });
  for (int i = 0; i < 4; ++i) REQUIRE(p.next());
  CHECK_THROWS_AS(p.next(), ferry::format_error);
  CHECK(p.next() == std::uint64_t(5));
}

TEST_CASE("an upstream error reaches the consumer through filter, which goes on") {
  auto p = ferry_test::failing_source(30, {4, 10, 11}) | ferry::filter(keep_or_throw(~0ull));
  std::vector<std::string> errors;
  auto got = ferry_test::drain_through_errors(p, errors);
  CHECK(errors == std::vector<std::string>{"failed at 4", "failed at 10", "failed at 11"});
  std::vector<std::uint64_t> expect;
  for (std::uint64_t i = 0; i < 30; ++i)
    if (i % 3 != 0 && i != 4 && i != 10 && i != 11) expect.push_back(i);
  CHECK(got == expect);
}

TEST_CASE("filter resumes exactly, and errors after a restore still name their element") {
  auto make = [] {
    return ferry::from_generator(60, [](std::uint64_t i) { return i; }) | ferry::filter(keep_or_throw(35));
  };
  auto ref = make();
  std::vector<std::string> ref_errors;
  const auto all = ferry_test::drain_through_errors(ref, ref_errors);
  REQUIRE(ref_errors.size() == 1);
  for (std::size_t k : {0, 1, 10, 22, 23, 38}) {
    CAPTURE(k);
    auto p = make();
    std::vector<std::uint64_t> got;
    std::vector<std::string> errors;
    while (got.size() < k) {
      try {
        got.push_back(*p.next());
      } catch (const ferry::element_error& e) {
        errors.push_back(e.what());
      }
    }
    auto q = make();
    ferry::restore_state(q, ferry::save_state(p));
    for (auto x : ferry_test::drain_through_errors(q, errors)) got.push_back(x);
    CHECK(got == all);
    CHECK(errors == ref_errors);
  }
  auto r = make();
  std::vector<std::string> e1, e2;
  const auto first = ferry_test::drain_through_errors(r, e1);
  r.rewind();
  CHECK(ferry_test::drain_through_errors(r, e2) == first);
  CHECK(e2 == e1);
}
