// The source concept, the pipe operator, closures, laziness and range-for.
#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/doubles.hpp"
#include "ferry/ferry.hpp"
#include "ferry/stages/interleave.hpp"

using ferry_test::counting_source;
using ferry_test::drain;

static_assert(ferry::source<counting_source>);
static_assert(ferry::resumable_source<counting_source>);
static_assert(ferry::rewindable_source<counting_source>);
static_assert(!ferry::source<int>);
static_assert(!ferry::source<std::vector<int>>);

TEST_CASE("nothing runs until the first next()") {
  counting_source src(100);
  auto calls = src.calls();
  auto p = std::move(src) | ferry::map([](std::uint64_t x) { return x + 1; }) |
           ferry::filter([](std::uint64_t x) { return x % 2 == 0; }) | ferry::batch(8);
  CHECK(*calls == 0);
  auto b = p.next();
  REQUIRE(b);
  CHECK(b->size() == 8);
  // 8 even values of x+1 need exactly 16 upstream elements: nothing read ahead.
  CHECK(*calls == 16);
}

TEST_CASE("a closure chain is a reusable value") {
  auto prep = ferry::map([](int x) { return x * 3; }) | ferry::filter([](int x) { return x % 2 == 1; }) |
              ferry::take(4);
  for (int start : {0, 1}) {
    std::vector<int> v(20);
    std::iota(v.begin(), v.end(), start);
    auto p = ferry::from_range(v) | prep;
    std::vector<int> expect;
    for (int x : v)
      if ((x * 3) % 2 == 1 && expect.size() < 4) expect.push_back(x * 3);
    CHECK(drain(p) == expect);
  }
}

TEST_CASE("call form and pipe form build the same pipeline") {
  std::vector<int> v{5, 6, 7, 8, 9};
  auto a = ferry::take(ferry::map(ferry::from_range(v), [](int x) { return -x; }), 3);
  auto b = ferry::from_range(v) | ferry::map([](int x) { return -x; }) | ferry::take(3);
  CHECK(drain(a) == drain(b));
}

TEST_CASE("range-for over a pipeline, and ferry::iterate over a user source") {
  int sum = 0;
  for (int x : ferry::from_range(std::vector<int>{1, 2, 3, 4})) sum += x;
  CHECK(sum == 10);
  counting_source src(5);
  std::uint64_t s2 = 0;
  for (auto x : ferry::iterate(src)) s2 += x;
  CHECK(s2 == 10);
}

TEST_CASE("after the end a pipeline keeps returning empty, and rewind starts again") {
  auto p = ferry::from_range(std::vector<int>{1, 2}) | ferry::map([](int x) { return x; });
  CHECK(drain(p).size() == 2);
  CHECK_FALSE(p.next());
  CHECK_FALSE(p.next());
  p.rewind();
  CHECK(drain(p) == std::vector<int>{1, 2});
}

TEST_CASE("from_generator: bounded and open-ended") {
  auto a = ferry::from_generator(4, [](std::uint64_t i) { return int(i * i); });
  CHECK(drain(a) == std::vector<int>{0, 1, 4, 9});
  auto b = ferry::from_generator([](std::uint64_t i) -> std::optional<int> {
    if (i == 3) return std::nullopt;
    return int(i);
  });
  CHECK(drain(b) == std::vector<int>{0, 1, 2});
}

TEST_CASE("filter keeps exactly the elements the predicate accepts") {
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    ferry::detail::splitmix64 g(seed);
    std::vector<std::uint64_t> v(g.below(300));
    for (auto& x : v) x = g();
    const std::uint64_t m = 1 + g.below(5);
    auto p = ferry::from_range(v) | ferry::filter([m](std::uint64_t x) { return x % m == 0; });
    std::vector<std::uint64_t> expect;
    for (auto x : v)
      if (x % m == 0) expect.push_back(x);
    CHECK(drain(p) == expect);
  }
}

