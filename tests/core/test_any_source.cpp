// any_source<T>: a pipeline whose type is erased gives what the typed pipeline gives
// (elements, errors, epochs, checkpoints, report), for pipelines chosen at run time; its
// bulk and borrowing paths; the capabilities the held pipeline lacks as config_errors;
// distribute() through it (batch size, pinned-memory hook).
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <unistd.h>
#include <vector>

#include "common/doubles.hpp"
#include "failing_source.hpp"
#include "take_skip.hpp"
#include "ferry/any_source.hpp"
#include "ferry/ferry.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/interleave.hpp"

using namespace std::chrono_literals;
using ferry_test::drain;
using ferry_test::watchdog;

namespace {

using u64 = std::uint64_t;

u64 mix(u64 x) { return x * 0x9e3779b97f4a7c15ull ^ (x >> 7); }

// One of several differently typed pipelines over the same n elements, by `shape`: what a
// program builds from its configuration. make_typed(shape) must give the same elements.
ferry::any_source<u64> make_erased(int shape, u64 n) {
  auto base = ferry::from_generator(n, [](u64 i) { return mix(i); });
  switch (shape) {
    case 0: return base;
    case 1: return std::move(base) | ferry::shuffle(37, 5);
    case 2: return std::move(base) | ferry::filter([](u64 x) { return x % 3 != 0; }) | ferry::shard(2, 1);
    case 3: return std::move(base) | ferry::map([](u64 x) { return x ^ 0xff; }, {.workers = 2, .window = 8});
    default: return std::move(base) | ferry::skip(5) | ferry::take(n / 2) | ferry::prefetch(3);
  }
}
// Two epochs (drain, rewind, drain) of the typed pipeline of `shape`.
template <class P>
std::vector<std::vector<u64>> two_epochs(P p) {
  std::vector<std::vector<u64>> out;
  out.push_back(drain(p));
  p.rewind();
  out.push_back(drain(p));
  return out;
}
std::vector<std::vector<u64>> typed(int shape, u64 n) {
  auto base = ferry::from_generator(n, [](u64 i) { return mix(i); });
  switch (shape) {
    case 0: return two_epochs(std::move(base));
    case 1: return two_epochs(std::move(base) | ferry::shuffle(37, 5));
    case 2:
      return two_epochs(std::move(base) | ferry::filter([](u64 x) { return x % 3 != 0; }) | ferry::shard(2, 1));
    case 3: return two_epochs(std::move(base) | ferry::map([](u64 x) { return x ^ 0xff; }, {.workers = 2, .window = 8}));
    default: return two_epochs(std::move(base) | ferry::skip(5) | ferry::take(n / 2) | ferry::prefetch(3));
  }
}

// A plain source with no rewind, no save and no bulk path: 0..n-1.
class bare_source {
 public:
  using value_type = u64;
  explicit bare_source(u64 n) : n_(n) {}
  std::optional<u64> next() {
    if (i_ >= n_) return std::nullopt;
    return i_++;
  }

 private:
  u64 n_, i_ = 0;
};

struct temp_file {
  std::string path;
  explicit temp_file(const std::string& bytes) {
    char tmpl[] = "/tmp/ferry-any-XXXXXX";
    const int fd = ::mkstemp(tmpl);
    REQUIRE(fd >= 0);
    REQUIRE(::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()));
    ::close(fd);
    path = tmpl;
  }
  ~temp_file() { std::filesystem::remove(path); }
};

std::string lines_text(u64 n) {
  std::string s;
  for (u64 i = 0; i < n; ++i) s += "line " + std::to_string(mix(i) % (i + 7)) + std::string(i % 5, 'x') + "\n";
  return s;
}

// A record source that lends nothing (no next_borrowed): records built by hand.
class own_records {
 public:
  using value_type = ferry::record;
  explicit own_records(std::vector<std::string> v) : v_(std::move(v)) {}
  std::optional<ferry::record> next() {
    if (i_ >= v_.size()) return std::nullopt;
    const std::string& s = v_[i_++];
    std::shared_ptr<std::byte[]> b(new std::byte[s.size() + 1]);
    for (std::size_t j = 0; j < s.size(); ++j) b[j] = static_cast<std::byte>(s[j]);
    return ferry::record(std::shared_ptr<const std::byte>(b, b.get()), s.size());
  }

 private:
  std::vector<std::string> v_;
  std::size_t i_ = 0;
};

