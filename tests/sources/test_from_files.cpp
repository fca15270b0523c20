// from_files: the formats against their writers' bytes (TensorFlow's TFRecord vectors,
// numpy.save's files: tests/sources/make_fixtures.py), property
// sweeps against a naive oracle, bad input, error policy, sharding, resume.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/doubles.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stats.hpp"
#include "sources/helpers.hpp"

using namespace src_test;
namespace crc = ferry::detail::crc32c;

namespace {
std::vector<std::string> read_all(auto& src) {
  std::vector<std::string> out;
  while (auto r = src.next()) out.emplace_back(r->str());
  return out;
}
std::vector<std::string> read_all(const std::vector<std::string>& files, ferry::file_format f,
                                  ferry::from_files_options o = {}) {
  auto src = ferry::from_files(files, f, o);
  return read_all(src);
}
// The gzip file write_gzip writes for `bytes`.
std::string gzip_bytes(const std::string& bytes) {
  temp_dir t;
  write_gzip(t / "g.gz", bytes);
  return read_file(t / "g.gz");
}
// How many bytes zlib itself inflates from z (gzip, possibly cut short): the oracle for
// what a reader can have seen before a truncated stream ends.
std::size_t inflatable(const std::string& z) {
  z_stream s{};
  REQUIRE(inflateInit2(&s, 15 + 32) == Z_OK);
  s.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(z.data()));
  s.avail_in = static_cast<uInt>(z.size());
  std::string out(1 << 16, '\0');
  std::size_t total = 0;
  for (;;) {
    s.next_out = reinterpret_cast<Bytef*>(out.data());
    s.avail_out = static_cast<uInt>(out.size());
    const int rc = inflate(&s, Z_NO_FLUSH);
    total += out.size() - s.avail_out;
    if (rc != Z_OK || s.avail_out != 0) break;
  }
  inflateEnd(&s);
  return total;
}
// Reads `files` to the end or the first error: the records before it, and the error.
struct read_result {
  std::vector<std::string> recs;
  std::optional<ferry::skipped_record> err;  // path, offset, reason (describe())
  std::string what;
};
read_result read_until_error(const std::vector<std::string>& files, ferry::file_format f,
                             ferry::from_files_options o = {}) {
  read_result r;
  auto src = ferry::from_files(files, f, o);
  try {
    while (auto x = src.next()) r.recs.emplace_back(x->str());
  } catch (const ferry::error& e) {
    r.err = ferry::detail::describe(e);
    r.what = e.what();
  }
  return r;
}
std::vector<std::string> split_lines(const std::string& s) {  // the oracle
  std::vector<std::string> out;
  std::size_t i = 0;
  while (i < s.size()) {
    std::size_t j = s.find('\n', i);
    if (j == std::string::npos) {
      out.push_back(s.substr(i));
      break;
    }
    std::string l = s.substr(i, j - i);
    if (!l.empty() && l.back() == '\r') l.pop_back();
    out.push_back(l);
    i = j + 1;
  }
  return out;
}
}  // namespace

TEST_CASE("crc32c: check value, masking, and the fast path against the bitwise oracle") {
  CHECK(crc::value("123456789", 9) == 0xE3069283u);
  CHECK(crc::extend_portable(0, "123456789", 9) == 0xE3069283u);
  CHECK(crc::unmask(crc::mask(0xdeadbeefu)) == 0xdeadbeefu);
  std::mt19937_64 g(7);
  for (std::size_t n : {0ul, 1ul, 7ul, 8ul, 9ul, 100ul, 767ul, 768ul, 1024ul, 1500ul, 2304ul, 24575ul, 24576ul, 24577ul, 50000ul, 100003ul}) {
    std::string s = random_bytes(g, n);
    CHECK(crc::value(s.data(), n) == crc::extend_portable(0, s.data(), n));
    const std::size_t cut = n / 3;
    CHECK(crc::extend(crc::value(s.data(), cut), s.data() + cut, n - cut) == crc::value(s.data(), n));
    CHECK(crc::combine(crc::value(s.data(), cut), crc::value(s.data() + cut, n - cut), n - cut) ==
          crc::value(s.data(), n));
  }
}

TEST_CASE("crc32c: every fast path in this build against the oracle, at any alignment") {
  std::mt19937_64 g(11);
  const std::string s = random_bytes(g, 70000);
  for (int trial = 0; trial < 300; ++trial) {
    const std::size_t off = g() % 64, n = trial < 100 ? g() % 300 : g() % (s.size() - 64);
    const std::uint32_t start = trial % 2 ? 0u : static_cast<std::uint32_t>(g());
    const std::uint32_t want = crc::extend_portable(start, s.data() + off, n);
    INFO("offset " << off << ", " << n << " bytes");
    CHECK(crc::extend(start, s.data() + off, n) == want);
#ifdef FERRY_CRC32C_X86
    if (crc::have_sse42()) CHECK(crc::extend_sse(start, s.data() + off, n) == want);
#endif
#if defined(FERRY_WITH_ISAL)
    CHECK(crc::extend_isal(start, s.data() + off, n) == want);
#endif
    // Four at once: each lane equals the oracle of its own buffer.
    const unsigned char* p4[4];
    std::uint32_t got[4];
    const std::size_t m = n % 300;
    for (auto& q : p4) q = reinterpret_cast<const unsigned char*>(s.data()) + g() % (s.size() - 300);
    crc::value_x4(p4, m, got);
    for (int k = 0; k < 4; ++k) CHECK(got[k] == crc::extend_portable(0, p4[k], m));
  }
}

TEST_CASE("tfrecord: short records of one length (checked four at a time): the same records, errors and offsets" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));
  temp_dir t;
  std::mt19937_64 g(17);
  for (std::size_t len : {0, 1, 7, 8, 9, 100, 128, 255, 256}) {
    for (int trial = 0; trial < 6; ++trial) {
      // 60 records of `len` bytes; some with a bad data CRC (that record is skipped), a bad
      // length CRC (the rest of the file is), a flipped data byte, or a file cut short.
      std::string tf;
      std::vector<std::string> want;
      std::vector<std::uint64_t> bad_at;  // offsets the skips must name
      const int n = 60;
      const int cut = trial == 5 ? static_cast<int>(g() % n) : -1;
      for (int i = 0; i < n; ++i) {
        const std::string rec = random_bytes(g, len);
        std::string enc = tfrecord_of(rec);
        const std::uint64_t at = tf.size();
        const auto fault = g() % 12;
        if (i == cut) {  // truncated inside this record's header or data
          tf += enc.substr(0, g() % enc.size());
          bad_at.push_back(at);
          break;
        }
        if (fault == 0) {
          enc[enc.size() - 1 - g() % 4] ^= 0x04;  // stored data CRC
          bad_at.push_back(at);
        } else if (fault == 1 && len > 0) {
          enc[12 + g() % len] ^= 0x80;  // a data byte
          bad_at.push_back(at);
        } else if (fault == 2 && trial % 2 == 1) {
          enc[8 + g() % 4] ^= 0x01;  // stored length CRC: the rest of the file is lost
          tf += enc;
          bad_at.push_back(at);
          break;
        } else {
          want.push_back(rec);
        }
        tf += enc;
      }
      const std::string path = t / ("eq" + std::to_string(len) + "_" + std::to_string(trial) + ".tfrecord");
      write_file(path, tf);
      for (std::size_t chunk : {64, 1000, 1 << 20}) {
        INFO("len " << len << ", trial " << trial << ", chunk " << chunk);
        std::vector<std::uint64_t> offsets;
        ferry::from_files_options o{.on_error = ferry::error_policy::skip,
                                    .on_skip = [&](const ferry::skipped_record& r) { offsets.push_back(r.offset); },
                                    .chunk_bytes = chunk};
        CHECK(read_all({path}, ferry::tfrecord{}, o) == want);
        CHECK(offsets == bad_at);
        // And with a batch on top (the borrowing path).
        auto p = ferry::from_files({path}, ferry::tfrecord{}, o) | ferry::batch(7);
        std::vector<std::string> got;
        while (auto b = p.next())
          for (std::size_t k = 0; k < b->size(); ++k) {
            auto r = b->field<0>()[k];
            got.emplace_back(reinterpret_cast<const char*>(r.data()), r.size());
          }
        CHECK(got == want);
      }
    }
  }
}

TEST_CASE("tfrecord: TensorFlow's vectors, plain and gzip") {
  const std::string d = data_dir();
  // The test-side writer reproduces TensorFlow's bytes exactly.
  CHECK(read_file(d + "/vectors.tfrecord") ==
        tfrecord_of("") + tfrecord_of("hello") + tfrecord_of(std::string(32, '\0')));
  const std::vector<std::string> want = {"", "hello", std::string(32, '\0')};
  CHECK(read_all({d + "/vectors.tfrecord"}, ferry::tfrecord{}) == want);
  CHECK(read_all({d + "/vectors.tfrecord.gz"}, ferry::tfrecord{}) == want);
  CHECK(read_all({d + "/vectors.tfrecord", d + "/vectors.tfrecord.gz"}, ferry::tfrecord{}).size() == 6);
}

TEST_CASE("tfrecord, lines, fixed: random files against the oracle, any chunk size" * doctest::timeout(120)) {
  ferry_test::watchdog wd(std::chrono::seconds(120));  // read-ahead threads: never hang
  temp_dir t;
  std::mt19937_64 g(42);
  for (int trial = 0; trial < 12; ++trial) {
    const bool gz = trial % 3 == 2;
    const std::size_t chunk = std::vector<std::size_t>{64, 1000, 1 << 16}[trial % 3];
    std::vector<std::string> want, files;
    std::string all_lines;
    std::vector<std::string> want_lines, line_files, want_fixed, fixed_files;
    for (int f = 0; f < 3; ++f) {
      std::string tf, lines, fixed = "HDR";
      const int n = static_cast<int>(g() % 40);
      for (int i = 0; i < n; ++i) {
        const std::size_t len = g() % 8 == 0 ? g() % 5000 : g() % 100;
        std::string rec = random_bytes(g, len);
        want.push_back(rec);
        tf += tfrecord_of(rec);
        std::string line;
        for (std::size_t k = 0; k < len % 300; ++k) line += static_cast<char>('a' + g() % 26);
        lines += line + (g() % 2 ? "\r\n" : "\n");
        std::string fr = random_bytes(g, 37);
        want_fixed.push_back(fr);
        fixed += fr;
      }
      if (g() % 2) lines += "tail without newline";
      fixed += "FOOTER";
      for (auto& l : split_lines(lines)) want_lines.push_back(l);
      const std::string base = t / ("f" + std::to_string(trial) + "_" + std::to_string(f));
      const std::string ext = gz ? ".gz" : "";
      if (gz) {
        write_gzip(base + ".tfrecord" + ext, tf);
        write_gzip(base + ".txt" + ext, lines);
        write_gzip(base + ".bin" + ext, fixed);
      } else {
        write_file(base + ".tfrecord", tf);
        write_file(base + ".txt", lines);
        write_file(base + ".bin", fixed);
      }
      files.push_back(base + ".tfrecord" + ext);
      line_files.push_back(base + ".txt" + ext);
      fixed_files.push_back(base + ".bin" + ext);
    }
    // On the calling thread, and read ahead by one or more I/O threads.
    for (auto [ahead, threads] : {std::pair<std::size_t, std::size_t>{0, 1}, {1, 1}, {2, 2}, {5, 3}}) {
      INFO("chunk " << chunk << ", read_ahead " << ahead << ", read_threads " << threads);
      ferry::from_files_options o{.chunk_bytes = chunk, .read_ahead = ahead, .read_threads = threads};
      CHECK(read_all(files, ferry::tfrecord{}, o) == want);
      CHECK(read_all(line_files, ferry::text_lines{}, o) == want_lines);
      CHECK(read_all(fixed_files, ferry::fixed_length{.record_bytes = 37, .header_bytes = 3, .footer_bytes = 6}, o) ==
            want_fixed);
    }
  }
}

TEST_CASE("read-ahead: the same errors at the same offsets, exact skips, and a stop mid-file joins" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));
  temp_dir t;
  std::mt19937_64 g(5);
  std::string tf;
  std::vector<std::string> recs;
  std::vector<std::uint64_t> at;  // offset of each record
  for (int i = 0; i < 400; ++i) {
    at.push_back(tf.size());
    recs.push_back(random_bytes(g, g() % 3 == 0 ? 2000 + g() % 3000 : g() % 200));
    tf += tfrecord_of(recs.back());
  }
  std::string bad = tf;
  bad[at[250] + 12 + 3] ^= 0x01;  // a data byte of record 250: its data CRC fails
  write_file(t / "bad.tfrecord", bad);
  write_file(t / "short.tfrecord", tf.substr(0, at[300] + 9));  // ends inside record 300's header
  for (auto [ahead, threads] : {std::pair<std::size_t, std::size_t>{0, 1}, {1, 1}, {3, 1}, {4, 2}, {6, 6}}) {
    INFO("read_ahead " << ahead << ", read_threads " << threads);
    const ferry::from_files_options o{.chunk_bytes = 4096, .read_ahead = ahead, .read_threads = threads};
    expect_error<ferry::format_error>([&] { read_all({t / "bad.tfrecord"}, ferry::tfrecord{}, o); },
                                      t / "bad.tfrecord", at[250], "CRC");
    expect_error<ferry::format_error>([&] { read_all({t / "short.tfrecord"}, ferry::tfrecord{}, o); },
                                      t / "short.tfrecord", at[300], "truncated");
    ferry::from_files_options skip = o;
    skip.on_error = ferry::error_policy::skip;
    skip.on_skip = [](const ferry::skipped_record&) {};
    auto src = ferry::from_files({t / "bad.tfrecord", t / "short.tfrecord"}, ferry::tfrecord{}, skip);
    std::vector<std::string> want(recs.begin(), recs.end());
    want.erase(want.begin() + 250);
    want.insert(want.end(), recs.begin(), recs.begin() + 300);
    CHECK(read_all(src) == want);
    CHECK(src.skipped() == 2);
    // Stopping mid-file: the I/O threads wait on a full queue (or are between preads);
    // destruction wakes and joins them at once: timed, well under the watchdog.
    for (int k : {0, 1, 37, 249}) {
      std::optional<decltype(ferry::from_files({t / "bad.tfrecord"}, ferry::tfrecord{}, o))> s2;
      s2.emplace(ferry::from_files({t / "bad.tfrecord"}, ferry::tfrecord{}, o));
      for (int i = 0; i < k; ++i) REQUIRE((*s2).next());
      // Time for the threads to park on a full queue. Not a synchronisation: parked or
      // mid-read, destruction must be prompt; this only makes the parked case likely.
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      const auto t0 = std::chrono::steady_clock::now();
      s2.reset();
      const auto took = std::chrono::steady_clock::now() - t0;
      CHECK_MESSAGE(took < std::chrono::seconds(2),
                    "destruction took " << std::chrono::duration<double>(took).count() << " s");
    }
  }
}

