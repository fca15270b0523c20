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

#include "ferry/detail/random.hpp"
#include "ferry/error.hpp"

namespace ferry {

// The saved position of a whole pipeline. `words` is its portable form: write it to a
// checkpoint with to_bytes() and read it back with from_bytes().
//
// Bytes: the magic word "ferrySt3", the words, and a check word (a SplitMix64-mixed hash of
// the words), each 8 bytes little-endian. The check catches a checkpoint file that was cut
// short or damaged: restoring garbage positions would silently read the wrong elements.
struct pipeline_state {
  std::vector<std::uint64_t> words;  // upstream first: each stage's words, tag, configuration, position

  static constexpr std::uint64_t magic = 0x3374537972726566ull;  // "ferrySt3" read as LE
  // Older formats, refused by name: 1 (before from_files saved its epoch for
  // shuffle_files), 2 (before each stage saved its configuration beside its position).
  static constexpr std::uint64_t magic_v1 = 0x3174537972726566ull;  // "ferrySt1"
  static constexpr std::uint64_t magic_v2 = 0x3274537972726566ull;  // "ferrySt2"

  // The checkpoint bytes (layout above), for from_bytes() to read back.
  std::string to_bytes() const {
    std::string out((words.size() + 2) * 8, '\0');
    auto put = [&](std::size_t i, std::uint64_t w) {
      for (std::size_t b = 0; b < 8; ++b) out[i * 8 + b] = static_cast<char>(w >> (8 * b));
    };
    put(0, magic);
    for (std::size_t i = 0; i < words.size(); ++i) put(i + 1, words[i]);
    put(words.size() + 1, check(words));
    return out;
  }
  // Throws config_error naming what is wrong: not a whole number of words, not a ferry
  // state (magic), or a check word that does not match (cut short or damaged).
  static pipeline_state from_bytes(std::string_view bytes) {
    auto fail = [&](const std::string& why) {
      return config_error("pipeline_state::from_bytes: " + std::to_string(bytes.size()) + " bytes: " + why);
    };
    if (bytes.size() % 8 != 0) throw fail("not a multiple of 8");
    if (bytes.size() < 16) throw fail("too short for a ferry pipeline state (magic and check word)");
    auto get = [&](std::size_t i) {
      std::uint64_t w = 0;
      for (std::size_t b = 0; b < 8; ++b)
        w |= std::uint64_t(static_cast<unsigned char>(bytes[i * 8 + b])) << (8 * b);
      return w;
    };
    if (get(0) == magic_v1)
      throw fail("a state of an older ferry (\"ferrySt1\"): from_files and interleave save their epoch "
                 "since; it cannot be restored");
    if (get(0) == magic_v2)
      throw fail("a state of an older ferry (\"ferrySt2\"): stages save their configuration (seed, shard, "
                 "files) since, so that a checkpoint is never restored into another; it cannot be restored");
    if (get(0) != magic) throw fail("not a ferry pipeline state (no \"ferrySt3\" at offset 0)");
    const std::size_t n = bytes.size() / 8 - 2;
    pipeline_state s;
    s.words.resize(n);
    for (std::size_t i = 0; i < n; ++i) s.words[i] = get(i + 1);
    if (get(n + 1) != check(s.words))
      throw fail("the check word at offset " + std::to_string((n + 1) * 8) +
                 " does not match the words before it (the state was cut short or damaged)");
    return s;
  }
  // Equal words: the same position of the same pipeline shape.
  friend bool operator==(const pipeline_state&, const pipeline_state&) = default;

 private:
  // The word count, then each word, chained through SplitMix64 as mix_seed does: each step
  // is a bijection of the running hash, so any one changed word changes the check.
  static std::uint64_t check(const std::vector<std::uint64_t>& ws) {
    std::uint64_t h = detail::mix_seed({ws.size()});
    for (std::uint64_t w : ws) h = detail::splitmix64(h ^ w)();
    return h;
  }
};

namespace detail {
// FNV-1a of a stage name: the tag that catches a state restored into the wrong pipeline.
constexpr std::uint64_t stage_tag(std::string_view name) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return h;
}
}  // namespace detail

// What a stage's save() writes through: appends words to a pipeline_state.
class state_writer {
 public:
  // Appends to s, which must outlive the writer.
  explicit state_writer(pipeline_state& s) : s_(&s) {}
  // Appends the tag of stage `stage` (a hash of its name), which restore() expects.
  void tag(std::string_view stage) { s_->words.push_back(detail::stage_tag(stage)); }
  // Appends one word.
  void put(std::uint64_t w) { s_->words.push_back(w); }
  // Appends several words (a saved sub-state, e.g. a producer's upstream position).
  void put_words(const std::vector<std::uint64_t>& ws) {
    s_->words.insert(s_->words.end(), ws.begin(), ws.end());
  }

 private:
  pipeline_state* s_;
};

// What a stage's restore() reads through: the words of a pipeline_state, in the order
// save() wrote them.
class state_reader {
 public:
  // Reads s from its first word; s must outlive the reader.
  explicit state_reader(const pipeline_state& s) : s_(&s) {}
  // Throws config_error when the next word is not `stage`'s tag.
  void expect(std::string_view stage) {
    if (pos_ >= s_->words.size())
      throw config_error("restore_state: the state ends before stage '" + std::string(stage) +
                         "' (saved from a pipeline of another shape, with fewer stages?)");
    if (get_raw() != detail::stage_tag(stage))
      throw config_error("restore_state: the state was saved from a pipeline of another shape "
                         "(expected stage '" + std::string(stage) + "' at word " +
                         std::to_string(pos_ - 1) + ")");
  }
  // The next word; throws config_error when the state has no more (another pipeline shape).
  std::uint64_t get() { return get_raw(); }
  // The next word as a count a stage of parameter n can have reached (take(n) took at most
  // n elements); over n, config_error "restore_state: take: the state took 8 elements,
  // more than this take(5) hands on (saved from a take of a larger n?)".
  std::uint64_t get_count(std::uint64_t n, std::string_view stage, std::string_view did,
                          std::string_view does) {
    const std::uint64_t v = get_raw();
    if (v > n)
      throw config_error("restore_state: " + std::string(stage) + ": the state " + std::string(did) + " " +
                         std::to_string(v) + " elements, more than this " + std::string(stage) + "(" +
                         std::to_string(n) + ") " + std::string(does) + " (saved from a " +
                         std::string(stage) + " of a larger n?)");
    return v;
  }
  // The next word as a flag (0 or 1); anything else is a damaged state: config_error
  // "restore_state: repeat: a damaged state (a flag of 7 where 0 or 1 belongs)".
  bool get_flag(std::string_view stage) {
    const std::uint64_t v = get_raw();
    if (v > 1)
      throw config_error("restore_state: " + std::string(stage) + ": a damaged state (a flag of " +
                         std::to_string(v) + " where 0 or 1 belongs)");
    return v == 1;
  }
  // Whether every word was read (restore_state refuses a state longer than the pipeline's).
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

namespace detail {
// Asks `up` to save into `scratch` (cleared; its capacity kept), and throws what its
// save() throws. For a stage that writes an anchor taken earlier: the anchor may predate
// the upstream's refusal (an unordered map saves only before its first next()), so the
// upstream is asked again, and an inexact checkpoint is refused, not written.
template <class Up>
void ask_save(const Up& up, pipeline_state& scratch) {
  scratch.words.clear();
  state_writer w(scratch);
  up.save(w);
}
}  // namespace detail

}  // namespace ferry
