// padded_batch: ragged fields padded to one length per batch, against a naive padding
// loop over the same rows; bad options and rows; errors upstream; checkpoints; and
// distribute() splitting padded batches over host replicas.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <memory_resource>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/doubles.hpp"
#include "ferry/detail/random.hpp"
#include "ferry/ferry.hpp"
#include "ferry/stages/distribute.hpp"

namespace {

using i32 = std::int32_t;
using u64 = std::uint64_t;
using seq = std::pair<std::vector<i32>, i32>;  // tokens, label

std::vector<seq> random_rows(ferry::detail::splitmix64& g, std::size_t n, std::size_t max_len) {
  std::vector<seq> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    v[i].first.resize(g.below(max_len + 1));
    for (auto& t : v[i].first) t = i32(g.below(1000));
    v[i].second = i32(i);
  }
  return v;
}

// The oracle: one batch of rows padded by hand.
struct padded_rows {
  std::size_t width = 0;
  std::vector<i32> values, labels;
  std::vector<std::uint32_t> lengths;
};
padded_rows pad_by_hand(const std::vector<seq>& rows, std::size_t first, std::size_t count,
                        const ferry::padded_batch_options& o) {
  padded_rows p;
  std::size_t longest = 0;
  for (std::size_t i = first; i < first + count; ++i) longest = std::max(longest, rows[i].first.size());
  p.width = o.length != ferry::longest_row ? o.length : (longest + o.multiple_of - 1) / o.multiple_of * o.multiple_of;
  for (std::size_t i = first; i < first + count; ++i) {
    const auto& t = rows[i].first;
    const std::size_t k = std::min(t.size(), p.width);
    for (std::size_t j = 0; j < p.width; ++j) p.values.push_back(j < k ? t[j] : i32(o.pad_value));
    p.lengths.push_back(std::uint32_t(k));
    p.labels.push_back(rows[i].second);
  }
  return p;
}

template <class B>
padded_rows as_rows(const B& b) {
  padded_rows p;
  ferry::padded_view<i32> t = b.template field<0>();
  p.width = t.width;
  p.values.assign(t.values.begin(), t.values.end());
  p.lengths.assign(t.lengths.begin(), t.lengths.end());
  auto l = b.template field<1>();
  p.labels.assign(l.begin(), l.end());
  return p;
}

void check_same(const padded_rows& got, const padded_rows& want) {
  CHECK(got.width == want.width);
  CHECK(got.lengths == want.lengths);
  CHECK(got.values == want.values);
  CHECK(got.labels == want.labels);
}

}  // namespace

TEST_CASE("padded_batch matches padding by hand: longest, multiple_of, fixed length, truncate") {
  for (u64 seed = 1; seed <= 40; ++seed) {
    ferry::detail::splitmix64 g(seed);
    const auto rows = random_rows(g, g.below(120), g.below(4) == 0 ? 0 : 1 + g.below(40));
    const std::size_t n = 1 + g.below(17);
    ferry::padded_batch_options o;
    switch (seed % 4) {
      case 0: break;
      case 1: o.multiple_of = 1 + g.below(8); break;
      case 2: o.length = 41 + g.below(5); break;  // longer than any row
      case 3: o.length = 1 + g.below(20), o.truncate = true; break;
    }
    o.pad_value = double(g.below(3)) - 1;
    o.drop_remainder = g.below(2) == 0;
    CAPTURE(seed);
    CAPTURE(n);
    auto p = ferry::from_range(rows) | ferry::padded_batch(n, o);
    static_assert(std::same_as<ferry::value_t<decltype(p)>, ferry::batch_of<std::tuple<ferry::padded<i32>, i32>>>);
    CHECK(p.batch_size() == n);
    std::size_t first = 0;
    for (auto& b : p) {
      REQUIRE(first < rows.size());
      const std::size_t count = std::min(n, rows.size() - first);
      CHECK(b.size() == count);
      check_same(as_rows(b), pad_by_hand(rows, first, count, o));
      first += count;
    }
    CHECK(first == (o.drop_remainder ? rows.size() / n * n : rows.size()));
  }
}

