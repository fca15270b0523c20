// ferry/image/png.hpp: PNG decoding on libspng (Debian's libspng-dev; link with -lspng,
// pkg-config spng), into the uint8 HWC images of image.hpp, and a crop + resize to a fixed
// size for batch().
//
//   ferry::image::png_info h = ferry::image::read_png_header(bytes);
//   ferry::image::image full = ferry::image::decode_png(bytes);             // uint8 HWC, RGB
//   std::array<std::uint8_t, 224 * 224 * 3> out;
//   ferry::image::decode_png_crop(bytes, {0, 0, h.height, h.width}, {224, 224, 3, false}, out);
//
// The crop is a full decode, then resize_bilinear (image.hpp) on the window: PNG has no
// reduced-size decode (no DCT to scale) and no way to start at a row (one deflate stream,
// each row filtered against the one above), so unlike decode_jpeg_crop nothing is saved
// by cropping; a reduction of more than 2x therefore aliases (bilinear reads two taps).
//
// Conversions (libspng 0.7's SPNG_FMT_RGB8 and SPNG_FMT_G8; libspng's docs/decode.md, its
// spng.c):
// - every colour type and bit depth decodes; interlaced (Adam7) files are de-interlaced;
// - 16-bit samples become 8-bit by their high byte (v >> 8, libspng's decode loop; what
//   libpng's png_set_strip_16 does), not v / 257 rounded: the two differ by at most 1;
// - 1, 2 and 4-bit grey is scaled to 8 bits by bit replication (1 -> 255, 0xA -> 0xAA);
//   palette entries are looked up (an index past the palette reads black);
// - alpha (grey+alpha, RGBA, a palette's or a colour's tRNS) is dropped, not composited:
//   the colour values are kept as stored (straight alpha), as PIL's convert("RGB") and
//   torchvision's ImageReadMode.RGB give them;
// - no gamma, sBIT or colour-profile correction: the samples as stored;
// - channels 1 (grey): grey files of 8 bits or fewer come straight from libspng (G8);
//   anything else is decoded to RGB8 and reduced to ITU-R 601 luma,
//   (299 R + 587 G + 114 B + 500) / 1000 (PIL's convert("L") weights), which leaves a grey
//   file's values unchanged.
//
// Threads: none; every function runs on the calling thread and may be called from several
// at once (map's workers): each call has its own libspng context.
//
// Errors: format_error (path "PNG"; map's element_error names the element) for data that
// is not a PNG, a truncated or corrupt one, a CRC mismatch in any chunk (critical or
// ancillary: SPNG_CRC_ERROR for both, where libspng's default discards an ancillary one),
// a bad zlib stream (its Adler-32 too when it arrives with the last rows' data: libspng
// stops reading the stream at the last row, so one in an IDAT of its own goes unchecked;
// the chunks' CRCs cover those bytes), a file that does not reach the end of its IEND
// chunk (libspng 0.7 lets a missing IEND CRC pass: the reader here catches it), a bad
// IHDR (bit depth, colour type), and a header whose size is more than
// limits.max_pixels, or a row of more than max_pixels bytes of samples (libspng holds a few
// rows whatever the height) (checked before anything is allocated from it; libspng itself refuses
// 0 rows or columns) or more samples than the file could hold compressed (deflate's
// 1032:1 at best: a short file claiming a large image allocates nothing either). Its offset is the byte libspng had read up to when it failed (its
// reads come through this header's reader: libspng has no offset of its own to report),
// except for a missing signature (0) and a bad size (16, the IHDR's width); its reason is
// libspng's spng_strerror text with the chunk it was in. Chunks over limits.max_chunk_bytes
// or kept metadata over limits.max_chunk_cache (compressed text or profiles: decompression
// bombs) are format_errors too. config_error for an output size or channel count that is
// not valid, or a crop window outside the image. std::bad_alloc (libspng's SPNG_EMEM too).
//
// Memory: decode_png returns a new image or reuses the caller's (for a grey output of a
// colour file its buffer holds the RGB decode first: 3 bytes a pixel); decode_png_crop
// writes into the caller's span and keeps the whole decoded image in a per-thread buffer
// that is reused, as is resize_bilinear's. libspng allocates its context, an 8 KiB read
// buffer and two or three rows per call.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <vector>

