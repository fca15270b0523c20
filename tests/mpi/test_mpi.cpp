// Multi-process training over MPI: run under `mpirun -np 2` and `-np 4` (tests/mpi/meson.build).
// Every rank runs every test case in the same order, so the collectives inside match;
// checks use CHECK (not REQUIRE) where leaving a test case early would skip a collective
// the other ranks still enter. Each case has a watchdog: a hang aborts the rank and
// mpirun ends the job.
//
//   mpi_communicator   against a naive oracle computed on every rank (rank-seeded data)
//   trainer            W ranks x 1 replica, per-rank batch B/W, element-level shards, give
//                      the same weights as one process with batch B and the same seed
//   exactly once       uneven files, file-level shards, 2 local replicas per rank,
//                      pad: every record seen exactly once; drop: equal full steps
//   uneven + trainer   equal step counts agreed before the epoch, no hang
//   lockstep           step counts no rank knows ahead (a filter), agreed step by step
//   fewer files        file-level shard with fewer files than ranks is a config_error;
//                      by_element is the explicit fallback
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/close.hpp"
#include "common/doubles.hpp"
#include "ferry/collective/agree_steps.hpp"
#include "ferry/collective/rank_exchange.hpp"
#include "ferry/distributed.hpp"
#include "ferry/sources/fixed_length.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/sources/global_shuffle.hpp"
#include "ferry/sources/row_files.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/cache_on_device.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/filter.hpp"
#include "ferry/stages/lockstep.hpp"
#include "ferry/stages/map.hpp"
#include "ferry/stages/shard.hpp"
#include "ferry/train/host_backend.hpp"
#include "ferry/train/host_trainer.hpp"
#include "ferry/train/mirrored_trainer.hpp"
#include "sources/helpers.hpp"  // tfrecord_of

using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

ferry::distributed_context& ctx() {
  static ferry::distributed_context c({.devices_per_rank = 0});
  return c;
}

// A fresh directory made by rank 0, its path broadcast to every rank.
fs::path shared_dir(const char* tag) {
  auto& w = ctx().world();
  std::array<char, 512> buf{};
  if (w.rank() == 0) {
    std::string t = (fs::temp_directory_path() / (std::string("ferry-mpi-") + tag + "-XXXXXX")).string();
    if (!mkdtemp(t.data())) t.clear();
    std::snprintf(buf.data(), buf.size(), "%s", t.c_str());
  }
  w.broadcast_bytes(std::as_writable_bytes(std::span<char>(buf)), 0);
  return fs::path(buf.data());
}

void write_file(const fs::path& p, const void* data, std::size_t bytes) {
  std::ofstream f(p, std::ios::binary);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
}

// ---- a small classification dataset: 8 features, 4 classes, label = argmax(W x) ----
constexpr int features = 8, classes = 4;
struct row {
  float x[features];
  std::int32_t y;
};
static_assert(sizeof(row) == 36);
using sample = std::tuple<std::array<float, features>, std::int32_t>;

std::vector<fs::path> write_dataset(const fs::path& dir, const std::vector<int>& rows_per_file,
                                    std::uint32_t seed) {
  std::vector<fs::path> files;
  std::mt19937 g(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  float W[classes][features];
  for (auto& r : W)
    for (float& v : r) v = n(g);
  for (std::size_t f = 0; f < rows_per_file.size(); ++f) {
    std::vector<row> rows(static_cast<std::size_t>(rows_per_file[f]));
    for (row& r : rows) {
      for (float& v : r.x) v = n(g);
      float best = -1e30f;
      for (int c = 0; c < classes; ++c) {
        float s = 0;
        for (int i = 0; i < features; ++i) s += W[c][i] * r.x[i];
        if (s > best) best = s, r.y = c;
      }
    }
    char name[32];
    std::snprintf(name, sizeof name, "part-%02zu.bin", f);
    files.push_back(dir / name);
    if (ctx().rank() == 0) write_file(files.back(), rows.data(), rows.size() * sizeof(row));
  }
  ctx().world().barrier();  // the files exist before anyone opens them
  return files;
}

std::vector<std::string> strings(const std::vector<fs::path>& v) {
  return {v.begin(), v.end()};
}

auto to_sample = [](const ferry::record& r) {
  row w;
  std::memcpy(&w, r.bytes().data(), sizeof w);
  sample s;
  std::memcpy(std::get<0>(s).data(), w.x, sizeof w.x);
  std::get<1>(s) = w.y;
  return s;
};

}  // namespace

