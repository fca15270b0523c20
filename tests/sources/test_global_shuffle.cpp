// global_shuffle and row_files: the permutation against a naive oracle (a bijection, fixed by
// its key), one global order for any number of ranks and replicas, elastic resume at other
// rank counts (every element of an epoch exactly once), pipeline_state, bad arguments, and
// rows read by index from .npy, fixed-length and TFRecord files (against from_files' reading).
#include <doctest/doctest.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <cstdint>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/doubles.hpp"
#include "ferry/detail/permutation.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/sources/global_shuffle.hpp"
#include "ferry/sources/row_files.hpp"
#include "ferry/sources/webdataset.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/state.hpp"
#include "sources/helpers.hpp"

namespace {

using u64 = std::uint64_t;

std::vector<u64> iota(u64 n) {
  std::vector<u64> v(n);
  std::iota(v.begin(), v.end(), u64{0});
  return v;
}

// The elements rank w of W reads in `steps` global steps from `start` (of epoch e).
std::vector<u64> read_steps(const std::vector<u64>& data, ferry::global_shuffle_options o, u64 steps) {
  auto src = ferry::global_shuffle(data, o);
  std::vector<u64> out;
  const u64 part = o.global_batch / o.ranks;
  for (u64 i = 0; i < steps * part; ++i) {
    auto e = src.next();
    REQUIRE(e);
    out.push_back(*e);
  }
  return out;
}

}  // namespace

TEST_CASE("feistel_permutation: a bijection of [0, n), fixed by its key, and its inverse") {
  for (u64 n : {u64(0), u64(1), u64(2), u64(3), u64(5), u64(17), u64(63), u64(64), u64(65), u64(255), u64(256), u64(257),
                u64(1000), u64(4095), u64(4096), u64(4097), u64(16385)}) {
    CAPTURE(n);
    const ferry::detail::feistel_permutation p(n, 42), same(n, 42), other(n, 43);
    std::vector<u64> seen;
    std::size_t differ = 0;
    for (u64 i = 0; i < n; ++i) {
      seen.push_back(p(i));
      CHECK(p(i) == same(i));
      CHECK(p.inverse(p(i)) == i);
      differ += p(i) != other(i);
    }
    for (u64 v = 0; v < n; ++v) CHECK(p(p.inverse(v)) == v);
    std::sort(seen.begin(), seen.end());
    CHECK(seen == iota(n));
    if (n >= 17) CHECK(differ > n / 2);  // another key, another order
  }
  // Positions look independent: over many keys, element 0 lands in each quarter evenly.
  const u64 n = 1000;
  std::size_t quarter[4] = {};
  for (u64 k = 0; k < 4000; ++k) quarter[ferry::detail::feistel_permutation(n, k)(0) * 4 / n]++;
  for (std::size_t q : quarter) CHECK(q == doctest::Approx(1000).epsilon(0.15));
}

