// concatenate: a's elements then b's, against the oracle (a + b); empties on either side;
// the bulk path (batch() runs across the boundary) equals the per-element path; errors
// from either side in place; resume at every position through bytes, the boundary
// included; rewind (shuffle on both sides: each epoch in its order); laziness; threads.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/doubles.hpp"
#include "failing_source.hpp"
#include "take_skip.hpp"
#include "ferry/ferry.hpp"
#include "ferry/stages/concatenate.hpp"

using namespace std::chrono_literals;
using ferry_test::bulk_double;
using ferry_test::drain;
using ferry_test::events;
using ferry_test::resumes_everywhere;
using ferry_test::watchdog;

namespace {

using u64 = std::uint64_t;

std::vector<u64> range_of(u64 from, u64 n) {
  std::vector<u64> v(n);
  for (u64 i = 0; i < n; ++i) v[i] = from + i;
  return v;
}
std::vector<u64> joined(std::vector<u64> a, const std::vector<u64>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}
std::vector<std::string> joined(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}
// a's events as failing_source(na, fa) makes them, named "a: ..."; b's scaled by 1000.
std::vector<std::string> side(const std::string& name, u64 n, const std::vector<u64>& fails, u64 scale) {
  std::vector<std::string> ev;
  for (u64 i = 0; i < n; ++i)
    ev.push_back(std::find(fails.begin(), fails.end(), i) != fails.end() ? "!" + name + ": failed at " + std::to_string(i)
                                                                          : std::to_string(i * scale));
  return ev;
}

template <class S>
std::vector<u64> flat(S& s) {
  std::vector<u64> out;
  while (auto e = s.next()) {
    if constexpr (requires { e->field(); })
      for (auto x : e->field()) out.push_back(x);
    else
      out.push_back(*e);
  }
  return out;
}

}  // namespace

TEST_CASE("concatenate hands out all of a, then all of b; empties on either side") {
  ferry::detail::splitmix64 g(1);
  for (int round = 0; round < 300; ++round) {
    const u64 na = round % 5 == 0 ? 0 : g.below(50), nb = round % 7 == 0 ? 0 : g.below(50);
    CAPTURE(na);
    CAPTURE(nb);
    const auto a = range_of(0, na), b = range_of(1000, nb);
    auto p = ferry::concatenate(ferry::from_range(a), ferry::from_range(b));
    CHECK(drain(p) == joined(a, b));
    CHECK_FALSE(p.next());  // stays at the end
    CHECK(p.in_second());
    std::vector<u64> got;
    auto q = ferry::concatenate(ferry::from_range(a), ferry::from_generator(nb, [](u64 i) { return 1000 + i; }));
    for (u64 x : q) got.push_back(x);  // range-for; two kinds of source
    CHECK(got == joined(a, b));
    // Nested: three sources.
    auto r = ferry::concatenate(ferry::concatenate(ferry::from_range(a), ferry::from_range(b)), ferry::from_range(a));
    CHECK(drain(r) == joined(joined(a, b), a));
  }
}

TEST_CASE("b is not pulled before a has ended") {
  ferry_test::counting_source a(3), b(2);
  auto ca = a.calls(), cb = b.calls();
  auto p = ferry::concatenate(std::move(a), std::move(b));
  CHECK(*ca == 0);
  for (u64 i = 0; i < 3; ++i) CHECK(p.next() == std::optional<u64>(i));
  CHECK(*cb == 0);
  CHECK_FALSE(p.in_second());
  CHECK(p.next() == std::optional<u64>(0));  // a ends, b's first
  CHECK(*ca == 4);
  CHECK(*cb == 1);
  CHECK(p.next() == std::optional<u64>(1));
  CHECK_FALSE(p.next());
  CHECK(*ca == 4);  // a is not asked again
}

