// benchmarks/common/timing.hpp: the host timers and the median the benchmarks share.
#pragma once

#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

namespace bench {

// Seconds on the steady clock (differences only).
inline double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The median of v (the upper one of an even count); v must not be empty.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The median of `reps` timed calls of f, in seconds.
template <class F>
double median_seconds(int reps, F&& f) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const double a = now();
    f();
    t.push_back(now() - a);
  }
  return median(std::move(t));
}

}  // namespace bench
