// Is data loading hidden behind GPU training? ferry's training step time when fed by the
// example's whole pipeline (Fashion-MNIST gzip IDX files -> shuffle -> map on worker
// threads -> batch into pinned memory -> prefetch -> distribute(cuda::devices) onto the
// trainer's compute streams) against the same model's step time on data already in
// device memory (synthetic batches uploaded once), same run, same GPU(s).
//
// Every step is a real train_step_async, as the example's loop does (cuBLAS forward/backward,
// NCCL all-reduce, Adam update, the statistics added up on the GPU, not read back): the
// host never waits per step, so it enqueues step k+1 while the GPU runs step k, and the
// on-device round measures the GPU's step time rather than the host's launch loop. Both
// rounds time the same way: take_stats() (one wait) ends the warm-up, so the clock starts
// with the GPU idle, and take_stats() again (one wait) ends the timed region, so every
// timed step has run on the GPU when the clock stops. Each mode runs `--rounds` rounds of
// `--warmup` untimed then `--steps` timed steps, alternating; a fed round builds a fresh
// pipeline (its start, the shuffle buffer filling, falls in the warm-up) and runs it for
// two epochs: the first inflates the gzip files and fills the pipeline's cache() (timed
// apart: fed-epoch1), the second replays it, as every later epoch of training does (the
// headline: fed). Medians are reported. Ends with:
//   train_fed_ratio_epoch1: <first-epoch step time / on-device step time>
//   train_fed_ratio: <epoch-2 step time / on-device step time>     (target <= 1.05)
// Exits 77 ("skipped: ...") without a usable GPU or without the data files.
//
// usage: bench_train_fed_gpu [--data DIR] [--batch 128] [--steps 400] [--warmup 30]
//                            [--rounds 3] [--workers W] [--gpus N] [--limit SAMPLES] [--json FILE]
//                            [--report 1] [--staging 0|1] [--graphs 1|0]
//   --limit: train on the first SAMPLES images only (short epochs, for the simulator's smoke run)
//   --report 1: print each fed round's pipeline report (ferry/stats.hpp; set FERRY_STATS=1)
//   --staging 0: distribute makes its copies on the training loop's thread (the example's
//                pipeline, and the default, use its staging thread)
//   --graphs 1 (the default): the trainer runs each step as a CUDA graph
//               (trainer_options::graphs), in both modes; a third mode, on-device steps of a
//               trainer without graphs, is timed in the same rounds, and graph_step_speedup
//               (its step time / the graphs' on-device step time) says what the graphs gained.
//   --graphs 0: every kernel launched, in both modes (no third mode)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/timing.hpp"
#include "fashion_mnist.hpp"
#include "ferry/cuda/devices.hpp"
#include "ferry/cuda/runtime.hpp"
#include "ferry/stats.hpp"
#include "model.hpp"

