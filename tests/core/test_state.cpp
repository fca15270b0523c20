// Iterator state: stop after k elements, restore a fresh pipeline from the saved state,
// and the rest equals an uninterrupted run. Swept over k and over pipeline shapes.
#include <doctest/doctest.h>

#include <chrono>
#include <functional>
#include <optional>
#include <stdexcept>
#include <vector>

#include "common/doubles.hpp"
#include "ferry/ferry.hpp"
#include "ferry/stages/interleave.hpp"

using namespace std::chrono_literals;
using ferry_test::drain;
using ferry_test::watchdog;

namespace {

std::uint64_t mix(std::uint64_t x) { return x * 0x9e3779b97f4a7c15ull ^ (x >> 7); }

// Flattens batches so every shape yields a vector of numbers to compare.
template <class T>
void flatten(std::vector<std::uint64_t>& out, const T& e) {
  if constexpr (requires { e.field(); })
    for (auto x : e.field()) out.push_back(x);
  else
    out.push_back(e);
}

// Runs make() to the end; then for each k: k elements, save, restore into a fresh
// make(), drain; the concatenation must equal the uninterrupted run.
template <class Make>
void check_resume(Make make, std::vector<std::size_t> ks) {
  std::vector<std::uint64_t> ref;
  std::size_t total = 0;
  {
    auto p = make();
    while (auto e = p.next()) {
      flatten(ref, *e);
      ++total;
    }
  }
  for (std::size_t k : ks) {
    if (k > total) continue;
    CAPTURE(k);
    std::vector<std::uint64_t> got;
    ferry::pipeline_state st;
    {
      auto p = make();
      for (std::size_t i = 0; i < k; ++i) {
        auto e = p.next();
        REQUIRE(e);
        flatten(got, *e);
      }
      st = ferry::save_state(p);
    }
    // Through bytes, as a checkpoint file would.
    auto st2 = ferry::pipeline_state::from_bytes(st.to_bytes());
    CHECK(st2 == st);
    auto q = make();
    ferry::restore_state(q, st2);
    while (auto e = q.next()) flatten(got, *e);
    CHECK(got == ref);
  }
}

std::vector<std::size_t> ks{0, 1, 2, 5, 13, 63, 64, 65, 100, 299, 300, 1000};

}  // namespace

TEST_CASE("resume is exact: sources and stateless stages") {
  check_resume([] { return ferry::from_generator(300, [](std::uint64_t i) { return mix(i); }); }, ks);
  check_resume(
      [] {
        return ferry::from_generator(600, [](std::uint64_t i) { return i; }) |
               ferry::filter([](std::uint64_t x) { return mix(x) % 3 != 0; }) | ferry::shard(3, 1) |
               ferry::take(150);
      },
      ks);
}

TEST_CASE("resume is exact: shuffle across windows and epochs") {
  check_resume(
      [] { return ferry::from_generator(300, [](std::uint64_t i) { return i; }) | ferry::shuffle(64, 5) | ferry::repeat(3); },
      ks);
}

TEST_CASE("resume is exact: parallel map and prefetch mid-flight" * doctest::timeout(60)) {
  watchdog w(60s);
  for (std::size_t workers : {1, 3})
    check_resume(
        [workers] {
          return ferry::from_generator(1000, [](std::uint64_t i) { return i; }) | ferry::shuffle(100, 9) |
                 ferry::map([](std::uint64_t x) { return mix(x); }, {.workers = workers, .window = 8}) |
                 ferry::prefetch(3);
        },
        ks);
}

TEST_CASE("resume is exact: batches of a shuffled, mapped, prefetched pipeline" * doctest::timeout(60)) {
  watchdog w(60s);
  check_resume(
      [] {
        return ferry::from_generator(2000, [](std::uint64_t i) { return i; }) | ferry::shuffle(128, 1) |
               ferry::map([](std::uint64_t x) { return x ^ 0xff; }, {.workers = 2}) |
               ferry::batch(16) | ferry::prefetch(2) | ferry::repeat(2);
      },
      {0, 1, 7, 8, 9, 124, 125, 200, 249, 250});
}

TEST_CASE("a state from another pipeline shape is refused") {
  auto a = ferry::from_generator(10, [](std::uint64_t i) { return i; }) | ferry::shuffle(4, 1);
  auto st = ferry::save_state(a);
  auto b = ferry::from_generator(10, [](std::uint64_t i) { return i; }) | ferry::take(4);
  CHECK_THROWS_WITH_AS(ferry::restore_state(b, st), doctest::Contains("another shape"), ferry::config_error);
  auto c = ferry::from_generator(10, [](std::uint64_t i) { return i; });
  CHECK_THROWS_AS(ferry::restore_state(c, st), ferry::config_error);
  CHECK_THROWS_AS(ferry::pipeline_state::from_bytes("abc"), ferry::config_error);
}

