// ferry/image/random_crop.hpp: decode + RandomResizedCrop + flip as one callable for map(),
// deterministic per (seed, epoch, element), on the fused JPEG crop of jpeg.hpp.
//
//   auto train = ferry::from_files({"photos/*.tar"}, ferry::webdataset{}) | ferry::shard(n, i)
//              | ferry::shuffle(4096, 7)
//              | ferry::map([crop = ferry::image::decode_random_crop<224, 224>({.seed = 7})](const ferry::record& r) {
//                  const auto s = ferry::parse_webdataset(r);
//                  return std::tuple{crop(s.at("jpg")), std::int32_t(std::stoi(std::string(s.at("cls").str())))};
//                }, {.workers = 8})
//              | ferry::batch(256);
//
// The draw: torchvision's RandomResizedCrop (random_resized_crop in image.hpp: area scale
// and log-uniform aspect ratio, ten tries, then the centre crop) and a horizontal flip with
// probability `flip`, from a SplitMix64 seeded by element_key: the seed, the record's
// epoch (record::origin().epoch: from_files' and interleave's count of rewinds;
// global_shuffle's and cache()'s for the records they hand out), its file's
// base name and its offset in that file. So the crop of an element depends on nothing but
// the seed, the epoch and which element it is: not on map's worker count, the order
// workers finish in, sharding or shuffling, nor on where a resumed job restarted. A new
// epoch gives new crops; the same epoch after a restore the same ones. (The base name, not
// the path, so that ranks that mount the data at different places draw alike.) A record
// built by hand has no file: it is keyed on its bytes (the same crop every epoch), or pass
// a key of your own to the (bytes, key) form.
//
// Threads: operator() runs on the thread calling it (map's workers) and may run on many at
// once: the callable is immutable, decoding state is per call and per thread (jpeg.hpp).
// Errors: format_error for a JPEG that cannot be decoded, naming the record's file and the
// byte offset in that file (the member's data offset plus jpeg.hpp's: where libjpeg was,
// or the JPEG's end for a cut one), with "JPEG:" and libjpeg's message; map() wraps it in
// an element_error naming the element. The constructor throws config_error for options
// out of range (a scale or ratio range that is empty, flip outside [0, 1]). Memory: the
// output array is the element (H * W * C bytes); nothing else is allocated per call once a
// thread's buffers have grown.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "ferry/detail/random.hpp"
#include "ferry/error.hpp"
#include "ferry/image/jpeg.hpp"
#include "ferry/sources/record.hpp"

namespace ferry::image {

// What decode_random_crop draws from.
struct random_crop_options {
  std::uint64_t seed = 0;  // with the epoch and the element, fixes every draw
  double scale_lo = 0.08, scale_hi = 1.0;        // the crop's area over the image's (torchvision's scale)
  double ratio_lo = 3.0 / 4, ratio_hi = 4.0 / 3;  // the crop's width over its height (torchvision's ratio)
  double flip = 0.5;  // the chance of a horizontal flip
  jpeg_limits limits{};  // the largest image decoded (jpeg.hpp)
};

// One element's draw: the window in source pixels, and whether to flip.
struct crop_draw {
  crop_window win;   // the crop of the source image
  bool flip = false;  // mirrored left to right
};

// The key of a record's draw: (seed, epoch, the file's base name, the offset of the
// record) for a record read from files; (seed, its bytes) for one built by hand. Throws
// nothing.
inline std::uint64_t element_key(std::uint64_t seed, const record& r) noexcept {
  const record_origin o = r.origin();
  std::uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  if (o.file.empty()) {
    for (std::byte b : r.bytes()) h = (h ^ std::to_integer<std::uint64_t>(b)) * 0x100000001b3ull;
    return ferry::detail::mix_seed({0x63726f70ull /* "crop" */, seed, h, r.size()});
  }
  const std::size_t slash = o.file.rfind('/');
  for (char c : o.file.substr(slash == std::string_view::npos ? 0 : slash + 1))
    h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return ferry::detail::mix_seed({0x63726f70ull, seed, o.epoch, h, o.data_offset});
}

// The draw for `key` over a width x height image (width, height >= 1). Throws nothing.
inline crop_draw draw_crop(std::uint64_t key, std::uint32_t width, std::uint32_t height,
                           const random_crop_options& o) noexcept {
  ferry::detail::splitmix64 g(key);
  crop_draw d;
  d.win = random_resized_crop(width, height, g, o.scale_lo, o.scale_hi, o.ratio_lo, o.ratio_hi);
  d.flip = double(g() >> 11) * 0x1.0p-53 < o.flip;
  return d;
}

// Decodes a JPEG, crops it as drawn and resizes the crop to H x W x C (C: 3 RGB, 1 grey)
// in one pass (decode_jpeg_crop: only the crop's region, at the smallest DCT scale). See
// the file's top for the draw, threads and errors.
template <std::uint32_t H, std::uint32_t W, std::uint32_t C = 3>
class decode_random_crop {
  static_assert(H > 0 && W > 0 && (C == 1 || C == 3), "decode_random_crop: H, W >= 1 and C = 1 or 3");

