// Tests of parse_example (include/ferry/sources/example.hpp) and record::origin().
// The oracle is protobuf itself: tests/data/sources/examples.txt holds payloads written by
// protobuf's encoder or by hand, with what protobuf's parser made of each (or, for corrupt
// ones, the payload byte where they go wrong); example_cuts.txt protobuf's verdict on
// prefixes and single-byte changes of some of them; make_example_fixtures.py writes both.
#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <map>
#include <span>
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
      // A lookup's error names the origin given with the bytes, as a parse error does (it
      // read "<memory>" at offset 0).
      const ferry::example named = ferry::parse_example(bytes, {"payload.bin", 100, 112});
      try {
        (void)named.bytes("no such feature");
        FAIL("no error for a missing feature");
      } catch (const ferry::example_error& e) {
        CHECK(e.path() == "payload.bin");
        CHECK(e.offset() == 100);
      }
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

namespace {
// FNV-1a (64-bit) of a description, each line followed by '\n', with NaN floats written
// "nan": the generator's fnv1a64(describe_wire()) (protobuf's Python API widens floats to
// doubles, which does not keep a NaN's payload bits).
std::string description_hash(const std::vector<std::string>& lines) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  auto add = [&](std::string_view s) {
    for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  };
  for (const std::string& line : lines) {
    std::istringstream in(line);
    std::vector<std::string> w;
    for (std::string x; in >> x;) w.push_back(x);
    for (std::size_t i = 0; i < w.size(); ++i) {
      if (i >= 4 && w[2] == "float_list") {
        const auto bits = static_cast<std::uint32_t>(std::stoul(w[i], nullptr, 16));
        if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) w[i] = "nan";
      }
      add(i ? " " : "");
      add(w[i]);
    }
    add("\n");
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}
}  // namespace

// tests/data/sources/example_cuts.txt (make_example_fixtures.py): protobuf's own verdict on
// every prefix of nine payloads and on every single-byte change (to 00, 80, ff, 0a, 7f) of
// six, and what parse_example must do with each. They agree except where protobuf's
// Python parser (the C++ one underneath) is documented to differ from ferry:
//  - strict: a known field sent with another wire type: protobuf keeps it as an unknown
//    field and parses on; ferry refuses it (example.hpp: no writer produces it).
//  - utf8: a feature name that is not UTF-8: protobuf refuses a proto3 string that is not
//    UTF-8 (even one a later entry replaces); ferry does not check names (example.hpp).
//    What ferry parses is compared with protobuf's parse of the same bytes with the key
//    as bytes.
// A prefix protobuf refuses must throw at the byte where the item the cut runs through
// starts (the generator's cut_error(), cross-checked there against protobuf's verdict):
// every cut strictly inside a length-delimited field throws at that field's length.
TEST_CASE("parse_example agrees with protobuf on every prefix and on single-byte changes, offsets included") {
  std::ifstream in(src_test::data_dir() + "/example_cuts.txt");
  REQUIRE(in.good());
  std::map<std::string, std::string> fixture;  // examples.txt: the same payloads
  for (const auto& c : load_cases()) fixture[c.name] = c.payload;
  std::map<std::string, int> seen;
  std::string name, payload, line;
  auto throws_at = [&](const std::string& bytes, std::uint64_t& at, std::string& what) {
    try {
      (void)ferry::parse_example(make_record(bytes));
    } catch (const ferry::example_error& e) {
      at = e.payload_offset();
      what = e.what();
      return true;
    }
    return false;
  };
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    std::string word;
    ls >> word;
    if (word == "payload") {
      std::string h;
      ls >> name >> h;
      payload = unhex(h);
      REQUIRE(fixture.count(name));
      CHECK(fixture[name] == payload);
      ++seen["payloads"];
      continue;
    }
    if (word == "end") continue;
    CAPTURE(name);
    CAPTURE(line);
    std::string bytes;
    std::string protobuf, want, hash, why;
    if (word == "cut") {
      std::size_t n = 0;
      ls >> n >> want;
      REQUIRE(n <= payload.size());
      bytes = payload.substr(0, n);
      protobuf = want;  // no documented difference on prefixes
    } else {
      REQUIRE(word == "mut");
      std::size_t pos = 0;
      std::string val;
      ls >> pos >> val >> protobuf >> want;
      REQUIRE(pos < payload.size());
      bytes = payload;
      bytes[pos] = unhex(val)[0];
      REQUIRE(bytes != payload);
    }
    std::uint64_t at = 0, want_at = 0;
    if (want == "parses") ls >> hash;
    else if (word == "cut") ls >> want_at;
    ls >> why;
    // The two verdicts differ only for a documented reason, and that reason only then.
    if (protobuf == want) CHECK(why.empty());
    else CHECK(((protobuf == "parses" && why == "strict") || (protobuf == "fails" && why == "utf8")));
    std::string what;
    const bool threw = throws_at(bytes, at, what);
    ++seen[word + " " + want + (why.empty() ? "" : " " + why)];
    if (want == "parses") {
      REQUIRE_MESSAGE(!threw, what);
      CHECK(description_hash(describe(ferry::parse_example(make_record(bytes)))) == hash);
      continue;
    }
    REQUIRE_MESSAGE(threw, "parse_example accepted a payload it must refuse");
    CHECK(at <= bytes.size());
    CHECK(what.find("payload byte " + std::to_string(at) + ":") != std::string::npos);
    if (why == "strict") CHECK(what.find("wrong wire type") != std::string::npos);
    if (word == "cut") {
      CHECK(at == want_at);
      // The record's file and offset come from its origin.
      try {
        (void)ferry::parse_example(std::as_bytes(std::span<const char>(bytes.data(), bytes.size())),
                                   {"cut.tfrecord", 4096, 4108});
        FAIL("no error the second time");
      } catch (const ferry::example_error& e) {
        CHECK(e.path() == "cut.tfrecord");
        CHECK(e.offset() == 4096);
        CHECK(e.payload_offset() == want_at);
      }
    }
  }
  // Enough of each kind that the comparison means something.
  CAPTURE(seen.size());
  CHECK(seen["payloads"] >= 9);
  CHECK(seen["cut fails"] >= 1500);
  CHECK(seen["cut parses"] >= 20);
  CHECK(seen["mut parses"] >= 400);
  CHECK(seen["mut fails"] >= 500);
  CHECK(seen["mut fails strict"] >= 1);
  CHECK(seen["mut parses utf8"] >= 20);
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

