// ferry/cuda/nvtx.hpp: NVTX ranges, so Nsight Systems shows ferry's work (distribute's
// copies, a training step) on the timeline next to the user's kernels.
//
//   ferry::enable_nvtx();                              // or FERRY_NVTX=1 in the environment
//   { ferry::cuda::nvtx_range r("my step"); ... }      // a range on this thread
//
// Uses NVTX3 (header-only, in the CUDA toolkit's include/nvtx3) when the build drives the
// CUDA runtime (FERRY_WITH_CUDART) and the header is there; otherwise the ranges compile
// to nothing. Off by default: then a range costs one relaxed load and a branch. With no
// profiler attached NVTX itself is a call to an empty function.
// `name` must outlive the range (a string literal). Throws nothing; any thread.
#pragma once

#include "ferry/config.hpp"
#include "ferry/observe/hooks.hpp"

#if defined(FERRY_WITH_CUDART) && defined(__has_include)
#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define FERRY_HAVE_NVTX 1
#endif
#endif

namespace ferry {

// Turns ferry's NVTX ranges on or off, process-wide.
inline void enable_nvtx(bool on = true) noexcept { observe::set_bit(observe::nvtx_bit, on); }

// Whether this build can emit NVTX ranges at all.
inline constexpr bool nvtx_available() noexcept {
#if defined(FERRY_HAVE_NVTX)
  return true;
#else
  return false;
#endif
}

namespace cuda {

// An NVTX range for the object's lifetime (RAII), when NVTX is built in and turned on.
class nvtx_range {
 public:
  // Pushes a range named `name` (a string that outlives the call) if NVTX is on.
  explicit nvtx_range(const char* name) noexcept {
#if defined(FERRY_HAVE_NVTX)
    if (observe::nvtx_on()) {
      nvtxRangePushA(name);
      pushed_ = true;
    }
#else
    (void)name;
#endif
  }
  ~nvtx_range() {
#if defined(FERRY_HAVE_NVTX)
    if (pushed_) nvtxRangePop();
#endif
  }
  nvtx_range(const nvtx_range&) = delete;
  nvtx_range& operator=(const nvtx_range&) = delete;

 private:
  [[maybe_unused]] bool pushed_ = false;
};

}  // namespace cuda
}  // namespace ferry
