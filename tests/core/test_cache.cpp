// cache(): in memory and in a file.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "common/doubles.hpp"
#include "failing_source.hpp"
#include "ferry/ferry.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/stages/cache.hpp"
#include "sources/helpers.hpp"

using ferry_test::drain;
using ferry_test::drain_through_errors;
namespace fs = std::filesystem;

namespace {

using item = std::tuple<std::uint64_t, std::string, std::vector<float>>;

// Element i: its index, a string of a length that varies with i, and a few floats.
item make_item(std::uint64_t i) {
  std::string s(static_cast<std::size_t>((i * 7919) % 1500), '\0');
  for (std::size_t k = 0; k < s.size(); ++k) s[k] = static_cast<char>('a' + (i + k) % 26);
  std::vector<float> v(static_cast<std::size_t>(i % 5));
  for (std::size_t k = 0; k < v.size(); ++k) v[k] = static_cast<float>(i) + 0.25f * static_cast<float>(k);
  return {i, std::move(s), std::move(v)};
}

// A generator of make_item(i) that counts its calls.
auto counted_items(std::uint64_t n, std::shared_ptr<std::uint64_t> calls) {
  return ferry::from_generator(n, [calls](std::uint64_t i) {
    ++*calls;
    return make_item(i);
  });
}

// Files in `dir` whose name has ".partial" (a pass that was dropped must leave none).
std::size_t partial_files(const std::string& dir) {
  std::size_t n = 0;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().find(".partial") != std::string::npos) ++n;
  return n;
}

// Where a cache file's elements start: its 32-byte header, then the word count at byte
// 24 of upstream state words.
std::uint64_t elements_start(const std::string& path) {
  const std::string b = src_test::read_file(path);
  std::uint64_t w = 0;
  std::memcpy(&w, b.data() + 24, 8);
  return 32 + 8 * w;
}

// The file offset of element k's frame: the elements' start, then per element its 12-byte
// frame header and payload (a string encodes as an 8-byte length and its bytes).
std::uint64_t string_frame_offset(const std::string& path, const std::vector<std::string>& items, std::size_t k) {
  std::uint64_t at = elements_start(path);
  for (std::size_t i = 0; i < k; ++i) at += 12 + 8 + items[i].size();
  return at;
}

std::vector<std::string> strings(std::size_t n) {
  std::vector<std::string> v;
  for (std::size_t i = 0; i < n; ++i) v.push_back(std::get<1>(make_item(i)) + std::to_string(i));
  return v;
}

}  // namespace

TEST_CASE("cache plays the first whole pass back without running the upstream again") {
  src_test::temp_dir dir;
  for (std::uint64_t n : {0, 1, 7, 3000})  // 3000 items: about 2.3 MB, several write and read chunks
    for (bool file : {false, true}) {
      CAPTURE(n);
      CAPTURE(file);
      auto calls = std::make_shared<std::uint64_t>(0);
      const std::string path = dir / ("pass-" + std::to_string(n));
      std::vector<item> got;
      if (file) {
        auto p = counted_items(n, calls) | ferry::cache(path) | ferry::repeat(3);
        got = drain(p);
        CHECK(p.next() == std::nullopt);
      } else {
        auto p = counted_items(n, calls) | ferry::cache() | ferry::repeat(3);
        got = drain(p);
      }
      std::vector<item> expect;
      for (int e = 0; e < 3; ++e)
        for (std::uint64_t i = 0; i < n; ++i) expect.push_back(make_item(i));
      CHECK(got == expect);
      CHECK(*calls == n);  // one pass of the upstream
      CHECK(fs::exists(path) == file);
      CHECK(partial_files(dir.path) == 0);
    }
}

TEST_CASE("cache(path): elements larger than a read chunk, read ahead or not") {
  src_test::temp_dir dir;
  // Sizes around the 64 KiB headroom and the 1 MiB chunk, in an order that makes the
  // elements cross chunk and read-ahead block boundaries at different places.
  const std::vector<std::size_t> sizes = {10, 70000, 3 << 20, 5, (1 << 20) - 7, 65536, 1 << 20, 200000, 17,
                                          (2 << 20) + 3, 1000, 500000, 600000, 700000};
  auto elem = [&](std::uint64_t i) {
    std::vector<std::uint8_t> v(sizes[i % sizes.size()]);
    for (std::size_t k = 0; k < v.size(); ++k) v[k] = static_cast<std::uint8_t>(k * 31 + i);
    return v;
  };
  std::vector<std::vector<std::uint8_t>> want;
  for (std::uint64_t i = 0; i < 3 * sizes.size(); ++i) want.push_back(elem(i));
  for (std::size_t ahead : {0, 1, 4})
    for (std::size_t threads : {1, 2}) {
      CAPTURE(ahead);
      CAPTURE(threads);
      const std::string path = dir / ("big-" + std::to_string(ahead) + "-" + std::to_string(threads));
      auto calls = std::make_shared<std::uint64_t>(0);
      auto p = ferry::from_generator(want.size(), [&, calls](std::uint64_t i) { return ++*calls, elem(i); }) |
               ferry::cache(path, {.key = "", .read_ahead = ahead, .read_threads = threads}) | ferry::repeat(3);
      const auto got = drain(p);
      REQUIRE(got.size() == 3 * want.size());
      for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == want[i % want.size()]);
      CHECK(*calls == want.size());
    }
}

TEST_CASE("cache then shuffle: a new order each epoch over the kept pass") {
  auto calls = std::make_shared<std::uint64_t>(0);
  auto p = ferry::from_generator(500, [calls](std::uint64_t i) { return ++*calls, i; }) | ferry::cache() |
           ferry::shuffle(500, 11) | ferry::repeat(3);
  auto all = drain(p);
  REQUIRE(all.size() == 1500);
  std::vector<std::uint64_t> e0(all.begin(), all.begin() + 500), e1(all.begin() + 500, all.begin() + 1000);
  CHECK(e0 != e1);
  std::sort(e0.begin(), e0.end());
  std::sort(e1.begin(), e1.end());
  CHECK(e0 == e1);
  CHECK(*calls == 500);
}