TEST_CASE("distributed_context: ranks, local ranks, devices" * doctest::timeout(30)) {
  ferry_test::watchdog wd(30s);
  auto& c = ctx();
  int n = 0, r = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  CHECK(c.world_size() == n);
  CHECK(c.rank() == r);
  CHECK(c.local_rank() >= 0);
  CHECK(c.local_rank() < c.local_size());
  CHECK(c.local_size() <= c.world_size());
  // One machine here: every rank is local, and local ranks are a permutation of ranks.
  auto& w = c.world();
  CHECK(w.all_reduce_sum(std::int64_t(c.local_size())) == std::int64_t(n) * n);
  CHECK(w.all_reduce_sum(std::int64_t(c.local_rank())) == std::int64_t(n) * (n - 1) / 2);
  CHECK(c.local_devices().empty());  // devices_per_rank = 0
  CHECK(!c.host().empty());

  // Device ownership, pure: 2 ranks x 2 devices on a 4-GPU node; a launcher that shows
  // each rank only its own devices; too few devices is a clear error.
  CHECK(ferry::pick_local_devices(1, 2, 2, 4) == std::vector<int>{2, 3});
  CHECK(ferry::pick_local_devices(3, 8, 1, 8) == std::vector<int>{3});
  CHECK(ferry::pick_local_devices(3, 4, 1, 1) == std::vector<int>{0});
  CHECK(ferry::pick_local_devices(2, 4, 1, 0).empty());
  CHECK_THROWS_AS(ferry::pick_local_devices(2, 3, 2, 4), ferry::config_error);
  CHECK_THROWS_AS(ferry::pick_local_devices(0, 1, -1, 4), ferry::config_error);

  // The launcher's local rank, the cross-check's, pure. mpiexec (MPICH's or Intel MPI's
  // hydra) inside a Slurm allocation: every rank inherits its node's proxy's SLURM_LOCALID
  // (0) and SLURM_PROCID; hydra's MPI_LOCALRANKID is the rank's own. Slurm's counts only
  // where srun started this very task. (Slurm's was read first: every local rank but 0
  // refused.)
  const char* vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "SLURM_PROCID"};
  std::vector<std::optional<std::string>> saved;
  for (const char* v : vars) saved.push_back(std::getenv(v) ? std::optional<std::string>(std::getenv(v)) : std::nullopt);
  const auto with = [&](std::vector<std::pair<const char*, const char*>> set, int world_rank) {
    for (const char* v : vars) ::unsetenv(v);
    for (auto [k, v] : set) ::setenv(k, v, 1);
    return ferry::detail::launcher_local_rank(world_rank);
  };
  CHECK(with({}, 3) == -1);
  CHECK(with({{"OMPI_COMM_WORLD_LOCAL_RANK", "2"}}, 3) == 2);
  CHECK(with({{"MPI_LOCALRANKID", "1"}, {"SLURM_LOCALID", "0"}, {"SLURM_PROCID", "0"}}, 5) == 1);  // hydra in Slurm
  CHECK(with({{"SLURM_LOCALID", "0"}, {"SLURM_PROCID", "0"}}, 5) == -1);  // another launcher in Slurm
  CHECK(with({{"SLURM_LOCALID", "1"}, {"SLURM_PROCID", "5"}}, 5) == 1);   // srun
  CHECK(with({{"OMPI_COMM_WORLD_LOCAL_RANK", "x"}}, 0) == -1);
  for (std::size_t i = 0; i < std::size(vars); ++i)
    if (saved[i]) ::setenv(vars[i], saved[i]->c_str(), 1);
    else ::unsetenv(vars[i]);
}

TEST_CASE("mpi_communicator against a naive oracle" * doctest::timeout(30)) {
  ferry_test::watchdog wd(30s);
  auto& w = ctx().world();
  const int n = w.size(), me = w.rank();
  auto data = [](int rank, std::size_t len) {
    std::mt19937 g(1234u + unsigned(rank));
    std::uniform_int_distribution<int> d(-1000, 1000);
    std::vector<float> v(len);
    for (auto& x : v) x = float(d(g)) * 0.25f;  // exact in float: sums are exact too
    return v;
  };
  for (std::size_t len : {std::size_t(0), std::size_t(1), std::size_t(7), std::size_t(100003)}) {
    CAPTURE(len);
    std::vector<float> oracle(len, 0.0f);
    for (int q = 0; q < n; ++q) {
      const auto v = data(q, len);
      for (std::size_t i = 0; i < len; ++i) oracle[i] += v[i];
    }
    auto mine = data(me, len);
    w.all_reduce_sum(mine);
    CHECK(mine == oracle);
    mine = data(me, len);
    w.all_reduce_average(mine);
    bool avg_ok = true;
    for (std::size_t i = 0; i < len; ++i)
      avg_ok = avg_ok && std::fabs(mine[i] - oracle[i] / float(n)) <= 1e-4f * (1 + std::fabs(oracle[i]));
    CHECK(avg_ok);
    for (int root = 0; root < n; ++root) {
      mine = data(me, len);
      w.broadcast(mine, root);
      CHECK(mine == data(root, len));
    }
  }
  CHECK(w.all_reduce_min(std::int64_t(10 + me)) == 10);
  CHECK(w.all_reduce_max(std::int64_t(10 + me)) == 10 + n - 1);
  CHECK(w.exclusive_scan_sum(std::int64_t(me + 1)) == std::int64_t(me) * (me + 1) / 2);
  CHECK_THROWS_AS(w.broadcast(std::span<float>(), n), ferry::config_error);
  w.barrier();
}

TEST_CASE("agree_steps: MIN for drop, MAX for pad" * doctest::timeout(30)) {
  ferry_test::watchdog wd(30s);
  auto& w = ctx().world();
  const std::int64_t local = 5 + 3 * w.rank();
  CHECK(ferry::agree_steps(w, local, ferry::step_policy::drop) == 5);
  CHECK(ferry::agree_steps(w, local, ferry::step_policy::pad) == 5 + 3 * (w.size() - 1));
  CHECK(ferry::steps_for(10, 4, ferry::step_policy::drop) == 2);
  CHECK(ferry::steps_for(10, 4, ferry::step_policy::pad) == 3);
  CHECK(ferry::steps_for(0, 4, ferry::step_policy::pad) == 0);
  CHECK_THROWS_AS(ferry::steps_for(10, 0, ferry::step_policy::pad), ferry::config_error);
  CHECK(ferry::shard_rows(10, 4, 1) == 3);
  CHECK(ferry::shard_rows(10, 4, 3) == 2);
  // Near the top of int64 (rows + batch - 1 overflowed), and a negative total.
  constexpr std::int64_t top = INT64_MAX;
  CHECK(ferry::steps_for(top, 2, ferry::step_policy::pad) == top / 2 + 1);
  CHECK(ferry::steps_for(top - 1, top, ferry::step_policy::pad) == 1);
  CHECK(ferry::steps_for(top, top, ferry::step_policy::drop) == 1);
  CHECK_THROWS_AS(ferry::shard_rows(-5, 2, 0), ferry::config_error);
  CHECK_THROWS_AS(ferry::agree_steps(w, -1, ferry::step_policy::pad), ferry::config_error);
}

