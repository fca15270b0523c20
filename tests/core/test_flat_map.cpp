// flat_map: hands out each element's range, in order, against a naive oracle (nested
// loops); empty ranges; parallel and prefetched upstreams; errors from fn, from the
// upstream and from a lazy range mid-iteration; resume at every output through bytes
// (mid-element, after errors, across anchors, over shuffle, prefetch and a parallel map);
// what a restore re-reads; rewind over epochs; views into the element; what is moved and
// what is copied.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <ranges>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/doubles.hpp"
#include "failing_source.hpp"
#include "take_skip.hpp"
#include "ferry/ferry.hpp"
#include "ferry/stages/flat_map.hpp"

using namespace std::chrono_literals;
using ferry_test::drain;
using ferry_test::event;
using ferry_test::events;
using ferry_test::resumes_everywhere;
using ferry_test::watchdog;

namespace {

using u64 = std::uint64_t;
using list = std::vector<u64>;

// How many outputs upstream element i makes under `seed`: 0 (three times in seven: runs
// of empty ranges are common) to 4.
u64 list_size(u64 seed, u64 i) {
  const u64 r = ferry::detail::splitmix64(ferry::detail::mix_seed({seed, i}))() % 7;
  return r < 3 ? 0 : r - 2;
}
// Output j of element i: unique, so any reordering or loss shows.
u64 out(u64 i, u64 j) { return i * 1000 + j; }
list make_list(u64 seed, u64 i) {
  list v(list_size(seed, i));
  for (u64 j = 0; j < v.size(); ++j) v[j] = out(i, j);
  return v;
}
auto lists(u64 n, u64 seed) {
  return ferry::from_generator(n, [seed](u64 i) { return make_list(seed, i); });
}

// The first element at or after `from` with at least `min` outputs.
u64 first_sized(u64 seed, u64 from, u64 min) {
  while (list_size(seed, from) < min) ++from;
  return from;
}

bool has(const std::vector<u64>& v, u64 x) { return std::find(v.begin(), v.end(), x) != v.end(); }

// What can go wrong where, for the oracle and the functions under test: the upstream fails
// at these indices (failing_source), fn throws on these elements (by value), and element
// i's lazy range throws at its output lazy_at[i].
struct faults {
  u64 seed = 1;
  std::vector<u64> up, fn;
  std::vector<std::pair<u64, u64>> lazy;
  const u64* lazy_at(u64 i) const {
    for (auto& [e, j] : lazy)
      if (e == i) return &j;
    return nullptr;
  }
};

// The oracle: nested loops over the upstream's events (an element's index as a number,
// or an error as "!what"). k counts elements, not errors.
std::vector<std::string> flatten(const std::vector<std::string>& up, const faults& f) {
  std::vector<std::string> ev;
  u64 k = 0;
  for (const std::string& e : up) {
    if (e[0] == '!') {
      ev.push_back(e);
      continue;
    }
    const u64 i = std::stoull(e);
    const std::string at = "!flat_map: user function threw at element " + std::to_string(k++) + ": ";
    if (has(f.fn, i)) {
      ev.push_back(at + "boom " + std::to_string(i));
      continue;
    }
    const u64* bad = f.lazy_at(i);
    const u64 size = list_size(f.seed, i);
    for (u64 j = 0; j < size; ++j) {
      if (bad && *bad == j) {
        ev.push_back(at + "lazy " + std::to_string(i) + " " + std::to_string(j));
        break;
      }
      ev.push_back(std::to_string(out(i, j)));
    }
  }
  return ev;
}
std::vector<std::string> naive(u64 n, const faults& f) { return flatten(ferry_test::naive(n, f.up), f); }
std::vector<u64> naive_values(u64 n, u64 seed) {
  std::vector<u64> v;
  for (u64 i = 0; i < n; ++i)
    for (u64 x : make_list(seed, i)) v.push_back(x);
  return v;
}

// fn over the index: a lazy view (iota | transform) that throws where `f` says.
auto lazy_fn(faults f) {
  return [f](const u64& i) {
    if (has(f.fn, i)) throw std::runtime_error("boom " + std::to_string(i));
    const u64* p = f.lazy_at(i);
    const u64 bad = p ? *p : ~u64(0);
    return std::views::iota(u64(0), list_size(f.seed, i)) | std::views::transform([i, bad](u64 j) {
             if (j == bad) throw std::runtime_error("lazy " + std::to_string(i) + " " + std::to_string(j));
             return out(i, j);
           });
  };
}
// The same through a filter view: its begin() and ++ call the predicate, so the lazy
// error comes from opening the range or stepping it, not from reading an output.
auto filter_fn(faults f) {
  return [f](const u64& i) {
    if (has(f.fn, i)) throw std::runtime_error("boom " + std::to_string(i));
    const u64* p = f.lazy_at(i);
    const u64 bad = p ? *p : ~u64(0);
    return std::views::iota(u64(0), list_size(f.seed, i)) | std::views::filter([i, bad](u64 j) {
             if (j == bad) throw std::runtime_error("lazy " + std::to_string(i) + " " + std::to_string(j));
             return true;
           }) |
           std::views::transform([i](u64 j) { return out(i, j); });
  };
}
// fn over the index returning a std::vector by value.
auto vector_fn(faults f) {
  return [f](const u64& i) {
    if (has(f.fn, i)) throw std::runtime_error("boom " + std::to_string(i));
    return make_list(f.seed, i);
  };
}

std::vector<std::string> show_all(const std::vector<u64>& v) {
  std::vector<std::string> s;
  for (u64 x : v) s.push_back(std::to_string(x));
  return s;
}

// Random faults over n elements.
faults random_faults(ferry::detail::splitmix64& g, u64 n, u64 seed) {
  faults f;
  f.seed = seed;
  if (n == 0) return f;
  for (u64 c = g.below(4); c > 0; --c) f.up.push_back(g.below(n));
  for (u64 c = g.below(4); c > 0; --c) f.fn.push_back(g.below(n));
  for (u64 c = g.below(4); c > 0; --c) f.lazy.emplace_back(g.below(n), g.below(4));
  return f;
}

}  // namespace