TEST_CASE("global_shuffle: one global order for any number of ranks and replicas") {
  const u64 n = 1000, g = 24;
  const auto data = iota(n);
  auto whole = ferry::global_shuffle(data, {.seed = 3, .global_batch = g});
  const u64 steps = whole.steps();
  CHECK(steps == n / g);
  std::vector<u64> order;  // epoch 0's global sequence, by the oracle
  for (u64 p = 0; p < steps * g; ++p) order.push_back(whole.index_at(p));
  std::vector<u64> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end());  // nothing twice
  for (u64 w_count : {u64(1), u64(2), u64(3), u64(4), u64(6), u64(8), u64(24)}) {
    CAPTURE(w_count);
    std::vector<std::vector<u64>> parts;
    for (u64 w = 0; w < w_count; ++w)
      parts.push_back(read_steps(data, {.seed = 3, .global_batch = g, .ranks = w_count, .rank = w}, steps));
    // Step s is rank 0's part, then rank 1's...: the same sequence as one rank reads.
    std::vector<u64> joined;
    const u64 part = g / w_count;
    for (u64 s = 0; s < steps; ++s)
      for (u64 w = 0; w < w_count; ++w)
        joined.insert(joined.end(), parts[w].begin() + std::ptrdiff_t(s * part), parts[w].begin() + std::ptrdiff_t((s + 1) * part));
    CHECK(joined == order);
  }
  // Every rank ends the epoch after the same number of steps.
  auto r1 = ferry::global_shuffle(data, {.seed = 3, .global_batch = g, .ranks = 4, .rank = 1});
  std::size_t k = 0;
  while (r1.next()) ++k;
  CHECK(k == steps * g / 4);
  // A new epoch, a new order; without shuffle, the dataset's order.
  r1.rewind();
  CHECK(r1.epoch() == 1);
  std::size_t same = 0;
  for (u64 p = 0; p < 100; ++p) same += r1.index_at(p) == whole.index_at(p);
  CHECK(same < 10);
  auto plain = ferry::global_shuffle(data, {.shuffle = false, .global_batch = g, .ranks = 2, .rank = 1});
  CHECK(*plain.next() == 12);
}

TEST_CASE("global_shuffle: distribute's replicas take their slices of the same global batch") {
  const u64 n = 480, g = 24;
  const auto data = iota(n);
  const auto oracle = ferry::global_shuffle(data, {.seed = 9, .global_batch = g});
  for (std::size_t replicas : {std::size_t(1), std::size_t(2), std::size_t(3)}) {
    CAPTURE(replicas);
    for (u64 w_count : {u64(1), u64(2)}) {
      std::vector<u64> joined(oracle.steps() * g);
      for (u64 w = 0; w < w_count; ++w) {
        auto p = ferry::global_shuffle(data, {.seed = 9, .global_batch = g, .ranks = w_count, .rank = w}) |
                 ferry::batch(g / w_count) | ferry::distribute(ferry::host_replicas{replicas});
        u64 s = 0;
        for (auto& st : p) {
          u64 at = s * g + w * (g / w_count);
          for (std::size_t r = 0; r < st.replicas(); ++r)
            for (u64 v : st[r].field<0>().first(st[r].valid())) joined[at++] = v;
          ++s;
        }
        CHECK(s == oracle.steps());
      }
      for (u64 p = 0; p < joined.size(); ++p) REQUIRE(joined[p] == oracle.index_at(p));
    }
  }
}

TEST_CASE("global_shuffle: a resume at other rank counts sees every element once (2 -> 4 -> 3)") {
  const u64 n = 1000, g = 24;
  const auto data = iota(n);
  for (u64 epoch : {u64(0), u64(2)}) {
    CAPTURE(epoch);
    const u64 steps = n / g;
    std::vector<int> visits(n, 0);
    const u64 cut[] = {0, 7, 23, steps};
    const u64 ranks[] = {2, 4, 3};
    for (int phase = 0; phase < 3; ++phase) {
      // What the first phase's job saved after cut[phase] steps: a global_position.
      const ferry::global_position at{epoch, cut[phase], n, g};
      for (u64 w = 0; w < ranks[phase]; ++w)
        for (u64 v : read_steps(data, {.seed = 5, .global_batch = g, .ranks = ranks[phase], .rank = w, .resume = at},
                                cut[phase + 1] - cut[phase]))
          visits[v]++;
    }
    std::size_t once = 0, never = 0;
    for (int v : visits) {
      REQUIRE(v <= 1);
      once += v == 1;
      never += v == 0;
    }
    CHECK(once == steps * g);
    CHECK(never == n - steps * g);
  }
}

