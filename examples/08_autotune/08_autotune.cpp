// 08_autotune: let map choose its worker count (tf.data's AUTOTUNE).
//
//   ./08_autotune [epochs=3]
//
// The decode here waits 200 us per element, as a read from remote storage would, so more
// threads help even on a machine with few cores. With workers = ferry::autotune, map
// starts 8 threads (max_workers), lets one work, and adds one while the consumer waits
// and the extra worker pays; the count it learns is kept for the next epoch. Prints, per
// epoch, the time, the workers chosen and whether the checksum is right:
//   epoch 0: 0.81 s, 6 workers, checksum ok
//   epoch 1: 0.38 s, 8 workers, checksum ok
// (the first epoch pays the climb from one worker. On the 2-core development machine an
// epoch takes 2.8 s with workers = 1 and 0.37 s with workers = 8.) Exits 1 if a checksum
// is wrong.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "ferry/ferry.hpp"
#include "ferry/stats.hpp"

namespace {
std::uint64_t fetch_and_decode(std::uint64_t x) {
  std::this_thread::sleep_for(std::chrono::microseconds(200));  // waiting on storage
  return x * 0x9e3779b97f4a7c15ull;
}
}  // namespace

int main(int argc, char** argv) {
  const int epochs = argc > 1 ? std::atoi(argv[1]) : 3;
  const std::uint64_t n = 10000;
  std::uint64_t expect = 0;
  for (std::uint64_t i = 0; i < n; ++i) expect += i * 0x9e3779b97f4a7c15ull;

  auto p = ferry::from_generator(n, [](std::uint64_t i) { return i; }) |
           ferry::map(fetch_and_decode, {.workers = ferry::autotune, .max_workers = 8}) | ferry::batch(100);
  int bad = 0;
  for (int e = 0; e < epochs; ++e) {
    const auto t0 = std::chrono::steady_clock::now();
    std::uint64_t sum = 0;
    for (auto& b : p)
      for (auto v : b.field()) sum += v;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::size_t workers = 0;
    for (const auto& st : ferry::report(p).stages)
      if (st.kind == "map") workers = st.threads;
    std::printf("epoch %d: %.2f s, %zu workers, checksum %s\n", e, s, workers, sum == expect ? "ok" : "WRONG");
    bad += sum != expect;
    p.rewind();  // the next epoch; the map keeps the count it learned
  }
  return bad ? 1 : 0;
}
