// ferry/stages/sample_from.hpp: sample_from(options, a, b, ...) mixes several sources,
// drawing at each next() which one gives the next element (tf.data's
// Dataset.sample_from_datasets).
//
//   auto mix = ferry::sample_from({.weights = {0.7, 0.3}, .seed = 42}, std::move(web), std::move(books));
//   // about 70% web, 30% books, in an order fixed by (seed, epoch)
//   std::vector<corpus_pipeline> langs = ...;                 // a count known only at run time
//   auto all = ferry::sample_from({.seed = 1}, std::move(langs));   // equal weights
//
// Two forms: a pack of sources (their types may differ; their value_types must be the
// same, a static_assert says so otherwise; zero sources does not compile), or a
// std::vector of sources of one type (for a count known at run time; an empty vector is
// a config_error). Sources are moved in.
//
// Draws: draw d of epoch e takes u in [0, 1) from the d-th output of SplitMix64 seeded with
// mix_seed({seed, e}) (ferry/detail/random.hpp; its top 53 bits times 2^-53), computed from
// the counter alone, and picks
// the first active source (in argument order) whose cumulative weight exceeds
// u * (sum of the active weights). "Active": a positive weight and not ended this epoch.
// So the order is a function of (seed, epoch, the sources' lengths and errors) only, the
// same run to run and on every build; rewind() starts epoch e + 1 with a new sequence. A
// draw costs O(sources) and allocates nothing.
// Weights: empty means equal; otherwise one per source, finite and >= 0, not all 0 (and
// with a finite sum). A zero weight is allowed: that source is never drawn, so its
// elements are never read (nor is its next() called).
// End of a source: with .stop_on_empty = false (the default), a drawn source that ends is
// dropped (the draw that found its end is used up) and later draws go over the remaining
// active sources, their weights renormalised; the epoch ends when every source of positive weight has ended (sources of
// weight 0 are never read, so they do not keep it going). With .stop_on_empty = true the
// epoch ends at the first draw that hits a source's end (as tf.data's
// stop_on_empty_dataset), and the other sources keep their unread elements. Either way a
// source that ended is not called again this epoch, and after the end next() returns the
// end without calling any source.
// rewind() (when every source is rewindable) rewinds every source and starts the next
// epoch.
// Stats: the sources appear in report() in argument order (each source's stages, then
// the next source's), then "sample_from", whose own time excludes every source's time.
//
// Threads: everything (every source's next(), the draws) runs on the thread that calls
// next(); threaded upstreams (map with workers, prefetch) run their own threads as usual.
//
// Errors: config_error from sample_from() for bad options (see above) or no sources,
// naming the value; nothing of its own from next(). A source's exception reaches the
// consumer unchanged. The draw that called it is used up, so the next call draws again;
// the failing source keeps whatever position it had after throwing (as it would without
// sample_from), and nothing else is lost.
//
// Memory: no element is held: the sources themselves, and per source its weight, a bit
// saying whether it ended this epoch and its place in the active list.
//
// Checkpoints: when every source is resumable, save() records every source's state in
// argument order, then the tag "sample_from", the source count, the epoch, the draws made
// this epoch, and one bit per source (64 to a word) saying which have ended. restore()
// continues the identical sequence; a state of another source count or shape is a
// config_error. The options are not saved: a restore with other weights or seed goes on
// with the sources' positions exact, under the new options (how a mixture schedule is
// changed mid-run).
#pragma once

#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <memory_resource>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/detail/random.hpp"
#include "ferry/error.hpp"
#include "ferry/memory/buffer.hpp"
#include "ferry/stage.hpp"
#include "ferry/stages/detail/sample_sources.hpp"
#include "ferry/state.hpp"

namespace ferry {

// sample_from()'s options, a braced list: sample_from({.weights = {0.7, 0.3}, .seed = 42}, ...).
struct sample_from_options {
  std::vector<double> weights = {};  // one per source, >= 0; empty: equal weights
  std::uint64_t seed = 0;  // with the epoch, fixes the order of draws
  bool stop_on_empty = false;  // end the epoch when the first drawn source ends
};

namespace detail {

// u in [0, 1) for draw d of the epoch whose key is `key`: the d-th output of SplitMix64
// seeded with `key` (each output is the mix of key + (d + 1) * gamma), so any draw is
// computed from its counter alone, and a checkpoint needs only the counter.
inline double sample_draw(std::uint64_t key, std::uint64_t d) {
  splitmix64 g(key + d * 0x9e3779b97f4a7c15ull);
  return static_cast<double>(g() >> 11) * 0x1.0p-53;
}

template <class Ups>
class sample_from_source : public source_base<sample_from_source<Ups>, typename Ups::value_type> {
  friend source_base<sample_from_source, typename Ups::value_type>;