TEST_CASE("a pass cut short or with an upstream error is handed on and not kept") {
  src_test::temp_dir dir;
  for (bool file : {false, true}) {
    CAPTURE(file);
    const std::string path = dir / (file ? "f" : "m");
    // An error in every pass: each pass reads the upstream again, nothing is lost.
    {
      auto run = [&](auto p) {
        for (int pass = 0; pass < 3; ++pass) {
          std::vector<std::string> errors;
          auto got = drain_through_errors(p, errors);
          CHECK(got == std::vector<std::uint64_t>{0, 1, 2, 3, 5, 6, 7, 8, 9});
          CHECK(errors == std::vector<std::string>{"failed at 4"});
          p.rewind();
        }
        CHECK_FALSE(p.cached());
      };
      if (file)
        run(ferry_test::failing_source(10, {4}) | ferry::cache(path));
      else
        run(ferry_test::failing_source(10, {4}) | ferry::cache());
      CHECK_FALSE(fs::exists(path));
      CHECK(partial_files(dir.path) == 0);
    }
    // An error in the first pass only: the second pass is kept, the third is replayed.
    {
      auto calls = std::make_shared<std::uint64_t>(0);
      auto failed = std::make_shared<bool>(false);
      auto gen = ferry::from_generator(10, [calls, failed](std::uint64_t i) {
        ++*calls;
        if (i == 4 && !*failed) {
          *failed = true;
          throw std::runtime_error("once");
        }
        return i;
      });
      auto run = [&](auto p) {
        std::vector<std::string> errors;
        CHECK(drain_through_errors(p, errors).size() == 9);
        CHECK(errors.size() == 1);
        p.rewind();
        CHECK(drain(p).size() == 10);
        CHECK(p.cached());
        CHECK(*calls == 20);
        p.rewind();
        std::vector<std::uint64_t> all(10);
        std::iota(all.begin(), all.end(), 0);
        CHECK(drain(p) == all);
        CHECK(*calls == 20);
      };
      if (file)
        run(std::move(gen) | ferry::cache(path));
      else
        run(std::move(gen) | ferry::cache());
      CHECK(fs::exists(path) == file);
    }
    fs::remove(path);
    // Cut short: three elements, then rewind; the next pass reads the upstream again.
    {
      ferry_test::counting_source src(10);
      auto calls = src.calls();
      auto run = [&](auto p) {
        for (int i = 0; i < 3; ++i) CHECK(p.next());
        p.rewind();
        CHECK(drain(p).size() == 10);
        CHECK(*calls == 3 + 11);  // 11: ten elements and the end
        p.rewind();
        CHECK(drain(p).size() == 10);
        CHECK(*calls == 14);
      };
      if (file)
        run(std::move(src) | ferry::cache(path));
      else
        run(std::move(src) | ferry::cache());
      CHECK(partial_files(dir.path) == 0);
    }
  }
}

TEST_CASE("cache(path): a later pipeline reads the file and never its upstream") {
  src_test::temp_dir dir;
  const std::string path = dir / "records.cache";
  const auto want = strings(300);
  auto bytes_of = [](const std::string& s) {
    auto b = std::shared_ptr<std::byte[]>(new std::byte[s.size() + 1]);
    std::memcpy(b.get(), s.data(), s.size());
    return ferry::record(std::shared_ptr<const std::byte>(b, b.get()), s.size());
  };
  {
    auto p = ferry::from_generator(want.size(), [&](std::uint64_t i) { return bytes_of(want[i]); }) |
             ferry::cache(path, {.key = "v1"});
    CHECK(drain(p).size() == want.size());
  }
  auto never = [](std::uint64_t) -> ferry::record { throw std::logic_error("the upstream ran"); };
  {
    auto p = ferry::from_generator(want.size(), never) | ferry::cache(path, {.key = "v1"}) | ferry::repeat(2);
    auto got = drain(p);
    REQUIRE(got.size() == 2 * want.size());
    for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i].str() == want[i % want.size()]);
    // A record read back names the cache file and where its length word is.
    const std::uint64_t start = elements_start(path);
    CHECK(start == 40);  // the header: 32 bytes and the pass id
    CHECK(got[0].origin().file == path);
    CHECK(got[0].origin().offset == start + 12);
    CHECK(got[0].origin().data_offset == start + 12 + 8);
    CHECK(got[5].origin().offset == string_frame_offset(path, want, 5) + 12);
  }
  // Another key, another element type, a file that is not a cache: refused, left alone.
  {
    auto p = ferry::from_generator(want.size(), never) | ferry::cache(path, {.key = "v2"});
    CHECK_THROWS_WITH_AS(p.next(), doctest::Contains("another cache_options::key"), ferry::config_error);
    CHECK_THROWS_AS(p.next(), ferry::config_error);  // again: the pipeline is misconfigured
  }
  {
    auto p = ferry::from_generator(3, [](std::uint64_t i) { return int(i); }) | ferry::cache(path, {.key = "v1"});
    CHECK_THROWS_WITH_AS(p.next(), doctest::Contains("another type"), ferry::config_error);
  }
  {
    const std::string other = dir / "notes.txt";
    src_test::write_file(other, "my notes, not a cache");
    auto p = ferry::from_generator(3, [](std::uint64_t i) { return int(i); }) | ferry::cache(other);
    CHECK_THROWS_WITH_AS(p.next(), doctest::Contains("not a ferry cache file"), ferry::config_error);
    CHECK(src_test::read_file(other) == "my notes, not a cache");
  }
  CHECK_THROWS_AS(ferry::from_generator(3, never) | ferry::cache(dir.path), ferry::config_error);
  CHECK_THROWS_AS(ferry::from_generator(3, never) | ferry::cache(""), ferry::config_error);
}

