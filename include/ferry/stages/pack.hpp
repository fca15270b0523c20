// ferry/stages/pack.hpp: pack(L, n, {...}) concatenates variable-length sequences (the
// elements: a std::vector, std::string or span of tokens each) and cuts the stream into
// rows of exactly L tokens, n rows a batch, with each token's segment id and position,
// so that a model can keep attention inside each sequence. What LLM pretraining loaders
// do instead of padding: no token is padding except in the epoch's last row.
//
//   // docs: a source of std::vector<std::int32_t>, one document's tokens each
//   auto p = std::move(docs) | ferry::pack(2048, 8) | ferry::prefetch(2) | ferry::distribute(devs);
//   for (auto& st : p)                             // batches: batch_of<std::tuple<
//     for (auto& rb : st) {                        //   padded<std::int32_t>, padded<std::uint32_t>,
//       ferry::padded_view<std::int32_t> tok = rb.field<0>();   //   padded<std::uint32_t>>>
//       ferry::padded_view<std::uint32_t> seg = rb.field<1>();  // each replica's rows, on its
//       ferry::padded_view<std::uint32_t> pos = rb.field<2>();  // device with cuda::devices
//     }
//
// Each row: L tokens (width L) from one or more sequences, in order. seg[i][j] is 1 for
// the row's first (piece of a) sequence, 2 for the next, ...; pos[i][j] counts from 0
// within that piece. A sequence longer than the room left in a row is split: the row takes
// what fits, the next row goes on with the rest as its segment 1, positions from 0 again.
// Empty sequences add nothing. Every row has L real tokens (lengths[i] == L) except the
// epoch's last, which is padded: tokens with pad_value, segment ids and positions with 0.
// The batch: padded fields as padded_batch's, so distribute() splits it across replicas.
//
// Across epochs and resumes nothing is lost or repeated: the epoch's last tokens end the
// epoch (its last batch may be short and its last row partial; drop_remainder drops a
// last batch with fewer than n rows, or whose last row is partial), and the next epoch
// starts a new row.
//
// Threads: runs on the thread calling next(); no user code of its own.
//
// Errors: config_error for L == 0 or n == 0, or a pad_value that is not a value of the token
// type (-1 for uint8 tokens). An upstream error arrives at its place; the
// batch being built is dropped with it, as batch() drops its elements: every token already
// in it, the rest of a sequence split into it included. The next batch starts with the
// sequence after the one that failed.
//
// Memory: the batch being built (3 fields of n × L values and n lengths each), and the
// sequence being split.
//
// Checkpoints: exact, and holding positions, not tokens: the upstream's position before
// the sequence being split (a snapshot taken before each pull, when the upstream can
// save) and how many of its tokens are already in rows. A restore pulls that one sequence
// again. Saving costs one upstream save() per sequence pulled. Over an upstream that
// cannot be saved (an unordered map) the data flows and save() is the config_error saying
// why.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <memory_resource>
#include <optional>
#include <ranges>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/batch_of.hpp"
#include "ferry/error.hpp"
#include "ferry/memory/buffer.hpp"
#include "ferry/source.hpp"
#include "ferry/stage.hpp"
#include "ferry/state.hpp"

