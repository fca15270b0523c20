// ferry/stages/detail/bucket_shape.hpp: the shape of bucket_by_sequence_length's batches:
// the checks on its boundaries and batch sizes, the bucket of a length, the padded width L
// of a bucket's batch, the check of a row entering a bucket, the fingerprint a restore
// must match, and the rows a saved state holds.
// bucket_by_sequence_length.hpp documents what users see; these run on the thread that
// builds the stage or calls next(), and call no user code.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <ranges>
#include <tuple>
#include <utility>
#include <string>
#include <vector>

#include "ferry/batch_of.hpp"
#include "ferry/detail/random.hpp"
#include "ferry/error.hpp"
#include "ferry/state.hpp"

namespace ferry::detail {

struct bucket_shape {
  std::vector<std::size_t> bounds;  // increasing, from 1: bounds.size() + 1 buckets
  std::size_t multiple_of = 1;      // L rounded up to a multiple of this
  bool to_boundary = false;         // L = the bucket's upper boundary - 1 (pad_to_bucket_boundary)

  // Throws config_error for boundaries that do not increase from 1, a number of batch sizes
  // other than boundaries + 1 (none with a token budget), a batch size or multiple_of of 0.
  static void check(const std::vector<std::size_t>& bounds, const std::vector<std::size_t>& sizes,
                    std::size_t max_tokens, std::size_t multiple_of) {
    const std::string me = "bucket_by_sequence_length: ";
    if (max_tokens && !sizes.empty())
      throw config_error(me + "give batch sizes or a token budget (max_tokens), not both (got " +
                         std::to_string(sizes.size()) + " batch sizes and max_tokens = " + std::to_string(max_tokens) +
                         ")");
    if (!max_tokens && sizes.size() != bounds.size() + 1)
      throw config_error(me + "give one batch size per bucket: " + std::to_string(bounds.size()) +
                         " boundaries make " + std::to_string(bounds.size() + 1) + " buckets, and there are " +
                         std::to_string(sizes.size()) + " batch sizes");
    for (std::size_t i = 0; i < bounds.size(); ++i)
      if (bounds[i] == 0 || (i && bounds[i] <= bounds[i - 1]))
        throw config_error(me + "the boundaries must increase from at least 1 (boundary " + std::to_string(i) +
                           " is " + std::to_string(bounds[i]) +
                           (i ? ", after " + std::to_string(bounds[i - 1]) : std::string()) + ")");
    for (std::size_t i = 0; i < sizes.size(); ++i)
      if (sizes[i] == 0) throw config_error(me + "batch size " + std::to_string(i) + " is 0; each must be at least 1");
    if (multiple_of == 0) throw config_error(me + "multiple_of must be at least 1 (got 0)");
  }

  // The bucket of a row whose length (length_fn's) is len.
  std::size_t bucket_of(std::size_t len) const {
    return static_cast<std::size_t>(std::upper_bound(bounds.begin(), bounds.end(), len) - bounds.begin());
  }
  // L for bucket b whose longest row is `longest` long: the boundary, or rounded up.
  std::size_t width(std::size_t b, std::size_t longest) const {
    if (to_boundary && b < bounds.size()) return bounds[b] - 1;
    return round_up(longest, multiple_of);
  }
  // Checks a row of bucket b as it enters the bucket: its ragged field `field` holds
  // `values` values. Throws config_error, naming the row by its place in the epoch, for a
  // field over uint32's lengths or longer than the boundary it is padded to.
  void check_row(std::size_t b, std::size_t values, std::size_t field, std::uint64_t row) const {
    if (values <= std::numeric_limits<std::uint32_t>::max() && !(to_boundary && b < bounds.size() && values > bounds[b] - 1))
      return;
    const std::string me = "bucket_by_sequence_length: row " + std::to_string(row) + " of the epoch has " +
                           std::to_string(values) + " values in field " + std::to_string(field);
    if (values > std::numeric_limits<std::uint32_t>::max())
      throw config_error(me + ": lengths are uint32; cut such rows before bucketing (the row is dropped)");
    throw config_error(me + ", more than bucket " + std::to_string(b) + "'s boundary - 1 = " +
                       std::to_string(bounds[b] - 1) +
                       " it is padded to (pad_to_bucket_boundary); length_fn must count the field's values (the "
                       "row is dropped)");
  }
  // A fingerprint of the boundaries, batch sizes and token budget.
  std::uint64_t fingerprint(const std::vector<std::size_t>& sizes, std::size_t max_tokens) const {
    std::uint64_t h = 0x9e3779b97f4a7c15ull;
    for (std::size_t x : bounds) h = splitmix64(h ^ x)();
    for (std::size_t x : sizes) h = splitmix64(h ^ (x + 0x100000000ull))();
    return splitmix64(h ^ max_tokens)();
  }
};

// f(field, values) for each ragged field of element e.
template <class T, class F>
void each_ragged_size(const T& e, F&& f) {
  using L = typename field_list<T>::type;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (
        [&] {
          if constexpr (ragged_field<std::tuple_element_t<I, L>>) f(I, std::size_t(std::ranges::size(get_field<I>(e))));
        }(),
        ...);
  }(std::make_index_sequence<std::tuple_size_v<L>>{});
}

// A saved bucket_by_sequence_length's rows held in each bucket (their places in the epoch),
// refilled from row `from` to row `to` (at most `refill` rows); `sizes`: each bucket's
// batch size. Throws config_error for a damaged state.
inline std::vector<std::vector<std::uint64_t>> read_held(state_reader& r, const std::vector<std::size_t>& sizes,
                                                         std::uint64_t from, std::uint64_t to, std::uint64_t refill) {
  const std::string me = "restore_state: bucket_by_sequence_length: a damaged state (";
  if (from > to || to - from > refill)
    throw config_error(me + "a refill from row " + std::to_string(from) + " to " + std::to_string(to) + ")");
  std::vector<std::vector<std::uint64_t>> want(sizes.size());
  for (std::size_t b = 0; b < sizes.size(); ++b) {
    const std::uint64_t n = r.get_count(sizes[b], "bucket_by_sequence_length", "held", "holds in a bucket");
    for (std::uint64_t i = 0; i < n; ++i) {
      want[b].push_back(r.get());
      if (want[b].back() < from || want[b].back() >= to || (i && want[b][i] <= want[b][i - 1]))
        throw config_error(me + "row " + std::to_string(want[b].back()) + " in a bucket, outside rows " +
                           std::to_string(from) + " to " + std::to_string(to) + ")");
    }
  }
  return want;
}

}  // namespace ferry::detail