TEST_CASE("the bulk path: runs across the boundary, through batch() and direct, equal the per-element path") {
  using bulk_t = decltype(ferry::concatenate(bulk_double(1), bulk_double(1)));
  static_assert(ferry::bulk_source<bulk_t>);
  static_assert(!ferry::bulk_source<decltype(ferry::concatenate(bulk_double(1), ferry_test::counting_source(1)))>);
  ferry::detail::splitmix64 g(3);
  for (int round = 0; round < 300; ++round) {
    const u64 na = round % 6 == 0 ? 0 : g.below(60), nb = round % 9 == 0 ? 0 : g.below(60), n = 1 + g.below(17);
    const bool drop = round % 2 == 1;
    CAPTURE(na);
    CAPTURE(nb);
    CAPTURE(n);
    CAPTURE(drop);
    auto bulk = ferry::concatenate(bulk_double(na), bulk_double(nb)) | ferry::batch(n, {.drop_remainder = drop});
    // filter has no next_bulk: batch pulls element by element.
    auto per = ferry::concatenate(bulk_double(na), bulk_double(nb)) | ferry::filter([](u64) { return true; }) |
               ferry::batch(n, {.drop_remainder = drop});
    auto want = joined(range_of(0, na), range_of(0, nb));
    if (drop) want.resize(want.size() / n * n);
    std::vector<std::size_t> sizes_bulk, sizes_per;
    std::vector<u64> got_bulk, got_per;
    while (auto b = bulk.next()) {
      sizes_bulk.push_back(b->size());
      for (auto x : b->field()) got_bulk.push_back(x);
    }
    while (auto b = per.next()) {
      sizes_per.push_back(b->size());
      for (auto x : b->field()) got_per.push_back(x);
    }
    CHECK(got_bulk == want);
    CHECK(got_per == want);
    CHECK(sizes_bulk == sizes_per);  // full batches across the boundary; short only at b's end
    // Direct next_bulk with random run sizes (0 included): fewer only at the end of b.
    auto d = ferry::concatenate(bulk_double(na), bulk_double(nb));
    std::vector<u64> got, buf(20);
    for (;;) {
      const std::size_t want_k = g.below(21);
      const std::size_t k = d.next_bulk(std::span<u64>(buf).first(want_k));
      REQUIRE(k <= want_k);
      got.insert(got.end(), buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(k));
      if (want_k > 0 && k < want_k) break;
      if (got.size() > na + nb) break;  // a bug: do not loop forever
    }
    CHECK(got == joined(range_of(0, na), range_of(0, nb)));
  }
}

TEST_CASE("errors from either side reach the consumer unchanged, in place; the next call goes on") {
  ferry::detail::splitmix64 g(5);
  for (int round = 0; round < 300; ++round) {
    const u64 na = g.below(20), nb = g.below(20);
    std::vector<u64> fa, fb;
    if (na) for (u64 c = g.below(4); c > 0; --c) fa.push_back(g.below(na));
    if (nb) for (u64 c = g.below(4); c > 0; --c) fb.push_back(g.below(nb));
    CAPTURE(na);
    CAPTURE(nb);
    auto p = ferry::concatenate(ferry_test::failing_source(na, fa).named("a"),
                                ferry_test::failing_source(nb, fb, 1000).named("b"));
    CHECK(events(p) == joined(side("a", na, fa, 1), side("b", nb, fb, 1000)));
  }
  // The original exception type, and a's last element failing (the boundary right after).
  auto q = ferry::concatenate(ferry_test::failing_source(3, {2}), ferry_test::failing_source(2, {0}, 10));
  CHECK(q.next() == std::optional<u64>(0));
  CHECK(q.next() == std::optional<u64>(1));
  CHECK_THROWS_WITH_AS(q.next(), "failed at 2", std::runtime_error);
  CHECK_THROWS_WITH_AS(q.next(), "failed at 0", std::runtime_error);
  CHECK(q.next() == std::optional<u64>(10));
  CHECK_FALSE(q.next());
  // In a bulk run, an error drops the run's elements (a's too when b threw), as batch's.
  auto r = ferry::concatenate(bulk_double(3), bulk_double(4, {1})) | ferry::batch(5);
  CHECK_THROWS_WITH_AS(r.next(), "failed at 1", std::runtime_error);
  auto rest = r.next();
  REQUIRE(rest);
  CHECK(std::vector<u64>(rest->field().begin(), rest->field().end()) == std::vector<u64>{2, 3});
  CHECK_FALSE(r.next());
}

