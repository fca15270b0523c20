// from_files(webdataset): tar shards of samples against the test's writer (a property sweep
// over names, sizes and chunk sizes), against GNU tar's own archives, bad input (cut at
// every byte, damaged headers), the error policy, and the records' origin and epoch.
#include <doctest/doctest.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "ferry/sources/from_files.hpp"
#include "ferry/sources/webdataset.hpp"
#include "ferry/stages/interleave.hpp"
#include "ferry/state.hpp"
#include "sources/helpers.hpp"

using namespace src_test;

namespace {

struct want_member {
  std::string ext, data;
  std::size_t header = 0, data_at = 0;  // offsets in the file: its first header, its data
};
struct want_sample {
  std::string file, key;
  std::vector<want_member> members;
};

// An archive of random samples: keys in directories, 1-4 members of random sizes (0, one
// block, odd sizes), long names of all three kinds, directories and dot-less names
// between samples, which WebDataset passes over.
struct archive {
  std::string bytes;
  std::vector<want_sample> samples;
  std::vector<std::size_t> boundaries;  // where each entry (with its padding) ends, and 0
  std::vector<std::pair<std::size_t, std::size_t>> paddings;  // [data end, padded end) of each entry
  std::size_t data_end = 0;  // before the closing zero blocks
};

archive make_archive(std::mt19937_64& g, const std::string& file, int n, bool closing = true) {
  static const char* exts[] = {"jpg", "cls", "json", "seg.png", "txt"};
  tar_writer w;
  archive a;
  a.boundaries.push_back(0);
  const auto note = [&](std::size_t data_end) {
    a.paddings.emplace_back(data_end, w.out.size());
    a.boundaries.push_back(w.out.size());
  };
  for (int i = 0; i < n; ++i) {
    if (g() % 6 == 0) {
      w.add("dir" + std::to_string(i) + "/", "", '5');
      note(w.out.size());
    }
    if (g() % 8 == 0) {
      const std::string junk = random_bytes(g, g() % 40);
      note(w.add("README", junk) + 512 + junk.size());
    }
    if (g() % 8 == 0) {  // WebDataset's metadata: passed over, dot or not
      const std::string junk = random_bytes(g, g() % 40);
      note(w.add(g() % 2 ? "__meta__/info.json" : "__index__", junk) + 512 + junk.size());
    }
    want_sample s;
    s.file = file;
    const char kinds[] = {'L', 'x', 'p'};
    const bool long_name = g() % 4 == 0;
    const char kind = kinds[g() % 3];
    s.key = (long_name ? std::string(120, 'd') + "/" : std::string("shard/")) + std::to_string(100000 + i);
    std::vector<std::string> pick(std::begin(exts), std::end(exts));
    std::shuffle(pick.begin(), pick.end(), g);
    pick.resize(1 + g() % 4);
    for (const auto& x : pick) {
      const std::size_t sizes[] = {0, 1, 511, 512, 513, std::size_t(g() % 3000)};
      want_member m{x, random_bytes(g, sizes[g() % 6]), 0, 0};
      std::string written = x;  // extensions in any case come out lowercased, as WebDataset's
      for (char& c : written)
        if (g() % 3 == 0) c = char(std::toupper(static_cast<unsigned char>(c)));
      m.header = w.add(s.key + "." + written, m.data, '0', kind);
      m.data_at = w.out.size() - tar_writer::padded(m.data).size();
      note(m.data_at + m.data.size());
      s.members.push_back(m);
    }
    a.samples.push_back(s);
  }
  a.data_end = w.out.size();
  if (closing) w.end();
  a.bytes = w.out;
  return a;
}

std::vector<want_sample> read_samples(ferry::source auto& src) {
  std::vector<want_sample> out;
  while (auto r = src.next()) {
    const ferry::webdataset_sample s = ferry::parse_webdataset(*r);
    want_sample got;
    got.file = std::string(r->origin().file);
    got.key = s.key;
    for (const auto& m : s.members)
      got.members.push_back({m.ext, std::string(m.data.str()), m.data.origin().offset, m.data.origin().data_offset});
    out.push_back(got);
  }
  return out;
}

void check_same(const std::vector<want_sample>& got, const std::vector<want_sample>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i].file == want[i].file);
    CHECK(got[i].key == want[i].key);
    REQUIRE(got[i].members.size() == want[i].members.size());
    for (std::size_t j = 0; j < got[i].members.size(); ++j) {
      CHECK(got[i].members[j].ext == want[i].members[j].ext);
      CHECK(got[i].members[j].data == want[i].members[j].data);
      CHECK(got[i].members[j].header == want[i].members[j].header);
      CHECK(got[i].members[j].data_at == want[i].members[j].data_at);
    }
  }
}

// Runs f, expecting a format_error at `offset` whose message contains `what`.
template <class F>
void expect_format_error(F&& f, const std::string& path, std::uint64_t offset, const std::string& what) {
  try {
    f();
    FAIL("no error; expected: " << what);
  } catch (const ferry::format_error& e) {
    CHECK(e.path() == path);
    CHECK(e.offset() == offset);
    CHECK_MESSAGE(std::string(e.what()).find(what) != std::string::npos, std::string(e.what()));
  }
}

}  // namespace

