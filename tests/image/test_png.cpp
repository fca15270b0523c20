// PNG decoding (ferry/image/png.hpp) on files this test writes itself with zlib, not with
// libspng (so the decoder is not checked against its own encoder): every colour type and
// bit depth, Adam7 interlacing, all five row filters, several IDAT chunks. Full decodes
// against the samples encoded (exact); 16-bit to 8-bit by the high byte; the crop against a
// naive oracle; and bad input: not a PNG, every truncation of a file, CRC mismatches in
// critical and ancillary chunks, headers claiming 0x0 or 100000x100000 pixels (crafted
// with correct CRCs), metadata over the chunk limits, bad channels, windows and outputs.
#include <doctest/doctest.h>

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "ferry/detail/random.hpp"
#include "ferry/error.hpp"
#include "ferry/image/png.hpp"
#include "image/crop_oracle.hpp"

namespace {

namespace fi = ferry::image;
using image_test::crop_resize;
using bytes_t = std::vector<std::byte>;

// What to write: PNG's colour type and bit depth, and one sample value (below 2^depth)
// for each channel of each pixel, rows top to bottom.
struct png_spec {
  std::uint32_t width = 0, height = 0;
  int depth = 8;
  int colour = 2;  // 0 grey, 2 RGB, 3 palette, 4 grey+alpha, 6 RGBA
  bool interlaced = false;
  std::vector<std::uint16_t> samples;           // height * width * channels(colour)
  std::vector<std::array<std::uint8_t, 3>> palette;
  std::vector<std::uint8_t> palette_alpha;      // a tRNS chunk, when not empty
  std::size_t idat_size = 64;                   // the zlib stream split into IDATs of this size
};

std::uint32_t u32(const std::byte* p) {  // big-endian, as PNG stores it
  return std::uint32_t(p[0]) << 24 | std::uint32_t(p[1]) << 16 | std::uint32_t(p[2]) << 8 | std::uint32_t(p[3]);
}

int channels_of(int colour) { return colour == 2 ? 3 : colour == 4 ? 2 : colour == 6 ? 4 : 1; }

void put32(bytes_t& b, std::uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) b.push_back(std::byte(v >> s));
}

// A chunk: length, type, data, CRC-32 of type and data (zlib's crc32 is PNG's).
void put_chunk(bytes_t& b, const char* type, const std::vector<std::uint8_t>& data) {
  put32(b, std::uint32_t(data.size()));
  const std::size_t at = b.size();
  for (int i = 0; i < 4; ++i) b.push_back(std::byte(type[i]));
  for (std::uint8_t v : data) b.push_back(std::byte(v));
  put32(b, std::uint32_t(crc32(0, reinterpret_cast<const Bytef*>(b.data() + at), uInt(b.size() - at))));
}

std::vector<std::uint8_t> ihdr_data(std::uint32_t w, std::uint32_t h, int depth, int colour, bool interlaced) {
  std::vector<std::uint8_t> d;
  for (std::uint32_t v : {w, h})
    for (int s = 24; s >= 0; s -= 8) d.push_back(std::uint8_t(v >> s));
  d.insert(d.end(), {std::uint8_t(depth), std::uint8_t(colour), 0, 0, std::uint8_t(interlaced)});
  return d;
}

int paeth(int a, int b, int c) {
  const int p = a + b - c, pa = std::abs(p - a), pb = std::abs(p - b), pc = std::abs(p - c);
  return pa <= pb && pa <= pc ? a : pb <= pc ? b : c;
}

