// A host backend over a communicator of device memory (nccl_communicator says memory =
// span_memory::device): NCCL would be handed host arrays. The trainer must refuse it at
// compile time. Both are stand-ins: the real ones need cuBLAS/OpenBLAS and NCCL.
// max-errors: 2
// expect: mirrored_trainer<host_backend, device_communicator>
// first-error: mirrored_trainer<Backend, Comm>: the communicator all-reduces the backend's buffers in place
#include <span>

#include "device_communicator.hpp"
#include "ferry/collective/communicator.hpp"
#include "ferry/train/mirrored_trainer.hpp"

struct host_backend {};  // says nothing: host memory, as host_backend (on_device = false)

int main() { return sizeof(ferry::train::mirrored_trainer<host_backend, device_communicator>) > 0; }
