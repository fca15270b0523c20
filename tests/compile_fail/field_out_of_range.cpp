// field<I> past the batch's fields: the message gives the field count.
// max-errors: 2
// expect: batch_field_index_out_of_range<2, 2,
// first-error: ferry::batch_of::field<I>: I is past the batch's last field
#include <array>
#include <cstdint>
#include <tuple>
#include <vector>

#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"

int main() {
  using example = std::tuple<std::array<float, 4>, std::int32_t>;
  auto p = ferry::from_range(std::vector<example>(64)) | ferry::batch(8);
  for (auto& b : p) {
    auto labels = b.field<2>();
    (void)labels.size();
  }
}
