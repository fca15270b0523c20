// ferry/train/gpu_backend.cuh: the GPU backend of the trainer: GEMMs through cuBLAS and
// the same elementwise functors as the host backend through Thrust's CUDA system, all on
// the replica's compute stream (the stream distribute() hands out with each slice).
//
//   using gpu_trainer = ferry::train::mirrored_trainer<ferry::train::gpu_backend,
//                                                      ferry::nccl_communicator>;
//   gpu_trainer t(cfg, opts, ferry::nccl_communicator::local({0, 1}),
//                 {{.device = 0, .stream = s0}, {.device = 1, .stream = s1}});
//
// Memory: alloc() is cudaMalloc on the replica's device, zeroed, freed with the backend;
// everything is allocated when the trainer is built, nothing per step. Work is enqueued
// asynchronously (thrust::cuda::par_nosync); only download() and upload() wait for the
// stream: per step, train_step's 16-byte statistics read back, none in train_step_async
// (take_stats reads 32 bytes of totals). No stream given: the backend creates one and owns it.
//
// CUDA graphs (trainer_options::graphs): capture(f) records what f enqueues on the stream
// into a graph (stream capture, mode ThreadLocal, so other threads' CUDA calls, e.g.
// distribute's staging thread, are unaffected) and instantiates it; launch(g) replays it
// with one call. Before the first capture cuBLAS gets a workspace of its own
// (workspace_bytes, allocated then), so no GEMM allocates during capture.
//
// Throws ferry::cuda_error (call, device, status) for a failed CUDA call and ferry::error
// naming the cuBLAS call, device and status for cuBLAS. One backend per replica, used by
// that replica's thread; it makes its device current on entry to each operation, since
// replica 0 runs on the caller's thread, whose current device may be another.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cuda/execution_policy.h>

#include "ferry/cuda/error.hpp"
#include "ferry/cuda/stream.hpp"
#include "ferry/cuda/stream_handle.hpp"
#include "ferry/error.hpp"

namespace ferry::train {

namespace detail {
inline void blas_check(cublasStatus_t s, const char* call, int device) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw error(std::string("cuBLAS: ") + call + " failed on device " + std::to_string(device) + ": status " +
                std::to_string(int(s)) + " (" + cublasGetStatusName(s) + ": " + cublasGetStatusString(s) + ")");
}
// p[i] = v (namespace scope: kernels cannot name a private nested type).
struct fill_fn {
  float* p;
  float v;
  __host__ __device__ void operator()(std::size_t i) const { p[i] = v; }
};
// f(i / cols, i % cols): a 2-D functor over a flat index.
template <class F>
struct flat_2d {
  F f;
  std::size_t cols;
  __host__ __device__ void operator()(std::size_t i) const { f(i / cols, i % cols); }
};
}  // namespace detail

// A replica's backend on one CUDA device: cuBLAS and Thrust on the replica's stream (see
// the file's top).
class gpu_backend {
 public:
  static constexpr bool on_device = true;  // its memory is device memory (the communicator's buffers too)

  // Context: anything with .device and .stream (replica_context).
  // Leaves the device current (as each call does). Throws cuda_error, or ferry::error for
  // cuBLAS; then what it made is released and the caller's device is current again.
  template <class Context>
  explicit gpu_backend(const Context& ctx) : dev_(ctx.device < 0 ? 0 : ctx.device) {
    int caller = -1;
    FERRY_CUDA_TRY(cudaGetDevice(&caller));
    try {
      make_current();
      if (ctx.stream) {
        stream_ = static_cast<cudaStream_t>(ctx.stream);
      } else {
        FERRY_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
        own_stream_ = true;
      }
      detail::blas_check(cublasCreate(&blas_), "cublasCreate", dev_);
      detail::blas_check(cublasSetStream(blas_, stream_), "cublasSetStream", dev_);
    } catch (...) {
      release();  // no destructor runs for a constructor that throws
      FERRY_CUDA_LOG(cudaSetDevice(caller));
      throw;
    }
  }
  gpu_backend(const gpu_backend&) = delete;
  gpu_backend& operator=(const gpu_backend&) = delete;
  ~gpu_backend() { release(); }