TEST_CASE("resume is exact at every position, the boundary included, through bytes") {
  struct shape {
    u64 na, nb;
    std::vector<u64> fa, fb;
  };
  for (const shape& s : std::vector<shape>{{0, 0, {}, {}}, {0, 5, {}, {2}}, {5, 0, {4}, {}}, {6, 6, {5}, {0}},
                                           {10, 7, {0, 3}, {6}}, {1, 1, {}, {}}}) {
    CAPTURE(s.na);
    CAPTURE(s.nb);
    auto make = [&] {
      return ferry::concatenate(ferry_test::failing_source(s.na, s.fa).named("a"),
                                ferry_test::failing_source(s.nb, s.fb, 1000).named("b")) |
             ferry::repeat(2);
    };
    auto ref = make();
    const auto one = joined(side("a", s.na, s.fa, 1), side("b", s.nb, s.fb, 1000));
    REQUIRE(events(ref) == (one.empty() ? one : joined(one, one)));
    resumes_everywhere(make);
  }
  // Over shuffles on both sides, and through the bulk path across the boundary.
  resumes_everywhere([] {
    return ferry::concatenate(ferry_test::failing_source(40, {7}) | ferry::shuffle(8, 1),
                              ferry_test::failing_source(30, {29}, 1000) | ferry::shuffle(5, 2)) |
           ferry::repeat(2);
  });
  resumes_everywhere([] { return ferry::concatenate(bulk_double(23), bulk_double(18, {3})) | ferry::batch(4) | ferry::repeat(2); });
}

TEST_CASE("the checkpoint: a's words, b's words, the tag, which one; another shape is a config_error") {
  auto p = ferry::concatenate(ferry_test::counting_source(2), ferry_test::counting_source(2));
  const u64 c = ferry::detail::stage_tag("counting"), tag = ferry::detail::stage_tag("concatenate");
  auto words = [&] { return ferry::save_state(p).words; };
  CHECK(words() == std::vector<u64>{c, 0, c, 0, tag, 0});
  p.next();
  p.next();
  CHECK(words() == std::vector<u64>{c, 2, c, 0, tag, 0});
  p.next();
  CHECK(words() == std::vector<u64>{c, 2, c, 1, tag, 1});
  auto z = ferry::zip(ferry_test::counting_source(2), ferry_test::counting_source(2));
  auto q = ferry::concatenate(ferry_test::counting_source(2), ferry_test::counting_source(2));
  CHECK_THROWS_WITH_AS(ferry::restore_state(q, ferry::save_state(z)), doctest::Contains("'concatenate'"),
                       ferry::config_error);
  auto z2 = ferry::zip(ferry_test::counting_source(2), ferry_test::counting_source(2));
  CHECK_THROWS_WITH_AS(ferry::restore_state(z2, ferry::save_state(p)), doctest::Contains("'zip'"),
                       ferry::config_error);
  auto st = ferry::save_state(p);
  st.words.back() = 2;
  auto q2 = ferry::concatenate(ferry_test::counting_source(2), ferry_test::counting_source(2));
  CHECK_THROWS_WITH_AS(ferry::restore_state(q2, st), doctest::Contains("concatenate: a damaged state"),
                       ferry::config_error);
}

TEST_CASE("rewind rewinds both: each epoch plays a's and b's orders of that epoch, mid-a and mid-b too") {
  for (u64 seed : {1, 2, 3}) {
    CAPTURE(seed);
    auto sa = [&] { return ferry::from_range(range_of(0, 30)) | ferry::shuffle(8, seed); };
    auto sb = [&] { return ferry::from_range(range_of(1000, 20)) | ferry::shuffle(6, seed + 100); };
    auto p = ferry::concatenate(sa(), sb());
    auto oa = sa();
    auto ob = sb();
    ferry::detail::splitmix64 g(seed);
    std::vector<u64> previous;
    for (int epoch = 0; epoch < 5; ++epoch) {
      CAPTURE(epoch);
      const auto want = joined(drain(oa), drain(ob));
      CHECK(want != previous);
      previous = want;
      if (epoch % 2 == 1) {  // stop somewhere (in a, at the boundary, or in b), then rewind
        const u64 stop = g.below(want.size());
        for (u64 i = 0; i < stop; ++i) REQUIRE(p.next() == std::optional<u64>(want[i]));
      } else {
        CHECK(drain(p) == want);
      }
      p.rewind();
      oa.rewind();
      ob.rewind();
    }
  }
  auto r = ferry::concatenate(ferry::from_range(range_of(0, 3)), ferry::from_range(range_of(7, 2))) | ferry::repeat(3);
  CHECK(drain(r) == std::vector<u64>{0, 1, 2, 7, 8, 0, 1, 2, 7, 8, 0, 1, 2, 7, 8});
  static_assert(!ferry::rewindable_source<decltype(ferry::concatenate(ferry_test::throwing_source(1, 0),
                                                                      ferry_test::counting_source(1)))>);
  static_assert(!ferry::resumable_source<decltype(ferry::concatenate(ferry_test::counting_source(1),
                                                                     ferry_test::throwing_source(1, 0)))>);
}

