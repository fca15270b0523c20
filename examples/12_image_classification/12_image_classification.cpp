// 12_image_classification: the whole image path, from JPEG files in tar shards to a
// trained classifier: Fashion-MNIST written as WebDataset shards of 28 x 28 greyscale JPEGs
// (bash scripts/setup.sh --images writes data/images/fmnist-jpeg/), trained with example
// 04's MLP and trainer, on every GPU when there is one, else on host replicas.
//
//   12_image_classification [--epochs 12] [--batch 128] [--workers N] [--device auto|gpu|cpu]
//                           [--replicas R] [--limit N] [--seed S] [--world W --rank I]
//                           [--data data/images/fmnist-jpeg]
//
// Training, per epoch:
//   from_files(train-*.tar, webdataset)      one record per sample (its .jpg and .cls members)
//   | shard(world, rank)                     this process's tar files (6 files: file level;
//                                            --world/--rank: 1/0, one process reads all; a
//                                            job of several processes also all-reduces across
//                                            them, which example 05 shows and this one does not)
//   | shuffle(20000, seed)                   records, before any decoding
//   | map(parse + decode_random_crop<28, 28, 1> + label, {.workers})   uint8 HWC, on workers
//   | batch(128) | prefetch(2)
//   | distribute(host_replicas{R} or cuda::devices)
// then, per replica batch, ferry::image augmentation (uint8 -> float, normalised with
// Fashion-MNIST's mean and deviation; the kernel on a GPU replica's stream) into the
// mirrored trainer. Test: the test shard decoded WHOLE (decode_jpeg: no crop, no flip),
// through the same normalisation, every image once (the last batch padded).
//
// Prints per epoch `epoch <k> loss <l> test_accuracy <a> images_per_s <r> elapsed_s <s>`
// (r: training images through the whole path per second of the epoch's training loop),
// then `images_per_s: <r>` (over all epochs) and `test_accuracy: <a>`; stderr names the
// backend. Exit status 77 with the command to run when the data is missing, 1 with a
// message on bad arguments or unreadable data.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "ferry/error.hpp"
#include "ferry/image/augment.hpp"
#include "ferry/image/jpeg.hpp"
#include "ferry/image/random_crop.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/sources/webdataset.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/map.hpp"
#include "ferry/stages/prefetch.hpp"
#include "ferry/stages/shard.hpp"
#include "ferry/stages/shuffle.hpp"
#include "ferry/stages/take.hpp"
#include "image_sample.hpp"
#include "backend.hpp"  // examples/04_train_fashion_mnist: the backend choice
#include "model.hpp"  // examples/04_train_fashion_mnist: the trainer behind one interface

#if defined(FERRY_EXAMPLE_GPU)
#include "ferry/cuda/devices.hpp"
#include "ferry/cuda/runtime.hpp"
#endif
#if defined(FERRY_EXAMPLE_HOST)
#include "ferry/train/host_trainer.hpp"
#endif
#if !defined(FERRY_EXAMPLE_GPU) && !defined(FERRY_EXAMPLE_HOST)
#error "12_image_classification: build with FERRY_EXAMPLE_HOST (OpenBLAS) and/or FERRY_EXAMPLE_GPU (nvcc)"
#endif

namespace {

namespace tr = ferry::train;
using ex12::sample;
using ex12::side;

struct options {
  int epochs = 12;
  std::size_t batch = 128, replicas = 0, workers = 0, shuffle_buffer = 20000;
  std::size_t world = 1, rank = 0;
  std::uint64_t seed = 1, limit = ~std::uint64_t(0);
  std::string device = "auto", data = "data/images/fmnist-jpeg";
};

// The shards of a split (<split>-*.tar, sorted), or none.
std::vector<std::string> shards(const std::string& dir, const std::string& split) {
  std::vector<std::string> v;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.starts_with(split + "-") && n.ends_with(".tar")) v.push_back(e.path().string());
  }
  std::sort(v.begin(), v.end());
  return v;
}

// The class in the sample's .cls member (ASCII digits), or format_error naming the file.
std::int32_t label_of(const ferry::webdataset_sample& s) {
  const ferry::record& c = s.at("cls");
  const std::string_view t = c.str();
  int v = -1;
  const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (ec != std::errc{} || end != t.data() + t.size() || v < 0 || v >= ex12::classes)
    throw ferry::format_error(std::string(c.origin().file), c.origin().data_offset,
                              "sample '" + s.key + "': .cls is not a class 0-9");
  return v;
}

