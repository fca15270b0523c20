// ferry/stages/detail/distribute_plan.hpp: how distribute() splits one global batch of G
// rows among R replicas: the checks on G and on each batch's row count, each replica's
// slice of a whole or short batch under the remainder policy, and the padded copy of a
// short batch. distribute.hpp documents what users see; these run wherever it makes a
// step (the consumer's thread or its staging thread) and call no user code.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <memory_resource>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/batch_of.hpp"
#include "ferry/error.hpp"
#include "ferry/step.hpp"

namespace ferry::detail {

// Throws config_error when G rows do not divide among R replicas. inferred: G was taken
// from the first batch's size (no batch() visible upstream).
inline void check_global_batch(std::size_t g, std::size_t replicas, bool inferred) {
  if (g % replicas == 0) return;
  throw config_error("distribute: the global batch size " + std::to_string(g) +
                     (inferred ? " (inferred from the first batch: no batch() visible upstream)" : "") +
                     " does not divide among " + std::to_string(replicas) +
                     " replicas; use a batch size that is a multiple of " + std::to_string(replicas) +
                     (inferred ? ", and if that first batch was short (fewer rows than one batch), "
                                 "pass distribute_options::global_batch"
                               : ""));
}

// Throws config_error for a batch of m rows larger than G (with an inferred G: the first
// batch was short).
inline void check_batch_rows(std::size_t m, std::size_t global, bool inferred) {
  if (m <= global) return;
  if (inferred)
    throw config_error("distribute: got a batch of " + std::to_string(m) + " rows after a first batch of " +
                       std::to_string(global) + ", from which the global batch size had been inferred (no "
                       "batch() visible upstream); that first batch was short: pass "
                       "distribute_options::global_batch");
  throw config_error("distribute: got a batch of " + std::to_string(m) + " rows, larger than the global batch size " +
                     std::to_string(global));
}

// Each replica's slice of a batch of m rows (0 < m <= G) into `slices` (R of them), every
// replica G / R rows wide. A whole batch: equal parts. A short one under drop: false (skip
// it); under pad: the parts of the padded batch, `valid` counting the real rows; under
// partial: m / R rows each, the first m % R replicas one more.
inline bool plan_slices(std::size_t m, std::size_t global, remainder_policy policy,
                        std::vector<replica_slice>& slices) {
  const std::size_t R = slices.size(), per = global / R;
  if (m == global) {
    for (std::size_t r = 0; r < R; ++r) slices[r] = {r * per, per, per};
  } else if (policy == remainder_policy::drop) {
    return false;
  } else if (policy == remainder_policy::pad) {
    for (std::size_t r = 0; r < R; ++r) slices[r] = {r * per, per, std::min(per, m > r * per ? m - r * per : 0)};
  } else {
    std::size_t first = 0;
    for (std::size_t r = 0; r < R; ++r) {
      const std::size_t rows = m / R + (r < m % R ? 1 : 0);
      slices[r] = {first, rows, rows};
      first += rows;
    }
  }
  return true;
}

// A short batch copied into a batch of `global` rows from `res`, its tail rows
// value-initialised (a padded field's: zero values, length 0). Throws what the resource
// throws.
template <class T>
batch_of<T> pad_batch(const std::shared_ptr<std::pmr::memory_resource>& res, std::size_t global,
                      const batch_of<T>& b) {
  return batch_collator<T>{}.pad_rows(res, global, b);
}

}  // namespace ferry::detail