TEST_CASE("W ranks train to the same weights as one process with the same global batch" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  auto& c = ctx();
  const int W = c.world_size(), me = c.rank();
  ferry::train::host_backend::set_blas_threads(1);
  const fs::path dir = shared_dir("same-weights");
  const auto files = strings(write_dataset(dir, {96, 96, 96, 96}, 7));
  const std::size_t B = 32;  // global batch: 12 steps an epoch
  const int epochs = 2;
  const ferry::train::mlp_config cfg{.layers = {features, 16, classes}, .class_weights = {}};
  const ferry::train::trainer_options opts{
      .opt = {.kind = ferry::train::optimizer_kind::sgd, .lr = 0.1f, .momentum = 0.9f},
      .seed = 11, .max_rows = int(B)};
  const ferry::fixed_length fmt{.record_bytes = sizeof(row)};

  // One process, one replica, batch B, every file.
  ferry::train::host_trainer ref(cfg, opts, 1);
  {
    auto steps = ferry::from_files(files, fmt) | ferry::map(to_sample) | ferry::batch(B) |
                 ferry::distribute(ferry::host_replicas{1});
    for (int e = 0; e < epochs; ++e, steps.rewind())
      for (auto& s : steps) ref.train_step(s);
  }

  // W processes, one replica each, batch B / W, element-level shards: step k of rank r
  // holds the global rows of step k that are == r mod W, so every step's global batch is
  // the one-process batch.
  ferry::train::mirrored_trainer<ferry::train::host_backend, ferry::mpi_communicator> t(
      cfg, {.opt = opts.opt, .seed = opts.seed, .max_rows = int(B) / W},
      ferry::one_replica_per_process(c));
  auto steps = ferry::from_files(files, fmt) | ferry::shard(W, me, ferry::by_element) |
               ferry::map(to_sample) | ferry::batch(B / W) |
               ferry::distribute(ferry::host_replicas{1});
  const std::int64_t local = ferry::steps_for(ferry::shard_rows(4 * 96, W, me), B / W,
                                              ferry::step_policy::drop);
  const std::int64_t n = ferry::agree_steps(c.world(), local, ferry::step_policy::drop);
  CHECK(n == 12);
  double first_loss = 0, last_loss = 0;
  for (int e = 0; e < epochs; ++e, steps.rewind()) {
    std::int64_t k = 0;
    for (auto& s : steps) {
      if (k == n) break;
      const auto st = t.train_step(s);
      CHECK(st.rows == doctest::Approx(double(B)));  // global figures on every rank
      CHECK(std::isfinite(st.loss));
      if (e == 0 && k == 0) first_loss = st.loss;
      last_loss = st.loss;
      ++k;
    }
    CHECK(k == n);
  }
  const auto mine = t.parameters(), theirs = ref.parameters();
  REQUIRE(mine.size() == theirs.size());
  const double d = ferry_test::max_abs_diff(mine, theirs);  // NaN if a weight is not finite
  CAPTURE(d);
  CHECK(d < 1e-4);
  CHECK(mine != ferry::train::init_params(ferry::train::mlp_layout(cfg), opts.seed));
  CHECK(last_loss < first_loss);  // it learned something
  // Every rank holds the same weights: rank 0's, bit for bit.
  auto r0 = mine;
  c.world().broadcast(r0, 0);
  CHECK(r0 == mine);
  c.world().barrier();
  if (me == 0) fs::remove_all(dir);
}

namespace {
// Files of record ids (int64, 8 bytes each), of uneven sizes; ids are global and dense.
std::vector<std::string> write_id_files(const fs::path& dir, const std::vector<int>& sizes) {
  std::vector<std::string> files;
  std::int64_t id = 0;
  for (std::size_t f = 0; f < sizes.size(); ++f) {
    std::vector<std::int64_t> ids(static_cast<std::size_t>(sizes[f]));
    for (auto& x : ids) x = id++;
    char name[32];
    std::snprintf(name, sizeof name, "ids-%02zu.bin", f);
    files.push_back((dir / name).string());
    if (ctx().rank() == 0) write_file(files.back(), ids.data(), ids.size() * 8);
  }
  ctx().world().barrier();
  return files;
}
// The same ids as TFRecord files (each record's data is one id), for row_files' index.
std::vector<std::string> write_id_tfrecords(const fs::path& dir, const std::vector<int>& sizes) {
  std::vector<std::string> files;
  std::int64_t id = 0;
  for (std::size_t f = 0; f < sizes.size(); ++f) {
    std::string bytes;
    for (int i = 0; i < sizes[f]; ++i, ++id) bytes += src_test::tfrecord_of(src_test::le(std::uint64_t(id), 8));
    char name[48];
    std::snprintf(name, sizeof name, "ids-%02zu.tfrecord", f);
    files.push_back((dir / name).string());
    if (ctx().rank() == 0) write_file(files.back(), bytes.data(), bytes.size());
  }
  ctx().world().barrier();
  return files;
}
// Rows of this rank's files (file-level shard j % W == r), from the file sizes: a
// fixed-length format knows its row count before reading a byte.
std::int64_t my_rows(const std::vector<std::string>& files, int W, int r) {
  std::int64_t rows = 0;
  for (std::size_t j = std::size_t(r); j < files.size(); j += std::size_t(W))
    rows += std::int64_t(fs::file_size(files[j]) / 8);
  return rows;
}
auto to_id = [](const ferry::record& r) {
  std::int64_t v;
  std::memcpy(&v, r.bytes().data(), 8);
  return v;
};
}  // namespace

