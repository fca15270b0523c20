// Host-replica overhead of distribute(): the same batches consumed by a plain loop
// (slicing by hand) and through distribute(host_replicas{R}), in the same run.
// Prints ns per step for both, the overhead per step and the ratio.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/distribute.hpp"

namespace {
using clk = std::chrono::steady_clock;

template <class F>
double best_ns_per_step(int reps, std::size_t steps, F&& run) {
  double best = 1e300;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = clk::now();
    run();
    const double ns = std::chrono::duration<double, std::nano>(clk::now() - t0).count() / double(steps);
    if (ns < best) best = ns;
  }
  return best;
}
}  // namespace

int main() {
  std::printf("# distribute(host_replicas) overhead per step vs a plain loop over the same batches\n");
  std::printf("%8s %8s %8s %14s %14s %14s %8s %8s\n", "global", "replicas", "steps", "plain_ns/step",
              "ferry_ns/step", "overhead_ns", "ratio", "#wrong");
  int wrong = 0;  // cases whose sums differ: the run fails
  for (std::size_t G : {64u, 1024u}) {
    for (std::size_t R : {1u, 4u, 8u}) {
      std::vector<float> data(G * 512);
      for (std::size_t i = 0; i < data.size(); ++i) data[i] = float(i % 1000);
      const std::size_t steps = data.size() / G, per = G / R;
      volatile double sink = 0;
      double plain_sum = 0, ferry_sum = 0;
      const double plain = best_ns_per_step(7, steps, [&] {
        auto p = ferry::from_range(data) | ferry::batch(G);
        double s = 0;
        for (auto& b : p) {
          auto f = b.field<0>();
          for (std::size_t r = 0; r < R; ++r) s += f[r * per] + f[r * per + per - 1];
        }
        plain_sum = s;
        sink = s;
      });
      const double ferry_ns = best_ns_per_step(7, steps, [&] {
        auto p = ferry::from_range(data) | ferry::batch(G) | ferry::distribute(ferry::host_replicas{R});
        double s = 0;
        for (auto& st : p)
          for (std::size_t r = 0; r < R; ++r) {
            auto f = st[r].field<0>();
            s += f[0] + f[per - 1];
          }
        ferry_sum = s;
        sink = s;
      });
      (void)sink;
      std::printf("%8zu %8zu %8zu %14.1f %14.1f %14.1f %8.3f %8d\n", G, R, steps, plain, ferry_ns,
                  ferry_ns - plain, ferry_ns / plain, plain_sum == ferry_sum ? 0 : 1);
      wrong += plain_sum == ferry_sum ? 0 : 1;
    }
  }
  if (wrong) std::printf("FAIL: %d cases read other values through distribute than the plain loop\n", wrong);
  return wrong ? 1 : 0;
}
