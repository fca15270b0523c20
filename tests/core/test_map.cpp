// map: ordered parallel map equals sequential map; errors reach the consumer at their
// element; destruction mid-epoch joins every thread.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
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
    for (std::size_t workers : {std::size_t(1), std::size_t(2), std::size_t(3), std::size_t(8), ferry::autotune})
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

TEST_CASE("move-only results (unique_ptr, a batch), inline and with workers, ordered or not, through batch" *
          doctest::timeout(60)) {
  watchdog w(60s);
  for (std::size_t workers : {std::size_t(1), std::size_t(2), std::size_t(3), ferry::autotune})
    for (bool ordered : {true, false}) {
      CAPTURE(workers);
      CAPTURE(ordered);
      auto p = ferry::from_generator(500, [](std::uint64_t i) { return i; }) |
               ferry::map([](std::uint64_t i) { return std::make_unique<std::uint64_t>(work(i)); },
                          {.workers = workers, .ordered = ordered}) |
               ferry::map([](std::unique_ptr<std::uint64_t> q) { return *q; });
      auto got = drain(p);
      std::vector<std::uint64_t> expect(500);
      for (std::size_t i = 0; i < 500; ++i) expect[i] = work(i);
      if (!ordered) std::sort(got.begin(), got.end()), std::sort(expect.begin(), expect.end());
      CHECK(got == expect);
      // A batch is move-only too: a map over batches hands them on.
      auto b = ferry::from_generator(100, [](std::uint64_t i) { return i; }) | ferry::batch(10) |
               ferry::map([](ferry::batch_of<std::uint64_t> x) { return x; }, {.workers = workers, .ordered = ordered});
      std::uint64_t sum = 0, rows = 0;
      while (auto x = b.next())
        for (auto v : x->field()) sum += v, ++rows;
      CHECK(rows == 100);
      CHECK(sum == 99 * 100 / 2);
    }
}

