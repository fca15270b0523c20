// A static NVTX injection for tests: records every nvtxRangePushA / nvtxRangePop of the
// process (name and thread), so a test can check which ranges ferry emits, where, and that
// they nest, with no profiler attached (nvtx_recorder.cpp; NVTX3's static injection).
#pragma once

#include <string>
#include <thread>
#include <vector>

namespace ferry_test {

struct nvtx_event {
  bool push;          // false: a pop
  std::string name;   // the pushed range's name
  std::thread::id thread;
};

// Everything recorded so far (a copy), and a fresh start.
std::vector<nvtx_event> nvtx_events();
void nvtx_clear();
// Whether NVTX called the injection's initialisation (on the first range call).
bool nvtx_injected();

}  // namespace ferry_test
