// ferry/collective/agree_steps.hpp: every rank runs the same number of steps, agreed
// before the epoch starts, so no rank waits forever in an all-reduce that another rank
// never enters (the DDP / MultiWorkerMirroredStrategy hang with uneven shards).
//
//   const std::int64_t local = ferry::steps_for(my_rows, per_rank_batch, ferry::step_policy::pad);
//   const std::int64_t n = ferry::agree_steps(ctx.world(), local, ferry::step_policy::pad);
//   auto it = steps.begin();
//   for (std::int64_t i = 0; i < n; ++i) {
//     if (it != steps.end()) { trainer.train_step(*it); ++it; }
//     else trainer.train_step(std::vector<ferry::train::replica_input>(R));  // empty step
//   }
//
// Policies (the same words as distribute's remainder_policy):
//   drop  n = MIN of the ranks' step counts; ranks with more batches stop early and their
//         extra records are not seen this epoch (every step is full everywhere).
//   pad   n = MAX; a rank that runs out feeds empty steps (rows = 0: no loss, no gradient,
//         it still joins the all-reduce), so every record of the epoch is seen exactly
//         once. The mirrored trainer divides by the global weight sum, so an empty slice
//         changes nothing but the step's participants.
//
// A rank's local count: its rows and its per-rank batch (steps_for), or any count the
// user knows. One collective (an integer MPI_Allreduce); every rank must call it.
// Throws config_error for a negative count (rows, total or steps) or a zero batch, a rank
// outside the world; communicator errors
// propagate. Runs no user code.
#pragma once

#include <cstdint>
#include <string>

#include "ferry/error.hpp"

namespace ferry {

// How ranks agree on a step count: drop takes the least, pad the most (see the file's
// top).
enum class step_policy { drop, pad };

// Steps a rank with `rows` rows takes at `batch_rows` rows per step: full batches only
// (drop) or one more for a partial last batch (pad). (Not `batch`: ferry::batch, the stage.)
inline std::int64_t steps_for(std::int64_t rows, std::int64_t batch_rows, step_policy p) {
  if (rows < 0) throw config_error("steps_for: negative row count " + std::to_string(rows));
  if (batch_rows < 1) throw config_error("steps_for: the batch must hold at least 1 row");
  return rows / batch_rows + (p == step_policy::pad && rows % batch_rows != 0);  // (rows + b - 1) could overflow
}

// Rows that element-level sharding (shard(world, rank, by_element)) gives `rank` out of
// `total`: elements k with k % world == rank.
inline std::int64_t shard_rows(std::int64_t total, int world, int rank) {
  if (world < 1 || rank < 0 || rank >= world)
    throw config_error("shard_rows: rank " + std::to_string(rank) + " of " + std::to_string(world));
  if (total < 0) throw config_error("shard_rows: negative row count " + std::to_string(total));
  return total / world + (rank < total % world ? 1 : 0);
}

// The number of steps every rank runs this epoch. Comm: anything with integer
// all_reduce_min / all_reduce_max (mpi_communicator).
template <class Comm>
std::int64_t agree_steps(Comm& comm, std::int64_t local, step_policy p) {
  if (local < 0) throw config_error("agree_steps: negative local step count " + std::to_string(local));
  return p == step_policy::drop ? comm.all_reduce_min(local) : comm.all_reduce_max(local);
}

}  // namespace ferry
