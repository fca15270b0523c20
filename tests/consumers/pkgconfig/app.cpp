// A user's program on ferry's CPU layer (ferry/ferry.hpp): a threaded pipeline whose sum
// is known, so a broken build or install shows as a wrong answer, not only as a link error.
#include <cstdio>
#include <numeric>
#include <vector>

#include "ferry/ferry.hpp"

int main() {
  std::vector<int> v(1000);
  std::iota(v.begin(), v.end(), 0);
  auto p = ferry::from_range(v) | ferry::shuffle(64, 7) |
           ferry::map([](int x) { return 2 * x; }, {.workers = 2}) | ferry::batch(100) | ferry::prefetch(2);
  long sum = 0;
  std::size_t n = 0, batches = 0;
  for (auto& b : p) {
    for (int x : b.field()) sum += x;
    n += b.size();
    ++batches;
  }
  const bool ok = sum == 999000 && n == 1000 && batches == 10;
  std::printf("%s: %zu elements in %zu batches, sum %ld\n", ok ? "ok" : "WRONG", n, batches, sum);
  return ok ? 0 : 1;
}
