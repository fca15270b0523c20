// ferry/detail/random.hpp: small, exactly specified random numbers.
// std::uniform_int_distribution differs between standard libraries, so a seeded shuffle
// would differ between builds; these are defined bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <utility>

namespace ferry::detail {

// GCC's and clang's 128-bit integer; __extension__: an extension -Wpedantic need not report.
__extension__ using uint128 = unsigned __int128;

// SplitMix64 (Steele, Lea, Flood 2014): a fast generator and a good mixer of seeds.
class splitmix64 {
 public:
  explicit constexpr splitmix64(std::uint64_t seed) : s_(seed) {}
  constexpr std::uint64_t operator()() {
    std::uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n), n > 0 (Lemire's multiply-shift with rejection: no modulo bias).
  constexpr std::uint64_t below(std::uint64_t n) {
    uint128 m = static_cast<uint128>((*this)()) * n;
    auto lo = static_cast<std::uint64_t>(m);
    if (lo < n) {
      const std::uint64_t t = (0 - n) % n;
      while (lo < t) {
        m = static_cast<uint128>((*this)()) * n;
        lo = static_cast<std::uint64_t>(m);
      }
    }
    return static_cast<std::uint64_t>(m >> 64);
  }

 private:
  std::uint64_t s_;
};

// Fisher-Yates over a random-access container, drawing from g: the permutation depends
// only on g's state and the size, bit for bit on every build.
template <class V>
constexpr void permute(V& v, splitmix64& g) {
  for (std::size_t i = v.size(); i > 1; --i) {
    const std::size_t j = static_cast<std::size_t>(g.below(i));
    if (j != i - 1) std::swap(v[i - 1], v[j]);
  }
}

// Derives one seed from several words (seed, epoch, block...): order matters.
constexpr std::uint64_t mix_seed(std::initializer_list<std::uint64_t> words) {
  std::uint64_t h = 0x6a09e667f3bcc909ull;
  for (std::uint64_t w : words) h = splitmix64(h ^ w)();
  return h;
}

}  // namespace ferry::detail
