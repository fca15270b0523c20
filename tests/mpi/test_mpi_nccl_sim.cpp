// ferry::nccl_communicators(ctx) under mpirun -np 2, each process on the simulated CUDA
// runtime and NCCL (tests/cuda/sim, two GPUs each): when one rank cannot join, every rank
// must throw, none may wait forever in MPI for it (MPI_Exscan, MPI_Bcast). Modes (argv[1]):
//   ok               every rank joins: one communicator each, NCCL rank = MPI rank
//   no_device        rank 1 owns no device (devices_per_rank 0 there)
//   unusable_device  rank 1 cannot make its device current (sim::fail_set_device)
//   unique_id        rank 0's ncclGetUniqueId fails (sim::nccl_fail_unique_id)
// A rank left waiting is caught by the watchdog, which aborts the job (a failure).
// (The simulated NCCL is per process: the clique of "ok" forms without a rendezvous and
// runs no collective; test_mpi and collective_nccl_sim cover those.)
#include <cuda_runtime_api.h>  // the simulator's
#include <mpi.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "common/doubles.hpp"
#include "ferry/cuda/error.hpp"
#include "ferry/distributed.hpp"

using namespace std::chrono_literals;

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "ok";
  int provided = 0, rank = 0, size = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int failures = 0;
  auto fail = [&](const std::string& what) {
    ++failures;
    std::fprintf(stderr, "FAILED rank %d (%s): %s\n", rank, mode.c_str(), what.c_str());
  };
  auto expect = [&](const std::string& got, const std::string& want) {
    if (got.find(want) == std::string::npos) fail("the error \"" + got + "\" does not contain \"" + want + "\"");
  };
  if (size != 2) fail("run with -np 2");
  sim::reset(1, 0);
  {
    ferry_test::watchdog wd(20s, "nccl_communicators (a rank left waiting in MPI)");
    ferry::distributed_context ctx({.devices_per_rank = mode == "no_device" && rank == 1 ? 0 : 1});
    if (mode == "unusable_device" && rank == 1) sim::fail_set_device(1, 1, cudaErrorDevicesUnavailable);
    if (mode == "unique_id" && rank == 0) sim::nccl_fail_unique_id(ncclSystemError);
    std::string err = "(no error)";
    bool config = false, cuda = false;
    try {
      auto comms = ferry::nccl_communicators(ctx);
      if (comms.size() != 1 || comms[0].rank() != rank || comms[0].size() != 2 || comms[0].device() != rank)
        fail("communicators: " + std::to_string(comms.size()) + ", rank " +
             std::to_string(comms.empty() ? -1 : comms[0].rank()));
    } catch (const ferry::config_error& e) {
      err = e.what(), config = true;
    } catch (const ferry::cuda_error& e) {
      err = e.what(), cuda = true;
    } catch (const std::exception& e) {
      err = e.what();
    }
    if (mode == "ok") {
      if (err != "(no error)") fail("unexpected error: " + err);
    } else if (mode == "no_device") {
      if (!config) fail("not a config_error: " + err);
      expect(err, rank == 1 ? "nccl_communicators: rank 1 owns no CUDA device (devices_per_rank is 0)"
                            : "nccl_communicators: rank 1 owns no CUDA device, so no rank joins NCCL");
    } else if (mode == "unusable_device") {
      if (cuda != (rank == 1)) fail(std::string(rank == 1 ? "not" : "") + " a cuda_error: " + err);
      expect(err, rank == 1 ? "cudaSetDevice for nccl_communicators on rank 1 failed on device 1"
                            : "rank 1 cannot make one of its CUDA devices current");
    } else if (mode == "unique_id") {
      expect(err, rank == 0 ? "ncclGetUniqueId failed" : "rank 0 could not make the NCCL id");
    } else {
      fail("unknown mode");
    }
    MPI_Barrier(MPI_COMM_WORLD);  // every rank came back
    if (!failures) std::printf("rank %d (%s): ok: %s\n", rank, mode.c_str(), err.c_str());
  }
  MPI_Finalize();
  return failures ? 1 : 0;
}