TEST_CASE("global_shuffle: pipeline_state at every position; bad arguments and positions") {
  const u64 n = 100, g = 12;
  const auto data = iota(n);
  const ferry::global_shuffle_options o{.seed = 1, .global_batch = g, .ranks = 3, .rank = 2};
  auto full = ferry::global_shuffle(data, o);
  std::vector<u64> want;
  while (auto e = full.next()) want.push_back(*e);
  full.rewind();
  while (auto e = full.next()) want.push_back(*e);  // epoch 1
  for (std::size_t k = 0; k <= want.size(); k += 3) {
    CAPTURE(k);
    auto a = ferry::global_shuffle(data, o);
    std::size_t read = 0;
    for (; read < k; ++read)
      if (!a.next()) {
        a.rewind();
        REQUIRE(a.next());
      }
    const auto st = ferry::save_state(a);
    auto b = ferry::global_shuffle(data, o);
    ferry::restore_state(b, ferry::pipeline_state::from_bytes(st.to_bytes()));
    std::vector<u64> rest;
    while (rest.size() + k < want.size()) {
      auto e = b.next();
      if (!e) {
        b.rewind();
        continue;
      }
      rest.push_back(*e);
    }
    CHECK(std::equal(rest.begin(), rest.end(), want.begin() + std::ptrdiff_t(k)));
    auto other = ferry::global_shuffle(data, {.seed = 1, .global_batch = g, .ranks = 4, .rank = 2});
    CHECK_THROWS_WITH_AS(ferry::restore_state(other, st), doctest::Contains("global_shuffle_options::resume"),
                         ferry::config_error);
  }
  CHECK_THROWS_WITH_AS(ferry::global_shuffle(data, {.global_batch = 0}), doctest::Contains("at least 1"),
                       ferry::config_error);
  CHECK_THROWS_WITH_AS(ferry::global_shuffle(data, {.global_batch = 10, .ranks = 3}),
                       doctest::Contains("3 ranks do not divide the global batch of 10"), ferry::config_error);
  CHECK_THROWS_AS(ferry::global_shuffle(data, {.global_batch = 12, .ranks = 3, .rank = 3}), ferry::config_error);
  CHECK_THROWS_WITH_AS(ferry::global_shuffle(data, {.global_batch = 12, .resume = ferry::global_position{0, 1, 99, 12}}),
                       doctest::Contains("saved over a dataset of 99 elements; this one has 100"), ferry::config_error);
  CHECK_THROWS_WITH_AS(ferry::global_shuffle(data, {.global_batch = 12, .resume = ferry::global_position{0, 1, 100, 24}}),
                       doctest::Contains("global steps of 24"), ferry::config_error);
  CHECK_THROWS_WITH_AS(ferry::global_shuffle(data, {.global_batch = 12, .resume = ferry::global_position{0, 9, 100, 12}}),
                       doctest::Contains("past the epoch's 8"), ferry::config_error);
  // position() carries the order's fingerprint: a resume with another seed, or without
  // shuffling, would continue another order (elements twice, others never): refused. The
  // same options continue exactly where the saved job was.
  auto saved = ferry::global_shuffle(data, {.seed = 3, .global_batch = 12});
  for (int i = 0; i < 12 * 8; ++i) REQUIRE(saved.next());  // epoch 0's 8 steps
  saved.rewind();
  for (int i = 0; i < 12 + 5; ++i) REQUIRE(saved.next());  // epoch 1, into its step 1
  const ferry::global_position at = saved.position();
  CHECK(at.epoch == 1);
  CHECK(at.step == 1);
  CHECK(at.order == saved.order());
  for (auto o : {ferry::global_shuffle_options{.seed = 4, .global_batch = 12},
                 ferry::global_shuffle_options{.seed = 3, .shuffle = false, .global_batch = 12}}) {
    o.resume = at;
    CHECK_THROWS_WITH_AS(ferry::global_shuffle(data, o), doctest::Contains("global_shuffle: the resume position was saved over another order"),
                         ferry::config_error);
  }
  auto resumed = ferry::global_shuffle(data, {.seed = 3, .global_batch = 12, .resume = at});
  auto whole = ferry::global_shuffle(data, {.seed = 3, .global_batch = 12});
  for (int i = 0; i < 12 * 8; ++i) REQUIRE(whole.next());
  whole.rewind();
  for (int i = 0; i < 12; ++i) REQUIRE(whole.next());
  for (int i = 0; i < 12 * 7; ++i) CHECK(resumed.next() == whole.next());
  CHECK(!resumed.next());
}

