// ferry/image/augment.cuh: the kernel of ferry/image/augment.hpp (nvcc only): one launch
// per replica batch, on the replica's stream, doing the host path's arithmetic with the
// same functions (augment_draw, augment_pixel: fmaf throughout), so host and device agree
// bit for bit (augment.hpp's top says why; not under --use_fast_math).
//
//   #include "ferry/image/augment.cuh"    // in a .cu file
//   ferry::image::augmenter aug({224, 224, 3}, opts);
//   ferry::image::augmented x = aug(st, r, ferry::image::augment_key(epoch, st.index()));
//   my_model<<<g, b, 0, (cudaStream_t)x.stream()>>>(x.data().data(), x.size());
//
// The grid: blockIdx.y walks the rows (images), blockIdx.x and the threads the pixels of
// one image, each thread a few pixels, all of a pixel's channels: its reads (C adjacent
// bytes) and its writes (one float in each of the C planes) are contiguous across a warp.
// Thread 0 of a block draws the row's flip, contrast and brightness into shared memory:
// the draw is computed on the device from (seed, key, row), so nothing per step is copied
// or allocated for it, and nothing on the host has to outlive the launch.
//
// Needs --expt-relaxed-constexpr (ferry/detail/random.hpp's splitmix64 and mix_seed are
// constexpr host functions, called from the kernel). Throws cuda_error when the launch
// fails. Runs on the caller's thread; enqueues only.
#pragma once

#if !defined(__CUDACC__)
#error "ferry/image/augment.cuh needs nvcc: include ferry/image/augment.hpp from code g++ compiles"
#endif
#if !defined(__CUDACC_RELAXED_CONSTEXPR__)
#error "ferry/image/augment.cuh: compile with --expt-relaxed-constexpr (the kernel calls ferry/detail/random.hpp's constexpr draws)"
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ferry/cuda/error.hpp"
#include "ferry/image/augment.hpp"

namespace ferry::image {

namespace detail {

inline constexpr unsigned augment_threads = 256;       // a block
inline constexpr unsigned augment_pixels_each = 4;     // pixels a thread, about (fewer blocks per image)
inline constexpr unsigned augment_max_grid_y = 65535;  // CUDA's limit on gridDim.y: rows loop beyond it

template <std::uint32_t C>
__global__ void __launch_bounds__(augment_threads) augment_kernel(augment_plan p, augment_launch a) {
  __shared__ augment_row r;
  const std::uint32_t n = p.pixels();
  const std::size_t per = p.values();
  for (std::uint32_t row = blockIdx.y; row < a.rows; row += gridDim.y) {
    if (threadIdx.x == 0) r = augment_draw(p, a.key, a.first_row + row);
    __syncthreads();
    const augment_row rr = r;
    const std::uint8_t* in = a.in + row * per;
    float* out = a.out + row * per;
    for (std::uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
      augment_pixel<C>(p, rr, in, out, i);
    __syncthreads();  // every thread has read r before thread 0 draws the next row into it
  }
}

}  // namespace detail

// Enqueues the kernel for a.rows images on `s` (whose device must be current, as for any
// launch). Throws cuda_error when the launch fails (cudaGetLastError after it).
inline void launch_augment(const augment_plan& p, const augment_launch& a, cudaStream_t s) {
  if (a.rows == 0) return;
  const unsigned per_block = detail::augment_threads * detail::augment_pixels_each;
  const unsigned gx = std::max(1u, (p.pixels() + per_block - 1) / per_block);
  const unsigned gy = std::min(a.rows, detail::augment_max_grid_y);
  const dim3 grid(gx, gy);
  switch (p.channels) {  // one instance per channel count: the channel loop unrolled
    case 1: detail::augment_kernel<1><<<grid, detail::augment_threads, 0, s>>>(p, a); break;
    case 2: detail::augment_kernel<2><<<grid, detail::augment_threads, 0, s>>>(p, a); break;
    case 3: detail::augment_kernel<3><<<grid, detail::augment_threads, 0, s>>>(p, a); break;
    default: detail::augment_kernel<4><<<grid, detail::augment_threads, 0, s>>>(p, a); break;
  }
  FERRY_CUDA_TRY(cudaGetLastError());
}

// The launcher basic_augmenter uses for device replicas: launch_augment.
struct cuda_kernel {
  // launch_augment on stream s; throws cuda_error.
  static void launch(const augment_plan& p, const augment_launch& a, cuda_stream s) { launch_augment(p, a, s); }
};

// Host and device replicas: augment_host for the one, the kernel on the replica's stream
// for the other (basic_augmenter in augment.hpp documents the calls).
using augmenter = basic_augmenter<cuda_kernel>;

}  // namespace ferry::image