TEST_CASE("a state past the end of a shorter range or generator is refused, not read out of bounds") {
  std::vector<std::uint32_t> longer(100), shorter(10);
  auto a = ferry::from_range(longer);
  for (int i = 0; i < 50; ++i) REQUIRE(a.next());
  const auto st = ferry::save_state(a);
  auto b = ferry::from_range(shorter);
  CHECK_THROWS_WITH_AS(ferry::restore_state(b, st),
                       "restore_state: from_range: the state is at element 50, past the end of this range of 10 "
                       "(saved from a longer one?)",
                       ferry::config_error);
  auto same = ferry::from_range(std::vector<std::uint32_t>(50));  // at its end: allowed, and empty
  ferry::restore_state(same, st);
  CHECK_FALSE(same.next());

  auto g = ferry::from_generator(100, [](std::uint64_t i) { return i; });
  for (int i = 0; i < 50; ++i) REQUIRE(g.next());
  const auto gs = ferry::save_state(g);
  auto h = ferry::from_generator(10, [](std::uint64_t i) { return i; });
  CHECK_THROWS_WITH_AS(ferry::restore_state(h, gs),
                       "restore_state: from_generator: the state is at index 50, past this generator's count of 10 "
                       "(saved from a longer one?)",
                       ferry::config_error);
  auto k = ferry::from_generator(60, [](std::uint64_t i) { return i; });
  ferry::restore_state(k, gs);
  CHECK(k.next() == std::optional<std::uint64_t>(50));
}

TEST_CASE("checkpoint bytes cut short, damaged or foreign are refused, every cut and every bit") {
  auto p = ferry::from_generator(1000, [](std::uint64_t i) { return i; }) | ferry::shuffle(64, 5) |
           ferry::batch(8);
  for (int i = 0; i < 7; ++i) REQUIRE(p.next());
  const ferry::pipeline_state st = ferry::save_state(p);
  const std::string bytes = st.to_bytes();
  REQUIRE(bytes.size() == (st.words.size() + 2) * 8);
  CHECK(bytes.substr(0, 8) == "ferrySt3");
  CHECK(ferry::pipeline_state::from_bytes(bytes) == st);
  for (std::size_t n = 0; n < bytes.size(); ++n) {  // every cut
    CAPTURE(n);
    CHECK_THROWS_AS(ferry::pipeline_state::from_bytes(std::string_view(bytes).substr(0, n)), ferry::config_error);
  }
  for (std::size_t bit = 0; bit < bytes.size() * 8; ++bit) {  // every single flipped bit
    CAPTURE(bit);
    std::string bad = bytes;
    bad[bit / 8] = char(bad[bit / 8] ^ (1 << (bit % 8)));
    CHECK_THROWS_AS(ferry::pipeline_state::from_bytes(bad), ferry::config_error);
  }
  // The messages say which: foreign bytes, or a damaged state (with the check's offset).
  CHECK_THROWS_WITH_AS(ferry::pipeline_state::from_bytes(std::string(bytes.size(), 'x')),
                       doctest::Contains("not a ferry pipeline state"), ferry::config_error);
  std::string flipped = bytes;
  flipped[20] = char(flipped[20] ^ 4);
  const std::string at = "check word at offset " + std::to_string(bytes.size() - 8);
  CHECK_THROWS_WITH_AS(ferry::pipeline_state::from_bytes(flipped), doctest::Contains(at.c_str()),
                       ferry::config_error);
  // A state of format 1 (from_files saved no epoch then) is refused by name, even with a
  // check word that matches.
  std::string v1 = bytes;
  v1[7] = '1';
  CHECK_THROWS_WITH_AS(ferry::pipeline_state::from_bytes(v1), doctest::Contains("older ferry (\"ferrySt1\")"),
                       ferry::config_error);
  // Format 2 (no configuration words: it could be restored into another seed or shard) too.
  std::string v2 = bytes;
  v2[7] = '2';
  CHECK_THROWS_WITH_AS(ferry::pipeline_state::from_bytes(v2), doctest::Contains("older ferry (\"ferrySt2\")"),
                       ferry::config_error);
  // An empty pipeline state (no words) still round-trips.
  CHECK(ferry::pipeline_state::from_bytes(ferry::pipeline_state{}.to_bytes()).words.empty());
}

TEST_CASE("an unordered parallel map refuses to save" * doctest::timeout(30)) {
  watchdog w(30s);
  auto p = ferry::from_generator(100, [](std::uint64_t i) { return i; }) |
           ferry::map([](std::uint64_t x) { return x; }, {.workers = 2, .ordered = false});
  REQUIRE(p.next());
  CHECK_THROWS_AS(ferry::save_state(p), ferry::config_error);
}

TEST_CASE("a checkpoint stays small: positions, not buffers") {
  auto p = ferry::from_generator(100000, [](std::uint64_t i) { return i; }) | ferry::shuffle(10000, 1) |
           ferry::map([](std::uint64_t x) { return x; }) | ferry::batch(64);
  for (int i = 0; i < 200; ++i) REQUIRE(p.next());
  CHECK(ferry::save_state(p).words.size() < 16);
}

