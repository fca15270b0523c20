// ferry/stages/detail/distribute_plan.hpp: how distribute() splits one global batch of G
// rows among R replicas: the checks on its options, on G and on each batch's row count,
// each replica's slice of a whole or short batch under the remainder policy, and the
// padded copy of a short batch. distribute.hpp documents what users see; these run where
// the stage is built or makes a step (the consumer's thread or its staging thread) and
// call no user code.
#pragma once

#include <algorithm>
#include <atomic>
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

// Where distribute's G came from, for its errors.
enum class global_batch_from { option, upstream, inferred };

// Throws config_error when G rows do not divide among R replicas, saying where G came from.
inline void check_global_batch(std::size_t g, std::size_t replicas, global_batch_from from) {
  if (g % replicas == 0) return;
  const bool inferred = from == global_batch_from::inferred;
  throw config_error("distribute: the global batch size " + std::to_string(g) + " does not divide among " +
                     std::to_string(replicas) + " replicas" +
                     (inferred ? " (inferred from the first batch: no batch() visible upstream)"
                      : from == global_batch_from::option
                          ? " (distribute_options::global_batch)"
                          : " (the upstream batch stage's batch_size(); bucket_by_sequence_length's under a "
                            "token budget is max_tokens)") +
                     "; use a batch size that is a multiple of " + std::to_string(replicas) +
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

// G for a batch of m rows: the one known, or, when none is known yet, m itself (the first
// batch's size: inferred, and checked to divide among R); then m is checked against it.
// Throws config_error as check_global_batch and check_batch_rows do.
inline std::size_t settle_global_batch(std::atomic<std::size_t>& known, std::atomic<bool>& inferred,
                                       std::size_t m, std::size_t replicas) {
  std::size_t global = known.load(std::memory_order_relaxed);
  if (global == 0) {
    inferred.store(true, std::memory_order_relaxed);
    check_global_batch(m, replicas, global_batch_from::inferred);
    global = m;
    known.store(m, std::memory_order_relaxed);
  }
  check_batch_rows(m, global, inferred.load(std::memory_order_relaxed));
  return global;
}

// distribute()'s options as the stage is built. Throws config_error for remainder_policy::pad
// over elements that cannot be value-initialised, a global batch that does not divide among
// the replicas, or steps_ahead out of range (1 to 64 with a staging thread, else 0 or 1).
inline void check_distribute_options(remainder_policy remainder, bool default_constructible, std::size_t global_batch,
                                     std::size_t replicas, bool staging_thread, std::size_t steps_ahead) {
  if (remainder == remainder_policy::pad && !default_constructible)
    throw config_error("distribute: remainder_policy::pad fills with value-initialised "
                       "elements, and this element type is not default-constructible; "
                       "use drop or partial");
  if (global_batch != 0) check_global_batch(global_batch, replicas, global_batch_from::option);
  if (staging_thread && (steps_ahead == 0 || steps_ahead > 64))
    throw config_error("distribute: with staging_thread, steps_ahead is the number of steps made ahead: "
                       "1 to 64 (got " + std::to_string(steps_ahead) + ")");
  if (!staging_thread && steps_ahead > 1)
    throw config_error("distribute: steps_ahead must be 0 or 1 (got " + std::to_string(steps_ahead) +
                       "); more steps ahead need staging_thread = true");
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
