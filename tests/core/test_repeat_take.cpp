// repeat and take. take against its oracle (the first n elements; errors in place, not
// counted) and against skip, its complement: over the same upstream the two never share an
// element, whatever mix of next(), next_bulk() and batch() pulls them, and lose nothing
// through next(); what take calls upstream once n is reached (nothing); checkpoints.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
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

using ferry_test::drain;

TEST_CASE("repeat(n) plays the dataset n times; take(k) stops after k") {
  for (std::uint64_t n : {0, 1, 3})
    for (std::size_t size : {0, 1, 4}) {
      auto p = ferry::from_generator(size, [](std::uint64_t i) { return int(i); }) | ferry::repeat(n);
      auto got = drain(p);
      std::vector<int> expect;
      for (std::uint64_t e = 0; e < n; ++e)
        for (std::size_t i = 0; i < size; ++i) expect.push_back(int(i));
      CHECK(got == expect);
    }
  auto forever = ferry::from_range(std::vector<int>{1, 2, 3}) | ferry::repeat() | ferry::take(10);
  CHECK(drain(forever) == std::vector<int>{1, 2, 3, 1, 2, 3, 1, 2, 3, 1});
}

TEST_CASE("repeat of an empty dataset ends instead of spinning") {
  auto p = ferry::from_range(std::vector<int>{}) | ferry::repeat();
  CHECK_FALSE(p.next());
}

TEST_CASE("repeat over shuffle gives a new order each epoch") {
  auto p = ferry::from_generator(100, [](std::uint64_t i) { return i; }) | ferry::shuffle(100, 3) | ferry::repeat(2);
  auto all = drain(p);
  REQUIRE(all.size() == 200);
  std::vector<std::uint64_t> a(all.begin(), all.begin() + 100), b(all.begin() + 100, all.end());
  CHECK(a != b);
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  CHECK(a == b);
}

// Each epoch of repeat(n) is n epochs of its upstream, also after a rewind() part way:
// repeat used to rewind its upstream only for the passes it reached, so a shuffle below
// started the next epoch at another order after a rewind() part way than after a whole
// epoch (found by a random-composition test), and, under a stage that reads ahead, at an
// order that depended on how far its threads had read.
TEST_CASE("repeat(n): after rewind() part way, the next epoch is the one a whole epoch leads to, "
          "whatever read ahead" * doctest::timeout(60)) {
  ferry_test::watchdog w(std::chrono::seconds(60));
  auto make = [] { return ferry::from_generator(6, [](std::uint64_t i) { return i; }) | ferry::shuffle(6, 7) | ferry::repeat(3); };
  std::vector<std::uint64_t> second;  // epoch 1 after a whole epoch 0
  {
    auto p = make();
    REQUIRE(drain(p).size() == 18);
    p.rewind();
    second = drain(p);
    REQUIRE(second.size() == 18);
  }
  for (std::size_t taken : {0, 1, 5, 6, 7, 12, 17, 18}) {
    CAPTURE(taken);
    auto p = make();
    for (std::size_t i = 0; i < taken; ++i) REQUIRE(p.next());
    p.rewind();
    CHECK(drain(p) == second);
  }
  // Under a parallel map and a prefetch, which read passes ahead of the consumer.
  for (int round = 0; round < 20; ++round) {
    CAPTURE(round);
    auto m = make() | ferry::map([](std::uint64_t x) { return x; }, {.workers = 2, .window = 8});
    REQUIRE(m.next());
    m.rewind();
    CHECK(drain(m) == second);
    auto q = make() | ferry::prefetch(16);
    REQUIRE(q.next());
    q.rewind();
    CHECK(drain(q) == second);
  }
  // A repeat(0) and an empty dataset rewind nothing more.
  auto z = make() | ferry::repeat(0);
  CHECK(drain(z).empty());
  z.rewind();
  CHECK(drain(z).empty());
}

TEST_CASE("take never pulls more than it hands out") {
  ferry_test::counting_source src(100);
  auto calls = src.calls();
  auto p = std::move(src) | ferry::take(7);
  CHECK(drain(p).size() == 7);
  CHECK(*calls == 7);
}


