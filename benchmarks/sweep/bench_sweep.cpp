// bench_sweep: items/s of from_range | map(work, {.workers = w}) | batch(b) across worker
// counts and batch sizes, beside a hand-written loop doing the same work in the same run:
// w std::threads over static contiguous slices, each writing groups of b results into a
// reused buffer that the consumer checksums. The work per element is a fixed number of
// integer mixing rounds (a stand-in for decoding), so the figures show what ferry's
// scheduling costs per element and per batch, not memory bandwidth.
//
// Autotune rows (map workers = ferry::autotune, batch 256): against the hand loop with one
// thread per hardware thread, once with a new pipeline per run ("autotune-new": the ramp
// from one worker is paid) and once for later epochs of one pipeline ("autotune", after a
// second of epochs to learn; the count learned is kept); and, where fn blocks (it sleeps 100 us, as a read from remote storage
// would), for later epochs with a ceiling of 8 against a hand loop of 8 threads
// ("autotune-io"). The workers column shows the count autotune had chosen at the end.
//
// Each case runs on all the elements, or on fewer (the same number on both sides) where
// one ferry run would take over a quarter of a second; the table says how many.
// Output: a table, one JSON line per case ({"bench":"sweep", ...}), and last
//   sweep_min_ratio: <lowest ferry items/s / loop items/s over all cases>
// Usage: bench_sweep [elements (default 1048576)] [rounds per element (default 32)]
//                    [repetitions (default 5)]
// Exits 1 when a checksum differs (#wrong column).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <thread>
#include <vector>

#include "common/timing.hpp"
#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/map.hpp"
#include "ferry/stats.hpp"

namespace {


// splitmix64 rounds: cheap, branch-free, and the compiler cannot fold them away.
inline std::uint32_t work(std::uint64_t x, unsigned rounds) {
  for (unsigned i = 0; i < rounds; ++i) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    x ^= x >> 31;
  }
  return static_cast<std::uint32_t>(x);
}

inline std::uint64_t checksum(const std::uint32_t* p, std::size_t n) {
  std::uint64_t s = 0;
  for (std::size_t i = 0; i < n; ++i) s += p[i];
  return s;
}

// Blocking work: the mixing rounds plus a sleep (the stand-in for waiting on storage).
inline std::uint32_t io_work(std::uint64_t x, unsigned rounds) {
  std::this_thread::sleep_for(std::chrono::microseconds(100));
  return work(x, rounds);
}

// The baseline: w threads, thread t handles slice t, in groups of b into its own buffer.
template <class Fn>
std::uint64_t hand_loop_fn(std::span<const std::uint64_t> data, std::size_t w, std::size_t b, Fn fn) {
  std::vector<std::uint64_t> sums(w, 0);
  auto body = [&](std::size_t t) {
    const std::size_t lo = data.size() * t / w, hi = data.size() * (t + 1) / w;
    std::vector<std::uint32_t> buf(b);
    std::uint64_t s = 0;
    for (std::size_t i = lo; i < hi; i += b) {
      const std::size_t m = std::min(b, hi - i);
      for (std::size_t j = 0; j < m; ++j) buf[j] = fn(data[i + j]);
      s += checksum(buf.data(), m);
    }
    sums[t] = s;
  };
  std::vector<std::thread> threads;
  for (std::size_t t = 1; t < w; ++t) threads.emplace_back(body, t);
  body(0);
  for (auto& t : threads) t.join();
  std::uint64_t s = 0;
  for (auto v : sums) s += v;
  return s;
}

std::uint64_t hand_loop(std::span<const std::uint64_t> data, std::size_t w, std::size_t b, unsigned rounds) {
  return hand_loop_fn(data, w, b, [rounds](std::uint64_t x) { return work(x, rounds); });
}