TEST_CASE("a damaged cache file: an error with the file and offset, then the upstream refills it") {
  src_test::temp_dir dir;
  const std::string path = dir / "s.cache";
  const auto want = strings(200);
  auto calls = std::make_shared<std::uint64_t>(0);
  auto make = [&] {
    return ferry::from_generator(want.size(), [&, calls](std::uint64_t i) { return ++*calls, want[i]; }) |
           ferry::cache(path);
  };
  auto fill = [&] {
    fs::remove(path);
    auto p = make();
    REQUIRE(drain(p) == want);
    *calls = 0;
  };
  SUBCASE("a flipped byte in element 50") {
    fill();
    std::string bytes = src_test::read_file(path);
    const std::uint64_t at = string_frame_offset(path, want, 50);
    bytes[at + 12 + 8 + 3] ^= 0x20;
    src_test::write_file(path, bytes);
    auto p = make();
    std::vector<std::string> got;
    for (int i = 0; i < 50; ++i) got.push_back(*p.next());
    CHECK(got == std::vector<std::string>(want.begin(), want.begin() + 50));
    try {
      (void)p.next();
      FAIL("no error");
    } catch (const ferry::format_error& e) {
      CHECK(e.path() == path);
      CHECK(e.offset() == at);
      CHECK(std::string(e.what()).find("CRC-32C") != std::string::npos);
    }
    CHECK(p.next() == std::nullopt);  // the rest of this pass is lost to the damage
    CHECK(*calls == 0);
    p.rewind();
    CHECK(drain(p) == want);  // refilled from the upstream, and the file rewritten
    CHECK(*calls == want.size());
    auto q = make();
    CHECK(drain(q) == want);
    CHECK(*calls == want.size());
  }
  SUBCASE("cut short: no footer") {
    fill();
    std::string bytes = src_test::read_file(path);
    bytes.resize(bytes.size() - 10);
    src_test::write_file(path, bytes);
    auto p = make();
    try {
      (void)p.next();
      FAIL("no error");
    } catch (const ferry::format_error& e) {
      CHECK(e.path() == path);
      CHECK(e.offset() == bytes.size() - 16);
      CHECK(std::string(e.what()).find("no footer") != std::string::npos);
    }
    CHECK(drain(p) == want);  // the same pass, from the upstream
    CHECK(*calls == want.size());
    CHECK(src_test::read_file(path).size() == bytes.size() + 10);
  }
  SUBCASE("cut inside the header") {
    fill();
    src_test::write_file(path, src_test::read_file(path).substr(0, 20));
    auto p = make();
    CHECK_THROWS_WITH_AS(p.next(), doctest::Contains("shorter than its header"), ferry::format_error);
    CHECK(drain(p) == want);
  }
  SUBCASE("a wrong element count in the footer") {
    fill();
    std::string bytes = src_test::read_file(path);
    bytes[bytes.size() - 16] = static_cast<char>(bytes[bytes.size() - 16] + 1);
    src_test::write_file(path, bytes);
    auto p = make();
    std::vector<std::string> errors;
    CHECK(drain_through_errors(p, errors) == want);  // every element is whole; the count check comes after
    REQUIRE(errors.size() == 1);
    CHECK(errors[0].find("its footer says 201") != std::string::npos);
    p.rewind();
    CHECK(drain(p) == want);
    CHECK(*calls == want.size());
  }
}

namespace {
// Limits the size of files this process writes, for the duration of a scope (SIGXFSZ
// ignored, so write() fails with EFBIG instead).
struct file_size_limit {
  rlimit old{};
  void (*old_handler)(int);
  explicit file_size_limit(rlim_t bytes) {
    old_handler = ::signal(SIGXFSZ, SIG_IGN);
    ::getrlimit(RLIMIT_FSIZE, &old);
    rlimit l = old;
    l.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &l);
  }
  ~file_size_limit() {
    ::setrlimit(RLIMIT_FSIZE, &old);
    ::signal(SIGXFSZ, old_handler);
  }
};
}  // namespace

TEST_CASE("a write that fails is an io_error after its element: nothing is lost, nothing kept") {
  src_test::temp_dir dir;
  const std::string path = dir / "full.cache";
  for (std::size_t n : {100, 3000}) {  // the failure at the end (commit), or mid-pass (a flush)
    CAPTURE(n);
    fs::remove(path);  // the first round leaves a whole file, which the second would read
    auto calls = std::make_shared<std::uint64_t>(0);
    auto p = counted_items(n, calls) | ferry::cache(path);
    std::vector<std::string> errors;
    std::vector<item> got;
    {
      file_size_limit limit(32 * 1024);
      got = drain_through_errors(p, errors);
    }
    REQUIRE(errors.size() == 1);
    CHECK(errors[0].find(path) == 0);
    CHECK(errors[0].find("File too large") != std::string::npos);
    std::vector<item> expect;
    for (std::uint64_t i = 0; i < n; ++i) expect.push_back(make_item(i));
    CHECK(got == expect);
    CHECK_FALSE(fs::exists(path));
    CHECK(partial_files(dir.path) == 0);
    CHECK_FALSE(p.cached());
    p.rewind();  // without the limit: this pass is kept
    CHECK(drain(p) == expect);
    CHECK(p.cached());
    CHECK(*calls == 2 * n);
  }
  // The partial file cannot be created at all: the pass goes on uncached.
  auto p = counted_items(5, std::make_shared<std::uint64_t>(0)) | ferry::cache(dir / "no-such-dir/x.cache");
  CHECK_THROWS_WITH_AS(p.next(), doctest::Contains("cannot create the cache's partial file"), ferry::io_error);
  CHECK(drain(p).size() == 5);
}

namespace {
// i + per_epoch * epoch for i < n; in epoch 0 only, element `at` fails (consumed, as a
// corrupt record is). Its epoch is in its state, so a restored pipeline fails exactly where
// the saved one did: the first pass is not kept, the second is.
class first_epoch_failure : public ferry::source_interface<first_epoch_failure> {
 public:
  using value_type = std::uint64_t;
  first_epoch_failure(std::uint64_t n, std::uint64_t at, std::uint64_t per_epoch = 0)
      : n_(n), at_(at), per_epoch_(per_epoch) {}
  std::optional<value_type> next() {
    if (i_ >= n_) return std::nullopt;
    const std::uint64_t i = i_++;
    if (epoch_ == 0 && i == at_) throw std::runtime_error("failed at " + std::to_string(i) + " in epoch 0");
    return i + per_epoch_ * epoch_;
  }
  void rewind() {
    i_ = 0;
    ++epoch_;
  }
  void save(ferry::state_writer& w) const {
    w.tag("first_epoch_failure");
    w.put(i_);
    w.put(epoch_);
  }
  void restore(ferry::state_reader& r) {
    r.expect("first_epoch_failure");
    i_ = r.get();
    epoch_ = r.get();
  }

 private:
  std::uint64_t n_, at_, per_epoch_, i_ = 0, epoch_ = 0;
};

template <class P>
void pull(P& p, std::size_t k, std::vector<std::uint64_t>& seen, std::vector<std::string>& errors) {
  for (std::size_t i = 0; i < k; ++i) {
    try {
      if (auto e = p.next()) seen.push_back(*e);
    } catch (const std::exception& e) {
      errors.push_back(e.what());
    }
  }
}

// Pulls hops[0] times (elements and errors), saves, optionally removes the cache file,
// restores into a fresh make(); then the same for each further hop; then drains. Returns
// what was seen and the errors, which must equal one uninterrupted run's.
template <class Make>
std::pair<std::vector<std::uint64_t>, std::vector<std::string>> resumed(Make make, std::vector<std::size_t> hops,
                                                                        const std::string& remove) {
  std::vector<std::uint64_t> seen;
  std::vector<std::string> errors;
  ferry::pipeline_state st;
  {
    auto a = make();
    pull(a, hops[0], seen, errors);
    st = ferry::save_state(a);
  }
  for (std::size_t h = 1; h <= hops.size(); ++h) {
    if (!remove.empty()) fs::remove(remove);
    auto b = make();
    ferry::restore_state(b, st);
    if (h == hops.size()) {
      auto rest = drain_through_errors(b, errors);
      seen.insert(seen.end(), rest.begin(), rest.end());
    } else {
      pull(b, hops[h], seen, errors);
      st = ferry::save_state(b);
    }
  }
  return {seen, errors};
}
}  // namespace

