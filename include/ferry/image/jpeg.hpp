// ferry/image/jpeg.hpp: JPEG decoding (and encoding) on libjpeg-turbo (its libjpeg API, Debian's
// libjpeg62-turbo-dev; link with -ljpeg, pkg-config libjpeg), with a fused crop: only the
// region a crop needs is decoded, at the smallest DCT scale that still gives the output
// size, then resized. This is where DALI's image_random_crop and FFCV get their speed.
//
//   ferry::image::jpeg_info h = ferry::image::read_jpeg_header(bytes);
//   ferry::image::image full = ferry::image::decode_jpeg(bytes);            // uint8 HWC, RGB
//   std::array<std::uint8_t, 224 * 224 * 3> out;
//   auto win = ferry::image::random_resized_crop(h.width, h.height, rng);    // torchvision's draw
//   ferry::image::decode_jpeg_crop(bytes, win, {224, 224, 3, /*flip=*/true}, out);
//
// The fused crop: libjpeg-turbo decodes at scale k/8 through the inverse DCT, so a crop
// that is at least twice the output size costs a fraction of a full decode; the smallest k
// of 1, 2 and 4 whose scaled crop is at least the output size in both directions is taken,
// else 8 (full size: libjpeg-turbo has SIMD code for those four; 3/8, 5/8, 6/8 and 7/8 are
// plain C there and were slower than decoding at the next of them; docs/images.md).
// Only the crop's rows are decoded (jpeg_skip_scanlines before, none after) and, across,
// only the iMCU columns of its columns and of one more either side (jpeg_crop_scanline:
// libjpeg repeats a region's edge chroma where a full decode interpolates, tens of levels
// apart at 4:2:0 edges), so the crop has the pixels a full decode at that scale has.
// The resizer is bilinear, sampling pixel centres: after the DCT scaling the remaining
// reduction is less than 2x, where a two-tap filter does not alias visibly, and the DCT
// scaling itself is the low-pass filter for the rest (a full-resolution decode followed by
// bilinear would alias at 4x).
//
// Colour: out.channels 3 gives RGB, 1 grey (libjpeg converts); CMYK and YCCK JPEGs (Adobe,
// inverted) are converted to RGB here. Progressive JPEGs decode as libjpeg-turbo decodes
// them (a crop of one still reads the whole file).
//
// Threads: none; every function runs on the calling thread and may be called from several
// at once (map's workers): each call has its own decoder state.
//
// Errors: format_error for data that is not a JPEG, a truncated or corrupt one (libjpeg's
// warnings about pixel data are errors here: a truncated image is not silently grey; those
// that lose no pixel, such as an unknown JFIF revision or bytes skipped before a marker, are
// not, as in libjpeg-turbo's own tools and PIL), and a header whose
// size is 0 or more than limits.max_pixels, or more than the file's bytes can code (a bit a
// block of every component, for Huffman coding) (checked before anything is allocated from it),
// or more scans than limits.max_scans (found when libjpeg reaches the scan past it);
// the error's path is "JPEG" (map's element_error names the element), its offset the byte
// libjpeg had reached. A cut file fails every crop, whichever rows it needs: the scan's data
// must end in an EOI marker, checked first (offset: the file's end; bytes after the EOI are
// ignored, as by a full decode). Damaged data below a crop's rows goes unseen (not read).
// config_error for an output size or channel count that is not valid, or a crop window
// outside the image, or limits.max_scans below 1. std::bad_alloc, also when libjpeg's own
// allocations fail.
//
// Memory: decode_jpeg returns a new image or reuses the caller's; decode_jpeg_crop writes
// into the caller's span and keeps the decoded rows of the crop, and resize_bilinear its
// tables, in per-thread buffers that are reused.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <csetjmp>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <span>
#include <string>
#include <vector>

#include <jpeglib.h>  // after <cstdio> and <cstddef>: it uses FILE and size_t undeclared
#include <jerror.h>   // the warnings' codes (J_MESSAGE_CODE)

#include "ferry/error.hpp"
#include "ferry/image/image.hpp"

