// concatenate's two sources must hand out the same type.
// max-errors: 2
// expect: concatenate_sources_differ_in_value_type<int, float>
// first-error: ferry::concatenate: both sources must have the same value_type
#include <vector>

#include "ferry/sources/from_range.hpp"
#include "ferry/stages/concatenate.hpp"

int main() {
  auto p = ferry::concatenate(ferry::from_range(std::vector<int>{1, 2}), ferry::from_range(std::vector<float>{3}));
  while (auto e = p.next()) (void)*e;
}
