// thread_group / thread_communicator: all-reduce, broadcast and barrier among N threads,
// against a naive oracle (sums in rank order), plus the failure paths.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/doubles.hpp"
#include "ferry/collective/communicator.hpp"
#include "ferry/collective/thread_collective.hpp"

using namespace std::chrono_literals;

namespace {
// Runs f(rank) on n threads and joins them; rethrows nothing (tests check results).
template <class F>
void on_threads(int n, F f) {
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r) ts.emplace_back([&, r] { f(r); });
  for (auto& t : ts) t.join();
}
// Ranks 0..k-1 of g, each in an all_reduce_sum on a thread of its own (the caller joins
// them); an abort lets them out: each counts itself in `released`, then calls after().
template <class After>
std::vector<std::thread> waiters(ferry::thread_group& g, int k, std::atomic<int>& released, After after) {
  std::vector<std::thread> ts;
  for (int r = 0; r < k; ++r)
    ts.emplace_back([&g, &released, after, r] {
      std::vector<float> v(8, 1.0f);
      try {
        g.communicator(r).all_reduce_sum(v);
      } catch (const ferry::error&) {
        released.fetch_add(1);
        after();
      }
    });
  return ts;
}
std::vector<float> random_floats(std::size_t n, std::uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(-10.0f, 10.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}
}  // namespace

TEST_CASE("solo_communicator is the identity" * doctest::timeout(5)) {
  ferry::solo_communicator c;
  std::vector<float> v{1, 2, 3};
  c.all_reduce_sum(v);
  c.all_reduce_average(v);
  c.broadcast(v, 0);
  c.barrier();
  CHECK(v == std::vector<float>{1, 2, 3});
  CHECK(c.rank() == 0);
  CHECK(c.size() == 1);
}

TEST_CASE("all_reduce sum and average equal the rank-order oracle, bit for bit" *
          doctest::timeout(30)) {
  ferry_test::watchdog wd(30s, "all_reduce sweep");
  for (int n : {1, 2, 3, 4, 5}) {
    for (std::size_t len : {std::size_t(0), std::size_t(1), std::size_t(3), std::size_t(7),
                            std::size_t(1000), std::size_t(4099)}) {
      ferry::thread_group g(n);
      std::vector<std::vector<float>> in(n), sum(n), avg(n);
      for (int r = 0; r < n; ++r) in[r] = random_floats(len, 100u * n + r + len);
      std::vector<float> want_sum(len), want_avg(len);
      for (std::size_t i = 0; i < len; ++i) {
        float t = in[0][i];
        for (int r = 1; r < n; ++r) t += in[r][i];
        want_sum[i] = t;
        want_avg[i] = t * (1.0f / n);
      }
      on_threads(n, [&](int r) {
        auto c = g.communicator(r);
        sum[r] = in[r];
        avg[r] = in[r];
        for (int rep = 0; rep < 3; ++rep) {  // the group is reusable call after call
          if (rep > 0) sum[r] = in[r], avg[r] = in[r];
          c.all_reduce_sum(sum[r]);
          c.all_reduce_average(avg[r]);
        }
      });
      for (int r = 0; r < n; ++r) {
        INFO("n=" << n << " len=" << len << " rank=" << r);
        CHECK(sum[r] == want_sum);
        CHECK(avg[r] == want_avg);
      }
    }
  }
}

TEST_CASE("broadcast copies the root's values to every rank" * doctest::timeout(20)) {
  ferry_test::watchdog wd(20s, "broadcast");
  const int n = 4;
  ferry::thread_group g(n);
  for (int root = 0; root < n; ++root) {
    std::vector<std::vector<float>> v(n);
    for (int r = 0; r < n; ++r) v[r] = random_floats(333, 7u * r + root);
    const std::vector<float> want = v[root];
    on_threads(n, [&](int r) { g.communicator(r).broadcast(v[r], root); });
    for (int r = 0; r < n; ++r) CHECK(v[r] == want);
  }
}

TEST_CASE("barrier: nobody leaves before everybody arrived" * doctest::timeout(20)) {
  ferry_test::watchdog wd(20s, "barrier");
  const int n = 4;
  ferry::thread_group g(n);
  std::atomic<int> arrived{0};
  std::atomic<int> early{0};
  on_threads(n, [&](int r) {
    auto c = g.communicator(r);
    for (int round = 1; round <= 50; ++round) {
      arrived.fetch_add(1);
      c.barrier();
      if (arrived.load() < round * n) early.fetch_add(1);
      c.barrier();
    }
  });
  CHECK(early.load() == 0);
  CHECK(arrived.load() == 50 * n);
}