TEST_CASE("cache resumes exactly: mid-fill, mid-replay, with or without its file, over one or two restores") {
  src_test::temp_dir dir;
  const std::size_t n = 40;
  const char* const names[] = {"memory", "file-kept", "file-removed"};
  for (int mode = 0; mode < 3; ++mode) {  // memory; file kept; file removed before each restore
    CAPTURE(mode);
    const std::string path = dir / names[mode];
    auto run = [&](auto make_p) {
      fs::remove(path);
      auto ref = make_p();
      std::vector<std::string> ref_errors;
      const auto want = drain_through_errors(ref, ref_errors);
      REQUIRE(want.size() == 4 * n - 1);
      REQUIRE(ref_errors.size() == 1);
      for (std::size_t k = 0; k <= want.size() + 2; k += (k < 50 ? 1 : 7))
        for (std::size_t j : {0, 1, 5}) {  // one restore; or a second after j more pulls
          CAPTURE(k);
          CAPTURE(j);
          fs::remove(path);
          auto [seen, errors] = resumed(make_p, j ? std::vector<std::size_t>{k, j} : std::vector<std::size_t>{k},
                                        mode == 2 ? path : std::string());
          CHECK(seen == want);
          CHECK(errors == ref_errors);
        }
    };
    // Element 13 of the first epoch fails, so the first pass is not kept and the second is.
    // A shuffle before the cache makes the kept order depend on which upstream epoch filled
    // it, so a restore that refilled from the wrong place would show; one after it makes
    // the replayed passes' orders depend on the epoch restored.
    auto before = [n] { return first_epoch_failure(n, 13) | ferry::shuffle(16, 5); };
    if (mode == 0) {
      run([&] { return before() | ferry::cache() | ferry::repeat(4); });
      run([&] { return first_epoch_failure(n, 13) | ferry::cache() | ferry::shuffle(7, 3) | ferry::repeat(4); });
    } else {
      run([&] { return before() | ferry::cache(path) | ferry::repeat(4); });
      run([&] { return first_epoch_failure(n, 13) | ferry::cache(path) | ferry::shuffle(7, 3) | ferry::repeat(4); });
    }
  }
}

namespace {
// 0..4 in epoch 0 (element 2 fails), 100..104 in epoch 1, and so on.
first_epoch_failure epoch_source() { return first_epoch_failure(5, 2, 100); }

// Re-frames element k of a cache file of fixed-size elements (`bytes` each) with `payload`
// and a valid CRC, as a hostile or buggy writer could.
void reframe(const std::string& path, std::size_t k, std::size_t bytes, const std::string& payload) {
  namespace crc = ferry::detail::crc32c;
  std::string b = src_test::read_file(path);
  const std::size_t at = elements_start(path) + k * (12 + bytes);
  std::uint64_t n = payload.size();
  const std::uint32_t c = crc::extend(crc::value(&n, 8), payload.data(), n);
  std::string frame(12, '\0');
  std::memcpy(frame.data(), &n, 8);
  std::memcpy(frame.data() + 8, &c, 4);
  b.replace(at, 12 + bytes, frame + payload);
  src_test::write_file(path, b);
}
}  // namespace

// A restored position in a kept pass (a replay) with rewind() before the refill that
// rebuilds it (memory, or the file gone) ended: the refill was dropped and the upstream
// rewound, so the next pass filled from the upstream's next epoch (another order after a
// shuffle) where the saved job replays its kept pass. Likewise a shuffle after the cache
// whose restored window had ended at the cache's end: it re-read the window but not the
// end, so the refill was not kept. Property: random schedules of next()
// and rewind() (mid-epoch too), cut at every point by a save and a restore into a fresh
// pipeline, give what the uninterrupted schedule gives.
TEST_CASE("cache: any schedule of next() and rewind(), saved and restored at any point, continues as uninterrupted") {
  src_test::temp_dir dir;
  const std::string path = dir / "c";
  std::mt19937_64 g(11);
  for (int mode = 0; mode < 3; ++mode) {  // memory; file kept; file removed before the restore
    for (int shape = 0; shape < 2; ++shape) {
      CAPTURE(mode);
      CAPTURE(shape);
      const auto make = [&] {
        auto up = ferry::from_generator(10, [](std::uint64_t i) { return i; }) | ferry::shuffle(4, 1);
        using any = ferry::any_source<std::uint64_t>;
        if (mode == 0) return shape ? any(std::move(up) | ferry::cache() | ferry::shuffle(4, 2)) : any(std::move(up) | ferry::cache());
        return shape ? any(std::move(up) | ferry::cache(path) | ferry::shuffle(4, 2)) : any(std::move(up) | ferry::cache(path));
      };
      for (int trial = 0; trial < 12; ++trial) {
        std::string ops;  // 'n': next(), 'r': rewind()
        for (int i = 0; i < 60; ++i) ops += g() % 9 == 0 ? 'r' : 'n';
        const auto run = [](auto& p, std::string_view o, std::vector<std::int64_t>& out) {
          for (char c : o) {
            if (c == 'r') {
              p.rewind();
              out.push_back(-1);
            } else if (auto e = p.next()) {
              out.push_back(std::int64_t(*e));
            } else {
              out.push_back(-2);
            }
          }
        };
        fs::remove(path);
        std::vector<std::int64_t> want;
        {
          auto p = make();
          run(p, ops, want);
        }
        for (std::size_t k = 0; k <= ops.size(); k += 3) {
          CAPTURE(trial);
          CAPTURE(k);
          CAPTURE(ops);
          fs::remove(path);
          std::vector<std::int64_t> got;
          ferry::pipeline_state st;
          {
            auto p = make();
            run(p, std::string_view(ops).substr(0, k), got);
            st = ferry::save_state(p);
          }
          if (mode == 2) fs::remove(path);
          auto q = make();
          ferry::restore_state(q, st);
          run(q, std::string_view(ops).substr(k), got);
          REQUIRE(got == want);
        }
      }
    }
  }
}