// A stage's integer argument keeps its sign (ferry::int_arg): a std::size_t parameter made
// batch(-1) a 2^64 - 1 row batch, and prefetch(-1) (tf.data's AUTOTUNE) and shuffle(-1, s)
// unbounded buffers, with no error.
TEST_CASE("a negative count or size is a config_error naming the stage, in both forms") {
  const std::vector<int> v{1, 2, 3, 4, 5};
  const auto refused = [](auto&& make, const char* stage) {
    INFO(stage);
    CHECK_THROWS_WITH_AS(make(), doctest::Contains(stage), ferry::config_error);
  };
  for (const long long n : {-2LL, -3LL, -1000LL, std::numeric_limits<long long>::min()}) {
    INFO(n);
    refused([&] { return ferry::take(n); }, "take: ");
    refused([&] { return ferry::take(ferry::from_range(v), n); }, "take: ");
    refused([&] { return ferry::skip(n); }, "skip: ");
    refused([&] { return ferry::repeat(ferry::from_range(v), n); }, "repeat: ");
  }
  for (const int n : {-1, -2, -100}) {
    INFO(n);
    refused([&] { return ferry::prefetch(n); }, "prefetch: ");
    refused([&] { return ferry::prefetch(ferry::from_range(v), n); }, "prefetch: ");
    refused([&] { return ferry::shuffle(n, 7); }, "shuffle: ");
    refused([&] { return ferry::shuffle(ferry::from_range(v), n, 7); }, "shuffle: ");
    refused([&] { return ferry::shard(n, 0); }, "shard: ");
    refused([&] { return ferry::shard(2, n); }, "shard: ");
    refused([&] { return ferry::batch(n); }, "batch: ");
    refused([&] { return ferry::batch(ferry::from_range(v), n); }, "batch: ");
    refused([&] { return ferry::padded_batch(n); }, "padded_batch: ");
    refused([&] { return ferry::pack(n, 2); }, "pack: ");
    refused([&] { return ferry::pack(4, n); }, "pack: ");
    refused([&] { return ferry::interleave(n); }, "interleave: ");
  }
  CHECK_THROWS_WITH_AS(ferry::prefetch(-1), doctest::Contains("no autotune"), ferry::config_error);
  CHECK_THROWS_WITH_AS(ferry::prefetch(ferry::autotune), doctest::Contains("no autotune"), ferry::config_error);
  CHECK_THROWS_WITH_AS(ferry::batch(-3), doctest::Contains("got -3"), ferry::config_error);
  static_assert(!std::is_invocable_v<const ferry::batch_t&, bool>, "batch(true) is a mistake, not a size");
  // shuffle has no autotune: ferry::autotune is SIZE_MAX, a buffer of the whole dataset.
  CHECK_THROWS_WITH_AS(ferry::shuffle(ferry::autotune, 1), doctest::Contains("no autotune"), ferry::config_error);
  CHECK_THROWS_WITH_AS(ferry::shuffle(ferry::from_range(v), ferry::autotune, 1), doctest::Contains("no autotune"),
                       ferry::config_error);
  // from_generator's count too: an int -5 was 2^64 - 5 elements.
  const auto gen = [](std::uint64_t i) { return static_cast<int>(i); };
  CHECK_THROWS_WITH_AS(ferry::from_generator(-5, gen), doctest::Contains("from_generator: the count must not be negative (got -5)"),
                       ferry::config_error);
  auto three = ferry::from_generator(std::int8_t{3}, gen);
  CHECK(drain(three) == std::vector<int>{0, 1, 2});
}

// An old-style enum constant is its integer; a scoped enum, a floating value and a wider
// than 64-bit integer (whose high bits a conversion would drop) do not compile.
enum { enum_batch = 2, enum_negative = -2 };
enum class scoped_size : int { two = 2 };
TEST_CASE("an unscoped enum's constant is an integer argument; scoped enums and 128-bit integers are refused") {
  const std::vector<int> v{1, 2, 3, 4, 5};
  auto b = ferry::from_range(v) | ferry::batch(enum_batch);
  std::size_t batches = 0;
  for (const auto& x : b) {
    CHECK(x.size() == (batches < 2 ? 2u : 1u));
    ++batches;
  }
  CHECK(batches == 3);
  auto t = ferry::from_range(v) | ferry::take(enum_batch);
  CHECK(drain(t) == std::vector<int>{1, 2});
  CHECK_THROWS_WITH_AS(ferry::take(enum_negative), doctest::Contains("got -2"), ferry::config_error);
  static_assert(!std::is_invocable_v<const ferry::batch_t&, scoped_size>);
  static_assert(!std::is_invocable_v<decltype(ferry::take), double>);
#if defined(__SIZEOF_INT128__)
  static_assert(!std::is_constructible_v<ferry::int_arg, __int128>);
  static_assert(!std::is_constructible_v<ferry::int_arg, unsigned __int128>);
#endif
}

