// Stats: per-stage counters equal a naive count of what each stage hands downstream; the
// report names a deliberately slow stage (or consumer) as the bottleneck; off means zero.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/doubles.hpp"
#include "ferry/ferry.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/interleave.hpp"
#include "ferry/stats.hpp"

using namespace std::chrono_literals;
using ferry_test::drain;
using ferry_test::watchdog;

namespace {

struct stats_on {
  stats_on() { ferry::enable_stats(true); }
  ~stats_on() { ferry::enable_stats(false); }
};

// The reports below come from wall-clock timing on a shared 2-core machine, where a
// thread descheduled inside a stage counts as busy there. So each scenario gets up to
// five runs and the checks apply to the first that passes all of them (else the
// last): a report that is wrong every time still fails.
template <class Run, class Ok>
auto first_good(Run run, Ok ok) {
  auto r = run();
  for (int i = 1; i < 5 && !ok(r); ++i) r = run();
  return r;
}


// Work that takes `d` of CPU time (a busy loop: the stage is busy, not asleep).
void spin_for(std::chrono::microseconds d) {
  const auto end = std::chrono::steady_clock::now() + d;
  while (std::chrono::steady_clock::now() < end) {
  }
}

const ferry::stage_stats& stage(const ferry::pipeline_report& r, const std::string& name) {
  for (const auto& s : r.stages)
    if (s.name == name) return s;
  FAIL("no stage named " << name);
  return r.stages.front();
}

std::vector<std::string> names(const ferry::pipeline_report& r) {
  std::vector<std::string> n;
  for (const auto& s : r.stages) n.push_back(s.name);
  return n;
}

}  // namespace

TEST_CASE("element and byte counts equal a naive count, stage by stage (property, fixed seeds)") {
  stats_on on;
  std::mt19937_64 g(7);
  for (int round = 0; round < 40; ++round) {
    const std::size_t n = g() % 2000;
    const std::uint64_t shards = 1 + g() % 3, index = g() % shards;
    const std::size_t bs = 1 + g() % 50, window = 1 + g() % 64;
    const std::uint64_t keep_mod = 1 + g() % 4;
    const bool drop = g() % 2;
    std::vector<std::uint32_t> data(n);
    for (auto& x : data) x = static_cast<std::uint32_t>(g());
    auto keep = [=](std::uint32_t x) { return x % keep_mod == 0; };

    auto p = ferry::from_range(data) | ferry::shuffle(window, round) | ferry::shard(shards, index) |
             ferry::filter(keep) | ferry::map([](std::uint32_t x) { return std::uint64_t(x) * 3; }) |
             ferry::batch(bs, {.drop_remainder = drop});
    std::uint64_t got_rows = 0, got_batches = 0, got_bytes = 0;
    auto count = [&](const auto& b) {
      got_rows += b.size();
      got_bytes += b.payload_bytes();
      ++got_batches;
    };
    if (round % 2 == 0) {
      while (auto b = p.next()) count(*b);
    } else {
      for (auto& b : p) count(b);  // batch's refill: each batch into the last one's buffers
    }

    // Naive oracle: what each stage hands downstream, counted by draining a plain
    // (stats-free) pipeline of the same prefix, or by arithmetic.
    ferry::enable_stats(false);
    auto prefix = ferry::from_range(data) | ferry::shuffle(window, round) | ferry::shard(shards, index) |
                  ferry::filter(keep);
    const std::uint64_t kept = drain(prefix).size();
    ferry::enable_stats(true);
    const std::uint64_t after_shard = n / shards + (index < n % shards ? 1 : 0);
    const std::uint64_t batches = drop ? kept / bs : (kept + bs - 1) / bs;

    const auto r = ferry::report(p);
    REQUIRE(names(r) == std::vector<std::string>{"from_range", "shuffle", "shard", "filter", "map", "batch"});
    CHECK(stage(r, "from_range").elements == n);
    CHECK(stage(r, "from_range").bytes == n * sizeof(std::uint32_t));
    CHECK(stage(r, "shuffle").elements == n);
    CHECK(stage(r, "shard").elements == after_shard);
    CHECK(stage(r, "filter").elements == kept);
    CHECK(stage(r, "map").elements == kept);
    CHECK(stage(r, "map").bytes == kept * sizeof(std::uint64_t));
    CHECK(stage(r, "batch").elements == batches);
    CHECK(got_batches == batches);
    CHECK(stage(r, "batch").bytes == got_bytes);
    CHECK(got_bytes == got_rows * sizeof(std::uint64_t));
    for (std::size_t i = 0; i < r.stages.size(); ++i) CHECK(r.stages[i].index == i);
  }
}

