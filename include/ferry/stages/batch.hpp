// ferry/stages/batch.hpp: batch(n, {.drop_remainder}) collates n elements into one
// contiguous buffer per field.
//
//   src | ferry::batch(256)                              // last batch may be short
//   src | ferry::batch(256, {.drop_remainder = true})    // every batch has 256 elements
//
// Collation: an element of a trivially-copyable type T (a struct, a number, a std::array)
// becomes one array of T; a std::tuple / std::pair of fields becomes one array per field;
// a field that is a contiguous range of trivially-copyable values (std::vector<float>,
// std::string, std::span<const std::byte>, a record view) becomes a ragged field: one
// contiguous value buffer plus n+1 offsets. Fixed-size fields are written straight into
// their buffer as elements arrive (no per-element allocation, no second copy), from where
// a map upstream leaves them (map's next_into) when stats are off. Records
// from a borrowing_source (from_files) are lent as views and copied at once, with no
// reference per record.
//
// Threads: runs on the thread calling next(), which pulls the upstream and collates;
// batch runs no user code and starts no thread.
//
// Errors: throws config_error for n == 0, and for n rows whose bytes do not fit in a
// size_t. Upstream errors propagate unchanged, and the elements already pulled into the
// batch being built are dropped with it (as tf.data's batch drops them): the next batch
// starts after the element that failed. To keep them, skip bad elements before batch
// (error_policy::skip in from_files; a map function that catches, then filter).
// Compile-time errors: a batch's field<I>() past its last field is a static_assert naming
// I and the field count (batch_of.hpp).
//
// Memory: one batch being built. Buffers come from a std::pmr::memory_resource, by
// default a buffer_pool private to the stage, so batches in steady state reuse the same
// memory. A range-for consumer's batches skip the pool: its ++ hands the finished batch
// back (refill), and the next one is collated into the same buffers. The hook
// set_buffer_resource(r) (called by distribute() before the first next()) makes batch
// collate into pinned memory instead, without the user changing the pipeline. A batch's
// buffers start at n rows, or at 16 MiB of rows when that is less, and grow as rows come. Ragged types hold the n elements of the batch being built before
// collating them (that vector's capacity is reused batch to batch).
//
// Checkpoints: a batch is built whole inside one next(), so between calls batch holds no
// element: save() records the upstream's state and batch's tag, and restore() resumes
// with the next batch (config_error when the state has another stage at that place).
// n and drop_remainder are not saved: a state restores into a batch of another size,
// whose first batch starts at the element where the saved run's next batch would have
// (how a batch size is changed on resume). padded_batch, whose options shape its rows,
// refuses that.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <memory>
#include <optional>
#include <ranges>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/error.hpp"
#include "ferry/batch_of.hpp"
#include "ferry/memory/buffer.hpp"
#include "ferry/stage.hpp"
#include "ferry/observe/hooks.hpp"
#include "ferry/source.hpp"
#include "ferry/sources/record.hpp"

namespace ferry {

// batch()'s options, a braced list: batch(256, {.drop_remainder = true}).
struct batch_options {
  bool drop_remainder = false;  // drop a last batch with fewer than n elements
  // Where batch buffers come from; null means a buffer_pool private to the stage.
  std::shared_ptr<std::pmr::memory_resource> resource = nullptr;
};

namespace detail {

template <source Up>
class batch_source : public stage<batch_source<Up>, Up, batch_of<value_t<Up>>> {
  friend stage<batch_source, Up, batch_of<value_t<Up>>>;
  using T = value_t<Up>;
  using B = batch_of<T>;

 public:
  static constexpr char name[] = "batch";
  // Throws config_error for n rows whose bytes do not fit in a size_t.
  batch_source(Up up, std::size_t n, batch_options o)
      : stage<batch_source, Up, batch_of<value_t<Up>>>(std::move(up)), target_(n, std::move(o.resource)),
        drop_(o.drop_remainder) {
    constexpr std::size_t row = batch_collator<T>::row_bytes();
    if (target_.rows > std::numeric_limits<std::size_t>::max() / (row + 1))
      throw config_error("batch: a batch of " + std::to_string(target_.rows) + " rows of " + std::to_string(row) +
                         " bytes does not fit in memory's address range; use a smaller batch size");
    // A batch's buffers start at the batch size, or at 16 MiB of rows when that is less,
    // and grow as rows come: batch(2^34) over ten elements allocates for ten.
    first_rows_ = std::min<std::size_t>(target_.rows,
                                        std::max<std::size_t>(1, (std::size_t(16) << 20) / std::max<std::size_t>(row, 1)));
  }

  // next() into slot, which holds the consumer's last batch or nothing (range-for's ++
  // calls it): the next batch is collated into the last one's buffers when they fit (no
  // trip through the pool, and no batch moved), else slot = next(). At the end of the
  // epoch, or when next() throws, slot is left empty. Runs on the caller's thread; throws
  // what next() throws.
  void refill(std::optional<B>& slot) {
    if constexpr (batch_collator<T>::all_fixed) {
      if (slot && collator_.fits(*slot, target_.resource, first_rows_)) {
        this->check_live();
        if (!observe::on()) [[likely]]
          return fill_in_place(slot);
        const observe::ticks t0 = observe::now();  // counted and timed as next() is
        fill_in_place(slot);
        observe::note_next(this->stats(), name, t0, slot);
        return;
      }
    }
    slot.reset();  // the last batch's buffers go back first: the pool hands them out again
    slot = this->next();
  }