namespace ferry::image {

// What a JPEG's header says.
struct jpeg_info {
  std::uint32_t width = 0;   // pixels a row
  std::uint32_t height = 0;  // rows
  int components = 0;        // 1 grey, 3 YCbCr/RGB, 4 CMYK/YCCK
  bool progressive = false;  // progressive (else baseline or extended sequential) coding
};

// What a file may make a decode do: the most pixels its header may claim (2^28: 16384 x
// 16384), and the most scans (libjpeg reads a progressive file's scans one by one, each
// over every block of its components: a file of a few hundred kB repeating a scan thousands
// of times, each one valid, costs minutes at these sizes; real files have about 10, rarely
// over 20; djpeg's -maxscans is the same check).
struct jpeg_limits {
  std::uint64_t max_pixels = std::uint64_t(1) << 28;  // width x height at most
  int max_scans = 100;                                 // scans at most (progressive files)
};

namespace detail {

// libjpeg reports errors through error_exit, which must not return: it jumps back to the
// call, which throws. Warnings (corrupt data, a premature end) jump too.
struct jpeg_error {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX] = {};
};
extern "C" inline void ferry_jpeg_error_exit(j_common_ptr c) {
  auto* e = reinterpret_cast<jpeg_error*>(c->err);
  (*c->err->format_message)(c, e->message);
  std::longjmp(e->jump, 1);
}
// Warnings that lose no pixel: metadata libjpeg does not understand (a JFIF revision, an
// Adobe transform code, a bad ICC marker, unusual SOS parameters) or bytes it skips before
// a marker. libjpeg-turbo and PIL decode such files, and so does ferry.
inline bool harmless_warning(int code) {
  return code == JWRN_JFIF_MAJOR || code == JWRN_ADOBE_XFORM || code == JWRN_BOGUS_ICC ||
         code == JWRN_NOT_SEQUENTIAL || code == JWRN_EXTRANEOUS_DATA;
}
extern "C" inline void ferry_jpeg_emit_message(j_common_ptr c, int level) {
  // The other warnings (a premature end, a bad Huffman or arithmetic code, a lost restart
  // marker, an inconsistent progression) mean pixels that are not the file's: an error.
  if (level < 0 && !harmless_warning(c->err->msg_code)) ferry_jpeg_error_exit(c);
}

// Stops a decode at scan max_scans + 1: libjpeg calls it as it reads the file.
struct jpeg_scan_limit {
  jpeg_progress_mgr mgr;
  int max_scans;
};
extern "C" inline void ferry_jpeg_progress(j_common_ptr c) {
  const auto* d = reinterpret_cast<j_decompress_ptr>(c);
  const int most = reinterpret_cast<const jpeg_scan_limit*>(c->progress)->max_scans;
  if (d->input_scan_number <= most) return;
  auto* e = reinterpret_cast<jpeg_error*>(c->err);
  c->err->msg_code = 0;  // not an out-of-memory code left by an earlier (harmless) warning
  std::snprintf(e->message, sizeof e->message, "more than %d scans (jpeg_limits::max_scans)", most);
  std::longjmp(e->jump, 1);
}

// One decompressor for one call; destroyed on every path. create() runs inside the
// caller's setjmp: libjpeg's first allocation may fail, and its error jumps.
struct jpeg_decoder {
  jpeg_decompress_struct cinfo{};
  jpeg_error err{};
  jpeg_scan_limit scans{};
  std::size_t size = 0;
  jpeg_decoder() {
    cinfo.err = jpeg_std_error(&err.mgr);
    err.mgr.error_exit = ferry_jpeg_error_exit;
    err.mgr.emit_message = ferry_jpeg_emit_message;
  }
  jpeg_decoder(const jpeg_decoder&) = delete;
  jpeg_decoder& operator=(const jpeg_decoder&) = delete;
  ~jpeg_decoder() { jpeg_destroy_decompress(&cinfo); }  // harmless before create() (no memory manager)
  void create() { jpeg_create_decompress(&cinfo); }
  // Where libjpeg had read to (the error's byte offset).
  std::size_t offset() const { return cinfo.src ? size - cinfo.src->bytes_in_buffer : 0; }
  // The error libjpeg jumped with: std::bad_alloc when it ran out of memory (a good file
  // must not read as a corrupt one), else format_error.
  [[noreturn]] void fail() const {
    if (err.mgr.msg_code == JERR_OUT_OF_MEMORY) throw std::bad_alloc();
    throw format_error("JPEG", offset(), std::string(err.message) + " (of " + std::to_string(size) + " bytes)");
  }
};

inline void check_output(const char* fn, const crop_output& out) {
  if (out.height == 0 || out.width == 0)
    throw config_error(std::string(fn) + ": the output size must be at least 1x1 (got " + std::to_string(out.height) +
                       "x" + std::to_string(out.width) + ")");
  if (out.channels != 1 && out.channels != 3)
    throw config_error(std::string(fn) + ": channels must be 1 or 3 (got " + std::to_string(out.channels) + ")");
}

// Creates the decompressor, reads the header and checks the size against the limits
// (nothing allocated from it yet), and sets the scan limit. Call inside the setjmp of the
// caller.
inline void read_header(jpeg_decoder& d, std::span<const std::byte> bytes, const jpeg_limits& lim) {
  if (bytes.size() < 3 || bytes[0] != std::byte{0xFF} || bytes[1] != std::byte{0xD8})
    throw format_error("JPEG", 0, "not a JPEG: no SOI marker (" + std::to_string(bytes.size()) + " bytes)");
  if (lim.max_scans < 1)
    throw config_error("jpeg_limits: max_scans must be at least 1 (got " + std::to_string(lim.max_scans) + ")");
  d.create();
  d.scans.mgr.progress_monitor = ferry_jpeg_progress;
  d.scans.max_scans = lim.max_scans;
  d.cinfo.progress = &d.scans.mgr;
  d.size = bytes.size();
  jpeg_mem_src(&d.cinfo, reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<unsigned long>(bytes.size()));
  jpeg_read_header(&d.cinfo, TRUE);
  const std::uint64_t px = std::uint64_t(d.cinfo.image_width) * d.cinfo.image_height;
  if (px == 0 || px > lim.max_pixels)
    throw format_error("JPEG", d.offset(),
                       "the header claims " + std::to_string(d.cinfo.image_width) + "x" +
                           std::to_string(d.cinfo.image_height) + " pixels, " +
                           (px == 0 ? std::string("none") : "more than the limit of " + std::to_string(lim.max_pixels)));
  // Huffman codes are at least a bit long, and every block of every component is coded in
  // some scan (its DC, or all of a sequential block): a file too short for that is refused
  // before libjpeg's buffers and the image are allocated from its claim (within the limit,
  // hundreds of MB for a file of a few hundred bytes). Not the first scan's blocks alone: a
  // file whose first scan is a component subsampled against the others claims 33 times its
  // blocks. Arithmetic coding can spend less than a bit a block: only the limit holds there.
  if (!d.cinfo.arith_code) {
    std::uint64_t blocks = 0;
    for (int i = 0; i < d.cinfo.num_components; ++i)
      blocks += std::uint64_t(d.cinfo.comp_info[i].width_in_blocks) * d.cinfo.comp_info[i].height_in_blocks;
    const std::uint64_t least = (blocks + 7) / 8, left = bytes.size() - d.offset();
    if (left < least)
      throw format_error("JPEG", d.offset(),
                         "the header claims " + std::to_string(d.cinfo.image_width) + "x" +
                             std::to_string(d.cinfo.image_height) + " pixels, whose scans need at least " +
                             std::to_string(least) + " bytes; the file has " + std::to_string(left) +
                             " after its header (of " + std::to_string(bytes.size()) + " bytes)");
  }
}

// The output colour space for `channels`; CMYK/YCCK come out as CMYK, converted after.
inline bool set_colour(jpeg_decompress_struct& c, std::uint32_t channels) {
  const bool cmyk = c.jpeg_color_space == JCS_CMYK || c.jpeg_color_space == JCS_YCCK;
  c.out_color_space = cmyk ? JCS_CMYK : channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
  return cmyk;
}

// One pixel of an Adobe (inverted) CMYK row to RGB or grey.
inline void cmyk_to(const std::uint8_t* s, std::uint8_t* d, std::uint32_t channels) {
  const unsigned k = s[3];
  const std::uint8_t r = std::uint8_t(s[0] * k / 255), g = std::uint8_t(s[1] * k / 255), b = std::uint8_t(s[2] * k / 255);
  if (channels == 3) {
    d[0] = r, d[1] = g, d[2] = b;
  } else {
    d[0] = std::uint8_t((299 * r + 587 * g + 114 * b + 500) / 1000);
  }
}

// A file cut short, found before a crop that stops above the cut would decode it: the last
// scan's data must be followed by an EOI marker (FF D9), as libjpeg's full decode requires;
// bytes after it are ignored, as there. Entropy-coded data holds no FF D9 (an FF there is
// followed by 00 or a restart marker) and the search starts after the SOS header (APPn and
// COM segments before it may hold any bytes): a backwards scan, two bytes for most files.
// (A file of several scans, progressive, libjpeg reads whole before any row: it finds a cut.)
inline void check_eoi(const jpeg_decoder& d, std::span<const std::byte> bytes) {
  const std::size_t from = d.offset();  // after the (first) SOS header
  for (std::size_t i = bytes.size(); i >= from + 2; --i)
    if (bytes[i - 1] == std::byte{0xD9} && bytes[i - 2] == std::byte{0xFF}) return;
  throw format_error("JPEG", bytes.size(),
                     "Premature end of JPEG file: truncated, no EOI marker after the scan's data from offset " +
                         std::to_string(from) + " (of " + std::to_string(bytes.size()) + " bytes)");
}

// Rows decoded for a crop, reused by the thread's next call.
inline std::vector<std::uint8_t>& crop_rows() {
  thread_local std::vector<std::uint8_t> rows;
  return rows;
}

}  // namespace detail

