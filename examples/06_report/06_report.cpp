// 06_report: which stage limits throughput? A pipeline with a deliberately slow map,
// its per-stage report, and a Chrome trace to open in Perfetto (ui.perfetto.dev).
//
//   ./06_report [trace.json]
//
// Prints a table like
//   #   stage            threads     elements         MB       elem/s   busy  wait_up wait_down
//   0   source                 1         2000       0.02       ...       0.1%    0.0%     0.0%
//   1   map                    1         2000       0.02       ...      99.7%    0.0%     0.0%
//   ...
// and "map is the bottleneck: 100% busy; prefetch waited 100% of the time on upstream"
// (figures from a run on the 2-core development machine: docs/observe.md).
// Then the same with the map given 2 workers.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <string>

#include "ferry/ferry.hpp"
#include "ferry/stats.hpp"
#include "ferry/trace.hpp"

namespace {
// Stands in for an expensive decode: 200 µs of CPU per element.
std::uint64_t slow_decode(std::uint64_t x) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
  std::uint64_t h = x;
  while (std::chrono::steady_clock::now() < end) h = h * 6364136223846793005ull + 1;
  return h;
}

template <class P>
std::uint64_t consume(P& p) {
  std::uint64_t sum = 0;
  for (auto& b : p)
    for (std::uint64_t v : b.field()) sum += v;
  return sum;
}
}  // namespace

int main(int argc, char** argv) {
  const std::string trace_path = argc > 1 ? argv[1] : "06_report.trace.json";
  ferry::enable_stats();

  std::uint64_t sum = 0;
  {
    ferry::tracing trace(trace_path);  // written when this scope ends
    auto p = ferry::from_generator(2000, [](std::uint64_t i) { return i; }) | ferry::map(slow_decode) |
             ferry::batch(50) | ferry::prefetch(2);
    sum += consume(p);
    std::cout << "== one map thread ==\n" << ferry::report(p) << '\n';
  }
  std::cout << "trace written to " << trace_path << " (open it in ui.perfetto.dev)\n\n";

  auto p = ferry::from_generator(2000, [](std::uint64_t i) { return i; }) |
           ferry::map(slow_decode, {.workers = 2}) | ferry::batch(50) | ferry::prefetch(2);
  sum += consume(p);
  std::cout << "== two map threads ==\n" << ferry::report(p);
  std::printf("(checksum %llu)\n", static_cast<unsigned long long>(sum));
}
