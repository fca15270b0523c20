// prefetch: same elements as without it; errors re-thrown in order; bounded read-ahead;
// destruction mid-epoch joins at once.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "common/doubles.hpp"
#include "ferry/ferry.hpp"

using namespace std::chrono_literals;
using ferry_test::drain;
using ferry_test::watchdog;

TEST_CASE("prefetch hands out exactly the upstream sequence" * doctest::timeout(30)) {
  watchdog w(30s);
  for (std::size_t depth : {1, 2, 8})
    for (std::size_t n : {0, 1, 5, 1000}) {
      auto p = ferry::from_generator(n, [](std::uint64_t i) { return i * 3; }) | ferry::prefetch(depth);
      auto got = drain(p);
      REQUIRE(got.size() == n);
      for (std::size_t i = 0; i < n; ++i) CHECK(got[i] == i * 3);
    }
}

TEST_CASE("an upstream exception is re-thrown after the elements before it" * doctest::timeout(30)) {
  watchdog w(30s);
  auto p = ferry_test::throwing_source(100, 42) | ferry::prefetch(4);
  std::size_t got = 0;
  CHECK_THROWS_WITH_AS(
      [&] {
        while (p.next()) ++got;
      }(),
      "source failed at 42", std::runtime_error);
  CHECK(got == 42);
  CHECK_FALSE(p.next());  // the epoch is over, nothing hangs
}

TEST_CASE("prefetch reads at most depth + 1 elements ahead" * doctest::timeout(30)) {
  watchdog w(30s);
  ferry_test::counting_source src(1000);
  auto calls = src.calls();
  auto p = std::move(src) | ferry::prefetch(3);
  REQUIRE(p.next());
  // The producer fills the queue (3) and blocks holding one more: 1 + 3 + 1 pulls at most.
  for (int spin = 0; spin < 100000 && *calls < 5; ++spin) std::this_thread::yield();
  CHECK(*calls <= 5);
}

TEST_CASE("destroying prefetch and parallel map mid-epoch returns promptly" * doctest::timeout(30)) {
  watchdog w(30s);
  for (int round = 0; round < 20; ++round) {
    auto p = ferry::from_generator(1'000'000, [](std::uint64_t i) { return i; }) |
             ferry::map([](std::uint64_t x) { return x + 1; }, {.workers = 3}) | ferry::batch(16) |
             ferry::prefetch(2);
    for (int i = 0; i < round; ++i) REQUIRE(p.next());
  }
  CHECK(true);  // reaching here (inside the watchdog) is the test
}

TEST_CASE("prefetch stopped while its producer waits on a gated source" * doctest::timeout(30)) {
  watchdog w(30s);
  ferry_test::gated_source g(100);
  auto gate = g.control();
  gate.open(5);
  {
    auto p = std::move(g) | ferry::prefetch(2);
    for (int i = 0; i < 5; ++i) REQUIRE(p.next());
    gate.close();  // the producer's pending next() returns, then it sees stop
  }
  CHECK(true);
}

TEST_CASE("prefetch(0) is a config error") {
  CHECK_THROWS_WITH_AS(ferry::prefetch(0), doctest::Contains("at least 1"), ferry::config_error);
}