namespace {
// A state as an attacker would make it: the words edited, the check word recomputed
// (it is public: to_bytes() makes it for anyone).
ferry::pipeline_state edited(ferry::pipeline_state st, std::size_t word, std::uint64_t value) {
  REQUIRE(word < st.words.size());
  st.words[word] = value;
  return ferry::pipeline_state::from_bytes(st.to_bytes());
}
// The index of the word after stage `tag`'s tag (its first own word).
std::size_t after_tag(const ferry::pipeline_state& st, const char* tag) {
  for (std::size_t i = 0; i < st.words.size(); ++i)
    if (st.words[i] == ferry::detail::stage_tag(tag)) return i + 1;
  FAIL("no tag " << tag);
  return 0;
}
}  // namespace

TEST_CASE("a crafted checkpoint cannot hang a pipeline: every restored count is checked" * doctest::timeout(30)) {
  watchdog w(30s);
  auto gen = [] { return ferry::from_generator(100, [](std::uint64_t i) { return i; }); };
  // map's re-read of 2^62 elements over repeat() (which never ends) never returned.
  for (std::size_t workers : {1, 2}) {
    CAPTURE(workers);
    auto make = [&] { return gen() | ferry::repeat() | ferry::map([](std::uint64_t x) { return x; }, {.workers = workers}); };
    auto a = make();
    for (int i = 0; i < 5; ++i) REQUIRE(a.next());
    const auto st = ferry::save_state(a);
    auto b = make();
    CHECK_THROWS_WITH_AS(ferry::restore_state(b, edited(st, after_tag(st, "map"), std::uint64_t(1) << 62)),
                         doctest::Contains("map: the state re-reads 4611686018427387904 elements, more than this "
                                           "map's window"),
                         ferry::config_error);
  }
  // shuffle: a window longer than its buffer, or an offset past the window.
  {
    auto a = gen() | ferry::shuffle(8, 1);
    for (int i = 0; i < 3; ++i) REQUIRE(a.next());
    const auto st = ferry::save_state(a);
    const std::size_t at = after_tag(st, "shuffle") + 2;  // after the buffer and seed: epoch, window, offset, length
    for (auto [word, value] : {std::pair<std::size_t, std::uint64_t>{at + 3, 1u << 20}, {at + 2, 9}}) {
      auto b = gen() | ferry::shuffle(8, 1);
      CHECK_THROWS_WITH_AS(ferry::restore_state(b, edited(st, word, value)), doctest::Contains("shuffle: a damaged state"),
                           ferry::config_error);
    }
  }
  // repeat: a pass past its count; flat_map: a re-read longer than an anchor's worth.
  {
    auto a = gen() | ferry::repeat(3);
    REQUIRE(a.next());
    const auto st = ferry::save_state(a);
    auto b = gen() | ferry::repeat(3);
    CHECK_THROWS_WITH_AS(ferry::restore_state(b, edited(st, after_tag(st, "repeat"), 7)),
                         doctest::Contains("repeat: the state is at pass 7"), ferry::config_error);
    auto c = gen() | ferry::repeat(3);  // the pass's "seen" flag: 0 or 1
    CHECK_THROWS_WITH_AS(ferry::restore_state(c, edited(st, after_tag(st, "repeat") + 1, 7)),
                         doctest::Contains("repeat: a damaged state (a flag of 7"), ferry::config_error);
    auto f = gen() | ferry::flat_map([](std::uint64_t x) { return std::vector<std::uint64_t>{x, x}; });
    for (int i = 0; i < 3; ++i) REQUIRE(f.next());
    const auto fs = ferry::save_state(f);
    auto g = gen() | ferry::flat_map([](std::uint64_t x) { return std::vector<std::uint64_t>{x, x}; });
    CHECK_THROWS_WITH_AS(ferry::restore_state(g, edited(fs, after_tag(fs, "flat_map"), std::uint64_t(1) << 40)),
                         doctest::Contains("flat_map: a damaged state"), ferry::config_error);
  }
}

