// repeat and take.
#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

#include "common/doubles.hpp"
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