namespace ferry {

// pack()'s options, a braced list: pack(2048, 8, {.pad_value = -1}).
struct pack_options {
  double pad_value = 0;  // the epoch's last row's padding tokens, converted to the token type
  bool drop_remainder = false;  // drop a last batch that is short or ends in a partial row
  // Where batch buffers come from; null means a buffer_pool private to the stage.
  std::shared_ptr<std::pmr::memory_resource> resource = nullptr;
};

// The element type pack()'s batches are named by: tokens, segment ids, positions.
template <class E>
using packed_element_t = std::tuple<padded<E>, padded<std::uint32_t>, padded<std::uint32_t>>;

namespace detail {

template <source Up>
class pack_source
    : public stage<pack_source<Up>, Up, batch_of<packed_element_t<std::ranges::range_value_t<value_t<Up>>>>> {
  using T = value_t<Up>;
  static_assert(ragged_field<T>,
                "ferry::pack: the elements must be sequences of tokens (a std::vector, std::string or span of "
                "trivially-copyable values)");
  using E = std::ranges::range_value_t<T>;
  using P = packed_element_t<E>;
  using B = batch_of<P>;
  friend stage<pack_source, Up, B>;
  static constexpr bool snapshots = resumable_source<Up>;

 public:
  static constexpr char name[] = "pack";
  // Throws config_error for rows too large to address.
  pack_source(Up up, std::size_t len, std::size_t n, pack_options o)
      : stage<pack_source, Up, B>(std::move(up)), len_(len), target_(n, std::move(o.resource)), o_(std::move(o)) {
    check_pad_value<T>(o_.pad_value, name);
    if (len_ > std::numeric_limits<std::uint32_t>::max() ||
        target_.rows > std::numeric_limits<std::size_t>::max() / len_ / (sizeof(E) + 8))
      throw config_error("pack: " + std::to_string(target_.rows) + " rows of " + std::to_string(len_) +
                         " tokens do not fit in memory's address range (or a row in uint32 lengths)");
  }

 private:
  collation& collates() { return target_; }  // the base's batch_size() and buffer hook
  std::optional<B> pull() {
    if (ended_) return std::nullopt;
    B b = col_.start_padded(target_.resource, target_.rows, {len_, len_, len_});
    E* tok = col_.template padded_values<0>(b);
    std::uint32_t* seg = col_.template padded_values<1>(b);
    std::uint32_t* pos = col_.template padded_values<2>(b);
    std::size_t rows = 0, used = 0;
    while (rows < target_.rows) {
      used = 0;
      std::uint32_t segment = 0;
      while (used < len_) {
        if (off_ == cur_size()) {
          if (!next_sequence()) break;
          continue;
        }
        const std::size_t take = std::min(len_ - used, cur_size() - off_);
        std::memcpy(tok + used, std::ranges::data(*cur_) + off_, take * sizeof(E));
        ++segment;
        for (std::size_t j = 0; j < take; ++j) seg[used + j] = segment, pos[used + j] = std::uint32_t(j);
        used += take;
        off_ += take;
      }
      if (used == 0) break;
      std::fill(tok + used, tok + len_, pad_as<E>(o_.pad_value));
      std::fill(seg + used, seg + len_, 0u);
      std::fill(pos + used, pos + len_, 0u);
      for (std::size_t f = 0; f < 3; ++f) lengths(b, f)[rows] = std::uint32_t(used);
      ++rows, tok += len_, seg += len_, pos += len_;
      if (used < len_) break;  // the epoch's last row
    }
    if (rows == 0 || (o_.drop_remainder && (rows < target_.rows || used < len_))) {
      ended_ = true;
      return std::nullopt;
    }
    col_.set_size(b, rows);
    return b;
  }

  std::size_t cur_size() const { return cur_ ? std::ranges::size(*cur_) : 0; }
  // The next sequence into cur_ (its tokens from 0); false at the end of the epoch.
  bool next_sequence() {
    if (ended_) return false;
    if constexpr (snapshots) {
      if (save_error_.empty()) {
        before_.words.clear();
        state_writer w(before_);
        try {
          this->up().save(w);
        } catch (const config_error& e) {  // an upstream that cannot be saved: the data flows, save() says why
          save_error_ = e.what();
        }
      }
    }
    cur_.reset();
    off_ = 0;
    std::optional<T> e = this->pull_up();
    if (!e) {
      ended_ = true;
      return false;
    }
    cur_ = std::move(e);
    return true;
  }
  std::uint32_t* lengths(B& b, std::size_t f) {
    switch (f) {
      case 0: return col_.template padded_lengths<0>(b);
      case 1: return col_.template padded_lengths<1>(b);
      default: return col_.template padded_lengths<2>(b);
    }
  }

  template <class F>
  void config(F&& f) const {
    f("length", len_);
    f("rows", target_.rows);
    f("drop_remainder", std::uint64_t(o_.drop_remainder));
  }
  bool splitting() const { return cur_ && off_ < cur_size(); }
  // The upstream before the sequence being split, when there is one.
  void save_upstream(state_writer& w) const {
    if (!save_error_.empty()) throw config_error(save_error_);
    if (splitting()) {
      ask_save(this->up(), scratch_);  // before_ may predate the upstream's refusal (an unordered map)
      w.put_words(before_.words);
    } else
      this->up().save(w);
  }
  void save_words(state_writer& w) const {
    w.put(splitting() ? off_ : 0);
    w.put(splitting());
    w.put(ended_);
  }
  // Throws config_error for a damaged state, or an upstream whose sequence there is shorter
  // than the tokens the state took from it (another dataset).
  void restore_words(state_reader& r) {
    const std::uint64_t off = r.get();
    const bool split = r.get_flag(name), ended = r.get_flag(name);
    cur_.reset();
    off_ = 0;
    ended_ = false;
    if (split) {
      if (!next_sequence() || off == 0 || off >= cur_size())
        throw config_error("restore_state: pack: the state had taken " + std::to_string(off) +
                           " tokens of a sequence that the upstream now " +
                           (cur_ ? "has " + std::to_string(cur_size()) + " tokens in" : std::string("ends before")) +
                           " (restored into another dataset?)");
      off_ = off;
    }
    ended_ = ended;
  }
  void start_epoch() {
    cur_.reset();
    off_ = 0;
    ended_ = false;
  }

  std::size_t len_;
  collation target_;  // n rows per batch, and where batches are collated
  pack_options o_;
  std::optional<T> cur_;  // the sequence being split
  std::size_t off_ = 0;  // its tokens already in rows
  bool ended_ = false;  // the upstream has ended this epoch
  pipeline_state before_;  // the upstream's position before cur_ was pulled
  std::string save_error_;  // why the upstream cannot be saved, once a snapshot found it
  mutable pipeline_state scratch_;  // save() asks the upstream into it (capacity reused)
  batch_collator<P> col_;
};

// {L, rows per batch}, checked.
inline std::pair<std::size_t, std::size_t> check_pack_args(int_arg len_arg, int_arg n_arg) {
  const std::uint64_t len = len_arg.count("pack", "the row length L");
  const std::uint64_t n = n_arg.count("pack", "the rows per batch");
  if (len == 0) throw config_error("pack: the row length L must be at least 1 (got 0)");
  if (n == 0) throw config_error("pack: the rows per batch must be at least 1 (got 0)");
  return {static_cast<std::size_t>(len), static_cast<std::size_t>(n)};
}

}  // namespace detail

// Not a stage_adaptor: its options are a braced list.
struct pack_t {
  // pack(src, L, n, options): builds the stage over src (moved in); throws config_error
  // for L == 0 or n == 0.
  template <source S>
  auto operator()(S&& s, int_arg len_arg, int_arg n_arg, pack_options o = {}) const {
    detail::require_rvalue_source<S>();
    const auto [len, n] = detail::check_pack_args(len_arg, n_arg);
    return detail::pack_source<std::remove_cvref_t<S>>(std::forward<S>(s), len, n, std::move(o));
  }
  // pack(L, n, options): a closure for `src | pack(L, n)`; throws config_error now.
  auto operator()(int_arg len_arg, int_arg n_arg, pack_options o = {}) const {
    const std::pair<std::size_t, std::size_t> ln = detail::check_pack_args(len_arg, n_arg);
    const std::size_t len = ln.first, n = ln.second;  // clang 14 cannot capture a structured binding
    return make_closure([len, n, o]<class S>(S&& s) { return pack_t{}(std::forward<S>(s), len, n, o); });
  }
};
// pack(L, n, {...}): sequences concatenated into batches of n rows of L tokens, with
// segment ids and positions (see the file's top).
inline constexpr pack_t pack{};

}  // namespace ferry