template <class B>
std::vector<std::string> batch_strings(B& batches) {
  std::vector<std::string> out;
  for (auto& b : batches)
    for (std::size_t i = 0; i < b.size(); ++i) {
      auto v = b[i];
      out.emplace_back(reinterpret_cast<const char*>(v.data()), v.size());
    }
  return out;
}

}  // namespace

TEST_CASE("a pipeline chosen at run time gives what the typed pipeline gives, epoch after epoch" *
          doctest::timeout(60)) {
  watchdog w(60s);
  for (int shape = 0; shape < 5; ++shape)
    for (u64 n : {0ull, 1ull, 9ull, 100ull, 1000ull}) {
      CAPTURE(shape);
      CAPTURE(n);
      const auto ref = typed(shape, n);
      auto p = make_erased(shape, n);
      CHECK(static_cast<bool>(p));
      CHECK(drain(p) == ref[0]);
      CHECK(!p.next());  // the end stays the end
      REQUIRE(p.can_rewind());
      p.rewind();  // shuffle's second epoch draws another order, erased or not
      CHECK(drain(p) == ref[1]);
    }
}

TEST_CASE("repeat, batch and prefetch over an any_source; erase_type() as a stage" * doctest::timeout(60)) {
  watchdog w(60s);
  auto p = make_erased(1, 300) | ferry::repeat(3) | ferry::batch(32) | ferry::prefetch(2);
  auto q = ferry::from_generator(300, [](u64 i) { return mix(i); }) | ferry::shuffle(37, 5) | ferry::repeat(3) |
           ferry::erase_type() | ferry::batch(32) | ferry::prefetch(2);
  auto r = ferry::from_generator(300, [](u64 i) { return mix(i); }) | ferry::shuffle(37, 5) | ferry::repeat(3) |
           ferry::batch(32) | ferry::prefetch(2);
  static_assert(std::same_as<ferry::value_t<decltype(ferry::from_generator(1, mix) | ferry::erase_type())>, u64>);
  std::size_t batches = 0;
  while (auto c = r.next()) {
    auto a = p.next(), b = q.next();
    REQUIRE(a);
    REQUIRE(b);
    CHECK(std::vector<u64>(a->field().begin(), a->field().end()) == std::vector<u64>(c->field().begin(), c->field().end()));
    CHECK(std::vector<u64>(b->field().begin(), b->field().end()) == std::vector<u64>(c->field().begin(), c->field().end()));
    ++batches;
  }
  CHECK(batches == (900 + 31) / 32);
  CHECK(!p.next());
  CHECK(!q.next());
}

TEST_CASE("batch() pulls an any_source in runs: the held source's bulk path, or one loop inside it") {
  SUBCASE("bulk source: next_bulk forwarded, no next() per element") {
    ferry_test::bulk_double src(1000);
    auto calls = src.counts();
    auto p = ferry::any_source<u64>(std::move(src)) | ferry::batch(100);
    u64 expect = 0, batches = 0;
    for (auto& b : p) {
      for (u64 x : b.field()) CHECK(x == expect++);
      ++batches;
    }
    CHECK(expect == 1000);
    CHECK(batches == 10);
    CHECK(calls->next == 0);
    CHECK(calls->bulk == 11);  // ten full runs and the empty one that ends the epoch
  }
  SUBCASE("plain source: the same batches") {
    auto p = ferry::any_source<u64>(bare_source(250)) | ferry::batch(100, {.drop_remainder = false});
    std::vector<u64> got, sizes;
    for (auto& b : p) {
      sizes.push_back(b.size());
      for (u64 x : b.field()) got.push_back(x);
    }
    CHECK(sizes == std::vector<u64>{100, 100, 50});
    std::vector<u64> ref(250);
    for (u64 i = 0; i < 250; ++i) ref[i] = i;
    CHECK(got == ref);
  }
}

TEST_CASE("upstream errors pass through unchanged, at their place, and iteration goes on") {
  const std::vector<u64> fails{0, 7, 8, 99};
  auto typed_p = ferry_test::bulk_double(100, fails) | ferry::skip(0);
  auto erased = ferry::any_source<u64>(ferry_test::bulk_double(100, fails) | ferry::skip(0));
  const auto want = ferry_test::naive(100, fails);
  CHECK(ferry_test::events(typed_p) == want);
  CHECK(ferry_test::events(erased) == want);
  // Batches over it: the batch being built goes with the error, as without erasure.
  auto tb = ferry_test::bulk_double(100, fails) | ferry::batch(10);
  auto eb = ferry::any_source<u64>(ferry_test::bulk_double(100, fails)) | ferry::batch(10);
  CHECK(ferry_test::events(eb) == ferry_test::events(tb));
}

