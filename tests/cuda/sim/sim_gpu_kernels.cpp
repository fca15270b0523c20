// The GPU tests' and benchmarks' kernels (tests/cuda/gpu_kernels.hpp; nvcc builds them from
// gpu_kernels.cu) as simulated kernels, so the programs that launch them can run on the
// simulated runtime: the same device reads and writes, checked for races; no timing.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "../gpu_kernels.hpp"

namespace ferry_test {

cudaError_t launch_spin(void* stream, long long, const void* in, float* out) {
  std::vector<sim::range> reads, writes;
  if (in) reads.push_back({in, 32 * sizeof(float)});
  if (out) writes.push_back({out, sizeof(float)});
  sim::launch(static_cast<cudaStream_t>(stream), "spin kernel", reads, writes, [in, out] {
    if (out) *out = in ? static_cast<const float*>(in)[0] : 0.0f;
  });
  return cudaGetLastError();
}

cudaError_t launch_sum_ids(void* stream, const std::uint32_t* ids, std::size_t n, unsigned long long* out) {
  sim::launch(static_cast<cudaStream_t>(stream), "sum_ids kernel", {{ids, n * sizeof(std::uint32_t)}},
              {{out, sizeof *out}}, [ids, n, out] {
                for (std::size_t i = 0; i < n; ++i) *out += ids[i];
              });
  return cudaGetLastError();
}

// One pass whatever `passes` says: the sim has no time to spend.
cudaError_t launch_consume(void* stream, const float* x, std::size_t n, int, float* out) {
  sim::launch(static_cast<cudaStream_t>(stream), "consume kernel", {{x, n * sizeof(float)}}, {}, [x, n, out] {
    float acc = 0.f;
    for (std::size_t i = 0; i < n; ++i) acc += x[i] * 1.0001f;
    if (acc == 12345.678f) *out = acc;
  });
  return cudaGetLastError();
}

long long cycles_for_ms(double ms) { return static_cast<long long>(ms * 1.0e6); }

}  // namespace ferry_test