TEST_CASE("text lines: endings, empty lines, last line") {
  temp_dir t;
  write_file(t / "a.txt", "a\r\n\nb\n\r\nlast");
  CHECK(read_all({t / "a.txt"}, ferry::text_lines{}) == std::vector<std::string>{"a", "", "b", "", "last"});
  write_file(t / "b.txt", "x\n");
  CHECK(read_all({t / "b.txt"}, ferry::text_lines{}) == std::vector<std::string>{"x"});
  write_file(t / "e.txt", "");
  CHECK(read_all({t / "e.txt"}, ferry::text_lines{}).empty());
  write_file(t / "n.txt", "\n");
  CHECK(read_all({t / "n.txt"}, ferry::text_lines{}) == std::vector<std::string>{""});
}

TEST_CASE("npy: files written by numpy.save, v1/v2/v3, and meta") {
  const std::string d = data_dir();
  const std::string v1 = read_file(d + "/f4_2x3.npy");
  // What numpy.save (1.24) writes for a (2, 3) <f4 array: v1.0, header length 118, data at
  // 128, 152 bytes.
  REQUIRE(v1.size() == 152);
  CHECK(v1.substr(0, 10) == std::string("\x93NUMPY\x01\x00\x76\x00", 10));
  std::vector<std::string> want;
  for (int r = 0; r < 2; ++r) {
    std::string row;
    for (int c = 0; c < 3; ++c) {
      float v = static_cast<float>(r * 3 + c);
      row.append(reinterpret_cast<const char*>(&v), 4);
    }
    want.push_back(row);
  }
  for (auto f : {"/f4_2x3.npy", "/f4_2x3_v2.npy", "/f4_2x3_v3.npy"}) {
    auto src = ferry::from_files({d + f}, ferry::npy{});
    auto m = src.meta();
    REQUIRE(m);
    CHECK(m->dtype == "<f4");
    CHECK(m->shape == std::vector<std::uint64_t>{2, 3});
    CHECK(m->row_shape() == std::vector<std::uint64_t>{3});
    CHECK(m->row_bytes == 12);
    CHECK(read_all(src) == want);
  }
  auto u1 = read_all({d + "/u1_4x2x3.npy"}, ferry::npy{});
  REQUIRE(u1.size() == 4);
  for (int r = 0; r < 4; ++r)
    for (int k = 0; k < 6; ++k) CHECK(static_cast<unsigned char>(u1[r][k]) == r * 6 + k);
  auto be = read_all({d + "/i2be_5.npy"}, ferry::npy{});
  REQUIRE(be.size() == 5);
  CHECK(be[2] == std::string("\x01\x2c", 2));  // 300, big-endian as stored
  auto sc = ferry::from_files({d + "/scalar_f8.npy"}, ferry::npy{});
  CHECK(sc.meta()->shape.empty());
  auto s = read_all(sc);
  REQUIRE(s.size() == 1);
  double v;
  std::memcpy(&v, s[0].data(), 8);
  CHECK(v == 2.5);
  CHECK(read_all({d + "/bool_3.npy"}, ferry::npy{}) == std::vector<std::string>{"\x01", std::string(1, '\0'), "\x01"});
  CHECK(read_all({d + "/empty_0x4.npy"}, ferry::npy{}).empty());
  // fortran_order True in one dimension: the same bytes as C order, rows 0, 1, 2 (<i8).
  CHECK(read_all({d + "/fortran_1d.npy"}, ferry::npy{}) == std::vector<std::string>{le(0, 8), le(1, 8), le(2, 8)});
  // Files of different row layouts cannot be read together.
  expect_error([&] { read_all({d + "/f4_2x3.npy", d + "/u1_4x2x3.npy"}, ferry::npy{}); }, d + "/u1_4x2x3.npy", 0,
               "differ from the first file's");
}

TEST_CASE("idx: fixtures, gzip, and Fashion-MNIST when installed") {
  const std::string d = data_dir();
  auto a = read_all({d + "/u1_3x4x5.idx"}, ferry::idx{});
  auto b = read_all({d + "/u1_3x4x5.idx.gz"}, ferry::idx{});
  REQUIRE(a.size() == 3);
  CHECK(a == b);
  for (int i = 0; i < 60; ++i) CHECK(static_cast<unsigned char>(a[i / 20][i % 20]) == i % 251);
  auto f = ferry::from_files({d + "/f4be_2x2.idx"}, ferry::idx{});
  CHECK(f.meta()->dtype == ">f4");
  // A first file that next() would skip: meta() gives the next one's layout, as next()
  // reads it (it threw the skipped file's error); under raise it throws that error.
  ferry::from_files_options skip{.on_error = ferry::error_policy::skip};
  skip.on_skip = [](const ferry::skipped_record&) {};
  auto after_missing = ferry::from_files({d + "/missing.idx", d + "/f4be_2x2.idx"}, ferry::idx{}, skip);
  REQUIRE(after_missing.meta());
  CHECK(after_missing.meta()->dtype == ">f4");
  CHECK_FALSE(ferry::from_files({d + "/missing.idx"}, ferry::idx{}, skip).meta());
  CHECK_THROWS_AS(ferry::from_files({d + "/missing.idx", d + "/f4be_2x2.idx"}, ferry::idx{}).meta(), ferry::io_error);
  CHECK(read_all(f)[0] == std::string("\x3f\xc0\x00\x00\xc0\x00\x00\x00", 8));  // 1.5, -2 big-endian

  const std::string fm = "/usr/share/datasets/fashion-mnist/";
  if (!std::filesystem::exists(fm + "train-labels-idx1-ubyte.gz")) {
    MESSAGE("Fashion-MNIST not installed (Debian dataset-fashion-mnist): skipped that part");
    return;
  }
  auto imgs = ferry::from_files({fm + "train-images-idx3-ubyte.gz"}, ferry::idx{});
  CHECK(imgs.meta()->shape == std::vector<std::uint64_t>{60000, 28, 28});
  std::uint64_t n = 0;
  while (auto r = imgs.next()) n += r->size() == 784;
  CHECK(n == 60000);
  std::map<int, int> per_class;
  auto labels = ferry::from_files({fm + "train-labels-idx1-ubyte.gz"}, ferry::idx{});
  while (auto r = labels.next()) ++per_class[std::to_integer<int>((*r).data()[0])];
  CHECK(per_class.size() == 10);
  for (auto [c, k] : per_class) CHECK(k == 6000);  // Fashion-MNIST is balanced
}

TEST_CASE("fixed length: header, footer, record count") {
  temp_dir t;
  write_file(t / "a.bin", "HH0123456789FFF");
  CHECK(read_all({t / "a.bin"}, ferry::fixed_length{.record_bytes = 5, .header_bytes = 2, .footer_bytes = 3}) ==
        std::vector<std::string>{"01234", "56789"});
  CHECK_THROWS_AS(ferry::from_files({t / "a.bin"}, ferry::fixed_length{}), ferry::config_error);
  // Sizes whose sum wraps used to frame a record of SIZE_MAX bytes (a crash).
  constexpr std::size_t huge = SIZE_MAX;
  CHECK_THROWS_AS(ferry::from_files({t / "a.bin"}, ferry::fixed_length{.record_bytes = huge, .footer_bytes = 1}),
                  ferry::config_error);
  CHECK_THROWS_AS(ferry::from_files({t / "a.bin"}, ferry::fixed_length{.record_bytes = 1, .footer_bytes = huge}),
                  ferry::config_error);
  CHECK_THROWS_AS(ferry::from_files({t / "a.bin"}, ferry::fixed_length{.record_bytes = 5, .header_bytes = huge}),
                  ferry::config_error);
  // A record and its footer are buffered together: at most max_record_bytes.
  CHECK_THROWS_AS(ferry::from_files({t / "a.bin"}, ferry::fixed_length{.record_bytes = huge}), ferry::config_error);
  CHECK_THROWS_AS(ferry::from_files({t / "a.bin"}, ferry::fixed_length{.record_bytes = 60, .footer_bytes = 5},
                                    {.max_record_bytes = 64}),
                  ferry::config_error);
  try {
    ferry::from_files({t / "a.bin"}, ferry::fixed_length{.record_bytes = (64ull << 20) + 1});
    FAIL("no config_error");
  } catch (const ferry::config_error& e) {
    CHECK(std::string(e.what()).find("max_record_bytes (67108864)") != std::string::npos);  // 64 MiB by default
  }
  CHECK(read_all({t / "a.bin"}, ferry::fixed_length{.record_bytes = 5, .header_bytes = 2, .footer_bytes = 3},
                 {.max_record_bytes = 8})
            .size() == 2);
  // max_record_bytes is 1 to 2^40: "no limit" (2^64 - 1) let a TFRecord length of 2^64 - 16
  // wrap its framing in a stream of unknown size (a read past the buffer, or the same
  // record framed forever).
  for (const std::uint64_t bad : {std::uint64_t(0), (std::uint64_t(1) << 40) + 1, ~std::uint64_t(0)})
    CHECK_THROWS_WITH_AS(ferry::from_files({t / "a.bin"}, ferry::tfrecord{}, {.max_record_bytes = bad}),
                         doctest::Contains("max_record_bytes"), ferry::config_error);
  CHECK_NOTHROW(ferry::from_files({t / "a.bin"}, ferry::tfrecord{}, {.max_record_bytes = std::uint64_t(1) << 40}));
  {
    std::string rec(12, '\0');
    const std::uint64_t len = ~std::uint64_t(0) - 15;  // + 16 wraps to 0
    for (int i = 0; i < 8; ++i) rec[std::size_t(i)] = char(len >> (8 * i));
    const std::uint32_t crc = ferry::detail::crc32c::mask(ferry::detail::crc32c::value(rec.data(), 8));
    for (int i = 0; i < 4; ++i) rec[std::size_t(8 + i)] = char(crc >> (8 * i));
    write_gzip(t / "wrap.tfrecord.gz", rec + std::string(64, 'x'));
    expect_error([&] { read_all({t / "wrap.tfrecord.gz"}, ferry::tfrecord{}, {.max_record_bytes = std::uint64_t(1) << 40}); },
                 t / "wrap.tfrecord.gz", 0, "exceeds max_record_bytes (1099511627776)");
    // A claim of 2^39 bytes within the limit, in a stream of unknown size: the buffer grows
    // with the bytes that come (it allocated the claim at once: std::bad_alloc at every
    // call, which skip could not pass), so the record is truncated, and skip goes on.
    const std::uint64_t claim = std::uint64_t(1) << 39;
    for (int i = 0; i < 8; ++i) rec[std::size_t(i)] = char(claim >> (8 * i));
    const std::uint32_t crc2 = ferry::detail::crc32c::mask(ferry::detail::crc32c::value(rec.data(), 8));
    for (int i = 0; i < 4; ++i) rec[std::size_t(8 + i)] = char(crc2 >> (8 * i));
    write_gzip(t / "claim.tfrecord.gz", rec + std::string(64, 'x'));
    write_gzip(t / "good.tfrecord.gz", tfrecord_of("after"));
    const ferry::from_files_options big{.max_record_bytes = std::uint64_t(1) << 40};
    expect_error([&] { read_all({t / "claim.tfrecord.gz"}, ferry::tfrecord{}, big); }, t / "claim.tfrecord.gz", 0,
                 "truncated record");
    ferry::from_files_options skip = big;
    skip.on_error = ferry::error_policy::skip;
    skip.on_skip = [](const ferry::skipped_record&) {};
    auto s = ferry::from_files({t / "claim.tfrecord.gz", t / "good.tfrecord.gz"}, ferry::tfrecord{}, skip);
    CHECK(read_all(s) == std::vector<std::string>{"after"});
    CHECK(s.skipped() == 1);
  }
  // A header larger than any buffer (3 MiB) in a compressed file is skipped piece by piece.
  write_gzip(t / "h.bin.gz", std::string(3 << 20, 'H') + "0123456789");
  CHECK(read_all({t / "h.bin.gz"}, ferry::fixed_length{.record_bytes = 5, .header_bytes = 3 << 20},
                 {.chunk_bytes = 4096}) == std::vector<std::string>{"01234", "56789"});
  expect_error([&] { read_all({t / "h.bin.gz"}, ferry::fixed_length{.record_bytes = 5, .header_bytes = 4 << 20}); },
               t / "h.bin.gz", 0, "the uncompressed stream has 3145738 bytes");
}

