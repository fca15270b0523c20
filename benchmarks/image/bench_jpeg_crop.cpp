// The fused JPEG crop (ferry/image/jpeg.hpp's decode_jpeg_crop) against a full decode
// followed by the crop and the same bilinear resize (resize_bilinear), both ferry's, on the same images and
// the same RandomResizedCrop windows (to 224 x 224, flipped at random), in the same run.
//
// Images: photographs from Debian's mate-backgrounds (scripts/setup.sh installs it),
// re-encoded as ImageNet-like files: 500 x 375 crops of them, at quality 90 with 4:2:0
// chroma (libjpeg-turbo's encoder, encode_jpeg), built in memory here, so the figure is decoding alone.
// Prints `fused_crop_speedup:` (target 1.5), then where the time goes: the entropy decoding
// that no crop can skip, the resize that both sides share, and the ceiling the crops'
// geometry puts on the speedup. Run: bench_jpeg_crop [images] [reps].
#include <algorithm>
#include <csetjmp>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "common/timing.hpp"
#include "ferry/detail/random.hpp"
#include "ferry/image/jpeg.hpp"

namespace {

namespace fi = ferry::image;
using bytes_t = std::vector<std::byte>;

// The baseline's crop and resize: the same resizer over the whole decoded image.
void resize_full(const fi::image& img, const fi::crop_window& win, const fi::crop_output& out, std::uint8_t* o) {
  fi::resize_bilinear({img.pixels.data(), img.width, img.height, img.channels, std::size_t(img.width) * img.channels},
                      win.left, win.top, win.width, win.height, out, o);
}

volatile std::uint64_t sink;

// The entropy decoding alone: every row but the last skipped. libjpeg-turbo still decodes
// the Huffman codes of the rows it skips (a JPEG without restart markers has no other way
// to find a row), but runs no inverse DCT, upsampling or colour conversion for them.
void entropy_only(const bytes_t& f) {
  fi::detail::jpeg_decoder d;  // ferry's decoder set-up: the decode paths' memory source and errors
  if (setjmp(d.err.jump)) d.fail();
  fi::detail::read_header(d, f, {});
  fi::detail::set_colour(d.cinfo, 3);
  jpeg_start_decompress(&d.cinfo);
  jpeg_skip_scanlines(&d.cinfo, d.cinfo.output_height - 1);
  thread_local std::vector<unsigned char> row;
  row.resize(std::size_t(d.cinfo.output_width) * d.cinfo.output_components);
  JSAMPROW r = row.data();
  jpeg_read_scanlines(&d.cinfo, &r, 1);
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t count = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 400;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 5;
  const std::filesystem::path dir = "/usr/share/backgrounds/mate/nature";
  std::vector<std::filesystem::path> paths;
  if (std::filesystem::is_directory(dir))
    for (const auto& e : std::filesystem::directory_iterator(dir))
      if (e.path().extension() == ".jpg") paths.push_back(e.path());
  std::sort(paths.begin(), paths.end());  // the directory's order is not fixed
  std::vector<bytes_t> photos;
  for (const auto& p : paths) {
    std::ifstream f(p, std::ios::binary);
    std::vector<char> c((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    photos.emplace_back(reinterpret_cast<const std::byte*>(c.data()), reinterpret_cast<const std::byte*>(c.data()) + c.size());
  }
  if (photos.empty()) {
    std::printf("bench_jpeg_crop: no photographs in %s (scripts/setup.sh installs mate-backgrounds): skipped\n",
                dir.c_str());
    return 0;
  }

  // The corpus: 500 x 375 crops of the photographs (4:3, a third to all of the width).
  ferry::detail::splitmix64 g(2026);
  std::vector<bytes_t> files;
  std::vector<std::uint8_t> px(500 * 375 * 3);
  std::size_t corpus_bytes = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const bytes_t& src = photos[i % photos.size()];
    const fi::jpeg_info h = fi::read_jpeg_header(src);
    const std::uint32_t w = std::min<std::uint32_t>(h.width, std::uint32_t(double(h.height) * 4 / 3));
    const std::uint32_t cw = std::max<std::uint32_t>(500, w / 3 + std::uint32_t(g.below(w - w / 3 + 1)));
    const std::uint32_t ch = cw * 3 / 4;
    const fi::crop_window win{std::uint32_t(g.below(h.height - ch + 1)), std::uint32_t(g.below(h.width - cw + 1)), ch, cw};
    fi::decode_jpeg_crop(src, win, {375, 500, 3, false}, px);
    files.push_back(fi::encode_jpeg({px.data(), 500, 375, 3, 500 * 3}, {.quality = 90}));  // 4:2:0
    corpus_bytes += files.back().size();
  }

  // The same windows and flips for both: one draw per image, as a per-element seed would give.
  std::vector<fi::crop_window> wins(files.size());
  std::vector<bool> flips(files.size());
  for (std::size_t i = 0; i < files.size(); ++i) {
    ferry::detail::splitmix64 e(0x5eed + i);
    wins[i] = fi::random_resized_crop(500, 375, e);
    flips[i] = e.below(2) == 1;
  }
  std::vector<std::uint8_t> a(224 * 224 * 3), b(224 * 224 * 3);

  std::uint64_t sum_full = 0, sum_fused = 0;
  double full_s = 0, fused_s = 0;
  for (int round = 0; round < 2; ++round) {  // alternating, so neither side has the warm machine
    full_s = bench::median_seconds(reps, [&] {
      std::uint64_t s = 0;
      fi::image img;  // reused: one allocation, as a loop over files would do
      for (std::size_t i = 0; i < files.size(); ++i) {
        fi::decode_jpeg(files[i], img);
        resize_full(img, wins[i], {224, 224, 3, bool(flips[i])}, a.data());
        s += a[i % a.size()];
      }
      sum_full = s;
    });
    fused_s = bench::median_seconds(reps, [&] {
      std::uint64_t s = 0;
      for (std::size_t i = 0; i < files.size(); ++i) {
        fi::decode_jpeg_crop(files[i], wins[i], {224, 224, 3, bool(flips[i])}, b);
        s += b[i % b.size()];
      }
      sum_fused = s;
    });
  }
  sink = sum_full + sum_fused;

  // Where the time goes. The fused decode must entropy-decode every iMCU row down to the
  // crop's last, and runs the rest of the decoder (inverse DCT, upsampling, colour) over
  // the crop's iMCU-aligned area only: its floor is rows x entropy + area x (full - entropy).
  const fi::image one = fi::decode_jpeg(files[0]);
  const double entropy_s = bench::median_seconds(reps, [&] {
    for (const bytes_t& f : files) entropy_only(f);
  });
  const double decode_s = bench::median_seconds(reps, [&] {
    fi::image img;
    for (const bytes_t& f : files) fi::decode_jpeg(f, img);
  });
  const double resize_s = bench::median_seconds(reps, [&] {  // the same windows and output, on one decoded image
    for (std::size_t i = 0; i < files.size(); ++i) resize_full(one, wins[i], {224, 224, 3, bool(flips[i])}, a.data());
  });
  double rows = 0, area = 0;
  for (const fi::crop_window& w : wins) {  // 16-pixel iMCUs (4:2:0)
    const double bottom = std::min(375u, (w.top + w.height + 15) / 16 * 16);
    rows += bottom / 375;
    area += (bottom - w.top / 16 * 16) * (std::min(500u, (w.left + w.width + 15) / 16 * 16) - w.left / 16 * 16) / (375.0 * 500);
  }
  rows /= double(wins.size()), area /= double(wins.size());
  const double floor_s = rows * entropy_s + area * (decode_s - entropy_s);

  // How far apart the two are (DCT scaling averages where bilinear picks), on 50 images.
  double diff = 0;
  for (std::size_t i = 0; i < std::min<std::size_t>(50, files.size()); ++i) {
    const fi::image img = fi::decode_jpeg(files[i]);
    resize_full(img, wins[i], {224, 224, 3, bool(flips[i])}, a.data());
    fi::decode_jpeg_crop(files[i], wins[i], {224, 224, 3, bool(flips[i])}, b);
    for (std::size_t k = 0; k < a.size(); ++k) diff += std::abs(int(a[k]) - int(b[k]));
  }
  diff /= double(a.size()) * double(std::min<std::size_t>(50, files.size()));
  // The photographs themselves (2560 x 1600 and larger), each whole to 224 x 224: here the
  // DCT scaling applies.
  double large_full_s = 0, large_fused_s = 0;
  {
    fi::image img;
    large_full_s = bench::median_seconds(reps, [&] {
      for (const bytes_t& p : photos) {
        fi::decode_jpeg(p, img);
        resize_full(img, {0, 0, img.height, img.width}, {224, 224, 3, false}, a.data());
      }
    });
    large_fused_s = bench::median_seconds(reps, [&] {
      for (const bytes_t& p : photos) {
        const fi::jpeg_info h = fi::read_jpeg_header(p);
        fi::decode_jpeg_crop(p, {0, 0, h.height, h.width}, {224, 224, 3, false}, b);
      }
    });
  }
  const double n = double(files.size());
  std::printf("%zu images of 500x375 (%.1f KB each, quality 90, 4:2:0) from %zu photographs; RandomResizedCrop(224) + flip\n",
              files.size(), corpus_bytes / n / 1024, photos.size());
  std::printf("%-40s %12s %12s\n", "case", "images/s", "us/image");
  std::printf("%-40s %12.0f %12.1f\n", "full decode, then crop + resize", n / full_s, full_s * 1e6 / n);
  std::printf("%-40s %12.0f %12.1f\n", "fused (partial decode at DCT scale)", n / fused_s, fused_s * 1e6 / n);
  std::printf("mean |difference| between the two, 50 images: %.2f levels\n", diff);
  std::printf("{\"bench\":\"jpeg_crop\",\"images\":%zu,\"full_images_per_s\":%.1f,\"fused_images_per_s\":%.1f}\n", files.size(),
              n / full_s, n / fused_s);
  std::printf("the %zu photographs whole to 224x224: full %.1f ms, fused %.1f ms a photograph (%.2fx)\n", photos.size(),
              large_full_s * 1e3 / double(photos.size()), large_fused_s * 1e3 / double(photos.size()),
              large_full_s / large_fused_s);
  std::printf("fused_crop_speedup: %.3f\n", full_s / fused_s);
  std::printf("where the time goes, us/image: full decode %.1f, of which entropy decoding %.1f (%.0f%%); resize %.1f (both sides)\n",
              decode_s * 1e6 / n, entropy_s * 1e6 / n, 100 * entropy_s / decode_s, resize_s * 1e6 / n);
  std::printf("the crops' iMCU rows reach %.1f%% of the height on average, their iMCU-aligned area %.1f%% of the image\n",
              100 * rows, 100 * area);
  std::printf("fused decode without the resize %.1f us/image, its floor %.1f (rows x entropy + area x the rest)\n",
              (fused_s - resize_s) * 1e6 / n, floor_s * 1e6 / n);
  std::printf("decode_only_speedup: %.3f\n", (full_s - resize_s) / (fused_s - resize_s));
  std::printf("speedup_ceiling: %.3f with this resize, %.3f with a free one\n", (decode_s + resize_s) / (floor_s + resize_s),
              decode_s / floor_s);
  return 0;
}
