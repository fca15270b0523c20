// Tracing: the file is valid JSON (checked by python's json module) with events for the
// stages of the pipeline; a full buffer drops events but keeps the file valid; no
// session, no events; one session at a time; write failures are io_errors.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <clocale>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <thread>
#include <unistd.h>

#include "common/doubles.hpp"
#include "ferry/cuda/nvtx.hpp"
#include "ferry/ferry.hpp"
#include "ferry/stats.hpp"
#include "ferry/trace.hpp"

using namespace std::chrono_literals;
using ferry_test::drain;
using ferry_test::watchdog;

namespace {

struct scratch {
  std::filesystem::path dir;
  scratch() {
    dir = std::filesystem::temp_directory_path() / ("ferry_trace_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
  }
  ~scratch() { std::filesystem::remove_all(dir); }
  std::string file(const std::string& name) const { return (dir / name).string(); }
};

// Runs tests/observe/check_trace.py on `path` with `args`; its exit status.
int check_trace(const std::string& path, const std::string& args) {
  const std::string cmd = std::string(FERRY_PYTHON) + " " + FERRY_TRACE_CHECKER + " '" + path + "' " + args;
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

auto pipeline() {
  return ferry::from_generator(4000, [](std::uint64_t i) { return i; }) |
         ferry::map([](std::uint64_t x) { return x + 1; }, {.workers = 2}) |
         ferry::filter([](std::uint64_t x) { return x % 3 != 0; }) | ferry::batch(32) | ferry::prefetch(2);
}

}  // namespace

TEST_CASE("a trace is valid JSON with events for each stage, on named threads" * doctest::timeout(60)) {
  watchdog w(60s);
  scratch s;
  const std::string path = s.file("pipeline.json");
  std::size_t recorded = 0;
  {
    ferry::tracing t(path);
    auto p = pipeline();
    CHECK(drain(p).size() == (4000 * 2 / 3 + 31) / 32);
    t.stop();
    recorded = t.recorded();
    CHECK(t.dropped() == 0);
  }
  // At least one event per call: from_generator's and map's fn per element (4000), filter per
  // element kept (2667 of 4000 are not multiples of 3 after the +1), batch and prefetch per
  // batch of 32 (84); every thread named.
  CHECK(recorded > 4000 + 4000 + 2667);
  CHECK(check_trace(path, "--events " + std::to_string(recorded) +
                              " --named-threads from_generator=4000 'map: fn'=4000 map=2667 filter=2667 "
                              "batch=84 prefetch=84") == 0);
  // Tracing ended with the session: stats are off again.
  CHECK_FALSE(ferry::stats_enabled());
}

TEST_CASE("a call that throws is traced, marked as thrown, and the error still reaches the caller" *
          doctest::timeout(60)) {
  watchdog w(60s);
  scratch s;
  const std::string path = s.file("threw.json");
  struct boom : std::runtime_error {
    using std::runtime_error::runtime_error;
  };
  {
    ferry::tracing t(path);
    // A user function failing on a map worker: the worker's fn event, then map's and
    // batch's calls on the consumer's thread, which rethrow it.
    auto p = ferry::from_generator(100, [](std::uint64_t i) { return i; }) |
             ferry::map([](std::uint64_t x) {
               if (x == 50) throw boom("element 50");
               return x;
             }, {.workers = 2}) |
             ferry::batch(8);
    CHECK_THROWS_AS(drain(p), ferry::element_error);  // wrapping boom, naming map and the element
    // A source's generator failing inline: the generator's stage event.
    auto q = ferry::from_generator(10, [](std::uint64_t i) {
      if (i == 3) throw boom("element 3");
      return i;
    });
    CHECK_THROWS_AS(drain(q), ferry::element_error);
    t.stop();
    CHECK(t.dropped() == 0);
  }
  CHECK(check_trace(path, "'map: fn (threw)'=1 'map (threw)'=1 'batch (threw)'=1 "
                          "'from_generator (threw)'=1 map batch=6") == 0);
}

TEST_CASE("a full buffer drops events, counts them, and the file is still valid JSON" * doctest::timeout(60)) {
  watchdog w(60s);
  scratch s;
  const std::string path = s.file("small.json");
  ferry::tracing t(path, {.capacity = 10});
  auto p = pipeline();
  drain(p);
  t.stop();
  CHECK(t.recorded() == 10);
  CHECK(t.dropped() > 0);
  CHECK(check_trace(path, "--events 10 --dropped " + std::to_string(t.dropped())) == 0);
}

TEST_CASE("with no session open, nothing is recorded" * doctest::timeout(60)) {
  watchdog w(60s);
  scratch s;
  auto p = pipeline();
  drain(p);  // before the session: must leave no events behind
  const std::string path = s.file("empty.json");
  {
    ferry::tracing t(path);
    t.stop();
    CHECK(t.recorded() == 0);
  }
  CHECK(check_trace(path, "--events 0") == 0);
  // Between sessions: a pipeline drained with none open leaves nothing for the next one,
  // which records exactly what a first session records for the same (inline, so
  // deterministic) pipeline.
  const auto inline_pipeline = [] {
    return ferry::from_generator(300, [](std::uint64_t i) { return i; }) |
           ferry::filter([](std::uint64_t x) { return x % 3 != 0; }) | ferry::batch(10);
  };
  std::uint64_t alone = 0;
  {
    ferry::tracing t(s.file("alone.json"));
    auto q = inline_pipeline();
    drain(q);
    t.stop();
    alone = t.recorded();
  }
  CHECK(alone > 0);
  auto between = inline_pipeline();
  drain(between);
  {
    ferry::tracing t(s.file("again.json"));
    auto q = inline_pipeline();
    drain(q);
    t.stop();
    CHECK(t.recorded() == alone);
  }
}

// A program that sets a comma-decimal locale (setlocale(LC_ALL, "") under de_DE) still
// writes JSON: numbers with a '.' ("16,765" is no JSON number).
TEST_CASE("the trace is valid JSON under a comma-decimal LC_NUMERIC" * doctest::timeout(60)) {
  watchdog w(60s);
  scratch s;
  // A de_DE locale of our own (the locales package's sources; none need be installed).
  const std::string built = "localedef -c -i de_DE -f UTF-8 '" + s.file("de_DE.UTF-8") + "' 2>/dev/null";
  REQUIRE_MESSAGE(std::system(built.c_str()) == 0, "localedef could not build de_DE.UTF-8 (Debian's locales package)");
  REQUIRE(::setenv("LOCPATH", s.dir.c_str(), 1) == 0);
  REQUIRE(std::setlocale(LC_NUMERIC, "de_DE.UTF-8") != nullptr);
  struct back_to_c {
    ~back_to_c() {
      std::setlocale(LC_NUMERIC, "C");
      ::unsetenv("LOCPATH");
    }
  } guard;
  char probe[16];
  std::snprintf(probe, sizeof probe, "%.1f", 1.5);
  REQUIRE(std::string(probe) == "1,5");  // the locale is in force: %f would break the JSON
  const std::string path = s.file("de.json");
  std::uint64_t recorded = 0;
  {
    ferry::tracing t(path);
    auto p = pipeline();
    drain(p);
    t.stop();
    recorded = t.recorded();
  }
  std::setlocale(LC_NUMERIC, "C");
  CHECK(check_trace(path, "--events " + std::to_string(recorded)) == 0);
}

TEST_CASE("an event begun before the session is cut at its start, so events still nest" * doctest::timeout(60)) {
  watchdog w(60s);
  scratch s;
  std::atomic<bool> in_fn{false}, go{false};
  ferry::enable_stats();  // stats on before the session: stage calls are timed from their start
  auto p = ferry::from_generator(200, [](std::uint64_t i) { return i; }) |
           ferry::map([&](std::uint64_t x) {
             if (x == 0) {  // the producer's first map call spans the session's start
               in_fn = true;
               while (!go.load()) std::this_thread::yield();
             } else {  // work that outlasts the gap below, so a stretched event overlaps it
               const auto end = std::chrono::steady_clock::now() + 50us;
               while (std::chrono::steady_clock::now() < end) {
               }
             }
             return x;
           }) |
           ferry::batch(8) | ferry::prefetch(2);
  std::size_t batches = 0;
  std::thread consumer([&] { batches = drain(p).size(); });
  while (!in_fn.load()) std::this_thread::yield();
  // A gap between the event's start and the session's, far above the file's rounding.
  const auto until = std::chrono::steady_clock::now() + 2ms;
  while (std::chrono::steady_clock::now() < until) {
  }
  const std::string path = s.file("straddle.json");
  {
    ferry::tracing t(path);
    go = true;
    consumer.join();
    t.stop();
    CHECK(t.recorded() > 0);
  }
  ferry::enable_stats(false);
  CHECK(batches == 25);
  CHECK(check_trace(path, "map batch") == 0);  // every event inside the session, nested per thread
}

TEST_CASE("one session at a time; trace_to opens one") {
  scratch s;
  auto t = ferry::trace_to(s.file("a.json"));
  CHECK_THROWS_AS(ferry::tracing(s.file("b.json")), ferry::config_error);
  t->stop();
  ferry::tracing again(s.file("c.json"));  // the first one is closed: fine
  again.stop();
  CHECK(std::filesystem::exists(s.file("a.json")));
  CHECK(std::filesystem::exists(s.file("c.json")));
}

TEST_CASE("a trace file that cannot be written is an io_error naming it") {
  ferry::tracing t("/nonexistent-ferry-dir/trace.json");
  try {
    t.stop();
    FAIL("stop() should have thrown");
  } catch (const ferry::io_error& e) {
    CHECK(e.path() == "/nonexistent-ferry-dir/trace.json");
  }
}

TEST_CASE("nvtx ranges are off by default and harmless without a profiler") {
  ferry::cuda::nvtx_range r("ferry test");  // compiles to nothing, or a no-op push/pop
  ferry::enable_nvtx(true);
  { ferry::cuda::nvtx_range r2("ferry test on"); }
  ferry::enable_nvtx(false);
  CHECK_FALSE(ferry::stats_enabled());  // NVTX does not turn stats on
}
