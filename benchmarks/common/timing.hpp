// benchmarks/common/timing.hpp: the host timers the CPU benchmarks share.
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace bench {

// Seconds on the steady clock (differences only).
inline double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
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
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace bench