TEST_CASE("flat_map equals nested loops: random sizes, empty ranges, empty upstream; every range kind") {
  ferry::detail::splitmix64 g(3);
  for (int round = 0; round < 300; ++round) {
    const u64 seed = g();
    const u64 n = round % 10 == 0 ? 0 : g.below(120);
    CAPTURE(seed);
    CAPTURE(n);
    const auto want = naive_values(n, seed);
    auto a = lists(n, seed) | ferry::flat_map(std::identity{});  // elements already ranges
    CHECK(drain(a) == want);
    CHECK_FALSE(a.next());  // stays at the end
    auto b = ferry::flat_map(lists(n, seed), [](const list& v) { return v; });  // the call form
    std::vector<u64> got;
    for (u64 x : b) got.push_back(x);  // range-for
    CHECK(got == want);
    auto c = ferry::from_generator(n, [](u64 i) { return i; }) | ferry::flat_map(lazy_fn(faults{.seed = seed, .up = {}, .fn = {}, .lazy = {}}));
    CHECK(drain(c) == want);
    auto d = lists(n, seed) | ferry::flat_map([](const list& v) { return std::span<const u64>(v); });
    CHECK(drain(d) == want);
    auto e = lists(n, seed) | ferry::flat_map([](list& v) { return std::views::transform(v, [](u64 x) { return x; }); });
    CHECK(drain(e) == want);
  }
}

