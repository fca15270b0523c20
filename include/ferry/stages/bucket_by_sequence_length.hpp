// ferry/stages/bucket_by_sequence_length.hpp: bucket_by_sequence_length(length_fn,
// boundaries, batch_sizes, {...}) sends each element to the bucket of its length and
// hands out a bucket's rows as one padded batch (padded_batch.hpp's batch_of) when it
// holds its batch size. Rows of like length share a batch, so little of it is padding.
// tf.data's bucket_by_sequence_length.
//
//   // rows(): a new source of std::pair<std::vector<std::int32_t>, std::int32_t> (tokens, label)
//   auto p = rows() | ferry::bucket_by_sequence_length(
//                         [](const auto& e) { return e.first.size(); },
//                         {8, 16, 32},           // buckets [0, 8), [8, 16), [16, 32), [32, inf)
//                         {128, 64, 32, 16});    // a batch size per bucket
//   auto q = rows() | ferry::bucket_by_sequence_length(len, {8, 16, 32}, {}, {.max_tokens = 4096});
//
// Buckets: k boundaries b0 < b1 < ... make k+1 buckets, [0, b0), [b0, b1), ..., [b(k-1),
// infinity), each with its batch size (k+1 of them). L, for each ragged field: the batch's
// longest row rounded up to `multiple_of`; with pad_to_bucket_boundary, the bucket's upper
// boundary minus 1 (every batch of a bucket the same shape; the last bucket: its longest
// row). The length length_fn gives picks the bucket; the ragged fields' own sizes set L.
// With a trailing ferry::with_mask argument, each batch also has a mask field per ragged
// field, as padded_batch's (padded_batch.hpp).
//
// A token budget instead of batch sizes (max_tokens, with no batch sizes given): a bucket
// is handed out when one more row would make rows × L exceed max_tokens, L being its
// longest length_fn value rounded as the padding is (multiple_of, or the boundary); it
// keeps that row for its next batch. A row alone over the budget is a batch of one. So
// batches of short rows have many rows, batches of long rows few, all about max_tokens
// tokens (padding included).
//
// Order: a batch is handed out when its bucket fills, so the order is the upstream's,
// regrouped: deterministic for a deterministic upstream (a seeded shuffle). At the end of
// the epoch the partial buckets are handed out, oldest first, unless drop_remainder. A
// partial batch whose first row was pulled more than `max_wait` rows ago is handed out
// then, short, so a rare bucket does not hold its rows for the whole epoch (and a
// checkpoint's refill stays bounded, below).
//
// With distribute(): batch_size() is the largest batch size, which distribute takes as
// its global batch G; the smaller buckets' batches are short batches then, so use
// remainder_policy::partial (each replica gets its share of every batch; drop would drop
// them, pad would pad them to G).
//
// Threads: runs on the thread calling next(); length_fn runs there, once per element.
//
// Errors: config_error for boundaries that do not increase (or start at 0), a number of
// batch sizes other than boundaries + 1, a batch size or multiple_of of 0, a pad_value that
// is not a value of a ragged field's type, and (pad_to_bucket_boundary) a boundary whose
// batch of rows padded to it would not fit in memory's address range (a huge sentinel
// boundary: leave it out). A batch whose padded width does not fit (a huge multiple_of) is
// a config_error from next() naming it; its rows go with it. What length_fn throws arrives
// from next() at its element's place; that element is dropped, and the next call goes on
// after it. So does a
// row that its bucket cannot pad: a ragged field of 2^32 values or more, or
// (pad_to_bucket_boundary) longer than the boundary - 1 it is padded to (a config_error
// naming the row; length_fn must count that field's values). Upstream errors likewise, a
// config_error from upstream user code included (each holds its row's place in the epoch's
// numbering and in a checkpoint); rows already in buckets stay.
//
// Memory: at most one partial batch per bucket (the sum of the batch sizes, less the
// buckets' count, elements), plus the batch handed out; checkpoint snapshots of the
// upstream's position, at most max_wait / max(1, max_wait / 4) + 2 of them (6 when max_wait
// is a multiple of 4, never more than 9).
//
// Checkpoints: exact, and holding positions, not rows: the upstream's position as of a
// snapshot taken at or before the oldest row still in a bucket, the number of rows pulled
// since, and the epoch indices of the rows in buckets. A restore restores the upstream to
// the snapshot and pulls it forward again to where the save was (at most max_wait plus a
// quarter of it rows, running the upstream's user code again), keeping the rows the
// buckets held. Saving costs one upstream save() per max_wait/4 rows pulled. Over an
// upstream that cannot be saved (an unordered map, or none with save()) the data flows and
// save() is the config_error saying why.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <memory_resource>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/batch_of.hpp"
#include "ferry/detail/holds_ahead.hpp"
#include "ferry/error.hpp"
#include "ferry/memory/buffer.hpp"
#include "ferry/source.hpp"
#include "ferry/stage.hpp"
#include "ferry/stages/detail/bucket_shape.hpp"
#include "ferry/stages/padded_batch.hpp"
#include "ferry/state.hpp"

