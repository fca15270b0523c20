// cache_on_device on host replicas: later epochs come from each replica's cache (the
// upstream is not read again), a permutation of the rows it cached with its fields kept
// together, a new order each epoch fixed by the seed; the budget's two choices (the padding
// rows served counted, the step over it not lost); an epoch 0 stopped part way is never
// served; padded remainders cache only real rows; a resume in epoch 0 or later continues
// the uninterrupted job's global batches at another replica count; what a resume checks.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ferry/detail/random.hpp"
#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/cache_on_device.hpp"
#include "ferry/stages/detail/cache_exchange.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/repeat.hpp"
#include "ferry/stages/map.hpp"

namespace {

using u64 = std::uint64_t;
using row = std::tuple<u64, std::array<u64, 2>>;
using epoch_rows = std::vector<std::vector<u64>>;  // per replica, the ids in order

std::vector<u64> ids(u64 n) {
  std::vector<u64> v(n);
  for (u64 i = 0; i < n; ++i) v[i] = i;
  return v;
}

auto pipeline(const std::vector<u64>& data, std::atomic<u64>& reads, std::size_t replicas, ferry::cache_on_device_options o,
              ferry::remainder_policy policy = ferry::remainder_policy::drop) {
  return ferry::from_range(data) | ferry::map([&reads](u64 id) {
           reads++;
           return row{id, {id * 3, id * 7}};
         }) |
         ferry::batch(12) | ferry::distribute(ferry::host_replicas{replicas}, {.remainder = policy}) |
         ferry::cache_on_device(o);
}

// One epoch: per replica the ids of the real rows, checking the fields stayed together.
template <class P>
epoch_rows epoch_of(P& p, std::size_t& steps) {
  epoch_rows out;
  steps = 0;
  for (auto& st : p) {
    out.resize(st.replicas());
    for (std::size_t r = 0; r < st.replicas(); ++r) {
      const auto a = st[r].template field<0>();
      const auto b = st[r].template field<1>();
      for (std::size_t i = 0; i < st[r].valid(); ++i) {
        REQUIRE(b[i][0] == a[i] * 3);
        REQUIRE(b[i][1] == a[i] * 7);
        out[r].push_back(a[i]);
      }
    }
    ++steps;
  }
  p.rewind();
  return out;
}

std::vector<u64> flat(const std::vector<std::vector<u64>>& steps) {
  std::vector<u64> v;
  for (const auto& s : steps) v.insert(v.end(), s.begin(), s.end());
  return v;
}

std::vector<u64> sorted(std::vector<u64> v) {
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

TEST_CASE("cache_on_device: later epochs from the cache, each a new order of each replica's rows") {
  const auto data = ids(240);
  for (std::size_t replicas : {std::size_t(1), std::size_t(2), std::size_t(3)}) {
    CAPTURE(replicas);
    std::atomic<u64> reads{0};
    auto p = pipeline(data, reads, replicas, {.seed = 5});
    std::size_t steps0 = 0, steps = 0;
    const epoch_rows first = epoch_of(p, steps0);
    CHECK(reads == 240);
    CHECK(p.cached());
    std::vector<epoch_rows> later;
    for (int e = 1; e <= 3; ++e) {
      later.push_back(epoch_of(p, steps));
      CHECK(steps == steps0);
      CHECK(reads == 240);  // the upstream is not read again
      REQUIRE(later.back().size() == replicas);
      for (std::size_t r = 0; r < replicas; ++r) {
        CHECK(sorted(later.back()[r]) == sorted(first[r]));  // the rows it cached, once each
        CHECK(later.back()[r] != first[r]);                   // in a new order
      }
    }
    for (std::size_t r = 0; r < replicas; ++r) CHECK(later[0][r] != later[1][r]);
    // The same seed, the same orders; another seed, others.
    std::atomic<u64> reads2{0};
    auto q = pipeline(data, reads2, replicas, {.seed = 5});
    auto other = pipeline(data, reads2, replicas, {.seed = 6});
    (void)epoch_of(q, steps);
    (void)epoch_of(other, steps);
    CHECK(epoch_of(q, steps) == later[0]);
    CHECK(epoch_of(other, steps) != later[0]);
    // Without shuffle, the cache serves epoch 0's order.
    auto plain = pipeline(data, reads2, replicas, {.shuffle = false});
    const epoch_rows p0 = epoch_of(plain, steps);
    CHECK(epoch_of(plain, steps) == p0);
    CHECK(plain.bytes_per_replica() == 240 / replicas * 24);
    CHECK(p.bytes_per_replica() == 2 * 240 / replicas * 24);  // the cache and the epoch's copy
  }
}

TEST_CASE("cache_on_device: over budget, a config_error naming the size, or the upstream every epoch") {
  const auto data = ids(240);
  std::atomic<u64> reads{0};
  // 120 rows a replica of 24 bytes, twice (shuffled copy): 5760 bytes needed.
  auto tight = pipeline(data, reads, 2, {.budget_bytes = 5000, .seed = 1});
  std::size_t steps = 0;
  try {
    for (auto& st : tight) (void)st, ++steps;
    FAIL("no error");
  } catch (const ferry::config_error& e) {
    const std::string w = e.what();
    CHECK(w.find("replica 0 needs more than its budget of 5000 bytes") != std::string::npos);
    CHECK(w.find("over_budget::stream") != std::string::npos);
    CHECK(steps == 17);  // 17 steps of 6 rows a replica fit (4896 bytes), the 18th does not
  }
  auto ok = pipeline(data, reads, 2, {.budget_bytes = 5760, .seed = 1});
  (void)epoch_of(ok, steps);
  CHECK(ok.cached());
  // stream: the cache is given up; every epoch is the upstream's, read again.
  reads = 0;
  auto streaming = pipeline(data, reads, 2, {.budget_bytes = 5000, .when_over = ferry::over_budget::stream});
  const epoch_rows e0 = epoch_of(streaming, steps);
  const epoch_rows e1 = epoch_of(streaming, steps);
  CHECK(!streaming.cached());
  CHECK(e0 == e1);
  CHECK(reads == 480);
  CHECK(e0[0].size() + e0[1].size() == 240);
}

TEST_CASE("cache_on_device: an epoch 0 stopped part way is filled again, never served") {
  const auto data = ids(240);
  std::atomic<u64> reads{0};
  auto p = pipeline(data, reads, 2, {.seed = 3});
  int k = 0;
  for (auto& st : p) {
    (void)st;
    if (++k == 4) break;
  }
  p.rewind();
  CHECK(!p.cached());
  std::size_t steps = 0;
  const epoch_rows full = epoch_of(p, steps);  // read again, whole
  CHECK(full[0].size() + full[1].size() == 240);
  CHECK(p.cached());
  const epoch_rows served = epoch_of(p, steps);
  CHECK(sorted(served[0]) == sorted(full[0]));
  CHECK(sorted(served[1]) == sorted(full[1]));
}

TEST_CASE("cache_on_device: a padded last batch caches its real rows only") {
  const auto data = ids(100);  // 8 batches of 12 and one of 4
  std::atomic<u64> reads{0};
  auto p = pipeline(data, reads, 2, {.seed = 2}, ferry::remainder_policy::pad);
  std::size_t s0 = 0, s1 = 0;
  const epoch_rows e0 = epoch_of(p, s0);
  const epoch_rows e1 = epoch_of(p, s1);
  CHECK(s0 == 9);
  CHECK(s1 == 9);
  std::vector<u64> all = e1[0];
  all.insert(all.end(), e1[1].begin(), e1[1].end());
  CHECK(sorted(all) == data);
  CHECK(sorted(e1[0]) == sorted(e0[0]));
}

TEST_CASE("cache_on_device: under pad, later epochs keep epoch 0's slice sizes, the padding rows zero") {
  const auto data = ids(100);  // batches of 12 over 3 replicas: the last is 4 real rows, padded
  std::atomic<u64> reads{0};
  for (bool shuffle : {true, false}) {
    CAPTURE(shuffle);
    auto p = pipeline(data, reads, 3, {.seed = 8, .shuffle = shuffle}, ferry::remainder_policy::pad);
    std::vector<std::vector<std::pair<std::size_t, std::size_t>>> shapes(3);  // per epoch: (size, valid) per replica per step
    for (int e = 0; e < 3; ++e) {
      shapes[std::size_t(e)].clear();
      for (auto& st : p)
        for (std::size_t r = 0; r < st.replicas(); ++r) {
          shapes[std::size_t(e)].emplace_back(st[r].size(), st[r].valid());
          const auto a = st[r].field<0>();
          const auto b = st[r].field<1>();
          for (std::size_t i = st[r].valid(); i < st[r].size() && e > 0; ++i) {  // served padding rows
            CHECK(a[i] == 0);
            CHECK(b[i][0] == 0);
          }
        }
      p.rewind();
    }
    CHECK(shapes[1] == shapes[0]);
    CHECK(shapes[2] == shapes[0]);
    CHECK(shapes[0].back() == std::pair<std::size_t, std::size_t>(4, 0));
  }
}

// A short step before the last (batch(G) | repeat(2)) once shifted every later step
// (slices of the largest epoch-0 slice: epoch 1 was 12 12 12 12 12 0 after 12 12 6 12 12 6);
// later epochs now serve epoch 0's per-step layout.
TEST_CASE("cache_on_device: short steps before epoch 0's last, under partial: every epoch keeps epoch 0's steps") {
  // Epoch 0's steps, per step and replica the real rows' ids; later epochs: the same step
  // and slice sizes, each replica's own rows (or, across replicas, the global batches of
  // the documented order: epoch e's global row g is epoch 0's global row perm_e(g)).
  using steps_t = std::vector<std::vector<std::vector<u64>>>;  // [step][replica] -> ids
  const auto epoch = [](auto& p) {
    steps_t out;
    for (auto& st : p) {
      out.emplace_back(st.replicas());
      for (std::size_t r = 0; r < st.replicas(); ++r) {
        REQUIRE(st[r].size() == st[r].valid());  // partial: no padding rows
        const auto a = st[r].template field<0>();
        const auto b = st[r].template field<1>();
        for (std::size_t i = 0; i < st[r].valid(); ++i) {
          REQUIRE(b[i][1] == a[i] * 7);
          out.back()[r].push_back(a[i]);
        }
      }
    }
    p.rewind();
    return out;
  };
  const auto global = [](const steps_t& e) {
    std::vector<std::vector<u64>> g;
    for (const auto& st : e) g.push_back(flat(st));
    return g;
  };
  const auto data = ids(30);
  const auto as_row = [](u64 id) { return row{id, {id * 3, id * 7}}; };
  for (const bool across : {false, true}) {
    std::vector<std::vector<std::vector<u64>>> first_replicas;  // across: epochs 1..3 as global batches, 1 replica
    for (const std::size_t replicas : {std::size_t(1), std::size_t(2), std::size_t(3)}) {
      CAPTURE(across);
      CAPTURE(replicas);
      const ferry::cache_on_device_options o{.seed = 5, .across_replicas = across};
      auto twice = ferry::from_range(data) | ferry::map(as_row) | ferry::batch(12) | ferry::repeat(2) |  // 12 12 6 12 12 6
                   ferry::distribute(ferry::host_replicas{replicas}, {.remainder = ferry::remainder_policy::partial}) |
                   ferry::cache_on_device(o);
      const steps_t e0 = epoch(twice);
      REQUIRE(e0.size() == 6);
      CHECK(e0[2].size() == replicas);
      CHECK(flat(e0[2]).size() == 6);
      REQUIRE(twice.cached());
      const std::vector<u64> all0 = flat(global(e0));
      std::vector<std::vector<u64>> later;
      for (u64 e = 1; e <= 3; ++e) {
        CAPTURE(e);
        const steps_t got = epoch(twice);
        REQUIRE(got.size() == e0.size());
        for (std::size_t k = 0; k < got.size(); ++k) {
          REQUIRE(got[k].size() == replicas);
          for (std::size_t r = 0; r < replicas; ++r) CHECK(got[k][r].size() == e0[k][r].size());
        }
        CHECK(global(got) != global(e0));
        if (!across) {
          for (std::size_t r = 0; r < replicas; ++r) {  // each replica's own rows, in a new order
            std::vector<u64> mine, were;
            for (std::size_t k = 0; k < got.size(); ++k) {
              mine.insert(mine.end(), got[k][r].begin(), got[k][r].end());
              were.insert(were.end(), e0[k][r].begin(), e0[k][r].end());
            }
            CHECK(sorted(mine) == sorted(were));
          }
          continue;
        }
        const ferry::detail::feistel_permutation perm(
            all0.size(), ferry::detail::mix_seed({0x646576636163ull, 5, e, 0x616c6cull}));
        std::vector<std::vector<u64>> want;
        std::size_t g = 0;
        for (const auto& st : e0) {
          want.emplace_back();
          for (std::size_t n = flat(st).size(); n > 0; --n) want.back().push_back(all0[perm(g++)]);
        }
        CHECK(global(got) == want);
        for (const auto& st : global(got)) later.push_back(st);
      }
      if (across && replicas == 1) first_replicas.push_back(later);
      if (across && replicas > 1) CHECK(later == first_replicas[0]);  // the same global batches for any count
    }
  }
}

// Under pad a padded step before the last has no place for its padding rows (served after
// all real rows): refused at the step after it, which is handed out next; then every epoch
// streams, unchanged.
TEST_CASE("cache_on_device: a padded step before epoch 0's last is a config_error; the epochs stream, nothing lost") {
  const auto data = ids(30);
  // Three epochs of `plain` and of `cached` (the same pipeline with cache_on_device): the
  // same real rows at every step, and one config_error, in epoch 0.
  const auto check = [](auto plain, auto cached) {
    const auto rows_of = [](const auto& st) {
      std::vector<u64> rows;
      for (std::size_t r = 0; r < st.replicas(); ++r)
        for (std::size_t i = 0; i < st[r].valid(); ++i) rows.push_back(st[r].template field<0>()[i]);
      return rows;
    };
    for (int e = 0; e < 3; ++e) {
      CAPTURE(e);
      std::vector<std::vector<u64>> want, got;
      for (auto& st : plain) want.push_back(rows_of(st));
      plain.rewind();
      std::size_t errors = 0;
      for (std::size_t calls = 0;; ++calls) {
        REQUIRE(calls < 100);
        try {
          auto st = cached.next();
          if (!st) break;
          got.push_back(rows_of(*st));
        } catch (const ferry::config_error& err) {
          CHECK(std::string(err.what()).find("only the last step may be padded") != std::string::npos);
          ++errors;
        }
      }
      cached.rewind();
      CHECK(errors == (e == 0 ? 1u : 0u));
      CHECK(got == want);
    }
  };
  const auto pad = ferry::remainder_policy::pad;
  for (const std::size_t replicas : {std::size_t(1), std::size_t(2), std::size_t(3)}) {
    CAPTURE(replicas);
    const ferry::cache_on_device_options o{.seed = 1, .across_replicas = true};
    auto twice = [&] {  // batches of 12 12 6 12 12 6
      return ferry::from_range(data) | ferry::batch(12) | ferry::repeat(2) |
             ferry::distribute(ferry::host_replicas{replicas}, {.remainder = pad});
    };
    check(twice(), twice() | ferry::cache_on_device(o));
    auto small = [&] {  // batches of 10 under global steps of 12
      return ferry::from_range(data) | ferry::batch(10) |
             ferry::distribute(ferry::host_replicas{replicas}, {.remainder = pad, .global_batch = 12});
    };
    check(small(), small() | ferry::cache_on_device(o));
  }
}

TEST_CASE("cache_on_device: memory within the budget while filling, exact after") {
  const auto data = ids(240);
  std::atomic<u64> reads{0};
  for (bool shuffle : {true, false}) {
    CAPTURE(shuffle);
    const std::size_t budget = shuffle ? 5760 : 2880;  // 120 rows of 24 bytes a replica, once or twice
    auto p = pipeline(data, reads, 2, {.budget_bytes = budget, .seed = 1, .shuffle = shuffle});
    for (auto& st : p) {
      (void)st;
      CHECK(p.bytes_per_replica() <= budget);
    }
    p.rewind();
    CHECK(p.cached());
    CHECK(p.bytes_per_replica() == budget);
  }
}

namespace {

// One epoch as global batches: each step's real rows, replica after replica.
template <class P>
std::vector<std::vector<u64>> global_steps(P& p) {
  std::vector<std::vector<u64>> out;
  for (auto& st : p) {
    out.emplace_back();
    for (std::size_t r = 0; r < st.replicas(); ++r) {
      const auto a = st[r].template field<0>();
      const auto b = st[r].template field<1>();
      for (std::size_t i = 0; i < st[r].valid(); ++i) {
        REQUIRE(b[i][0] == a[i] * 3);  // fields still together after moving replicas
        out.back().push_back(a[i]);
      }
    }
  }
  p.rewind();
  return out;
}


}  // namespace

TEST_CASE("cache_on_device across_replicas: one order of all rows an epoch, the same global batches for 1 to 4 replicas") {
  using policy = ferry::remainder_policy;
  for (auto [n, pol] : {std::pair{u64(240), policy::drop}, std::pair{u64(250), policy::partial},
                        std::pair{u64(250), policy::pad}, std::pair{u64(247), policy::drop}}) {
    CAPTURE(n);
    CAPTURE(int(pol));
    const auto data = ids(n);
    std::vector<std::vector<std::vector<std::vector<u64>>>> by_replicas;  // [R][epoch][step] -> ids
    for (std::size_t replicas : {std::size_t(1), std::size_t(2), std::size_t(3), std::size_t(4)}) {
      CAPTURE(replicas);
      std::atomic<u64> reads{0};
      auto p = pipeline(data, reads, replicas, {.seed = 9, .across_replicas = true}, pol);
      std::vector<std::vector<std::vector<u64>>> epochs;
      epochs.push_back(global_steps(p));
      const u64 cached = flat(epochs[0]).size();
      for (int e = 1; e <= 3; ++e) {
        epochs.push_back(global_steps(p));
        CHECK(reads == n);  // the upstream is read in epoch 0 only
        REQUIRE(epochs[e].size() == epochs[0].size());
        for (std::size_t k = 0; k < epochs[e].size(); ++k) CHECK(epochs[e][k].size() == epochs[0][k].size());
        CHECK(sorted(flat(epochs[e])) == sorted(flat(epochs[0])));  // every cached row, once
        CHECK(flat(epochs[e]) != flat(epochs[e - 1]));
      }
      CHECK(cached == (pol == policy::drop ? n / 12 * 12 : n));
      if (replicas > 1) {
        // Replica 0's steps draw from the rows the other replicas cached.
        std::atomic<u64> r2{0};
        auto q = pipeline(data, r2, replicas, {.seed = 9, .across_replicas = true}, pol);
        std::size_t steps = 0;
        const epoch_rows first = epoch_of(q, steps);
        const epoch_rows later = epoch_of(q, steps);
        const auto mine = sorted(first[0]);
        std::size_t foreign = 0;
        for (u64 id : later[0]) foreign += !std::binary_search(mine.begin(), mine.end(), id);
        CHECK(foreign > later[0].size() / 4);
      }
      by_replicas.push_back(std::move(epochs));
    }
    for (std::size_t i = 1; i < by_replicas.size(); ++i) CHECK(by_replicas[i] == by_replicas[0]);
  }
  // Another seed, another order; without shuffle, a config_error when built.
  std::atomic<u64> reads{0};
  const auto data = ids(240);
  auto a = pipeline(data, reads, 2, {.seed = 9, .across_replicas = true});
  auto b = pipeline(data, reads, 2, {.seed = 10, .across_replicas = true});
  (void)global_steps(a), (void)global_steps(b);
  CHECK(global_steps(a) != global_steps(b));
  CHECK_THROWS_WITH_AS(pipeline(data, reads, 2, {.shuffle = false, .across_replicas = true}),
                       doctest::Contains("across_replicas reorders rows across replicas each epoch; it needs shuffle"),
                       ferry::config_error);
}

TEST_CASE("cache_on_device across_replicas: the budget counts the rows only (the layout is kept per step)") {
  const auto data = ids(240);
  std::atomic<u64> reads{0};
  // 120 rows a replica of 24 bytes, twice: 5760 bytes, as without across_replicas.
  auto tight = pipeline(data, reads, 2, {.budget_bytes = 5759, .seed = 1, .across_replicas = true});
  CHECK_THROWS_WITH_AS(
      [&] {
        for (auto& st : tight) (void)st;
      }(),
      doctest::Contains("its cache reaches 5760 bytes (120 rows of 24 bytes, twice"), ferry::config_error);
  auto ok = pipeline(data, reads, 2, {.budget_bytes = 5760, .seed = 1, .across_replicas = true});
  std::size_t steps = 0;
  (void)epoch_of(ok, steps);
  CHECK(ok.cached());
  CHECK(ok.bytes_per_replica() == 5760);
}

TEST_CASE("cache_exchange: a row's global index and a global index's owner invert each other (random layouts)") {
  // Against a naive table built row by row, with steps and replicas of zero rows.
  ferry::detail::splitmix64 g(11);
  for (int round = 0; round < 200; ++round) {
    const std::size_t R = 1 + g.below(5), S = 1 + g.below(12);
    ferry::detail::cache_exchange ex;
    std::vector<std::vector<u64>> naive(R);  // per replica, its rows' global indices
    u64 next = 0;
    for (std::size_t k = 0; k < S; ++k) {
      std::vector<u64> valid(R);
      for (auto& v : valid) v = g.below(4) == 0 ? 0 : g.below(7);
      ex.add_step(R, [&](std::size_t r) { return valid[r]; });
      for (std::size_t r = 0; r < R; ++r)
        for (u64 i = 0; i < valid[r]; ++i) naive[r].push_back(next++);
    }
    ex.finish();
    REQUIRE(ex.rows() == next);
    const auto l = ex.view();
    for (std::size_t r = 0; r < R; ++r)
      for (u64 j = 0; j < naive[r].size(); ++j) {
        REQUIRE(l.global(r, j) == naive[r][j]);
        u64 q = 0, i = 0;
        l.owner(naive[r][j], q, i);
        REQUIRE(q == r);
        REQUIRE(i == j);
      }
  }
}

TEST_CASE("cache_on_device resume: a saved epoch and step continue the same global batches at other replica counts") {
  using policy = ferry::remainder_policy;
  for (auto [n, pol] : {std::pair{u64(240), policy::drop}, std::pair{u64(250), policy::pad},
                        std::pair{u64(247), policy::partial}}) {
    CAPTURE(n);
    CAPTURE(int(pol));
    const auto data = ids(n);
    std::atomic<u64> reads{0};
    auto whole = pipeline(data, reads, 2, {.seed = 4, .across_replicas = true}, pol);
    std::vector<std::vector<std::vector<u64>>> epochs;  // [epoch][step] -> ids: the oracle
    for (int e = 0; e <= 3; ++e) epochs.push_back(global_steps(whole));
    const u64 steps = epochs[0].size();
    for (std::size_t replicas : {std::size_t(1), std::size_t(3), std::size_t(4)})
      for (auto [e, k] : {std::pair{u64(1), u64(0)}, std::pair{u64(2), u64(7)}, std::pair{u64(3), steps}}) {
        CAPTURE(replicas);
        CAPTURE(e);
        CAPTURE(k);
        std::atomic<u64> r2{0};
        auto p = pipeline(data, r2, replicas,
                          {.seed = 4, .across_replicas = true, .resume = ferry::global_position{e, k, n, 12}}, pol);
        const auto rest = global_steps(p);  // epoch e from step k
        CHECK(r2 == n);                     // epoch 0 read once, to fill, and not served
        REQUIRE(rest.size() == steps - k);
        for (std::size_t i = 0; i < rest.size(); ++i) CHECK(rest[i] == epochs[e][k + i]);
        if (e < 3) CHECK(global_steps(p) == epochs[e + 1]);  // and the next epoch as the whole run's
        CHECK(r2 == n);
        // A rewind before the first next() goes on to the next epoch, from its start, as the
        // whole run's rewind at that point does (it served epoch e again from step k).
        if (e < 3) {
          std::atomic<u64> r3{0};
          auto q = pipeline(data, r3, replicas,
                            {.seed = 4, .across_replicas = true, .resume = ferry::global_position{e, k, n, 12}}, pol);
          q.rewind();
          CHECK(global_steps(q) == epochs[e + 1]);
        }
      }
  }
  // Bad positions and options: each a config_error naming what is wrong.
  std::atomic<u64> reads{0};
  const auto data = ids(240);
  const auto at = [](u64 e, u64 k, u64 g) { return ferry::global_position{e, k, 240, g}; };
  CHECK_THROWS_WITH_AS(pipeline(data, reads, 2, {.seed = 4, .resume = at(1, 0, 12)}),
                       doctest::Contains("need across_replicas"), ferry::config_error);
  auto past0 = pipeline(data, reads, 2, {.seed = 4, .across_replicas = true, .resume = at(0, 21, 12)});
  CHECK_THROWS_WITH_AS(past0.next(), doctest::Contains("resume at epoch 0, step 21: past the epoch's 20 steps"),
                       ferry::config_error);
  auto past = pipeline(data, reads, 2, {.seed = 4, .across_replicas = true, .resume = at(1, 21, 12)});
  CHECK_THROWS_WITH_AS(past.next(), doctest::Contains("past the epoch's 20 steps"), ferry::config_error);
  auto other_g = pipeline(data, reads, 2, {.seed = 4, .across_replicas = true, .resume = at(1, 3, 24)});
  CHECK_THROWS_WITH_AS(other_g.next(), doctest::Contains("saved with global steps of 24 rows, epoch 0's have 12"),
                       ferry::config_error);
  // A position saved over another seed's order (its fingerprint, order()): refused at once;
  // the same seed's fingerprint resumes, and 0 is not checked.
  {
    auto seed4 = pipeline(data, reads, 1, {.seed = 4, .across_replicas = true});
    auto seed5 = pipeline(data, reads, 1, {.seed = 5, .across_replicas = true});
    REQUIRE(seed4.order() != seed5.order());
    REQUIRE(seed4.order() != 0);
    CHECK_THROWS_WITH_AS(pipeline(data, reads, 2,
                                  {.seed = 4, .across_replicas = true,
                                   .resume = ferry::global_position{1, 3, 240, 12, seed5.order()}}),
                         doctest::Contains("cache_on_device: the resume position was saved over another order"),
                         ferry::config_error);
    auto same = pipeline(data, reads, 2,
                         {.seed = 4, .across_replicas = true, .resume = ferry::global_position{1, 3, 240, 12, seed4.order()}});
    auto unchecked = pipeline(data, reads, 2, {.seed = 4, .across_replicas = true, .resume = at(1, 3, 12)});
    CHECK(global_steps(same) == global_steps(unchecked));
  }
  auto other_n = pipeline(data, reads, 2,
                          {.seed = 4, .across_replicas = true, .resume = ferry::global_position{1, 3, 500, 12}});
  CHECK_THROWS_WITH_AS(other_n.next(), doctest::Contains("saved over 500 rows, but epoch 0 has 20 steps of 12"),
                       ferry::config_error);
  // A resume that failed fails the next call again: epoch 0 is never served.
  CHECK_THROWS_AS(other_n.next(), ferry::config_error);
  auto over = pipeline(data, reads, 2,
                       {.budget_bytes = 1000, .when_over = ferry::over_budget::stream, .seed = 4, .across_replicas = true,
                        .resume = at(1, 3, 12)});
  CHECK_THROWS_WITH_AS(over.next(), doctest::Contains("the cache was not filled"), ferry::config_error);
}

TEST_CASE("cache_on_device: over budget under ::error, the step that failed is the next next()'s: no row lost") {
  const auto data = ids(240);
  std::atomic<u64> reads{0};
  auto p = pipeline(data, reads, 2, {.budget_bytes = 5000, .seed = 1});  // the 18th step does not fit
  std::vector<u64> seen;
  std::size_t steps = 0, errors = 0;
  for (;;) {
    try {
      auto st = p.next();
      if (!st) break;
      ++steps;
      for (std::size_t r = 0; r < st->replicas(); ++r)
        for (std::size_t i = 0; i < (*st)[r].valid(); ++i) seen.push_back((*st)[r].field<0>()[i]);
    } catch (const ferry::config_error& e) {
      ++errors;
      CHECK(std::string(e.what()).find("needs more than its budget") != std::string::npos);
    }
  }
  CHECK(errors == 1);
  CHECK(steps == 20);  // every rank would have the others' step count
  CHECK(sorted(seen) == data);
  CHECK(!p.cached());
  CHECK(p.bytes_per_replica() == 0);
  p.rewind();
  std::size_t s1 = 0;
  const epoch_rows e1 = epoch_of(p, s1);  // streamed
  CHECK(s1 == 20);
  CHECK(e1[0].size() + e1[1].size() == 240);
  // A rewind right after the error drops the held step: the next epoch starts whole.
  auto q = pipeline(data, reads, 2, {.budget_bytes = 5000, .seed = 1});
  CHECK_THROWS_AS([&] { while (q.next()) {} }(), ferry::config_error);
  q.rewind();
  const epoch_rows q1 = epoch_of(q, s1);
  CHECK(s1 == 20);
  CHECK(q1[0].size() + q1[1].size() == 240);
}

TEST_CASE("cache_on_device: under pad the budget counts the padding rows the steps serve") {
  // 100 rows, 2 replicas, steps of 12: 9 steps of 6 rows a replica, the last one padded (4
  // real rows on replica 0, none on 1): replica 0 caches 52 rows and serves 54.
  const auto data = ids(100);
  std::atomic<u64> reads{0};
  for (bool shuffle : {true, false}) {
    CAPTURE(shuffle);
    const std::size_t need = shuffle ? (52 + 54) * 24 : 54 * 24;  // the cache (its rows), the served copy (54)
    auto ok = pipeline(data, reads, 2, {.budget_bytes = need, .seed = 1, .shuffle = shuffle}, ferry::remainder_policy::pad);
    std::size_t steps = 0;
    (void)epoch_of(ok, steps);
    CHECK(ok.cached());
    CHECK(ok.bytes_per_replica() == need);
    const epoch_rows e1 = epoch_of(ok, steps);
    CHECK(steps == 9);
    CHECK(e1[0].size() + e1[1].size() == 100);
    auto tight = pipeline(data, reads, 2, {.budget_bytes = need - 1, .seed = 1, .shuffle = shuffle},
                          ferry::remainder_policy::pad);
    std::size_t got = 0;
    const std::string said = "reaches " + std::to_string(need) + " bytes (52 rows of 24 bytes";
    CHECK_THROWS_WITH_AS(
        [&] {
          while (tight.next()) ++got;
        }(),
        doctest::Contains(said.c_str()), ferry::config_error);
    CHECK(got == 8);  // the padded last step is the one that passes it
    CHECK(tight.next());  // and it is not lost
    CHECK(!tight.next());
    tight.rewind();
    CHECK(!tight.cached());
    auto streaming = pipeline(
        data, reads, 2, {.budget_bytes = need - 1, .when_over = ferry::over_budget::stream, .seed = 1, .shuffle = shuffle},
        ferry::remainder_policy::pad);
    for (auto& st : streaming) {
      (void)st;
      CHECK(streaming.bytes_per_replica() < need);
    }
    streaming.rewind();
    CHECK(!streaming.cached());
    CHECK(streaming.bytes_per_replica() == 0);
  }
}

TEST_CASE("cache_on_device resume: a dataset smaller than one global batch, and the dataset size checked exactly") {
  using policy = ferry::remainder_policy;
  // n < G: one short step (partial, pad), resumable; none under drop, said plainly.
  for (auto pol : {policy::partial, policy::pad}) {
    CAPTURE(int(pol));
    const auto data = ids(10);
    std::atomic<u64> reads{0};
    auto whole = pipeline(data, reads, 2, {.seed = 4, .across_replicas = true}, pol);
    (void)global_steps(whole);
    const auto e1 = global_steps(whole);
    REQUIRE(e1.size() == 1);
    for (std::size_t replicas : {std::size_t(1), std::size_t(3)}) {
      CAPTURE(replicas);
      auto p = pipeline(data, reads, replicas,
                        {.seed = 4, .across_replicas = true, .resume = ferry::global_position{1, 0, 10, 12}}, pol);
      CHECK(global_steps(p) == e1);
      auto other = pipeline(data, reads, replicas,
                            {.seed = 4, .across_replicas = true, .resume = ferry::global_position{1, 0, 11, 12}}, pol);
      CHECK_THROWS_WITH_AS(other.next(), doctest::Contains("saved over 11 rows"), ferry::config_error);
    }
  }
  std::atomic<u64> reads{0};
  const auto small = ids(10);
  auto none =
      pipeline(small, reads, 2, {.seed = 4, .across_replicas = true, .resume = ferry::global_position{1, 0, 10, 12}});
  CHECK_THROWS_WITH_AS(none.next(), doctest::Contains("epoch 0 had no steps (fewer rows than one global batch"),
                       ferry::config_error);
  // Partial, pad: every row cached, so the saved size must be the rows cached (21 steps
  // over 245 rows or over 250 alike).
  const auto data = ids(245);
  for (auto pol : {policy::partial, policy::pad}) {
    CAPTURE(int(pol));
    for (u64 saved : {u64(250), u64(241)}) {
      auto p = pipeline(data, reads, 2,
                        {.seed = 4, .across_replicas = true, .resume = ferry::global_position{1, 3, saved, 12}}, pol);
      const std::string said = "saved over " + std::to_string(saved) + " rows, but epoch 0 has 21 steps of 12, 245 rows cached";
      CHECK_THROWS_WITH_AS(p.next(), doctest::Contains(said.c_str()), ferry::config_error);
    }
    auto ok = pipeline(data, reads, 2,
                       {.seed = 4, .across_replicas = true, .resume = ferry::global_position{1, 3, 245, 12}}, pol);
    CHECK(global_steps(ok).size() == 18);
  }
  // Drop: 240 cached rows are a dataset of 240 to 251 (the same 20 steps): 252 is refused.
  auto drop =
      pipeline(data, reads, 2, {.seed = 4, .across_replicas = true, .resume = ferry::global_position{1, 3, 252, 12}});
  CHECK_THROWS_WITH_AS(drop.next(), doctest::Contains("a dataset of 240 to 251"), ferry::config_error);
  auto drop_ok =
      pipeline(data, reads, 2, {.seed = 4, .across_replicas = true, .resume = ferry::global_position{1, 3, 251, 12}});
  CHECK(global_steps(drop_ok).size() == 17);
}

namespace {

// `epochs` epochs of an uninterrupted job at `replicas` replicas, as global steps.
std::vector<std::vector<std::vector<u64>>> whole_run(const std::vector<u64>& data, std::size_t replicas,
                                                     ferry::remainder_policy pol, int epochs,
                                                     ferry::cache_on_device_options o) {
  std::atomic<u64> reads{0};
  auto p = pipeline(data, reads, replicas, o, pol);
  std::vector<std::vector<std::vector<u64>>> out;
  for (int e = 0; e < epochs; ++e) out.push_back(global_steps(p));
  return out;
}

// Step `want[0][k..]` of epoch 0, then epochs 1 to want.size() - 1 as want's, from a job
// resumed at epoch 0, step k (its next() calls that throw counted in errors).
template <class P>
void check_resumed(P& p, const std::vector<std::vector<std::vector<u64>>>& want, u64 k, std::size_t& errors) {
  std::vector<std::vector<u64>> rest;
  for (;;) {
    try {
      auto st = p.next();
      if (!st) break;
      rest.emplace_back();
      for (std::size_t r = 0; r < st->replicas(); ++r)
        for (std::size_t i = 0; i < (*st)[r].valid(); ++i) rest.back().push_back((*st)[r].template field<0>()[i]);
    } catch (const ferry::config_error& e) {
      ++errors;
      CHECK(std::string(e.what()).find("needs more than its budget") != std::string::npos);
      REQUIRE(errors < 3);
    }
  }
  p.rewind();
  REQUIRE(rest.size() + k == want[0].size());
  for (std::size_t i = 0; i < rest.size(); ++i) CHECK(rest[i] == want[0][k + i]);
  for (std::size_t e = 1; e < want.size(); ++e) {
    CAPTURE(e);
    CHECK(global_steps(p) == want[e]);
  }
}

}  // namespace

TEST_CASE("cache_on_device resume in epoch 0: saved after k steps at R replicas, resumed at R', the whole job's "
          "global batches in epochs 0, 1 and 2") {
  using policy = ferry::remainder_policy;
  for (auto [n, pol] : {std::pair{u64(240), policy::drop}, std::pair{u64(247), policy::drop},
                        std::pair{u64(250), policy::partial}, std::pair{u64(250), policy::pad},
                        std::pair{u64(245), policy::pad}}) {
    CAPTURE(n);
    CAPTURE(int(pol));
    const auto data = ids(n);
    const ferry::cache_on_device_options o{.seed = 4, .across_replicas = true};
    for (auto [R, R2] : {std::pair{std::size_t(2), std::size_t(3)}, std::pair{std::size_t(4), std::size_t(1)},
                         std::pair{std::size_t(1), std::size_t(2)}, std::pair{std::size_t(3), std::size_t(4)}}) {
      CAPTURE(R);
      CAPTURE(R2);
      const auto want = whole_run(data, R, pol, 3, o);  // the uninterrupted job at R
      const u64 steps = want[0].size();
      for (u64 k : {u64(0), u64(1), u64(7), steps - 1, steps}) {
        CAPTURE(k);
        // The saved job: k global steps at R replicas, its position then.
        std::atomic<u64> reads{0};
        auto saved = pipeline(data, reads, R, o, pol);
        for (u64 s = 0; s < k; ++s) {
          std::vector<u64> got;
          auto st = saved.next();
          REQUIRE(st);
          for (std::size_t r = 0; r < st->replicas(); ++r)
            for (std::size_t i = 0; i < (*st)[r].valid(); ++i) got.push_back((*st)[r].field<0>()[i]);
          CHECK(got == want[0][s]);
        }
        const ferry::global_position at{0, k, n, 12};
        // The resumed job at R': the rest, the same global batches.
        std::atomic<u64> r2{0};
        auto p = pipeline(data, r2, R2, {.seed = 4, .across_replicas = true, .resume = at}, pol);
        std::size_t errors = 0;
        check_resumed(p, want, k, errors);
        CHECK(errors == 0);
        CHECK(r2 == n);  // epoch 0 read once (its first k steps cached, not served), the upstream not again
        CHECK(p.cached());
      }
    }
  }
}

TEST_CASE("cache_on_device resume in epoch 0: over budget while skipping or after, no row of the steps handed out lost "
          "or repeated") {
  // 240 rows, 2 replicas, 20 steps: a budget of 5000 bytes fits 17 steps, the 18th (step
  // 17) passes it.
  const auto data = ids(240);
  const auto want = whole_run(data, 2, ferry::remainder_policy::drop, 1, {.seed = 1, .across_replicas = true});
  for (u64 k : {u64(3), u64(17), u64(18), u64(20)}) {
    CAPTURE(k);
    const ferry::global_position at{0, k, 240, 12};
    // ::error: one config_error, at the step over the budget; a skipped one is not handed
    // out (the next next() goes on), one to hand out is the next next()'s. Then streams.
    std::atomic<u64> reads{0};
    auto p = pipeline(data, reads, 2, {.budget_bytes = 5000, .seed = 1, .across_replicas = true, .resume = at});
    std::size_t errors = 0;
    check_resumed(p, want, k, errors);
    CHECK(errors == 1);
    CHECK(!p.cached());
    CHECK(p.bytes_per_replica() == 0);
    // ::stream: no error, the steps handed out alike; the cache given up.
    auto q = pipeline(data, reads, 2,
                      {.budget_bytes = 5000, .when_over = ferry::over_budget::stream, .seed = 1, .across_replicas = true,
                       .resume = at});
    errors = 0;
    check_resumed(q, want, k, errors);
    CHECK(errors == 0);
    CHECK(!q.cached());
    // Streamed, the next epoch is the upstream's again (every row once).
    std::size_t s = 0;
    const epoch_rows e1 = epoch_of(q, s);
    CHECK(sorted(flat(e1)) == sorted(flat(want[0])));
  }
}

TEST_CASE("cache_on_device resume in epoch 0: a step past the epoch, another global batch or dataset size, config_errors") {
  const auto data = ids(240);
  std::atomic<u64> reads{0};
  const auto opts = [](ferry::global_position at) {
    return ferry::cache_on_device_options{.seed = 4, .across_replicas = true, .resume = at};
  };
  // Past epoch 0's 20 steps: at the first next() (the upstream ends first), and again.
  auto past = pipeline(data, reads, 2, opts({0, 21, 240, 12}));
  CHECK_THROWS_WITH_AS(past.next(), doctest::Contains("resume at epoch 0, step 21: past the epoch's 20 steps"),
                       ferry::config_error);
  CHECK_THROWS_AS(past.next(), ferry::config_error);
  auto past_pad = pipeline(ids(250), reads, 3, opts({0, 23, 250, 12}), ferry::remainder_policy::pad);
  CHECK_THROWS_WITH_AS(past_pad.next(), doctest::Contains("past the epoch's 21 steps"), ferry::config_error);
  // The last step is no error: an empty rest of epoch 0, then epoch 1.
  auto last = pipeline(data, reads, 2, opts({0, 20, 240, 12}));
  CHECK(!last.next());
  last.rewind();
  CHECK(last.cached());
  // G and the dataset size: at the end of epoch 0 (the first rewind), where the cache serves.
  auto other_g = pipeline(data, reads, 2, opts({0, 3, 240, 24}));
  std::size_t steps = 0;
  while (other_g.next()) ++steps;
  CHECK(steps == 17);
  CHECK_THROWS_WITH_AS(other_g.rewind(), doctest::Contains("saved with global steps of 24 rows, epoch 0's have 12"),
                       ferry::config_error);
  auto other_n = pipeline(data, reads, 2, opts({0, 3, 500, 12}));
  while (other_n.next()) {
  }
  CHECK_THROWS_WITH_AS(other_n.rewind(), doctest::Contains("saved over 500 rows, but epoch 0 has 20 steps of 12"),
                       ferry::config_error);
  auto other_pad = pipeline(ids(245), reads, 2, opts({0, 3, 250, 12}), ferry::remainder_policy::pad);
  while (other_pad.next()) {
  }
  CHECK_THROWS_WITH_AS(other_pad.rewind(), doctest::Contains("saved over 250 rows"), ferry::config_error);
  // Without across_replicas, as for a later epoch.
  CHECK_THROWS_WITH_AS(pipeline(data, reads, 2, {.seed = 4, .resume = ferry::global_position{0, 3, 240, 12}}),
                       doctest::Contains("need across_replicas"), ferry::config_error);
}
