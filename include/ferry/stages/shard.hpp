// ferry/stages/shard.hpp: shard(count, index) keeps one of `count` disjoint parts.
//
//   from_files(paths, fmt) | ferry::shard(world, rank)          // splits FILES: no wasted reads
//   src | ferry::shard(4, 1)                                    // splits ELEMENTS round-robin
//   from_files(...) | ferry::shard(8, i, ferry::by_element)     // elements, even after files
//
// Directly after a source that can split its files (it has shard_files(count, index)),
// shard splits files: file j goes to shard j % count (tf.data's AutoShardPolicy.FILE).
// Elsewhere, or when asked for element level, element k goes to shard k % count
// (AutoShardPolicy.DATA): every element reaches exactly one shard.
//
// Threads: runs on the thread that calls next(); shard runs no user code and starts no
// thread.
//
// Errors: throws config_error when count == 0, index >= count or either is negative, and (from the file source)
// when file-level sharding has more shards than files: pass ferry::by_element then.
// Upstream errors propagate unchanged; the next call goes on.
//
// Memory: no element is held: element-level sharding counts the upstream's elements and
// drops the other shards' as they come; file-level sharding is the file source's own.
//
// Checkpoints: element level: save() records the upstream's state, then count and index
// and the number of upstream elements pulled this epoch; restore() throws config_error
// naming both values when count or index differ (another rank's checkpoint would repeat
// and lose elements). File level: the file source's checkpoint (sources/from_files.hpp).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "ferry/error.hpp"
#include "ferry/stage.hpp"

namespace ferry {

// Tag: split elements round-robin even directly after a file source (when there are
// fewer files than shards, or files differ a lot in size).
struct by_element_t { explicit by_element_t() = default; };
// The tag's value: shard(count, index, ferry::by_element).
inline constexpr by_element_t by_element{};

namespace detail {

template <source Up>
class shard_source : public stage<shard_source<Up>, Up> {
  friend stage<shard_source, Up>;

 public:
  static constexpr char name[] = "shard";
  shard_source(Up up, std::uint64_t count, std::uint64_t index)
      : stage<shard_source, Up>(std::move(up)), count_(count), index_(index) {}

 private:
  std::optional<value_t<Up>> pull() {
    while (std::optional<value_t<Up>> e = this->pull_up())
      if (k_++ % count_ == index_) return e;
    return std::nullopt;
  }
  void start_epoch() { k_ = 0; }
  // Another rank's checkpoint (another index), or another count, would repeat and lose elements.
  template <class F>
  void config(F&& f) const {
    f("count", count_);
    f("index", index_);
  }
  void save_words(state_writer& w) const { w.put(k_); }
  void restore_words(state_reader& r) { k_ = r.get(); }

  std::uint64_t count_, index_;
  std::uint64_t k_ = 0;  // elements pulled from upstream this epoch
};

template <class S>
concept file_shardable = requires(S&& s, std::uint64_t c) { std::move(s).shard_files(c, c); };

}  // namespace detail

// The type of ferry::shard: shard(src, count, index [, by_element]), or the same without
// src for `src | shard(...)`.
struct shard_t : stage_adaptor<shard_t> {
  // Throws config_error for count == 0, index >= count, or either negative.
  static void check(int_arg count_arg, int_arg index_arg, by_element_t = by_element_t{}) {
    const std::uint64_t count = count_arg.count("shard", "count");
    const std::uint64_t index = index_arg.count("shard", "index");
    if (count == 0) throw config_error("shard: count must be at least 1 (got 0)");
    if (index >= count)
      throw config_error("shard: index must be in [0, count): got index " + std::to_string(index) +
                         " with count " + std::to_string(count));
  }
  // Builds the stage over s (stage_adaptor calls it): the file source's own shard_files()
  // when s can split its files and by_element is not given, element-level sharding
  // otherwise. Checks as check() does.
  template <source S, class... By>
  static auto make(S&& s, int_arg count_arg, int_arg index_arg, By...) {
    check(count_arg, index_arg);
    const std::uint64_t count = count_arg.bits(), index = index_arg.bits();
    if constexpr (sizeof...(By) == 0 && detail::file_shardable<std::remove_cvref_t<S>>)
      return std::move(s).shard_files(count, index);
    else
      return detail::shard_source<std::remove_cvref_t<S>>(std::forward<S>(s), count, index);
  }
};
// shard(count, index): keeps one of `count` disjoint parts (see the file's top).
inline constexpr shard_t shard{};

}  // namespace ferry
