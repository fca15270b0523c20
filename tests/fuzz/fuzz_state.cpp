// libFuzzer harness for checkpoints: the input is a pipeline_state's words (8 bytes each,
// little-endian), restored into pipelines of several shapes, which then hand out a few
// elements. A state is not trusted: its check word is public, so anyone can make one
// (here it is not even asked for). ferry::error is the expected outcome of a bad state; a
// crash, a sanitizer report, a hang past libFuzzer's -timeout or a huge allocation is a bug.
// Every count a stage restores must be checked against what it can be (a re-read of 2^62
// elements over repeat() would never return).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ferry/ferry.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/interleave.hpp"
#include "ferry/sources/from_files.hpp"

namespace {

// A small TFRecord file (three records), written once.
const std::string& records_path() {
  static const std::string path = [] {
    const int fd = ::memfd_create("ferry-fuzz-state", 0);
    auto le = [](std::uint64_t v, int n) {
      std::string s;
      for (int i = 0; i < n; ++i) s += static_cast<char>(v >> (8 * i));
      return s;
    };
    namespace c = ferry::detail::crc32c;
    std::string file;
    for (std::string data : {"alpha", "bravo!", "charlie.."}) {
      const std::string len = le(data.size(), 8);
      file += len + le(c::mask(c::value(len.data(), 8)), 4) + data + le(c::mask(c::value(data.data(), data.size())), 4);
    }
    if (fd >= 0 && ::write(fd, file.data(), file.size()) != static_cast<ssize_t>(file.size())) return std::string();
    return "/proc/self/fd/" + std::to_string(fd);
  }();
  return path;
}

// Restores st into p and pulls at most `pulls` elements (errors included). Throws nothing.
template <class P>
void restore_and_pull(P&& p, const ferry::pipeline_state& st, int pulls = 40) {
  try {
    ferry::restore_state(p, st);
  } catch (const ferry::error&) {
    return;  // refused: the expected outcome for most inputs
  }
  for (int i = 0; i < pulls; ++i) {
    try {
      if (!p.next()) return;
    } catch (const ferry::error&) {
    }
  }
  try {
    (void)ferry::save_state(p);  // and the restored position saves again
  } catch (const ferry::error&) {
  }
}

std::uint64_t twice(std::uint64_t x) { return x * 2; }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  ferry::pipeline_state st;
  st.words.resize(size / 8);
  if (!st.words.empty()) std::memcpy(st.words.data(), data, st.words.size() * 8);
  auto gen = [](std::uint64_t n) { return ferry::from_generator(n, [](std::uint64_t i) { return i * 3; }); };

  restore_and_pull(gen(1000) | ferry::shuffle(16, 3) | ferry::map(twice) | ferry::batch(8), st);
  // An infinite upstream: a restored count that is not checked never returns.
  restore_and_pull(gen(100) | ferry::repeat() | ferry::map(twice), st);
  restore_and_pull(gen(100) | ferry::repeat() | ferry::map(twice, {.workers = 2, .window = 64}) | ferry::prefetch(2), st);
  restore_and_pull(gen(100) | ferry::repeat() | ferry::skip(7) | ferry::take(30) |
                       ferry::flat_map([](std::uint64_t x) { return std::vector<std::uint64_t>(x % 4, x); }),
                   st);
  restore_and_pull(gen(100) | ferry::repeat(5) | ferry::shard(3, 1) | ferry::filter([](std::uint64_t x) { return x % 2; }),
                   st);
  restore_and_pull(ferry::concatenate(gen(10), gen(20)) | ferry::shuffle(4, 1), st);
  restore_and_pull(ferry::zip(gen(50), gen(50)), st);
  restore_and_pull(ferry::sample_from({.seed = 2}, gen(30), gen(40) | ferry::repeat(2)), st);
  restore_and_pull(gen(64) | ferry::batch(8) | ferry::distribute(ferry::host_replicas{2}), st);
  restore_and_pull(ferry::from_range(std::vector<int>(20, 1)) | ferry::cache(), st);
  // interleave(fn)'s slot table: its re-read count and each slot's distance.
  restore_and_pull(gen(100) | ferry::repeat() |
                       ferry::interleave([](std::uint64_t x) { return ferry::from_generator(x % 4, [](std::uint64_t j) { return j; }); },
                                         {.workers = 0, .cycle = 2}),
                   st);
  if (!records_path().empty()) {
    restore_and_pull(ferry::from_files({records_path()}, ferry::tfrecord{}) | ferry::batch(2), st);
    restore_and_pull(ferry::from_files({records_path(), records_path()}, ferry::tfrecord{}) |
                         ferry::interleave(2, {.workers = 1, .block = 2}),
                     st);
  }
  return 0;
}
