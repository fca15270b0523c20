// The augmentation kernel (ferry/image/augment.cuh) on a GPU against its bound, measured
// in the same run: a batch of N x 224 x 224 x 3 uint8 (N = 256 by default, argv[1]) to
// N x 3 x 224 x 224 float with flip, brightness, contrast and ImageNet's mean/std. The
// kernel reads N*H*W*C bytes and writes 4x that; the bound is the time a device-to-device
// cudaMemcpyAsync takes to move the same traffic: a copy of half that byte count reads
// and writes it once each, so its time is the same traffic over the copy's bandwidth.
//   augment_bound_ratio: <kernel time> / (<bytes read + written> / <D2D bandwidth>)
// 1.0 means the kernel runs at copy speed; the figure to report, with the card. The
// table gives the medians of `reps` timings (CUDA events on one stream) and #wrong: the
// values of the kernel's output that differ from augment_host's (must be 0: they are
// compared bit for bit). Compiled by nvcc (it includes augment.cuh). Exits 77 without a
// usable device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ferry/cuda/error.hpp"
#include "ferry/cuda/runtime.hpp"
#include "ferry/detail/random.hpp"
#include "ferry/image/augment.cuh"

namespace {

// The median of `reps` timings of f() on stream s, in seconds, after one untimed call.
template <class F>
double median_seconds(cudaStream_t s, int reps, F&& f) {
  cudaEvent_t a = nullptr, b = nullptr;
  FERRY_CUDA_TRY(cudaEventCreate(&a));
  FERRY_CUDA_TRY(cudaEventCreate(&b));
  f();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    FERRY_CUDA_TRY(cudaEventRecord(a, s));
    f();
    FERRY_CUDA_TRY(cudaEventRecord(b, s));
    FERRY_CUDA_TRY(cudaEventSynchronize(b));
    float ms = 0;
    FERRY_CUDA_TRY(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1e-3);
  }
  FERRY_CUDA_TRY(cudaEventDestroy(a));
  FERRY_CUDA_TRY(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (!ferry::cuda::available()) {
    std::printf("SKIP: no usable CUDA device: %s\n", ferry::cuda::unavailable_reason().c_str());
    return 77;
  }
  const std::uint32_t rows = argc > 1 ? std::uint32_t(std::atoi(argv[1])) : 256;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 50;
  if (rows == 0 || reps <= 0) {
    std::fprintf(stderr, "usage: %s [rows (256)] [reps (50)]\n", argv[0]);
    return 2;
  }
  namespace fi = ferry::image;
  fi::augment_options o;
  o.mean = {0.485f, 0.456f, 0.406f};
  o.stddev = {0.229f, 0.224f, 0.225f};
  o.flip_probability = 0.5f;
  o.brightness = {-0.2f, 0.2f};
  o.contrast = {0.6f, 1.4f};
  o.seed = 1;
  const fi::augment_plan p = fi::make_augment_plan({224, 224, 3}, o);
  const std::size_t in_bytes = std::size_t(rows) * p.values(), out_bytes = in_bytes * sizeof(float);
  const std::size_t moved = in_bytes + out_bytes, copy_bytes = moved / 2;

  std::vector<std::uint8_t> in(in_bytes);
  ferry::detail::splitmix64 g(3);
  for (auto& b : in) b = std::uint8_t(g());
  std::uint8_t* d_in = nullptr;
  float* d_out = nullptr;
  void *d_src = nullptr, *d_dst = nullptr;
  FERRY_CUDA_TRY(cudaMalloc(&d_in, in_bytes));
  FERRY_CUDA_TRY(cudaMalloc(&d_out, out_bytes));
  FERRY_CUDA_TRY(cudaMalloc(&d_src, copy_bytes));
  FERRY_CUDA_TRY(cudaMalloc(&d_dst, copy_bytes));
  FERRY_CUDA_TRY(cudaMemcpy(d_in, in.data(), in_bytes, cudaMemcpyHostToDevice));
  FERRY_CUDA_TRY(cudaMemset(d_src, 1, copy_bytes));
  // A pageable cudaMemcpy may return before its DMA lands, and cudaMemset may return before
  // it ran; the non-blocking stream below does not wait for the legacy stream's work.
  FERRY_CUDA_TRY(cudaDeviceSynchronize());
  cudaStream_t s = nullptr;
  FERRY_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  std::uint64_t key = 0;
  const double t_kernel = median_seconds(s, reps, [&] { fi::launch_augment(p, {d_in, d_out, rows, ++key, 0}, s); });
  const double t_copy = median_seconds(s, reps, [&] {
    FERRY_CUDA_TRY(cudaMemcpyAsync(d_dst, d_src, copy_bytes, cudaMemcpyDeviceToDevice, s));
  });

  // #wrong: the last launch (key) against the host path.
  std::vector<float> got(in_bytes), want(in_bytes);
  FERRY_CUDA_TRY(cudaMemcpy(got.data(), d_out, out_bytes, cudaMemcpyDeviceToHost));
  fi::augment_host(in, want, p, key, 0);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < got.size(); ++i) wrong += std::memcmp(&got[i], &want[i], sizeof(float)) != 0;

  cudaDeviceProp prop{};
  FERRY_CUDA_TRY(cudaGetDeviceProperties(&prop, 0));
  const double bw = double(moved) / t_copy;  // bytes read + written per second by the copy
  std::printf("# augment %u x 224 x 224 x 3 uint8 -> float CHW on %s, median of %d\n", rows, prop.name, reps);
  std::printf("%-22s %14s %12s %12s %8s\n", "what", "bytes moved", "time (us)", "GB/s", "#wrong");
  std::printf("%-22s %14zu %12.1f %12.1f %8zu\n", "augment kernel", moved, t_kernel * 1e6, moved / t_kernel / 1e9, wrong);
  std::printf("%-22s %14zu %12.1f %12.1f %8s\n", "D2D cudaMemcpyAsync", moved, t_copy * 1e6, bw / 1e9, "-");
  std::printf("augment_bound_ratio: %.3f\n", t_kernel / (double(moved) / bw));

  FERRY_CUDA_TRY(cudaStreamDestroy(s));
  FERRY_CUDA_TRY(cudaFree(d_in));
  FERRY_CUDA_TRY(cudaFree(d_out));
  FERRY_CUDA_TRY(cudaFree(d_src));
  FERRY_CUDA_TRY(cudaFree(d_dst));
  return wrong == 0 ? 0 : 1;
}
