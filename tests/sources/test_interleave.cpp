// interleave: the order against a naive oracle for any worker count, exact resume,
// prompt shutdown mid-epoch, errors at their place in the order.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <iterator>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "common/doubles.hpp"
#include "ferry/ferry.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/interleave.hpp"
#include "sources/helpers.hpp"

using namespace src_test;
using namespace std::chrono_literals;

namespace {
struct dataset {
  temp_dir t;
  std::vector<std::string> files;
  std::vector<std::vector<std::string>> recs;  // per file
  dataset(int nfiles, std::uint64_t seed, bool gz = false) {
    std::mt19937_64 g(seed);
    for (int f = 0; f < nfiles; ++f) {
      std::string s;
      recs.emplace_back();
      const int n = static_cast<int>(g() % 30);
      for (int i = 0; i < n; ++i) {
        recs.back().push_back(std::to_string(f) + "/" + std::to_string(i) + ":" + random_bytes(g, g() % 200));
        s += tfrecord_of(recs.back().back());
      }
      files.push_back(t / ("i" + std::to_string(f) + (gz ? ".tfrecord.gz" : ".tfrecord")));
      gz ? write_gzip(files.back(), s) : write_file(files.back(), s);
    }
  }
  // The oracle: slot s reads files s, s+cycle, ... back to back; `block` records per turn.
  std::vector<std::string> expected(std::size_t cycle, std::size_t block) const {
    const std::size_t k = std::min(cycle, files.size());
    std::vector<std::vector<std::string>> slot(k);
    for (std::size_t j = 0; j < files.size(); ++j)
      for (auto& r : recs[j]) slot[j % k].push_back(r);
    std::vector<std::size_t> at(k, 0);
    std::vector<std::string> out;
    bool any = true;
    while (any) {
      any = false;
      for (std::size_t s = 0; s < k; ++s)
        for (std::size_t b = 0; b < block && at[s] < slot[s].size(); ++b) {
          out.push_back(slot[s][at[s]++]);
          any = true;
        }
    }
    return out;
  }
};
std::vector<std::string> drain(auto& src) {
  std::vector<std::string> out;
  while (auto r = src.next()) out.emplace_back(r->str());
  return out;
}
}  // namespace

TEST_CASE("interleave: deterministic order equal to the oracle, any workers" * doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    dataset d(static_cast<int>(seed * 2 + 1), seed, seed % 3 == 0);
    for (std::size_t cycle : {1, 2, 3, 5, 16})
      for (std::size_t block : {1, 4})
        for (std::size_t workers : {0, 1, 3}) {
          auto src = ferry::from_files(d.files, ferry::tfrecord{}, {.chunk_bytes = 700}) |
                     ferry::interleave(cycle, {.workers = workers, .block = block, .buffer = 5});
          CHECK(drain(src) == d.expected(cycle, block));
          CHECK(!src.next());
          src.rewind();
          CHECK(drain(src) == d.expected(cycle, block));
        }
  }
  CHECK_THROWS_AS(ferry::interleave(0), ferry::config_error);
  CHECK_THROWS_AS(ferry::interleave(2, {.block = 0}), ferry::config_error);
}

TEST_CASE("interleave: save/restore at every position is exact" * doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  dataset d(5, 99);
  const auto all = d.expected(3, 2);
  for (std::size_t workers : {0, 2}) {
    for (std::size_t k = 0; k <= all.size(); k += 3) {
      auto a = ferry::from_files(d.files, ferry::tfrecord{}, {.chunk_bytes = 300}) |
               ferry::interleave(3, {.workers = workers, .block = 2});
      for (std::size_t i = 0; i < k; ++i) a.next();
      auto st = ferry::save_state(a);
      auto b = ferry::from_files(d.files, ferry::tfrecord{}, {.chunk_bytes = 300}) |
               ferry::interleave(3, {.workers = workers, .block = 2});
      ferry::restore_state(b, st);
      CHECK(drain(b) == std::vector<std::string>(all.begin() + static_cast<long>(k), all.end()));
    }
  }
}

