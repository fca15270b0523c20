// ferry/cuda/runtime.hpp: is there a usable CUDA device? Detected once per process.
//
//   if (ferry::cuda::available()) ...          // a driver and at least one device
//   ferry::cuda::device_count()                // 0 without a driver, a device or cudart
//   ferry::cuda::unavailable_reason()          // why not, in words (for skipped tests)
//
// Without a driver every runtime call fails with cudaErrorInsufficientDriver (35) and the
// error is sticky, so the probe asks cudaDriverGetVersion first (0 means no driver) and
// only then cudaGetDeviceCount; error 35, no-device (100) or a count of 0 all mean "none".
// The answer is computed on first use (thread-safe) and never changes. Throws nothing.
#pragma once

#include <string>

#include "ferry/config.hpp"

#if defined(FERRY_WITH_CUDART)
#include <cuda_runtime_api.h>
#endif

// The CUDA layer: device detection, streams, device buffers and distribute()'s device
// backend.
namespace ferry::cuda {

namespace detail {
struct probe_result {
  int count = 0;
  std::string reason;
};

inline const probe_result& probe() noexcept {
  static const probe_result r = []() noexcept {
    probe_result p;
#if defined(FERRY_WITH_CUDART)
    int drv = 0;
    if (cudaDriverGetVersion(&drv) != cudaSuccess || drv == 0) {
      (void)cudaGetLastError();
      p.reason = "no NVIDIA driver (cudaDriverGetVersion reports none)";
      return p;
    }
    int n = 0;  // left untouched on failure
    const cudaError_t st = cudaGetDeviceCount(&n);
    if (st != cudaSuccess) {
      (void)cudaGetLastError();
      p.reason = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(st) + " (" +
                 std::to_string(static_cast<int>(st)) + ")";
      return p;
    }
    if (n <= 0) {
      p.reason = "the driver reports no CUDA device";
      return p;
    }
    p.count = n;
#else
    p.reason = "built without the CUDA runtime (FERRY_WITH_CUDART not set)";
#endif
    return p;
  }();
  return r;
}
}  // namespace detail

// The number of usable CUDA devices: 0 without a driver, a device or the runtime.
inline int device_count() noexcept { return detail::probe().count; }
// Whether there is at least one usable device.
inline bool available() noexcept { return device_count() > 0; }
// Why there is none, in words (empty when there is one).
inline const std::string& unavailable_reason() noexcept { return detail::probe().reason; }

}  // namespace ferry::cuda