TEST_CASE("repeat: upstream errors reach the consumer in every epoch; nothing lost") {
  for (std::uint64_t n : {1, 2, 9})
    for (const std::vector<std::uint64_t>& fails : std::vector<std::vector<std::uint64_t>>{{0}, {n - 1}, {0, n - 1}}) {
      CAPTURE(n);
      CAPTURE(fails.size());
      auto p = ferry_test::failing_source(n, fails) | ferry::repeat(3);
      std::vector<std::string> expect;
      for (int epoch = 0; epoch < 3; ++epoch) {
        auto one = naive(n, fails);
        expect.insert(expect.end(), one.begin(), one.end());
      }
      // n == 1 with its only element failing: the epochs are not empty, so all three run.
      CHECK(events(p) == expect);
    }
}

TEST_CASE("take: an upstream error reaches the consumer and does not count toward n") {
  for (std::uint64_t k : {0, 3, 6, 7, 9}) {
    CAPTURE(k);
    auto p = ferry_test::failing_source(10, {k}) | ferry::take(7);
    std::vector<std::string> expect;
    std::size_t taken = 0;
    for (auto& e : naive(10, {k})) {
      if (taken == 7) break;
      expect.push_back(e);
      if (e[0] != '!') ++taken;
    }
    CHECK(events(p) == expect);
  }
}

TEST_CASE("repeat and take resume exactly around an upstream error") {
  auto make = [] { return ferry_test::failing_source(6, {2}) | ferry::repeat(3) | ferry::take(14); };
  auto ref = make();
  const auto all = events(ref);
  REQUIRE(all.size() == 17);  // 14 elements, 3 errors (the third epoch ends at the take)
  resumes_everywhere(make);
}

namespace {

using namespace std::chrono_literals;



// What a consumer that goes on after errors gets, split: the numbers (a batch's rows
// flattened) in order, and the error messages in order.
struct pulled {
  std::vector<std::uint64_t> values;
  std::vector<std::string> errors;
};
template <class E>
void put_values(pulled& p, const E& e) {
  if constexpr (requires { e.field(); })
    for (auto x : e.field()) p.values.push_back(x);
  else
    p.values.push_back(e);
}
// An error as the tests compare it: its message, less an inline map's "map: user function
// threw at element <k>: " (the map numbers elements by what it pulled, and a bulk run an
// upstream error cut short is not counted, so <k> depends on how it was pulled; the
// function's own message names the element).
std::string error_text(const std::exception& e) {
  const std::string m = e.what(), prefix = "map: user function threw at element ";
  if (m.rfind(prefix, 0) == 0)
    if (const auto colon = m.find(": ", prefix.size()); colon != std::string::npos) return m.substr(colon + 2);
  return m;
}
// Through next() only, to the end of the epoch.
template <class S>
pulled pull_next(S& s) {
  pulled p;
  for (std::size_t guard = 0; guard < 100000; ++guard) {
    try {
      auto e = s.next();
      if (!e) break;
      put_values(p, *e);
    } catch (const std::exception& e) {
      p.errors.push_back(error_text(e));
    }
  }
  return p;
}
// Through a random mix of next() and next_bulk(k) (k in [0, 9], 0 included), to the end
// of the epoch.
template <class S>
pulled pull_mixed(S& s, ferry::detail::splitmix64& g) {
  pulled p;
  std::vector<std::uint64_t> buf(9);
  for (std::size_t guard = 0; guard < 100000; ++guard) {
    try {
      if (g.below(3) == 0) {
        auto e = s.next();
        if (!e) break;
        p.values.push_back(*e);
      } else {
        const std::size_t want = g.below(10);
        const std::size_t k = s.next_bulk(std::span<std::uint64_t>(buf).first(want));
        REQUIRE(k <= want);
        p.values.insert(p.values.end(), buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(k));
        if (want > 0 && k < want) break;
      }
    } catch (const std::exception& e) {
      p.errors.push_back(error_text(e));
    }
  }
  return p;
}

// True when `sub` is a subsequence of `whole` (in order, each once).
template <class T>
bool subsequence(const std::vector<T>& sub, const std::vector<T>& whole) {
  auto it = whole.begin();
  for (const auto& x : sub) {
    it = std::find(it, whole.end(), x);
    if (it == whole.end()) return false;
    ++it;
  }
  return true;
}

// The upstreams of the property test. Each is deterministic, so pulled again it is "the
// same upstream"; values are the element's index, so an element is known by its value.
//   0: bulk_double (a failing run's elements before the error go with it)
//   1: from_generator whose function throws (the same, as element_error)
//   2: bulk_double | inline map whose function also throws: the map pulls the run as one
//      unit, so an error in it loses the run's elements after the error too
struct fails_at {
  std::vector<std::uint64_t> at;
  std::string what;
  std::uint64_t operator()(std::uint64_t i) const {
    if (std::find(at.begin(), at.end(), i) != at.end()) throw std::runtime_error(what + std::to_string(i));
    return i;
  }
};
class any_upstream : public ferry::source_interface<any_upstream> {
 public:
  using value_type = std::uint64_t;
  any_upstream(int kind, std::uint64_t size, const std::vector<std::uint64_t>& fails,
               const std::vector<std::uint64_t>& map_fails) {
    if (kind == 0) a_.emplace(size, fails);
    if (kind == 1) b_.emplace(ferry::from_generator(size, fails_at{fails, "failed at "}));
    if (kind == 2) c_.emplace(bulk_double(size, fails) | ferry::map(fails_at{map_fails, "map failed at "}));
  }
  std::optional<value_type> next() { return a_ ? a_->next() : b_ ? b_->next() : c_->next(); }
  std::size_t next_bulk(std::span<value_type> out) {
    return a_ ? a_->next_bulk(out) : b_ ? b_->next_bulk(out) : c_->next_bulk(out);
  }

