// distribute() with host replicas: the splitting, the remainder policies, memory reuse and
// shutdown, checked on the CPU against a naive oracle (the upstream order, cut by hand).
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/doubles.hpp"
#include "cuda/elements.hpp"
#include "ferry/memory/pinned.hpp"
#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/filter.hpp"
#include "ferry/stages/interleave.hpp"
#include "ferry/stages/map.hpp"
#include "ferry/stages/prefetch.hpp"
#include "ferry/stages/repeat.hpp"
#include "ferry/stages/shard.hpp"
#include "ferry/stages/shuffle.hpp"
#include "ferry/stages/take.hpp"

using namespace std::chrono_literals;

namespace {

// batch(10) | distribute over two host replicas: 10 steps of 100 rows.
auto host_steps(const std::vector<elem>& data) {
  return ferry::from_range(data) | ferry::batch(10) | ferry::distribute(ferry::host_replicas{2});
}

std::string name(ferry::remainder_policy p) {
  switch (p) {
    case ferry::remainder_policy::drop: return "drop";
    case ferry::remainder_policy::pad: return "pad";
    default: return "partial";
  }
}

// Checks every step of `steps` against the oracle: the data cut into G-row batches,
// each split as the documented policy says. Returns the number of steps seen.
template <class P>
std::size_t check_epoch(P& steps, const std::vector<elem>& data, std::size_t R, std::size_t per,
                        ferry::remainder_policy pol) {
  const std::size_t G = R * per, n = data.size();
  std::size_t pos = 0, nsteps = 0;
  std::vector<std::size_t> seen(n, 0);
  for (auto& st : steps) {
    REQUIRE(st.replicas() == R);
    CHECK(st.index() == nsteps);
    const std::size_t m = std::min(G, n - pos);  // rows of this global batch
    REQUIRE(m > 0);
    if (pol == ferry::remainder_policy::drop) REQUIRE(m == G);
    std::size_t cursor = pos;
    for (std::size_t r = 0; r < R; ++r) {
      auto& rb = st[r];
      CHECK(rb.device() == -1);
      CHECK(rb.stream() == nullptr);
      std::size_t expect_rows = per, expect_valid = per;
      if (m < G && pol == ferry::remainder_policy::pad) {
        expect_valid = std::min(per, m > r * per ? m - r * per : 0);
      } else if (m < G) {  // partial
        expect_rows = expect_valid = m / R + (r < m % R ? 1 : 0);
      }
      REQUIRE(rb.size() == expect_rows);
      REQUIRE(rb.valid() == expect_valid);
      auto ids = rb.template field<0>();
      auto xs = rb.template field<1>();
      REQUIRE(ids.size() == rb.size());
      for (std::size_t i = 0; i < rb.valid(); ++i) {
        REQUIRE(cursor < n);
        CHECK(ids[i] == std::get<0>(data[cursor]));
        CHECK(xs[i] == std::get<1>(data[cursor]));
        ++seen[cursor++];
      }
      for (std::size_t i = rb.valid(); i < rb.size(); ++i) {  // padding is zeros
        CHECK(ids[i] == 0u);
        CHECK(xs[i] == std::array<float, 3>{0, 0, 0});
      }
    }
    CHECK(cursor == pos + m);
    CHECK(st.valid() == m);
    pos += m;
    ++nsteps;
  }
  // Exactly once each: all elements, or all of the full batches under drop.
  const std::size_t covered = pol == ferry::remainder_policy::drop ? n / G * G : n;
  for (std::size_t i = 0; i < n; ++i) CHECK(seen[i] == (i < covered ? 1u : 0u));
  return nsteps;
}

// Batches of the given sizes with no batch_size(): a pipeline that hides batch(), so
// distribute has to infer G from the first batch.
struct sized_batches {
  using value_type = ferry::batch_of<elem>;
  std::vector<std::size_t> sizes;
  std::size_t i = 0;
  std::uint32_t next_id = 0;
  std::optional<value_type> next() {
    if (i == sizes.size()) return std::nullopt;
    ferry::batch_collator<elem> c;
    auto b = c.start(std::make_shared<ferry::buffer_pool>(), sizes[i]);
    for (std::size_t k = 0; k < sizes[i]; ++k) {
      elem e{++next_id, {0, 0, 0}};
      c.put(b, e);
    }
    ++i;
    return b;
  }
};

}  // namespace

