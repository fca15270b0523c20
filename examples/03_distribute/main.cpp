// 03_distribute: split each global batch across replicas, one step at a time.
//
// Runs with host replicas everywhere; built with the CUDA runtime and run on a machine
// with a GPU, it also feeds two replicas (on devices 0 and 1 when there are two GPUs or
// more, both on device 0 otherwise) and checks a sum.
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <vector>

#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/prefetch.hpp"
#if defined(FERRY_WITH_CUDART)
#include "ferry/cuda/devices.hpp"
#include "ferry/cuda/runtime.hpp"
#endif

int main() {
  std::vector<std::uint32_t> ids(1000);
  std::iota(ids.begin(), ids.end(), 1u);

  // 4 replicas, global batch 64 (16 rows each); the last 40 rows padded to 64, masked.
  auto steps = ferry::from_range(ids) | ferry::batch(64) | ferry::prefetch(2) |
               ferry::distribute(ferry::host_replicas{4}, {.remainder = ferry::remainder_policy::pad});
  std::uint64_t sum = 0, nsteps = 0;
  for (auto& step : steps) {
    for (std::size_t r = 0; r < step.replicas(); ++r) {
      auto& rb = step[r];
      auto x = rb.field<0>();
      for (std::size_t i = 0; i < rb.valid(); ++i) sum += x[i];  // rows >= valid() are padding
    }
    ++nsteps;
  }
  std::printf("host replicas: %llu steps, sum %llu (expected %llu)\n", (unsigned long long)nsteps,
              (unsigned long long)sum, 1000ull * 1001 / 2);

#if defined(FERRY_WITH_CUDART)
  if (ferry::cuda::available()) {
    const int n = ferry::cuda::device_count();
    ferry::cuda::devices devs = n > 1 ? ferry::cuda::devices{0, 1} : ferry::cuda::devices{0, 0};
    auto gpu = ferry::from_range(ids) | ferry::batch(64) | ferry::prefetch(2) |
               ferry::distribute(devs, {.remainder = ferry::remainder_policy::partial});
    std::uint64_t gsum = 0;
    for (auto& step : gpu)
      for (auto& rb : step) {
        // A real program launches kernels on rb.stream(); here: copy back and add up.
        std::vector<std::uint32_t> h(rb.size());
        if (rb.size())
          cudaMemcpyAsync(h.data(), rb.field<0>().data(), rb.field_bytes(0).size(), cudaMemcpyDeviceToHost,
                          static_cast<cudaStream_t>(rb.stream()));
        cudaStreamSynchronize(static_cast<cudaStream_t>(rb.stream()));
        gsum += std::accumulate(h.begin(), h.end(), std::uint64_t{0});
      }
    std::printf("cuda replicas: sum %llu\n", (unsigned long long)gsum);
    if (gsum != sum) return 1;
  } else {
    std::printf("cuda replicas: skipped (%s)\n", ferry::cuda::unavailable_reason().c_str());
  }
#endif
  return sum == 1000ull * 1001 / 2 ? 0 : 1;
}
