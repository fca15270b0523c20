// The host oracle of test_train_sim: the trainer on its host backend (OpenBLAS + Thrust's
// CPP system), built in its own file (sim_reference.cpp) because the sim test's file sees
// the simulator's Thrust shim instead of the real Thrust.
#pragma once

#include <array>
#include <cstdint>
#include <tuple>
#include <vector>

#include "blobs.hpp"
#include "ferry/train/mlp.hpp"
#include "ferry/train/mirrored_trainer.hpp"

namespace sim_ref {

inline constexpr int dim = 32;
using row = std::tuple<std::array<float, dim>, std::int32_t>;

using blobs = train_test::blobs;
inline blobs make_blobs(int n, int classes, unsigned seed) { return train_test::make_blobs(n, dim, classes, seed); }
std::vector<row> rows_of(const blobs& d, std::size_t n);

// The packed gradient buffer (gradients, then the step statistics) of one forward/backward
// of a fresh replica on rows [0, rows) of d, the last rows - valid of them padding.
std::vector<float> first_gradient(const ferry::train::mlp_config& cfg, std::uint64_t seed, const blobs& d,
                                  int rows, int valid);

struct curve {
  std::vector<double> loss, accuracy, rows, weight;  // per step
  std::vector<float> params;                 // after the last step
  ferry::train::step_stats eval{};           // on the rows after the training steps
};
// One host replica, global batch B, `steps` steps over consecutive rows, then evaluate()
// on the next `eval_rows` rows.
curve train(const ferry::train::mlp_config& cfg, const ferry::train::trainer_options& o, const blobs& d, int B,
            int steps, int eval_rows);
// from_range(rows) | batch(B) | distribute(host_replicas{1}, pad) into one host replica,
// for `epochs` epochs (rewind between them).
curve train_pipeline(const ferry::train::mlp_config& cfg, const ferry::train::trainer_options& o,
                     const std::vector<row>& rows, int B, int epochs);

}  // namespace sim_ref