TEST_CASE("fixed-size ranges, all-empty upstreams, ranges of other types, chains of closures") {
  // A std::array per element: value_type is the array's element type.
  auto a = ferry::from_generator(5, [](u64 i) { return i; }) |
           ferry::flat_map([](u64 i) { return std::array<std::uint32_t, 3>{std::uint32_t(i), 7, std::uint32_t(i * 2)}; });
  static_assert(std::is_same_v<ferry::value_t<decltype(a)>, std::uint32_t>);
  std::vector<std::uint32_t> want;
  for (std::uint32_t i = 0; i < 5; ++i) want.insert(want.end(), {i, 7, i * 2});
  CHECK(drain(a) == want);
  // Every range empty: the end, with no recursion however many there are.
  ferry_test::counting_source src(200000);
  auto calls = src.calls();
  auto e = std::move(src) | ferry::flat_map([](u64) { return std::array<int, 0>{}; });
  CHECK_FALSE(e.next());
  CHECK(*calls == 200001);
  // Strings out of string elements (const view, so copied), and value_type drops const.
  auto s = ferry::from_range(std::vector<std::string>{"ab", "", "c"}) |
           ferry::flat_map([](const std::string& x) { return std::string_view(x); });
  static_assert(std::is_same_v<ferry::value_t<decltype(s)>, char>);
  CHECK(drain(s) == std::vector<char>{'a', 'b', 'c'});
  // A reusable chain: flat_map | batch, applied twice.
  auto chain = ferry::flat_map(std::identity{}) | ferry::batch(4);
  for (int twice = 0; twice < 2; ++twice) {
    auto p = lists(50, 9) | chain;
    std::vector<u64> got;
    while (auto b = p.next())
      for (u64 x : b->field()) got.push_back(x);
    CHECK(got == naive_values(50, 9));
  }
}

TEST_CASE("flat_map is lazy, pulls one element at a time, calls fn once per element") {
  ferry_test::counting_source src(10);
  auto calls = src.calls();
  auto fn_calls = std::make_shared<int>(0);
  auto p = std::move(src) | ferry::flat_map([fn_calls](u64 i) {
             ++*fn_calls;
             return list(i % 3, i);  // sizes 0, 1, 2, 0, 1, 2, ...
           });
  CHECK(*calls == 0);
  CHECK(p.next() == std::optional<u64>(1));  // element 0 is empty
  CHECK(*calls == 2);
  CHECK(*fn_calls == 2);
  CHECK(p.next() == std::optional<u64>(2));
  CHECK(p.next() == std::optional<u64>(2));
  CHECK(*calls == 3);  // element 2's two outputs from one pull, one fn call
  CHECK(*fn_calls == 3);
  CHECK(p.next() == std::optional<u64>(4));
  CHECK(*calls == 5);
}

TEST_CASE("over a parallel map and a prefetch, and under a prefetch: the same sequence" * doctest::timeout(30)) {
  watchdog w(30s);
  ferry::detail::splitmix64 g(5);
  for (int round = 0; round < 30; ++round) {
    const u64 seed = g(), n = round % 5 == 0 ? 0 : g.below(400);
    CAPTURE(seed);
    CAPTURE(n);
    const auto want = naive_values(n, seed);
    auto m = ferry::from_generator(n, [](u64 i) { return i; }) |
             ferry::map([seed](u64 i) { return make_list(seed, i); }, {.workers = 3}) | ferry::flat_map(std::identity{});
    CHECK(drain(m) == want);
    auto pf = lists(n, seed) | ferry::prefetch(2) | ferry::flat_map([](const list& v) { return std::span(v); });
    CHECK(drain(pf) == want);
    auto under = lists(n, seed) | ferry::flat_map(std::identity{}) | ferry::prefetch(3);
    CHECK(drain(under) == want);
  }
}

