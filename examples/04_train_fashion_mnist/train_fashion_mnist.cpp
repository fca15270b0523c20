// train_fashion_mnist: MirroredStrategy for C++ on the real Fashion-MNIST files.
//
//   train_fashion_mnist --epochs 12 --batch 128 --replicas 2 --seed 1 --hidden 256,128
//
// The pipeline reads Debian's gzip IDX files as they are (nothing converted by hand):
//   from_files(images, idx) zip from_files(labels, idx)     one (image row, label) pair
//   | shuffle(buffer, seed)                                  new order every epoch
//   | map(bytes -> normalised floats, {.workers})            on worker threads
//   | batch(global batch) | prefetch(2)                      a thread ahead of training
//   | distribute(host_replicas{R})                           R slices per step
// and the mirrored trainer runs one MLP replica per slice (its own thread), all-reducing
// gradients so the replicas stay identical. After every epoch it evaluates on the test
// set and prints (stdout, exactly):
//   epoch <k> loss <mean training loss> test_accuracy <a> elapsed_s <seconds since start>
// and at the end:
//   test_accuracy: <a>
// A progress bar (or plain log lines, when stderr is not a terminal) goes to stderr.
//
// Exit status 1 with a message on bad arguments or unreadable data.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "ferry/error.hpp"
#include "ferry/source.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/sources/idx.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/map.hpp"
#include "ferry/stages/prefetch.hpp"
#include "ferry/stages/shuffle.hpp"
#include "ferry/train/host_trainer.hpp"
#include "ferry/train/progress.hpp"

namespace {

// Pairs the i-th elements of two sources (ferry has no zip stage yet). Two sources of
// different lengths are a format error: the image and label files do not match.
template <class A, class B>
class zip_source : public ferry::source_interface<zip_source<A, B>> {
 public:
  using value_type = std::pair<ferry::value_t<A>, ferry::value_t<B>>;
  zip_source(A a, B b, std::string what) : a_(std::move(a)), b_(std::move(b)), what_(std::move(what)) {}
  std::optional<value_type> next() {
    auto x = a_.next();
    auto y = b_.next();
    if (!x && !y) return std::nullopt;
    if (!x || !y)
      throw ferry::format_error(what_, n_, "the two files hold different numbers of records (one "
                                           "ends at record " + std::to_string(n_) + ")");
    ++n_;
    return value_type(std::move(*x), std::move(*y));
  }
  void rewind() {
    a_.rewind();
    b_.rewind();
    n_ = 0;
  }

 private:
  A a_;
  B b_;
  std::string what_;
  std::uint64_t n_ = 0;
};

constexpr int pixels = 28 * 28;
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

template <class Map>
auto pipeline(const std::string& dir, const std::string& split, bool train, std::size_t batch,
              std::size_t replicas, std::size_t shuffle_buffer, std::uint64_t seed,
              std::size_t workers, Map fn) {
  auto images = ferry::from_files(std::vector<std::string>{dir + "/" + split + "-images-idx3-ubyte.gz"}, ferry::idx{});
  auto labels = ferry::from_files(std::vector<std::string>{dir + "/" + split + "-labels-idx1-ubyte.gz"}, ferry::idx{});
  using Z = zip_source<decltype(images), decltype(labels)>;
  Z pairs(std::move(images), std::move(labels), dir + "/" + split + "-*-idx*-ubyte.gz");
  // The test set is not shuffled (a buffer of 1 keeps the order) and is padded, not
  // dropped: every test image counts once.
  return std::move(pairs) | ferry::shuffle(train ? shuffle_buffer : 1, seed) |
         ferry::map(fn, {.workers = workers}) | ferry::batch(batch) | ferry::prefetch(2) |
         ferry::distribute(ferry::host_replicas{replicas},
                           {.remainder = train ? ferry::remainder_policy::drop
                                               : ferry::remainder_policy::pad});
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
               "usage: train_fashion_mnist [--epochs N] [--batch GLOBAL] [--replicas R] [--seed S]\n"
               "         [--hidden 256,128] [--lr 1e-3] [--optimizer adam|sgd] [--momentum 0.9]\n"
               "         [--workers W] [--shuffle-buffer N] [--data DIR] [--save FILE] [--load FILE]\n"
               "         [--quiet]\n");
}

}  // namespace