// The filtered scanlines of the sub-image x0 + i*dx, y0 + j*dy (an Adam7 pass, or the whole
// image), row j with filter j % 5: none, sub, up, average, Paeth.
void put_pass(std::vector<std::uint8_t>& out, const png_spec& s, std::uint32_t x0, std::uint32_t y0, std::uint32_t dx,
              std::uint32_t dy) {
  if (x0 >= s.width || y0 >= s.height) return;  // an empty pass has no rows at all
  const int C = channels_of(s.colour);
  const std::uint32_t pw = (s.width - x0 + dx - 1) / dx;
  const std::size_t row_bytes = (std::size_t(pw) * C * s.depth + 7) / 8;
  const std::size_t bpp = std::max(1, C * s.depth / 8);
  std::vector<std::uint8_t> prev(row_bytes, 0), cur(row_bytes);
  for (std::uint32_t j = 0, y = y0; y < s.height; ++j, y += dy) {
    std::fill(cur.begin(), cur.end(), 0);
    std::size_t bit = 0;
    for (std::uint32_t i = 0, x = x0; x < s.width; ++i, x += dx)
      for (int c = 0; c < C; ++c) {
        const std::uint16_t v = s.samples[(std::size_t(y) * s.width + x) * C + c];
        if (s.depth == 16) {
          cur[bit / 8] = std::uint8_t(v >> 8), cur[bit / 8 + 1] = std::uint8_t(v);
        } else {  // packed from the most significant bit
          cur[bit / 8] |= std::uint8_t(v << (8 - s.depth - bit % 8));
        }
        bit += std::size_t(s.depth);
      }
    const int f = int(j % 5);
    out.push_back(std::uint8_t(f));
    for (std::size_t k = 0; k < row_bytes; ++k) {
      const int a = k >= bpp ? cur[k - bpp] : 0, b = prev[k], c = k >= bpp ? prev[k - bpp] : 0;
      const int pred = f == 0 ? 0 : f == 1 ? a : f == 2 ? b : f == 3 ? (a + b) / 2 : paeth(a, b, c);
      out.push_back(std::uint8_t(cur[k] - pred));
    }
    std::swap(prev, cur);
  }
}

bytes_t encode_png(const png_spec& s) {
  std::vector<std::uint8_t> raw;
  if (s.interlaced) {
    constexpr std::uint32_t adam7[7][4] = {{0, 0, 8, 8}, {4, 0, 8, 8}, {0, 4, 4, 8}, {2, 0, 4, 4},
                                           {0, 2, 2, 4}, {1, 0, 2, 2}, {0, 1, 1, 2}};
    for (const auto& p : adam7) put_pass(raw, s, p[0], p[1], p[2], p[3]);
  } else {
    put_pass(raw, s, 0, 0, 1, 1);
  }
  uLongf zlen = compressBound(uLong(raw.size()));
  std::vector<std::uint8_t> z(zlen);
  const int zr = compress2(z.data(), &zlen, raw.data(), uLong(raw.size()), 9);
  REQUIRE(zr == Z_OK);
  z.resize(zlen);
  bytes_t b;
  for (int v : {0x89, 0x50, 0x4E, 0x47, 0x0D, 0x0A, 0x1A, 0x0A}) b.push_back(std::byte(v));  // the signature
  put_chunk(b, "IHDR", ihdr_data(s.width, s.height, s.depth, s.colour, s.interlaced));
  if (!s.palette.empty()) {
    std::vector<std::uint8_t> p;
    for (const auto& e : s.palette) p.insert(p.end(), e.begin(), e.end());
    put_chunk(b, "PLTE", p);
  }
  if (!s.palette_alpha.empty()) put_chunk(b, "tRNS", s.palette_alpha);
  for (std::size_t at = 0; at < z.size(); at += s.idat_size)
    put_chunk(b, "IDAT", std::vector<std::uint8_t>(z.begin() + std::ptrdiff_t(at),
                                                   z.begin() + std::ptrdiff_t(std::min(z.size(), at + s.idat_size))));
  put_chunk(b, "IEND", {});
  return b;
}

// A random image of the given type; palette files get a random palette of 2^depth entries
// (up to 256) and alpha for some of them.
png_spec random_png(std::uint32_t w, std::uint32_t h, int depth, int colour, bool interlaced, std::uint64_t seed) {
  ferry::detail::splitmix64 g(seed);
  png_spec s{w, h, depth, colour, interlaced, {}, {}, {}, 64};
  const std::uint64_t top = std::uint64_t(1) << depth;
  s.samples.resize(std::size_t(w) * h * channels_of(colour));
  for (auto& v : s.samples) v = std::uint16_t(g.below(top));
  if (colour == 3) {
    s.palette.resize(std::size_t(std::min<std::uint64_t>(top, 256)));
    for (auto& e : s.palette)
      for (auto& c : e) c = std::uint8_t(g.below(256));
    s.palette_alpha.resize(s.palette.size() / 2, 7);
  }
  return s;
}

