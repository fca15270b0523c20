// JPEG decoding (ferry/image/jpeg.hpp) on images this test encodes with libjpeg itself:
// a full decode against the pixels encoded; the fused crop against a naive oracle (a full
// decode, then the crop, then the same bilinear resize) where no DCT scaling applies, and
// close to an area-mean reference where it does; flip, grey, CMYK and progressive files; the
// RandomResizedCrop draw; and bad input (not a JPEG, truncated, a header claiming too many
// or no pixels, a crop outside the image).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "ferry/detail/random.hpp"
#include "ferry/error.hpp"
#include "ferry/image/jpeg.hpp"
#include "image/crop_oracle.hpp"

namespace {

namespace fi = ferry::image;
using image_test::crop_resize;
using bytes_t = std::vector<std::byte>;

// A smooth test picture with some texture: gradients, a diagonal stripe pattern, noise.
// f scales the stripes' frequency (their period is about 60 / f pixels).
std::vector<std::uint8_t> picture(std::uint32_t w, std::uint32_t h, int comps, std::uint64_t seed, double f = 1) {
  ferry::detail::splitmix64 g(seed);
  std::vector<std::uint8_t> px(std::size_t(w) * h * comps);
  for (std::uint32_t y = 0; y < h; ++y)
    for (std::uint32_t x = 0; x < w; ++x)
      for (int c = 0; c < comps; ++c) {
        const double v = 128 + 90 * std::sin((x + 2 * y) * 0.05 * f + c) * std::cos(y * 0.03 * f - c) + double(g.below(9)) - 4;
        px[(std::size_t(y) * w + x) * comps + c] = std::uint8_t(std::clamp(v, 0.0, 255.0));
      }
  return px;
}

struct encode_opts {
  int quality = 100;
  bool progressive = false;
  std::uint32_t channels = 3;  // 1 grey, 3 RGB, 4 CMYK
  bool subsample = false;      // 4:2:0 chroma (else 4:4:4)
};

bytes_t encode(const std::vector<std::uint8_t>& px, std::uint32_t w, std::uint32_t h, encode_opts o = {}) {
  return fi::encode_jpeg({px.data(), w, h, o.channels, std::size_t(w) * o.channels},
                         {.quality = o.quality, .progressive = o.progressive, .subsample = o.subsample});
}

// px (w x h, `comps` components of colour space `cs`) through libjpeg's encoder, with
// setup(c) after jpeg_set_defaults: what encode_jpeg does not offer (sampling factors, a
// scan script; whatever setup points at must outlive the call).
template <class Setup>
bytes_t encode_with(const std::vector<std::uint8_t>& px, std::uint32_t w, std::uint32_t h, int comps, J_COLOR_SPACE cs,
                    Setup&& setup) {
  jpeg_compress_struct c;
  jpeg_error_mgr jerr;
  c.err = jpeg_std_error(&jerr);
  jpeg_create_compress(&c);
  unsigned char* mem = nullptr;
  unsigned long mem_size = 0;
  jpeg_mem_dest(&c, &mem, &mem_size);
  c.image_width = w, c.image_height = h, c.input_components = comps, c.in_color_space = cs;
  jpeg_set_defaults(&c);
  setup(c);
  jpeg_start_compress(&c, TRUE);
  while (c.next_scanline < c.image_height) {
    JSAMPROW r = const_cast<std::uint8_t*>(px.data() + std::size_t(c.next_scanline) * w * std::size_t(comps));
    jpeg_write_scanlines(&c, &r, 1);
  }
  jpeg_finish_compress(&c);
  const bytes_t out(reinterpret_cast<const std::byte*>(mem), reinterpret_cast<const std::byte*>(mem) + mem_size);
  std::free(mem);
  jpeg_destroy_compress(&c);
  return out;
}


// The reference for reductions: each output pixel the mean of the source area it covers
// (area resampling, what an antialiasing resize approximates).
std::vector<std::uint8_t> crop_area(const fi::image& img, fi::crop_window win, fi::crop_output out) {
  const std::uint32_t C = img.channels;
  std::vector<std::uint8_t> o(std::size_t(out.height) * out.width * C);
  const double sx = double(win.width) / out.width, sy = double(win.height) / out.height;
  for (std::uint32_t j = 0; j < out.height; ++j)
    for (std::uint32_t i = 0; i < out.width; ++i)
      for (std::uint32_t c = 0; c < C; ++c) {
        const auto ya = std::uint32_t(win.top + j * sy), yb = std::max(ya + 1, std::uint32_t(win.top + (j + 1) * sy));
        const auto xa = std::uint32_t(win.left + i * sx), xb = std::max(xa + 1, std::uint32_t(win.left + (i + 1) * sx));
        double sum = 0;
        for (std::uint32_t y = ya; y < yb; ++y)
          for (std::uint32_t x = xa; x < xb; ++x) sum += img.pixels[(std::size_t(y) * img.width + x) * C + c];
        o[(std::size_t(j) * out.width + i) * C + c] = std::uint8_t(sum / double((yb - ya) * (xb - xa)) + 0.5);
      }
  return o;
}

double mean_abs(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += std::abs(int(a[i]) - int(b[i]));
  return s / double(a.size());
}

std::vector<std::uint8_t> fused(const bytes_t& jpg, fi::crop_window win, fi::crop_output out) {
  std::vector<std::uint8_t> o(std::size_t(out.height) * out.width * out.channels);
  fi::decode_jpeg_crop(jpg, win, out, o);
  return o;
}

// The whole image decoded at DCT scale k/8 through libjpeg's usual path (no skipped rows, no
// cropped columns): what the fused crop's decoded pixels must equal.
fi::image decode_scaled(const bytes_t& jpg, unsigned k, std::uint32_t channels) {
  fi::detail::jpeg_decoder d;
  fi::image img;
  std::vector<std::uint8_t> row;
  if (setjmp(d.err.jump)) d.fail();
  fi::detail::read_header(d, jpg, {});
  const bool cmyk = fi::detail::set_colour(d.cinfo, channels);
  d.cinfo.scale_num = k, d.cinfo.scale_denom = 8;
  jpeg_start_decompress(&d.cinfo);
  img.width = d.cinfo.output_width, img.height = d.cinfo.output_height, img.channels = channels;
  img.pixels.resize(std::size_t(img.width) * img.height * channels);
  row.resize(std::size_t(img.width) * d.cinfo.output_components);
  while (d.cinfo.output_scanline < d.cinfo.output_height) {
    std::uint8_t* dst = img.pixels.data() + std::size_t(d.cinfo.output_scanline) * img.width * channels;
    JSAMPROW r = row.data();
    jpeg_read_scanlines(&d.cinfo, &r, 1);
    for (std::uint32_t x = 0; x < img.width; ++x)
      if (cmyk) fi::detail::cmyk_to(row.data() + 4 * x, dst + channels * x, channels);
      else std::copy_n(row.data() + channels * x, channels, dst + channels * x);
  }
  jpeg_finish_decompress(&d.cinfo);
  return img;
}

}  // namespace

