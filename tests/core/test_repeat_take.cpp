// repeat and take.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "common/doubles.hpp"
#include "failing_source.hpp"
#include "ferry/ferry.hpp"

using ferry_test::drain;

TEST_CASE("repeat(n) plays the dataset n times; take(k) stops after k") {
  for (std::uint64_t n : {0, 1, 3})
    for (std::size_t size : {0, 1, 4}) {
      auto p = ferry::from_generator(size, [](std::uint64_t i) { return int(i); }) | ferry::repeat(n);
      auto got = drain(p);
      std::vector<int> expect;
      for (std::uint64_t e = 0; e < n; ++e)
        for (std::size_t i = 0; i < size; ++i) expect.push_back(int(i));
      CHECK(got == expect);
    }
  auto forever = ferry::from_range(std::vector<int>{1, 2, 3}) | ferry::repeat() | ferry::take(10);
  CHECK(drain(forever) == std::vector<int>{1, 2, 3, 1, 2, 3, 1, 2, 3, 1});
}

TEST_CASE("repeat of an empty dataset ends instead of spinning") {
  auto p = ferry::from_range(std::vector<int>{}) | ferry::repeat();
  CHECK_FALSE(p.next());
}

TEST_CASE("repeat over shuffle gives a new order each epoch") {
  auto p = ferry::from_generator(100, [](std::uint64_t i) { return i; }) | ferry::shuffle(100, 3) | ferry::repeat(2);
  auto all = drain(p);
  REQUIRE(all.size() == 200);
  std::vector<std::uint64_t> a(all.begin(), all.begin() + 100), b(all.begin() + 100, all.end());
  CHECK(a != b);
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  CHECK(a == b);
}

TEST_CASE("take never pulls more than it hands out") {
  ferry_test::counting_source src(100);
  auto calls = src.calls();
  auto p = std::move(src) | ferry::take(7);
  CHECK(drain(p).size() == 7);
  CHECK(*calls == 7);
}

namespace {
// What a consumer that goes on after errors sees: elements, and "!<what>" for each error.
template <class S>
std::vector<std::string> events(S& s) {
  std::vector<std::string> out;
  for (std::size_t guard = 0; guard < 100000; ++guard) {
    try {
      auto e = s.next();
      if (!e) break;
      out.push_back(std::to_string(*e));
    } catch (const std::exception& e) {
      out.push_back(std::string("!") + e.what());
    }
  }
  return out;
}
// The naive oracle: elements 0..n-1 with each failing one replaced by its error.
std::vector<std::string> naive(std::uint64_t n, const std::vector<std::uint64_t>& fails) {
  std::vector<std::string> out;
  for (std::uint64_t i = 0; i < n; ++i)
    out.push_back(std::find(fails.begin(), fails.end(), i) != fails.end() ? "!failed at " + std::to_string(i)
                                                                          : std::to_string(i));
  return out;
}
}  // namespace

TEST_CASE("repeat: upstream errors reach the consumer in every epoch; nothing lost") {
  for (std::uint64_t n : {1, 2, 9})
    for (const std::vector<std::uint64_t>& fails : std::vector<std::vector<std::uint64_t>>{{0}, {n - 1}, {0, n - 1}}) {
      CAPTURE(n);
      CAPTURE(fails.size());
      auto p = ferry_test::failing_source(n, fails) | ferry::repeat(3);
      std::vector<std::string> expect;
      for (int epoch = 0; epoch < 3; ++epoch) {
        auto one = naive(n, fails);
        expect.insert(expect.end(), one.begin(), one.end());
      }
      // n == 1 with its only element failing: the epochs are not empty, so all three run.
      CHECK(events(p) == expect);
    }
}

TEST_CASE("take: an upstream error reaches the consumer and does not count toward n") {
  for (std::uint64_t k : {0, 3, 6, 7, 9}) {
    CAPTURE(k);
    auto p = ferry_test::failing_source(10, {k}) | ferry::take(7);
    std::vector<std::string> expect;
    std::size_t taken = 0;
    for (auto& e : naive(10, {k})) {
      if (taken == 7) break;
      expect.push_back(e);
      if (e[0] != '!') ++taken;
    }
    CHECK(events(p) == expect);
  }
}

TEST_CASE("repeat and take resume exactly around an upstream error") {
  auto make = [] { return ferry_test::failing_source(6, {2}) | ferry::repeat(3) | ferry::take(14); };
  auto ref = make();
  const auto all = events(ref);
  REQUIRE(all.size() == 17);  // 14 elements, 3 errors (the third epoch ends at the take)
  for (std::size_t k = 0; k <= all.size(); ++k) {
    CAPTURE(k);
    auto p = make();
    std::vector<std::string> got;
    while (got.size() < k) {
      try {
        got.push_back(std::to_string(*p.next()));
      } catch (const std::exception& e) {
        got.push_back(std::string("!") + e.what());
      }
    }
    auto q = make();
    ferry::restore_state(q, ferry::save_state(p));
    auto rest = events(q);
    got.insert(got.end(), rest.begin(), rest.end());
    CHECK(got == all);
  }
}