// What decode_png should give for s, as png.hpp documents it: 16-bit by the high byte,
// lower depths of grey by bit replication (v * 255 / (2^depth - 1)), palette looked up,
// alpha dropped; grey output as ITU-R 601 luma of that RGB.
std::vector<std::uint8_t> expected(const png_spec& s, std::uint32_t channels) {
  const int C = channels_of(s.colour);
  auto to8 = [&](std::uint16_t v) {
    return s.depth == 16 ? std::uint8_t(v >> 8) : std::uint8_t(v * 255 / ((1u << s.depth) - 1));
  };
  std::vector<std::uint8_t> o;
  for (std::size_t p = 0; p < std::size_t(s.width) * s.height; ++p) {
    const std::uint16_t* v = &s.samples[p * C];
    std::array<std::uint8_t, 3> rgb{};
    if (s.colour == 3)
      rgb = s.palette[v[0]];
    else if (s.colour == 0 || s.colour == 4)
      rgb = {to8(v[0]), to8(v[0]), to8(v[0])};
    else
      rgb = {to8(v[0]), to8(v[1]), to8(v[2])};
    if (channels == 3)
      o.insert(o.end(), rgb.begin(), rgb.end());
    else
      o.push_back(std::uint8_t((299 * rgb[0] + 587 * rgb[1] + 114 * rgb[2] + 500) / 1000));
  }
  return o;
}


// A smooth RGB picture (gradients and stripes), for the crop: 8-bit samples.
png_spec smooth_png(std::uint32_t w, std::uint32_t h, std::uint64_t seed, bool interlaced) {
  ferry::detail::splitmix64 g(seed);
  png_spec s{w, h, 8, 2, interlaced, {}, {}, {}, 4096};
  s.samples.resize(std::size_t(w) * h * 3);
  for (std::uint32_t y = 0; y < h; ++y)
    for (std::uint32_t x = 0; x < w; ++x)
      for (int c = 0; c < 3; ++c) {
        const double v = 128 + 90 * std::sin((x + 2 * y) * 0.05 + c) * std::cos(y * 0.03 - c) + double(g.below(9)) - 4;
        s.samples[(std::size_t(y) * w + x) * 3 + c] = std::uint16_t(std::clamp(v, 0.0, 255.0));
      }
  return s;
}

std::vector<std::uint8_t> cropped(const bytes_t& png, fi::crop_window win, fi::crop_output out) {
  std::vector<std::uint8_t> o(std::size_t(out.height) * out.width * out.channels);
  fi::decode_png_crop(png, win, out, o);
  return o;
}

// The offset of the first chunk of `type` in a file (its length field).
std::size_t find_chunk(const bytes_t& b, const char* type) {
  for (std::size_t p = 8; p + 8 <= b.size();) {
    if (std::memcmp(b.data() + p + 4, type, 4) == 0) return p;
    p += 12 + u32(b.data() + p);
  }
  FAIL("no such chunk");
  return 0;
}

// b with a chunk inserted before byte `at` (a chunk boundary).
bytes_t with_chunk(const bytes_t& b, std::size_t at, const char* type, const std::vector<std::uint8_t>& data) {
  bytes_t c;
  put_chunk(c, type, data);
  bytes_t r(b.begin(), b.begin() + std::ptrdiff_t(at));
  r.insert(r.end(), c.begin(), c.end());
  r.insert(r.end(), b.begin() + std::ptrdiff_t(at), b.end());
  return r;
}

}  // namespace

TEST_CASE("decode_png: every colour type and bit depth, plain and Adam7, gives the samples encoded") {
  struct type_t {
    int colour, depth;
  };
  const type_t types[] = {{0, 1}, {0, 2}, {0, 4}, {0, 8}, {0, 16}, {2, 8}, {2, 16}, {3, 1}, {3, 2},
                          {3, 4}, {3, 8}, {4, 8}, {4, 16}, {6, 8}, {6, 16}};
  const std::pair<std::uint32_t, std::uint32_t> sizes[] = {{1, 1}, {13, 7}, {3, 17}, {64, 48}, {33, 1}, {1, 9}};
  std::uint64_t seed = 1;
  fi::image img;  // reused across sizes: its buffer grows and shrinks
  for (const auto& t : types)
    for (const auto& size : sizes)
      for (bool interlaced : {false, true}) {
        const std::uint32_t w = size.first, h = size.second;  // (clang 14 captures no bindings)
        CAPTURE(t.colour);
        CAPTURE(t.depth);
        CAPTURE(w);
        CAPTURE(h);
        CAPTURE(interlaced);
        const png_spec s = random_png(w, h, t.depth, t.colour, interlaced, ++seed);
        const bytes_t png = encode_png(s);
        const fi::png_info info = fi::read_png_header(png);
        CHECK(info.width == w);
        CHECK(info.height == h);
        CHECK(info.bit_depth == t.depth);
        CHECK(int(info.colour_type) == t.colour);
        CHECK(info.interlaced == interlaced);
        for (std::uint32_t channels : {3u, 1u}) {
          fi::decode_png(png, img, channels);
          CHECK(img.width == w);
          CHECK(img.height == h);
          CHECK(img.channels == channels);
          CHECK(img.pixels == expected(s, channels));
        }
      }
}