 public:
  // An output image: H rows of W pixels of C values (HWC), what batch() collates.
  using pixels = std::array<std::uint8_t, std::size_t(H) * W * C>;

  // Throws config_error for an empty scale or ratio range, or flip outside [0, 1].
  explicit decode_random_crop(random_crop_options o = {}) : o_(o) {
    if (!(o.scale_lo > 0 && o.scale_lo <= o.scale_hi && o.scale_hi <= 1))
      throw config_error("decode_random_crop: the scale range must satisfy 0 < lo <= hi <= 1 (got " +
                         std::to_string(o.scale_lo) + ", " + std::to_string(o.scale_hi) + ")");
    if (!(o.ratio_lo > 0 && o.ratio_lo <= o.ratio_hi))
      throw config_error("decode_random_crop: the ratio range must satisfy 0 < lo <= hi (got " +
                         std::to_string(o.ratio_lo) + ", " + std::to_string(o.ratio_hi) + ")");
    if (!(o.flip >= 0 && o.flip <= 1))
      throw config_error("decode_random_crop: flip is a probability in [0, 1] (got " + std::to_string(o.flip) + ")");
  }

  // The JPEG in `r`, keyed by element_key(seed, r); errors name r's file and offset.
  pixels operator()(const record& r) const {
    pixels out;
    const record_origin o = r.origin();
    try {
      into(r.bytes(), element_key(o_.seed, r), out);
    } catch (const format_error& e) {
      if (o.file.empty()) throw;
      throw format_error(std::string(o.file), o.data_offset + e.offset(), "JPEG: " + e.reason());
    }
    return out;
  }
  // A JPEG inside the element `r` (a tf.train.Example's "image/encoded" value, a view into
  // r's bytes: ferry::example::bytes), keyed by element_key(seed, r); errors name r's file
  // and the offset in it.
  pixels operator()(const record& r, std::string_view jpeg) const {
    pixels out;
    const std::span<const std::byte> b(reinterpret_cast<const std::byte*>(jpeg.data()), jpeg.size());
    const record_origin o = r.origin();
    try {
      into(b, element_key(o_.seed, r), out);
    } catch (const format_error& e) {
      const bool inside = !r.empty() && b.data() >= r.data() && b.data() + b.size() <= r.data() + r.size();
      if (o.file.empty() || !inside) throw;
      throw format_error(std::string(o.file), o.data_offset + std::uint64_t(b.data() - r.data()) + e.offset(),
                         "JPEG: " + e.reason());
    }
    return out;
  }
  // The JPEG in `bytes`, drawn from `key` (errors: path "JPEG", the offset in `bytes`).
  pixels operator()(std::span<const std::byte> bytes, std::uint64_t key) const {
    pixels out;
    into(bytes, key, out);
    return out;
  }
  // The same into the caller's H * W * C bytes.
  void into(std::span<const std::byte> bytes, std::uint64_t key, std::span<std::uint8_t> out) const {
    const jpeg_info h = read_jpeg_header(bytes, o_.limits);
    const crop_draw d = draw_crop(key, h.width, h.height, o_);
    decode_jpeg_crop(bytes, d.win, {H, W, C, d.flip}, out, o_.limits);
  }
  // The options it draws with.
  const random_crop_options& options() const noexcept { return o_; }

 private:
  random_crop_options o_;
};

}  // namespace ferry::image