int main(int argc, char** argv) try {
  int epochs = 12;
  std::size_t batch = 128;
  unsigned hc = std::thread::hardware_concurrency();
  std::size_t replicas = hc ? hc : 1;
  std::uint64_t seed = 1;
  std::vector<int> hidden{256, 128};
  ferry::train::optimizer_config opt{.kind = ferry::train::optimizer_kind::adam, .lr = 1e-3f};
  std::size_t workers = 1, shuffle_buffer = 20000;
  std::string dir = "/usr/share/datasets/fashion-mnist", save, load;
  bool quiet = false;

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
      if (x < lo || x != static_cast<double>(static_cast<long long>(x)))
        throw ferry::config_error(a + ": expected a whole number >= " + std::to_string(int(lo)));
      return static_cast<long long>(x);
    };
    if (a == "--epochs") epochs = int(count(val(), 1));
    else if (a == "--batch") batch = std::size_t(count(val(), 1));
    else if (a == "--replicas") replicas = std::size_t(count(val(), 1));
    else if (a == "--seed") seed = std::uint64_t(count(val(), 0));
    else if (a == "--hidden") hidden = parse_sizes(val());
    else if (a == "--lr") opt.lr = float(num(val()));
    else if (a == "--momentum") opt.momentum = float(num(val()));
    else if (a == "--optimizer") {
      const std::string o = val();
      if (o == "adam") opt.kind = ferry::train::optimizer_kind::adam;
      else if (o == "sgd") opt.kind = ferry::train::optimizer_kind::sgd;
      else throw ferry::config_error("--optimizer: adam or sgd, not '" + o + "'");
    } else if (a == "--workers") workers = std::size_t(count(val(), 1));
    else if (a == "--shuffle-buffer") shuffle_buffer = std::size_t(count(val(), 1));
    else if (a == "--data") dir = val();
    else if (a == "--save") save = val();
    else if (a == "--load") load = val();
    else if (a == "--quiet") quiet = true;
    else if (a == "--help" || a == "-h") { usage(); return 0; }
    else { usage(); throw ferry::config_error("unknown argument '" + a + "'"); }
  }
  if (batch % replicas != 0)
    throw ferry::config_error("--batch " + std::to_string(batch) + " is not divisible by --replicas " +
                              std::to_string(replicas));

  ferry::train::mlp_config cfg;
  cfg.layers.push_back(pixels);
  cfg.layers.insert(cfg.layers.end(), hidden.begin(), hidden.end());
  cfg.layers.push_back(10);
  const int per_replica = int(batch / replicas);
  ferry::train::host_trainer trainer(cfg, {.opt = opt, .seed = seed, .max_rows = per_replica},
                                     int(replicas));
  if (!load.empty()) trainer.load(load);

  auto fn = [](const auto& p) { return to_sample(p); };
  auto train = pipeline(dir, "train", true, batch, replicas, shuffle_buffer, seed, workers, fn);
  auto test = pipeline(dir, "t10k", false, batch, replicas, 1, seed, workers, fn);
  const std::uint64_t train_rows = 60000 / batch * batch;

  const auto t0 = std::chrono::steady_clock::now();
  double accuracy = 0;
  for (int e = 1; e <= epochs; ++e) {
    ferry::train::progress_bar bar("epoch " + std::to_string(e), train_rows, stderr,
                                   quiet ? ferry::train::progress_mode::off
                                         : ferry::train::progress_mode::automatic);
    double loss_sum = 0;
    std::uint64_t steps = 0, seen = 0;
    for (auto& step : train) {
      const auto s = trainer.train_step(step);
      loss_sum += s.loss;
      ++steps;
      seen += std::uint64_t(s.rows);
      bar.update(seen, s.loss);
    }
    bar.finish(steps ? loss_sum / double(steps) : 0.0);
    train.rewind();

    double correct = 0, rows = 0;
    for (auto& step : test) {
      const auto s = trainer.evaluate(step);
      correct += s.accuracy * s.rows;
      rows += s.rows;
    }
    test.rewind();
    accuracy = rows > 0 ? correct / rows : 0.0;
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("epoch %d loss %.4f test_accuracy %.4f elapsed_s %.1f\n", e,
                steps ? loss_sum / double(steps) : 0.0, accuracy, elapsed);
    std::fflush(stdout);
  }
  if (!save.empty()) trainer.save(save);
  std::printf("test_accuracy: %.4f\n", accuracy);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "train_fashion_mnist: %s\n", e.what());
  return 1;
}
