// flat_map's function must return a range; one element per element is map's job.
// max-errors: 2
// expect: flat_map_function_must_return_a_range<int, int>
// first-error: ferry::flat_map: the function must return a range
#include <vector>

#include "ferry/sources/from_range.hpp"
#include "ferry/stages/flat_map.hpp"

int main() {
  auto p = ferry::from_range(std::vector<int>{1, 2, 3}) | ferry::flat_map([](int x) { return x * 2; });
  while (auto e = p.next()) (void)*e;
}
