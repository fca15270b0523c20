// The protocol table of docs/architecture.md, generated from the code: what each stage and
// source has (by concept, for a resumable, rewindable upstream with the fast paths), which
// stages pass batch() sizes on to distribute, and which run threads of their own. Fails
// when the table in the docs differs (printing the table the code gives), or when a stage
// or source header has no row. (The threads column is written here, by hand: which
// threads a stage runs is its header's to say.)
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <unistd.h>
#include <sstream>
#include <string>
#include <vector>

#include "ferry/collective/communicator.hpp"
#include "ferry/ferry.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/sources/global_shuffle.hpp"
#include "ferry/stages/cache_on_device.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/interleave.hpp"
#include "ferry/stats.hpp"

namespace {

namespace fs = std::filesystem;
using u64 = std::uint64_t;

fs::path source_root() {
  const char* d = std::getenv("FERRY_TEST_DATA");  // <root>/tests/data
  return d ? fs::path(d).parent_path().parent_path() : fs::path(".");
}

auto up() { return ferry::from_range(std::vector<u64>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}); }
auto up_batches() { return up() | ferry::batch(4); }

struct file_fixture {
  fs::path dir = fs::temp_directory_path() / ("ferry_protocol_" + std::to_string(::getpid()));
  std::string path;
  file_fixture() {
    fs::create_directories(dir);
    path = (dir / "lines.txt").string();
    std::ofstream(path) << "a\nbb\nccc\n";
  }
  ~file_fixture() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

const char* yes(bool b) { return b ? "yes" : "-"; }

// One row: `p` is the stage over a rich upstream; `over_batches` the same stage over
// batch(4), to see whether batch()'s size reaches past it (nullptr-like: "-").
template <class P, class B>
std::string row(const char* name, const char* header, P p, B over_batches, const char* threads) {
  using T = std::remove_cvref_t<P>;
  std::string batch_size = "-";
  if constexpr (!std::is_same_v<B, std::nullptr_t>) {
    // batch(4) upstream: its 4 comes through; another size is the stage's own (batch()).
    if constexpr (ferry::sized_batches<B>) batch_size = over_batches.batch_size() == 4 ? "passed on" : "its own";
  }
  std::ostringstream o;
  o << "| " << name << " | `" << header << "` | " << yes(ferry::rewindable_source<T>) << " | "
    << yes(ferry::resumable_source<T>) << " | " << yes(ferry::bulk_source<T>) << " | "
    << yes(ferry::borrowing_source<T>) << " | " << yes(ferry::view_source<T>) << " | " << batch_size << " | "
    << threads << " |";
  (void)p;
  return o.str();
}

std::vector<std::string> table_from_code() {
  static file_fixture f;
  auto files = [&] { return ferry::from_files({f.path}, ferry::text_lines{}); };
  std::vector<std::string> t;
  t.push_back("| stage | header | rewind | save | next_bulk | next_borrowed | next_view | batch_size | threads |");
  t.push_back("|---|---|---|---|---|---|---|---|---|");
  t.push_back(row("from_range", "sources/from_range.hpp", up(), nullptr, "-"));
  t.push_back(row("from_generator", "sources/from_generator.hpp", ferry::from_generator(3, [](u64 i) { return i; }),
                  nullptr, "-"));
  t.push_back(row("from_files", "sources/from_files.hpp", files(), nullptr, "read-ahead I/O"));
  t.push_back(row("global_shuffle", "sources/global_shuffle.hpp",
                  ferry::global_shuffle(std::vector<u64>(8, 1), {.global_batch = 2}), nullptr, "-"));
  t.push_back(row("filter", "stages/filter.hpp", up() | ferry::filter([](u64) { return true; }),
                  up_batches() | ferry::filter([](const ferry::batch_of<u64>&) { return true; }), "-"));
  t.push_back(row("take", "stages/take.hpp", up() | ferry::take(3), up_batches() | ferry::take(3), "-"));
  t.push_back(row("skip", "stages/skip.hpp", up() | ferry::skip(3), up_batches() | ferry::skip(3), "-"));
  t.push_back(row("shard", "stages/shard.hpp", up() | ferry::shard(2, 0), up_batches() | ferry::shard(2, 0), "-"));
  t.push_back(row("repeat", "stages/repeat.hpp", up() | ferry::repeat(2), up_batches() | ferry::repeat(2), "-"));
  t.push_back(row("shuffle", "stages/shuffle.hpp", up() | ferry::shuffle(4, 1), up_batches() | ferry::shuffle(4, 1), "-"));
  t.push_back(row("map", "stages/map.hpp", up() | ferry::map([](u64 x) { return x; }),
                  up_batches() | ferry::map([](ferry::batch_of<u64> b) { return b; }), "workers > 1"));
  t.push_back(row("flat_map", "stages/flat_map.hpp", up() | ferry::flat_map([](u64 x) { return std::vector<u64>{x}; }),
                  nullptr, "-"));
  t.push_back(row("batch", "stages/batch.hpp", up() | ferry::batch(4), up() | ferry::batch(5), "-"));
  {
    auto seqs = [] { return up() | ferry::map([](u64 x) { return std::vector<u64>(x % 3, x); }); };
    t.push_back(row("padded_batch", "stages/padded_batch.hpp", seqs() | ferry::padded_batch(4),
                    seqs() | ferry::padded_batch(5), "-"));
    auto len = [](const std::vector<u64>& v) { return v.size(); };
    t.push_back(row("bucket_by_sequence_length", "stages/bucket_by_sequence_length.hpp",
                    seqs() | ferry::bucket_by_sequence_length(len, {2}, {2, 3}),
                    seqs() | ferry::bucket_by_sequence_length(len, {2}, {2, 3}), "-"));
    t.push_back(row("pack", "stages/pack.hpp", seqs() | ferry::pack(3, 2), seqs() | ferry::pack(3, 2), "-"));
    static ferry::solo_communicator solo;
    auto steps = [] { return up_batches() | ferry::distribute(ferry::host_replicas{2}); };
    t.push_back(row("lockstep", "stages/lockstep.hpp", steps() | ferry::lockstep(solo, ferry::step_policy::pad),
                    nullptr, "-"));
    t.push_back(row("cache_on_device", "stages/cache_on_device.hpp", steps() | ferry::cache_on_device(), nullptr, "-"));
  }
  t.push_back(row("prefetch", "stages/prefetch.hpp", up() | ferry::prefetch(2), up_batches() | ferry::prefetch(2), "one"));
  t.push_back(row("cache", "stages/cache.hpp", up() | ferry::cache(), nullptr, "-"));
  t.push_back(row("concatenate", "stages/concatenate.hpp", ferry::concatenate(up(), up()),
                  ferry::concatenate(up_batches(), up_batches()), "-"));
  t.push_back(row("zip", "stages/zip.hpp", ferry::zip(up(), up()), nullptr, "-"));
  t.push_back(row("sample_from", "stages/sample_from.hpp", ferry::sample_from({}, up(), up()), nullptr, "-"));
  t.push_back(row("interleave", "stages/interleave.hpp", files() | ferry::interleave(2), nullptr, "workers"));
  t.push_back(row("distribute", "stages/distribute.hpp", up_batches() | ferry::distribute(ferry::host_replicas{2}),
                  nullptr, "staging_thread"));
  return t;
}

std::vector<std::string> table_in_docs() {
  std::ifstream in(source_root() / "docs" / "architecture.md");
  REQUIRE(in);
  std::vector<std::string> rows;
  std::string line;
  bool inside = false;
  while (std::getline(in, line)) {
    if (line.find("<!-- protocol-table:begin -->") != std::string::npos) {
      inside = true;
      continue;
    }
    if (line.find("<!-- protocol-table:end -->") != std::string::npos) break;
    if (inside && !line.empty()) rows.push_back(line);
  }
  return rows;
}

}  // namespace

TEST_CASE("docs/architecture.md's protocol table is the one the code gives") {
  const auto code = table_from_code(), docs = table_in_docs();
  std::string printed;
  for (const auto& r : code) printed += r + "\n";
  CHECK_MESSAGE(docs == code, "the table the code gives (paste it between the protocol-table markers):\n" << printed);
}

TEST_CASE("every stage and source header has a row in the protocol table") {
  const auto docs = table_in_docs();
  std::string all;
  for (const auto& r : docs) all += r + "\n";
  const fs::path inc = source_root() / "include" / "ferry";
  std::vector<std::string> headers;
  for (const auto& e : fs::directory_iterator(inc / "stages"))
    if (e.path().extension() == ".hpp") headers.push_back("stages/" + e.path().filename().string());
  for (const auto& e : fs::directory_iterator(inc / "sources"))
    if (e.path().filename().string().rfind("from_", 0) == 0) headers.push_back("sources/" + e.path().filename().string());
  REQUIRE(headers.size() >= 19);
  for (const auto& h : headers) {
    CAPTURE(h);
    CHECK(all.find("`" + h + "`") != std::string::npos);
  }
}
