// The same refusal through a stage's direct form, take(src, n).
// max-errors: 2
// expect: pipeline_is_an_lvalue<
// first-error: ferry: a pipeline is a single-pass value: move it into the next stage
#include <vector>

#include "ferry/sources/from_range.hpp"
#include "ferry/stages/take.hpp"

int main() {
  auto src = ferry::from_range(std::vector<int>{1, 2, 3});
  auto p = ferry::take(src, 2);
  while (auto e = p.next()) (void)*e;
}