 private:
  std::optional<bulk_double> a_;
  std::optional<decltype(ferry::from_generator(0, fails_at{}))> b_;
  std::optional<decltype(bulk_double(0) | ferry::map(fails_at{}))> c_;
};
auto upstream(int kind, std::uint64_t size, const std::vector<std::uint64_t>& fails,
              const std::vector<std::uint64_t>& map_fails) {
  return any_upstream(kind, size, fails, map_fails);
}

// Pulls `s` (take(n) or skip(n) over an upstream) one of four ways: 0 next() only, 1 a
// random mix of next() and next_bulk(), 2 through batch(b) (its bulk path), 3 through an
// inline map and batch(b) (the map pulls runs from it).
template <class S>
pulled pull_way(S s, int way, std::size_t b, ferry::detail::splitmix64& g) {
  if (way == 0) return pull_next(s);
  if (way == 1) return pull_mixed(s, g);
  if (way == 2) {
    auto p = std::move(s) | ferry::batch(b);
    return pull_next(p);
  }
  auto p = std::move(s) | ferry::map([](std::uint64_t x) { return x; }) | ferry::batch(b);
  return pull_next(p);
}

}  // namespace

TEST_CASE("take(n) | batch over a bulk error: nothing past the first n, so never one of skip(n)'s") {
  // 0..19 with element 2 failing: the first 5 elements are 0 1 3 4 5; skip(5) hands on 6.
  auto gen = [] {
    return ferry::from_generator(20, [](std::uint64_t i) -> std::uint64_t {
      if (i == 2) throw std::runtime_error("bad");
      return i;
    });
  };
  auto t = gen() | ferry::take(5) | ferry::batch(4);
  const auto got = pull_next(t);
  // The run 0 1 !2 3 threw after using up 0 and 1 (they go with it): take counts the run
  // less the error, 3, so it hands on 2 more; 5, the fifth element, is lost, never 6 or 7.
  CHECK(got.values == std::vector<std::uint64_t>{3, 4});
  CHECK(got.errors.size() == 1);
  auto s = gen() | ferry::skip(5);
  const auto rest = pull_next(s);
  CHECK(rest.values.front() == 6);
  for (auto x : got.values) CHECK(std::find(rest.values.begin(), rest.values.end(), x) == rest.values.end());
  // Through next() nothing is lost: 0 1 3 4 5, then skip's 6 onward.
  auto e = gen() | ferry::take(5);
  CHECK(pull_next(e).values == std::vector<std::uint64_t>{0, 1, 3, 4, 5});
}

TEST_CASE("take's next_bulk: a failed run counts all it may have used up but the error; a run of one is exact") {
  bulk_double src(20, {2});
  auto calls = src.counts();
  auto p = std::move(src) | ferry::take(5);
  std::vector<std::uint64_t> buf(4);
  CHECK_THROWS_WITH(p.next_bulk(std::span<std::uint64_t>(buf)), "failed at 2");
  const std::uint64_t up_tag = ferry::detail::stage_tag("bulk_double"), tag = ferry::detail::stage_tag("take");
  CHECK(ferry::save_state(p).words == std::vector<std::uint64_t>{up_tag, 3, tag, 3});  // 0, 1 and one more
  REQUIRE(p.next_bulk(std::span<std::uint64_t>(buf)) == 2);  // what is left of n, no more
  CHECK(buf[0] == 3);
  CHECK(buf[1] == 4);
  CHECK(p.next_bulk(std::span<std::uint64_t>(buf)) == 0);
  CHECK_FALSE(p.next());
  CHECK(calls->bulk == 2);
  CHECK(calls->next == 0);
  // Runs of one lose nothing: the same as next(), errors in place and not counted.
  for (std::uint64_t n : {0, 1, 3, 4, 6, 8}) {
    CAPTURE(n);
    auto a = bulk_double(10, {1, 3, 4}) | ferry::take(n);
    auto b = bulk_double(10, {1, 3, 4}) | ferry::take(n) | ferry::batch(1);
    const auto want = pull_next(a), got = pull_next(b);
    CHECK(got.values == want.values);
    CHECK(got.errors == want.errors);
    CHECK(got.values == first(std::vector<std::uint64_t>{0, 2, 5, 6, 7, 8, 9}, n));
  }
}