TEST_CASE("mismatched lengths are a config_error on every rank" * doctest::timeout(20)) {
  ferry_test::watchdog wd(20s, "mismatch");
  const int n = 3;
  ferry::thread_group g(n);
  std::atomic<int> errors{0};
  on_threads(n, [&](int r) {
    std::vector<float> v(10 + (r == 1 ? 1 : 0), 1.0f);
    try {
      g.communicator(r).all_reduce_sum(v);
    } catch (const ferry::config_error&) {
      errors.fetch_add(1);
    }
  });
  CHECK(errors.load() == n);
  // and the group still works afterwards
  std::vector<std::vector<float>> v(n, std::vector<float>(5, 2.0f));
  on_threads(n, [&](int r) { g.communicator(r).all_reduce_sum(v[r]); });
  for (auto& x : v) CHECK(x == std::vector<float>(5, 6.0f));
}

TEST_CASE("abort releases ranks waiting in a collective" * doctest::timeout(20)) {
  ferry_test::watchdog wd(20s, "abort");
  const int n = 3;
  ferry::thread_group g(n);
  std::atomic<int> released{0};
  // Rank n-1 never comes: its replica "failed".
  std::vector<std::thread> ts = waiters(g, n - 1, released, [] {});
  // Abort only once both are blocked inside the collective, so what is tested is the
  // wake-up of sleeping waiters, not the check on entry.
  while (g.waiting() < n - 1) std::this_thread::yield();
  CHECK(released.load() == 0);
  g.abort();
  for (auto& t : ts) t.join();
  CHECK(released.load() == n - 1);
  CHECK(g.aborted());
  std::vector<float> v(1);
  CHECK_THROWS_AS(g.communicator(0).barrier(), ferry::error);
  g.reset();
  CHECK_FALSE(g.aborted());
}

TEST_CASE("broadcast: only the ranks whose length differs from the root's throw" *
          doctest::timeout(20)) {
  ferry_test::watchdog wd(20s, "broadcast mismatch");
  const int n = 3;
  ferry::thread_group g(n);
  std::vector<int> threw(n, 0);
  std::vector<std::vector<float>> v{std::vector<float>(4, 7.0f), std::vector<float>(4, 0.0f),
                                    std::vector<float>(5, 0.0f)};
  on_threads(n, [&](int r) {
    try {
      g.communicator(r).broadcast(v[r], 0);
    } catch (const ferry::config_error&) {
      threw[r] = 1;
    }
  });
  CHECK(threw == std::vector<int>{0, 0, 1});
  CHECK(v[1] == std::vector<float>(4, 7.0f));  // the matching rank got its copy
}

TEST_CASE("a communicator's abort() releases the others; its reset() makes the group usable" *
          doctest::timeout(20)) {
  ferry_test::watchdog wd(20s, "communicator abort");
  const int n = 3;
  ferry::thread_group g(n);
  std::vector<ferry::thread_communicator> c;
  for (int r = 0; r < n; ++r) c.push_back(g.communicator(r));
  std::atomic<int> released{0};
  on_threads(n, [&](int r) {
    std::vector<float> v(8, 1.0f);
    if (r == n - 1) {  // this rank "fails" instead of joining: it aborts through its handle
      c[r].abort();
      return;
    }
    try {
      c[r].all_reduce_sum(v);
    } catch (const ferry::error&) {
      released.fetch_add(1);
    }
  });
  CHECK(released.load() == n - 1);
  CHECK(g.aborted());
  c[1].reset();
  CHECK_FALSE(g.aborted());
  std::vector<std::vector<float>> v(n, std::vector<float>(5, 2.0f));
  on_threads(n, [&](int r) { c[r].all_reduce_sum(v[r]); });
  for (auto& x : v) CHECK(x == std::vector<float>(5, 6.0f));
}

TEST_CASE("bad group sizes, ranks and roots are config_errors") {
  CHECK_THROWS_AS(ferry::thread_group(0), ferry::config_error);
  ferry::thread_group g(2);
  CHECK_THROWS_AS(g.communicator(2), ferry::config_error);
  CHECK_THROWS_AS(g.communicator(-1), ferry::config_error);
  ferry::thread_group one(1);
  std::vector<float> v(3, 1.0f);
  CHECK_THROWS_AS(one.communicator(0).broadcast(v, 1), ferry::config_error);
}

