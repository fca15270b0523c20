// train_fashion_mnist: MirroredStrategy for C++ on the real Fashion-MNIST files.
//
//   train_fashion_mnist --epochs 12 --batch 128 --seed 1 --hidden 256,128
//
// The pipeline (fashion_mnist.hpp) reads Debian's gzip IDX files as they are:
//   from_files(images, idx) zip from_files(labels, idx) | shuffle | map(bytes -> floats)
//   | batch(global batch) | prefetch(2) | distribute(replicas)
// and the mirrored trainer runs one MLP replica per slice (its own thread), all-reducing
// gradients so the replicas stay identical:
//   - on every local GPU when there is a usable one and the program was built with nvcc
//     (distribute(cuda::devices{0..n-1}) onto each trainer replica's compute stream, the
//     GPU backend: cuBLAS + Thrust on that stream, NCCL all-reduce, one rank per GPU);
//   - else on host replicas (distribute(host_replicas{R}), OpenBLAS, in-process
//     all-reduce), R = --replicas (default: one per core, at most batch / 64, dividing the batch).
// --device gpu|cpu forces one (gpu without a usable device is an error); one line on
// stderr says which was chosen and why. Each GPU replica's step runs as a CUDA graph
// (trainer_options::graphs: one launch instead of about 25); --graphs 0 launches every
// kernel instead (no effect on the CPU).
//
// Training steps are asynchronous (train_step_async): the statistics are read every 0.2 s
// and at the end of each epoch, not after every step. After every epoch it evaluates on the
// test set and prints (stdout, exactly):
//   epoch <k> loss <mean training loss> test_accuracy <a> elapsed_s <seconds since start>
// and at the end:
//   test_accuracy: <a>
// A progress bar (or plain log lines, when stderr is not a terminal) goes to stderr.
//
// Exit status 1 with a message on bad arguments or unreadable data.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fashion_mnist.hpp"
#include "ferry/error.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/train/progress.hpp"
#include "model.hpp"

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

namespace {

namespace tr = ferry::train;

struct run_options {
  int epochs = 12;
  fmnist::pipeline_options train, test;
  std::string save, load;
  bool quiet = false;
};

// The training loop, the same for every backend: tag picks distribute()'s backend.
template <class Tag>
void run(fmnist::model& m, const Tag& tag, const run_options& o) {
  if (!o.load.empty()) m.load(o.load);
  auto train = fmnist::pipeline(o.train, tag);
  auto test = fmnist::pipeline(o.test, tag);
  const std::uint64_t n = std::min<std::uint64_t>(o.train.limit, fmnist::train_images);
  const std::uint64_t train_rows = n / o.train.batch * o.train.batch;

  const auto t0 = std::chrono::steady_clock::now();
  double accuracy = 0;
  for (int e = 1; e <= o.epochs; ++e) {
    tr::progress_bar bar("epoch " + std::to_string(e), train_rows, stderr,
                         o.quiet ? tr::progress_mode::off : tr::progress_mode::automatic);
    // Asynchronous steps: on a GPU the host enqueues step k+1 while the GPU runs step k,
    // and waits only when it reads the statistics: every 0.2 s for the bar, and at the end
    // of the epoch. The totals read add up to the epoch's mean loss over all its rows.
    double loss_sum = 0, weight = 0;
    std::uint64_t seen = 0;
    auto read_stats = [&] {
      const tr::step_stats s = m.take_stats();
      loss_sum += s.loss * s.weight;
      weight += s.weight;
      if (s.weight > 0) bar.update(seen, s.loss);
    };
    auto last_read = std::chrono::steady_clock::now();
    for (auto& step : train) {
      m.train_async(step);
      for (std::size_t r = 0; r < step.replicas(); ++r) seen += step[r].valid();
      const auto now = std::chrono::steady_clock::now();
      if (now - last_read >= std::chrono::milliseconds(200)) {
        last_read = now;
        read_stats();
      } else {
        bar.advance(seen);
      }
    }
    read_stats();
    const double epoch_loss = weight > 0 ? loss_sum / weight : 0.0;
    bar.finish(epoch_loss);
    train.rewind();

    // The test pass: no wait per batch, one for the pass (take_eval).
    for (auto& step : test) m.eval_async(step);
    test.rewind();
    accuracy = m.take_eval().accuracy;
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("epoch %d loss %.4f test_accuracy %.4f elapsed_s %.1f\n", e, epoch_loss,
                accuracy, elapsed);
    std::fflush(stdout);
  }
  if (!o.save.empty()) m.save(o.save);
  std::printf("test_accuracy: %.4f\n", accuracy);
}

std::vector<int> parse_sizes(const std::string& s) {
  std::vector<int> v;
  std::size_t p = 0;
  while (p <= s.size()) {
    const std::size_t q = s.find(',', p);
    const std::string tok = s.substr(p, q == std::string::npos ? std::string::npos : q - p);
    char* end = nullptr;
    const long x = std::strtol(tok.c_str(), &end, 10);
    if (tok.empty() || *end || x < 1 || x > 1 << 20)
      throw ferry::config_error("--hidden: expected sizes like 256,128, got '" + s + "'");
    v.push_back(static_cast<int>(x));
    if (q == std::string::npos) break;
    p = q + 1;
  }
  return v;
}

void usage() {
  std::fprintf(stderr,
               "usage: train_fashion_mnist [--epochs N] [--batch GLOBAL] [--device auto|gpu|cpu]\n"
               "         [--replicas R (cpu)] [--gpus N (gpu: the first N devices)] [--seed S]\n"
               "         [--hidden 256,128] [--lr 1e-3] [--optimizer adam|sgd] [--momentum 0.9]\n"
               "         [--workers W] [--shuffle-buffer N] [--blas-threads N] [--limit N]\n"
               "         [--data DIR] [--save FILE] [--load FILE] [--graphs 1|0 (gpu)] [--quiet]\n");
}

}  // namespace