namespace {
using clk = std::chrono::steady_clock;
namespace tr = ferry::train;

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_train_fed_gpu: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) try {
  std::string dir = "/usr/share/datasets/fashion-mnist", json;
  bool report = false, staging = true, graphs = true;
  if (const char* d = std::getenv("FERRY_FASHION_MNIST")) dir = d;
  std::size_t batch = 128, steps = 400, warmup = 30, rounds = 3, gpus = 0, limit = fmnist::train_images;
  const unsigned hc = std::max(1u, std::thread::hardware_concurrency());
  std::size_t workers = std::max<std::size_t>(1, std::min<std::size_t>(8, hc / 2));
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--data") dir = v;
    else if (a == "--json") json = v;
    else if (a == "--report") report = v == "1";
    else if (a == "--staging") staging = v == "1";
    else if (a == "--graphs") graphs = v == "1";
    else if (a == "--batch") batch = std::stoul(v);
    else if (a == "--steps") steps = std::stoul(v);
    else if (a == "--warmup") warmup = std::stoul(v);
    else if (a == "--rounds") rounds = std::stoul(v);
    else if (a == "--workers") workers = std::stoul(v);
    else if (a == "--gpus") gpus = std::stoul(v);
    else if (a == "--limit") limit = std::min<std::size_t>(fmnist::train_images, std::stoul(v));
    else {
      std::fprintf(stderr, "bench_train_fed_gpu: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (!ferry::cuda::available()) {
    std::printf("skipped: no GPU (%s)\n", ferry::cuda::unavailable_reason().c_str());
    return 77;
  }
  if (!std::filesystem::exists(dir + "/train-images-idx3-ubyte.gz")) {
    std::printf("skipped: no Fashion-MNIST files in %s (set --data or FERRY_FASHION_MNIST)\n",
                dir.c_str());
    return 77;
  }
  // One epoch holds limit / batch steps; a round must fit in it (no epoch boundary timed).
  if (batch == 0 || warmup + steps > limit / batch) {
    std::fprintf(stderr, "bench_train_fed_gpu: warmup + steps must fit one epoch (%zu steps)\n",
                 batch ? limit / batch : 0);
    return 2;
  }

  std::vector<int> devs;
  const int n = ferry::cuda::device_count();
  for (int d = 0; d < (gpus ? std::min(int(gpus), n) : n); ++d) devs.push_back(d);
  const std::size_t R = devs.size();
  if (batch % R) {
    std::fprintf(stderr, "bench_train_fed_gpu: --batch %zu does not divide among %zu GPUs\n", batch, R);
    return 2;
  }
  const int per = int(batch / R);
  const tr::mlp_config cfg{{fmnist::pixels, 256, 128, fmnist::classes}, {}};
  const tr::trainer_options topts{.opt = {.kind = tr::optimizer_kind::adam, .lr = 1e-3f}, .seed = 1,
                                  .max_rows = per, .graphs = graphs};
  auto m = fmnist::make_gpu_model(cfg, topts, devs);
  // With --graphs 1: the same model without graphs, for graph_step_speedup.
  std::unique_ptr<fmnist::model> direct;
  if (graphs) {
    tr::trainer_options o = topts;
    o.graphs = false;
    direct = fmnist::make_gpu_model(cfg, o, devs);
  }
  const std::vector<ferry::cuda_stream> streams = m->streams();

  // On-device data: K distinct synthetic batches per replica, uploaded once.
  constexpr int K = 16;
  std::vector<float*> dx(R);
  std::vector<std::int32_t*> dy(R);
  {
    std::mt19937 g(7);
    std::normal_distribution<float> nd;
    std::vector<float> hx(std::size_t(K) * per * fmnist::pixels);
    std::vector<std::int32_t> hy(std::size_t(K) * per);
    for (auto& v : hx) v = nd(g);
    for (std::size_t i = 0; i < hy.size(); ++i) hy[i] = std::int32_t(i % fmnist::classes);
    for (std::size_t r = 0; r < R; ++r) {
      cuda_ok(cudaSetDevice(devs[r]), "cudaSetDevice");
      cuda_ok(cudaMalloc(reinterpret_cast<void**>(&dx[r]), hx.size() * sizeof(float)), "cudaMalloc");
      cuda_ok(cudaMalloc(reinterpret_cast<void**>(&dy[r]), hy.size() * sizeof(std::int32_t)), "cudaMalloc");
      cuda_ok(cudaMemcpy(dx[r], hx.data(), hx.size() * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
      cuda_ok(cudaMemcpy(dy[r], hy.data(), hy.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice), "cudaMemcpy");
      // Pageable copies may return before their DMA ends, on the legacy stream, which the
      // trainer's non-blocking streams do not wait for.
      cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    }
  }
  // Host time per timed step on the consumer's thread, to say which side limits a step:
  // the trainer's launches (train_step_async, train_async) and the pipeline's next().
  double host_launch_dev = 0, host_launch_direct = 0, host_launch_fed = 0, host_next_fed = 0;
  auto secs = [](clk::time_point a, clk::time_point b) { return std::chrono::duration<double>(b - a).count(); };
  auto on_device_round = [&](fmnist::model& mm, double& host_launch) {
    std::vector<tr::replica_input> in(R);
    clk::time_point t0;
    double launch = 0;
    for (std::size_t s = 0; s < warmup + steps; ++s) {
      if (s == warmup) {
        (void)mm.take_stats();  // the warm-up has run
        t0 = clk::now();
      }
      const std::size_t k = s % K;
      for (std::size_t r = 0; r < R; ++r)
        in[r] = {dx[r] + k * per * fmnist::pixels, dy[r] + k * per, per, per};
      const auto ta = clk::now();
      mm.train_step_async(in);
      if (s >= warmup) launch += secs(ta, clk::now());
    }
    host_launch = launch / double(steps);
    (void)mm.take_stats();  // one wait: every timed step has run
    return std::chrono::duration<double>(clk::now() - t0).count() / double(steps);
  };
  // A fed round runs a fresh pipeline for two epochs. Epoch 1 inflates the gzip files (one
  // thread per file: zlib) and fills cache(); it is timed apart, past its warm-up steps.
  // Epoch 2 replays the cache, as every later epoch of a training run does: its
  // `steps` steps after `warmup` are the steady state, the headline figure.
  std::uint64_t seed = 1;
  struct fed_times {
    double first, steady;
  };
  auto fed_round = [&] {
    fmnist::pipeline_options po{.dir = dir, .split = "train", .train = true, .batch = batch,
                                .shuffle_buffer = 20000, .seed = seed++, .workers = workers, .limit = limit,
                                .staging = staging};
    auto p = fmnist::pipeline(po, ferry::cuda::devices(devs, streams));
    fed_times t{};
    clk::time_point t0;
    std::size_t s = 0;
    for (auto& st : p) {
      if (s == warmup) {
        (void)m->take_stats();
        t0 = clk::now();
      }
      m->train_async(st);
      ++s;
    }
    (void)m->take_stats();
    t.first = std::chrono::duration<double>(clk::now() - t0).count() / double(s - warmup);
    p.rewind();
    s = 0;
    double launch = 0, next = 0;
    auto tn = clk::now();
    for (auto& st : p) {
      if (s == warmup) {
        (void)m->take_stats();  // the warm-up has run
        t0 = tn = clk::now();
      }
      const auto ta = clk::now();
      m->train_async(st);  // st is on the trainer's streams: released safely at the next step
      const auto tb = clk::now();
      if (s >= warmup) {
        next += secs(tn, ta);
        launch += secs(ta, tb);
      }
      tn = tb;
      if (++s == warmup + steps) break;
    }
    (void)m->take_stats();  // one wait: every timed step has run
    t.steady = std::chrono::duration<double>(clk::now() - t0).count() / double(steps);
    host_launch_fed = launch / double(steps);
    host_next_fed = next / double(steps);
    if (report) {
      const auto rep = ferry::report(p);
      std::printf("%s\n%s\n", rep.table().c_str(), rep.summary().c_str());
    }
    return t;
  };

  std::vector<double> dev_t, fed_t, first_t, direct_t;
  for (std::size_t i = 0; i < rounds; ++i) {
    dev_t.push_back(on_device_round(*m, host_launch_dev));
    if (direct) direct_t.push_back(on_device_round(*direct, host_launch_direct));
    const fed_times f = fed_round();
    fed_t.push_back(f.steady);
    first_t.push_back(f.first);
  }
  const double td = bench::median(dev_t), tf = bench::median(fed_t), t1 = bench::median(first_t), ratio = tf / td;
  std::printf("# %zu GPU(s), %s; batch %zu (%d per replica), MLP 784-256-128-10, Adam; "
              "%zu map workers; distribute staging thread %s; CUDA graphs %s; median of %zu rounds of %zu steps\n",
              R, fmnist::gpu_name(devs[0]).c_str(), batch, per, workers, staging ? "on" : "off", graphs ? "on" : "off",
              rounds, steps);
  std::printf("# fed: epoch 2 (cache() replay, every later epoch); fed-epoch1: the first epoch, "
              "inflating the gzip files, all its steps past the warm-up\n");
  std::printf("%-10s %8s %10s %12s\n", "mode", "steps", "step_us", "samples/s");
  std::printf("%-10s %8zu %10.1f %12.0f\n", "on-device", steps, td * 1e6, double(batch) / td);
  std::printf("%-10s %8zu %10.1f %12.0f\n", "fed", steps, tf * 1e6, double(batch) / tf);
  const double tdirect = direct ? bench::median(direct_t) : 0;
  if (direct) std::printf("%-10s %8zu %10.1f %12.0f\n", "on-device-nograph", steps, tdirect * 1e6, double(batch) / tdirect);
  std::printf("%-10s %8zu %10.1f %12.0f\n", "fed-epoch1", limit / batch - warmup, t1 * 1e6,
              double(batch) / t1);
  std::printf("# host per step, last round: on-device train_step_async %.1f us; fed train_async %.1f us, "
              "pipeline next() %.1f us\n", host_launch_dev * 1e6, host_launch_fed * 1e6, host_next_fed * 1e6);
  if (direct) {
    std::printf("# host per step, last round, on-device without graphs: train_step_async %.1f us\n",
                host_launch_direct * 1e6);
    std::printf("graph_step_speedup: %.3f\n", tdirect / td);
  }
  std::printf("train_fed_ratio_epoch1: %.3f\n", t1 / td);
  std::printf("train_fed_ratio: %.3f (target <= 1.05)\n", ratio);
  if (!json.empty()) {
    if (FILE* f = std::fopen(json.c_str(), "w")) {
      std::fprintf(f,
                   "{\"benchmark\": \"train_fed_gpu\", \"gpus\": %zu, \"batch\": %zu, \"workers\": %zu, "
                   "\"graphs\": %s, \"on_device_step_s\": %.9f, \"fed_step_s\": %.9f, \"fed_epoch1_step_s\": %.9f, "
                   "\"on_device_nograph_step_s\": %.9f, \"train_fed_ratio\": %.4f}\n",
                   R, batch, workers, graphs ? "true" : "false", td, tf, t1, tdirect, ratio);
      std::fclose(f);
    }
  }
  for (std::size_t r = 0; r < R; ++r) {
    cudaSetDevice(devs[r]);
    cudaFree(dx[r]);
    cudaFree(dy[r]);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_train_fed_gpu: %s\n", e.what());
  return 1;
}
