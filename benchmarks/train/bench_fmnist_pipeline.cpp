// The main example's input pipeline on its own, no training: how many samples a second it
// can hand a trainer, against a hand-written loop doing the same work on one thread, in
// one run. A GPU step fed by it (benchmarks/train/bench_train_fed_gpu) can only be as
// short as the pipeline's time per batch, so this says where that limit is on a machine.
//
//   ferry: fmnist::pipeline (from_files over the gzip IDX files | take | cache | shuffle
//          | map(bytes -> normalised floats, W workers) | batch | prefetch | distribute(
//          host_replicas{1})), drained step by step.
//   loop:  gzread both files into memory (epoch 1), then each epoch a new permutation
//          (std::shuffle) and, batch by batch, the same normalisation into one reused
//          batch buffer of floats and labels: what a hand-written C++ loader does.
// Epoch 1 (inflating; ferry also fills its cache) is timed apart from the steady epochs
// (2..E, ferry replaying its cache: their median). Each contender runs `--rounds` times,
// in turn (loop, ferry, loop, ...), from a fresh start; the medians are reported. The shuffles differ (ferry's is a
// 20,000-sample buffer, the loop's a full permutation); the work per sample is the same.
// Prints a table, `pipeline_ratio_steady` and `pipeline_ratio_epoch1` (ferry samples/s /
// loop samples/s, for each worker count) and a JSON line. Exits 77 without the files.
//
// usage: bench_fmnist_pipeline [--data DIR] [--epochs 9] [--rounds 3] [--workers W (default: 1 and hc/2)]
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/timing.hpp"
#include "fashion_mnist.hpp"

namespace {
using clk = std::chrono::steady_clock;
double since(clk::time_point t0) { return std::chrono::duration<double>(clk::now() - t0).count(); }

// Inflates a whole gzip file (gzread: zlib, one thread), as a hand-written loader does.
std::vector<unsigned char> gunzip(const std::string& path) {
  std::vector<unsigned char> out;
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) return out;
  gzbuffer(f, 1 << 18);
  unsigned char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) out.insert(out.end(), buf, buf + n);
  gzclose(f);
  return out;
}

struct times {
  double epoch1 = 0, steady = 0;  // seconds; steady: median of epochs 2..E
  std::size_t samples = 0;        // per epoch
  double checksum = 0;
};

times run_loop(const std::string& dir, int epochs, std::size_t batch) {
  times t;
  std::vector<double> steady;
  std::vector<unsigned char> img, lab;
  std::vector<float> x(batch * fmnist::pixels);
  std::vector<std::int32_t> y(batch);
  std::vector<std::uint32_t> order;
  std::mt19937_64 g(1);
  for (int e = 0; e < epochs; ++e) {
    const auto t0 = clk::now();
    if (e == 0) {
      img = gunzip(dir + "/train-images-idx3-ubyte.gz");
      lab = gunzip(dir + "/train-labels-idx1-ubyte.gz");
      if (img.size() < 16 || lab.size() < 8) return t;
      order.resize(std::min((img.size() - 16) / fmnist::pixels, lab.size() - 8));
      std::iota(order.begin(), order.end(), 0u);
    }
    std::shuffle(order.begin(), order.end(), g);
    std::size_t n = 0;
    for (std::size_t b = 0; b + batch <= order.size(); b += batch) {
      for (std::size_t i = 0; i < batch; ++i) {
        const std::size_t k = order[b + i];
        const unsigned char* p = img.data() + 16 + k * fmnist::pixels;
        float* o = x.data() + i * fmnist::pixels;
        for (int j = 0; j < fmnist::pixels; ++j) o[j] = (p[j] * (1.0f / 255.0f) - 0.2860f) * (1.0f / 0.3530f);
        y[i] = lab[8 + k];
      }
      n += batch;
      t.checksum += x[0] + x[x.size() - 1] + y[0];  // the batch is used
    }
    const double s = since(t0);
    t.samples = n;
    if (e == 0) t.epoch1 = s;
    else steady.push_back(s);
  }
  t.steady = bench::median(steady);
  return t;
}

