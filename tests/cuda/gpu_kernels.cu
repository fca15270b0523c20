// Kernels the GPU tests and benchmark launch, behind plain host functions so the
// pipeline code itself compiles with g++ (ferry's .hpp headers never need nvcc).
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "gpu_kernels.hpp"

namespace {
__global__ void spin_kernel(long long cycles, const float* in, float* out) {
  const long long t0 = clock64();
  float acc = in ? in[threadIdx.x] : 0.f;
  while (clock64() - t0 < cycles) acc = acc * 0.999f + 1.f;
  if (threadIdx.x == 0 && out) *out = acc;
}

__global__ void sum_ids_kernel(const std::uint32_t* ids, std::size_t n, unsigned long long* out) {
  unsigned long long s = 0;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) s += ids[i];
  atomicAdd(out, s);
}

// Reads every float once (a bandwidth-bound consumer): out += sum.
__global__ void consume_kernel(const float* x, std::size_t n, int passes, float* out) {
  float acc = 0.f;
  for (int p = 0; p < passes; ++p)
    for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
      acc += x[i] * 1.0001f;
  if (acc == 12345.678f) *out = acc;  // keeps the loads alive without a reduction
}
}  // namespace

namespace ferry_test {

cudaError_t launch_spin(void* stream, long long cycles, const void* in, float* out) {
  spin_kernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(cycles, static_cast<const float*>(in), out);
  return cudaGetLastError();
}

cudaError_t launch_sum_ids(void* stream, const std::uint32_t* ids, std::size_t n, unsigned long long* out) {
  sum_ids_kernel<<<4, 128, 0, static_cast<cudaStream_t>(stream)>>>(ids, n, out);
  return cudaGetLastError();
}

cudaError_t launch_consume(void* stream, const float* x, std::size_t n, int passes, float* out) {
  consume_kernel<<<264, 256, 0, static_cast<cudaStream_t>(stream)>>>(x, n, passes, out);
  return cudaGetLastError();
}

long long cycles_for_ms(double ms) {
  int khz = 0;
  if (cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0) != cudaSuccess) return 0;
  return static_cast<long long>(ms * khz);
}

}  // namespace ferry_test