TEST_CASE("decode_jpeg: a quality-100 4:4:4 file decodes to its pixels (within the DCT's rounding)") {
  for (const auto& size : {std::pair{64u, 48u}, std::pair{123u, 77u}, std::pair{1u, 1u}, std::pair{500u, 375u}}) {
    const std::uint32_t w = size.first, h = size.second;
    CAPTURE(w);
    const auto px = picture(w, h, 3, w);
    const fi::image img = fi::decode_jpeg(encode(px, w, h));
    CHECK(img.width == w);
    CHECK(img.height == h);
    CHECK(img.channels == 3);
    REQUIRE(img.pixels.size() == px.size());
    CHECK(mean_abs(img.pixels, px) < 1.0);
    const fi::jpeg_info info = fi::read_jpeg_header(encode(px, w, h, {.progressive = true}));
    CHECK(info.width == w);
    CHECK(info.progressive);
  }
}

TEST_CASE("decode_jpeg_crop at full scale equals a full decode, cropped and resized (the oracle)") {
  // Crops no more than the output size: scale 8/8, so the decoded rows are the full
  // decode's and only the resize remains, done the same way by the oracle (up to a
  // rounding at an exact half, below).
  ferry::detail::splitmix64 g(7);
  for (int t = 0; t < 40; ++t) {
    const std::uint32_t w = 16 + std::uint32_t(g.below(300)), h = 16 + std::uint32_t(g.below(300));
    const bool sub = t % 3 == 0;  // 4:2:0: the crop's edge columns upsample chroma as a full decode does
    const auto jpg = encode(picture(w, h, 3, std::uint64_t(t)), w, h, {.quality = 90, .subsample = sub});
    const fi::image full = fi::decode_jpeg(jpg);
    fi::crop_window win;
    win.width = 1 + std::uint32_t(g.below(w)), win.height = 1 + std::uint32_t(g.below(h));
    win.left = std::uint32_t(g.below(w - win.width + 1)), win.top = std::uint32_t(g.below(h - win.height + 1));
    const fi::crop_output out{win.height + std::uint32_t(g.below(40)), win.width + std::uint32_t(g.below(40)), 3,
                              g.below(2) == 0};
    CAPTURE(t);
    CAPTURE(w);
    CAPTURE(h);
    CAPTURE(win.left);
    CAPTURE(win.top);
    CAPTURE(win.width);
    CAPTURE(win.height);
    REQUIRE(fi::jpeg_crop_scale(win, out) == 8);
    const auto got = fused(jpg, win, out), want = crop_resize(full, win, out);
    // The same pixels through the same formula, but the sample position is computed from
    // the window's origin there and from the decoded columns' here.
    image_test::check_within_one_level(got, want);
  }
}

TEST_CASE("decode_jpeg_crop with DCT scaling: the smallest SIMD scale that covers the output, close to an area mean") {
  // Stripes of a period of about 240 pixels: an output pixel's area (up to 12 pixels across)
  // then averages to what its centre's neighbours give, within the noise, so the area mean
  // is the reference at every reduction; a window misplaced by half a scaled pixel (4
  // source pixels at 1/8) would be about 6 levels off.
  const std::uint32_t w = 500, h = 375;
  const auto px = picture(w, h, 3, 3, 0.25);
  const auto jpg = encode(px, w, h, {.quality = 95});
  const fi::image full = fi::decode_jpeg(jpg);
  struct want_t {
    fi::crop_window win;
    std::uint32_t size;  // the output: size x size
    unsigned scale;      // the DCT scale k/8 expected: libjpeg-turbo's SIMD ones, 1, 2, 4 or 8
  };
  for (const auto& c : {want_t{{0, 0, 375, 500}, 224, 8}, want_t{{0, 0, 375, 500}, 64, 2}, want_t{{0, 0, 375, 500}, 40, 1},
                        want_t{{10, 20, 300, 300}, 150, 4}, want_t{{10, 20, 300, 300}, 151, 8},
                        want_t{{100, 100, 224, 224}, 224, 8}, want_t{{0, 0, 112, 112}, 224, 8},
                        want_t{{50, 40, 60, 448}, 30, 4}, want_t{{0, 0, 375, 448}, 90, 2}}) {
    const fi::crop_output out{c.size, c.size, 3, false};
    CAPTURE(c.win.width);
    CAPTURE(c.win.height);
    CAPTURE(c.size);
    CHECK(fi::jpeg_crop_scale(c.win, out) == c.scale);
    // Against the area mean: the DCT scaling averages the source (as the reference does)
    // where bilinear alone would pick single pixels (at 12x, 7 levels off on this picture).
    const auto got = fused(jpg, c.win, out), want = crop_area(full, c.win, out);
    CHECK(mean_abs(got, want) < 3.0);
  }
}