TEST_CASE("uneven files: every record exactly once across ranks and replicas, equal steps" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  auto& c = ctx();
  auto& w = c.world();
  const int W = c.world_size(), me = c.rank();
  const fs::path dir = shared_dir("once");
  const std::vector<int> sizes{7, 13, 5, 11, 9, 3, 17, 1};  // 66 records
  const auto files = write_id_files(dir, sizes);
  const std::int64_t total = 66;
  const std::size_t R = 2, b = 4;  // 2 local replicas, per-rank batch 4
  const ferry::fixed_length fmt{.record_bytes = 8};

  for (auto policy : {ferry::step_policy::pad, ferry::step_policy::drop}) {
    const bool pad = policy == ferry::step_policy::pad;
    CAPTURE(pad);
    auto steps = ferry::from_files(files, fmt) | ferry::shard(W, me) | ferry::map(to_id) |
                 ferry::batch(b) |
                 ferry::distribute(ferry::host_replicas{R},
                                   {.remainder = pad ? ferry::remainder_policy::pad
                                                     : ferry::remainder_policy::drop});
    const std::int64_t rows_here = my_rows(files, W, me);
    const std::int64_t local = ferry::steps_for(rows_here, b, policy);
    const std::int64_t n = ferry::agree_steps(w, local, policy);
    // The naive oracle of both: this rank's batches counted one by one (pad keeps the short
    // last one, drop does not), then the largest (pad) or smallest (drop) over the ranks.
    std::int64_t oracle_local = 0;
    for (std::int64_t left = rows_here; pad ? left > 0 : left >= std::int64_t(b); left -= std::int64_t(b))
      ++oracle_local;
    CHECK(local == oracle_local);
    CHECK(n == (pad ? w.all_reduce_max(oracle_local) : w.all_reduce_min(oracle_local)));
    std::vector<std::int64_t> visits(std::size_t(total), 0);
    // What this rank's pipeline really delivered in the n agreed steps: the steps holding
    // at least one row, and the rows themselves (not padding).
    std::int64_t delivered_steps = 0, delivered_rows = 0, empty = 0, bad_ids = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      auto s = steps.next();
      std::int64_t step_rows = 0;
      if (s) {
        CHECK(s->replicas() == R);
        for (std::size_t r = 0; r < R; ++r) {
          auto ids = (*s)[r].field<0>();
          for (std::size_t k = 0; k < (*s)[r].valid(); ++k, ++step_rows)
            if (ids[k] >= 0 && ids[k] < total) ++visits[std::size_t(ids[k])];
            else ++bad_ids;
        }
      }
      if (step_rows > 0) ++delivered_steps;
      else ++empty;  // this rank ran out: an empty step (it would still join the all-reduce)
      delivered_rows += step_rows;
      w.barrier();  // stands in for the step's all-reduce: every rank must enter it
    }
    CHECK(bad_ids == 0);
    CAPTURE(rows_here);
    CAPTURE(local);
    CAPTURE(n);
    // pad: n is the largest local count, ranks with fewer steps run empty ones at the end;
    // drop: n is the smallest, every rank stops after n full steps.
    CHECK(delivered_steps == std::min(local, n));
    CHECK(empty == n - std::min(local, n));
    // The rows the policy keeps: pad every row of this rank's files, drop n full batches.
    const std::int64_t kept_here = pad ? rows_here : n * std::int64_t(b);
    CHECK(delivered_rows == kept_here);
    CHECK(w.all_reduce_sum(delivered_rows) == (pad ? total : n * std::int64_t(b) * W));
    if (pad) {
      CHECK(local <= n);
      CHECK(!steps.next());  // nothing of this rank's files left behind
    } else {
      CHECK(local >= n);
      CHECK(empty == 0);
    }
    w.all_reduce_sum(std::span<std::int64_t>(visits));
    std::int64_t seen = 0, twice = 0, never = 0;
    for (auto v : visits) {
      seen += v;
      twice += v > 1;
      never += v == 0;
    }
    CHECK(twice == 0);
    if (pad) {
      CHECK(never == 0);  // every record of the epoch, exactly once
      CHECK(seen == total);
    } else {
      CHECK(seen == n * std::int64_t(b) * W);  // full steps only, the same count everywhere
    }
  }
  w.barrier();
  if (me == 0) fs::remove_all(dir);
}

// Elastic resume: a job at W/2 ranks trains a few global steps and saves its position, a
// job at W ranks resumes there, a third at W - 1 finishes the epoch (2 -> 4 -> 3 at 4
// processes): over the epoch every element is seen exactly once, each rank's two replicas
// taking their slices of the same global batches. Over fixed-length files and over
// TFRecord files (row_files' index of record offsets: the streaming formats' global order).
TEST_CASE("global_shuffle: elastic resume at other rank counts sees every element once" * doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  auto& c = ctx();
  auto& w = c.world();
  const int W = c.world_size(), me = c.rank();
  const fs::path dir = shared_dir("elastic");
  const std::vector<int> sizes{50, 130, 77, 200, 43};  // 500 ids
  const ferry::row_files fixed(write_id_files(dir, sizes), ferry::fixed_length{.record_bytes = 8});
  const ferry::row_files tfrecords(write_id_tfrecords(dir, sizes), ferry::tfrecord{});
  const std::uint64_t n = fixed.size(), G = 24, R = 2;
  REQUIRE(tfrecords.size() == n);
  const std::uint64_t steps = n / G;
  const int ranks[] = {std::max(1, (W + 1) / 2), W, std::max(1, W - 1)};
  const std::uint64_t cut[] = {0, 5, 13, steps};
  for (int run = 0; run < 4; ++run) {
    const ferry::row_files& rows = run < 2 ? fixed : tfrecords;
    const std::uint64_t epoch = std::uint64_t(run % 2);
    CAPTURE(epoch);
    CAPTURE(run < 2);  // fixed-length files, else TFRecord
    std::vector<std::int64_t> visits(n, 0);
    for (int phase = 0; phase < 3; ++phase) {
      const int Wp = ranks[phase];
      if (me >= Wp) continue;  // this phase's job has fewer processes
      const ferry::global_position at{epoch, cut[phase], n, G};
      auto p = ferry::global_shuffle(rows, {.seed = 11, .global_batch = G, .ranks = std::uint64_t(Wp),
                                            .rank = std::uint64_t(me), .resume = at}) |
               ferry::map(to_id) | ferry::batch(G / std::uint64_t(Wp)) | ferry::distribute(ferry::host_replicas{R});
      for (std::uint64_t s = cut[phase]; s < cut[phase + 1]; ++s) {
        auto st = p.next();
        REQUIRE(st);
        for (std::size_t r = 0; r < st->replicas(); ++r)
          for (std::int64_t id : st->operator[](r).field<0>().first(st->operator[](r).valid())) visits[std::size_t(id)]++;
      }
    }
    w.all_reduce_sum(std::span<std::int64_t>(visits));
    std::int64_t once = 0, never = 0, more = 0;
    for (auto v : visits) {
      once += v == 1;
      never += v == 0;
      more += v > 1;
    }
    CHECK(more == 0);
    CHECK(once == std::int64_t(steps * G));
    CHECK(never == std::int64_t(n - steps * G));
  }
}

