// map with a function that cannot take the upstream's element (ferry::record, not
// std::string): the first error is ferry's, naming the element type.
// max-errors: 2
// expect: map_function_cannot_take<ferry::record
// first-error: ferry::map: the function cannot be called with the upstream's element
#include <string>

#include "ferry/sources/from_files.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/map.hpp"

int main() {
  auto p = ferry::from_files({"train.tfrecord"}, ferry::tfrecord{}) |
           ferry::map([](const std::string& s) { return s.size(); }) | ferry::batch(32);
  for (auto& b : p) (void)b.size();
}
