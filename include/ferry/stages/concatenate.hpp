// ferry/stages/concatenate.hpp: concatenate(a, b) hands out every element of a, then
// every element of b (tf.data's Dataset.concatenate).
//
//   auto all = ferry::concatenate(from_files(train_paths, fmt), from_files(extra_paths, fmt));
//   auto p = ferry::concatenate(std::move(a), std::move(b)) | ferry::shuffle(4096, seed);
//
// Both sources must have the same value_type (a static_assert says so otherwise: map one
// to the other's type first). Only the call form: a pipe closure would have to carry b,
// a single-pass source, inside what is otherwise a reusable, copyable value (closure |
// closure chains are applied more than once), so concatenate(b) is refused with a message.
// Nested calls concatenate more: concatenate(concatenate(a, b), c).
// rewind() (both rewindable): rewinds both, so epoch e plays a's epoch e, then b's (a
// shuffle on either side draws its order of that epoch), whether or not b was reached.
// Stats: report() lists a's stages, then b's, then concatenate, whose own time excludes
// both sides' (stage_visitor::add_joined).
//
// Threads: runs both sources on the thread that calls next(); b is not pulled (nor are its
// threads started) until a has ended. concatenate runs no user code and starts no thread.
//
// Errors: concatenate throws nothing itself, but restore() refuses a damaged state
// (Checkpoints). An exception from either source reaches the consumer unchanged, at its
// position; the next call goes on with the same source (a's errors do not end a).
// next_bulk (both sources bulk_source; batch() pulling a run) fills from a, then, when a
// ends inside the run, goes on from b in the same call: fewer than out.size() only at the
// end of b. An error inside a run drops the elements of the run written before it, as any
// bulk run's (batch() drops the batch it was building), a's included when it came from b.
//
// Memory: no element is held: only which source is being read; next_bulk() runs go
// straight into the caller's buffer.
//
// Checkpoints: when both sources are resumable, save() records a's state, b's state, then
// which one is being read; a restore goes on exactly there, at the boundary too. A state
// of another shape, or a damaged one, is a config_error.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>

#include "ferry/error.hpp"
#include "ferry/stage.hpp"
#include "ferry/stages/detail/diagnostics.hpp"

namespace ferry {
namespace detail {

template <source A, source B>
class concatenate_source : public join_stage<concatenate_source<A, B>, value_t<A>, A, B> {
  friend join_stage<concatenate_source, value_t<A>, A, B>;
  using T = value_t<A>;

 public:
  static constexpr char name[] = "concatenate";
  concatenate_source(A a, B b) : join_stage<concatenate_source, value_t<A>, A, B>(std::move(a), std::move(b)) {}

  // True once a has ended this epoch (what is handed out now comes from b).
  bool in_second() const { return in_b_; }

 private:
  std::optional<T> pull() {
    if (!in_b_) {
      if (std::optional<T> e = this->template pull_up<0>()) return e;
      in_b_ = true;
    }
    return this->template pull_up<1>();
  }
  std::size_t pull_bulk(std::span<T> out)
    requires bulk_source<A> && bulk_source<B>
  {
    std::size_t k = 0;
    if (!in_b_) {
      k = this->template pull_up_bulk<0>(out);
      if (k == out.size()) return k;  // a full run (an empty request too): a goes on
      in_b_ = true;                   // a short run: a has ended
    }
    return k + this->template pull_up_bulk<1>(out.subspan(k));
  }
  void start_epoch() { in_b_ = false; }
  void save_words(state_writer& w) const { w.put(in_b_ ? 1 : 0); }
  // Throws config_error for a damaged state.
  void restore_words(state_reader& r) { in_b_ = r.get_flag(name); }

  bool in_b_ = false;  // a has ended this epoch
};

}  // namespace detail

// concatenate(a, b): every element of a, then every element of b (see the file's top).
inline constexpr join_adaptor<detail::concatenate_source, detail::concatenate_misuse> concatenate{};

}  // namespace ferry
