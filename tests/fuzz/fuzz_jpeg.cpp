// libFuzzer harness for ferry/image/jpeg.hpp: the input is a JPEG file. It is read whole,
// grey and in colour, and cropped (a window from its header, into a small output, at the
// scales the window gives). Any crash, sanitizer report, hang or huge allocation is a bug;
// ferry::format_error is the expected outcome for bad input, its offset inside the input.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "ferry/image/jpeg.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::byte> in(size);  // a copy of its own size, so ASan sees reads past it
  if (size) std::memcpy(in.data(), data, size);
  const ferry::image::jpeg_limits lim{.max_pixels = 1 << 22};  // libFuzzer's memory limit
  try {
    const ferry::image::jpeg_info h = ferry::image::read_jpeg_header(in, lim);
    ferry::image::image img;
    ferry::image::decode_jpeg(in, img, size % 2 ? 3 : 1, lim);
    if (img.pixels.size() != std::size_t(h.width) * h.height * img.channels) __builtin_trap();
    // A window from the input's last bytes, inside the image; outputs at 1/8 to 1 scale.
    const std::uint32_t w = 1 + (size > 1 ? data[size - 1] : 0) % h.width, hh = 1 + (size > 2 ? data[size - 2] : 0) % h.height;
    const ferry::image::crop_window win{(h.height - hh) / 2, (h.width - w) / 2, hh, w};
    std::vector<std::uint8_t> out(16 * 16 * 3);
    ferry::image::decode_jpeg_crop(in, win, {16, 16, 3, (size & 4) != 0}, out, lim);
    ferry::image::decode_jpeg_crop(in, win, {std::min<std::uint32_t>(16, hh), std::min<std::uint32_t>(16, w), 1, false}, out, lim);
  } catch (const ferry::format_error& e) {
    if (e.offset() > size) __builtin_trap();
  }
  return 0;
}