TEST_CASE("threads on either side: prefetch and a parallel map, in order, errors in place" * doctest::timeout(30)) {
  watchdog w(30s);
  for (int round = 0; round < 10; ++round) {
    CAPTURE(round);
    const u64 na = 50 * u64(round), nb = 300 - 25 * u64(round);
    auto p = ferry::concatenate(
        ferry::from_generator(na, [](u64 i) { return i; }) | ferry::map([](u64 x) { return x * 2; }, {.workers = 3}),
        ferry::from_generator(nb, [](u64 i) { return i; }) | ferry::prefetch(2));
    std::vector<u64> want;
    for (u64 i = 0; i < na; ++i) want.push_back(2 * i);
    for (u64 i = 0; i < nb; ++i) want.push_back(i);
    CHECK(drain(p) == want);
    auto q = ferry::concatenate(ferry_test::failing_source(na, {3}) | ferry::prefetch(3),
                                ferry_test::failing_source(nb, {0, 9}, 1000) | ferry::prefetch(1)) |
             ferry::prefetch(2);
    auto ev = joined(side("x", na, {3}, 1), side("x", nb, {0, 9}, 1000));
    for (auto& e : ev)
      if (e[0] == '!') e = "!" + e.substr(4);  // unnamed sources: "failed at i"
    CHECK(events(q) == ev);
  }
  resumes_everywhere([] {
    return ferry::concatenate(ferry::from_generator(40, [](u64 i) { return i; }) | ferry::prefetch(2),
                              ferry::from_generator(30, [](u64 i) { return i; }) |
                                  ferry::map([](u64 x) { return x + 500; }, {.workers = 2, .window = 16}));
  });
}

TEST_CASE("buffer resource forwarded to both; stats list a's stages, b's, then concatenate") {
  auto res = std::make_shared<ferry::buffer_pool>();
  auto batched = ferry::concatenate(ferry::from_generator(10, [](u64 i) { return i; }) | ferry::batch(4),
                                    ferry::from_generator(10, [](u64 i) { return i; }) | ferry::batch(4));
  CHECK(batched.set_buffer_resource(res));
  auto plain = ferry::concatenate(ferry::from_range(range_of(0, 3)), ferry::from_range(range_of(0, 3)));
  CHECK_FALSE(plain.set_buffer_resource(res));

  ferry::enable_stats(true);
  struct off {
    ~off() { ferry::enable_stats(false); }
  } guard;
  auto p = ferry::concatenate(ferry::from_range(range_of(0, 30)) | ferry::skip(10), ferry::from_range(range_of(0, 5)));
  CHECK(flat(p).size() == 25);
  const auto rep = ferry::report(p);
  REQUIRE(rep.stages.size() == 4);
  CHECK(rep.stages[0].elements == 30);
  CHECK(rep.stages[1].kind == "skip");
  CHECK(rep.stages[1].elements == 20);
  CHECK(rep.stages[2].elements == 5);
  CHECK(rep.stages[3].name == "concatenate");
  CHECK(rep.stages[3].elements == 25);

  // A slow first side: its time is not concatenate's, though b's stage is listed just before.
  auto slow = ferry::from_generator(50, [](u64 i) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    return i;
  });
  auto q = ferry::concatenate(std::move(slow), ferry::from_range(range_of(0, 5)) | ferry::skip(0));
  CHECK(flat(q).size() == 55);
  const auto r2 = ferry::report(q);
  REQUIRE(r2.stages.size() == 4);
  CHECK(r2.stages[0].busy_s >= 50 * 150e-6);
  CHECK(r2.stages[3].busy_s < 0.25 * r2.stages[0].busy_s);
}
