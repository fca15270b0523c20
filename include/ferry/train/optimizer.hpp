// ferry/train/optimizer.hpp: SGD with momentum and Adam, as elementwise functors over the
// flat parameter array (FERRY_HOST_DEVICE: one source of math for both backends).
//
// The gradient buffer holds the gradient of the SUMMED loss of the global batch followed
// by the step statistics; each functor divides by the global weight sum it reads from
// that buffer (so the GPU needs no host round trip). A step whose weight sum is 0 (a
// batch of padding only) leaves the parameters and the optimizer state unchanged.
//
//   optimizer_config{.kind = optimizer_kind::adam, .lr = 1e-3f}
//   optimizer_config{.kind = optimizer_kind::sgd, .lr = 0.05f, .momentum = 0.9f}
//
// Each functor reads the weight sum once per call of apply(i, w): operator()(i) reads it
// from memory (the GPU path), while the host backend reads scalar() once and runs
// apply over the whole range, so the loop vectorizes (build with -fno-math-errno so
// sqrtf does too).
//
// Throws nothing; validate() throws config_error for a non-positive learning rate or
// betas/momentum outside [0, 1).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "ferry/config.hpp"
#include "ferry/error.hpp"

namespace ferry::train {

enum class optimizer_kind { sgd, adam };

struct optimizer_config {
  optimizer_kind kind = optimizer_kind::adam;
  float lr = 1e-3f;
  float momentum = 0.9f;  // sgd
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;  // adam

  void validate() const {
    auto unit = [](float v) { return v >= 0.0f && v < 1.0f; };
    if (!(lr > 0.0f) || !std::isfinite(lr))
      throw config_error("optimizer_config: lr must be > 0 (got " + std::to_string(lr) + ")");
    if (!unit(momentum) || !unit(beta1) || !unit(beta2))
      throw config_error("optimizer_config: momentum, beta1 and beta2 must be in [0, 1)");
    if (!(eps > 0.0f)) throw config_error("optimizer_config: eps must be > 0");
  }
  // Optimizer state floats per parameter.
  std::size_t state_per_param() const { return kind == optimizer_kind::adam ? 2 : 1; }
};

// v = momentum * v + g / W;  p -= lr * v   (PyTorch's SGD momentum form)
struct sgd_update {
  float* p;
  const float* g;
  float* v;
  const float* weight_sum;  // the global weight sum, in the gradient buffer
  float lr, momentum;
  FERRY_HOST_DEVICE float scalar() const { return *weight_sum; }
  FERRY_HOST_DEVICE void operator()(std::size_t i) const { apply(i, *weight_sum); }
  FERRY_HOST_DEVICE void apply(std::size_t i, float w) const {
    if (!(w > 0.0f)) return;
    const float gi = g[i] / w;
    const float vi = momentum * v[i] + gi;
    v[i] = vi;
    p[i] -= lr * vi;
  }
};

// Adam (Kingma & Ba) with bias correction, in PyTorch's arrangement (one sqrt and one
// division per parameter): with bc1 = 1 - beta1^t and bc2 = 1 - beta2^t,
//   p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
// step = lr / bc1 and inv_sqrt_bc2 = 1 / sqrt(bc2) come from adam_update::at(t).
struct adam_update {
  float* p;
  const float* g;
  float* m;
  float* v;
  const float* weight_sum;
  float beta1, beta2, eps, step, inv_sqrt_bc2;
  FERRY_HOST_DEVICE float scalar() const { return *weight_sum; }
  FERRY_HOST_DEVICE void operator()(std::size_t i) const { apply(i, *weight_sum); }
  FERRY_HOST_DEVICE void apply(std::size_t i, float w) const {
    if (!(w > 0.0f)) return;
    const float gi = g[i] * (1.0f / w);
    const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
    const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] -= step * mi / (sqrtf(vi) * inv_sqrt_bc2 + eps);
  }
  // The functor for step t (1-based) of config c over these arrays.
  static adam_update at(const optimizer_config& c, std::uint64_t t, float* p, const float* g,
                        float* m, float* v, const float* weight_sum) {
    const double bc1 = 1.0 - std::pow(double(c.beta1), double(t));
    const double bc2 = 1.0 - std::pow(double(c.beta2), double(t));
    return {p, g, m, v, weight_sum, c.beta1, c.beta2, c.eps, static_cast<float>(c.lr / bc1),
            static_cast<float>(1.0 / std::sqrt(bc2))};
  }
};

}  // namespace ferry::train
