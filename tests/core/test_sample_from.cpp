// sample_from: the order equals a naive oracle of the documented draw rule (over random
// source counts, lengths, weights, errors and both end rules, in the pack and list forms),
// shares match the weights, determinism per (seed, epoch), errors pass through with
// nothing lost, resume is exact at every position, bad options and states are refused,
// threaded upstreams, no allocation per draw, stats and buffer resources reach every source.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <memory_resource>
#include <new>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/doubles.hpp"
#include "failing_source.hpp"
#include "take_skip.hpp"
#include "ferry/ferry.hpp"
#include "ferry/stages/sample_from.hpp"

using namespace std::chrono_literals;
using ferry_test::drain;
using ferry_test::event;
using ferry_test::events;
using ferry_test::resumes_everywhere;
using ferry_test::watchdog;

// Counts heap allocations, to show a draw allocates nothing. (malloc and free behind
// calls g++ does not inline, so it does not take the replaced operators for a new/free
// mismatch.)
namespace {
std::atomic<std::uint64_t> allocations{0};
[[gnu::noinline]] void* counted_malloc(std::size_t n) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(n ? n : 1);
}
[[gnu::noinline]] void counted_free(void* p) noexcept { std::free(p); }
}  // namespace
void* operator new(std::size_t n) {
  if (void* p = counted_malloc(n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { counted_free(p); }
void operator delete(void* p, std::size_t) noexcept { counted_free(p); }

namespace {

// Element i of source k is k * stride + i: the value says which source gave it.
constexpr std::uint64_t stride = 1'000'000;

// What each source's next() saw: calls in all, and calls that returned the end.
struct call_counts {
  std::uint64_t calls = 0, ends = 0;
};

// Source k: n elements k * stride + i; at an index in `fails` next() uses the element up
// and throws std::runtime_error("s<k>: failed at <i>") (as failing_source named "s<k>").
// Rewindable, resumable, and counts its calls.
class lane_source : public ferry::source_interface<lane_source> {
 public:
  using value_type = std::uint64_t;
  lane_source(std::uint64_t k, std::uint64_t n, std::vector<std::uint64_t> fails = {})
      : k_(k), n_(n), fails_(std::move(fails)), counts_(std::make_shared<call_counts>()) {}
  std::optional<value_type> next() {
    ++counts_->calls;
    if (i_ >= n_) {
      ++counts_->ends;
      return std::nullopt;
    }
    const std::uint64_t i = i_++;
    if (std::find(fails_.begin(), fails_.end(), i) != fails_.end())
      throw std::runtime_error("s" + std::to_string(k_) + ": failed at " + std::to_string(i));
    return k_ * stride + i;
  }
  void rewind() { i_ = 0; }
  void save(ferry::state_writer& w) const {
    w.tag("lane");
    w.put(i_);
  }
  void restore(ferry::state_reader& r) {
    r.expect("lane");
    i_ = r.get();
  }
  std::shared_ptr<call_counts> counts() const { return counts_; }

 private:
  std::uint64_t k_, n_;
  std::vector<std::uint64_t> fails_;
  std::shared_ptr<call_counts> counts_;
  std::uint64_t i_ = 0;
};

struct lane {
  std::uint64_t n = 0;
  std::vector<std::uint64_t> fails;
};

// The oracle: the documented draw rule, restated over plain vectors. Each draw takes the
// next output of SplitMix64 seeded with mix_seed({seed, epoch}), recounts the active
// sources and their sum from scratch, and walks their cumulative weights.
std::vector<std::string> oracle(const std::vector<lane>& lanes, std::vector<double> w, std::uint64_t seed,
                                std::uint64_t epoch, bool stop_on_empty) {
  const std::size_t n = lanes.size();
  if (w.empty()) w.assign(n, 1.0);
  ferry::detail::splitmix64 g(ferry::detail::mix_seed({seed, epoch}));
  std::vector<std::uint64_t> pos(n, 0);
  std::vector<bool> ended(n, false);
  std::vector<std::string> out;
  for (;;) {
    std::vector<std::size_t> act;
    double total = 0;
    for (std::size_t k = 0; k < n; ++k)
      if (w[k] > 0 && !ended[k]) {
        act.push_back(k);
        total += w[k];
      }
    if (act.empty()) break;
    const double x = double(g() >> 11) * 0x1.0p-53 * total;
    std::size_t pick = act.back();
    double acc = 0;
    for (std::size_t k : act) {
      acc += w[k];
      if (x < acc) {
        pick = k;
        break;
      }
    }
    if (pos[pick] == lanes[pick].n) {
      ended[pick] = true;
      if (stop_on_empty) break;
      continue;
    }
    const std::uint64_t i = pos[pick]++;
    const auto& f = lanes[pick].fails;
    if (std::find(f.begin(), f.end(), i) != f.end())
      out.push_back("!s" + std::to_string(pick) + ": failed at " + std::to_string(i));
    else
      out.push_back(std::to_string(pick * stride + i));
  }
  return out;
}

std::vector<lane_source> make_lanes(const std::vector<lane>& lanes) {
  std::vector<lane_source> v;
  for (std::size_t k = 0; k < lanes.size(); ++k) v.emplace_back(k, lanes[k].n, lanes[k].fails);
  return v;
}

// The pack form over the first N lanes; source 0 behind a take, so the pack's types differ.
template <std::size_t... I>
auto pack_of(ferry::sample_from_options o, std::vector<lane_source>& v, std::index_sequence<I...>) {
  return ferry::sample_from(std::move(o), std::move(v[0]) | ferry::take(std::numeric_limits<std::uint64_t>::max()),
                            std::move(v[I + 1])...);
}
template <std::size_t N>
auto pack_of(ferry::sample_from_options o, std::vector<lane_source>& v) {
  return pack_of(std::move(o), v, std::make_index_sequence<N - 1>{});
}

// Events of `epochs` epochs of the pack form (rewind() between them), for 1 to 5 lanes.
std::vector<std::vector<std::string>> pack_events(const ferry::sample_from_options& o, const std::vector<lane>& lanes,
                                                  int epochs) {
  auto v = make_lanes(lanes);
  auto run = [&](auto p) {
    std::vector<std::vector<std::string>> out;
    for (int e = 0; e < epochs; ++e) {
      if (e > 0) p.rewind();
      out.push_back(events(p));
    }
    return out;
  };
  switch (lanes.size()) {
    case 1: return run(pack_of<1>(o, v));
    case 2: return run(pack_of<2>(o, v));
    case 3: return run(pack_of<3>(o, v));
    case 4: return run(pack_of<4>(o, v));
    case 5: return run(pack_of<5>(o, v));
  }
  FAIL("pack_events: 1 to 5 lanes");
  return {};
}

// A random case: 1 to 5 sources, lengths 0 to 40 (0 often), weights with zeros (or none
// given), a few failing indices.
struct random_case {
  std::vector<lane> lanes;
  std::vector<double> weights;
};
random_case random_mix(ferry::detail::splitmix64& g) {
  random_case c;
  const std::size_t n = 1 + g.below(5);
  for (std::size_t k = 0; k < n; ++k) {
    lane l;
    l.n = g.below(4) == 0 ? 0 : g.below(41);
    for (std::uint64_t f = g.below(3); f > 0 && l.n > 0; --f) l.fails.push_back(g.below(l.n));
    c.lanes.push_back(l);
  }
  if (g.below(4) != 0) {
    for (std::size_t k = 0; k < n; ++k) c.weights.push_back(g.below(3) == 0 ? 0.0 : double(1 + g.below(1000)) / 100);
    if (std::all_of(c.weights.begin(), c.weights.end(), [](double w) { return w == 0; }))
      c.weights[g.below(n)] = 0.25;
  }
  return c;
}

// The source each value came from (values only; errors skipped).
std::vector<std::uint64_t> lanes_of(const std::vector<std::string>& ev) {
  std::vector<std::uint64_t> out;
  for (const auto& e : ev)
    if (e[0] != '!') out.push_back(std::stoull(e) / stride);
  return out;
}

}  // namespace

TEST_CASE("property: the order equals the oracle's, pack and list forms, both end rules, over epochs") {
  ferry::detail::splitmix64 g(2024);
  for (int round = 0; round < 600; ++round) {
    const random_case c = random_mix(g);
    const std::uint64_t seed = g();
    const bool stop = round % 2 == 1;
    CAPTURE(round);
    CAPTURE(c.lanes.size());
    CAPTURE(stop);
    const ferry::sample_from_options o{.weights = c.weights, .seed = seed, .stop_on_empty = stop};

    auto v = make_lanes(c.lanes);
    std::vector<std::shared_ptr<call_counts>> counts;
    for (auto& s : v) counts.push_back(s.counts());
    auto p = ferry::sample_from(o, std::move(v));
    const int epochs = 3;
    for (int e = 0; e < epochs; ++e) {
      CAPTURE(e);
      if (e > 0) p.rewind();
      CHECK(p.epoch() == std::uint64_t(e));
      CHECK(events(p) == oracle(c.lanes, c.weights, seed, std::uint64_t(e), stop));
      CHECK_FALSE(p.next());  // stays at the end, calling no source
    }
    for (std::size_t k = 0; k < counts.size(); ++k) {
      CAPTURE(k);
      CHECK(counts[k]->ends <= std::uint64_t(epochs));  // an ended source is not called again
      if (!c.weights.empty() && c.weights[k] == 0) CHECK(counts[k]->calls == 0);  // never read
    }

    const auto packed = pack_events(o, c.lanes, 2);
    for (std::uint64_t e = 0; e < 2; ++e) CHECK(packed[e] == oracle(c.lanes, c.weights, seed, e, stop));
  }
}

TEST_CASE("stop_on_empty: the epoch ends at the first draw that hits an ended source, the others unread") {
  // Source 0 is empty and drawn half the time: the epoch ends at its first draw.
  for (std::uint64_t seed = 0; seed < 50; ++seed) {
    CAPTURE(seed);
    const std::vector<lane> lanes{{0, {}}, {100, {}}};
    auto v = make_lanes(lanes);
    auto p = ferry::sample_from({.seed = seed, .stop_on_empty = true}, std::move(v));
    const auto got = events(p);
    CHECK(got == oracle(lanes, {}, seed, 0, true));
    CHECK(got.size() < 30);  // 2^-30: the empty one is drawn long before
    for (const auto& e : got) CHECK(std::stoull(e) / stride == 1);
    // Without stop_on_empty the empty one is dropped and the other read to its end.
    auto q = ferry::sample_from({.seed = seed}, make_lanes(lanes));
    CHECK(events(q).size() == 100);
  }
  // Only zero-weight sources left: the epoch ends without reading them.
  auto v = make_lanes({{3, {}}, {5, {}}});
  auto zero = v[1].counts();
  auto p = ferry::sample_from({.weights = {1, 0}, .seed = 3}, std::move(v));
  CHECK(drain(p) == std::vector<std::uint64_t>{0, 1, 2});
  CHECK(zero->calls == 0);
}

TEST_CASE("statistics: each source's share is within 6 sigma of its weight") {
  struct mix_case {
    std::vector<double> weights;
    std::uint64_t seed;
  };
  const std::vector<mix_case> cases{{{0.7, 0.3}, 1},          {{1, 2, 3, 4}, 2},   {{0.01, 0.99}, 3},
                                    {{5, 0, 5}, 4},           {{}, 5},             {{1e-3, 1e-3, 2e-3}, 6},
                                    {{1e6, 1, 1e6, 3e6, 1e6}, 7}};
  constexpr std::uint64_t draws = 200'000;
  for (const auto& mc : cases) {
    CAPTURE(mc.seed);
    const std::size_t n = mc.weights.empty() ? 4 : mc.weights.size();
    std::vector<lane> lanes(n, lane{draws, {}});  // none ends within the run
    auto p = ferry::sample_from({.weights = mc.weights, .seed = mc.seed}, make_lanes(lanes));
    std::vector<std::uint64_t> count(n, 0);
    for (std::uint64_t d = 0; d < draws; ++d) ++count[*p.next() / stride];
    std::vector<double> w = mc.weights.empty() ? std::vector<double>(n, 1.0) : mc.weights;
    double total = 0;
    for (double x : w) total += x;
    for (std::size_t k = 0; k < n; ++k) {
      CAPTURE(k);
      const double share = w[k] / total, expect = double(draws) * share;
      const double sigma = std::sqrt(double(draws) * share * (1 - share));
      CHECK(std::fabs(double(count[k]) - expect) <= 6 * sigma + 1);
      if (w[k] == 0) CHECK(count[k] == 0);
    }
  }
  // After a source ends, the others share its draws by their weights: sources 0 and 2
  // (weights 1 and 3) then split 1:3.
  auto p = ferry::sample_from({.weights = {1, 2, 3}, .seed = 9}, make_lanes({{draws, {}}, {100, {}}, {draws, {}}}));
  std::vector<std::uint64_t> count(3, 0);
  while (count[1] < 100) ++count[*p.next() / stride];
  const std::uint64_t before0 = count[0], before2 = count[2];
  constexpr std::uint64_t later = 100'000;
  for (std::uint64_t d = 0; d < later; ++d) ++count[*p.next() / stride];
  CHECK(count[1] == 100);
  const double got0 = double(count[0] - before0), sigma = std::sqrt(later * 0.25 * 0.75);
  CHECK(std::fabs(got0 - later * 0.25) <= 6 * sigma + 1);
  CHECK(count[2] - before2 == later - (count[0] - before0));
}

TEST_CASE("the same seed gives the same sequence; other seeds and other epochs differ") {
  const std::vector<lane> lanes{{1000, {}}, {1000, {}}, {1000, {}}};
  auto run = [&](std::uint64_t seed) {
    auto p = ferry::sample_from({.weights = {1, 1, 2}, .seed = seed}, make_lanes(lanes));
    std::vector<std::vector<std::uint64_t>> epochs;
    for (int e = 0; e < 3; ++e) {
      if (e > 0) p.rewind();
      epochs.push_back(lanes_of(events(p)));
    }
    return epochs;
  };
  const auto a = run(42), b = run(42), c = run(43);
  CHECK(a == b);
  CHECK(a[0].size() == 3000);
  for (int e = 0; e < 3; ++e) CHECK(a[e] != c[e]);
  CHECK(a[0] != a[1]);
  CHECK(a[1] != a[2]);
  CHECK(a[0] != a[2]);
  // rewind() mid-epoch starts the next epoch's sequence from its start.
  auto p = ferry::sample_from({.weights = {1, 1, 2}, .seed = 42}, make_lanes(lanes));
  for (int i = 0; i < 17; ++i) p.next();
  p.rewind();
  CHECK(lanes_of(events(p)) == a[1]);
  // The pack form draws the same sequence as the list form.
  auto v = make_lanes(lanes);
  auto q = ferry::sample_from({.weights = {1, 1, 2}, .seed = 42}, std::move(v[0]), std::move(v[1]), std::move(v[2]));
  CHECK(lanes_of(events(q)) == a[0]);
}

TEST_CASE("errors: a source's exception reaches the consumer unchanged; the rest arrives in the oracle's order") {
  // Source 0 is failing_source (named "s0", so its messages are the oracle's), at every
  // single position and at several; sources 1 and 2 are plain.
  constexpr std::uint64_t n0 = 12;
  std::vector<std::vector<std::uint64_t>> fail_sets;
  for (std::uint64_t k = 0; k < n0; ++k) fail_sets.push_back({k});
  fail_sets.push_back({0, 1, 2});
  fail_sets.push_back({0, n0 - 1});
  fail_sets.push_back({3, 4, 9, 10, 11});
  for (std::uint64_t k = 0; k < n0; ++k) fail_sets.back().push_back(k);  // every element fails
  for (const auto& fails : fail_sets)
    for (bool stop : {false, true})
      for (std::uint64_t seed : {1, 2, 3}) {
        CAPTURE(fails.size());
        CAPTURE(fails.front());
        CAPTURE(stop);
        CAPTURE(seed);
        const std::vector<lane> lanes{{n0, fails}, {8, {}}, {20, {}}};
        const ferry::sample_from_options o{.weights = {2, 1, 1}, .seed = seed, .stop_on_empty = stop};
        auto p = ferry::sample_from(o, ferry_test::failing_source(n0, fails).named("s0"), lane_source(1, 8),
                                    lane_source(2, 20));
        const auto want = oracle(lanes, o.weights, seed, 0, stop);
        CHECK(events(p) == want);
        p.rewind();
        CHECK(events(p) == oracle(lanes, o.weights, seed, 1, stop));
      }
  // The exception is the source's own object type and message, not wrapped.
  auto p = ferry::sample_from({}, ferry_test::failing_source(3, {0}).named("s0"));
  try {
    p.next();
    FAIL("no exception");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()) == "s0: failed at 0");
    CHECK(dynamic_cast<const ferry::error*>(&e) == nullptr);
  }
  CHECK(p.next() == std::optional<std::uint64_t>(1));  // the next call draws again
  CHECK(p.next() == std::optional<std::uint64_t>(2));
  CHECK_FALSE(p.next());
}

TEST_CASE("resume is exact at every position: after errors, after a source ended, both end rules, epochs") {
  struct shape {
    std::vector<lane> lanes;
    std::vector<double> weights;
    bool stop;
  };
  const std::vector<shape> shapes{
      {{{6, {1, 4}}, {3, {}}, {0, {}}}, {1, 2, 1}, false},  // an empty source, errors, ends mid-run
      {{{6, {1, 4}}, {3, {}}, {0, {}}}, {1, 2, 1}, true},
      {{{10, {}}, {2, {0, 1}}}, {}, false},  // a source of errors only
      {{{10, {}}, {2, {0, 1}}}, {}, true},
      {{{5, {}}, {7, {6}}, {4, {}}}, {0, 1, 1}, false},  // a zero-weight source
      {{{9, {0}}}, {}, true},                              // one source
  };
  for (const auto& sh : shapes)
    for (std::uint64_t seed : {5, 6}) {
      CAPTURE(sh.lanes.size());
      CAPTURE(sh.stop);
      CAPTURE(seed);
      const ferry::sample_from_options o{.weights = sh.weights, .seed = seed, .stop_on_empty = sh.stop};
      // Over two epochs, through repeat (which rewinds), the list form.
      auto make = [&] { return ferry::sample_from(o, make_lanes(sh.lanes)) | ferry::repeat(2); };
      auto ref = make();
      auto one = oracle(sh.lanes, sh.weights, seed, 0, sh.stop), two = oracle(sh.lanes, sh.weights, seed, 1, sh.stop);
      if (!one.empty()) one.insert(one.end(), two.begin(), two.end());  // an empty epoch stops repeat
      REQUIRE(events(ref) == one);
      resumes_everywhere(make);
    }
  // The pack form, with failing_source and a source behind a shuffle.
  auto make = [] {
    return ferry::sample_from({.weights = {3, 1}, .seed = 11},
                              ferry_test::failing_source(30, {0, 7, 29}).named("s0"),
                              ferry::from_generator(25, [](std::uint64_t i) { return stride + i; }) |
                                  ferry::shuffle(8, 4)) |
           ferry::repeat(2);
  };
  resumes_everywhere(make);
}

TEST_CASE("the checkpoint: every source's words, the tag, the count, epoch, draws, the ended bits") {
  auto p = ferry::sample_from({.weights = {1, 1}, .seed = 1, .stop_on_empty = false}, make_lanes({{2, {}}, {0, {}}}));
  const std::uint64_t lt = ferry::detail::stage_tag("lane"), st = ferry::detail::stage_tag("sample_from");
  CHECK(ferry::save_state(p).words == std::vector<std::uint64_t>{lt, 0, lt, 0, st, 2, 0, 0, 0});
  drain(p);
  const auto words = ferry::save_state(p).words;
  REQUIRE(words.size() == 9);
  CHECK(words[1] == 2);  // source 0 read to its end
  CHECK(words[3] == 0);
  CHECK(words[6] == 0);        // the epoch
  CHECK(words[7] == 4);        // two elements and two ends (an ended source is not drawn again)
  CHECK(words[8] == 0b11);     // both ended
  p.rewind();
  const auto again = ferry::save_state(p).words;
  CHECK(again == std::vector<std::uint64_t>{lt, 0, lt, 0, st, 2, 1, 0, 0});

  // 70 sources: the ended bits take two words.
  std::vector<lane> many(70, lane{1, {}});
  auto q = ferry::sample_from({}, make_lanes(many));
  CHECK(drain(q).size() == 70);
  const auto w70 = ferry::save_state(q).words;
  REQUIRE(w70.size() == 70 * 2 + 4 + 2);
  CHECK(w70[140 + 4] == ~std::uint64_t(0));
  CHECK(w70[140 + 5] == 0x3f);
  auto r = ferry::sample_from({}, make_lanes(many));
  ferry::restore_state(r, ferry::pipeline_state::from_bytes(ferry::save_state(q).to_bytes()));
  CHECK_FALSE(r.next());

  // Saved after stop_on_empty ended the epoch (source 0 is empty): restored, it is still
  // at the end, though source 1 has elements left; its next epoch is the oracle's.
  for (std::uint64_t seed = 0; seed < 10; ++seed) {
    CAPTURE(seed);
    const std::vector<lane> lanes{{0, {}}, {50, {}}};
    auto s = ferry::sample_from({.seed = seed, .stop_on_empty = true}, make_lanes(lanes));
    CHECK(events(s) == oracle(lanes, {}, seed, 0, true));
    const auto done = ferry::save_state(s);
    CHECK(done.words.back() == 0b01);
    auto s2 = ferry::sample_from({.seed = seed, .stop_on_empty = true}, make_lanes(lanes));
    ferry::restore_state(s2, ferry::pipeline_state::from_bytes(done.to_bytes()));
    CHECK_FALSE(s2.next());
    s2.rewind();
    CHECK(events(s2) == oracle(lanes, {}, seed, 1, true));
  }
}

TEST_CASE("restored under other weights, the sources' positions are exact: nothing lost, nothing twice") {
  const std::vector<lane> lanes{{40, {}}, {30, {}}, {20, {}}};
  for (std::size_t k : {0, 1, 25, 60, 89, 90}) {
    CAPTURE(k);
    auto a = ferry::sample_from({.weights = {1, 1, 1}, .seed = 1}, make_lanes(lanes));
    std::vector<std::uint64_t> seen;
    for (std::size_t i = 0; i < k; ++i) seen.push_back(*a.next());
    auto b = ferry::sample_from({.weights = {5, 0.5, 1}, .seed = 2}, make_lanes(lanes));
    ferry::restore_state(b, ferry::save_state(a));
    for (auto x : drain(b)) seen.push_back(x);
    std::sort(seen.begin(), seen.end());
    std::vector<std::uint64_t> all;
    for (std::uint64_t s = 0; s < 3; ++s)
      for (std::uint64_t i = 0; i < lanes[s].n; ++i) all.push_back(s * stride + i);
    CHECK(seen == all);
  }
}

TEST_CASE("a state of another source count or shape is a config_error") {
  auto two = ferry::sample_from({}, make_lanes({{4, {}}, {4, {}}}));
  two.next();
  const auto st = ferry::save_state(two);
  // Three sources: the third reads the sample_from tag as its own.
  auto three = ferry::sample_from({}, make_lanes({{4, {}}, {4, {}}, {4, {}}}));
  CHECK_THROWS_WITH_AS(ferry::restore_state(three, st), doctest::Contains("expected stage 'lane'"), ferry::config_error);
  // One source: the second source's words stand where the tag should.
  auto one = ferry::sample_from({}, make_lanes({{4, {}}}));
  CHECK_THROWS_WITH_AS(ferry::restore_state(one, st), doctest::Contains("expected stage 'sample_from'"),
                       ferry::config_error);
  // Another stage over the same sources.
  auto other = ferry::zip(lane_source(0, 4), lane_source(1, 4));
  CHECK_THROWS_WITH_AS(ferry::restore_state(other, st), doctest::Contains("expected stage 'zip'"), ferry::config_error);
  // A count word that does not match (words the sources' tags cannot catch).
  auto bad = st;
  bad.words[5] = 3;
  auto t = ferry::sample_from({}, make_lanes({{4, {}}, {4, {}}}));
  CHECK_THROWS_WITH_AS(ferry::restore_state(t, bad), "restore_state: sample_from: the state has 3 sources, this sample_from has 2",
                       ferry::config_error);
  // An ended bit past the last source.
  auto bits = st;
  bits.words[8] = 0b101;
  auto u = ferry::sample_from({}, make_lanes({{4, {}}, {4, {}}}));
  CHECK_THROWS_WITH_AS(ferry::restore_state(u, bits),
                       "restore_state: sample_from: the state marks source 2 as ended, but this sample_from has 2 sources",
                       ferry::config_error);
  // A state cut short.
  auto cut = st;
  cut.words.pop_back();
  auto c = ferry::sample_from({}, make_lanes({{4, {}}, {4, {}}}));
  CHECK_THROWS_WITH_AS(ferry::restore_state(c, cut), doctest::Contains("too short"), ferry::config_error);
  // The right shape restores.
  auto ok = ferry::sample_from({}, make_lanes({{4, {}}, {4, {}}}));
  ferry::restore_state(ok, st);
  CHECK(drain(ok).size() == 7);
}

TEST_CASE("bad options are config_errors naming the value") {
  auto two = [] { return make_lanes({{3, {}}, {3, {}}}); };
  auto refuse = [&](std::vector<double> w, const char* msg) {
    CAPTURE(msg);
    CHECK_THROWS_WITH_AS(ferry::sample_from({.weights = w}, two()), msg, ferry::config_error);
    auto v = two();
    CHECK_THROWS_WITH_AS(ferry::sample_from({.weights = w}, std::move(v[0]), std::move(v[1])), msg, ferry::config_error);
  };
  refuse({1, 2, 3}, "sample_from: 3 weights for 2 sources (give one weight per source, or none for equal weights)");
  refuse({1}, "sample_from: 1 weight for 2 sources (give one weight per source, or none for equal weights)");
  refuse({1, -0.5}, "sample_from: weight 1 is -0.5 (weights must be finite and >= 0)");
  refuse({std::nan(""), 1}, "sample_from: weight 0 is nan (weights must be finite and >= 0)");
  refuse({1, std::numeric_limits<double>::infinity()}, "sample_from: weight 1 is inf (weights must be finite and >= 0)");
  refuse({-std::numeric_limits<double>::infinity(), 1}, "sample_from: weight 0 is -inf (weights must be finite and >= 0)");
  refuse({0, 0}, "sample_from: every weight is 0 (at least one source needs a positive weight)");
  refuse({1.7e308, 1.7e308}, "sample_from: the weights sum to infinity (scale them down)");
  CHECK_THROWS_WITH_AS(ferry::sample_from({}, std::vector<lane_source>{}), "sample_from: no sources (give at least one)",
                       ferry::config_error);
  // A refused call leaves the sources unmoved.
  auto v = two();
  CHECK_THROWS_AS(ferry::sample_from({.weights = {0, 0}}, std::move(v[0]), std::move(v[1])), ferry::config_error);
  CHECK(v[0].next() == std::optional<std::uint64_t>(0));
  // Allowed: -0.0 counts as 0; tiny and mixed weights; one source.
  CHECK_NOTHROW(ferry::sample_from({.weights = {-0.0, 1}}, two()));
  CHECK_NOTHROW(ferry::sample_from({.weights = {1e-300, 1e300}}, two()));
  CHECK_NOTHROW(ferry::sample_from({.weights = {2}}, lane_source(0, 1)));
}

TEST_CASE("capabilities follow the sources: rewind and checkpoints need all of them") {
  using ok_t = decltype(ferry::sample_from({}, lane_source(0, 1), lane_source(1, 1)));
  static_assert(ferry::rewindable_source<ok_t> && ferry::resumable_source<ok_t>);
  static_assert(std::is_same_v<ferry::value_t<ok_t>, std::uint64_t>);
  using half_t = decltype(ferry::sample_from({}, lane_source(0, 1), ferry_test::throwing_source(1, 0)));
  static_assert(!ferry::rewindable_source<half_t> && !ferry::resumable_source<half_t>);
  using list_t = decltype(ferry::sample_from({}, std::vector<ferry_test::throwing_source>{}));
  static_assert(ferry::source<list_t> && !ferry::resumable_source<list_t>);
  // range-for works, and a non-resumable mix still runs.
  auto p = ferry::sample_from({.seed = 2}, lane_source(0, 3), ferry_test::throwing_source(2, 99));
  std::vector<std::uint64_t> got;
  for (auto x : p) got.push_back(x);
  std::sort(got.begin(), got.end());
  CHECK(got == std::vector<std::uint64_t>{0, 0, 1, 1, 2});
}

TEST_CASE("threaded upstreams: parallel map and prefetch feeding sources; order, errors, resume" *
          doctest::timeout(30)) {
  watchdog w(30s, "sample_from threaded upstreams");
  const std::vector<lane> lanes{{300, {}}, {200, {5, 150}}, {100, {}}};
  for (bool stop : {false, true})
    for (std::size_t workers : {2, 4}) {
      CAPTURE(stop);
      CAPTURE(workers);
      const ferry::sample_from_options o{.weights = {1, 2, 1}, .seed = 77, .stop_on_empty = stop};
      auto make = [&] {
        return ferry::sample_from(o,
                                  lane_source(0, 300) | ferry::map([](std::uint64_t x) { return x; }, {.workers = workers}),
                                  lane_source(1, 200, {5, 150}) | ferry::prefetch(2),
                                  lane_source(2, 100) | ferry::prefetch(1) |
                                      ferry::map([](std::uint64_t x) { return x; }, {.workers = 2}));
      };
      auto p = make();
      CHECK(events(p) == oracle(lanes, o.weights, 77, 0, stop));
      p.rewind();
      CHECK(events(p) == oracle(lanes, o.weights, 77, 1, stop));
      // Checkpoints every 37 events, through bytes.
      auto ref = make();
      const auto whole = events(ref);
      for (std::size_t k = 0; k <= whole.size(); k += 37) {
        CAPTURE(k);
        auto a = make();
        std::vector<std::string> got;
        for (std::size_t i = 0; i < k; ++i) got.push_back(*event(a));
        auto b = make();
        ferry::restore_state(b, ferry::pipeline_state::from_bytes(ferry::save_state(a).to_bytes()));
        auto rest = events(b);
        got.insert(got.end(), rest.begin(), rest.end());
        CHECK(got == whole);
      }
    }
  // Destroyed mid-epoch with threads running upstream: joins promptly.
  for (int i = 0; i < 20; ++i) {
    auto p = ferry::sample_from({}, lane_source(0, 100000) | ferry::prefetch(4),
                                lane_source(1, 100000) | ferry::map([](std::uint64_t x) { return x; }, {.workers = 3}));
    for (int k = 0; k < i; ++k) p.next();
  }
}

TEST_CASE("a draw allocates nothing") {
  std::vector<std::uint64_t> a(5000, 1), b(3000, 2), c(2000, 3);
  auto p = ferry::sample_from({.weights = {5, 3, 2}, .seed = 8}, ferry::from_range(std::span<const std::uint64_t>(a)),
                              ferry::from_range(std::span<const std::uint64_t>(b)),
                              ferry::from_range(std::span<const std::uint64_t>(c)));
  std::uint64_t sum = 0, n = 0;
  while (auto e = p.next()) sum += *e, ++n;  // the first epoch
  p.rewind();
  const std::uint64_t before = allocations.load();
  while (auto e = p.next()) sum += *e, ++n;
  const std::uint64_t during = allocations.load() - before;
  CHECK(during == 0);
  CHECK(n == 20000);
  CHECK(sum == 2 * (5000 + 3000 * 2 + 2000 * 3));
}

TEST_CASE("stats: every source's stages, then sample_from; its own time excludes every source's") {
  ferry::enable_stats(true);
  struct off {
    ~off() { ferry::enable_stats(false); }
  } guard;
  // Source 0 is slow (sleeps), source 1 fast: sample_from's own time must not include
  // source 0's, which is not the stage just before it in the report (source 1 is).
  auto slow = ferry::from_generator(100, [](std::uint64_t i) {
    std::this_thread::sleep_for(200us);
    return i;
  });
  auto p = ferry::sample_from({.seed = 3}, std::move(slow), lane_source(1, 100) | ferry::skip(0));
  const auto got = drain(p);
  CHECK(got.size() == 200);
  const auto rep = ferry::report(p);
  REQUIRE(rep.stages.size() == 4);
  CHECK(rep.stages[0].kind == "from_generator");  // it names itself (the stage base)
  CHECK(rep.stages[1].kind == "source");  // lane_source, timed by skip's probe
  CHECK(rep.stages[2].kind == "skip");
  CHECK(rep.stages[3].name == "sample_from");
  CHECK(rep.stages[0].elements == 100);
  CHECK(rep.stages[2].elements == 100);
  CHECK(rep.stages[3].elements == 200);
  CHECK(rep.stages[0].busy_s >= 100 * 150e-6);
  CHECK(rep.stages[3].busy_s < 0.25 * rep.stages[0].busy_s);
  CHECK(rep.bottleneck != "sample_from");
  // reset_stats zeroes sample_from's own counters too.
  ferry::reset_stats(p);
  ferry::enable_stats(false);
  const auto after = ferry::report(p);
  for (const auto& s : after.stages) CHECK(s.elements == 0);
}

namespace {
// A memory resource that counts the bytes it hands out, to show a batch stage used it.
class counting_resource : public std::pmr::memory_resource {
 public:
  std::atomic<std::uint64_t> allocated{0};

 private:
  void* do_allocate(std::size_t n, std::size_t a) override {
    allocated += n;
    return std::pmr::new_delete_resource()->allocate(n, a);
  }
  void do_deallocate(void* p, std::size_t n, std::size_t a) override {
    std::pmr::new_delete_resource()->deallocate(p, n, a);
  }
  bool do_is_equal(const std::pmr::memory_resource& o) const noexcept override { return this == &o; }
};
}  // namespace

TEST_CASE("set_buffer_resource reaches every source's batch stage") {
  auto batches = [](std::uint64_t k) {
    return ferry::from_generator(40, [k](std::uint64_t i) { return k * stride + i; }) | ferry::batch(8);
  };
  for (std::size_t drawn : {0, 1}) {
    CAPTURE(drawn);
    // Only source `drawn` is read (the other has weight 0), so its batches show whether
    // it got the resource; it is forwarded to both alike.
    auto r = std::make_shared<counting_resource>();
    auto p = ferry::sample_from({.weights = {drawn == 0 ? 1.0 : 0.0, drawn == 1 ? 1.0 : 0.0}}, batches(0), batches(1));
    CHECK(p.set_buffer_resource(r));
    std::size_t n = 0;
    while (auto b = p.next()) {
      CHECK(b->field()[0] / stride == drawn);
      ++n;
    }
    CHECK(n == 5);
    CHECK(r->allocated.load() > 0);
  }
  // Sources with no batch stage take nothing.
  auto plain = ferry::sample_from({}, lane_source(0, 1), lane_source(1, 1));
  CHECK_FALSE(plain.set_buffer_resource(std::make_shared<counting_resource>()));
}
