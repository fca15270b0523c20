// A backend with device memory (gpu_backend says on_device = true) over a thread
// communicator, which would memcpy the replicas' device pointers as host memory: the trainer
// must refuse it at compile time. The backend is a stand-in: gpu_backend needs nvcc.
// max-errors: 2
// expect: mirrored_trainer<device_backend, ferry::thread_communicator>
// first-error: mirrored_trainer<Backend, Comm>: the communicator all-reduces the backend's buffers in place
#include "ferry/collective/thread_collective.hpp"
#include "ferry/train/mirrored_trainer.hpp"

struct device_backend {
  static constexpr bool on_device = true;
};

int main() { return sizeof(ferry::train::mirrored_trainer<device_backend, ferry::thread_communicator>) > 0; }
