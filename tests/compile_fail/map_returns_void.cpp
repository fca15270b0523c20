// map's function must return the new element.
// max-errors: 2
// expect: map_function_returns_void<int
// first-error: ferry::map: the function returns void
#include <vector>

#include "ferry/sources/from_range.hpp"
#include "ferry/stages/map.hpp"

int main() {
  auto p = ferry::from_range(std::vector<int>{1, 2, 3}) | ferry::map([](int) {});
  while (auto e = p.next()) (void)*e;
}