TEST_CASE("unordered parallel map yields a permutation of the mapped elements" * doctest::timeout(60)) {
  watchdog w(60s);
  for (std::size_t workers : {std::size_t(2), std::size_t(4), ferry::autotune}) {
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
  for (std::size_t workers : {std::size_t(1), std::size_t(2), std::size_t(4), ferry::autotune}) {
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
// An element whose second move on a worker thread throws std::bad_alloc. An unordered map
// moves fn's result into the worker's buffer, then publishes it into the shared queue,
// outside fn (as an allocation in the worker's own buffers or queue would): that second
// move fails. An ordered map constructs the result in its ring place (the first move) and
// publishes without moving it, so its second move is the consumer's own.
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
  for (std::size_t workers : {2, 3}) {  // unordered: see fragile
    CAPTURE(workers);
    poison_moves = 0;
    auto p = ferry::from_generator(200, [](std::uint64_t i) { return i; }) |
             ferry::map([](std::uint64_t x) { return fragile(x); },
                        {.workers = workers, .ordered = false, .window = 16});
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
    p.rewind();  // and the next epoch runs
    std::size_t n = 0;
    while (p.next()) ++n;
    CHECK(n == 200);
  }
}

TEST_CASE("ordered: a result whose move into its ring place throws is that element's error; the rest arrive" *
          doctest::timeout(60)) {
  watchdog w(60s);
  consumer_thread = std::this_thread::get_id();
  for (std::size_t workers : {2, 3}) {
    CAPTURE(workers);
    // fn's result is moved once on the worker (into its place): the poison's second move
    // must not happen there. Make the first one throw: count from 1.
    poison_moves = 1;
    auto p = ferry::from_generator(200, [](std::uint64_t i) { return i; }) |
             ferry::map([](std::uint64_t x) { return fragile(x); }, {.workers = workers, .window = 16});
    std::vector<std::uint64_t> got;
    int errors = 0;
    for (;;) {
      try {
        auto e = p.next();
        if (!e) break;
        got.push_back(e->v);
      } catch (const ferry::element_error& e) {
        ++errors;
        CHECK(std::string(e.what()) == "map: user function threw at element 13: std::bad_alloc");
        CHECK_THROWS_AS(std::rethrow_if_nested(e), std::bad_alloc);
      }
    }
    CHECK(errors == 1);
    std::vector<std::uint64_t> expect(200);
    std::iota(expect.begin(), expect.end(), 0);
    expect.erase(expect.begin() + fragile::poison);
    CHECK(got == expect);
    CHECK(poison_moves.load() == 2);  // exactly one move of it on a worker
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

TEST_CASE("autotune decisions: climb while it pays, test a worker less every 16 periods, shed when idle") {
  using ferry::detail::autotune_sample;
  using ferry::detail::autotune_state;
  autotune_state st;
  const autotune_sample starving{.rate = 100, .consumer_wait = 0.5, .worker_wait = 0};
  const autotune_sample settling{.rate = 1e9, .consumer_wait = 1, .worker_wait = 1};  // never judged
  auto at = [](double rate, double cw = 0.3, double ww = 0.1) {
    return autotune_sample{.rate = rate, .consumer_wait = cw, .worker_wait = ww};
  };
  CHECK(st.decide(starving, 1, 4) == 1);  // the first period settles
  CHECK(st.decide(starving, 1, 4) == 2);  // the consumer waits: one more
  CHECK(st.decide(settling, 2, 4) == 2);
  // Judged on the mean of two periods: 1 -> 2 must add a quarter (25%); 24% does not pay.
  CHECK(st.decide(at(124), 2, 4) == 2);
  CHECK(st.decide(at(124), 2, 4) == 1);
  CHECK(st.decide(settling, 1, 4) == 1);
  CHECK(st.decide(starving, 1, 4) == 1);  // held for 2 periods (backoff 2)
  CHECK(st.decide(starving, 1, 4) == 1);
  CHECK(st.decide(starving, 1, 4) == 2);
  CHECK(st.decide(settling, 2, 4) == 2);
  CHECK(st.decide(at(130), 2, 4) == 2);
  // A mean of 125 pays: kept, and with the consumer still waiting the next is tried at
  // once, against that mean.
  CHECK(st.decide(at(120), 2, 4) == 3);
  CHECK(st.decide(settling, 3, 4) == 3);
  // 2 -> 3 needs 12.5% (140.6): 142 pays. The consumer no longer waits: no more.
  const autotune_sample quiet = at(142, 0.02);
  CHECK(st.decide(quiet, 3, 4) == 3);
  CHECK(st.decide(quiet, 3, 4) == 3);
  // Every 16 steady periods, one worker less is tested.
  for (int i = 0; i < 14; ++i) CHECK(st.decide(quiet, 3, 4) == 3);
  CHECK(st.decide(quiet, 3, 4) == 2);
  CHECK(st.decide(settling, 2, 4) == 2);
  // At 110 the third worker had paid (142 >= 110 * 1.125): it comes back, and the next
  // test waits 32 periods.
  CHECK(st.decide(at(110), 2, 4) == 2);
  CHECK(st.decide(at(110), 2, 4) == 3);
  CHECK(st.decide(settling, 3, 4) == 3);
  for (int i = 0; i < 31; ++i) CHECK(st.decide(quiet, 3, 4) == 3);
  CHECK(st.decide(quiet, 3, 4) == 2);
  CHECK(st.decide(settling, 2, 4) == 2);
  // At 130 it had not (142 < 146.25): it stays parked, and the next try to add one waits
  // (backoff 2).
  CHECK(st.decide(at(130), 2, 4) == 2);
  CHECK(st.decide(at(130), 2, 4) == 2);
  CHECK(st.decide(starving, 2, 4) == 2);
  CHECK(st.decide(starving, 2, 4) == 3);
  CHECK(st.decide(settling, 3, 4) == 3);
  CHECK(st.decide(at(300, 0.5), 3, 4) == 3);
  CHECK(st.decide(at(300, 0.5), 3, 4) == 4);  // paid; still starving: the ceiling next
  CHECK(st.decide(settling, 4, 4) == 4);
  CHECK(st.decide(at(400, 0.5), 4, 4) == 4);
  CHECK(st.decide(at(400, 0.5), 4, 4) == 4);
  CHECK(st.decide(starving, 4, 4) == 4);  // the ceiling
  // The consumer is the bottleneck and the workers mostly wait for room: shed one, settle.
  const autotune_sample idle = at(100, 0.0, 0.8);
  CHECK(st.decide(idle, 4, 4) == 3);
  CHECK(st.decide(idle, 3, 4) == 3);  // settle
  CHECK(st.decide(idle, 3, 4) == 3);  // hold
  CHECK(st.decide(idle, 3, 4) == 2);
  CHECK(st.decide(at(100, 0.02, 0.9), 2, 4) == 2);  // settle
  CHECK(st.decide(at(100, 0.02, 0.9), 2, 4) == 2);  // the consumer waits a bit: not plainly too many
  // The down test runs on its own clock, also while the consumer waits and up-tries are
  // held: a worker kept by a lucky period is tested again.
  autotune_state d;
  CHECK(d.decide(starving, 2, 4) == 2);  // settle
  for (int i = 0; i < 15; ++i) {
    d.hold = 5;  // an up-try is held every time
    CHECK(d.decide(starving, 2, 4) == 2);
  }
  CHECK(d.decide(starving, 2, 4) == 1);
  // The bar has a floor of 3%: at 40 workers a quarter share would be 0.6%.
  CHECK_FALSE(autotune_state::pays(100, 102.9, 40));
  CHECK(autotune_state::pays(100, 103, 40));
  CHECK_FALSE(autotune_state::pays(100, 106, 4));
  CHECK(autotune_state::pays(100, 106.25, 4));
  // Periods: 50 ms and 64 elements, or fewer elements over longer; never an empty one.
  CHECK_FALSE(autotune_state::period_done(0.049, 100000));
  CHECK_FALSE(autotune_state::period_done(0.5, 63));
  CHECK(autotune_state::period_done(0.05, 64));
  CHECK_FALSE(autotune_state::period_done(0.99, 8));
  CHECK(autotune_state::period_done(1.0, 8));
  CHECK_FALSE(autotune_state::period_done(9.9, 7));
  CHECK(autotune_state::period_done(10, 1));
  CHECK_FALSE(autotune_state::period_done(1000, 0));
  // Property: any sample moves the count by at most one, within [1, max].
  std::uint64_t x = 12345;
  auto rnd = [&] {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    return double(x >> 11) / double(1ull << 53);
  };
  for (std::size_t max : {1, 2, 3, 16}) {
    autotune_state s;
    std::size_t a = 1;
    for (int i = 0; i < 20000; ++i) {
      const autotune_sample m{.rate = 1000 * rnd(), .consumer_wait = rnd() < 0.5 ? rnd() * 0.1 : rnd(),
                              .worker_wait = rnd()};
      const std::size_t b = s.decide(m, a, max);
      REQUIRE(b >= 1);
      REQUIRE(b <= max);
      REQUIRE((b == a || b == a + 1 || b + 1 == a));
      a = b;
    }
  }
}

TEST_CASE("autotune map equals sequential map for every ceiling, over epochs, errors included" *
          doctest::timeout(120)) {
  watchdog w(120s);
  struct boom : std::runtime_error {
    using std::runtime_error::runtime_error;
  };
  for (std::size_t max : {1, 2, 3, 8})
    for (std::size_t n : {0, 1, 100, 5000}) {
      CAPTURE(max);
      CAPTURE(n);
      auto p = ferry::from_generator(n, [](std::uint64_t i) { return i; }) |
               ferry::map(
                   [](std::uint64_t x) {
                     if (x % 997 == 3) throw boom("bad " + std::to_string(x));
                     return work(x);
                   },
                   {.workers = ferry::autotune, .window = 64, .max_workers = max});
      for (int epoch = 0; epoch < 3; ++epoch) {
        std::vector<std::uint64_t> got, errors;
        for (;;) {
          try {
            auto e = p.next();
            if (!e) break;
            got.push_back(*e);
          } catch (const ferry::element_error& e) {
            errors.push_back(e.element());
          }
        }
        std::vector<std::uint64_t> expect, expect_errors;
        for (std::uint64_t i = 0; i < n; ++i)
          if (i % 997 == 3)
            expect_errors.push_back(i);
          else
            expect.push_back(work(i));
        CHECK(got == expect);
        CHECK(errors == expect_errors);
        p.rewind();
      }
    }
}

namespace {
// Counts fn calls running at once, and the most seen.
struct concurrency {
  std::atomic<int> now{0}, most{0};
  void enter() {
    const int n = ++now;
    int m = most.load();
    while (n > m && !most.compare_exchange_weak(m, n)) {
    }
  }
  void leave() { --now; }
};
template <class P>
std::size_t map_threads(const P& p) {
  for (const auto& st : ferry::report(p).stages)
    if (st.kind == "map") return st.threads;
  return 0;
}
}  // namespace

TEST_CASE("autotune: a map whose fn blocks gets more workers, keeps them next epoch; destroying it "
          "mid-epoch joins them all" * doctest::timeout(60)) {
  watchdog w(60s);
  concurrency c;
  auto p = std::make_optional(
      ferry::from_generator(100'000, [](std::uint64_t i) { return i; }) |
      ferry::map(
          [&](std::uint64_t x) {
            c.enter();
            std::this_thread::sleep_for(200us);  // a blocking read: more workers help even on one core
            c.leave();
            return x;
          },
          {.workers = ferry::autotune, .max_workers = 4}));
  std::uint64_t expect = 0;
  // Four seconds at most: one worker does about 4,000 elements a second here, four 16,000.
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - t0 < 4s) {
    auto e = p->next();
    REQUIRE(e);
    REQUIRE(*e == expect++);
    if (expect % 256 == 0 && map_threads(*p) == 4) break;
  }
  const std::size_t threads = map_threads(*p);
  CAPTURE(expect);
  // The weakest claims that timing on a loaded machine cannot break: it chose more than one,
  // and more than one really ran at once.
  CHECK(threads >= 2);
  CHECK(c.most >= 2);
  MESSAGE("autotune reached " << threads << " of 4 workers after " << expect << " elements");
  // The next epoch starts with the count learned (or one less: a test of one fewer may have
  // been under way), not from one.
  p->rewind();
  CHECK(map_threads(*p) + 1 >= threads);
  REQUIRE(p->next());
  CHECK(map_threads(*p) + 1 >= threads);
  const auto t1 = std::chrono::steady_clock::now();
  p.reset();  // parked and working threads alike stop and join
  CHECK(c.now == 0);
  CHECK(std::chrono::steady_clock::now() - t1 < 2s);
}

TEST_CASE("autotune: epochs shorter than a period still learn" * doctest::timeout(60)) {
  watchdog w(60s);
  concurrency c;
  auto p = ferry::from_generator(300, [](std::uint64_t i) { return i; }) |
           ferry::map(
               [&](std::uint64_t x) {
                 c.enter();
                 std::this_thread::sleep_for(100us);
                 c.leave();
                 return x;
               },
               {.workers = ferry::autotune, .max_workers = 8});
  // An epoch takes about 40 ms at one worker here: under one 50 ms period.
  int epoch = 0;
  for (; epoch < 100 && map_threads(p) < 4; ++epoch) {
    std::uint64_t expect = 0;
    while (auto e = p.next()) REQUIRE(*e == expect++);
    REQUIRE(expect == 300);
    p.rewind();
  }
  MESSAGE("short epochs: " << map_threads(p) << " workers after " << epoch << " epochs");
  CHECK(map_threads(p) >= 2);
  CHECK(c.most >= 2);
}

TEST_CASE("autotune: a map that is not the bottleneck (a slow consumer) does not climb" * doctest::timeout(60)) {
  watchdog w(60s);
  concurrency c;
  auto p = ferry::from_generator(3000, [](std::uint64_t i) { return i; }) |
           ferry::map(
               [&](std::uint64_t x) {
                 c.enter();
                 c.leave();
                 return x + 1;
               },
               {.workers = ferry::autotune, .max_workers = 4});
  std::uint64_t expect = 1;
  while (auto e = p.next()) {
    REQUIRE(*e == expect++);
    std::this_thread::sleep_for(100us);  // the consumer's own work: the map is far ahead
  }
  CHECK(expect == 3001);
  // One worker; two while it tests one more (a period in which the worker was descheduled,
  // on a loaded machine, can start such a test). Three or four would mean it kept workers
  // that cannot pay here: the consumer is the limit.
  CHECK(c.most <= 2);
  CHECK(map_threads(p) <= 2);
  MESSAGE("not the bottleneck: " << map_threads(p) << " worker(s) at the end, " << c.most.load() << " at once at most");
}

TEST_CASE("autotune: max_workers without autotune is a config error") {
  CHECK_THROWS_WITH(ferry::map([](int x) { return x; }, {.workers = 2, .max_workers = 4}),
                    doctest::Contains("max_workers is autotune's ceiling"));
}

TEST_CASE("map's next_into, and batch over a map through it: the batches and errors of next() (the path "
          "with stats on is the oracle); a sink that throws takes its element" * doctest::timeout(120)) {
  watchdog w(120s);
  using elem = std::tuple<std::array<float, 48>, std::int32_t>;  // fixed-size: batch collates in place
  const bool stats_were = ferry::stats_enabled();
  std::mt19937_64 g(77);
  struct boom : std::runtime_error {
    using std::runtime_error::runtime_error;
  };
  for (int it = 0; it < 60; ++it) {
    const std::size_t workers = std::vector<std::size_t>{1, 2, 3, ferry::autotune}[it % 4];
    const bool ordered = it % 8 < 6;
    const std::uint64_t n = g() % 400;
    const std::uint64_t bad = g() % 3 == 0 ? g() % (n + 1) : ~std::uint64_t(0);  // fn throws there
    const std::size_t bsize = std::vector<std::size_t>{1, 7, 32}[g() % 3];
    const bool drop = g() % 2;
    CAPTURE(it);
    CAPTURE(workers);
    CAPTURE(n);
    CAPTURE(bad);
    auto make = [&] {
      return ferry::from_generator(n, [](std::uint64_t i) { return i; }) |
             ferry::map(
                 [bad](std::uint64_t x) {
                   if (x == bad) throw boom("bad " + std::to_string(x));
                   elem e;
                   for (std::size_t j = 0; j < 48; ++j) std::get<0>(e)[j] = float(x * 48 + j);
                   std::get<1>(e) = std::int32_t(x);
                   return e;
                 },
                 {.workers = workers, .ordered = ordered}) |
             ferry::batch(bsize, {.drop_remainder = drop});
    };
    struct epoch {
      std::vector<std::vector<std::int32_t>> labels;  // per batch
      std::vector<float> pixels;                       // every batch's floats, in order
      std::optional<std::uint64_t> err;
    };
    auto drain = [&](bool stats) {
      ferry::enable_stats(stats);
      auto p = make();
      std::vector<epoch> out;
      for (int e = 0; e < 2; ++e) {  // two epochs: the ring's places come back
        epoch ep;
        try {
          while (auto b = p.next()) {
            auto x = b->template field<0>();
            auto y = b->template field<1>();
            ep.labels.emplace_back(y.begin(), y.end());
            for (const auto& a : x) ep.pixels.insert(ep.pixels.end(), a.begin(), a.end());
          }
        } catch (const ferry::element_error& err) {
          ep.err = err.element();
        }
        out.push_back(std::move(ep));
        p.rewind();
      }
      return out;
    };
    const auto want = drain(true), got = drain(false);
    for (int e = 0; e < 2; ++e) {
      CAPTURE(e);
      CHECK(got[e].err == want[e].err);
      if (ordered) {
        CHECK(got[e].labels == want[e].labels);
        CHECK(got[e].pixels == want[e].pixels);
      } else {  // the same elements, in some order
        auto flat = [](const epoch& ep) {
          std::vector<std::int32_t> v;
          for (const auto& l : ep.labels) v.insert(v.end(), l.begin(), l.end());
          std::sort(v.begin(), v.end());
          return v;
        };
        if (!want[e].err) CHECK(flat(got[e]) == flat(want[e]));
      }
      if (!want[e].err && ordered) {  // and what a plain loop would give
        std::size_t total = 0;
        for (const auto& l : got[e].labels) total += l.size();
        CHECK(total == (drop ? n / bsize * bsize : n));
      }
    }
  }
  // next_into itself: a sink that throws takes its element; the next call goes on after it.
  for (std::size_t workers : {std::size_t(1), std::size_t(3)}) {
    ferry::enable_stats(false);
    auto m = ferry::from_generator(50, [](std::uint64_t i) { return i; }) |
             ferry::map([](std::uint64_t x) { return x * 10; }, {.workers = workers});
    std::vector<std::uint64_t> seen;
    for (;;) {
      try {
        if (!m.next_into([&](std::uint64_t& v) {
              if (v == 70) throw boom("sink");
              seen.push_back(v);
            }))
          break;
      } catch (const boom&) {
        seen.push_back(~std::uint64_t(0));
      }
    }
    std::vector<std::uint64_t> want;
    for (std::uint64_t i = 0; i < 50; ++i) want.push_back(i == 7 ? ~std::uint64_t(0) : i * 10);
    CHECK(seen == want);
  }
  ferry::enable_stats(stats_were);
}

TEST_CASE("absurd worker counts and windows are config_errors naming map and the value") {
  auto src = [] { return ferry::from_generator(10, [](std::uint64_t i) { return i; }); };
  auto id = [](std::uint64_t x) { return x; };
  CHECK_THROWS_WITH_AS(src() | ferry::map(id, {.workers = 1000000}),
                       doctest::Contains("map: workers = 1000000 threads; at most 1024"), ferry::config_error);
  CHECK_THROWS_WITH_AS(ferry::map(id, {.workers = ferry::autotune, .max_workers = 5000}),
                       doctest::Contains("map: max_workers = 5000"), ferry::config_error);
  CHECK_THROWS_WITH_AS(src() | ferry::map(id, {.workers = 2, .window = std::size_t(1) << 40}),
                       doctest::Contains("map: window = 1099511627776 elements"), ferry::config_error);
}

// An upstream error holds its place in map's element count on every path: fn's errors and
// the saved index name the same element at 1, 2 or 3 workers and under autotune (the
// inline path did not count them: "element 4" at 1 worker, "element 5" at 2). Property over
// error placements, against the count of places before each failing element.
TEST_CASE("map: fn's error names the same element at any worker count, with upstream errors before it" *
          doctest::timeout(60)) {
  watchdog w(60s);
  std::mt19937_64 g(5);
  for (int trial = 0; trial < 20; ++trial) {
    const std::uint64_t n = 1 + g() % 60;
    std::vector<std::uint64_t> up_fail;
    for (std::uint64_t i = 0; i < n; ++i)
      if (g() % 5 == 0) up_fail.push_back(i);
    const std::uint64_t bad_mod = 3 + g() % 5;  // fn throws on values v with v % bad_mod == 1
    std::vector<std::uint64_t> want;             // the places of fn's errors: upstream errors count
    for (std::uint64_t i = 0; i < n; ++i)
      if (std::find(up_fail.begin(), up_fail.end(), i) == up_fail.end() && i % bad_mod == 1) want.push_back(i);
    CAPTURE(trial);
    for (std::size_t workers : {std::size_t(1), std::size_t(2), std::size_t(3), ferry::autotune}) {
      CAPTURE(workers);
      auto p = ferry_test::failing_source(n, up_fail) | ferry::map(
                                                            [bad_mod](std::uint64_t v) {
                                                              if (v % bad_mod == 1) throw std::runtime_error("bad");
                                                              return v;
                                                            },
                                                            {.workers = workers, .window = 8,
                                                             .max_workers = workers == ferry::autotune ? 2u : 0u});
      std::vector<std::uint64_t> got;
      for (;;) {
        try {
          if (!p.next()) break;
        } catch (const ferry::element_error& e) {
          got.push_back(e.element());
        } catch (const std::runtime_error&) {  // the upstream's, unchanged
        }
      }
      CHECK(got == want);
    }
  }
}

// An ordered parallel map takes an anchor (the upstream's state) every window while it
// reads, checkpoint or not. An upstream that refuses to save (an unordered parallel map)
// made each refusal an error in the data, once a window: plain iteration lost elements.
// Now iteration goes on untouched, and save_state() is what throws.
TEST_CASE("map: an upstream that cannot be saved never puts errors into an ordered parallel map's data" *
          doctest::timeout(60)) {
  watchdog w(60s);
  for (std::size_t window : {std::size_t(4), std::size_t(8), std::size_t(64)}) {
    CAPTURE(window);
    auto p = ferry::from_generator(100, [](std::uint64_t i) { return i; }) |
             ferry::map([](std::uint64_t x) { return x; }, {.workers = 2, .ordered = false}) |
             ferry::map([](std::uint64_t x) { return x + 1; }, {.workers = 2, .window = window});
    std::vector<std::uint64_t> got;
    for (int epoch = 0; epoch < 2; ++epoch) {
      got.clear();
      for (int k = 0; k < 50; ++k) got.push_back(p.next().value());  // no error on the way
      CHECK_THROWS_WITH_AS(ferry::save_state(p), doctest::Contains("an unordered parallel map cannot be checkpointed"),
                           ferry::config_error);
      while (auto e = p.next()) got.push_back(*e);
      std::sort(got.begin(), got.end());
      std::vector<std::uint64_t> want(100);
      std::iota(want.begin(), want.end(), 1);
      CHECK(got == want);
      p.rewind();
    }
  }
}