TEST_CASE("webdataset: samples and members as the writer wrote them, whatever the chunk size") {
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    CAPTURE(seed);
    std::mt19937_64 g(seed);
    temp_dir d;
    std::vector<std::string> paths;
    std::vector<want_sample> want;
    for (int f = 0; f < 3; ++f) {
      paths.push_back(d / ("shard-" + std::to_string(f) + ".tar"));
      archive a = make_archive(g, paths.back(), 1 + int(g() % 12), g() % 5 != 0);
      write_file(paths.back(), a.bytes);
      want.insert(want.end(), a.samples.begin(), a.samples.end());
    }
    const std::size_t chunks[] = {64, 700, 4096, std::size_t(1) << 20};
    const std::size_t chunk = chunks[seed % 4];
    auto src = ferry::from_files(paths, ferry::webdataset{}, {.chunk_bytes = chunk, .read_ahead = seed % 2 ? 4u : 0u});
    check_same(read_samples(src), want);
    // interleave's readers frame the same samples (two files at a time, one sample each).
    auto il = ferry::from_files(paths, ferry::webdataset{}, {.chunk_bytes = chunk}) |
              ferry::interleave(3, {.workers = 2, .block = 1});
    std::vector<want_sample> got = read_samples(il);
    std::vector<want_sample> sorted_got = got, sorted_want = want;
    const auto by_place = [](const want_sample& a, const want_sample& b) {
      return std::tie(a.file, a.members.front().header) < std::tie(b.file, b.members.front().header);
    };
    std::sort(sorted_got.begin(), sorted_got.end(), by_place);
    std::sort(sorted_want.begin(), sorted_want.end(), by_place);
    check_same(sorted_got, sorted_want);
  }
}

TEST_CASE("webdataset: GNU tar's archives (ustar, gnu, pax) read as written") {
  if (std::system("tar --version > /dev/null 2>&1") != 0) {
    MESSAGE("no tar on this machine: skipped");
    return;
  }
  temp_dir d;
  std::mt19937_64 g(7);
  std::map<std::string, std::map<std::string, std::string>> want;  // key -> ext -> bytes
  std::filesystem::create_directories(d / "in/part");
  for (int i = 0; i < 20; ++i) {
    const std::string key = (i % 5 == 0 ? "part/" + std::string(110, 'k') : "part/") + std::to_string(1000 + i);
    for (const char* x : {"jpg", "cls"}) {
      const std::string bytes = random_bytes(g, g() % 5000);
      want["./" + key][x] = bytes;
      write_file(d / ("in/" + key + "." + x), bytes);
    }
  }
  for (const std::string fmt : {"gnu", "pax", "ustar"}) {
    CAPTURE(fmt);
    const std::string tar = d / ("out-" + fmt + ".tar");
    // ustar cannot hold the 110-byte base names: those members are left out there.
    const std::string cmd = "tar --format=" + fmt + " --sort=name -C " + (d / "in") + " -cf " + tar + " . 2>/dev/null";
    const int rc = std::system(cmd.c_str());
    auto src = ferry::from_files({tar}, ferry::webdataset{});
    std::size_t n = 0;
    while (auto r = src.next()) {
      const ferry::webdataset_sample s = ferry::parse_webdataset(*r);
      REQUIRE(want.count(s.key) == 1);
      CHECK(s.members.size() == 2);
      for (const auto& m : s.members) CHECK(std::string(m.data.str()) == want[s.key][m.ext]);
      ++n;
    }
    CHECK(n == (fmt == "ustar" ? 16u : 20u));
    if (fmt != "ustar") CHECK(rc == 0);
  }
}

