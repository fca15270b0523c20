// The main example's GPU model (examples/04_train_fashion_mnist/gpu_model.cu, nvcc on a GPU
// machine) compiled by g++ against the simulated CUDA runtime, cuBLAS, NCCL and Thrust of
// tests/cuda/sim, so the example's GPU path runs end to end in CI on two simulated GPUs.
#include "../../examples/04_train_fashion_mnist/gpu_model.cu"
#include "../cuda/sim_cache_gather.hpp"

// cache_on_device's gathers (--cache-on-device), which nvcc's build launches as kernels:
// here the simulator's kernels of the same host gathers.
namespace fmnist {
void gpu_gather::launch(const ferry::cache_gather_args& a, ferry::cuda_stream s) { ferry_test::sim_gather::launch(a, s); }
void gpu_gather::launch_global(const ferry::cache_global_gather_args& a, ferry::cuda_stream s) {
  ferry_test::sim_gather::launch_global(a, s);
}
}  // namespace fmnist

