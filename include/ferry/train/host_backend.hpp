// ferry/train/host_backend.hpp: the CPU backend of the trainer: GEMMs through OpenBLAS's
// cblas_sgemm, elementwise functors through Thrust's CPP (host) system.
//
// Build: link OpenBLAS (Meson's cblas_dep) and give g++ Thrust's headers
// (-isystem /usr/local/cuda/include/cccl) with THRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP
// on that target only (never globally: device_vector would change meaning across targets).
// Add -fno-math-errno there too: without it sqrtf may set errno, which keeps GCC from
// vectorizing Adam's update (a quarter of a Fashion-MNIST step when scalar).
// Under nvcc the device system stays CUDA; this backend names thrust::cpp::par explicitly.
//
// Memory: alloc() hands out zeroed float arrays owned by the backend, freed with it; the
// trainer allocates everything up front, so a step allocates nothing.
// One backend per replica; it is used by that replica's thread only. Throws
// std::bad_alloc from alloc(); nothing else.
#pragma once

#if !defined(__CUDACC__) && !defined(THRUST_DEVICE_SYSTEM)
#error "ferry/train/host_backend.hpp: compile this target with -DTHRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP (and -isystem /usr/local/cuda/include/cccl)"
#endif

#include <cblas.h>

#include <cstddef>
#include <cstring>
#include <memory>
#include <vector>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cpp/execution_policy.h>

#include "ferry/cuda/stream_handle.hpp"

namespace ferry::train {

// A replica's backend on the CPU (see the file's top).
class host_backend {
 public:
  static constexpr bool on_device = false;  // its memory is host memory

  host_backend() = default;
  // From a replica_context, which the host ignores.
  template <class Context>
  explicit host_backend(const Context&) {}  // host replicas need no device or stream
  host_backend(const host_backend&) = delete;
  host_backend& operator=(const host_backend&) = delete;

  // n zeroed floats, freed with the backend; throws std::bad_alloc.
  float* alloc(std::size_t n) {
    blocks_.push_back(std::make_unique<float[]>(n ? n : 1));  // value-initialised: zeros
    return blocks_.back().get();
  }

  // Row-major C(m x n) = op(A) op(B) + beta C, op(X) = X^T when t is set.
  void gemm(bool ta, bool tb, int m, int n, int k, const float* a, int lda, const float* b,
            int ldb, float beta, float* c, int ldc) {
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
  }
  // y(cols) = A^T x, A rows x cols row-major (the bias gradient: column sums).
  void gemv_t(int rows, int cols, const float* a, const float* x, float* y) {
    cblas_sgemv(CblasRowMajor, CblasTrans, rows, cols, 1.0f, a, cols, x, 1, 0.0f, y, 1);
  }
  // f(i) for i < n. A functor that reads one scalar from backend memory exposes scalar()
  // and apply(i, s): it is read once here, so the loop has no load that might alias its
  // stores and vectorizes.
  template <class F>
  void for_each(std::size_t n, F f) {
    if constexpr (requires { f.apply(std::size_t{}, f.scalar()); }) {
      const auto s = f.scalar();
      thrust::for_each(thrust::cpp::par, thrust::counting_iterator<std::size_t>(0),
                       thrust::counting_iterator<std::size_t>(n),
                       [f, s](std::size_t i) { f.apply(i, s); });
    } else {
      thrust::for_each(thrust::cpp::par, thrust::counting_iterator<std::size_t>(0),
                       thrust::counting_iterator<std::size_t>(n), f);
    }
  }
  // f(r, c) for r < rows, c < cols: a row at a time, the inner loop contiguous.
  template <class F>
  void for_each_2d(std::size_t rows, std::size_t cols, F f) {
    thrust::for_each(thrust::cpp::par, thrust::counting_iterator<std::size_t>(0),
                     thrust::counting_iterator<std::size_t>(rows), [f, cols](std::size_t r) {
                       for (std::size_t c = 0; c < cols; ++c) f(r, c);
                     });
  }
  // p[0, n) = v.
  void fill(float* p, std::size_t n, float v) {
    for (std::size_t i = 0; i < n; ++i) p[i] = v;
  }
  // Host <-> backend memory: plain copies here.
  void upload(void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); }
  // Backend -> host memory: a plain copy.
  void download(void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); }
  // Nothing to wait for: every call above has finished when it returns.
  void sync() {}
  // No stream: null.
  cuda_stream stream() const { return nullptr; }

  // OpenBLAS's own thread count (process-wide): 1 when replicas run on their own threads.
  static void set_blas_threads(int n) { openblas_set_num_threads(n); }

 private:
  std::vector<std::unique_ptr<float[]>> blocks_;
};

}  // namespace ferry::train
