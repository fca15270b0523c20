// Sim shim of thrust::cuda::par_nosync (see ../../for_each.h): .on(stream) names the stream.
#pragma once

#include <cuda_runtime_api.h>

namespace thrust {
inline namespace ferry_sim {
namespace cuda {

struct stream_policy {
  cudaStream_t stream;
};
struct par_nosync_t {
  stream_policy on(cudaStream_t s) const { return {s}; }
};
inline constexpr par_nosync_t par_nosync{};

}  // namespace cuda
}  // namespace ferry_sim
}  // namespace thrust