namespace {
// Times a destructor: how long `p.reset()` takes.
double seconds_to_destroy(auto& p) {
  const auto t0 = std::chrono::steady_clock::now();
  p.reset();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

TEST_CASE("interleave: destruction mid-epoch joins promptly" * doctest::timeout(30)) {
  ferry_test::watchdog wd(30s);
  dataset d(8, 5);
  using src_t = decltype(ferry::from_files(d.files, ferry::tfrecord{}) | ferry::interleave(4));
  double worst = 0;
  for (int i = 0; i < 20; ++i) {
    std::optional<src_t> src(ferry::from_files(d.files, ferry::tfrecord{}) |
                             ferry::interleave(4, {.workers = 4, .buffer = 2}));
    for (int k = 0; k < i; ++k) src->next();
    // Every 5th time, time for the readers to fill their buffers and park. Not a
    // synchronisation: parked or mid-read, destruction must be prompt; this only makes
    // the parked case likely as well.
    if (i % 5 == 4) std::this_thread::sleep_for(5ms);
    worst = std::max(worst, seconds_to_destroy(src));
  }
  CHECK_MESSAGE(worst < 2.0, "the slowest destruction took " << worst << " s");
}

TEST_CASE("interleave: destruction with one reader in read(2) on a slow pipe and one on a full buffer: under 2 s" *
          doctest::timeout(30)) {
  ferry_test::watchdog wd(30s);
  temp_dir t;
  // cycle 2, two workers: worker 0 reads slot 0, a FIFO fed a line every 20 ms (it spends
  // its time blocked in read(2)); worker 1 reads slot 1, a file of 2000 lines, and waits
  // on its full buffer. The destructor must wake the one and wait out the other's read:
  // a line away, not the watchdog.
  const std::string fifo = t / "slow.fifo", file = t / "big.txt";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  std::string big;
  for (int i = 0; i < 2000; ++i) big += "line " + std::to_string(i) + "\n";
  write_file(file, big);
  // Feeds the FIFO until destroyed (also when a REQUIRE below throws). SIGPIPE is ignored
  // meanwhile: the reader closes the pipe first.
  struct pipe_writer {
    std::string path;
    std::atomic<bool> stop{false};
    void (*old_pipe)(int) = std::signal(SIGPIPE, SIG_IGN);
    std::thread th{[this] {
      int fd = -1;
      while (!stop && fd < 0) {  // non-blocking open: fails until the reader has opened it
        fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
        if (fd < 0) std::this_thread::sleep_for(2ms);
      }
      for (int i = 0; !stop; ++i) {
        const std::string l = "slow " + std::to_string(i) + "\n";
        if (::write(fd, l.data(), l.size()) < 0 && errno == EPIPE) break;
        std::this_thread::sleep_for(20ms);
      }
      if (fd >= 0) ::close(fd);
    }};
    ~pipe_writer() {
      stop = true;
      th.join();
      std::signal(SIGPIPE, old_pipe);
    }
  } writer{fifo};
  {
    using src_t = decltype(ferry::from_files({fifo, file}, ferry::text_lines{}) | ferry::interleave(2));
    std::optional<src_t> src(ferry::from_files({fifo, file}, ferry::text_lines{}) |
                             ferry::interleave(2, {.workers = 2, .buffer = 4}));
    for (int k = 0; k < 6; ++k) {  // alternating: "slow 0", "line 0", "slow 1", ...
      auto r = src->next();
      REQUIRE(r);
      CHECK(r->str() == (k % 2 ? "line " : "slow ") + std::to_string(k / 2));
    }
    // Time for worker 1 to fill its buffer while worker 0 waits in read(2). Not a
    // synchronisation: the bound below must hold in whatever state they are.
    std::this_thread::sleep_for(50ms);
    const double took = seconds_to_destroy(src);
    CHECK_MESSAGE(took < 2.0, "destruction took " << took << " s");
  }
}

TEST_CASE("interleave: destruction with a reader on a FIFO that no writer opened, or one that never writes: "
          "under 2 s" * doctest::timeout(30)) {
  ferry_test::watchdog wd(30s);
  temp_dir t;
  const std::string file = t / "lines.txt";
  write_file(file, "a\nb\nc\n");
  for (bool writer : {false, true}) {
    CAPTURE(writer);
    const std::string fifo = t / (writer ? "silent.fifo" : "lonely.fifo");
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    // A writer that opens the FIFO and never writes (the read then waits for data rather
    // than for a writer); without one, opening it once blocked the reader, and the
    // destructor with it, forever.
    int wfd = -1;
    std::thread opener;
    if (writer)
      opener = std::thread([&] {
        for (int i = 0; i < 2000 && wfd < 0; ++i) {
          wfd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
          if (wfd < 0) std::this_thread::sleep_for(1ms);
        }
      });
    {
      using src_t = decltype(ferry::from_files({file, fifo}, ferry::text_lines{}) | ferry::interleave(2));
      std::optional<src_t> src(ferry::from_files({file, fifo}, ferry::text_lines{}) | ferry::interleave(2, {.workers = 2}));
      auto r = src->next();  // slot 0, the file; slot 1's reader waits on the FIFO
      REQUIRE(r);
      CHECK(r->str() == "a");
      if (writer) opener.join();
      std::this_thread::sleep_for(30ms);  // time for the reader to reach its wait (not a synchronisation)
      const double took = seconds_to_destroy(src);
      CHECK_MESSAGE(took < 2.0, "destruction took " << took << " s");
    }
    if (wfd >= 0) ::close(wfd);
  }
}

TEST_CASE("interleave: restore_state refuses a state of other files, cycle or block, or with a bad slot" *
          doctest::timeout(30)) {
  ferry_test::watchdog wd(30s);
  dataset d(5, 41);
  for (std::size_t workers : {0, 2}) {
    INFO("workers " << workers);
    auto make = [&](const std::vector<std::string>& files, std::size_t cycle, std::size_t block) {
      return ferry::from_files(files, ferry::tfrecord{}) | ferry::interleave(cycle, {.workers = workers, .block = block});
    };
    auto a = make(d.files, 3, 2);
    for (int i = 0; i < 7; ++i) REQUIRE(a.next());
    const ferry::pipeline_state st = ferry::save_state(a);
    const auto rest = drain(a);
    std::vector<std::string> reordered = d.files;
    std::swap(reordered[0], reordered[1]);
    // Each difference named: the files by from_files' checkpoint (which comes first), the
    // cycle and block by interleave's.
    const std::string files_differ = "from_files: the state was saved with another file list";
    for (auto [files, cycle, block, why] :
         {std::tuple{std::vector<std::string>(d.files.begin(), d.files.end() - 1), 3, 2, files_differ},
          std::tuple{reordered, 3, 2, files_differ},
          std::tuple{d.files, 2, 2, std::string("interleave: the state was saved with cycle = 3, this pipeline has cycle = 2")},
          std::tuple{d.files, 3, 1, std::string("interleave: the state was saved with block = 2, this pipeline has block = 1")}}) {
      INFO(files.size() << " files, cycle " << cycle << ", block " << block);
      auto b = make(files, static_cast<std::size_t>(cycle), static_cast<std::size_t>(block));
      CHECK_THROWS_WITH_AS(ferry::restore_state(b, st), doctest::Contains(why.c_str()), ferry::config_error);
    }
    // The same files, cycle and block: exact.
    auto same = make(d.files, 3, 2);
    ferry::restore_state(same, st);
    CHECK(drain(same) == rest);
    // interleave's words come last: after from_files' state and its own tag, cycle and
    // block, the slot to read next (`turn`), the records taken in this turn, then 5 words
    // per slot (active, file ordinal, open, offset, records).
    REQUIRE(st.words.size() > 2 + 3 * 5);
    const std::size_t turn = st.words.size() - 3 * 5 - 2, taken = turn + 1;
    REQUIRE(st.words[turn - 3] == ferry::detail::stage_tag("interleave"));
    REQUIRE(st.words[turn] < 3);
    REQUIRE(st.words[taken] < 2);
    for (auto [word, value] : {std::pair<std::size_t, std::uint64_t>{turn, 3}, {turn, 4}, {turn, ~0ull}, {taken, 2},
                               {taken, ~0ull}}) {
      ferry::pipeline_state bad = st;
      bad.words[word] = value;
      auto b = make(d.files, 3, 2);
      CHECK_THROWS_WITH_AS(ferry::restore_state(b, bad), doctest::Contains("bad slot"), ferry::config_error);
      // from_files took the state's words, interleave refused: next() says so until a rewind
      CHECK_THROWS_WITH_AS(b.next(), doctest::Contains("failed part way"), ferry::config_error);
      b.rewind();  // which starts the epoch afresh
      CHECK(drain(b) == d.expected(3, 2));
    }
    // The turn at a slot that has ended while another has not (word taken + 1 + 5 j: slot j active).
    {
      ferry::pipeline_state bad = st;
      bad.words[taken + 1 + 5 * bad.words[turn]] = 0;
      auto b = make(d.files, 3, 2);
      CHECK_THROWS_WITH_AS(ferry::restore_state(b, bad), doctest::Contains("bad slot"), ferry::config_error);
      CHECK_THROWS_AS(b.next(), ferry::config_error);
      b.rewind();
      CHECK(drain(b) == d.expected(3, 2));
    }
    // A slot past its last file (word taken + 2 + 5 j: slot j's file ordinal; slot 0 has 2 files).
    {
      ferry::pipeline_state bad = st;
      bad.words[taken + 2] = 3;
      auto b = make(d.files, 3, 2);
      CHECK_THROWS_WITH_AS(ferry::restore_state(b, bad), doctest::Contains("slot 0 is at file 3 of 2"),
                           ferry::config_error);
      CHECK_THROWS_AS(b.next(), ferry::config_error);
      b.rewind();
      CHECK(drain(b) == d.expected(3, 2));
    }
    // Cut short, or another stage's state.
    ferry::pipeline_state cut = st;
    cut.words.pop_back();
    auto b = make(d.files, 3, 2);
    CHECK_THROWS_WITH_AS(ferry::restore_state(b, cut), doctest::Contains("too short"), ferry::config_error);
    CHECK_THROWS_AS(b.next(), ferry::config_error);
    ferry::restore_state(b, st);  // the state itself, after the refused one: exact
    CHECK(drain(b) == rest);
    b.rewind();
    CHECK(drain(b) == d.expected(3, 2));
    auto plain = ferry::from_files(d.files, ferry::tfrecord{});
    CHECK_THROWS_WITH_AS(ferry::restore_state(b, ferry::save_state(plain)), doctest::Contains("another shape"),
                         ferry::config_error);
  }
}

TEST_CASE("interleave: errors at their place; skip counts exactly" * doctest::timeout(30)) {
  ferry_test::watchdog wd(30s);
  dataset d(4, 8);
  std::string bad = tfrecord_of("good-before") + tfrecord_of("bad");
  bad[bad.size() - 2] ^= 1;  // data CRC of the second record
  bad += tfrecord_of("good-after");
  write_file(d.files[1], bad);
  d.recs[1] = {"good-before", "good-after"};
  auto want = d.expected(2, 1);
  for (std::size_t workers : {0, 2}) {
    auto src = ferry::from_files(d.files, ferry::tfrecord{}) | ferry::interleave(2, {.workers = workers});
    std::vector<std::string> got;
    int errors = 0;
    for (;;) {
      try {
        auto r = src.next();
        if (!r) break;
        got.emplace_back(r->str());
      } catch (const ferry::format_error& e) {
        CHECK(e.path() == d.files[1]);
        CHECK(e.offset() == 12 + 11 + 4);
        ++errors;
      }
    }
    CHECK(errors == 1);
    CHECK(got == want);
    std::atomic<int> logged{0};
    auto sk = ferry::from_files(d.files, ferry::tfrecord{},
                                {.on_error = ferry::error_policy::skip,
                                 .on_skip = [&](const ferry::skipped_record&) { ++logged; }}) |
              ferry::interleave(2, {.workers = workers});
    CHECK(drain(sk) == want);
    CHECK(sk.skipped() == 1);
    CHECK(logged == 1);
  }
}

namespace {
// Everything a source gives until its end, as (file, text): a record's file and "=" + its
// bytes, or for a throw the file it names and "!" + what(). An on_skip below throws
// "on_skip:<path>@<offset>", so that error names its file too.
using outcome = std::vector<std::pair<std::string, std::string>>;
std::string file_named(const std::exception& e) {
  if (auto* f = dynamic_cast<const ferry::error*>(&e)) return ferry::detail::describe(*f).path;
  const std::string w = e.what();
  const std::size_t a = w.find("on_skip:"), b = w.rfind('@');
  return a == 0 && b != std::string::npos ? w.substr(8, b - 8) : std::string("?");
}
outcome outcomes(auto& src) {
  outcome out;
  for (int guard = 0; guard < 100000; ++guard) {
    try {
      auto r = src.next();
      if (!r) return out;
      out.emplace_back(std::string(r->origin().file), "=" + std::string(r->str()));
    } catch (const std::exception& e) {
      out.emplace_back(file_named(e), "!" + std::string(e.what()));
    }
  }
  FAIL("no end after 100000 entries");
  return out;
}
// The oracle: from_files' entries (records and errors, in file order) dealt out as
// interleave deals them: slot s reads files s, s + cycle, ...; `block` records per turn,
// an error taking no turn.
std::vector<std::string> interleaved(const outcome& file_order, const std::vector<std::string>& files,
                                     std::size_t cycle, std::size_t block) {
  const std::size_t k = std::min(cycle, files.size());
  std::vector<std::vector<std::string>> slot(k);
  for (const auto& [file, text] : file_order) {
    const auto j = static_cast<std::size_t>(std::find(files.begin(), files.end(), file) - files.begin());
    REQUIRE(j < files.size());
    slot[j % k].push_back(text);
  }
  std::vector<std::size_t> at(k, 0);
  std::vector<std::string> out;
  for (bool any = true; any;) {
    any = false;
    for (std::size_t s = 0; s < k; ++s)
      for (std::size_t b = 0; b < block && at[s] < slot[s].size(); ++at[s], any = true) {
        out.push_back(slot[s][at[s]]);
        if (out.back()[0] != '!') ++b;
      }
  }
  return out;
}
std::vector<std::string> texts(const outcome& o) {
  std::vector<std::string> t;
  for (const auto& e : o) t.push_back(e.second);
  return t;
}
std::size_t errors_in(const outcome& o) {
  return static_cast<std::size_t>(std::count_if(o.begin(), o.end(), [](const auto& e) { return e.second[0] == '!'; }));
}
}  // namespace

TEST_CASE("interleave: npy/IDX files of another row layout are refused as from_files refuses them, any workers" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  temp_dir t;
  // The audit's pair: <f4 (2, 3) and |u1 (4, 5), cycle 2. The second file is refused with
  // from_files' error, at its place; the first's rows all arrive.
  const std::string f4 = t / "a.npy", u1 = t / "b.npy";
  write_file(f4, npy_of("<f4", "(2, 3)", std::string(24, 'a')));
  write_file(u1, npy_of("|u1", "(4, 5)", std::string(20, 'b')));
  std::string want_what;
  try {
    auto plain = ferry::from_files({f4, u1}, ferry::npy{});
    while (plain.next()) {
    }
  } catch (const ferry::format_error& e) {
    CHECK(e.path() == u1);
    CHECK(e.offset() == 0);
    want_what = e.what();
  }
  REQUIRE(want_what.find("differ from the first file's") != std::string::npos);
  for (std::size_t workers : {0, 2}) {
    INFO("workers " << workers);
    auto src = ferry::from_files({f4, u1}, ferry::npy{}) | ferry::interleave(2, {.workers = workers});
    std::vector<std::size_t> sizes;
    int errors = 0;
    for (int guard = 0; guard < 100; ++guard) {
      try {
        auto r = src.next();
        if (!r) break;
        sizes.push_back(r->size());
      } catch (const ferry::format_error& e) {
        CHECK(e.path() == u1);
        CHECK(e.offset() == 0);
        CHECK(std::string(e.what()) == want_what);
        ++errors;
      }
    }
    CHECK(errors == 1);
    CHECK(sizes == std::vector<std::size_t>{12, 12});
  }

  // Random lists of npy files (two layouts; some missing, cut short or not npy at all) and
  // of IDX files: interleave gives from_files' records and errors, in the oracle's order.
  std::mt19937_64 g(21);
  for (int trial = 0; trial < 24; ++trial) {
    const bool use_idx = trial % 3 == 2;
    std::vector<std::string> files;
    const int n = 2 + static_cast<int>(g() % 6);
    for (int f = 0; f < n; ++f) {
      const std::string p = t / ("t" + std::to_string(trial) + "_" + std::to_string(f) + (use_idx ? ".idx" : ".npy"));
      files.push_back(p);
      const auto kind = g() % 8;
      const std::uint32_t rows = static_cast<std::uint32_t>(g() % 5);
      if (kind == 0) continue;  // missing
      std::string bytes;
      if (kind <= 2)  // the second layout
        bytes = use_idx ? idx_of(0x0D, {rows, 3}, random_bytes(g, rows * 12))
                        : npy_of("<i2", "(" + std::to_string(rows) + ", 2)", random_bytes(g, rows * 4));
      else
        bytes = use_idx ? idx_of(0x08, {rows, 4}, random_bytes(g, rows * 4))
                        : npy_of("|u1", "(" + std::to_string(rows) + ", 4)", random_bytes(g, rows * 4));
      if (kind == 3 && rows > 0) bytes.resize(bytes.size() - 1);  // the last row cut short
      if (kind == 4) bytes = "not an array file";
      write_file(p, bytes);
    }
    const ferry::file_format fmt = use_idx ? ferry::file_format(ferry::idx{}) : ferry::file_format(ferry::npy{});
    auto plain = ferry::from_files(files, fmt, {.chunk_bytes = 64});
    const outcome file_order = outcomes(plain);
    for (std::size_t cycle : {1, 2, 3})
      for (std::size_t block : {1, 2})
        for (std::size_t workers : {0, 1, 2}) {
          INFO("trial " << trial << ", cycle " << cycle << ", block " << block << ", workers " << workers);
          auto src = ferry::from_files(files, fmt, {.chunk_bytes = 64}) |
                     ferry::interleave(cycle, {.workers = workers, .block = block, .buffer = 2});
          CHECK(texts(outcomes(src)) == interleaved(file_order, files, cycle, block));
          std::atomic<std::size_t> logged{0};
          auto sk = ferry::from_files(files, fmt,
                                      {.on_error = ferry::error_policy::skip,
                                       .on_skip = [&](const ferry::skipped_record&) { ++logged; },
                                       .chunk_bytes = 64}) |
                    ferry::interleave(cycle, {.workers = workers, .block = block, .buffer = 2});
          const outcome skipped = outcomes(sk);
          CHECK(errors_in(skipped) == 0);
          // The exact sequence: from_files' records without its errors, dealt out as
          // interleave deals them (interleave.hpp: a skipped error takes no turn).
          outcome good;
          std::copy_if(file_order.begin(), file_order.end(), std::back_inserter(good),
                       [](const auto& e) { return e.second[0] != '!'; });
          CHECK(texts(skipped) == interleaved(good, files, cycle, block));
          CHECK(sk.skipped() == errors_in(file_order));
          CHECK(logged == errors_in(file_order));
        }
  }
}

TEST_CASE("interleave: a missing and a truncated file among several: from_files' errors at their place, no hang" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  dataset d(6, 31);
  const std::string missing = d.files[1], cut = d.files[4];
  std::filesystem::remove(missing);
  std::string tf;
  for (auto& r : d.recs[4]) tf += tfrecord_of(r);
  tf += tfrecord_of("the last record").substr(0, 15);  // ends inside its data
  write_file(cut, tf);
  auto plain = ferry::from_files(d.files, ferry::tfrecord{}, {.chunk_bytes = 300});
  const outcome file_order = outcomes(plain);
  REQUIRE(errors_in(file_order) == 2);
  for (std::size_t workers : {0, 2})
    for (std::size_t cycle : {2, 3, 4}) {
      INFO("workers " << workers << ", cycle " << cycle);
      auto src = ferry::from_files(d.files, ferry::tfrecord{}, {.chunk_bytes = 300}) |
                 ferry::interleave(cycle, {.workers = workers, .block = 2});
      std::vector<std::string> got;
      std::vector<std::pair<std::string, std::uint64_t>> errs;
      for (int guard = 0; guard < 10000; ++guard) {
        try {
          auto r = src.next();
          if (!r) break;
          got.push_back("=" + std::string(r->str()));
        } catch (const ferry::io_error& e) {
          errs.emplace_back(e.path(), e.offset());
          got.push_back("!" + std::string(e.what()));
        } catch (const ferry::format_error& e) {
          errs.emplace_back(e.path(), e.offset());
          got.push_back("!" + std::string(e.what()));
        }
      }
      CHECK(got == interleaved(file_order, d.files, cycle, 2));
      std::sort(errs.begin(), errs.end());
      CHECK(errs == std::vector<std::pair<std::string, std::uint64_t>>{{missing, 0}, {cut, tf.size() - 15}});
      // Destroyed after an error, mid-epoch, with the readers ahead: joins.
      auto early = ferry::from_files(d.files, ferry::tfrecord{}) | ferry::interleave(cycle, {.workers = workers});
      for (int k = 0; k < 3; ++k) try { early.next(); } catch (const ferry::error&) {}
    }
}

TEST_CASE("interleave: anything thrown while reading reaches next() as from_files throws it; nothing lost" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  // on_skip throwing on a worker used to escape the thread (std::terminate).
  dataset d(5, 12);
  std::string bad = tfrecord_of("before") + tfrecord_of("bad") + tfrecord_of("after");
  bad[tfrecord_of("before").size() + 12] ^= 1;  // the data of "bad": its data CRC fails
  write_file(d.files[2], bad);
  std::filesystem::remove(d.files[3]);
  const ferry::from_files_options o{
      .on_error = ferry::error_policy::skip,
      .on_skip = [](const ferry::skipped_record& r) {
        throw std::runtime_error("on_skip:" + r.path + "@" + std::to_string(r.offset));
      }};
  auto plain = ferry::from_files(d.files, ferry::tfrecord{}, o);
  const outcome file_order = outcomes(plain);
  REQUIRE(errors_in(file_order) == 2);
  CHECK(plain.skipped() == 2);
  for (std::size_t workers : {0, 1, 2})
    for (std::size_t cycle : {1, 2, 3}) {
      INFO("workers " << workers << ", cycle " << cycle);
      auto src = ferry::from_files(d.files, ferry::tfrecord{}, o) | ferry::interleave(cycle, {.workers = workers});
      int thrown = 0;
      std::vector<std::string> got;
      for (int guard = 0; guard < 10000; ++guard) {
        try {
          auto r = src.next();
          if (!r) break;
          got.push_back("=" + std::string(r->str()));
        } catch (const ferry::error&) {
          FAIL("a skipped error reached next()");
        } catch (const std::runtime_error& e) {  // the callback's own exception, not wrapped
          got.push_back("!" + std::string(e.what()));
          ++thrown;
        }
      }
      CHECK(thrown == 2);
      CHECK(got == interleaved(file_order, d.files, cycle, 1));
      CHECK(src.skipped() == 2);
      // And destroyed with the readers blocked behind a pending exception.
      auto early = ferry::from_files(d.files, ferry::tfrecord{}, o) |
                   ferry::interleave(cycle, {.workers = workers, .buffer = 1});
      try { early.next(); } catch (const std::runtime_error&) {}
    }
}

TEST_CASE("interleave: resuming into a compressed file now too short: the error names it, the slot goes on" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  temp_dir t;
  // cycle 2: slot 0 reads files 0 and 2, slot 1 reads file 1. Saved after 6 records, slot
  // 0 is inside file 0 at its fourth record (offset 57: records of 19 bytes).
  std::vector<std::string> files, recs[3];
  for (int f = 0; f < 3; ++f) {
    std::string s;
    for (int i = 0; i < 5; ++i) s += tfrecord_of(recs[f].emplace_back(std::to_string(f) + "r" + std::to_string(i)));
    files.push_back(t / ("z" + std::to_string(f) + ".tfrecord.gz"));
    write_gzip(files.back(), s);
  }
  for (std::size_t workers : {0, 2}) {
    INFO("workers " << workers);
    write_gzip(files[0], tfrecord_of(recs[0][0]) + tfrecord_of(recs[0][1]) + tfrecord_of(recs[0][2]) +
                             tfrecord_of(recs[0][3]) + tfrecord_of(recs[0][4]));
    auto a = ferry::from_files(files, ferry::tfrecord{}) | ferry::interleave(2, {.workers = workers});
    for (int i = 0; i < 6; ++i) REQUIRE(a.next());
    const auto st = ferry::save_state(a);
    write_gzip(files[0], tfrecord_of(recs[0][0]) + tfrecord_of(recs[0][1]));  // 38 bytes now
    auto b = ferry::from_files(files, ferry::tfrecord{}) | ferry::interleave(2, {.workers = workers});
    ferry::restore_state(b, st);
    std::vector<std::string> got;
    int errors = 0;
    for (int guard = 0; guard < 1000; ++guard) {
      try {
        auto r = b.next();
        if (!r) break;
        got.push_back("=" + std::string(r->str()));
      } catch (const ferry::format_error& e) {
        CHECK(e.path() == files[0]);
        CHECK(e.offset() == 38);
        CHECK(std::string(e.what()).find("cannot resume") != std::string::npos);
        ++errors;
      }
    }
    CHECK(errors == 1);
    // The error takes no turn: slot 0 goes on with file 2, then the turns alternate with
    // slot 1's last two records. Nothing of file 0 again.
    std::vector<std::string> want;
    for (const auto* r : {&recs[2][0], &recs[1][3], &recs[2][1], &recs[1][4], &recs[2][2], &recs[2][3], &recs[2][4]})
      want.push_back("=" + *r);
    CHECK(got == want);
  }
}

namespace {
// Everything next_borrowed gives until the end, as interleaved() writes it ("=" + bytes for
// a record, "!" + what() for a throw), asking for a random number of records (1..17) each
// call; every `save_every` calls (0: never) the state is saved and the rest read by a new
// source restored from it, as a job resumed from a checkpoint would.
template <class Make>
std::vector<std::string> borrowed_outcomes(const Make& make, std::uint64_t seed, int save_every) {
  std::mt19937_64 g(seed);
  auto src = std::make_unique<decltype(make())>(make());
  std::vector<std::string> out;
  ferry::borrowed_records b;
  for (int call = 1; call < 100000; ++call) {
    if (save_every > 0 && call % save_every == 0) {
      const ferry::pipeline_state st = ferry::save_state(*src);
      src = std::make_unique<decltype(make())>(make());
      ferry::restore_state(*src, st);
    }
    b.clear();
    const std::size_t max = 1 + g() % 17;
    std::size_t n = 0;
    std::string thrown;
    try {
      n = src->next_borrowed(b, max);
      CHECK(n == b.size());
      CHECK(n <= max);
    } catch (const std::exception& e) {
      thrown = "!" + std::string(e.what());
    }
    for (const auto& v : b.views) out.push_back("=" + std::string(reinterpret_cast<const char*>(v.data()), v.size()));
    if (!thrown.empty()) out.push_back(thrown);
    else if (n == 0) return out;
    // Each view's chunk is held by `b`, not by the source: the views stay valid after the
    // source moved on (checked above by reading them after next_borrowed returned).
    CHECK(b.owners.size() <= std::max<std::size_t>(b.views.size(), 1));
  }
  FAIL("no end after 100000 calls");
  return out;
}
}  // namespace

TEST_CASE("interleave: next_borrowed (batch's path) gives next()'s order and errors; any max, buffer, resume" *
          doctest::timeout(120)) {
  ferry_test::watchdog wd(120s);
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    dataset d(7, 70 + seed, seed == 2);
    // A CRC error in file 2 (raise: an error at its place) and file 5 cut inside a record.
    std::string bad = tfrecord_of("good-before") + tfrecord_of("bad") + tfrecord_of("good-after");
    bad[tfrecord_of("good-before").size() + 12] ^= 1;
    write_file(d.files[2], bad);
    std::string cut;
    for (auto& r : d.recs[5]) cut += tfrecord_of(r);
    write_file(d.files[5], cut + tfrecord_of("the last record").substr(0, 15));
    auto plain = ferry::from_files(d.files, ferry::tfrecord{}, {.chunk_bytes = 300});
    const outcome file_order = outcomes(plain);
    REQUIRE(errors_in(file_order) == 2);
    for (std::size_t cycle : {2, 3, 8})
      for (std::size_t block : {1, 3})
        for (std::size_t workers : {0, 1, 3})
          for (std::size_t buffer : {1, 5, 1024})
            for (int save_every : {0, 7}) {
              if (workers == 0 && buffer != 1024) continue;  // no read-ahead: buffer unused
              INFO("seed " << seed << ", cycle " << cycle << ", block " << block << ", workers " << workers
                           << ", buffer " << buffer << ", save every " << save_every);
              auto make = [&] {
                return ferry::from_files(d.files, ferry::tfrecord{}, {.chunk_bytes = 300}) |
                       ferry::interleave(cycle, {.workers = workers, .block = block, .buffer = buffer});
              };
              CHECK(borrowed_outcomes(make, seed * 1000 + cycle, save_every) ==
                    interleaved(file_order, d.files, cycle, block));
            }
  }
}

TEST_CASE("interleave | batch: the batches hold the oracle's records, in order, for any workers" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  dataset d(9, 5);
  for (std::size_t workers : {0, 2})
    for (std::size_t n : {1, 4, 64}) {
      INFO("workers " << workers << ", batch " << n);
      auto p = ferry::from_files(d.files, ferry::tfrecord{}, {.chunk_bytes = 500}) |
               ferry::interleave(4, {.workers = workers, .block = 2, .buffer = 3}) | ferry::batch(n);
      std::vector<std::string> got;
      std::size_t batches = 0;
      while (auto b = p.next()) {
        ++batches;
        CHECK(b->size() <= n);
        for (std::size_t i = 0; i < b->size(); ++i) {
          const auto v = b->field<0>()[i];
          got.emplace_back(reinterpret_cast<const char*>(v.data()), v.size());
        }
      }
      const auto want = d.expected(4, 2);
      CHECK(got == want);
      CHECK(batches == (want.size() + n - 1) / n);
    }
}

TEST_CASE("interleave over shuffle_files: each epoch interleaves that epoch's order of files; resume keeps it" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  dataset d(7, 23);
  const ferry::from_files_options o{.chunk_bytes = 300, .shuffle_files = true, .shuffle_seed = 11};
  // The oracle of epoch e: the plain source's records at epoch e (its files in that epoch's
  // order), dealt out as interleave deals them.
  auto want = [&](std::uint64_t e, std::size_t cycle, std::size_t block) {
    auto plain = ferry::from_files(d.files, ferry::tfrecord{}, o);
    plain.set_epoch(e);
    std::vector<std::string> order = plain.files();
    const outcome recs = outcomes(plain);
    std::vector<std::string> texts_out;
    for (const std::string& t : interleaved(recs, order, cycle, block)) texts_out.push_back(t.substr(1));
    return texts_out;
  };
  for (std::size_t workers : {0, 2}) {
    INFO("workers " << workers);
    auto make = [&] {
      return ferry::from_files(d.files, ferry::tfrecord{}, o) | ferry::interleave(3, {.workers = workers, .block = 2});
    };
    auto src = make();
    std::set<std::vector<std::string>> epochs;
    for (std::uint64_t e = 0; e < 4; ++e) {
      CAPTURE(e);
      const auto got = drain(src);
      CHECK(got == want(e, 3, 2));
      epochs.insert(got);
      src.rewind();
    }
    CHECK(epochs.size() == 4);  // a new order every epoch
    // Saved mid-way through epoch 2, restored into a fresh source: the rest of epoch 2,
    // then epoch 3.
    auto a = make();
    for (int e = 0; e < 2; ++e) (void)drain(a), a.rewind();
    const auto e2 = want(2, 3, 2);
    for (std::size_t k = 0; k < 9; ++k) REQUIRE(a.next());
    auto b = make();
    ferry::restore_state(b, ferry::save_state(a));
    CHECK(drain(b) == std::vector<std::string>(e2.begin() + 9, e2.end()));
    b.rewind();
    CHECK(drain(b) == want(3, 3, 2));
  }
}

// With workers = 0 the consumer reads the files itself, its reads sharing the readers' stop
// flag as their cancel. rewind() and restore_state() stop the (absent) readers, which left
// the flag raised: the next wait for a pipe's data, 50 ms on, was cancelled, the rest of
// the file dropped and a non-std exception thrown. A FIFO whose writer pauses between
// lines (the pauses make the reads wait; the order does not depend on them).
TEST_CASE("interleave, workers = 0: after rewind() or a restore, a slow pipe is read whole" * doctest::timeout(30)) {
  ferry_test::watchdog wd(30s);
  temp_dir t;
  for (int how = 0; how < 2; ++how) {  // rewind; restore_state
    CAPTURE(how);
    const std::string fifo = t / ("slow" + std::to_string(how) + ".fifo");
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    void (*old_pipe)(int) = std::signal(SIGPIPE, SIG_IGN);
    std::thread writer([&] {
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_CLOEXEC);  // blocks until the reader opens it
      if (fd < 0) return;
      for (int i = 0; i < 3; ++i) {
        const std::string l = "line" + std::to_string(i) + "\n";
        if (::write(fd, l.data(), l.size()) < 0) break;
        std::this_thread::sleep_for(120ms);
      }
      ::close(fd);
    });
    auto make = [&] { return ferry::from_files({fifo}, ferry::text_lines{}) | ferry::interleave(1, {.workers = 0}); };
    auto p = make();
    if (how == 0) {
      p.rewind();
    } else {
      auto q = make();
      ferry::restore_state(p, ferry::save_state(q));
    }
    std::vector<std::string> lines;
    try {
      while (auto r = p.next()) lines.emplace_back(r->str());
    } catch (const std::exception& e) {
      FAIL_CHECK("next() threw: " << e.what());
    } catch (...) {
      FAIL_CHECK("next() threw something that is not a std::exception");
    }
    writer.join();
    std::signal(SIGPIPE, old_pipe);
    CHECK(lines == std::vector<std::string>{"line0", "line1", "line2"});
  }
}

