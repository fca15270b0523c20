// The trainer reads field 0 of a step as floats: rows of another element type (int pixel
// values here) must not compile, rather than train on their bytes read as floats.
// max-errors: 2
// expect: trainer_inputs_not_floats<(const )?std::array<int, 4> ?>
// first-error: mirrored_trainer: field 0 \(the inputs\) must be float, float\[N\] or std::array<float, N>
#include <array>
#include <cstdint>
#include <tuple>
#include <vector>

#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/train/mirrored_trainer.hpp"

int main() {
  using row = std::tuple<std::array<std::int32_t, 4>, std::int32_t>;
  auto steps = ferry::from_range(std::vector<row>(64)) | ferry::batch(32) |
               ferry::distribute(ferry::host_replicas{2});
  std::vector<ferry::train::replica_input> in;
  for (auto& step : steps) ferry::train::step_inputs(step, 2, 4, in);
}
