// A job in which rank 1 fails mid-epoch while the other ranks wait in the trainer's
// all-reduce: run by expect_abort.py, which wants a non-zero exit and "rank 1: <error>"
// on stderr within its timeout (never a hang).
//
//   mpi_abort_job step     rank 1's pipeline throws at record 37 (a map that rejects it)
//   mpi_abort_job thread   a thread of rank 1 lets an exception escape (terminate handler)
#include <array>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "ferry/distributed.hpp"
#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/map.hpp"
#include "ferry/stages/shard.hpp"
#include "ferry/train/host_backend.hpp"
#include "ferry/train/mirrored_trainer.hpp"

int main(int argc, char** argv) {
  ferry::distributed_context ctx(argc, argv, {.devices_per_rank = 0});
  const std::string mode = argc > 1 ? argv[1] : "step";
  return ferry::abort_on_exception([&] {
    ferry::train::host_backend::set_blas_threads(1);
    using sample = std::tuple<std::array<float, 4>, std::int32_t>;
    std::vector<int> ids(400);
    for (int i = 0; i < 400; ++i) ids[std::size_t(i)] = i;
    const int me = ctx.rank();
    auto steps = ferry::from_range(std::move(ids)) | ferry::shard(ctx.world_size(), me) |
                 ferry::map([me](int i) {
                   if (me == 1 && i / 3 == 37) throw std::runtime_error("bad record " + std::to_string(i / 3));
                   sample s{};
                   std::get<0>(s)[std::size_t(i % 4)] = 1.0f;
                   std::get<1>(s) = i % 2;
                   return s;
                 }) |
                 ferry::batch(4) | ferry::distribute(ferry::host_replicas{1});
    ferry::train::mirrored_trainer<ferry::train::host_backend, ferry::mpi_communicator> t(
        {.layers = {4, 4, 2}, .class_weights = {}}, {.seed = 1, .max_rows = 4}, ferry::one_replica_per_process(ctx));
    std::thread escaping;
    int k = 0;
    for (auto& s : steps) {
      if (mode == "thread" && me == 1 && k == 5) {
        // Wait for it here: the terminate handler ends the job and join never returns. (Going
        // on instead raced the handler with this thread's own MPI calls.)
        escaping = std::thread([] { throw std::runtime_error("worker failed"); });
        escaping.join();
      }
      t.train_step(s);  // the others wait here for rank 1, which never comes
      ++k;
    }
    if (escaping.joinable()) escaping.join();
    std::printf("rank %d: finished %d steps (the job should have been aborted)\n", me, k);
    return 0;
  });
}
