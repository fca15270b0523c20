// ferry/stages/detail/bucket_shape.hpp: the shape of bucket_by_sequence_length's batches:
// the checks on its boundaries and batch sizes, the bucket of a length, the padded width L
// of a bucket's batch, and the fingerprint a restore must match.
// bucket_by_sequence_length.hpp documents what users see; these run on the thread that
// builds the stage or calls next(), and call no user code.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "ferry/detail/random.hpp"
#include "ferry/error.hpp"

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
    return (longest + multiple_of - 1) / multiple_of * multiple_of;
  }
  // L of ragged field `field` in a batch of bucket b whose longest row there holds
  // `longest` values. Throws config_error for a row over uint32's lengths, or longer than
  // the boundary it is padded to (length_fn did not count the field's values).
  std::size_t field_width(std::size_t b, std::size_t longest, std::size_t field) const {
    if (longest > std::numeric_limits<std::uint32_t>::max())
      throw config_error("bucket_by_sequence_length: a row of " + std::to_string(longest) + " values in field " +
                         std::to_string(field) + ": lengths are uint32; cut such rows before bucketing");
    if (to_boundary && b < bounds.size() && longest > bounds[b] - 1)
      throw config_error("bucket_by_sequence_length: a row of bucket " + std::to_string(b) + " has " +
                         std::to_string(longest) + " values in field " + std::to_string(field) +
                         ", more than the bucket's boundary - 1 = " + std::to_string(bounds[b] - 1) +
                         " it is padded to (pad_to_bucket_boundary); length_fn must count the field's values");
    return width(b, longest);
  }
  // A fingerprint of the boundaries, batch sizes and token budget.
  std::uint64_t fingerprint(const std::vector<std::size_t>& sizes, std::size_t max_tokens) const {
    std::uint64_t h = 0x9e3779b97f4a7c15ull;
    for (std::size_t x : bounds) h = splitmix64(h ^ x)();
    for (std::size_t x : sizes) h = splitmix64(h ^ (x + 0x100000000ull))();
    return splitmix64(h ^ max_tokens)();
  }
};

}  // namespace ferry::detail
