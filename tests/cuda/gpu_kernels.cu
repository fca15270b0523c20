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

// A stand-in for a training step: reads every float of the batch once, then each block
// computes until `cycles` of its clock have passed since it started. Its time is the larger
// of the read and the cycles, whatever the data and wherever it sits in the caches (a
// kernel that read the batch many times ran 30% faster on a block just written by a copy
// than on a buffer re-read from L2, which made a step fed by distribute look faster than
// one on device-resident data).
__global__ void consume_kernel(const float* x, std::size_t n, long long cycles, float* out) {
  const long long t0 = clock64();
  float acc = 0.f;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    acc += x[i] * 1.0001f;
  while (clock64() - t0 < cycles) acc = acc * 0.999f + 1.f;
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

cudaError_t launch_consume(void* stream, const float* x, std::size_t n, long long cycles, float* out) {
  consume_kernel<<<264, 256, 0, static_cast<cudaStream_t>(stream)>>>(x, n, cycles, out);
  return cudaGetLastError();
}

long long cycles_for_ms(double ms) {
  int khz = 0;
  if (cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0) != cudaSuccess) return 0;
  return static_cast<long long>(ms * khz);
}

}  // namespace ferry_test
