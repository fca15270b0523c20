// How many times the program has waited on the host with the runtime's explicit waits:
// sync_counter.cpp counts them on a GPU (interposing libcudart.so), sim/sim_sync_counter.cpp
// on the simulator.
#pragma once

namespace ferry_test {
struct host_syncs {
  long device = 0;  // cudaDeviceSynchronize
  long stream = 0;  // cudaStreamSynchronize
  long event = 0;   // cudaEventSynchronize
};
host_syncs count_host_syncs();
}  // namespace ferry_test
