// batch: collation into one contiguous buffer per field; batch then unbatch is the
// identity; buffers are recycled.
#include <doctest/doctest.h>

#include <array>
#include <cstring>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "common/doubles.hpp"
#include "ferry/ferry.hpp"

using ferry_test::drain;

namespace {
// Elements 0..99 mapped in runs (the bulk path), the map throwing at 42, in batches of 10.
auto throws_at_42() {
  return ferry::from_generator(100, [](std::uint64_t i) { return int(i); }) | ferry::map([](int x) {
           if (x == 42) throw std::runtime_error("bad 42");
           return x;
         }) |
         ferry::batch(10);
}

struct pixel {
  float r, g, b;
  int label;
  bool operator==(const pixel&) const = default;
};
}  // namespace

TEST_CASE("batch then unbatch is the identity for a trivially-copyable struct") {
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    ferry::detail::splitmix64 g(seed);
    std::vector<pixel> v(g.below(200));
    for (auto& p : v) p = {float(g.below(100)), float(g.below(100)), 0.5f, int(g.below(10))};
    const std::size_t n = 1 + g.below(17);
    for (bool drop : {false, true}) {
      auto p = ferry::from_range(v) | ferry::batch(n, {.drop_remainder = drop});
      std::vector<pixel> back;
      std::size_t batches = 0;
      for (auto& b : p) {
        ++batches;
        CHECK((b.size() == n || (!drop && b.size() < n)));
        auto vals = b.field();
        // One contiguous array of the struct.
        CHECK(reinterpret_cast<const std::byte*>(vals.data()) == b.field_bytes(0).data());
        back.insert(back.end(), vals.begin(), vals.end());
      }
      const std::size_t kept = drop ? v.size() / n * n : v.size();
      CHECK(batches == (drop ? v.size() / n : (v.size() + n - 1) / n));
      CHECK(back == std::vector<pixel>(v.begin(), v.begin() + kept));
    }
  }
}

TEST_CASE("a tuple of fields gets one contiguous buffer per field") {
  using elem = std::tuple<std::array<float, 4>, std::int32_t>;
  std::vector<elem> v;
  for (int i = 0; i < 10; ++i) v.push_back({{float(i), float(i) + 0.25f, -1.f, 2.f}, i * 10});
  auto p = ferry::from_range(v) | ferry::batch(4);
  std::vector<elem> back;
  for (auto& b : p) {
    static_assert(ferry::batch_of<elem>::field_count == 2);
    auto xs = b.field<0>();
    auto ys = b.field<1>();
    CHECK(b.field_bytes(0).size() == b.size() * 16);
    CHECK(b.field_bytes(1).size() == b.size() * 4);
    CHECK(reinterpret_cast<std::uintptr_t>(xs.data()) % ferry::buffer_alignment == 0);
    for (std::size_t i = 0; i < b.size(); ++i) back.push_back({xs[i], ys[i]});
  }
  CHECK(back == v);
}

TEST_CASE("ragged fields: values in one buffer plus n+1 offsets") {
  for (std::uint64_t seed = 1; seed <= 10; ++seed) {
    ferry::detail::splitmix64 g(seed);
    std::vector<std::tuple<std::string, int>> v;
    for (int i = 0, n = int(g.below(60)); i < n; ++i)
      v.push_back({std::string(g.below(20), char('a' + g.below(26))), i});
    auto p = ferry::from_range(v) | ferry::batch(1 + g.below(8));
    std::vector<std::tuple<std::string, int>> back;
    for (auto& b : p) {
      auto strs = b.field<0>();
      auto ids = b.field<1>();
      CHECK(strs.offsets.size() == b.size() + 1);
      CHECK(strs.values.size() == strs.offsets.back());
      for (std::size_t i = 0; i < b.size(); ++i)
        back.push_back({std::string(strs[i].begin(), strs[i].end()), ids[i]});
    }
    CHECK(back == v);
  }
}