TEST_CASE("webdataset: an archive cut at every byte gives what is whole, then a clear error") {
  std::mt19937_64 g(3);
  const archive a = make_archive(g, "", 4);
  temp_dir d;
  const std::string path = d / "cut.tar";
  // Every byte near an entry's edges (its start, its header's end, its padding), every 61st
  // elsewhere.
  std::vector<std::size_t> cuts;
  for (std::size_t cut = 0; cut <= a.bytes.size(); ++cut) {
    bool near = cut % 61 == 0 || cut + 3 >= a.bytes.size();
    for (std::size_t b : a.boundaries) near |= (cut + 3 >= b && cut <= b + 3) || (cut + 3 >= b + 512 && cut <= b + 515);
    for (const auto& [from, to] : a.paddings) near |= cut + 3 >= from && cut <= from + 3;
    if (near) cuts.push_back(cut);
  }
  for (std::size_t cut : cuts) {
    CAPTURE(cut);
    write_file(path, a.bytes.substr(0, cut));
    auto src = ferry::from_files({path}, ferry::webdataset{}, {.chunk_bytes = 1024, .read_ahead = 0});
    std::vector<want_sample> got;
    std::optional<ferry::format_error> err;
    try {
      while (auto r = src.next()) {
        const auto s = ferry::parse_webdataset(*r);
        want_sample w{path, s.key, {}};
        for (const auto& m : s.members) w.members.push_back({m.ext, std::string(m.data.str()), 0, 0});
        got.push_back(w);
      }
    } catch (const ferry::format_error& e) {
      err = e;
    }
    // Whole samples come out as written; a cut between two members of a sample (a member
    // boundary, undetectable in tar) gives the members before it.
    for (std::size_t i = 0; i < got.size(); ++i) {
      REQUIRE(i < a.samples.size());
      CHECK(got[i].key == a.samples[i].key);
      REQUIRE(got[i].members.size() <= a.samples[i].members.size());
      for (std::size_t j = 0; j < got[i].members.size(); ++j) CHECK(got[i].members[j].data == a.samples[i].members[j].data);
      if (i + 1 < got.size()) CHECK(got[i].members.size() == a.samples[i].members.size());
    }
    const bool at_boundary = std::count(a.boundaries.begin(), a.boundaries.end(), cut) > 0;
    bool in_padding = false;
    for (const auto& [from, to] : a.paddings) in_padding |= cut >= from && cut < to;
    const bool fine = at_boundary || in_padding || cut >= a.data_end;
    CHECK_MESSAGE(fine == !err.has_value(), (err ? err->what() : "no error"));
    if (err) {
      CHECK(err->path() == path);
      CHECK(err->offset() < cut);
      CHECK(std::string(err->what()).find("truncated") != std::string::npos);
    }
    if (cut >= a.data_end) CHECK(got.size() == a.samples.size());
  }
}

