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
// replica's cache (peer memory), finding each through epoch 0's step layout. With a
// device_exchange, each replica plans its trade instead (one kernel computes both sort
// keys of every row, CUB's radix sort orders them over only the bits the keys use, a
// kernel finds each replica's start), and packs and unpacks rows by the plan's indices.
// Needs --expt-relaxed-constexpr (random.hpp's constexpr draws are called in the kernel).
// Throws cuda_error when a launch fails. Runs on the caller's thread; enqueues only.
#pragma once

#if !defined(__CUDACC__)
#error "ferry/stages/cache_on_device.cuh needs nvcc: include ferry/stages/cache_on_device.hpp from code g++ compiles"
#endif
#if !defined(__CUDACC_RELAXED_CONSTEXPR__)
#error "ferry/stages/cache_on_device.cuh: compile with --expt-relaxed-constexpr (the kernel calls ferry/detail/random.hpp)"
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cstdint>

#include <cub/device/device_radix_sort.cuh>

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

// A replica's trade plan (exchange_plan_args): held row i's key to send (where it goes)
// and to receive (where epoch row i comes from), and i itself.
__global__ void plan_keys_kernel(plan_keys keys, std::uint64_t replica, std::uint64_t rows, std::uint64_t* send_keys,
                                 std::uint64_t* recv_keys, std::uint64_t* vals) {
  for (std::uint64_t i = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows;
       i += std::uint64_t(gridDim.x) * blockDim.x) {
    send_keys[i] = keys.send(replica, i);
    recv_keys[i] = keys.recv(replica, i);
    vals[i] = i;
  }
}
// at[q] = the first sorted key of replica q or later (q = 0 .. replicas).
__global__ void plan_bounds_kernel(const std::uint64_t* keys, std::uint64_t rows, std::uint64_t replicas,
                                   std::uint64_t* at) {
  for (std::uint64_t q = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; q <= replicas;
       q += std::uint64_t(gridDim.x) * blockDim.x) {
    std::uint64_t lo = 0, n = rows;
    while (n > 0) {
      const std::uint64_t half = n / 2;
      if (keys[lo + half] >> plan_row_bits < q) lo += half + 1, n -= half + 1;
      else n = half;
    }
    at[q] = lo;
  }
}
template <class W>
__global__ void move_rows_kernel(const W* src, W* dst, const std::uint64_t* idx, std::uint64_t rows,
                                 std::uint64_t words, bool scatter) {
  const std::uint64_t total = rows * words;
  for (std::uint64_t i = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += std::uint64_t(gridDim.x) * blockDim.x) {
    const std::uint64_t k = i / words, w = i % words;
    if (scatter) dst[idx[k] * words + w] = src[k * words + w];
    else dst[k * words + w] = src[idx[k] * words + w];
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

  // With a device_exchange: the scratch a plan of `rows` rows needs (4 key or value arrays
  // and the sort's temporary storage), bytes. Throws cuda_error.
  static std::size_t plan_scratch(std::uint64_t rows) { return 4 * arrays(rows) + sort_bytes(rows); }
  // Enqueues replica a.replica's plan on stream s; throws cuda_error.
  static void plan(const exchange_plan_args& a, cuda_stream s) {
    const auto st = static_cast<cudaStream_t>(s);
    const std::uint64_t n = a.rows, G = a.layout.replicas;
    auto* base = static_cast<unsigned char*>(a.scratch);
    auto* send_keys = reinterpret_cast<std::uint64_t*>(base);
    auto* recv_keys = reinterpret_cast<std::uint64_t*>(base + arrays(n));
    auto* vals = reinterpret_cast<std::uint64_t*>(base + 2 * arrays(n));
    auto* sorted = reinterpret_cast<std::uint64_t*>(base + 3 * arrays(n));
    void* temp = base + 4 * arrays(n);
    std::size_t temp_bytes = a.scratch_bytes - 4 * arrays(n);
    const int end_bit = int(plan_row_bits) + int(std::bit_width(G));
    if (n > 0) {
      const plan_keys keys{a.layout, {a.total_rows, a.key}, {a.total_rows, a.from_key}, a.from_shuffled};
      plan_keys_kernel<<<blocks(n), 256, 0, st>>>(keys, a.replica, n, send_keys, recv_keys, vals);
      FERRY_CUDA_TRY(cudaGetLastError());
    }
    for (int side = 0; side < 2; ++side) {
      if (n > 0)
        FERRY_CUDA_TRY(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, side ? recv_keys : send_keys, sorted, vals,
                                                       side ? a.recv_rows : a.send_rows, std::int64_t(n), 0, end_bit,
                                                       st));
      plan_bounds_kernel<<<blocks(G + 1), 256, 0, st>>>(sorted, n, G, a.at + side * (G + 1));
      FERRY_CUDA_TRY(cudaGetLastError());
    }
  }
  // Enqueues a pack or unpack on stream s; throws cuda_error.
  static void move_rows(const move_rows_args& a, cuda_stream s) {
    if (a.rows == 0 || a.row_bytes == 0) return;
    const auto st = static_cast<cudaStream_t>(s);
    const bool wide = a.row_bytes % 16 == 0 && reinterpret_cast<std::uintptr_t>(a.src) % 16 == 0 &&
                      reinterpret_cast<std::uintptr_t>(a.dst) % 16 == 0;
    const std::uint64_t words = wide ? a.row_bytes / 16 : a.row_bytes;
    if (wide)
      move_rows_kernel<<<blocks(a.rows * words), 256, 0, st>>>(reinterpret_cast<const uint4*>(a.src),
                                                                reinterpret_cast<uint4*>(a.dst), a.idx, a.rows, words,
                                                                a.scatter);
    else
      move_rows_kernel<<<blocks(a.rows * words), 256, 0, st>>>(reinterpret_cast<const unsigned char*>(a.src),
                                                                reinterpret_cast<unsigned char*>(a.dst), a.idx, a.rows,
                                                                words, a.scatter);
    FERRY_CUDA_TRY(cudaGetLastError());
  }

 private:
  static unsigned blocks(std::uint64_t work) { return unsigned(std::min<std::uint64_t>((work + 255) / 256, 65535)); }
  // One array of `rows` 8-byte values, rounded up to 256 bytes (CUB's alignment).
  static std::size_t arrays(std::uint64_t rows) { return (std::size_t(rows) * 8 + 255) / 256 * 256; }
  static std::size_t sort_bytes(std::uint64_t rows) {
    std::size_t bytes = 0;
    if (rows > 0)
      FERRY_CUDA_TRY(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const std::uint64_t*>(nullptr),
                                                     static_cast<std::uint64_t*>(nullptr),
                                                     static_cast<const std::uint64_t*>(nullptr),
                                                     static_cast<std::uint64_t*>(nullptr), std::int64_t(rows)));
    return bytes;
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
