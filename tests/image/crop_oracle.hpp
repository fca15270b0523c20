// The crop oracle of the image tests: crop `win` out of a full image and resize it
// bilinearly at pixel centres, in doubles, the way decode_jpeg_crop resizes when it decodes
// at full scale (and decode_png_crop always).
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ferry/image/image.hpp"

namespace image_test {

namespace fi = ferry::image;

inline std::vector<std::uint8_t> crop_resize(const fi::image& img, fi::crop_window win, fi::crop_output out) {
  const std::uint32_t C = img.channels;
  std::vector<std::uint8_t> o(std::size_t(out.height) * out.width * C);
  const double sx = double(win.width) / out.width, sy = double(win.height) / out.height;
  for (std::uint32_t j = 0; j < out.height; ++j) {
    const double y = std::clamp(win.top + (j + 0.5) * sy - 0.5, double(win.top), double(win.top + win.height - 1));
    // The fused decode samples inside the rows it decoded: [top, top + height) here.
    const std::size_t ya = std::size_t(y), yb = std::min<std::size_t>(ya + 1, win.top + win.height - 1);
    const double wy = y - double(ya);
    for (std::uint32_t i = 0; i < out.width; ++i) {
      const double x = std::clamp(win.left + (i + 0.5) * sx - 0.5, double(win.left), double(win.left + win.width - 1));
      const std::size_t xa = std::size_t(x), xb = std::min<std::size_t>(xa + 1, win.left + win.width - 1);
      const double wx = x - double(xa);
      for (std::uint32_t c = 0; c < C; ++c) {
        auto at = [&](std::size_t yy, std::size_t xx) { return double(img.pixels[(yy * img.width + xx) * C + c]); };
        const double v = (at(ya, xa) * (1 - wx) + at(ya, xb) * wx) * (1 - wy) + (at(yb, xa) * (1 - wx) + at(yb, xb) * wx) * wy;
        o[(std::size_t(j) * out.width + (out.flip ? out.width - 1 - i : i)) * C + c] = std::uint8_t(v + 0.5);
      }
    }
  }
  return o;
}

// got against the oracle: at most one level off anywhere, and off in at most 1% of the
// values (a rounding at an exact half may go the other way).
inline void check_within_one_level(const std::vector<std::uint8_t>& got, const std::vector<std::uint8_t>& want) {
  REQUIRE(got.size() == want.size());
  int most = 0;
  std::size_t differ = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    most = std::max(most, std::abs(int(got[i]) - int(want[i])));
    differ += got[i] != want[i];
  }
  CHECK(most <= 1);
  CHECK(differ * 100 <= got.size());
}

}  // namespace image_test