// The naive oracle: a state restores only into the configuration that saved it; into it,
// exactly. Random configurations of the stages whose parameters decide the sequence.
TEST_CASE("property: a checkpoint restores into its own configuration only, naming what differs") {
  std::uint64_t rng = 12345;
  auto next = [&](std::uint64_t m) { return ferry::detail::splitmix64(rng++)() % m; };
  auto gen = [] { return ferry::from_generator(200, [](std::uint64_t i) { return i * 5; }); };
  for (int trial = 0; trial < 60; ++trial) {
    CAPTURE(trial);
    // shuffle(buffer, seed) | shard(count, index)
    const std::uint64_t buf[2] = {1 + next(12), 1 + next(12)}, seed[2] = {next(3), next(3)};
    const std::uint64_t count[2] = {1 + next(4), 1 + next(4)};
    const std::uint64_t index[2] = {next(count[0]), next(count[1])};
    auto make = [&](int k) { return gen() | ferry::shuffle(buf[k], seed[k]) | ferry::shard(count[k], index[k]); };
    auto a = make(0);
    const std::uint64_t at = next(30);
    for (std::uint64_t i = 0; i < at; ++i) a.next();
    const auto st = ferry::pipeline_state::from_bytes(ferry::save_state(a).to_bytes());
    auto b = make(1);
    const bool same = buf[0] == buf[1] && seed[0] == seed[1] && count[0] == count[1] && index[0] == index[1];
    if (same) {
      ferry::restore_state(b, st);
      CHECK(drain(b) == drain(a));
      continue;
    }
    std::string why;
    try {
      ferry::restore_state(b, st);
    } catch (const ferry::config_error& e) {
      why = e.what();
    }
    CAPTURE(why);
    // The first difference in pipeline order is the one named.
    if (buf[0] != buf[1])
      CHECK(why.find("shuffle: the state was saved with buffer = " + std::to_string(buf[0])) != std::string::npos);
    else if (seed[0] != seed[1])
      CHECK(why.find("shuffle: the state was saved with seed = " + std::to_string(seed[0])) != std::string::npos);
    else if (count[0] != count[1])
      CHECK(why.find("shard: the state was saved with count = " + std::to_string(count[0])) != std::string::npos);
    else
      CHECK(why.find("shard: the state was saved with index = " + std::to_string(index[0]) +
                     ", this pipeline has index = " + std::to_string(index[1])) != std::string::npos);
  }
}

// A refused restore used to leave the stages it reached restored and the rest not, and
// the pipeline then handed out an epoch that was neither the state's nor a fresh one's,
// with no error (from_range(20) | shuffle(4, seed 1)'s state into seed 2: 12 of 20
// elements; found by a review helper). Now every stage the refusal throws through is
// marked: pulls and save_state() throw config_error until rewind() or a good restore.
TEST_CASE("a refused restore marks the pipeline until rewind() or a good restore" * doctest::timeout(60)) {
  watchdog w(60s);
  const auto part_way = doctest::Contains("a restore or rewind() of this pipeline failed part way");
  std::vector<std::uint64_t> v(20);
  for (std::uint64_t i = 0; i < 20; ++i) v[i] = i;
  auto shuffled = [&](std::uint64_t seed) { return ferry::from_range(v) | ferry::shuffle(4, seed); };
  auto a = shuffled(1);
  for (int i = 0; i < 9; ++i) REQUIRE(a.next());
  const auto st1 = ferry::save_state(a);
  auto c = shuffled(2);  // the same position under seed 2: the good state
  for (int i = 0; i < 9; ++i) REQUIRE(c.next());
  const auto st2 = ferry::save_state(c);
  const auto rest2 = drain(c);

  SUBCASE("another seed: refused; next() and save_state() throw; rewind() gives a whole epoch") {
    auto b = shuffled(2);
    CHECK_THROWS_WITH_AS(ferry::restore_state(b, st1), doctest::Contains("shuffle: the state was saved with seed = 1"),
                         ferry::config_error);
    CHECK_THROWS_WITH_AS(b.next(), part_way, ferry::config_error);
    CHECK_THROWS_WITH_AS(b.next(), part_way, ferry::config_error);  // until rewound, every time
    CHECK_THROWS_WITH_AS(ferry::save_state(b), part_way, ferry::config_error);
    b.rewind();
    auto fresh = shuffled(2);
    fresh.rewind();
    CHECK(drain(b) == drain(fresh));  // the second epoch, all 20
  }
  SUBCASE("a good restore after a refused one goes on exactly") {
    auto b = shuffled(2);
    CHECK_THROWS_AS(ferry::restore_state(b, st1), ferry::config_error);
    ferry::restore_state(b, st2);
    CHECK(drain(b) == rest2);
  }
  SUBCASE("a state longer than the pipeline's: every stage took its words, then refused; marked too") {
    auto longer = st2;
    longer.words.push_back(7);
    auto b = shuffled(2);
    CHECK_THROWS_WITH_AS(ferry::restore_state(b, longer), doctest::Contains("longer than this pipeline's"),
                         ferry::config_error);
    CHECK_THROWS_WITH_AS(b.next(), part_way, ferry::config_error);
    ferry::restore_state(b, st2);
    CHECK(drain(b) == rest2);
  }
  SUBCASE("a stage built over a marked pipeline is marked; an any_source holding one throws") {
    auto b = shuffled(2);
    CHECK_THROWS_AS(ferry::restore_state(b, st1), ferry::config_error);
    auto t = std::move(b) | ferry::take(100);  // take's pull skips its upstream's check
    CHECK_THROWS_WITH_AS(t.next(), part_way, ferry::config_error);
    t.rewind();
    CHECK(drain(t).size() == 20);
    auto d = shuffled(2);
    CHECK_THROWS_AS(ferry::restore_state(d, st1), ferry::config_error);
    ferry::any_source<std::uint64_t> any(std::move(d));
    CHECK_THROWS_WITH_AS(any.next(), part_way, ferry::config_error);
    auto e = std::move(any) | ferry::map([](std::uint64_t x) { return x; });
    CHECK_THROWS_WITH_AS(e.next(), part_way, ferry::config_error);
    e.rewind();
    CHECK(drain(e).size() == 20);
  }
  SUBCASE("any_source: refused inside, or longer than the held pipeline's") {
    ferry::any_source<std::uint64_t> b = shuffled(2);
    CHECK_THROWS_AS(ferry::restore_state(b, st1), ferry::config_error);
    CHECK_THROWS_WITH_AS(b.next(), part_way, ferry::config_error);
    ferry::restore_state(b, st2);
    CHECK(drain(b) == rest2);
    auto longer = st2;
    longer.words.push_back(7);
    ferry::any_source<std::uint64_t> d = shuffled(2);
    CHECK_THROWS_AS(ferry::restore_state(d, longer), ferry::config_error);
    CHECK_THROWS_WITH_AS(d.next(), part_way, ferry::config_error);
    d.rewind();
    CHECK(drain(d).size() == 20);
  }
}

