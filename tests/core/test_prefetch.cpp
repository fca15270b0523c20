// prefetch: same elements as without it; errors re-thrown in order; bounded read-ahead;
// destruction mid-epoch joins at once.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <optional>
#include <cstdlib>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "ahead_source.hpp"
#include "common/doubles.hpp"
#include "failing_source.hpp"
#include "ferry/ferry.hpp"

using namespace std::chrono_literals;
using ferry_test::drain;
using ferry_test::watchdog;

// Out of memory on demand: once armed, the next allocation on the producer thread (marked
// by the source it runs) throws std::bad_alloc.
namespace {
thread_local bool on_producer = false;
std::atomic<bool> fail_armed{false};
}  // namespace
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpragmas"
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"  // these replace both: they match
void* operator new(std::size_t n) {
  if (on_producer && fail_armed.exchange(false)) throw std::bad_alloc();
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop

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
  // The producer went on after the error: the rest follows, then the end.
  std::size_t rest = 0;
  while (auto e = p.next()) CHECK(*e == 43 + rest++);
  CHECK(rest == 100 - 43);
  CHECK_FALSE(p.next());
}

TEST_CASE("prefetch: errors in place, nothing lost, and resume exact around them, any depth" * doctest::timeout(60)) {
  watchdog w(60s);
  const std::vector<std::uint64_t> fails{0, 7, 8, 31, 99};
  // The oracle: the source itself, drained through its errors.
  std::vector<std::string> want_errors;
  auto plain = ferry_test::failing_source(100, fails);
  const auto want = ferry_test::drain_through_errors(plain, want_errors);
  REQUIRE(want.size() == 95);
  for (std::size_t depth : {1, 2, 5}) {
    CAPTURE(depth);
    std::vector<std::string> errors;
    auto p = ferry_test::failing_source(100, fails) | ferry::prefetch(depth);
    CHECK(ferry_test::drain_through_errors(p, errors) == want);
    CHECK(errors == want_errors);
    // Saved after every call (value or error), restored into a new pipeline: the rest is
    // what the first one gave after that point, errors included.
    for (std::size_t k = 0; k <= want.size() + fails.size(); k += 7) {
      CAPTURE(k);
      std::vector<std::string> seen_errors;
      auto make = [&] { return ferry_test::failing_source(100, fails) | ferry::prefetch(depth); };
      CHECK(ferry_test::resumed_through_errors(make, k, seen_errors) == want);
      CHECK(seen_errors == want_errors);
    }
  }
}

TEST_CASE("prefetch reads at most depth + 1 elements ahead" * doctest::timeout(30)) {
  watchdog w(30s);
  for (std::size_t depth : {1, 3, 8}) {
    CAPTURE(depth);
    // Checked inside the upstream's next() on every pull: pulled - asked <= depth + 1 (depth
    // queued and one being built; the one asked for is the consumer's).
    ferry_test::ahead_source src(1000, depth + 1);
    auto c = src.control();
    auto p = std::move(src) | ferry::prefetch(depth);
    c->ask();
    REQUIRE(p.next());
    // The producer fills the queue and blocks holding one more: the bound is reached, so
    // one pull past it would have been counted. (The watchdog bounds this wait.)
    while (c->ahead() < depth + 1) std::this_thread::yield();
    std::uint64_t got = 1;
    for (;; ++got) {
      c->ask();
      if (!p.next()) break;
    }
    CHECK(got == 1000);
    CHECK(c->max_ahead == depth + 1);
    CHECK(c->excess == 0);
  }
}

TEST_CASE("destroying prefetch and parallel map mid-epoch returns promptly" * doctest::timeout(30)) {
  watchdog w(30s);
  const std::size_t window = 512;
  for (int round = 0; round < 20; ++round) {
    CAPTURE(round);
    std::atomic<std::uint64_t> calls{0};
    auto make = [&] {
      return ferry::from_generator(1'000'000, [](std::uint64_t i) { return i; }) |
             ferry::map(
                 [&](std::uint64_t x) {
                   ++calls;
                   return x + 1;
                 },
                 {.workers = 3, .window = window}) |
             ferry::batch(16) | ferry::prefetch(2);
    };
    std::optional<decltype(make())> p(make());
    for (int i = 0; i < round; ++i) REQUIRE((*p).next());
    const auto t0 = std::chrono::steady_clock::now();
    p.reset();
    CHECK(std::chrono::steady_clock::now() - t0 < 2s);
    // Both stages stopped where they were: the batches handed out, prefetch's queue and the
    // one being built (depth + 1), and the map's window; not the epoch's 1,000,000.
    CHECK(calls.load() <= std::uint64_t(round + 3) * 16 + window);
  }
}

TEST_CASE("prefetch stopped while its producer waits on a gated source" * doctest::timeout(30)) {
  watchdog w(30s);
  ferry_test::gated_source g(100);
  auto gate = g.control();
  gate.open(5);
  std::chrono::steady_clock::time_point t0;
  {
    auto p = std::move(g) | ferry::prefetch(2);
    for (int i = 0; i < 5; ++i) REQUIRE(p.next());
    gate.close();  // the producer's pending next() returns, then it sees stop
    t0 = std::chrono::steady_clock::now();
  }
  // The producer stopped at its next check instead of draining the 95 elements the closed
  // gate now releases at once; the join took no time to speak of.
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  CHECK(gate.pulled() <= 5 + 2 + 2);  // handed out, queued (depth), one in hand, one more
}

namespace {
// Elements 0..n-1; allocates nothing; arms the allocation failure after element arm_at.
class arming_source : public ferry::source_interface<arming_source> {
 public:
  using value_type = std::uint64_t;
  arming_source(std::uint64_t n, std::uint64_t arm_at) : n_(n), arm_(arm_at) {}
  std::optional<value_type> next() {
    on_producer = true;
    if (i_ >= n_) return std::nullopt;
    if (i_ == arm_) fail_armed = true;
    return i_++;
  }

 private:
  std::uint64_t n_, arm_, i_ = 0;
};
}  // namespace

TEST_CASE("prefetch: out of memory queueing an element reaches the consumer, not std::terminate" *
          doctest::timeout(30)) {
  watchdog w(30s);
  auto p = arming_source(100000, 100) | ferry::prefetch(2);
  std::vector<std::uint64_t> got;
  bool threw = false;
  try {
    while (auto e = p.next()) got.push_back(*e);
  } catch (const std::bad_alloc&) {
    threw = true;
  }
  fail_armed = false;
  CHECK(threw);
  CHECK_FALSE(p.next());  // the epoch is over
  // What came before the failure came in order; only the element being queued is lost.
  REQUIRE(got.size() >= 100);
  CHECK(got.size() < 100000);
  for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(got[i] == i);
}

TEST_CASE("prefetch(0) is a config error") {
  CHECK_THROWS_WITH_AS(ferry::prefetch(0), doctest::Contains("at least 1"), ferry::config_error);
}
