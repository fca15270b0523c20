// shard: every element reaches exactly one shard; bad arguments are config errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

#include "common/doubles.hpp"
#include "ferry/ferry.hpp"

using ferry_test::drain;

TEST_CASE("shards are disjoint and their union is the input (property sweep)") {
  for (std::uint64_t seed = 1; seed <= 30; ++seed) {
    ferry::detail::splitmix64 g(seed);
    const std::size_t n = g.below(500);
    const std::uint64_t count = 1 + g.below(9);
    std::vector<std::uint64_t> input(n);
    for (auto& x : input) x = g();
    std::vector<std::uint64_t> all;
    for (std::uint64_t i = 0; i < count; ++i) {
      auto p = ferry::from_range(input) | ferry::shard(count, i);
      auto part = drain(p);
      // Round-robin: shard i holds input[i], input[i + count], ... in order.
      std::vector<std::uint64_t> expect;
      for (std::size_t k = i; k < n; k += count) expect.push_back(input[k]);
      CHECK(part == expect);
      all.insert(all.end(), part.begin(), part.end());
    }
    auto sorted_input = input;
    std::sort(sorted_input.begin(), sorted_input.end());
    std::sort(all.begin(), all.end());
    CHECK(all == sorted_input);
  }
}

TEST_CASE("shard sizes differ by at most one") {
  for (std::uint64_t count = 1; count <= 7; ++count) {
    std::size_t lo = SIZE_MAX, hi = 0;
    for (std::uint64_t i = 0; i < count; ++i) {
      auto p = ferry::from_generator(100, [](std::uint64_t x) { return x; }) | ferry::shard(count, i, ferry::by_element);
      const std::size_t s = drain(p).size();
      lo = std::min(lo, s);
      hi = std::max(hi, s);
    }
    CHECK(hi - lo <= 1);
  }
}

TEST_CASE("bad shard arguments are config errors that say what is allowed") {
  CHECK_THROWS_WITH_AS(ferry::shard(4, 4), doctest::Contains("index must be in [0, count)"), ferry::config_error);
  CHECK_THROWS_WITH_AS(ferry::shard(0, 0), doctest::Contains("count must be at least 1"), ferry::config_error);
  CHECK_THROWS_AS(ferry::shard(ferry::from_range(std::vector<int>{1}), 2, 5), ferry::config_error);
}

// Found by mutation testing (a changed bound, a check or a saved field dropped, each passing
// the suite before): a state of another shard index must be refused (it was not in the
// saved configuration's checks, and only the count was tested).
TEST_CASE("shard: a state of another index is refused") {
  std::vector<int> v(20);
  auto a = ferry::from_range(v) | ferry::shard(4, 0);
  REQUIRE(a.next());
  auto b = ferry::from_range(v) | ferry::shard(4, 1);
  CHECK_THROWS_AS(ferry::restore_state(b, ferry::save_state(a)), ferry::config_error);
}