TEST_CASE("bad input: a clear error naming file and offset") {
  temp_dir t;
  const std::string d = data_dir();
  const std::string good = tfrecord_of("abc") + tfrecord_of("defgh");  // records at 0 and 19
  SUBCASE("missing file, directory, pattern matching nothing") {
    expect_error<ferry::io_error>([&] { read_all({t / "nope.tfrecord"}, ferry::tfrecord{}); }, t / "nope.tfrecord", 0,
                                  "No such file");
    expect_error<ferry::io_error>([&] { read_all({t.path}, ferry::tfrecord{}); }, t.path, 0, "directory");
    CHECK_THROWS_AS(ferry::from_files({t / "*.none"}, ferry::tfrecord{}), ferry::io_error);
  }
  SUBCASE("absurd read_ahead, read_threads and chunk_bytes are config_errors naming the value") {
    write_file(t / "g.tfrecord", good);
    CHECK_THROWS_WITH_AS(ferry::from_files({t / "g.tfrecord"}, ferry::tfrecord{}, {.read_ahead = std::size_t(1) << 40}),
                         doctest::Contains("from_files: read_ahead = 1099511627776"), ferry::config_error);
    CHECK_THROWS_WITH_AS(ferry::from_files({t / "g.tfrecord"}, ferry::tfrecord{}, {.read_threads = 100000}),
                         doctest::Contains("from_files: read_threads = 100000"), ferry::config_error);
    CHECK_THROWS_WITH_AS(ferry::from_files({t / "g.tfrecord"}, ferry::tfrecord{}, {.chunk_bytes = std::size_t(1) << 40}),
                         doctest::Contains("from_files: chunk_bytes = 1099511627776"), ferry::config_error);
    CHECK(read_all({t / "g.tfrecord"}, ferry::tfrecord{}, {.read_ahead = 64, .read_threads = 8}).size() == 2);
  }
  SUBCASE("a file named with glob characters is that file, not a pattern") {
    write_file(t / "data[1].tfrecord", good);
    write_file(t / "data1.tfrecord", tfrecord_of("other"));  // what the pattern data[1] would match
    CHECK(read_all({t / "data[1].tfrecord"}, ferry::tfrecord{}) == std::vector<std::string>{"abc", "defgh"});
    write_file(t / "x*y.tfrecord", good);
    CHECK(read_all({t / "x*y.tfrecord"}, ferry::tfrecord{}).size() == 2);
    // A pattern that names no file as written still globs.
    CHECK(read_all({t / "data[0-9].tfrecord"}, ferry::tfrecord{}) == std::vector<std::string>{"other"});
  }
  SUBCASE("empty files") {
    write_file(t / "e", "");
    CHECK(read_all({t / "e"}, ferry::tfrecord{}).empty());  // as TensorFlow: no records
    CHECK(read_all({t / "e"}, ferry::fixed_length{.record_bytes = 4}).empty());
    expect_error([&] { read_all({t / "e"}, ferry::npy{}); }, t / "e", 0, "truncated npy header");
    expect_error([&] { read_all({t / "e"}, ferry::idx{}); }, t / "e", 0, "truncated IDX header");
    expect_error([&] { read_all({t / "e"}, ferry::fixed_length{.record_bytes = 4, .header_bytes = 2}); }, t / "e", 0,
                 "not header (2)");
  }
  SUBCASE("tfrecord: truncated header and payload") {
    write_file(t / "h", good + good.substr(0, 5));
    expect_error([&] { read_all({t / "h"}, ferry::tfrecord{}); }, t / "h", 40, "truncated record");
    write_file(t / "p", good + tfrecord_of("0123456789").substr(0, 20));
    expect_error([&] { read_all({t / "p"}, ferry::tfrecord{}); }, t / "p", 40, "truncated record");
    write_gzip(t / "p.gz", good + tfrecord_of("0123456789").substr(0, 20));
    expect_error([&] { read_all({t / "p.gz"}, ferry::tfrecord{}); }, t / "p.gz", 40, "truncated record");
  }
  SUBCASE("tfrecord: CRC mismatches, and --no-verify") {
    std::string bad = good;
    bad[19 + 12 + 2] ^= 1;  // data of the second record
    write_file(t / "c", bad);
    expect_error([&] { read_all({t / "c"}, ferry::tfrecord{}); }, t / "c", 19, "corrupted record (data CRC mismatch)");
    CHECK(read_all({t / "c"}, ferry::tfrecord{.verify_crc = false}).size() == 2);
    bad = good;
    bad[19 + 9] ^= 1;  // length CRC of the second
    write_file(t / "l", bad);
    expect_error([&] { read_all({t / "l"}, ferry::tfrecord{}); }, t / "l", 19, "length CRC mismatch");
  }
  SUBCASE("tfrecord: a length field of 2^63 is never allocated") {
    std::string len = le(1ull << 63, 8);
    std::string rec = len + le(crc::mask(crc::value(len.data(), 8)), 4) + "xyz" + le(0, 4);
    write_file(t / "big", good + rec);
    expect_error([&] { read_all({t / "big"}, ferry::tfrecord{}); }, t / "big", 40, "the length field says 9223372036854775808");
    write_gzip(t / "big.gz", good + rec);
    expect_error([&] { read_all({t / "big.gz"}, ferry::tfrecord{}); }, t / "big.gz", 40, "exceeds max_record_bytes");
  }
  SUBCASE("npy: truncated header, header lying about its size, refused dtypes, missing rows") {
    const std::string v1 = read_file(d + "/f4_2x3.npy");
    write_file(t / "h.npy", v1.substr(0, 8));
    expect_error([&] { read_all({t / "h.npy"}, ferry::npy{}); }, t / "h.npy", 0, "truncated npy header");
    std::string lie = v1;
    lie[8] = '\xff', lie[9] = '\x7f';  // header length 32767 > file
    write_file(t / "lie.npy", lie);
    expect_error([&] { read_all({t / "lie.npy"}, ferry::npy{}); }, t / "lie.npy", 8, "header length field says 32767");
    write_file(t / "short.npy", v1.substr(0, 128 + 12 + 5));  // one whole row and a part
    expect_error([&] { read_all({t / "short.npy"}, ferry::npy{}); }, t / "short.npy", 140, "truncated row 1 of 2");
    write_file(t / "long.npy", v1 + "x");
    expect_error([&] { read_all({t / "long.npy"}, ferry::npy{}); }, t / "long.npy", 152, "unexpected bytes");
    expect_error([&] { read_all({d + "/object.npy"}, ferry::npy{}); }, d + "/object.npy", 10, "object arrays");
    expect_error([&] { read_all({d + "/structured.npy"}, ferry::npy{}); }, d + "/structured.npy", 10, "structured");
    expect_error([&] { read_all({d + "/fortran_2d.npy"}, ferry::npy{}); }, d + "/fortran_2d.npy", 10, "fortran_order");
    std::string magic = v1;
    magic[1] = 'X';
    write_file(t / "m.npy", magic);
    expect_error([&] { read_all({t / "m.npy"}, ferry::npy{}); }, t / "m.npy", 0, "bad magic");
  }
  SUBCASE("idx: wrong magic, truncated") {
    std::string idx = read_file(d + "/u1_3x4x5.idx");
    std::string w = idx;
    w[0] = 1;
    write_file(t / "w.idx", w);
    expect_error([&] { read_all({t / "w.idx"}, ferry::idx{}); }, t / "w.idx", 0, "wrong magic 0x01000803");
    w = idx;
    w[2] = 0x42;
    write_file(t / "t.idx", w);
    expect_error([&] { read_all({t / "t.idx"}, ferry::idx{}); }, t / "t.idx", 0, "wrong magic");
    write_file(t / "s.idx", idx.substr(0, 16 + 20 + 3));
    expect_error([&] { read_all({t / "s.idx"}, ferry::idx{}); }, t / "s.idx", 36, "truncated row 1 of 3");
  }
  SUBCASE("fixed length: a size that is not a multiple") {
    write_file(t / "f.bin", "HH0123456789xFFF");
    expect_error([&] { read_all({t / "f.bin"}, ferry::fixed_length{.record_bytes = 5, .header_bytes = 2, .footer_bytes = 3}); },
                 t / "f.bin", 12, "the file has 16 bytes");
  }
  SUBCASE("fixed length: a file shorter than header + footer; a footer cut short") {
    const ferry::fixed_length fl{.record_bytes = 5, .header_bytes = 4, .footer_bytes = 3};
    for (bool gz : {false, true}) {
      INFO((gz ? "gzip" : "plain"));
      const std::string sfx = gz ? ".gz" : "";
      auto put = [&](const std::string& name, const std::string& bytes) {
        gz ? write_gzip(t / (name + sfx), bytes) : write_file(t / (name + sfx), bytes);
        return t / (name + sfx);
      };
      auto size = [&](std::size_t n) {
        return (gz ? "the uncompressed stream has " : "the file has ") + std::to_string(n) + " bytes";
      };
      // Shorter than the header: the header cannot be skipped (offset 0).
      const std::string h = put("h", "HHH");
      expect_error<ferry::format_error>([&] { read_all({h}, fl); }, h, 0, "not header (4) + k * 5 + footer (3): " + size(3));
      // The header, and part of the footer: no record, the error where the records start.
      const std::string hf = put("hf", "HHHHFF");
      expect_error<ferry::format_error>([&] { read_all({hf}, fl); }, hf, 4, size(6));
      // Exactly header + footer: no records, no error.
      CHECK(read_all({put("e", "HHHHFFF")}, fl).empty());
      // A footer cut short: a record is handed out once it and a whole footer's worth of
      // bytes after it are there, so the last record is not; the error is at its offset.
      const std::string cut = put("cut", "HHHH0123456789FF");
      const read_result r = read_until_error({cut}, fl);
      CHECK(r.recs == std::vector<std::string>{"01234"});
      REQUIRE(r.err);
      CHECK(r.err->path == cut);
      CHECK(r.err->offset == 9);
      CHECK_MESSAGE(r.what.find(size(16)) != std::string::npos, r.what);
    }
  }
  SUBCASE("idx: bytes after the last row, plain and gzip") {
    const std::string idx = read_file(d + "/u1_3x4x5.idx");  // 16 header bytes, 3 rows of 20
    write_file(t / "x.idx", idx + "x");
    write_gzip(t / "x.idx.gz", idx + "xyz");
    for (const std::string& f : {t / "x.idx", t / "x.idx.gz"}) {
      const read_result r = read_until_error({f}, ferry::idx{});
      CHECK(r.recs == read_all({d + "/u1_3x4x5.idx"}, ferry::idx{}));  // every row first
      REQUIRE(r.err);
      CHECK(r.err->path == f);
      CHECK(r.err->offset == 76);
      CHECK_MESSAGE(r.what.find("unexpected bytes after the last row (the header says 3 rows)") != std::string::npos,
                    r.what);
    }
  }
  SUBCASE("corrupt gzip stream") {
    std::string z;
    write_gzip(t / "z.gz", good + good + good);
    z = read_file(t / "z.gz");
    z[z.size() / 2] ^= 0x55;
    z[z.size() / 2 + 1] ^= 0x55;
    write_file(t / "z.gz", z);
    // The records before the damage arrive; the error names the file and the offset of the
    // first record the stream cannot complete (in the uncompressed data).
    const std::vector<std::string> recs = {"abc", "defgh", "abc", "defgh", "abc", "defgh"};
    auto src = ferry::from_files({t / "z.gz"}, ferry::tfrecord{});
    std::vector<std::string> got;
    try {
      while (auto r = src.next()) got.emplace_back(r->str());
      FAIL("no error");
    } catch (const ferry::format_error& e) {
      REQUIRE(got.size() < recs.size());
      CHECK(got == std::vector<std::string>(recs.begin(), recs.begin() + static_cast<long>(got.size())));
      CHECK(e.path() == t / "z.gz");
      CHECK(e.offset() == got.size() / 2 * 40 + got.size() % 2 * 19);
      CHECK_MESSAGE(std::string(e.what()).find(t / "z.gz") == 0, std::string(e.what()));
      CHECK_MESSAGE(std::string(e.what()).find(" at offset " + std::to_string(e.offset())) != std::string::npos,
                    std::string(e.what()));
    }
    // A bad CRC in the gzip trailer: every record arrives, then the error at the end.
    write_gzip(t / "c.gz", good + good + good);
    z = read_file(t / "c.gz");
    z[z.size() - 6] ^= 0x01;
    write_file(t / "c.gz", z);
    auto c = ferry::from_files({t / "c.gz"}, ferry::tfrecord{});
    got.clear();
    expect_error<ferry::format_error>([&] { while (auto r = c.next()) got.emplace_back(r->str()); }, t / "c.gz", 120,
                                      "corrupt gzip stream (incorrect data check");
    CHECK(got == recs);
  }
  SUBCASE("gzip cut short at every byte: the records before the cut, then an error at the next") {
    std::mt19937_64 g(9);
    std::string tf;
    std::vector<std::string> recs;
    std::vector<std::uint64_t> ends;  // where each record ends
    for (int i = 0; i < 40; ++i) {
      recs.push_back(random_bytes(g, g() % 120));
      tf += tfrecord_of(recs.back());
      ends.push_back(tf.size());
    }
    write_gzip(t / "whole.gz", tf);
    const std::string z = read_file(t / "whole.gz");
    for (std::size_t cut = 0; cut < z.size(); ++cut) {
      INFO("cut at " << cut << " of " << z.size() << " bytes");
      write_file(t / "cut.gz", z.substr(0, cut));
      for (std::size_t chunk : {64, 1 << 20}) {
        auto src = ferry::from_files({t / "cut.gz"}, ferry::tfrecord{}, {.chunk_bytes = chunk});
        std::vector<std::string> got;
        try {
          while (auto r = src.next()) got.emplace_back(r->str());
          FAIL("no error");
        } catch (const ferry::format_error& e) {
          CHECK(got == std::vector<std::string>(recs.begin(), recs.begin() + static_cast<long>(got.size())));
          CHECK(e.path() == t / "cut.gz");
          CHECK(e.offset() == (got.empty() ? 0 : ends[got.size() - 1]));
          CHECK_MESSAGE(std::string(e.what()).find("truncated gzip stream") != std::string::npos, std::string(e.what()));
        }
      }
    }
  }
  SUBCASE("npy: versions, header dicts, shapes that overflow, header length limit") {
    const std::string row = std::string(12, 'r');
    const std::string ok = npy_of("<f4", "(2, 3)", row + row);
    CHECK(ok == read_file(d + "/f4_2x3.npy").substr(0, 128) + row + row);  // numpy.save's header
    for (auto [major, minor] : {std::pair{0, 0}, {4, 0}, {1, 1}, {255, 0}}) {
      std::string v = ok;
      v[6] = static_cast<char>(major), v[7] = static_cast<char>(minor);
      write_file(t / "v.npy", v);
      expect_error<ferry::format_error>([&] { read_all({t / "v.npy"}, ferry::npy{}); }, t / "v.npy", 6,
                                        "unsupported npy version " + std::to_string(major) + "." + std::to_string(minor));
    }
    const std::string tail = "'fortran_order': False, 'shape': (2, 3), }";
    const std::vector<std::pair<std::string, std::string>> bad = {
        {"['descr', '<f4']", "not a dict"},
        {"{descr: '<f4', " + tail, "not a dict of quoted keys"},
        {"{'descr: '<f4', " + tail, "not a dict of quoted keys"},
        {"{'descr': '<f4' " + tail, "dict is malformed"},
        {"{'descr': '<f4', " + tail + " x", "unexpected text after the npy header dict"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'extra': 1, }", "unknown key 'extra'"},
        {"{'descr': '<f4', 'fortran_order': False, }", "lacks descr, fortran_order or shape"},
        {"{'descr': '<f4', 'fortran_order': 0, 'shape': (2, 3), }", "not True or False"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': [2, 3], }", "shape is not a tuple"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }", "non-integer"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (2; 3), }", "not a tuple of integers"},
        // Python reads (2) as the number 2: NumPy refuses it as a shape.
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (2), }", "shape (2) is not a tuple (NumPy writes (2,))"},
        {"{'descr': 4, 'fortran_order': False, 'shape': (2, 3), }", "descr is not a string"},
        {"{'descr': '<q9', 'fortran_order': False, 'shape': (2, 3), }", "unsupported npy dtype '<q9'"},
        // Sizes NumPy has not for the kind (they were framed as 3- or 4-byte items).
        {"{'descr': '<i3', 'fortran_order': False, 'shape': (2, 3), }", "'<i3' (no such size for its kind)"},
        {"{'descr': '<f3', 'fortran_order': False, 'shape': (2, 3), }", "'<f3' (no such size for its kind)"},
        {"{'descr': '|b4', 'fortran_order': False, 'shape': (2, 3), }", "'|b4' (no such size for its kind)"},
        {"{'descr': '<c3', 'fortran_order': False, 'shape': (2, 3), }", "'<c3' (no such size for its kind)"},
        {"{'descr': '<M4[s]', 'fortran_order': False, 'shape': (2, 3), }", "'<M4[s]' (no such size for its kind)"},
        // Rows of 0 bytes past 2^24: no byte backs them, and 2^64 of them would never end.
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (18446744073709551615, 0), }",
         "claims 18446744073709551615 rows of 0 bytes"},
        {"{'descr': '|V0', 'fortran_order': False, 'shape': (16777217,), }", "claims 16777217 rows of 0 bytes"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999999,), }", "shape overflows"},
        // The row, then the whole array, larger than 2^64 bytes.
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (1, 4294967296, 4294967296), }", "size overflows"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }", "size overflows"},
    };
    for (const auto& [dict, what] : bad) {
      INFO(dict);
      write_file(t / "d.npy", npy_with_dict(dict, row + row));
      expect_error<ferry::format_error>([&] { read_all({t / "d.npy"}, ferry::npy{}); }, t / "d.npy", 10, what);
    }
    // A header length over the limit (1 MiB) is refused before it is read; v2 and v3
    // carry 4-byte lengths that could say 4 GiB.
    for (std::uint64_t len : {(1ull << 20) + 1, 0xffffffffull}) {
      std::string big = npy_with_dict("{'descr': '<f4', 'fortran_order': False, 'shape': (0,), }", "", 2);
      big.replace(8, 4, le(len, 4));
      write_file(t / "big.npy", big);
      expect_error<ferry::format_error>([&] { read_all({t / "big.npy"}, ferry::npy{}); }, t / "big.npy", 8,
                                        "npy header length " + std::to_string(len) + " exceeds the limit of 1048576");
    }
    // At the limit it is read (NumPy pads the header so the shape can grow in place).
    const std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
    std::string at_limit = npy_with_dict(dict, row + row, 2);  // then its header padded to 1 MiB
    at_limit.replace(8, 4, le(1u << 20, 4));
    at_limit.replace(12, at_limit.size() - 24 - 12, dict + std::string((1u << 20) - dict.size() - 1, ' ') + "\n");
    REQUIRE(at_limit.size() == 12 + (1u << 20) + 24);
    write_file(t / "limit.npy", at_limit);
    CHECK(read_all({t / "limit.npy"}, ferry::npy{}) == std::vector<std::string>{row, row});
  }
  SUBCASE("idx: header cut in the dimensions, shapes that overflow, gzip cut short at every byte") {
    const std::string idx = read_file(d + "/u1_3x4x5.idx");
    for (std::size_t cut : {5, 6, 8, 10, 15}) {
      write_file(t / "h.idx", idx.substr(0, cut));
      expect_error<ferry::format_error>([&] { read_all({t / "h.idx"}, ferry::idx{}); }, t / "h.idx", 0,
                                        "truncated IDX header (3 dimensions need 16 bytes)");
    }
    // Rows of 8 * (2^32 - 1)^3 bytes; (2^32 - 1)^3 rows of (2^32 - 1)^2 bytes.
    write_file(t / "o1.idx", idx_of(0x0E, {1, 0xffffffffu, 0xffffffffu, 0xffffffffu}, "x"));
    expect_error<ferry::format_error>([&] { read_all({t / "o1.idx"}, ferry::idx{}); }, t / "o1.idx", 4,
                                      "the IDX shape's size overflows");
    write_file(t / "o2.idx", idx_of(0x08, {0xffffffffu, 0xffffffffu, 0xffffffffu}, "x"));
    expect_error<ferry::format_error>([&] { read_all({t / "o2.idx"}, ferry::idx{}); }, t / "o2.idx", 4,
                                      "the IDX shape's size overflows");
    // 2^32 - 1 rows of 0 bytes (a dimension of 0): past max_empty_rows, refused (reading
    // them took minutes); at it, read.
    write_file(t / "z.idx", idx_of(0x08, {0xffffffffu, 0}, ""));
    expect_error<ferry::format_error>([&] { read_all({t / "z.idx"}, ferry::idx{}); }, t / "z.idx", 4,
                                      "claims 4294967295 rows of 0 bytes");
    write_file(t / "z3.idx", idx_of(0x08, {3, 0}, ""));
    CHECK(read_all({t / "z3.idx"}, ferry::idx{}) == std::vector<std::string>(3));
    std::mt19937_64 g(4);
    const std::string rows = random_bytes(g, 50 * 20);
    write_gzip(t / "whole.idx.gz", idx_of(0x08, {50, 4, 5}, rows));
    const std::string z = read_file(t / "whole.idx.gz");
    for (std::size_t cut = 0; cut < z.size(); ++cut) {
      INFO("cut at " << cut << " of " << z.size() << " bytes");
      write_file(t / "cut.idx.gz", z.substr(0, cut));
      for (std::size_t chunk : {64, 1 << 20}) {
        auto src = ferry::from_files({t / "cut.idx.gz"}, ferry::idx{}, {.chunk_bytes = chunk});
        std::string got;
        try {
          while (auto r = src.next()) got += r->str();
          FAIL("no error");
        } catch (const ferry::format_error& e) {
          CHECK(got == rows.substr(0, got.size()));
          CHECK(e.path() == t / "cut.idx.gz");
          // The header, or the first row the stream cannot complete.
          CHECK(e.offset() == (src.meta() ? 16 + got.size() : 0));
          CHECK_MESSAGE(std::string(e.what()).find("truncated gzip stream") != std::string::npos, std::string(e.what()));
        }
      }
    }
  }
  SUBCASE("text lines: a line longer than max_record_bytes, compressed or plain") {
    const std::string lines = "first\n" + std::string(5000, 'x') + "\nlast\n";
    write_gzip(t / "l.txt.gz", lines);
    CHECK(read_all({t / "l.txt.gz"}, ferry::text_lines{}).size() == 3);
    std::vector<std::string> got;
    for (std::size_t chunk : {64, 4096, 1 << 20}) {
      INFO("chunk " << chunk);
      const ferry::from_files_options o{.chunk_bytes = chunk, .max_record_bytes = 1000};
      auto src = ferry::from_files({t / "l.txt.gz"}, ferry::text_lines{}, o);
      got.clear();
      expect_error<ferry::format_error>([&] { while (auto r = src.next()) got.emplace_back(r->str()); }, t / "l.txt.gz",
                                        6, "a line longer than max_record_bytes (1000)");
      CHECK(got == std::vector<std::string>{"first"});
      // The same file uncompressed: the same error at the same place (the limit holds on
      // every path: a file without newlines must not be buffered whole).
      write_file(t / "l.txt", lines);
      auto plain = ferry::from_files({t / "l.txt"}, ferry::text_lines{}, o);
      got.clear();
      expect_error<ferry::format_error>([&] { while (auto r = plain.next()) got.emplace_back(r->str()); }, t / "l.txt",
                                        6, "a line longer than max_record_bytes (1000)");
      CHECK(got == std::vector<std::string>{"first"});
      CHECK(read_all({t / "l.txt"}, ferry::text_lines{}, {.chunk_bytes = chunk}).size() == 3);  // 64 MiB by default
    }
  }
  SUBCASE("tfrecord: a length field past max_record_bytes in a plain file is refused before any buffering") {
    std::string big = tfrecord_of(std::string(3000, 'z'));
    write_file(t / "big.tfrecord", good + big);
    expect_error([&] { read_all({t / "big.tfrecord"}, ferry::tfrecord{}, {.max_record_bytes = 1000}); },
                 t / "big.tfrecord", 40, "record length 3000 exceeds max_record_bytes (1000)");
    CHECK(read_all({t / "big.tfrecord"}, ferry::tfrecord{}).size() == 3);
  }
}

