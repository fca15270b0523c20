// ferry/train/mlp.hpp: the model: a multi-layer perceptron, its parameter layout and its
// seeded initialisation.
//
//   ferry::train::mlp_config cfg{.layers = {784, 256, 128, 10}};   // ReLU between layers
//
// Parameters live in ONE contiguous float array, layer by layer: W_l (out x in, row-major)
// then b_l (out). Gradients use the same layout in one buffer per replica, followed by
// mlp_layout::extras floats of step statistics (loss sum, weight sum, correct, valid
// rows), so a single all-reduce per step carries everything.
//
// init_params(cfg, seed) is portable: the same seed gives the same bits on any machine
// (SplitMix64, He-uniform weights, zero biases), so every replica starts identical.
// Throws config_error for fewer than 2 layer sizes, a size < 1, or class_weights whose
// length is not the number of classes (or that are negative). Pure; runs no user code.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ferry/error.hpp"

namespace ferry::train {

// The model: its layer sizes and optional class weights (a braced list, as above).
struct mlp_config {
  std::vector<int> layers;           // input size, hidden sizes..., number of classes
  std::vector<float> class_weights;  // empty: every class weighs 1
};

// Where each layer's parameters lie in the flat array, and the sizes derived from the
// config (see the file's top).
struct mlp_layout {
  static constexpr std::size_t extras = 4;  // loss_sum, weight_sum, correct, valid
  // The place of each step statistic after the gradients (at params + extra).
  enum extra : std::size_t { loss_sum = 0, weight_sum = 1, correct = 2, valid = 3 };

  std::vector<int> sizes;  // mlp_config::layers
  std::vector<std::size_t> w_off, b_off;  // per layer l (0-based, l < layers())
  std::size_t params = 0;  // the number of parameters (floats)

  // Checks c and lays it out; throws config_error as the file's top says.
  explicit mlp_layout(const mlp_config& c) : sizes(c.layers) {
    if (sizes.size() < 2)
      throw config_error("mlp_config: layers needs at least an input size and a class count (got " +
                         std::to_string(sizes.size()) + " sizes)");
    for (std::size_t i = 0; i < sizes.size(); ++i)
      if (sizes[i] < 1)
        throw config_error("mlp_config: layer size " + std::to_string(i) + " is " +
                           std::to_string(sizes[i]) + "; sizes must be at least 1");
    if (!c.class_weights.empty()) {
      if (c.class_weights.size() != static_cast<std::size_t>(sizes.back()))
        throw config_error("mlp_config: class_weights has " +
                           std::to_string(c.class_weights.size()) + " values for " +
                           std::to_string(sizes.back()) + " classes");
      for (float w : c.class_weights)
        if (!(w >= 0.0f) || !std::isfinite(w))
          throw config_error("mlp_config: class weights must be finite and >= 0");
    }
    for (std::size_t l = 0; l + 1 < sizes.size(); ++l) {
      w_off.push_back(params);
      params += std::size_t(sizes[l]) * std::size_t(sizes[l + 1]);
      b_off.push_back(params);
      params += std::size_t(sizes[l + 1]);
    }
  }
  // The number of layers (weight matrices): sizes - 1.
  std::size_t layers() const { return sizes.size() - 1; }
  // Layer l's input width.
  int in(std::size_t l) const { return sizes[l]; }
  // Layer l's output width.
  int out(std::size_t l) const { return sizes[l + 1]; }
  // The model's input width.
  int inputs() const { return sizes.front(); }
  // The number of classes (the last layer's width).
  int classes() const { return sizes.back(); }
  // The widest layer (what activation scratch buffers are sized for).
  int widest() const {
    int m = 0;
    for (int s : sizes) m = s > m ? s : m;
    return m;
  }
  // The gradient buffer's size: the parameters' gradients, then the step statistics.
  std::size_t grad_floats() const { return params + extras; }
};

namespace detail {
inline std::uint64_t splitmix64(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
}  // namespace detail

// He-uniform weights U(-sqrt(6/fan_in), +sqrt(6/fan_in)), zero biases.
inline std::vector<float> init_params(const mlp_layout& lay, std::uint64_t seed) {
  std::vector<float> p(lay.params, 0.0f);
  std::uint64_t s = seed ^ 0x6665727279ull;  // "ferry"
  for (std::size_t l = 0; l < lay.layers(); ++l) {
    const double lim = std::sqrt(6.0 / lay.in(l));
    const std::size_t n = std::size_t(lay.in(l)) * std::size_t(lay.out(l));
    for (std::size_t i = 0; i < n; ++i) {
      const double u = double(detail::splitmix64(s) >> 11) * 0x1.0p-53;  // [0, 1)
      p[lay.w_off[l] + i] = static_cast<float>((2.0 * u - 1.0) * lim);
    }
  }
  return p;
}

}  // namespace ferry::train