namespace {
std::string pb_varint(std::uint64_t v) {
  std::string s;
  for (; v >= 0x80; v >>= 7) s += char(v | 0x80);
  return s + char(v);
}
std::string pb_field(int field, const std::string& body) {  // length-delimited
  return pb_varint(std::uint64_t(field) << 3 | 2) + pb_varint(body.size()) + body;
}
std::string pb_unpacked_floats(std::initializer_list<float> v) {  // FloatList.value, wire type 5 each
  std::string s;
  for (float f : v) {
    s += pb_varint(1 << 3 | 5);
    s.append(reinterpret_cast<const char*>(&f), 4);
  }
  return s;
}
}  // namespace

// Floats kept in the example's arena (unpacked, or packed in several runs) were read from
// byte first_ instead of 4 x first_: every such feature after the first got other bytes.
TEST_CASE("float features kept in the example's arena each read their own values") {
  // Example{features{feature{"a": float_list{1, 2}}, feature{"b": float_list{3, 4}}, "c": two packed runs}}
  const std::string packed_runs = pb_field(1, std::string(reinterpret_cast<const char*>(std::array<float, 1>{5}.data()), 4)) +
                                  pb_field(1, std::string(reinterpret_cast<const char*>(std::array<float, 2>{6, 7}.data()), 8));
  const std::string msg = pb_field(1, pb_field(1, pb_field(1, "a") + pb_field(2, pb_field(2, pb_unpacked_floats({1, 2})))) +
                                          pb_field(1, pb_field(1, "b") + pb_field(2, pb_field(2, pb_unpacked_floats({3, 4})))) +
                                          pb_field(1, pb_field(1, "c") + pb_field(2, pb_field(2, packed_runs))));
  const ferry::example ex = ferry::parse_example(std::as_bytes(std::span(msg.data(), msg.size())));
  CHECK(ex.floats("a").to_vector() == std::vector<float>{1, 2});
  CHECK(ex.floats("b").to_vector() == std::vector<float>{3, 4});
  CHECK(ex.floats("c").to_vector() == std::vector<float>{5, 6, 7});
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
