// train_fashion_mnist: MirroredStrategy for C++ on the real Fashion-MNIST files.
//
//   train_fashion_mnist --epochs 12 --batch 128 --seed 1 --hidden 256,128   (--help: all)
//
// Three parts, one file each:
//   fashion_mnist.hpp  the pipeline over Debian's gzip IDX files:
//                      zip(from_files(images), from_files(labels)) | cache | shuffle
//                      | map(bytes -> floats) | batch | prefetch | distribute(replicas)
//   model.hpp          the mirrored trainer: one MLP replica per slice, gradients
//                      all-reduced so the replicas stay identical
//   train_loop.hpp     the epochs: asynchronous steps, the progress bar, the printed lines
// This file reads the options (options.hpp) and picks the backend:
//   - every local GPU when there is a usable one and the program was built with nvcc
//     (distribute(cuda::devices{0..n-1}) onto each trainer replica's compute stream, the
//     GPU backend: cuBLAS + Thrust on that stream, NCCL all-reduce, one rank per GPU;
//     each replica's step a CUDA graph unless --graphs 0);
//   - else host replicas (distribute(host_replicas{R}), OpenBLAS, in-process all-reduce).
// --device gpu|cpu forces one (gpu without a usable device is an error); one line on
// stderr says which was chosen and why. --cache-on-device adds cache_on_device after
// distribute: from epoch 2 the training split comes from the replicas' own memory (GPU
// memory, through gpu_model.cu's gather launcher), one order across the replicas.
//
// Prints after each epoch `epoch <k> loss <l> test_accuracy <a> elapsed_s <s>` (l: the
// epoch's mean training loss) and at the end `test_accuracy: <a>`. Exit status 1 with a
// message on bad arguments or unreadable data.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ferry/error.hpp"
#include "backend.hpp"
#include "ferry/stages/distribute.hpp"
#include "options.hpp"
#include "train_loop.hpp"

#if defined(FERRY_EXAMPLE_GPU)
#include "ferry/cuda/devices.hpp"
#include "ferry/cuda/runtime.hpp"
#endif
#if defined(FERRY_EXAMPLE_HOST)
#include "ferry/train/host_trainer.hpp"
#endif
#if !defined(FERRY_EXAMPLE_GPU) && !defined(FERRY_EXAMPLE_HOST)
#error "train_fashion_mnist: build with FERRY_EXAMPLE_HOST (OpenBLAS) and/or FERRY_EXAMPLE_GPU (nvcc)"
#endif

namespace tr = ferry::train;

int main(int argc, char** argv) try {
  const std::optional<fmnist::options> parsed = fmnist::parse(argc, argv);
  if (!parsed) return 0;  // --help
  fmnist::options o = *parsed;
  const unsigned hc = std::max(1u, std::thread::hardware_concurrency());

  // Which backend: every local GPU when there is one (and this build has the GPU path).
  const fmnist::backend_choice be = fmnist::choose_backend(o.device, o.gpus, o.batch, o.replicas, hc);
  const bool use_gpu = be.gpu;
  [[maybe_unused]] const std::vector<int>& devs = be.devices;  // the GPU path's (FERRY_EXAMPLE_GPU)
  o.replicas = be.replicas;
  if (o.workers == 0) o.workers = use_gpu ? std::clamp<std::size_t>(hc / 2, 1, 8) : 1;
  if (o.batch % o.replicas != 0)
    throw ferry::config_error("--batch " + std::to_string(o.batch) + " is not divisible by the " +
                              std::to_string(o.replicas) + " replicas");

  if (o.cache_on_device)
    std::fprintf(stderr, "train_fashion_mnist: after epoch 1 the training split comes from the replicas' memory "
                         "(cache_on_device, one order across replicas)\n");
  tr::mlp_config cfg;
  cfg.layers.push_back(fmnist::pixels);
  cfg.layers.insert(cfg.layers.end(), o.hidden.begin(), o.hidden.end());
  cfg.layers.push_back(fmnist::classes);
  const tr::trainer_options topts{.opt = o.opt, .seed = o.seed, .max_rows = int(o.batch / o.replicas),
                                  .blas_threads = o.blas_threads, .graphs = o.graphs};
  fmnist::run_options ro;
  ro.epochs = o.epochs;
  ro.save = o.save;
  ro.load = o.load;
  ro.quiet = o.quiet;
  ro.train = {.dir = o.data, .split = "train", .train = true, .batch = o.batch,
              .shuffle_buffer = o.shuffle_buffer, .seed = o.seed, .workers = o.workers, .limit = o.limit};
  ro.test = {.dir = o.data, .split = "t10k", .train = false, .batch = o.batch, .shuffle_buffer = 1,
             .seed = o.seed, .workers = o.workers};

#if defined(FERRY_EXAMPLE_GPU)
  if (use_gpu) {
    std::unique_ptr<fmnist::model> m = fmnist::make_gpu_model(cfg, topts, devs);
    std::fprintf(stderr, "train_fashion_mnist: %zu GPU replica(s) on %s (cuBLAS, NCCL%s), %zu map workers\n",
                 devs.size(), fmnist::gpu_name(devs[0]).c_str(), o.graphs ? ", CUDA graphs" : "", o.workers);
    // Each slice is copied on ferry's copy stream and made ready on the replica's own
    // compute stream, where its GEMMs and all-reduce run.
    const ferry::cache_on_device_options co{.seed = o.seed, .across_replicas = true};
    if (o.cache_on_device)
      fmnist::run(*m, ferry::cuda::devices(devs, m->streams()), ro,
                  ferry::cache_on_device_with<fmnist::gpu_gather>(co));
    else
      fmnist::run(*m, ferry::cuda::devices(devs, m->streams()), ro, nullptr);
    return 0;
  }
#endif
#if defined(FERRY_EXAMPLE_HOST)
  std::fprintf(stderr, "train_fashion_mnist: %zu host replica(s) (OpenBLAS, in-process all-reduce)%s\n",
               o.replicas, be.why.c_str());
  fmnist::trainer_model<tr::host_trainer> m(cfg, topts, int(o.replicas));
  if (o.cache_on_device)
    fmnist::run(m, ferry::host_replicas{o.replicas}, ro,
                ferry::cache_on_device({.seed = o.seed, .across_replicas = true}));
  else
    fmnist::run(m, ferry::host_replicas{o.replicas}, ro, nullptr);
#endif
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "train_fashion_mnist: %s\n", e.what());
  return 1;
}