times run_ferry(const std::string& dir, int epochs, std::size_t batch, std::size_t workers) {
  times t;
  std::vector<double> steady;
  auto p = fmnist::pipeline({.dir = dir, .batch = batch, .workers = workers}, ferry::host_replicas{1});
  for (int e = 0; e < epochs; ++e) {
    const auto t0 = clk::now();
    std::size_t n = 0;
    for (auto& st : p) {
      auto x = st[0].template field<0>();
      auto y = st[0].template field<1>();
      n += st[0].size();
      t.checksum += x[0][0] + x[x.size() - 1][fmnist::pixels - 1] + y[0];  // the batch is used
    }
    const double s = since(t0);
    p.rewind();
    t.samples = n;
    if (e == 0) t.epoch1 = s;
    else steady.push_back(s);
  }
  t.steady = bench::median(steady);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  const char* env = std::getenv("FERRY_FASHION_MNIST");
  std::string dir = env ? env : "/usr/share/datasets/fashion-mnist";
  int epochs = 9, rounds = 3;
  std::vector<std::size_t> worker_counts;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--data") dir = v;
    else if (a == "--epochs") epochs = std::max(2, std::atoi(v.c_str()));
    else if (a == "--rounds") rounds = std::max(1, std::atoi(v.c_str()));
    else if (a == "--workers") worker_counts = {std::size_t(std::max(1, std::atoi(v.c_str())))};
    else {
      std::fprintf(stderr, "bench_fmnist_pipeline: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (!std::filesystem::exists(dir + "/train-images-idx3-ubyte.gz")) {
    std::printf("skipped: no Fashion-MNIST files in %s (--data DIR or FERRY_FASHION_MNIST)\n", dir.c_str());
    return 77;
  }
  const std::size_t hc = std::max(1u, std::thread::hardware_concurrency());
  if (worker_counts.empty()) {
    worker_counts = {1};
    if (hc / 2 > 1) worker_counts.push_back(hc / 2);
  }
  const std::size_t batch = 128;
  // Rounds in turn; the median of each figure over the rounds.
  std::vector<std::vector<times>> runs(1 + worker_counts.size());
  for (int r = 0; r < rounds; ++r) {
    runs[0].push_back(run_loop(dir, epochs, batch));
    if (runs[0].back().samples == 0) {
      std::fprintf(stderr, "bench_fmnist_pipeline: cannot read the files in %s\n", dir.c_str());
      return 1;
    }
    for (std::size_t i = 0; i < worker_counts.size(); ++i)
      runs[1 + i].push_back(run_ferry(dir, epochs, batch, worker_counts[i]));
  }
  auto med = [](const std::vector<times>& v) {
    std::vector<double> e1, st;
    for (const times& t : v) {
      e1.push_back(t.epoch1);
      st.push_back(t.steady);
    }
    times m = v.front();
    m.epoch1 = bench::median(e1);
    m.steady = bench::median(st);
    return m;
  };
  const times loop = med(runs[0]);
  std::vector<times> ferry_t;
  for (std::size_t i = 0; i < worker_counts.size(); ++i) ferry_t.push_back(med(runs[1 + i]));

  std::printf("# Fashion-MNIST train split, batch %zu, %d epochs (steady: median of epochs 2..%d); "
              "medians of %d rounds; %zu cores\n", batch, epochs, epochs, rounds, hc);
  std::printf("%-28s %10s %14s %14s\n", "what", "epoch1_s", "epoch1_per_s", "steady_per_s");
  auto row = [&](const std::string& w, const times& t) {
    std::printf("%-28s %10.3f %14.0f %14.0f\n", w.c_str(), t.epoch1, double(t.samples) / t.epoch1,
                double(t.samples) / t.steady);
  };
  row("hand loop, 1 thread", loop);
  bool ok = true;
  std::string json = "{\"bench\":\"fmnist_pipeline\",\"cores\":" + std::to_string(hc) +
                     ",\"loop_epoch1_s\":" + std::to_string(loop.epoch1) +
                     ",\"loop_steady_s\":" + std::to_string(loop.steady) + ",\"ferry\":[";
  for (std::size_t i = 0; i < ferry_t.size(); ++i) {
    const times& t = ferry_t[i];
    row("ferry, " + std::to_string(worker_counts[i]) + " map worker(s)", t);
    ok = ok && t.samples == loop.samples;
    json += std::string(i ? "," : "") + "{\"workers\":" + std::to_string(worker_counts[i]) +
            ",\"epoch1_s\":" + std::to_string(t.epoch1) + ",\"steady_s\":" + std::to_string(t.steady) +
            ",\"ratio_steady\":" + std::to_string(loop.steady / t.steady) +
            ",\"ratio_epoch1\":" + std::to_string(loop.epoch1 / t.epoch1) + "}";
  }
  for (std::size_t i = 0; i < ferry_t.size(); ++i) {
    std::printf("pipeline_ratio_steady_w%zu: %.3f (ferry samples/s / loop samples/s)\n", worker_counts[i],
                loop.steady / ferry_t[i].steady);
    std::printf("pipeline_ratio_epoch1_w%zu: %.3f\n", worker_counts[i], loop.epoch1 / ferry_t[i].epoch1);
  }
  std::printf("JSON %s]}\n", json.c_str());
  if (!ok) std::fprintf(stderr, "bench_fmnist_pipeline: ferry and the loop made different numbers of samples\n");
  return ok ? 0 : 1;
}