int main(int argc, char** argv) try {
  run_options ro;
  std::size_t batch = 128;
  const unsigned hc = std::thread::hardware_concurrency() ? std::thread::hardware_concurrency() : 1;
  std::size_t replicas = 0, gpus = 0, workers = 0, shuffle_buffer = 20000;
  std::uint64_t seed = 1, limit = ~std::uint64_t(0);
  std::vector<int> hidden{256, 128};
  tr::optimizer_config opt{.kind = tr::optimizer_kind::adam, .lr = 1e-3f};
  int blas_threads = 0;
  bool graphs = true;
  std::string dir = "/usr/share/datasets/fashion-mnist", device = "auto";

  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) throw ferry::config_error(a + " needs a value");
      return argv[++i];
    };
    auto num = [&](const std::string& v) {
      char* end = nullptr;
      const double x = std::strtod(v.c_str(), &end);
      if (v.empty() || *end) throw ferry::config_error(a + ": '" + v + "' is not a number");
      return x;
    };
    auto count = [&](const std::string& v, double lo) {
      const double x = num(v);
      if (x < lo || x > 1e15 || x != static_cast<double>(static_cast<long long>(x)))
        throw ferry::config_error(a + ": expected a whole number >= " + std::to_string(int(lo)));
      return static_cast<long long>(x);
    };
    if (a == "--epochs") ro.epochs = int(count(val(), 1));
    else if (a == "--batch") batch = std::size_t(count(val(), 1));
    else if (a == "--replicas") replicas = std::size_t(count(val(), 1));
    else if (a == "--gpus") gpus = std::size_t(count(val(), 1));
    else if (a == "--device") {
      device = val();
      if (device != "auto" && device != "gpu" && device != "cpu")
        throw ferry::config_error("--device: auto, gpu or cpu, not '" + device + "'");
    } else if (a == "--seed") seed = std::uint64_t(count(val(), 0));
    else if (a == "--hidden") hidden = parse_sizes(val());
    else if (a == "--lr") opt.lr = float(num(val()));
    else if (a == "--momentum") opt.momentum = float(num(val()));
    else if (a == "--optimizer") {
      const std::string o = val();
      if (o == "adam") opt.kind = tr::optimizer_kind::adam;
      else if (o == "sgd") opt.kind = tr::optimizer_kind::sgd;
      else throw ferry::config_error("--optimizer: adam or sgd, not '" + o + "'");
    } else if (a == "--workers") workers = std::size_t(count(val(), 1));
    else if (a == "--shuffle-buffer") shuffle_buffer = std::size_t(count(val(), 1));
    else if (a == "--blas-threads") blas_threads = int(count(val(), 0));
    else if (a == "--graphs") {
      const std::string g = val();
      if (g != "0" && g != "1") throw ferry::config_error("--graphs: 0 or 1, not '" + g + "'");
      graphs = g == "1";
    }
    else if (a == "--limit") limit = std::uint64_t(count(val(), 1));
    else if (a == "--data") dir = val();
    else if (a == "--save") ro.save = val();
    else if (a == "--load") ro.load = val();
    else if (a == "--quiet") ro.quiet = true;
    else if (a == "--help" || a == "-h") { usage(); return 0; }
    else { usage(); throw ferry::config_error("unknown argument '" + a + "'"); }
  }

  // Which backend: every local GPU when there is one (and this build has the GPU path).
  bool use_gpu = false;
  std::string why;