// Moved from, a batch is empty: it used to keep its size while its buffers had gone, so a
// ragged field's payload_bytes() read offsets through a null pointer.
TEST_CASE("a moved-from batch is empty, every accessor safe; a default step's host batch too") {
  std::vector<std::tuple<std::string, int>> v{{"ab", 1}, {"cde", 2}, {"", 3}};
  auto p = ferry::from_range(v) | ferry::batch(3);
  auto b = p.next();
  REQUIRE(b);
  const std::size_t bytes = b->payload_bytes();
  ferry::batch_of<std::tuple<std::string, int>> kept = std::move(*b);
  CHECK(kept.size() == 3);
  CHECK(kept.payload_bytes() == bytes);
  CHECK(b->size() == 0);  // NOLINT(bugprone-use-after-move): the point
  CHECK(b->empty());
  CHECK(b->payload_bytes() == 0);
  CHECK(b->field_bytes(0).empty());
  CHECK(b->field<0>().offsets.empty());
  CHECK(b->field<1>().empty());
  ferry::batch_of<std::tuple<std::string, int>> again;
  again = std::move(kept);
  CHECK(again.size() == 3);
  CHECK(kept.size() == 0);  // NOLINT(bugprone-use-after-move)
  CHECK(again.field<0>()[1].size() == 3);
  const ferry::step<std::tuple<std::string, int>> none;
  CHECK(none.host_batch().size() == 0);
}

TEST_CASE("batch buffers are recycled: the pool stops allocating after warm-up") {
  auto pool = std::make_shared<ferry::buffer_pool>();
  auto p = ferry::from_generator(10'000, [](std::uint64_t i) { return std::array<float, 16>{float(i)}; }) |
           ferry::batch(100, {.resource = pool});
  std::uint64_t after_warmup = 0;
  int k = 0;
  while (auto b = p.next()) {  // each batch dropped before the next: through the pool
    CHECK(b->field()[0][0] == float(k * 100));
    if (++k == 3) after_warmup = pool->statistics().upstream_allocations;
  }
  CHECK(k == 100);
  CHECK(after_warmup <= 2);
  CHECK(pool->statistics().upstream_allocations == after_warmup);
  CHECK(pool->statistics().reuses >= 95);
  CHECK(pool->statistics().outstanding_bytes == 0);
}

TEST_CASE("range-for collates each batch into the last one's buffers, with the rows next() gives") {
  // refill(): the iterator's batch is reused in place (no pool round trip); a batch moved
  // out of the loop, a short last batch and an error mid-batch all behave as with next().
  for (std::uint64_t seed = 1; seed <= 30; ++seed) {
    CAPTURE(seed);
    ferry::detail::splitmix64 g(seed);
    std::vector<std::uint32_t> v(g.below(2000));
    for (auto& x : v) x = static_cast<std::uint32_t>(g());
    const std::size_t n = 1 + g.below(200);
    const bool drop = g.below(2) == 1;
    const std::uint64_t take_out = g.below(12);  // this batch is moved out of the loop
    auto run = [&](auto make) {
      auto expect = make() | ferry::batch(n, {.drop_remainder = drop});
      std::vector<std::vector<std::uint32_t>> want;
      while (auto b = expect.next()) want.emplace_back(b->field().begin(), b->field().end());
      auto pool = std::make_shared<ferry::buffer_pool>();
      auto p = make() | ferry::batch(n, {.drop_remainder = drop, .resource = pool});
      std::vector<std::vector<std::uint32_t>> got;
      std::vector<ferry::batch_of<std::uint32_t>> kept;
      const void* first = nullptr;
      std::size_t same_buffer = 0;
      for (auto& b : p) {
        if (got.empty()) first = b.field().data();
        if (b.field().data() == first) ++same_buffer;
        got.emplace_back(b.field().begin(), b.field().end());
        if (got.size() == take_out + 1) kept.push_back(std::move(b));
      }
      CHECK(got == want);
      if (!kept.empty())
        CHECK(std::vector<std::uint32_t>(kept[0].field().begin(), kept[0].field().end()) == want[take_out]);
      // Every batch up to the one moved out reused the first one's buffer; after it, a
      // second buffer serves the rest (the pull that finds the end allocates it too).
      CHECK(same_buffer == std::min<std::size_t>(got.size(), take_out + 1));
      CHECK(pool->statistics().upstream_allocations == (kept.empty() ? 1 : 2));
    };
    const std::span<const std::uint32_t> data(v);
    SUBCASE("bulk: from_range | map") {
      run([&] { return ferry::from_range(data) | ferry::map([](std::uint32_t x) { return x ^ 5u; }); });
    }
    SUBCASE("element by element: from_range | filter") {
      run([&] { return ferry::from_range(data) | ferry::filter([](std::uint32_t x) { return x % 3 != 0; }); });
    }
  }
  // Tuples (one buffer per field): reused as a whole.
  auto t = ferry::from_generator(1000, [](std::uint64_t i) { return std::tuple<int, double>(int(i), double(i) / 4); }) |
           ferry::batch(64);
  std::size_t rows = 0;
  for (auto& b : t) {
    for (std::size_t r = 0; r < b.size(); ++r) {
      CHECK(b.field<0>()[r] == int(rows + r));
      CHECK(b.field<1>()[r] == double(rows + r) / 4);
    }
    rows += b.size();
  }
  CHECK(rows == 1000);
}

TEST_CASE("range-for over batch: an error mid-batch ends the loop with nothing reused; the next loop goes on") {
  auto p = throws_at_42();
  std::vector<int> firsts;
  CHECK_THROWS_WITH_AS(
      [&] {
        for (auto& b : p) firsts.push_back(b.field()[0]);
      }(),
      doctest::Contains("element 42"), ferry::element_error);
  CHECK(firsts == std::vector<int>{0, 10, 20, 30});
  for (auto& b : p) firsts.push_back(b.field()[0]);  // the batch holding 42 is dropped
  CHECK(firsts == std::vector<int>{0, 10, 20, 30, 50, 60, 70, 80, 90});
}

TEST_CASE("batch(0) is a config error") {
  CHECK_THROWS_WITH_AS(ferry::batch(0), doctest::Contains("at least 1"), ferry::config_error);
  CHECK_THROWS_AS(ferry::batch(ferry::from_range(std::vector<int>{1}), 0), ferry::config_error);
}

TEST_CASE("from_range | map | batch (the zero-copy bulk path) equals the naive loop") {
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    ferry::detail::splitmix64 g(seed);
    std::vector<std::uint32_t> v(g.below(3000));
    for (auto& x : v) x = static_cast<std::uint32_t>(g());
    const std::size_t n = 1 + g.below(300);
    auto same = ferry::from_range(std::span<const std::uint32_t>(v)) |
                ferry::map([](std::uint32_t x) { return x * 3u + 1u; }) | ferry::batch(n);
    auto wider = ferry::from_range(v) | ferry::map([](std::uint32_t x) { return double(x) / 2; }) |
                 ferry::batch(n, {.drop_remainder = true});
    std::vector<std::uint32_t> a;
    for (auto& b : same) a.insert(a.end(), b.field().begin(), b.field().end());
    std::vector<double> d;
    for (auto& b : wider) {
      CHECK(b.size() == n);
      d.insert(d.end(), b.field().begin(), b.field().end());
    }
    REQUIRE(a.size() == v.size());
    REQUIRE(d.size() == v.size() / n * n);
    for (std::size_t i = 0; i < v.size(); ++i) CHECK(a[i] == v[i] * 3u + 1u);
    for (std::size_t i = 0; i < d.size(); ++i) CHECK(d[i] == double(v[i]) / 2);
  }
}

