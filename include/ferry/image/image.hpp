// ferry/image/image.hpp: what every image decoder shares, with no codec library behind it:
// the decoded image (uint8 HWC), a crop window and a crop's output, a view of pixels in
// memory, and the bilinear resizer the crops end in. jpeg.hpp (libjpeg-turbo) and png.hpp
// (libspng) include it; code that only handles decoded images needs nothing else.
//
// Threads: none; resize_bilinear runs on the calling thread and may run on several at once.
// Errors: resize_bilinear throws std::bad_alloc only (its per-thread tables).
// Memory: resize_bilinear keeps its column and row tables in per-thread buffers, reused.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "ferry/detail/random.hpp"

namespace ferry::image {

// An image: height rows of width pixels of `channels` uint8 values (HWC).
struct image {
  std::uint32_t height = 0;    // rows
  std::uint32_t width = 0;     // pixels a row
  std::uint32_t channels = 0;  // values a pixel: 3 (RGB) or 1 (grey)
  std::vector<std::uint8_t> pixels;  // height * width * channels
};

// A crop of the source image, in source pixels.
struct crop_window {
  std::uint32_t top = 0;     // first row
  std::uint32_t left = 0;    // first column
  std::uint32_t height = 0;  // rows (at least 1)
  std::uint32_t width = 0;   // columns (at least 1)
};

// What a crop decode (decode_jpeg_crop, decode_png_crop) writes: height x width x channels
// (1 or 3), mirrored when flip.
struct crop_output {
  std::uint32_t height = 0;    // rows
  std::uint32_t width = 0;     // pixels a row
  std::uint32_t channels = 3;  // 3 (RGB) or 1 (grey)
  bool flip = false;           // mirrored left to right
};

// Pixels in memory: `height` rows of `width` pixels of `channels` uint8 values, each row
// `stride` bytes after the one before.
struct pixels_view {
  const std::uint8_t* data = nullptr;  // the first row
  std::uint32_t width = 0;             // pixels a row
  std::uint32_t height = 0;            // rows
  std::uint32_t channels = 0;          // values a pixel
  std::size_t stride = 0;              // bytes from a row to the next
};

// The window [x, x + w) x [y, y + h) of src, in real pixel coordinates, resized to
// out.height x out.width (out.channels must be src's), mirrored when out.flip, into dst.
// Bilinear: each output pixel's centre mapped into the window, from the two nearest rows
// and columns, never outside the pixels that cover the window (a crop, then a resize, as
// torchvision does). What decode_jpeg_crop uses after its partial decode, and decode_png_crop
// after its full one; with src a whole decoded image, the same crop of a full decode. src.channels: 1 or 3. Throws std::bad_alloc
// (its per-thread tables, once); runs on the caller's thread.
inline void resize_bilinear(const pixels_view& src, double x, double y, double w, double h, const crop_output& out,
                            std::uint8_t* dst) {
  const std::uint32_t C = src.channels;
  // The pixels covering the window, within src.
  const double xlo = std::max(0.0, std::floor(x)), ylo = std::max(0.0, std::floor(y));
  const double xhi = std::min(double(src.width) - 1, std::max(xlo, std::ceil(x + w) - 1));
  const double yhi = std::min(double(src.height) - 1, std::max(ylo, std::ceil(y + h) - 1));
  const double sx = w / out.width, sy = h / out.height;
  // Each output column's two source columns and weight, once per image, not per row;
  // weights in 11-bit fixed point (integer arithmetic: 3x the float loop's speed).
  thread_local std::vector<std::uint32_t> cols;
  thread_local std::vector<std::int32_t> wxs;
  cols.resize(2 * std::size_t(out.width));
  wxs.resize(out.width);
  for (std::uint32_t i = 0; i < out.width; ++i) {
    const double sxp = std::clamp(x + (i + 0.5) * sx - 0.5, xlo, xhi);
    const auto xa = std::uint32_t(sxp);
    const std::uint32_t o = out.flip ? out.width - 1 - i : i;
    cols[2 * o] = xa * C;
    cols[2 * o + 1] = std::min<std::uint32_t>(xa + 1, std::uint32_t(xhi)) * C;
    wxs[o] = std::int32_t(std::lround((sxp - double(xa)) * 2048));
  }
  // Separable: each source row a pass needs is blended across once (kept while the next
  // output row uses it too), then two such rows are blended down, a loop the compiler
  // vectorises.
  thread_local std::vector<std::int32_t> across[2];
  const std::size_t n = std::size_t(out.width) * C;
  across[0].resize(n);
  across[1].resize(n);
  std::size_t have[2] = {std::size_t(-1), std::size_t(-1)};  // the source row in each
  auto rows = [&]<std::uint32_t K>() {  // K: the channel count, known to the compiler
    auto blend_across = [&](std::size_t r, std::vector<std::int32_t>& h) {
      const std::uint8_t* row = src.data + r * src.stride;
      for (std::uint32_t i = 0; i < out.width; ++i) {
        const std::uint32_t a = cols[2 * i], b = cols[2 * i + 1];
        const std::int32_t wx = wxs[i];
        for (std::uint32_t c = 0; c < K; ++c)
          h[i * K + c] = std::int32_t(row[a + c]) * 2048 + (std::int32_t(row[b + c]) - row[a + c]) * wx;
      }
    };
    for (std::uint32_t j = 0; j < out.height; ++j) {
      const double syp = std::clamp(y + (j + 0.5) * sy - 0.5, ylo, yhi);
      const auto ya = std::size_t(syp);
      const std::size_t yb = std::min<std::size_t>(ya + 1, std::size_t(yhi));
      const auto wy = std::int32_t(std::lround((syp - double(ya)) * 2048));
      if (have[0] != ya) {
        if (have[1] == ya) {
          std::swap(across[0], across[1]);
          std::swap(have[0], have[1]);
        } else {
          blend_across(ya, across[0]);
          have[0] = ya;
        }
      }
      if (have[1] != yb) {
        blend_across(yb, across[1]);
        have[1] = yb;
      }
      const std::int32_t* ta = across[0].data();
      const std::int32_t* tb = across[1].data();
      std::uint8_t* o = dst + std::size_t(j) * n;
      for (std::size_t k = 0; k < n; ++k) o[k] = std::uint8_t((ta[k] * 2048 + (tb[k] - ta[k]) * wy + (1 << 21)) >> 22);
    }
  };
  if (C == 3)
    rows.template operator()<3>();
  else
    rows.template operator()<1>();
}

// torchvision's RandomResizedCrop draw: an area of scale [lo, hi] of the image's and an
// aspect ratio log-uniform in [ratio_lo, ratio_hi], up to 10 tries, then the centre crop of
// the ratio clamped to the image's. g: ferry's splitmix64 (seed it per element, e.g. from
// (seed, epoch, index), and a checkpoint resumes the same crops).
inline crop_window random_resized_crop(std::uint32_t width, std::uint32_t height, ferry::detail::splitmix64& g,
                                       double scale_lo = 0.08, double scale_hi = 1.0, double ratio_lo = 3.0 / 4,
                                       double ratio_hi = 4.0 / 3) {
  const double area = double(width) * height;
  auto uniform = [&](double a, double b) { return a + (b - a) * (double(g() >> 11) * 0x1.0p-53); };
  for (int t = 0; t < 10; ++t) {
    const double target = area * uniform(scale_lo, scale_hi);
    const double ar = std::exp(uniform(std::log(ratio_lo), std::log(ratio_hi)));
    const auto w = std::uint32_t(std::lround(std::sqrt(target * ar)));
    const auto h = std::uint32_t(std::lround(std::sqrt(target / ar)));
    if (w > 0 && h > 0 && w <= width && h <= height) {
      const auto top = std::uint32_t(g.below(height - h + 1)), left = std::uint32_t(g.below(width - w + 1));
      return {top, left, h, w};
    }
  }
  const double in_ratio = double(width) / height;
  std::uint32_t w = width, h = height;
  if (in_ratio < ratio_lo)
    h = std::max<std::uint32_t>(1, std::uint32_t(std::lround(w / ratio_lo)));
  else if (in_ratio > ratio_hi)
    w = std::max<std::uint32_t>(1, std::uint32_t(std::lround(h * ratio_hi)));
  return {(height - h) / 2, (width - w) / 2, h, w};
}

}  // namespace ferry::image
