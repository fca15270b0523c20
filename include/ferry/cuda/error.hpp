// ferry/cuda/error.hpp: CUDA runtime failures as exceptions.
//
//   FERRY_CUDA_TRY(cudaMemcpyAsync(...));    // throws ferry::cuda_error on failure
//   FERRY_CUDA_LOG(cudaFree(p));             // noexcept: logs to stderr, for destructors
//
// cuda_error names the API call, the device that was current, the status (number and
// name), the source location and the host. It is defined with or without the runtime so
// code that catches it compiles in CPU-only builds; the macros need FERRY_WITH_CUDART.
// Both macros run on the calling thread and name the device current on that thread; they
// run no user code.
#pragma once

#include <cstdio>
#include <string>
#include <utility>

#include "ferry/config.hpp"
#include "ferry/error.hpp"

#if defined(FERRY_WITH_CUDART)
#include <cuda_runtime_api.h>
#endif
#if defined(__unix__)
#include <unistd.h>
#endif

namespace ferry {

// A failed CUDA runtime call: the message names the call, the device, the status, the
// source location and the host (see the file's top).
class cuda_error : public error {
 public:
  // Built by FERRY_CUDA_TRY; status_name and status_text are cudaGetErrorName / String's.
  cuda_error(std::string call, int device, int status, std::string status_name,
             std::string status_text, const char* file, int line)
      : error(call + " failed on device " + std::to_string(device) + " of " + host_name() +
              ": status " + std::to_string(status) + " (" + status_name + ": " + status_text +
              ") at " + file + ":" + std::to_string(line)),
        call_(std::move(call)), device_(device), status_(status) {}
  // The failing call as written in the source, e.g. "cudaMemcpyAsync(dst, src, n, ...)".
  const std::string& call() const noexcept { return call_; }
  // The device current when it failed (-1 when none could be determined).
  int device() const noexcept { return device_; }
  // The cudaError_t value.
  int status() const noexcept { return status_; }

  // This machine's host name ("unknown host" when it cannot be read), for the message.
  static std::string host_name() {
#if defined(__unix__)
    char h[256] = {};
    if (::gethostname(h, sizeof h - 1) == 0) return h;
#endif
    return "unknown host";
  }

 private:
  std::string call_;
  int device_;
  int status_;
};

#if defined(FERRY_WITH_CUDART)
namespace cuda::detail {

inline int current_device_or_minus_one() noexcept {
  int d = -1;
  if (cudaGetDevice(&d) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return d;
}

// The error of a failed call on `device` (named by the caller: the current device may be
// another, e.g. when cudaSetDevice itself failed), `call` saying what was asked (with
// sizes, ranks). Clears a non-sticky error so the next call starts clean.
inline cuda_error make_cuda_error(cudaError_t st, std::string call, int device, const char* file, int line) {
  (void)cudaGetLastError();
  return cuda_error(std::move(call), device, static_cast<int>(st), cudaGetErrorName(st), cudaGetErrorString(st),
                    file, line);
}

[[noreturn]] inline void throw_cuda_error(cudaError_t st, const char* call, const char* file,
                                          int line) {
  throw make_cuda_error(st, call, current_device_or_minus_one(), file, line);
}

inline void log_cuda_error(cudaError_t st, const char* call, const char* file, int line) noexcept {
  // At process exit the runtime may already be unloading: nothing left to free or report.
  if (st == cudaErrorCudartUnloading) return;
  (void)cudaGetLastError();
  std::fprintf(stderr, "ferry: %s failed on device %d: status %d (%s) at %s:%d (ignored)\n",
               call, current_device_or_minus_one(), static_cast<int>(st), cudaGetErrorName(st),
               file, line);
}

}  // namespace cuda::detail

#define FERRY_CUDA_TRY(expr)                                                              \
  do {                                                                                    \
    const cudaError_t ferry_cuda_status_ = (expr);                                        \
    if (ferry_cuda_status_ != cudaSuccess)                                                \
      ::ferry::cuda::detail::throw_cuda_error(ferry_cuda_status_, #expr, __FILE__, __LINE__); \
  } while (0)

// For destructors and other noexcept paths: logs the failure and carries on.
#define FERRY_CUDA_LOG(expr)                                                              \
  do {                                                                                    \
    const cudaError_t ferry_cuda_status_ = (expr);                                        \
    if (ferry_cuda_status_ != cudaSuccess)                                                \
      ::ferry::cuda::detail::log_cuda_error(ferry_cuda_status_, #expr, __FILE__, __LINE__); \
  } while (0)
#endif

}  // namespace ferry