TEST_CASE("once n are taken, take calls the upstream no more: take(0) never does") {
  {
    bulk_double src(10);
    auto calls = src.counts();
    auto p = std::move(src) | ferry::take(0) | ferry::batch(4);
    CHECK_FALSE(p.next());
    CHECK_FALSE(p.next());
    CHECK(calls->bulk == 0);
    CHECK(calls->next == 0);
  }
  {
    bulk_double src(10);
    auto calls = src.counts();
    auto p = std::move(src) | ferry::take(3) | ferry::batch(3);
    REQUIRE(p.next());
    CHECK(calls->bulk == 1);
    CHECK_FALSE(p.next());
    CHECK_FALSE(p.next());
    CHECK(calls->bulk == 1);  // the second and third batches: n was reached, no call
    CHECK(calls->next == 0);
  }
  {
    bulk_double src(10);
    auto calls = src.counts();
    auto p = std::move(src) | ferry::take(2);
    std::vector<std::uint64_t> buf(4);
    CHECK(p.next_bulk(std::span<std::uint64_t>(buf).first(0)) == 0);  // an empty run: no call either
    CHECK(calls->bulk == 0);
    CHECK(p.next_bulk(std::span<std::uint64_t>(buf)) == 2);
    CHECK(p.next_bulk(std::span<std::uint64_t>(buf)) == 0);
    CHECK_FALSE(p.next());
    CHECK(calls->bulk == 1);
    CHECK(calls->next == 0);
    p.rewind();  // a new epoch takes again
    CHECK(p.next() == std::optional<std::uint64_t>(0));
    CHECK(calls->next == 1);
  }
}

TEST_CASE("take(0) over a parallel map never starts its workers" * doctest::timeout(30)) {
  ferry_test::watchdog w(30s);
  auto calls = std::make_shared<std::atomic<std::uint64_t>>(0);
  {
    auto p = ferry::from_generator(100000, [](std::uint64_t i) { return i; }) |
             ferry::map([calls](std::uint64_t x) { return ++*calls, x; }, {.workers = 2}) | ferry::take(0) |
             ferry::batch(8);
    CHECK_FALSE(p.next());
    CHECK_FALSE(p.next());
    // Started workers would read ahead (a window of thousands) at once; give them time.
    for (int i = 0; i < 20 && calls->load() == 0; ++i) std::this_thread::sleep_for(10ms);
  }
  CHECK(calls->load() == 0);
}

TEST_CASE("a restored state that took more than n is refused, naming take and both numbers") {
  auto a = bulk_double(20) | ferry::take(10);
  for (int i = 0; i < 8; ++i) REQUIRE(a.next());
  const auto st = ferry::save_state(a);
  auto b = bulk_double(20) | ferry::take(5);
  CHECK_THROWS_WITH_AS(ferry::restore_state(b, st),
                       "restore_state: take: the state took 8 elements, more than this take(5) hands on "
                       "(saved from a take of a larger n?)",
                       ferry::config_error);
  // Through bytes, as from a checkpoint file, and on the bulk path: refused the same.
  auto c = bulk_double(20) | ferry::take(5);
  CHECK_THROWS_AS(ferry::restore_state(c, ferry::pipeline_state::from_bytes(st.to_bytes())), ferry::config_error);
  // A state at exactly n restores to the end; one below n hands on the rest of this n.
  auto d = bulk_double(20) | ferry::take(8);
  ferry::restore_state(d, st);
  std::vector<std::uint64_t> buf(16);
  CHECK(d.next_bulk(std::span<std::uint64_t>(buf)) == 0);
  CHECK_FALSE(d.next());
  auto e = bulk_double(20) | ferry::take(9);
  ferry::restore_state(e, st);
  REQUIRE(e.next_bulk(std::span<std::uint64_t>(buf)) == 1);
  CHECK(buf[0] == 8);
}

