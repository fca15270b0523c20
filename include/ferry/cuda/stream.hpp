// ferry/cuda/stream.hpp: RAII for the runtime objects distribute() drives: the current
// device, streams and events. Plain C++ over the runtime API (no kernels): compiles with
// g++ when FERRY_WITH_CUDART is set, and to nothing otherwise.
//
//   ferry::cuda::device_guard g(1);          // device 1 current until g dies
//   ferry::cuda::device_restore keep;        // whatever is current now, back when keep dies
//   auto s = ferry::cuda::stream::create(1); // a non-blocking stream on device 1
//   auto e = ferry::cuda::event::create();   // timing disabled: cheapest to record/wait
//
// Constructors and methods throw ferry::cuda_error naming the call, device and status;
// destructors log failures and never throw. No user code runs.
#pragma once

#include "ferry/config.hpp"

#if defined(FERRY_WITH_CUDART)
#include <cuda_runtime_api.h>

#include <utility>

#include "ferry/cuda/error.hpp"

namespace ferry::cuda {

// Makes `device` current for its lifetime; restores the previous one after.
class device_guard {
 public:
  explicit device_guard(int device) {
    FERRY_CUDA_TRY(cudaGetDevice(&prev_));
    if (prev_ != device) FERRY_CUDA_TRY(cudaSetDevice(device));
    changed_ = prev_ != device;
  }
  ~device_guard() {
    if (changed_) FERRY_CUDA_LOG(cudaSetDevice(prev_));
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;

 private:
  int prev_ = 0;
  bool changed_ = false;
};

// Puts the calling thread's current device back when the scope ends, however many devices
// the scope made current in between, and never throws: for destructors, noexcept paths and
// calls that move through several devices (device_guard throws, and puts back only a
// device it set itself). With `device`, that device is made current now. A failure to read
// or set a device is logged, not thrown: with no device to read, none is put back.
class device_restore {
 public:
  device_restore() noexcept {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
  }
  explicit device_restore(int device) noexcept : device_restore() {
    if (device >= 0 && device != prev_) FERRY_CUDA_LOG(cudaSetDevice(device));
  }
  ~device_restore() {
    int now = -1;
    if (prev_ >= 0 && (cudaGetDevice(&now) != cudaSuccess || now != prev_)) FERRY_CUDA_LOG(cudaSetDevice(prev_));
  }
  device_restore(const device_restore&) = delete;
  device_restore& operator=(const device_restore&) = delete;

 private:
  int prev_ = -1;
};

// A stream: owned (created here, destroyed with this) or borrowed (the user's).
class stream {
 public:
  stream() = default;
  // A new stream on `device` that does not synchronise with the legacy default stream.
  static stream create(int device) {
    device_guard g(device);
    stream s;
    FERRY_CUDA_TRY(cudaStreamCreateWithFlags(&s.s_, cudaStreamNonBlocking));
    s.owned_ = true;
    s.device_ = device;
    return s;
  }
  static stream borrow(cudaStream_t s, int device) {
    stream r;
    r.s_ = s;
    r.device_ = device;
    return r;
  }
  stream(stream&& o) noexcept
      : s_(std::exchange(o.s_, nullptr)), owned_(std::exchange(o.owned_, false)), device_(o.device_) {}
  stream& operator=(stream&& o) noexcept {
    if (this != &o) {
      reset();
      s_ = std::exchange(o.s_, nullptr);
      owned_ = std::exchange(o.owned_, false);
      device_ = o.device_;
    }
    return *this;
  }
  ~stream() { reset(); }

  cudaStream_t get() const noexcept { return s_; }
  int device() const noexcept { return device_; }
  bool owned() const noexcept { return owned_; }
  void synchronize() const { FERRY_CUDA_TRY(cudaStreamSynchronize(s_)); }
  void synchronize_noexcept() const noexcept { FERRY_CUDA_LOG(cudaStreamSynchronize(s_)); }

 private:
  void reset() noexcept {
    if (owned_ && s_) {
      const device_restore keep(device_);
      FERRY_CUDA_LOG(cudaStreamDestroy(s_));
    }
    s_ = nullptr;
    owned_ = false;
  }
  cudaStream_t s_ = nullptr;
  bool owned_ = false;
  int device_ = 0;
};

// An owned event on the current device.
class event {
 public:
  event() = default;
  static event create(bool timing = false) {
    event e;
    FERRY_CUDA_TRY(cudaEventCreateWithFlags(&e.e_, timing ? cudaEventDefault : cudaEventDisableTiming));
    return e;
  }
  event(event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  event& operator=(event&& o) noexcept {
    if (this != &o) {
      if (e_) FERRY_CUDA_LOG(cudaEventDestroy(e_));
      e_ = std::exchange(o.e_, nullptr);
    }
    return *this;
  }
  ~event() {
    if (e_) FERRY_CUDA_LOG(cudaEventDestroy(e_));
  }
  cudaEvent_t get() const noexcept { return e_; }
  void record(cudaStream_t s) { FERRY_CUDA_TRY(cudaEventRecord(e_, s)); }
  // True when the work recorded before it has finished (never blocks).
  bool ready() const {
    const cudaError_t st = cudaEventQuery(e_);
    if (st == cudaErrorNotReady) return false;
    FERRY_CUDA_TRY(st);
    return true;
  }
  void synchronize() const { FERRY_CUDA_TRY(cudaEventSynchronize(e_)); }
  // Milliseconds between two timing events.
  static float elapsed_ms(const event& a, const event& b) {
    float ms = 0;
    FERRY_CUDA_TRY(cudaEventElapsedTime(&ms, a.e_, b.e_));
    return ms;
  }

 private:
  cudaEvent_t e_ = nullptr;
};

}  // namespace ferry::cuda
#endif
