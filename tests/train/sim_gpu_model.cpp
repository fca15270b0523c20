// The main example's GPU model (examples/04_train_fashion_mnist/gpu_model.cu, nvcc on a GPU
// machine) compiled by g++ against the simulated CUDA runtime, cuBLAS, NCCL and Thrust of
// tests/cuda/sim, so the example's GPU path runs end to end in CI on two simulated GPUs.
#include "../../examples/04_train_fashion_mnist/gpu_model.cu"