// The oracle sweep: every element reaches exactly one replica, in order, with the step
// count each remainder policy promises. `wrap` puts stages between batch() and
// distribute(); with short_first, half the trials are smaller than one global batch (a
// short FIRST batch): G must come from batch() through them, never from that batch.
template <class Wrap>
void sweep_through(Wrap wrap, std::uint32_t seed, int trials = 40, bool short_first = true) {
  std::mt19937 rng(seed);
  for (auto pol : {ferry::remainder_policy::drop, ferry::remainder_policy::pad,
                   ferry::remainder_policy::partial}) {
    for (int trial = 0; trial < trials; ++trial) {
      const std::size_t R = 1 + rng() % 5, per = 1 + rng() % 6, G = R * per;
      const auto data = make_data(short_first && trial % 2 ? rng() % G : rng() % (4 * G + 3));
      CAPTURE(name(pol));
      CAPTURE(R);
      CAPTURE(per);
      CAPTURE(data.size());
      auto steps = wrap(ferry::from_range(data) | ferry::batch(G)) |
                   ferry::distribute(ferry::host_replicas{R}, {.remainder = pol});
      const std::size_t n = data.size();
      const std::size_t expect =
          pol == ferry::remainder_policy::drop ? n / G : (n + G - 1) / G;
      CHECK(check_epoch(steps, data, R, per, pol) == expect);
      CHECK(steps.global_batch() == G);
      CHECK(steps.dropped() == (pol == ferry::remainder_policy::drop && n % G ? 1u : 0u));
    }
  }
}

TEST_CASE("distribute(host_replicas): every element reaches exactly one replica, in order, "
          "for every remainder policy (sweep against the oracle)") {
  sweep_through([](auto&& s) { return std::move(s); }, 20240611, 60, false);
}

TEST_CASE("distribute: the oracle sweep holds through prefetch, take, repeat, filter and "
          "shard, with datasets smaller than one global batch" * doctest::timeout(60)) {
  ferry_test::watchdog wd(90s, "pass-through sweep");
  SUBCASE("prefetch") {
    sweep_through([](auto&& s) { return std::move(s) | ferry::prefetch(2); }, 1);
  }
  SUBCASE("take") {
    sweep_through([](auto&& s) { return std::move(s) | ferry::take(1000); }, 2);
  }
  SUBCASE("repeat(1)") {
    sweep_through([](auto&& s) { return std::move(s) | ferry::repeat(1); }, 3);
  }
  SUBCASE("filter") {
    sweep_through([](auto&& s) { return std::move(s) | ferry::filter([](const auto&) { return true; }); }, 4);
  }
  SUBCASE("shard(1, 0)") {
    sweep_through([](auto&& s) { return std::move(s) | ferry::shard(1, 0); }, 5);
  }
  SUBCASE("take | repeat(1) | prefetch") {
    sweep_through([](auto&& s) {
      return std::move(s) | ferry::take(1000) | ferry::repeat(1) | ferry::prefetch(2);
    }, 6);
  }
}

TEST_CASE("distribute: batch(8) | prefetch(2) with a dataset shorter than one batch follows "
          "the policy (the audit's reproduction)" * doctest::timeout(20)) {
  ferry_test::watchdog wd(30s, "short dataset through prefetch");
  for (std::uint32_t rows : {4u, 5u, 6u}) {
    CAPTURE(rows);
    const auto data = make_data(std::uint32_t(rows));
    {
      auto steps = ferry::from_range(data) | ferry::batch(8) | ferry::prefetch(2) |
                   ferry::distribute(ferry::host_replicas{4});
      CHECK_FALSE(steps.next());  // drop: the only batch is short
      CHECK(steps.dropped() == 1);
      CHECK(steps.global_batch() == 8);
    }
    {
      auto steps = ferry::from_range(data) | ferry::batch(8) | ferry::prefetch(2) |
                   ferry::distribute(ferry::host_replicas{4}, {.remainder = ferry::remainder_policy::pad});
      auto st = steps.next();
      REQUIRE(st);
      for (std::size_t r = 0; r < 4; ++r) CHECK((*st)[r].size() == 2);
      CHECK(st->valid() == rows);
      CHECK_FALSE(steps.next());
    }
  }
  // Played three times: each epoch's only batch is short, each is dropped / padded.
  const auto data = make_data(4);
  auto steps = ferry::from_range(data) | ferry::batch(8) | ferry::repeat(3) | ferry::prefetch(2) |
               ferry::distribute(ferry::host_replicas{4}, {.remainder = ferry::remainder_policy::pad});
  std::size_t n = 0;
  for (auto& st : steps) {
    CHECK(st.global_size() == 8);
    CHECK(st.valid() == 4);
    ++n;
  }
  CHECK(n == 3);
}

