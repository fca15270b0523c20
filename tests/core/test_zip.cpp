// zip: pairs equal the naive pairing; unequal lengths are an error; resume is exact.
#include <doctest/doctest.h>

#include <chrono>
#include <thread>
#include <vector>

#include "common/doubles.hpp"
#include "failing_source.hpp"
#include "ferry/ferry.hpp"

using ferry_test::drain;

TEST_CASE("zip pairs the i-th elements, and batch collates each half as a field") {
  for (std::uint64_t seed = 1; seed <= 10; ++seed) {
    ferry::detail::splitmix64 g(seed);
    const std::size_t n = g.below(500);
    std::vector<std::uint32_t> a(n), b(n);
    for (auto& x : a) x = std::uint32_t(g());
    for (auto& x : b) x = std::uint32_t(g());
    auto p = ferry::zip(ferry::from_range(a), ferry::from_range(b)) | ferry::batch(1 + g.below(40));
    std::size_t i = 0;
    for (auto& batch : p)
      for (std::size_t k = 0; k < batch.size(); ++k, ++i) {
        CHECK(batch.field<0>()[k] == a[i]);
        CHECK(batch.field<1>()[k] == b[i]);
      }
    CHECK(i == n);
  }
}

TEST_CASE("zip of sources of different lengths is an error, not a truncation") {
  auto p = ferry::zip(ferry::from_range(std::vector<int>{1, 2, 3}), ferry::from_range(std::vector<int>{4, 5}));
  REQUIRE(p.next());
  REQUIRE(p.next());
  CHECK_THROWS_WITH_AS(p.next(), doctest::Contains("the second ended after 2 elements"), ferry::error);
  // Going on would hand out unpaired elements: zip refuses until rewound.
  CHECK_THROWS_WITH_AS(p.next(), doctest::Contains("out of step"), ferry::error);
  p.rewind();
  CHECK(p.next() == std::pair<int, int>(1, 4));
  // The other way round: the first side ends early.
  auto q = ferry::zip(ferry::from_range(std::vector<int>{1}), ferry::from_range(std::vector<int>{4, 5, 6}));
  CHECK(q.next() == std::pair<int, int>(1, 4));
  CHECK_THROWS_WITH_AS(q.next(), doctest::Contains("the first ended after 1 elements"), ferry::error);
  CHECK_THROWS_WITH_AS(q.next(), doctest::Contains("out of step"), ferry::error);
  // Equal lengths end together, with no error.
  auto e = ferry::zip(ferry::from_range(std::vector<int>{1, 2}), ferry::from_range(std::vector<int>{3, 4}));
  CHECK(e.next());
  CHECK(e.next());
  CHECK_FALSE(e.next());
}

namespace {
using pair_t = std::pair<std::uint64_t, std::uint64_t>;

// An error on either side: re-thrown unchanged, then zip refuses to go on (it cannot know
// how many elements the failing side skipped) until rewind() or restore_state().
void check_error_on_side(bool first_fails) {
  constexpr std::uint64_t n = 10, k = 3;
  auto make = [&] {
    auto a = ferry_test::failing_source(n, first_fails ? std::vector<std::uint64_t>{k} : std::vector<std::uint64_t>{})
                 .named("a");
    auto b = ferry_test::failing_source(n, first_fails ? std::vector<std::uint64_t>{} : std::vector<std::uint64_t>{k}, 10)
                 .named("b");
    return ferry::zip(std::move(a), std::move(b));
  };
  auto p = make();
  ferry::pipeline_state at1;
  for (std::uint64_t i = 0; i < k; ++i) {
    if (i == 1) at1 = ferry::save_state(p);
    CHECK(p.next() == pair_t(i, i * 10));
  }
  const std::string original = std::string(first_fails ? "a" : "b") + ": failed at 3";
  CHECK_THROWS_WITH_AS(p.next(), original.c_str(), std::runtime_error);  // unchanged
  for (int again = 0; again < 3; ++again) {
    try {
      auto e = p.next();
      FAIL("zip went on after an error: got ", e ? "a pair" : "the end");
    } catch (const ferry::error& e) {
      const std::string what = e.what();
      CHECK(what.find("out of step") != std::string::npos);
      CHECK(what.find(first_fails ? "the first source" : "the second source") != std::string::npos);
      CHECK(what.find("at pair 3") != std::string::npos);
      CHECK(what.find(original) != std::string::npos);
      CHECK(what.find("rewind()") != std::string::npos);
    }
  }
  CHECK_THROWS_WITH_AS(ferry::save_state(p), doctest::Contains("out of step"), ferry::error);

  // restore_state starts both sides again together, from the saved pair.
  ferry::restore_state(p, at1);
  CHECK(p.next() == pair_t(1, 10));
  CHECK(p.next() == pair_t(2, 20));
  CHECK_THROWS_WITH_AS(p.next(), original.c_str(), std::runtime_error);  // fails there again
  // rewind() too: the pairs are the naive pairing up to the error.
  p.rewind();
  std::vector<std::string> errors;
  auto got = ferry_test::drain_through_errors(p, errors, 3);
  CHECK(got == std::vector<pair_t>{{0, 0}, {1, 10}, {2, 20}});
  REQUIRE(errors.size() == 3);
  CHECK(errors[0] == original);
  CHECK(errors[1].find("out of step") != std::string::npos);
}
}  // namespace

