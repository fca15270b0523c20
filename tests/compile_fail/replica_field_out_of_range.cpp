// field<I> past the fields of a replica's slice of a distributed step.
// max-errors: 2
// expect: batch_field_index_out_of_range<3, 2,
// first-error: ferry::batch_of::field<I>: I is past the batch's last field
#include <array>
#include <cstdint>
#include <tuple>
#include <vector>

#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/distribute.hpp"

int main() {
  using example = std::tuple<std::array<float, 4>, std::int32_t>;
  auto steps = ferry::from_range(std::vector<example>(64)) | ferry::batch(8) |
               ferry::distribute(ferry::host_replicas{2});
  for (auto& step : steps)
    for (std::size_t r = 0; r < step.replicas(); ++r) (void)step[r].field<3>().size();
}