TEST_CASE("row_files: rows by index from .npy and fixed-length files, in any order") {
  src_test::temp_dir d;
  std::string rows_a, rows_b;
  for (int i = 0; i < 7; ++i) rows_a += std::string(6, char('a' + i));
  for (int i = 0; i < 5; ++i) rows_b += std::string(6, char('A' + i));
  src_test::write_file(d / "a.npy", src_test::npy_of("|u1", "(7, 6)", rows_a));
  src_test::write_file(d / "b.npy", src_test::npy_of("|u1", "(5, 6)", rows_b));
  const ferry::row_files rows({d / "a.npy", d / "b.npy"}, ferry::npy{});
  REQUIRE(rows.size() == 12);
  CHECK(rows.meta()->row_bytes == 6);
  const std::string all = rows_a + rows_b;
  auto src = ferry::global_shuffle(rows, {.seed = 4, .global_batch = 4});
  std::set<std::string> seen;
  for (u64 p = 0; p < 12; ++p) {
    const ferry::record r = *src.next();
    const u64 i = src.index_at(p);
    CHECK(r.str() == all.substr(std::size_t(i) * 6, 6));
    CHECK(r.origin().file == (i < 7 ? d / "a.npy" : d / "b.npy"));
    seen.insert(std::string(r.str()));
  }
  CHECK(seen.size() == 12);
  CHECK_THROWS_AS(rows[12], std::out_of_range);
  // An .npy or IDX file shorter than its header's rows: a format_error when opened.
  src_test::write_file(d / "short.npy", src_test::npy_of("|u1", "(100, 6)", rows_a));
  CHECK_THROWS_WITH_AS(ferry::row_files({d / "short.npy"}, ferry::npy{}), doctest::Contains("the header says 100 rows"),
                       ferry::format_error);
  // Counts whose bytes pass 2^64 with the header's (2^64 - 64 rows of a byte: it seemed to
  // fit), and two files of 2^63 rows of 0 bytes each (their total wrapped to 0; now refused
  // at the first, past max_empty_rows).
  src_test::write_file(d / "huge.npy", src_test::npy_of("|u1", "(18446744073709551552,)", std::string(100, 'x')));
  CHECK_THROWS_WITH_AS(ferry::row_files({d / "huge.npy"}, ferry::npy{}),
                       doctest::Contains("the header says 18446744073709551552 rows of 1 bytes"), ferry::format_error);
  src_test::write_file(d / "half.npy", src_test::npy_of("|u1", "(9223372036854775808, 0)", ""));
  CHECK_THROWS_WITH_AS(ferry::row_files({d / "half.npy", d / "half.npy"}, ferry::npy{}),
                       doctest::Contains("claims 9223372036854775808 rows of 0 bytes"), ferry::format_error);
  src_test::write_file(d / "x.idx", src_test::idx_of(0x08, {7, 6}, rows_a));
  const ferry::row_files idx_rows({d / "x.idx"}, ferry::idx{});
  CHECK(idx_rows.size() == 7);
  CHECK(idx_rows[6].str() == "gggggg");
  // fixed_length: header, rows, footer; a file of another size is a format_error.
  src_test::write_file(d / "f.bin", "HH" + rows_a + "F");
  const ferry::row_files fixed({d / "f.bin"}, ferry::fixed_length{.record_bytes = 6, .header_bytes = 2, .footer_bytes = 1});
  CHECK(fixed.size() == 7);
  CHECK(fixed[3].str() == "dddddd");
  CHECK(fixed[3].origin().offset == 2 + 18);
  src_test::write_file(d / "g.bin", "HH" + rows_a + "FF");
  CHECK_THROWS_WITH_AS(ferry::row_files({d / "g.bin"}, ferry::fixed_length{.record_bytes = 6, .header_bytes = 2, .footer_bytes = 1}),
                       doctest::Contains("the file has 46 bytes"), ferry::format_error);
  CHECK_THROWS_AS(ferry::row_files({d / "missing.npy"}, ferry::npy{}), ferry::io_error);
  // A file cut after it was opened: io_error naming it and the row's offset.
  const ferry::row_files cut({d / "f.bin"}, ferry::fixed_length{.record_bytes = 6, .header_bytes = 2, .footer_bytes = 1});
  src_test::write_file(d / "f.bin", "HH" + rows_a.substr(0, 12));
  CHECK_THROWS_WITH_AS(cut[4], doctest::Contains("short read of row 4"), ferry::io_error);
}