TEST_CASE("decode_jpeg_crop equals a full decode at its DCT scale, cropped and resized: 4:2:0 crop edges") {
  // libjpeg-turbo upsamples 4:2:0 chroma at the edges of a jpeg_crop_scanline region by
  // repeating the edge sample, where a full decode interpolates from the neighbour (tens of
  // levels apart on a busy picture): the crop's first column on an iMCU boundary and its
  // last inside the image. Windows on and off the 16-pixel iMCU boundaries, at every scale,
  // in images whose width is and is not a multiple of 16. The same resizer on the same
  // pixels: equal bytes (the window's origin relative to the decoded columns, fx0 - cx, is
  // exact in doubles, so the sample positions and weights are the full decode's).
  std::set<unsigned> scales;
  for (const auto& size : {std::pair{320u, 240u}, std::pair{333u, 250u}}) {
    const std::uint32_t w = size.first, h = size.second;
    const auto px = picture(w, h, 3, w, 4), cpx = picture(w, h, 4, h, 4);
    struct file_t {
      std::string what;
      bytes_t jpg;
    };
    const file_t files[] = {{"4:2:0", encode(px, w, h, {.quality = 90, .subsample = true})},
                            {"4:2:0 progressive", encode(px, w, h, {.quality = 90, .progressive = true, .subsample = true})},
                            {"4:4:4", encode(px, w, h, {.quality = 90})},
                            {"CMYK", encode(cpx, w, h, {.quality = 90, .channels = 4})}};
    for (const auto& f : files) {
      fi::image full[9][4];  // by scale and channels, decoded when first needed
      for (std::uint32_t left : {0u, 1u, 15u, 16u, 17u, 32u, 40u, 48u, 63u, 64u, 96u}) {
        for (std::uint32_t cw : {16u, 23u, 32u, 100u, 161u, w - left}) {
          if (left + cw > w) continue;
          for (unsigned k : {1u, 2u, 4u, 8u}) {
            const fi::crop_window win{std::uint32_t(left / 2), left, std::min(h - left / 2, cw), cw};
            const std::uint32_t C = (left + cw) % 3 == 0 ? 1 : 3;
            const fi::crop_output out{std::max(1u, win.height * k / 8), std::max(1u, win.width * k / 8), C, cw % 2 == 1};
            const unsigned s = fi::jpeg_crop_scale(win, out);
            scales.insert(s);
            fi::image& img = full[s][C];
            if (img.pixels.empty()) img = decode_scaled(f.jpg, s, C);
            // Source pixel x is at x s / 8 in the scaled image (each 8x8 block becomes s x s).
            const double sx = s / 8.0, sy = sx;
            std::vector<std::uint8_t> want(std::size_t(out.height) * out.width * C);
            fi::resize_bilinear({img.pixels.data(), img.width, img.height, C, std::size_t(img.width) * C}, win.left * sx,
                                win.top * sy, win.width * sx, win.height * sy, out, want.data());
            const auto got = fused(f.jpg, win, out);
            int most = 0;
            for (std::size_t i = 0; i < got.size(); ++i) most = std::max(most, std::abs(int(got[i]) - int(want[i])));
            CAPTURE(f.what);
            CAPTURE(w);
            CAPTURE(win.left);
            CAPTURE(win.top);
            CAPTURE(win.width);
            CAPTURE(s);
            CAPTURE(C);
            CHECK(most == 0);
          }
        }
      }
    }
  }
  CHECK(scales == std::set<unsigned>{1, 2, 4, 8});
}

TEST_CASE("decode_jpeg_crop with DCT scaling where the image is not a multiple of 8 / k: the window stays in place") {
  // A black-to-white step at x = 896 (or y = 896): at 1/8 an output column is the mean of
  // 8 source columns, all black or all white here. Placing the window by sw / iw instead of
  // k / 8 moved it right by up to 7 source pixels where 8 does not divide the width (the
  // column before the step came out 194 at width 1025).
  for (const std::uint32_t side : {1024u, 1025u, 1031u, 1033u, 1039u}) {
    for (const bool vertical : {false, true}) {
      const std::uint32_t w = vertical ? 64 : side, h = vertical ? side : 64;
      std::vector<std::uint8_t> px(std::size_t(w) * h);
      for (std::uint32_t y = 0; y < h; ++y)
        for (std::uint32_t x = 0; x < w; ++x) px[std::size_t(y) * w + x] = (vertical ? y : x) < 896 ? 0 : 255;
      const auto jpg = encode(px, w, h, {.channels = 1});
      for (const std::uint32_t reduce : {8u, 4u, 2u}) {
        const fi::crop_window win = vertical ? fi::crop_window{512, 0, 512, 64} : fi::crop_window{0, 512, 64, 512};
        const fi::crop_output out{win.height / reduce, win.width / reduce, 1, false};
        CAPTURE(side);
        CAPTURE(vertical);
        CAPTURE(reduce);
        REQUIRE(fi::jpeg_crop_scale(win, out) == 8 / reduce);
        const auto got = fused(jpg, win, out);
        int most = 0;
        for (std::uint32_t j = 0; j < out.height; ++j)
          for (std::uint32_t i = 0; i < out.width; ++i) {
            const std::uint32_t along = (vertical ? j : i) * reduce + 512;  // the output pixel's first source pixel
            most = std::max(most, std::abs(int(got[std::size_t(j) * out.width + i]) - (along < 896 ? 0 : 255)));
          }
        CHECK(most <= 2);
      }
    }
  }
}