TEST_CASE("take pulls no more than it hands out, and says so") {
  stats_on on;
  for (std::uint64_t k : {0, 1, 10, 99, 100, 150}) {
    auto p = ferry::from_generator(100, [](std::uint64_t i) { return i; }) | ferry::take(k);
    drain(p);
    const auto r = ferry::report(p);
    CHECK(stage(r, "from_generator").elements == std::min<std::uint64_t>(k, 100));
    CHECK(stage(r, "take").elements == std::min<std::uint64_t>(k, 100));
  }
}

TEST_CASE("filter's count equals the naive predicate count") {
  stats_on on;
  std::vector<std::uint32_t> data(10'000);
  std::iota(data.begin(), data.end(), 0u);
  auto p = ferry::from_range(data) | ferry::filter([](std::uint32_t x) { return x % 7 == 3; });
  drain(p);
  const auto want = std::count_if(data.begin(), data.end(), [](std::uint32_t x) { return x % 7 == 3; });
  CHECK(stage(ferry::report(p), "filter").elements == std::uint64_t(want));
}

TEST_CASE("the bulk path (source | map | take | batch filled in one call) is counted") {
  stats_on on;
  for (std::size_t n : {0, 1, 255, 256, 1000, 4097}) {
    std::vector<std::uint32_t> data(n, 1);
    auto p = ferry::from_range(data) | ferry::map([](std::uint32_t x) { return x + 1; }) | ferry::take(3000) |
             ferry::batch(256);
    std::uint64_t rows = 0, batches = 0;
    while (auto b = p.next()) {
      rows += b->size();
      ++batches;
    }
    const auto r = ferry::report(p);
    const std::uint64_t taken = std::min<std::uint64_t>(n, 3000);
    CHECK(rows == taken);
    CHECK(stage(r, "from_range").elements == taken);
    CHECK(stage(r, "map").elements == taken);
    CHECK(stage(r, "map").bytes == taken * 4);
    CHECK(stage(r, "take").elements == taken);
    CHECK(stage(r, "batch").elements == batches);
    CHECK(stage(r, "batch").bytes == taken * 4);
  }
}

TEST_CASE("threaded stages count exactly: parallel map, prefetch, repeat" * doctest::timeout(60)) {
  watchdog w(60s);
  stats_on on;
  // (An unordered map is not checkpointable, and prefetch checkpoints as it goes.)
  for (std::size_t workers : {2, 3}) {
      auto p = ferry::from_generator(1000, [](std::uint64_t i) { return i; }) |
               ferry::map([](std::uint64_t x) { return x * 2; }, {.workers = workers}) |
               ferry::repeat(3) | ferry::batch(64) | ferry::prefetch(2);
      std::uint64_t rows = 0, batches = 0;
      while (auto b = p.next()) {
        rows += b->size();
        ++batches;
      }
      const auto r = ferry::report(p);
      REQUIRE(names(r) == std::vector<std::string>{"from_generator", "map", "repeat", "batch", "prefetch"});
      CHECK(rows == 3000);
      CHECK(stage(r, "from_generator").elements == 3000);
      CHECK(stage(r, "map").elements == 3000);
      CHECK(stage(r, "map").threads == workers);
      CHECK(stage(r, "repeat").elements == 3000);
      CHECK(stage(r, "batch").elements == batches);
      CHECK(stage(r, "prefetch").elements == batches);
      CHECK(stage(r, "prefetch").bytes == 3000 * 8);
    }
}

TEST_CASE("an unordered parallel map under prefetch is counted (and runs: only save_state refuses)" *
          doctest::timeout(60)) {
  watchdog w(60s);
  stats_on on;
  auto p = ferry::from_generator(1000, [](std::uint64_t i) { return i; }) |
           ferry::map([](std::uint64_t x) { return x + 1; }, {.workers = 2, .ordered = false}) | ferry::prefetch(2);
  REQUIRE(p.next());
  CHECK_THROWS_AS(ferry::save_state(p), ferry::config_error);
  std::uint64_t n = 1;
  while (p.next()) ++n;
  CHECK(n == 1000);
  const auto r = ferry::report(p);
  CHECK(stage(r, "map").elements == 1000);
  CHECK(stage(r, "prefetch").elements == 1000);
}

TEST_CASE("ferry's sources name themselves; a user's own source is counted by the stage after it as 'source'") {
  stats_on on;
  auto p = ferry_test::counting_source(50) | ferry::map([](std::uint64_t x) { return x; });
  drain(p);
  const auto r = ferry::report(p);
  REQUIRE(names(r) == std::vector<std::string>{"source", "map"});
  CHECK(stage(r, "source").elements == 50);
  auto q = ferry::from_range(std::vector<int>(30, 1)) | ferry::take(10);
  drain(q);
  CHECK(names(ferry::report(q)) == std::vector<std::string>{"from_range", "take"});
  CHECK(stage(ferry::report(q), "from_range").elements == 10);
}

TEST_CASE("two stages of one kind are told apart by index") {
  stats_on on;
  auto p = ferry::from_generator(100, [](std::uint64_t i) { return i; }) | ferry::map([](std::uint64_t x) { return x; }) |
           ferry::map([](std::uint64_t x) { return x; });
  drain(p);
  CHECK(names(ferry::report(p)) == std::vector<std::string>{"from_generator", "map#1", "map#2"});
}

TEST_CASE("with stats off nothing is counted and the report says how to turn them on" * doctest::timeout(60)) {
  watchdog w(60s);  // prefetch runs a thread
  ferry::enable_stats(false);
  REQUIRE_FALSE(ferry::stats_enabled());
  auto p = ferry::from_generator(500, [](std::uint64_t i) { return i; }) | ferry::map([](std::uint64_t x) { return x; }) |
           ferry::batch(10) | ferry::prefetch(2);
  CHECK(drain(p).size() == 50);
  const auto r = ferry::report(p);
  REQUIRE(r.stages.size() == 4);
  for (const auto& s : r.stages) {
    CHECK(s.elements == 0);
    CHECK(s.bytes == 0);
    CHECK(s.busy_s == 0);
    CHECK(s.wait_upstream_s == 0);
    CHECK(s.wait_downstream_s == 0);
  }
  CHECK(r.wall_s == 0);
  CHECK(r.bottleneck.empty());
  CHECK(r.summary().find("enable_stats") != std::string::npos);
}

TEST_CASE("reset_stats zeroes every stage") {
  stats_on on;
  auto p = ferry::from_generator(100, [](std::uint64_t i) { return i; }) | ferry::filter([](std::uint64_t) { return true; }) |
           ferry::batch(10);
  drain(p);
  REQUIRE(stage(ferry::report(p), "batch").elements == 10);
  ferry::reset_stats(p);
  for (const auto& s : ferry::report(p).stages) CHECK(s.elements == 0);
  p.rewind();
  drain(p);
  CHECK(stage(ferry::report(p), "filter").elements == 100);
}

TEST_CASE("a deliberately slow map is named the bottleneck; prefetch waits on upstream" * doctest::timeout(60)) {
  watchdog w(60s);
  stats_on on;
  const auto r = first_good(
      [] {
        auto p = ferry::from_generator(150, [](std::uint64_t i) { return i; }) | ferry::map([](std::uint64_t x) {
                   spin_for(400us);
                   return x;
                 }) |
                 ferry::batch(10) | ferry::prefetch(2);
        CHECK(drain(p).size() == 15);
        return ferry::report(p);
      },
      [](const auto& r) {  // every timing check below
        return r.bottleneck == "map" && stage(r, "map").busy > 0.6 && stage(r, "prefetch").wait_upstream > 0.5 &&
               stage(r, "prefetch").wait_downstream < 0.2 && stage(r, "batch").busy < 0.2;
      });
  INFO(r);
  CHECK(r.bottleneck == "map");
  CHECK(stage(r, "map").busy > 0.6);
  CHECK(stage(r, "prefetch").wait_upstream > 0.5);
  CHECK(stage(r, "prefetch").wait_downstream < 0.2);
  CHECK(stage(r, "batch").busy < 0.2);
  CHECK(r.summary().rfind("map is the bottleneck: ", 0) == 0);
  CHECK(r.summary().find("prefetch waited") != std::string::npos);
}

TEST_CASE("a slow parallel map is the bottleneck, its busy time shared by its workers" * doctest::timeout(60)) {
  watchdog w(60s);
  stats_on on;
  const auto r = first_good(
      [] {
        auto p = ferry::from_generator(200, [](std::uint64_t i) { return i; }) |
                 ferry::map(
                     [](std::uint64_t x) {
                       spin_for(300us);
                       return x;
                     },
                     {.workers = 2}) |
                 ferry::batch(10);
        CHECK(drain(p).size() == 20);
        return ferry::report(p);
      },
      [](const auto& r) {  // every timing check below
        return r.bottleneck == "map" && stage(r, "map").busy_s >= 0.9 * 200 * 300e-6 &&
               stage(r, "map").wait_upstream > 0.3;
      });
  INFO(r);
  CHECK(r.bottleneck == "map");
  CHECK(stage(r, "map").threads == 2);
  // The function ran 200 × 300 µs over two workers.
  CHECK(stage(r, "map").busy_s >= 0.9 * 200 * 300e-6);
  CHECK(stage(r, "map").wait_upstream > 0.3);  // the consumer waited for the workers
}

TEST_CASE("a slow consumer shows as prefetch waiting on downstream" * doctest::timeout(60)) {
  watchdog w(60s);
  stats_on on;
  const auto r = first_good(
      [] {
        auto p = ferry::from_generator(2000, [](std::uint64_t i) { return i; }) | ferry::batch(20) |
                 ferry::prefetch(2);
        std::size_t batches = 0;
        while (auto b = p.next()) {
          spin_for(500us);
          ++batches;
        }
        CHECK(batches == 100);
        return ferry::report(p);
      },
      [](const auto& r) {
        return r.bottleneck == "consumer" && r.consumer > 0.6 && stage(r, "prefetch").wait_downstream > 0.5 &&
               stage(r, "prefetch").wait_upstream < 0.2;  // every timing check below
      });
  INFO(r);
  CHECK(r.bottleneck == "consumer");
  CHECK(r.consumer > 0.6);
  CHECK(stage(r, "prefetch").wait_downstream > 0.5);
  CHECK(stage(r, "prefetch").wait_upstream < 0.2);
  CHECK(r.summary().rfind("the consumer is the bottleneck", 0) == 0);
  CHECK(r.summary().find("prefetch waited") != std::string::npos);
}

TEST_CASE("report arithmetic on known counters") {
  // 1000 ticks of wall; inline chain source -> map -> batch, then prefetch (threaded).
  using ferry::observe::raw_stage;
  using ferry::observe::stage_mode;
  std::vector<raw_stage> raw(4);
  raw[0] = {"source", stage_mode::source_stage, 1, 100, 400, /*incl*/ 100, 0, 0, 0, 1, 900};
  raw[1] = {"map", stage_mode::inline_stage, 1, 100, 800, /*incl*/ 900, 0, 0, 0, 1, 950};
  raw[2] = {"batch", stage_mode::inline_stage, 1, 10, 800, /*incl*/ 950, 0, 0, 0, 1, 980};
  raw[3] = {"prefetch", stage_mode::threaded_stage, 1, 10, 800, /*incl*/ 800, 0, /*wait_up*/ 700,
            /*wait_down*/ 100, 1000, 2000};
  const auto r = ferry::observe::make_report(raw);
  const double k = ferry::observe::ns_per_tick() * 1e-9;
  CHECK(r.wall_s == doctest::Approx(1000 * k));
  CHECK(r.stages[0].busy == doctest::Approx(0.1));
  CHECK(r.stages[1].busy == doctest::Approx(0.8));
  CHECK(r.stages[2].busy == doctest::Approx(0.05));
  CHECK(r.stages[3].busy == doctest::Approx(0.1));
  CHECK(r.stages[3].wait_upstream == doctest::Approx(0.7));
  CHECK(r.stages[3].wait_downstream == doctest::Approx(0.1));
  CHECK(r.consumer == doctest::Approx(0.2));
  CHECK(r.bottleneck == "map");
  CHECK(r.summary() ==
        "map is the bottleneck: 80% busy; prefetch waited 70% of the time on upstream; prefetch waited 10% of the "
        "time on downstream");
  std::ostringstream os;
  os << r;
  CHECK(os.str().find("(consumer)") != std::string::npos);
}

TEST_CASE("from_files and interleave count records and their bytes" * doctest::timeout(60)) {
  watchdog w(60s);
  stats_on on;
  const auto dir = std::filesystem::temp_directory_path() / ("ferry_observe_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::vector<std::string> files;
  std::uint64_t lines = 0, bytes = 0;
  for (int f = 0; f < 3; ++f) {
    files.push_back((dir / ("f" + std::to_string(f) + ".txt")).string());
    std::ofstream o(files.back());
    for (int i = 0; i < 50 + 10 * f; ++i) {
      const std::string line = "line " + std::to_string(f) + " " + std::to_string(i);
      o << line << '\n';
      ++lines;
      bytes += line.size();
    }
  }
  {
    auto p = ferry::from_files(files, ferry::text_lines{}) | ferry::batch(16);
    drain(p);
    const auto r = ferry::report(p);
    REQUIRE(names(r) == std::vector<std::string>{"from_files", "batch"});
    CHECK(stage(r, "from_files").elements == lines);
    CHECK(stage(r, "from_files").bytes == bytes);
  }
  for (std::size_t workers : {0, 2}) {
    auto p = ferry::from_files(files, ferry::text_lines{}) | ferry::interleave(2, {.workers = workers}) |
             ferry::prefetch(2);
    drain(p);
    const auto r = ferry::report(p);
    REQUIRE(names(r) == std::vector<std::string>{"interleave", "prefetch"});
    CHECK(stage(r, "interleave").elements == lines);
    CHECK(stage(r, "interleave").bytes == bytes);
    CHECK(stage(r, "prefetch").elements == lines);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("distribute counts steps and the bytes it hands the replicas") {
  stats_on on;
  auto p = ferry::from_generator(1000, [](std::uint64_t i) { return float(i); }) | ferry::batch(64) |
           ferry::distribute(ferry::host_replicas{4});
  std::uint64_t steps = 0;
  while (auto s = p.next()) ++steps;
  const auto r = ferry::report(p);
  REQUIRE(names(r) == std::vector<std::string>{"from_generator", "batch", "distribute"});
  CHECK(steps == 1000 / 64);
  CHECK(stage(r, "batch").elements == 16);  // 15 full + 1 short, dropped by distribute
  CHECK(stage(r, "distribute").elements == steps);
  CHECK(stage(r, "distribute").bytes == steps * 64 * sizeof(float));
}
