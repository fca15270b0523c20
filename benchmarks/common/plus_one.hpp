// benchmarks/common/plus_one.hpp: the hand-written baseline of bench_overhead and
// bench_observe, and the checksum both sides consume batches with.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace bench {

// Consumes a batch the same way in every variant: a checksum the compiler cannot drop.
inline std::uint64_t consume(const std::uint32_t* p, std::size_t n) {
  std::uint64_t s = 0;
  for (std::size_t i = 0; i < n; ++i) s += p[i];
  return s;
}

// What from_range | map(+1) | batch(bs) does, by hand: each group of bs elements plus one
// into a reused buffer, then consumed. Returns the checksum.
inline std::uint64_t plus_one_loop(std::span<const std::uint32_t> data, std::size_t bs) {
  const std::size_t n = data.size();
  std::vector<std::uint32_t> buf(bs);
  std::uint64_t s = 0;
  for (std::size_t i = 0; i < n; i += bs) {
    const std::size_t m = std::min(bs, n - i);
    for (std::size_t j = 0; j < m; ++j) buf[j] = data[i + j] + 1;
    s += consume(buf.data(), m);
  }
  return s;
}

}  // namespace bench