// The same with threads and several upstreams: a map with workers and a prefetch restored
// under a batch that refuses, zip with one side restored, interleave(fn) over a restored
// shuffle; next_bulk is refused as next() is.
TEST_CASE("a refused restore marks threaded stages, joins and interleave(fn) too" * doctest::timeout(60)) {
  watchdog w(60s);
  const auto part_way = doctest::Contains("a restore or rewind() of this pipeline failed part way");
  auto gen = [] { return ferry::from_generator(60, [](std::uint64_t i) { return i * 3; }); };
  auto flat = [](auto& p) {
    std::vector<std::uint64_t> out;
    while (auto e = p.next()) flatten(out, *e);
    return out;
  };
  auto check = [&](auto make_a, auto make_b, int k) {
    auto a = make_a();
    for (int i = 0; i < k; ++i) REQUIRE(a.next());
    const auto st_a = ferry::save_state(a);
    auto c = make_b();
    for (int i = 0; i < k; ++i) REQUIRE(c.next());
    const auto st_b = ferry::save_state(c);
    const auto rest_b = flat(c);
    auto b = make_b();
    CHECK_THROWS_AS(ferry::restore_state(b, st_a), ferry::config_error);
    CHECK_THROWS_WITH_AS(b.next(), part_way, ferry::config_error);
    CHECK_THROWS_WITH_AS(ferry::save_state(b), part_way, ferry::config_error);
    ferry::restore_state(b, st_b);  // good: exact
    CHECK(flat(b) == rest_b);
    auto r = make_b();
    CHECK_THROWS_AS(ferry::restore_state(r, st_a), ferry::config_error);
    r.rewind();
    auto fresh = make_b();
    fresh.rewind();
    CHECK(flat(r) == flat(fresh));
  };
  SUBCASE("map with workers, prefetch and batch under a shuffle of another seed") {
    auto make = [&](std::uint64_t seed) {
      return gen() | ferry::map([](std::uint64_t x) { return x + 1; }, {.workers = 2, .window = 8}) |
             ferry::prefetch(3) | ferry::batch(4) | ferry::shuffle(2, seed);
    };
    check([&] { return make(1); }, [&] { return make(2); }, 3);
  }
  SUBCASE("prefetch over a shuffle of another seed") {
    auto make = [&](std::uint64_t seed) { return gen() | ferry::shuffle(8, seed) | ferry::prefetch(2); };
    check([&] { return make(1); }, [&] { return make(2); }, 7);
  }
  SUBCASE("interleave(fn) of another cycle over a restored shuffle") {
    auto make = [&](std::size_t cycle) {
      return gen() | ferry::shuffle(8, 3) |
             ferry::interleave([](std::uint64_t x) { return ferry::from_generator(x % 4, [x](std::uint64_t j) { return x * 10 + j; }); },
                               {.workers = 1, .cycle = cycle});
    };
    check([&] { return make(3); }, [&] { return make(2); }, 11);
  }
  SUBCASE("zip: one side restored, the other refused") {
    auto make = [&](std::uint64_t seed) {
      return ferry::zip(gen() | ferry::shuffle(4, 1), gen() | ferry::shuffle(4, seed)) |
             ferry::map([](const std::pair<std::uint64_t, std::uint64_t>& p) { return p.first * 1000 + p.second; });
    };
    check([&] { return make(1); }, [&] { return make(2); }, 5);
  }
  SUBCASE("next_bulk: a map over from_range, refused by a take's count") {
    std::vector<std::uint64_t> v(50);
    for (std::uint64_t i = 0; i < 50; ++i) v[i] = i;
    auto make = [&] { return ferry::from_range(v) | ferry::map([](std::uint64_t x) { return x * 2; }); };
    auto a = make() | ferry::take(40);
    for (int i = 0; i < 30; ++i) REQUIRE(a.next());
    const auto st = ferry::save_state(a);
    auto b = make() | ferry::take(20);  // the state took 30: more than take(20) hands on
    CHECK_THROWS_WITH_AS(ferry::restore_state(b, st), doctest::Contains("take"), ferry::config_error);
    std::vector<std::uint64_t> out(8);
    auto m = make();
    CHECK_THROWS_AS(ferry::restore_state(m, ferry::pipeline_state{}), ferry::config_error);  // too short
    CHECK_THROWS_WITH_AS(m.next_bulk(std::span<std::uint64_t>(out)), part_way, ferry::config_error);
    m.rewind();
    CHECK(m.next_bulk(std::span<std::uint64_t>(out)) == 8);
    CHECK(out[7] == 14);
    auto view = ferry::from_range(v);  // next_view, on a source
    CHECK_THROWS_AS(ferry::restore_state(view, ferry::pipeline_state{}), ferry::config_error);
    CHECK_THROWS_WITH_AS(view.next_view(4), part_way, ferry::config_error);
    view.rewind();
    CHECK(view.next_view(4).size() == 4);
  }
}

