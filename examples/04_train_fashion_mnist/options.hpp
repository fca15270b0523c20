// options.hpp: train_fashion_mnist's command line, parsed by CLI11 (`--help` lists it).
// A repeated option takes its last value, as `bash scripts/main.sh ARGS` passes them on.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "ferry/error.hpp"
#include "ferry/train/optimizer.hpp"

namespace fmnist {

struct options {
  int epochs = 12;
  std::size_t batch = 128;     // the global batch
  std::string device = "auto";  // auto | gpu | cpu
  std::size_t replicas = 0;    // host replicas (0: one per core, see main)
  std::size_t gpus = 0;        // the first N GPUs (0: all)
  std::uint64_t seed = 1;
  std::vector<int> hidden{256, 128};
  ferry::train::optimizer_config opt{.kind = ferry::train::optimizer_kind::adam, .lr = 1e-3f};
  std::size_t workers = 0;     // map workers (0: by backend, see main)
  std::size_t shuffle_buffer = 20000;
  int blas_threads = 0;
  std::uint64_t limit = ~std::uint64_t(0);
  std::string data = "/usr/share/datasets/fashion-mnist", save, load;
  bool graphs = true, quiet = false;
  bool cache_on_device = false;  // the training split kept in the replicas' memory after epoch 1
};

// "256,128" -> {256, 128}.
inline std::vector<int> parse_sizes(const std::string& s) {
  std::vector<int> v;
  for (std::size_t p = 0;;) {
    const std::size_t q = s.find(',', p);
    const std::string tok = s.substr(p, q == std::string::npos ? std::string::npos : q - p);
    char* end = nullptr;
    const long x = std::strtol(tok.c_str(), &end, 10);
    if (tok.empty() || *end || x < 1 || x > 1 << 20)
      throw ferry::config_error("--hidden: expected sizes like 256,128, got '" + s + "'");
    v.push_back(static_cast<int>(x));
    if (q == std::string::npos) return v;
    p = q + 1;
  }
}

// The options, or nullopt after printing --help. Throws config_error on a bad argument.
inline std::optional<options> parse(int argc, char** argv) {
  options o;
  std::string hidden = "256,128", optimizer = "adam";
  CLI::App app("Trains an MLP on Fashion-MNIST through a ferry pipeline, on every GPU or on "
               "CPU replicas.", "train_fashion_mnist");
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  // Whole numbers from lo up (signed: a negative one is refused, not wrapped around).
  auto at_least = [](long long lo) {
    return CLI::Range(lo, 1'000'000'000'000'000LL).description(lo ? "N>=1" : "N>=0");
  };
  app.add_option("--epochs", o.epochs)->check(at_least(1))->capture_default_str();
  app.add_option("--batch", o.batch, "the global batch")->check(at_least(1))->capture_default_str();
  app.add_option("--device", o.device)->check(CLI::IsMember({"auto", "gpu", "cpu"}))->capture_default_str();
  app.add_option("--replicas", o.replicas, "cpu: host replicas (default: one per core, "
                 "at most batch / 64, dividing the batch)")->check(at_least(1));
  app.add_option("--gpus", o.gpus, "gpu: the first N devices (default: all)")->check(at_least(1));
  app.add_option("--seed", o.seed)->check(at_least(0))->capture_default_str();
  app.add_option("--hidden", hidden, "hidden layer sizes")->capture_default_str();
  app.add_option("--lr", o.opt.lr)->capture_default_str();
  app.add_option("--optimizer", optimizer)->check(CLI::IsMember({"adam", "sgd"}))->capture_default_str();
  app.add_option("--momentum", o.opt.momentum, "sgd")->capture_default_str();
  app.add_option("--workers", o.workers, "map workers (default: 1 on cpu, min(8, cores / 2) on gpu)")
      ->check(at_least(1));
  app.add_option("--shuffle-buffer", o.shuffle_buffer)->check(at_least(1))->capture_default_str();
  app.add_option("--blas-threads", o.blas_threads, "OpenBLAS threads (default: its own)")->check(at_least(0));
  app.add_option("--limit", o.limit, "train on the first N images (default: all)")->check(at_least(1));
  app.add_option("--data", o.data, "the directory of the gzip IDX files")->capture_default_str();
  app.add_option("--save", o.save, "write the trained model to FILE");
  app.add_option("--load", o.load, "start from a model saved with --save");
  app.add_option("--graphs", o.graphs, "gpu: each replica's step as one CUDA graph (1) or "
                 "every kernel launched (0)")->check(CLI::IsMember({"0", "1"}))->capture_default_str();
  app.add_flag("--quiet", o.quiet, "no progress on stderr");
  app.add_flag("--cache-on-device", o.cache_on_device,
               "after epoch 1, the training split comes from the replicas' own memory (GPU or host), "
               "one order across all replicas each epoch (cache_on_device)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    app.exit(e);  // prints the help
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    throw ferry::config_error(std::string(e.what()) + " (see --help)");
  }
  o.hidden = parse_sizes(hidden);
  o.opt.kind = optimizer == "sgd" ? ferry::train::optimizer_kind::sgd : ferry::train::optimizer_kind::adam;
  return o;
}

}  // namespace fmnist
