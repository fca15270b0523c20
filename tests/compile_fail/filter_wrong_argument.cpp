// filter with a predicate that cannot take the upstream's element.
// max-errors: 2
// expect: filter_predicate_cannot_take<ferry::record
// first-error: ferry::filter: the predicate cannot be called with the upstream's element
#include <string>

#include "ferry/sources/from_files.hpp"
#include "ferry/stages/filter.hpp"

int main() {
  auto p = ferry::from_files({"train.tfrecord"}, ferry::tfrecord{}) |
           ferry::filter([](const std::string& s) { return !s.empty(); });
  while (auto e = p.next()) (void)e->size();
}
