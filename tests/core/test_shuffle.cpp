// shuffle: a permutation, deterministic per (seed, epoch), new each epoch, bounded window.
#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "common/doubles.hpp"
#include "ferry/ferry.hpp"

using ferry_test::drain;

namespace {
std::vector<std::uint64_t> iota_vec(std::size_t n) {
  std::vector<std::uint64_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}
}  // namespace

TEST_CASE("shuffle is a permutation whose elements move only within their window") {
  for (std::size_t n : {0, 1, 10, 257, 1000})
    for (std::size_t buf : {1, 2, 16, 100, 5000}) {
      CAPTURE(n);
      CAPTURE(buf);
      auto p = ferry::from_range(iota_vec(n)) | ferry::shuffle(buf, 7);
      auto got = drain(p);
      REQUIRE(got.size() == n);
      for (std::size_t i = 0; i < n; ++i) CHECK(got[i] / buf == i / buf);  // same window
      std::sort(got.begin(), got.end());
      CHECK(got == iota_vec(n));
    }
}

TEST_CASE("same seed, same order; new epoch or new seed, new order") {
  auto run = [](std::uint64_t seed, int epochs) {
    auto p = ferry::from_range(iota_vec(500)) | ferry::shuffle(500, seed);
    std::vector<std::uint64_t> out;
    for (int e = 0; e < epochs; ++e) {
      if (e) p.rewind();
      out = drain(p);
    }
    return out;
  };
  CHECK(run(1, 1) == run(1, 1));
  CHECK(run(1, 2) == run(1, 2));
  CHECK(run(1, 1) != run(1, 2));
  CHECK(run(1, 1) != run(2, 1));
  CHECK(run(1, 1) != iota_vec(500));
}

TEST_CASE("shuffle order does not depend on the number of map workers upstream") {
  std::vector<std::uint64_t> ref;
  for (std::size_t workers : {1, 2, 4}) {
    auto p = ferry::from_range(iota_vec(3000)) | ferry::map([](std::uint64_t x) { return x * x; }, {.workers = workers}) |
             ferry::shuffle(256, 99);
    auto got = drain(p);
    if (ref.empty()) ref = got;
    CHECK(got == ref);
  }
}

TEST_CASE("shuffle positions are roughly uniform within a window") {
  // Chi-square-style sanity check: element 0 of a 16-window lands in each slot about
  // equally often over many seeds.
  std::vector<int> hits(16, 0);
  for (std::uint64_t seed = 0; seed < 3200; ++seed) {
    auto p = ferry::from_range(iota_vec(16)) | ferry::shuffle(16, seed);
    auto got = drain(p);
    hits[std::find(got.begin(), got.end(), 0) - got.begin()]++;
  }
  for (int h : hits) {
    CHECK(h > 120);  // expected 200 each
    CHECK(h < 280);
  }
}

TEST_CASE("shuffle(0) is a config error") {
  CHECK_THROWS_WITH_AS(ferry::shuffle(0, 1), doctest::Contains("at least 1"), ferry::config_error);
}