TEST_CASE("row_files: TFRecord records by index equal from_files' records, in any order") {
  src_test::temp_dir d;
  // Three files of records of random lengths (empty ones, and records past the index's
  // 64 KiB window and 4 KiB page, so both of its reads run), one empty file among them.
  std::mt19937_64 rng(5);
  std::vector<std::string> paths;
  for (int f = 0; f < 4; ++f) {
    std::string bytes;
    const int n = f == 2 ? 0 : 40 + int(rng() % 60);
    for (int i = 0; i < n; ++i) {
      const std::uint64_t r = rng() % 100;
      const std::size_t len = r < 5 ? 0 : r < 10 ? 70000 + rng() % 50000 : r < 20 ? 3000 + rng() % 3000 : rng() % 200;
      std::string data(len, '\0');
      for (char& ch : data) ch = char(rng());
      bytes += src_test::tfrecord_of(data);
    }
    paths.push_back(d / ("r" + std::to_string(f) + ".tfrecord"));
    src_test::write_file(paths.back(), bytes);
  }
  // The oracle: from_files reading the files front to back.
  std::vector<ferry::record> all;
  auto seq = ferry::from_files(paths, ferry::tfrecord{});
  while (auto r = seq.next()) all.push_back(*r);
  const ferry::row_files rows(paths, ferry::tfrecord{});
  REQUIRE(rows.size() == all.size());
  REQUIRE(all.size() > 100);
  CHECK_FALSE(rows.meta());
  for (u64 i = 0; i < rows.size(); ++i) {
    const ferry::record r = rows[i];
    CHECK(r.str() == all[i].str());
    CHECK(r.origin().file == all[i].origin().file);
    CHECK(r.origin().offset == all[i].origin().offset);
    CHECK(r.origin().data_offset == all[i].origin().data_offset);
  }
  // One global order over them, at 1 and 3 ranks: the joined parts are the same records.
  for (u64 W : {u64(1), u64(3)}) {
    std::vector<std::string> joined(rows.size() / 6 * 6);
    for (u64 w = 0; w < W; ++w) {
      auto src = ferry::global_shuffle(rows, {.seed = 9, .global_batch = 6, .ranks = W, .rank = w});
      for (u64 s = 0; s < src.steps(); ++s)
        for (u64 k = 0; k < 6 / W; ++k) joined[s * 6 + w * (6 / W) + k] = std::string(src.next()->str());
    }
    auto whole = ferry::global_shuffle(rows, {.seed = 9, .global_batch = 6});
    for (u64 p = 0; p < joined.size(); ++p) CHECK(joined[p] == all[whole.index_at(p)].str());
  }
  CHECK_THROWS_AS(rows[rows.size()], std::out_of_range);
  // row_files reads with no epoch: global_shuffle hands its records out with its own, so a
  // random crop keyed on it (image/random_crop.hpp) changes every epoch (it repeated); a
  // restore and a resume at another rank count keep it.
  auto g = ferry::global_shuffle(rows, {.seed = 9, .global_batch = 6});
  for (u64 e = 0; e < 3; ++e, g.rewind())
    for (auto r = g.next(); r; r = g.next()) CHECK(r->origin().epoch == e);
  for (int k = 0; k < 4; ++k) (void)g.next();
  auto h = ferry::global_shuffle(rows, {.seed = 9, .global_batch = 6});
  ferry::restore_state(h, ferry::save_state(g));
  CHECK(h.next()->origin().epoch == 3);
  auto at = ferry::global_shuffle(rows, {.seed = 9, .global_batch = 6, .ranks = 2, .rank = 1, .resume = g.position()});
  CHECK(at.next()->origin().epoch == 3);
}

