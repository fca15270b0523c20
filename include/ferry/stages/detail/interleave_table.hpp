// ferry/stages/detail/interleave_table.hpp: the slot table that interleave(fn)'s checkpoint
// holds after the upstream's position: the turn, each open slot's distance from the anchor
// (the upstream before the oldest open slot's element) with its source's words, the
// upstream pulls since the anchor, whether the upstream had ended, and the pulls of the
// epoch before the anchor (so that errors after a restore name the same element). restore() reads and
// checks it; the first pull after replays it. stages/interleave.hpp documents what users
// see. Runs on the caller's thread; no user code.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ferry/error.hpp"
#include "ferry/state.hpp"

namespace ferry::detail {

struct interleave_table {
  struct open_slot {
    std::size_t slot = 0;
    std::uint64_t distance = 0;  // upstream pulls from the anchor to its element
    pipeline_state words;        // its source's position
  };
  std::uint64_t cur = 0, in_block = 0;  // the turn, and elements taken from it
  std::vector<open_slot> open;          // by slot
  std::uint64_t since = 0;              // upstream pulls from the anchor to the save
  bool ended = false;                   // the upstream had ended
  std::uint64_t base = 0;               // upstream pulls this epoch before the anchor (errors name k from 0)

  // The most upstream pulls a checkpoint re-reads: from the anchor (the oldest open slot's
  // element) to the save. Nothing else bounds them (a long source in one slot while the
  // others open and end many short ones, or upstream errors, keep the anchor far back),
  // so save() refuses past it and read() refuses a state claiming more (one claiming 2^62
  // would re-read for ever over repeat()).
  static constexpr std::uint64_t max_since = std::uint64_t(1) << 24;

  // Reads a table of `slots` slots. Throws config_error for a damaged one, or one no save
  // writes: a turn or slot out of range, a slot's words over 2^20, more than max_since
  // pulls, an open slot at or past the pulls, two at one distance, or none at the anchor.
  static interleave_table read(state_reader& r, std::size_t slots, std::size_t block) {
    interleave_table t;
    t.cur = r.get();
    t.in_block = r.get();
    if (t.cur >= slots || t.in_block >= block)
      throw config_error("restore_state: interleave: a damaged state (turn " + std::to_string(t.cur) + ", " +
                         std::to_string(t.in_block) + " taken)");
    for (std::size_t i = 0; i < slots; ++i) {
      const std::uint64_t is_open = r.get();
      if (is_open > 1) throw config_error("restore_state: interleave: a damaged state (slot " + std::to_string(i) + ")");
      if (!is_open) continue;
      open_slot s{i, r.get(), {}};
      const std::uint64_t n = r.get();
      if (n > (std::uint64_t(1) << 20))
        throw config_error("restore_state: interleave: a damaged state (slot " + std::to_string(i) + ": " +
                           std::to_string(n) + " words)");
      for (std::uint64_t j = 0; j < n; ++j) s.words.words.push_back(r.get());
      t.open.push_back(std::move(s));
    }
    t.since = r.get();
    const std::uint64_t ended = r.get();
    if (ended > 1) throw config_error("restore_state: interleave: a damaged state (an end flag of " + std::to_string(ended) + ")");
    if (t.since > max_since)
      throw config_error("restore_state: interleave: a damaged state (" + std::to_string(t.since) +
                         " upstream pulls to re-read since the anchor; a save writes at most " +
                         std::to_string(max_since) + ")");
    // Each open slot's element was pulled before the save (its distance is below the
    // pulls), one element per slot, and the anchor is the oldest one's (distance 0); with
    // no slot open the anchor is the save itself (no pulls).
    std::vector<std::uint64_t> d;
    d.reserve(t.open.size());
    for (const open_slot& s : t.open) {
      if (s.distance >= t.since)
        throw config_error("restore_state: interleave: a damaged state (slot " + std::to_string(s.slot) +
                           " opened " + std::to_string(s.distance) + " pulls after the anchor, of " +
                           std::to_string(t.since) + " pulls since it)");
      d.push_back(s.distance);
    }
    std::sort(d.begin(), d.end());
    if (std::adjacent_find(d.begin(), d.end()) != d.end())
      throw config_error("restore_state: interleave: a damaged state (two open slots of one upstream element)");
    if (d.empty() ? t.since != 0 : d.front() != 0)
      throw config_error("restore_state: interleave: a damaged state (" + std::to_string(t.since) +
                         " upstream pulls since an anchor that is no open slot's)");
    t.ended = ended != 0;
    t.base = r.get();
    if (t.base > (std::uint64_t(1) << 62))
      throw config_error("restore_state: interleave: a damaged state (" + std::to_string(t.base) +
                         " upstream pulls before the anchor)");
    return t;
  }

  // Writes the table as read() reads it (a save between a restore and its replay).
  void write(state_writer& w, std::size_t slots) const {
    w.put(cur);
    w.put(in_block);
    auto it = open.begin();
    for (std::size_t i = 0; i < slots; ++i) {
      const bool here = it != open.end() && it->slot == i;
      w.put(here ? 1 : 0);
      if (!here) continue;
      w.put(it->distance);
      w.put(it->words.words.size());
      w.put_words(it->words.words);
      ++it;
    }
    w.put(since);
    w.put(ended ? 1 : 0);
    w.put(base);
  }
};

}  // namespace ferry::detail
