// Float comparisons that never let a NaN or an infinity through.
//
// std::max(w, NaN) and std::fmax(w, NaN) both return w, and `err > tol` is false for a NaN
// err, so the usual "worst difference" loop passes a result full of NaNs. Here every
// figure is NaN as soon as one of its inputs is not finite, and checks are written
// `err <= tol` (or `!(err <= tol)` to count failures), which a NaN fails.
//
//   max_abs_diff(a, b)   max |a_i - b_i|; NaN if a value is not finite or the sizes differ
//   max_abs(a)           max |a_i|; NaN if a value is not finite
//   rel_diff(a, b)       |a - b| / max(floor, |b|); NaN if a or b is not finite
//   worst(w, x)          max(w, x), NaN once either is NaN (to fold figures in a loop)
//
// No test framework needed (test_train_gpu.cu uses it with nvcc and plain printf).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

namespace ferry_test {

inline constexpr double not_close = std::numeric_limits<double>::quiet_NaN();

// max(w, x) that keeps a NaN from either side.
inline double worst(double w, double x) {
  if (std::isnan(w) || std::isnan(x)) return not_close;
  return std::max(w, x);
}

// |a - b| / max(floor, |b|): the difference of a from the reference b, relative where b is
// not tiny. NaN if either is not finite.
inline double rel_diff(double a, double b, double floor = 1e-3) {
  if (!std::isfinite(a) || !std::isfinite(b)) return not_close;
  return std::fabs(a - b) / std::max(floor, std::fabs(b));
}

// max |a_i - b_i| over two ranges of numbers (size() and operator[]); NaN if any value of
// either is not finite, or if the sizes differ.
template <class A, class B>
double max_abs_diff(const A& a, const B& b) {
  if (a.size() != b.size()) return not_close;
  double w = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double x = double(a[i]), y = double(b[i]);
    if (!std::isfinite(x) || !std::isfinite(y)) return not_close;
    w = std::max(w, std::fabs(x - y));
  }
  return w;
}

// max |a_i|; NaN if any value is not finite.
template <class A>
double max_abs(const A& a) {
  double w = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double x = double(a[i]);
    if (!std::isfinite(x)) return not_close;
    w = std::max(w, std::fabs(x));
  }
  return w;
}

}  // namespace ferry_test