#if defined(FERRY_EXAMPLE_GPU)
  if (device != "cpu") {
    use_gpu = ferry::cuda::available();
    if (!use_gpu) {
      if (device == "gpu")
        throw ferry::config_error("--device gpu: no usable CUDA device (" +
                                  ferry::cuda::unavailable_reason() + ")");
      why = " (no usable CUDA device: " + ferry::cuda::unavailable_reason() + ")";
    }
  }
#else
  (void)gpus;
  if (device == "gpu")
    throw ferry::config_error("--device gpu: this build has no GPU path (built without nvcc)");
  why = " (built without the GPU path)";
#endif
#if !defined(FERRY_EXAMPLE_HOST)
  if (!use_gpu)
    throw ferry::config_error("no usable GPU" + why + ", and this build has no host backend "
                              "(built without OpenBLAS)");
#endif

  std::vector<int> devs;
#if defined(FERRY_EXAMPLE_GPU)
  if (use_gpu) {
    const int n = ferry::cuda::device_count();
    if (gpus > std::size_t(n))
      throw ferry::config_error("--gpus " + std::to_string(gpus) + ": this machine has " +
                                std::to_string(n));
    for (int d = 0; d < (gpus ? int(gpus) : n); ++d) devs.push_back(d);
    replicas = devs.size();
  }
#endif
  // One replica per core while each keeps at least 64 rows (thinner slices waste their
  // GEMMs and the all-reduce grows), and a count that divides the batch. On the 2-core
  // development machine, batch 128: 1 replica ran an epoch in 0.95 s, 2 in 0.76 s (the
  // pipeline's threads fit beside them since the step's elementwise work vectorizes).
  if (!use_gpu && replicas == 0) {
    replicas = std::max<std::size_t>(1, std::min<std::size_t>(hc, batch / 64));
    while (batch % replicas != 0) --replicas;
  }
  if (workers == 0) workers = use_gpu ? std::max<std::size_t>(1, std::min<std::size_t>(8, hc / 2)) : 1;
  if (batch % replicas != 0)
    throw ferry::config_error("--batch " + std::to_string(batch) + " is not divisible by the " +
                              std::to_string(replicas) + " replicas");

  tr::mlp_config cfg;
  cfg.layers.push_back(fmnist::pixels);
  cfg.layers.insert(cfg.layers.end(), hidden.begin(), hidden.end());
  cfg.layers.push_back(fmnist::classes);
  const tr::trainer_options topts{.opt = opt, .seed = seed, .max_rows = int(batch / replicas),
                                  .blas_threads = blas_threads, .graphs = graphs};
  ro.train = {.dir = dir, .split = "train", .train = true, .batch = batch,
              .shuffle_buffer = shuffle_buffer, .seed = seed, .workers = workers, .limit = limit};
  ro.test = {.dir = dir, .split = "t10k", .train = false, .batch = batch, .shuffle_buffer = 1,
             .seed = seed, .workers = workers};

#if defined(FERRY_EXAMPLE_GPU)
  if (use_gpu) {
    std::unique_ptr<fmnist::model> m = fmnist::make_gpu_model(cfg, topts, devs);
    std::fprintf(stderr, "train_fashion_mnist: %zu GPU replica(s) on %s (cuBLAS, NCCL%s), %zu map workers\n",
                 devs.size(), fmnist::gpu_name(devs[0]).c_str(), graphs ? ", CUDA graphs" : "", workers);
    // Each slice is copied on ferry's copy stream and made ready on the replica's own
    // compute stream, where its GEMMs and all-reduce run.
    run(*m, ferry::cuda::devices(devs, m->streams()), ro);
    return 0;
  }
#endif
#if defined(FERRY_EXAMPLE_HOST)
  std::fprintf(stderr, "train_fashion_mnist: %zu host replica(s) (OpenBLAS, in-process all-reduce)%s\n",
               replicas, why.c_str());
  fmnist::trainer_model<tr::host_trainer> m(cfg, topts, int(replicas));
  run(m, ferry::host_replicas{replicas}, ro);
#endif
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "train_fashion_mnist: %s\n", e.what());
  return 1;
}