TEST_CASE("distribute(host_replicas): slices are zero-copy views of the host batch") {
  auto data = make_data(64);
  auto steps = ferry::from_range(data) | ferry::batch(16) | ferry::distribute(ferry::host_replicas{4});
  for (auto& st : steps) {
    const auto& hb = st.host_batch();
    for (std::size_t r = 0; r < 4; ++r) {
      CHECK(st[r].field<0>().data() == hb.field<0>().data() + 4 * r);
      CHECK(st[r].field<1>().data() == hb.field<1>().data() + 4 * r);
      CHECK(st[r].field_bytes(1).size() == 4 * sizeof(std::array<float, 3>));
    }
  }
}

TEST_CASE("distribute: batch() collates into the memory distribute hands up, through prefetch" *
          doctest::timeout(20)) {
  ferry_test::watchdog wd(30s, "hook test");
  auto pool = ferry::make_pinned_pool();
  auto data = make_data(100);
  auto steps = ferry::from_range(data) | ferry::batch(20) | ferry::prefetch(2) |
               ferry::distribute(ferry::host_replicas{2}, {.host_resource = pool});
  std::size_t rows = 0;
  for (auto& st : steps) {
    CHECK(st.host_batch().field_buffer(0).resource() == pool);
    CHECK(st.host_batch().field_buffer(1).resource() == pool);
    rows += st.valid();
  }
  CHECK(rows == 100);
  CHECK(steps.collates_into_distribute_memory());
  CHECK(steps.global_batch() == 20);  // batch()'s size, seen through prefetch
}

TEST_CASE("distribute: the default host resource is used through the same hook") {
  auto data = make_data(40);
  auto steps = ferry::from_range(data) | ferry::batch(8) | ferry::distribute(ferry::host_replicas{2});
  auto st = steps.next();
  REQUIRE(st);
  CHECK(steps.collates_into_distribute_memory());
  REQUIRE(steps.host_resource() != nullptr);
  CHECK(st->host_batch().field_buffer(0).resource() == steps.host_resource());
}

TEST_CASE("distribute: the pool stops allocating after warm-up, for every policy") {
  // Single-threaded, so the number of batches alive at once is exact: allocation must
  // stop after the first epoch.
  for (auto pol : {ferry::remainder_policy::drop, ferry::remainder_policy::pad,
                   ferry::remainder_policy::partial}) {
    CAPTURE(name(pol));
    auto pool = ferry::make_pinned_pool();
    auto data = make_data(1003);  // a short last batch every epoch
    {
      auto steps = ferry::from_range(data) | ferry::batch(32) |
                   ferry::distribute(ferry::host_replicas{4}, {.remainder = pol, .host_resource = pool});
      std::uint64_t after_warmup = 0;
      for (int epoch = 0; epoch < 5; ++epoch) {
        std::size_t n = 0;
        for (auto& st : steps) n += st.valid();
        CHECK(n == (pol == ferry::remainder_policy::drop ? 992u : 1003u));
        if (epoch == 0) after_warmup = pool->statistics().upstream_allocations;
        steps.rewind();
      }
      // Two fields, and two batches alive at once (range-for builds the next step
      // before dropping the last), plus the padded copy.
      CHECK(after_warmup >= 2);
      CHECK(after_warmup <= 2 * 3);
      CHECK(pool->statistics().upstream_allocations == after_warmup);
      CHECK(pool->statistics().reuses > 100);
    }
    CHECK(pool->statistics().outstanding_bytes == 0);
  }
}

TEST_CASE("distribute: with prefetch, the pool stays bounded by the batches in flight" *
          doctest::timeout(30)) {
  ferry_test::watchdog wd(60s, "pool bound test");
  for (auto pol : {ferry::remainder_policy::drop, ferry::remainder_policy::pad,
                   ferry::remainder_policy::partial}) {
    CAPTURE(name(pol));
    auto pool = ferry::make_pinned_pool();
    auto data = make_data(1003);
    {
      auto steps = ferry::from_range(data) | ferry::batch(32) | ferry::prefetch(3) |
                   ferry::distribute(ferry::host_replicas{4}, {.remainder = pol, .host_resource = pool});
      for (int epoch = 0; epoch < 5; ++epoch) {
        std::size_t n = 0;
        for (auto& st : steps) n += st.valid();
        CHECK(n == (pol == ferry::remainder_policy::drop ? 992u : 1003u));
        steps.rewind();
      }
      // Batches alive at once: prefetch's depth + 2 (its documented bound), one more held
      // by the step being replaced, and the padded copy; two fields each. 5 epochs x 32
      // batches would be 320 allocations without the pool.
      CHECK(pool->statistics().upstream_allocations <= 2 * (3 + 2 + 1 + 1));
      CHECK(pool->statistics().reuses >= 300);
    }
    CHECK(pool->statistics().outstanding_bytes == 0);
  }
}

