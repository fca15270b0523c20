// 07_cache: decode once. The first epoch runs the expensive decode and streams what it
// made to a cache file; later epochs, and later runs of the program, read the file back
// and never decode again.
//
//   ./07_cache [cache file, default 07_cache.ferrycache]
//
// Run it twice: the second run finds the file and decodes nothing. Prints, per epoch, the
// time and how many elements were decoded; exits 1 if an epoch saw the wrong elements or
// decoded when it should not have. Remove the file (or change cache_options::key) when the
// decode changes: the file is not tied to it.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "ferry/ferry.hpp"
#include "ferry/stages/cache.hpp"

namespace {
std::atomic<std::uint64_t> decoded{0};

// Stands in for an expensive decode: 20 µs of CPU for 64 floats.
std::vector<float> decode(std::uint64_t i) {
  ++decoded;
  const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(20);
  std::uint64_t h = i + 1;
  while (std::chrono::steady_clock::now() < end) h = h * 6364136223846793005ull + 1442695040888963407ull;
  std::vector<float> v(64);
  for (std::size_t k = 0; k < v.size(); ++k) v[k] = static_cast<float>(i) + 0.5f * static_cast<float>(k);
  return v;
}
}  // namespace

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : "07_cache.ferrycache";
  const std::uint64_t n = 20000;
  auto p = ferry::from_generator(n, decode) | ferry::cache(path, {.key = "decode v1"}) |
           ferry::shuffle(4096, /*seed=*/7) | ferry::batch(256);
  bool ok = true;
  for (int epoch = 1; epoch <= 3; ++epoch) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::uint64_t before = decoded;
    double sum = 0;
    std::uint64_t rows = 0;
    for (auto& b : p)
      for (std::size_t r = 0; r < b.size(); ++r, ++rows) sum += b.field()[r][0];  // element i's first float is i
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::uint64_t fresh = decoded - before;
    std::printf("epoch %d: %llu rows in %.3f s, %llu decoded%s\n", epoch, static_cast<unsigned long long>(rows), s,
                static_cast<unsigned long long>(fresh), fresh ? "" : " (read from the cache file)");
    ok = ok && rows == n && sum == double(n) * double(n - 1) / 2 && (epoch == 1 || fresh == 0);
    p.rewind();
  }
  std::printf("%s: %s\n", path.c_str(), ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
