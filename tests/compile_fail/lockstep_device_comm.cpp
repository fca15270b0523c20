// lockstep's agreement is two floats in host memory: a communicator of device memory
// (nccl_communicator says memory = span_memory::device) would be handed them for an
// asynchronous all-reduce. A stand-in communicator: the real one needs NCCL.
// max-errors: 2
// first-error: ferry::lockstep\(comm\): comm all-reduces device memory
#include <cstdint>
#include <span>
#include <vector>

#include "device_communicator.hpp"
#include "ferry/collective/communicator.hpp"
#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/lockstep.hpp"

int main() {
  device_communicator comm;
  auto p = ferry::from_range(std::vector<std::uint64_t>(8, 1)) | ferry::batch(4) |
           ferry::distribute(ferry::host_replicas{1}) | ferry::lockstep(comm, ferry::step_policy::pad);
  while (auto e = p.next()) (void)*e;
}