TEST_CASE("decode_png: 16-bit samples become their high byte (v >> 8), not v / 257 rounded") {
  png_spec s{4, 1, 16, 0, false, {0x0000, 0xFF00, 0xFFFF, 0x017F}, {}, {}, 64};
  CHECK(fi::decode_png(encode_png(s), 1).pixels == std::vector<std::uint8_t>{0x00, 0xFF, 0xFF, 0x01});
  s = {2, 1, 16, 6, true, {0x12FF, 0x3480, 0x5601, 0x0000, 0xFFFF, 0xFF00, 0x00FF, 0x1234}, {}, {}, 64};
  CHECK(fi::decode_png(encode_png(s), 3).pixels == std::vector<std::uint8_t>{0x12, 0x34, 0x56, 0xFF, 0xFF, 0x00});
  // 0xFF00 / 257 = 254.0: rounding would give 254; the high byte is 255.
  CHECK(std::lround(0xFF00 / 257.0) == 254);
}

TEST_CASE("decode_png: alpha is dropped, not composited; a palette's tRNS too") {
  png_spec s{2, 1, 8, 6, false, {10, 20, 30, 0, 200, 100, 50, 128}, {}, {}, 64};
  CHECK(fi::decode_png(encode_png(s)).pixels == std::vector<std::uint8_t>{10, 20, 30, 200, 100, 50});
  png_spec p{3, 1, 8, 3, false, {0, 1, 2}, {{{1, 2, 3}}, {{4, 5, 6}}, {{7, 8, 9}}}, {0, 0, 0}, 64};
  CHECK(fi::decode_png(encode_png(p)).pixels == std::vector<std::uint8_t>{1, 2, 3, 4, 5, 6, 7, 8, 9});
}

TEST_CASE("decode_png_crop: resize_bilinear on the full decode, and the naive crop oracle") {
  ferry::detail::splitmix64 g(7);
  for (int t = 0; t < 30; ++t) {
    const std::uint32_t w = 8 + std::uint32_t(g.below(200)), h = 8 + std::uint32_t(g.below(200));
    const bytes_t png = encode_png(smooth_png(w, h, std::uint64_t(t), t % 2 == 1));
    const std::uint32_t channels = t % 3 == 2 ? 1 : 3;
    const fi::image full = fi::decode_png(png, channels);
    fi::crop_window win;
    win.width = 1 + std::uint32_t(g.below(w)), win.height = 1 + std::uint32_t(g.below(h));
    win.left = std::uint32_t(g.below(w - win.width + 1)), win.top = std::uint32_t(g.below(h - win.height + 1));
    // Outputs from a third of the window (a reduction) to the window plus 40 (enlarged).
    const fi::crop_output out{std::max<std::uint32_t>(1, win.height / 3 + std::uint32_t(g.below(win.height + 40))),
                              std::max<std::uint32_t>(1, win.width / 3 + std::uint32_t(g.below(win.width + 40))),
                              channels, g.below(2) == 0};
    CAPTURE(t);
    CAPTURE(w);
    CAPTURE(h);
    CAPTURE(win.left);
    CAPTURE(win.top);
    CAPTURE(win.width);
    CAPTURE(win.height);
    CAPTURE(out.width);
    CAPTURE(out.height);
    const auto got = cropped(png, win, out);
    // Exactly the resizer on decode_png's image, as documented.
    std::vector<std::uint8_t> direct(got.size());
    fi::resize_bilinear({full.pixels.data(), w, h, channels, std::size_t(w) * channels}, win.left, win.top, win.width,
                        win.height, out, direct.data());
    CHECK(got == direct);
    // Against the oracle in doubles: the resizer's 11-bit weights may round an exact half
    // the other way.
    image_test::check_within_one_level(got, crop_resize(full, win, out));
  }
  // A window of the whole image at its own size is the image itself; flip mirrors it.
  const png_spec s = random_png(24, 16, 8, 2, false, 99);
  const bytes_t png = encode_png(s);
  CHECK(cropped(png, {0, 0, 16, 24}, {16, 24, 3, false}) == expected(s, 3));
  const auto a = cropped(png, {2, 3, 10, 12}, {10, 12, 3, false}), b = cropped(png, {2, 3, 10, 12}, {10, 12, 3, true});
  for (std::uint32_t y = 0; y < 10; ++y)
    for (std::uint32_t x = 0; x < 12; ++x)
      for (int c = 0; c < 3; ++c) CHECK(a[(y * 12 + x) * 3 + c] == b[(y * 12 + 11 - x) * 3 + c]);
}