// cache_on_device with across_replicas over the ranks (host replicas, rows moved by MPI
// all-to-all): each later epoch's global batches are those of one process with one replica
// (the naive oracle, no exchange), every cached row is served once an epoch, the order
// changes each epoch; ranks whose epoch 0 differs all fail or all stream, with no hang.
TEST_CASE("cache_on_device across ranks: the one-process order, rows from other processes" * doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  auto& c = ctx();
  auto& w = c.world();
  const std::uint64_t W = std::uint64_t(c.world_size()), me = std::uint64_t(c.rank());
  const std::uint64_t n = 500, G = 24, steps = n / G;
  std::vector<std::int64_t> ids(n);
  for (std::uint64_t i = 0; i < n; ++i) ids[i] = std::int64_t(i);
  ferry::rank_exchange_over<ferry::mpi_communicator> ex(w);
  const auto pipeline = [&](std::uint64_t ranks, std::uint64_t rank, std::size_t R, ferry::rank_exchange* x) {
    return ferry::global_shuffle(ids, {.seed = 3, .global_batch = G, .ranks = ranks, .rank = rank}) |
           ferry::batch(G / ranks) | ferry::distribute(ferry::host_replicas{R}) |
           ferry::cache_on_device({.seed = 5, .across_replicas = true, .ranks = x});
  };
  auto p = pipeline(W, me, 2, &ex);
  auto solo = pipeline(1, 0, 1, nullptr);
  std::vector<std::int64_t> first_step(G / W);
  std::int64_t changed = 0;
  for (int epoch = 0; epoch < 4; ++epoch, p.rewind(), solo.rewind()) {
    CAPTURE(epoch);
    CHECK(p.cached() == (epoch > 0));
    std::vector<std::int64_t> visits(n, 0);
    for (std::uint64_t s = 0; s < steps; ++s) {
      auto st = p.next();
      auto so = solo.next();
      REQUIRE(st);
      REQUIRE(so);
      std::vector<std::int64_t> mine;
      for (std::size_t r = 0; r < st->replicas(); ++r)
        for (std::int64_t id : (*st)[r].field<0>().first((*st)[r].valid())) mine.push_back(id);
      const auto whole = (*so)[0].field<0>().first((*so)[0].valid());
      REQUIRE(mine.size() == G / W);
      CHECK(std::equal(mine.begin(), mine.end(), whole.begin() + std::ptrdiff_t(me * G / W)));
      for (std::int64_t id : mine) visits[std::size_t(id)]++;
      if (s == 0) {
        changed += epoch > 0 && mine != first_step;
        first_step = mine;
      }
    }
    CHECK_FALSE(p.next());
    CHECK_FALSE(solo.next());
    w.all_reduce_sum(std::span<std::int64_t>(visits));
    CHECK(std::count(visits.begin(), visits.end(), 1) == std::int64_t(steps * G));
    CHECK(std::count_if(visits.begin(), visits.end(), [](std::int64_t v) { return v > 1; }) == 0);
  }
  CHECK(changed >= 2);  // epochs 1, 2, 3 in new orders
  if (W == 1) return;
  // Other replica counts on rank 0: a config_error on every rank at the first rewind, then
  // every rank streams.
  {
    auto q = pipeline(W, me, me == 0 ? 1 : 2, &ex);
    while (q.next()) {
    }
    CHECK_THROWS_WITH_AS(q.rewind(), doctest::Contains("every rank needs the same steps, replicas and seed"), ferry::config_error);
    CHECK_FALSE(q.cached());
    std::uint64_t got = 0;
    while (q.next()) ++got;
    CHECK(got == steps);
  }
  // Another seed on rank 0: the same, naming the seeds.
  {
    auto q = ferry::global_shuffle(ids, {.seed = 3, .global_batch = G, .ranks = W, .rank = me}) | ferry::batch(G / W) |
             ferry::distribute(ferry::host_replicas{2}) |
             ferry::cache_on_device({.seed = me == 0 ? 6u : 5u, .across_replicas = true, .ranks = &ex});
    while (q.next()) {
    }
    CHECK_THROWS_WITH_AS(q.rewind(), doctest::Contains("replicas and seed"), ferry::config_error);
    CHECK_FALSE(q.cached());
  }
  // Rows of another layout on rank 0 (a wider field; fields of other sizes, the same bytes):
  // the same config_error on every rank at the first rewind, before any trade, then every
  // rank streams whole rows (no torn values) and the next rewind does not hang.
  {
    const auto run = [&]<std::size_t A, std::size_t B>(const char* said) {
      auto q = ferry::global_shuffle(ids, {.seed = 3, .global_batch = G, .ranks = W, .rank = me}) |
               ferry::map([](std::int64_t id) {
                 std::tuple<std::array<std::int64_t, A>, std::array<std::int64_t, B>> row;
                 std::get<0>(row).fill(id), std::get<1>(row).fill(id);
                 return row;
               }) |
               ferry::batch(G / W) | ferry::distribute(ferry::host_replicas{2}) |
               ferry::cache_on_device({.seed = 5, .across_replicas = true, .ranks = &ex});
      while (q.next()) {
      }
      CHECK_THROWS_WITH_AS(q.rewind(), doctest::Contains(said), ferry::config_error);
      CHECK_FALSE(q.cached());
      std::uint64_t got = 0, torn = 0;
      while (auto st = q.next()) {
        ++got;
        for (std::size_t r = 0; r < st->replicas(); ++r)
          for (std::size_t i = 0; i < (*st)[r].valid(); ++i) {
            const auto a = (*st)[r].template field<0>()[i];
            const auto b = (*st)[r].template field<1>()[i];
            torn += std::count_if(a.begin(), a.end(), [&](std::int64_t v) { return v != a[0]; });
            torn += std::count_if(b.begin(), b.end(), [&](std::int64_t v) { return v != a[0]; });
          }
      }
      CHECK(got == steps);
      CHECK(torn == 0);
      q.rewind();
      CHECK_FALSE(q.cached());
    };
    const char* wider = "every rank's rows need the same fields, each of the same bytes";
    if (me == 0) run.template operator()<2, 1>(wider);
    else run.template operator()<3, 1>(wider);
    if (me == 0) run.template operator()<2, 1>("(fields of other sizes)");
    else run.template operator()<1, 2>("(fields of other sizes)");
  }
  // Rank 0 stops epoch 0 part way: no rank serves a cache (all agree at the rewind), none hangs.
  {
    auto q = pipeline(W, me, 2, &ex);
    for (std::uint64_t s = 0; s < 3; ++s) REQUIRE(q.next());
    if (me != 0)  // the others read epoch 0 to its end: their caches are whole
      while (q.next()) {
      }
    q.rewind();
    CHECK_FALSE(q.cached());
    std::uint64_t got = 0;
    while (q.next()) ++got;
    CHECK(got == steps);
    q.rewind();
    CHECK_FALSE(q.cached());
  }
}