// interleave(fn) saves its upstream's position (an anchor) before opening each slot, for a
// checkpoint. An upstream that refuses to save (an unordered parallel map) threw from that
// save on every open after the first, before pulling: every next() threw, for ever. Now the
// elements come, and save_state() is what throws, while such a slot is open.
TEST_CASE("interleave(fn) over an upstream that cannot be saved: every element comes; save_state() throws" *
          doctest::timeout(30)) {
  ferry_test::watchdog wd(30s);
  for (std::size_t workers : {std::size_t(0), std::size_t(2)}) {
    CAPTURE(workers);
    auto p = ferry::from_generator(20, [](std::uint64_t i) { return i; }) |
             ferry::map([](std::uint64_t x) { return x; }, {.workers = 2, .ordered = false}) |
             ferry::interleave(
                 [](std::uint64_t x) { return ferry::from_generator(2, [x](std::uint64_t j) { return x * 100 + j; }); },
                 {.workers = workers, .cycle = 2});
    std::vector<std::uint64_t> got;
    for (int k = 0; k < 10; ++k) got.push_back(p.next().value());
    CHECK_THROWS_WITH_AS(ferry::save_state(p), doctest::Contains("an unordered parallel map cannot be checkpointed"),
                         ferry::config_error);
    while (auto e = p.next()) got.push_back(*e);
    std::sort(got.begin(), got.end());
    std::vector<std::uint64_t> want;
    for (std::uint64_t x = 0; x < 20; ++x)
      for (std::uint64_t j = 0; j < 2; ++j) want.push_back(x * 100 + j);
    CHECK(got == want);
  }
}

