// map: ordered parallel map equals sequential map; errors reach the consumer at their
// element; destruction mid-epoch joins every thread.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ahead_source.hpp"
#include "failing_source.hpp"
#include "common/doubles.hpp"
#include "ferry/ferry.hpp"

using namespace std::chrono_literals;
using ferry_test::drain;
using ferry_test::watchdog;

namespace {
std::uint64_t work(std::uint64_t x) {
  // Uneven cost, so workers finish out of order.
  std::uint64_t h = x;
  for (std::uint64_t i = 0; i < (x % 7) * 200; ++i) h = h * 6364136223846793005ull + 1442695040888963407ull;
  return x * 1000003 + (h & 1);
}
}  // namespace

TEST_CASE("ordered parallel map equals sequential map" * doctest::timeout(60)) {
  watchdog w(60s);
  for (std::size_t n : {0, 1, 7, 100, 1000}) {
    std::vector<std::uint64_t> expect(n);
    for (std::size_t i = 0; i < n; ++i) expect[i] = work(i);
    for (std::size_t workers : {1, 2, 3, 8})
      for (std::size_t window : {0, 1, 5, 64}) {
        CAPTURE(n);
        CAPTURE(workers);
        CAPTURE(window);
        auto p = ferry::from_generator(n, [](std::uint64_t i) { return i; }) |
                 ferry::map(work, {.workers = workers, .window = window});
        CHECK(drain(p) == expect);
      }
  }
}

TEST_CASE("unordered parallel map yields a permutation of the mapped elements" * doctest::timeout(60)) {
  watchdog w(60s);
  for (std::size_t workers : {2, 4}) {
    auto p = ferry::from_generator(2000, [](std::uint64_t i) { return i; }) |
             ferry::map(work, {.workers = workers, .ordered = false});
    auto got = drain(p);
    std::vector<std::uint64_t> expect(2000);
    for (std::size_t i = 0; i < 2000; ++i) expect[i] = work(i);
    std::sort(got.begin(), got.end());
    std::sort(expect.begin(), expect.end());
    CHECK(got == expect);
  }
}

TEST_CASE("unordered parallel map | batch (the bulk path) yields every mapped element once" *
          doctest::timeout(60)) {
  watchdog w(60s);
  for (std::size_t workers : {2, 3}) {
    CAPTURE(workers);
    std::vector<std::uint64_t> ids(3001);
    std::iota(ids.begin(), ids.end(), 0);
    auto p = ferry::from_range(std::move(ids)) |
             ferry::map(work, {.workers = workers, .ordered = false, .window = 100}) | ferry::batch(64);
    std::vector<std::uint64_t> got;
    std::size_t batches = 0;
    while (auto b = p.next()) {
      ++batches;
      for (auto x : b->field()) got.push_back(x);
    }
    CHECK(batches == 47);  // 46 full batches and one of 57
    std::vector<std::uint64_t> expect(3001);
    for (std::size_t i = 0; i < expect.size(); ++i) expect[i] = work(i);
    std::sort(got.begin(), got.end());
    std::sort(expect.begin(), expect.end());
    CHECK(got == expect);
  }
}

TEST_CASE("an exception in fn reaches the consumer at its element, original kept" * doctest::timeout(60)) {
  watchdog w(60s);
  struct boom : std::runtime_error {
    using std::runtime_error::runtime_error;
  };
  for (std::size_t workers : {1, 2, 4}) {
    for (std::uint64_t k : {0, 1, 17, 99}) {
      CAPTURE(workers);
      CAPTURE(k);
      auto p = ferry::from_generator(100, [](std::uint64_t i) { return i; }) |
               ferry::map(
                   [k](std::uint64_t x) {
                     if (x == k) throw boom("bad element " + std::to_string(x));
                     return x;
                   },
                   {.workers = workers});
      std::vector<std::uint64_t> before;
      bool threw = false;
      try {
        while (auto e = p.next()) before.push_back(*e);
      } catch (const ferry::element_error& e) {
        threw = true;
        CHECK(e.element() == k);
        CHECK(std::string(e.what()).find("element " + std::to_string(k)) != std::string::npos);
        bool nested_is_boom = false;
        try {
          std::rethrow_if_nested(e);
        } catch (const boom& b) {
          nested_is_boom = std::string(b.what()) == "bad element " + std::to_string(k);
        }
        CHECK(nested_is_boom);
      }
      CHECK(threw);
      std::vector<std::uint64_t> expect(k);
      std::iota(expect.begin(), expect.end(), 0);
      CHECK(before == expect);
      // A consumer that catches may go on: the rest of the epoch is intact.
      auto rest = drain(p);
      std::vector<std::uint64_t> expect_rest(100 - k - 1);
      std::iota(expect_rest.begin(), expect_rest.end(), k + 1);
      CHECK(rest == expect_rest);
    }
  }
}

