// ferry/stages/flat_map.hpp: flat_map(fn) replaces each element e by the elements of the
// range fn(e), handed out one by one, in order (tf.data's flat_map, or unbatch of lists).
//
//   src | ferry::flat_map([](const doc& d) { return tokenize(d); })       // a std::vector
//   src | ferry::flat_map([](const rec& r) { return std::span(r.bytes); }) // a view into r
//   lists | ferry::flat_map(std::identity{})     // elements that are ranges: flatten them
//
// value_type is the range's value type (std::ranges::range_value_t, cv dropped). fn is
// called with the element as an lvalue (take it as const T& or T&; a by-value parameter
// copies it) when its first output is asked for. flat_map keeps the element, and the range
// fn returned (moved in), alive until the next() after that range's last output, so fn may
// return a view into its argument. An element whose range is empty gives nothing: next()
// goes on to the next (in a loop, however many empty ones come in a row).
// Outputs: moved out (std::ranges::iter_move) where flat_map owns them: a container fn
// returned by value (or moved out of the element), or a container fn returned by
// reference that lies inside the element (std::identity, a member). From a view (std::span,
// std::views::transform, filter, ...) or a reference to anything else (a table fn captured)
// they are copied (*it): flat_map cannot tell whose elements a view refers to, and moving
// from a caller's table would empty it. A view that makes its values (transform) costs
// no copy either way.
// rewind() (rewindable upstream): rewinds the upstream and starts the epoch again, dropping
// the current element and the rest of its outputs.
//
// Threads: fn runs on the thread that calls next() (a map or prefetch worker when those sit
// downstream), as does the iteration of the range it returned; flat_map starts no thread.
//
// Errors: flat_map throws nothing of its own but std::bad_alloc and config_error (a
// restore of a wrong or damaged state). If fn throws on upstream element k (k counts the
// elements flat_map pulled this epoch, from 0; upstream errors are not elements), next()
// throws ferry::element_error ("flat_map: user function threw at element k: ...") with
// the original nested (std::rethrow_if_nested); ferry's own errors pass through
// unchanged. The same holds for an exception while iterating k's range (a lazy view's
// function): the outputs of k not handed out yet are dropped with it. Either way the next
// call goes on with element k + 1; nothing else is lost. Upstream errors reach the
// consumer unchanged, at their position, and the next call goes on with what upstream
// gives next.
// Compile-time errors: an fn that cannot take the element as E&, or that returns no range,
// is a static_assert naming E (detail::flat_map_function_cannot_take<E, F>,
// flat_map_function_must_return_a_range<E, Result>).
// Checkpoints (resumable upstream): exact at every output, also in the middle of an
//
// Memory: one upstream element and its range (in one heap block allocated at the first
// element, so the stage can move between next() calls while views point into it), plus
// the anchor's words (below).
//
// Checkpoints: with a resumable upstream, exact at every output, also in the middle of an
// element's outputs. flat_map does not save its upstream per element: every 64 upstream
// pulls it keeps the upstream's words (an anchor), so a checkpoint holds that anchor, the
// upstream pulls since it, the outputs of the current element handed out, and k. (An
// element stays current until the next() after its last output; at a boundary, after an
// error or before the first next(), the checkpoint holds the upstream's own position
// instead, and nothing is re-read. A save() mid-element also asks the upstream to save,
// so an upstream that cannot be checkpointed now refuses, though its anchor was taken.)
// restore_state() then re-reads (without calling fn) the pulls already fully handed out,
// swallowing errors among them (they reached the consumer before the save), pulls the
// current element, calls fn again and steps over the outputs already handed out, all in
// the first next(): at most 64 upstream elements and one fn call. fn and the upstream
// must be deterministic for this (as for any resume). If the upstream cannot save its
// state (an unordered parallel map), iteration is unaffected; save() throws its error.
// restore_state() must come before the first next(); a state of another pipeline shape is
// a config_error.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <ranges>
#include <string>
#include <type_traits>
#include <utility>

