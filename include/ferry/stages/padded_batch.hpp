// ferry/stages/padded_batch.hpp: padded_batch(n, {...}) collates n elements as batch()
// does, except that each ragged field (a std::vector, std::string, span of values) becomes
// a padded field: n rows of the same length L, each row its values then padding, and each
// row's real length. Fixed fields pass unchanged. tf.data's padded_batch.
//
//   // rows(): a new source of std::pair<std::vector<std::int32_t>, std::int32_t> (tokens, label)
//   auto p = rows() | ferry::padded_batch(64);                       // L: the batch's longest row
//   auto q = rows() | ferry::padded_batch(64, {.multiple_of = 8});   // ... rounded up to 8
//   auto r = rows() | ferry::padded_batch(64, {.length = 128, .truncate = true, .pad_value = -1});
//   for (auto& b : p) {
//     ferry::padded_view<std::int32_t> t = b.field<0>();   // t.width == L, t[i] a row of L
//     std::span<const std::uint32_t> len = t.lengths;       // real lengths, each <= L
//   }
//   auto m = rows() | ferry::padded_batch(64, ferry::with_mask);  // + field<2>(): t's mask
//
// The batch's type is batch_of<padded_element_t<T>>: each ragged field of T named
// ferry::padded<its value type>. distribute() splits such batches across replicas as it
// does fixed ones: each replica gets its rows (L values each) and their lengths, on the
// device for CUDA, with L free to change from step to step (replica_batch::field<I>() is a
// padded_view there too).
//
// Masks, on request (with_mask): after the element's own fields, one padded<std::uint8_t>
// field per ragged field, in their order, with the same L and lengths: row i holds
// lengths[i] ones, then zeros. distribute() splits and copies it as it does the rows.
//
// L, for each padded field on its own: `length` when set (every batch the same L), else
// (length = longest_row, the default) the longest row of the batch rounded up to a
// multiple of `multiple_of`. A row longer
// than a set `length` is cut to it with `truncate = true`, else a config_error names the
// row. Padding values are `pad_value` converted to the field's value type (value
// initialised for a non-arithmetic one). Lengths are uint32: a row of 2^32 values or more
// is a config_error.
//
// Threads: runs on the thread calling next(), which pulls the upstream and collates;
// padded_batch runs no user code and starts no thread.
//
// Errors: config_error for n == 0, `length` == 0, `multiple_of` == 0, a pad_value that is
// not a value of a padded field's type (-1 for uint8 tokens), a batch too large to
// address, and a row longer than `length` without truncate ("padded_batch: row 1234 of the
// epoch has 70 values in field 0, more than length = 64 ..."). Upstream errors propagate
// unchanged. Either way the elements already pulled into the batch being built are
// dropped with it, as batch() drops them: the next batch starts after the element that
// failed.
//
// Memory: the n elements of the batch being built (that vector's capacity is reused; none
// over a source that lends its elements where they lie, as from_range does), and
// the batch: n × L values and n lengths per padded field (a mask: n × L bytes and n
// lengths more), n values per fixed field, from a
// std::pmr::memory_resource: a buffer_pool private to the stage unless distribute() hands
// it its pinned pool (set_buffer_resource), as for batch().
//
// Checkpoints: a batch is built whole inside one next(): save() records the upstream's
// state, the stage's tag and options (a restore into other options is a config_error),
// and the count of rows this epoch (so an error names the same row after a restore).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <memory_resource>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ferry/batch_of.hpp"
#include "ferry/error.hpp"
#include "ferry/memory/buffer.hpp"
#include "ferry/source.hpp"
#include "ferry/stage.hpp"
#include "ferry/state.hpp"