TEST_CASE("fn throwing: element_error naming the element, original nested; the rest all arrive") {
  struct boom : std::runtime_error {
    using std::runtime_error::runtime_error;
  };
  for (u64 k : {0, 1, 5, 19}) {
    CAPTURE(k);
    auto p = ferry::from_generator(20, [](u64 i) { return i; }) | ferry::flat_map([k](u64 i) {
               if (i == k) throw boom("bad " + std::to_string(i));
               return list{i, i};
             });
    std::vector<u64> got;
    int errors = 0;
    for (;;) {
      try {
        auto e = p.next();
        if (!e) break;
        got.push_back(*e);
      } catch (const ferry::element_error& e) {
        ++errors;
        CHECK(e.element() == k);
        CHECK(std::string(e.what()) == "flat_map: user function threw at element " + std::to_string(k) + ": bad " +
                                           std::to_string(k));
        bool nested = false;
        try {
          std::rethrow_if_nested(e);
        } catch (const boom& b) {
          nested = std::string(b.what()) == "bad " + std::to_string(k);
        }
        CHECK(nested);
      }
    }
    CHECK(errors == 1);
    std::vector<u64> want;
    for (u64 i = 0; i < 20; ++i)
      if (i != k) want.insert(want.end(), {i, i});
    CHECK(got == want);
  }
  // ferry's own errors pass through unchanged.
  auto q = ferry::from_generator(3, [](u64 i) { return i; }) | ferry::flat_map([](u64 i) {
             if (i == 1) throw ferry::format_error("f.rec", 64, "truncated record");
             return list{i};
           });
  CHECK(q.next() == std::optional<u64>(0));
  CHECK_THROWS_AS(q.next(), ferry::format_error);
  CHECK(q.next() == std::optional<u64>(2));
}

TEST_CASE("errors from fn, from the upstream and from a lazy range mid-iteration, against the oracle") {
  ferry::detail::splitmix64 g(7);
  for (int round = 0; round < 300; ++round) {
    const u64 n = round % 20 == 0 ? 0 : g.below(60);
    const faults f = random_faults(g, n, g());
    CAPTURE(n);
    CAPTURE(f.seed);
    const auto want = naive(n, f);
    auto a = ferry_test::failing_source(n, f.up) | ferry::flat_map(lazy_fn(f));
    CHECK(events(a) == want);
    auto b = ferry_test::failing_source(n, f.up) | ferry::flat_map(filter_fn(f));
    CHECK(events(b) == want);
    faults no_lazy = f;
    no_lazy.lazy.clear();
    auto c = ferry_test::failing_source(n, f.up) | ferry::flat_map(vector_fn(f));
    CHECK(events(c) == naive(n, no_lazy));
  }
  // Spot checks the oracle cannot get wrong with the code: an upstream error is no
  // element (3 is element 2), and a lazy error keeps the outputs before it.
  faults f{.seed = 0, .up = {1}, .fn = {3}, .lazy = {}};
  auto p = ferry_test::failing_source(5, f.up) |
           ferry::flat_map([](const u64& i) {
             if (i == 3) throw std::runtime_error("boom");
             return std::views::iota(u64(0), u64(3)) | std::views::transform([i](u64 j) {
                      if (i == 2 && j == 1) throw std::runtime_error("lazy");
                      return i * 10 + j;
                    });
           });
  CHECK(events(p) == std::vector<std::string>{"0", "1", "2", "!failed at 1", "20",
                                              "!flat_map: user function threw at element 1: lazy",
                                              "!flat_map: user function threw at element 2: boom", "40", "41", "42"});
}

TEST_CASE("resume is exact at every output: mid-element, after errors, across anchors, over epochs") {
  ferry::detail::splitmix64 g(11);
  // 300 upstream elements: several anchor refreshes (every 64 pulls) per epoch.
  for (u64 n : {0, 1, 7, 70, 300}) {
    for (int variant = 0; variant < 2; ++variant) {
      const faults f = random_faults(g, n, g());
      CAPTURE(n);
      CAPTURE(f.seed);
      CAPTURE(variant);
      auto make = [&] {
        return ferry_test::failing_source(n, f.up) | ferry::flat_map(lazy_fn(f)) | ferry::repeat(2);
      };
      auto ref = make();
      auto one = naive(n, f);
      auto want = one;
      want.insert(want.end(), one.begin(), one.end());
      if (one.empty()) want.clear();
      REQUIRE(events(ref) == want);
      if (variant == 0)
        resumes_everywhere(make);
      else
        resumes_everywhere([&] { return ferry_test::failing_source(n, f.up) | ferry::flat_map(filter_fn(f)); });
    }
  }
}

