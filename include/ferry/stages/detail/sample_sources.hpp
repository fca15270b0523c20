// ferry/stages/detail/sample_sources.hpp: the sources a sample_from holds, as one object
// (sample_from.hpp documents the stage): a fixed pack of possibly different types, or a
// run-time list of one type. Each pulls source i through its own probe, and rewinds,
// saves, restores and visits them all in order. Runs on the caller's thread; throws what
// the sources throw.
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
#include "ferry/state.hpp"

namespace ferry::detail {

// The sources of a sample_from, a fixed pack of possibly different types. Every member
// takes the source's index where it acts on one.
template <class... S>
class sample_pack {
 public:
  using value_type = value_t<std::tuple_element_t<0, std::tuple<S...>>>;
  static constexpr bool rewindable = (rewindable_source<S> && ...);
  static constexpr bool resumable = (resumable_source<S> && ...);

  explicit sample_pack(S... s) : s_(std::move(s)...) {}
  std::size_t size() const { return sizeof...(S); }
  // Two sources: one compare. More: one indirect call through a table, not a chain of
  // compares (which costs a mispredicted branch per source passed).
  std::optional<value_type> pull(std::size_t i) {
    if constexpr (sizeof...(S) == 1)
      return pull_one<0>(*this);
    else if constexpr (sizeof...(S) == 2)
      return i == 0 ? pull_one<0>(*this) : pull_one<1>(*this);
    else
      return pullers[i](*this);
  }
  void rewind()
    requires rewindable
  {
    std::apply([](auto&... s) { (s.rewind(), ...); }, s_);
  }
  void save(state_writer& w) const
    requires resumable
  {
    std::apply([&](const auto&... s) { (s.save(w), ...); }, s_);
  }
  void restore(state_reader& r)
    requires resumable
  {
    std::apply([&](auto&... s) { (s.restore(r), ...); }, s_);
  }
  bool set_buffer_resource(const std::shared_ptr<std::pmr::memory_resource>& r) {
    // Every source gets it (no short-circuit): each may end in its own batch stage.
    return std::apply([&](auto&... s) { return (static_cast<int>(forward_buffer_resource(s, r)) | ... | 0); }, s_) != 0;
  }
  // Visits every source's stages in order; returns their inclusive times summed.
  std::uint64_t visit(observe::stage_visitor& v) const {
    return std::apply(
        [&](const auto&... s) {
          return std::apply(
              [&](const auto&... p) {
                std::uint64_t sum = 0;
                ((sum += visit_one(p, s, v)), ...);
                return sum;
              },
              p_);
        },
        s_);
  }

 private:
  template <std::size_t I>
  static std::optional<value_type> pull_one(sample_pack& p) {
    return std::get<I>(p.p_).pull(std::get<I>(p.s_));
  }
  using puller = std::optional<value_type> (*)(sample_pack&);
  template <std::size_t... I>
  static constexpr std::array<puller, sizeof...(S)> table(std::index_sequence<I...>) {
    return {&pull_one<I>...};
  }
  static constexpr std::array<puller, sizeof...(S)> pullers = table(std::index_sequence_for<S...>{});
  template <class P, class U>
  static std::uint64_t visit_one(const P& p, const U& s, observe::stage_visitor& v) {
    const std::size_t n = v.stages().size();
    p.visit(s, v);
    return v.upstream_incl(n);
  }

  std::tuple<S...> s_;
  std::tuple<observe::upstream_probe<S>...> p_;
};

// The sources of a sample_from, a run-time list of one type.
template <class S>
class sample_list {
 public:
  using value_type = value_t<S>;
  static constexpr bool rewindable = rewindable_source<S>;
  static constexpr bool resumable = resumable_source<S>;

  explicit sample_list(std::vector<S> s) : s_(std::move(s)), p_(s_.size()) {}
  std::size_t size() const { return s_.size(); }
  std::optional<value_type> pull(std::size_t i) { return p_[i].pull(s_[i]); }
  void rewind()
    requires rewindable
  {
    for (S& s : s_) s.rewind();
  }
  void save(state_writer& w) const
    requires resumable
  {
    for (const S& s : s_) s.save(w);
  }
  void restore(state_reader& r)
    requires resumable
  {
    for (S& s : s_) s.restore(r);
  }
  bool set_buffer_resource(const std::shared_ptr<std::pmr::memory_resource>& r) {
    bool took = false;
    for (S& s : s_) took = forward_buffer_resource(s, r) || took;  // every source gets it
    return took;
  }
  std::uint64_t visit(observe::stage_visitor& v) const {
    std::uint64_t sum = 0;
    for (std::size_t i = 0; i < s_.size(); ++i) {
      const std::size_t n = v.stages().size();
      p_[i].visit(s_[i], v);
      sum += v.upstream_incl(n);
    }
    return sum;
  }

 private:
  std::vector<S> s_;
  std::vector<observe::upstream_probe<S>> p_;
};

}  // namespace ferry::detail
