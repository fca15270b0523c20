// Tests of parse_example (include/ferry/sources/example.hpp) and record::origin().
// The oracle is protobuf itself: tests/data/sources/examples.txt holds payloads written by
// protobuf's encoder or by hand, with what protobuf's parser made of each (or, for corrupt
// ones, the payload byte where they go wrong); make_example_fixtures.py writes it.
#include <doctest/doctest.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/doubles.hpp"
#include "ferry/sources/example.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/stages/map.hpp"
#include "helpers.hpp"

namespace {

struct fixture_case {
  std::string name;
  bool encoder = false;
  std::string payload;
  bool ok = false;
  std::uint64_t error_at = 0;
  std::vector<std::string> features;  // protobuf's description
};

std::string unhex(const std::string& h) {
  if (h == "-") return {};
  std::string s;
  for (std::size_t i = 0; i + 1 < h.size(); i += 2) s += static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16));
  return s;
}
std::string hex(std::string_view s) {
  static const char* d = "0123456789abcdef";
  std::string o;
  for (unsigned char c : s) {
    o += d[c >> 4];
    o += d[c & 15];
  }
  return o.empty() ? "-" : o;
}

std::vector<fixture_case> load_cases() {
  std::ifstream in(src_test::data_dir() + "/examples.txt");
  REQUIRE(in.good());
  std::vector<fixture_case> out;
  std::string line;
  fixture_case c;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    std::string word;
    ls >> word;
    if (word == "case") {
      c = {};
      std::string src;
      ls >> c.name >> src;
      c.encoder = src == "encoder";
    } else if (word == "payload") {
      std::string h;
      ls >> h;
      c.payload = unhex(h);
    } else if (word == "ok") {
      c.ok = true;
    } else if (word == "error") {
      ls >> c.error_at;
    } else if (word == "feature") {
      c.features.push_back(line);
    } else if (word == "end") {
      out.push_back(c);
    }
  }
  return out;
}

// The same description of a parsed example as the generator writes from protobuf's.
std::vector<std::string> describe(const ferry::example& ex) {
  std::vector<std::string> out;
  for (const ferry::feature& f : ex.features()) {
    std::string s = "feature " + hex(f.name()) + " " + ferry::to_string(f.kind()) + " " + std::to_string(f.size());
    if (f.kind() == ferry::feature_kind::bytes_list) {
      for (std::string_view v : ex.bytes(f)) s += " " + hex(v);
      CHECK(ex.bytes(f).size() == f.size());
    } else if (f.kind() == ferry::feature_kind::float_list) {
      const ferry::float_values v = ex.floats(f);
      CHECK(v.size() == f.size());
      std::vector<float> copy = v.to_vector();
      std::size_t i = 0;
      for (float x : v) {  // iterator, operator[] and copy_to agree
        std::uint32_t bits;
        std::memcpy(&bits, &x, 4);
        char buf[16];
        std::snprintf(buf, sizeof buf, " %08x", bits);
        s += buf;
        CHECK(std::memcmp(&copy[i], &x, 4) == 0);
        const float y = v[i];
        CHECK(std::memcmp(&y, &x, 4) == 0);
        ++i;
      }
    } else if (f.kind() == ferry::feature_kind::int64_list) {
      for (std::int64_t v : ex.int64s(f)) s += " " + std::to_string(v);
      CHECK(ex.int64s(f).size() == f.size());
    }
    out.push_back(s);
  }
  return out;
}

ferry::record make_record(const std::string& bytes) {
  // An odd offset inside the allocation, so unaligned floats are exercised.
  auto buf = std::shared_ptr<std::byte[]>(new std::byte[bytes.size() + 1]);
  if (!bytes.empty()) std::memcpy(buf.get() + 1, bytes.data(), bytes.size());
  return ferry::record(std::shared_ptr<const std::byte>(buf, buf.get() + 1), bytes.size());
}

}  // namespace

TEST_CASE("parse_example agrees with protobuf on every fixture case") {
  const auto cases = load_cases();
  REQUIRE(cases.size() >= 30);
  int ok = 0, bad = 0;
  for (const auto& c : cases) {
    CAPTURE(c.name);
    const auto bytes = std::as_bytes(std::span<const char>(c.payload.data(), c.payload.size()));
    if (c.ok) {
      ++ok;
      const ferry::example ex = ferry::parse_example(make_record(c.payload));
      CHECK(describe(ex) == c.features);
      CHECK(describe(ferry::parse_example(bytes)) == c.features);
    } else {
      ++bad;
      try {
        (void)ferry::parse_example(bytes, {"payload.bin", 100, 112});
        FAIL("no error for a corrupt payload");
      } catch (const ferry::example_error& e) {
        CHECK(e.payload_offset() == c.error_at);
        CHECK(e.path() == "payload.bin");
        CHECK(e.offset() == 100);
        CHECK(std::string(e.what()).find("payload byte " + std::to_string(c.error_at) + ":") != std::string::npos);
      }
    }
  }
  CHECK(ok >= 20);
  CHECK(bad >= 15);
}

TEST_CASE("every prefix and every single-byte change of a valid payload parses or throws example_error") {
  for (const auto& c : load_cases()) {
    if (!c.ok || c.payload.size() > 600) continue;
    CAPTURE(c.name);
    for (std::size_t n = 0; n < c.payload.size(); ++n) {
      try {
        (void)ferry::parse_example(make_record(c.payload.substr(0, n)));
      } catch (const ferry::example_error& e) {
        CHECK(e.payload_offset() <= n);
      }
    }
    std::string m = c.payload;
    for (std::size_t i = 0; i < m.size(); ++i)
      for (unsigned char v : {0x00, 0x80, 0xff, 0x0a, 0x7f}) {
        const char old = m[i];
        m[i] = static_cast<char>(v);
        try {
          (void)ferry::parse_example(make_record(m));
        } catch (const ferry::example_error& e) {
          CHECK(e.payload_offset() <= m.size());
        }
        m[i] = old;
      }
  }
}