TEST_CASE("decode_jpeg_crop: a window one or two columns wide at an edge of a 4:2:0 file is the full decode's") {
  // libjpeg-turbo interpolates chroma (as a full decode does) only in a cropped region whose
  // chroma is more than 2 samples wide; a narrower one repeated samples, up to 15 levels off.
  for (const std::uint32_t w : {5u, 7u, 18u, 33u, 34u, 64u, 100u}) {
    for (const std::uint32_t h : {8u, 17u}) {
      const auto jpg = encode(picture(w, h, 3, w * 31 + h, 4), w, h, {.quality = 90, .subsample = true});
      const fi::image full = fi::decode_jpeg(jpg);
      for (const std::uint32_t cols : {1u, 2u, 3u}) {
        for (const std::uint32_t left : {0u, 1u, w - cols, w - cols - 1, w / 2}) {
          const fi::crop_window win{0, left, h, cols};
          const fi::crop_output out{h, cols, 3, false};
          CAPTURE(w);
          CAPTURE(h);
          CAPTURE(left);
          CAPTURE(cols);
          const auto got = fused(jpg, win, out), want = crop_resize(full, win, out);
          int most = 0;
          for (std::size_t i = 0; i < got.size(); ++i) most = std::max(most, std::abs(int(got[i]) - int(want[i])));
          CHECK(most == 0);
        }
      }
    }
  }
}

TEST_CASE("decode_jpeg_crop: flip mirrors the row; grey output; grey, CMYK and progressive files") {
  const std::uint32_t w = 96, h = 80;
  const auto px = picture(w, h, 3, 11);
  const auto jpg = encode(px, w, h);
  const fi::crop_window win{8, 4, 64, 80};
  const auto a = fused(jpg, win, {32, 40, 3, false}), b = fused(jpg, win, {32, 40, 3, true});
  for (std::uint32_t y = 0; y < 32; ++y)
    for (std::uint32_t x = 0; x < 40; ++x)
      for (int c = 0; c < 3; ++c) CHECK(a[(y * 40 + x) * 3 + c] == b[(y * 40 + 39 - x) * 3 + c]);

  // Grey output of a colour file: libjpeg's luma, as a full grey decode gives it.
  const fi::image grey = fi::decode_jpeg(jpg, 1);
  CHECK(grey.channels == 1);
  CHECK(fused(jpg, win, {64, 80, 1, false}) == crop_resize(grey, win, {64, 80, 1, false}));

  // A grey file to RGB: three equal channels.
  const auto gpx = picture(w, h, 1, 12);
  const fi::image g3 = fi::decode_jpeg(encode(gpx, w, h, {.channels = 1}));
  CHECK(g3.channels == 3);
  for (std::size_t i = 0; i < g3.pixels.size(); i += 3) CHECK((g3.pixels[i] == g3.pixels[i + 1] && g3.pixels[i] == g3.pixels[i + 2]));
  CHECK(mean_abs(fi::decode_jpeg(encode(gpx, w, h, {.channels = 1}), 1).pixels, gpx) < 1.0);

  // CMYK (Adobe's inverted convention): K = 255 and C, M, Y = R, G, B read back as R, G, B.
  std::vector<std::uint8_t> cmyk(std::size_t(w) * h * 4);
  for (std::size_t i = 0; i < std::size_t(w) * h; ++i) {
    for (int c = 0; c < 3; ++c) cmyk[4 * i + c] = px[3 * i + c];
    cmyk[4 * i + 3] = 255;
  }
  const auto cjpg = encode(cmyk, w, h, {.channels = 4});
  CHECK(fi::read_jpeg_header(cjpg).components == 4);
  CHECK(mean_abs(fi::decode_jpeg(cjpg).pixels, px) < 1.5);
  CHECK(mean_abs(fused(cjpg, win, {64, 80, 3, false}), crop_resize(fi::decode_jpeg(cjpg), win, {64, 80, 3, false})) < 0.01);

  // Progressive: the same coefficients as the baseline file, so the same pixels.
  const auto pjpg = encode(px, w, h, {.progressive = true});
  CHECK(fi::decode_jpeg(pjpg).pixels == fi::decode_jpeg(jpg).pixels);
  CHECK(fused(pjpg, win, {20, 24, 3, true}) == fused(jpg, win, {20, 24, 3, true}));
}

TEST_CASE("random_resized_crop: inside the image, within scale and ratio, the same for the same seed") {
  for (std::uint64_t seed = 1; seed <= 300; ++seed) {
    ferry::detail::splitmix64 g(seed), g2(seed);
    const std::uint32_t w = 1 + std::uint32_t(seed * 37 % 700), h = 1 + std::uint32_t(seed * 53 % 500);
    const fi::crop_window c = fi::random_resized_crop(w, h, g);
    const fi::crop_window d = fi::random_resized_crop(w, h, g2);
    CHECK((c.top == d.top && c.left == d.left && c.width == d.width && c.height == d.height));
    CHECK(c.width >= 1);
    CHECK(c.height >= 1);
    CHECK(c.left + c.width <= w);
    CHECK(c.top + c.height <= h);
    const double area = double(c.width) * c.height / (double(w) * h), ratio = double(c.width) / c.height;
    const bool centred = c.left == (w - c.width) / 2 && c.top == (h - c.height) / 2;  // the fallback
    if (!centred && w >= 30 && h >= 30) {
      CHECK(area >= 0.07);
      CHECK(area <= 1.0);
      CHECK(ratio >= 0.70);
      CHECK(ratio <= 1.43);
    }
  }
}