TEST_CASE("distribute: a consumer abandoning mid-epoch frees everything" * doctest::timeout(20)) {
  ferry_test::watchdog wd(30s, "abandon test");
  auto pool = ferry::make_pinned_pool();
  auto data = make_data(5000);
  std::optional<ferry::step<elem>> kept;
  {
    auto steps = ferry::from_range(data) | ferry::batch(40) | ferry::prefetch(4) |
                 ferry::distribute(ferry::host_replicas{4}, {.host_resource = pool});
    int k = 0;
    for (auto& st : steps) {
      if (++k == 7) {
        kept = std::move(st);  // a step may outlive its pipeline
        break;
      }
    }
    CHECK(pool->statistics().outstanding_bytes > 0);
  }  // pipeline destroyed with prefetch's queue full
  REQUIRE(kept);
  CHECK((*kept)[3].field<0>()[9] == std::get<0>(data[6 * 40 + 3 * 10 + 9]));  // still readable
  CHECK(pool->statistics().outstanding_bytes == kept->host_batch().payload_bytes());
  kept.reset();
  CHECK(pool->statistics().outstanding_bytes == 0);
}

TEST_CASE("distribute: configuration errors say what to do" * doctest::timeout(30)) {
  ferry_test::watchdog wd(30s, "configuration errors test");  // one subcase runs prefetch's thread
  auto data = make_data(100);
  SUBCASE("global batch not divisible by the replicas") {
    auto steps = ferry::from_range(data) | ferry::batch(10) | ferry::distribute(ferry::host_replicas{4});
    CHECK_THROWS_AS(steps.next(), ferry::config_error);
  }
  SUBCASE("batch size not divisible, seen through prefetch") {
    auto steps = ferry::from_range(data) | ferry::batch(10) | ferry::prefetch(1) |
                 ferry::distribute(ferry::host_replicas{3});
    CHECK_THROWS_WITH_AS(steps.next(), doctest::Contains("multiple of 3"), ferry::config_error);
  }
  SUBCASE("explicit global batch not divisible") {
    CHECK_THROWS_AS(ferry::from_range(data) | ferry::batch(10) |
                        ferry::distribute(ferry::host_replicas{4}, {.global_batch = 10}),
                    ferry::config_error);
  }
  SUBCASE("a batch larger than the global batch") {
    auto steps = ferry::from_range(data) | ferry::batch(16) |
                 ferry::distribute(ferry::host_replicas{4}, {.global_batch = 8});
    CHECK_THROWS_WITH_AS(steps.next(), doctest::Contains("larger than"), ferry::config_error);
  }
  SUBCASE("a short first batch through prefetch is not taken for the global batch") {
    // batch(8)'s size is seen through prefetch: 6 rows is a short batch, not G = 6.
    auto steps = ferry::from_range(make_data(6)) | ferry::batch(8) | ferry::prefetch(1) |
                 ferry::distribute(ferry::host_replicas{4}, {.remainder = ferry::remainder_policy::partial});
    auto st = steps.next();
    REQUIRE(st);
    CHECK(steps.global_batch() == 8);
    CHECK(st->valid() == 6);
  }
  SUBCASE("an inferred global batch that does not divide suggests global_batch") {
    auto steps = ferry::distribute(sized_batches{{6, 8}}, ferry::host_replicas{4});
    CHECK_THROWS_WITH_AS(steps.next(), doctest::Contains("distribute_options::global_batch"),
                         ferry::config_error);
  }
  SUBCASE("a short first batch followed by a longer one: inference was wrong") {
    auto steps = ferry::distribute(sized_batches{{4, 8, 8}}, ferry::host_replicas{4});
    REQUIRE(steps.next());  // 4 rows: G inferred as 4, nothing yet says otherwise
    CHECK_THROWS_WITH_AS(steps.next(), doctest::Contains("pass distribute_options::global_batch"),
                         ferry::config_error);
  }
  SUBCASE("global_batch overrides inference from a short first batch") {
    auto steps = ferry::distribute(sized_batches{{4, 8, 8}}, ferry::host_replicas{4},
                                   {.remainder = ferry::remainder_policy::pad, .global_batch = 8});
    std::size_t n = 0;
    for (auto& st : steps) {
      CHECK(st.global_size() == 8);
      ++n;
    }
    CHECK(n == 3);
  }
  SUBCASE("under drop, a global_batch option above batch()'s size: every batch would be dropped") {
    // It dropped all 100 rows (5 short batches) without a word.
    auto steps = ferry::from_range(data) | ferry::batch(20) | ferry::prefetch(1) |
                 ferry::distribute(ferry::host_replicas{2}, {.global_batch = 40});
    CHECK_THROWS_WITH_AS(steps.next(), doctest::Contains("global_batch is 40, more than the upstream batch stage's "
                                                         "batch_size() of 20"),
                         ferry::config_error);
    // pad keeps every row (steps of 40, half padding), as may be meant; so does an equal size.
    for (const auto policy : {ferry::remainder_policy::pad, ferry::remainder_policy::drop}) {
      auto fine = ferry::from_range(data) | ferry::batch(20) |
                  ferry::distribute(ferry::host_replicas{2},
                                    {.remainder = policy, .global_batch = policy == ferry::remainder_policy::pad ? 40u : 20u});
      std::size_t n = 0;
      for (auto& st : fine) n += st.valid();
      CHECK(n == 100);
    }
  }
  SUBCASE("pad to a global batch whose bytes do not fit: a config_error, not an overrun") {
    auto steps = ferry::from_range(make_data(6)) | ferry::batch(4) | ferry::prefetch(1) |
                 ferry::distribute(ferry::host_replicas{2}, {.remainder = ferry::remainder_policy::pad,
                                                             .global_batch = std::size_t(1) << 62});
    CHECK_THROWS_WITH_AS(steps.next(), doctest::Contains("does not fit in memory"), ferry::config_error);
    auto hidden = ferry::distribute(sized_batches{{4, 2}}, ferry::host_replicas{2},
                                    {.remainder = ferry::remainder_policy::pad, .global_batch = std::size_t(1) << 62});
    CHECK_THROWS_WITH_AS(hidden.next(), doctest::Contains("does not fit in memory"), ferry::config_error);
  }
  SUBCASE("zero replicas") {
    CHECK_THROWS_AS(ferry::distribute(ferry::from_range(data) | ferry::batch(4), ferry::host_replicas{0}),
                    ferry::config_error);
  }
  // Workers would hold steps ahead (refused for every backend; distribute onto devices
  // refuses prefetch and shuffle at run time: test_distribute_sim; interleave over steps
  // does not compile: tests/compile_fail).
  SUBCASE("map's workers and interleave's readers over steps") {
    const auto steps = [&] { return host_steps(data); };
    const auto rows = [](auto&& st) { return st.valid(); };
    CHECK_THROWS_WITH_AS(steps() | ferry::map(rows, {.workers = 2}), doctest::Contains("map: workers after distribute()"),
                         ferry::config_error);
    // Inline, a step is mapped before the next is asked for: fine.
    std::size_t n = 0;
    for (const std::size_t v : steps() | ferry::map(rows)) n += v;
    CHECK(n == 100);
    const auto twice = [&](std::uint64_t) { return steps() | ferry::take(2); };
    CHECK_THROWS_WITH_AS(ferry::from_range(std::vector<std::uint64_t>{1, 2}) | ferry::interleave(twice, {.cycle = 2}),
                         doctest::Contains("interleave: workers over sources of distribute()'s steps"),
                         ferry::config_error);
    // Without readers each slot's step is taken before its pipeline's next one is asked for.
    std::size_t taken = 0;
    for (auto& st : ferry::from_range(std::vector<std::uint64_t>{1, 2}) |
                        ferry::interleave(twice, {.workers = 0, .cycle = 2}))
      taken += st.valid();
    CHECK(taken == 40);
  }
}