TEST_CASE("bad input: a missing first file (npy, IDX, text lines, fixed length) is named; the next file is read") {
  temp_dir t;
  const std::string d = data_dir();
  write_file(t / "l.txt", "a\nb\n");
  write_file(t / "f.bin", "0123456789");
  const std::vector<std::pair<ferry::file_format, std::string>> formats = {
      {ferry::npy{}, d + "/u1_4x2x3.npy"},
      {ferry::idx{}, d + "/u1_3x4x5.idx"},
      {ferry::text_lines{}, t / "l.txt"},
      {ferry::fixed_length{.record_bytes = 5}, t / "f.bin"}};
  for (const auto& [fmt, good] : formats) {
    INFO("format " << fmt.index());
    const std::string missing = t / ("missing-" + std::to_string(fmt.index()));
    const auto rows = read_all({good}, fmt);
    REQUIRE(rows.size() >= 2);
    expect_error<ferry::io_error>([&] { read_all({missing, good}, fmt); }, missing, 0,
                                  "cannot open at offset 0: No such file or directory");
    // raise: the error first, then the next file from its start.
    auto src = ferry::from_files({missing, good}, fmt);
    CHECK_THROWS_AS(src.next(), ferry::io_error);
    CHECK(read_all(src) == rows);
    // skip: counted once, the same rows.
    std::vector<ferry::skipped_record> log;
    auto sk = ferry::from_files({missing, good}, fmt,
                                {.on_error = ferry::error_policy::skip,
                                 .on_skip = [&](const ferry::skipped_record& r) { log.push_back(r); }});
    CHECK(read_all(sk) == rows);
    CHECK(sk.skipped() == 1);
    REQUIRE(log.size() == 1);
    CHECK(log[0].path == missing);
    CHECK(log[0].offset == 0);
  }
  // npy/IDX: meta() reads the first file's header, so it names the missing file too.
  auto m = ferry::from_files({t / "missing.npy"}, ferry::npy{});
  expect_error<ferry::io_error>([&] { (void)m.meta(); }, t / "missing.npy", 0, "No such file");
}

// Pipelines are values: one moved mid-file reads on. zlib's state points back at its
// z_stream, so a z_stream moved with the source failed every inflate() after (a valid file
// reported corrupt); ISA-L's state and plain files moved fine.
TEST_CASE("a source moved mid-file reads on: gzip with either library, zlib-wrapped, plain") {
  temp_dir t;
  std::string text;
  std::vector<std::string> want;
  for (int i = 0; i < 20000; ++i) {
    want.push_back("line " + std::to_string(i) + std::string(std::size_t(i % 7), 'x'));
    text += want.back() + "\n";
  }
  write_file(t / "l.txt", text);
  write_file(t / "l.txt.gz", gzip_bytes(text));
  std::string z(compressBound(static_cast<uLong>(text.size())), '\0');
  uLongf zn = static_cast<uLongf>(z.size());
  REQUIRE(compress2(reinterpret_cast<Bytef*>(z.data()), &zn, reinterpret_cast<const Bytef*>(text.data()),
                    static_cast<uLong>(text.size()), 6) == Z_OK);
  z.resize(zn);
  write_file(t / "l.txt.zlib", z);
  for (const char* name : {"l.txt", "l.txt.gz", "l.txt.zlib"})
    for (const auto e : {ferry::inflate_engine::zlib, ferry::inflate_engine::isal}) {
      INFO(name << (e == ferry::inflate_engine::zlib ? " zlib" : " isal"));
      auto src = ferry::from_files({t / name}, ferry::text_lines{}, {.chunk_bytes = 4096, .inflater = e});
      std::vector<std::string> got;
      for (int i = 0; i < 10; ++i) got.emplace_back(src.next()->str());
      auto moved = std::move(src);  // construction; then reads past the chunk inflated before
      for (int i = 0; i < 3000; ++i) got.emplace_back(moved.next()->str());
      auto again = ferry::from_files({t / name}, ferry::text_lines{}, {.chunk_bytes = 4096, .inflater = e});
      again = std::move(moved);  // assignment, to a third place (not back to the first)
      for (auto r = again.next(); r; r = again.next()) got.emplace_back(r->str());
      CHECK(got == want);
    }
}

