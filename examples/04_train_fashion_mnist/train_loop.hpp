// train_loop.hpp: the example's epochs, the same for every backend: train on the
// pipeline's steps, evaluate on the test split, print one line per epoch (stdout):
//   epoch <k> loss <l> test_accuracy <a> elapsed_s <seconds since start>
// where l is the epoch's mean training loss over its rows, and at the end:
//   test_accuracy: <a>
// A progress bar (or plain log lines, when stderr is not a terminal) goes to stderr; its
// last running mean is the epoch line's loss, the same number from the same sums.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

#include "fashion_mnist.hpp"
#include "ferry/train/progress.hpp"
#include "model.hpp"

namespace fmnist {

struct run_options {
  int epochs = 12;
  pipeline_options train, test;
  std::string save, load;
  bool quiet = false;
};

template <class Train, class Test>
void run_epochs(model& m, Train& train, Test& test, const run_options& o);

// tag picks distribute()'s backend: ferry::host_replicas{R} or ferry::cuda::devices.
// cache: a cache_on_device stage for the training split (a closure), or nullptr.
template <class Tag, class Cache>
void run(model& m, const Tag& tag, const run_options& o, const Cache& cache) {
  if (!o.load.empty()) m.load(o.load);
  auto test = pipeline(o.test, tag);
  if constexpr (std::is_same_v<Cache, std::nullptr_t>) {
    auto train = pipeline(o.train, tag);
    run_epochs(m, train, test, o);
  } else {
    auto train = pipeline(o.train, tag) | cache;
    run_epochs(m, train, test, o);
  }
}

// The epochs: train, evaluate, print (see the file's top).
template <class Train, class Test>
void run_epochs(model& m, Train& train, Test& test, const run_options& o) {
  namespace tr = ferry::train;
  const std::uint64_t n = std::min<std::uint64_t>(o.train.limit, train_images);
  const std::uint64_t train_rows = n / o.train.batch * o.train.batch;

  const auto t0 = std::chrono::steady_clock::now();
  double accuracy = 0;
  for (int e = 1; e <= o.epochs; ++e) {
    tr::progress_bar bar("epoch " + std::to_string(e), train_rows, stderr,
                         o.quiet ? tr::progress_mode::off : tr::progress_mode::automatic);
    // Asynchronous steps: on a GPU the host enqueues step k+1 while the GPU runs step k,
    // and waits only when it reads the statistics: every 0.2 s for the bar, and at the end
    // of the epoch. Each read is the mean loss of the steps since the last, with their
    // weight: the bar's mean of them all is the epoch's mean loss.
    std::uint64_t seen = 0;
    auto read_stats = [&] {
      const tr::step_stats s = m.take_stats();
      bar.update(seen, s.loss, s.weight);
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
    const double epoch_loss = bar.mean_loss().value_or(0.0);
    bar.finish();
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

}  // namespace fmnist