// Training: a mild RandomResizedCrop. Fashion-MNIST's garments are centred and fill the
// 28 x 28 frame; torchvision's default (8-100 % of the area, ratio 3/4-4/3) would often
// keep a sleeve or a heel alone, which cannot tell a shirt from a pullover or a sandal
// from a sneaker. 70-100 % of the area at nearly the image's own ratio shifts and zooms
// the item by a few pixels (what an MLP, which is not translation invariant, has to learn
// to tolerate) and keeps it whole. Flip 0.5: a mirrored garment is the same class.
template <class Tag>
auto train_pipeline(const options& o, const Tag& tag) {
  const ferry::image::decode_random_crop<side, side, 1> crop(
      {.seed = o.seed, .scale_lo = 0.7, .scale_hi = 1.0, .ratio_lo = 0.9, .ratio_hi = 1.1, .flip = 0.5});
  auto fn = [crop](const ferry::record& r) {
    thread_local ferry::webdataset_sample s;  // one per worker: its strings keep their capacity
    ferry::parse_webdataset(r, s);
    const sample out{crop(s.at("jpg")), label_of(s)};
    s.members.clear();  // its members hold the file's chunk: not past this call
    return out;
  };
  // shard straight after from_files splits the files (each rank reads only its own);
  // the shuffle's seed differs per rank, as example 05's.
  return ferry::from_files(shards(o.data, "train"), ferry::webdataset{}) | ferry::shard(o.world, o.rank) |
         ferry::take(o.limit) | ferry::shuffle(o.shuffle_buffer, o.seed * 1000003u + o.rank) |
         ferry::map(fn, {.workers = o.workers}) | ferry::batch(o.batch) | ferry::prefetch(2) |
         ferry::distribute(tag, {.remainder = ferry::remainder_policy::drop, .steps_ahead = 8, .staging_thread = true});
}

// Test: the whole image as stored (a crop would test on something else than the data).
template <class Tag>
auto test_pipeline(const options& o, const Tag& tag) {
  auto fn = [](const ferry::record& r) {
    thread_local ferry::webdataset_sample s;
    thread_local ferry::image::image img;
    ferry::parse_webdataset(r, s);
    const ferry::record& jpg = s.at("jpg");
    ferry::image::decode_jpeg(jpg.bytes(), img, 1);
    if (img.width != side || img.height != side)
      throw ferry::format_error(std::string(jpg.origin().file), jpg.origin().data_offset,
                                "sample '" + s.key + "' is " + std::to_string(img.width) + "x" +
                                    std::to_string(img.height) + ", not 28x28");
    sample out;
    std::copy(img.pixels.begin(), img.pixels.end(), std::get<0>(out).begin());
    std::get<1>(out) = label_of(s);
    s.members.clear();
    return out;
  };
  // One test file: element-level shards, so any number of ranks splits it.
  return ferry::from_files(shards(o.data, "test"), ferry::webdataset{}) |
         ferry::shard(o.world, o.rank, ferry::by_element) | ferry::map(fn, {.workers = o.workers}) |
         ferry::batch(o.batch) | ferry::prefetch(2) |
         ferry::distribute(tag, {.remainder = ferry::remainder_policy::pad, .steps_ahead = 8, .staging_thread = true});
}

// The epochs: train, test, print. `augment` turns a replica's uint8 images into the
// trainer's float rows (host memory or the replica's device, ready on its stream).
template <class Tag>
void run(fmnist::model& m, const Tag& tag, const ex12::augment_fn& augment, const options& o) {
  auto train = train_pipeline(o, tag);
  auto test = test_pipeline(o, tag);
  const std::size_t R = o.replicas;
  std::vector<ferry::image::augmented> x(R);  // kept until the next step's: the trainer has enqueued its reads
  std::vector<tr::replica_input> in(R);
  auto inputs = [&](const ferry::step<sample>& st, std::uint64_t key) -> std::span<const tr::replica_input> {
    for (std::size_t r = 0; r < R; ++r) {
      x[r] = augment(st, r, key);  // the previous output goes back to the pool after the work enqueued on it
      in[r] = {x[r].data().data(), st[r].field<1>().data(), int(st[r].size()), int(st[r].valid())};
    }
    return in;
  };
  const auto t0 = std::chrono::steady_clock::now();
  double accuracy = 0, train_s = 0, images = 0;
  for (int e = 1; e <= o.epochs; ++e) {
    const auto e0 = std::chrono::steady_clock::now();
    double n = 0;
    for (auto& st : train) {
      m.train_step_async(inputs(st, ferry::image::augment_key(std::uint64_t(e), st.index())));
      n += double(st.valid());
    }
    const double loss = m.take_stats().loss;  // the one host wait of the epoch
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - e0).count();
    train.rewind();
    train_s += secs, images += n;
    for (auto& st : test) m.evaluate_async(inputs(st, 0));
    test.rewind();
    accuracy = m.take_eval().accuracy;
    std::printf("epoch %d loss %.4f test_accuracy %.4f images_per_s %.0f elapsed_s %.1f\n", e, loss, accuracy,
                n / secs, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    std::fflush(stdout);
  }
  std::printf("images_per_s: %.0f\n", images / train_s);
  std::printf("test_accuracy: %.4f\n", accuracy);
}

