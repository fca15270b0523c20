// filter's predicate must return something that converts to bool.
// max-errors: 2
// expect: filter_predicate_result_is_not_bool<int, std::vector<int>
// first-error: ferry::filter: the predicate's result does not convert to bool
#include <vector>

#include "ferry/sources/from_range.hpp"
#include "ferry/stages/filter.hpp"

int main() {
  auto p = ferry::from_range(std::vector<int>{1, 2, 3}) |
           ferry::filter([](int x) { return std::vector<int>(x); });
  while (auto e = p.next()) (void)*e;
}