TEST_CASE("an error in a bulk-mapped batch names its element; the next batch follows it") {
  auto p = throws_at_42();
  for (int k = 0; k < 4; ++k) REQUIRE(p.next());
  CHECK_THROWS_WITH_AS(p.next(), doctest::Contains("element 42"), ferry::element_error);
  auto b = p.next();  // the batch holding element 42 is not delivered; the next one is
  REQUIRE(b);
  CHECK(b->field()[0] == 50);
}

TEST_CASE("a batch size whose bytes overflow is a config_error naming batch, before any allocation") {
  // (2^62 + 1) x 4 bytes wraps a size_t: this once wrote past a 256-byte block.
  CHECK_THROWS_WITH_AS(ferry::from_range(std::vector<int>(100)) | ferry::batch((std::size_t(1) << 62) + 1),
                       doctest::Contains("batch: a batch of 4611686018427387905 rows of 4 bytes"),
                       ferry::config_error);
  CHECK_THROWS_AS(ferry::from_range(std::vector<int>(100)) | ferry::batch(SIZE_MAX), ferry::config_error);
  CHECK_THROWS_AS(ferry::from_range(std::vector<std::array<double, 4>>(3)) | ferry::batch(SIZE_MAX / 16),
                  ferry::config_error);
}

TEST_CASE("a huge batch size allocates for the rows that come, not for the batch size") {
  // batch(2^34) over ten ints: one batch of ten, its buffer 16 MiB at most (not 64 GiB).
  auto p = ferry::from_range(std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}) | ferry::batch(std::size_t(1) << 34);
  auto b = p.next();
  REQUIRE(b);
  CHECK(b->size() == 10);
  CHECK(b->field_buffer(0).size() <= (std::size_t(16) << 20));
  for (int i = 0; i < 10; ++i) CHECK(b->field()[std::size_t(i)] == i);
  CHECK_FALSE(p.next());
  // Element by element (a filter between: no bulk path) too.
  auto q = ferry::from_range(std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}) |
           ferry::filter([](int x) { return x % 2 == 0; }) | ferry::batch(std::size_t(1) << 34);
  auto c = q.next();
  REQUIRE(c);
  CHECK(c->size() == 5);
  CHECK(c->field_buffer(0).size() <= (std::size_t(16) << 20));
}