TEST_CASE("cache: a state saved right after a restore is the restored one (memory and file)") {
  src_test::temp_dir dir;
  const std::string path = dir / "again";
  auto run = [&](auto make) {
    std::vector<std::uint64_t> seen;
    std::vector<std::string> errors;
    auto a = make();
    pull(a, 4, seen, errors);
    const auto st1 = ferry::save_state(a);
    auto b = make();
    ferry::restore_state(b, st1);
    const auto st2 = ferry::save_state(b);
    CHECK(st2 == st1);
    auto c = make();
    ferry::restore_state(c, st2);
    auto rest = drain_through_errors(c, errors);
    seen.insert(seen.end(), rest.begin(), rest.end());
    CHECK(seen == std::vector<std::uint64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  };
  run([] { return ferry_test::failing_source(10, {}) | ferry::cache(); });
  run([&] { return ferry_test::failing_source(10, {}) | ferry::cache(path); });
}

TEST_CASE("cache: restoring twice through a refill does not repeat an upstream error") {
  auto make = [] { return ferry_test::failing_source(10, {4}) | ferry::cache(); };
  std::vector<std::uint64_t> seen;
  std::vector<std::string> errors;
  auto a = make();
  pull(a, 5, seen, errors);  // 0 1 2 3, the error
  auto b = make();
  ferry::restore_state(b, ferry::save_state(a));
  pull(b, 1, seen, errors);  // 5: the refill skipped 0-3 and the error
  auto c = make();
  ferry::restore_state(c, ferry::save_state(b));
  auto rest = drain_through_errors(c, errors);
  seen.insert(seen.end(), rest.begin(), rest.end());
  CHECK(seen == std::vector<std::uint64_t>{0, 1, 2, 3, 5, 6, 7, 8, 9});
  CHECK(errors == std::vector<std::string>{"failed at 4"});
}

TEST_CASE("cache: restored after damage ended a replay, the pass stays over; the next refills") {
  src_test::temp_dir dir;
  const std::string path = dir / "damaged";
  auto make = [&] { return ferry_test::failing_source(10, {}) | ferry::cache(path) | ferry::repeat(2); };
  {
    auto p = ferry_test::failing_source(10, {}) | ferry::cache(path);
    REQUIRE(drain(p).size() == 10);
  }
  std::string bytes = src_test::read_file(path);
  bytes[elements_start(path) + 3 * 20 + 12] ^= 1;  // element 3's payload (a u64: 20-byte frames)
  src_test::write_file(path, bytes);
  std::vector<std::uint64_t> seen;
  std::vector<std::string> errors;
  auto a = make();
  pull(a, 4, seen, errors);  // 0 1 2, then the CRC error
  REQUIRE(errors.size() == 1);
  auto b = make();
  ferry::restore_state(b, ferry::save_state(a));
  auto rest = drain_through_errors(b, errors);
  CHECK(errors.size() == 1);  // not read again
  seen.insert(seen.end(), rest.begin(), rest.end());
  // The damaged pass ended at element 3; repeat's second pass refilled from the upstream.
  CHECK(seen == std::vector<std::uint64_t>{0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
}

TEST_CASE("cache: a restored pipeline never overwrites a file that is not its cache") {
  src_test::temp_dir dir;
  SUBCASE("not a ferry cache") {
    const std::string path = dir / "notes.txt";
    src_test::write_file(path, "my notes, not a cache");
    auto make = [&] { return ferry_test::failing_source(10, {}) | ferry::cache(path); };
    auto a = make();
    CHECK_THROWS_AS(a.next(), ferry::config_error);
    auto b = make();
    ferry::restore_state(b, ferry::save_state(a));
    CHECK_THROWS_AS(b.next(), ferry::config_error);
    CHECK(src_test::read_file(path) == "my notes, not a cache");
  }
  SUBCASE("a cache of another key, restored mid-pass") {
    const std::string path = dir / "c";
    {
      auto p = ferry_test::failing_source(10, {}, 100) | ferry::cache(path, {.key = "other"});
      REQUIRE(drain(p).size() == 10);
    }
    const std::string before = src_test::read_file(path);
    auto make = [&] { return ferry_test::failing_source(10, {}) | ferry::cache(path, {.key = "mine"}); };
    fs::rename(path, path + ".aside");
    auto a = make();
    std::vector<std::uint64_t> seen;
    std::vector<std::string> errors;
    pull(a, 3, seen, errors);  // mid-fill, with no file there
    const auto st = ferry::save_state(a);
    fs::remove(path);  // (a's partial file is its own; a is still filling)
    fs::rename(path + ".aside", path);
    auto b = make();
    ferry::restore_state(b, st);
    CHECK_THROWS_WITH_AS(b.next(), doctest::Contains("another cache_options::key"), ferry::config_error);
    CHECK(src_test::read_file(path) == before);
  }
  SUBCASE("a state saved before the first next() still reuses a file") {
    const std::string path = dir / "reuse";
    {
      auto p = ferry_test::failing_source(10, {}) | ferry::cache(path);
      REQUIRE(drain(p).size() == 10);
    }
    ferry_test::counting_source src(10);
    auto calls = src.calls();
    auto a = ferry_test::counting_source(10) | ferry::cache(path);
    auto b = std::move(src) | ferry::cache(path);
    ferry::restore_state(b, ferry::save_state(a));
    CHECK(drain(b).size() == 10);
    CHECK(*calls == 0);
  }
}

TEST_CASE("cache: a file from an earlier run, damaged or gone, is refilled from this pipeline's upstream") {
  src_test::temp_dir dir;
  const std::string path = dir / "earlier";
  auto earlier_run = [&] {  // epoch 0 had an error (not kept); epoch 1's pass was kept
    fs::remove(path);
    auto p = epoch_source() | ferry::cache(path) | ferry::repeat(2);
    std::vector<std::string> errors;
    CHECK(drain_through_errors(p, errors).size() == 4 + 5);
    REQUIRE(fs::exists(path));
  };
  SUBCASE("gone before the restore: the refill is this upstream's first pass, from the saved position") {
    earlier_run();
    std::vector<std::uint64_t> seen;
    std::vector<std::string> errors;
    auto a = epoch_source() | ferry::cache(path);
    pull(a, 2, seen, errors);
    CHECK(seen == std::vector<std::uint64_t>{100, 101});  // read from the file
    const auto st = ferry::save_state(a);
    fs::remove(path);
    auto b = epoch_source() | ferry::cache(path);
    ferry::restore_state(b, st);
    CHECK(drain_through_errors(b, errors) == std::vector<std::uint64_t>{3, 4});
    CHECK(errors == std::vector<std::string>{"failed at 2 in epoch 0"});
  }
  SUBCASE("damaged while replaying, then restored: the next pass is the same as without the restore") {
    earlier_run();
    std::string bytes = src_test::read_file(path);
    bytes[elements_start(path) + 3 * 20 + 12] ^= 1;  // element 3 (u64 elements: 20-byte frames)
    src_test::write_file(path, bytes);
    auto make = [&] { return epoch_source() | ferry::cache(path) | ferry::repeat(2); };
    std::vector<std::uint64_t> seen, ref_seen;
    std::vector<std::string> errors, ref_errors;
    {
      auto r = make();
      ref_seen = drain_through_errors(r, ref_errors);
    }
    earlier_run();
    src_test::write_file(path, bytes);
    auto a = make();
    pull(a, 4, seen, errors);  // 100 101 102, the CRC error
    auto b = make();
    ferry::restore_state(b, ferry::save_state(a));
    auto rest = drain_through_errors(b, errors);
    seen.insert(seen.end(), rest.begin(), rest.end());
    CHECK(seen == ref_seen);
    CHECK(seen == std::vector<std::uint64_t>{100, 101, 102, 100, 101, 102, 103, 104});  // refilled: epoch 1
    CHECK(errors == ref_errors);
  }
}

// A replay position saved in one pass, restored after another pass (another order, the
// same type and key) was written at the same path: the restore used to seek into the new
// pass at the saved offset and hand out its elements. Each pass's header has an id, saved
// with the position; another id is a pass that is gone, refilled from the saved upstream
// position. A file written before ids (no extra header word) is still seeked into.
TEST_CASE("cache(path): a replay state restored after the file was rewritten refills, never reads the new pass") {
  src_test::temp_dir dir;
  const std::string path = dir / "rewritten";
  auto gen = [](std::uint64_t add) { return ferry::from_generator(10, [add](std::uint64_t i) { return i + add; }); };
  auto make = [&] { return gen(0) | ferry::cache(path) | ferry::repeat(2); };
  std::vector<std::uint64_t> seen;
  std::vector<std::string> errors;
  auto a = make();
  pull(a, 13, seen, errors);  // the fill pass 0..9, then 0 1 2 replayed from the file
  REQUIRE(errors.empty());
  const auto st = ferry::save_state(a);
  SUBCASE("rewritten with other elements: refilled from the upstream") {
    fs::remove(path);
    {
      auto other = gen(1000) | ferry::cache(path);
      REQUIRE(drain(other).size() == 10);
    }
    auto b = make();
    ferry::restore_state(b, st);
    auto rest = drain_through_errors(b, errors);
    CHECK(rest == std::vector<std::uint64_t>{3, 4, 5, 6, 7, 8, 9});
    CHECK(errors.empty());
  }
  SUBCASE("the same pass, its header cut back to the layout without an id: seeked into") {
    std::string bytes = src_test::read_file(path);
    REQUIRE(elements_start(path) == 40);
    std::uint64_t zero = 0;
    std::memcpy(bytes.data() + 24, &zero, 8);
    bytes.erase(32, 8);
    src_test::write_file(path, bytes);
    auto b = gen(0) | ferry::cache(path) | ferry::repeat(2);
    pull(b, 3, seen, errors);  // replayed from the file (id 0)
    const auto st0 = ferry::save_state(b);
    // An upstream that fails if it runs: the rest comes from the file.
    auto d = ferry::from_generator(10, [](std::uint64_t) -> std::uint64_t { throw std::logic_error("the upstream ran"); }) |
             ferry::cache(path) | ferry::repeat(2);
    ferry::restore_state(d, st0);
    auto rest = drain_through_errors(d, errors);
    CHECK(rest == std::vector<std::uint64_t>{3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
    CHECK(errors.empty());
  }
}

TEST_CASE("cache(path): a FIFO or a directory at the path is refused, never opened or replaced") {
  ferry_test::watchdog dog(std::chrono::seconds(30), "cache FIFO test");  // a FIFO open would block
  src_test::temp_dir dir;
  const std::string fifo = dir / "fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  auto p = ferry_test::failing_source(3, {}) | ferry::cache(fifo);
  CHECK_THROWS_WITH_AS(p.next(), doctest::Contains("not a regular file"), ferry::config_error);
  CHECK_THROWS_AS(p.next(), ferry::config_error);  // again: the pipeline is misconfigured
  CHECK(fs::is_fifo(fifo));
  // A directory made at the path after the pipeline was built.
  const std::string later = dir / "later";
  auto q = ferry_test::failing_source(3, {}) | ferry::cache(later);
  fs::create_directory(later);
  CHECK_THROWS_WITH_AS(q.next(), doctest::Contains("not a regular file"), ferry::config_error);
  CHECK(fs::is_directory(later));
}

TEST_CASE("cache: a state of cache() is refused by cache(path), and the other way") {
  src_test::temp_dir dir;
  const std::string path = dir / "c";
  auto m = ferry_test::failing_source(10, {}) | ferry::cache();
  (void)m.next();
  auto f = ferry_test::failing_source(10, {}) | ferry::cache(path);
  CHECK_THROWS_AS(ferry::restore_state(f, ferry::save_state(m)), ferry::config_error);
  auto m2 = ferry_test::failing_source(10, {}) | ferry::cache();
  CHECK_THROWS_AS(ferry::restore_state(m2, ferry::save_state(f)), ferry::config_error);
}

TEST_CASE("cache(path): hostile contents with valid CRCs, and files cut inside the magic") {
  src_test::temp_dir dir;
  SUBCASE("a bool that is not 0 or 1") {
    const std::string path = dir / "b";
    {
      auto p = ferry::from_generator(3, [](std::uint64_t i) { return i % 2 == 0; }) | ferry::cache(path);
      REQUIRE(drain(p).size() == 3);
    }
    reframe(path, 1, 1, std::string(1, '\x02'));
    auto p = ferry::from_generator(3, [](std::uint64_t) -> bool { throw std::logic_error("the upstream ran"); }) |
             ferry::cache(path);
    CHECK(*p.next() == true);
    try {
      (void)p.next();
      FAIL("no error");
    } catch (const ferry::format_error& e) {
      CHECK(e.offset() == elements_start(path) + 13);
      CHECK(std::string(e.what()).find("does not decode") != std::string::npos);
    }
  }
  SUBCASE("a vector<string> whose count claims more than its bytes hold") {
    const std::string path = dir / "vs";
    using T = std::vector<std::string>;
    {
      auto p = ferry::from_generator(1, [](std::uint64_t) { return T{std::string(1 << 20, 'a')}; }) |
               ferry::cache(path);
      REQUIRE(drain(p).size() == 1);
    }
    std::string payload((1 << 20) + 16, 'a');
    const std::uint64_t count = payload.size() - 8;  // one byte each: passes the first check
    std::memcpy(payload.data(), &count, 8);
    reframe(path, 0, payload.size(), payload);
    auto p = ferry::from_generator(1, [](std::uint64_t) -> T { throw std::logic_error("the upstream ran"); }) |
             ferry::cache(path);
    CHECK_THROWS_WITH_AS(p.next(), doctest::Contains("does not decode"), ferry::format_error);
  }
  SUBCASE("cut to 0 or 5 bytes: damaged, refilled") {
    const std::string path = dir / "s";
    for (std::size_t keep : {0, 5}) {
      CAPTURE(keep);
      fs::remove(path);
      auto make = [] { return ferry::from_generator(3, [](std::uint64_t i) { return i; }); };
      {
        auto p = make() | ferry::cache(path);
        REQUIRE(drain(p).size() == 3);
      }
      src_test::write_file(path, src_test::read_file(path).substr(0, keep));
      auto p = make() | ferry::cache(path);
      CHECK_THROWS_WITH_AS(p.next(), doctest::Contains("cut short inside its header"), ferry::format_error);
      CHECK(drain(p) == std::vector<std::uint64_t>{0, 1, 2});
      CHECK(src_test::read_file(path).size() == 40 + 3 * 20 + 16);  // rewritten whole (header: a pass id)
    }
  }
}

TEST_CASE("cache(path): two pipelines filling one path at once write their own partial files, and replay their own") {
  src_test::temp_dir dir;
  const std::string path = dir / "shared.cache";
  const auto partials = [&] {
    std::size_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator(std::filesystem::path(path).parent_path()))
      if (e.path().filename().string().starts_with("shared.cache.partial-")) ++n;
    return n;
  };
  // Two element types in one process: the partial file's name once came from a counter per
  // type and the pid, so both opened "<path>.partial-<pid>-0" and the int pipeline replayed
  // the unsigned one's elements.
  auto p1 = ferry::from_range(std::vector<int>{1, 2, 3}) | ferry::cache(path, {.key = "", .read_ahead = 0});
  auto p2 = ferry::from_range(std::vector<unsigned>{100, 200, 300}) | ferry::cache(path, {.key = "", .read_ahead = 0});
  CHECK(p1.next() == 1);
  CHECK(p2.next() == 100u);
  CHECK(partials() == 2);
  CHECK(drain(p1) == std::vector<int>{2, 3});
  CHECK(drain(p2) == std::vector<unsigned>{200, 300});
  p1.rewind();
  p2.rewind();
  CHECK(drain(p1) == std::vector<int>{1, 2, 3});
  CHECK(drain(p2) == std::vector<unsigned>{100, 200, 300});
  CHECK(partials() == 0);
}

// A writer killed mid-pass (a job that was stopped, a node that rebooted) left its partial
// file for good: each killed run leaked a pass's worth of disk beside the cache. A pass
// that starts filling now removes the partial files of its path that no writer holds
// locked and that nothing wrote for a minute; it leaves a live writer's (locked, or just
// written), names that are not a partial file's of this path, and other paths' files.
TEST_CASE("cache(path): a new fill removes the partial files killed writers left, and nothing else" *
          doctest::timeout(60)) {
  ferry_test::watchdog w(std::chrono::seconds(60));
  src_test::temp_dir dir;
  const std::string path = dir / "c.cache";
  const auto make_file = [&](const std::string& name, bool old) {
    const fs::path f = fs::path(std::string(dir / name));
    { std::ofstream(f) << "a dead pass"; }
    if (old) fs::last_write_time(f, fs::file_time_type::clock::now() - std::chrono::hours(1));
    return f;
  };
  // A real killed writer: a child process fills the cache part way and is killed there.
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    auto p = ferry::from_generator(1 << 20, [](std::uint64_t i) { return i; }) | ferry::cache(path);
    for (int i = 0; i < 1000; ++i) (void)p.next();
    ::raise(SIGSTOP);  // the parent kills it here, mid-pass, partial file locked
    ::_exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, WUNTRACED) == child);
  REQUIRE(WIFSTOPPED(status));
  std::vector<fs::path> killed;
  for (const auto& e : fs::directory_iterator(std::string(dir.path)))
    if (e.path().filename().string().starts_with("c.cache.partial-")) killed.push_back(e.path());
  REQUIRE(killed.size() == 1);
  {
    // While the writer lives (stopped, its lock held), an old partial file is not taken.
    fs::last_write_time(killed[0], fs::file_time_type::clock::now() - std::chrono::hours(1));
    auto p = ferry::from_range(std::vector<int>{1, 2, 3}) | ferry::cache(std::string(dir / "other.cache"));
    CHECK(drain(p) == std::vector<int>{1, 2, 3});
    auto q = ferry::from_range(std::vector<std::uint64_t>{7}) | ferry::cache(path);
    CHECK(drain(q) == std::vector<std::uint64_t>{7});
    CHECK(fs::exists(killed[0]));
    fs::remove(path);
  }
  ::kill(child, SIGKILL);
  REQUIRE(::waitpid(child, &status, 0) == child);
  fs::last_write_time(killed[0], fs::file_time_type::clock::now() - std::chrono::hours(1));
  const fs::path dead = make_file("c.cache.partial-00000000000000aa", true);
  const fs::path recent = make_file("c.cache.partial-00000000000000cc", false);   // a writer between write and rename
  const fs::path not_hex = make_file("c.cache.partial-notes12345678901", true);
  const fs::path longer = make_file("c.cache.partial-00000000000000dd.bak", true);
  const fs::path others = make_file("other.cache.partial-00000000000000ee", true);
  const fs::path held = make_file("c.cache.partial-00000000000000bb", true);
  const int hfd = ::open(held.c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(hfd >= 0);
  REQUIRE(::flock(hfd, LOCK_EX | LOCK_NB) == 0);  // a live writer (in this process: a lock of its own)
  auto p = ferry::from_range(std::vector<std::uint64_t>{1, 2, 3}) | ferry::cache(path);
  CHECK(drain(p) == std::vector<std::uint64_t>{1, 2, 3});
  ::close(hfd);
  CHECK(!fs::exists(killed[0]));
  CHECK(!fs::exists(dead));
  for (const fs::path& f : {recent, not_hex, longer, others, held}) {
    CAPTURE(f.string());
    CHECK(fs::exists(f));
  }
  CHECK(fs::exists(path));
  p.rewind();
  CHECK(drain(p) == std::vector<std::uint64_t>{1, 2, 3});  // the whole pass, replayed
}

// Records come out of cache() with its pass count as their epoch: a kept pass replays the
// records of the epoch that filled it (or, from a file, with none), so a random crop keyed
// on the epoch (image/random_crop.hpp) gave every pass the same crops. A restore keeps the
// count, so a resumed job draws as the uninterrupted one.
TEST_CASE("cache: records are handed out with the pass count as their epoch, through a restore too") {
  src_test::temp_dir dir;
  std::string text;
  for (int i = 0; i < 20; ++i) text += "line " + std::to_string(i) + "\n";
  src_test::write_file(dir / "l.txt", text);
  const auto lines = [&] { return ferry::from_files({dir / "l.txt"}, ferry::text_lines{}); };
  // The epochs of the first n records, passes rewound as they end; saved after `at` of them
  // and restored into a fresh pipeline when at < n.
  const auto epochs = [](auto make, std::size_t n, std::size_t at) {
    auto p = make();
    std::vector<std::uint32_t> got;
    const auto take = [&](auto& q, std::size_t upto) {
      while (got.size() < upto)
        if (auto r = q.next()) got.push_back(r->origin().epoch);
        else q.rewind();
    };
    take(p, at);
    if (at == n) return got;
    auto q = make();
    ferry::restore_state(q, ferry::save_state(p));
    take(q, n);
    return got;
  };
  const auto check = [&](auto make) {
    const std::size_t n = 4 * 20;
    const auto want = epochs(make, n, n);
    for (std::size_t k = 0; k < n; ++k) REQUIRE(want[k] == k / 20);  // pass k / 20
    for (std::size_t at = 0; at < n; at += 7) {
      CAPTURE(at);
      CHECK(epochs(make, n, at) == want);
    }
  };
  check([&] { return lines() | ferry::cache(); });
  int run = 0;
  // A file per run: the uninterrupted one's, then one shared by each saving pipeline and
  // the pipeline restored from it (make() is called once, then in pairs).
  check([&] { return lines() | ferry::cache(dir / ("c" + std::to_string((run++ + 1) / 2))); });
}

// A restore into a kept pass with nothing holding it (in memory; a file gone) rebuilds that
// pass from the upstream; a state saved during the rebuild is still of the kept pass. Saved
// as a fill, a second restore forgot the pass was kept: a rewind before its end filled
// from the upstream's next epoch (another order, kept for every later epoch) instead of
// replaying the kept pass as the uninterrupted run does.
TEST_CASE("cache: restored twice through a rebuilt kept pass, a rewind before its end still replays it") {
  src_test::temp_dir dir;
  for (const bool file : {false, true}) {
    CAPTURE(file);
    std::vector<std::uint64_t> v(8);
    for (std::uint64_t i = 0; i < v.size(); ++i) v[i] = i;
    const std::string path = dir / "twohop";
    const auto run = [&](auto make) {
      const auto read = [](auto& p, std::size_t n) {
        std::vector<std::uint64_t> out;
        while (out.size() < n)
          if (auto e = p.next()) out.push_back(*e);
          else break;
        return out;
      };
      std::filesystem::remove(path);
      auto a = make();  // uninterrupted: epoch 0 whole (kept), 3 of epoch 1, epoch 2 whole
      const auto e0 = read(a, 100);
      a.rewind();
      const auto e1 = read(a, 3);
      a.rewind();
      const auto e2 = read(a, 100);
      std::filesystem::remove(path);
      auto b = make();
      CHECK(read(b, 100) == e0);
      b.rewind();
      const ferry::pipeline_state at_e1 = ferry::save_state(b);
      std::filesystem::remove(path);  // nothing holds the kept pass: the restore rebuilds it
      auto c = make();
      ferry::restore_state(c, at_e1);
      auto got = read(c, 1);
      const ferry::pipeline_state mid_rebuild = ferry::save_state(c);
      auto d = make();
      ferry::restore_state(d, mid_rebuild);
      for (const auto x : read(d, 2)) got.push_back(x);
      CHECK(got == e1);
      d.rewind();
      CHECK(read(d, 100) == e2);
      CHECK(e2 == e0);  // the kept pass, replayed
    };
    if (file)
      run([&] { return ferry::from_range(v) | ferry::shuffle(8, 1) | ferry::cache(path); });
    else
      run([&] { return ferry::from_range(v) | ferry::shuffle(8, 1) | ferry::cache(); });
  }
}

namespace {
// Records "0".."n-1" (by hand: no file) whose rewind() throws while `fail_rewinds` > 0.
struct flaky_records : ferry::source_interface<flaky_records> {
  using value_type = ferry::record;
  std::uint64_t n = 5, i = 0;
  std::shared_ptr<int> fail_rewinds = std::make_shared<int>(0);
  std::optional<ferry::record> next() {
    if (i >= n) return std::nullopt;
    const std::string s = std::to_string(i++);
    auto bytes = std::shared_ptr<std::byte[]>(new std::byte[s.size()]);
    std::memcpy(bytes.get(), s.data(), s.size());
    return ferry::record(std::shared_ptr<const std::byte>(bytes, bytes.get()), s.size());
  }
  void rewind() {
    if (*fail_rewinds > 0) {
      --*fail_rewinds;
      throw std::runtime_error("rewind failed");
    }
    i = 0;
  }
  void save(ferry::state_writer& w) const { w.put(i); }
  void restore(ferry::state_reader& r) { i = r.get(); }
};
}  // namespace

// A rewind that throws begins no pass: the rewind that recovers counts it once (it was
// counted twice, so the records of that pass carried another epoch than a resumed run's).
// And mid-fill over an upstream that cannot be saved now (an unordered map, past its first
// next()): save() refuses, rather than write the fill's start taken before the refusal.
TEST_CASE("cache: a rewind that throws counts no pass; mid-fill over an unordered map, save() refuses") {
  flaky_records src;
  const auto fail = src.fail_rewinds;
  auto p = std::move(src) | ferry::cache();
  CHECK(p.next()->origin().epoch == 0);
  *fail = 1;
  CHECK_THROWS_WITH_AS(p.rewind(), "rewind failed", std::runtime_error);  // a cut pass: the upstream rewinds
  p.rewind();
  CHECK(p.next()->origin().epoch == 1);
  std::vector<int> v(64);
  for (int k = 0; k < 64; ++k) v[std::size_t(k)] = k;
  auto q = ferry::from_range(v) | ferry::map([](int x) { return x; }, {.workers = 4, .ordered = false}) |
           ferry::cache();
  REQUIRE(q.next());
  CHECK_THROWS_WITH_AS((void)ferry::save_state(q), doctest::Contains("unordered"), ferry::config_error);
}