TEST_CASE("decode_jpeg_crop: a truncated JPEG fails for every window, with its offset; a whole one decodes") {
  // The fused crop decodes no row below its window: a file cut below a window must fail all
  // the same (else a file decodes in one epoch and fails in the next, as windows move).
  const std::uint32_t w = 320, h = 240;
  const auto px = picture(w, h, 3, 21);
  const fi::crop_window wins[] = {{0, 0, 16, 16}, {0, 0, 48, 64}, {8, 200, 30, 100}, {120, 100, 80, 100}, {0, 0, h, w}};
  const fi::crop_output outs[] = {{8, 8, 3, false}, {32, 32, 3, true}, {16, 16, 1, false}};
  for (const bool prog : {false, true}) {
    const auto jpg = encode(px, w, h, {.quality = 90, .progressive = prog, .subsample = true});
    // The first scan's data starts after its SOS header (FF DA, a 2-byte length).
    std::size_t data = 0;
    for (std::size_t i = 2; i + 3 < jpg.size() && data == 0; ++i)
      if (jpg[i] == std::byte{0xFF} && jpg[i + 1] == std::byte{0xDA})
        data = i + 2 + (std::size_t(jpg[i + 2]) << 8 | std::size_t(jpg[i + 3]));
    REQUIRE(data > 0);
    for (const std::size_t cut : {data, data + 1, (data + jpg.size()) / 2, jpg.size() * 19 / 20, jpg.size() - 2,
                                  jpg.size() - 1}) {
      CAPTURE(prog);
      CAPTURE(cut);
      const bytes_t part(jpg.begin(), jpg.begin() + std::ptrdiff_t(cut));
      CHECK_THROWS_AS(fi::decode_jpeg(part), ferry::format_error);
      for (const auto& win : wins)
        for (const auto& out : outs) {
          CAPTURE(win.top);
          CAPTURE(win.left);
          CAPTURE(out.width);
          try {
            (void)fused(part, win, out);
            FAIL_CHECK("no error");
          } catch (const ferry::format_error& e) {
            CHECK(e.path() == "JPEG");
            CHECK(e.offset() > 0);
            CHECK(e.offset() <= cut);
            CHECK(std::string(e.what()).find("at offset ") != std::string::npos);
          }
        }
    }
    // Whole, and with bytes after its EOI marker (which libjpeg's full decode ignores): the
    // same pixels.
    bytes_t tail = jpg;
    for (const char c : std::string("trailer \xFF\xD8 data")) tail.push_back(std::byte(c));
    CHECK(fi::decode_jpeg(tail).pixels == fi::decode_jpeg(jpg).pixels);
    for (const auto& win : wins)
      for (const auto& out : outs) CHECK(fused(tail, win, out) == fused(jpg, win, out));
  }
}

// libjpeg's warnings: those that lose no pixel (an unknown JFIF revision, bytes skipped
// before a marker) decode to the file's pixels, as libjpeg-turbo's tools and PIL decode
// them; one about the pixel data (a marker inside the scan's data: "premature end of data
// segment") stays an error.
TEST_CASE("JPEG warnings: harmless ones decode to the file's pixels; one about pixel data is an error") {
  const std::uint32_t w = 96, h = 64;
  const auto jpg = encode(picture(w, h, 3, 8), w, h, {.quality = 90, .subsample = true});
  REQUIRE(jpg.size() > 20);
  REQUIRE(jpg[6] == std::byte{'J'});  // APP0 "JFIF\0", then the revision: major, minor
  const fi::image want = fi::decode_jpeg(jpg);
  const fi::crop_window win{8, 16, 40, 64};
  const fi::crop_output out{32, 32, 3, false};
  const auto want_crop = fused(jpg, win, out);

  bytes_t jfif2 = jpg;
  jfif2[11] = std::byte{2};  // JFIF 2.01: "unknown JFIF revision number"
  bytes_t extra = jpg;  // 3 bytes before the SOS marker: "3 extraneous bytes before marker 0xda"
  std::size_t sos = 0;
  for (std::size_t i = 2; i + 1 < extra.size() && sos == 0; ++i)
    if (extra[i] == std::byte{0xFF} && extra[i + 1] == std::byte{0xDA}) sos = i;
  REQUIRE(sos > 0);
  extra.insert(extra.begin() + std::ptrdiff_t(sos), {std::byte{1}, std::byte{2}, std::byte{3}});
  bytes_t tail = jpg;  // and before the EOI
  REQUIRE(tail[tail.size() - 2] == std::byte{0xFF});
  tail.insert(tail.end() - 2, {std::byte{1}, std::byte{2}, std::byte{3}});
  for (const bytes_t* f : {&jfif2, &extra, &tail}) {
    CHECK(fi::decode_jpeg(*f).pixels == want.pixels);
    CHECK(fused(*f, win, out) == want_crop);
  }

  // A restart marker in the middle of the scan's data, where the file has no restart
  // interval: libjpeg warns and pads the rest grey; here, an error.
  std::size_t data = 0;
  for (std::size_t i = 2; i + 3 < jpg.size() && data == 0; ++i)
    if (jpg[i] == std::byte{0xFF} && jpg[i + 1] == std::byte{0xDA})
      data = i + 2 + (std::size_t(jpg[i + 2]) << 8 | std::size_t(jpg[i + 3]));
  REQUIRE(data > 0);
  bytes_t hit = jpg;
  const std::size_t mid = (data + jpg.size()) / 2;
  hit.insert(hit.begin() + std::ptrdiff_t(mid), {std::byte{0xFF}, std::byte{0xD3}});
  CHECK_THROWS_AS(fi::decode_jpeg(hit), ferry::format_error);
  CHECK_THROWS_AS(fused(hit, {0, 0, h, w}, out), ferry::format_error);
}

