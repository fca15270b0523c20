// zip and concatenate take both sources: there is no pipe form.
// max-errors: 2
// first-error: ferry::zip and ferry::concatenate take both sources
#include <vector>

#include "ferry/sources/from_range.hpp"
#include "ferry/stages/zip.hpp"

int main() {
  auto p = ferry::from_range(std::vector<int>{1, 2}) | ferry::zip(ferry::from_range(std::vector<int>{3, 4}));
  while (auto e = p.next()) (void)*e;
}