// interleave(fn)'s slot table was trusted: a restored count of upstream pulls to re-read
// of 2^62 over repeat() never returned from the first next(), and a slot's distance of
// 2^64 - 1 (its + 1 wrapped) was accepted and the slot never reopened, its elements lost
// (found by a review helper). Every table a save cannot write is refused now, naming
// interleave; a real save, however far back its anchor, restores exactly.
TEST_CASE("interleave(fn): a crafted slot table is refused, not replayed for ever or half" * doctest::timeout(60)) {
  watchdog w(60s);
  auto fn = [](std::uint64_t x) { return ferry::from_generator(3, [x](std::uint64_t j) { return x * 10 + j; }); };
  auto make = [&] {
    return ferry::from_generator(100, [](std::uint64_t i) { return i; }) | ferry::repeat() |
           ferry::interleave(fn, {.workers = 0, .block = 1, .cycle = 2});
  };
  auto a = make();
  for (int i = 0; i < 5; ++i) REQUIRE(a.next());
  const auto st = ferry::save_state(a);
  // The table: turn, taken, then per slot open?, distance, n and n words; then the pulls
  // since the anchor, the end flag and the pulls before the anchor.
  const std::size_t table = after_tag(st, "interleave") + 2, slot0 = table + 2;
  REQUIRE(st.words[slot0] == 1);
  const std::size_t slot1 = slot0 + 3 + st.words[slot0 + 2];
  REQUIRE(st.words[slot1] == 1);
  const std::size_t since = st.words.size() - 3, base = st.words.size() - 1;
  REQUIRE(slot1 + 3 + st.words[slot1 + 2] == since);
  REQUIRE(st.words[slot0 + 1] + st.words[slot1 + 1] == 1);  // distances 0 and 1
  REQUIRE(st.words[since] == 2);
  const std::size_t at0 = st.words[slot0 + 1] == 0 ? slot0 + 1 : slot1 + 1, at1 = at0 == slot0 + 1 ? slot1 + 1 : slot0 + 1;
  struct edit {
    const char* what;
    std::vector<std::pair<std::size_t, std::uint64_t>> words;
  };
  for (const edit& e : std::vector<edit>{
           {"2^62 pulls to re-read", {{since, std::uint64_t(1) << 62}}},
           {"one pull more than a save re-reads", {{since, (std::uint64_t(1) << 24) + 1}}},
           {"a distance of 2^64 - 1", {{at1, ~std::uint64_t(0)}}},
           {"two slots at one distance", {{at1, 0}}},
           {"a slot at the pulls", {{at1, 2}}},
           {"a slot past the pulls", {{at1, 5}}},
           {"no slot at the anchor", {{at0, 2}, {since, 3}}},
           {"2^62 + 1 pulls before the anchor", {{base, (std::uint64_t(1) << 62) + 1}}},
       }) {
    INFO(std::string(e.what));
    ferry::pipeline_state bad = st;
    for (auto [word, value] : e.words) bad.words[word] = value;
    auto b = make();
    CHECK_THROWS_WITH_AS(ferry::restore_state(b, ferry::pipeline_state::from_bytes(bad.to_bytes())),
                         doctest::Contains("interleave: a damaged state"), ferry::config_error);
  }
  {
    INFO("pulls with no slot open");  // both slots closed, 2 pulls since the anchor
    ferry::pipeline_state bad = st;
    bad.words.resize(slot0);
    for (std::uint64_t x : {0, 0, 2, 0, 0}) bad.words.push_back(x);
    auto b = make();
    CHECK_THROWS_WITH_AS(ferry::restore_state(b, ferry::pipeline_state::from_bytes(bad.to_bytes())),
                         doctest::Contains("interleave: a damaged state"), ferry::config_error);
    bad.words[bad.words.size() - 3] = 0;  // none: a table a save writes
    auto c = make();
    CHECK_NOTHROW(ferry::restore_state(c, ferry::pipeline_state::from_bytes(bad.to_bytes())));
  }
  // The state as saved restores exactly.
  auto b = make();
  ferry::restore_state(b, st);
  for (int i = 0; i < 50; ++i) CHECK(b.next() == a.next());
}

