// ferry/source.hpp: the concepts every pipeline is built from, the pipe operator, and
// range-for over any pipeline.
//
// A `source` is a single-pass, pulled sequence: `next()` returns the next element, or an
// empty optional at the end of the epoch. Nothing runs until the first next(). Sources are
// movable values; stages take their upstream by value (move it in).
//
// Optional capabilities, detected by concept:
//   rewindable_source   rewind(): start the next epoch from the beginning (shuffle draws
//                       a new order; files are re-opened). repeat() needs it.
//   resumable_source    save(state_writer&) const / restore(state_reader&): see state.hpp.
//
// Threads: a source's next() runs on the thread that calls it (each stage's header says
// where it runs user code). Throws: the concepts and the pipe operator throw nothing of
// their own; restore_state throws config_error for a state of another shape or length.
#pragma once

#include <concepts>
#include <cstddef>
#include <iterator>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>

#include "ferry/state.hpp"

// ferry's API: sources, stages, the pipe operator, checkpoints, errors and reports
// (ferry::detail is the implementation, not API).
namespace ferry {

// The members first, then movability: a type without them (a tuple's element holder that
// converts from anything) is refused before asking whether it moves, which for a type that
// converts from any source (any_source) would ask this concept again.
template <class S>
concept source = requires(std::remove_cvref_t<S>& s) {
      typename std::remove_cvref_t<S>::value_type;
      { s.next() } -> std::same_as<std::optional<typename std::remove_cvref_t<S>::value_type>>;
    } && std::move_constructible<std::remove_cvref_t<S>>;

template <class S>
concept rewindable_source = source<S> && requires(std::remove_cvref_t<S>& s) { s.rewind(); };

template <class S>
concept resumable_source = source<S> &&
    requires(std::remove_cvref_t<S>& s, const std::remove_cvref_t<S>& cs, state_writer& w,
             state_reader& r) {
      cs.save(w);
      s.restore(r);
    };

// The element type of a source (its value_type), through references and const.
template <source S>
using value_t = typename std::remove_cvref_t<S>::value_type;

// Zero-copy fast path of sources over contiguous memory: next_view(max) returns the next
// elements (at most max; fewer only at the end of the epoch) as a view into the source's
// own storage, valid until the source's next call. An inline map reads through it and
// writes straight into the batch buffer: one pass over the data, as a hand loop would.
template <class S>
concept view_source = source<S> && requires(std::remove_cvref_t<S>& s, std::size_t n) {
  { s.next_view(n) } -> std::same_as<std::span<const value_t<S>>>;
};

// Optional fast path: next_bulk(out) fills `out` with the next elements, as out.size()
// next() calls would, and returns how many it wrote (fewer only at the end of the epoch).
// batch() uses it to have a source (and inline maps over it) write a whole batch into
// its buffer in one call, so per-element pulling costs nothing for plain data.
template <class S>
concept bulk_source = source<S> &&
    requires(std::remove_cvref_t<S>& s, std::span<value_t<S>> out) {
      { s.next_bulk(out) } -> std::same_as<std::size_t>;
    };

struct borrowed_records;  // ferry/sources/record.hpp

// Optional fast path of record sources (from_files): next_borrowed(out, max) appends the
// next records (at most max; fewer only at the end of the epoch) to `out` as views that
// stay valid until out.clear(), and returns how many. batch() of records uses it: it
// copies the bytes at once, so it needs no reference per record.
template <class S>
concept borrowing_source =
    source<S> && requires(std::remove_cvref_t<S>& s, borrowed_records& out, std::size_t max) {
      { s.next_borrowed(out, max) } -> std::same_as<std::size_t>;
    };

// A batch stage (or stages passing its batches on unchanged: prefetch, take, repeat,
// filter, shard) that says the batch size it makes, so distribute() need not infer the
// global batch size from a possibly short first batch. 0 means not known (an any_source
// whose pipeline holds no batch()): distribute() then infers it as for an unsized one.
template <class T>
class batch_of;  // ferry/stages/batch.hpp
namespace detail {
template <class B>
struct is_batch_of : std::false_type {};
template <class T>
struct is_batch_of<batch_of<T>> : std::true_type {};
}  // namespace detail

template <class S>
concept sized_batches = requires(const std::remove_cvref_t<S>& s) {
  { s.batch_size() } -> std::convertible_to<std::size_t>;
};

// ---- range-for ------------------------------------------------------------------------

// An input iterator over a source: holds the current element. Used by range-for.
template <class S>
class source_iterator {
 public:
  using value_type = typename S::value_type;  // the source's element type
  using difference_type = std::ptrdiff_t;     // required of an input iterator; unused

  source_iterator() = default;
  // Pulls the first element at once: next() runs here, on this thread, and what it throws
  // propagates.
  explicit source_iterator(S& s) : s_(&s), cur_(s.next()) {}
  // The current element; the iterator owns it until ++ (moving it out is fine).
  value_type& operator*() const { return *cur_; }
  // The current element's address.
  value_type* operator->() const { return &*cur_; }
  // Pulls the next element (s.next(), on this thread; its exceptions propagate). A source
  // with refill(slot) (batch) collates the next batch into the finished one's buffers.
  source_iterator& operator++() {
    if constexpr (requires { s_->refill(cur_); })
      s_->refill(cur_);
    else
      cur_ = s_->next();
    return *this;
  }
  // As ++it; returns nothing, as an input iterator may.
  void operator++(int) { ++*this; }
  // True at the end of the epoch (the last next() returned no element).
  friend bool operator==(const source_iterator& it, std::default_sentinel_t) { return !it.cur_; }

