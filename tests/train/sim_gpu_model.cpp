// The main example's GPU model (examples/04_train_fashion_mnist/gpu_model.cu, nvcc on a GPU
// machine) compiled by g++ against the simulated CUDA runtime, cuBLAS, NCCL and Thrust of
// tests/cuda/sim, so the example's GPU path runs end to end in CI on two simulated GPUs.
#include "../../examples/04_train_fashion_mnist/gpu_model.cu"

#include <cstdio>
#include <cstdlib>

namespace {
// At exit: what the simulator saw. A race, a call on the wrong device or a deadlock makes
// the program fail, so check_output.py fails with it.
struct report_at_exit {
  report_at_exit() {
    std::atexit([] {
      const auto c = sim::stats();
      const auto& v = sim::violations();
      std::fprintf(stderr, "sim: %llu copies, %llu collectives, %llu host waits, %zu violation(s)\n",
                   static_cast<unsigned long long>(c.copies), static_cast<unsigned long long>(c.collectives),
                   static_cast<unsigned long long>(c.host_waits), v.size());
      for (const auto& x : v) std::fprintf(stderr, "sim: %s\n", x.c_str());
      if (!v.empty()) std::_Exit(3);
    });
  }
} report;
}  // namespace
