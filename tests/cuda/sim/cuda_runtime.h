// The simulated runtime's <cuda_runtime.h>: the API (cuda_runtime_api.h) and, for code
// written for nvcc and compiled here by g++, execution-space specifiers that mean nothing.
#pragma once

#include "cuda_runtime_api.h"

#ifndef __host__
#define __host__
#endif
#ifndef __device__
#define __device__
#endif

// The runtime's C++ conveniences that ferry's code relies on (as in the real header).
template <class T>
inline cudaError_t cudaMalloc(T** p, std::size_t n) {
  return ::cudaMalloc(reinterpret_cast<void**>(p), n);
}