// The header's size, components and coding, without decoding. Throws format_error.
inline jpeg_info read_jpeg_header(std::span<const std::byte> bytes, const jpeg_limits& lim = {}) {
  detail::jpeg_decoder d;
  if (setjmp(d.err.jump)) d.fail();
  detail::read_header(d, bytes, lim);
  return {d.cinfo.image_width, d.cinfo.image_height, d.cinfo.num_components, d.cinfo.progressive_mode != 0};
}

// The whole image into img, uint8 HWC with `channels` 3 (RGB) or 1 (grey), reusing its
// pixels' capacity (a loop over files allocates once). Throws as the file's top says; img
// is then unspecified.
inline void decode_jpeg(std::span<const std::byte> bytes, image& img, std::uint32_t channels = 3,
                        const jpeg_limits& lim = {}) {
  detail::check_output("decode_jpeg", {1, 1, channels, false});
  detail::jpeg_decoder d;
  std::vector<std::uint8_t> row;
  if (setjmp(d.err.jump)) d.fail();
  detail::read_header(d, bytes, lim);
  const bool cmyk = detail::set_colour(d.cinfo, channels);
  jpeg_start_decompress(&d.cinfo);
  img.height = d.cinfo.output_height, img.width = d.cinfo.output_width, img.channels = channels;
  img.pixels.resize(std::size_t(img.height) * img.width * channels);
  if (cmyk) row.resize(std::size_t(img.width) * 4);
  while (d.cinfo.output_scanline < d.cinfo.output_height) {
    std::uint8_t* dst = img.pixels.data() + std::size_t(d.cinfo.output_scanline) * img.width * channels;
    JSAMPROW r = cmyk ? row.data() : dst;
    jpeg_read_scanlines(&d.cinfo, &r, 1);
    if (cmyk)
      for (std::uint32_t x = 0; x < img.width; ++x) detail::cmyk_to(row.data() + 4 * x, dst + channels * x, channels);
  }
  jpeg_finish_decompress(&d.cinfo);
}
// The whole image, as a new one (see above).
inline image decode_jpeg(std::span<const std::byte> bytes, std::uint32_t channels = 3, const jpeg_limits& lim = {}) {
  image img;
  decode_jpeg(bytes, img, channels, lim);
  return img;
}