TEST_CASE("checkpoints: the held pipeline's state, nothing more; typed and erased restore each other") {
  auto make_typed = [] {
    return ferry::from_generator(500, [](u64 i) { return mix(i); }) | ferry::shuffle(64, 3) |
           ferry::filter([](u64 x) { return x % 5 != 0; }) | ferry::repeat(2);
  };
  auto make_any = [&]() -> ferry::any_source<u64> { return make_typed(); };
  for (std::size_t k : {0, 1, 63, 64, 65, 399, 400, 401, 790}) {
    CAPTURE(k);
    auto a = make_typed();
    auto b = make_any();
    for (std::size_t i = 0; i < k; ++i) {
      auto x = a.next(), y = b.next();
      REQUIRE(x);
      REQUIRE(y);
      CHECK(*x == *y);
    }
    const auto sa = ferry::save_state(a), sb = ferry::save_state(b);
    CHECK(sa == sb);
    // Through bytes, across the two forms.
    auto a2 = make_typed();
    ferry::restore_state(a2, ferry::pipeline_state::from_bytes(sb.to_bytes()));
    auto b2 = make_any();
    ferry::restore_state(b2, ferry::pipeline_state::from_bytes(sa.to_bytes()));
    CHECK(drain(a2) == drain(a));
    CHECK(drain(b2) == drain(b));
  }
  // Resume at every event through errors, erased.
  ferry_test::resumes_everywhere(
      [] { return ferry::any_source<u64>(ferry_test::bulk_double(40, {3, 4, 39}) | ferry::take(30)); });
  // A state of another shape is refused, as it is typed.
  auto other = ferry::any_source<u64>(ferry::from_generator(10, mix) | ferry::skip(1));
  auto st = ferry::save_state(other);
  auto p = make_any();
  CHECK_THROWS_AS(ferry::restore_state(p, st), ferry::config_error);
}

TEST_CASE("what the held pipeline cannot do is a config_error, known beforehand") {
  ferry::any_source<u64> p = bare_source(5);
  CHECK(!p.can_rewind());
  CHECK(!p.can_save());
  CHECK(drain(p) == std::vector<u64>{0, 1, 2, 3, 4});
  CHECK_THROWS_AS(p.rewind(), ferry::config_error);
  CHECK_THROWS_AS((void)ferry::save_state(p), ferry::config_error);
  ferry::pipeline_state empty_state;
  auto q = ferry::any_source<u64>(bare_source(5));
  CHECK_THROWS_AS(ferry::restore_state(q, empty_state), ferry::config_error);
  // repeat() over it: the first epoch whole, then the error where the second would start.
  auto r = ferry::any_source<u64>(bare_source(3)) | ferry::repeat(2);
  CHECK(*r.next() == 0);
  CHECK(*r.next() == 1);
  CHECK(*r.next() == 2);
  CHECK_THROWS_WITH_AS(r.next(), doctest::Contains("cannot rewind"), ferry::config_error);
  // Typed pipelines that can, say so.
  auto s = ferry::any_source<u64>(ferry::from_generator(3, mix));
  CHECK(s.can_rewind());
  CHECK(s.can_save());
}

TEST_CASE("an empty any_source (default-constructed, moved from) throws config_error, never crashes") {
  ferry::any_source<u64> e;
  CHECK(!e);
  CHECK_THROWS_AS(e.next(), ferry::config_error);
  CHECK_THROWS_AS(e.rewind(), ferry::config_error);
  CHECK(!e.can_rewind());
  CHECK(!e.can_save());
  ferry::any_source<u64> a = ferry::from_generator(4, mix);
  CHECK(*a.next() == mix(0));
  ferry::any_source<u64> b = std::move(a);
  CHECK(!a);  // NOLINT(bugprone-use-after-move): moved-from is documented as empty
  CHECK_THROWS_AS(a.next(), ferry::config_error);
  CHECK(*b.next() == mix(1));  // the position moved with it
  e = std::move(b);
  CHECK(*e.next() == mix(2));
}