TEST_CASE("padded_batch pads each ragged field to its own length; strings and float vectors") {
  using elem = std::tuple<std::string, std::vector<float>, u64>;
  std::vector<elem> v = {{"ab", {1.f}, 1}, {"", {2.f, 3.f, 4.f}, 2}, {"xyz", {}, 3}};
  auto p = ferry::from_range(v) | ferry::padded_batch(3, {.pad_value = 7});
  auto b = *p.next();
  ferry::padded_view<char> s = b.field<0>();
  ferry::padded_view<float> f = b.field<1>();
  CHECK(s.width == 3);
  CHECK(f.width == 3);
  CHECK(std::string(s[0].begin(), s[0].end()) == std::string("ab\7"));
  CHECK(std::string(s.valid(2).begin(), s.valid(2).end()) == "xyz");
  CHECK(std::vector<std::uint32_t>(s.lengths.begin(), s.lengths.end()) == std::vector<std::uint32_t>{2, 0, 3});
  CHECK(std::vector<float>(f[1].begin(), f[1].end()) == std::vector<float>{2.f, 3.f, 4.f});
  CHECK(std::vector<float>(f[2].begin(), f[2].end()) == std::vector<float>{7.f, 7.f, 7.f});
  CHECK(b.field<2>()[1] == 2);
  CHECK(!p.next());
}

TEST_CASE("padded_batch: a batch of empty rows has L = 0; with a length, all padding") {
  std::vector<seq> v(4);
  auto p = ferry::from_range(v) | ferry::padded_batch(4, {.multiple_of = 8});
  auto b = *p.next();
  CHECK(b.field<0>().width == 0);
  CHECK(b.field<0>().values.empty());
  auto q = ferry::from_range(v) | ferry::padded_batch(2, {.length = 3, .pad_value = -1});
  auto c = *q.next();
  CHECK(c.field<0>().width == 3);
  CHECK(std::vector<i32>(c.field<0>().values.begin(), c.field<0>().values.end()) == std::vector<i32>(6, -1));
  CHECK(c.field<0>().lengths[1] == 0);
}

TEST_CASE("padded_batch: bad options are config_errors when the stage is written") {
  CHECK_THROWS_AS(ferry::padded_batch(0), ferry::config_error);
  CHECK_THROWS_AS(ferry::padded_batch(4, {.length = 0}), ferry::config_error);
  CHECK_THROWS_AS(ferry::padded_batch(4, {.multiple_of = 0}), ferry::config_error);
  CHECK_THROWS_AS(ferry::padded_batch(4, {.truncate = true}), ferry::config_error);
  std::vector<seq> v(3);
  CHECK_THROWS_WITH_AS(ferry::padded_batch(ferry::from_range(v), 4, {.length = 0}),
                       doctest::Contains("length must be at least 1"), ferry::config_error);
}

// A pad_value that the field's type cannot hold would be undefined to convert (-1 to
// uint8): refused, by padded_batch, bucket_by_sequence_length and pack alike, naming the
// field and its type's range; values it holds are taken, the extremes included.
TEST_CASE("padded_batch, bucket_by_sequence_length, pack: a pad_value the field's type cannot hold is refused") {
  using bytes = std::pair<std::vector<std::uint8_t>, std::vector<std::int64_t>>;
  std::vector<bytes> v = {{{1, 2}, {3}}, {{1}, {3, 4}}, {{1, 2}, {3}}};
  auto pb = [&](double pad) { return ferry::from_range(v) | ferry::padded_batch(2, {.pad_value = pad}); };
  CHECK_THROWS_WITH_AS(pb(-1), doctest::Contains("padded_batch: pad_value = -1 is not a value of field 0's type (1-byte unsigned: whole numbers from 0 to 255)"),
                       ferry::config_error);
  CHECK_THROWS_AS(pb(256), ferry::config_error);
  CHECK_THROWS_AS(pb(0.5), ferry::config_error);
  CHECK_THROWS_AS(pb(std::nan("")), ferry::config_error);
  CHECK_THROWS_WITH_AS(pb(-129), doctest::Contains("field 0's type"), ferry::config_error);
  auto b = pb(255).next();  // 255 fits both fields
  REQUIRE(b);
  CHECK(b->field<0>()[1][1] == 255);  // padding, in both fields
  CHECK(b->field<1>()[0][1] == 255);
  std::vector<std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>>> w = {{{1}, {1, 2}}, {{1, 2}, {1}}};
  CHECK_THROWS_WITH_AS(ferry::from_range(w) | ferry::padded_batch(2, {.pad_value = 9.3e18}),
                       doctest::Contains("field 0's type (8-byte signed: whole numbers from -9223372036854775808"),
                       ferry::config_error);
  auto big = (ferry::from_range(w) | ferry::padded_batch(2, {.pad_value = -9223372036854775808.0})).next();
  REQUIRE(big);
  CHECK(big->field<0>()[0][1] == std::numeric_limits<std::int64_t>::min());
  auto len = [](const bytes& e) { return e.first.size(); };
  CHECK_THROWS_WITH_AS(ferry::from_range(v) | ferry::bucket_by_sequence_length(len, {2}, {2, 2}, {.pad_value = 300}),
                       doctest::Contains("bucket_by_sequence_length: pad_value = 300"), ferry::config_error);
  std::vector<std::vector<float>> docs(3, std::vector<float>{1.5f});
  CHECK_THROWS_WITH_AS(ferry::from_range(docs) | ferry::pack(4, 1, {.pad_value = 1e300}),
                       doctest::Contains("pack: pad_value = 1.0000000000000001e+300"), ferry::config_error);
  CHECK_NOTHROW(ferry::from_range(docs) | ferry::pack(4, 1, {.pad_value = -INFINITY}));
}