 private:
  S* s_ = nullptr;
  mutable std::optional<value_type> cur_;
};

// CRTP base of ferry's sources and stages: gives begin()/end(), so `for (auto& x : p)`
// works on any pipeline. Iterating pulls from the pipeline: it is single-pass.
template <class Derived>
class source_interface {
 public:
  // Starts iterating: pulls the first element (next() on this thread).
  source_iterator<Derived> begin() { return source_iterator<Derived>(static_cast<Derived&>(*this)); }
  // The end of the epoch.
  std::default_sentinel_t end() const { return {}; }
};

// For a user-written source that does not derive from source_interface.
template <source S>
class iterate {
 public:
  // Refers to s, which must outlive the iteration.
  explicit iterate(S& s) : s_(&s) {}
  // Starts iterating: pulls the first element (s.next() on this thread).
  source_iterator<S> begin() { return source_iterator<S>(*s_); }
  // The end of the epoch.
  std::default_sentinel_t end() const { return {}; }

 private:
  S* s_;
};

// ---- state ----------------------------------------------------------------------------

// Throws config_error when the pipeline holds a stage that cannot be checkpointed exactly
// (map with .ordered = false).
template <resumable_source S>
pipeline_state save_state(const S& s) {
  pipeline_state st;
  state_writer w(st);
  s.save(w);
  return st;
}

// Call on a fresh pipeline of the same shape, before its first next().
// Throws config_error when the state came from another pipeline shape. A refused state
// may have been taken by some stages and not others: a ferry pipeline then throws
// config_error from next() and save_state() until rewind() or a restore_state that
// succeeds (stage.hpp).
template <resumable_source S>
void restore_state(S& s, const pipeline_state& st) {
  state_reader r(st);
  s.restore(r);
  if (!r.done()) {
    // Every stage took its words from the state's first part: not the state's position.
    if constexpr (requires { ferry_mark_restore_failed(s); }) ferry_mark_restore_failed(s);
    throw config_error("restore_state: the state is longer than this pipeline's");
  }
}

// ---- the pipe operator ----------------------------------------------------------------

struct closure_tag {};

template <class C>
concept pipe_closure = std::derived_from<std::remove_cvref_t<C>, closure_tag>;

// A stage with its arguments bound, waiting for its upstream: what `map(f)` returns.
template <class F>
struct closure : closure_tag {
  F fn;  // builds the stage from its upstream, with the bound arguments
  // Binds f (called later with the upstream).
  explicit closure(F f) : fn(std::move(f)) {}
  // Builds the stage over s (moved in); the closure stays usable (a reusable chain).
  template <source S>
  auto operator()(S&& s) const& { return fn(std::forward<S>(s)); }
  // Builds the stage over s, moving the bound arguments out of this temporary closure.
  template <source S>
  auto operator()(S&& s) && { return std::move(fn)(std::forward<S>(s)); }
};

// Wraps f (upstream -> stage) as a closure, so `src | c` calls it: how a stage's `_t`
// returns its closure form.
template <class F>
closure<F> make_closure(F f) {
  return closure<F>(std::move(f));
}

namespace detail {
template <class...>
inline constexpr bool always_false = false;

// Compile errors that say what is wrong (tests/compile_fail/): a misuse instantiates a
// class template named for it, whose arguments name the types (the element type first)
// and whose static_assert says what to do; the caller then returns
// `typename that<...>::error_above{}`, a type that does not exist, so the pipeline's type
// is erroneous and the compiler reports nothing more about it (else its next error comes
// from deep inside the stage, and dozens follow).
template <class S>
struct pipeline_is_an_lvalue {
  static_assert(always_false<S>,
                "ferry: a pipeline is a single-pass value: move it into the next stage, "
                "e.g. std::move(src) | ferry::map(f)");
};

// Stages take their upstream by value: an lvalue source would be copied mid-epoch (or
// not at all, for threaded stages), so it is refused with a message. consteval: checked
// where it is called, before the copy's own errors (a constexpr body waits for the end of
// the translation unit).
template <class S>
consteval void require_rvalue_source() {
  if constexpr (std::is_lvalue_reference_v<S>) (void)sizeof(pipeline_is_an_lvalue<S>);
}
}  // namespace detail

// src | closure: builds the stage over src, which must be moved in (an lvalue source is a
// compile error with a message). Throws what building the stage throws.
template <source S, pipe_closure C>
auto operator|(S&& s, C&& c) {
  if constexpr (std::is_lvalue_reference_v<S>)
    return typename detail::pipeline_is_an_lvalue<S>::error_above{};
  else
    return std::forward<C>(c)(std::forward<S>(s));
}

// closure | closure: a reusable chain of stages, e.g. auto prep = map(f) | batch(32);
template <pipe_closure A, pipe_closure B>
  requires(!source<A>)
auto operator|(A&& a, B&& b) {
  return make_closure([a = std::forward<A>(a), b = std::forward<B>(b)]<class S>(S&& s) {
    return b(a(std::forward<S>(s)));
  });
}

}  // namespace ferry
