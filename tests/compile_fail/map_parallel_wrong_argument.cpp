// The same through the direct form with options: map(src, fn, {.workers = 4}).
// max-errors: 2
// expect: map_function_cannot_take<std::pair<int, float>
// first-error: ferry::map: the function cannot be called with the upstream's element
#include <utility>
#include <vector>

#include "ferry/sources/from_range.hpp"
#include "ferry/stages/map.hpp"

int main() {
  auto p = ferry::map(ferry::from_range(std::vector<std::pair<int, float>>{}),
                      [](const std::vector<int>& v) { return v.size(); }, {.workers = 4});
  while (auto e = p.next()) (void)*e;
}