// interleave(fn) kept its counters inside the stage object, and its slots' threads wrote
// their waits there: after a move mid-epoch (into another variable, an any_source, the
// next stage) they wrote into the old object, freed or not (ASan: heap-use-after-free).
// The counters now live in the stage's heap block, which moves with it: the moved-to
// stage counts the waits of the threads started before the move.
TEST_CASE("interleave(fn) with workers moved mid-epoch: its threads count into the stage they now serve" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));
  ferry::enable_stats();
  struct stats_off {
    ~stats_off() { ferry::enable_stats(false); }
  } off;
  auto make = [] {
    return ferry::from_range(std::vector<std::uint64_t>{0, 1}) |  // no slot opens after the move
           ferry::interleave(
               [](std::uint64_t i) {
                 return ferry::from_generator(40000, [i](std::uint64_t k) { return i * 1000000 + k; });
               },
               {.workers = 2, .block = 1, .buffer = 4, .cycle = 2});
  };
  using P = decltype(make());
  auto p = std::make_unique<P>(make());
  REQUIRE(p->next());  // both slots' threads started
  REQUIRE(p->next());
  P q = std::move(*p);
  p.reset();  // the old object, where the threads counted, is gone
  const auto waits = [&] {
    for (const auto& s : ferry::report(q).stages)
      if (s.kind == "interleave") return s.wait_upstream_s + s.wait_downstream_s;
    return -1.0;
  };
  const double before = waits();
  std::uint64_t n = 2;
  while (q.next()) ++n;
  CHECK(n == 80000);
  // 80000 elements through queues of 4: some side waited, and it counted here.
  CHECK(waits() > before);
}

