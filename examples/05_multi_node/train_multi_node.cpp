// train_multi_node: the Fashion-MNIST MLP trained by several processes, on one machine or
// many, launched by mpirun or srun (docs/multi_node.md):
//
//   mpirun -np 4 train_multi_node --epochs 3 --batch 128
//   srun --ntasks=16 train_multi_node --epochs 3 --batch 512
//
// One replica per process (host backend, OpenBLAS); gradients are all-reduced across
// processes by ferry::mpi_communicator through the unchanged mirrored trainer. The global
// batch is --batch: each rank takes batch / world rows a step.
//
// Data: Debian's Fashion-MNIST is ONE file per split, fewer files than ranks, so this
// program shards by element (shard(world, rank, by_element)): every rank streams the file
// and keeps rows k % world == rank. A dataset of many files would shard by file
// (shard(world, rank)) and read only its own. Each rank shuffles its shard with seed
// (seed, rank). Before each epoch the ranks agree on the step count (MIN for training:
// every step full; MAX for the test set, with empty steps on ranks that run out, so every
// test image counts once).
//
// Output (rank 0, stdout): "epoch <k> loss <l> test_accuracy <a> elapsed_s <s>" per epoch,
// then "test_accuracy: <a>". Any rank's error ends the job: "rank R: <error>" on stderr and
// a non-zero exit from mpirun (MPI_Abort), never a hang.
#include <CLI/CLI.hpp>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ferry/collective/agree_steps.hpp"
#include "ferry/distributed.hpp"
#include "ferry/error.hpp"
#include "ferry/source.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/sources/idx.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/map.hpp"
#include "ferry/stages/prefetch.hpp"
#include "ferry/stages/shard.hpp"
#include "ferry/stages/shuffle.hpp"
#include "ferry/stages/zip.hpp"
#include "fashion_mnist.hpp"  // examples/04_train_fashion_mnist: the decoding
#include "ferry/train/host_backend.hpp"
#include "ferry/train/mirrored_trainer.hpp"

namespace {

// Images and labels to samples: the same decoding as example 04.
using fmnist::pixels;
using fmnist::to_sample;

auto pipeline(const std::string& dir, const std::string& split, bool train, std::size_t per_rank,
              int world, int rank, std::uint64_t seed) {
  auto images = ferry::from_files(std::vector<std::string>{dir + "/" + split + "-images-idx3-ubyte.gz"}, ferry::idx{});
  auto labels = ferry::from_files(std::vector<std::string>{dir + "/" + split + "-labels-idx1-ubyte.gz"}, ferry::idx{});
  return ferry::zip(std::move(images), std::move(labels)) | ferry::shard(std::uint64_t(world), std::uint64_t(rank), ferry::by_element) |
         ferry::shuffle(train ? 10000 : 1, seed * 1000003u + std::uint64_t(rank)) |
         ferry::map([](const auto& p) { return to_sample(p); }) | ferry::batch(per_rank) |
         ferry::prefetch(2) |
         ferry::distribute(ferry::host_replicas{1},
                           {.remainder = train ? ferry::remainder_policy::drop : ferry::remainder_policy::pad});
}

// Rows in an IDX file, from its header alone: each rank sizes its shard from it.
std::int64_t rows_in(const std::string& path) {
  const auto m = ferry::from_files(std::vector<std::string>{path}, ferry::idx{}).meta();
  return m ? std::int64_t(m->rows) : 0;
}

}  // namespace

