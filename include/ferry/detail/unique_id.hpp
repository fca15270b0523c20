// ferry/detail/unique_id.hpp: a 64-bit id that no other call, thread, process or host is
// likely to draw: for names and marks that must not collide (a temporary file's name, the
// pass id in a cache file). Not for anything reproducible (use mix_seed for that).
// Thread-safe; throws nothing.
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <random>

#include "ferry/detail/random.hpp"

namespace ferry::detail {

// The entropy source (other hosts sharing a file system), this process's id (other
// processes), a counter (other threads, other calls) and the clock, mixed.
inline std::uint64_t unique_id() noexcept {
  static std::atomic<std::uint64_t> counter{0};
  std::uint64_t noise = 0;
  try {
    noise = std::random_device{}();
  } catch (...) {  // no entropy source: the rest still tells calls apart
  }
  return mix_seed({noise, std::uint64_t(::getpid()), counter.fetch_add(1, std::memory_order_relaxed),
                   std::uint64_t(std::chrono::steady_clock::now().time_since_epoch().count())});
}

}  // namespace ferry::detail
