// ferry/image/image.hpp: what every image decoder shares, with no codec library behind it:
// the decoded image (uint8 HWC), a crop window and a crop's output, a view of pixels in
// memory, and the bilinear resizer the crops end in. jpeg.hpp (libjpeg-turbo) and png.hpp
// (libspng) include it; code that only handles decoded images needs nothing else.
//
// Threads: none; resize_bilinear runs on the calling thread and may run on several at once.
// Errors: resize_bilinear throws std::bad_alloc only (its per-thread tables).
// Memory: resize_bilinear keeps its column table and one blended row in per-thread buffers, reused.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "ferry/detail/random.hpp"

#ifndef FERRY_IMAGE_SSE2
#if defined(__SSE2__) && !defined(__CUDA_ARCH__)
// 1: resize_bilinear takes its SSE2 steps (every x86-64 has SSE2). Define it 0 for the
// whole program (every file that includes this) for the portable loops, which give the
// same bytes.
#define FERRY_IMAGE_SSE2 1
#else
// 0: no SSE2 here; resize_bilinear's portable loops.
#define FERRY_IMAGE_SSE2 0
#endif
#endif
#if FERRY_IMAGE_SSE2
#include <emmintrin.h>
#endif

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

namespace detail {

// Two source rows blended down, n values: (a (2048 - wy) + b wy + 8) >> 4, a level in
// 128ths (at most 32640, so 16 bits). The SSE2 steps compute the same integers.
inline void blend_down(const std::uint8_t* a, const std::uint8_t* b, std::int32_t wy, std::int16_t* v, std::size_t n) {
  std::size_t k = 0;
#if FERRY_IMAGE_SSE2
  const __m128i wt = _mm_set1_epi32(std::int32_t(std::uint32_t(2048 - wy) | (std::uint32_t(wy) << 16)));
  const __m128i zero = _mm_setzero_si128(), round = _mm_set1_epi32(8);
  auto part = [&](__m128i pairs) {  // 4 (a, b) pairs, 16-bit, blended and scaled
    return _mm_srai_epi32(_mm_add_epi32(_mm_madd_epi16(pairs, wt), round), 4);
  };
  for (; k + 16 <= n; k += 16) {
    const __m128i ra = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + k));
    const __m128i rb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + k));
    const __m128i lo = _mm_unpacklo_epi8(ra, rb), hi = _mm_unpackhi_epi8(ra, rb);  // (a, b) byte pairs
    _mm_storeu_si128(reinterpret_cast<__m128i*>(v + k),
                     _mm_packs_epi32(part(_mm_unpacklo_epi8(lo, zero)), part(_mm_unpackhi_epi8(lo, zero))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(v + k + 8),
                     _mm_packs_epi32(part(_mm_unpacklo_epi8(hi, zero)), part(_mm_unpackhi_epi8(hi, zero))));
  }
#endif
  for (; k < n; ++k) v[k] = std::int16_t((a[k] * (2048 - wy) + b[k] * wy + 8) >> 4);
}

}  // namespace detail

