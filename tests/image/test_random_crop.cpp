// decode_random_crop (ferry/image/random_crop.hpp) in a pipeline: WebDataset shards of
// JPEGs through map with 1 and 3 workers, ordered and not, across epochs and a resume. The
// crops must depend on (seed, epoch, element) alone; the draw must follow torchvision's
// ranges; a bad JPEG names its tar file and offset.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ferry/detail/random.hpp"
#include "ferry/image/random_crop.hpp"
#include "ferry/sources/example.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/sources/webdataset.hpp"
#include "ferry/stages/map.hpp"
#include "ferry/state.hpp"
#include "sources/helpers.hpp"

namespace {

namespace fi = ferry::image;
using crop = fi::decode_random_crop<24, 32, 3>;

// A small JPEG of smooth colours (so that crops differ visibly), w x h.
std::string jpeg_of(std::uint32_t w, std::uint32_t h, std::uint64_t seed) {
  std::vector<std::uint8_t> px(std::size_t(w) * h * 3);
  for (std::uint32_t y = 0; y < h; ++y)
    for (std::uint32_t x = 0; x < w; ++x)
      for (std::uint32_t c = 0; c < 3; ++c)
        px[(std::size_t(y) * w + x) * 3 + c] = std::uint8_t((x * (3 + c) + y * (5 + seed % 7) + c * 40) & 0xff);
  const auto b = fi::encode_jpeg({px.data(), w, h, 3, std::size_t(w) * 3}, {.quality = 95});
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

struct shards {
  src_test::temp_dir dir;
  std::vector<std::string> paths;
  std::size_t count = 0;
  explicit shards(int files = 3, int per = 7) {
    for (int f = 0; f < files; ++f) {
      src_test::tar_writer w;
      for (int i = 0; i < per; ++i, ++count) {
        const std::string key = std::to_string(1000 + count);
        w.add(key + ".jpg", jpeg_of(64 + 8 * std::uint32_t(i), 48 + 4 * std::uint32_t(f), count));
        w.add(key + ".cls", std::to_string(count % 10));
      }
      w.end();
      paths.push_back(dir / ("shard-" + std::to_string(f) + ".tar"));
      src_test::write_file(paths.back(), w.out);
    }
  }
};

using result = std::map<std::string, crop::pixels>;  // key -> crop

// One epoch of crops per sample key, through map with `workers` threads.
template <class Src>
result epoch_of(Src& src) {
  result out;
  while (auto e = src.next()) out[e->first] = e->second;
  return out;
}
auto pipeline(const shards& s, std::uint64_t seed, std::size_t workers, bool ordered) {
  return ferry::from_files(s.paths, ferry::webdataset{}) |
         ferry::map(
             [c = crop({.seed = seed})](const ferry::record& r) {
               const auto smp = ferry::parse_webdataset(r);
               return std::pair{smp.key, c(smp.at("jpg"))};
             },
             {.workers = workers, .ordered = ordered});
}

}  // namespace

TEST_CASE("decode_random_crop: the crop depends on (seed, epoch, element), not on workers or order") {
  shards s;
  auto one = pipeline(s, 7, 1, true);
  auto three = pipeline(s, 7, 3, false);
  auto other_seed = pipeline(s, 8, 1, true);
  std::vector<result> epochs;
  for (int e = 0; e < 3; ++e) {
    result a = epoch_of(one), b = epoch_of(three);
    REQUIRE(a.size() == s.count);
    CHECK(a == b);
    epochs.push_back(a);
    one.rewind();
    three.rewind();
  }
  // A new epoch, or another seed, draws anew: most crops differ.
  const auto differ = [](const result& x, const result& y) {
    std::size_t n = 0;
    for (const auto& [k, v] : x) n += y.at(k) != v;
    return n;
  };
  CHECK(differ(epochs[0], epochs[1]) >= s.count * 3 / 4);
  CHECK(differ(epochs[1], epochs[2]) >= s.count * 3 / 4);
  CHECK(differ(epochs[0], epoch_of(other_seed)) >= s.count * 3 / 4);
  // The draw is decode_jpeg_crop of draw_crop(element_key): the same pixels by hand.
  auto src = ferry::from_files(s.paths, ferry::webdataset{});
  const auto smp = ferry::parse_webdataset(*src.next());
  const ferry::record& jpg = smp.at("jpg");
  const fi::jpeg_info h = fi::read_jpeg_header(jpg.bytes());
  const fi::crop_draw d = fi::draw_crop(fi::element_key(7, jpg), h.width, h.height, crop({.seed = 7}).options());
  crop::pixels by_hand;
  fi::decode_jpeg_crop(jpg.bytes(), d.win, {24, 32, 3, d.flip}, by_hand);
  CHECK(by_hand == epochs[0].at(smp.key));
}

TEST_CASE("decode_random_crop: a resumed epoch draws what the uninterrupted one drew") {
  shards s(2, 6);
  auto full = pipeline(s, 3, 1, true);
  (void)epoch_of(full);  // epoch 0
  full.rewind();
  const result want = epoch_of(full);  // epoch 1
  for (std::size_t k : {std::size_t(0), std::size_t(5), s.count - 1}) {
    CAPTURE(k);
    auto a = pipeline(s, 3, 2, true);
    (void)epoch_of(a);
    a.rewind();
    result got;
    for (std::size_t i = 0; i < k; ++i) {
      auto e = a.next();
      got[e->first] = e->second;
    }
    const auto st = ferry::save_state(a);
    auto b = pipeline(s, 3, 3, true);
    ferry::restore_state(b, ferry::pipeline_state::from_bytes(st.to_bytes()));
    for (auto& [key, px] : epoch_of(b)) got[key] = px;
    CHECK(got == want);
  }
}

TEST_CASE("decode_random_crop: draws follow RandomResizedCrop's ranges and the flip chance") {
  const fi::random_crop_options o{.seed = 1, .flip = 0.3};
  std::size_t flips = 0, n = 4000;
  for (std::uint64_t k = 0; k < n; ++k) {
    const fi::crop_draw d = fi::draw_crop(ferry::detail::mix_seed({k}), 500, 375, o);
    CAPTURE(k);
    REQUIRE(d.win.left + d.win.width <= 500);
    REQUIRE(d.win.top + d.win.height <= 375);
    const double area = double(d.win.width) * d.win.height / (500.0 * 375.0);
    const double ratio = double(d.win.width) / d.win.height;
    // Within the ranges, up to rounding of a side to whole pixels (or the centre fallback).
    CHECK(area <= 1.0);
    CHECK(area >= 0.079);
    CHECK(ratio >= 0.74);
    CHECK(ratio <= 500.0 / 375.0 + 0.01);
    flips += d.flip;
  }
  CHECK(double(flips) / double(n) == doctest::Approx(0.3).epsilon(0.1));
  CHECK_THROWS_AS(crop({.scale_lo = 0, .scale_hi = 1}), ferry::config_error);
  CHECK_THROWS_AS(crop({.scale_lo = 0.5, .scale_hi = 0.4}), ferry::config_error);
  CHECK_THROWS_AS(crop({.ratio_lo = 2, .ratio_hi = 1}), ferry::config_error);
  CHECK_THROWS_AS(crop({.flip = 1.5}), ferry::config_error);
}

TEST_CASE("decode_random_crop: a bad JPEG names its tar file and the byte offset in it") {
  src_test::temp_dir dir;
  src_test::tar_writer w;
  w.add("a.jpg", jpeg_of(40, 30, 1));
  std::string bad = jpeg_of(40, 30, 2);
  bad.resize(bad.size() / 2);  // truncated
  const std::size_t at = w.add("b.jpg", bad);
  w.add("c.jpg", "not a jpeg at all");
  w.end();
  const std::string path = dir / "bad.tar";
  src_test::write_file(path, w.out);
  auto src = ferry::from_files({path}, ferry::webdataset{});
  const crop c({.seed = 1});
  CHECK_NOTHROW(c(ferry::parse_webdataset(*src.next()).at("jpg")));
  for (int i = 0; i < 2; ++i) {
    const auto smp = ferry::parse_webdataset(*src.next());
    try {
      (void)c(smp.at("jpg"));
      FAIL("no error");
    } catch (const ferry::format_error& e) {
      CHECK(e.path() == path);
      CHECK(e.offset() >= smp.at("jpg").origin().data_offset);
      CHECK(e.offset() <= smp.at("jpg").origin().data_offset + smp.at("jpg").size());
      CHECK(std::string(e.what()).find("JPEG: ") != std::string::npos);
      if (i == 0) CHECK(smp.at("jpg").origin().offset == at);
    }
  }
}

TEST_CASE("decode_random_crop: a JPEG cut near its end fails in every epoch, not only where the crop reaches") {
  // The fused crop decodes no row below its window; a cut below some windows must not let
  // those epochs through.
  std::string jpg = jpeg_of(320, 240, 4);
  jpg.resize(jpg.size() * 19 / 20);
  const crop c({.seed = 3});
  int errors = 0;
  for (std::uint64_t key = 0; key < 100; ++key) {
    try {
      (void)c({reinterpret_cast<const std::byte*>(jpg.data()), jpg.size()}, key);
    } catch (const ferry::format_error& e) {
      CHECK(e.offset() == jpg.size());
      ++errors;
    }
  }
  CHECK(errors == 100);
}

namespace {
// protobuf's length-delimited field: tag, varint length, bytes.
std::string varint(std::uint64_t v) {
  std::string s;
  for (; v >= 0x80; v >>= 7) s += char(0x80 | (v & 0x7f));
  return s + char(v);
}
std::string field(int number, const std::string& body) { return varint(std::uint64_t(number) << 3 | 2) + varint(body.size()) + body; }
// A tf.train.Example {"image/encoded": bytes_list [jpeg], "label": int64_list [label]}.
std::string example_of(const std::string& jpeg, int label) {
  const std::string image = field(1, field(1, "image/encoded") + field(2, field(1, field(1, jpeg))));
  const std::string lab = field(1, field(1, "label") + field(2, field(3, field(1, varint(std::uint64_t(label))))));
  return field(1, image + lab);
}
}  // namespace

TEST_CASE("decode_random_crop: a JPEG inside a tf.train.Example, keyed by its record") {
  src_test::temp_dir dir;
  std::string file;
  std::vector<std::string> jpegs;
  for (int i = 0; i < 6; ++i) {
    jpegs.push_back(jpeg_of(48 + 8 * std::uint32_t(i), 40, std::uint64_t(i)));
    file += src_test::tfrecord_of(example_of(jpegs.back(), i));
  }
  std::string bad = jpeg_of(40, 30, 9);
  bad.resize(bad.size() / 2);
  file += src_test::tfrecord_of(example_of(bad, 6));
  const std::string path = dir / "ex.tfrecord";
  src_test::write_file(path, file);
  const crop c({.seed = 5});
  for (int epoch = 0; epoch < 2; ++epoch) {
    auto src = ferry::from_files({path}, ferry::tfrecord{});
    for (int e = 0; e < epoch; ++e) {
      while (src.next()) {
      }
      src.rewind();
    }
    for (int i = 0; i < 6; ++i) {
      const ferry::record r = *src.next();
      const ferry::example ex = ferry::parse_example(r);
      const crop::pixels got = c(r, ex.bytes("image/encoded")[0]);
      CHECK(ex.int64s("label")[0] == i);
      // The draw is keyed on the record (its file, offset and epoch), the pixels are the
      // embedded JPEG's.
      const std::span<const std::byte> b(reinterpret_cast<const std::byte*>(jpegs[std::size_t(i)].data()),
                                         jpegs[std::size_t(i)].size());
      CHECK(got == c(b, fi::element_key(5, r)));
      CHECK(r.origin().epoch == std::uint32_t(epoch));
    }
    const ferry::record r = *src.next();
    const ferry::example ex = ferry::parse_example(r);
    const std::string_view jb = ex.bytes("image/encoded")[0];
    try {
      (void)c(r, jb);
      FAIL("no error");
    } catch (const ferry::format_error& e) {
      CHECK(e.path() == path);
      const std::uint64_t at = r.origin().data_offset + std::uint64_t(reinterpret_cast<const std::byte*>(jb.data()) - r.data());
      CHECK(e.offset() >= at);
      CHECK(e.offset() <= at + jb.size());
      // Exactly: where the JPEG starts in the file plus where libjpeg stopped in it (a
      // mutant that left out the JPEG's place in the record passed the bounds above).
      const std::span<const std::byte> alone(reinterpret_cast<const std::byte*>(jb.data()), jb.size());
      try {
        (void)c(alone, fi::element_key(5, r));
        FAIL("no error decoding the cut JPEG alone");
      } catch (const ferry::format_error& inner) {
        CHECK(e.offset() == at + inner.offset());
      }
    }
  }
}

// Found by mutation testing (a changed bound, a check or a saved field dropped, each passing
// the suite before): every left and top offset must be drawable (an offset range one short
// never reached the last column).
TEST_CASE("random_resized_crop: every left and top offset is drawn") {
  std::map<std::uint32_t, int> lefts, tops;
  for (std::uint64_t s = 1; s <= 2000; ++s) {
    ferry::detail::splitmix64 g(s);
    const auto c = ferry::image::random_resized_crop(8, 8, g, 0.25, 0.25, 1.0, 1.0);
    REQUIRE(c.width == 4);
    ++lefts[c.left], ++tops[c.top];
  }
  CHECK(lefts.size() == 5);
  CHECK(tops.size() == 5);
  CHECK(lefts.rbegin()->first == 4);
  CHECK(tops.rbegin()->first == 4);
}

// The draw is keyed on the file's base name, not its path ("ranks that mount the data at
// different places draw alike"): a mutant keyed on the whole path passed every test.
TEST_CASE("decode_random_crop: one shard under two mount points draws the same crops; another name, others") {
  src_test::temp_dir dir;
  src_test::tar_writer w;
  for (int i = 0; i < 5; ++i) {
    w.add(std::to_string(100 + i) + ".jpg", jpeg_of(96, 72, std::uint64_t(i)));
    w.add(std::to_string(100 + i) + ".cls", "1");
  }
  w.end();
  std::filesystem::create_directories(dir / "mnt-a/data");
  std::filesystem::create_directories(dir / "mnt-b");
  for (const std::string& p : {dir / "mnt-a/data/shard.tar", dir / "mnt-b/shard.tar", dir / "mnt-b/other.tar"})
    src_test::write_file(p, w.out);
  auto crops_of = [](const std::string& path) {
    auto p = ferry::from_files({path}, ferry::webdataset{}) |
             ferry::map([c = crop({.seed = 3})](const ferry::record& r) {
               const auto smp = ferry::parse_webdataset(r);
               return std::pair{smp.key, c(smp.at("jpg"))};
             });
    return epoch_of(p);
  };
  const result a = crops_of(dir / "mnt-a/data/shard.tar"), b = crops_of(dir / "mnt-b/shard.tar"),
               other = crops_of(dir / "mnt-b/other.tar");
  REQUIRE(a.size() == 5);
  CHECK(a == b);
  std::size_t differ = 0;
  for (const auto& [key, px] : a) differ += other.at(key) != px;
  CHECK(differ >= 4);  // another name, another key: the crops move (five draws all alike by chance: never)
}