TEST_CASE("JPEG bad input: not a JPEG, truncated, too many or no pixels, bad windows and sizes") {
  const std::uint32_t w = 64, h = 64;
  const auto jpg = encode(picture(w, h, 3, 5), w, h);
  std::vector<std::uint8_t> out(32 * 32 * 3);

  const bytes_t text = {std::byte{'h'}, std::byte{'i'}, std::byte{'!'}, std::byte{'\n'}};
  CHECK_THROWS_WITH_AS(fi::decode_jpeg(text), doctest::Contains("not a JPEG"), ferry::format_error);
  CHECK_THROWS_AS(fi::decode_jpeg(bytes_t{}), ferry::format_error);

  // Truncated: the entropy-coded data ends early. libjpeg would pad with grey and warn;
  // here that is an error naming the offset it reached.
  for (std::size_t cut : {jpg.size() / 2, jpg.size() - 3, std::size_t(20), std::size_t(2)}) {
    CAPTURE(cut);
    const bytes_t part(jpg.begin(), jpg.begin() + std::ptrdiff_t(cut));
    CHECK_THROWS_AS(fi::decode_jpeg(part), ferry::format_error);
    CHECK_THROWS_AS(fused(part, {0, 0, 64, 64}, {32, 32, 3, false}), ferry::format_error);
  }
  try {
    fi::decode_jpeg(bytes_t(jpg.begin(), jpg.begin() + std::ptrdiff_t(jpg.size() / 2)));
  } catch (const ferry::format_error& e) {
    CHECK(e.offset() > 0);
    CHECK(std::string(e.what()).find("at offset ") != std::string::npos);
  }

  // A header claiming 60000 x 60000 pixels, or 0 rows: refused from the header, before any
  // allocation of that size.
  auto with_size = [&](std::uint16_t ww, std::uint16_t hh) {
    bytes_t b = jpg;
    for (std::size_t i = 0; i + 9 < b.size(); ++i)
      if (b[i] == std::byte{0xFF} && b[i + 1] == std::byte{0xC0}) {  // SOF0: length(2) precision(1) height(2) width(2)
        b[i + 5] = std::byte(hh >> 8), b[i + 6] = std::byte(hh & 0xFF);
        b[i + 7] = std::byte(ww >> 8), b[i + 8] = std::byte(ww & 0xFF);
        return b;
      }
    FAIL("no SOF0 marker");
    return b;
  };
  CHECK_THROWS_WITH_AS(fi::decode_jpeg(with_size(60000, 60000)), doctest::Contains("more than the limit"),
                       ferry::format_error);
  CHECK_THROWS_AS(fi::read_jpeg_header(with_size(60000, 60000)), ferry::format_error);
  CHECK_THROWS_AS(fused(with_size(60000, 60000), {0, 0, 10, 10}, {32, 32, 3, false}), ferry::format_error);
  CHECK_THROWS_AS(fi::decode_jpeg(with_size(64, 0)), ferry::format_error);
  // Within the limit (2^28) but more blocks than the file has bits (a Huffman code is at
  // least one): refused from the header, before libjpeg and the image allocate 768 MB.
  for (const bool whole : {true, false}) {
    CAPTURE(whole);
    try {
      if (whole)
        fi::decode_jpeg(with_size(16000, 16000));
      else
        fused(with_size(16000, 16000), {0, 0, 10, 10}, {32, 32, 3, false});
      FAIL("a 16000 x 16000 claim decoded from " << jpg.size() << " bytes");
    } catch (const ferry::format_error& e) {
      CHECK(std::string(e.what()).find("scans need at least") != std::string::npos);
      CHECK(e.offset() > 0);
      CHECK(e.offset() < jpg.size());
    }
  }
  CHECK_THROWS_WITH_AS(fi::read_jpeg_header(with_size(16000, 16000)), doctest::Contains("scans need at least"),
                       ferry::format_error);
  // Every component counts, not the first scan's alone: one scan a component, the first a
  // luma sampled 4 times less than its chroma (1/33 of the blocks). 16000 x 16000 with 33000
  // bytes after the first scan's header passed a check of the first scan (31250 bytes) and
  // made libjpeg reserve 1 GB before it failed as truncated.
  {
    jpeg_scan_info scans[3] = {{1, {0}, 0, 63, 0, 0}, {1, {1}, 0, 63, 0, 0}, {1, {2}, 0, 63, 0, 0}};
    const bytes_t multi = encode_with(picture(64, 64, 3, 11), 64, 64, 3, JCS_RGB, [&](jpeg_compress_struct& c) {
      c.comp_info[0].h_samp_factor = c.comp_info[0].v_samp_factor = 1;
      for (int i : {1, 2}) c.comp_info[i].h_samp_factor = c.comp_info[i].v_samp_factor = 4;
      c.scan_info = scans, c.num_scans = 3;
    });
    CHECK(fi::decode_jpeg(multi).width == 64);  // a valid file as written
    bytes_t claim = multi;
    std::size_t sos = 0;
    for (std::size_t i = 0; i + 3 < claim.size(); ++i) {
      if (claim[i] == std::byte{0xFF} && claim[i + 1] == std::byte{0xC0}) {
        claim[i + 5] = claim[i + 7] = std::byte(16000 >> 8), claim[i + 6] = claim[i + 8] = std::byte(16000 & 0xFF);
      } else if (claim[i] == std::byte{0xFF} && claim[i + 1] == std::byte{0xDA}) {
        sos = i + 2 + ((std::size_t(claim[i + 2]) << 8) | std::size_t(claim[i + 3]));
        break;
      }
    }
    REQUIRE(sos > 0);
    claim.resize(sos);
    claim.insert(claim.end(), 33000, std::byte{0});
    claim.push_back(std::byte{0xFF}), claim.push_back(std::byte{0xD9});
    CHECK_THROWS_WITH_AS(fi::read_jpeg_header(claim), doctest::Contains("scans need at least 1031250 bytes"),
                         ferry::format_error);
    CHECK_THROWS_WITH_AS(fi::decode_jpeg(claim), doctest::Contains("scans need at least"), ferry::format_error);
    CHECK_THROWS_WITH_AS(fused(claim, {0, 0, 10, 10}, {8, 8, 3, false}), doctest::Contains("scans need at least"),
                         ferry::format_error);
  }
  // ... a bound real files stay inside: one flat colour, one bit a block in the DC scan of a
  // progressive file (optimal Huffman tables), grey and colour, and baseline.
  for (const auto& [channels, prog] : {std::pair{3u, true}, std::pair{1u, true}, std::pair{3u, false}}) {
    CAPTURE(channels);
    CAPTURE(prog);
    const std::uint32_t fw = 2048, fh = 1536;
    const std::vector<std::uint8_t> flat(std::size_t(fw) * fh * channels, 90);
    const bytes_t f = encode(flat, fw, fh, {.quality = 50, .progressive = prog, .channels = channels, .subsample = true});
    CAPTURE(f.size());
    const fi::image img = fi::decode_jpeg(f, channels);
    CHECK(img.width == fw);
    CHECK(img.height == fh);
    CHECK(std::all_of(img.pixels.begin(), img.pixels.end(), [](std::uint8_t v) { return v >= 88 && v <= 92; }));
  }
  CHECK_THROWS_AS(fi::decode_jpeg(jpg, 3, {.max_pixels = 1000}), ferry::format_error);

  // Windows and sizes: config_errors.
  CHECK_THROWS_AS(fi::decode_jpeg_crop(jpg, {0, 0, 65, 10}, {32, 32, 3, false}, out), ferry::config_error);
  CHECK_THROWS_AS(fi::decode_jpeg_crop(jpg, {60, 0, 10, 10}, {32, 32, 3, false}, out), ferry::config_error);
  CHECK_THROWS_AS(fi::decode_jpeg_crop(jpg, {0, 0, 0, 10}, {32, 32, 3, false}, out), ferry::config_error);
  CHECK_THROWS_AS(fi::decode_jpeg_crop(jpg, {0, 0, 10, 10}, {0, 32, 3, false}, out), ferry::config_error);
  CHECK_THROWS_AS(fi::decode_jpeg_crop(jpg, {0, 0, 10, 10}, {32, 32, 2, false}, out), ferry::config_error);
  CHECK_THROWS_AS(fi::decode_jpeg_crop(jpg, {0, 0, 10, 10}, {64, 64, 3, false}, out), ferry::config_error);
  CHECK_THROWS_AS(fi::decode_jpeg(jpg, 4), ferry::config_error);
  const std::vector<std::uint8_t> px(8 * 8 * 3, 7);
  CHECK_THROWS_AS(fi::encode_jpeg({px.data(), 8, 8, 2, 16}), ferry::config_error);
  CHECK_THROWS_AS(fi::encode_jpeg({px.data(), 8, 8, 3, 24}, {.quality = 0}), ferry::config_error);
  CHECK_THROWS_AS(fi::encode_jpeg({px.data(), 0, 8, 3, 0}), ferry::config_error);
  // After all of that, the same thread decodes a good file.
  CHECK(fused(jpg, {0, 0, 64, 64}, {32, 32, 3, false}).size() == out.size());
}