 public:
  using value_type = typename Ups::value_type;
  static constexpr char name[] = "sample_from";
  // The sources are held here, not by the base (a run-time list among them): saved first,
  // restored first, rewound by start_epoch(). Saving needs every source resumable.
  static constexpr bool cannot_save = !Ups::resumable;

  // `weights` checked by sample_from_t (one per source, valid).
  sample_from_source(Ups ups, std::vector<double> weights, std::uint64_t seed, bool stop_on_empty)
      : ups_(std::move(ups)), w_(std::move(weights)), seed_(seed), stop_on_empty_(stop_on_empty),
        ended_((w_.size() + 63) / 64, 0) {
    active_.reserve(w_.size());
    aw_.reserve(w_.size());
    begin_epoch();
  }

  std::uint64_t epoch() const { return epoch_; }

  bool set_buffer_resource(const std::shared_ptr<std::pmr::memory_resource>& r) {
    this->check_not_moved();
    return ups_.set_buffer_resource(r);
  }
  // Every source's stages in order, then sample_from, whose own time excludes all of theirs.
  void visit_stages(observe::stage_visitor& v) const {
    if (!this->live()) return;
    v.add_joined(name, this->stats(), ups_.visit(v));
  }

 private:
  std::optional<value_type> pull() { return next_impl(); }

  // rewind(): every source, then the next epoch's draws.
  void start_epoch()
    requires Ups::rewindable
  {
    ups_.rewind();
    ++epoch_;
    draws_ = 0;
    for (std::uint64_t& b : ended_) b = 0;
    begin_epoch();
  }

  void save_upstream(state_writer& w) const { ups_.save(w); }
  void restore_upstream(state_reader& r) { ups_.restore(r); }
  void save_words(state_writer& w) const {
    w.put(w_.size());
    w.put(epoch_);
    w.put(draws_);
    w.put_words(ended_);
  }
  // Throws config_error for a state of another source count, or one marking a source
  // this sample_from does not have as ended.
  void restore_words(state_reader& r) {
    const std::uint64_t n = r.get();
    if (n != w_.size())
      throw config_error("restore_state: sample_from: the state has " + std::to_string(n) +
                         " sources, this sample_from has " + std::to_string(w_.size()));
    epoch_ = r.get();
    draws_ = r.get();
    for (std::size_t k = 0; k < ended_.size(); ++k) {
      ended_[k] = r.get();
      const std::size_t valid = w_.size() - 64 * k;  // sources in this word
      if (valid < 64 && (ended_[k] >> valid) != 0)
        throw config_error("restore_state: sample_from: the state marks source " +
                           std::to_string(64 * k + static_cast<std::size_t>(std::countr_zero(ended_[k] >> valid)) + valid) +
                           " as ended, but this sample_from has " + std::to_string(w_.size()) + " sources");
    }
    begin_epoch();
  }

  std::optional<value_type> next_impl() {
    while (!over_) {
      const std::size_t j = pick(sample_draw(key_, draws_++));  // used up even if the source throws
      const std::size_t i = active_[j];
      std::optional<value_type> e = ups_.pull(i);
      if (e) [[likely]]
        return e;
      drop(i, j);
    }
    return std::nullopt;
  }
  // Source i (at j in active_) ended. Out of line: it keeps next() small enough to inline
  // into its caller, so the element is not copied through the stack (which cost 15 ns).
  [[gnu::noinline, gnu::cold]] void drop(std::size_t i, std::size_t j) {
    ended_[i / 64] |= std::uint64_t(1) << (i % 64);
    if (stop_on_empty_) {
      over_ = true;
      return;
    }
    active_.erase(active_.begin() + static_cast<std::ptrdiff_t>(j));  // no allocation
    aw_.erase(aw_.begin() + static_cast<std::ptrdiff_t>(j));
    sum_weights();
    over_ = active_.empty();
  }
  bool ended(std::size_t i) const { return (ended_[i / 64] >> (i % 64)) & 1; }