TEST_CASE("PNG bad input: every truncation of a file is a format_error, never a partial success") {
  for (bool interlaced : {false, true}) {
    png_spec s = random_png(9, 6, 8, 3, interlaced, 5);
    s.idat_size = 20;
    const bytes_t png = encode_png(s);
    REQUIRE(fi::decode_png(png).pixels == expected(s, 3));
    std::vector<std::uint8_t> out(4 * 4 * 3);
    fi::image img;
    for (std::size_t cut = 0; cut < png.size(); ++cut) {
      CAPTURE(cut);
      const bytes_t part(png.begin(), png.begin() + std::ptrdiff_t(cut));
      try {
        fi::decode_png(part, img);
        FAIL("decoded a truncated file");
      } catch (const ferry::format_error& e) {
        CHECK(e.path() == "PNG");
        CHECK(e.offset() <= cut);
      }
      CHECK_THROWS_AS(fi::decode_png_crop(part, {0, 0, 6, 9}, {4, 4, 3, false}, out), ferry::format_error);
      // The header alone: the signature and IHDR, 33 bytes.
      if (cut < 33)
        CHECK_THROWS_AS(fi::read_png_header(part), ferry::format_error);
      else
        CHECK(fi::read_png_header(part).width == 9);
    }
    // The message names the chunk that ended: here the palette (768 bytes, one read), or
    // an IDAT (read as its data arrive).
    const bytes_t in_plte(png.begin(), png.begin() + 100);
    CHECK_THROWS_WITH_AS(fi::decode_png(in_plte), doctest::Contains("truncated: the data ends in the 'PLTE' chunk at offset 33"),
                         ferry::format_error);
    const bytes_t in_idat(png.begin(), png.begin() + std::ptrdiff_t(find_chunk(png, "IDAT") + 10));
    CHECK_THROWS_WITH_AS(fi::decode_png(in_idat), doctest::Contains("'IDAT' chunk"), ferry::format_error);
    // Without its IEND: an error too (the image data is whole, the file is not).
    CHECK_THROWS_AS(fi::decode_png(bytes_t(png.begin(), png.end() - 12)), ferry::format_error);
  }
}