// Host replicas' steps own their rows (views of the host batch the step keeps), so stages
// that hold steps ahead may follow distribute there; device steps are refused
// (test_distribute_sim).
TEST_CASE("distribute(host_replicas): prefetch and shuffle after it hand out the same rows" * doctest::timeout(30)) {
  ferry_test::watchdog wd(30s, "prefetch after distribute(host_replicas)");
  const auto data = make_data(100);
  const auto rows_of = [](auto&& steps) {
    std::vector<std::vector<std::uint32_t>> out;  // a step's first fields, replica by replica
    for (auto& st : steps) {
      out.emplace_back();
      for (std::size_t r = 0; r < st.replicas(); ++r)
        for (const std::uint32_t id : st[r].template field<0>()) out.back().push_back(id);
    }
    return out;
  };
  const auto steps = [&] { return host_steps(data); };
  const auto plain = rows_of(steps());
  REQUIRE(plain.size() == 10);
  CHECK(rows_of(steps() | ferry::prefetch(3)) == plain);
  auto shuffled = rows_of(steps() | ferry::shuffle(4, 7));
  CHECK(shuffled != plain);
  std::sort(shuffled.begin(), shuffled.end());
  CHECK(shuffled == plain);  // the steps are each whole, in another order (plain's is sorted)
}