#include <spng.h>

#include "ferry/error.hpp"
#include "ferry/image/image.hpp"

namespace ferry::image {

// A PNG's colour type, as its IHDR stores it.
enum class png_colour : std::uint8_t { grey = 0, rgb = 2, palette = 3, grey_alpha = 4, rgba = 6 };

// What a PNG's header (IHDR) says.
struct png_info {
  std::uint32_t width = 0;   // pixels a row
  std::uint32_t height = 0;  // rows
  int bit_depth = 0;         // bits a sample (a palette index for palette files): 1, 2, 4, 8 or 16
  png_colour colour_type = png_colour::grey;  // grey, RGB, palette, grey + alpha or RGBA
  bool interlaced = false;   // Adam7 (else rows in order)
};

// What a PNG may claim and hold before it is refused.
struct png_limits {
  std::uint64_t max_pixels = std::uint64_t(1) << 28;     // width x height at most (16384 x 16384), and a row's bytes
  std::size_t max_chunk_bytes = std::size_t(1) << 24;    // one metadata chunk, decompressed (16 MiB)
  std::size_t max_chunk_cache = std::size_t(1) << 26;    // all metadata libspng keeps (64 MiB)
};

namespace detail {

// libspng reads through this, so that an error can say how far it had got.
struct png_reader {
  const std::byte* data = nullptr;
  std::size_t size = 0;
  std::size_t pos = 0;  // bytes handed to libspng so far
  bool ended = false;   // a read past the end was asked for
};
extern "C" inline int ferry_png_read(spng_ctx*, void* user, void* dst, std::size_t n) {
  auto* r = static_cast<png_reader*>(user);
  if (n > r->size - r->pos) {  // libspng never takes a short read
    r->ended = true;
    return SPNG_IO_EOF;
  }
  std::memcpy(dst, r->data + r->pos, n);
  r->pos += n;
  return 0;
}

inline constexpr unsigned char png_signature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};

inline std::uint32_t png_u32(const std::byte* p) {
  return std::uint32_t(p[0]) << 24 | std::uint32_t(p[1]) << 16 | std::uint32_t(p[2]) << 8 | std::uint32_t(p[3]);
}

// PNG's CRC-32 (zlib's), bit by bit: only read_png_header's 17 bytes go through it, and
// it keeps this header from needing -lz.
inline std::uint32_t png_crc(const std::byte* p, std::size_t n) {
  std::uint32_t c = 0xFFFFFFFF;
  for (std::size_t i = 0; i < n; ++i) {
    c ^= std::uint32_t(p[i]);
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320 & (0 - (c & 1)));
  }
  return c ^ 0xFFFFFFFF;
}

struct spng_free {
  void operator()(spng_ctx* c) const noexcept { spng_ctx_free(c); }
};

// One libspng decoding context for one call; freed on every path (a throw from the
// constructor included: it is a member).
struct png_decoder {
  std::unique_ptr<spng_ctx, spng_free> owner;
  spng_ctx* ctx = nullptr;
  png_reader in;