int main(int argc, char** argv) {
  ferry::distributed_context ctx(argc, argv, {.devices_per_rank = 0});
  return ferry::abort_on_exception([&] {
    int epochs = 3;
    std::size_t batch = 128;
    std::uint64_t seed = 1;
    std::int64_t max_steps = -1;
    float lr = 1e-3f;
    std::string dir = "/usr/share/datasets/fashion-mnist";
    CLI::App app("The Fashion-MNIST MLP trained by several processes (mpirun, srun).", "train_multi_node");
    app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    const auto whole = CLI::Range(1LL, 1'000'000'000'000'000LL).description("N>=1");  // signed: -1 is refused
    app.add_option("--epochs", epochs)->check(whole)->capture_default_str();
    app.add_option("--batch", batch, "the global batch (batch / ranks a rank)")->check(whole)->capture_default_str();
    app.add_option("--seed", seed)  // 0 too, as example 04
        ->check(CLI::Range(0LL, 1'000'000'000'000'000LL).description("N>=0"))
        ->capture_default_str();
    app.add_option("--steps", max_steps, "at most this many steps an epoch (default: all)")->check(whole);
    app.add_option("--lr", lr)->capture_default_str();
    app.add_option("--data", dir, "the directory of the gzip IDX files")->capture_default_str();
    try {
      app.parse(argc, argv);
    } catch (const CLI::CallForHelp&) {
      if (ctx.rank() == 0) std::fputs(app.help().c_str(), stdout);
      return 0;
    } catch (const CLI::ParseError& e) {  // every rank throws: abort_on_exception ends the job
      throw ferry::config_error(std::string(e.what()) + " (see --help)");
    }
    const int W = ctx.world_size(), me = ctx.rank();
    if (batch % std::size_t(W) != 0)
      throw ferry::config_error("--batch " + std::to_string(batch) + " is not divisible by " +
                                std::to_string(W) + " ranks");
    const std::size_t per_rank = batch / std::size_t(W);
    ferry::train::host_backend::set_blas_threads(1);  // ranks are the parallelism

    ferry::train::mirrored_trainer<ferry::train::host_backend, ferry::mpi_communicator> trainer(
        {.layers = {pixels, 256, 128, 10}, .class_weights = {}},
        {.opt = {.kind = ferry::train::optimizer_kind::adam, .lr = lr}, .seed = seed,
         .max_rows = int(per_rank)},
        ferry::one_replica_per_process(ctx));
    const std::int64_t train_rows = rows_in(dir + "/train-labels-idx1-ubyte.gz");
    const std::int64_t test_rows = rows_in(dir + "/t10k-labels-idx1-ubyte.gz");
    auto train = pipeline(dir, "train", true, per_rank, W, me, seed);
    auto test = pipeline(dir, "t10k", false, per_rank, W, me, seed);
    if (me == 0)
      std::fprintf(stderr, "train_multi_node: %d ranks on %d node(s), global batch %zu (%zu per rank); "
                           "1 file per split < %d ranks: element-level shards\n",
                   W, W / ctx.local_size(), batch, per_rank, W);

    const auto t0 = std::chrono::steady_clock::now();
    double accuracy = 0;
    for (int e = 1; e <= epochs; ++e) {
      std::int64_t n = ferry::agree_steps(
          ctx.world(), ferry::steps_for(ferry::shard_rows(train_rows, W, me), std::int64_t(per_rank), ferry::step_policy::drop),
          ferry::step_policy::drop);
      if (max_steps > 0) n = std::min(n, max_steps);
      double loss = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        auto s = train.next();
        if (!s) throw ferry::error("the training shard ended before the agreed " + std::to_string(n) + " steps");
        loss += trainer.train_step(*s).loss;
      }
      train.rewind();
      const std::int64_t m = ferry::agree_steps(
          ctx.world(), ferry::steps_for(ferry::shard_rows(test_rows, W, me), std::int64_t(per_rank), ferry::step_policy::pad),
          ferry::step_policy::pad);
      double correct = 0, rows = 0;
      for (std::int64_t i = 0; i < m; ++i) {
        auto s = test.next();
        const auto st = s ? trainer.evaluate(*s) : trainer.evaluate(std::vector<ferry::train::replica_input>(1));
        correct += st.accuracy * st.rows;
        rows += st.rows;
      }
      test.rewind();
      accuracy = rows > 0 ? correct / rows : 0.0;
      if (me == 0) {
        const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("epoch %d loss %.4f test_accuracy %.4f elapsed_s %.1f\n", e, n ? loss / double(n) : 0.0,
                    accuracy, el);
        std::fflush(stdout);
      }
    }
    if (me == 0) std::printf("test_accuracy: %.4f\n", accuracy);
    return 0;
  });
}