  bool drops_remainder() const { return drop_; }
  Up& upstream() { return this->up(); }

 private:
  collation& collates() { return target_; }  // the base's batch_size() and buffer hook

  std::optional<B> pull() {
    if constexpr (batch_collator<T>::all_fixed) {
      B b = collator_.start(target_.resource, first_rows_);
      if (!fill(b)) return std::nullopt;
      return b;
    } else if constexpr (borrowing_source<Up> && std::same_as<T, record>) {
      // Records lent as views: copied into the batch at once, so no reference per record.
      borrowed_.clear();
      this->pull_up_borrowed(borrowed_, target_.rows);
      if (borrowed_.size() == 0 || (drop_ && borrowed_.size() < target_.rows)) {
        borrowed_.clear();
        return std::nullopt;
      }
      B b = collator_.collate_bytes(target_.resource, borrowed_.views);
      borrowed_.clear();
      return b;
    } else {
      hold_.clear();
      while (hold_.size() < target_.rows) {
        std::optional<T> e = this->pull_up();
        if (!e) break;
        hold_.push_back(std::move(*e));
      }
      if (hold_.empty() || (drop_ && hold_.size() < target_.rows)) return std::nullopt;
      return collator_.collate(target_.resource, std::span<T>(hold_));
    }
  }

  // Collates the next batch into b, whose buffers hold first_rows_ rows (new from start(),
  // or a finished batch that fits()); false at the end of the epoch (or when a short last
  // batch is dropped). Fixed-only types.
  bool fill(B& b) {
    if constexpr (bulk_source<Up> && B::field_count == 1 && !field_list<T>::is_tuple) {
      // One call fills the batch buffer in place (one per growth of a huge batch).
      std::size_t k = 0, cap = first_rows_;
      for (;;) {
        k += this->pull_up_bulk(collator_.whole(b, cap).subspan(k));
        if (k < cap || cap == target_.rows) break;
        collator_.set_size(b, k);
        cap = more_rows(cap);
        collator_.grow(b, target_.resource, cap);
      }
      collator_.set_size(b, k);
      return k != 0 && !(drop_ && k < target_.rows);
    } else {
      Up& up = this->up();
      collator_.set_size(b, 0);
      std::size_t cap = first_rows_;
      auto room = [&] {  // a row's room, grown when a huge batch has filled its buffers
        if (b.size() == cap) collator_.grow(b, target_.resource, cap = more_rows(cap));
      };
      // An upstream that can hand an element where it lies (map's next_into) is copied
      // from there; with stats on, through the probe, which times the pull.
      bool pulled = false;
      if constexpr (requires { up.next_into([](T&) {}); }) {
        if (!observe::on()) {
          while (b.size() < target_.rows && (room(), up.next_into([&](T& e) { collator_.put(b, e); }))) {
          }
          pulled = true;
        }
      }
      while (!pulled && b.size() < target_.rows) {
        std::optional<T> e = this->pull_up();
        if (!e) break;
        room();
        collator_.put(b, *e);
      }
      return !b.empty() && !(drop_ && b.size() < target_.rows);
    }
  }

  void fill_in_place(std::optional<B>& slot) {
    try {
      if (!fill(*slot)) slot.reset();
    } catch (...) {
      slot.reset();
      throw;
    }
  }

  std::size_t more_rows(std::size_t cap) const { return cap > target_.rows / 2 ? target_.rows : cap * 2; }

  collation target_;  // rows per batch, and where batches are collated
  std::size_t first_rows_ = 0;  // rows a batch's buffers hold at first (fixed fields)
  bool drop_;
  batch_collator<T> collator_;
  std::vector<T> hold_;  // ragged types only; capacity reused batch to batch
  borrowed_records borrowed_;  // records from a borrowing_source; likewise
};

inline std::size_t check_batch_args(int_arg n) {
  const std::uint64_t v = n.count("batch", "the batch size");
  if (v == 0) throw config_error("batch: the batch size must be at least 1 (got 0)");
  return static_cast<std::size_t>(v);
}

}  // namespace detail

// Not a stage_adaptor: its options are a braced list (batch(256, {.drop_remainder = true})),
// which a template parameter pack cannot take.
struct batch_t {
  // batch(src, n, options): builds the stage over src (moved in); throws config_error for
  // n == 0, a negative n or a batch too large to address.
  template <source S>
  auto operator()(S&& s, int_arg n, batch_options o = {}) const {
    detail::require_rvalue_source<S>();
    return detail::batch_source<std::remove_cvref_t<S>>(std::forward<S>(s), detail::check_batch_args(n), std::move(o));
  }
  // batch(n, options): a closure for `src | batch(n)`; throws config_error for n == 0 or
  // negative now.
  auto operator()(int_arg rows, batch_options o = {}) const {
    const std::size_t n = detail::check_batch_args(rows);
    return make_closure([n, o]<class S>(S&& s) { return batch_t{}(std::forward<S>(s), n, o); });
  }
};
// batch(n, {.drop_remainder}): collates n elements into one buffer per field (see the
// file's top).
inline constexpr batch_t batch{};

}  // namespace ferry