TEST_CASE("bytes values and one-run packed floats are views into the record") {
  const auto cases = load_cases();
  for (const auto& c : cases) {
    if (c.name != "one_of_each") continue;
    const ferry::record r = make_record(c.payload);
    const ferry::example ex = ferry::parse_example(r);
    auto inside = [&](const void* p) {
      auto* b = static_cast<const std::byte*>(p);
      return b >= r.data() && b <= r.data() + r.size();
    };
    REQUIRE(ex.bytes("image").size() == 2);
    CHECK(inside(ex.bytes("image")[0].data()));
    CHECK(ex.bytes("image")[0] == std::string_view("\x89PNG\r\n\x1a\n", 8));
    REQUIRE(ex.floats("x").size() == 5);
    CHECK(inside(ex.floats("x").bytes().data()));
    CHECK(ex.floats("x")[0] == 0.5f);
    CHECK(ex.int64s("label")[2] == INT64_MAX);
    CHECK(ex.int64s("label")[3] == INT64_MIN);
    // The example keeps the bytes alive after the caller's record is gone.
    ferry::example moved = ferry::parse_example(make_record(c.payload));
    ferry::example other = std::move(moved);
    CHECK(other.bytes("image")[0].size() == 8);
    CHECK(other.record().size() == c.payload.size());
    // Missing and mistyped features name the feature.
    CHECK_THROWS_WITH_AS((void)ex.floats("nope"), doctest::Contains("no feature 'nope'"), ferry::example_error);
    CHECK_THROWS_WITH_AS((void)ex.floats("label"), doctest::Contains("'label' is a int64_list, not a float_list"),
                         ferry::example_error);
    CHECK(ex.find("nope") == nullptr);
    CHECK(ex.contains("x"));
    return;
  }
  FAIL("no one_of_each case");
}

TEST_CASE("from_files records carry their file and offset") {
  src_test::temp_dir d;
  const std::string a = d / "a.tfrecord", b = d / "b.tfrecord";
  src_test::write_file(a, src_test::tfrecord_of("hello") + src_test::tfrecord_of("") +
                              src_test::tfrecord_of("xyz"));
  src_test::write_file(b, "one\ntwo\n");
  auto src = ferry::from_files({a}, ferry::tfrecord{}, {.chunk_bytes = 64});
  std::vector<std::pair<std::uint64_t, std::uint64_t>> offs;
  std::vector<ferry::record> keep;
  while (auto r = src.next()) {
    CHECK(r->origin().file == a);
    offs.emplace_back(r->origin().offset, r->origin().data_offset);
    keep.push_back(*r);
  }
  CHECK(offs == std::vector<std::pair<std::uint64_t, std::uint64_t>>{{0, 12}, {21, 33}, {37, 49}});
  src = ferry::from_files({a}, ferry::tfrecord{});  // the reader is gone; the names stay
  CHECK(keep[2].origin().file == a);
  auto lines = ferry::from_files({b}, ferry::text_lines{});
  auto l1 = lines.next(), l2 = lines.next();
  CHECK(l2->origin().file == b);
  CHECK(l2->origin().offset == 4);
  CHECK(l2->origin().data_offset == 4);
  CHECK(ferry::record().origin().file.empty());
}

TEST_CASE("from_files | map(parse_example) reads protobuf-written examples and names the file of a bad one" * doctest::timeout(60)) {
  ferry_test::watchdog dog(std::chrono::seconds(60));
  const auto cases = load_cases();
  std::vector<const fixture_case*> enc;
  for (const auto& c : cases)
    if (c.encoder) enc.push_back(&c);
  REQUIRE(enc.size() >= 10);
  for (std::size_t workers : {1, 3}) {
    CAPTURE(workers);
    auto src = ferry::from_files({src_test::data_dir() + "/examples.tfrecord"}, ferry::tfrecord{},
                                 {.chunk_bytes = 4096}) |
               ferry::map(ferry::parse_example, {.workers = workers});
    std::size_t i = 0;
    while (auto ex = src.next()) {
      REQUIRE(i < enc.size());
      CAPTURE(enc[i]->name);
      CHECK(describe(*ex) == enc[i]->features);
      ++i;
    }
    CHECK(i == enc.size());
  }

  const std::string bad = src_test::data_dir() + "/examples_bad.tfrecord";
  const std::uint64_t first_len = 16 + enc[2]->payload.size();  // record 0 is one_of_each
  for (std::size_t workers : {1, 2}) {
    CAPTURE(workers);
    auto src = ferry::from_files({bad}, ferry::tfrecord{}) | ferry::map(ferry::parse_example, {.workers = workers});
    CHECK(src.next().has_value());
    try {
      (void)src.next();
      FAIL("no error");
    } catch (const ferry::example_error& e) {
      CHECK(e.path() == bad);
      CHECK(e.offset() == first_len);
      CHECK(e.payload_offset() == 1);
      CHECK(std::string(e.what()) ==
            bad + ": bad tf.train.Example (payload byte 1: truncated varint) at offset " + std::to_string(first_len));
    }
    auto third = src.next();  // the pipeline goes on past the bad element
    REQUIRE(third.has_value());
    CHECK(describe(*third) == enc[2]->features);
    CHECK_FALSE(src.next().has_value());
  }
}