template <class Fn>
auto tuned_pipeline(std::span<const std::uint64_t> data, std::size_t max_workers, Fn fn) {
  return ferry::from_range(data) | ferry::map(fn, {.workers = ferry::autotune, .max_workers = max_workers}) |
         ferry::batch(256);
}

template <class P>
std::uint64_t drain_sum(P& p) {
  std::uint64_t s = 0;
  while (auto batch = p.next()) s += checksum(batch->field().data(), batch->size());
  return s;
}

template <class P>
std::size_t chosen_workers(const P& p) {
  for (const auto& st : ferry::report(p).stages)
    if (st.kind == "map") return st.threads;
  return 0;
}

std::uint64_t ferry_pipeline(std::span<const std::uint64_t> data, std::size_t w, std::size_t b, unsigned rounds) {
  auto p = ferry::from_range(data) |
           ferry::map([rounds](std::uint64_t x) { return work(x, rounds); }, {.workers = w}) | ferry::batch(b);
  std::uint64_t s = 0;
  for (auto& batch : p) s += checksum(batch.field().data(), batch.size());
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : (std::size_t(1) << 20);
  const unsigned rounds = argc > 2 ? static_cast<unsigned>(std::strtoul(argv[2], nullptr, 10)) : 32;
  const int reps = argc > 3 ? std::max(1, std::atoi(argv[3])) : 5;
  const double budget_s = 0.25;  // longest one ferry run may take; larger cases use fewer elements
  std::vector<std::uint64_t> data(n);
  for (std::size_t i = 0; i < n; ++i) data[i] = i * 0x2545f4914f6cdd1dull;
  const std::span<const std::uint64_t> d(data);
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());

  struct point {
    const char* sweep;
    std::size_t workers, batch;
  };
  std::vector<point> cases;
  for (std::size_t w : {1, 2, 4, 8}) cases.push_back({"workers", w, 256});
  for (std::size_t b : {1, 4, 16, 64, 256, 1024, 4096}) cases.push_back({"batch", 1, b});
  if (cores > 1)
    for (std::size_t b : {1, 16, 256, 4096}) cases.push_back({"batch", 2, b});

  std::printf("# sweep: %zu elements, %u mixing rounds each, median of %d, %u hardware threads\n", n, rounds, reps,
              cores);
  std::printf("%-12s %8s %8s %9s %14s %14s %8s %7s\n", "sweep", "workers", "batch", "elements", "loop items/s",
              "ferry items/s", "ratio", "#wrong");
  double min_ratio = 1e300;
  int wrong_total = 0;
  for (const auto& c : cases) {
    // Both sides run on the same m elements: all of them, or fewer where one ferry run
    // would take over `budget_s` (a probe on n/64 elements tells), so a slow case cannot
    // make the sweep take minutes.
    const auto probe = d.first(std::max<std::size_t>(1, n / 64));
    const double t0 = bench::now();
    ferry_pipeline(probe, c.workers, c.batch, rounds);
    const double probe_s = bench::now() - t0;
    const double per_elem = probe_s / double(probe.size());
    const std::size_t m = std::clamp<std::size_t>(static_cast<std::size_t>(budget_s / std::max(per_elem, 1e-12)),
                                                   std::min<std::size_t>(n, 4096), n);
    const auto dm = d.first(m);
    std::uint64_t ref = 0, got = 0;
    const double loop_s = bench::median_seconds(reps, [&] { ref = hand_loop(dm, c.workers, c.batch, rounds); });
    const double ferry_s = bench::median_seconds(reps, [&] { got = ferry_pipeline(dm, c.workers, c.batch, rounds); });
    const int wrong = got == ref ? 0 : 1;
    wrong_total += wrong;
    const double loop_ips = double(m) / loop_s, ferry_ips = double(m) / ferry_s, ratio = ferry_ips / loop_ips;
    min_ratio = std::min(min_ratio, ratio);
    std::printf("%-12s %8zu %8zu %9zu %14.0f %14.0f %8.3f %7d\n", c.sweep, c.workers, c.batch, m, loop_ips, ferry_ips,
                ratio, wrong);
    std::printf("{\"bench\":\"sweep\",\"sweep\":\"%s\",\"workers\":%zu,\"batch\":%zu,\"elements\":%zu,"
                "\"rounds\":%u,\"hardware_threads\":%u,\"loop_items_per_s\":%.0f,\"ferry_items_per_s\":%.0f,"
                "\"ratio\":%.4f,\"wrong\":%d}\n",
                c.sweep, c.workers, c.batch, m, rounds, cores, loop_ips, ferry_ips, ratio, wrong);
    std::fflush(stdout);
  }

  // Autotune rows: see the top of the file.
  auto row = [&](const char* sweep, std::size_t chosen, std::size_t m, double loop_s, double ferry_s, bool wrong) {
    const double loop_ips = double(m) / loop_s, ferry_ips = double(m) / ferry_s, ratio = ferry_ips / loop_ips;
    wrong_total += wrong ? 1 : 0;
    min_ratio = std::min(min_ratio, ratio);
    std::printf("%-12s %8zu %8d %9zu %14.0f %14.0f %8.3f %7d\n", sweep, chosen, 256, m, loop_ips, ferry_ips, ratio,
                wrong ? 1 : 0);
    std::printf("{\"bench\":\"sweep\",\"sweep\":\"%s\",\"workers\":%zu,\"batch\":256,\"elements\":%zu,"
                "\"rounds\":%u,\"hardware_threads\":%u,\"loop_items_per_s\":%.0f,\"ferry_items_per_s\":%.0f,"
                "\"ratio\":%.4f,\"wrong\":%d}\n",
                sweep, chosen, m, rounds, cores, loop_ips, ferry_ips, ratio, wrong ? 1 : 0);
    std::fflush(stdout);
  };
  auto cpu_fn = [rounds](std::uint64_t x) { return work(x, rounds); };
  {  // CPU-bound: a new pipeline per run, then later epochs of one pipeline
    std::uint64_t ref = 0, got = 0;
    const double loop_s = bench::median_seconds(reps, [&] { ref = hand_loop(d, cores, 256, rounds); });
    std::size_t chosen = 0;
    const double new_s = bench::median_seconds(reps, [&] {
      auto p = tuned_pipeline(d, cores, cpu_fn);
      got = drain_sum(p);
      chosen = chosen_workers(p);
    });
    row("autotune-new", chosen, n, loop_s, new_s, got != ref);
    auto p = tuned_pipeline(d, cores, cpu_fn);
    for (const double w0 = bench::now(); bench::now() - w0 < 1.0; p.rewind()) drain_sum(p);  // it learns
    const double later_s = bench::median_seconds(reps, [&] {
      p.rewind();
      got = drain_sum(p);
    });
    row("autotune", chosen_workers(p), n, loop_s, later_s, got != ref);
  }
  {  // blocking fn: 8 hand threads against autotune with a ceiling of 8
    const auto dm = d.first(std::min<std::size_t>(n, 8192));
    auto io_fn = [rounds](std::uint64_t x) { return io_work(x, rounds); };
    std::uint64_t ref = 0, got = 0;
    const double loop_s = bench::median_seconds(reps, [&] { ref = hand_loop_fn(dm, 8, 256, io_fn); });
    auto p = tuned_pipeline(dm, 8, io_fn);
    for (const double w0 = bench::now(); bench::now() - w0 < 2.0; p.rewind()) drain_sum(p);  // it learns
    const double later_s = bench::median_seconds(reps, [&] {
      p.rewind();
      got = drain_sum(p);
    });
    row("autotune-io", chosen_workers(p), dm.size(), loop_s, later_s, got != ref);
  }
  std::printf("sweep_min_ratio: %.3f\n", min_ratio);
  return wrong_total == 0 ? 0 : 1;
}
