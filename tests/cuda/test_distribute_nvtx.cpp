// distribute's NVTX ranges, seen through a static NVTX injection (nvtx_recorder.hpp) on the
// simulated CUDA runtime: with ferry::enable_nvtx() each step made is one range, "ferry
// distribute: copy to replicas", around its copies, on the thread that enqueues them (the
// consumer's, or distribute's staging thread), pushed and popped in order; with NVTX off,
// none. Nsight Systems shows these ranges; it cannot make reports on the GPU machines this
// project is lent (docs/observe.md), so this is where they are checked.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>  // the simulator's (this test's include path puts it first)

#include <map>
#include <string>
#include <thread>
#include <vector>

#include "common/doubles.hpp"
#include "cuda/elements.hpp"
#include "ferry/cuda/devices.hpp"
#include "ferry/cuda/nvtx.hpp"
#include "ferry/memory/pinned.hpp"
#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/prefetch.hpp"
#include "nvtx_recorder.hpp"

namespace {
constexpr const char* copy_range = "ferry distribute: copy to replicas";

// Runs one epoch of 6 steps (two simulated GPUs) and returns what NVTX recorded.
std::vector<ferry_test::nvtx_event> one_epoch(bool staging, bool nvtx) {
  sim::reset(81, 2);
  ferry::enable_nvtx(nvtx);
  ferry_test::nvtx_clear();
  const auto data = make_data(16 * 6);
  {
    auto pool = ferry::make_pinned_pool();
    auto steps = ferry::from_range(data) | ferry::batch(16) | ferry::prefetch(2) |
                 ferry::distribute(ferry::cuda::devices{0, 1},
                                   {.host_resource = pool, .steps_ahead = staging ? 3u : 1u, .staging_thread = staging});
    std::size_t n = 0;
    for (auto& st : steps) {
      (void)st;
      ++n;
    }
    CHECK(n == 6);
  }
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  ferry::enable_nvtx(false);
  return ferry_test::nvtx_events();
}
}  // namespace

TEST_CASE("NVTX: one range per step made, on the thread that enqueues its copies, nested; none when off" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));
  REQUIRE(ferry::nvtx_available());
  for (bool staging : {false, true}) {
    INFO("staging " << staging);
    CHECK(one_epoch(staging, false).empty());
    const auto ev = one_epoch(staging, true);
    CHECK(ferry_test::nvtx_injected());
    std::size_t copies = 0;
    std::map<std::thread::id, std::vector<std::string>> open;  // each thread's stack of ranges
    for (const auto& e : ev) {
      auto& stack = open[e.thread];
      if (e.push) {
        stack.push_back(e.name);
        if (e.name == copy_range) {
          ++copies;
          // The consumer's thread makes the steps, or distribute's own thread does.
          if (staging)
            CHECK(e.thread != std::this_thread::get_id());
          else
            CHECK(e.thread == std::this_thread::get_id());
        }
      } else {
        REQUIRE_FALSE(stack.empty());  // a pop without its push
        stack.pop_back();
      }
    }
    CHECK(copies == 6);  // the end of the epoch makes no step, and no range
    for (const auto& [thread, stack] : open) CHECK(stack.empty());  // every range closed
  }
}