// A file that grows after it was opened (a log appended to): its size at open bounds what
// is allocated ahead, but past it the reads grow as a stream's do. They were a byte a
// call, the record copied each time: a 4 MiB line took minutes (the watchdog fails it).
TEST_CASE("a text file that grows while read: the new lines whole, a long one read in a few calls" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60), "a file that grows");
  temp_dir t;
  write_file(t / "g.txt", "first\n");
  auto src = ferry::from_files({t / "g.txt"}, ferry::text_lines{}, {.chunk_bytes = 1 << 16});
  CHECK(src.next()->str() == "first");
  const std::string line(std::size_t(4) << 20, 'x');
  {
    std::ofstream o(t / "g.txt", std::ios::binary | std::ios::app);
    o << line << "\nlast\n";
  }
  std::vector<std::string> got;
  for (auto r = src.next(); r; r = src.next()) got.emplace_back(r->str());
  CHECK(got == std::vector<std::string>{line, "last"});
}

TEST_CASE("gzip: concatenated members are one stream; zero padding after the last is ignored, other bytes are not") {
  temp_dir t;
  const std::string good = tfrecord_of("abc") + tfrecord_of("defgh");  // records at 0 and 19, 40 bytes
  // `cat a.gz b.gz` (byte_stream.hpp): records, lines and rows run across the members, an
  // empty member among them; offsets count the uncompressed bytes of all members.
  std::string bad_rec = tfrecord_of("bad");
  bad_rec[bad_rec.size() - 1] ^= 1;  // its data CRC
  const std::string tf = good + good + bad_rec + tfrecord_of("z");
  write_file(t / "m.tfrecord.gz",
             gzip_bytes(tf.substr(0, 25)) + gzip_bytes("") + gzip_bytes(tf.substr(25, 40)) + gzip_bytes(tf.substr(65)));
  write_file(t / "m.txt.gz", gzip_bytes("first li") + gzip_bytes("ne\nsecond\r") + gzip_bytes("\nthird"));
  const std::string idx = read_file(data_dir() + "/u1_3x4x5.idx");
  write_file(t / "m.idx.gz", gzip_bytes(idx.substr(0, 6)) + gzip_bytes(idx.substr(6, 30)) + gzip_bytes(idx.substr(36)));
  for (std::size_t chunk : {64, 1 << 20}) {
    INFO("chunk " << chunk);
    const ferry::from_files_options o{.chunk_bytes = chunk};
    const read_result r = read_until_error({t / "m.tfrecord.gz"}, ferry::tfrecord{}, o);
    CHECK(r.recs == std::vector<std::string>{"abc", "defgh", "abc", "defgh"});
    REQUIRE(r.err);
    CHECK(r.err->path == t / "m.tfrecord.gz");
    CHECK(r.err->offset == 80);
    CHECK(r.err->reason.find("data CRC mismatch") != std::string::npos);
    ferry::from_files_options skip = o;
    skip.on_error = ferry::error_policy::skip;
    skip.on_skip = [](const ferry::skipped_record&) {};
    CHECK(read_all({t / "m.tfrecord.gz"}, ferry::tfrecord{}, skip) ==
          std::vector<std::string>{"abc", "defgh", "abc", "defgh", "z"});
    CHECK(read_all({t / "m.txt.gz"}, ferry::text_lines{}, o) == std::vector<std::string>{"first line", "second", "third"});
    CHECK(read_all({t / "m.idx.gz"}, ferry::idx{}, o) == read_all({data_dir() + "/u1_3x4x5.idx"}, ferry::idx{}));
  }

  // After the last member. Zero bytes (tape or block padding) are ignored, as gzip(1),
  // Python's gzip and zlib's gzread ignore them; a member after them is read. Anything
  // else is an error at the end of the data, after every record: it may be a member whose
  // header is damaged, and ignoring it could drop data silently.
  const std::string z = gzip_bytes(good);
  const std::vector<std::string> recs = {"abc", "defgh"};
  for (const std::string& pad : {std::string(1, '\0'), std::string(512, '\0')}) {
    write_file(t / "pad.gz", z + pad);
    CHECK(read_all({t / "pad.gz"}, ferry::tfrecord{}) == recs);
    write_file(t / "pad.txt.gz", gzip_bytes("x\ny") + pad);
    CHECK(read_all({t / "pad.txt.gz"}, ferry::text_lines{}) == std::vector<std::string>{"x", "y"});
  }
  write_file(t / "pad2.gz", z + std::string(100, '\0') + z);
  CHECK(read_all({t / "pad2.gz"}, ferry::tfrecord{}) == std::vector<std::string>{"abc", "defgh", "abc", "defgh"});
  const std::vector<std::pair<std::string, std::string>> trailing = {
      {"garbage", "corrupt gzip stream (incorrect header check"},
      {std::string(7, '\0') + "garbage", "corrupt gzip stream (incorrect header check"},
      {"\x1f", "truncated gzip stream"},              // a member that has only its first byte
      {z.substr(0, 20), "truncated gzip stream"}};   // a member cut short
  for (const auto& [tail, what] : trailing) {
    INFO("trailing " << tail.size() << " bytes");
    for (std::size_t chunk : {64, 1 << 20}) {
      write_file(t / "tail.gz", z + tail);
      const read_result r = read_until_error({t / "tail.gz"}, ferry::tfrecord{}, {.chunk_bytes = chunk});
      CHECK(r.recs == recs);
      REQUIRE(r.err);
      CHECK(r.err->path == t / "tail.gz");
      CHECK(r.err->offset == 40);
      CHECK_MESSAGE(r.what.find(what) != std::string::npos, r.what);
      write_file(t / "tail.txt.gz", gzip_bytes("x\ny\n") + tail);
      const read_result l = read_until_error({t / "tail.txt.gz"}, ferry::text_lines{}, {.chunk_bytes = chunk});
      CHECK(l.recs == std::vector<std::string>{"x", "y"});
      REQUIRE(l.err);
      CHECK(l.err->offset == 4);
      CHECK_MESSAGE(l.what.find(what) != std::string::npos, l.what);
    }
  }
}

TEST_CASE("gzip with ISA-L: any file, whole or damaged, reads exactly as with zlib (the oracle); whole ones "
          "stay with ISA-L, damaged ones go to zlib") {
  if (!ferry::detail::have_isal) {
    MESSAGE("this build has no ISA-L: nothing to compare");
    return;
  }
  temp_dir t;
  std::mt19937_64 g(31);
  // A member of `bytes`: gzip (write_gzip) or zlib (compress2), at a random level.
  bool zlib_member = false;
  auto member = [&](const std::string& bytes) {
    if (g() % 3) return gzip_bytes(bytes);
    zlib_member = true;
    uLongf n = compressBound(static_cast<uLong>(bytes.size()));
    std::string z(n, '\0');
    REQUIRE(compress2(reinterpret_cast<Bytef*>(z.data()), &n, reinterpret_cast<const Bytef*>(bytes.data()),
                      static_cast<uLong>(bytes.size()), static_cast<int>(g() % 10)) == Z_OK);
    z.resize(n);
    return z;
  };
  int damaged = 0, whole = 0;
  std::size_t extra = 0;  // records past the damage, over every 64-byte-chunk read
  for (int it = 0; it < 240; ++it) {
    INFO("iteration " << it);
    // Lines of a few letters (compressible, with long matches) and some random bytes.
    std::string text;
    const std::size_t len = g() % 6000;
    while (text.size() < len) {
      if (g() % 4 == 0) text += random_bytes(g, g() % 40);
      else text += std::string(g() % 30, static_cast<char>('a' + g() % 4));
      text += g() % 5 ? "\n" : "\r\n";
    }
    // 1 to 4 members, zero padding after some.
    std::string file;
    zlib_member = false;
    std::size_t from = 0;
    const int members = 1 + static_cast<int>(g() % 4);
    for (int m = 0; m < members; ++m) {
      const std::size_t to = m + 1 == members ? text.size() : from + g() % (text.size() - from + 1);
      file += member(text.substr(from, to - from));
      if (g() % 4 == 0) file += std::string(g() % 20, '\0');
      from = to;
    }
    const int kind = it % 5;  // whole; cut short; a byte changed; garbage after; the last trailer byte changed
    if (kind == 1) file.resize(g() % file.size());
    if (kind == 2) file[g() % file.size()] ^= static_cast<char>(1 + g() % 255);
    if (kind == 3) file += random_bytes(g, 1 + g() % 8);
    if (kind == 4) file.back() ^= 0x10;
    const std::string path = t / "p.txt.gz";
    write_file(path, file);
    for (std::size_t chunk : {std::size_t(64), std::size_t(1) << 20}) {
      const read_result z = read_until_error({path}, ferry::text_lines{},
                                             {.chunk_bytes = chunk, .inflater = ferry::inflate_engine::zlib});
      const read_result i = read_until_error({path}, ferry::text_lines{},
                                             {.chunk_bytes = chunk, .inflater = ferry::inflate_engine::isal});
      REQUIRE_MESSAGE(bool(i.err) == bool(z.err), i.what << " / " << z.what);
      if (kind == 2 && chunk == 64) {
        // ISA-L's bytes past damage inside the deflate data may have reached an earlier
        // (64-byte) chunk: then records past the damage arrive before zlib's error.
        REQUIRE(i.recs.size() >= z.recs.size());
        CHECK(std::equal(z.recs.begin(), z.recs.end(), i.recs.begin()));
        if (z.err) {
          CHECK(i.err->offset >= z.err->offset);
          CHECK(i.err->reason == z.err->reason);
        }
        extra += i.recs.size() - z.recs.size();
        continue;
      }
      CHECK(i.recs == z.recs);
      if (z.err) {
        CHECK(i.err->offset == z.err->offset);
        CHECK(i.what == z.what);
      }
      if (kind == 0) {
        CHECK_MESSAGE(!z.err, z.what);
        CHECK(z.recs == split_lines(text));
      }
    }
    // Which library inflated it, read straight from the byte stream.
    ferry::detail::byte_stream bs;
    bs.set_pool(std::make_shared<ferry::detail::chunk_pool>(4096));
    bs.set_inflater(ferry::inflate_engine::isal);
    bs.open(path, ferry::compression::gzip);
    std::string out;
    bool failed = false;
    try {
      while (const std::size_t n = bs.ensure(1000)) {
        out.append(reinterpret_cast<const char*>(bs.data()), n);
        bs.consume(n);
      }
    } catch (const ferry::format_error&) {
      failed = true;
    }
    if (!failed) {
      CHECK(bs.inflating_with_isal() == !zlib_member);  // read to its end by ISA-L, unless zlib-wrapped
      ++whole;
    } else {
      CHECK(!bs.inflating_with_isal());  // handed to zlib, which threw
      ++damaged;
    }
    if (kind == 0) CHECK(out == text);
  }
  CHECK(whole >= 48);  // every whole file, and any damage that changed nothing
  CHECK(damaged >= 100);
  MESSAGE(extra << " records past the damage, over the files changed inside read in 64-byte chunks");
}

// RFC 1952: a reserved FLG bit set is an error; zlib says so, ISA-L read the member.
TEST_CASE("gzip: a member header with a reserved FLG bit is refused by both libraries, first member or later") {
  temp_dir t;
  write_gzip(t / "one.txt.gz", "alpha\nbeta\n");
  const std::string z = read_file(t / "one.txt.gz");
  for (const std::uint8_t bit : {0x20, 0x40, 0x80})
    for (const bool second : {false, true}) {
      CAPTURE(int(bit));
      CAPTURE(second);
      std::string bad = z;
      bad[3] = static_cast<char>(bad[3] | bit);
      write_file(t / "x.txt.gz", second ? z + bad : bad);
      for (const auto e : {ferry::inflate_engine::zlib, ferry::inflate_engine::isal}) {
        CAPTURE(int(e));
        auto src = ferry::from_files({t / "x.txt.gz"}, ferry::text_lines{}, {.inflater = e});
        if (second) {  // the first member's lines, then the error
          REQUIRE(src.next());
          REQUIRE(src.next());
        }
        CHECK_THROWS_WITH_AS(src.next(), doctest::Contains("unknown header flags set"), ferry::format_error);
      }
    }
}

TEST_CASE("gzip: FERRY_INFLATE picks the library; another value is a config_error") {
  temp_dir t;
  write_gzip(t / "a.txt.gz", "x\ny\n");
  const char* old = std::getenv("FERRY_INFLATE");
  const std::string keep = old ? old : "";
  ::setenv("FERRY_INFLATE", "zlib", 1);
  CHECK(read_all({t / "a.txt.gz"}, ferry::text_lines{}) == std::vector<std::string>{"x", "y"});
  ::setenv("FERRY_INFLATE", "igzip", 1);
  CHECK_THROWS_WITH_AS(ferry::from_files({t / "a.txt.gz"}, ferry::text_lines{}),
                       doctest::Contains("FERRY_INFLATE must be zlib or isal, not 'igzip'"), ferry::config_error);
  if (old) ::setenv("FERRY_INFLATE", keep.c_str(), 1);
  else ::unsetenv("FERRY_INFLATE");
  ferry::detail::byte_stream bs;
  bs.set_inflater(ferry::inflate_engine::zlib);
  bs.set_pool(std::make_shared<ferry::detail::chunk_pool>(4096));
  bs.open(t / "a.txt.gz", ferry::compression::automatic);
  CHECK(bs.ensure(4) == 4);
  CHECK(!bs.inflating_with_isal());
}