// The elastic-resume tests' job: `ids` in one global order, G rows a global step, at
// `ranks` processes (this one `rank`), R host replicas each, cached across replicas and
// ranks (x), resumed at `at`.
auto elastic_cache_pipeline(const std::vector<std::int64_t>& ids, std::uint64_t G, std::uint64_t ranks,
                            std::uint64_t rank, std::size_t R, ferry::rank_exchange* x,
                            std::optional<ferry::global_position> at) {
  return ferry::global_shuffle(ids, {.seed = 3, .global_batch = G, .ranks = ranks, .rank = rank}) |
         ferry::batch(G / ranks) | ferry::distribute(ferry::host_replicas{R}) |
         ferry::cache_on_device({.seed = 5, .across_replicas = true, .ranks = x, .resume = at});
}
// The elastic tests' three jobs in turn, at ranks[k] processes each (ranks [0, ranks[k])
// of the world): f(k, ranks[k], the job's rank exchange) on the ranks each job has.
template <class F>
void elastic_phases(const int (&ranks)[3], int me, F f) {
  for (int phase = 0; phase < 3; ++phase) {
    const int Wp = ranks[phase];
    MPI_Comm part = MPI_COMM_NULL;
    MPI_Comm_split(MPI_COMM_WORLD, me < Wp ? 0 : MPI_UNDEFINED, me, &part);
    if (me >= Wp) continue;
    ferry::mpi_communicator job(part);
    MPI_Comm_free(&part);
    ferry::rank_exchange_over<ferry::mpi_communicator> ex(job);
    f(phase, Wp, ex);
  }
}
// This rank's rows of p's next step, every replica's in order (REQUIREs a step).
template <class P>
std::vector<std::int64_t> next_part(P& p) {
  auto st = p.next();
  REQUIRE(st);
  std::vector<std::int64_t> mine;
  for (std::size_t r = 0; r < st->replicas(); ++r)
    for (std::int64_t id : (*st)[r].template field<0>().first((*st)[r].valid())) mine.push_back(id);
  return mine;
}

// Elastic resume of cache_on_device across ranks: a job at W/2 ranks fills its caches and
// trains epoch 1 to step 5, a job at W ranks resumes there (.resume: it reads epoch 0
// again to fill, serving none of it) to step 13, a third at W - 1 finishes the epoch (2 ->
// 4 -> 3 at 4 processes). Each part of each global batch is what one process with one
// replica serves there, and over the epoch every cached row is served exactly once.
TEST_CASE("cache_on_device across ranks: elastic resume (2 -> 4 -> 3) serves every row once" * doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  auto& c = ctx();
  auto& w = c.world();
  const int W = c.world_size(), me = c.rank();
  const std::uint64_t n = 500, G = 24, steps = n / G;
  std::vector<std::int64_t> ids(n);
  for (std::uint64_t i = 0; i < n; ++i) ids[i] = std::int64_t(i);
  const auto pipeline = [&](std::uint64_t ranks, std::uint64_t rank, std::size_t R, ferry::rank_exchange* x,
                            std::optional<ferry::global_position> at) {
    return elastic_cache_pipeline(ids, G, ranks, rank, R, x, at);
  };
  auto solo = pipeline(1, 0, 1, nullptr, std::nullopt);  // the oracle's epoch 1
  while (solo.next()) {
  }
  solo.rewind();
  std::vector<std::vector<std::int64_t>> oracle;
  while (auto st = solo.next()) {
    const auto v = (*st)[0].field<0>().first((*st)[0].valid());
    oracle.emplace_back(v.begin(), v.end());
  }
  const int ranks[] = {std::max(1, (W + 1) / 2), W, std::max(1, W - 1)};
  const std::uint64_t cut[] = {0, 5, 13, steps};
  std::vector<std::int64_t> visits(n, 0);
  elastic_phases(ranks, me, [&](int phase, int Wp, ferry::rank_exchange& ex) {
    std::optional<ferry::global_position> at;
    if (phase > 0) at = ferry::global_position{1, cut[phase], n, G};
    auto p = pipeline(std::uint64_t(Wp), std::uint64_t(me), 2, &ex, at);
    if (phase == 0) {  // a fresh job: epoch 0 fills, then epoch 1
      while (p.next()) {
      }
      p.rewind();
    }
    for (std::uint64_t s = cut[phase]; s < cut[phase + 1]; ++s) {
      const std::vector<std::int64_t> mine = next_part(p);
      const std::uint64_t part_rows = G / std::uint64_t(Wp);
      REQUIRE(mine.size() == part_rows);
      CHECK(std::equal(mine.begin(), mine.end(), oracle[s].begin() + std::ptrdiff_t(std::uint64_t(me) * part_rows)));
      for (std::int64_t id : mine) visits[std::size_t(id)]++;
    }
  });
  w.all_reduce_sum(std::span<std::int64_t>(visits));
  CHECK(std::count(visits.begin(), visits.end(), 1) == std::int64_t(steps * G));
  CHECK(std::count_if(visits.begin(), visits.end(), [](std::int64_t v) { return v > 1; }) == 0);
}