TEST_CASE("distribute: an upstream error reaches the consumer unchanged, in place, and the "
          "epoch goes on") {
  for (std::size_t ahead : {0, 1}) {
    CAPTURE(ahead);
    auto steps = ferry::batch(ferry_test::throwing_source(100, 37), 8) |
                 ferry::distribute(ferry::host_replicas{2}, {.steps_ahead = ahead});
    // Each step's rows (replica 0's, then replica 1's), or -1 for the error.
    std::vector<std::int64_t> got;
    std::size_t errors = 0;
    for (;;) {
      try {
        auto s = steps.next();
        if (!s) break;
        for (std::size_t r = 0; r < s->replicas(); ++r) {
          auto v = (*s)[r].template field<0>();
          for (std::size_t i = 0; i < (*s)[r].valid(); ++i) got.push_back(std::int64_t(v[i]));
        }
      } catch (const std::runtime_error& e) {
        CHECK(std::string(e.what()).find("source failed at 37") != std::string::npos);
        got.push_back(-1);
        REQUIRE(++errors < 3);
      }
    }
    // The oracle: batch drops the batch it was building (32..36) and starts after the
    // failed element; distribute's default remainder policy (drop) drops the short last
    // batch of 94..99. So: 0..31, the error, 38..93.
    std::vector<std::int64_t> want;
    for (std::int64_t i = 0; i < 32; ++i) want.push_back(i);
    want.push_back(-1);
    for (std::int64_t i = 38; i < 94; ++i) want.push_back(i);
    CHECK(got == want);
  }
}

TEST_CASE("distribute: save/restore resumes at the same step; rewind starts over") {
  auto data = make_data(200);
  auto make = [&] {
    return ferry::from_range(data) | ferry::batch(12) |
           ferry::distribute(ferry::host_replicas{3}, {.remainder = ferry::remainder_policy::pad});
  };
  auto a = make();
  for (int i = 0; i < 5; ++i) REQUIRE(a.next());
  const auto st = ferry::save_state(a);
  auto b = make();
  ferry::restore_state(b, st);
  std::size_t steps = 0;
  while (auto sa = a.next()) {
    auto sb = b.next();
    REQUIRE(sb);
    CHECK(sa->index() == sb->index());
    CHECK(sa->valid() == sb->valid());
    for (std::size_t r = 0; r < 3; ++r)
      for (std::size_t i = 0; i < (*sa)[r].size(); ++i)
        CHECK((*sa)[r].field<0>()[i] == (*sb)[r].field<0>()[i]);
    ++steps;
  }
  CHECK_FALSE(b.next());
  CHECK(steps == 17 - 5);  // ceil(200 / 12) == 17
  a.rewind();
  auto first = a.next();
  REQUIRE(first);
  CHECK(first->index() == 0);
  CHECK((*first)[0].field<0>()[0] == 1u);
}