namespace {
// A grey progressive JPEG whose AC scan is repeated `copies` times after the one the
// encoder wrote: every copy is valid (it codes the whole component in one EOB run, a few
// bytes), and libjpeg runs each over every block. Spliced by hand: libjpeg's encoder
// refuses a script that codes a coefficient twice.
bytes_t repeated_scans(std::uint32_t side, int copies) {
  jpeg_scan_info script[2] = {{1, {0}, 0, 0, 0, 0}, {1, {0}, 1, 63, 0, 0}};  // DC, then AC
  const bytes_t f = encode_with(std::vector<std::uint8_t>(std::size_t(side) * side, 128), side, side, 1, JCS_GRAYSCALE,
                                [&](jpeg_compress_struct& c) { c.scan_info = script, c.num_scans = 2; });
  const auto at = [&](std::size_t i, unsigned char m) { return f[i] == std::byte{0xFF} && f[i + 1] == std::byte{m}; };
  std::size_t sos = 0, dht = 0;  // the last scan's SOS, and the DHT before it
  for (std::size_t i = 0; i + 1 < f.size(); ++i)
    if (at(i, 0xDA)) sos = i;
  for (std::size_t i = 0; i + 1 < sos; ++i)
    if (at(i, 0xC4)) dht = i;
  REQUIRE(dht > 0);
  bytes_t out(f.begin(), f.end() - 2);
  const bytes_t seg(f.begin() + std::ptrdiff_t(dht), f.end() - 2);
  for (int k = 0; k < copies; ++k) out.insert(out.end(), seg.begin(), seg.end());
  out.push_back(std::byte{0xFF}), out.push_back(std::byte{0xD9});
  return out;
}
}  // namespace