TEST_CASE("interleave(fn): an anchor far back (one long source among many short ones) restores exactly" *
          doctest::timeout(60)) {
  watchdog w(60s);
  // Element 0's source is 400 long, every other one 1 long: with cycle 2, slot 0 stays open
  // while slot 1 opens and ends hundreds of sources, so the anchor stays at element 0.
  auto make = [] {
    return ferry::from_generator(1000, [](std::uint64_t i) { return i; }) |
           ferry::interleave(
               [](std::uint64_t x) { return ferry::from_generator(x == 0 ? 400 : 1, [x](std::uint64_t j) { return x * 1000 + j; }); },
               {.workers = 0, .block = 1, .cycle = 2});
  };
  std::vector<std::uint64_t> all;
  {
    auto p = make();
    while (auto e = p.next()) all.push_back(*e);
  }
  REQUIRE(all.size() == 400 + 999);
  for (std::size_t k : {std::size_t(1), std::size_t(100), std::size_t(500), std::size_t(790), std::size_t(1000)}) {
    CAPTURE(k);
    auto p = make();
    for (std::size_t i = 0; i < k; ++i) REQUIRE(p.next());
    const auto st = ferry::save_state(p);
    auto q = make();
    ferry::restore_state(q, st);
    std::vector<std::uint64_t> rest;
    while (auto e = q.next()) rest.push_back(*e);
    CHECK(rest == std::vector<std::uint64_t>(all.begin() + static_cast<std::ptrdiff_t>(k), all.end()));
  }
}

// interleave(fn)'s replay swallowed every upstream error among the pulls it re-reads (the
// consumer had them before the save), also at a pull that opened a slot when the state was
// saved: a source that fails there now (a file changed or unreadable since) lost that slot's
// elements with no error at all. Such an error, or fn's, now reaches next() and marks the
// stage as a failed restore, as a refused state does; a good restore or rewind() clears it.
TEST_CASE("interleave(fn): a replayed pull that opened a slot and now throws is an error, not a lost slot" *
          doctest::timeout(60)) {
  watchdog w(60s);
  const auto part_way = doctest::Contains("a restore or rewind() of this pipeline failed part way");
  bool up_fails = false, fn_fails = false;
  auto make = [&] {
    return ferry::from_generator(20,
                                 [&](std::uint64_t i) {
                                   if (up_fails && i == 1) throw std::runtime_error("element 1 unreadable now");
                                   return i;
                                 }) |
           ferry::interleave(
               [&](std::uint64_t x) {
                 if (fn_fails && x == 1) throw std::runtime_error("fn fails on 1 now");
                 return ferry::from_generator(3, [x](std::uint64_t j) { return x * 10 + j; });
               },
               {.workers = 0, .block = 1, .cycle = 2});
  };
  std::vector<std::uint64_t> all;
  {
    auto p = make();
    while (auto e = p.next()) all.push_back(*e);
  }
  REQUIRE(all.size() == 60);
  auto a = make();
  for (int i = 0; i < 3; ++i) REQUIRE(a.next());  // 0, 10, 1: slots open at pulls 0 and 1
  const auto st = ferry::save_state(a);
  const std::vector<std::uint64_t> rest(all.begin() + 3, all.end());
  for (bool* fails : {&up_fails, &fn_fails}) {
    CAPTURE(fails == &up_fails ? "the upstream's pull" : "fn");
    *fails = true;
    auto b = make();
    ferry::restore_state(b, st);
    CHECK_THROWS_WITH(b.next(), doctest::Contains("now"));
    CHECK_THROWS_WITH_AS(b.next(), part_way, ferry::config_error);
    CHECK_THROWS_WITH_AS(ferry::save_state(b), part_way, ferry::config_error);
    *fails = false;
    ferry::restore_state(b, st);  // a good restore clears the mark
    CHECK(drain(b) == rest);
    *fails = true;
    auto c = make();
    ferry::restore_state(c, st);
    CHECK_THROWS(c.next());
    *fails = false;
    c.rewind();
    CHECK(drain(c) == all);
  }
}