TEST_CASE("gzip: truncated and corrupt streams of text lines, fixed-length records and npy rows") {
  temp_dir t;
  std::mt19937_64 g(23);
  // Three files of 20 records each, the uncompressed offset where each record starts
  // (`at`), and the header bytes before the first.
  struct format_case {
    std::string name;
    ferry::file_format fmt;
    std::string bytes;
    std::vector<std::string> recs;
    std::vector<std::uint64_t> at;
    std::uint64_t header = 0;
    std::size_t need_after = 0;  // bytes a record needs after it before it is handed out
  };
  std::vector<format_case> cases;
  {
    format_case c{"lines", ferry::text_lines{}, "", {}, {}, 0, 0};
    for (int i = 0; i < 20; ++i) {
      c.at.push_back(c.bytes.size());
      c.recs.push_back(std::string(g() % 12, static_cast<char>('a' + i % 26)));
      c.bytes += c.recs.back() + "\n";
    }
    cases.push_back(c);
  }
  {
    format_case c{"fixed", ferry::fixed_length{.record_bytes = 7, .header_bytes = 3, .footer_bytes = 2}, "HHH", {}, {},
                  3, 2};
    for (int i = 0; i < 20; ++i) {
      c.at.push_back(c.bytes.size());
      c.bytes += c.recs.emplace_back(random_bytes(g, 7));
    }
    c.bytes += "FF";
    cases.push_back(c);
  }
  {
    format_case c{"npy", ferry::npy{}, "", {}, {}, 128, 0};
    std::string data;
    for (int i = 0; i < 20; ++i) data += c.recs.emplace_back(random_bytes(g, 6));
    c.bytes = npy_of("<i2", "(20, 3)", data);
    REQUIRE(c.bytes.size() == 128 + 120);
    for (int i = 0; i < 20; ++i) c.at.push_back(128 + 6 * static_cast<std::uint64_t>(i));
    cases.push_back(c);
  }
  for (const format_case& c : cases) {
    INFO(c.name);
    const std::string z = gzip_bytes(c.bytes);
    const std::string path = t / (c.name + ".gz");
    // Cut at every byte: the records zlib can complete from what is left arrive, then a
    // "truncated gzip stream" error at the first one it cannot (the header: offset 0).
    for (std::size_t cut = 0; cut < z.size(); ++cut) {
      INFO("cut at " << cut << " of " << z.size());
      write_file(path, z.substr(0, cut));
      const std::size_t have = inflatable(z.substr(0, cut));
      std::size_t whole = 0;  // records the reader can hand out from `have` bytes
      if (have >= c.header)
        while (whole < c.recs.size() && c.at[whole] + c.recs[whole].size() + (c.name == "lines") + c.need_after <= have)
          ++whole;
      const std::uint64_t want_at =
          have < c.header ? 0 : whole < c.at.size() ? c.at[whole] : c.bytes.size() - c.need_after;
      for (std::size_t chunk : {64, 1 << 20}) {
        const read_result r = read_until_error({path}, c.fmt, {.chunk_bytes = chunk});
        CHECK(r.recs == std::vector<std::string>(c.recs.begin(), c.recs.begin() + static_cast<long>(whole)));
        REQUIRE(r.err);
        CHECK(r.err->path == path);
        CHECK(r.err->offset == want_at);
        CHECK_MESSAGE(r.what.find("truncated gzip stream") != std::string::npos, r.what);
      }
    }
    // Damage zlib detects before any output (a bad magic, a block of the reserved type),
    // and in the trailer (every record first).
    struct damage {
      std::size_t at;
      unsigned char flip, set;  // bits to flip, bits to set
      bool all_records;
      const char* what;
    };
    for (const damage& dm : {damage{0, 0x67, 0, false, "incorrect header check"},  // 1f -> 78: neither gzip nor zlib
                             damage{10, 0, 0x06, false, "invalid block type"},     // BTYPE 11 in the first block
                             damage{z.size() - 8, 0x01, 0, true, "incorrect data check"},
                             damage{z.size() - 4, 0x01, 0, true, "incorrect length check"}}) {
      INFO("damage at " << dm.at);
      std::string bad = z;
      bad[dm.at] = static_cast<char>((static_cast<unsigned char>(bad[dm.at]) ^ dm.flip) | dm.set);
      write_file(path, bad);
      const read_result r = read_until_error({path}, c.fmt);
      CHECK(r.recs == (dm.all_records ? c.recs : std::vector<std::string>{}));
      REQUIRE(r.err);
      CHECK(r.err->path == path);
      CHECK(r.err->offset == (dm.all_records ? c.bytes.size() - c.need_after : 0));
      CHECK_MESSAGE(r.what.find(std::string("corrupt gzip stream (") + dm.what) != std::string::npos, r.what);
    }
  }
}

TEST_CASE("on_error = skip: exact count, every good record arrives, reading goes on") {
  temp_dir t;
  std::vector<std::string> files, want;
  std::uint64_t want_skipped = 0;
  std::mt19937_64 g(3);
  for (int f = 0; f < 6; ++f) {
    std::string tf;
    for (int i = 0; i < 20; ++i) {
      std::string rec = "f";  // appended piece by piece: "f" + std::string trips GCC 12's false -Wrestrict
      rec += std::to_string(f);
      rec += 'r';
      rec += std::to_string(i);
      rec += random_bytes(g, g() % 50);
      std::string enc = tfrecord_of(rec);
      if (f == 1 && i % 5 == 0) {  // data CRC mismatch: that record only
        enc[enc.size() - 5] ^= 0x20;
        ++want_skipped;
      } else if (f == 3 && i == 12) {  // corrupt length: the rest of the file, counted once
        enc[9] ^= 1;
        tf += enc;
        ++want_skipped;
        break;
      } else {
        want.push_back(rec);
      }
      tf += enc;
    }
    files.push_back(t / ("s" + std::to_string(f) + ".tfrecord"));
    write_file(files.back(), tf);
  }
  files.insert(files.begin() + 2, t / "missing.tfrecord");
  ++want_skipped;
  std::vector<ferry::skipped_record> log;
  ferry::from_files_options o{.on_error = ferry::error_policy::skip,
                              .on_skip = [&](const ferry::skipped_record& s) { log.push_back(s); }};
  auto src = ferry::from_files(files, ferry::tfrecord{}, o);
  CHECK(read_all(src) == want);
  CHECK(src.skipped() == want_skipped);
  REQUIRE(log.size() == want_skipped);
  CHECK(log[4].path == t / "missing.tfrecord");
  CHECK(log.back().path == files[4]);
  CHECK(log.back().reason.find("length CRC") != std::string::npos);
  // raise: throws at the bad record, then reading can go on past it.
  auto strict = ferry::from_files(files, ferry::tfrecord{});
  std::size_t got = 0, errors = 0;
  for (;;) {
    try {
      auto r = strict.next();
      if (!r) break;
      ++got;
    } catch (const ferry::error&) {
      ++errors;
    }
  }
  CHECK(got == want.size());
  CHECK(errors == want_skipped);
  CHECK(!strict.next());
}

TEST_CASE("shard_files: disjoint shards whose union is the dataset; bad arguments") {
  temp_dir t;
  std::vector<std::string> files;
  std::vector<std::string> all;
  for (int f = 0; f < 7; ++f) {
    std::string s;
    for (int i = 0; i < f + 1; ++i) s += std::to_string(f) + ":" + std::to_string(i) + "\n";
    files.push_back(t / ("l" + std::to_string(f) + ".txt"));
    write_file(files.back(), s);
  }
  for (auto& r : read_all(files, ferry::text_lines{})) all.push_back(r);
  for (std::size_t n = 1; n <= 7; ++n) {
    std::vector<std::string> u;
    for (std::size_t i = 0; i < n; ++i) {
      auto s = ferry::from_files(files, ferry::text_lines{}).shard_files(n, i);
      for (std::size_t j = 0; j < s.files().size(); ++j) CHECK(s.files()[j] == files[i + j * n]);
      for (auto& r : read_all(s)) u.push_back(r);
    }
    std::sort(u.begin(), u.end());
    auto a = all;
    std::sort(a.begin(), a.end());
    CHECK(u == a);  // each record in exactly one shard
  }
  CHECK_THROWS_AS(ferry::from_files(files, ferry::text_lines{}).shard_files(8, 0), ferry::config_error);
  CHECK_THROWS_AS(ferry::from_files(files, ferry::text_lines{}).shard_files(2, 2), ferry::config_error);
  CHECK_THROWS_AS(ferry::from_files(files, ferry::text_lines{}).shard_files(0, 0), ferry::config_error);
}

TEST_CASE("save/restore at every position, rewind, end stays ended" * doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));  // read-ahead threads: never hang
  temp_dir t;
  std::mt19937_64 g(11);
  for (bool gz : {false, true}) {
    std::vector<std::string> files;
    for (int f = 0; f < 3; ++f) {
      std::string s;
      for (int i = 0; i < 9; ++i) s += tfrecord_of(random_bytes(g, g() % 300));
      files.push_back(t / ("r" + std::to_string(f) + (gz ? ".tfrecord.gz" : ".tfrecord")));
      gz ? write_gzip(files.back(), s) : write_file(files.back(), s);
    }
    ferry::from_files_options o{.chunk_bytes = 512};
    const auto all = read_all(files, ferry::tfrecord{}, o);
    REQUIRE(all.size() == 27);
    for (std::size_t k = 0; k <= all.size(); ++k) {
      auto a = ferry::from_files(files, ferry::tfrecord{}, o);
      for (std::size_t i = 0; i < k; ++i) a.next();
      const ferry::pipeline_state st = ferry::save_state(a);
      auto b = ferry::from_files(files, ferry::tfrecord{}, o);
      ferry::restore_state(b, ferry::pipeline_state::from_bytes(st.to_bytes()));
      const auto rest = read_all(b);
      CHECK(rest == std::vector<std::string>(all.begin() + static_cast<long>(k), all.end()));
    }
    auto c = ferry::from_files(files, ferry::tfrecord{}, o);
    CHECK(read_all(c) == all);
    CHECK(!c.next());
    CHECK(!c.next());
    c.rewind();
    CHECK(read_all(c) == all);
    auto other = ferry::from_files({files[0]}, ferry::tfrecord{}, o);
    CHECK_THROWS_WITH_AS(ferry::restore_state(other, ferry::save_state(c)),
                         doctest::Contains("from_files: the state was saved with another file list"),
                         ferry::config_error);
    // The same files read as another format (or with other record sizes, or another order
    // of files) would seek to the saved offset inside some other record: refused, named.
    auto mid = ferry::from_files(files, ferry::tfrecord{}, o);
    for (int i = 0; i < 4; ++i) REQUIRE(mid.next());
    const auto ms = ferry::save_state(mid);
    if (!gz) {
      // The open file cut below the saved position since the checkpoint: an error naming it,
      // not an end of that file (its other records skipped unseen).
      const std::string keep = read_file(files[0]);
      write_file(files[0], keep.substr(0, 100));
      auto shrunk = ferry::from_files(files, ferry::tfrecord{}, o);
      ferry::restore_state(shrunk, ms);
      try {
        shrunk.next();
        FAIL("a restore past the end of a file that shrank read on");
      } catch (const ferry::format_error& e) {
        CHECK(e.path() == files[0]);
        CHECK(std::string(e.what()).find("cannot resume: the file has 100 bytes") != std::string::npos);
      }
      write_file(files[0], keep);
    }
    auto fixed = ferry::from_files(files, ferry::fixed_length{.record_bytes = 16}, o);
    CHECK_THROWS_WITH_AS(ferry::restore_state(fixed, ms), doctest::Contains("from_files: the state was saved with another format"),
                         ferry::config_error);
    auto lines = ferry::from_files(files, ferry::text_lines{}, o);
    CHECK_THROWS_WITH_AS(ferry::restore_state(lines, ms), doctest::Contains("another format"), ferry::config_error);
    auto shuffled = ferry::from_files(files, ferry::tfrecord{}, {.chunk_bytes = 512, .shuffle_files = true});
    CHECK_THROWS_WITH_AS(ferry::restore_state(shuffled, ms), doctest::Contains("shuffle_files = 0"), ferry::config_error);
    {
      auto f16 = ferry::from_files(files, ferry::fixed_length{.record_bytes = 16}, o);
      REQUIRE(f16.next());
      auto f8 = ferry::from_files(files, ferry::fixed_length{.record_bytes = 8}, o);
      CHECK_THROWS_WITH_AS(ferry::restore_state(f8, ferry::save_state(f16)), doctest::Contains("another format"),
                           ferry::config_error);
    }
    {
      // A compress option that reads the files otherwise than their names say (offsets in
      // the inflated stream against offsets in the bytes): refused as another format. One
      // that agrees with the names restores, both ways.
      ferry::from_files_options agree = o, against = o;
      agree.compress = gz ? ferry::compression::gzip : ferry::compression::none;
      against.compress = gz ? ferry::compression::none : ferry::compression::gzip;
      auto bad = ferry::from_files(files, ferry::tfrecord{}, against);
      CHECK_THROWS_WITH_AS(ferry::restore_state(bad, ms), doctest::Contains("another format"), ferry::config_error);
      auto good = ferry::from_files(files, ferry::tfrecord{}, agree);
      ferry::restore_state(good, ms);
      CHECK(good.next()->str() == all[4]);
      CHECK(good.next()->str() == all[5]);
      auto back = ferry::from_files(files, ferry::tfrecord{}, o);
      ferry::restore_state(back, ferry::save_state(good));
      CHECK(read_all(back) == std::vector<std::string>(all.begin() + 6, all.end()));
    }
  }
  // npy rows resume too, plain and compressed: after k rows, exactly rows k.. of a straight read.
  write_gzip(t / "u1.npy.gz", read_file(data_dir() + "/u1_4x2x3.npy"));
  for (const std::string& f : {data_dir() + "/u1_4x2x3.npy", t / "u1.npy.gz"}) {
    const auto rows = read_all({f}, ferry::npy{});
    REQUIRE(rows.size() == 4);
    for (std::size_t k = 0; k <= rows.size(); ++k) {
      INFO(f << " after " << k << " rows");
      auto n = ferry::from_files({f}, ferry::npy{}, {.chunk_bytes = 64});
      for (std::size_t i = 0; i < k; ++i) REQUIRE(n.next());
      const auto st = ferry::save_state(n);
      auto m = ferry::from_files({f}, ferry::npy{}, {.chunk_bytes = 64});
      ferry::restore_state(m, st);
      CHECK(read_all(m) == std::vector<std::string>(rows.begin() + static_cast<long>(k), rows.end()));
    }
  }
}