// A reset() right after abort() must not strand a waiter that has not woken yet: it was
// waiting for peers that left, and used to see aborted() false and its generation
// unchanged, and sleep forever. Here each released waiter resets the group at once (as a
// trainer over part of a shared group did once its own replicas were back), so the first
// one out resets before the second wakes, nearly every time.
TEST_CASE("a waiter woken by abort() throws even when reset() came first" * doctest::timeout(60)) {
  ferry_test::watchdog wd(60s, "abort then reset");
  for (int it = 0; it < 200; ++it) {
    ferry::thread_group g(3);
    std::atomic<int> released{0};
    std::vector<std::thread> ts = waiters(g, 2, released, [&g] { g.reset(); });
    while (g.waiting() < 2) std::this_thread::yield();
    g.communicator(2).abort();
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (released.load() < 2 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
    const int got = released.load();
    if (got < 2) g.abort();  // release the stranded waiter, so the failure is reported, not a hang
    for (auto& t : ts) t.join();
    INFO("iteration " << it);
    REQUIRE(got == 2);
    // The group works again, and the aborted waiters no longer count as arrived.
    std::vector<std::vector<float>> v(3, std::vector<float>(4, 1.0f));
    on_threads(3, [&](int r) { g.communicator(r).all_reduce_sum(v[r]); });
    for (auto& x : v) REQUIRE(x == std::vector<float>(4, 3.0f));
  }
}

TEST_CASE("the abort error names the rank it reaches and the rank that aborted" * doctest::timeout(20)) {
  ferry_test::watchdog wd(20s, "abort message");
  ferry::thread_group g(3);
  std::string msg;
  std::thread t([&] {
    std::vector<float> v(2);
    try {
      g.communicator(1).all_reduce_sum(v);
    } catch (const ferry::error& e) {
      msg = e.what();
    }
  });
  while (g.waiting() < 1) std::this_thread::yield();
  g.communicator(2).abort();
  t.join();
  CHECK(msg == "thread_group rank 1 of 3: the collective was aborted by rank 2 (a replica failed)");
  CHECK_THROWS_WITH_AS(g.communicator(0).barrier(),
                       "thread_group rank 0 of 3: the collective was aborted by rank 2 (a replica failed)",
                       ferry::error);
  g.reset();
  g.abort();
  CHECK_THROWS_WITH_AS(g.barrier(), "thread_group: the collective was aborted by thread_group::abort() (a replica failed)",
                       ferry::error);
}

// The mismatch message reads the other rank's length before the barrier that lets that
// rank go on: it used to read it after, when the rank may have posted its next call's.
TEST_CASE("a length mismatch names the lengths of that call, not the next" * doctest::timeout(60)) {
  ferry_test::watchdog wd(60s, "mismatch message");
  int wrong_reduce = 0, wrong_bcast = 0;
  std::string example;
  for (int it = 0; it < 2000; ++it) {
    ferry::thread_group g(2);
    std::string reduce_msg, bcast_msg;
    std::thread t1([&] {
      auto c = g.communicator(1);
      std::vector<float> v(4, 1.0f), w(7, 1.0f), b(9, 1.0f);
      try { c.all_reduce_sum(v); } catch (const ferry::config_error&) {}
      c.all_reduce_sum(w);  // the next call, at once
      c.broadcast(b, 1);    // root 1 posts 9 ...
      c.broadcast(w, 1);    // ... then 7 at once
    });
    auto c = g.communicator(0);
    std::vector<float> v(3, 1.0f), w(7, 1.0f), b(8, 1.0f);
    try { c.all_reduce_sum(v); } catch (const ferry::config_error& e) { reduce_msg = e.what(); }
    c.all_reduce_sum(w);
    try { c.broadcast(b, 1); } catch (const ferry::config_error& e) { bcast_msg = e.what(); }
    c.broadcast(w, 1);
    t1.join();
    if (reduce_msg.find("(4 on rank 1, 3 on rank 0)") == std::string::npos && ++wrong_reduce == 1) example = reduce_msg;
    if (bcast_msg.find("rank 0 passed 8 floats, the root 9") == std::string::npos && ++wrong_bcast == 1) example = bcast_msg;
  }
  INFO("e.g. " << example);
  CHECK(wrong_reduce == 0);
  CHECK(wrong_bcast == 0);
}

// An abort() after every rank posted its buffer made the first rank at the closing barrier
// throw and free its buffer while the others still summed into it (ASan: heap-use-after-
// free). Once every buffer is posted the collective now finishes, abort or not: every
// rank returns the right sums, and the next collective throws the abort.
TEST_CASE("abort() after every rank posted its buffer: the collective finishes on every rank, the next one throws" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(60s, "abort mid-collective");
  constexpr std::size_t len = std::size_t(1) << 22;  // a reduce of milliseconds: the abort lands in it or after
  for (int it = 0; it < 10; ++it) {
    INFO("iteration " << it);
    ferry::thread_group g(2);
    std::vector<std::vector<float>> v(2);
    std::atomic<bool> go1{false};
    std::atomic<int> returned{0}, threw{0};
    std::vector<std::thread> ts;
    for (int r = 0; r < 2; ++r)
      ts.emplace_back([&, r] {
        if (r == 1)
          while (!go1.load()) std::this_thread::yield();
        v[r].assign(len, float(r + 1));
        try {
          g.communicator(r).all_reduce_sum(v[r]);
          ++returned;
        } catch (const ferry::error&) {
          ++threw;
        }
      });
    while (g.waiting() < 1) std::this_thread::yield();  // rank 0 has posted and waits
    go1 = true;
    while (g.waiting() != 0) std::this_thread::yield();  // rank 1 posted: the barrier completed
    g.abort();
    for (auto& t : ts) t.join();
    REQUIRE(returned == 2);
    CHECK(threw == 0);
    for (int r = 0; r < 2; ++r) {
      CHECK(v[r].front() == 3.0f);
      CHECK(v[r].back() == 3.0f);
    }
    CHECK(g.aborted());
    std::vector<float> x(4, 1.0f);
    CHECK_THROWS_AS(g.communicator(0).all_reduce_sum(x), ferry::error);
  }
}
