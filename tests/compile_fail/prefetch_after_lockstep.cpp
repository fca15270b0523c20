// prefetch's thread over lockstep() would run its all-reduce ahead of the consumer: a rank
// that stops mid-epoch would leave the others waiting in it.
// max-errors: 2
// first-error: ferry::prefetch after lockstep\(\)
#include <cstdint>
#include <vector>

#include "ferry/collective/thread_collective.hpp"
#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/lockstep.hpp"
#include "ferry/stages/prefetch.hpp"

int main() {
  ferry::thread_group g{1};
  auto comm = g.communicator(0);
  auto p = ferry::from_range(std::vector<std::uint64_t>(8, 1)) | ferry::batch(4) |
           ferry::distribute(ferry::host_replicas{1}) | ferry::lockstep(comm, ferry::step_policy::pad) |
           ferry::prefetch(2);
  while (auto e = p.next()) (void)*e;
}