TEST_CASE("npy/idx: a restored reader checks every file against the first file's layout, as a straight read does") {
  const std::string d = data_dir();
  // f4 (2,3) twice, then u1 (4,2,3) twice: a straight read refuses both u1 files, each at
  // its turn (the reader goes on after each error). A reader restored after the first
  // refusal opens the second u1 file first: it must still refuse it.
  const std::vector<std::string> files{d + "/f4_2x3.npy", d + "/f4_2x3.npy", d + "/u1_4x2x3.npy",
                                       d + "/u1_4x2x3.npy"};
  auto a = ferry::from_files(files, ferry::npy{});
  for (int i = 0; i < 4; ++i) REQUIRE(a.next());
  expect_error([&] { a.next(); }, files[2], 0, "differ from the first file's");
  const ferry::pipeline_state st = ferry::save_state(a);
  expect_error([&] { a.next(); }, files[3], 0, "differ from the first file's");
  CHECK(!a.next());

  auto b = ferry::from_files(files, ferry::npy{});
  ferry::restore_state(b, st);
  CHECK(b.meta()->dtype == "<f4");  // the list's first layout, not that of the file it opens next
  expect_error([&] { b.next(); }, files[3], 0, "differ from the first file's");
  CHECK(!b.next());
}

TEST_CASE("npy with shuffle_files: the reference layout is the list's first file's in every epoch and after a resume") {
  const std::string d = data_dir();
  // Two f4 (2,3) files listed first, then two u1 (4,2,3): whatever an epoch's order, the
  // two u1 files are the ones refused (as in the order given), never the f4 ones, and a
  // resumed reader refuses the same.
  const std::vector<std::string> files{d + "/f4_2x3.npy", d + "/f4_2x3.npy", d + "/u1_4x2x3.npy",
                                       d + "/u1_4x2x3.npy"};
  const ferry::from_files_options o{.shuffle_files = true, .shuffle_seed = 3};
  auto read_epoch = [&](auto& src, std::size_t& rows, std::vector<std::string>& refused) {
    for (int guard = 0; guard < 100; ++guard) {
      try {
        if (!src.next()) return;
        ++rows;
      } catch (const ferry::format_error& e) {
        refused.push_back(e.path());
        CHECK(std::string(e.what()).find("differ from the first file's") != std::string::npos);
      }
    }
    FAIL("no end");
  };
  auto a = ferry::from_files(files, ferry::npy{}, o);
  bool u1_first = false;  // some epoch must open a u1 file first, or the test shows nothing
  for (int e = 0; e < 12; ++e, a.rewind()) {
    CAPTURE(e);
    u1_first = u1_first || a.files()[0] == files[2];
    CHECK(a.meta()->dtype == "<f4");
    std::size_t rows = 0;
    std::vector<std::string> refused;
    read_epoch(a, rows, refused);
    CHECK(rows == 4);  // the two f4 files' rows
    CHECK(refused == std::vector<std::string>{files[2], files[2]});
  }
  CHECK(u1_first);
  // Resumed at the start of an epoch whose first file is a u1 one: that file is refused.
  auto b = ferry::from_files(files, ferry::npy{}, o);
  int e = 0;
  while (b.files()[0] != files[2]) b.rewind(), ++e;
  auto c = ferry::from_files(files, ferry::npy{}, o);
  ferry::restore_state(c, ferry::save_state(b));
  CHECK(c.epoch() == std::uint64_t(e));
  std::size_t rows = 0;
  std::vector<std::string> refused;
  read_epoch(c, rows, refused);
  CHECK(rows == 4);
  CHECK(refused.size() == 2);
}

TEST_CASE("records outlive the reader's chunk; batch collates them as a ragged field" * doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));  // read-ahead threads: never hang
  temp_dir t;
  std::string s;
  std::vector<std::string> want;
  for (int i = 0; i < 500; ++i) {
    want.push_back(std::string(static_cast<std::size_t>(i % 97), static_cast<char>('a' + i % 26)));
    s += want.back() + "\n";
  }
  write_file(t / "x.txt", s);
  auto src = ferry::from_files({t / "x.txt"}, ferry::text_lines{}, {.chunk_bytes = 256});
  std::vector<ferry::record> kept;  // held across many chunk refills
  while (auto r = src.next()) kept.push_back(*r);
  REQUIRE(kept.size() == 500);
  for (std::size_t i = 0; i < 500; ++i) CHECK(kept[i].str() == want[i]);
  auto b = ferry::from_files({t / "x.txt"}, ferry::text_lines{}, {.chunk_bytes = 256}) | ferry::batch(64);
  std::size_t i = 0;
  while (auto batch = b.next()) {
    auto f = batch->field<0>();
    for (std::size_t k = 0; k < batch->size(); ++k, ++i)
      CHECK(std::string(reinterpret_cast<const char*>(f[k].data()), f[k].size()) == want[i]);
  }
  CHECK(i == 500);
}

namespace {
// Hides next_borrowed, so batch takes its records one by one, as ferry::record values.
template <class S>
struct records_one_by_one {
  using value_type = ferry::record;
  S s;
  std::optional<ferry::record> next() { return s.next(); }
};
static_assert(ferry::borrowing_source<decltype(ferry::from_files("x", ferry::tfrecord{}))>);
static_assert(!ferry::borrowing_source<records_one_by_one<decltype(ferry::from_files("x", ferry::tfrecord{}))>>);

// What a batch stage yields, batch by batch: the records' bytes, or nullopt for an error
// (whose text goes to `errors`).
using outcome = std::vector<std::optional<std::vector<std::string>>>;
outcome batches_of(auto&& p, std::vector<std::string>& errors) {
  outcome out;
  for (int guard = 0; guard < 100000; ++guard) {
    try {
      auto b = p.next();
      if (!b) break;
      auto f = b->template field<0>();
      REQUIRE(f.size() == b->size());
      REQUIRE(f.values.size() == b->field_bytes(0).size());
      std::vector<std::string> v;
      for (std::size_t k = 0; k < b->size(); ++k)
        v.emplace_back(reinterpret_cast<const char*>(f[k].data()), f[k].size());
      out.emplace_back(std::move(v));
    } catch (const ferry::error& e) {
      out.emplace_back(std::nullopt);
      errors.emplace_back(e.what());
    }
  }
  return out;
}
}  // namespace

TEST_CASE("batch of records borrows them: the same batches as record by record, errors included" *
          doctest::timeout(120)) {
  ferry_test::watchdog wd(std::chrono::seconds(120));
  temp_dir t;
  std::mt19937_64 g(11);
  for (int trial = 0; trial < 16; ++trial) {
    // Files of random records, a few with a bad data CRC (that record is lost) or a bad
    // length (the rest of the file is), one missing; the oracle cuts the record stream
    // into batches, dropping the partial batch an error interrupts.
    std::vector<std::string> files;
    std::vector<std::optional<std::string>> stream;  // records in order; nullopt: an error
    const int nfiles = 1 + static_cast<int>(g() % 4);
    for (int f = 0; f < nfiles; ++f) {
      const std::string path = t / ("b" + std::to_string(trial) + "_" + std::to_string(f) + ".tfrecord");
      if (g() % 8 == 0) {
        files.push_back(path);  // never written: missing
        stream.push_back(std::nullopt);
        continue;
      }
      std::string tf;
      const int n = static_cast<int>(g() % 300);
      for (int i = 0; i < n; ++i) {
        const std::string rec = random_bytes(g, g() % 16 == 0 ? 3000 + g() % 5000 : g() % 200);
        std::string enc = tfrecord_of(rec);
        const auto fault = g() % 64;
        if (fault == 0) {
          enc[enc.size() - 1] ^= 0x10;  // data CRC: this record only
          stream.push_back(std::nullopt);
        } else if (fault == 1) {
          enc[3] ^= 0x01;  // length CRC: the rest of the file
          tf += enc;
          stream.push_back(std::nullopt);
          break;
        } else {
          stream.push_back(rec);
        }
        tf += enc;
      }
      write_file(path, tf);
      files.push_back(path);
    }
    const std::size_t n = std::vector<std::size_t>{1, 7, 64, 1000}[g() % 4];
    const bool drop = g() % 2;
    const std::size_t chunk = std::vector<std::size_t>{64, 4096, 1 << 20}[g() % 3];
    const std::size_t ahead = g() % 4, threads = 1 + g() % 2;
    INFO("trial " << trial << ": batch " << n << std::string(drop ? " drop" : "") << ", chunk " << chunk << ", read_ahead "
                  << ahead << " x" << threads);
    outcome want;
    std::vector<std::string> cur;
    for (const auto& r : stream) {
      if (!r) {
        cur.clear();
        want.emplace_back(std::nullopt);
        continue;
      }
      cur.push_back(*r);
      if (cur.size() == n) want.emplace_back(std::exchange(cur, {}));
    }
    if (!cur.empty() && !drop) want.emplace_back(cur);

    const ferry::from_files_options o{.chunk_bytes = chunk, .read_ahead = ahead, .read_threads = threads};
    const ferry::batch_options bo{.drop_remainder = drop};
    std::vector<std::string> errors_borrowed, errors_one_by_one;
    const outcome borrowed =
        batches_of(ferry::from_files(files, ferry::tfrecord{}, o) | ferry::batch(n, bo), errors_borrowed);
    const outcome one_by_one = batches_of(
        ferry::batch(records_one_by_one<decltype(ferry::from_files(files, ferry::tfrecord{}))>{
                         ferry::from_files(files, ferry::tfrecord{}, o)},
                     n, bo),
        errors_one_by_one);
    CHECK(borrowed == want);
    CHECK(one_by_one == want);
    CHECK(errors_borrowed == errors_one_by_one);  // the same files and offsets

    // With stats on, from_files counts the lent records and their bytes.
    ferry::from_files_options skip = o;
    skip.on_error = ferry::error_policy::skip;
    skip.on_skip = [](const ferry::skipped_record&) {};
    ferry::enable_stats(true);
    auto p = ferry::from_files(files, ferry::tfrecord{}, skip) | ferry::batch(n, bo);
    std::uint64_t rows = 0, bytes = 0;
    while (auto b = p.next()) {
      rows += b->size();
      bytes += b->field_bytes(0).size();
    }
    const ferry::pipeline_report r = ferry::report(p);
    ferry::enable_stats(false);
    std::uint64_t good = 0, good_bytes = 0;
    for (const auto& rec : stream)
      if (rec) ++good, good_bytes += rec->size();
    REQUIRE(r.stages.size() == 2);
    CHECK(r.stages[0].elements == good);
    CHECK(r.stages[0].bytes == good_bytes);
    if (!drop) CHECK(rows == good);
    if (!drop) CHECK(bytes == good_bytes);
  }
}

namespace {
long status_kib(const char* key) {  // a "Vm...:" line of /proc/self/status, in KiB
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string k = key;
  while (std::getline(f, line))
    if (line.rfind(k, 0) == 0) return std::stol(line.substr(k.size()));
  return -1;
}
long vm_hwm_kib() { return status_kib("VmHWM:"); }
}  // namespace

TEST_CASE("memory: peak RSS stays flat reading far more than the read buffers" * doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));
  temp_dir t;
  const std::size_t rec = 1024, per_file = 32 * 1024;  // 2 files x 32 MiB
  std::string block(rec * 1024, '\0');
  for (std::size_t i = 0; i < block.size(); ++i) block[i] = static_cast<char>(i * 131);
  std::vector<std::string> files;
  for (int f = 0; f < 2; ++f) {
    files.push_back(t / ("m" + std::to_string(f) + ".bin"));
    std::ofstream o(files.back(), std::ios::binary);
    for (std::size_t k = 0; k < per_file / 1024; ++k) o.write(block.data(), static_cast<std::streamsize>(block.size()));
  }
  block = std::string();
  // Raise the high-water mark 32 MiB above what stays resident, so a reset that did not
  // happen shows: the write to clear_refs can fail (or be ignored) in containers and
  // under some kernels.
  constexpr std::size_t balloon = 32u << 20;
  void* b = ::mmap(nullptr, balloon, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(b != MAP_FAILED);
  std::memset(b, 1, balloon);
  ::munmap(b, balloon);
  // Reset the high-water mark to the resident size ("5": the kernel's reset of VmHWM).
  const int fd = ::open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
  const bool wrote = fd >= 0 && ::write(fd, "5", 1) == 1;
  if (fd >= 0) ::close(fd);
  const long before = vm_hwm_kib(), rss = status_kib("VmRSS:");
  if (!wrote || before < 0 || rss < 0 || before - rss > 8 * 1024) {
    MESSAGE("SKIPPED: the peak-RSS check needs /proc/self/clear_refs to reset VmHWM (write "
            << std::string(wrote ? "ok" : "failed") << "; after it VmHWM " << before << " KiB, VmRSS " << rss << " KiB)");
    return;
  }
  auto src = ferry::from_files(files, ferry::fixed_length{.record_bytes = rec}) | ferry::batch(256);
  std::uint64_t n = 0;
  while (auto b = src.next()) n += b->size();
  CHECK(n == 2 * per_file);
  const long grew = vm_hwm_kib() - before;
  MESSAGE("read 64 MiB; peak RSS grew by " << grew << " KiB");
#if defined(__SANITIZE_THREAD__)
  const long shadow = 5;  // TSan keeps about 4 bytes of shadow per byte touched
#else
  const long shadow = 1;
#endif
  // A few 1 MiB chunks (read ahead included) and batch buffers, never the files.
  CHECK(grew < shadow * 16 * 1024);
}