// Found by mutation testing (a changed bound, a check or a saved field dropped, each passing
// the suite before): a restored interleave(fn) saved again (restore, one element, save,
// restore) must go on exactly: the replayed slots' distances were not checked by any test.
TEST_CASE("interleave(fn): save, restore, take one, save again, restore again: exact" * doctest::timeout(60)) {
  watchdog w(60s);
  std::vector<std::uint64_t> up(12);
  for (std::uint64_t i = 0; i < 12; ++i) up[i] = i;
  auto make = [&] {
    return ferry::from_range(up) |
           ferry::interleave([](std::uint64_t x) { return ferry::from_generator(x % 5 + 1, [x](std::uint64_t j) { return x * 100 + j; }); },
                             {.workers = 0, .block = 2, .cycle = 3});
  };
  std::vector<std::uint64_t> all;
  {
    auto p = make();
    all = drain(p);
  }
  for (std::size_t k = 0; k + 1 < all.size(); ++k) {
    CAPTURE(k);
    auto a = make();
    for (std::size_t i = 0; i < k; ++i) REQUIRE(a.next());
    auto b = make();
    ferry::restore_state(b, ferry::save_state(a));
    REQUIRE(b.next() == all[k]);
    auto c = make();
    ferry::restore_state(c, ferry::save_state(b));
    CHECK(drain(c) == std::vector<std::uint64_t>(all.begin() + std::ptrdiff_t(k + 1), all.end()));
  }
}

// A source whose rewind() throws while armed (a file that cannot be reopened).
class rewind_fails : public ferry::source_interface<rewind_fails> {
 public:
  using value_type = std::uint64_t;
  explicit rewind_fails(const bool* armed) : armed_(armed) {}
  std::optional<std::uint64_t> next() {
    if (i_ >= 40) return std::nullopt;
    return i_++;
  }
  void rewind() {
    if (*armed_) throw std::runtime_error("cannot reopen");
    i_ = 0;
  }

 private:
  const bool* armed_;
  std::uint64_t i_ = 0;
};

// A rewind() that throws in the upstream stopped a prefetch's or a parallel map's threads
// and started no epoch: the next next() waited for ever on a queue nothing fills (an
// interleave(fn) restarted its slots from wherever the upstream was). Now every stage it
// throws through is marked: next() and save() throw config_error until a rewind() that
// succeeds, which gives a whole epoch.
TEST_CASE("a rewind() that throws part way marks the pipeline: next() throws, not waits; the next rewind() recovers" *
          doctest::timeout(60)) {
  watchdog w(60s);
  const auto part_way = doctest::Contains("a restore or rewind() of this pipeline failed part way");
  bool armed = false;
  const auto check = [&](auto p, const char* what, std::size_t per_epoch) {
    CAPTURE(what);
    armed = false;
    std::size_t n = 0;
    REQUIRE(p.next());  // threads started, reading ahead
    REQUIRE(p.next());
    armed = true;
    CHECK_THROWS_WITH(p.rewind(), doctest::Contains("cannot reopen"));
    CHECK_THROWS_WITH_AS((void)p.next(), part_way, ferry::config_error);
    CHECK_THROWS_WITH_AS((void)p.next(), part_way, ferry::config_error);
    armed = false;
    p.rewind();
    while (p.next()) ++n;
    CHECK(n == per_epoch);
  };
  const auto src = [&] { return rewind_fails(&armed); };
  check(src() | ferry::prefetch(2), "prefetch", 40);
  check(src() | ferry::map([](std::uint64_t x) { return x + 1; }, {.workers = 2, .window = 4}), "map, 2 workers", 40);
  check(src() | ferry::map([](std::uint64_t x) { return x + 1; }, {.workers = 2, .window = 4}) | ferry::batch(8),
        "map, 2 workers | batch", 5);
  check(src() | ferry::interleave([](std::uint64_t x) { return ferry::from_generator(2, [x](std::uint64_t j) { return x * 10 + j; }); },
                                  {.workers = 2, .block = 1, .cycle = 3}),
        "interleave(fn), 2 workers", 80);
  check(src() | ferry::prefetch(2) | ferry::shuffle(8, 1) | ferry::prefetch(1), "prefetch | shuffle | prefetch", 40);
  check(src() | ferry::cache(), "cache, a pass part way (its own rewind)", 40);

  // repeat rewinds its upstream as it hands out elements: a rewind that throws there marks
  // repeat too (it skipped the check, and the pass after came out empty).
  armed = false;
  auto r = src() | ferry::prefetch(2) | ferry::repeat(2);
  for (int i = 0; i < 40; ++i) REQUIRE(r.next());
  armed = true;
  CHECK_THROWS_WITH(r.next(), doctest::Contains("cannot reopen"));
  CHECK_THROWS_WITH_AS((void)r.next(), part_way, ferry::config_error);
  armed = false;
  r.rewind();
  std::size_t n = 0;
  while (r.next()) ++n;
  CHECK(n == 80);
}
