// bench_images: images/s of JPEG decode + RandomResizedCrop(224) + flip, batched, from
// WebDataset tar shards: ferry against PyTorch's DataLoader with torchvision's transforms
// (torchvision_baseline.py), on the same files with the same number of workers, in the
// same run.
//   ferry:       from_files(shards, webdataset) | map(parse + decode_random_crop<224, 224>, {.workers}) | batch(64)
//   ferry, full: the same map with a full decode_jpeg, then the same crop and resize
//                (resize_bilinear): what the fused crop saves
//   PyTorch:     DataLoader(IterableDataset over the shards, num_workers) with PIL decode +
//                RandomResizedCrop(224) + RandomHorizontalFlip + PILToTensor, batch 64
// Both start their clock after the first 512 images (threads started, page cache warm)
// and stop after the last batch of the last epoch. The shards: scripts/setup.sh --images
// (4000 photographs from mate-backgrounds, 500 x 375 at quality 90, in 8 shards).
//
// Output: a table, a JSON line, then `images_vs_torchvision: <ferry / PyTorch>` and
// `full_decode_vs_torchvision:`. Usage: bench_images [shard glob] [workers (2)] [epochs (2)]
// [python3]. Exits 77 without shards; the ratios are n/a without torchvision.
#include <glob.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "common/timing.hpp"
#include "ferry/image/random_crop.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/sources/webdataset.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/map.hpp"

#ifndef FERRY_SOURCE_DIR
#define FERRY_SOURCE_DIR "."
#endif

namespace {

namespace fi = ferry::image;
constexpr std::uint32_t side = 224;
using crop_t = fi::decode_random_crop<side, side, 3>;
using element = std::tuple<crop_t::pixels, std::int32_t>;
constexpr std::size_t batch_rows = 64, warmup = 512;

std::int32_t label_of(const ferry::webdataset_sample& s) {
  const auto t = s.at("cls").str();
  std::int32_t v = 0;
  for (char c : t)
    if (c >= '0' && c <= '9') v = v * 10 + (c - '0');
  return v;
}

// The full decode, then the same draw's crop and resize: the baseline of the fused crop.
struct full_decode {
  fi::random_crop_options o;
  element operator()(const ferry::record& r) const {
    const auto s = ferry::parse_webdataset(r);
    const ferry::record& jpg = s.at("jpg");
    thread_local fi::image img;
    fi::decode_jpeg(jpg.bytes(), img, 3);
    const fi::crop_draw d = fi::draw_crop(fi::element_key(o.seed, jpg), img.width, img.height, o);
    element e;
    fi::resize_bilinear({img.pixels.data(), img.width, img.height, 3, std::size_t(img.width) * 3}, d.win.left,
                        d.win.top, d.win.width, d.win.height, {side, side, 3, d.flip}, std::get<0>(e).data());
    std::get<1>(e) = label_of(s);
    return e;
  }
};

// Images/s of `fn` over `epochs` epochs after the first `warmup` images; `sum` reads a
// value of every batch, so no work is left out.
template <class F>
double rate(const std::vector<std::string>& shards, F fn, std::size_t workers, int epochs, std::size_t& images,
            std::uint64_t& sum) {
  auto p = ferry::from_files(shards, ferry::webdataset{}) | ferry::map(std::move(fn), {.workers = workers}) |
           ferry::batch(batch_rows);
  std::size_t n = 0, n0 = 0;
  double t0 = 0;
  sum = 0;
  for (int e = 0; e < epochs; ++e) {
    for (auto& b : p) {
      const auto px = b.template field<0>();
      n += px.size();
      sum += px.front()[px.front().size() / 2] + std::size_t(b.template field<1>().back());
      if (t0 == 0 && n >= warmup) {
        t0 = bench::now();
        n0 = n;
      }
    }
    p.rewind();
  }
  images = n - n0;
  return double(images) / (bench::now() - t0);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string pattern = argc > 1 ? argv[1] : std::string(FERRY_SOURCE_DIR) + "/data/images/photos/photos-*.tar";
  const std::size_t workers = argc > 2 ? std::stoul(argv[2]) : 2;
  const int epochs = argc > 3 ? std::stoi(argv[3]) : 2;
  const std::string py = argc > 4 ? argv[4] : "/usr/bin/python3";
  std::vector<std::string> shards;
  glob_t g{};
  if (::glob(pattern.c_str(), 0, nullptr, &g) == 0)
    for (std::size_t i = 0; i < g.gl_pathc; ++i) shards.emplace_back(g.gl_pathv[i]);
  globfree(&g);
  if (shards.empty()) {
    std::printf("bench_images: no shards match %s (make them: bash scripts/setup.sh --images)\n", pattern.c_str());
    return 77;
  }

  const fi::random_crop_options o{.seed = 1};
  std::size_t fused_n = 0, full_n = 0;
  std::uint64_t fused_sum = 0, full_sum = 0;
  const double fused = rate(
      shards,
      [c = crop_t(o)](const ferry::record& r) {
        const auto s = ferry::parse_webdataset(r);
        return element{c(s.at("jpg")), label_of(s)};
      },
      workers, epochs, fused_n, fused_sum);
  const double full = rate(shards, full_decode{o}, workers, epochs, full_n, full_sum);

  double torch_ips = 0;
  std::size_t torch_n = 0;
  int torch_workers = 0;
  const std::string cmd = py + " " + std::string(FERRY_SOURCE_DIR) + "/benchmarks/image/torchvision_baseline.py" +
                          " --workers " + std::to_string(workers) + " --epochs " + std::to_string(epochs) +
                          " --batch " + std::to_string(batch_rows) + " --warmup-images " + std::to_string(warmup) +
                          " --shards '" + pattern + "' 2>/dev/null";
  if (FILE* f = ::popen(cmd.c_str(), "r")) {
    if (std::fscanf(f, "torchvision_images_per_s: %lf images %zu workers %d", &torch_ips, &torch_n,
                    &torch_workers) != 3)
      torch_ips = 0;
    ::pclose(f);
  }

  std::printf("%zu shards, %zu workers, %d epochs, batches of %zu, %ux%u RGB out\n", shards.size(), workers, epochs,
              batch_rows, side, side);
  std::printf("%-64s %12s %10s\n", "case", "images/s", "images");
  std::printf("%-64s %12.1f %10zu\n", "ferry: map(decode_random_crop: the fused crop) | batch", fused, fused_n);
  std::printf("%-64s %12.1f %10zu\n", "ferry: map(decode_jpeg, then the same crop + resize) | batch", full, full_n);
  std::printf("%-64s %12.1f %10zu\n", "PyTorch DataLoader + torchvision (PIL, RandomResizedCrop, flip)", torch_ips,
              torch_n);
  std::printf("{\"bench\":\"images\",\"shards\":%zu,\"workers\":%zu,\"epochs\":%d,\"ferry_images_per_s\":%.6g,"
              "\"ferry_full_decode_images_per_s\":%.6g,\"torchvision_images_per_s\":%.6g,\"checksums\":[%llu,%llu]}\n",
              shards.size(), workers, epochs, fused, full, torch_ips, (unsigned long long)fused_sum,
              (unsigned long long)full_sum);
  std::printf("fused_vs_full_decode: %.2f\n", fused / full);
  if (torch_ips > 0) {
    std::printf("images_vs_torchvision: %.2f\n", fused / torch_ips);
    std::printf("full_decode_vs_torchvision: %.2f\n", full / torch_ips);
  } else {
    std::printf("images_vs_torchvision: n/a (no torchvision: %s)\n", cmd.c_str());
  }
  return 0;
}
