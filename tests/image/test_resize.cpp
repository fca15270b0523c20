// resize_bilinear (ferry/image/image.hpp) against its fixed-point specification, computed
// here the naive way, one output value at a time, and exactly; and against bilinear in
// doubles (the crop oracle), within a level. Built twice (tests/image/meson.build): with
// the SSE2 steps where the machine has them, and with FERRY_IMAGE_SSE2=0, so that both
// paths are held to the same bytes. Images and outputs are allocated to the byte, so the
// sanitizer builds catch a read or write past either.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "ferry/detail/random.hpp"
#include "ferry/image/image.hpp"
#include "image/crop_oracle.hpp"

namespace {

namespace fi = ferry::image;

// The specification: the output pixel's centre mapped into the window and clamped to the
// pixels covering it; its two rows and two columns with 11-bit weights; the rows blended
// first, to 128ths of a level, rounded; then the columns, rounded to a level.
std::vector<std::uint8_t> spec(const std::vector<std::uint8_t>& px, std::uint32_t width, std::uint32_t height,
                               std::uint32_t channels, std::size_t stride, double x, double y, double w, double h,
                               const fi::crop_output& out) {
  const double xlo = std::max(0.0, std::floor(x)), ylo = std::max(0.0, std::floor(y));
  const double xhi = std::min(double(width) - 1, std::max(xlo, std::ceil(x + w) - 1));
  const double yhi = std::min(double(height) - 1, std::max(ylo, std::ceil(y + h) - 1));
  std::vector<std::uint8_t> o(std::size_t(out.height) * out.width * channels);
  for (std::uint32_t j = 0; j < out.height; ++j) {
    const double sy = std::clamp(y + (j + 0.5) * (h / out.height) - 0.5, ylo, yhi);
    const auto ya = std::size_t(sy);
    const std::size_t yb = std::min(ya + 1, std::size_t(yhi));
    const long wy = std::lround((sy - double(ya)) * 2048);
    for (std::uint32_t i = 0; i < out.width; ++i) {
      const double sx = std::clamp(x + (i + 0.5) * (w / out.width) - 0.5, xlo, xhi);
      const auto xa = std::size_t(sx);
      const std::size_t xb = std::min(xa + 1, std::size_t(xhi));
      const long wx = std::lround((sx - double(xa)) * 2048);
      for (std::uint32_t c = 0; c < channels; ++c) {
        auto down = [&](std::size_t col) {
          return (px[ya * stride + col * channels + c] * (2048 - wy) + px[yb * stride + col * channels + c] * wy + 8) >> 4;
        };
        const long v = (down(xa) * (2048 - wx) + down(xb) * wx + (1 << 17)) >> 18;  // 0 to 255
        o[(std::size_t(j) * out.width + (out.flip ? out.width - 1 - i : i)) * channels + c] = std::uint8_t(v);
      }
    }
  }
  return o;
}

// Noise (every neighbour unrelated) or a smooth wave.
std::vector<std::uint8_t> picture(std::size_t bytes, bool noise, ferry::detail::splitmix64& g) {
  std::vector<std::uint8_t> px(bytes);
  const double phase = double(g.below(1000));
  for (std::size_t k = 0; k < bytes; ++k)
    px[k] = noise ? std::uint8_t(g()) : std::uint8_t(128 + 120 * std::sin(double(k) * 0.013 + phase));
  return px;
}

}  // namespace