  // The active sources and their weight sum, from the weights and ended_.
  void begin_epoch() {
    key_ = mix_seed({seed_, epoch_});
    active_.clear();
    aw_.clear();
    bool any_ended = false;
    for (std::size_t i = 0; i < w_.size(); ++i) {
      any_ended = any_ended || ended(i);
      if (w_[i] > 0 && !ended(i)) {
        active_.push_back(i);
        aw_.push_back(w_[i]);
      }
    }
    sum_weights();
    over_ = active_.empty() || (stop_on_empty_ && any_ended);
  }
  // Summed in index order, as pick() accumulates: its last cumulative weight is total_.
  void sum_weights() {
    total_ = 0;
    for (double w : aw_) total_ += w;
  }
  // The position in active_ of the first source whose cumulative weight exceeds u * total.
  std::size_t pick(double u) const {
    const double x = u * total_;
    double acc = 0;
    const std::size_t n = aw_.size();
    for (std::size_t j = 0; j + 1 < n; ++j) {
      acc += aw_[j];
      if (x < acc) return j;
    }
    return n - 1;  // x < total_ always; the last active source also takes any rounding
  }

  Ups ups_;
  std::vector<double> w_;  // per source
  std::uint64_t seed_;
  bool stop_on_empty_;
  std::uint64_t epoch_ = 0;
  std::uint64_t draws_ = 0;   // draws this epoch (the counter the next draw uses)
  std::uint64_t key_ = 0;     // mix_seed({seed_, epoch_})
  std::vector<std::uint64_t> ended_;  // bit i: source i ended this epoch
  std::vector<std::size_t> active_;   // sources of positive weight not ended, in order
  std::vector<double> aw_;            // their weights
  double total_ = 0;                  // the sum of aw_
  bool over_ = false;                 // the epoch ended
};

}  // namespace detail

// The type of ferry::sample_from: sample_from(options, a, b, ...) or
// sample_from(options, std::move(vector)); no pipe form.
struct sample_from_t {
  // The pack form: sources of any types with one value_type.
  template <source... S>
  auto operator()(sample_from_options o, S&&... s) const {
    static_assert(sizeof...(S) > 0,
                  "ferry::sample_from needs at least one source: sample_from(options, std::move(a), std::move(b), ...)");
    (detail::require_rvalue_source<S>(), ...);
    if constexpr (sizeof...(S) > 0) {
      using first = value_t<std::tuple_element_t<0, std::tuple<S...>>>;
      static_assert((std::is_same_v<value_t<S>, first> && ...),
                    "ferry::sample_from: every source must have the same value_type; convert the others "
                    "first, e.g. std::move(b) | ferry::map([](auto x) { return T(x); })");
      std::vector<double> w = checked_weights(std::move(o.weights), sizeof...(S));
      return detail::sample_from_source<detail::sample_pack<std::remove_cvref_t<S>...>>(
          detail::sample_pack<std::remove_cvref_t<S>...>(std::forward<S>(s)...), std::move(w), o.seed,
          o.stop_on_empty);
    }
  }
  // The list form: a run-time count of sources of one type, moved in.
  template <source S>
  auto operator()(sample_from_options o, std::vector<S>&& sources) const {
    std::vector<double> w = checked_weights(std::move(o.weights), sources.size());
    return detail::sample_from_source<detail::sample_list<S>>(detail::sample_list<S>(std::move(sources)),
                                                             std::move(w), o.seed, o.stop_on_empty);
  }
  // An lvalue vector of sources: refused at compile time (move the sources in).
  template <source S>
  void operator()(sample_from_options, const std::vector<S>&) const {
    static_assert(detail::always_false<S>,
                  "ferry::sample_from: a pipeline is a single-pass value: move the sources in, "
                  "e.g. ferry::sample_from(options, std::move(sources))");
  }

 private:
  // The weights, one per source (equal when none were given). Throws config_error naming
  // the bad value.
  static std::vector<double> checked_weights(std::vector<double> w, std::size_t n) {
    if (n == 0) throw config_error("sample_from: no sources (give at least one)");
    if (w.empty()) return std::vector<double>(n, 1.0);
    if (w.size() != n)
      throw config_error("sample_from: " + std::to_string(w.size()) + (w.size() == 1 ? " weight" : " weights") +
                         " for " + std::to_string(n) + (n == 1 ? " source" : " sources") +
                         " (give one weight per source, or none for equal weights)");
    double sum = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (!std::isfinite(w[i]) || w[i] < 0) {
        char v[32];
        std::snprintf(v, sizeof v, "%g", w[i]);
        throw config_error("sample_from: weight " + std::to_string(i) + " is " + v +
                           " (weights must be finite and >= 0)");
      }
      sum += w[i];
    }
    if (sum == 0)
      throw config_error("sample_from: every weight is 0 (at least one source needs a positive weight)");
    if (!std::isfinite(sum)) throw config_error("sample_from: the weights sum to infinity (scale them down)");
    return w;
  }
};
// sample_from(options, sources...): mixes several sources by weighted draws (see the
// file's top).
inline constexpr sample_from_t sample_from{};

}  // namespace ferry