// The window [x, x + w) x [y, y + h) of src, in real pixel coordinates, resized to
// out.height x out.width (out.channels must be src's), mirrored when out.flip, into dst.
// Bilinear: each output pixel's centre mapped into the window, from the two nearest rows
// and columns, never outside the pixels that cover the window (a crop, then a resize, as
// torchvision does). In integers: 11-bit weights, the two rows blended first (to 128ths of
// a level), then the two columns; within a level of bilinear in doubles. What
// decode_jpeg_crop uses after its partial decode, and decode_png_crop after its full one;
// with src a whole decoded image, the same crop of a full decode. src.channels: 1 or 3;
// the window's origin inside src. Throws std::bad_alloc (its per-thread buffers, when a
// window wider than any before comes); runs on the caller's thread.
inline void resize_bilinear(const pixels_view& src, double x, double y, double w, double h, const crop_output& out,
                            std::uint8_t* dst) {
  const std::uint32_t C = src.channels;
  if (out.width == 0 || out.height == 0) return;  // nothing to write
  // The pixels covering the window, within src.
  const double xlo = std::max(0.0, std::floor(x)), ylo = std::max(0.0, std::floor(y));
  const double xhi = std::min(double(src.width) - 1, std::max(xlo, std::ceil(x + w) - 1));
  const double yhi = std::min(double(src.height) - 1, std::max(ylo, std::ceil(y + h) - 1));
  const double sx = w / out.width, sy = h / out.height;
  const auto x0 = std::uint32_t(xlo);
  // Each output column's two source columns (values from x0) and weights (2048 - wx, wx)
  // as two 16-bit halves, once per image; weights in 11-bit fixed point.
  thread_local std::vector<std::uint32_t> col_table;
  thread_local std::vector<std::int32_t> wx_table;
  col_table.resize(2 * std::size_t(out.width));
  wx_table.resize(out.width);
  std::uint32_t* const cols = col_table.data();  // raw pointers: the stores below cannot move them
  std::int32_t* const wxs = wx_table.data();
  for (std::uint32_t i = 0; i < out.width; ++i) {
    const double sxp = std::clamp(x + (i + 0.5) * sx - 0.5, xlo, xhi);
    const auto xa = std::uint32_t(sxp);
    const std::uint32_t o = out.flip ? out.width - 1 - i : i;
    cols[2 * o] = (xa - x0) * C;
    cols[2 * o + 1] = (std::min<std::uint32_t>(xa + 1, std::uint32_t(xhi)) - x0) * C;
    const auto wx = std::uint32_t(std::lround((sxp - double(xa)) * 2048));
    wxs[o] = std::int32_t((2048 - wx) | (wx << 16));
  }
  // Separable, down first: each output row blends its two source rows over the columns the
  // window covers (contiguous, 16 values an SSE2 step), then each output pixel blends two
  // of those. Down first, the gathers are one per output pixel, not one per source row.
  thread_local std::vector<std::int16_t> down_row;
  const std::size_t span = (std::size_t(xhi) - x0 + 1) * C;
  down_row.resize(span + 4);  // + 4: a pixel's 8-byte load reads a lane past its 3 values
  std::int16_t* const v = down_row.data();
  for (std::uint32_t j = 0; j < out.height; ++j) {
    const double syp = std::clamp(y + (j + 0.5) * sy - 0.5, ylo, yhi);
    const auto ya = std::size_t(syp);
    const std::size_t yb = std::min<std::size_t>(ya + 1, std::size_t(yhi));
    const auto wy = std::int32_t(std::lround((syp - double(ya)) * 2048));
    detail::blend_down(src.data + ya * src.stride + std::size_t(x0) * C, src.data + yb * src.stride + std::size_t(x0) * C,
                       wy, v, span);
    std::uint8_t* o = dst + std::size_t(j) * out.width * C;
    std::uint32_t i = 0;
#if FERRY_IMAGE_SSE2
    if (C == 3) {
      // A pixel's (a, b) pairs per channel times (2048 - wx, wx), in one pmaddwd; stored as 4
      // bytes, the 4th the next pixel's first (written next), but for the image's last pixel.
      const __m128i round = _mm_set1_epi32(1 << 17);
      const std::uint32_t stop = j + 1 == out.height ? out.width - 1 : out.width;
      for (; i < stop; ++i) {
        const __m128i pa = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(v + cols[2 * i]));
        const __m128i pb = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(v + cols[2 * i + 1]));
        const __m128i sum = _mm_madd_epi16(_mm_unpacklo_epi16(pa, pb), _mm_set1_epi32(wxs[i]));
        const __m128i q = _mm_srai_epi32(_mm_add_epi32(sum, round), 18);
        const __m128i px = _mm_packus_epi16(_mm_packs_epi32(q, q), q);
        const std::int32_t four = _mm_cvtsi128_si32(px);
        std::memcpy(o + 3 * std::size_t(i), &four, 4);
      }
    }
#endif
    for (; i < out.width; ++i) {
      const std::int16_t* pa = v + cols[2 * i];
      const std::int16_t* pb = v + cols[2 * i + 1];
      const std::int32_t wa = wxs[i] & 0xffff, wb = wxs[i] >> 16;
      for (std::uint32_t c = 0; c < C; ++c)
        o[std::size_t(i) * C + c] = std::uint8_t((pa[c] * wa + pb[c] * wb + (1 << 17)) >> 18);
    }
  }
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