// G inferred from the first batch (no batch() visible: a map after it) is part of the
// state: a restore used to infer it again from the batch after the saved position, the
// short last one perhaps, which then went out as a full step of G = its rows (or did not
// divide among the replicas). Every policy, replica count and save position, against the
// run that was not interrupted.
TEST_CASE("distribute: a restore keeps the global batch size inferred before the save") {
  const auto ident = [](ferry::batch_of<elem> b) { return b; };
  for (std::size_t R : {1, 2, 4, 8})
    for (const auto policy : {ferry::remainder_policy::drop, ferry::remainder_policy::pad,
                              ferry::remainder_policy::partial})
      for (std::size_t rows : {20, 24, 36}) {
        CAPTURE(R);
        CAPTURE(name(policy));
        CAPTURE(rows);
        const auto data = make_data(std::uint32_t(rows));
        auto make = [&] {
          return ferry::from_range(data) | ferry::batch(8) | ferry::repeat(2) | ferry::map(ident) |
                 ferry::distribute(ferry::host_replicas{R}, {.remainder = policy});
        };
        // The uninterrupted run: each step's size, valid rows and first row.
        std::vector<std::tuple<std::size_t, std::size_t, std::uint32_t>> want;
        auto whole = make();
        for (auto& st : whole) want.emplace_back(st.global_size(), st.valid(), st.valid() ? st[0].field<0>()[0] : 0);
        for (std::size_t k = 1; k < want.size(); ++k) {
          CAPTURE(k);
          auto a = make();
          for (std::size_t i = 0; i < k; ++i) REQUIRE(a.next());
          const auto st = ferry::save_state(a);
          const std::uint64_t dropped_before = a.dropped();
          while (a.next()) {
          }
          auto b = make();
          ferry::restore_state(b, st);
          std::size_t at = k;
          for (auto& s : b) {
            REQUIRE(at < want.size());
            CHECK(s.global_size() == std::get<0>(want[at]));
            CHECK(s.valid() == std::get<1>(want[at]));
            if (s.valid()) CHECK(s[0].field<0>()[0] == std::get<2>(want[at]));
            ++at;
          }
          CHECK(at == want.size());
          CHECK(b.dropped() == a.dropped() - dropped_before);  // the short batches after the save
        }
      }
}

// A state saved before the inferred size was part of it (the step index alone, its top
// bit clear) still restores, inferring as those states did.
TEST_CASE("distribute: a state of the step index alone (saved before) still restores") {
  const auto data = make_data(64);
  auto make = [&] { return ferry::from_range(data) | ferry::batch(8) | ferry::distribute(ferry::host_replicas{2}); };
  auto a = make();
  for (int i = 0; i < 3; ++i) REQUIRE(a.next());
  ferry::pipeline_state st = ferry::save_state(a);
  // distribute's words come last: the index (top bit set) and G (0: not inferred here).
  REQUIRE(st.words.size() >= 2);
  CHECK(st.words.back() == 0);
  st.words.pop_back();
  CHECK(st.words.back() == (std::uint64_t(1) << 63 | 3));
  st.words.back() = 3;
  auto b = make();
  ferry::restore_state(b, st);
  auto s = b.next();
  REQUIRE(s);
  CHECK(s->index() == 3);
  CHECK((*s)[0].field<0>()[0] == 25);
}

TEST_CASE("distribute: nothing runs before the first next()") {
  auto calls = std::make_shared<std::atomic<std::uint64_t>>(0);
  auto steps = ferry::batch(ferry_test::counting_source(64, calls), 8) |
               ferry::distribute(ferry::host_replicas{2});
  CHECK(calls->load() == 0);
  REQUIRE(steps.next());
  CHECK(calls->load() == 8);
}

TEST_CASE("plan_slices against a row-by-row oracle: every policy, every short length, 1 to 8 replicas") {
  using ferry::remainder_policy;
  for (std::size_t R = 1; R <= 8; ++R)
    for (std::size_t per = 1; per <= 5; ++per) {
      const std::size_t G = R * per;
      for (std::size_t m = 1; m <= G; ++m)
        for (auto pol : {remainder_policy::drop, remainder_policy::pad, remainder_policy::partial}) {
          CAPTURE(R);
          CAPTURE(m);
          CAPTURE(static_cast<int>(pol));
          std::vector<ferry::detail::replica_slice> s(R);
          const bool kept = ferry::detail::plan_slices(m, G, pol, s);
          if (m < G && pol == remainder_policy::drop) {
            CHECK_FALSE(kept);
            continue;
          }
          REQUIRE(kept);
          // The oracle: deal rows out one by one. Whole and padded batches: replica r owns
          // rows [r*per, (r+1)*per), its valid ones those below m. Partial: rows go round
          // the replicas in blocks, sizes differing by at most one, the larger first.
          std::vector<std::size_t> owner(G, R), valid(R, 0), width(R, 0);
          if (m == G || pol == remainder_policy::pad) {
            for (std::size_t i = 0; i < G; ++i) {
              owner[i] = i / per;
              ++width[i / per];
              if (i < m) ++valid[i / per];
            }
          } else {
            std::vector<std::size_t> rows(R, 0);
            for (std::size_t i = 0; i < m; ++i) ++rows[i % R];
            std::size_t at = 0;
            for (std::size_t r = 0; r < R; ++r)
              for (std::size_t k = 0; k < rows[r]; ++k, ++at) {
                owner[at] = r;
                ++width[r];
                ++valid[r];
              }
          }
          for (std::size_t r = 0; r < R; ++r) {
            CHECK(s[r].rows == width[r]);
            CHECK(s[r].valid == valid[r]);
            for (std::size_t i = s[r].first; i < s[r].first + s[r].rows; ++i) CHECK(owner[i] == r);
          }
        }
    }
}

