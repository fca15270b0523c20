// bench_observe: what ferry's stats and tracing cost, beside a hand-written loop doing
// the same work, all in the same run (variants interleaved, best of `reps`).
//
//   bulk         from_range | map(+1) | batch(256): batch fills its buffer with one
//                next_bulk call per batch, so hooks run per batch
//   per-element  from_range | filter(true) | map(+1) | batch(256): filter breaks the bulk
//                path, so each element goes through three next() calls (hooks per element)
//
// Variants: stats off (the default), stats on, tracing on (a session whose buffer holds
// 1 Mi events; the rest are counted as dropped, which is part of the cost). Built with
// -DFERRY_NO_STATS (bench_observe_uninstrumented) only the "off" rows exist and every hook
// is compiled out: compare its off_ratio with this binary's.
//
// Output: a table, a JSON line, and `off_ratio_bulk` / `off_ratio_elem` (ferry ns/elem
// with stats off / loop ns/elem), then the on and trace ratios.
// Usage: bench_observe [elements (default 4194304)] [repetitions (default 9)]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "common/plus_one.hpp"
#include "ferry/ferry.hpp"
#include "ferry/stats.hpp"
#include "ferry/trace.hpp"

namespace {

using clk = std::chrono::steady_clock;

using bench::consume;
volatile std::uint64_t sink;

// The best of the repetitions: on a shared machine the minimum is the figure least
// disturbed by other work (all variants are interleaved, so all get the same chances).
double best(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

#if defined(FERRY_NO_STATS)
constexpr bool instrumented = false;
#else
constexpr bool instrumented = true;
#endif

enum class mode { off, on, trace };
const char* mode_name(mode m) { return m == mode::off ? "off" : m == mode::on ? "stats on" : "tracing on"; }

}  // namespace

int main(int argc, char** argv) {
  const std::size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : (std::size_t(1) << 22);
  const int reps = argc > 2 ? std::atoi(argv[2]) : 9;
  constexpr std::size_t bs = 256;
  std::vector<std::uint32_t> data(n);
  for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<std::uint32_t>(i * 2654435761u);
  const std::string trace_path =
      (std::filesystem::temp_directory_path() / ("bench_observe_" + std::to_string(::getpid()) + ".json")).string();

  std::uint64_t ref = 0;
  auto loop = [&] { ref = bench::plus_one_loop(data, bs); };
  auto bulk = [&] {
    auto p = ferry::from_range(std::span<const std::uint32_t>(data)) |
             ferry::map([](std::uint32_t x) { return x + 1; }) | ferry::batch(bs);
    std::uint64_t s = 0;
    for (auto& b : p) s += consume(b.field().data(), b.size());
    return s;
  };
  auto elem = [&] {
    auto p = ferry::from_range(std::span<const std::uint32_t>(data)) |
             ferry::filter([](std::uint32_t x) { return x != 0xffffffffu || true; }) |
             ferry::map([](std::uint32_t x) { return x + 1; }) | ferry::batch(bs);
    std::uint64_t s = 0;
    for (auto& b : p) s += consume(b.field().data(), b.size());
    return s;
  };

  std::vector<mode> modes{mode::off};
  if (instrumented) modes = {mode::off, mode::on, mode::trace};
  std::vector<double> t_loop;
  std::vector<std::vector<double>> t_bulk(modes.size()), t_elem(modes.size());
  bool wrong = false;
  auto timed = [&](auto&& f, mode m) {
    ferry::enable_stats(m == mode::on);
    std::unique_ptr<ferry::tracing> session;
    if (m == mode::trace) session = ferry::trace_to(trace_path);
    const auto a = clk::now();
    const std::uint64_t s = f();
    const double t = std::chrono::duration<double>(clk::now() - a).count();
    session.reset();  // writes the file: not timed
    ferry::enable_stats(false);
    if (s != ref) wrong = true;
    return t;
  };
  for (int r = 0; r < reps; ++r) {
    const auto a = clk::now();
    loop();
    t_loop.push_back(std::chrono::duration<double>(clk::now() - a).count());
    for (std::size_t k = 0; k < modes.size(); ++k) {
      t_bulk[k].push_back(timed(bulk, modes[k]));
      t_elem[k].push_back(timed(elem, modes[k]));
    }
  }
  std::filesystem::remove(trace_path);
  if (wrong) {
    std::fprintf(stderr, "bench_observe: a pipeline's checksum differs from the loop's\n");
    return 1;
  }

  const double loop_ns = best(t_loop) * 1e9 / n;
  std::printf("%s build\n", instrumented ? "instrumented" : "uninstrumented (-DFERRY_NO_STATS)");
  std::printf("%-46s %12s %10s %8s\n", "case", "elements", "ns/elem", "ratio");
  std::printf("%-46s %12zu %10.3f %8.3f\n", "hand-written loop (+1, groups of 256)", n, loop_ns, 1.0);
  std::string json = "{\"bench\":\"observe\",\"instrumented\":" + std::string(instrumented ? "true" : "false") +
                     ",\"elements\":" + std::to_string(n) + ",\"loop_ns_per_elem\":" + std::to_string(loop_ns);
  std::vector<std::string> ratios;
  for (std::size_t k = 0; k < modes.size(); ++k) {
    const double b = best(t_bulk[k]) * 1e9 / n, e = best(t_elem[k]) * 1e9 / n;
    std::printf("%-46s %12zu %10.3f %8.3f\n", (std::string("bulk: map|batch, ") + mode_name(modes[k])).c_str(), n, b,
                b / loop_ns);
    std::printf("%-46s %12zu %10.3f %8.3f\n",
                (std::string("per-element: filter|map|batch, ") + mode_name(modes[k])).c_str(), n, e, e / loop_ns);
    const std::string tag = modes[k] == mode::off ? "off" : modes[k] == mode::on ? "on" : "trace";
    json += ",\"bulk_" + tag + "_ns_per_elem\":" + std::to_string(b) + ",\"elem_" + tag +
            "_ns_per_elem\":" + std::to_string(e);
    char line[160];
    std::snprintf(line, sizeof line, "%s_ratio_bulk: %.3f\n%s_ratio_elem: %.3f\n", tag.c_str(), b / loop_ns,
                  tag.c_str(), e / loop_ns);
    ratios.push_back(line);
  }
  std::printf("%s}\n", json.c_str());
  for (const auto& r : ratios) std::printf("%s", r.c_str());
}