  png_decoder(std::span<const std::byte> bytes, const png_limits& lim) : in{bytes.data(), bytes.size(), 0} {
    if (bytes.size() < 8 || std::memcmp(bytes.data(), png_signature, 8) != 0)
      throw format_error("PNG", 0, "not a PNG: no PNG signature (" + std::to_string(bytes.size()) + " bytes)");
    owner.reset(spng_ctx_new(0));
    ctx = owner.get();
    if (!ctx) throw std::bad_alloc();
    // A side can be no longer than max_pixels (the other is at least 1); libspng takes at
    // most 2^31 - 1, and a chunk limit no larger than the cache's. The product is checked
    // after the header.
    const auto side = std::uint32_t(std::min<std::uint64_t>(lim.max_pixels, 0x7FFFFFFF));
    const std::size_t chunk = std::min({lim.max_chunk_bytes, lim.max_chunk_cache, std::size_t(0x7FFFFFFF)});
    if (spng_set_image_limits(ctx, side, side) != 0 || spng_set_chunk_limits(ctx, chunk, lim.max_chunk_cache) != 0)
      throw config_error("png_limits: libspng refused the limits");
    check(spng_set_crc_action(ctx, SPNG_CRC_ERROR, SPNG_CRC_ERROR));  // default: ancillary CRC errors discard
    check(spng_set_png_stream(ctx, ferry_png_read, &in));
  }
  png_decoder(const png_decoder&) = delete;
  png_decoder& operator=(const png_decoder&) = delete;

  void check(int err) const {
    if (err) fail(err);
  }