namespace ferry {

// padded_batch_options::length's default: each batch's longest row.
inline constexpr std::size_t longest_row = std::numeric_limits<std::size_t>::max();

// padded_batch()'s options, a braced list: padded_batch(64, {.multiple_of = 8}).
struct padded_batch_options {
  // L for every batch; longest_row: each batch's longest row, rounded up to multiple_of.
  std::size_t length = longest_row;
  std::size_t multiple_of = 1;  // the longest row rounded up to a multiple of this (>= 1)
  bool truncate = false;  // cut rows longer than `length` (else they are a config_error)
  double pad_value = 0;  // padding, converted to each padded field's value type
  bool drop_remainder = false;  // drop a last batch with fewer than n elements
  // Where batch buffers come from; null means a buffer_pool private to the stage.
  std::shared_ptr<std::pmr::memory_resource> resource = nullptr;
};

// The element type padded_batch()'s batches are named by (batch_of<padded_element_t<T>>):
// T's ragged fields as ferry::padded<value type>; with Mask (with_mask), then a
// padded<std::uint8_t> mask per ragged field.
template <class T, bool Mask = false>
using padded_element_t = typename detail::padded_element<T, Mask>::type;

namespace detail {

template <source Up, bool Mask = false>
class padded_batch_source
    : public stage<padded_batch_source<Up, Mask>, Up, batch_of<padded_element_t<value_t<Up>, Mask>>> {
  using T = value_t<Up>;
  using P = padded_element_t<T, Mask>;
  using B = batch_of<P>;
  friend stage<padded_batch_source, Up, B>;
  static_assert(batchable<T>,
                "ferry::padded_batch: each field must be trivially copyable (a struct, number or "
                "std::array) or a contiguous range of trivially-copyable values (std::vector<int>, "
                "std::string)");
  static_assert(!no_ragged<typename field_list<T>::type>::value,
                "ferry::padded_batch: the elements have no ragged field (vector, string) to pad; "
                "use batch()");
  static constexpr std::size_t nf = B::field_count;
  static constexpr std::size_t ns = std::tuple_size_v<typename field_list<T>::type>;  // T's own fields

 public:
  static constexpr char name[] = "padded_batch";
  // Throws config_error for bad options (see the file's top).
  padded_batch_source(Up up, std::size_t n, padded_batch_options o)
      : stage<padded_batch_source, Up, B>(std::move(up)), target_(n, std::move(o.resource)), o_(std::move(o)) {
    check_pad_value<T>(o_.pad_value, name);
    if (target_.rows > std::numeric_limits<std::size_t>::max() / 64)
      throw config_error("padded_batch: a batch of " + std::to_string(target_.rows) +
                         " rows does not fit in memory's address range; use a smaller batch size");
  }

 private:
  collation& collates() { return target_; }  // the base's batch_size() and buffer hook
  std::optional<B> pull() {
    std::span<const T> rows;
    if constexpr (view_source<Up>) {
      // A source over memory (from_range) lends the rows where they lie: collated from
      // there, with no copy into hold_ (bench_padded_batch: 0.85 -> 0.94 of the loop, median of 3).
      rows = this->pull_up_view(target_.rows);
      rows_ += rows.size();
    } else {
      hold_.clear();
      while (hold_.size() < target_.rows) {
        std::optional<T> e;
        try {
          e = this->pull_up();
        } catch (...) {
          ++rows_;  // the failed element held a row's place: later rows keep their numbers
          throw;
        }
        if (!e) break;
        ++rows_;
        hold_.push_back(std::move(*e));
      }
      rows = hold_;
    }
    if (rows.empty() || (o_.drop_remainder && rows.size() < target_.rows)) return std::nullopt;
    std::array<std::size_t, nf> width{};
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((width[I] = field_width<I>(rows)), ...);
    }(std::make_index_sequence<ns>{});  // (mask fields take their field's)
    return collator_.collate_padded(target_.resource, rows, width, o_.pad_value);
  }

  // Field I's L for `rows` (0 for a fixed field: unused); checks each row.
  template <std::size_t I>
  std::size_t field_width(std::span<const T> rows) const {
    if constexpr (!B::template is_padded<I>) {
      return 0;
    } else {
      using E = typename field_traits<typename B::template field_t<I>>::element;
      std::size_t longest = 0;
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const std::size_t len = std::ranges::size(get_field<I>(rows[i]));
        if (len > std::numeric_limits<std::uint32_t>::max() && !(fixed() && o_.truncate))
          throw config_error(row_name(rows.size(), i) + " has " + std::to_string(len) + " values in field " + std::to_string(I) +
                             ": padded_batch's lengths are uint32; cut such rows before padded_batch");
        if (fixed() && len > o_.length && !o_.truncate)
          throw config_error(row_name(rows.size(), i) + " has " + std::to_string(len) + " values in field " + std::to_string(I) +
                             ", more than length = " + std::to_string(o_.length) +
                             "; set truncate = true to cut such rows, or a larger length");
        longest = std::max(longest, len);
      }
      const std::size_t w = fixed() ? o_.length : round_up(longest, o_.multiple_of);
      if (w > std::numeric_limits<std::size_t>::max() / sizeof(E) / rows.size())
        throw config_error("padded_batch: a batch of " + std::to_string(rows.size()) + " rows of " +
                           std::to_string(w) + " values does not fit in memory's address range");
      return w;
    }
  }
  bool fixed() const { return o_.length != longest_row; }
  // Row i of the batch of `count` rows just pulled, named by its place in the epoch.
  std::string row_name(std::size_t count, std::size_t i) const {
    return "padded_batch: row " + std::to_string(rows_ - count + i) + " of the epoch";
  }