  // The CUDA device ordinal.
  int device() const { return dev_; }
  // The stream every operation is enqueued on.
  cuda_stream stream() const { return stream_; }

  // n floats of device memory, zeroed on the stream, freed with the backend; throws
  // cuda_error.
  float* alloc(std::size_t n) {
    float* p = nullptr;
    make_current();
    FERRY_CUDA_TRY(cudaMalloc(&p, (n ? n : 1) * sizeof(float)));
    blocks_.push_back(p);
    FERRY_CUDA_TRY(cudaMemsetAsync(p, 0, (n ? n : 1) * sizeof(float), stream_));
    return p;
  }

  // Row-major C(m x n) = op(A) op(B) + beta C. cuBLAS is column-major: a row-major C is a
  // column-major C^T = op(B)^T op(A)^T, so swap the operands (no transposes copied).
  void gemm(bool ta, bool tb, int m, int n, int k, const float* a, int lda, const float* b,
            int ldb, float beta, float* c, int ldc) {
    const float one = 1.0f;
    make_current();
    detail::blas_check(cublasSgemm(blas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                   n, m, k, &one, b, ldb, a, lda, &beta, c, ldc),
                       "cublasSgemm", dev_);
  }
  // y(cols) = A^T x, A rows x cols row-major (= column-major cols x rows: y = A_cm x).
  void gemv_t(int rows, int cols, const float* a, const float* x, float* y) {
    const float one = 1.0f, zero = 0.0f;
    make_current();
    detail::blas_check(cublasSgemv(blas_, CUBLAS_OP_N, cols, rows, &one, a, cols, x, 1, &zero, y, 1),
                       "cublasSgemv", dev_);
  }
  // f(i) for i < n, one device thread per index, on the stream (no wait).
  template <class F>
  void for_each(std::size_t n, F f) {
    make_current();
    thrust::for_each(thrust::cuda::par_nosync.on(stream_), thrust::counting_iterator<std::size_t>(0),
                     thrust::counting_iterator<std::size_t>(n), f);
  }
  // f(r, c) for r < rows, c < cols, one thread per element.
  template <class F>
  void for_each_2d(std::size_t rows, std::size_t cols, F f) {
    for_each(rows * cols, detail::flat_2d<F>{f, cols});
  }
  // p[0, n) = v, on the stream (no wait).
  void fill(float* p, std::size_t n, float v) { for_each(n, detail::fill_fn{p, v}); }
  // Device-to-device copy on the stream (no wait).
  void copy(void* dst, const void* src, std::size_t bytes) {
    make_current();
    FERRY_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  }

  // An instantiated CUDA graph of this backend's device (move-only). Destroying it while a
  // launch is in flight is safe: CUDA frees it once that launch completes.
  class graph {
   public:
    graph() = default;
    // Takes o's graph; o is left empty.
    graph(graph&& o) noexcept : g_(std::exchange(o.g_, nullptr)), dev_(o.dev_) {}
    // Destroys this graph, then takes o's.
    graph& operator=(graph&& o) noexcept {
      if (this != &o) {
        reset();
        g_ = std::exchange(o.g_, nullptr);
        dev_ = o.dev_;
      }
      return *this;
    }
    graph(const graph&) = delete;
    graph& operator=(const graph&) = delete;
    ~graph() { reset(); }

   private:
    friend class gpu_backend;
    graph(cudaGraphExec_t g, int dev) : g_(g), dev_(dev) {}
    void reset() noexcept {
      if (!g_) return;
      const cuda::device_restore keep(dev_);
      FERRY_CUDA_LOG(cudaGraphExecDestroy(g_));
      g_ = nullptr;
    }
    cudaGraphExec_t g_ = nullptr;
    int dev_ = 0;
  };
  // cuBLAS's workspace for captured GEMMs: NVIDIA's recommended size for Hopper (and
  // ample for earlier GPUs).
  static constexpr std::size_t workspace_bytes = std::size_t(32) << 20;