namespace ferry {

// bucket_by_sequence_length()'s options, a braced list.
struct bucket_options {
  bool pad_to_bucket_boundary = false;  // L = the bucket's upper boundary - 1
  std::size_t multiple_of = 1;  // otherwise the longest row rounded up to a multiple of this
  double pad_value = 0;  // padding, converted to each ragged field's value type
  bool drop_remainder = false;  // drop the partial buckets at the end of the epoch
  // A partial batch whose first row came more than this many rows ago is handed out
  // short; 0: 8 times the sum of the batch sizes (with max_tokens: 8 times max_tokens
  // times the buckets).
  std::size_t max_wait = 0;
  // A token budget per batch instead of batch sizes (give no batch sizes then): rows × L
  // stays at most this (see the file's top). 0: batch sizes.
  std::size_t max_tokens = 0;
  // Where batch buffers come from; null means a buffer_pool private to the stage.
  std::shared_ptr<std::pmr::memory_resource> resource = nullptr;
};

namespace detail {

template <source Up, class LengthFn, bool Mask = false>
class bucket_source
    : public stage<bucket_source<Up, LengthFn, Mask>, Up, batch_of<padded_element_t<value_t<Up>, Mask>>> {
  using T = value_t<Up>;
  using P = padded_element_t<T, Mask>;
  using B = batch_of<P>;
  friend stage<bucket_source, Up, B>;
  static_assert(batchable<T> && !no_ragged<typename field_list<T>::type>::value,
                "ferry::bucket_by_sequence_length: the elements need a ragged field (vector, string) "
                "to pad, and every field trivially copyable or a range of trivially-copyable values");
  static_assert(std::is_invocable_v<LengthFn&, const T&> &&
                    std::is_convertible_v<std::invoke_result_t<LengthFn&, const T&>, std::size_t>,
                "ferry::bucket_by_sequence_length: length_fn must take const T& and return a length "
                "(an unsigned integer)");
  static constexpr std::size_t nf = B::field_count;
  static constexpr std::size_t ns = std::tuple_size_v<typename field_list<T>::type>;  // T's own fields

  struct bucket {
    std::vector<T> rows;
    std::vector<std::uint64_t> index;  // each row's place in the epoch
    std::vector<std::size_t> lens;  // each row's length_fn value
    void clear() { rows.clear(), index.clear(), lens.clear(); }
  };
  struct snapshot {
    std::uint64_t at = 0;  // rows pulled when it was taken
    std::vector<std::uint64_t> words;  // the upstream's state then
  };

 public:
  static constexpr char name[] = "bucket_by_sequence_length";
  // Throws config_error for bad arguments (see the file's top).
  bucket_source(Up up, LengthFn fn, std::vector<std::size_t> bounds, std::vector<std::size_t> sizes, bucket_options o)
      : stage<bucket_source, Up, B>(std::move(up)), fn_(std::move(fn)),
        shape_{std::move(bounds), o.multiple_of, o.pad_to_bucket_boundary}, sizes_(std::move(sizes)),
        target_(0, std::move(o.resource)), o_(std::move(o)) {
    check_pad_value<T>(o_.pad_value, name);
    if (o_.max_tokens) sizes_.assign(shape_.bounds.size() + 1, o_.max_tokens);  // rows a batch can hold at most
    buckets_.resize(sizes_.size());
    if (o_.max_wait == 0) o_.max_wait = 8 * std::accumulate(sizes_.begin(), sizes_.end(), std::size_t(0));
    every_ = std::max<std::size_t>(1, o_.max_wait / 4);
    // batch_size(), for distribute(): the largest batch size (with max_tokens: max_tokens
    // rows; see the file's top).
    target_.rows = *std::max_element(sizes_.begin(), sizes_.end());
    target_.budget = o_.max_tokens != 0;
    target_.bound = target_.budget || *std::min_element(sizes_.begin(), sizes_.end()) != target_.rows;
    if (shape_.to_boundary)  // a batch of a bucket padded to its boundary must fit (a huge sentinel boundary)
      for (std::size_t k = 0; k < shape_.bounds.size(); ++k) {
        const std::size_t w = shape_.bounds[k] - 1;
        const std::size_t rows = o_.max_tokens ? std::max<std::size_t>(1, o_.max_tokens / std::max<std::size_t>(w, 1))
                                               : sizes_[k];
        std::array<std::size_t, nf> width{};
        width.fill(w);
        if (unfit_field(rows, width) != none)
          throw config_error("bucket_by_sequence_length: bucket " + std::to_string(k) + " pads its rows to boundary - 1 = " +
                             std::to_string(w) + " values (pad_to_bucket_boundary), and a batch of " +
                             std::to_string(rows) + " such rows does not fit in memory's address range; leave that "
                             "boundary out (the last bucket pads to its longest row)");
      }
  }

 private:
  collation& collates() { return target_; }  // the base's batch_size() and buffer hook

  std::optional<B> pull() {
    for (;;) {
      if (std::size_t b = overdue(); b != none) return emit(b, buckets_[b].rows.size());
      if (ended_) {
        const std::size_t b = oldest();
        if (b == none || o_.drop_remainder) {
          for (auto& k : buckets_) k.clear();
          return std::nullopt;
        }
        return emit(b, buckets_[b].rows.size());
      }
      maybe_snapshot();
      std::optional<T> e = pull_counted();
      if (!e) {
        ended_ = true;
        continue;
      }
      const std::uint64_t idx = pulled_ - 1;
      const auto [b, len] = bucket_of(*e);  // length_fn may throw: the element goes
      check_row(b, *e, idx);  // so may a row that cannot be padded: it goes too
      bucket& k = buckets_[b];
      k.rows.push_back(std::move(*e));
      k.index.push_back(idx);
      k.lens.push_back(len);
      if (o_.max_tokens && k.rows.size() > 1 && over_budget(k.rows.size(), budget_width(b)))
        return emit(b, k.rows.size() - 1);  // the new row starts the bucket's next batch
      if (k.rows.size() == sizes_[b]) return emit(b, k.rows.size());
    }
  }

  static constexpr std::size_t none = ~std::size_t{0};

  // The upstream's next element, counted as a row; an error counts as one too (it takes
  // an element's place, here and when a restore pulls the same rows again), a
  // config_error included: a map or from_generator function passes ferry's own errors
  // through, and its element goes with it.
  std::optional<T> pull_counted() {
    try {
      std::optional<T> e = this->pull_up();
      if (e) ++pulled_;
      return e;
    } catch (...) {
      ++pulled_;
      throw;
    }
  }
  void maybe_snapshot() {
    if constexpr (resumable_source<Up>)
      if (save_error_.empty() && pulled_ % every_ == 0 && (snaps_.empty() || snaps_.back().at != pulled_))
        take_snapshot();
  }

  // e's bucket and length (length_fn's).
  std::pair<std::size_t, std::size_t> bucket_of(const T& e) {
    std::size_t len;
    {
      const in_user_code<std::size_t> user;  // length_fn runs user code (holds_ahead.hpp)
      len = static_cast<std::size_t>(fn_(e));
    }
    return {shape_.bucket_of(len), len};
  }
  // Throws config_error for a row whose ragged fields bucket b cannot pad (bucket_shape::check_row).
  void check_row(std::size_t b, const T& e, std::uint64_t idx) const {
    each_ragged_size(e, [&](std::size_t f, std::size_t n) { shape_.check_row(b, n, f, idx); });
  }
  // Bucket b's L for the token budget: its longest length rounded as the padding is.
  // rows × w > max_tokens, without the product (w saturates for a huge multiple_of).
  bool over_budget(std::size_t rows, std::size_t w) const { return w && rows > o_.max_tokens / w; }
  std::size_t budget_width(std::size_t b) const {
    return shape_.width(b, *std::max_element(buckets_[b].lens.begin(), buckets_[b].lens.end()));
  }
  // The bucket whose partial batch began first, or none.
  std::size_t oldest() const {
    std::size_t best = none;
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      if (!buckets_[b].index.empty() && (best == none || buckets_[b].index[0] < buckets_[best].index[0])) best = b;
    return best;
  }
  std::size_t overdue() const {
    const std::size_t b = oldest();
    return b != none && pulled_ - buckets_[b].index[0] > o_.max_wait ? b : none;
  }

  // Bucket b's first `count` rows as a batch; the rest stay (a token budget's next batch).
  B emit(std::size_t b, std::size_t count) {
    bucket& k = buckets_[b];
    const std::span<const T> rows(k.rows.data(), count);
    std::array<std::size_t, nf> width{};  // each ragged field's L (mask fields take their field's)
    for (const T& e : rows) each_ragged_size(e, [&](std::size_t f, std::size_t n) { width[f] = std::max(width[f], n); });
    for (std::size_t f = 0; f < ns; ++f) width[f] = shape_.width(b, width[f]);  // (rows checked: check_row)
    if (const std::size_t f = unfit_field(count, width); f != none) {  // never a wrapped size: drop the rows
      const std::string why = "bucket_by_sequence_length: bucket " + std::to_string(b) + "'s batch of " +
                              std::to_string(count) + " rows (from row " + std::to_string(k.index[0]) +
                              " of the epoch) padded to " + std::to_string(width[f]) + " values in field " +
                              std::to_string(f) + " does not fit in memory's address range (the rows are dropped)";
      drop(k, count);
      throw config_error(why);
    }
    B out = collator_.collate_padded(target_.resource, rows, width, o_.pad_value);
    drop(k, count);
    return out;
  }
  void drop(bucket& k, std::size_t count) {
    k.rows.erase(k.rows.begin(), k.rows.begin() + std::ptrdiff_t(count));
    k.index.erase(k.index.begin(), k.index.begin() + std::ptrdiff_t(count));
    k.lens.erase(k.lens.begin(), k.lens.begin() + std::ptrdiff_t(count));
    prune();
  }
  // The first of T's padded fields whose `rows` rows of width[f] values overflow a size_t
  // in bytes, or none.
  static std::size_t unfit_field(std::size_t rows, const std::array<std::size_t, nf>& width) {
    std::size_t bad = none;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((bad = bad == none && width[I] > max_width<I>(rows) ? I : bad), ...);
    }(std::make_index_sequence<ns>{});
    return bad;
  }
  template <std::size_t I>
  static std::size_t max_width(std::size_t rows) {
    if constexpr (B::template is_padded<I>)
      return std::numeric_limits<std::size_t>::max() / sizeof(typename B::template field_t<I>::value_type) /
             std::max<std::size_t>(rows, 1);
    else
      return std::numeric_limits<std::size_t>::max();
  }

