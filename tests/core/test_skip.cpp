// skip: drops the first n elements of every epoch, against a naive oracle (drop the first
// n of a vector); over epochs (repeat, rewind), next_bulk (batch downstream, mixed calls),
// upstream errors (in place, not counted, nothing lost), resume at every position, and
// take(a) | skip(b).
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/doubles.hpp"
#include "failing_source.hpp"
#include "take_skip.hpp"
#include "ferry/ferry.hpp"

using ferry_test::bulk_double;
using ferry_test::drop;
using ferry_test::event;
using ferry_test::events;
using ferry_test::first;
using ferry_test::naive;
using ferry_test::resumes_everywhere;

using namespace std::chrono_literals;
using ferry_test::drain;
using ferry_test::watchdog;

// Counts heap allocations, to show skip's bulk path allocates nothing in steady state.
// (malloc and free behind calls g++ does not inline, so it does not take the replaced
// operators for a new/free mismatch.)
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

constexpr std::uint64_t all = std::numeric_limits<std::uint64_t>::max();

auto gen(std::uint64_t n) {
  return ferry::from_generator(n, [](std::uint64_t i) { return i; });
}

std::vector<std::uint64_t> iota(std::uint64_t n) {
  std::vector<std::uint64_t> v(n);
  for (std::uint64_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

// The oracle: the vector without its first n elements.
// Pulls with a random mix of next() and next_bulk(k) (k in [0, 9], 0 included) to the end
// of the epoch; every value, in order.
template <class S>
std::vector<std::uint64_t> drain_mixed(S& s, ferry::detail::splitmix64& g) {
  std::vector<std::uint64_t> out;
  std::vector<std::uint64_t> buf(9);
  for (;;) {
    if (g.below(3) == 0) {
      auto e = s.next();
      if (!e) break;
      out.push_back(*e);
    } else {
      const std::size_t want = g.below(10);
      const std::size_t k = s.next_bulk(std::span<std::uint64_t>(buf).first(want));
      REQUIRE(k <= want);
      out.insert(out.end(), buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(k));
      if (want > 0 && k < want) break;
    }
  }
  return out;
}

// Flattens a pipeline of batches (or of numbers) into the numbers, to the end of the epoch.
template <class S>
std::vector<std::uint64_t> flat(S& s) {
  std::vector<std::uint64_t> out;
  while (auto e = s.next()) {
    if constexpr (requires { e->field(); })
      for (auto x : e->field()) out.push_back(x);
    else
      out.push_back(*e);
  }
  return out;
}

// The oracle of skip(n) over events: errors stay where they are and do not count; the
// first n elements are dropped.
std::vector<std::string> skip_events(const std::vector<std::string>& ev, std::uint64_t n) {
  std::vector<std::string> out;
  std::uint64_t skipped = 0;
  for (const auto& e : ev) {
    if (e[0] == '!')
      out.push_back(e);
    else if (skipped < n)
      ++skipped;
    else
      out.push_back(e);
  }
  return out;
}

// A random set of failing indices in [0, size).
std::vector<std::uint64_t> random_fails(ferry::detail::splitmix64& g, std::uint64_t size) {
  std::vector<std::uint64_t> f;
  if (size == 0) return f;
  const std::uint64_t count = g.below(4);
  for (std::uint64_t i = 0; i < count; ++i) f.push_back(g.below(size));
  return f;
}

// Interesting skip counts for a dataset of `size`: 0, 1, size - 1, size, size + 1, a
// random one below size, and the largest.
std::vector<std::uint64_t> counts_for(std::uint64_t size, ferry::detail::splitmix64& g) {
  std::vector<std::uint64_t> ns{0, 1, size, size + 1, all};
  if (size > 0) ns.push_back(size - 1);
  if (size > 0) ns.push_back(g.below(size));
  return ns;
}

}  // namespace

TEST_CASE("skip(n) equals dropping the first n, for next() and range-for") {
  ferry::detail::splitmix64 g(1);
  for (std::uint64_t size : {0, 1, 2, 7, 64, 100, 257}) {
    for (std::uint64_t n : counts_for(size, g)) {
      CAPTURE(size);
      CAPTURE(n);
      auto p = gen(size) | ferry::skip(n);
      CHECK(drain(p) == drop(iota(size), n));
      CHECK_FALSE(p.next());  // stays at the end
      auto q = ferry::skip(ferry::from_range(iota(size)), n);  // the call form, a non-generator source
      std::vector<std::uint64_t> got;
      for (auto x : q) got.push_back(x);
      CHECK(got == drop(iota(size), n));
    }
  }
}

TEST_CASE("skip(0) hands everything on; skip past the end is an empty epoch, not an error") {
  auto p = gen(5) | ferry::skip(0);
  CHECK(drain(p) == iota(5));
  auto q = gen(5) | ferry::skip(5);
  CHECK_FALSE(q.next());
  auto r = gen(5) | ferry::skip(all);
  CHECK_NOTHROW(CHECK(drain(r).empty()));
  std::vector<std::uint64_t> buf(4);
  auto b = gen(5) | ferry::skip(all);
  CHECK(b.next_bulk(std::span<std::uint64_t>(buf)) == 0);
}

TEST_CASE("skip is lazy and pulls only what it drops and hands on") {
  ferry_test::counting_source src(100);
  auto calls = src.calls();
  auto p = std::move(src) | ferry::skip(7);
  CHECK(*calls == 0);
  REQUIRE(p.next() == std::optional<std::uint64_t>(7));
  CHECK(*calls == 8);
  REQUIRE(p.next() == std::optional<std::uint64_t>(8));
  CHECK(*calls == 9);
}

TEST_CASE("property: random sizes and counts, through next(), next_bulk() and a random mix") {
  ferry::detail::splitmix64 g(7);
  for (int round = 0; round < 400; ++round) {
    const std::uint64_t size = round % 10 == 0 ? 0 : g.below(80);
    const std::uint64_t n = round % 7 == 0 ? size : round % 11 == 0 ? size + g.below(5) : g.below(size + 3);
    CAPTURE(size);
    CAPTURE(n);
    const auto want = drop(iota(size), n);
    auto a = bulk_double(size) | ferry::skip(n);
    CHECK(drain(a) == want);
    auto b = bulk_double(size) | ferry::skip(n);
    CHECK(drain_mixed(b, g) == want);
    // Whole runs of one size, the size 1 included.
    const std::size_t run = 1 + g.below(20);
    auto c = bulk_double(size) | ferry::skip(n);
    std::vector<std::uint64_t> got, buf(run);
    for (std::size_t k; (k = c.next_bulk(std::span<std::uint64_t>(buf))) > 0;)
      got.insert(got.end(), buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(k));
    CHECK(got == want);
  }
}

TEST_CASE("every epoch drops its own first n: repeat, shuffle, rewind mid-epoch") {
  ferry::detail::splitmix64 g(11);
  for (std::uint64_t size : {0, 1, 5, 33}) {
    for (std::uint64_t n : counts_for(size, g)) {
      CAPTURE(size);
      CAPTURE(n);
      // skip inside repeat: each of the 3 epochs drops its first n.
      auto p = gen(size) | ferry::skip(n) | ferry::repeat(3);
      std::vector<std::uint64_t> want;
      for (int e = 0; e < 3; ++e) {
        auto one = drop(iota(size), n);
        want.insert(want.end(), one.begin(), one.end());
      }
      CHECK(drain(p) == want);
      // The same through batch (skip's next_bulk).
      auto pb = bulk_double(size) | ferry::skip(n) | ferry::batch(4) | ferry::repeat(3);
      CHECK(flat(pb) == want);
      // repeat inside skip: one epoch of 3 * size elements.
      auto q = gen(size) | ferry::repeat(3) | ferry::skip(n);
      std::vector<std::uint64_t> three;
      const auto once = iota(size);
      for (int e = 0; e < 3; ++e) three.insert(three.end(), once.begin(), once.end());
      CHECK(drain(q) == drop(three, n));
      // A new order each epoch: the first n of each epoch's own order are dropped.
      auto ref = gen(size) | ferry::shuffle(8, 3) | ferry::repeat(3);
      const auto orders = drain(ref);
      REQUIRE(orders.size() == 3 * size);
      auto s = gen(size) | ferry::shuffle(8, 3) | ferry::skip(n) | ferry::repeat(3);
      std::vector<std::uint64_t> swant;
      for (std::uint64_t e = 0; e < 3; ++e) {
        auto one = drop(std::vector<std::uint64_t>(orders.begin() + e * size, orders.begin() + (e + 1) * size), n);
        swant.insert(swant.end(), one.begin(), one.end());
      }
      CHECK(drain(s) == swant);
    }
  }
  // rewind() mid-epoch and after the end: every pass drops its first n again.
  for (int round = 0; round < 200; ++round) {
    const std::uint64_t size = g.below(40), n = g.below(size + 3);
    CAPTURE(size);
    CAPTURE(n);
    auto p = bulk_double(size) | ferry::skip(n);
    for (int pass = 0; pass < 4; ++pass) {
      const std::uint64_t stop = g.below(size + 2);  // pull some, possibly past the end
      std::vector<std::uint64_t> got, buf(3);
      for (std::uint64_t i = 0; i < stop; ++i)
        if (pass % 2 == 0) {
          if (auto e = p.next()) got.push_back(*e);
        } else if (std::size_t k = p.next_bulk(std::span<std::uint64_t>(buf).first(1))) {
          got.push_back(buf[0]);
          CHECK(k == 1);
        }
      CHECK(got == first(drop(iota(size), n), stop));
      p.rewind();
      if (pass == 3) CHECK(drain_mixed(p, g) == drop(iota(size), n));
    }
  }
}

TEST_CASE("batch downstream: skip's bulk path fills batches, with and without drop_remainder") {
  ferry::detail::splitmix64 g(5);
  for (int round = 0; round < 150; ++round) {
    const std::uint64_t size = g.below(200), n = g.below(size + 10), b = 1 + g.below(17);
    const bool drop_rem = round % 2 == 1;
    CAPTURE(size);
    CAPTURE(n);
    CAPTURE(b);
    CAPTURE(drop_rem);
    auto want = drop(iota(size), n);
    if (drop_rem) want.resize(want.size() / b * b);
    auto p = gen(size) | ferry::skip(n) | ferry::batch(b, {.drop_remainder = drop_rem});
    std::size_t batches = 0;
    std::vector<std::uint64_t> got;
    while (auto e = p.next()) {
      ++batches;
      CHECK(e->size() <= b);
      for (auto x : e->field()) got.push_back(x);
    }
    CHECK(got == want);
    CHECK(batches == (want.size() + b - 1) / b);
    // Over a source without next_bulk (filter), batch pulls skip element by element.
    auto q = gen(size) | ferry::filter([](std::uint64_t) { return true; }) | ferry::skip(n) |
             ferry::batch(b, {.drop_remainder = drop_rem});
    CHECK(flat(q) == want);
    // An inline map between skip and batch pulls skip's runs too.
    auto m = gen(size) | ferry::skip(n) | ferry::map([](std::uint64_t x) { return x * 3; }) |
             ferry::batch(b, {.drop_remainder = drop_rem});
    auto tripled = want;
    for (auto& x : tripled) x *= 3;
    CHECK(flat(m) == tripled);
  }
}

TEST_CASE("next_bulk skips in runs, not element by element, and allocates nothing in steady state") {
  bulk_double src(1000);
  auto calls = src.counts();
  auto p = std::move(src) | ferry::skip(900);
  std::vector<std::uint64_t> buf(64), got;
  got.reserve(1000);
  auto pass = [&] {
    got.clear();
    for (std::size_t k; (k = p.next_bulk(std::span<std::uint64_t>(buf))) > 0;)
      got.insert(got.end(), buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(k));
  };
  pass();
  CHECK(got == drop(iota(1000), 900));
  CHECK(calls->next == 0);
  // 900 skipped in runs of 64 (14 of 64, one of 4), then 64, 36 and the end.
  CHECK(calls->bulk == 15 + 3);
  p.rewind();
  const std::uint64_t before = allocations.load();
  pass();
  const std::uint64_t during = allocations.load() - before;
  CHECK(during == 0);
  CHECK(got == drop(iota(1000), 900));
  CHECK(calls->next == 0);
}

TEST_CASE("take(a) | skip(b) and skip(b) | take(a) against the oracle") {
  ferry::detail::splitmix64 g(13);
  for (int round = 0; round < 300; ++round) {
    const std::uint64_t size = g.below(50), a = g.below(size + 5), b = g.below(size + 5);
    CAPTURE(size);
    CAPTURE(a);
    CAPTURE(b);
    auto p = gen(size) | ferry::take(a) | ferry::skip(b);
    CHECK(drain(p) == drop(first(iota(size), a), b));
    auto q = gen(size) | ferry::skip(b) | ferry::take(a);
    CHECK(drain(q) == first(drop(iota(size), b), a));
    // Through the bulk path, and as a reusable chain of closures.
    auto split = ferry::take(a) | ferry::skip(b) | ferry::batch(3);
    auto r = bulk_double(size) | split;
    CHECK(flat(r) == drop(first(iota(size), a), b));
    // The validation and training splits are disjoint and together the whole.
    auto val = gen(size) | ferry::take(a);
    auto train = gen(size) | ferry::skip(a);
    auto both = drain(val);
    auto rest = drain(train);
    both.insert(both.end(), rest.begin(), rest.end());
    CHECK(both == iota(size));
  }
  // An endless dataset: skip drops its first n once (one epoch), then take ends it.
  auto endless = gen(5) | ferry::repeat() | ferry::skip(12) | ferry::take(4);
  CHECK(drain(endless) == std::vector<std::uint64_t>{2, 3, 4, 0});
}

TEST_CASE("upstream errors pass through skip at their position, do not count, lose nothing") {
  ferry::detail::splitmix64 g(17);
  for (int round = 0; round < 400; ++round) {
    const std::uint64_t size = round % 13 == 0 ? 0 : 1 + g.below(30);
    const auto fails = random_fails(g, size);
    for (std::uint64_t n : counts_for(size, g)) {
      CAPTURE(size);
      CAPTURE(n);
      CAPTURE(fails.size());
      const auto up = naive(size, fails);
      auto p = ferry_test::failing_source(size, fails) | ferry::skip(n);
      CHECK(events(p) == skip_events(up, n));
      // Several epochs: each one drops its own first n; every error comes through in each.
      auto r = ferry_test::failing_source(size, fails) | ferry::skip(n) | ferry::repeat(3);
      std::vector<std::string> want;
      const auto one = skip_events(up, n);
      if (!one.empty())  // an epoch with no element and no error is an empty dataset: repeat stops
        for (int e = 0; e < 3; ++e) want.insert(want.end(), one.begin(), one.end());
      CHECK(events(r) == want);
    }
  }
  // Errors at every chosen position around the boundary, one at a time.
  for (std::uint64_t k = 0; k < 12; ++k) {
    CAPTURE(k);
    auto p = ferry_test::failing_source(12, {k}) | ferry::skip(5);
    CHECK(events(p) == skip_events(naive(12, {k}), 5));
  }
  // Every element fails: nothing to skip, every error comes through.
  auto p = ferry_test::failing_source(4, {0, 1, 2, 3}) | ferry::skip(2);
  CHECK(events(p) == naive(4, {0, 1, 2, 3}));
}

TEST_CASE("next_bulk over an upstream that throws: every error comes through, and none of the first n") {
  // In a run being skipped, skip cannot tell how much of the run the upstream used up
  // before it threw, so it counts none of it: it may drop more, never fewer.
  ferry::detail::splitmix64 g(19);
  for (int round = 0; round < 400; ++round) {
    const std::uint64_t size = 1 + g.below(60), n = g.below(size + 3);
    const std::size_t run = 1 + g.below(12);
    auto fails = random_fails(g, size);
    if (round % 2 == 0) {  // errors only where skip is still skipping
      std::erase_if(fails, [&](std::uint64_t f) { return f >= n; });
    }
    CAPTURE(size);
    CAPTURE(n);
    CAPTURE(run);
    CAPTURE(fails.size());
    auto p = bulk_double(size, fails) | ferry::skip(n);
    std::vector<std::uint64_t> got, buf(run);
    std::vector<std::string> errors;
    for (std::size_t guard = 0; guard < 10000; ++guard) {
      try {
        const std::size_t k = p.next_bulk(std::span<std::uint64_t>(buf));
        got.insert(got.end(), buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(k));
        if (k < run) break;
      } catch (const std::exception& e) {
        errors.push_back(e.what());
      }
    }
    std::vector<std::string> want_errors;
    for (auto& e : naive(size, fails))
      if (e[0] == '!' && std::find(want_errors.begin(), want_errors.end(), e.substr(1)) == want_errors.end())
        want_errors.push_back(e.substr(1));
    CHECK(errors == want_errors);  // every error, once, in order
    // The good elements in order; none of the first n of them is ever handed on.
    std::vector<std::uint64_t> good;
    for (std::uint64_t i = 0; i < size; ++i)
      if (std::find(fails.begin(), fails.end(), i) == fails.end()) good.push_back(i);
    const auto exact = drop(good, n);
    CHECK(std::is_sorted(got.begin(), got.end()));
    for (auto x : got) CHECK(std::find(exact.begin(), exact.end(), x) != exact.end());
    if (fails.empty() || *std::max_element(fails.begin(), fails.end()) < n) {
      // Errors only while skipping: what is handed on is the oracle's tail, all of it
      // when no error fell inside the first n.
      REQUIRE(got.size() <= exact.size());
      CHECK(got == std::vector<std::uint64_t>(exact.end() - static_cast<std::ptrdiff_t>(got.size()), exact.end()));
      if (fails.empty()) CHECK(got == exact);
    }
  }
  // Through next(), the same upstream is exact: errors in place, not counted.
  for (std::uint64_t k = 0; k < 10; ++k) {
    auto p = bulk_double(10, {k}) | ferry::skip(4);
    CHECK(events(p) == skip_events(naive(10, {k}), 4));
  }
}

TEST_CASE("resume is exact at every position: errors in and after the skipped part, several epochs") {
  struct shape {
    std::uint64_t size, n;
    std::vector<std::uint64_t> fails;
  };
  const std::vector<shape> shapes{{10, 4, {1, 7}},  // an error while skipping: saves mid-skip
                                  {10, 4, {0, 2, 3, 4}},
                                  {8, 0, {3}},
                                  {6, 9, {5}},  // n past the end: only the error, each epoch
                                  {12, 12, {}},
                                  {12, 3, {}}};
  for (const auto& sh : shapes) {
    CAPTURE(sh.size);
    CAPTURE(sh.n);
    auto make = [&] { return ferry_test::failing_source(sh.size, sh.fails) | ferry::skip(sh.n) | ferry::repeat(2); };
    auto ref = make();
    const auto whole = events(ref);
    auto one = skip_events(naive(sh.size, sh.fails), sh.n);
    std::vector<std::string> want;
    if (!one.empty()) {
      want = one;
      want.insert(want.end(), one.begin(), one.end());
    }
    REQUIRE(whole == want);
    resumes_everywhere(make);
  }
}

TEST_CASE("resume is exact at every batch: shuffle | skip | batch | repeat, and bulk errors while skipping") {
  for (std::uint64_t n : {0, 1, 15, 16, 37, 99, 100, 150}) {
    CAPTURE(n);
    auto make = [n] { return gen(100) | ferry::shuffle(16, 2) | ferry::skip(n) | ferry::batch(8) | ferry::repeat(2); };
    resumes_everywhere(make);
  }
  // An error thrown from a run being skipped leaves skip mid-skip; a checkpoint then still
  // resumes to exactly what the uninterrupted run hands on.
  for (std::uint64_t n : {5, 12, 30}) {
    CAPTURE(n);
    auto make = [n] { return bulk_double(40, {2, 9, 20, 33}) | ferry::skip(n) | ferry::batch(4) | ferry::repeat(2); };
    resumes_everywhere(make);
  }
}

TEST_CASE("the checkpoint: the upstream's words, the tag, then how many were skipped so far") {
  auto p = ferry_test::failing_source(10, {1}) | ferry::skip(4);
  auto words = [&] { return ferry::save_state(p).words; };
  const std::uint64_t up_tag = ferry::detail::stage_tag("failing"), tag = ferry::detail::stage_tag("skip");
  CHECK(words() == std::vector<std::uint64_t>{up_tag, 0, tag, 0});
  CHECK(*event(p) == "!failed at 1");  // skipped 0 then hit the error: one skipped so far
  CHECK(words() == std::vector<std::uint64_t>{up_tag, 2, tag, 1});
  CHECK(*event(p) == "5");
  CHECK(words() == std::vector<std::uint64_t>{up_tag, 6, tag, 4});
  // A state of another shape is refused.
  auto t = ferry_test::failing_source(10, {1}) | ferry::take(4);
  CHECK_THROWS_WITH_AS(ferry::restore_state(t, ferry::save_state(p)), doctest::Contains("'take'"),
                       ferry::config_error);
  auto s = ferry_test::failing_source(10, {1}) | ferry::skip(4);
  auto fresh_take = ferry_test::failing_source(10, {1}) | ferry::take(4);  // t is marked by its refusal
  CHECK_THROWS_WITH_AS(ferry::restore_state(s, ferry::save_state(fresh_take)), doctest::Contains("'skip'"),
                       ferry::config_error);
}

TEST_CASE("skip forwards what take forwards: capabilities, batch size, buffer resource, stats") {
  using g_t = decltype(gen(1));
  using s_t = decltype(gen(1) | ferry::skip(1));
  static_assert(ferry::bulk_source<s_t> && ferry::rewindable_source<s_t> && ferry::resumable_source<s_t>);
  using f_t = decltype(gen(1) | ferry::filter([](std::uint64_t) { return true; }) | ferry::skip(1));
  static_assert(!ferry::bulk_source<f_t> && ferry::resumable_source<f_t>);
  static_assert(!ferry::rewindable_source<decltype(ferry_test::throwing_source(1, 0) | ferry::skip(1))>);
  static_assert(!ferry::resumable_source<decltype(ferry_test::throwing_source(1, 0) | ferry::skip(1))>);
  static_assert(std::is_same_v<ferry::value_t<s_t>, ferry::value_t<g_t>>);
  static_assert(!ferry::sized_batches<s_t>);

  auto b = gen(100) | ferry::batch(8) | ferry::skip(2);
  static_assert(ferry::sized_batches<decltype(b)>);
  CHECK(b.batch_size() == 8);
  auto r = std::make_shared<ferry::buffer_pool>();
  CHECK(b.set_buffer_resource(r));
  auto first_batch = b.next();
  REQUIRE(first_batch);
  CHECK(first_batch->field()[0] == 16);  // two batches of 8 skipped
  auto plain = gen(10) | ferry::skip(2);
  CHECK_FALSE(plain.set_buffer_resource(r));

  ferry::enable_stats(true);
  struct off {
    ~off() { ferry::enable_stats(false); }
  } guard;
  for (std::uint64_t k : {0, 1, 99, 100, 150}) {
    CAPTURE(k);
    auto p = gen(100) | ferry::skip(k);
    drain(p);
    const auto rep = ferry::report(p);
    REQUIRE(rep.stages.size() == 2);
    CHECK(rep.stages[1].name == "skip");
    CHECK(rep.stages[0].elements == 100);  // the source made all of them
    CHECK(rep.stages[1].elements == 100 - std::min<std::uint64_t>(k, 100));  // skip hands on the rest
    // The bulk path counts the same.
    std::vector<std::uint32_t> data(100, 1);
    auto q = ferry::from_range(data) | ferry::skip(k) | ferry::batch(16);
    flat(q);
    const auto rq = ferry::report(q);
    REQUIRE(rq.stages.size() == 3);
    CHECK(rq.stages[0].elements == 100);
    CHECK(rq.stages[1].name == "skip");
    CHECK(rq.stages[1].elements == 100 - std::min<std::uint64_t>(k, 100));
    CHECK(rq.stages[1].bytes == 4 * (100 - std::min<std::uint64_t>(k, 100)));
  }
}

TEST_CASE("skip under prefetch and parallel map: other threads skip; order and errors kept" *
          doctest::timeout(30)) {
  watchdog w(30s);
  for (std::size_t depth : {1, 3}) {
    CAPTURE(depth);
    auto p = ferry_test::failing_source(50, {3, 20}) | ferry::skip(10) | ferry::prefetch(depth) | ferry::repeat(2);
    auto one = skip_events(naive(50, {3, 20}), 10);
    std::vector<std::string> want = one;
    want.insert(want.end(), one.begin(), one.end());
    CHECK(events(p) == want);
    auto q = gen(1000) | ferry::skip(300) | ferry::batch(32) | ferry::prefetch(depth);
    CHECK(flat(q) == drop(iota(1000), 300));
  }
  // Under a parallel map, worker threads take turns pulling through skip.
  for (std::size_t workers : {2, 4}) {
    CAPTURE(workers);
    auto m = gen(500) | ferry::skip(123) | ferry::map([](std::uint64_t x) { return x + 1; }, {.workers = workers}) |
             ferry::batch(16);
    auto want = drop(iota(500), 123);
    for (auto& x : want) ++x;
    CHECK(flat(m) == want);
  }
}

TEST_CASE("a restored state that skipped more than n is refused, naming skip and both numbers") {
  auto a = bulk_double(20) | ferry::skip(10);
  std::vector<std::uint64_t> one(1);
  REQUIRE(a.next_bulk(std::span<std::uint64_t>(one)) == 1);  // skipped all 10
  const auto st = ferry::save_state(a);
  auto b = bulk_double(20) | ferry::skip(5);
  CHECK_THROWS_WITH_AS(ferry::restore_state(b, ferry::pipeline_state::from_bytes(st.to_bytes())),
                       "restore_state: skip: the state skipped 10 elements, more than this skip(5) drops "
                       "(saved from a skip of a larger n?)",
                       ferry::config_error);
  // At exactly n it restores, and hands on what follows.
  auto c = bulk_double(20) | ferry::skip(10);
  ferry::restore_state(c, st);
  CHECK(c.next() == std::optional<std::uint64_t>(11));
}