TEST_CASE("padded_batch: a row longer than the length names the row; the next batch goes on") {
  std::vector<seq> v(10);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = {std::vector<i32>(i == 6 ? 9 : 2, i32(i)), i32(i)};
  auto p = ferry::from_range(v) | ferry::padded_batch(4, {.length = 4});
  CHECK(p.next()->size() == 4);  // rows 0-3
  CHECK_THROWS_WITH_AS(p.next(), doctest::Contains("row 6 of the epoch has 9 values in field 0, more than length = 4"),
                       ferry::config_error);
  auto last = p.next();  // rows 8-9: the failed batch's rows went with it, as in batch()
  REQUIRE(last);
  CHECK(last->field<1>()[0] == 8);
  CHECK(!p.next());
  // truncate: cut to the length, counted as 4.
  auto q = ferry::from_range(v) | ferry::padded_batch(10, {.length = 4, .truncate = true});
  auto b = *q.next();
  CHECK(b.field<0>().lengths[6] == 4);
  CHECK(b.field<0>()[6][3] == 6);
}

TEST_CASE("padded_batch: an error in user code upstream arrives at its place") {
  auto src = ferry::from_generator(20, [](u64 i) -> seq {
    if (i == 5) throw std::runtime_error("bad element 5");
    return {std::vector<i32>(i % 3, i32(i)), i32(i)};
  });
  auto p = std::move(src) | ferry::padded_batch(4);
  CHECK(p.next()->field<1>()[3] == 3);
  CHECK_THROWS_WITH_AS(p.next(), doctest::Contains("bad element 5"), std::runtime_error);
  auto b = p.next();  // rows 6-9: 4 was pulled into the failed batch and dropped with it
  REQUIRE(b);
  CHECK(b->field<1>()[0] == 6);
  CHECK(b->size() == 4);
  // A row named later counts the failed element: row 11 is element 11 (it was "row 10").
  auto long_row = ferry::from_generator(20, [](u64 i) -> seq {
                    if (i == 5) throw std::runtime_error("bad element 5");
                    return {std::vector<i32>(i == 11 ? 9 : 1, i32(i)), i32(i)};
                  }) |
                  ferry::padded_batch(4, {.length = 4});
  CHECK(long_row.next());
  CHECK_THROWS_AS(long_row.next(), std::runtime_error);
  CHECK(long_row.next());  // rows 6-9
  CHECK_THROWS_WITH_AS(long_row.next(), doctest::Contains("row 11 of the epoch has 9 values"), ferry::config_error);
}

TEST_CASE("padded_batch: a checkpoint resumes exactly; another configuration is refused") {
  ferry::detail::splitmix64 g(9);
  const auto rows = random_rows(g, 50, 12);
  const ferry::padded_batch_options o{.multiple_of = 4};
  auto make = [&](ferry::padded_batch_options opt) { return ferry::from_range(rows) | ferry::padded_batch(6, opt); };
  for (std::size_t at = 0; at <= 9; ++at) {
    auto a = make(o);
    for (std::size_t i = 0; i < at; ++i) a.next();
    const auto st = ferry::save_state(a);
    auto b = make(o);
    ferry::restore_state(b, st);
    std::size_t k = 0;
    while (auto x = a.next()) {
      auto y = b.next();
      REQUIRE(y);
      check_same(as_rows(*y), as_rows(*x));
      ++k;
    }
    CHECK(!b.next());
    auto c = make({.length = 12});
    CHECK_THROWS_AS(ferry::restore_state(c, st), ferry::config_error);
  }
  // The row named after a restore is the same row.
  std::vector<seq> v(10, seq{{1, 2}, 0});
  v[7].first.resize(9);
  auto a = ferry::from_range(v) | ferry::padded_batch(2, {.length = 4});
  a.next(), a.next();
  auto b = ferry::from_range(v) | ferry::padded_batch(2, {.length = 4});
  ferry::restore_state(b, ferry::save_state(a));
  b.next();
  CHECK_THROWS_WITH_AS(b.next(), doctest::Contains("row 7 of the epoch"), ferry::config_error);
  b.rewind();
  CHECK(b.next()->size() == 2);
}