TEST_CASE("row_files: bad TFRecord files name the file and the record's offset") {
  src_test::temp_dir d;
  using src_test::expect_error;
  const std::string a = src_test::tfrecord_of("first"), b = src_test::tfrecord_of(std::string(100, 'b'));
  const auto open = [](const std::string& p, ferry::tfrecord t = {}, ferry::row_files_options o = {}) {
    return [=] { ferry::row_files(std::vector<std::string>{p}, t, o); };
  };
  // Cut inside the second record (at offset 21), inside its header, and a bad length CRC.
  src_test::write_file(d / "cut.tfrecord", a + b.substr(0, 50));
  expect_error<ferry::format_error>(open(d / "cut.tfrecord"), d / "cut.tfrecord", 21,
                                    "truncated record (the length field says 100 bytes, 34 are left");
  src_test::write_file(d / "head.tfrecord", a + b.substr(0, 7));
  expect_error<ferry::format_error>(open(d / "head.tfrecord"), d / "head.tfrecord", 21,
                                    "truncated record (7 bytes of a 12-byte header)");
  std::string bad = a + b;
  bad[21 + 9] ^= 1;  // the second record's length CRC
  src_test::write_file(d / "crc.tfrecord", bad);
  expect_error<ferry::format_error>(open(d / "crc.tfrecord"), d / "crc.tfrecord", 21, "length CRC mismatch");
  CHECK(ferry::row_files({d / "crc.tfrecord"}, ferry::tfrecord{.verify_crc = false}).size() == 2);
  // A length over max_record_bytes: refused at open, nothing allocated for it.
  expect_error<ferry::format_error>(open(d / "cut.tfrecord", {}, {.max_record_bytes = 4}), d / "cut.tfrecord", 0,
                                    "record length 5 exceeds max_record_bytes (4)");
  // A data CRC is checked when the record is read: that record fails, the others read.
  std::string data_bad = a + b + a;
  data_bad[21 + 12 + 40] ^= 1;
  src_test::write_file(d / "data.tfrecord", data_bad);
  const ferry::row_files rows({d / "data.tfrecord"}, ferry::tfrecord{});
  REQUIRE(rows.size() == 3);
  expect_error<ferry::format_error>([&] { (void)rows[1]; }, d / "data.tfrecord", 21, "corrupted record (data CRC mismatch)");
  CHECK(rows[0].str() == "first");
  CHECK(rows[2].str() == "first");
  CHECK(ferry::row_files({d / "data.tfrecord"}, ferry::tfrecord{.verify_crc = false})[1].size() == 100);
  // Rewritten after it was indexed: a short read (io_error) or a changed header (format_error).
  src_test::write_file(d / "data.tfrecord", a + b.substr(0, 60));
  expect_error<ferry::io_error>([&] { (void)rows[2]; }, d / "data.tfrecord", 21 + 116, "short read of row 2");
  src_test::write_file(d / "data.tfrecord", a + src_test::tfrecord_of(std::string(60, 'c')) + a + a);
  expect_error<ferry::format_error>([&] { (void)rows[1]; }, d / "data.tfrecord", 21, "header changed");
  // Compressed files and missing ones.
  src_test::write_gzip(d / "z.tfrecord.gz", a);
  CHECK_THROWS_WITH_AS(ferry::row_files({d / "z.tfrecord.gz"}, ferry::tfrecord{}), doctest::Contains("compressed"),
                       ferry::config_error);
  CHECK_THROWS_AS(ferry::row_files({d / "missing.tfrecord"}, ferry::tfrecord{}), ferry::io_error);
  CHECK_THROWS_AS(ferry::row_files({d / "data.tfrecord"}, ferry::tfrecord{}, {.max_record_bytes = 0}), ferry::config_error);
}