TEST_CASE("JPEG: more scans than jpeg_limits::max_scans is a format_error, found at the scan past the limit") {
  // 2 scans written, 200 more: 202. Each costs a pass over the image's blocks, so a file of
  // a few hundred kB repeating one thousands of times took seconds to minutes a decode.
  const bytes_t many = repeated_scans(64, 200);
  std::vector<std::size_t> sos;  // where each scan's header starts
  for (std::size_t i = 0; i + 1 < many.size(); ++i)
    if (many[i] == std::byte{0xFF} && many[i + 1] == std::byte{0xDA}) sos.push_back(i);
  REQUIRE(sos.size() == 202);
  std::vector<std::uint8_t> out(16 * 16 * 3);
  const fi::jpeg_limits enough{.max_scans = 202};
  CHECK(fi::decode_jpeg(many, 1, enough).width == 64);  // a valid file: it decodes within its limit
  CHECK_NOTHROW(fi::decode_jpeg_crop(many, {0, 0, 16, 16}, {16, 16, 3, false}, out, enough));
  for (const bool crop : {false, true}) {
    CAPTURE(crop);
    try {
      if (crop)
        fi::decode_jpeg_crop(many, {0, 0, 16, 16}, {16, 16, 3, false}, out);
      else
        fi::decode_jpeg(many, 1);
      FAIL("202 scans decoded under the default limit of 100");
    } catch (const ferry::format_error& e) {
      CHECK(std::string(e.what()).find("more than 100 scans (jpeg_limits::max_scans)") != std::string::npos);
      CHECK(e.offset() > 0);
      CHECK(e.offset() > sos[100]);  // in scan 101, the first past the limit, not at the end
      CHECK(e.offset() < sos[101]);
    }
    try {
      if (crop)
        fi::decode_jpeg_crop(many, {0, 0, 16, 16}, {16, 16, 3, false}, out, {.max_scans = 201});
      else
        fi::decode_jpeg(many, 1, {.max_scans = 201});
      FAIL("202 scans decoded under a limit of 201");
    } catch (const ferry::format_error& e) {
      CHECK(std::string(e.what()).find("more than 201 scans") != std::string::npos);
    }
  }
  // An ordinary progressive file (libjpeg's own script: 10 scans for colour) is well inside.
  const auto px = picture(64, 48, 3, 3);
  CHECK(fi::decode_jpeg(encode(px, 64, 48, {.progressive = true}), 3, {.max_scans = 10}).height == 48);
  CHECK_THROWS_AS(fi::decode_jpeg(many, 1, {.max_scans = 0}), ferry::config_error);
  CHECK_THROWS_WITH_AS(fi::decode_jpeg(encode(px, 64, 48), 2), doctest::Contains("decode_jpeg: channels"),
                       ferry::config_error);
}

// libjpeg's allocations failing: std::bad_alloc, as documented, not a format_error (a good
// file is not corrupt) nor a jump to an unset jmp_buf (the decompressor was created before
// its setjmp). malloc is replaced in this program for it, which the sanitizers' own malloc
// forbids: their builds leave these cases out.
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
namespace {
std::size_t fail_malloc_over = SIZE_MAX;  // malloc refuses blocks larger than this
}  // namespace
extern "C" void* __libc_malloc(std::size_t);
extern "C" void* malloc(std::size_t n) { return n > fail_malloc_over ? nullptr : __libc_malloc(n); }

namespace {
// Runs f with malloc refusing blocks over `over` bytes; what it threw, by kind.
template <class F>
std::string with_malloc_failing(std::size_t over, F&& f) {
  std::string what = "returned";
  fail_malloc_over = over;
  try {
    f();
  } catch (const std::bad_alloc&) {
    what = "bad_alloc";
  } catch (const ferry::format_error&) {
    what = "format_error";
  } catch (...) {
    what = "other";
  }
  fail_malloc_over = SIZE_MAX;
  return what;
}
}  // namespace

TEST_CASE("JPEG: libjpeg out of memory is std::bad_alloc, from its first allocation on") {
  const auto px = picture(16, 16, 3, 1);
  const bytes_t small = encode(px, 16, 16);
  CHECK(with_malloc_failing(0, [&] { fi::read_jpeg_header(small); }) == "bad_alloc");
  CHECK(with_malloc_failing(0, [&] { fi::encode_jpeg({px.data(), 16, 16, 3, 48}); }) == "bad_alloc");
  // A progressive file's coefficient buffer (1500 x 1500: several MB) refused inside
  // jpeg_start_decompress.
  const auto big_px = picture(1500, 1500, 3, 2);
  const bytes_t big = encode(big_px, 1500, 1500, {.quality = 90, .progressive = true, .subsample = true});
  std::vector<std::uint8_t> out(16 * 16 * 3);
  CHECK(with_malloc_failing(1 << 20, [&] { fi::decode_jpeg(big); }) == "bad_alloc");
  CHECK(with_malloc_failing(1 << 20, [&] { fi::decode_jpeg_crop(big, {0, 0, 1500, 1500}, {16, 16, 3, false}, out); }) ==
        "bad_alloc");
  CHECK(fi::decode_jpeg(big).width == 1500);  // and with memory, it decodes
}
#endif
