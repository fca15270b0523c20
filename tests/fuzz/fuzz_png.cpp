// libFuzzer harness for ferry/image/png.hpp: the input is a PNG file. Its header is read,
// it is decoded whole, grey and in colour, and cropped (a window from its header, into a
// small output, flipped or not). Any crash, sanitizer report, hang or huge allocation is a
// bug; ferry::format_error is the expected outcome for bad input, its offset inside the
// input. A decode that succeeds must agree with the header and with the crop.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "ferry/image/png.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::byte> in(size);  // a copy of its own size, so ASan sees reads past it
  if (size) std::memcpy(in.data(), data, size);
  // Every CRC is checked, so a mutation inside a chunk seldom gets past it: for two sizes
  // in three the CRCs are made right first, and the decoder behind them runs; the third
  // keeps the CRC checks themselves under test.
  if (size % 3 != 0) {
    for (std::size_t p = 8; p + 12 <= size;) {
      const std::uint64_t len = ferry::image::detail::png_u32(in.data() + p);
      if (len > size - p - 12) break;
      const std::uint32_t c = ferry::image::detail::png_crc(in.data() + p + 4, std::size_t(len) + 4);
      for (int i = 0; i < 4; ++i) in[p + 8 + std::size_t(len) + std::size_t(i)] = std::byte(c >> (24 - 8 * i));
      p += std::size_t(len) + 12;
    }
  }
  // libFuzzer's memory limit: 2^22 pixels (12 MiB as RGB), 1 MiB of metadata.
  const ferry::image::png_limits lim{.max_pixels = 1 << 22, .max_chunk_bytes = 1 << 20, .max_chunk_cache = 1 << 20};
  try {
    const ferry::image::png_info h = ferry::image::read_png_header(in, lim);
    ferry::image::image img;
    const std::uint32_t channels = size % 2 ? 3 : 1;
    ferry::image::decode_png(in, img, channels, lim);
    if (img.width != h.width || img.height != h.height || img.pixels.size() != std::size_t(h.width) * h.height * channels)
      __builtin_trap();
    // A window from the input's last bytes, inside the image; the crop is the resizer on
    // the full decode, so at the window's own size and no flip it is the window itself.
    const std::uint32_t w = 1 + (size > 1 ? data[size - 1] : 0) % h.width, hh = 1 + (size > 2 ? data[size - 2] : 0) % h.height;
    const ferry::image::crop_window win{(h.height - hh) / 2, (h.width - w) / 2, hh, w};
    std::vector<std::uint8_t> out(16 * 16 * 3);
    ferry::image::decode_png_crop(in, win, {16, 16, 3, (size & 4) != 0}, out, lim);
    if (w <= 16 && hh <= 16) {
      ferry::image::decode_png_crop(in, win, {hh, w, channels, false}, out, lim);
      for (std::uint32_t y = 0; y < hh; ++y)
        if (std::memcmp(out.data() + std::size_t(y) * w * channels,
                        img.pixels.data() + (std::size_t(win.top + y) * h.width + win.left) * channels,
                        std::size_t(w) * channels) != 0)
          __builtin_trap();
    }
  } catch (const ferry::format_error& e) {
    if (e.offset() > size) __builtin_trap();
  }
  return 0;
}
