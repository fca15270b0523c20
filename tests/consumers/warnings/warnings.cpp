// Every public header, included with -I (not -isystem) and its templates instantiated by
// the typical pipelines, must compile without a warning under
//   -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Werror
// (scripts/check_consumers.sh, consumer "warnings"). Template code warns only where it is
// instantiated, so this file builds one of each kind of pipeline; it is compiled, not run.
// The headers that need a third-party library are included where it is found: the CUDA
// runtime API (FERRY_WITH_CUDART, set by the script), MPI, Thrust and OpenBLAS.
// ferry.hpp first, as users include it: a header's name that shadows one declared before
// it (a parameter named `batch` after ferry::batch) warns only in that order.
#include "ferry/ferry.hpp"
#include "ferry/any_source.hpp"
#include "ferry/batch_of.hpp"
#include "ferry/cache_codec.hpp"
#include "ferry/collective/agree_steps.hpp"
#include "ferry/collective/communicator.hpp"
#include "ferry/collective/mpi.hpp"
#include "ferry/collective/rank_exchange.hpp"
#if !defined(FERRY_WITH_CUDART) || __has_include(<nccl.h>)
#include "ferry/collective/nccl.hpp"
#endif
#include "ferry/collective/thread_collective.hpp"
#include "ferry/config.hpp"
#include "ferry/cuda/device_pool.hpp"
#include "ferry/cuda/devices.hpp"
#include "ferry/cuda/error.hpp"
#include "ferry/cuda/nvtx.hpp"
#include "ferry/cuda/runtime.hpp"
#include "ferry/cuda/stream.hpp"
#include "ferry/cuda/stream_handle.hpp"
#include "ferry/distributed.hpp"
#include "ferry/error.hpp"
#include "ferry/ferry.hpp"
#include "ferry/memory/buffer.hpp"
#include "ferry/memory/pinned.hpp"
#include "ferry/observe/hooks.hpp"
#include "ferry/source.hpp"
#include "ferry/sources/array_meta.hpp"
#include "ferry/sources/compression.hpp"
#include "ferry/sources/example.hpp"
#include "ferry/sources/file_options.hpp"
#include "ferry/sources/fixed_length.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/sources/from_generator.hpp"
#include "ferry/sources/from_range.hpp"
#include "ferry/sources/global_shuffle.hpp"
#include "ferry/sources/idx.hpp"
#include "ferry/sources/npy.hpp"
#include "ferry/sources/record.hpp"
#include "ferry/sources/row_files.hpp"
#include "ferry/sources/text_lines.hpp"
#include "ferry/sources/tfrecord.hpp"
#include "ferry/stage.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/cache.hpp"
#include "ferry/stages/cache_on_device.hpp"
#include "ferry/stages/concatenate.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/filter.hpp"
#include "ferry/stages/flat_map.hpp"
#include "ferry/stages/interleave.hpp"
#include "ferry/stages/map.hpp"
#include "ferry/stages/prefetch.hpp"
#include "ferry/stages/repeat.hpp"
#include "ferry/stages/sample_from.hpp"
#include "ferry/stages/shard.hpp"
#include "ferry/stages/shuffle.hpp"
#include "ferry/stages/skip.hpp"
#include "ferry/stages/take.hpp"
#include "ferry/stages/zip.hpp"
#include "ferry/state.hpp"
#include "ferry/stats.hpp"
#include "ferry/step.hpp"
#include "ferry/trace.hpp"
#include "ferry/train/loss.hpp"
#include "ferry/train/mlp.hpp"
#include "ferry/train/optimizer.hpp"
#include "ferry/train/progress.hpp"
#include "ferry/train/replica.hpp"
#include "ferry/train/weights_file.hpp"
#if defined(THRUST_DEVICE_SYSTEM) && __has_include(<thrust/for_each.h>) && __has_include(<cblas.h>)
#define WARNINGS_HOST_TRAINER 1
#include "ferry/train/host_backend.hpp"
#include "ferry/train/host_trainer.hpp"
#include "ferry/train/mirrored_trainer.hpp"
#endif

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using example = std::tuple<std::array<float, 4>, std::int32_t>;

example decode(const ferry::record& r) {
  example e{};
  for (std::size_t i = 0; i < r.size() && i < 4; ++i) std::get<0>(e)[i] = static_cast<float>(r.data()[i]);
  std::get<1>(e) = static_cast<std::int32_t>(r.size() % 10);
  return e;
}

// Drains a pipeline; its checkpoint, restored into a fresh one, and its report.
template <class P>
std::size_t drain(P& p) {
  std::size_t n = 0;
  for (auto& e : p) {
    (void)e;
    ++n;
  }
  return n;
}
template <class Make>
std::size_t resume(Make make) {
  auto p = make();
  const std::size_t n = drain(p);
  const ferry::pipeline_state st = ferry::save_state(p);
  auto q = make();
  ferry::restore_state(q, st);
  return n + drain(q) + ferry::report(q).stages.size();
}

std::size_t formats(const std::vector<std::string>& files) {
  std::size_t n = 0;
  n += resume([&] { return ferry::from_files(files, ferry::tfrecord{}) | ferry::map(decode); });
  n += resume([&] { return ferry::from_files(files, ferry::npy{}, {.on_error = ferry::error_policy::skip}); });
  n += resume([&] { return ferry::from_files(files, ferry::idx{}); });
  n += resume([&] { return ferry::from_files(files, ferry::fixed_length{16}); });
  n += resume([&] { return ferry::from_files(files, ferry::text_lines{}); });
  n += resume([&] {
    return ferry::from_files(files, ferry::tfrecord{}) | ferry::map(ferry::parse_example) |
           ferry::map([](const ferry::example& e) { return e.size(); });
  });
  return n;
}