// The command line, or an exit: 0 after --help, 1 with CLI11's message for a bad one.
options parse(int argc, char** argv) {
  options o;
  CLI::App app("Image classification through the image path: WebDataset shards of JPEGs, a fused random "
               "crop on map's workers, augmentation after distribute, example 04's trainer.",
               "12_image_classification");
  app.add_option("--epochs", o.epochs)->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--batch", o.batch, "the global batch")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--workers", o.workers, "map's decode threads (default: the cores)")->check(CLI::Range(1, 1024));
  app.add_option("--device", o.device)->check(CLI::IsMember({"auto", "gpu", "cpu"}))->capture_default_str();
  app.add_option("--replicas", o.replicas, "cpu: host replicas (default: one per core, at most batch / 64, dividing the batch)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--limit", o.limit, "train on the first N images")->check(CLI::Range(std::uint64_t(1), ~std::uint64_t(0)));
  app.add_option("--seed", o.seed)->capture_default_str();
  app.add_option("--world", o.world, "shards (by file)")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--rank", o.rank, "this one's shard (below --world)")->check(CLI::Range(0, 1 << 20))->capture_default_str();
  app.add_option("--data", o.data, "the directory of train-*.tar and test-*.tar")->capture_default_str();
  try {
    app.parse(argc, argv);
    if (o.rank >= o.world) throw CLI::ValidationError("--rank", "must be below --world");
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e) == 0 ? 0 : 1);
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) try {
  options o = parse(argc, argv);
  if (shards(o.data, "train").empty() || shards(o.data, "test").empty()) {
    std::printf("12_image_classification: no train-*.tar and test-*.tar in %s: make them with\n"
                "  bash scripts/setup.sh --images   (or /usr/bin/python3 scripts/make_image_corpus.py)\n"
                "from the repository's root, or pass --data DIR\n",
                o.data.c_str());
    return 77;
  }
  const unsigned hc = std::max(1u, std::thread::hardware_concurrency());

  // The backend, as example 04 picks it: every local GPU when there is one.
  const fmnist::backend_choice be = fmnist::choose_backend(o.device, 0, o.batch, o.replicas, hc);
  const bool use_gpu = be.gpu;
  const std::vector<int>& devs = be.devices;
  o.replicas = be.replicas;
  // Decoding is the pipeline's work: on a GPU machine the cores are free for it; on host
  // replicas they share the cores with the trainer's replicas.
  if (o.workers == 0) o.workers = use_gpu ? std::clamp<std::size_t>(hc - 1, 1, 16) : std::max(1u, hc);
  if (o.batch % o.replicas != 0)
    throw ferry::config_error("--batch " + std::to_string(o.batch) + " is not divisible by the " +
                              std::to_string(o.replicas) + " replicas");

  // Example 04's model (784 -> 256 -> 128 -> 10, Adam 1e-3), so the accuracies compare.
  const tr::mlp_config cfg{.layers = {int(side * side), 256, 128, ex12::classes}, .class_weights = {}};
  const tr::trainer_options topts{.opt = {.kind = tr::optimizer_kind::adam, .lr = 1e-3f}, .seed = o.seed,
                                  .max_rows = int(o.batch / o.replicas)};
  // uint8 -> float, normalised with Fashion-MNIST's training mean and deviation (example
  // 04's constants). No random draws here: the crop and flip were made at decoding.
  const ferry::image::augment_shape shape{side, side, 1};
  const ferry::image::augment_options aopts{.mean = {0.2860f}, .stddev = {0.3530f}};

#if defined(FERRY_EXAMPLE_GPU)
  if (use_gpu) {
    std::unique_ptr<fmnist::model> m = fmnist::make_gpu_model(cfg, topts, devs);
    std::fprintf(stderr, "12_image_classification: %zu GPU replica(s) on %s (cuBLAS, NCCL, augmentation kernel), "
                 "%zu decode workers\n", devs.size(), fmnist::gpu_name(devs[0]).c_str(), o.workers);
    run(*m, ferry::cuda::devices(devs, m->streams()), ex12::make_device_augment(shape, aopts), o);
    return 0;
  }
#endif
#if defined(FERRY_EXAMPLE_HOST)
  std::fprintf(stderr, "12_image_classification: %zu host replica(s) (OpenBLAS), %zu decode workers%s\n",
               o.replicas, o.workers, be.why.c_str());
  fmnist::trainer_model<tr::host_trainer> m(cfg, topts, int(o.replicas));
  auto aug = std::make_shared<ferry::image::host_augmenter>(shape, aopts);
  run(m, ferry::host_replicas{o.replicas},
      [aug](const ferry::step<sample>& st, std::size_t r, std::uint64_t key) { return (*aug)(st, r, key); }, o);
#endif
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "12_image_classification: %s\n", e.what());
  return 1;
}