TEST_CASE("resume is exact over shuffle, from_generator, and under batch") {
  for (u64 seed : {1, 2}) {
    CAPTURE(seed);
    faults f{.seed = seed, .up = {4, 90}, .fn = {17}, .lazy = {}};
    f.lazy = {{first_sized(seed, 30, 2), 1}, {first_sized(seed, 60, 1), 0}};  // errors that do fire
    auto make = [&] {
      return ferry_test::failing_source(150, f.up) | ferry::shuffle(16, seed) | ferry::flat_map(lazy_fn(f)) |
             ferry::repeat(2);
    };
    // The oracle: flat_map's over shuffle's own events, epoch by epoch (k from 0 in each).
    auto order = ferry_test::failing_source(150, f.up) | ferry::shuffle(16, seed);
    auto want = flatten(events(order), f);
    order.rewind();
    const auto second = flatten(events(order), f);
    CHECK(want != second);  // a new order in the second epoch
    want.insert(want.end(), second.begin(), second.end());
    CHECK(std::count_if(want.begin(), want.end(), [](auto& e) { return e.find(": lazy") != e.npos; }) == 4);
    auto ref = make();
    REQUIRE(events(ref) == want);
    resumes_everywhere(make);
  }
  auto gen_make = [] { return lists(200, 4) | ferry::flat_map(std::identity{}) | ferry::repeat(2); };
  auto ref = gen_make();
  auto one = show_all(naive_values(200, 4));
  auto want = one;
  want.insert(want.end(), one.begin(), one.end());
  REQUIRE(events(ref) == want);
  resumes_everywhere(gen_make);
  // Under batch: each batch's state is flat_map's, mid-element mostly.
  resumes_everywhere([] { return lists(120, 6) | ferry::flat_map(std::identity{}) | ferry::batch(5); });
}

TEST_CASE("resume over a prefetch and an ordered parallel map upstream, and under a prefetch" *
          doctest::timeout(30)) {
  watchdog w(30s);
  resumes_everywhere([] { return lists(90, 12) | ferry::prefetch(2) | ferry::flat_map(std::identity{}); });
  // prefetch saves flat_map's state on its own thread, after every output.
  resumes_everywhere([] {
    const faults f{.seed = 14, .up = {5, 40}, .fn = {9}, .lazy = {{first_sized(14, 20, 2), 1}}};
    return ferry_test::failing_source(90, f.up) | ferry::flat_map(lazy_fn(f)) | ferry::prefetch(2);
  });
  resumes_everywhere([] {
    return ferry::from_generator(90, [](u64 i) { return i; }) |
           ferry::map([](u64 i) { return make_list(13, i); }, {.workers = 3, .window = 32}) |
           ferry::flat_map(std::identity{});
  });
}

TEST_CASE("a restore re-reads at most one anchor's worth of upstream and calls fn once") {
  for (u64 stop = 1; stop < 700; stop += 7) {
    CAPTURE(stop);
    auto fn_calls = std::make_shared<u64>(0);
    auto fn = [fn_calls](u64 i) {
      ++*fn_calls;
      return list(3, i);  // three outputs per element
    };
    auto p = ferry_test::counting_source(1000) | ferry::flat_map(fn);
    for (u64 i = 0; i < stop; ++i) REQUIRE(p.next() == std::optional<u64>(i / 3));
    const auto st = ferry::save_state(p);
    ferry_test::counting_source src(1000);
    auto calls = src.calls();
    auto q = std::move(src) | ferry::flat_map(fn);
    ferry::restore_state(q, ferry::pipeline_state::from_bytes(st.to_bytes()));
    CHECK(ferry::save_state(q) == st);  // restored, not yet replayed: the same state
    *fn_calls = 0;
    REQUIRE(q.next() == std::optional<u64>(stop / 3));
    // Element (stop - 1) / 3 is current; at most 64 pulls since the anchor, it included,
    // plus one more when stop ended the element (the next one is pulled then).
    const u64 current = (stop - 1) / 3;
    CHECK(*calls <= 64 + (stop % 3 == 0 ? 1 : 0));
    CHECK(*calls >= (current % 64) + 1);
    CHECK(*fn_calls == (stop % 3 == 0 ? 2 : 1));
  }
}

