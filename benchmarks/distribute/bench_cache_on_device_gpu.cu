// cache_on_device on a GPU: the steady epoch's time with the dataset cached on the device,
// over the same training-like step on device-resident data prepared by hand, beside the
// streamed pipeline's ratio (from host memory every epoch), in the same run.
//
// Data: `rows` rows of 784 floats (Fashion-MNIST's shape, 3136 bytes); global batch 1024;
// one replica on device 0. The step: launch_consume (tests/cuda/gpu_kernels.cu) reads the
// batch once and computes for `ms` milliseconds. Epoch time: host clock around an epoch
// ended by a device synchronisation after its rewind(), so the cached epoch includes its
// reorder (the gather). Every side has steps = rows / G full steps (drop_remainder: the
// hand loop has no short step either).
// Prints, last:
//   device_cache_step_ratio: <cached epoch / resident epoch>   (target <= 1.01)
//   streamed_step_ratio: <streamed epoch / resident epoch>
//   h2d_bytes_after_epoch1: <bytes the upstream handed distribute after epoch 0>   (target 0)
//   device_bytes_per_replica: <the cache and its shuffled copy>  dataset_bytes: <...>
//   reorder_vs_copy: <one epoch's reorder (the gather, at rewind) / a device-to-device copy
//                     of the same bytes>, each replica's own rows (two replicas on device 0)
//   reorder_across_vs_copy: the same with across_replicas (one order of both replicas'
//                     rows: each kernel reads both caches; on one GPU no peer link is
//                     crossed, so this is the kernel's cost, the model's input for NVLink)
//   reorder_nccl_vs_copy: the same with .devices (NCCL, one replica trading with itself):
//                     the plan (keys, CUB's sort), the pack, the trade, the unpack: the
//                     per-GPU cost of the trade but the link (built with NCCL only). A
//                     training loop gets the trade a unit a step while the epoch before is
//                     served; rewinding with no step between makes it whole at the rewind,
//                     so this times all its units
// Usage: bench_cache_on_device_gpu [rows (60000)] [ms per step (0.2)] [epochs (3)].
// Exits 77 without a usable device.
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#if defined(FERRY_BENCH_NCCL)
#include "ferry/collective/nccl.hpp"
#endif
#include "ferry/cuda/devices.hpp"
#include "ferry/cuda/runtime.hpp"
#include "ferry/memory/pinned.hpp"
#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/cache_on_device.cuh"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/map.hpp"
#include "gpu_kernels.hpp"

namespace {
using row = std::array<float, 784>;
using clk = std::chrono::steady_clock;
constexpr std::size_t G = 1024;

double seconds_since(clk::time_point t) { return std::chrono::duration<double>(clk::now() - t).count(); }

// One epoch of `p` (steps consumed on each replica's stream), then its rewind() (for the
// cache: the next epoch's reorder, the gather), in seconds, all on the device finished.
template <class P>
double epoch(P& p, long long cycles, float* out) {
  const auto t0 = clk::now();
  cudaStream_t last = nullptr;
  for (auto& st : p) {
    const auto& rb = st[0];
    last = static_cast<cudaStream_t>(rb.stream());
    FERRY_CUDA_TRY(ferry_test::launch_consume(last, rb.template field<0>().data()->data(), rb.size() * 784, cycles, out));
  }
  if (last) FERRY_CUDA_TRY(cudaStreamSynchronize(last));
  p.rewind();
  FERRY_CUDA_TRY(cudaDeviceSynchronize());  // the gather, whichever stream it went on
  return seconds_since(t0);
}
}  // namespace