TEST_CASE("PNG bad input: CRC mismatches in critical and ancillary chunks; a corrupt zlib stream") {
  const png_spec s = random_png(20, 10, 8, 2, false, 8);
  const bytes_t png = encode_png(s);
  for (const char* type : {"IHDR", "IDAT", "IEND"}) {
    CAPTURE(type);
    bytes_t b = png;
    const std::size_t at = find_chunk(b, type);
    b[at + 8 + u32(b.data() + at)] ^= std::byte{1};  // the first CRC byte
    if (std::string(type) == "IHDR")  // checked by read_png_header itself
      CHECK_THROWS_WITH_AS(fi::read_png_header(b), doctest::Contains("CRC mismatch"), ferry::format_error);
    try {
      fi::decode_png(b);
      FAIL("decoded a file with a bad CRC");
    } catch (const ferry::format_error& e) {
      CHECK(std::string(e.what()).find("CRC") != std::string::npos);
      CHECK(std::string(e.what()).find(std::string("'") + type + "' chunk at offset " + std::to_string(at)) !=
            std::string::npos);
      CHECK(e.offset() == at + 12 + u32(b.data() + at));  // read up to the chunk's end
    }
  }
  // A byte of image data changed: the IDAT's CRC no longer matches.
  bytes_t b = png;
  b[find_chunk(b, "IDAT") + 10] ^= std::byte{0x40};
  CHECK_THROWS_WITH_AS(fi::decode_png(b), doctest::Contains("CRC"), ferry::format_error);
  // An ancillary chunk (libspng would discard it by default): an error here.
  const std::size_t idat = find_chunk(png, "IDAT");
  bytes_t t = with_chunk(png, idat, "tEXt", {'k', 0, 'v'});
  CHECK(fi::decode_png(t).pixels == expected(s, 3));  // a good one is read past
  t[idat + 8 + 3] ^= std::byte{1};                    // its CRC
  CHECK_THROWS_WITH_AS(fi::decode_png(t), doctest::Contains("CRC"), ferry::format_error);
  // A zlib stream that is not one (with a correct CRC): libspng's zlib error.
  bytes_t z = with_chunk(png, idat, "IDAT", {0xFF, 0xFF, 0xFF, 0xFF});
  CHECK_THROWS_AS(fi::decode_png(z), ferry::format_error);
  // A wrong Adler-32 at the stream's end (the CRC made right again), in the one IDAT.
  png_spec one = s;
  one.idat_size = 1 << 20;
  bytes_t a = encode_png(one);
  const std::size_t at = find_chunk(a, "IDAT");
  const std::uint32_t len = u32(a.data() + at);
  a[at + 8 + len - 1] ^= std::byte{0xFF};
  const auto crc = std::uint32_t(crc32(0, reinterpret_cast<const Bytef*>(a.data() + at + 4), uInt(len + 4)));
  for (int i = 0; i < 4; ++i) a[at + 8 + len + std::size_t(i)] = std::byte(crc >> (24 - 8 * i));
  CHECK_THROWS_WITH_AS(fi::decode_png(a), doctest::Contains("IDAT stream error"), ferry::format_error);
}

