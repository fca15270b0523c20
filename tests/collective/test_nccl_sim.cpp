// nccl_communicator's failure paths on two simulated GPUs (tests/cuda/sim: runtime and
// NCCL, ncclCommInitRank's rendezvous on, as in NCCL): join() checks every device before
// any rank joins (a rank added to the group without its siblings made ncclGroupEnd wait for
// them forever), and the errors name the NCCL rank, the clique's size, the device and the
// host. Runs everywhere, no GPU.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>  // the simulator's (the include path puts tests/cuda/sim first)
#include <nccl.h>

#include <chrono>
#include <span>
#include <string>
#include <vector>

#include "common/doubles.hpp"
#include "ferry/collective/nccl.hpp"
#include "ferry/cuda/error.hpp"

using namespace std::chrono_literals;

namespace {

// The simulator afresh with NCCL's rendezvous on; after the body, no violation (a deadlock
// the simulator saw included) and no communicator left alive.
template <class F>
void sim_run(F body) {
  ferry_test::watchdog wd(60s, "an nccl sim run");
  sim::reset(7, 2);
  sim::nccl_rendezvous(true, 2.0);
  body();
  sim::nccl_rendezvous(false);
  std::string seen;
  for (const auto& v : sim::violations()) seen += v + "\n";
  CHECK_MESSAGE(seen.empty(), seen);
  sim::clear_violations();
  CHECK(sim::live_nccl_comms() == 0);
}

const std::string host = ferry::cuda_error::host_name();
// doctest::Contains of a built string (Contains keeps a copy).
doctest::Contains has(const std::string& s) { return doctest::Contains(s.c_str()); }

}  // namespace

TEST_CASE("join: a device that cannot be made current is an error before any rank joins, not a hang" *
          doctest::timeout(30)) {
  sim_run([] {
    int before = -1;
    REQUIRE(cudaSetDevice(1) == cudaSuccess);
    const auto t0 = std::chrono::steady_clock::now();
    // Rank 1's device does not exist: rank 0 must not have joined the group alone.
    CHECK_THROWS_WITH_AS(ferry::nccl_communicator::join(ferry::nccl_communicator::unique_id(), 2, 0, {0, 7}),
                         has("cudaSetDevice for NCCL rank 1 of 2 failed on device 7 of " + host),
                         ferry::error);
    CHECK(std::chrono::steady_clock::now() - t0 < 1s);  // the rendezvous would wait 2 s
    REQUIRE(cudaGetDevice(&before) == cudaSuccess);
    CHECK(before == 1);  // the caller's device, as it was
    // A device that exists but cannot be made current (exclusive mode, taken by another
    // process): the same.
    sim::fail_set_device(1, 1, cudaErrorDevicesUnavailable);
    CHECK_THROWS_WITH_AS(ferry::nccl_communicator::join(ferry::nccl_communicator::unique_id(), 2, 0, {0, 1}),
                         has("cudaSetDevice for NCCL rank 1 of 2 failed on device 1 of " + host),
                         ferry::error);
    // The same clique with good devices still forms.
    CHECK(ferry::nccl_communicator::join(ferry::nccl_communicator::unique_id(), 2, 0, {0, 1}).size() == 2);
  });
}

TEST_CASE("join: a device listed twice is a config_error" * doctest::timeout(30)) {
  sim_run([] {
    CHECK_THROWS_WITH_AS(ferry::nccl_communicator::join(ferry::nccl_communicator::unique_id(), 2, 0, {1, 1}),
                         doctest::Contains("device 1 is listed twice"), ferry::config_error);
  });
}

TEST_CASE("NCCL errors name the call, the NCCL rank, the clique's size, the device and the host" *
          doctest::timeout(30)) {
  sim_run([] {
    CHECK_THROWS_WITH_AS(ferry::nccl_communicator::local({0, 7}),
                         has("ncclCommInitAll (devices 0,7) failed on " + host + ": status 4 (invalid argument"),
                         ferry::error);
    auto comms = ferry::nccl_communicator::local({1, 0});
    std::vector<float> v(4);
    // The simulated NCCL refuses a root outside the clique (ncclInvalidArgument).
    CHECK_THROWS_WITH_AS(comms[1].broadcast(std::span<float>(v.data(), 0), 5),
                         has("ncclBroadcast failed for NCCL rank 1 of 2 on device 0 of " + host +
                             ": status 4 (invalid argument"),
                         ferry::error);
    sim::nccl_async_error(0, ncclRemoteError);
    CHECK_THROWS_WITH_AS(comms[0].check_async(),
                         has("(asynchronous error) failed for NCCL rank 0 of 2 on device 1 of " + host +
                             ": status 6 (remote process exited"),
                         ferry::error);
    sim::nccl_async_error(0, ncclSuccess);
    CHECK_THROWS_WITH_AS(comms[0].barrier(),
                         has("nccl_communicator (NCCL rank 0 of 2 on device 1 of " + host +
                             "): barrier on a communicator that was aborted"),
                         ferry::error);
    comms[1].abort();
  });
}

TEST_CASE("nccl_error and cuda_error carry the rank's device and status" * doctest::timeout(30)) {
  sim_run([] {
    auto comms = ferry::nccl_communicator::local({0, 1});
    try {
      comms[1].broadcast(std::span<float>(), -1);
      FAIL("no error");
    } catch (const ferry::nccl_error& e) {
      CHECK(e.call() == "ncclBroadcast");
      CHECK(e.rank() == 1);
      CHECK(e.device() == 1);
      CHECK(e.status() == int(ncclInvalidArgument));
    }
    try {
      (void)ferry::nccl_communicator::join(ferry::nccl_communicator::unique_id(), 3, 1, {1, 9});
      FAIL("no error");
    } catch (const ferry::cuda_error& e) {
      CHECK(e.device() == 9);
      CHECK(e.status() == int(cudaErrorInvalidDevice));
      CHECK(e.call() == "cudaSetDevice for NCCL rank 2 of 3");
    }
  });
}