// The DCT scale k/8 (k = 1, 2, 4 or 8) a fused crop decodes `win` at for `out`: the
// smallest of 1, 2 and 4 whose scaled crop is at least the output in both directions,
// else 8 (full size; when even that is smaller the resize enlarges).
inline unsigned jpeg_crop_scale(const crop_window& win, const crop_output& out) {
  for (unsigned k = 1; k < 8; k *= 2)
    if (std::uint64_t(win.width) * k >= std::uint64_t(out.width) * 8 && std::uint64_t(win.height) * k >= std::uint64_t(out.height) * 8)
      return k;
  return 8;
}

// The fused crop: `win` of the source (in source pixels) decoded at jpeg_crop_scale and
// resized bilinearly to out.height x out.width x out.channels, mirrored left to right when
// out.flip, into `dst` (at least that many bytes). Throws as the file's top says.
inline void decode_jpeg_crop(std::span<const std::byte> bytes, const crop_window& win, const crop_output& out,
                             std::span<std::uint8_t> dst, const jpeg_limits& lim = {}) {
  detail::check_output("decode_jpeg_crop", out);
  const std::size_t need = std::size_t(out.height) * out.width * out.channels;
  if (dst.size() < need)
    throw config_error("decode_jpeg_crop: the output holds " + std::to_string(dst.size()) + " bytes, fewer than " +
                       std::to_string(need));
  detail::jpeg_decoder d;
  std::vector<std::uint8_t>& rows = detail::crop_rows();
  std::vector<std::uint8_t> cmyk_row;
  if (setjmp(d.err.jump)) d.fail();
  detail::read_header(d, bytes, lim);
  const std::uint32_t iw = d.cinfo.image_width, ih = d.cinfo.image_height;
  if (win.width == 0 || win.height == 0 || win.left > iw || win.top > ih || win.width > iw - win.left ||
      win.height > ih - win.top)
    throw config_error("decode_jpeg_crop: the crop " + std::to_string(win.width) + "x" + std::to_string(win.height) +
                       " at (" + std::to_string(win.left) + ", " + std::to_string(win.top) + ") is not inside the " +
                       std::to_string(iw) + "x" + std::to_string(ih) + " image");
  detail::check_eoi(d, bytes);  // a cut file fails whichever rows the window needs
  const unsigned k = jpeg_crop_scale(win, out);
  d.cinfo.scale_num = k;
  d.cinfo.scale_denom = 8;
  const bool cmyk = detail::set_colour(d.cinfo, out.channels);
  const unsigned comps = cmyk ? 4 : out.channels;
  jpeg_start_decompress(&d.cinfo);
  const std::uint32_t sw = d.cinfo.output_width, sh = d.cinfo.output_height;  // the scaled image
  // The window in scaled pixels, as real numbers, and the whole pixels that cover it. At
  // scale k/8 each 8x8 block becomes k x k, so source pixel x is at x k / 8 (sw / iw is
  // larger where iw is not a multiple of 8 / k: up to 7 source pixels off at 1/8).
  const double sx = k / 8.0, sy = sx;
  const double fx0 = win.left * sx, fy0 = win.top * sy, fw = win.width * sx, fh = win.height * sy;
  const std::uint32_t x0 = std::min<std::uint32_t>(sw - 1, std::uint32_t(fx0));
  const std::uint32_t x1 = std::max(x0 + 1, std::min<std::uint32_t>(sw, std::uint32_t(std::ceil(fx0 + fw))));
  const std::uint32_t y0 = std::min<std::uint32_t>(sh - 1, std::uint32_t(fy0));
  const std::uint32_t y1 = std::max(y0 + 1, std::min<std::uint32_t>(sh, std::uint32_t(std::ceil(fy0 + fh))));
  // A column more each side (inside the image), then widened to iMCU columns: libjpeg
  // upsamples subsampled chroma at a cropped region's edges by repeating the edge sample,
  // so the window's own columns get the neighbours a full decode gives them.
  JDIMENSION cx = x0 ? x0 - 1 : 0, cw = std::min<std::uint32_t>(sw, x1 + 1) - cx;
  // libjpeg-turbo interpolates ("fancy" upsampling, as a full decode does) only a chroma
  // row more than 2 samples wide: a region of at least 2 x max_h_samp_factor + 1 columns.
  const JDIMENSION least = 2 * JDIMENSION(d.cinfo.max_h_samp_factor) + 1;
  if (cw < least) {
    const JDIMENSION end = std::min<JDIMENSION>(sw, std::max<JDIMENSION>(cx + cw, cx + least));
    cx = end >= least ? std::min(cx, end - least) : 0;
    cw = end - cx;
  }
  if (cx != 0 || cw != sw) jpeg_crop_scanline(&d.cinfo, &cx, &cw);
  if (y0) jpeg_skip_scanlines(&d.cinfo, y0);
  const std::size_t stride = std::size_t(cw) * comps, rh = y1 - y0;
  rows.resize(stride * rh);
  for (std::size_t r = 0; r < rh; ++r) {
    JSAMPROW p = rows.data() + r * stride;
    jpeg_read_scanlines(&d.cinfo, &p, 1);
  }
  jpeg_abort_decompress(&d.cinfo);  // the rows below the crop are not needed
  if (cmyk) {  // to RGB or grey in place, row by row (out.channels <= 4)
    cmyk_row.resize(stride);
    for (std::size_t r = 0; r < rh; ++r) {
      std::uint8_t* row = rows.data() + r * stride;
      std::copy(row, row + stride, cmyk_row.begin());
      for (std::size_t x = 0; x < cw; ++x) detail::cmyk_to(cmyk_row.data() + 4 * x, row + out.channels * x, out.channels);
    }
  }
  const std::size_t rstride = cmyk ? stride : std::size_t(cw) * out.channels;  // (CMYK rows keep their stride)
  // The window relative to the decoded rows, which start at (cx, y0) and cover it.
  resize_bilinear({rows.data(), cw, std::uint32_t(rh), out.channels, rstride}, fx0 - cx, fy0 - y0, fw, fh, out,
                  dst.data());
}