  // The chunk holding byte `at`, as " in the 'TYPE' chunk at offset N", or "".
  std::string chunk_at(std::size_t at) const {
    std::size_t p = 8;
    while (p + 8 <= in.size) {
      const std::uint64_t end = p + std::uint64_t(png_u32(in.data + p)) + 12;
      if (at < end) {
        std::string type;
        for (std::size_t i = 0; i < 4; ++i) {
          const auto c = char(in.data[p + 4 + i]);
          type += (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') ? c : '?';
        }
        return " in the '" + type + "' chunk at offset " + std::to_string(p);
      }
      p = std::size_t(end);
    }
    return "";
  }

  [[noreturn]] void fail(int err) const {
    if (err == SPNG_EMEM) throw std::bad_alloc();
    const std::string of = " (" + std::to_string(in.size) + " bytes)";
    if (err == SPNG_EWIDTH || err == SPNG_EHEIGHT || err == SPNG_EUSER_WIDTH || err == SPNG_EUSER_HEIGHT) {
      std::string claim;
      if (in.size >= 24 && std::memcmp(in.data + 12, "IHDR", 4) == 0)
        claim = ": the header claims " + std::to_string(png_u32(in.data + 16)) + "x" +
                std::to_string(png_u32(in.data + 20)) + " pixels";
      throw format_error("PNG", 16, std::string(spng_strerror(err)) + claim + of);
    }
    if (err == SPNG_IO_EOF)  // the failed read started at in.pos: the chunk cut short holds it
      throw format_error("PNG", in.pos, "truncated: the data ends" + chunk_at(in.pos) + of);
    // Any other error is found after a read: its last byte is in the chunk at fault.
    throw format_error("PNG", in.pos,
                       std::string(err == SPNG_ECHUNK_CRC ? "CRC mismatch: " : "") + spng_strerror(err) +
                           " (libspng error " + std::to_string(err) + ")" + chunk_at(in.pos ? in.pos - 1 : 0) + of);
  }

  // Reads the signature and IHDR, checks the size against the limits (nothing allocated
  // from it yet).
  png_info header(const png_limits& lim) const {
    spng_ihdr h{};
    check(spng_get_ihdr(ctx, &h));
    const std::uint64_t px = std::uint64_t(h.width) * h.height;
    if (px == 0 || px > lim.max_pixels)
      throw format_error("PNG", 16,
                         "the header claims " + std::to_string(h.width) + "x" + std::to_string(h.height) + " pixels, " +
                             (px == 0 ? std::string("none")
                                      : "more than the limit of " + std::to_string(lim.max_pixels)));
    // libspng holds two or three rows of the widest (zero-filled), whatever the height: a
    // 2^28 x 1 RGBA16 image took 2.8 GB for 0.8 GB of pixels. Rows of more than max_pixels
    // bytes of samples are refused, so memory follows max_pixels, not the image's shape.
    const int spp = h.color_type == SPNG_COLOR_TYPE_TRUECOLOR ? 3 : h.color_type == SPNG_COLOR_TYPE_TRUECOLOR_ALPHA ? 4
                  : h.color_type == SPNG_COLOR_TYPE_GRAYSCALE_ALPHA ? 2 : 1;
    const std::uint64_t row = (std::uint64_t(h.width) * std::uint64_t(spp * h.bit_depth) + 7) / 8;
    if (row > lim.max_pixels)
      throw format_error("PNG", 16,
                         "the header claims " + std::to_string(h.width) + "x" + std::to_string(h.height) +
                             " pixels: a row of " + std::to_string(row) + " bytes of samples, more than the limit of " +
                             std::to_string(lim.max_pixels) + " (max_pixels) a row may take");
    return {h.width, h.height, h.bit_depth, png_colour(h.color_type), h.interlace_method != 0};
  }
};

inline void check_png_output(const crop_output& out) {
  if (out.height == 0 || out.width == 0)
    throw config_error("decode_png_crop: the output size must be at least 1x1 (got " + std::to_string(out.height) +
                       "x" + std::to_string(out.width) + ")");
  if (out.channels != 1 && out.channels != 3)
    throw config_error("decode_png_crop: channels must be 1 or 3 (got " + std::to_string(out.channels) + ")");
}

// The whole image into px (height x width x channels), reusing its capacity. With `win`,
// the window is checked against the header before anything is decoded.
inline png_info decode_png_into(std::span<const std::byte> bytes, std::uint32_t channels, const png_limits& lim,
                                std::vector<std::uint8_t>& px, const crop_window* win) {
  png_decoder d(bytes, lim);
  const png_info h = d.header(lim);
  if (win && (win->width == 0 || win->height == 0 || win->left > h.width || win->top > h.height ||
              win->width > h.width - win->left || win->height > h.height - win->top))
    throw config_error("decode_png_crop: the crop " + std::to_string(win->width) + "x" + std::to_string(win->height) +
                       " at (" + std::to_string(win->left) + ", " + std::to_string(win->top) +
                       ") is not inside the " + std::to_string(h.width) + "x" + std::to_string(h.height) + " image");
  // Deflate packs at most 1032 bytes into one (a 258-byte match in two bits): a file too
  // short to hold the samples its header claims is refused before they are allocated.
  const int spp = h.colour_type == png_colour::rgb ? 3 : h.colour_type == png_colour::rgba ? 4
                : h.colour_type == png_colour::grey_alpha ? 2 : 1;
  const std::uint64_t least = std::uint64_t(h.width) * h.height * std::uint64_t(spp * h.bit_depth) / 8;
  if (least / 1032 > bytes.size())
    throw format_error("PNG", 16,
                       "the header claims " + std::to_string(h.width) + "x" + std::to_string(h.height) + " pixels (" +
                           std::to_string(least) + " bytes of samples), more than the file's " +
                           std::to_string(bytes.size()) + " bytes can hold compressed");
  // libspng's G8 takes grey files of up to 8 bits only; the rest go through RGB8.
  const bool direct = channels == 3 || (h.colour_type == png_colour::grey && h.bit_depth <= 8);
  const int fmt = channels == 3 ? SPNG_FMT_RGB8 : direct ? SPNG_FMT_G8 : SPNG_FMT_RGB8;
  std::size_t len = 0;
  d.check(spng_decoded_image_size(d.ctx, fmt, &len));
  const std::size_t n = std::size_t(h.width) * h.height;
  if (len != n * (fmt == SPNG_FMT_G8 ? 1 : 3))  // libspng's own size: a bug, not a file's
    throw format_error("PNG", 16, "libspng's decoded size " + std::to_string(len) + " does not match the header");
  px.resize(len);
  d.check(spng_decode_image(d.ctx, px.data(), len, fmt, 0));  // no tRNS, no gamma
  d.check(spng_decode_chunks(d.ctx));                         // up to IEND: a cut file is an error
  // libspng 0.7 takes a failed read of IEND's CRC (SPNG_IO_EOF, -1) for its "discard this
  // chunk" (-SPNG_CRC_DISCARD, also -1) and succeeds: the reader saw the end.
  if (d.in.ended) d.fail(SPNG_IO_EOF);
  if (!direct) {  // RGB to luma in place: pixel i is written at i, read from 3i >= i
    for (std::size_t i = 0; i < n; ++i) {
      const unsigned r = px[3 * i], g = px[3 * i + 1], b = px[3 * i + 2];
      px[i] = std::uint8_t((299 * r + 587 * g + 114 * b + 500) / 1000);
    }
    px.resize(n);
  }
  return h;
}

// The decoded image a crop reads from, reused by the thread's next call.
inline std::vector<std::uint8_t>& png_crop_pixels() {
  thread_local std::vector<std::uint8_t> px;
  return px;
}

}  // namespace detail

