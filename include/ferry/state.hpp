// ferry/state.hpp: iterator state, so a pipeline resumes mid-epoch exactly.
//
// A pipeline's state is a flat list of 64-bit words, written upstream first: each stage
// writes its upstream's words, then a tag naming the stage, then its own position and RNG
// words. It holds positions, never buffered elements, so it is small (tens of words) and
// restoring never replays more than one stage-buffer's worth of upstream elements.
//
// save_state(p) may be called between next() calls, on the consumer's thread.
// restore_state(p, s) must be called on a fresh pipeline of the same shape, before its
// first next(); a state from a pipeline of another shape is a config_error.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/error.hpp"

namespace ferry {

// The saved position of a whole pipeline. `words` is its portable form: write it to a
// checkpoint with to_bytes() and read it back with from_bytes().
struct pipeline_state {
  std::vector<std::uint64_t> words;

  std::string to_bytes() const {
    std::string out(words.size() * 8, '\0');
    for (std::size_t i = 0; i < words.size(); ++i)
      for (int b = 0; b < 8; ++b) out[i * 8 + b] = static_cast<char>(words[i] >> (8 * b));
    return out;
  }
  // Throws config_error when `bytes` is not a whole number of words.
  static pipeline_state from_bytes(std::string_view bytes) {
    if (bytes.size() % 8 != 0)
      throw config_error("pipeline_state::from_bytes: " + std::to_string(bytes.size()) +
                         " bytes is not a multiple of 8");
    pipeline_state s;
    s.words.resize(bytes.size() / 8);
    for (std::size_t i = 0; i < s.words.size(); ++i)
      for (int b = 0; b < 8; ++b)
        s.words[i] |= std::uint64_t(static_cast<unsigned char>(bytes[i * 8 + b])) << (8 * b);
    return s;
  }
  friend bool operator==(const pipeline_state&, const pipeline_state&) = default;
};

namespace detail {
// FNV-1a of a stage name: the tag that catches a state restored into the wrong pipeline.
constexpr std::uint64_t stage_tag(std::string_view name) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return h;
}
}  // namespace detail

class state_writer {
 public:
  explicit state_writer(pipeline_state& s) : s_(&s) {}
  void tag(std::string_view stage) { s_->words.push_back(detail::stage_tag(stage)); }
  void put(std::uint64_t w) { s_->words.push_back(w); }
  void put_words(const std::vector<std::uint64_t>& ws) {
    s_->words.insert(s_->words.end(), ws.begin(), ws.end());
  }

 private:
  pipeline_state* s_;
};

class state_reader {
 public:
  explicit state_reader(const pipeline_state& s) : s_(&s) {}
  // Throws config_error when the next word is not `stage`'s tag.
  void expect(std::string_view stage) {
    if (get_raw() != detail::stage_tag(stage))
      throw config_error("restore_state: the state was saved from a pipeline of another shape "
                         "(expected stage '" + std::string(stage) + "' at word " +
                         std::to_string(pos_ - 1) + ")");
  }
  std::uint64_t get() { return get_raw(); }
  bool done() const { return pos_ == s_->words.size(); }

 private:
  std::uint64_t get_raw() {
    if (pos_ >= s_->words.size())
      throw config_error("restore_state: the state is too short for this pipeline");
    return s_->words[pos_++];
  }
  const pipeline_state* s_;
  std::size_t pos_ = 0;
};

}  // namespace ferry