TEST_CASE("padded_batch then distribute: each host replica gets its rows and lengths") {
  ferry::detail::splitmix64 g(3);
  const auto rows = random_rows(g, 45, 20);
  for (auto policy : {ferry::remainder_policy::drop, ferry::remainder_policy::pad, ferry::remainder_policy::partial}) {
    auto p = ferry::from_range(rows) | ferry::padded_batch(8) |
             ferry::distribute(ferry::host_replicas{4}, {.remainder = policy});
    std::size_t first = 0, steps = 0;
    for (auto& st : p) {
      ++steps;
      const std::size_t count = std::min<std::size_t>(8, rows.size() - first);
      const padded_rows want = pad_by_hand(rows, first, count, {});
      std::size_t row = 0;
      for (std::size_t r = 0; r < st.replicas(); ++r) {
        ferry::padded_view<i32> t = st[r].field<0>();
        CHECK(t.width == want.width);
        CHECK(t.size() == st[r].size());
        CHECK(st[r].lengths_bytes(0).size() == st[r].size() * 4);
        for (std::size_t i = 0; i < st[r].size(); ++i, ++row) {
          if (i >= st[r].valid()) {  // padding rows (pad policy): length 0, zero values
            CHECK(t.lengths[i] == 0);
            CHECK(std::all_of(t[i].begin(), t[i].end(), [](i32 x) { return x == 0; }));
            continue;
          }
          CHECK(t.lengths[i] == want.lengths[row]);
          CHECK(std::equal(t[i].begin(), t[i].end(), want.values.begin() + std::ptrdiff_t(row * want.width)));
          CHECK(st[r].field<1>()[i] == want.labels[row]);
        }
      }
      first += count;
    }
    CHECK(steps == (policy == ferry::remainder_policy::drop ? 5u : 6u));
  }
}

TEST_CASE("padded_batch collates into distribute's memory") {
  struct counting : std::pmr::memory_resource {
    std::size_t allocs = 0;
    void* do_allocate(std::size_t b, std::size_t a) override {
      ++allocs;
      return std::pmr::new_delete_resource()->allocate(b, a);
    }
    void do_deallocate(void* p, std::size_t b, std::size_t a) override {
      std::pmr::new_delete_resource()->deallocate(p, b, a);
    }
    bool do_is_equal(const std::pmr::memory_resource& o) const noexcept override { return this == &o; }
  };
  auto res = std::make_shared<counting>();
  std::vector<seq> v(16, seq{{1, 2, 3}, 0});
  auto p = ferry::from_range(v) | ferry::padded_batch(8) |
           ferry::distribute(ferry::host_replicas{2}, {.host_resource = res});
  std::size_t steps = 0;
  for (auto& st : p) steps += st.replicas() == 2;
  CHECK(steps == 2);
  CHECK(res->allocs >= 2);
}

