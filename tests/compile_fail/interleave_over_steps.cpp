// interleave's open slots would each hold a step, valid only until the next is asked for.
// max-errors: 2
// first-error: ferry::interleave over distribute\(\)'s steps
#include <cstdint>
#include <vector>

#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/interleave.hpp"

int main() {
  auto p = ferry::from_range(std::vector<std::uint64_t>(8, 1)) | ferry::batch(4) |
           ferry::distribute(ferry::host_replicas{2}) |
           ferry::interleave([](auto&& st) { return ferry::from_range(std::vector<std::size_t>{st.valid()}); },
                             {.workers = 0, .cycle = 2});
  while (auto e = p.next()) (void)*e;
}