// The header's size, bit depth, colour type and interlacing, from the signature and IHDR
// alone (the first 33 bytes, its CRC checked here: libspng checks it only when it reads
// on; the rest is not read). Throws format_error as the file's top says (not a PNG, a cut
// or corrupt IHDR, a size over lim.max_pixels), std::bad_alloc. Runs on the caller's
// thread.
inline png_info read_png_header(std::span<const std::byte> bytes, const png_limits& lim = {}) {
  detail::png_decoder d(bytes, lim);
  const png_info h = d.header(lim);
  if (bytes.size() < 33)
    throw format_error("PNG", bytes.size(), "truncated: the data ends in the 'IHDR' chunk at offset 8 (" +
                                                std::to_string(bytes.size()) + " bytes)");
  if (detail::png_crc(bytes.data() + 12, 17) != detail::png_u32(bytes.data() + 29))
    throw format_error("PNG", 29, "CRC mismatch in the 'IHDR' chunk at offset 8");
  return h;
}

// The whole image into img, uint8 HWC with `channels` 3 (RGB) or 1 (grey), converted as
// the file's top says, reusing its pixels' capacity (a loop over files allocates once).
// Throws config_error for a channel count other than 1 or 3, otherwise as the file's top
// says; img is then unspecified. Runs on the caller's thread.
inline void decode_png(std::span<const std::byte> bytes, image& img, std::uint32_t channels = 3,
                       const png_limits& lim = {}) {
  if (channels != 1 && channels != 3)
    throw config_error("decode_png: channels must be 1 or 3 (got " + std::to_string(channels) + ")");
  const png_info h = detail::decode_png_into(bytes, channels, lim, img.pixels, nullptr);
  img.height = h.height, img.width = h.width, img.channels = channels;
}
// The whole image, as a new one (see above).
inline image decode_png(std::span<const std::byte> bytes, std::uint32_t channels = 3, const png_limits& lim = {}) {
  image img;
  decode_png(bytes, img, channels, lim);
  return img;
}

// `win` of the image (in source pixels) resized bilinearly to out.height x out.width x
// out.channels, mirrored left to right when out.flip, into `dst` (at least that many
// bytes): a full decode (into a per-thread buffer), then resize_bilinear, so the result
// is exactly resize_bilinear on decode_png's image. Throws config_error for an output or
// window that is not valid (the window after the header is read, before the decode),
// otherwise as the file's top says. Runs on the caller's thread.
inline void decode_png_crop(std::span<const std::byte> bytes, const crop_window& win, const crop_output& out,
                            std::span<std::uint8_t> dst, const png_limits& lim = {}) {
  detail::check_png_output(out);
  const std::size_t need = std::size_t(out.height) * out.width * out.channels;
  if (dst.size() < need)
    throw config_error("decode_png_crop: the output holds " + std::to_string(dst.size()) + " bytes, fewer than " +
                       std::to_string(need));
  std::vector<std::uint8_t>& px = detail::png_crop_pixels();
  const png_info h = detail::decode_png_into(bytes, out.channels, lim, px, &win);
  resize_bilinear({px.data(), h.width, h.height, out.channels, std::size_t(h.width) * out.channels}, win.left, win.top,
                  win.width, win.height, out, dst.data());
}

}  // namespace ferry::image