TEST_CASE("records: lent to batch() without a reference each, from from_files or from a plain source") {
  const std::string text = lines_text(300);
  temp_file f(text);
  std::vector<std::string> want;
  {
    std::size_t at = 0;
    while (at < text.size()) {
      const std::size_t nl = text.find('\n', at);
      want.push_back(text.substr(at, nl - at));
      at = nl + 1;
    }
  }
  SUBCASE("from_files: its borrowing path") {
    auto p = ferry::any_source<ferry::record>(ferry::from_files({f.path}, ferry::text_lines{}, {.chunk_bytes = 256})) |
             ferry::batch(32);
    CHECK(batch_strings(p) == want);
  }
  SUBCASE("a source that does not lend: one block per batch holds its records") {
    auto p = ferry::any_source<ferry::record>(own_records(want)) | ferry::batch(32);
    CHECK(batch_strings(p) == want);
  }
  SUBCASE("appended to what the caller holds: each call returns how many it added") {
    ferry::any_source<ferry::record> p = own_records(want);
    ferry::borrowed_records out;
    std::size_t total = 0;
    for (std::size_t n; (n = p.next_borrowed(out, 7)) > 0;) {
      CHECK(n <= 7);
      total += n;
      CHECK(out.views.size() == total);
    }
    CHECK(total == want.size());
    for (std::size_t i = 0; i < want.size(); ++i)
      CHECK(std::string(reinterpret_cast<const char*>(out.views[i].data()), out.views[i].size()) == want[i]);
  }
  SUBCASE("record origins survive erasure") {
    ferry::any_source<ferry::record> p = ferry::from_files({f.path}, ferry::text_lines{});
    auto r1 = p.next(), r2 = p.next();
    REQUIRE(r2);
    CHECK(r2->origin().file == f.path);
    CHECK(r2->origin().offset == want[0].size() + 1);
  }
}

TEST_CASE("distribute() through an any_source: batch()'s size and its pinned-memory hook are found" *
          doctest::timeout(30)) {
  watchdog w(30s);
  auto data = std::vector<u64>(100);
  for (u64 i = 0; i < 100; ++i) data[i] = mix(i);
  {
    ferry::any_source<ferry::batch_of<u64>> b = ferry::from_range(data) | ferry::batch(20) | ferry::prefetch(2);
    CHECK(b.batch_size() == 20);
    auto steps = std::move(b) | ferry::distribute(ferry::host_replicas{4});
    std::vector<u64> got;
    for (auto& st : steps)
      for (std::size_t r = 0; r < 4; ++r)
        for (u64 x : st[r].field<0>()) got.push_back(x);
    CHECK(got == data);
    CHECK(steps.collates_into_distribute_memory());
  }
  {
    // 20 does not divide among 3 replicas: refused before anything runs, as typed.
    ferry::any_source<ferry::batch_of<u64>> b = ferry::from_range(data) | ferry::batch(20);
    auto steps = std::move(b) | ferry::distribute(ferry::host_replicas{3});
    CHECK_THROWS_WITH_AS(steps.next(), doctest::Contains("does not divide"), ferry::config_error);
  }
  {
    // No batch() visible through the held pipeline (a map of batches): size 0, so
    // distribute infers it from the first batch.
    ferry::any_source<ferry::batch_of<u64>> b =
        ferry::from_range(data) | ferry::batch(20) | ferry::map([](ferry::batch_of<u64> x) { return x; });
    CHECK(b.batch_size() == 0);
    auto steps = std::move(b) | ferry::distribute(ferry::host_replicas{2});
    std::size_t n = 0;
    for (auto& st : steps) {
      CHECK(st.global_size() == 20);
      ++n;
    }
    CHECK(n == 5);
  }
}

TEST_CASE("report() sees the held pipeline's stages; any_source is not one of them") {
  ferry::enable_stats(true);
  struct off {
    ~off() { ferry::enable_stats(false); }
  } guard;
  ferry::any_source<u64> p = ferry::from_generator(50, mix) | ferry::skip(10);
  auto b = std::move(p) | ferry::batch(8);
  std::size_t rows = 0;
  for (auto& x : b) rows += x.size();
  CHECK(rows == 40);
  const auto rep = ferry::report(b);
  REQUIRE(rep.stages.size() == 3);
  CHECK(rep.stages[0].kind == "from_generator");  // it names itself (the stage base)
  CHECK(rep.stages[0].elements == 50);
  CHECK(rep.stages[1].kind == "skip");
  CHECK(rep.stages[1].elements == 40);
  CHECK(rep.stages[2].kind == "batch");
  CHECK(rep.stages[2].elements == 5);
  // A plain source inside is counted by the any_source's probe, as a stage would count it.
  ferry::any_source<u64> q = bare_source(7);
  auto c = std::move(q) | ferry::batch(3);
  (void)drain(c);
  const auto rq = ferry::report(c);
  REQUIRE(rq.stages.size() == 2);
  CHECK(rq.stages[0].kind == "source");
  CHECK(rq.stages[0].elements == 7);
}