  // Snapshots: the newest one at or before the oldest row in a bucket, and those after.
  // An upstream that cannot be saved at all (config_error: an unordered map) is noted and
  // the data still flows; save() throws why, as prefetch's does.
  void take_snapshot() {
    pipeline_state ps;
    state_writer w(ps);
    try {
      this->up().save(w);
    } catch (const config_error& e) {
      save_error_ = e.what();
      snaps_.clear();
      return;
    }
    snaps_.push_back({pulled_, std::move(ps.words)});
    prune();
  }
  void prune() {
    const std::size_t b = oldest();
    const std::uint64_t need = b == none ? pulled_ : buckets_[b].index[0];
    while (snaps_.size() > 1 && snaps_[1].at <= need) snaps_.pop_front();
  }
  template <class F>
  void config(F&& f) const {
    f("boundaries, batch sizes and token budget", shape_.fingerprint(sizes_, o_.max_tokens), true);
    f("pad_to_bucket_boundary", std::uint64_t(shape_.to_boundary));
    f("multiple_of", shape_.multiple_of);
    f("drop_remainder", std::uint64_t(o_.drop_remainder));
    f("max_wait", o_.max_wait);
    f("mask", std::uint64_t(Mask));
  }
  // The upstream as of the snapshot the refill starts from (see the file's top).
  void save_upstream(state_writer& w) const {
    if (!save_error_.empty()) throw config_error(save_error_);
    if (snaps_.empty()) {
      this->up().save(w);  // nothing pulled this epoch
      return;
    }
    ask_save(this->up(), scratch_);  // the snapshot may predate the upstream's refusal (an unordered map)
    w.put_words(snaps_.front().words);
  }
  void save_words(state_writer& w) const {
    w.put(snaps_.empty() ? pulled_ : snaps_.front().at);
    w.put(pulled_);
    w.put(ended_);
    for (const bucket& k : buckets_) {
      w.put(k.index.size());
      for (std::uint64_t i : k.index) w.put(i);
    }
  }
  // Throws config_error for a damaged state; runs the upstream forward (its user code
  // included) from the snapshot to where the save was.
  void restore_words(state_reader& r) {
    const std::uint64_t from = r.get(), to = r.get();
    const bool ended = r.get_flag(name);
    const auto want = read_held(r, sizes_, from, to, o_.max_wait + every_ + 1);
    for (auto& k : buckets_) k.clear();
    snaps_.clear();
    pulled_ = from;
    ended_ = false;
    take_snapshot();
    std::vector<std::size_t> next(buckets_.size(), 0);
    while (pulled_ < to) {
      maybe_snapshot();
      std::optional<T> e;
      try {
        e = pull_counted();
      } catch (...) {  // handed out before the save, at its place
        continue;
      }
      if (!e)
        throw config_error("restore_state: bucket_by_sequence_length: the upstream ended at row " +
                           std::to_string(pulled_) + ", before row " + std::to_string(to) +
                           " where the state was saved (restored into another dataset?)");
      const std::uint64_t idx = pulled_ - 1;
      for (std::size_t b = 0; b < buckets_.size(); ++b)
        if (next[b] < want[b].size() && want[b][next[b]] == idx) {
          const auto [bucket_now, len] = bucket_of(*e);
          if (bucket_now != b)
            throw config_error("restore_state: bucket_by_sequence_length: row " + std::to_string(idx) +
                               " falls in another bucket than when the state was saved (another dataset, or "
                               "another length_fn?)");
          check_row(b, *e, idx);
          buckets_[b].rows.push_back(std::move(*e));
          buckets_[b].index.push_back(idx);
          buckets_[b].lens.push_back(len);
          ++next[b];
          break;
        }
    }
    ended_ = ended;
    prune();
  }
  void start_epoch() {
    for (auto& k : buckets_) k.clear();
    snaps_.clear();
    pulled_ = 0;
    ended_ = false;
  }