TEST_CASE("check_global_batch and check_batch_rows name the sizes") {
  using from = ferry::detail::global_batch_from;
  CHECK_NOTHROW(ferry::detail::check_global_batch(12, 3, from::upstream));
  CHECK_THROWS_WITH_AS(ferry::detail::check_global_batch(10, 3, from::upstream),
                       doctest::Contains("global batch size 10 does not divide among 3 replicas (the upstream batch "
                                         "stage's batch_size(); bucket_by_sequence_length's under a token budget "
                                         "is max_tokens)"),
                       ferry::config_error);
  CHECK_THROWS_WITH_AS(ferry::detail::check_global_batch(10, 3, from::option),
                       doctest::Contains("3 replicas (distribute_options::global_batch)"), ferry::config_error);
  CHECK_THROWS_WITH_AS(ferry::detail::check_global_batch(10, 3, from::inferred),
                       doctest::Contains("inferred from the first batch"), ferry::config_error);
  CHECK_NOTHROW(ferry::detail::check_batch_rows(12, 12, false));
  CHECK_THROWS_WITH_AS(ferry::detail::check_batch_rows(13, 12, false),
                       doctest::Contains("batch of 13 rows, larger than the global batch size 12"), ferry::config_error);
  CHECK_THROWS_WITH_AS(ferry::detail::check_batch_rows(13, 12, true), doctest::Contains("that first batch was short"),
                       ferry::config_error);
}

TEST_CASE("distribute(host_replicas): ragged fields reach each replica as its rows, offsets rebased to 0, "
          "for every policy") {
  using row = std::tuple<std::vector<std::int32_t>, std::string, std::int32_t>;
  std::mt19937 g(5);
  std::vector<row> data(103);
  for (std::size_t i = 0; i < data.size(); ++i) {
    std::get<0>(data[i]).assign(g() % 9, std::int32_t(i));
    std::get<1>(data[i]).assign(g() % 4, char('a' + i % 26));
    std::get<2>(data[i]) = std::int32_t(i);
  }
  for (auto pol : {ferry::remainder_policy::drop, ferry::remainder_policy::pad, ferry::remainder_policy::partial})
    for (std::size_t R : {1, 2, 3, 4}) {
      CAPTURE(static_cast<int>(pol));
      CAPTURE(R);
      const std::size_t G = 4 * R;
      auto steps = ferry::from_range(data) | ferry::batch(G) | ferry::prefetch(2) |
                   ferry::distribute(ferry::host_replicas{R}, {.remainder = pol});
      std::size_t next = 0;
      for (auto& st : steps) {
        for (std::size_t r = 0; r < R; ++r) {
          auto& rb = st[r];
          ferry::ragged_view<std::int32_t> xs = rb.field<0>();
          ferry::ragged_view<char> words = rb.field<1>();
          REQUIRE(xs.size() == rb.size());
          REQUIRE(words.size() == rb.size());
          CHECK(xs.offsets[0] == 0);
          CHECK(xs.offsets.back() == xs.values.size());
          CHECK(rb.field_bytes(0).size() == xs.values.size() * 4);
          CHECK(rb.offsets_bytes(0).size() == (rb.size() + 1) * 8);
          for (std::size_t i = 0; i < rb.size(); ++i) {
            if (i >= rb.valid()) {  // pad: empty sequences
              CHECK(xs[i].empty());
              CHECK(words[i].empty());
              continue;
            }
            const row& want = data[next++];
            CHECK(std::vector<std::int32_t>(xs[i].begin(), xs[i].end()) == std::get<0>(want));
            CHECK(std::string(words[i].begin(), words[i].end()) == std::get<1>(want));
            CHECK(rb.field<2>()[i] == std::get<2>(want));
          }
        }
      }
      CHECK(next == (pol == ferry::remainder_policy::drop ? data.size() / G * G : data.size()));
    }
}
