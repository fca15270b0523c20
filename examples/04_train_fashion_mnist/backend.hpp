// The backend an example trains on: every local GPU when there is one and the build has the
// GPU path (FERRY_EXAMPLE_GPU), else host replicas (FERRY_EXAMPLE_HOST). Shared by
// examples 04 and 12. Runs on the calling thread; throws config_error for --device gpu
// without a usable GPU, --gpus larger than the machine's count, and no backend at all.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "ferry/error.hpp"
#if defined(FERRY_EXAMPLE_GPU)
#include "ferry/cuda/devices.hpp"
#endif

namespace fmnist {

struct backend_choice {
  bool gpu = false;          // train on devices (else host replicas)
  std::string why;           // why not on GPUs, for the stderr line ("" when on GPUs)
  std::vector<int> devices;  // the GPUs (0..gpus-1, or all)
  std::size_t replicas = 0;  // one per GPU, or the host replicas
};

// device: "auto", "gpu" or "cpu"; gpus: how many GPUs (0: all); replicas: host replicas
// asked for (0: chosen for `batch` and `cores`, see below).
inline backend_choice choose_backend(const std::string& device, std::size_t gpus, std::size_t batch,
                                     std::size_t replicas, std::size_t cores) {
  backend_choice b;
#if defined(FERRY_EXAMPLE_GPU)
  if (device != "cpu") {
    b.gpu = ferry::cuda::available();
    if (!b.gpu) {
      if (device == "gpu")
        throw ferry::config_error("--device gpu: no usable CUDA device (" + ferry::cuda::unavailable_reason() + ")");
      b.why = " (no usable CUDA device: " + ferry::cuda::unavailable_reason() + ")";
    }
  }
  if (b.gpu) {
    const int n = ferry::cuda::device_count();
    if (gpus > std::size_t(n))
      throw ferry::config_error("--gpus " + std::to_string(gpus) + ": this machine has " + std::to_string(n));
    for (int d = 0; d < (gpus ? int(gpus) : n); ++d) b.devices.push_back(d);
  }
#else
  (void)gpus;
  if (device == "gpu") throw ferry::config_error("--device gpu: this build has no GPU path (built without nvcc)");
  b.why = " (built without the GPU path)";
#endif
#if !defined(FERRY_EXAMPLE_HOST)
  if (!b.gpu)
    throw ferry::config_error("no usable GPU" + b.why + ", and this build has no host backend (built without OpenBLAS)");
#endif
  b.replicas = b.gpu ? b.devices.size() : replicas;
  // One host replica per core while each keeps at least 64 rows (thinner slices waste
  // their GEMMs and the all-reduce grows), and a count that divides the batch. On the
  // 2-core development machine, batch 128: 1 replica ran an epoch in 0.95 s, 2 in 0.76 s
  // (the pipeline's threads fit beside them since the step's elementwise work vectorizes).
  if (!b.gpu && b.replicas == 0) {
    b.replicas = std::max<std::size_t>(1, std::min<std::size_t>(cores, batch / 64));
    while (batch % b.replicas != 0) --b.replicas;
  }
  return b;
}

}  // namespace fmnist
