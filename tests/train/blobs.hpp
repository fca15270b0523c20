// Synthetic, separable data for the trainer tests: n points of `dim` floats around
// `classes` random centres (point i in class i % classes). Plain C++ (nvcc tests use it too).
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace train_test {

struct blobs {
  std::vector<float> x;  // n x dim
  std::vector<std::int32_t> y;
};

inline blobs make_blobs(int n, int dim, int classes, unsigned seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd;
  std::vector<float> c(std::size_t(classes) * dim);
  for (auto& v : c) v = 3.0f * nd(g);
  blobs d;
  for (int i = 0; i < n; ++i) {
    d.y.push_back(i % classes);
    for (int k = 0; k < dim; ++k) d.x.push_back(c[std::size_t(i % classes) * dim + k] + 0.5f * nd(g));
  }
  return d;
}

}  // namespace train_test
