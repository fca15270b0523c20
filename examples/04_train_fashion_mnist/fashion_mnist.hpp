// fashion_mnist.hpp: the example's input pipeline over Debian's gzip IDX files, shared by
// train_fashion_mnist and the GPU training benchmark (benchmarks/train/).
//
//   zip(from_files(images, idx), from_files(labels, idx))   one (image row, label) pair
//   | take(limit)                                            the first `limit` pairs
//   | cache()                                                epoch 1 inflates the gzip files;
//                                                            later epochs replay its records
//   | shuffle(buffer, seed)                                  new order every epoch
//   | map(bytes -> normalised floats, {.workers})            on worker threads
//   | batch(global batch) | prefetch(2)                      a thread ahead of training
//   | distribute(tag, {.staging_thread})                     host_replicas{R} or cuda::devices
//                                                            (GPUs: copies on its own thread)
//
// The test split is not shuffled and its last batch is padded (every image counts once);
// the training split drops its short last batch. Throws what from_files throws (io_error,
// format_error naming the file) when the files are missing or corrupt, and ferry::error
// (from zip) when the image and label files hold different numbers of records. The map runs on the
// map stage's worker threads; everything else on the thread that pulls.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ferry/error.hpp"
#include "ferry/source.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/sources/idx.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/cache.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/map.hpp"
#include "ferry/stages/prefetch.hpp"
#include "ferry/stages/shuffle.hpp"
#include "ferry/stages/take.hpp"
#include "ferry/stages/zip.hpp"

namespace fmnist {

constexpr int pixels = 28 * 28;
constexpr int classes = 10;
constexpr std::size_t train_images = 60000;
using sample = std::tuple<std::array<float, pixels>, std::int32_t>;

// Bytes to floats, normalised with Fashion-MNIST's training mean and deviation.
template <class Pair>
sample to_sample(const Pair& p) {
  sample s;
  auto img = p.first.bytes();
  auto lab = p.second.bytes();
  if (img.size() != pixels || lab.size() != 1)
    throw ferry::config_error("fashion-mnist: expected 784-byte images and 1-byte labels, got " +
                              std::to_string(img.size()) + " and " + std::to_string(lab.size()));
  auto& x = std::get<0>(s);
  for (int i = 0; i < pixels; ++i)
    x[i] = (std::to_integer<int>(img[i]) * (1.0f / 255.0f) - 0.2860f) * (1.0f / 0.3530f);
  std::get<1>(s) = std::to_integer<int>(lab[0]);
  return s;
}

struct pipeline_options {
  std::string dir = "/usr/share/datasets/fashion-mnist";
  std::string split = "train";  // or "t10k"
  bool train = true;            // shuffle and drop the short last batch (else keep order, pad)
  std::size_t batch = 128;      // the global batch
  std::size_t shuffle_buffer = 20000;
  std::uint64_t seed = 1;
  std::size_t workers = 1;      // map worker threads
  std::uint64_t limit = ~std::uint64_t(0);  // the first `limit` samples only
  bool staging = true;          // GPUs: distribute's staging thread (false: on the consumer's)
};

// The whole pipeline, ending in distribute(tag): tag is ferry::host_replicas{R} or
// ferry::cuda::devices{...}.
template <class Tag>
auto pipeline(const pipeline_options& o, const Tag& tag) {
  auto images = ferry::from_files(
      std::vector<std::string>{o.dir + "/" + o.split + "-images-idx3-ubyte.gz"}, ferry::idx{});
  auto labels = ferry::from_files(
      std::vector<std::string>{o.dir + "/" + o.split + "-labels-idx1-ubyte.gz"}, ferry::idx{});
  auto pairs = ferry::zip(std::move(images), std::move(labels));
  auto fn = [](const ferry::value_t<decltype(pairs)>& p) { return to_sample(p); };
  // cache() before shuffle: the kept pass is the files' order, shuffled anew every epoch.
  // It holds the inflated files (about 48 MB for train) rather than inflate them again.
  return std::move(pairs) | ferry::take(o.limit) | ferry::cache() |
         ferry::shuffle(o.train ? o.shuffle_buffer : 1, o.seed) |
         ferry::map(fn, {.workers = o.workers}) | ferry::batch(o.batch) | ferry::prefetch(2) |
         ferry::distribute(tag, {.remainder = o.train ? ferry::remainder_policy::drop
                                                      : ferry::remainder_policy::pad,
                                 // GPUs: the copies are made on distribute's own thread, so the
                                 // training loop's thread (launch-bound for this small MLP)
                                 // only takes ready steps. Host replicas ignore both.
                                 .steps_ahead = o.staging ? 8u : 1u,
                                 .staging_thread = o.staging});
}

}  // namespace fmnist
