// The element the distribute tests (host and GPU) batch: an id and three floats derived
// from it, so any element's bytes can be checked from its id.
#pragma once

#include <array>
#include <cstdint>
#include <tuple>
#include <vector>

using elem = std::tuple<std::uint32_t, std::array<float, 3>>;

inline std::vector<elem> make_data(std::uint32_t n) {
  std::vector<elem> v;
  for (std::uint32_t i = 0; i < n; ++i)
    v.emplace_back(i + 1, std::array<float, 3>{float(i), float(i) * 0.5f, -float(i)});
  return v;
}
