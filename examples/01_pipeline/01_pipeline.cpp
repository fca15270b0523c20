// Example 01: a lazy pipeline over in-memory data, consumed batch by batch.
//
// One idea: stages compose with `|`, nothing runs until the first element is pulled, and a
// batch of a struct is one contiguous array, ready to copy to a device.
#include <cstdio>
#include <vector>

#include "ferry/ferry.hpp"

struct sample {
  float x[4];
  int label;
};

int main() {
  std::vector<int> ids(1000);
  for (int i = 0; i < 1000; ++i) ids[i] = i;

  auto pipeline = ferry::from_range(ids)                       // any random-access range
                  | ferry::shuffle(256, /*seed=*/42)           // new order every epoch
                  | ferry::map([](int i) {                     // runs on 2 worker threads,
                      sample s{{i * 0.1f, i * 0.2f, i * 0.3f, i * 0.4f}, i % 10};
                      return s;                                // results stay in order
                    }, {.workers = 2})
                  | ferry::batch(100, {.drop_remainder = true})
                  | ferry::prefetch(2);                        // batches built on a thread

  int step = 0;
  for (auto& b : pipeline) {
    std::span<const sample> s = b.field();  // 100 samples, one contiguous buffer
    int sum = 0;
    for (const sample& e : s) sum += e.label;
    std::printf("batch %d: %zu samples, label sum %d\n", step++, b.size(), sum);
  }
}