TEST_CASE("webdataset: damaged headers, duplicates, sizes and limits") {
  temp_dir d;
  const std::string path = d / "bad.tar";
  std::mt19937_64 g(5);
  SUBCASE("a damaged header: the samples before it, then 'not a tar header' at its offset") {
    tar_writer w;
    w.add("a/1.jpg", "one");
    const std::size_t at = w.add("a/2.jpg", "two");
    w.end();
    w.out[at + 20] ^= 0x55;
    write_file(path, w.out);
    auto src = ferry::from_files({path}, ferry::webdataset{});
    CHECK(ferry::parse_webdataset(*src.next()).key == "a/1");
    expect_format_error([&] { src.next(); }, path, at, "not a tar header (checksum mismatch)");
    CHECK(!src.next());  // the rest of that file cannot be read
    // skip: counted once, and the next file is read.
    const std::string good = d / "good.tar";
    tar_writer w2;
    w2.add("b/1.cls", "7");
    w2.end();
    write_file(good, w2.out);
    int skips = 0;
    auto sk = ferry::from_files({path, good}, ferry::webdataset{},
                                {.on_error = ferry::error_policy::skip, .on_skip = [&](const ferry::skipped_record& s) {
                                   ++skips;
                                   CHECK(s.offset == at);
                                 }});
    std::vector<std::string> keys;
    while (auto r = sk.next()) keys.push_back(ferry::parse_webdataset(*r).key);
    CHECK(keys == std::vector<std::string>{"a/1", "b/1"});
    CHECK(skips == 1);
  }
  SUBCASE("a file that is not a tar") {
    write_file(path, std::string(600, 'x'));
    expect_format_error([&] { ferry::from_files({path}, ferry::webdataset{}).next(); }, path, 0, "not a tar header");
  }
  SUBCASE("a size field that is not a number") {
    std::string h = tar_writer::header("a/1.jpg", 3, '0');
    h.replace(124, 12, std::string("0000000001x\0", 12));
    unsigned sum = 0;
    h.replace(148, 8, "        ");
    for (unsigned char c : h) sum += c;
    h.replace(148, 8, tar_writer::octal(sum, 7) + ' ');
    write_file(path, h + tar_writer::padded("abc"));
    expect_format_error([&] { ferry::from_files({path}, ferry::webdataset{}).next(); }, path, 0, "not an octal number");
  }
  SUBCASE("extensions compare and come out lowercased, and metadata names are passed over, as in WebDataset") {
    tar_writer w;
    w.add("__meta__/info.json", "{}");  // WebDataset's metadata: not a sample
    w.add("a/1.JPG", "one");
    w.add("a/1.Seg.PNG", "mask");
    w.add("__index__", "x");  // within the span: passed over, the sample goes on
    w.add("a/1.cls", "7");
    w.add("__a__b/2.jpg", "two");  // a first component that only starts and ends alike is a key
    w.add("____/3.jpg", "three");  // "____" is WebDataset's __[^/]*__ too
    const std::size_t at = w.add("a/4.jpg", "four");
    w.add("a/4.JPG", "again");  // the same extension to WebDataset: a duplicate
    w.add("a/5.txt", "five");
    w.end();
    write_file(path, w.out);
    auto src = ferry::from_files({path}, ferry::webdataset{});
    const ferry::webdataset_sample one = ferry::parse_webdataset(*src.next());
    CHECK(one.key == "a/1");
    REQUIRE(one.members.size() == 3);
    CHECK(one.members[0].ext == "jpg");
    CHECK(one.members[1].ext == "seg.png");
    CHECK(one.members[2].ext == "cls");
    CHECK(one.at("jpg").str() == "one");
    CHECK(one.at("JPG").str() == "one");
    CHECK(one.at("SEG.png").str() == "mask");
    CHECK(one.find("png") == nullptr);
    CHECK(ferry::parse_webdataset(*src.next()).key == "__a__b/2");
    expect_format_error([&] { src.next(); }, path, at, "sample 'a/4' has two members with one extension");
    CHECK(ferry::parse_webdataset(*src.next()).key == "a/5");  // reading goes on past it
    CHECK(!src.next());
  }
  SUBCASE("a sample with two members of one extension is one bad record") {
    tar_writer w;
    w.add("a/1.jpg", "one");
    const std::size_t at = w.add("a/2.jpg", "two");
    w.add("a/2.jpg", "again");
    w.add("a/3.jpg", "three");
    w.end();
    write_file(path, w.out);
    auto src = ferry::from_files({path}, ferry::webdataset{});
    CHECK(ferry::parse_webdataset(*src.next()).key == "a/1");
    expect_format_error([&] { src.next(); }, path, at, "sample 'a/2' has two members with one extension");
    CHECK(ferry::parse_webdataset(*src.next()).key == "a/3");  // reading goes on past it
    CHECK(!src.next());
  }
  SUBCASE("a README cut short after a whole sample: the sample, then the error") {
    tar_writer w;
    w.add("a/1.jpg", "one");
    const std::size_t readme_at = w.add("README", std::string(1000, 'r'));
    write_file(path, w.out.substr(0, readme_at + 512 + 500));
    auto src = ferry::from_files({path}, ferry::webdataset{});
    CHECK(ferry::parse_webdataset(*src.next()).key == "a/1");
    expect_format_error([&] { src.next(); }, path, readme_at,
                        "truncated member 'README' (its header says 1000 bytes, 500 are left)");
  }
  SUBCASE("members and samples larger than max_record_bytes; a long name with no member") {
    tar_writer w;
    w.add("a/1.jpg", std::string(3000, 'x'));
    w.add("a/1.cls", std::string(3000, 'y'));
    w.end();
    write_file(path, w.out);
    expect_format_error([&] { ferry::from_files({path}, ferry::webdataset{}, {.max_record_bytes = 5000}).next(); },
                        path, 0, "sample 'a/1' is larger than max_record_bytes (5000)");
    CHECK(ferry::from_files({path}, ferry::webdataset{}, {.max_record_bytes = 8192}).next());
    tar_writer l;
    l.add("a/1.jpg", "x");
    l.out += tar_writer::header("././@LongLink", 300, 'L') + tar_writer::padded(std::string(300, 'n'));
    write_file(path, l.out);
    auto src = ferry::from_files({path}, ferry::webdataset{});
    CHECK(src.next());
    expect_format_error([&] { src.next(); }, path, 1024, "a long-name or pax header with no member after it");
    // A header claiming an absurd size: nothing allocated, an error at its offset.
    std::string huge = tar_writer::header("a/1.jpg", std::uint64_t(1) << 40, '0', "", true);
    write_file(path, huge + std::string(512, 'z'));
    expect_format_error([&] { ferry::from_files({path}, ferry::webdataset{}).next(); }, path, 0,
                        "truncated member 'a/1.jpg'");
  }
  SUBCASE("what is never buffered: a chain of long names, a large file without a dot") {
    // 40 long-name headers of 60 KB with no member: an error before max_record_bytes is
    // buffered, not at the end of the chain.
    tar_writer w;
    w.add("a/1.jpg", "x");
    for (int i = 0; i < 40; ++i) w.out += tar_writer::header("././@LongLink", 60000, 'L') + tar_writer::padded(std::string(60000, 'n'));
    w.add("a/2.jpg", "y");
    write_file(path, w.out);
    auto src = ferry::from_files({path}, ferry::webdataset{}, {.max_record_bytes = 1 << 20});
    CHECK(ferry::parse_webdataset(*src.next()).key == "a/1");
    expect_format_error([&] { src.next(); }, path, 1024, "long-name or pax headers reaching past max_record_bytes");
    // Files without a dot carry no sample data. Between members of a sample one is passed
    // over inside it (WebDataset's group_by_keys): a/1 is one record with both members, not
    // two with one key. At a shard's start a 2 MiB one (max_record_bytes 1 MiB) is passed
    // over a chunk at a time, never buffered whole; after a member it would take the
    // sample past the bound, so the sample ends before it, and only a member of the same
    // key after it is an error (at that member, naming the file passed over).
    auto samples_of = [&](const std::string& bytes) {
      write_file(path, bytes);
      auto rs = ferry::from_files({path}, ferry::webdataset{}, {.chunk_bytes = 4096, .max_record_bytes = 1 << 20});
      std::vector<std::string> got;
      while (auto e = rs.next()) {
        const auto smp = ferry::parse_webdataset(*e);
        std::string s = smp.key + ":";
        for (const auto& m : smp.members) s += " " + m.ext + "=" + std::string(m.data.str());
        got.push_back(s);
      }
      return got;
    };
    tar_writer r;
    r.add("README", std::string(2 << 20, 'r'));
    r.add("a/1.jpg", "one");
    r.add("LICENSE", std::string(600 << 10, 'l'));
    r.add("a/1.cls", "7");
    r.add("NOTES", "n");
    r.add("a/2.jpg", "two");
    r.end();
    CHECK(samples_of(r.out) == std::vector<std::string>{"a/1: jpg=one cls=7", "a/2: jpg=two"});
    for (const bool at_end : {false, true}) {
      tar_writer after;
      after.add("a/1.jpg", "one");
      after.add("a/1.cls", "7");
      after.add("README", std::string(2 << 20, 'r'));
      if (!at_end) after.add("a/2.jpg", "two");
      after.end();
      CHECK(samples_of(after.out) == (at_end ? std::vector<std::string>{"a/1: jpg=one cls=7"}
                                             : std::vector<std::string>{"a/1: jpg=one cls=7", "a/2: jpg=two"}));
    }
    tar_writer big;
    big.add("a/1.jpg", "one");
    big.add("README", std::string(2 << 20, 'r'));
    const std::size_t cls_at = big.add("a/1.cls", "7");
    big.add("a/2.jpg", "two");
    big.end();
    {
      write_file(path, big.out);
      auto rs = ferry::from_files({path}, ferry::webdataset{}, {.chunk_bytes = 4096, .max_record_bytes = 1 << 20});
      const auto first = ferry::parse_webdataset(*rs.next());
      CHECK(first.key == "a/1");
      CHECK(first.members.size() == 1);  // the jpg: the cls is after the README
      // The rest of a/1 is a bad record of its own: raise throws it, and reading goes on.
      expect_format_error([&] { rs.next(); }, path, cls_at,
                          "sample 'a/1' goes on after 'README' (2097152 bytes, no sample data), which would take it "
                          "past max_record_bytes (1048576)");
      const auto after = rs.next();
      REQUIRE(after);
      CHECK(ferry::parse_webdataset(*after).key == "a/2");
      CHECK(!rs.next());
      // skip passes over it alone: a/2 is not lost with it.
      std::vector<std::uint64_t> skipped;
      auto sk = ferry::from_files({path}, ferry::webdataset{},
                                  {.on_error = ferry::error_policy::skip,
                                   .on_skip = [&](const ferry::skipped_record& s) { skipped.push_back(s.offset); },
                                   .chunk_bytes = 4096,
                                   .max_record_bytes = 1 << 20});
      std::vector<std::string> keys;
      while (auto e = sk.next()) keys.push_back(ferry::parse_webdataset(*e).key);
      CHECK(keys == std::vector<std::string>{"a/1", "a/2"});
      CHECK(skipped == std::vector<std::uint64_t>{cls_at});
    }
    // Long-name or pax headers after a member that would take the sample past the bound
    // end it as a large entry does: a README's (a/1.cls after it is the bad record), or
    // the next member's own (that member is). Both kinds, and a chain of several.
    const std::size_t near = (std::size_t(1) << 20) - 1536;  // a/1.jpg's padded end + 1536 passes 1 MiB
    for (const char kind : {'L', 'x'}) {
      for (const bool own : {false, true}) {
        CAPTURE(kind);
        CAPTURE(own);
        tar_writer t;
        const std::string key = own ? std::string(150, 'k') + "/1" : "a/1";
        const std::size_t jpg_at = t.add(key + ".jpg", std::string(near - (own ? 1024 : 0), 'j'), '0', kind);
        CHECK(jpg_at == 0);
        std::size_t bad_at = 0;
        if (own) {
          bad_at = t.add(key + ".cls", "7", '0', kind);
          CHECK(bad_at == near + 512);
        } else {
          const std::size_t chain_at = t.add(std::string(150, 'r'), "readme", '0', kind);
          bad_at = t.add("a/1.cls", "7");
          CHECK(chain_at == near + 512);
        }
        t.add("a/2.jpg", "two");
        t.end();
        write_file(path, t.out);
        auto rs = ferry::from_files({path}, ferry::webdataset{}, {.chunk_bytes = 4096, .max_record_bytes = 1 << 20});
        const auto first = ferry::parse_webdataset(*rs.next());
        CHECK(first.key == key);
        CHECK(first.members.size() == 1);
        expect_format_error([&] { rs.next(); }, path, bad_at,
                            "sample '" + key + "' goes on after the long-name or pax headers at offset " +
                                std::to_string(near + 512) +
                                ", which would take it past max_record_bytes (1048576)");
        const auto after = rs.next();
        REQUIRE(after);
        CHECK(ferry::parse_webdataset(*after).key == "a/2");
        CHECK(!rs.next());
      }
    }
    // A pax size applies to the member, not to a long name between them.
    tar_writer p;
    const std::string rec = tar_writer::pax_record("size", "3");
    p.out += tar_writer::header("PaxHeaders/x", rec.size(), 'x') + tar_writer::padded(rec);
    const std::string longname = std::string(110, 'd') + "/1.jpg";
    p.out += tar_writer::header("././@LongLink", longname.size() + 1, 'L') + tar_writer::padded(longname + '\0');
    p.out += tar_writer::header(longname.substr(0, 100), 3, '0') + tar_writer::padded("abc");
    p.end();
    write_file(path, p.out);
    auto ps = ferry::from_files({path}, ferry::webdataset{});
    const auto smp = ferry::parse_webdataset(*ps.next());
    CHECK(smp.key == std::string(110, 'd') + "/1");
    CHECK(smp.at("jpg").str() == "abc");
  }
  SUBCASE("bytes after the end-of-archive zero blocks end the file, as plain tar stops there") {
    tar_writer w;
    w.add("a/1.jpg", "one");
    w.add("a/2.jpg", "two");
    w.end();
    tar_writer next;
    next.add("b/1.jpg", "three");
    next.end();
    for (const std::string& trailer : {std::string("\n"), std::string(700, 'g'), std::string(511, '\0') + "x",
                                       std::string(1024, '\0') + std::string(512, '\xff'), next.out}) {
      CAPTURE(trailer.size());
      write_file(path, w.out + trailer);
      auto src = ferry::from_files({path}, ferry::webdataset{});
      std::vector<std::string> keys;
      while (auto r = src.next()) keys.push_back(ferry::parse_webdataset(*r).key);
      CHECK(keys == (trailer == next.out ? std::vector<std::string>{"a/1", "a/2", "b/1"}
                                         : std::vector<std::string>{"a/1", "a/2"}));
    }
    // Without a zero block before it, a damaged header stays an error (see above).
    write_file(path, w.out.substr(0, 2048) + std::string(512, 'g'));
    auto src = ferry::from_files({path}, ferry::webdataset{});
    CHECK(src.next());
    CHECK(src.next());
    expect_format_error([&] { src.next(); }, path, 2048, "not a tar header");
  }
  SUBCASE("a damaged header of an archive after the end-of-archive blocks is a format_error, not the end") {
    tar_writer w;
    w.add("a/1.jpg", "one");
    w.end();
    tar_writer next;
    next.add("c/3.jpg", "three");
    next.end();
    std::string bytes = w.out + next.out;
    bytes[w.out.size()] = 'C';  // the second archive's first name: its checksum no longer matches
    write_file(path, bytes);
    auto src = ferry::from_files({path}, ferry::webdataset{});
    CHECK(ferry::parse_webdataset(*src.next()).key == "a/1");
    expect_format_error([&] { src.next(); }, path, w.out.size(), "checksum mismatch), after the end-of-archive zero blocks");
  }
  SUBCASE("a sample larger than max_record_bytes is one bad record: skip loses it alone, raise reads on after it") {
    tar_writer w;
    w.add("a/1.jpg", "one");
    const std::size_t b_at = w.add("b/2.jpg", std::string(300, 'b'));
    w.add("README", std::string(100, 'r'));  // no sample data, inside b/2's span
    const std::size_t big_at = w.add("b/2.cls", std::string(6000, 'x'));
    w.add("b/2.txt", "after the big one");
    w.add("c/3.jpg", "three");
    w.add("d/4.jpg", "four");
    w.end();
    write_file(path, w.out);
    for (const std::size_t chunk : {std::size_t(512), std::size_t(4096), std::size_t(1) << 20}) {
      CAPTURE(chunk);
      auto skip = ferry::from_files({path}, ferry::webdataset{},
                                    {.on_error = ferry::error_policy::skip, .on_skip = [](const ferry::skipped_record&) {},
                                     .chunk_bytes = chunk, .max_record_bytes = 4096});
      std::vector<std::string> keys;
      while (auto r = skip.next()) keys.push_back(ferry::parse_webdataset(*r).key);
      CHECK(keys == std::vector<std::string>{"a/1", "c/3", "d/4"});
      CHECK(skip.skipped() == 1);
      auto raise = ferry::from_files({path}, ferry::webdataset{}, {.chunk_bytes = chunk, .max_record_bytes = 4096});
      CHECK(ferry::parse_webdataset(*raise.next()).key == "a/1");
      expect_format_error([&] { raise.next(); }, path, b_at,
                          "sample 'b/2' is larger than max_record_bytes (4096): its member 'b/2.cls' (6000 bytes, "
                          "header at offset " + std::to_string(big_at) + ")");
      CHECK(ferry::parse_webdataset(*raise.next()).key == "c/3");
      CHECK(ferry::parse_webdataset(*raise.next()).key == "d/4");
      CHECK_FALSE(raise.next());
    }
    // The first member alone too large, at the file's start and at its end.
    tar_writer f;
    f.add("z/0.bin", std::string(5000, 'z'));
    f.add("y/1.jpg", "one");
    f.add("x/2.bin", std::string(5000, 'x'));
    f.end();
    write_file(path, f.out);
    auto skip = ferry::from_files({path}, ferry::webdataset{},
                                  {.on_error = ferry::error_policy::skip, .on_skip = [](const ferry::skipped_record&) {},
                                   .max_record_bytes = 4096});
    std::vector<std::string> keys;
    while (auto r = skip.next()) keys.push_back(ferry::parse_webdataset(*r).key);
    CHECK(keys == std::vector<std::string>{"y/1"});
    CHECK(skip.skipped() == 2);
  }
  SUBCASE("sparse members (GNU tar --sparse) are a format_error, never passed over or read as data") {
    tar_writer w;
    w.add("a/1.jpg", "one");
    const std::size_t s_at = w.out.size();
    w.out += tar_writer::header("b/2.bin", 512, 'S') + std::string(512, '\0');
    w.add("b/2.cls", "2");
    w.end();
    write_file(path, w.out);
    auto src = ferry::from_files({path}, ferry::webdataset{});
    CHECK(ferry::parse_webdataset(*src.next()).key == "a/1");
    expect_format_error([&] { src.next(); }, path, s_at, "a sparse member 'b/2.bin' (GNU tar --sparse)");
    tar_writer p;
    const std::string rec = tar_writer::pax_record("GNU.sparse.major", "1") + tar_writer::pax_record("GNU.sparse.minor", "0");
    p.out += tar_writer::header("PaxHeaders/x", rec.size(), 'x') + tar_writer::padded(rec);
    p.add("d/GNUSparseFile.0/000006.bin", std::string(512, '\0'));
    p.end();
    write_file(path, p.out);
    expect_format_error([&] { ferry::from_files({path}, ferry::webdataset{}).next(); }, path, 0,
                        "a sparse member (GNU tar --sparse, pax GNU.sparse.major)");
    // GNU tar's own, where it is installed: a 2 MiB file with a hole.
    if (std::system("tar --version > /dev/null 2>&1") == 0) {
      std::filesystem::create_directories(d / "sparse/d");
      write_file(d / "sparse/d/000006.cls", "6");
      std::filesystem::resize_file(d / "sparse/d/000006.cls", 1);
      {
        std::FILE* fh = std::fopen((d / "sparse/d/000006.bin").c_str(), "wb");
        std::fseek(fh, 2 << 20, SEEK_SET);
        std::fputc('x', fh);
        std::fclose(fh);
      }
      for (const std::string fmt : {"gnu", "pax"}) {
        CAPTURE(fmt);
        const std::string tar = d / ("sparse-" + fmt + ".tar");
        const std::string cmd = "tar --sparse --format=" + fmt + " --sort=name -C " + (d / "sparse") + " -cf " + tar + " d";
        REQUIRE(std::system(cmd.c_str()) == 0);
        try {
          auto s = ferry::from_files({tar}, ferry::webdataset{});
          while (s.next()) {
          }
          FAIL("a sparse member read without an error");
        } catch (const ferry::format_error& e) {
          CHECK(std::string(e.what()).find("sparse member") != std::string::npos);
        }
      }
    }
  }
  SUBCASE(".tgz shards are inflated, as .tar.gz ones") {
    tar_writer w;
    w.add("a/1.jpg", "one");
    w.add("a/1.cls", "1");
    w.end();
    const std::string tgz = d / "shard.tgz";
    write_gzip(tgz, w.out);
    auto src = ferry::from_files({tgz}, ferry::webdataset{});
    CHECK(ferry::parse_webdataset(*src.next()).at("cls").str() == "1");
    CHECK_FALSE(src.next());
  }
  SUBCASE("a member header lost to zeros (one zero block, then its data) is a format_error there, not the end") {
    tar_writer w;
    w.add("s0.cls", "0");
    const std::size_t at = w.add("s1.cls", "1");
    w.add("s2.cls", "2");
    w.end();
    std::fill(w.out.begin() + std::ptrdiff_t(at), w.out.begin() + std::ptrdiff_t(at + 512), '\0');
    write_file(path, w.out);
    auto src = ferry::from_files({path}, ferry::webdataset{});
    CHECK(ferry::parse_webdataset(*src.next()).key == "s0");
    expect_format_error([&] { src.next(); }, path, at + 512, "after a lone zero block (a member's header lost to zeros?)");
    // Under skip the rest of the file is one error, counted: not a silent end.
    auto skip = ferry::from_files({path}, ferry::webdataset{},
                                  {.on_error = ferry::error_policy::skip, .on_skip = [](const ferry::skipped_record&) {}});
    std::size_t n = 0;
    while (skip.next()) ++n;
    CHECK(n == 1);
    CHECK(skip.skipped() == 1);
  }
  SUBCASE("a pax header of 70 KB (an xattr) is read: only max_record_bytes bounds it") {
    tar_writer w;
    w.add("a/1.jpg", "one");
    const std::string rec = tar_writer::pax_record("SCHILY.xattr.user.big", std::string(70000, 'x'));
    w.out += tar_writer::header("PaxHeaders/b", rec.size(), 'x') + tar_writer::padded(rec);
    w.add("b/1.jpg", "two");
    w.add("b/1.cls", "2");
    w.end();
    write_file(path, w.out);
    auto src = ferry::from_files({path}, ferry::webdataset{}, {.chunk_bytes = 4096});
    std::vector<std::string> got;
    while (auto r = src.next()) {
      const auto smp = ferry::parse_webdataset(*r);
      got.push_back(smp.key + ":" + std::to_string(smp.members.size()));
    }
    CHECK(got == std::vector<std::string>{"a/1:1", "b/1:2"});
    auto small = ferry::from_files({path}, ferry::webdataset{}, {.max_record_bytes = 60000});
    CHECK(small.next());  // a/1 ends before the pax header
    expect_format_error([&] { small.next(); }, path, 1024, "long-name or pax headers reaching past max_record_bytes (60000)");
  }
  SUBCASE("base-256 sizes, archives one after another, empty and all-zero files") {
    tar_writer a, b;
    a.add("x/1.jpg", "first", '0', 'L', true);
    a.end();
    b.add("x/2.jpg", "second");
    b.end();
    write_file(path, a.out + std::string(10240, '\0') + b.out);
    const std::string empty = d / "empty.tar", zeros = d / "zeros.tar";
    write_file(empty, "");
    write_file(zeros, std::string(1536, '\0'));
    auto src = ferry::from_files({empty, path, zeros}, ferry::webdataset{});
    std::vector<std::string> got;
    while (auto r = src.next()) got.emplace_back(ferry::parse_webdataset(*r).at("jpg").str());
    CHECK(got == std::vector<std::string>{"first", "second"});
  }
  SUBCASE("parse_webdataset of bytes that are not one sample; at() of a missing member") {
    const std::string text = "not a tar at all, but long enough to fill one header block" + std::string(600, '.');
    auto bytes = std::make_shared<std::string>(text);
    const ferry::record r(std::shared_ptr<const std::byte>(bytes, reinterpret_cast<const std::byte*>(bytes->data())),
                          bytes->size());
    CHECK_THROWS_WITH_AS(ferry::parse_webdataset(r), doctest::Contains("not a tar header"), ferry::format_error);
    tar_writer w;
    w.add("k/1.jpg", "j");
    w.add("k/2.jpg", "j");
    auto two = std::make_shared<std::string>(w.out);
    const ferry::record r2(std::shared_ptr<const std::byte>(two, reinterpret_cast<const std::byte*>(two->data())),
                           two->size());
    CHECK_THROWS_WITH_AS(ferry::parse_webdataset(r2), doctest::Contains("is not of sample 'k/1'"), ferry::format_error);
    tar_writer one;
    one.add("k/1.jpg", "j");
    write_file(path, one.out);
    auto src = ferry::from_files({path}, ferry::webdataset{});
    const auto s = ferry::parse_webdataset(*src.next());
    expect_format_error([&] { (void)s.at("cls"); }, path, 0, "sample 'k/1' has no member '.cls' (it has jpg)");
  }
  (void)g;
}