TEST_CASE("the checkpoint's words: the anchor or the upstream, the tag, pulls, outputs, elements") {
  const u64 up_tag = ferry::detail::stage_tag("counting"), tag = ferry::detail::stage_tag("flat_map");
  auto p = ferry_test::counting_source(10) | ferry::flat_map([](u64 i) {
             if (i == 1) throw std::runtime_error("no");
             return list(2, i);
           });
  auto words = [&] { return ferry::save_state(p).words; };
  CHECK(words() == std::vector<u64>{up_tag, 0, tag, 0, 0, 0});
  REQUIRE(p.next() == std::optional<u64>(0));
  CHECK(words() == std::vector<u64>{up_tag, 0, tag, 1, 1, 1});  // the anchor before element 0
  REQUIRE(p.next() == std::optional<u64>(0));
  CHECK(words() == std::vector<u64>{up_tag, 0, tag, 1, 2, 1});
  CHECK_THROWS_AS(p.next(), ferry::element_error);
  CHECK(words() == std::vector<u64>{up_tag, 2, tag, 0, 0, 2});  // a boundary: the upstream itself
  REQUIRE(p.next() == std::optional<u64>(2));
  CHECK(words() == std::vector<u64>{up_tag, 0, tag, 3, 1, 3});  // the anchor is still before element 0
}

TEST_CASE("a state of another shape, or a damaged one, is a config_error") {
  auto fm = ferry::from_generator(10, [](u64 i) { return i; }) | ferry::flat_map([](u64 i) { return list(2, i); });
  REQUIRE(fm.next());
  auto mp = ferry::from_generator(10, [](u64 i) { return i; }) | ferry::map([](u64 i) { return i; });
  REQUIRE(mp.next());
  auto fm2 = ferry::from_generator(10, [](u64 i) { return i; }) | ferry::flat_map([](u64 i) { return list(2, i); });
  CHECK_THROWS_WITH_AS(ferry::restore_state(fm2, ferry::save_state(mp)), doctest::Contains("'flat_map'"),
                       ferry::config_error);
  auto mp2 = ferry::from_generator(10, [](u64 i) { return i; }) | ferry::map([](u64 i) { return i; });
  CHECK_THROWS_WITH_AS(ferry::restore_state(mp2, ferry::save_state(fm)), doctest::Contains("'map'"),
                       ferry::config_error);
  // Outputs handed out of an element never pulled.
  auto st = ferry::save_state(fm);
  st.words[st.words.size() - 3] = 0;  // pulls since the anchor
  auto fm3 = ferry::from_generator(10, [](u64 i) { return i; }) | ferry::flat_map([](u64 i) { return list(2, i); });
  CHECK_THROWS_WITH_AS(ferry::restore_state(fm3, st), doctest::Contains("flat_map: a damaged state"),
                       ferry::config_error);
}

TEST_CASE("an upstream that cannot be saved (unordered parallel map): iteration goes on, save() says why" *
          doctest::timeout(30)) {
  watchdog w(30s);
  auto p = ferry::from_generator(500, [](u64 i) { return i; }) |
           ferry::map([](u64 i) { return make_list(21, i); }, {.workers = 3, .ordered = false}) |
           ferry::flat_map(std::identity{});
  std::vector<u64> got;
  for (int i = 0; i < 10; ++i) got.push_back(*p.next());
  CHECK_THROWS_WITH_AS(ferry::save_state(p), doctest::Contains("unordered"), ferry::config_error);
  while (auto e = p.next()) got.push_back(*e);
  auto want = naive_values(500, 21);
  std::sort(got.begin(), got.end());
  std::sort(want.begin(), want.end());
  CHECK(got == want);
}