  // Captures what enqueue() puts on the stream into a graph and instantiates it; nothing
  // runs until launch(). enqueue() must only enqueue (no host waits, no allocation: those
  // fail the capture with a cuda_error). If it throws, the capture is ended and dropped,
  // and the exception propagates.
  template <class F>
  graph capture(F&& enqueue) {
    make_current();
    if (!workspace_) {
      workspace_ = alloc(workspace_bytes / sizeof(float));
      detail::blas_check(cublasSetWorkspace(blas_, workspace_, workspace_bytes), "cublasSetWorkspace", dev_);
    }
    FERRY_CUDA_TRY(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    cudaGraph_t g = nullptr;
    try {
      enqueue();
    } catch (...) {
      make_current();
      if (cudaStreamEndCapture(stream_, &g) == cudaSuccess && g) cudaGraphDestroy(g);
      cudaGetLastError();  // the failed capture's status is not the error being thrown
      throw;
    }
    make_current();
    FERRY_CUDA_TRY(cudaStreamEndCapture(stream_, &g));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t made = cudaGraphInstantiate(&exec, g, 0);
    FERRY_CUDA_LOG(cudaGraphDestroy(g));
    FERRY_CUDA_TRY(made);
    return graph(exec, dev_);
  }
  // Enqueues one run of g on the stream (no wait).
  void launch(const graph& g) {
    make_current();
    FERRY_CUDA_TRY(cudaGraphLaunch(g.g_, stream_));
  }
  // Host-to-device copy, waited for (src may be a temporary); throws cuda_error.
  void upload(void* dst, const void* src, std::size_t bytes) {
    make_current();
    FERRY_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    sync();  // src may be a temporary on the caller's stack
  }
  // Device-to-host copy, waited for; throws cuda_error (also for an earlier fault on the
  // stream).
  void download(void* dst, const void* src, std::size_t bytes) {
    make_current();
    FERRY_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    sync();
  }
  // Waits for the stream; throws cuda_error for a fault its work met.
  void sync() { FERRY_CUDA_TRY(cudaStreamSynchronize(stream_)); }
  // Step marks, in a ring of `marks` events on the stream: mirrored_trainer records one
  // after each step and, with NCCL, polls the one `marks` steps back before enqueuing
  // another (at most `marks` steps in flight). Events made on first use.
  static constexpr std::uint64_t marks = 3;
  // Records step's mark on the stream (no wait); throws cuda_error.
  void mark(std::uint64_t step) {
    cudaEvent_t& e = marks_[step % marks];
    make_current();
    if (!e) FERRY_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    FERRY_CUDA_TRY(cudaEventRecord(e, stream_));
  }
  // True once the stream has run past mark(step) (or no mark was recorded in its slot).
  bool marked(std::uint64_t step) const {
    const cudaEvent_t e = marks_[step % marks];
    return !e || ready(cudaEventQuery(e), "cudaEventQuery(step mark)");
  }
  // True once the stream has run everything enqueued on it (cudaStreamQuery, no wait).
  // Throws cuda_error for a fault the stream's work met.
  bool idle() const { return ready(cudaStreamQuery(stream_), "cudaStreamQuery(replica stream)"); }

 private:
  void make_current() const { FERRY_CUDA_TRY(cudaSetDevice(dev_)); }
  // Frees what the backend made, on its device, the caller's device kept; logs failures.
  void release() noexcept {
    const cuda::device_restore keep(dev_);
    if (stream_) FERRY_CUDA_LOG(cudaStreamSynchronize(stream_));
    for (float* p : blocks_) FERRY_CUDA_LOG(cudaFree(p));
    for (cudaEvent_t e : marks_)
      if (e) FERRY_CUDA_LOG(cudaEventDestroy(e));
    if (blas_) cublasDestroy(blas_);
    if (own_stream_) FERRY_CUDA_LOG(cudaStreamDestroy(stream_));
  }
  // A query's answer: false while not ready; throws cuda_error for any other failure.
  static bool ready(cudaError_t st, const char* call) {
    if (st == cudaErrorNotReady) return false;
    if (st != cudaSuccess) cuda::detail::throw_cuda_error(st, call, __FILE__, __LINE__);
    return true;
  }

  int dev_;
  cudaStream_t stream_ = nullptr;
  bool own_stream_ = false;
  cublasHandle_t blas_ = nullptr;
  std::vector<float*> blocks_;
  float* workspace_ = nullptr;     // cuBLAS's, set before the first capture (one of blocks_)
  cudaEvent_t marks_[marks] = {};  // see mark()
};

}  // namespace ferry::train