TEST_CASE(
    "property: take(n) and skip(n) over the same upstream never share an element; with next() they lose nothing") {
  ferry::detail::splitmix64 g(23);
  for (int round = 0; round < 3000; ++round) {
    const int kind = static_cast<int>(g.below(3));
    const std::uint64_t size = round % 17 == 0 ? 0 : g.below(60);
    const std::uint64_t n = round % 9 == 0 ? size : g.below(size + 4);
    std::vector<std::uint64_t> fails, map_fails;
    const std::uint64_t nf = round % 5 == 0 ? 0 : g.below(5);
    for (std::uint64_t i = 0; i < nf && size > 0; ++i) fails.push_back(g.below(size));
    if (kind == 2)
      for (std::uint64_t i = 0, m = g.below(3); i < m && size > 0; ++i) map_fails.push_back(g.below(size));
    const int take_way = static_cast<int>(g.below(4)), skip_way = static_cast<int>(g.below(4));
    const std::size_t tb = 1 + g.below(9), sb = 1 + g.below(9);
    CAPTURE(round);
    CAPTURE(kind);
    CAPTURE(size);
    CAPTURE(n);
    CAPTURE(fails.size());
    CAPTURE(map_fails.size());
    CAPTURE(take_way);
    CAPTURE(skip_way);
    CAPTURE(tb);
    CAPTURE(sb);
    // The oracle: the upstream pulled element by element; the first n of its elements
    // are take's, the rest skip's.
    auto up = upstream(kind, size, fails, map_fails);
    const pulled whole = pull_next(up);
    const auto head = first(whole.values, n), tail = drop(whole.values, n);
    const pulled t = pull_way(upstream(kind, size, fails, map_fails) | ferry::take(n), take_way, tb, g);
    const pulled s = pull_way(upstream(kind, size, fails, map_fails) | ferry::skip(n), skip_way, sb, g);
    // Never an element past the first n from take, never one of them from skip: no overlap.
    CHECK(subsequence(t.values, head));
    CHECK(subsequence(s.values, tail));
    for (auto x : t.values) CHECK(std::find(s.values.begin(), s.values.end(), x) == s.values.end());
    CHECK(subsequence(t.errors, whole.errors));  // errors in order, each once
    CHECK(subsequence(s.errors, whole.errors));
    if (whole.errors.empty()) {  // no error: every way is exact
      CHECK(t.values == head);
      CHECK(s.values == tail);
    }
    if (take_way == 0 && skip_way == 0) {  // next() only: exact, together the whole
      CHECK(t.values == head);
      CHECK(s.values == tail);
      auto both = t.values;
      both.insert(both.end(), s.values.begin(), s.values.end());
      CHECK(both == whole.values);
      CHECK(s.errors == whole.errors);  // skip hands on every error
      // take: every error before its n-th element (all of them when it ends with the epoch)
      auto u = upstream(kind, size, fails, map_fails);
      std::vector<std::string> errs;
      std::uint64_t taken = 0;
      for (std::size_t guard = 0; taken < n && guard < 100000; ++guard) {
        try {
          if (!u.next()) break;
          ++taken;
        } catch (const std::exception& e) {
          errs.push_back(error_text(e));
        }
      }
      CHECK(t.errors == errs);
    }
  }
}

TEST_CASE("resume is exact at every batch through take's bulk path, bulk errors included") {
  for (std::uint64_t n : {0, 5, 12, 30, 36, 45}) {
    CAPTURE(n);
    auto make = [n] { return bulk_double(40, {2, 9, 20, 33}) | ferry::take(n) | ferry::batch(4) | ferry::repeat(2); };
    resumes_everywhere(make);
  }
}

// Found by mutation testing (a changed bound, a check or a saved field dropped, each passing
// the suite before): a state saved after the last pass (a checkpoint at the end of training)
// was refused had repeat compared its pass count with >=.
TEST_CASE("repeat(n): a state saved after the last pass restores, at the end") {
  const std::vector<int> v{1, 2, 3};
  auto a = ferry::from_range(v) | ferry::repeat(2);
  CHECK(drain(a).size() == 6);
  const auto st = ferry::save_state(a);
  auto b = ferry::from_range(v) | ferry::repeat(2);
  REQUIRE_NOTHROW(ferry::restore_state(b, st));
  CHECK(!b.next());
}