TEST_CASE("rewind starts the epoch again, mid-element too; shuffle upstream: each epoch in its order") {
  for (u64 seed : {1, 8, 15}) {
    CAPTURE(seed);
    auto order = ferry::from_generator(120, [](u64 i) { return i; }) | ferry::shuffle(10, seed);
    auto p = ferry::from_generator(120, [](u64 i) { return i; }) | ferry::shuffle(10, seed) |
             ferry::flat_map([seed](const u64& i) { return make_list(seed, i); });
    ferry::detail::splitmix64 g(seed);
    for (int epoch = 0; epoch < 4; ++epoch) {
      CAPTURE(epoch);
      std::vector<u64> want;
      for (u64 i : drain(order))
        for (u64 x : make_list(seed, i)) want.push_back(x);
      REQUIRE(want.size() > 20);
      if (epoch % 2 == 1) {  // stop mid-epoch (mid-element, mostly), then rewind
        const u64 stop = 1 + g.below(want.size() - 1);
        for (u64 i = 0; i < stop; ++i) REQUIRE(p.next() == std::optional<u64>(want[i]));
        p.rewind();
        order.rewind();
        want.clear();
        for (u64 i : drain(order))
          for (u64 x : make_list(seed, i)) want.push_back(x);
      }
      CHECK(drain(p) == want);
      p.rewind();
      order.rewind();
    }
  }
  // Through repeat: three epochs, three orders, each the oracle's.
  auto r = ferry::from_generator(60, [](u64 i) { return i; }) | ferry::shuffle(7, 3) |
           ferry::flat_map([](const u64& i) { return make_list(3, i); }) | ferry::repeat(3);
  auto order = ferry::from_generator(60, [](u64 i) { return i; }) | ferry::shuffle(7, 3) | ferry::repeat(3);
  std::vector<u64> want;
  for (u64 i : drain(order))
    for (u64 x : make_list(3, i)) want.push_back(x);
  CHECK(drain(r) == want);
  static_assert(!ferry::rewindable_source<decltype(ferry_test::throwing_source(1, 0) |
                                                   ferry::flat_map([](u64 i) { return list{i}; }))>);
}

TEST_CASE("views into the element stay valid until its last output, also when the stage moves") {
  // Elements are heap vectors and strings; fn returns spans, string_views and transform
  // views of them. Run under ASan: a dangling view reads freed memory.
  ferry::detail::splitmix64 g(19);
  for (int round = 0; round < 50; ++round) {
    const u64 seed = g(), n = g.below(80);
    const auto want = naive_values(n, seed);
    auto make_a = [&] { return lists(n, seed) | ferry::flat_map([](const list& v) { return std::span(v); }); };
    auto make_b = [&] {
      return lists(n, seed) |
             ferry::flat_map([](list& v) { return v | std::views::transform([](u64& x) -> u64& { return x; }); });
    };
    // (On the heap, not in std::optional: GCC 12 warns falsely of an uninitialized
    // exception_ptr when a stage moves in and out of one, shuffle's as much as this one's.)
    auto a = std::make_unique<decltype(make_a())>(make_a());
    auto b = std::make_unique<decltype(make_b())>(make_b());
    std::vector<u64> ga, gb;
    // Move the pipelines between calls: the element and its range must not move with them.
    for (u64 i = 0; i < want.size(); ++i) {
      ga.push_back(*a->next());
      gb.push_back(*b->next());
      if (i % 3 == 1) {
        a = std::make_unique<decltype(make_a())>(std::move(*a));
        b = std::make_unique<decltype(make_b())>(std::move(*b));
      }
    }
    CHECK_FALSE(a->next());
    CHECK_FALSE(b->next());
    CHECK(ga == want);
    CHECK(gb == want);
  }
  auto make_s = [] {
    return ferry::from_generator(100, [](u64 i) { return std::string(i % 5 * 20, char('a' + i % 26)); }) |
           ferry::flat_map([](const std::string& x) { return std::string_view(x); });
  };
  auto s = std::make_unique<decltype(make_s())>(make_s());
  std::string got, want;
  for (u64 i = 0; i < 100; ++i) want += std::string(i % 5 * 20, char('a' + i % 26));
  while (auto c = s->next()) {
    got += *c;
    s = std::make_unique<decltype(make_s())>(std::move(*s));
  }
  CHECK(got == want);
}