int main(int argc, char** argv) {
  if (!ferry::cuda::available()) {
    std::printf("SKIP: no usable CUDA device: %s\n", ferry::cuda::unavailable_reason().c_str());
    return 77;
  }
  const std::size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 60000;
  const double ms = argc > 2 ? std::atof(argv[2]) : 0.2;
  const int epochs = argc > 3 ? std::atoi(argv[3]) : 3;
  const long long cycles = ferry_test::cycles_for_ms(ms);
  std::vector<row> data(n);
  for (std::size_t i = 0; i < n; ++i) data[i].fill(float(i % 251));
  float* out = nullptr;
  FERRY_CUDA_TRY(cudaMalloc(&out, 1024 * sizeof(float)));
  const std::size_t steps = n / G;

  // By hand: the dataset on the device, steps as offsets into it.
  float* resident = nullptr;
  FERRY_CUDA_TRY(cudaMalloc(&resident, steps * G * sizeof(row)));
  FERRY_CUDA_TRY(cudaMemcpy(resident, data.data(), steps * G * sizeof(row), cudaMemcpyHostToDevice));
  FERRY_CUDA_TRY(cudaDeviceSynchronize());  // a pageable cudaMemcpy may return before its DMA lands
  cudaStream_t s;
  FERRY_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  double by_hand = 1e30;
  for (int e = 0; e < epochs + 1; ++e) {
    const auto t0 = clk::now();
    for (std::size_t k = 0; k < steps; ++k)
      FERRY_CUDA_TRY(ferry_test::launch_consume(s, resident + k * G * 784, G * 784, cycles, out));
    FERRY_CUDA_TRY(cudaStreamSynchronize(s));
    if (e > 0) by_hand = std::min(by_hand, seconds_since(t0));
  }

  std::atomic<std::size_t> pulled{0};
  auto pool = ferry::make_pinned_pool();
  auto source = [&] {
    return ferry::from_range(std::span<const row>(data)) | ferry::map([&pulled](const row& r) {
             pulled++;
             return r;
           });
  };
  auto cached = source() | ferry::batch(G, {.drop_remainder = true}) | ferry::distribute(ferry::cuda::devices{0}, {.host_resource = pool}) |
                ferry::cuda::cache_on_device({.seed = 1});
  const double fill = epoch(cached, cycles, out);
  const std::size_t after0 = pulled;
  double cache_s = 1e30;
  for (int e = 0; e < epochs; ++e) cache_s = std::min(cache_s, epoch(cached, cycles, out));
  const std::size_t h2d = (pulled - after0) * sizeof(row);

  auto streamed = source() | ferry::batch(G, {.drop_remainder = true}) | ferry::distribute(ferry::cuda::devices{0}, {.host_resource = pool});
  (void)epoch(streamed, cycles, out);
  double stream_s = 1e30;
  for (int e = 0; e < epochs; ++e) stream_s = std::min(stream_s, epoch(streamed, cycles, out));

  std::printf("%zu rows of %zu bytes, %zu steps of %zu, %.3f ms a step, best of %d epochs\n", n, sizeof(row), steps, G,
              ms, epochs);
  std::printf("epoch on device-resident data (by hand)   %9.4f s\n", by_hand);
  std::printf("epoch 0, filling the cache                %9.4f s\n", fill);
  std::printf("epoch from cache_on_device                %9.4f s\n", cache_s);
  std::printf("epoch streamed from host memory           %9.4f s\n", stream_s);
  std::printf("device_cache_step_ratio: %.4f\n", cache_s / by_hand);
  std::printf("streamed_step_ratio: %.4f\n", stream_s / by_hand);
  std::printf("h2d_bytes_after_epoch1: %zu\n", h2d);
  std::printf("device_bytes_per_replica: %zu dataset_bytes: %zu\n", cached.bytes_per_replica(), n * sizeof(row));
  // The reorder alone, against a copy of the same bytes on the device.
  const std::size_t bytes = steps * G * sizeof(row);
  float* copy = nullptr;
  FERRY_CUDA_TRY(cudaMalloc(&copy, bytes));
  double copy_s = 1e30;
  for (int e = 0; e < epochs + 1; ++e) {
    const auto t0 = clk::now();
    FERRY_CUDA_TRY(cudaMemcpyAsync(copy, resident, bytes, cudaMemcpyDeviceToDevice, s));
    FERRY_CUDA_TRY(cudaStreamSynchronize(s));
    if (e > 0) copy_s = std::min(copy_s, seconds_since(t0));
  }
  FERRY_CUDA_LOG(cudaFree(copy));
  auto reorder_s = [&](bool across, ferry::device_exchange* ex = nullptr) {
    const ferry::cuda::devices gpus = ex ? ferry::cuda::devices{0} : ferry::cuda::devices{0, 0};
    auto p = source() | ferry::batch(G, {.drop_remainder = true}) | ferry::distribute(gpus, {.host_resource = pool}) |
             ferry::cuda::cache_on_device({.seed = 1, .across_replicas = across, .devices = ex});
    for (auto& st : p) (void)st;  // epoch 0 fills the caches
    double best = 1e30;
    for (int e = 0; e < epochs + 1; ++e) {  // the first rewind also trims the caches: not timed
      FERRY_CUDA_TRY(cudaDeviceSynchronize());
      const auto t0 = clk::now();
      p.rewind();
      FERRY_CUDA_TRY(cudaDeviceSynchronize());
      if (e > 0) best = std::min(best, seconds_since(t0));
    }
    return best;
  };
  const double local_s = reorder_s(false), across_s = reorder_s(true);
  std::printf("device-to-device copy of the dataset      %9.4f s\n", copy_s);
  std::printf("reorder, each replica's own rows          %9.4f s\n", local_s);
  std::printf("reorder, across_replicas                  %9.4f s\n", across_s);
  std::printf("reorder_vs_copy: %.4f\n", local_s / copy_s);
  std::printf("reorder_across_vs_copy: %.4f\n", across_s / copy_s);
#if defined(FERRY_BENCH_NCCL)
  {
    auto comms = ferry::nccl_communicator::local({0});
    ferry::nccl_device_exchange ex(comms);
    const double nccl_s = reorder_s(true, &ex);
    std::printf("reorder, .devices (NCCL, one GPU)         %9.4f s\n", nccl_s);
    std::printf("reorder_nccl_vs_copy: %.4f\n", nccl_s / copy_s);
  }
#endif
  FERRY_CUDA_LOG(cudaFree(resident));
  FERRY_CUDA_LOG(cudaFree(out));
  FERRY_CUDA_LOG(cudaStreamDestroy(s));
  return 0;
}