  LengthFn fn_;
  bucket_shape shape_;  // boundaries and padding
  std::vector<std::size_t> sizes_;  // rows per bucket's batch (max_tokens: its bound)
  collation target_;  // the largest batch size, and where batches are collated
  bucket_options o_;  // (its resource moved into target_)
  std::size_t every_ = 1;  // rows between snapshots
  std::vector<bucket> buckets_;
  std::deque<snapshot> snaps_;
  std::uint64_t pulled_ = 0;  // rows pulled this epoch (errors included)
  bool ended_ = false;  // the upstream has ended this epoch
  std::string save_error_;  // why the upstream cannot be saved, once a snapshot found it
  mutable pipeline_state scratch_;  // save() asks the upstream into it (capacity reused)
  batch_collator<P> collator_;
};

}  // namespace detail

// Not a stage_adaptor: its options are a braced list. M: nothing, or with_mask_t.
struct bucket_by_sequence_length_t {
  // bucket_by_sequence_length(src, length_fn, boundaries, batch_sizes, options[, with_mask]):
  // builds the stage over src (moved in); throws config_error for bad arguments.
  template <source S, class F, class... M>
    requires(detail::mask_tag<M...>)
  auto operator()(S&& s, F fn, std::vector<std::size_t> boundaries, std::vector<std::size_t> batch_sizes,
                  bucket_options o = {}, M...) const {
    detail::require_rvalue_source<S>();
    detail::bucket_shape::check(boundaries, batch_sizes, o.max_tokens, o.multiple_of);
    return detail::bucket_source<std::remove_cvref_t<S>, F, sizeof...(M) == 1>(
        std::forward<S>(s), std::move(fn), std::move(boundaries), std::move(batch_sizes), std::move(o));
  }
  // bucket_by_sequence_length(length_fn, boundaries, batch_sizes, options[, with_mask]): a
  // closure for `src | bucket_by_sequence_length(...)`; throws config_error for bad
  // arguments now.
  template <class F, class... M>
    requires(!source<F> && detail::mask_tag<M...>)
  auto operator()(F fn, std::vector<std::size_t> boundaries, std::vector<std::size_t> batch_sizes,
                  bucket_options o = {}, M... m) const {
    detail::bucket_shape::check(boundaries, batch_sizes, o.max_tokens, o.multiple_of);
    return make_closure([fn = std::move(fn), boundaries = std::move(boundaries), batch_sizes = std::move(batch_sizes),
                         o = std::move(o), m...]<class S>(S&& s) {
      return bucket_by_sequence_length_t{}(std::forward<S>(s), fn, boundaries, batch_sizes, o, m...);
    });
  }
};
// bucket_by_sequence_length(length_fn, boundaries, batch_sizes, {...}): rows grouped by
// length into padded batches (see the file's top).
inline constexpr bucket_by_sequence_length_t bucket_by_sequence_length{};

}  // namespace ferry
