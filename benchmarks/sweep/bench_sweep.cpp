// bench_sweep: items/s of from_range | map(work, {.workers = w}) | batch(b) across worker
// counts and batch sizes, beside a hand-written loop doing the same work in the same run:
// w std::threads over static contiguous slices, each writing groups of b results into a
// reused buffer that the consumer checksums. The work per element is a fixed number of
// integer mixing rounds (a stand-in for decoding), so the figures show what ferry's
// scheduling costs per element and per batch, not memory bandwidth.
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

// The baseline: w threads, thread t handles slice t, in groups of b into its own buffer.
std::uint64_t hand_loop(std::span<const std::uint64_t> data, std::size_t w, std::size_t b, unsigned rounds) {
  std::vector<std::uint64_t> sums(w, 0);
  auto body = [&](std::size_t t) {
    const std::size_t lo = data.size() * t / w, hi = data.size() * (t + 1) / w;
    std::vector<std::uint32_t> buf(b);
    std::uint64_t s = 0;
    for (std::size_t i = lo; i < hi; i += b) {
      const std::size_t m = std::min(b, hi - i);
      for (std::size_t j = 0; j < m; ++j) buf[j] = work(data[i + j], rounds);
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
  std::printf("%-8s %8s %8s %9s %14s %14s %8s %7s\n", "sweep", "workers", "batch", "elements", "loop items/s",
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
    std::printf("%-8s %8zu %8zu %9zu %14.0f %14.0f %8.3f %7d\n", c.sweep, c.workers, c.batch, m, loop_ips, ferry_ips,
                ratio, wrong);
    std::printf("{\"bench\":\"sweep\",\"sweep\":\"%s\",\"workers\":%zu,\"batch\":%zu,\"elements\":%zu,"
                "\"rounds\":%u,\"hardware_threads\":%u,\"loop_items_per_s\":%.0f,\"ferry_items_per_s\":%.0f,"
                "\"ratio\":%.4f,\"wrong\":%d}\n",
                c.sweep, c.workers, c.batch, m, rounds, cores, loop_ips, ferry_ips, ratio, wrong);
    std::fflush(stdout);
  }
  std::printf("sweep_min_ratio: %.3f\n", min_ratio);
  return wrong_total == 0 ? 0 : 1;
}