TEST_CASE("row_files: a directory or a FIFO is an io_error at once; its max_record_bytes holds for every format") {
  src_test::temp_dir d;
  std::filesystem::create_directories(d / "dir.bin");
  // A directory's size (4096 bytes) once counted as 512 rows of 8.
  for (const ferry::file_format& fmt :
       {ferry::file_format(ferry::fixed_length{.record_bytes = 8}), ferry::file_format(ferry::tfrecord{}),
        ferry::file_format(ferry::text_lines{})})
    src_test::expect_error<ferry::io_error>([&] { ferry::row_files({d / "dir.bin"}, fmt); }, d / "dir.bin", 0,
                                  "not a regular file");
  // npy's header is read first: that read fails.
  src_test::expect_error<ferry::io_error>([&] { ferry::row_files({d / "dir.bin"}, ferry::npy{}); }, d / "dir.bin", 0,
                                          "Is a directory");
  // A FIFO with no writer: open() blocked for good.
  REQUIRE(::mkfifo((d / "fifo.bin").c_str(), 0600) == 0);
  ferry_test::watchdog w(std::chrono::seconds(30), "row_files over a FIFO");
  src_test::expect_error<ferry::io_error>([&] { ferry::row_files({d / "fifo.bin"}, ferry::fixed_length{.record_bytes = 8}); },
                                d / "fifo.bin", 0, "not a regular file");
  // Rows of 96 bytes with max_record_bytes 64, then 128: the option, not from_files' default.
  std::string rows;
  for (int i = 0; i < 3; ++i) rows += std::string(96, char('a' + i));
  src_test::write_file(d / "wide.npy", src_test::npy_of("|u1", "(3, 96)", rows));
  src_test::write_file(d / "wide.bin", rows);
  CHECK_THROWS(ferry::row_files({d / "wide.npy"}, ferry::npy{}, {.max_record_bytes = 64}));
  CHECK_THROWS_AS(ferry::row_files({d / "wide.bin"}, ferry::fixed_length{.record_bytes = 96}, {.max_record_bytes = 64}),
                  ferry::config_error);
  CHECK(ferry::row_files({d / "wide.npy"}, ferry::npy{}, {.max_record_bytes = 128})[2].str() == std::string(96, 'c'));
  // Over 80 MiB rows, above from_files' 64 MiB default, read with the option raised (the
  // option was dropped for these formats: refused).
  CHECK(ferry::row_files({d / "wide.bin"}, ferry::fixed_length{.record_bytes = 96}, {.max_record_bytes = 96})[1].str() ==
        std::string(96, 'b'));
  src_test::write_file(d / "big.bin", std::string(std::size_t(80) << 20, 'z'));
  CHECK(ferry::row_files({d / "big.bin"}, ferry::fixed_length{.record_bytes = std::size_t(80) << 20},
                         {.max_record_bytes = std::uint64_t(1) << 30})
            .size() == 1);
}

