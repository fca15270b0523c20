// Host entry points of gpu_kernels.cu (compiled by nvcc), callable from g++ code.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace ferry_test {
// Spins one warp for `cycles` GPU clocks on `stream`, reading in[0..31] (may be null).
cudaError_t launch_spin(void* stream, long long cycles, const void* in, float* out);
// *out += sum of ids[0..n).
cudaError_t launch_sum_ids(void* stream, const std::uint32_t* ids, std::size_t n, unsigned long long* out);
// A stand-in for a training step: reads x[0..n) once, then computes until `cycles` GPU
// clocks have passed (each block on its own clock).
cudaError_t launch_consume(void* stream, const float* x, std::size_t n, long long cycles, float* out);
long long cycles_for_ms(double ms);
}  // namespace ferry_test