// fn's error names its upstream element by its index in the epoch, after a restore too: the
// state keeps the pulls before its anchor (a restore counted from the anchor, naming
// element 3 for element 5). The elements around it are the uninterrupted run's.
TEST_CASE("interleave(fn): after a restore at any position, fn's error names the same element" * doctest::timeout(60)) {
  ferry_test::watchdog wd(60s, "interleave error index");
  std::vector<std::uint64_t> v(12);
  for (std::uint64_t i = 0; i < v.size(); ++i) v[i] = i;
  for (const std::size_t workers : {0, 2}) {
    CAPTURE(workers);
    const auto make = [&] {
      return ferry::from_range(v) | ferry::interleave(
                                        [](std::uint64_t x) {
                                          if (x == 5 || x == 9) throw std::runtime_error("bad " + std::to_string(x));
                                          return ferry::from_range(std::vector<std::uint64_t>(1 + x % 3, x));
                                        },
                                        {.workers = workers, .block = 1, .cycle = 3});
    };
    // Each event: an element's value, or 1000 + the index an error names.
    const auto events = [](auto& p, std::vector<std::uint64_t>& out, std::size_t upto) {
      while (out.size() < upto) try {
          auto e = p.next();
          if (!e) return true;
          out.push_back(*e);
        } catch (const ferry::element_error& err) {
          out.push_back(1000 + err.element());
        }
      return false;
    };
    std::vector<std::uint64_t> want;
    {
      auto a = make();
      events(a, want, 1000);
    }
    REQUIRE(std::count(want.begin(), want.end(), 1005) == 1);
    REQUIRE(std::count(want.begin(), want.end(), 1009) == 1);
    for (std::size_t at = 0; at <= want.size(); ++at) {
      CAPTURE(at);
      auto b = make();
      std::vector<std::uint64_t> got;
      events(b, got, at);
      auto c = make();
      ferry::restore_state(c, ferry::save_state(b));
      events(c, got, 1000);
      CHECK(got == want);
    }
  }
}