TEST_CASE("map | batch takes runs in bulk: same batches as element by element, errors included" *
          doctest::timeout(60)) {
  watchdog w(60s);
  // The oracle: batches of 16 cut from the mapped sequence, element by element.
  for (std::size_t workers : {1, 2, 3}) {
    for (std::uint64_t k : {~std::uint64_t(0), std::uint64_t(0), std::uint64_t(40), std::uint64_t(999)}) {
      CAPTURE(workers);
      CAPTURE(k);
      std::vector<std::uint64_t> ids(1000);
      std::iota(ids.begin(), ids.end(), 0);
      auto q = ferry::from_range(std::move(ids)) |
               ferry::map(
                   [k](std::uint64_t x) {
                     if (x == k) throw std::runtime_error("bad " + std::to_string(x));
                     return work(x);
                   },
                   {.workers = workers, .window = 64}) |
               ferry::batch(16);
      std::vector<std::vector<std::uint64_t>> got;
      int errors = 0;
      for (;;) {
        try {
          auto b = q.next();
          if (!b) break;
          auto col = b->field();
          got.emplace_back(col.begin(), col.end());
        } catch (const ferry::element_error& e) {
          ++errors;
          CHECK(e.element() == k);
        }
      }
      CHECK(errors == (k < 1000 ? 1 : 0));
      // Workers: as element by element, batch loses the batch being built when an element
      // throws and goes on with the next elements. Inline (workers 1) the batch's whole run
      // was pulled and mapped as one unit, so the batch holding k is lost and the rest keep
      // their places (documented in map.hpp).
      std::vector<std::vector<std::uint64_t>> want;
      std::vector<std::uint64_t> cur;
      for (std::uint64_t x = 0; x < 1000; ++x) {
        if (workers == 1 && k < 1000 && x / 16 == k / 16) continue;
        if (x == k) {
          cur.clear();
          continue;
        }
        cur.push_back(work(x));
        if (cur.size() == 16) want.push_back(std::exchange(cur, {}));
      }
      if (!cur.empty()) want.push_back(cur);
      CHECK(got == want);
    }
  }
}

TEST_CASE("upstream errors reach the consumer unchanged, in place; nothing lost; resume exact "
          "around them, any workers" * doctest::timeout(120)) {
  watchdog w(120s);
  const std::vector<std::uint64_t> fails{0, 7, 8, 31, 99};
  auto sq = [](std::uint64_t x) { return x * x + 1; };
  // The oracle: the source itself drained through its errors, then squared.
  std::vector<std::string> want_errors;
  auto plain = ferry_test::failing_source(100, fails);
  auto want = ferry_test::drain_through_errors(plain, want_errors);
  REQUIRE(want.size() == 95);
  for (auto& x : want) x = sq(x);
  for (std::size_t workers : {1, 3}) {
    for (std::size_t window : {4, 16}) {
      CAPTURE(workers);
      CAPTURE(window);
      auto make = [&] {
        return ferry_test::failing_source(100, fails) | ferry::map(sq, {.workers = workers, .window = window});
      };
      std::vector<std::string> errors;
      auto p = make();
      CHECK(ferry_test::drain_through_errors(p, errors) == want);
      CHECK(errors == want_errors);  // unchanged: not wrapped as element_error
      // Saved after every 5th call (value or error), restored into a new pipeline: the
      // rest is what the first gave after that point, errors included, none twice.
      for (std::size_t k = 0; k <= want.size() + fails.size(); k += 5) {
        CAPTURE(k);
        std::vector<std::string> seen_errors;
        CHECK(ferry_test::resumed_through_errors(make, k, seen_errors) == want);
        CHECK(seen_errors == want_errors);
      }
    }
  }
}

TEST_CASE("destroying a parallel map mid-epoch joins its workers promptly" * doctest::timeout(30)) {
  watchdog w(30s);
  std::atomic<int> running{0};
  std::atomic<std::uint64_t> calls{0};
  const std::size_t window = 256;
  auto make = [&] {
    return ferry::from_generator(1'000'000, [](std::uint64_t i) { return i; }) |
           ferry::map(
               [&](std::uint64_t x) {
                 ++running;
                 ++calls;
                 std::this_thread::yield();
                 --running;
                 return x;
               },
               {.workers = 4, .window = window});
  };
  std::optional<decltype(make())> p(make());
  for (int i = 0; i < 100; ++i) REQUIRE((*p).next());
  const auto t0 = std::chrono::steady_clock::now();
  p.reset();  // destructor: stop and join
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(running == 0);  // every fn call that started had ended when the destructor returned
  // The workers stopped where they were: at most a window past what was handed out, not
  // the 1,000,000 elements of the epoch.
  CHECK(calls.load() <= 100 + window);
  CHECK(took < 2s);
}