namespace {
// Counts copies, to show which outputs flat_map moves and which it copies.
struct counted {
  static inline int copies = 0;
  std::string s;
  explicit counted(std::string x) : s(std::move(x)) {}
  counted(const counted& o) : s(o.s) { ++copies; }
  counted(counted&&) noexcept = default;
  counted& operator=(const counted& o) {
    s = o.s;
    ++copies;
    return *this;
  }
  counted& operator=(counted&&) noexcept = default;
};
std::vector<counted> counted_list(u64 i) {
  std::vector<counted> v;
  v.reserve(3);
  for (u64 j = 0; j < 3; ++j) v.emplace_back(std::to_string(out(i, j)) + " a string too long for SSO");
  return v;
}
template <class S>
std::vector<std::string> strings(S& s) {
  std::vector<std::string> v;
  while (auto e = s.next()) v.push_back(e->s);
  return v;
}
}  // namespace

TEST_CASE("outputs are moved out of what flat_map owns, copied out of anything else") {
  std::vector<std::string> want;
  for (u64 i = 0; i < 10; ++i)
    for (u64 j = 0; j < 3; ++j) want.push_back(std::to_string(out(i, j)) + " a string too long for SSO");
  auto src = [] { return ferry::from_generator(10, [](u64 i) { return counted_list(i); }); };
  auto run = [&](auto p) {
    counted::copies = 0;
    CHECK(strings(p) == want);
    return counted::copies;
  };
  CHECK(run(src() | ferry::flat_map(std::identity{})) == 0);  // the element itself
  CHECK(run(src() | ferry::flat_map([](std::vector<counted>& v) { return std::move(v); })) == 0);  // by value
  CHECK(run(src() | ferry::flat_map([](std::vector<counted>& v) { return std::span(v); })) == 30);  // a view
  struct rec {
    int id;
    std::vector<counted> items;
  };
  auto recs = ferry::from_generator(10, [](u64 i) { return rec{int(i), counted_list(i)}; });
  CHECK(run(std::move(recs) | ferry::flat_map([](rec& r) -> std::vector<counted>& { return r.items; })) == 0);
  // A reference to a table fn captured: copied, the table left whole (read twice here).
  std::vector<std::vector<counted>> table;
  for (u64 i = 0; i < 10; ++i) table.push_back(counted_list(i));
  auto from_table = [&] {
    return ferry::from_generator(10, [](u64 i) { return i; }) |
           ferry::flat_map([&table](u64 i) -> std::vector<counted>& { return table[i]; });
  };
  CHECK(run(from_table()) == 30);
  CHECK(run(from_table()) == 30);
}

TEST_CASE("stats: flat_map reports its outputs; buffer resource forwarded; capabilities follow the upstream") {
  ferry::enable_stats(true);
  struct off {
    ~off() { ferry::enable_stats(false); }
  } guard;
  auto p = lists(100, 2) | ferry::flat_map(std::identity{});
  const auto n = drain(p).size();
  const auto rep = ferry::report(p);
  REQUIRE(rep.stages.size() == 2);
  CHECK(rep.stages[0].elements == 100);
  CHECK(rep.stages[1].name == "flat_map");
  CHECK(rep.stages[1].elements == n);
  auto b = lists(100, 2) | ferry::batch(4) | ferry::flat_map([](const auto& batch) {
             return std::vector<std::size_t>(batch.size(), 1);
           });
  CHECK(b.set_buffer_resource(std::make_shared<ferry::buffer_pool>()));
  auto plain = lists(10, 2) | ferry::flat_map(std::identity{});
  CHECK_FALSE(plain.set_buffer_resource(std::make_shared<ferry::buffer_pool>()));
  using fm_t = decltype(plain);
  static_assert(ferry::rewindable_source<fm_t> && ferry::resumable_source<fm_t> && !ferry::bulk_source<fm_t>);
  using t_t = decltype(ferry_test::throwing_source(1, 0) | ferry::flat_map([](u64 i) { return list{i}; }));
  static_assert(!ferry::resumable_source<t_t>);
}