std::size_t stages(const std::vector<std::string>& files) {
  std::size_t n = 0;
  std::vector<int> v(1000);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int>(i);
  n += resume([&] {
    return ferry::from_range(v) | ferry::shuffle(64, 7) | ferry::map([](int x) { return 2 * x; }) |
           ferry::filter([](int x) { return x % 3 != 0; }) |
           ferry::map([](int x) { return static_cast<float>(x); }, {.workers = 2}) | ferry::batch(100) |
           ferry::prefetch(2);
  });
  n += resume([&] {
    return ferry::from_range(v) | ferry::map([](int x) { return x; }, {.workers = ferry::autotune}) |
           ferry::take(500) | ferry::skip(10) | ferry::shard(2, 1) | ferry::repeat(2);
  });
  n += resume([&] {
    return ferry::from_range(v) |
           ferry::flat_map([](int x) { return std::vector<std::int64_t>(static_cast<std::size_t>(x % 3), x); }) |
           ferry::cache();
  });
  n += resume([&] {
    return ferry::from_files(files, ferry::tfrecord{}) | ferry::interleave(4, {.workers = 2, .block = 16}) |
           ferry::map(decode) | ferry::cache("/tmp/ferry-warnings.cache", {.key = "v1"}) | ferry::batch(32);
  });
  n += resume([&] {
    return ferry::from_range(files) |
           ferry::interleave([](const std::string& f) { return ferry::from_files({f}, ferry::tfrecord{}); },
                             {.workers = 2, .block = 4, .cycle = 2});
  });
  n += resume([&] {
    return ferry::zip(ferry::from_files(files, ferry::idx{}), ferry::from_files(files, ferry::idx{})) |
           ferry::batch(8);
  });
  n += resume([&] {
    return ferry::concatenate(ferry::from_range(v), ferry::from_generator(100, [](std::uint64_t i) {
                                return static_cast<int>(i);
                              }));
  });
  n += resume([&] {
    return ferry::sample_from({.weights = {0.7, 0.3}, .seed = 42}, ferry::from_range(v), ferry::from_range(v));
  });
  n += resume([&] {
    ferry::any_source<example> a = ferry::from_files(files, ferry::tfrecord{}) | ferry::map(decode);
    return std::move(a) | ferry::batch(16, {.drop_remainder = true}) |
           ferry::distribute(ferry::host_replicas{2});
  });
  {
    auto steps = ferry::from_range(std::vector<example>(64)) | ferry::batch(8) |
                 ferry::distribute(ferry::host_replicas{2}, {.remainder = ferry::remainder_policy::pad});
    for (auto& st : steps)
      for (std::size_t r = 0; r < st.replicas(); ++r) n += st[r].field<0>().size() + st[r].field<1>().size();
  }
  {  // records by index in one global order; a cache with one order across replicas (and ranks)
    if (!files.empty()) {
      const ferry::row_files rows(files, ferry::tfrecord{}, {.max_record_bytes = 1 << 20});
      auto g = ferry::global_shuffle(rows, {.seed = 1, .global_batch = 8}) | ferry::map(decode) | ferry::batch(8);
      n += drain(g);
    }
    ferry::rank_exchange* ranks = nullptr;
#if defined(FERRY_HAVE_MPI)
    ferry::mpi_communicator world;
    ferry::rank_exchange_over<ferry::mpi_communicator> over(world);
    ranks = &over;
#endif
    auto c = ferry::global_shuffle(std::vector<example>(64), {.seed = 2, .global_batch = 8}) | ferry::batch(8) |
             ferry::distribute(ferry::host_replicas{2}) |
             ferry::cache_on_device({.seed = 3, .across_replicas = true, .ranks = ranks,
                                     .resume = ferry::global_position{1, 2, 64, 8}});
    n += drain(c);
  }
#if defined(FERRY_WITH_CUDART)
  n += resume([&] {
    return ferry::from_range(std::vector<example>(64)) | ferry::batch(8) |
           ferry::distribute(ferry::cuda::devices{0}, {.remainder = ferry::remainder_policy::partial});
  });
#endif
#if defined(WARNINGS_HOST_TRAINER)
  {
    ferry::train::mlp_config cfg;
    cfg.layers = {4, 8, 10};
    ferry::train::host_trainer t(cfg, {.opt = {.lr = 1e-3f}, .seed = 1, .max_rows = 4}, 2);
    auto steps = ferry::from_range(std::vector<example>(64)) | ferry::batch(8) |
                 ferry::distribute(ferry::host_replicas{2});
    for (auto& st : steps) {
      n += static_cast<std::size_t>(t.train_step(st).loss > 0);
      t.train_step_async(st);
      n += static_cast<std::size_t>(t.evaluate(st).accuracy > 0);
    }
    n += static_cast<std::size_t>(t.take_stats().loss > 0);
  }
#endif
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  ferry::enable_stats();
  ferry::tracing session("/tmp/ferry-warnings.trace.json");
  std::vector<std::string> files(argv + 1, argv + argc);
  return formats(files) + stages(files) == 0;
}