TEST_CASE("parallel map reads at most `window` elements ahead of the consumer" * doctest::timeout(60)) {
  watchdog w(60s);
  for (bool ordered : {true, false})
    for (std::size_t workers : {2, 3})
      for (std::size_t window : {3, 5, 7}) {  // < 8: a worker wakes for 1 free slot (window / 4)
        CAPTURE(ordered);
        CAPTURE(workers);
        CAPTURE(window);
        // Checked inside the upstream's next() on every pull: pulled - asked <= window.
        ferry_test::ahead_source src(2000, window);
        auto c = src.control();
        auto p = std::move(src) | ferry::map([](std::uint64_t x) { return x; },
                                             {.workers = workers, .ordered = ordered, .window = window});
        std::uint64_t got = 0;
        for (; got < 10; ++got) {
          c->ask();
          REQUIRE(p.next());
        }
        // The workers fill the window, then wait: the bound is reached, so one element past
        // it would have been counted. (With a window of 8 or more they may rest a little
        // short of it, waking for a quarter of the window; the watchdog bounds this wait.)
        while (c->ahead() < window) std::this_thread::yield();
        for (;; ++got) {
          c->ask();
          if (!p.next()) break;
        }
        CHECK(got == 2000);
        CHECK(c->max_ahead == window);
        CHECK(c->excess == 0);
      }
}

namespace {
// An element whose second move on a worker thread throws std::bad_alloc: the first is
// fn's result into its slot, the second publishing it, outside fn (as an allocation in
// the worker's own buffers or queue would).
std::thread::id consumer_thread;
std::atomic<int> poison_moves{0};
struct fragile {
  static constexpr std::uint64_t poison = 13;
  std::uint64_t v = 0;
  explicit fragile(std::uint64_t x) : v(x) {}
  fragile(const fragile&) = default;
  fragile& operator=(const fragile&) = default;
  fragile(fragile&& o) : v(o.v) {
    if (v == poison && std::this_thread::get_id() != consumer_thread && ++poison_moves == 2) throw std::bad_alloc();
  }
  fragile& operator=(fragile&& o) {
    v = o.v;
    return *this;
  }
};
}  // namespace

TEST_CASE("a worker's failure outside fn (out of memory) reaches the consumer, not std::terminate" *
          doctest::timeout(60)) {
  watchdog w(60s);
  consumer_thread = std::this_thread::get_id();
  for (bool ordered : {true, false})
    for (std::size_t workers : {2, 3}) {
      CAPTURE(ordered);
      CAPTURE(workers);
      poison_moves = 0;
      auto p = ferry::from_generator(200, [](std::uint64_t i) { return i; }) |
               ferry::map([](std::uint64_t x) { return fragile(x); },
                          {.workers = workers, .ordered = ordered, .window = 16});
      std::vector<std::uint64_t> got;
      bool threw = false;
      try {
        while (auto e = p.next()) got.push_back(e->v);
      } catch (const std::bad_alloc&) {
        threw = true;
      }
      CHECK(threw);
      CHECK_FALSE(p.next());  // the epoch is over
      std::set<std::uint64_t> unique(got.begin(), got.end());
      CHECK(unique.size() == got.size());
      CHECK(unique.count(fragile::poison) == 0);
      if (ordered) {  // everything before the failed element, in order
        std::vector<std::uint64_t> expect(fragile::poison);
        std::iota(expect.begin(), expect.end(), 0);
        CHECK(got == expect);
      }
      p.rewind();  // and the next epoch runs
      std::size_t n = 0;
      while (p.next()) ++n;
      CHECK(n == 200);
    }
}

TEST_CASE("bad map arguments are config errors") {
  CHECK_THROWS_AS(ferry::map([](int x) { return x; }, {.workers = 0}), ferry::config_error);
  CHECK_THROWS_WITH(ferry::map([](int x) { return x; }, {.workers = 0}),
                    doctest::Contains("workers must be at least 1"));
}

TEST_CASE("map: restore_state after the first next() is a config_error, inline or parallel" *
          doctest::timeout(30)) {
  watchdog w(30s);
  for (std::size_t workers : {1, 3}) {
    CAPTURE(workers);
    auto make = [&] {
      return ferry::from_generator(100, [](std::uint64_t i) { return i; }) |
             ferry::map([](std::uint64_t x) { return x; }, {.workers = workers});
    };
    auto a = make();
    REQUIRE(a.next());
    const auto st = ferry::save_state(a);
    REQUIRE(a.next());
    if (workers > 1)
      CHECK_THROWS_WITH_AS(ferry::restore_state(a, st), doctest::Contains("before the first next()"),
                           ferry::config_error);
    auto b = make();
    ferry::restore_state(b, st);  // a fresh pipeline takes it
    CHECK(b.next() == std::optional<std::uint64_t>(1));
  }
}