TEST_CASE("-1 is no limit for take, skip and repeat, as in tf.data; a seed may be negative") {
  const std::vector<int> v{1, 2, 3, 4, 5};
  auto all = ferry::from_range(v) | ferry::take(-1);
  CHECK(drain(all) == v);
  auto none = ferry::from_range(v) | ferry::skip(-1);
  CHECK(drain(none).empty());
  auto forever = ferry::from_range(v) | ferry::repeat(-1) | ferry::take(23);
  const auto got = drain(forever);
  REQUIRE(got.size() == 23);
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == v[i % v.size()]);
  // Unsigned values of every width are taken as they are; a signed seed modulo 2^64.
  auto two = ferry::from_range(v) | ferry::take(std::uint8_t{2});
  CHECK(drain(two) == std::vector<int>{1, 2});
  std::vector<int> w(200);
  std::iota(w.begin(), w.end(), 0);
  auto a = ferry::from_range(w) | ferry::shuffle(64, -7);
  auto b = ferry::from_range(w) | ferry::shuffle(64, std::uint64_t(0) - 7);
  const auto da = drain(a);
  CHECK(da == drain(b));
  CHECK(da != w);
}

// A stage that holds what it pulls marks its thread (detail/holds_ahead.hpp), so that
// distribute onto devices refuses to be pulled there. User functions run with the mark
// cleared (one may drain a device pipeline of its own) and it comes back after each call,
// on a throw too; a function that may hand out a step keeps it. The mark is opened here as
// a holding stage's thread opens it.
TEST_CASE("user functions run with the thread's holding mark cleared; it comes back after, on a throw too") {
  using ferry::detail::holds_ahead;
  using ferry::detail::holding_scopes;
  static_assert(ferry::detail::may_hold_step<ferry::step<int>>::value);
  static_assert(ferry::detail::may_hold_step<std::optional<std::pair<int, ferry::step<int>>>>::value);
  static_assert(ferry::detail::may_hold_step<std::vector<std::tuple<int, std::array<ferry::step<int>, 2>>>>::value);
  static_assert(!ferry::detail::may_hold_step<std::pair<int, std::vector<float>>>::value);
  const std::size_t scopes = holding_scopes.load();
  static const char* const name = "test holder";
  {
    const ferry::detail::holding_ahead holder(name);
    CHECK(holding_scopes.load() == scopes + 1);
    int calls = 0, marked = 0;
    const auto see = [&] {
      ++calls;
      marked += holds_ahead != nullptr;
    };
    const auto count = [&](auto&& p) {  // elements and errors; the mark checked after each next()
      std::pair<std::size_t, std::size_t> n{0, 0};
      for (int guard = 0; guard < 100; ++guard) {
        try {
          const bool got = p.next().has_value();
          CHECK(holds_ahead == name);
          if (!got) return n;
          ++n.first;
        } catch (const ferry::error&) {
          CHECK(holds_ahead == name);
          ++n.second;
        }
      }
      FAIL("no end");
      return n;
    };
    const std::vector<int> xs{1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    const auto fn = [&](int x) {
      see();
      if (x == 4) throw std::runtime_error("four");
      return x;
    };
    using counts = std::pair<std::size_t, std::size_t>;
    CHECK(count(ferry::from_range(xs) | ferry::map(fn)) == counts{9, 1});
    CHECK(count(ferry::from_range(xs) | ferry::map(fn) | ferry::batch(3)) == counts{3, 1});  // the bulk path
    CHECK(count(ferry::from_range(xs) | ferry::map(fn, {.workers = 2})) == counts{9, 1});
    const auto gen = [&](std::uint64_t i) { return fn(static_cast<int>(i) + 1); };
    CHECK(count(ferry::from_generator(10, gen)) == counts{9, 1});
    CHECK(count(ferry::from_generator(10, gen) | ferry::batch(3)) == counts{3, 1});  // the bulk path
    CHECK(count(ferry::from_range(xs) | ferry::filter([&](int x) { return fn(x) % 2 == 0; })) == counts{4, 1});
    CHECK(count(ferry::from_range(xs) | ferry::flat_map([&](int x) { return std::vector<int>(1, fn(x)); })) ==
          counts{9, 1});
    CHECK(count(ferry::from_range(xs) | ferry::interleave([&](int x) { return ferry::from_range(std::vector<int>{fn(x)}); },
                                                          {.workers = 0, .cycle = 2})) == counts{9, 1});
    CHECK(calls == 8 * 10 - 2);  // the bulk map's failed run of 3 maps up to its throw
    CHECK(marked == 0);
    {  // a function that may hand out a step keeps the mark
      const ferry::detail::in_user_code<std::optional<ferry::step<int>>> user;
      CHECK(holds_ahead == name);
    }
    {
      const ferry::detail::in_user_code<int> user;
      CHECK(holds_ahead == nullptr);
    }
    CHECK(holds_ahead == name);
  }
  CHECK(holds_ahead == nullptr);
  CHECK(holding_scopes.load() == scopes);
}