TEST_CASE("zip: an error from the first source stops the pairing until rewind or restore") {
  check_error_on_side(true);
}

TEST_CASE("zip: an error from the second source stops the pairing until rewind or restore") {
  check_error_on_side(false);
}

TEST_CASE("zip rewinds both sources and resumes exactly") {
  auto make = [] {
    return ferry::zip(ferry::from_generator(100, [](std::uint64_t i) { return i; }) | ferry::shuffle(16, 1),
                      ferry::from_generator(100, [](std::uint64_t i) { return i * 10; }));
  };
  auto p = make();
  auto first = drain(p);
  p.rewind();
  auto second = drain(p);
  REQUIRE(first.size() == 100);
  CHECK(first != second);  // the shuffle drew a new order
  for (std::size_t k : {0, 1, 17, 64, 99, 100}) {
    auto q = make();
    std::vector<std::pair<std::uint64_t, std::uint64_t>> got;
    for (std::size_t i = 0; i < k; ++i) got.push_back(*q.next());
    auto st = ferry::save_state(q);
    auto r = make();
    ferry::restore_state(r, st);
    for (auto& e : drain(r)) got.push_back(e);
    CHECK(got == first);
  }
}

TEST_CASE("zip in report(): both sources' stages, then zip, whose own time excludes both") {
  using namespace std::chrono_literals;
  ferry::enable_stats(true);
  struct off {
    ~off() { ferry::enable_stats(false); }
  } guard;
  // The first source is slow: its time must not count as zip's, though the stage just
  // before zip in the report is the second source's.
  auto slow = ferry::from_generator(100, [](std::uint64_t i) {
    std::this_thread::sleep_for(200us);
    return i;
  });
  auto p = ferry::zip(std::move(slow), ferry::from_generator(100, [](std::uint64_t i) { return 2 * i; }) |
                                           ferry::skip(0));
  std::size_t n = 0;
  while (auto e = p.next()) {
    CHECK(e->second == 2 * e->first);
    ++n;
  }
  CHECK(n == 100);
  const auto rep = ferry::report(p);
  REQUIRE(rep.stages.size() == 4);
  CHECK(rep.stages[0].kind == "from_generator");  // sources name themselves (the stage base)
  CHECK(rep.stages[1].kind == "from_generator");
  CHECK(rep.stages[2].kind == "skip");
  CHECK(rep.stages[3].kind == "zip");
  CHECK(rep.stages[0].elements == 100);
  CHECK(rep.stages[3].elements == 100);
  CHECK(rep.stages[0].busy_s >= 100 * 150e-6);
  CHECK(rep.stages[3].busy_s < 0.25 * rep.stages[0].busy_s);
  CHECK(rep.bottleneck == "from_generator#0");
  ferry::reset_stats(p);  // reaches every stage, zip's own counters included
  const auto after = ferry::report(p);
  for (const auto& s : after.stages) CHECK(s.elements == 0);
}
