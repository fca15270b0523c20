// ferry/detail/permutation.hpp: a random permutation of [0, n) that is a function, not a
// table: position -> index (and back) in O(1) memory, for any n, the same bit for bit on every build.
//
// A balanced Feistel network (four rounds of a SplitMix64-based round function) on the
// smallest even bit width 2h with 2^(2h) >= n, cycle-walking values that land at or past n
// (at most a few steps on average, since 2^(2h) < 4n). Four rounds make a permutation
// whose positions look independent for shuffling (Luby-Rackoff); it is not cryptographic.
// Throws nothing; any thread.
#pragma once

#include <cstdint>

#include "ferry/config.hpp"
#include "ferry/detail/random.hpp"

namespace ferry::detail {

class feistel_permutation {
 public:
  feistel_permutation() = default;
  // A permutation of [0, n) drawn from key; n <= 2^62.
  feistel_permutation(std::uint64_t n, std::uint64_t key) : n_(n) {
    unsigned bits = 2;
    while (bits < 62 && (std::uint64_t(1) << bits) < n) bits += 2;
    half_ = bits / 2;
    mask_ = (std::uint64_t(1) << half_) - 1;
    for (unsigned r = 0; r < rounds; ++r) keys_[r] = mix_seed({key, r});
  }
  // The value at position i (i < n). Also in device code (nvcc with
  // --expt-relaxed-constexpr: it calls splitmix64): the object is trivially copyable.
  FERRY_HOST_DEVICE std::uint64_t operator()(std::uint64_t i) const noexcept {
    if (i >= n_) return i;  // outside the domain (n = 0 included): no walk that cannot end
    std::uint64_t x = i;
    do x = encrypt(x);
    while (x >= n_);
    return x;
  }
  // The position of value v (v < n): inverse(operator()(i)) == i. The rounds run
  // backwards, walking the same cycle the other way.
  FERRY_HOST_DEVICE std::uint64_t inverse(std::uint64_t v) const noexcept {
    if (v >= n_) return v;
    std::uint64_t x = v;
    do x = decrypt(x);
    while (x >= n_);
    return x;
  }
  // n.
  FERRY_HOST_DEVICE std::uint64_t size() const noexcept { return n_; }

 private:
  static constexpr unsigned rounds = 4;
  FERRY_HOST_DEVICE std::uint64_t encrypt(std::uint64_t x) const noexcept {
    std::uint64_t l = x >> half_, r = x & mask_;
    for (unsigned k = 0; k < rounds; ++k) {
      const std::uint64_t f = splitmix64(keys_[k] ^ r)() & mask_;
      const std::uint64_t t = l ^ f;
      l = r;
      r = t;
    }
    return (l << half_) | r;
  }
  FERRY_HOST_DEVICE std::uint64_t decrypt(std::uint64_t x) const noexcept {
    std::uint64_t l = x >> half_, r = x & mask_;
    for (unsigned k = rounds; k-- > 0;) {
      const std::uint64_t t = r ^ (splitmix64(keys_[k] ^ l)() & mask_);
      r = l;
      l = t;
    }
    return (l << half_) | r;
  }

  std::uint64_t n_ = 0;
  unsigned half_ = 1;
  std::uint64_t mask_ = 1;
  std::uint64_t keys_[rounds] = {};
};

}  // namespace ferry::detail