#include "ferry/detail/holds_ahead.hpp"
#include "ferry/error.hpp"
#include "ferry/stage.hpp"
#include "ferry/stages/detail/diagnostics.hpp"

namespace ferry {
namespace detail {

// The range type fn returns (a reference result held by reference), for the stage's
// value_type before the class is complete.
template <class Up, class F>
struct flat_map_range {
  using result = std::invoke_result_t<F&, value_t<Up>&>;
  using type = std::conditional_t<std::is_lvalue_reference_v<result>, std::remove_reference_t<result>,
                                  std::remove_cvref_t<result>>;
};

template <source Up, class F>
class flat_map_source
    : public stage<flat_map_source<Up, F>, Up,
                   std::remove_cv_t<std::ranges::range_value_t<typename flat_map_range<Up, F>::type>>> {
  using In = value_t<Up>;
  // flat_map's adaptor checks that fn takes In& and returns a range (flat_map_misuse).
  using Result = std::invoke_result_t<F&, In&>;
  // An lvalue result (std::identity, a member) is held by reference, not copied.
  static constexpr bool by_ref = std::is_lvalue_reference_v<Result>;
  using Rng = std::conditional_t<by_ref, std::remove_reference_t<Result>, std::remove_cvref_t<Result>>;
  static_assert(by_ref || std::move_constructible<Rng>, "ferry::flat_map: the range fn returns must be movable");
  using It = std::ranges::iterator_t<Rng>;
  using Sent = std::ranges::sentinel_t<Rng>;
  static constexpr bool resumable = resumable_source<Up>;
  // Outputs are moved only out of what flat_map owns (see the header): always, never, or
  // when the range fn returned by reference lies inside the element.
  enum class taking { move, copy, move_if_inside };
  static constexpr taking policy = std::ranges::view<std::remove_cv_t<Rng>> ? taking::copy
                                   : by_ref                                  ? taking::move_if_inside
                                                                             : taking::move;
  // Upstream pulls between anchors: what a restore re-reads at most, against one
  // upstream save() per this many pulls while running.
  static constexpr std::uint64_t anchor_every = 64;

  // The current element and its range, on the heap: views and iterators point into them,
  // and the stage may move between next() calls. Members go in reverse order.
  struct holder {
    std::optional<In> elem;
    std::conditional_t<by_ref, Rng*, std::optional<Rng>> range{};
    std::optional<It> it;
    std::optional<Sent> end;
    bool advance = false;  // it is at the output handed out last: step before reading
    bool move_out = policy == taking::move;
    Rng& rng() { return *range; }
    bool open() const { return it.has_value(); }
    void close() noexcept {
      end.reset();
      it.reset();
      if constexpr (by_ref)
        range = nullptr;
      else
        range.reset();
      elem.reset();
      advance = false;
    }
  };

 public:
  using value_type = std::remove_cv_t<std::ranges::range_value_t<Rng>>;
  static constexpr char name[] = "flat_map";
  static constexpr bool changes_batch_size = true;  // one element becomes many
  static_assert(std::constructible_from<value_type, std::iter_reference_t<It>> &&
                    std::constructible_from<value_type, std::iter_rvalue_reference_t<It>>,
                "ferry::flat_map: the range's elements must convert to its value type");

  flat_map_source(Up up, F fn) : stage<flat_map_source, Up, value_type>(std::move(up)), fn_(std::move(fn)) {}

 private:
  friend stage<flat_map_source, Up, value_type>;

  std::optional<value_type> pull() { return next_impl(); }

  // Throws what the upstream's save() throws (mid-element too: it is asked, though its
  // words at the anchor are written), or the error an anchor's save() met.
  void save_upstream(state_writer& w) const {
    std::uint64_t since = 0, given = 0;
    if (replay_) {  // restored, not yet replayed: the upstream sits at the anchor
      this->up().save(w);
      since = since_;
      given = given_;
    } else if (!h_ || !h_->open()) {  // a boundary: the upstream is exactly here
      this->up().save(w);
    } else {
      if (anchor_error_) std::rethrow_exception(anchor_error_);
      ask_save(this->up(), scratch_);  // the anchor may predate the upstream's refusal
      w.put_words(anchor_.words);
      since = since_;
      given = given_;
    }
    saved_since_ = since;
    saved_given_ = given;
  }
  void save_words(state_writer& w) const {
    w.put(saved_since_);
    w.put(saved_given_);
    w.put(index_);
  }
  // Call before the first next(). Throws config_error for a state of another shape, or
  // one that re-reads more than an anchor's worth (at most anchor_every pulls).
  void restore_words(state_reader& r) {
    const std::uint64_t since = r.get(), given = r.get(), index = r.get();
    if (given > 0 && (since == 0 || index == 0))
      throw config_error("restore_state: flat_map: a damaged state (" + std::to_string(given) +
                         " outputs handed out of an element never pulled)");
    if (since > anchor_every)
      throw config_error("restore_state: flat_map: a damaged state (" + std::to_string(since) +
                         " pulls to re-read since the anchor; at most " + std::to_string(anchor_every) + ")");
    start_epoch();
    since_ = since;
    given_ = given;
    index_ = index;
    replay_ = since > 0;
  }
  // The hot path, small so it inlines into the caller: the current element's next output.
  // Anything else (the element's end, the next pull, a replay) goes out of line.
  std::optional<value_type> next_impl() {
    if (h_ && h_->open()) [[likely]]
      if (std::optional<value_type> v = step()) return v;
    return next_element();
  }

  [[gnu::noinline]] std::optional<value_type> next_element() {
    if (replay_) replay();
    for (;;) {  // a loop, not recursion: any number of empty ranges in a row
      if (h_ && h_->open())
        if (std::optional<value_type> v = step()) return v;
      if (!open_next()) return std::nullopt;
    }
  }

  // The current element's next output; empty at the end of its range (then closed).
  std::optional<value_type> step() {
    holder& h = *h_;
    try {
      if (h.advance) {
        h.advance = false;
        ++*h.it;
      }
      if (*h.it == *h.end) [[unlikely]] {
        close();
        return std::nullopt;
      }
      std::optional<value_type> v;
      if constexpr (policy == taking::move)
        v.emplace(std::ranges::iter_move(*h.it));
      else if constexpr (policy == taking::copy)
        v.emplace(**h.it);
      else if (h.move_out)
        v.emplace(std::ranges::iter_move(*h.it));
      else
        v.emplace(**h.it);
      h.advance = true;
      ++given_;
      return v;
    } catch (...) {
      fail();
    }
  }

  // Pulls the next upstream element and opens its range. False at the end of the epoch.
  bool open_next() {
    if constexpr (resumable)
      if (since_ >= anchor_every) refresh_anchor();
    ++since_;  // an upstream error holds its place too
    std::optional<In> e = this->pull_up();
    if (!e) {
      --since_;
      return false;
    }
    ++index_;
    if (!h_) h_ = std::make_unique<holder>();
    h_->elem.emplace(std::move(*e));
    given_ = 0;
    try {
      open_range();
    } catch (...) {
      fail();
    }
    return true;
  }

  void open_range() {
    holder& h = *h_;
    if constexpr (by_ref) {
      Rng& r = [&]() -> Rng& {
        const in_user_code<value_type> user;  // fn runs user code (holds_ahead.hpp); its range is pulled after
        return std::invoke(fn_, *h.elem);
      }();
      h.range = std::addressof(r);
      if constexpr (policy == taking::move_if_inside) {  // the element itself, or a member of it
        const auto* p = reinterpret_cast<const unsigned char*>(std::addressof(r));
        const auto* lo = reinterpret_cast<const unsigned char*>(std::addressof(*h.elem));
        std::less<const unsigned char*> lt;
        h.move_out = !lt(p, lo) && lt(p, lo + sizeof(In));
      }
    } else {
      const in_user_code<value_type> user;  // as above
      h.range.emplace(std::invoke(fn_, *h.elem));
    }
    h.it.emplace(std::ranges::begin(h.rng()));
    h.end.emplace(std::ranges::end(h.rng()));
  }

  [[gnu::noinline]] void close() noexcept {
    h_->close();
    given_ = 0;
  }
  // In a catch block: drops the current element and throws for it (k = index_ - 1).
  [[noreturn, gnu::noinline, gnu::cold]] void fail() {
    close();
    rethrow_element(std::current_exception(), "flat_map", index_ - 1);
  }

  // The upstream's words before the pull about to happen. A failure (the upstream cannot
  // be saved) must not stop iteration: it is kept for save(), and not retried this epoch.
  [[gnu::noinline]] void refresh_anchor() {
    since_ = 0;
    if (anchor_error_) return;
    try {
      anchor_.words.clear();  // keeps its capacity: no allocation in steady state
      state_writer w(anchor_);
      this->up().save(w);
    } catch (...) {
      anchor_error_ = std::current_exception();
    }
  }

  // After restore: the upstream sits at the anchor. Re-read the pulls handed out before
  // the save (their errors were thrown then), then reopen the current element and step
  // over its outputs already handed out.
  void replay() {
    replay_ = false;
    const std::uint64_t since = since_, given = given_;
    since_ = anchor_every;  // take the anchor now: it is the restored position
    if constexpr (resumable) refresh_anchor();
    const std::uint64_t redo = given > 0 ? since - 1 : since;
    for (std::uint64_t i = 0; i < redo; ++i) {
      ++since_;
      try {
        if (!this->pull_up()) {  // the upstream gave less than before: nothing to reopen
          --since_;
          return;
        }
      } catch (...) {
      }
    }
    if (given == 0) return;
    ++since_;
    std::optional<In> e = this->pull_up();
    if (!e) {
      --since_;
      return;
    }
    if (!h_) h_ = std::make_unique<holder>();
    h_->elem.emplace(std::move(*e));
    try {
      open_range();
      holder& h = *h_;
      // Output given - 1 was the last handed out: stand on it, the step to the next pending.
      for (std::uint64_t j = 1; j < given && *h.it != *h.end; ++j) ++*h.it;
      h.advance = *h.it != *h.end;
      given_ = given;
    } catch (...) {
      fail();
    }
  }

  void start_epoch() {
    if (h_) h_->close();
    given_ = 0;
    index_ = 0;
    since_ = anchor_every;  // no anchor yet: take one at the first pull
    anchor_error_ = nullptr;
    replay_ = false;
  }

  F fn_;
  std::unique_ptr<holder> h_;
  std::uint64_t given_ = 0;  // outputs of the current element handed out
  std::uint64_t index_ = 0;  // upstream elements pulled this epoch (the current one included)
  std::uint64_t since_ = anchor_every;  // upstream pulls since the anchor (errors included)
  bool replay_ = false;  // restored: replay() before the next output
  pipeline_state anchor_;  // the upstream's words `since_` pulls ago (resumable upstreams)
  std::exception_ptr anchor_error_;  // the upstream's save() failed this epoch
  mutable pipeline_state scratch_;  // save() asks the upstream into it (capacity reused)
  mutable std::uint64_t saved_since_ = 0, saved_given_ = 0;  // from save_upstream to save_words
};

}  // namespace detail

// flat_map(fn) or flat_map(src, fn): replaces each element e by the elements of the range
// fn(e) (see the file's top).
inline constexpr fn_adaptor<detail::flat_map_source, detail::flat_map_misuse> flat_map{};

}  // namespace ferry