TEST_CASE("resize_bilinear: its fixed-point specification exactly, at any size, window, stride and flip") {
  ferry::detail::splitmix64 g(11);
  for (int t = 0; t < 600; ++t) {
    const std::uint32_t width = 1 + std::uint32_t(g.below(t < 100 ? 8 : 220));
    const std::uint32_t height = 1 + std::uint32_t(g.below(t < 100 ? 8 : 220));
    const std::uint32_t channels = g.below(3) == 0 ? 1 : 3;
    const std::size_t stride = std::size_t(width) * channels + g.below(8);
    // To the byte: the last row has no padding after it.
    const auto px = picture(stride * (height - 1) + std::size_t(width) * channels, t % 2 == 0, g);
    // A window in real coordinates, from inside the image; one in four may hang over its
    // right and bottom edges (sampling clamps to the last pixels).
    auto real = [&](double lo, double hi) { return lo + (hi - lo) * double(g.below(1 << 20)) / double(1 << 20); };
    const double x = real(0, width - 0.01), y = real(0, height - 0.01);
    const double over = t % 4 == 0 ? 1.5 : 1.0;
    const double w = std::max(0.01, real(0, over * width - x)), h = std::max(0.01, real(0, over * height - y));
    const fi::crop_output out{1 + std::uint32_t(g.below(t % 5 == 0 ? 400 : 120)), 1 + std::uint32_t(g.below(t % 7 == 0 ? 400 : 120)),
                              channels, g.below(2) == 0};
    CAPTURE(t);
    CAPTURE(width);
    CAPTURE(height);
    CAPTURE(channels);
    CAPTURE(stride);
    CAPTURE(x);
    CAPTURE(y);
    CAPTURE(w);
    CAPTURE(h);
    CAPTURE(out.width);
    CAPTURE(out.height);
    CAPTURE(out.flip);
    std::vector<std::uint8_t> got(std::size_t(out.height) * out.width * channels);
    fi::resize_bilinear({px.data(), width, height, channels, stride}, x, y, w, h, out, got.data());
    CHECK(got == spec(px, width, height, channels, stride, x, y, w, h, out));
  }
}

TEST_CASE("resize_bilinear: within a level of bilinear in doubles; an image at its own size is itself") {
  ferry::detail::splitmix64 g(12);
  std::size_t values = 0, off = 0;
  for (int t = 0; t < 200; ++t) {
    fi::image img;
    img.width = 1 + std::uint32_t(g.below(300)), img.height = 1 + std::uint32_t(g.below(300));
    img.channels = t % 3 == 2 ? 1 : 3;
    img.pixels = picture(std::size_t(img.width) * img.height * img.channels, t % 2 == 1, g);
    fi::crop_window win;
    win.width = 1 + std::uint32_t(g.below(img.width)), win.height = 1 + std::uint32_t(g.below(img.height));
    win.left = std::uint32_t(g.below(img.width - win.width + 1)), win.top = std::uint32_t(g.below(img.height - win.height + 1));
    const fi::crop_output out{std::max<std::uint32_t>(1, win.height / 3 + std::uint32_t(g.below(win.height + 40))),
                              std::max<std::uint32_t>(1, win.width / 3 + std::uint32_t(g.below(win.width + 40))),
                              img.channels, g.below(2) == 0};
    std::vector<std::uint8_t> got(std::size_t(out.height) * out.width * img.channels);
    fi::resize_bilinear({img.pixels.data(), img.width, img.height, img.channels, std::size_t(img.width) * img.channels},
                        win.left, win.top, win.width, win.height, out, got.data());
    const auto want = image_test::crop_resize(img, win, out);
    int most = 0;
    for (std::size_t k = 0; k < got.size(); ++k) {
      most = std::max(most, std::abs(int(got[k]) - int(want[k])));
      off += got[k] != want[k];
    }
    CHECK(most <= 1);
    values += got.size();
    // The whole image at its own size: every weight is 0, every value comes back.
    std::vector<std::uint8_t> same(img.pixels.size());
    fi::resize_bilinear({img.pixels.data(), img.width, img.height, img.channels, std::size_t(img.width) * img.channels}, 0,
                        0, img.width, img.height, {img.height, img.width, img.channels, false}, same.data());
    CHECK(same == img.pixels);
  }
  // The 11-bit weights and the 128ths in between round a value the other way from the
  // doubles' where it lies within about a 200th of a level of a half: about 1% of values
  // on these pictures (half of them noise).
  CAPTURE(off);
  CAPTURE(values);
  CHECK(off * 50 <= values);
}

TEST_CASE("resize_bilinear: an output with no rows or no columns writes nothing") {
  const std::vector<std::uint8_t> px(4 * 4 * 3, 200);
  for (const std::uint32_t channels : {1u, 3u})
    for (const fi::crop_output out : {fi::crop_output{2, 0, channels, false}, fi::crop_output{0, 2, channels, true},
                                      fi::crop_output{0, 0, channels, false}}) {
      std::vector<std::uint8_t> guard(8, 7);  // would be written past a zero-sized output
      fi::resize_bilinear({px.data(), 4, 4, channels, 4 * std::size_t(channels)}, 0, 0, 4, 4, out, guard.data());
      CHECK(guard == std::vector<std::uint8_t>(8, 7));
    }
}