  template <class F>
  void config(F&& f) const {
    f("batch", target_.rows);
    f("length", o_.length);
    f("multiple_of", o_.multiple_of);
    f("truncate", std::uint64_t(o_.truncate));
    f("drop_remainder", std::uint64_t(o_.drop_remainder));
    f("mask", std::uint64_t(Mask));
  }
  void save_words(state_writer& w) const { w.put(rows_); }
  void restore_words(state_reader& r) { rows_ = r.get(); }
  void start_epoch() { rows_ = 0; }

  collation target_;  // n rows per batch, and where batches are collated
  padded_batch_options o_;  // (its resource moved into target_)
  std::uint64_t rows_ = 0;  // elements pulled this epoch, errors included (names a row in errors)
  batch_collator<P> collator_;
  std::vector<T> hold_;  // the batch being built (unless the upstream lends views); capacity reused
};

// with_mask's place in the adaptors' arguments: nothing, or one with_mask_t.
template <class... M>
concept mask_tag = sizeof...(M) == 0 || (sizeof...(M) == 1 && (std::same_as<M, with_mask_t> && ...));

inline std::size_t check_padded_batch_args(int_arg rows, const padded_batch_options& o) {
  const std::uint64_t n = rows.count("padded_batch", "the batch size");
  if (n == 0) throw config_error("padded_batch: the batch size must be at least 1 (got 0)");
  if (o.length == 0)
    throw config_error("padded_batch: length must be at least 1 (got 0); leave it unset to pad to each "
                       "batch's longest row");
  if (o.multiple_of == 0) throw config_error("padded_batch: multiple_of must be at least 1 (got 0)");
  if (o.truncate && o.length == longest_row)
    throw config_error("padded_batch: truncate needs a length to cut rows to (got truncate = true and no "
                       "length)");
  return static_cast<std::size_t>(n);
}

}  // namespace detail

// Not a stage_adaptor: its options are a braced list, which a template parameter pack
// cannot take. M: nothing, or with_mask_t (mask fields).
struct padded_batch_t {
  // padded_batch(src, n, options[, with_mask]): builds the stage over src (moved in);
  // throws config_error for bad options (see the file's top).
  template <source S, class... M>
    requires(detail::mask_tag<M...>)
  auto operator()(S&& s, int_arg rows, padded_batch_options o = {}, M...) const {
    detail::require_rvalue_source<S>();
    const std::size_t n = detail::check_padded_batch_args(rows, o);
    return detail::padded_batch_source<std::remove_cvref_t<S>, sizeof...(M) == 1>(std::forward<S>(s), n,
                                                                                   std::move(o));
  }
  // padded_batch(n, options[, with_mask]): a closure for `src | padded_batch(n)`; throws
  // config_error for bad options now.
  template <class... M>
    requires(detail::mask_tag<M...>)
  auto operator()(int_arg rows, padded_batch_options o = {}, M... m) const {
    const std::size_t n = detail::check_padded_batch_args(rows, o);
    return make_closure([n, o, m...]<class S>(S&& s) { return padded_batch_t{}(std::forward<S>(s), n, o, m...); });
  }
  // padded_batch(n, with_mask): masks with the default options.
  auto operator()(int_arg n, with_mask_t m) const { return (*this)(n, {}, m); }
};

// padded_batch(n, {...}): collates n elements, ragged fields padded to one length (see the
// file's top).
inline constexpr padded_batch_t padded_batch{};

}  // namespace ferry