TEST_CASE("padded_batch with_mask: a mask per ragged field, 1 for each real value, 0 for padding") {
  for (u64 seed = 1; seed <= 24; ++seed) {
    ferry::detail::splitmix64 g(seed);
    const auto rows = random_rows(g, g.below(60), g.below(4) == 0 ? 0 : 1 + g.below(30));
    const std::size_t n = 1 + g.below(9);
    ferry::padded_batch_options o;
    if (seed % 3 == 1) o.multiple_of = 1 + g.below(8);
    if (seed % 3 == 2) o.length = 1 + g.below(20), o.truncate = true;
    CAPTURE(seed);
    auto p = ferry::from_range(rows) | ferry::padded_batch(n, o, ferry::with_mask);
    static_assert(std::same_as<ferry::value_t<decltype(p)>,
                               ferry::batch_of<std::tuple<ferry::padded<i32>, i32, ferry::padded<std::uint8_t>>>>);
    std::size_t first = 0;
    for (auto& b : p) {
      const std::size_t count = std::min(n, rows.size() - first);
      const padded_rows want = pad_by_hand(rows, first, count, o);
      check_same(as_rows(b), want);  // the fields before the mask are unchanged
      ferry::padded_view<std::uint8_t> m = b.field<2>();
      CHECK(m.width == want.width);
      CHECK(std::vector<std::uint32_t>(m.lengths.begin(), m.lengths.end()) == want.lengths);
      for (std::size_t i = 0; i < count; ++i)
        for (std::size_t j = 0; j < want.width; ++j) CHECK(m[i][j] == (j < want.lengths[i] ? 1 : 0));
      first += count;
    }
    CHECK(first == rows.size());
  }
  // Two ragged fields: two masks, in their order, each of its field's L.
  using elem = std::tuple<std::string, u64, std::vector<float>>;
  std::vector<elem> v = {{"ab", 1, {1.f}}, {"", 2, {2.f, 3.f, 4.f}}};
  auto p = ferry::padded_batch(ferry::from_range(v), 2, {}, ferry::with_mask);
  auto b = *p.next();
  static_assert(decltype(b)::field_count == 5);
  ferry::padded_view<std::uint8_t> ms = b.field<3>(), mf = b.field<4>();
  CHECK(ms.width == 2);
  CHECK(mf.width == 3);
  CHECK(std::vector<std::uint8_t>(ms.values.begin(), ms.values.end()) == std::vector<std::uint8_t>{1, 1, 0, 0});
  CHECK(std::vector<std::uint8_t>(mf.values.begin(), mf.values.end()) == std::vector<std::uint8_t>{1, 0, 0, 1, 1, 1});
}

TEST_CASE("padded_batch with_mask then distribute: each replica's mask matches its rows") {
  ferry::detail::splitmix64 g(5);
  const auto rows = random_rows(g, 37, 15);
  for (auto policy : {ferry::remainder_policy::pad, ferry::remainder_policy::partial}) {
    auto p = ferry::from_range(rows) | ferry::padded_batch(9, ferry::with_mask) |
             ferry::distribute(ferry::host_replicas{3}, {.remainder = policy});
    std::size_t checked = 0;
    for (auto& st : p)
      for (std::size_t r = 0; r < st.replicas(); ++r) {
        ferry::padded_view<i32> t = st[r].field<0>();
        ferry::padded_view<std::uint8_t> m = st[r].field<2>();
        CHECK(m.width == t.width);
        REQUIRE(m.size() == t.size());
        for (std::size_t i = 0; i < t.size(); ++i, ++checked) {
          CHECK(m.lengths[i] == t.lengths[i]);
          for (std::size_t j = 0; j < m.width; ++j) CHECK(m[i][j] == (j < t.lengths[i] ? 1 : 0));
        }
      }
    CHECK(checked >= rows.size());
  }
}

TEST_CASE("padded_batch with_mask: a checkpoint without masks does not restore into one with") {
  ferry::detail::splitmix64 g(4);
  const auto rows = random_rows(g, 20, 6);
  auto a = ferry::from_range(rows) | ferry::padded_batch(4);
  a.next();
  auto b = ferry::from_range(rows) | ferry::padded_batch(4, ferry::with_mask);
  CHECK_THROWS_WITH_AS(ferry::restore_state(b, ferry::save_state(a)), doctest::Contains("mask"), ferry::config_error);
  auto c = ferry::from_range(rows) | ferry::padded_batch(4, ferry::with_mask);
  c.next();
  ferry::restore_state(b, ferry::save_state(c));
  CHECK(as_rows(*b.next()).values == as_rows(*c.next()).values);
}

// Found by mutation testing (a changed bound, a check or a saved field dropped, each passing
// the suite before): a row of exactly the fixed length is no error (only a longer one is),
// and a state saved with truncate is refused by a padded_batch without it.
TEST_CASE("padded_batch: a row of exactly .length fits; another truncate is refused") {
  const std::vector<seq> exact(3, seq{{1, 2, 3, 4}, 0});
  auto p = ferry::from_range(exact) | ferry::padded_batch(2, {.length = 4});
  CHECK_NOTHROW(p.next());
  const std::vector<seq> v(6, seq{{1, 2}, 0});
  auto a = ferry::from_range(v) | ferry::padded_batch(2, {.length = 4, .truncate = true});
  REQUIRE(a.next());
  auto b = ferry::from_range(v) | ferry::padded_batch(2, {.length = 4});
  CHECK_THROWS_AS(ferry::restore_state(b, ferry::save_state(a)), ferry::config_error);
}
