// The GPU tests' and benchmarks' kernels (tests/cuda/gpu_kernels.hpp; nvcc builds them from
// gpu_kernels.cu) as simulated kernels, so the programs that launch them can run on the
// simulated runtime: the same device reads and writes, checked for races, and a duration
// in virtual time (a 1 GHz clock for the spin; 3 TB/s of device memory for the others).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "../gpu_kernels.hpp"

namespace ferry_test {

namespace {
constexpr double clock_hz = 1e9, memory_bytes_per_s = 3e12;
}

cudaError_t launch_spin(void* stream, long long cycles, const void* in, float* out) {
  std::vector<sim::range> reads, writes;
  if (in) reads.push_back({in, 32 * sizeof(float)});
  if (out) writes.push_back({out, sizeof(float)});
  sim::launch(static_cast<cudaStream_t>(stream), "spin kernel", reads, writes, [in, out] {
    if (out) *out = in ? static_cast<const float*>(in)[0] : 0.0f;
  }, static_cast<double>(cycles) / clock_hz);
  return cudaGetLastError();
}

cudaError_t launch_sum_ids(void* stream, const std::uint32_t* ids, std::size_t n, unsigned long long* out) {
  sim::launch(static_cast<cudaStream_t>(stream), "sum_ids kernel", {{ids, n * sizeof(std::uint32_t)}},
              {{out, sizeof *out}}, [ids, n, out] {
                for (std::size_t i = 0; i < n; ++i) *out += ids[i];
              }, static_cast<double>(n * sizeof(std::uint32_t)) / memory_bytes_per_s);
  return cudaGetLastError();
}

// One read of x, timed as the longer of that read and `cycles`.
cudaError_t launch_consume(void* stream, const float* x, std::size_t n, long long cycles, float* out) {
  sim::launch(static_cast<cudaStream_t>(stream), "consume kernel", {{x, n * sizeof(float)}}, {}, [x, n, out] {
    float acc = 0.f;
    for (std::size_t i = 0; i < n; ++i) acc += x[i] * 1.0001f;
    if (acc == 12345.678f) *out = acc;
  }, std::max(static_cast<double>(n * sizeof(float)) / memory_bytes_per_s, static_cast<double>(cycles) / clock_hz));
  return cudaGetLastError();
}

long long cycles_for_ms(double ms) { return static_cast<long long>(ms * 1e-3 * clock_hz); }

}  // namespace ferry_test
