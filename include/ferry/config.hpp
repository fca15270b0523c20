// ferry/config.hpp: compile-time switches shared by every header. Macros only: runs no
// code, throws nothing.
#pragma once

// Functors that may run on the device carry FERRY_HOST_DEVICE: one source of math for
// the host (g++) and device (nvcc) backends.
#if defined(__CUDACC__)
#define FERRY_HOST_DEVICE __host__ __device__
#else
#define FERRY_HOST_DEVICE
#endif

// FERRY_WITH_CUDART: set by the build when the CUDA runtime API is linked into a g++
// target. Host code that only drives the runtime (streams, events, cudaHostAlloc) is
// plain C++ and compiles under this macro; kernels live in .cuh files.
#if !defined(FERRY_WITH_CUDART) && defined(__CUDACC__)
#define FERRY_WITH_CUDART 1
#endif
