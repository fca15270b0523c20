// Stages take their upstream by value: piping an lvalue pipeline is refused (copying a
// half-read pipeline would read its elements twice).
// max-errors: 2
// expect: pipeline_is_an_lvalue<ferry::detail::range_source<std::vector<int> ?>&>
// first-error: ferry: a pipeline is a single-pass value: move it into the next stage
#include <vector>

#include "ferry/sources/from_range.hpp"
#include "ferry/stages/map.hpp"

int main() {
  auto src = ferry::from_range(std::vector<int>{1, 2, 3});
  auto p = src | ferry::map([](int x) { return x + 1; });
  while (auto e = p.next()) (void)*e;
}
