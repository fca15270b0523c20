// interleave: the order against a naive oracle for any worker count, exact resume,
// prompt shutdown mid-epoch, errors at their place in the order.
#include <doctest/doctest.h>

#include <random>
#include <string>
#include <vector>

#include "common/doubles.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/stages/interleave.hpp"
#include "sources/helpers.hpp"

using namespace src_test;
using namespace std::chrono_literals;

namespace {
struct dataset {
  temp_dir t;
  std::vector<std::string> files;
  std::vector<std::vector<std::string>> recs;  // per file
  dataset(int nfiles, std::uint64_t seed, bool gz = false) {
    std::mt19937_64 g(seed);
    for (int f = 0; f < nfiles; ++f) {
      std::string s;
      recs.emplace_back();
      const int n = static_cast<int>(g() % 30);
      for (int i = 0; i < n; ++i) {
        recs.back().push_back(std::to_string(f) + "/" + std::to_string(i) + ":" + random_bytes(g, g() % 200));
        s += tfrecord_of(recs.back().back());
      }
      files.push_back(t / ("i" + std::to_string(f) + (gz ? ".tfrecord.gz" : ".tfrecord")));
      gz ? write_gzip(files.back(), s) : write_file(files.back(), s);
    }
  }
  // The oracle: slot s reads files s, s+cycle, ... back to back; `block` records per turn.
  std::vector<std::string> expected(std::size_t cycle, std::size_t block) const {
    const std::size_t k = std::min(cycle, files.size());
    std::vector<std::vector<std::string>> slot(k);
    for (std::size_t j = 0; j < files.size(); ++j)
      for (auto& r : recs[j]) slot[j % k].push_back(r);
    std::vector<std::size_t> at(k, 0);
    std::vector<std::string> out;
    bool any = true;
    while (any) {
      any = false;
      for (std::size_t s = 0; s < k; ++s)
        for (std::size_t b = 0; b < block && at[s] < slot[s].size(); ++b) {
          out.push_back(slot[s][at[s]++]);
          any = true;
        }
    }
    return out;
  }
};
std::vector<std::string> drain(auto& src) {
  std::vector<std::string> out;
  while (auto r = src.next()) out.emplace_back(r->str());
  return out;
}
}  // namespace

TEST_CASE("interleave: deterministic order equal to the oracle, any workers" * doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    dataset d(static_cast<int>(seed * 2 + 1), seed, seed % 3 == 0);
    for (std::size_t cycle : {1, 2, 3, 5, 16})
      for (std::size_t block : {1, 4})
        for (std::size_t workers : {0, 1, 3}) {
          auto src = ferry::from_files(d.files, ferry::tfrecord{}, {.chunk_bytes = 700}) |
                     ferry::interleave(cycle, {.workers = workers, .block = block, .buffer = 5});
          CHECK(drain(src) == d.expected(cycle, block));
          CHECK(!src.next());
          src.rewind();
          CHECK(drain(src) == d.expected(cycle, block));
        }
  }
  CHECK_THROWS_AS(ferry::interleave(0), ferry::config_error);
  CHECK_THROWS_AS(ferry::interleave(2, {.block = 0}), ferry::config_error);
}

TEST_CASE("interleave: save/restore at every position is exact" * doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  dataset d(5, 99);
  const auto all = d.expected(3, 2);
  for (std::size_t workers : {0, 2}) {
    for (std::size_t k = 0; k <= all.size(); k += 3) {
      auto a = ferry::from_files(d.files, ferry::tfrecord{}, {.chunk_bytes = 300}) |
               ferry::interleave(3, {.workers = workers, .block = 2});
      for (std::size_t i = 0; i < k; ++i) a.next();
      auto st = ferry::save_state(a);
      auto b = ferry::from_files(d.files, ferry::tfrecord{}, {.chunk_bytes = 300}) |
               ferry::interleave(3, {.workers = workers, .block = 2});
      ferry::restore_state(b, st);
      CHECK(drain(b) == std::vector<std::string>(all.begin() + static_cast<long>(k), all.end()));
    }
  }
}

TEST_CASE("interleave: destruction mid-epoch joins promptly" * doctest::timeout(30)) {
  ferry_test::watchdog wd(30s);
  dataset d(8, 5);
  for (int i = 0; i < 20; ++i) {
    auto src = ferry::from_files(d.files, ferry::tfrecord{}) | ferry::interleave(4, {.workers = 4, .buffer = 2});
    for (int k = 0; k < i; ++k) src.next();
  }
}

TEST_CASE("interleave: errors at their place; skip counts exactly" * doctest::timeout(30)) {
  ferry_test::watchdog wd(30s);
  dataset d(4, 8);
  std::string bad = tfrecord_of("good-before") + tfrecord_of("bad");
  bad[bad.size() - 2] ^= 1;  // data CRC of the second record
  bad += tfrecord_of("good-after");
  write_file(d.files[1], bad);
  d.recs[1] = {"good-before", "good-after"};
  auto want = d.expected(2, 1);
  for (std::size_t workers : {0, 2}) {
    auto src = ferry::from_files(d.files, ferry::tfrecord{}) | ferry::interleave(2, {.workers = workers});
    std::vector<std::string> got;
    int errors = 0;
    for (;;) {
      try {
        auto r = src.next();
        if (!r) break;
        got.emplace_back(r->str());
      } catch (const ferry::format_error& e) {
        CHECK(e.path() == d.files[1]);
        CHECK(e.offset() == 12 + 11 + 4);
        ++errors;
      }
    }
    CHECK(errors == 1);
    CHECK(got == want);
    std::atomic<int> logged{0};
    auto sk = ferry::from_files(d.files, ferry::tfrecord{},
                                {.on_error = ferry::error_policy::skip,
                                 .on_skip = [&](const ferry::skipped_record&) { ++logged; }}) |
              ferry::interleave(2, {.workers = workers});
    CHECK(drain(sk) == want);
    CHECK(sk.skipped() == 1);
    CHECK(logged == 1);
  }
}
