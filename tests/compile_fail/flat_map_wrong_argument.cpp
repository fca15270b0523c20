// flat_map with a function that cannot take the upstream's element.
// max-errors: 2
// expect: flat_map_function_cannot_take<std::vector<int>
// first-error: ferry::flat_map: the function cannot be called with the upstream's element
#include <string>
#include <vector>

#include "ferry/sources/from_range.hpp"
#include "ferry/stages/flat_map.hpp"

int main() {
  auto p = ferry::from_range(std::vector<std::vector<int>>{}) |
           ferry::flat_map([](const std::string& s) { return std::vector<char>(s.begin(), s.end()); });
  while (auto e = p.next()) (void)*e;
}