TEST_CASE("memory: a line without end, plain or compressed, buffers max_record_bytes at most" * doctest::timeout(120)) {
  ferry_test::watchdog wd(std::chrono::seconds(120));
  temp_dir t;
  // 96 MiB of zeros and no newline: once the whole file (or 1 GiB of a gzip of zeros) was
  // buffered looking for the line's end.
  {
    std::ofstream o(t / "z.txt", std::ios::binary);
    const std::string mib(1 << 20, 'z');
    for (int i = 0; i < 96; ++i) o.write(mib.data(), static_cast<std::streamsize>(mib.size()));
  }
  {
    gzFile g = gzopen((t / "z.txt.gz").c_str(), "wb1");
    const std::string mib(1 << 20, '\0');
    for (int i = 0; i < 96; ++i) gzwrite(g, mib.data(), static_cast<unsigned>(mib.size()));
    gzclose(g);
  }
  const int fd = ::open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
  const bool can_reset = fd >= 0 && ::write(fd, "5", 1) == 1;
  if (fd >= 0) ::close(fd);
  for (const std::string& f : {t / "z.txt", t / "z.txt.gz"}) {
    CAPTURE(f);
    const int r = ::open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
    if (r >= 0) {
      (void)!::write(r, "5", 1);
      ::close(r);
    }
    const long before = vm_hwm_kib();
    auto src = ferry::from_files({f}, ferry::text_lines{}, {.max_record_bytes = 8 << 20});
    expect_error<ferry::format_error>([&] { src.next(); }, f, 0, "a line longer than max_record_bytes (8388608)");
    const long grew = vm_hwm_kib() - before;
    MESSAGE(f << ": peak RSS grew by " << grew << " KiB");
#if defined(__SANITIZE_THREAD__)
    const long shadow = 5;
#else
    const long shadow = 1;
#endif
    // The line's buffer (at most 8 MiB + 2, copied once while it grows) and read chunks.
    if (can_reset) CHECK(grew < shadow * 40 * 1024);
  }
}

TEST_CASE("npy: headers as NumPy writes them (any key order, padding, version) against the rows" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));  // read-ahead threads: never hang
  temp_dir t;
  std::mt19937_64 g(77);
  const std::vector<std::pair<std::string, std::size_t>> dtypes = {
      {"<f4", 4}, {"|u1", 1}, {">i2", 2}, {"<f8", 8}, {"|b1", 1}, {"<c16", 16},
      {"|S3", 3}, {"<U2", 8}, {"<M8[ns]", 8}, {"|?", 1}, {"=i4", 4}, {"|V5", 5}};
  for (int trial = 0; trial < 200; ++trial) {
    const auto& [descr, item] = dtypes[g() % dtypes.size()];
    const std::size_t ndim = g() % 4;
    std::vector<std::uint64_t> shape;
    for (std::size_t k = 0; k < ndim; ++k) shape.push_back(g() % (k == 0 ? 6 : 5));
    std::string sh = "(";
    for (std::size_t k = 0; k < ndim; ++k)
      sh += (k ? "," + std::string(g() % 2, ' ') : "") + std::to_string(shape[k]) + (g() % 8 == 0 ? "L" : "");
    sh += ndim == 1 ? ",)" : ")";
    std::vector<std::string> keys = {"'descr': '" + descr + "'", "'shape': " + sh,
                                     std::string("'fortran_order': ") + (ndim <= 1 && g() % 2 ? "True" : "False")};
    std::shuffle(keys.begin(), keys.end(), g);
    std::string dict = "{";
    for (std::size_t k = 0; k < 3; ++k) dict += (k ? ", " : "") + keys[k];
    dict += g() % 2 ? ", }" : "}";
    const std::uint64_t rows = ndim == 0 ? 1 : shape[0];
    std::uint64_t row_bytes = item;
    for (std::size_t k = 1; k < ndim; ++k) row_bytes *= shape[k];
    std::vector<std::string> want;
    std::string data;
    for (std::uint64_t r = 0; r < rows; ++r) data += want.emplace_back(random_bytes(g, row_bytes));
    const int major = 1 + static_cast<int>(g() % 3);
    const bool gz = g() % 4 == 0;
    const std::string path = t / ("r" + std::to_string(trial) + (gz ? ".npy.gz" : ".npy"));
    const std::string bytes = npy_with_dict(dict, data, major, g() % 3 == 0 ? g() % 300 : 0);
    gz ? write_gzip(path, bytes) : write_file(path, bytes);
    INFO(dict << " v" << major << (gz ? " gzip" : ""));
    for (std::size_t chunk : {64, 1 << 20}) {
      auto src = ferry::from_files({path}, ferry::npy{}, {.chunk_bytes = chunk});
      const auto m = src.meta();
      REQUIRE(m);
      CHECK(m->dtype == descr);
      CHECK(m->shape == shape);
      CHECK(m->row_bytes == row_bytes);
      CHECK(read_all(src) == want);
    }
  }
}

TEST_CASE("resume: a compressed file now shorter than the saved position is an error naming it; reading goes on") {
  temp_dir t;
  std::string a;
  for (int i = 0; i < 6; ++i) a += tfrecord_of("a" + std::to_string(i));
  const std::string shorter = a.substr(0, 2 * 18);  // records of 18 bytes
  const std::vector<std::string> files = {t / "a.tfrecord.gz", t / "b.tfrecord.gz"};
  write_gzip(files[0], a);
  write_gzip(files[1], tfrecord_of("b0") + tfrecord_of("b1"));
  auto src = ferry::from_files(files, ferry::tfrecord{});
  for (int i = 0; i < 4; ++i) REQUIRE(src.next());
  const ferry::pipeline_state st = ferry::save_state(src);  // in a.tfrecord.gz at offset 72
  write_gzip(files[0], shorter);                            // which then loses records
  for (auto policy : {ferry::error_policy::raise, ferry::error_policy::skip}) {
    std::vector<ferry::skipped_record> log;
    auto r = ferry::from_files(files, ferry::tfrecord{},
                               {.on_error = policy, .on_skip = [&](const ferry::skipped_record& s) { log.push_back(s); }});
    ferry::restore_state(r, st);
    const std::string why = "cannot resume: the compressed stream ends before the saved position";
    if (policy == ferry::error_policy::raise) {
      expect_error<ferry::format_error>([&] { r.next(); }, files[0], shorter.size(), why);
    }
    // Then the next file, from its start (the short file is not read on from where it ended).
    CHECK(read_all(r) == std::vector<std::string>{"b0", "b1"});
    if (policy == ferry::error_policy::skip) {
      REQUIRE(log.size() == 1);
      CHECK(log[0].path == files[0]);
      CHECK(log[0].offset == shorter.size());
      CHECK(log[0].reason == why);
      CHECK(r.skipped() == 1);
    }
  }
}

namespace {
// Six TFRecord files; file j holds records "f<j>:0" .. "f<j>:<j+1>".
struct six_files {
  temp_dir t;
  std::vector<std::string> files;
  six_files() {
    for (int j = 0; j < 6; ++j) {
      std::string s;
      for (int i = 0; i <= j + 1; ++i) s += tfrecord_of("f" + std::to_string(j) + ":" + std::to_string(i));
      files.push_back(t / ("s" + std::to_string(j) + ".tfrecord"));
      write_file(files.back(), s);
    }
  }
  // The order of files an epoch's records show, checking that each file came whole, in
  // its own order, once.
  static std::vector<int> order_of(const std::vector<std::string>& recs) {
    std::vector<int> order;
    std::size_t k = 0;
    while (k < recs.size()) {
      const int j = recs[k][1] - '0';
      for (int i = 0; i <= j + 1; ++i, ++k) {
        REQUIRE(k < recs.size());
        REQUIRE(recs[k] == "f" + std::to_string(j) + ":" + std::to_string(i));
      }
      order.push_back(j);
    }
    return order;
  }
};
}  // namespace

TEST_CASE("shuffle_files: every epoch reads each file once, whole and in order, in a new seeded order") {
  six_files d;
  const ferry::from_files_options o{.shuffle_files = true, .shuffle_seed = 42};
  auto a = ferry::from_files(d.files, ferry::tfrecord{}, o);
  auto b = ferry::from_files(d.files, ferry::tfrecord{}, o);
  auto c = ferry::from_files(d.files, ferry::tfrecord{}, {.shuffle_files = true, .shuffle_seed = 43});
  constexpr int epochs = 300;
  int count[6][6] = {};  // file, position
  std::vector<std::vector<int>> orders;
  bool c_differs = false;
  for (int e = 0; e < epochs; ++e) {
    CAPTURE(e);
    CHECK(a.epoch() == std::uint64_t(e));
    std::vector<int> want_files;  // what files() says this epoch reads
    for (const auto& f : a.files()) want_files.push_back(int(std::find(d.files.begin(), d.files.end(), f) - d.files.begin()));
    const std::vector<int> order = six_files::order_of(read_all(a));
    std::vector<int> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    CHECK(sorted == std::vector<int>{0, 1, 2, 3, 4, 5});  // a permutation: each file once
    CHECK(order == want_files);
    CHECK(six_files::order_of(read_all(b)) == order);  // the same seed: the same orders
    c_differs = c_differs || six_files::order_of(read_all(c)) != order;
    for (int p = 0; p < 6; ++p) ++count[order[std::size_t(p)]][p];
    orders.push_back(order);
    a.rewind(), b.rewind(), c.rewind();
  }
  CHECK(c_differs);
  CHECK(std::count(orders.begin(), orders.end(), orders[0]) < 10);  // not one order
  // Uniform: each file at each place about 1/6 of the epochs (50 of 300; the binomial's
  // sd is 6.5, so 20 is 3 sd). A biased shuffle (j drawn from [0, n) rather than [0, i])
  // puts file 1 first about 0.22 of the time instead of 0.17.
  for (int f = 0; f < 6; ++f)
    for (int p = 0; p < 6; ++p) {
      CAPTURE(f);
      CAPTURE(p);
      CHECK(std::abs(count[f][p] - epochs / 6) < 20);
    }
  // Off (the default): the order as given, every epoch.
  auto plain = ferry::from_files(d.files, ferry::tfrecord{});
  for (int e = 0; e < 3; ++e, plain.rewind())
    CHECK(six_files::order_of(read_all(plain)) == std::vector<int>{0, 1, 2, 3, 4, 5});
}

TEST_CASE("shuffle_files: a resumed source continues the epoch's order and the later epochs'; shards keep their files") {
  six_files d;
  const ferry::from_files_options o{.chunk_bytes = 64, .shuffle_files = true, .shuffle_seed = 7};
  for (int epoch : {0, 1, 4})
    for (int k : {0, 1, 5, 12, 27}) {
      CAPTURE(epoch);
      CAPTURE(k);
      auto a = ferry::from_files(d.files, ferry::tfrecord{}, o);
      for (int e = 0; e < epoch; ++e) (void)read_all(a), a.rewind();
      for (int i = 0; i < k; ++i) REQUIRE(a.next());
      const auto st = ferry::save_state(a);
      auto b = ferry::from_files(d.files, ferry::tfrecord{}, o);
      ferry::restore_state(b, st);
      CHECK(b.epoch() == std::uint64_t(epoch));
      CHECK(read_all(b) == read_all(a));
      a.rewind(), b.rewind();
      CHECK(read_all(b) == read_all(a));  // the next epoch's order too
    }
  // shard(3, i) after from_files: shard i keeps files j % 3 == i, in a new order each epoch.
  for (std::size_t i = 0; i < 3; ++i) {
    auto s = ferry::from_files(d.files, ferry::tfrecord{}, o).shard_files(3, i);
    std::set<std::vector<int>> seen;
    for (int e = 0; e < 20; ++e, s.rewind()) {
      std::vector<int> order = six_files::order_of(read_all(s));
      seen.insert(order);
      std::sort(order.begin(), order.end());
      CHECK(order == std::vector<int>{int(i), int(i) + 3});
    }
    CHECK(seen.size() == 2);  // both orders of its two files come up
  }
}

// Found by mutation testing (a changed bound, a check or a saved field dropped, each passing
// the suite before): drop_remainder on the borrowed-records path.
TEST_CASE("tfrecord | batch(drop_remainder): the short last batch is dropped") {
  src_test::temp_dir dir;
  const std::string path = dir / "seven.tfrecord";
  std::string bytes;
  for (int i = 0; i < 7; ++i) bytes += src_test::tfrecord_of("rec" + std::to_string(i));
  src_test::write_file(path, bytes);
  auto p = ferry::from_files({path}, ferry::tfrecord{}) | ferry::batch(4, {.drop_remainder = true});
  std::size_t n = 0;
  while (auto b = p.next()) {
    CHECK(b->size() == 4);
    ++n;
  }
  CHECK(n == 1);
}