TEST_CASE("rows beyond a batch's first buffer: the buffers grow, the rows stay exact") {
  // 1 MiB + 1 byte rows: a batch's buffers start at 15 rows (16 MiB) and double as rows
  // come, up to the batch size (15, 30, 40).
  using row = std::array<std::uint8_t, (std::size_t(1) << 20) + 1>;
  auto make_row = [](std::uint64_t i) {
    row r;
    r.fill(static_cast<std::uint8_t>(i * 37 + 1));
    std::memcpy(r.data(), &i, sizeof i);
    return r;
  };
  for (bool bulk : {true, false}) {
    CAPTURE(bulk);
    std::vector<std::vector<std::uint64_t>> got;
    auto check_batch = [&](const ferry::batch_of<row>& b) {
      got.emplace_back();
      for (std::size_t r = 0; r < b.size(); ++r) {
        const row& x = b.field()[r];
        std::uint64_t i;
        std::memcpy(&i, x.data(), sizeof i);
        got.back().push_back(i);
        CHECK(x[100] == static_cast<std::uint8_t>(i * 37 + 1));
        CHECK(x[row().size() - 1] == static_cast<std::uint8_t>(i * 37 + 1));
      }
    };
    if (bulk) {
      auto p = ferry::from_generator(50, make_row) | ferry::batch(40);
      while (auto b = p.next()) check_batch(*b);
    } else {
      auto p = ferry::from_generator(50, make_row) | ferry::filter([](const row&) { return true; }) | ferry::batch(40);
      while (auto b = p.next()) check_batch(*b);
    }
    REQUIRE(got.size() == 2);
    CHECK(got[0].size() == 40);
    CHECK(got[1].size() == 10);
    for (std::uint64_t i = 0; i < 50; ++i) CHECK(got[i / 40][i % 40] == i);
  }
}

// batch's size is not part of its state (it holds no element between calls): a state
// saved at batch(3) restores into batch(4) and batch(3, drop_remainder), which start at
// the element the saved run's next batch would have. Property over sizes and cut points,
// against the elements of a straight read.
TEST_CASE("batch: a state restores into another batch size at the same element") {
  const std::size_t total = 50;
  auto make = [&](std::size_t n, bool drop) {
    return ferry::from_generator(total, [](std::uint64_t i) { return std::uint32_t(i * 7 + 1); }) |
           ferry::batch(n, {.drop_remainder = drop});
  };
  for (std::size_t n : {1, 3, 7}) {
    for (std::size_t n2 : {1, 4, 7, 64}) {
      for (bool drop : {false, true}) {
        for (std::size_t k = 0; k * n <= total + n; ++k) {
          CAPTURE(n);
          CAPTURE(n2);
          CAPTURE(drop);
          CAPTURE(k);
          auto a = make(n, false);
          std::size_t at = 0;
          for (std::size_t i = 0; i < k; ++i)
            if (auto b = a.next()) at += b->size();
          auto b = make(n2, drop);
          ferry::restore_state(b, ferry::save_state(a));
          std::vector<std::uint32_t> rest;
          while (auto x = b.next()) {
            CHECK(x->size() <= n2);
            if (drop) CHECK(x->size() == n2);
            rest.insert(rest.end(), x->field().begin(), x->field().end());
          }
          const std::size_t left = total - at;
          REQUIRE(rest.size() == (drop ? left / n2 * n2 : left));
          for (std::size_t i = 0; i < rest.size(); ++i) CHECK(rest[i] == std::uint32_t((at + i) * 7 + 1));
        }
      }
    }
  }
}

// Found by mutation testing (a changed bound, a check or a saved field dropped, each passing
// the suite before): drop_remainder was tested only on the bulk path (from_range); an
// upstream pulled element by element (filter) and ragged elements take other paths.
TEST_CASE("batch(drop_remainder): the short last batch is dropped on the element-by-element and ragged paths") {
  const std::vector<int> v(7, 1);
  auto p = ferry::from_range(v) | ferry::filter([](int) { return true; }) | ferry::batch(4, {.drop_remainder = true});
  CHECK(drain(p).size() == 1);
  const std::vector<std::vector<int>> r(7, std::vector<int>{1, 2});
  auto q = ferry::from_range(r) | ferry::batch(4, {.drop_remainder = true});
  CHECK(drain(q).size() == 1);
}
