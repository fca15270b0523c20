// ferry/train/loss.hpp: softmax cross-entropy with optional per-class weights, as a
// functor over rows, and the sums of its statistics (FERRY_HOST_DEVICE: the same code runs
// on the host and GPU backends).
//
// For row i with label y and weight w = (i < valid rows) ? class_weight[y] : 0:
//   loss_i = -w * log softmax(z_i)[y]
//   dz_i   =  w * (softmax(z_i) - onehot(y))          (gradient of the SUM of losses)
// The trainer sums loss_i, w and the gradients over the global batch (all-reduce) and
// divides by the global weight sum: the mean over the global batch, whatever the replica
// count. The replica runs it over a slice's valid rows only (n = valid): padding rows
// never reach the loss or the GEMMs, where a weight of 0 would not cancel a NaN. Labels
// outside [0, classes) are treated as padding (weight 0) and counted in stats[3] as not
// valid, never read out of bounds. Throws nothing; runs on the backend
// (the replica's thread on the host, its stream on the GPU), with no user code.
#pragma once

#include <cmath>
#include <cstdint>

#include "ferry/config.hpp"

namespace ferry::train {

// The loss, its gradient and its statistics for one row i (see the file's top): run over
// the n rows of a slice.
struct softmax_xent_rows {
  const float* logits;        // n x classes
  const std::int32_t* labels; // n
  const float* class_weights; // classes, or null for all ones
  float* dlogits;             // n x classes: gradient of the summed loss
  float* stats;               // n x 4: weighted loss, weight, correct, valid
  int classes;                // the number of classes (logits per row)
  int valid;                  // rows [valid, n) are padding

  // Row i: writes dlogits' row i and stats' row i.
  FERRY_HOST_DEVICE void operator()(std::size_t i) const {
    const float* z = logits + i * static_cast<std::size_t>(classes);  // classes >= 1 (mlp_layout)
    float* d = dlogits + i * static_cast<std::size_t>(classes);
    const std::int32_t y = labels[i];
    const bool real = static_cast<int>(i) < valid && y >= 0 && y < classes;
    const float w = real ? (class_weights ? class_weights[y] : 1.0f) : 0.0f;
    float m = z[0];
    int arg = 0;
    for (int c = 1; c < classes; ++c)
      if (z[c] > m) { m = z[c]; arg = c; }
    float s = 0.0f;
    for (int c = 0; c < classes; ++c) s += expf(z[c] - m);
    const float inv = 1.0f / s;
    for (int c = 0; c < classes; ++c) {
      const float p = expf(z[c] - m) * inv;
      d[c] = w * (p - (c == y ? 1.0f : 0.0f));
    }
    const float logp = real ? (z[y] - m) - logf(s) : 0.0f;
    float* st = stats + i * 4;
    st[0] = -w * logp;
    st[1] = w;
    st[2] = (real && arg == y) ? 1.0f : 0.0f;
    st[3] = real ? 1.0f : 0.0f;
  }
};

// Sums column k of an n x 4 stats array into out[k] (k < 4): launched with 4 indices.
struct sum_stats {
  const float* stats;  // n x 4, from softmax_xent_rows
  float* out;  // 4 floats
  int n;  // rows
  // Column k.
  FERRY_HOST_DEVICE void operator()(std::size_t k) const {
    float s = 0.0f;
    for (int i = 0; i < n; ++i) s += stats[static_cast<std::size_t>(i) * 4 + k];
    out[k] = s;
  }
};

// Adds a step's 4 reduced statistics into a running sum: sum[k] += step[k] for k < 4, with
// sum[4 + k] holding the rounding error of each add (Neumaier's variant of Kahan
// summation): a plain float running sum of the loss loses digits after a few thousand
// steps, this one stays about as exact as a double sum of the steps' floats. Read it as
// double(sum[k]) + double(sum[4 + k]). Launched with 4 indices.
struct add_stats {
  const float* step;  // the step's 4 reduced statistics
  float* sum;  // 8 floats
  // Statistic k.
  FERRY_HOST_DEVICE void operator()(std::size_t k) const {
    const float x = step[k], s = sum[k], t = s + x;
    const float as = s < 0.0f ? -s : s, ax = x < 0.0f ? -x : x;
    sum[4 + k] += as >= ax ? (s - t) + x : (x - t) + s;
    sum[k] = t;
  }
};

}  // namespace ferry::train
