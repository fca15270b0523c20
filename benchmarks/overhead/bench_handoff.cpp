// bench_handoff: what handing elements from a thread to the consumer costs, element by
// element, on ferry's two machines for it: map's ordered ring (map(fn, {.workers = 2}):
// workers publish runs into their slots, no lock per element) against the producer engine
// (map(fn) | prefetch(1024): detail/producer.hpp, one element per lock). The figure is
// why map keeps its ring instead of running on the engine (issue "one shape for every
// stage"; docs/architecture.md). A plain loop over the same data is the baseline.
//
// Output: a table, a JSON line, and last `engine_over_ring: <engine ns / ring ns>`.
// Usage: bench_handoff [elements (default 262144)] [repetitions (default 5)]
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <vector>

#include "common/timing.hpp"
#include "ferry/ferry.hpp"

namespace {
volatile std::uint64_t sink;
}  // namespace

int main(int argc, char** argv) {
  const std::size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : (std::size_t(1) << 18);
  const int reps = argc > 2 ? std::atoi(argv[2]) : 5;
  std::vector<std::uint32_t> data(n);
  for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<std::uint32_t>(i * 2654435761u);
  const std::span<const std::uint32_t> in(data);
  auto fn = [](std::uint32_t x) { return x + 1; };

  std::uint64_t ref = 0, s_ring = 0, s_engine = 0;
  const double loop_s = bench::median_seconds(reps, [&] {
    std::uint64_t s = 0;
    for (std::uint32_t x : in) s += fn(x);
    ref = s;
  });
  const double ring_s = bench::median_seconds(reps, [&] {
    auto p = ferry::from_range(in) | ferry::map(fn, {.workers = 2});
    std::uint64_t s = 0;
    while (auto x = p.next()) s += *x;
    s_ring = s;
  });
  const double engine_s = bench::median_seconds(reps, [&] {
    auto p = ferry::from_range(in) | ferry::map(fn) | ferry::prefetch(1024);
    std::uint64_t s = 0;
    while (auto x = p.next()) s += *x;
    s_engine = s;
  });
  sink = s_ring + s_engine;
  if (s_ring != ref || s_engine != ref) {
    std::fprintf(stderr, "bench_handoff: a threaded pipeline changed the data\n");
    return 1;
  }
  const double loop_ns = loop_s * 1e9 / double(n), ring_ns = ring_s * 1e9 / double(n),
               engine_ns = engine_s * 1e9 / double(n);
  std::printf("%-48s %10s %10s\n", "case (element by element)", "elements", "ns/elem");
  std::printf("%-48s %10zu %10.3f\n", "plain loop (+1)", n, loop_ns);
  std::printf("%-48s %10zu %10.3f\n", "map(+1, 2 workers): the ordered ring", n, ring_ns);
  std::printf("%-48s %10zu %10.3f\n", "map(+1) | prefetch(1024): the producer engine", n, engine_ns);
  std::printf("{\"bench\":\"handoff\",\"elements\":%zu,\"loop_ns_per_elem\":%.4f,\"ring_ns_per_elem\":%.4f,"
              "\"engine_ns_per_elem\":%.4f}\n",
              n, loop_ns, ring_ns, engine_ns);
  std::printf("engine_over_ring: %.2f\n", engine_ns / ring_ns);
}