TEST_CASE("webdataset: records know their epoch; a resume continues at the sample") {
  std::mt19937_64 g(11);
  temp_dir d;
  std::vector<std::string> paths;
  std::vector<want_sample> want;
  for (int f = 0; f < 2; ++f) {
    paths.push_back(d / ("s" + std::to_string(f) + ".tar"));
    archive a = make_archive(g, paths.back(), 6);
    write_file(paths.back(), a.bytes);
    want.insert(want.end(), a.samples.begin(), a.samples.end());
  }
  auto src = ferry::from_files(paths, ferry::webdataset{}, {.shuffle_files = true, .shuffle_seed = 3});
  for (std::uint32_t epoch = 0; epoch < 3; ++epoch) {
    std::size_t n = 0;
    while (auto r = src.next()) {
      CHECK(r->origin().epoch == epoch);
      CHECK(ferry::parse_webdataset(*r).members.front().data.origin().epoch == epoch);
      ++n;
    }
    CHECK(n == want.size());
    src.rewind();
  }
  auto il = ferry::from_files(paths, ferry::webdataset{}) | ferry::interleave(2, {.workers = 2});
  for (std::uint32_t epoch = 0; epoch < 2; ++epoch) {
    while (auto r = il.next()) CHECK(r->origin().epoch == epoch);
    il.rewind();
  }
  // Resume after every sample: the rest is what a full read gives.
  for (std::size_t k = 0; k <= want.size(); ++k) {
    CAPTURE(k);
    auto a = ferry::from_files(paths, ferry::webdataset{}, {.chunk_bytes = 512});
    for (std::size_t i = 0; i < k; ++i) REQUIRE(a.next());
    const ferry::pipeline_state st = ferry::save_state(a);
    auto b = ferry::from_files(paths, ferry::webdataset{});
    ferry::restore_state(b, ferry::pipeline_state::from_bytes(st.to_bytes()));
    const auto rest = read_samples(b);
    check_same(rest, std::vector<want_sample>(want.begin() + std::ptrdiff_t(k), want.end()));
  }
}
