// zip: pairs equal the naive pairing; unequal lengths are an error; resume is exact.
#include <doctest/doctest.h>

#include <vector>

#include "common/doubles.hpp"
#include "ferry/ferry.hpp"

using ferry_test::drain;

TEST_CASE("zip pairs the i-th elements, and batch collates each half as a field") {
  for (std::uint64_t seed = 1; seed <= 10; ++seed) {
    ferry::detail::splitmix64 g(seed);
    const std::size_t n = g.below(500);
    std::vector<std::uint32_t> a(n), b(n);
    for (auto& x : a) x = std::uint32_t(g());
    for (auto& x : b) x = std::uint32_t(g());
    auto p = ferry::zip(ferry::from_range(a), ferry::from_range(b)) | ferry::batch(1 + g.below(40));
    std::size_t i = 0;
    for (auto& batch : p)
      for (std::size_t k = 0; k < batch.size(); ++k, ++i) {
        CHECK(batch.field<0>()[k] == a[i]);
        CHECK(batch.field<1>()[k] == b[i]);
      }
    CHECK(i == n);
  }
}

TEST_CASE("zip of sources of different lengths is an error, not a truncation") {
  auto p = ferry::zip(ferry::from_range(std::vector<int>{1, 2, 3}), ferry::from_range(std::vector<int>{4, 5}));
  REQUIRE(p.next());
  REQUIRE(p.next());
  CHECK_THROWS_WITH_AS(p.next(), doctest::Contains("the second ended after 2 elements"), ferry::error);
}

TEST_CASE("zip rewinds both sources and resumes exactly") {
  auto make = [] {
    return ferry::zip(ferry::from_generator(100, [](std::uint64_t i) { return i; }) | ferry::shuffle(16, 1),
                      ferry::from_generator(100, [](std::uint64_t i) { return i * 10; }));
  };
  auto p = make();
  auto first = drain(p);
  p.rewind();
  auto second = drain(p);
  REQUIRE(first.size() == 100);
  CHECK(first != second);  // the shuffle drew a new order
  for (std::size_t k : {0, 1, 17, 64, 99, 100}) {
    auto q = make();
    std::vector<std::pair<std::uint64_t, std::uint64_t>> got;
    for (std::size_t i = 0; i < k; ++i) got.push_back(*q.next());
    auto st = ferry::save_state(q);
    auto r = make();
    ferry::restore_state(r, st);
    for (auto& e : drain(r)) got.push_back(e);
    CHECK(got == first);
  }
}
