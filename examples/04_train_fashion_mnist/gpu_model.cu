// gpu_model.cu: the example's GPU trainer, the only part nvcc compiles: the mirrored
// trainer on the GPU backend (cuBLAS GEMMs, Thrust/CUB elementwise work on each replica's
// compute stream) with NCCL all-reduce, one rank per local GPU. See model.hpp.
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "ferry/collective/nccl.hpp"
#if defined(__CUDACC__)
#include "ferry/stages/cache_on_device.cuh"
#endif
#include "ferry/train/gpu_backend.cuh"
#include "model.hpp"

namespace fmnist {

std::unique_ptr<model> make_gpu_model(const tr::mlp_config& cfg, const tr::trainer_options& o,
                                      const std::vector<int>& devices) {
  using trainer = tr::mirrored_trainer<tr::gpu_backend, ferry::nccl_communicator>;
  std::vector<tr::replica_context> ctx;
  for (int d : devices) ctx.push_back({d, nullptr});  // null stream: each backend makes its own
  return std::make_unique<trainer_model<trainer>>(cfg, o, ferry::nccl_communicator::local(devices),
                                                  std::move(ctx));
}

#if defined(__CUDACC__)  // (the simulator's build, g++, defines these in tests/train/sim_gpu_model.cpp)
void gpu_gather::launch(const ferry::cache_gather_args& a, ferry::cuda_stream s) {
  ferry::cuda::cache_gather_launcher::launch(a, s);
}
void gpu_gather::launch_global(const ferry::cache_global_gather_args& a, ferry::cuda_stream s) {
  ferry::cuda::cache_gather_launcher::launch_global(a, s);
}
#endif

std::string gpu_name(int device) {
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, device) != cudaSuccess) return "GPU " + std::to_string(device);
  return p.name;
}

}  // namespace fmnist