TEST_CASE("row_files: WebDataset samples and text lines by index equal from_files' records") {
  src_test::temp_dir d;
  std::mt19937_64 rng(8);
  // Two shards of samples of 1-3 members (a directory and a file without a dot between
  // them, which belong to no sample), and two text files (an empty line, no final newline).
  std::vector<std::string> shards;
  for (int f = 0; f < 2; ++f) {
    src_test::tar_writer w;
    for (int i = 0; i < 30; ++i) {
      const std::string key = "s" + std::to_string(f) + "/" + std::to_string(1000 + i);
      w.add(key + ".jpg", std::string(rng() % 3000, char('a' + i % 26)));
      if (i % 2) w.add(key + ".cls", std::to_string(i));
      if (i % 7 == 3) w.add("s" + std::to_string(f) + "/", "", '5');
      if (i % 5 == 1) w.add("README", "no dot");
      if (i % 3 == 0) w.add(key + ".seg.png", std::string(rng() % 700, 'p'));
    }
    w.end();
    shards.push_back(d / ("shard-" + std::to_string(f) + ".tar"));
    src_test::write_file(shards.back(), w.out);
  }
  src_test::write_file(d / "a.txt", "first line\n\nthird\r\nfourth");
  src_test::write_file(d / "b.txt", "x\ny\n");
  const std::vector<std::pair<std::vector<std::string>, ferry::file_format>> cases = {
      {shards, ferry::webdataset{}}, {{d / "a.txt", d / "b.txt"}, ferry::text_lines{}}};
  for (const auto& [paths, fmt] : cases) {
    std::vector<ferry::record> all;
    auto seq = ferry::from_files(paths, fmt);
    while (auto r = seq.next()) all.push_back(*r);
    const ferry::row_files rows(paths, fmt);
    REQUIRE(rows.size() == all.size());
    REQUIRE(all.size() >= 6);
    auto src = ferry::global_shuffle(rows, {.seed = 2, .global_batch = 3});
    for (u64 p = 0; p < src.steps() * 3; ++p) {
      const ferry::record r = *src.next();
      const ferry::record& want = all[src.index_at(p)];
      CHECK(r.str() == want.str());
      CHECK(r.origin().file == want.origin().file);
      CHECK(r.origin().offset == want.origin().offset);
      CHECK(r.origin().data_offset == want.origin().data_offset);
    }
    if (std::holds_alternative<ferry::webdataset>(fmt)) {  // a sample read by index parses as one
      const ferry::webdataset_sample s = ferry::parse_webdataset(rows[5]);
      CHECK(s.key == "s0/1005");
      CHECK(s.at("cls").str() == "5");
      CHECK(s.at("jpg").origin().offset == ferry::parse_webdataset(all[5]).at("jpg").origin().offset);
    }
  }
  // A shard cut inside a member: from_files' error, naming the file and the member's header.
  const std::string whole = src_test::read_file(shards[0]);
  src_test::write_file(d / "cut.tar", whole.substr(0, 512 + 100));
  CHECK_THROWS_WITH_AS(ferry::row_files({d / "cut.tar"}, ferry::webdataset{}), doctest::Contains("truncated member"),
                       ferry::format_error);
  // A line over max_record_bytes is refused when indexed.
  CHECK_THROWS_WITH_AS(ferry::row_files({d / "a.txt"}, ferry::text_lines{}, {.max_record_bytes = 4}),
                       doctest::Contains("max_record_bytes"), ferry::format_error);
}

// Found by mutation testing (a changed bound, a check or a saved field dropped, each passing
// the suite before): the position at the end of an epoch must resume (nothing left), and a
// state whose offset in this rank's part equals the part's size must be refused.
TEST_CASE("global_shuffle: the end of an epoch resumes; a part offset at the part's size is refused") {
  std::vector<int> data(10);
  for (int i = 0; i < 10; ++i) data[static_cast<std::size_t>(i)] = i;
  auto a = ferry::global_shuffle(data, {.seed = 3, .global_batch = 2});
  REQUIRE(a.next());
  auto st = ferry::save_state(a);
  REQUIRE(st.words.back() == 1);
  st.words.back() = 2;  // j == the part (2 rows a step / 1 rank)
  auto b = ferry::global_shuffle(data, {.seed = 3, .global_batch = 2});
  CHECK_THROWS_AS(ferry::restore_state(b, st), ferry::config_error);
  while (a.next()) {
  }
  ferry::global_shuffle_options o{.seed = 3, .global_batch = 2};
  o.resume = a.position();
  auto c = ferry::global_shuffle(data, o);
  CHECK(!c.next());
}
