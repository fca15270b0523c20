// field<I> past the fields of a const batch (the const overload).
// max-errors: 2
// expect: batch_field_index_out_of_range<1, 1,
// first-error: ferry::batch_of::field<I>: I is past the batch's last field
#include <vector>

#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"

int main() {
  auto p = ferry::from_range(std::vector<float>(64)) | ferry::batch(8);
  for (const auto& b : p) (void)b.field<1>()[0];
}
