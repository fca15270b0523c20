// sync_counter.hpp on the simulator, which counts the explicit host waits itself.
#include <cuda_runtime_api.h>

#include "../sync_counter.hpp"

ferry_test::host_syncs ferry_test::count_host_syncs() {
  const auto c = sim::stats();
  return {static_cast<long>(c.device_syncs), static_cast<long>(c.stream_syncs), static_cast<long>(c.event_syncs)};
}