// Elastic resume of cache_on_device in epoch 0: a job at W/2 ranks serves epoch 0 to step
// 5, a job at W ranks resumes there (.resume in epoch 0, global_shuffle from epoch 0, step
// 0: the first 5 steps cached, not served) to step 13, a third at W - 1 resumes there and
// finishes epoch 0, then serves epoch 1 from its caches (2 -> 4 -> 3 at 4 processes). Each
// part of each global batch is what one process with one replica serves there, and every
// row is served exactly once an epoch.
TEST_CASE("cache_on_device across ranks: elastic resume in epoch 0 (2 -> 4 -> 3), then epoch 1 from the caches" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  auto& c = ctx();
  auto& w = c.world();
  const int W = c.world_size(), me = c.rank();
  const std::uint64_t n = 500, G = 24, steps = n / G;
  std::vector<std::int64_t> ids(n);
  for (std::uint64_t i = 0; i < n; ++i) ids[i] = std::int64_t(i);
  const auto pipeline = [&](std::uint64_t ranks, std::uint64_t rank, std::size_t R, ferry::rank_exchange* x,
                            std::optional<ferry::global_position> at) {
    return elastic_cache_pipeline(ids, G, ranks, rank, R, x, at);
  };
  auto solo = pipeline(1, 0, 1, nullptr, std::nullopt);  // the oracle's epochs 0 and 1
  std::vector<std::vector<std::vector<std::int64_t>>> oracle(2);
  for (auto& e : oracle) {
    while (auto st = solo.next()) {
      const auto v = (*st)[0].field<0>().first((*st)[0].valid());
      e.emplace_back(v.begin(), v.end());
    }
    solo.rewind();
  }
  const int ranks[] = {std::max(1, (W + 1) / 2), W, std::max(1, W - 1)};
  const std::uint64_t cut[] = {0, 5, 13, steps};
  std::vector<std::int64_t> visits(2 * n, 0);  // epoch 0's, then epoch 1's
  // This rank's part of step s of epoch e, checked against the oracle, counted.
  const auto take = [&](auto& p, std::uint64_t e, std::uint64_t s, int Wp) {
    const std::vector<std::int64_t> mine = next_part(p);
    const std::uint64_t part_rows = G / std::uint64_t(Wp);
    REQUIRE(mine.size() == part_rows);
    CHECK(std::equal(mine.begin(), mine.end(), oracle[e][s].begin() + std::ptrdiff_t(std::uint64_t(me) * part_rows)));
    for (std::int64_t id : mine) visits[e * n + std::size_t(id)]++;
  };
  elastic_phases(ranks, me, [&](int phase, int Wp, ferry::rank_exchange& ex) {
    std::optional<ferry::global_position> at;
    if (phase > 0) at = ferry::global_position{0, cut[phase], n, G};
    auto p = pipeline(std::uint64_t(Wp), std::uint64_t(me), 2, &ex, at);
    for (std::uint64_t s = cut[phase]; s < cut[phase + 1]; ++s) take(p, 0, s, Wp);
    if (phase < 2) return;
    CHECK_FALSE(p.next());  // the end of epoch 0
    p.rewind();             // every rank cached a whole epoch 0: the caches serve
    CHECK(p.cached());
    for (std::uint64_t s = 0; s < steps; ++s) take(p, 1, s, Wp);
    CHECK_FALSE(p.next());
  });
  w.all_reduce_sum(std::span<std::int64_t>(visits));
  for (std::size_t e = 0; e < 2; ++e) {
    CAPTURE(e);
    const auto b = visits.begin() + std::ptrdiff_t(e * n), end = b + std::ptrdiff_t(n);
    CHECK(std::count(b, end, 1) == std::int64_t(steps * G));
    CHECK(std::count_if(b, end, [](std::int64_t v) { return v > 1; }) == 0);
  }
}

