// Linked into whole programs run on the simulator (the main example, GPU benchmarks): at
// exit, one line of what the simulator saw; a race, a call on the wrong device or a
// deadlock makes the program exit 3, so the test that runs it fails.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

namespace {
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
