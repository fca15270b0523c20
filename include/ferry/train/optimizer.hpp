// ferry/train/optimizer.hpp: SGD with momentum and Adam, as elementwise functors over the
// flat parameter array (FERRY_HOST_DEVICE: one source of math for both backends).
//
// The gradient buffer holds the gradient of the SUMMED loss of the global batch followed
// by the step statistics; each functor divides by the global weight sum it reads from
// that buffer (so the GPU needs no host round trip). A step whose weight sum is 0 (a
// batch of padding only, or rows of class weight 0 only) leaves the parameters and the
// optimizer state unchanged, Adam's step counter included: that counter and its bias
// corrections live in backend memory too (adam_schedule), advanced by adam_advance only
// when the weight sum is > 0, so the host never waits for the reduced sum.
//
//   optimizer_config{.kind = optimizer_kind::adam, .lr = 1e-3f}
//   optimizer_config{.kind = optimizer_kind::sgd, .lr = 0.05f, .momentum = 0.9f}
//
// Each functor reads its scalars (the weight sum; Adam's step sizes) once per call of
// apply(i, s): operator()(i) reads them from memory (the GPU path), while the host backend
// reads scalar() once and runs apply over the whole range, so the loop vectorizes (build
// with -fno-math-errno so sqrtf does too).
//
// Throws nothing; validate() throws config_error for a non-positive learning rate or
// betas/momentum outside [0, 1). The functors run on the backend (the replica's thread on
// the host, its stream on the GPU), with no user code.
#pragma once

#include <cmath>
#include <math.h>  // ::pow, ::sqrt (host and device)
#include <cstddef>
#include <cstdint>
#include <string>

#include "ferry/config.hpp"
#include "ferry/error.hpp"

namespace ferry::train {

// Which optimizer a trainer runs: SGD with momentum, or Adam.
enum class optimizer_kind { sgd, adam };

// The optimizer and its hyperparameters (a braced list, as in the examples above).
struct optimizer_config {
  optimizer_kind kind = optimizer_kind::adam;  // which update
  float lr = 1e-3f;  // the learning rate, > 0
  float momentum = 0.9f;  // sgd
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;  // adam

  // Throws config_error for lr not > 0 (or not finite), momentum or betas outside [0, 1),
  // or eps not > 0.
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
  float* p;  // the parameters, updated in place
  const float* g;  // the gradient of the summed loss
  float* v;  // the momentum buffer (optimizer state, one float per parameter)
  const float* weight_sum;  // the global weight sum, in the gradient buffer
  float lr, momentum;  // from optimizer_config
  // The weight sum W, read once (the host backend's loop).
  FERRY_HOST_DEVICE float scalar() const { return *weight_sum; }
  // Updates parameter i, reading W from memory (the GPU path).
  FERRY_HOST_DEVICE void operator()(std::size_t i) const { apply(i, *weight_sum); }
  // Updates parameter i with W = w; nothing when w is not > 0.
  FERRY_HOST_DEVICE void apply(std::size_t i, float w) const {
    if (!(w > 0.0f)) return;
    const float gi = g[i] / w;
    const float vi = momentum * v[i] + gi;
    v[i] = vi;
    p[i] -= lr * vi;
  }
};

// Adam's schedule, adam_schedule::floats floats of backend memory (zeros: step 0):
// the step count t (as two exact float halves, t = hi * 2^24 + lo, since a float counts
// exactly only to 2^24) and the bias-corrected step sizes of step t.
struct adam_schedule {
  // The indices of t's halves, step and inv_sqrt_bc2 in it, and its size (floats).
  static constexpr std::size_t t_lo = 0, t_hi = 1, step = 2, inv_sqrt_bc2 = 3, floats = 4;
};

// Run as for_each(1, ...) before adam_update: when the global weight sum is > 0, t += 1 and
// with bc1 = 1 - beta1^t, bc2 = 1 - beta2^t: step = lr / bc1, inv_sqrt_bc2 = 1 / sqrt(bc2).
// A step of weight 0 leaves t alone, so later bias corrections stay those of the real steps.
struct adam_advance {
  float* sched;  // the adam_schedule floats, in backend memory
  const float* weight_sum;  // the global weight sum, in the gradient buffer
  float lr, beta1, beta2;  // from optimizer_config
  // Advances the schedule (run for one index only).
  FERRY_HOST_DEVICE void operator()(std::size_t) const {
    if (!(*weight_sum > 0.0f)) return;
    constexpr float half = 16777216.0f;  // 2^24
    float lo = sched[adam_schedule::t_lo] + 1.0f, hi = sched[adam_schedule::t_hi];
    if (lo >= half) {
      lo = 0.0f;
      hi += 1.0f;
    }
    sched[adam_schedule::t_lo] = lo;
    sched[adam_schedule::t_hi] = hi;
    const double t = double(hi) * double(half) + double(lo);
    // ::pow / ::sqrt on doubles: the same calls in host and CUDA device code.
    const double bc1 = 1.0 - ::pow(double(beta1), t);
    const double bc2 = 1.0 - ::pow(double(beta2), t);
    sched[adam_schedule::step] = static_cast<float>(double(lr) / bc1);
    sched[adam_schedule::inv_sqrt_bc2] = static_cast<float>(1.0 / ::sqrt(bc2));
  }
};

// What adam_update reads once per call: the weight sum and the step sizes of this step.
struct adam_scalars {
  float w, step, inv_sqrt_bc2;  // the weight sum; the schedule's floats of the same names
};

// Adam (Kingma & Ba) with bias correction, in PyTorch's arrangement (one sqrt and one
// division per parameter): with bc1 = 1 - beta1^t and bc2 = 1 - beta2^t,
//   p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
// step = lr / bc1 and inv_sqrt_bc2 = 1 / sqrt(bc2) are read from the schedule that
// adam_advance wrote for this step.
struct adam_update {
  float* p;  // the parameters, updated in place
  const float* g;  // the gradient of the summed loss
  float* m;  // the first-moment estimates (optimizer state)
  float* v;  // the second-moment estimates (optimizer state)
  const float* weight_sum;  // the global weight sum, in the gradient buffer
  const float* sched;  // adam_schedule::floats floats
  float beta1, beta2, eps;  // from optimizer_config
  // The weight sum and this step's step sizes, read once (the host backend's loop).
  FERRY_HOST_DEVICE adam_scalars scalar() const {
    return {*weight_sum, sched[adam_schedule::step], sched[adam_schedule::inv_sqrt_bc2]};
  }
  // Updates parameter i, reading the scalars from memory (the GPU path).
  FERRY_HOST_DEVICE void operator()(std::size_t i) const { apply(i, scalar()); }
  // Updates parameter i with the scalars s; nothing when s.w is not > 0.
  FERRY_HOST_DEVICE void apply(std::size_t i, adam_scalars s) const {
    if (!(s.w > 0.0f)) return;
    const float gi = g[i] * (1.0f / s.w);
    const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
    const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] -= s.step * mi / (sqrtf(vi) * s.inv_sqrt_bc2 + eps);
  }
};

}  // namespace ferry::train