TEST_CASE("uneven files with the trainer: pad with empty steps, no hang" * doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  auto& c = ctx();
  const int W = c.world_size(), me = c.rank();
  ferry::train::host_backend::set_blas_threads(1);
  const fs::path dir = shared_dir("uneven-train");
  // Rank 0's files are far larger than the others' (file j goes to rank j % W).
  std::vector<int> sizes;
  for (int j = 0; j < 2 * W; ++j) sizes.push_back(j % W == 0 ? 40 : 4 + j);
  const auto files = strings(write_dataset(dir, sizes, 3));
  std::int64_t total = 0, mine = 0;
  for (int j = 0; j < 2 * W; ++j) {
    total += sizes[std::size_t(j)];
    if (j % W == me) mine += sizes[std::size_t(j)];
  }
  const std::size_t b = 8;
  ferry::train::mirrored_trainer<ferry::train::host_backend, ferry::mpi_communicator> t(
      {.layers = {features, 8, classes}, .class_weights = {}}, {.opt = {.lr = 0.01f}, .seed = 5, .max_rows = int(b)},
      ferry::one_replica_per_process(c));
  auto steps = ferry::from_files(files, ferry::fixed_length{.record_bytes = sizeof(row)}) |
               ferry::shard(W, me) | ferry::map(to_sample) | ferry::batch(b) |
               ferry::distribute(ferry::host_replicas{1}, {.remainder = ferry::remainder_policy::pad});
  for (int e = 0; e < 2; ++e, steps.rewind()) {
    CAPTURE(e);
    const std::int64_t local = ferry::steps_for(mine, std::int64_t(b), ferry::step_policy::pad);
    const std::int64_t n = ferry::agree_steps(c.world(), local, ferry::step_policy::pad);
    std::int64_t oracle_local = 0;  // batches of this rank counted one by one, the short one too
    for (std::int64_t left = mine; left > 0; left -= std::int64_t(b)) ++oracle_local;
    CHECK(local == oracle_local);
    CHECK(n == c.world().all_reduce_max(oracle_local));
    const std::uint64_t trained_before = t.steps();
    double rows = 0;
    // What this rank's pipeline delivered: non-empty steps and their rows (not padding).
    std::int64_t delivered_steps = 0, delivered_rows = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      auto s = steps.next();
      if (s) {
        std::int64_t step_rows = 0;
        for (std::size_t r = 0; r < s->replicas(); ++r) step_rows += std::int64_t((*s)[r].valid());
        delivered_steps += step_rows > 0;
        delivered_rows += step_rows;
      }
      const auto st = s ? t.train_step(*s)
                        : t.train_step(std::vector<ferry::train::replica_input>(1));
      CHECK(std::isfinite(st.loss));
      rows += st.rows;  // global rows of this step, the same on every rank
    }
    CHECK(!steps.next());  // nothing left behind on this rank
    CAPTURE(mine);
    CAPTURE(local);
    CAPTURE(n);
    CHECK(local <= n);
    CHECK(delivered_steps == std::min(local, n));  // then n - local empty steps
    CHECK(delivered_rows == mine);
    CHECK(c.world().all_reduce_sum(delivered_rows) == total);  // pad keeps every row
    CHECK(rows == doctest::Approx(double(total)));
    CHECK(t.steps() - trained_before == std::uint64_t(n));  // the trainer ran every step, empty ones too
  }
  c.world().barrier();
  if (me == 0) fs::remove_all(dir);
}

TEST_CASE("lockstep: step counts no rank can know ahead (a filter), agreed step by step; no hang" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  auto& c = ctx();
  const int W = c.world_size(), me = c.rank();
  ferry::train::host_backend::set_blas_threads(1);
  const fs::path dir = shared_dir("lockstep");
  std::vector<int> sizes;
  for (int j = 0; j < 2 * W; ++j) sizes.push_back(10 + 7 * j);
  const auto files = strings(write_dataset(dir, sizes, 11));
  const std::size_t b = 4;
  ferry::train::mirrored_trainer<ferry::train::host_backend, ferry::mpi_communicator> t(
      {.layers = {features, 8, classes}, .class_weights = {}}, {.opt = {.lr = 0.01f}, .seed = 5, .max_rows = int(b)},
      ferry::one_replica_per_process(c));
  // Rank r keeps rows whose class is not r % classes, plus all of rank 0's: counts differ
  // by rank and by the data, and no rank counts them first.
  auto keep = [me](const sample& s) { return me == 0 || std::get<1>(s) != me % classes; };
  for (auto policy : {ferry::step_policy::pad, ferry::step_policy::drop}) {
    CAPTURE(static_cast<int>(policy));
    auto steps = ferry::from_files(files, ferry::fixed_length{.record_bytes = sizeof(row)}) | ferry::shard(W, me) |
                 ferry::map(to_sample) | ferry::filter(keep) | ferry::batch(b) |
                 ferry::distribute(ferry::host_replicas{1}, {.remainder = ferry::remainder_policy::partial}) |
                 ferry::lockstep(c.world(), policy);
    std::int64_t n = 0, rows = 0, empty = 0;
    for (auto& st : steps) {
      const auto s = t.train_step(st);
      CHECK(std::isfinite(s.loss));
      ++n;
      rows += std::int64_t(st[0].size());
      empty += st.global_size() == 0;
    }
    // Every rank took the same number of steps, and (pad) every kept row was trained on.
    CHECK(c.world().all_reduce_min(n) == c.world().all_reduce_max(n));
    auto mine = ferry::from_files(files, ferry::fixed_length{.record_bytes = sizeof(row)}) | ferry::shard(W, me) |
                ferry::map(to_sample) | ferry::filter(keep);
    std::int64_t kept = 0;
    for (auto& x : mine) kept += (void(x), 1);
    const std::int64_t local = (kept + std::int64_t(b) - 1) / std::int64_t(b);
    if (policy == ferry::step_policy::pad) {
      CHECK(rows == kept);
      CHECK(n == c.world().all_reduce_max(local));
      CHECK(empty == n - local);
    } else {
      CHECK(n == c.world().all_reduce_min(local));
      CHECK(empty == 0);
    }
  }
  c.world().barrier();
  if (me == 0) fs::remove_all(dir);
}

TEST_CASE("fewer files than ranks: a config_error, or element level when asked" *
          doctest::timeout(30)) {
  ferry_test::watchdog wd(30s);
  auto& c = ctx();
  auto& w = c.world();
  const int W = c.world_size(), me = c.rank();
  const fs::path dir = shared_dir("few");
  const auto files = write_id_files(dir, {23});  // one file, like Fashion-MNIST's
  const ferry::fixed_length fmt{.record_bytes = 8};
  if (W > 1) {
    try {
      auto s = ferry::from_files(files, fmt) | ferry::shard(W, me);
      FAIL("file-level shard of 1 file over " << W << " ranks did not throw");
    } catch (const ferry::config_error& e) {
      CHECK(std::string(e.what()).find("by_element") != std::string::npos);  // says what to do
    }
  }
  auto src = ferry::from_files(files, fmt) | ferry::shard(W, me, ferry::by_element) | ferry::map(to_id);
  std::vector<std::int64_t> visits(23, 0);
  std::int64_t got = 0;
  while (auto v = src.next()) {
    ++got;
    if (*v >= 0 && *v < 23) ++visits[std::size_t(*v)];
  }
  CHECK(got == ferry::shard_rows(23, W, me));
  w.all_reduce_sum(std::span<std::int64_t>(visits));
  bool once = true;
  for (auto v : visits) once = once && v == 1;
  CHECK(once);
  w.barrier();
  if (me == 0) fs::remove_all(dir);
}
