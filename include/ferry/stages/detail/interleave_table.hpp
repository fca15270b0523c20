// ferry/stages/detail/interleave_table.hpp: the slot table that interleave(fn)'s checkpoint
// holds after the upstream's position: the turn, each open slot's distance from the anchor
// (the upstream before the oldest open slot's element) with its source's words, the
// upstream pulls since the anchor, and whether the upstream had ended. restore() reads and
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

  // Reads a table of `slots` slots. Throws config_error for a damaged one (a turn or slot
  // out of range, a slot's words over 2^20, pulls that do not reach every open slot).
  static interleave_table read(state_reader& r, std::size_t slots, std::size_t block) {
    interleave_table t;
    t.cur = r.get();
    t.in_block = r.get();
    if (t.cur >= slots || t.in_block >= block)
      throw config_error("restore_state: interleave: a damaged state (turn " + std::to_string(t.cur) + ", " +
                         std::to_string(t.in_block) + " taken)");
    std::uint64_t last = 0;
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
      last = std::max(last, s.distance + 1);
      t.open.push_back(std::move(s));
    }
    t.since = r.get();
    const std::uint64_t ended = r.get();
    if (t.since < last || ended > 1)
      throw config_error("restore_state: interleave: a damaged state (" + std::to_string(t.since) +
                         " upstream pulls since the anchor)");
    t.ended = ended != 0;
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
  }
};

}  // namespace ferry::detail