TEST_CASE("PNG bad input: not a PNG; headers claiming 0x0 or 100000x100000 pixels; limits") {
  const bytes_t text = {std::byte{'h'}, std::byte{'i'}, std::byte{'!'}, std::byte{'\n'}};
  CHECK_THROWS_WITH_AS(fi::decode_png(text), doctest::Contains("not a PNG"), ferry::format_error);
  CHECK_THROWS_WITH_AS(fi::read_png_header(bytes_t{}), doctest::Contains("not a PNG"), ferry::format_error);
  bytes_t jpeg(64, std::byte{0});
  jpeg[0] = std::byte{0xFF}, jpeg[1] = std::byte{0xD8}, jpeg[2] = std::byte{0xFF};
  CHECK_THROWS_WITH_AS(fi::decode_png(jpeg), doctest::Contains("not a PNG"), ferry::format_error);

  // A file whose IHDR (with a correct CRC) claims a size; the image data is a 4x4's.
  const png_spec small = random_png(4, 4, 8, 2, false, 3);
  const bytes_t good = encode_png(small);
  auto claiming = [&](std::uint32_t w, std::uint32_t h) {
    bytes_t b(good.begin(), good.begin() + 8);
    put_chunk(b, "IHDR", ihdr_data(w, h, 8, 2, false));
    b.insert(b.end(), good.begin() + 33, good.end());
    return b;
  };
  REQUIRE(fi::decode_png(claiming(4, 4)).pixels == expected(small, 3));
  for (const auto& size : {std::pair{100000u, 100000u}, std::pair{0u, 0u}, std::pair{0u, 4u}, std::pair{4u, 0u},
                           std::pair{0x7FFFFFFFu, 1u}, std::pair{0xFFFFFFFFu, 0xFFFFFFFFu}}) {
    const std::uint32_t w = size.first, h = size.second;
    CAPTURE(w);
    CAPTURE(h);
    const bytes_t b = claiming(w, h);
    std::vector<std::uint8_t> out(8 * 8 * 3);
    // format_error, not std::bad_alloc or an allocation of 30 GB: refused from the header.
    try {
      fi::decode_png(b);
      FAIL("decoded a header claiming an impossible size");
    } catch (const ferry::format_error& e) {
      CHECK(e.offset() == 16);  // the IHDR's width
      CHECK(std::string(e.what()).find("claims " + std::to_string(w) + "x" + std::to_string(h)) != std::string::npos);
    }
    CHECK_THROWS_AS(fi::read_png_header(b), ferry::format_error);
    CHECK_THROWS_AS(fi::decode_png_crop(b, {0, 0, 1, 1}, {8, 8, 3, false}, out), ferry::format_error);
  }
  CHECK_THROWS_WITH_AS(fi::decode_png(claiming(100000, 100000)), doctest::Contains("more than the limit"),
                       ferry::format_error);
  // Within the limit but more than the data holds: the decode runs out of data.
  CHECK_THROWS_AS(fi::decode_png(claiming(64, 64)), ferry::format_error);
  // Within the limit (2^28) but more than the file could hold at deflate's best (1032:1):
  // refused before the 768 MB are allocated.
  CHECK_THROWS_WITH_AS(fi::decode_png(claiming(16000, 16000)), doctest::Contains("can hold compressed"),
                       ferry::format_error);
  // ... a bound real files stay inside: zeros, deflate's best case, at level 9.
  png_spec zeros{1500, 1000, 8, 2, false, std::vector<std::uint16_t>(1500 * 1000 * 3, 0), {}, {}, 1 << 16};
  const bytes_t zpng = encode_png(zeros);
  CAPTURE(zpng.size());
  CHECK(fi::decode_png(zpng).pixels == std::vector<std::uint8_t>(1500 * 1000 * 3, 0));
  // A lower limit of one's own.
  CHECK_THROWS_AS(fi::decode_png(good, 3, {.max_pixels = 15}), ferry::format_error);
  CHECK(fi::decode_png(good, 3, {.max_pixels = 16}).pixels.size() == 48);
  // A row of more bytes of samples than max_pixels (libspng holds a few rows of the widest,
  // whatever the height: 2^28 x 1 RGBA16 took 2.8 GB for 0.8 GB of pixels): refused from
  // the header. 6x1 RGB8 is 6 pixels but 18 bytes a row.
  CHECK_THROWS_WITH_AS(fi::decode_png(claiming(6, 1), 3, {.max_pixels = 16}),
                       doctest::Contains("a row of 18 bytes of samples, more than the limit of 16"), ferry::format_error);
  CHECK_THROWS_WITH_AS(fi::decode_png(claiming(1u << 27, 1)), doctest::Contains("a row of 402653184 bytes"),
                       ferry::format_error);
  // Metadata over the chunk cache: a 2000-byte tEXt against a 1000-byte cache.
  std::vector<std::uint8_t> txt(2000, 'x');
  txt[1] = 0;  // keyword "x"
  const bytes_t big = with_chunk(good, 33, "tEXt", txt);
  CHECK(fi::decode_png(big).pixels == expected(small, 3));
  CHECK_THROWS_AS(fi::decode_png(big, 3, {.max_chunk_cache = 1000}), ferry::format_error);
  // A bad bit depth for the colour type (RGB at 4 bits).
  bytes_t depth(good.begin(), good.begin() + 8);
  put_chunk(depth, "IHDR", ihdr_data(4, 4, 4, 2, false));
  depth.insert(depth.end(), good.begin() + 33, good.end());
  CHECK_THROWS_AS(fi::decode_png(depth), ferry::format_error);
}

TEST_CASE("PNG bad arguments: channels, outputs and windows are config_errors") {
  const bytes_t png = encode_png(random_png(16, 12, 8, 2, false, 4));
  std::vector<std::uint8_t> out(8 * 8 * 3);
  for (std::uint32_t c : {0u, 2u, 4u}) {
    CHECK_THROWS_AS(fi::decode_png(png, c), ferry::config_error);
    CHECK_THROWS_AS(fi::decode_png_crop(png, {0, 0, 4, 4}, {8, 8, c, false}, out), ferry::config_error);
  }
  CHECK_THROWS_AS(fi::decode_png_crop(png, {0, 0, 13, 4}, {8, 8, 3, false}, out), ferry::config_error);
  CHECK_THROWS_AS(fi::decode_png_crop(png, {0, 15, 4, 2}, {8, 8, 3, false}, out), ferry::config_error);
  CHECK_THROWS_AS(fi::decode_png_crop(png, {0, 0, 0, 4}, {8, 8, 3, false}, out), ferry::config_error);
  CHECK_THROWS_AS(fi::decode_png_crop(png, {0, 0, 4, 4}, {0, 8, 3, false}, out), ferry::config_error);
  CHECK_THROWS_AS(fi::decode_png_crop(png, {0, 0, 4, 4}, {9, 8, 3, false}, out), ferry::config_error);
  // After all of that, the same thread decodes and crops a good file.
  CHECK_NOTHROW(fi::decode_png_crop(png, {0, 0, 12, 16}, {8, 8, 3, false}, out));
}
