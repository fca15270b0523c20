// ferry/stages/cache_on_device.cuh: the gather kernel of ferry/stages/cache_on_device.hpp
// (nvcc only), and ferry::cuda::cache_on_device, the stage for GPU replicas (and host ones).
//
//   #include "ferry/stages/cache_on_device.cuh"    // in a .cu file
//   auto steps = ... | ferry::distribute(ferry::cuda::devices{0, 1})
//              | ferry::cuda::cache_on_device({.budget_bytes = 20ull << 30, .seed = 7});
//
// Each later epoch, one launch per field and replica, on the replica's stream: row p of the
// epoch buffer = row perm(p) of the cache, perm the Feistel permutation of the replica's
// rows computed in the kernel (passed by value: nothing is copied from the host). Threads
// copy 16-byte words when the rows allow it, else bytes, a grid-stride loop over rows x
// words. With across_replicas, replica r's kernel reads the rows it serves from every
// replica's cache (peer memory), finding each through epoch 0's step layout. Needs --expt-relaxed-constexpr (random.hpp's constexpr draws are called in the
// kernel). Throws cuda_error when a launch fails. Runs on the caller's thread; enqueues only.
#pragma once

#if !defined(__CUDACC__)
#error "ferry/stages/cache_on_device.cuh needs nvcc: include ferry/stages/cache_on_device.hpp from code g++ compiles"
#endif
#if !defined(__CUDACC_RELAXED_CONSTEXPR__)
#error "ferry/stages/cache_on_device.cuh: compile with --expt-relaxed-constexpr (the kernel calls ferry/detail/random.hpp)"
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ferry/cuda/error.hpp"
#include "ferry/stages/cache_on_device.hpp"

namespace ferry {
namespace detail {

template <class W>
__global__ void gather_rows_kernel(const W* src, W* dst, std::uint64_t rows, std::uint64_t words,
                                   feistel_permutation perm, bool shuffle) {
  const std::uint64_t total = rows * words;
  for (std::uint64_t i = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += std::uint64_t(gridDim.x) * blockDim.x) {
    const std::uint64_t p = i / words, w = i % words;
    dst[p * words + w] = src[(shuffle ? perm(p) : p) * words + w];
  }
}

// across_replicas: replica r's epoch row p = row i of replica q's cache (q's memory, read
// through peer access), (q, i) where perm(p's global index) was cached.
template <class W>
__global__ void gather_global_kernel(const W* const* srcs, W* dst, std::uint64_t rows, std::uint64_t words,
                                     cache_layout_view layout, std::uint64_t replica, feistel_permutation perm) {
  const std::uint64_t total = rows * words;
  for (std::uint64_t i = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += std::uint64_t(gridDim.x) * blockDim.x) {
    const std::uint64_t p = i / words, w = i % words;
    std::uint64_t q = 0, row = 0;
    layout.owner(perm(layout.global(replica, p)), q, row);
    dst[p * words + w] = srcs[q][row * words + w];
  }
}

// The launcher cache_on_device_source uses for device replicas (the replica's device is
// current).
struct gather_kernel {
  // Enqueues the gather on stream s; throws cuda_error.
  static void launch(const gather_args& a, cuda_stream s) {
    if (a.rows == 0 || a.row_bytes == 0) return;
    const feistel_permutation perm(a.rows, a.key);
    const bool wide = a.row_bytes % 16 == 0 && reinterpret_cast<std::uintptr_t>(a.src) % 16 == 0 &&
                      reinterpret_cast<std::uintptr_t>(a.dst) % 16 == 0;
    const std::uint64_t words = wide ? a.row_bytes / 16 : a.row_bytes;
    const std::uint64_t blocks = std::min<std::uint64_t>((a.rows * words + 255) / 256, 65535);
    const auto st = static_cast<cudaStream_t>(s);
    if (wide)
      gather_rows_kernel<<<unsigned(blocks), 256, 0, st>>>(reinterpret_cast<const uint4*>(a.src),
                                                            reinterpret_cast<uint4*>(a.dst), a.rows, words, perm,
                                                            a.shuffle);
    else
      gather_rows_kernel<<<unsigned(blocks), 256, 0, st>>>(reinterpret_cast<const unsigned char*>(a.src),
                                                            reinterpret_cast<unsigned char*>(a.dst), a.rows, words,
                                                            perm, a.shuffle);
    FERRY_CUDA_TRY(cudaGetLastError());
  }
  // across_replicas: enqueues replica a.replica's gather from every replica's cache on
  // stream s; throws cuda_error.
  static void launch_global(const global_gather_args& a, cuda_stream s) {
    if (a.rows == 0 || a.row_bytes == 0) return;
    const feistel_permutation perm(a.total_rows, a.key);
    const bool wide = a.row_bytes % 16 == 0 && reinterpret_cast<std::uintptr_t>(a.dst) % 16 == 0;
    const std::uint64_t words = wide ? a.row_bytes / 16 : a.row_bytes;
    const std::uint64_t blocks = std::min<std::uint64_t>((a.rows * words + 255) / 256, 65535);
    const auto st = static_cast<cudaStream_t>(s);
    if (wide)
      gather_global_kernel<<<unsigned(blocks), 256, 0, st>>>(reinterpret_cast<const uint4* const*>(a.srcs),
                                                              reinterpret_cast<uint4*>(a.dst), a.rows, words, a.layout,
                                                              a.replica, perm);
    else
      gather_global_kernel<<<unsigned(blocks), 256, 0, st>>>(reinterpret_cast<const unsigned char* const*>(a.srcs),
                                                              reinterpret_cast<unsigned char*>(a.dst), a.rows, words,
                                                              a.layout, a.replica, perm);
    FERRY_CUDA_TRY(cudaGetLastError());
  }
};

}  // namespace detail

namespace cuda {
// cache_on_device(options) for GPU replicas (and host ones): see cache_on_device.hpp.
inline constexpr ferry::detail::cache_on_device_t<ferry::detail::gather_kernel> cache_on_device{};
// The kernels' launcher, for a launcher that code g++ compiles declares and a .cu file
// defines (ferry::cache_on_device_with, cache_on_device.hpp).
using cache_gather_launcher = ferry::detail::gather_kernel;
}  // namespace cuda

}  // namespace ferry