// encode_jpeg()'s options.
struct jpeg_encode_options {
  int quality = 90;          // 1-100
  bool progressive = false;  // progressive coding (else baseline)
  bool subsample = true;     // 4:2:0 chroma for colour (else 4:4:4)
};

// px (channels 1: grey, 3: RGB, 4: CMYK, stored as Adobe writes it, inverted) as a JPEG
// file: making test data and re-encoding datasets. Throws config_error for a channel count
// or quality that is not valid or an empty image, std::bad_alloc. Runs on the caller's
// thread; several threads may encode at once.
inline std::vector<std::byte> encode_jpeg(const pixels_view& px, const jpeg_encode_options& o = {}) {
  if (px.channels != 1 && px.channels != 3 && px.channels != 4)
    throw config_error("encode_jpeg: channels must be 1, 3 or 4 (got " + std::to_string(px.channels) + ")");
  if (px.width == 0 || px.height == 0 || px.width > 65500 || px.height > 65500)
    throw config_error("encode_jpeg: " + std::to_string(px.width) + "x" + std::to_string(px.height) +
                       " pixels: a JPEG holds 1 to 65500 each way");
  if (o.quality < 1 || o.quality > 100)
    throw config_error("encode_jpeg: quality must be 1 to 100 (got " + std::to_string(o.quality) + ")");
  jpeg_compress_struct c{};
  detail::jpeg_error err{};
  c.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = detail::ferry_jpeg_error_exit;
  unsigned char* out = nullptr;
  unsigned long size = 0;
  if (setjmp(err.jump)) {  // out of memory inside libjpeg, in effect
    jpeg_destroy_compress(&c);  // harmless when the create failed (no memory manager)
    std::free(out);
    throw std::bad_alloc();
  }
  jpeg_create_compress(&c);  // inside the setjmp: its first allocation may fail
  jpeg_mem_dest(&c, &out, &size);
  c.image_width = px.width, c.image_height = px.height, c.input_components = int(px.channels);
  c.in_color_space = px.channels == 1 ? JCS_GRAYSCALE : px.channels == 3 ? JCS_RGB : JCS_CMYK;
  jpeg_set_defaults(&c);
  jpeg_set_quality(&c, o.quality, TRUE);
  if (px.channels == 3 && !o.subsample)
    for (int i = 0; i < c.num_components; ++i) c.comp_info[i].h_samp_factor = c.comp_info[i].v_samp_factor = 1;
  if (o.progressive) jpeg_simple_progression(&c);
  jpeg_start_compress(&c, TRUE);
  while (c.next_scanline < c.image_height) {
    JSAMPROW row = const_cast<std::uint8_t*>(px.data + std::size_t(c.next_scanline) * px.stride);
    jpeg_write_scanlines(&c, &row, 1);
  }
  jpeg_finish_compress(&c);
  jpeg_destroy_compress(&c);
  std::vector<std::byte> file(reinterpret_cast<std::byte*>(out), reinterpret_cast<std::byte*>(out) + size);
  std::free(out);
  return file;
}

}  // namespace ferry::image
