// distribute(cuda::devices) against the simulated CUDA runtime (tests/cuda/sim): the
// ordering logic of the CUDA backend, checked on a machine without a GPU. Every replica's
// device data, read when the simulated GPU runs the consumer's kernel, equals the oracle's
// rows; no two accesses to device bytes are unordered; copies of step k+1 are never
// ordered after step k's kernel (they can overlap it); steady state allocates and waits
// for nothing; a GPU that lags is met with bounded memory; errors and early stops free
// everything. The GPU suite checks the same on a real device (test_distribute_gpu).
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>  // the simulator's (this test's include path puts it first)

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <numeric>
#include <thread>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/doubles.hpp"
#include "cuda/elements.hpp"
#include "ferry/cuda/device_pool.hpp"
#include "ferry/cuda/devices.hpp"
#include "ferry/memory/pinned.hpp"
#include "ferry/sources/from_generator.hpp"
#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/bucket_by_sequence_length.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/filter.hpp"
#include "ferry/stages/flat_map.hpp"
#include "ferry/stages/interleave.hpp"
#include "ferry/stages/map.hpp"
#include "ferry/stages/padded_batch.hpp"
#include "ferry/stages/prefetch.hpp"
#include "ferry/stages/shuffle.hpp"
#include "ferry/stats.hpp"

namespace {

// How steps are made: on the consumer's thread when asked (0) or one ahead (1), or on
// distribute's staging thread, 1 or 3 ahead.
struct making {
  std::size_t ahead;
  bool staging;
};
constexpr making makings[] = {{0, false}, {1, false}, {1, true}, {3, true}};

enum class consumer {
  range_for,    // for (auto& step : steps): step k lives while step k+1 is asked for
  drop_first,   // while (auto step = steps.next()): step k is gone before
  host_waits,   // range-for, and the host waits for each step's kernels (a trainer reading its loss)
};

struct scenario {
  std::vector<int> devices{0};
  std::size_t per = 8;  // rows per replica
  std::size_t rows = 0;
  ferry::remainder_policy policy = ferry::remainder_policy::drop;
  consumer how = consumer::range_for;
  int progress = 4;
  bool prefetch = false;
  std::size_t steps_ahead = 1;
  bool staging = false;  // distribute_options::staging_thread
  std::size_t max_pending = 4;
  std::uint64_t seed = 1;
  std::size_t stop_after = 0;  // 0: the whole epoch; else leave after this many steps
};

struct trace {
  std::size_t steps = 0;
  std::vector<sim::op_id> copy, kernel;     // replica 0's, per step
  std::vector<std::uint64_t> copies_when_handed_out;  // sim copies enqueued when step k came
  std::vector<std::uint64_t> host_allocs_at;          // cudaHostAlloc calls so far, likewise
  sim::counters warm, end;                  // at step 10, and after the last step
  std::uint64_t backpressure_waits = 0;
  std::uint64_t rows_checked = 0;           // by kernels, when they ran
  std::vector<std::string> wrong;           // what kernels found wrong
};

// The rows replica r must hold in the step cut from rows [pos, pos + m) of the data.
struct expected_slice {
  std::size_t first_id = 0, rows = 0, valid = 0;
};
expected_slice expect(std::size_t pos, std::size_t m, std::size_t R, std::size_t per, std::size_t r,
                      ferry::remainder_policy pol) {
  const std::size_t G = R * per;
  if (m == G || pol == ferry::remainder_policy::pad) {
    const std::size_t valid = m == G ? per : std::min(per, m > r * per ? m - r * per : 0);
    return {pos + r * per + 1, per, valid};
  }
  std::size_t first = pos;
  for (std::size_t q = 0; q < r; ++q) first += m / R + (q < m % R ? 1 : 0);
  const std::size_t rows = m / R + (r < m % R ? 1 : 0);
  return {first + 1, rows, rows};
}

template <class Steps>
void consume(Steps& steps, const scenario& sc, trace& t, std::mutex& m) {
  const std::size_t R = sc.devices.size(), G = R * sc.per;
  std::size_t pos = 0;
  auto on_step = [&](auto& st) {
    const std::size_t k = t.steps;
    REQUIRE(st.index() == k);
    REQUIRE(st.replicas() == R);
    t.copies_when_handed_out.push_back(sim::stats().copies);
    t.host_allocs_at.push_back(sim::stats().host_allocs);
    if (k == 10) t.warm = sim::stats();
    const std::size_t got = std::min(G, sc.rows - pos);  // rows of this global batch
    for (std::size_t r = 0; r < R; ++r) {
      auto& rb = st[r];
      REQUIRE(rb.device() == sc.devices[r]);
      const expected_slice e = expect(pos, got, R, sc.per, r, sc.policy);
      REQUIRE(rb.size() == e.rows);
      REQUIRE(rb.valid() == e.valid);
      REQUIRE(cudaSetDevice(rb.device()) == cudaSuccess);
      auto ids = rb.template field<0>();
      auto xs = rb.template field<1>();
      if (r == 0) t.copy.push_back(rb.size() ? sim::last_copy_into(ids.data()) : 0);
      // The kernel: reads the slice when the simulated GPU runs it, checks it.
      const sim::op_id id = sim::launch(
          rb.stream(), "kernel of step " + std::to_string(k),
          {{ids.data(), ids.size_bytes()}, {xs.data(), xs.size_bytes()}}, {}, [&t, &m, ids, xs, e, k, r] {
            std::lock_guard lk(m);
            for (std::size_t i = 0; i < e.rows; ++i) {
              const bool pad = i >= e.valid;
              const std::uint32_t want = pad ? 0 : static_cast<std::uint32_t>(e.first_id + i);
              const float f = pad ? 0.0f : float(want - 1);
              const std::array<float, 3> want_x{f, pad ? 0.0f : f * 0.5f, pad ? 0.0f : -f};
              if (ids[i] != want || xs[i] != want_x)
                t.wrong.push_back("step " + std::to_string(k) + " replica " + std::to_string(r) + " row " +
                                  std::to_string(i) + ": id " + std::to_string(ids[i]) + ", expected " +
                                  std::to_string(want));
              ++t.rows_checked;
            }
          });
      if (r == 0) t.kernel.push_back(id);
    }
    if (sc.how == consumer::host_waits)
      for (std::size_t r = 0; r < R; ++r) REQUIRE(cudaStreamSynchronize(st[r].stream()) == cudaSuccess);
    pos += got;
    ++t.steps;
  };
  if (sc.how == consumer::drop_first) {
    while (auto st = steps.next()) {
      on_step(*st);
      if (sc.stop_after && t.steps == sc.stop_after) return;
    }
  } else {
    for (auto& st : steps) {
      on_step(st);
      if (sc.stop_after && t.steps == sc.stop_after) return;
    }
  }
}

trace run(const scenario& sc) {
  sim::reset(sc.seed, sc.progress);
  trace t;
  std::mutex m;
  const auto data = make_data(static_cast<std::uint32_t>(sc.rows));
  {
    auto pool = ferry::make_pinned_pool();
    ferry::cuda::devices dev(sc.devices);
    dev.max_pending = sc.max_pending;
    const ferry::distribute_options o{.remainder = sc.policy, .host_resource = pool, .steps_ahead = sc.steps_ahead,
                                      .staging_thread = sc.staging};
    const std::size_t G = sc.devices.size() * sc.per;
    auto body = [&](auto steps) {
      consume(steps, sc, t, m);
      t.end = sim::stats();
      t.backpressure_waits = steps.backend().backpressure_waits();
    };
    if (sc.prefetch)
      body(ferry::from_range(data) | ferry::batch(G) | ferry::prefetch(2) | ferry::distribute(dev, o));
    else
      body(ferry::from_range(data) | ferry::batch(G) | ferry::distribute(dev, o));
    sim::drain();  // the kernels run, and check
  }
  return t;
}

std::size_t expected_steps(const scenario& sc) {
  const std::size_t G = sc.devices.size() * sc.per;
  return sc.policy == ferry::remainder_policy::drop ? sc.rows / G : (sc.rows + G - 1) / G;
}

void check_clean(const trace& t) {
  for (const auto& w : t.wrong) FAIL_CHECK(w);
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  const auto s = sim::stats();
  CHECK(s.live_device_blocks == 0);  // everything freed, also mid-epoch
  CHECK(s.live_events == 0);
  CHECK(s.live_streams == 0);
  CHECK(s.pending_ops == 0);
}

}  // namespace

TEST_CASE("sim: every replica's device data equals the oracle's rows, and no access races" *
          doctest::timeout(120)) {
  ferry_test::watchdog wd(std::chrono::seconds(120));
  std::uint64_t seed = 1;
  for (auto devs : {std::vector<int>{0}, std::vector<int>{0, 1}, std::vector<int>{1, 0, 1}})
    for (auto pol : {ferry::remainder_policy::drop, ferry::remainder_policy::pad, ferry::remainder_policy::partial})
      for (auto how : {consumer::range_for, consumer::drop_first, consumer::host_waits})
        for (int progress : {0, 1, 6})
          for (const making mk : makings) {
            const std::size_t ahead = mk.ahead;
            scenario sc{.devices = devs, .per = 3 + seed % 5, .policy = pol, .how = how, .progress = progress,
                        .prefetch = seed % 2 == 0, .steps_ahead = ahead, .staging = mk.staging, .seed = seed};
            sc.rows = sc.per * devs.size() * (6 + seed % 4) + seed % 7;
            ++seed;
            INFO("devices " << devs.size() << ", policy " << int(pol) << ", consumer " << int(how) << ", progress "
                            << progress << ", ahead " << ahead << ", staging " << sc.staging << ", prefetch "
                            << sc.prefetch << ", rows " << sc.rows
                            << ", per " << sc.per);
            const trace t = run(sc);
            CHECK(t.steps == expected_steps(sc));
            std::size_t want_rows = 0;  // rows the kernels check: padding included
            for (std::size_t k = 0, pos = 0; k < t.steps; ++k) {
              const std::size_t G = devs.size() * sc.per, m = std::min(G, sc.rows - pos);
              want_rows += pol == ferry::remainder_policy::pad ? G : m;
              pos += m;
            }
            CHECK(t.rows_checked == want_rows);
            check_clean(t);
          }
}

TEST_CASE("sim: the copies of step k+1 and the kernel of step k are not ordered either way") {
  for (auto how : {consumer::range_for, consumer::drop_first, consumer::host_waits})
    for (const making mk : makings) {
      const std::size_t ahead = mk.ahead;
      // Without a step made ahead, a consumer that waits on the host, or drops step k before
      // asking for step k+1, leaves nothing to overlap (documented in devices.hpp).
      if (ahead == 0 && how != consumer::range_for) continue;
      // The staging thread enqueues step k+1's copies when it gets to them: a consumer that
      // waits on the host for kernel k may do so first, and the simulator's one host clock
      // then orders the copies after it. On a GPU they run beside kernel k whenever the
      // stager is ahead, which it is when the consumer is the slower side.
      if (mk.staging && how == consumer::host_waits) continue;
      for (int progress : {0, 3}) {
        // Likewise, with a GPU that runs on its own (progress > 0) kernel k may have finished
        // when the stager gets to step k+1; its block is then free, and reusing it orders
        // nothing that could have overlapped. Without progress, kernel k is still queued, and
        // copy k+1 must not wait for it (the pool grows instead: grow_below).
        if (mk.staging && progress > 0) continue;
        scenario sc{.devices = {0, 1}, .per = 16, .rows = 16 * 2 * 12, .how = how, .progress = progress,
                    .steps_ahead = ahead, .staging = mk.staging, .seed = 7};
        INFO("consumer " << int(how) << ", ahead " << ahead << ", staging " << mk.staging << ", progress "
                         << progress);
        const trace t = run(sc);
        REQUIRE(t.steps == 12);
        for (std::size_t k = 0; k + 1 < t.steps; ++k) {
          INFO("step " << k);
          CHECK_FALSE(sim::happens_before(t.kernel[k], t.copy[k + 1]));  // copy k+1 need not wait for kernel k
          CHECK_FALSE(sim::happens_before(t.copy[k + 1], t.kernel[k]));  // nor kernel k for copy k+1
          CHECK(sim::happens_before(t.copy[k], t.kernel[k]));  // and the data is there first
        }
        if (ahead == 1 && !mk.staging)  // step k+1's copies (2 fields x 2 replicas) were enqueued when step k came
          for (std::size_t k = 0; k + 1 < t.steps; ++k) CHECK(t.copies_when_handed_out[k] == 4 * (k + 2));
        check_clean(t);
      }
    }
}

TEST_CASE("sim: steady state allocates nothing and never waits on the host" * doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));  // prefetch threads: never hang
  for (auto how : {consumer::range_for, consumer::drop_first})
    for (bool prefetch : {false, true}) {
      scenario sc{.devices = {0, 1}, .per = 32, .rows = 32 * 2 * 40, .how = how, .progress = 12, .prefetch = prefetch,
                  .seed = 3};
      INFO("consumer " << int(how) << ", prefetch " << prefetch);
      const trace t = run(sc);
      REQUIRE(t.steps == 40);
      CHECK(t.end.host_waits == t.warm.host_waits);
      CHECK(t.end.device_allocs == t.warm.device_allocs);
      if (!prefetch)  // all on this thread: the same every run
        CHECK(t.end.host_allocs == t.warm.host_allocs);
      else  // how far prefetch's thread runs ahead varies: its queue, one being collated,
            // the step handed out, the one made ahead, max_pending released; two fields each
        CHECK(t.end.host_allocs <= 2 * (2 + 1 + 1 + 1 + 4));
      CHECK(t.end.device_allocs <= 2 * 2);  // two blocks per replica
      CHECK(t.backpressure_waits == 0);
      check_clean(t);
    }
}

TEST_CASE("sim: with the staging thread, steady state allocates nothing and the blocks stay bounded" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));
  for (auto how : {consumer::range_for, consumer::drop_first, consumer::host_waits})
    for (std::size_t ahead : {1, 3})
      for (bool prefetch : {false, true}) {
        scenario sc{.devices = {0, 1}, .per = 32, .rows = 32 * 2 * 40, .how = how, .progress = 12,
                    .prefetch = prefetch, .steps_ahead = ahead, .staging = true, .seed = 3};
        INFO("consumer " << int(how) << ", ahead " << ahead << ", prefetch " << prefetch);
        const trace t = run(sc);
        REQUIRE(t.steps == 40);
        // Bounded, whatever the threads' timing (which sets how many are held at once, so
        // a new high may come late in the epoch). Per replica: the step handed out, `ahead`
        // queued, one being made, one released whose reuse waits on the GPU.
        CHECK(t.end.device_allocs <= 2 * (ahead + 3));
        // Pinned batches, two fields each: those above, max_pending released with copies in
        // flight, prefetch's queue and the one it collates.
        CHECK(t.end.host_allocs <= 2 * (ahead + 3 + 4 + 3));
        check_clean(t);
      }
}

TEST_CASE("sim: a GPU that lags behind meets bounded memory, not a growing queue") {
  for (std::size_t max_pending : {1, 4})
    for (const making mk : makings) {
      if (mk.ahead == 0) continue;
      scenario sc{.devices = {0, 1}, .per = 8, .rows = 8 * 2 * 60, .progress = 0, .steps_ahead = mk.ahead,
                  .staging = mk.staging, .max_pending = max_pending, .seed = 5};
      INFO("max_pending " << max_pending << ", ahead " << mk.ahead << ", staging " << mk.staging);
      const trace t = run(sc);
      REQUIRE(t.steps == 60);
      CHECK(t.backpressure_waits > 0);
      // Pinned batches: the pending ones, the step handed out, the ones made ahead, the one
      // being made, the one being collated - two fields each - however long the epoch.
      CHECK(t.end.host_allocs <= 2 * (max_pending + mk.ahead + 3));
      if (!mk.staging)  // one thread: stopped growing (with the stager, a late new high may come, bounded)
        CHECK(t.host_allocs_at[30] == t.end.host_allocs);
      CHECK(t.end.device_allocs <= 2 * (mk.staging ? mk.ahead + 3 : 2));
      check_clean(t);
    }
}

TEST_CASE("sim: leaving mid-epoch, with or without the last step kept, frees everything" * doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));  // prefetch threads: never hang
  for (auto how : {consumer::range_for, consumer::drop_first})
    for (std::size_t stop : {1, 2, 5})
      for (int progress : {0, 5})
        for (bool staging : {false, true}) {
        scenario sc{.devices = {1, 0}, .per = 4, .rows = 4 * 2 * 10, .how = how, .progress = progress,
                    .prefetch = true, .steps_ahead = staging ? 3u : 1u, .staging = staging, .seed = 11 + stop,
                    .stop_after = stop};
        INFO("consumer " << int(how) << ", stop after " << stop << ", progress " << progress << ", staging "
                         << staging);
        const trace t = run(sc);
        CHECK(t.steps == stop);
        check_clean(t);
      }
}

TEST_CASE("sim: a failing copy is a cuda_error naming the call and the device; nothing leaks" * doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));  // the staging thread: never hang
  for (int nth : {1, 2, 7})
    for (bool staging : {false, true}) {
    INFO("copy " << nth << ", staging " << staging);
    sim::reset(21, 2);
    const auto data = make_data(8 * 2 * 10);
    {
      auto pool = ferry::make_pinned_pool();
      auto steps = ferry::from_range(data) | ferry::batch(16) |
                   ferry::distribute(ferry::cuda::devices{0, 1},
                                     {.host_resource = pool, .steps_ahead = staging ? 2u : 1u, .staging_thread = staging});
      sim::fail_copy(nth, cudaErrorIllegalAddress);
      bool threw = false;
      try {
        for (auto& st : steps) (void)st;
      } catch (const ferry::cuda_error& e) {
        threw = true;
        CHECK(e.call().find("cudaMemcpyAsync") != std::string::npos);
        CHECK(e.status() == cudaErrorIllegalAddress);
        CHECK((e.device() == 0 || e.device() == 1));
        CHECK(std::string(e.what()).find("cudaErrorIllegalAddress") != std::string::npos);
      }
      CHECK(threw);
    }
    sim::drain();
    for (const auto& v : sim::violations()) FAIL_CHECK(v);
    CHECK(sim::stats().live_device_blocks == 0);
    CHECK(sim::stats().live_events == 0);
    CHECK(sim::stats().live_streams == 0);
  }
}

TEST_CASE("sim: save with a step made ahead resumes at the next undelivered step" * doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));  // the staging thread: never hang
  const auto data = make_data(8 * 2 * 10);
  auto pool = ferry::make_pinned_pool();
  for (std::size_t stop : {1, 4, 9})
    for (bool staging : {false, true}) {
    INFO("stop " << stop << ", staging " << staging);
    const ferry::distribute_options o{.host_resource = pool, .steps_ahead = staging ? 3u : 1u, .staging_thread = staging};
    sim::reset(31, 3);
    ferry::pipeline_state saved;
    {
      auto steps = ferry::from_range(data) | ferry::batch(16) | ferry::distribute(ferry::cuda::devices{0, 1}, o);
      for (std::size_t k = 0; k < stop; ++k) REQUIRE(steps.next());
      saved = ferry::save_state(steps);
    }
    {
      auto steps = ferry::from_range(data) | ferry::batch(16) | ferry::distribute(ferry::cuda::devices{0, 1}, o);
      ferry::restore_state(steps, saved);
      auto st = steps.next();
      REQUIRE(st);
      CHECK(st->index() == stop);
      CHECK(st->host_batch().field<0>()[0] == std::uint32_t(stop * 16 + 1));  // ids start at 1
    }
    sim::drain();
    for (const auto& v : sim::violations()) FAIL_CHECK(v);
  }
}

TEST_CASE("sim: steps_ahead other than 0 or 1, or 1 to 64 with the staging thread, is a config error") {
  const auto data = make_data(64);
  CHECK_THROWS_WITH_AS(ferry::from_range(data) | ferry::batch(16) |
                           ferry::distribute(ferry::cuda::devices{0}, {.steps_ahead = 2}),
                       doctest::Contains("staging_thread"), ferry::config_error);
  for (std::size_t bad : {0, 65})
    CHECK_THROWS_WITH_AS(ferry::from_range(data) | ferry::batch(16) |
                             ferry::distribute(ferry::cuda::devices{0}, {.steps_ahead = bad, .staging_thread = true}),
                         doctest::Contains("steps_ahead"), ferry::config_error);
}

// A device step is valid only until the next is asked for (its blocks go back to the pool
// for the next copies): prefetch or shuffle after distribute would hand out steps whose
// blocks already hold later rows. distribute refuses to be pulled where a stage holds what
// it pulls, before it makes a step, whatever wraps the step (an inline map to a pair here),
// and every later next() says so again (no hang); the pipeline is torn down cleanly.
TEST_CASE("sim: prefetch or shuffle after distribute onto devices is a config_error at the first step" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));  // prefetch's thread: never hang
  sim::reset(5, 2);
  const auto data = make_data(64);
  for (const bool staging : {false, true}) {
    CAPTURE(staging);
    const auto steps = [&] {
      return ferry::from_range(data) | ferry::batch(16) |
             ferry::distribute(ferry::cuda::devices{0, 1}, {.steps_ahead = staging ? 2u : 1u, .staging_thread = staging});
    };
    const auto wrap = [](ferry::step<elem>&& st) { return std::make_pair(std::move(st), 1); };
    {
      auto p = steps() | ferry::prefetch(2);
      for (int k = 0; k < 3; ++k)
        CHECK_THROWS_WITH_AS(p.next(), doctest::Contains("distribute onto devices is pulled by prefetch's thread"),
                             ferry::config_error);
    }
    {
      auto p = steps() | ferry::map(wrap) | ferry::prefetch(2);
      CHECK_THROWS_WITH_AS(p.next(), doctest::Contains("is pulled by prefetch's thread"), ferry::config_error);
    }
    {
      auto p = steps() | ferry::shuffle(4, 1);
      CHECK_THROWS_WITH_AS(p.next(), doctest::Contains("distribute onto devices is pulled by shuffle"),
                           ferry::config_error);
    }
    {  // a window of one holds nothing: allowed
      std::size_t n = 0;
      for (auto& st : steps() | ferry::shuffle(1, 1)) n += st.valid();
      CHECK(n == 64);
    }
    sim::drain();
    for (const auto& v : sim::violations()) FAIL_CHECK(v);
    const auto st = sim::stats();
    CHECK(st.live_device_blocks == 0);
    CHECK(st.live_events == 0);
  }
}

// The refusal's mark is the thread's, so it is cleared while user code runs there: a map's
// function (inline or on workers), a generator, a filter's predicate, or flat_map's or
// interleave's function that builds and drains a device pipeline of its own (one training
// run each) holds nothing and is not refused. A function that hands out a step pulled from
// another device pipeline still is.
TEST_CASE("sim: user code on a holder's thread may drain a device pipeline of its own" * doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));  // prefetch's thread and map's workers: never hang
  sim::reset(5, 2);
  const auto data = make_data(64);
  const auto steps = [&] {
    return ferry::from_range(data) | ferry::batch(16) | ferry::distribute(ferry::cuda::devices{0, 1});
  };
  const auto run = [&] {  // a training run of its own: every row once
    std::size_t n = 0;
    for (auto& st : steps()) n += st.valid();
    return n;
  };
  const std::vector<int> runs{0, 1, 2, 3, 4};
  const auto all_full = [&](auto&& p) {
    std::size_t k = 0;
    for (const std::size_t n : p) {
      CHECK(n == 64);
      ++k;
    }
    CHECK(k == runs.size());
  };
  all_full(ferry::from_range(runs) | ferry::map([&](int) { return run(); }) | ferry::prefetch(2));
  all_full(ferry::from_range(runs) | ferry::map([&](int) { return run(); }, {.workers = 2}));
  all_full(ferry::from_range(runs) | ferry::map([&](int) { return run(); }, {.workers = 2}) | ferry::prefetch(2));
  all_full(ferry::from_generator(runs.size(), [&](std::uint64_t) { return run(); }) | ferry::prefetch(2));
  all_full(ferry::from_generator(runs.size(), [&](std::uint64_t) { return run(); }) | ferry::shuffle(4, 1));
  all_full(ferry::from_range(runs) | ferry::filter([&](int) { return run() == 64; }) |
           ferry::map([](int) { return std::size_t{64}; }) | ferry::prefetch(2));
  const auto one_run = [&](int) { return std::vector<std::size_t>{run()}; };
  all_full(ferry::from_range(runs) | ferry::flat_map(one_run) | ferry::prefetch(2));
  for (const std::size_t workers : {0, 2})
    all_full(ferry::from_range(runs) |
             ferry::interleave([&](int i) { return ferry::from_range(one_run(i)); }, {.workers = workers, .cycle = 2}) |
             ferry::prefetch(2));
  {  // prefetch's thread holds what the function hands out: a step pulled from elsewhere is refused
    auto other = steps();
    auto p = ferry::from_range(runs) | ferry::map([&](int) { return std::move(*other.next()); }) | ferry::prefetch(2);
    CHECK_THROWS_WITH_AS(p.next(), doctest::Contains("distribute onto devices is pulled by prefetch's thread"),
                         ferry::config_error);
  }
  CHECK(ferry::detail::holds_ahead == nullptr);  // the consumer's thread is left unmarked
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  const auto st = sim::stats();
  CHECK(st.live_device_blocks == 0);
  CHECK(st.live_events == 0);
}

TEST_CASE("sim: the end of the epoch releases the last step, as asking for another step does" * doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));  // the staging thread: never hang
  for (const making mk : makings) {
    INFO("ahead " << mk.ahead << ", staging " << mk.staging);
    sim::reset(41, 2);
    const auto data = make_data(16 * 5);
    {
      auto pool = ferry::make_pinned_pool();
      auto steps = ferry::from_range(data) | ferry::batch(16) |
                   ferry::distribute(ferry::cuda::devices{0, 1},
                                     {.host_resource = pool, .steps_ahead = mk.ahead, .staging_thread = mk.staging});
      std::optional<ferry::step<elem>> held;  // the last step stays alive past the end
      std::size_t n = 0;
      for (auto s = steps.next(); s; s = steps.next(), ++n) held = std::move(s);
      CHECK(n == 5);
      REQUIRE(held);
      CHECK(steps.backend().pool_stats(0).outstanding == 0);
      CHECK(steps.backend().pool_stats(1).outstanding == 0);
      CHECK_FALSE(steps.next());  // and the end stays the end
    }
    sim::drain();
    for (const auto& v : sim::violations()) FAIL_CHECK(v);
    CHECK(sim::stats().live_device_blocks == 0);
  }
}

TEST_CASE("sim: an upstream that cannot be checkpointed still runs; only save_state fails" * doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));  // map workers: never hang
  for (bool staging : {false, true}) {
  INFO("staging " << staging);
  sim::reset(51, 3);
  const auto data = make_data(16 * 10);
  {
    auto pool = ferry::make_pinned_pool();
    auto steps = ferry::from_range(data) | ferry::map([](elem e) { return e; }, {.workers = 2, .ordered = false}) |
                 ferry::batch(16) |
                 ferry::distribute(ferry::cuda::devices{0, 1},
                                   {.host_resource = pool, .steps_ahead = staging ? 2u : 1u, .staging_thread = staging});
    std::size_t n = 0;
    for (auto& st : steps) {
      (void)st;
      if (++n == 3) CHECK_THROWS_AS(ferry::save_state(steps), ferry::config_error);
    }
    CHECK(n == 10);
  }
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  }
}

TEST_CASE("sim: restore after some steps drops the steps made ahead and resumes where saved" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));
  for (const making mk : makings) {
  INFO("ahead " << mk.ahead << ", staging " << mk.staging);
  sim::reset(61, 2);
  const auto data = make_data(16 * 8);
  {
    auto pool = ferry::make_pinned_pool();
    auto steps = ferry::from_range(data) | ferry::batch(16) |
                 ferry::distribute(ferry::cuda::devices{0, 1},
                                   {.host_resource = pool, .steps_ahead = mk.ahead, .staging_thread = mk.staging});
    REQUIRE(steps.next());
    REQUIRE(steps.next());
    const ferry::pipeline_state saved = ferry::save_state(steps);  // after steps 0 and 1
    REQUIRE(steps.next());                                        // step 2 (and 3 made ahead)
    ferry::restore_state(steps, saved);
    for (std::size_t k = 2; k < 8; ++k) {
      auto st = steps.next();
      REQUIRE(st);
      CHECK(st->index() == k);
      CHECK(st->host_batch().field<0>()[0] == std::uint32_t(k * 16 + 1));
    }
    CHECK_FALSE(steps.next());
  }
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  CHECK(sim::stats().live_device_blocks == 0);
  }
}

TEST_CASE("sim: the user's own compute streams are used, waited on, and left alive" * doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));  // the staging thread: never hang
  for (bool staging : {false, true}) {
  INFO("staging " << staging);
  sim::reset(71, 3);
  cudaStream_t mine[2] = {};
  for (int d = 0; d < 2; ++d) {
    REQUIRE(cudaSetDevice(d) == cudaSuccess);
    REQUIRE(cudaStreamCreateWithFlags(&mine[d], cudaStreamNonBlocking) == cudaSuccess);
  }
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  const auto data = make_data(16 * 6);
  {
    auto pool = ferry::make_pinned_pool();
    auto steps = ferry::from_range(data) | ferry::batch(16) |
                 ferry::distribute(ferry::cuda::devices({0, 1}, {mine[0], mine[1]}),
                                   {.host_resource = pool, .steps_ahead = staging ? 2u : 1u, .staging_thread = staging});
    std::size_t n = 0;
    for (auto& st : steps) {
      for (int r = 0; r < 2; ++r) {
        CHECK(st[r].stream() == mine[r]);  // typed: the cudaStream_t itself
        auto ids = st[r].field<0>();
        REQUIRE(cudaSetDevice(r) == cudaSuccess);
        const sim::op_id k = sim::launch(mine[r], "user kernel", {{ids.data(), ids.size_bytes()}}, {}, {});
        CHECK(sim::happens_before(sim::last_copy_into(ids.data()), k));
      }
      ++n;
    }
    CHECK(n == 6);
  }
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  CHECK(sim::stats().live_streams == 2);  // ferry destroyed its copy streams, not the user's
  CHECK(sim::stats().live_device_blocks == 0);
  for (auto s : mine) CHECK(cudaStreamDestroy(s) == cudaSuccess);
  CHECK(sim::stats().live_streams == 0);
  }
}

TEST_CASE("sim: a block whose reuse wait failed keeps its event: the next user still waits for the last") {
  sim::reset(5, 0);  // a lagging GPU: the last user's kernel has not run when the block is reused
  REQUIRE(cudaSetDevice(0) == cudaSuccess);  // the launches below are on device 0 streams
  {
    ferry::cuda::device_buffer_pool pool(0);
    ferry::cuda::stream a = ferry::cuda::stream::create(0), b = ferry::cuda::stream::create(0);
    void* p = pool.acquire(4096, a.get());
    sim::launch(a.get(), "last user", {}, {{p, 4096}}, [] {});
    cudaEvent_t done = pool.take_event();
    REQUIRE(cudaEventRecord(done, a.get()) == cudaSuccess);
    pool.release(p, 4096, done);
    sim::fail_wait(1, cudaErrorIllegalAddress);
    CHECK_THROWS_AS(pool.acquire(4096, b.get()), ferry::cuda_error);
    void* q = pool.acquire(4096, b.get());  // the same block, its wait succeeding now
    CHECK(q == p);
    sim::launch(b.get(), "next user", {}, {{q, 4096}}, [] {});
    pool.release(q, 4096, nullptr);
    sim::drain();
    // Without the event kept, "next user" would write the block unordered with "last user".
    for (const auto& v : sim::violations()) MESSAGE(v);
    CHECK(sim::violations().empty());
  }
  CHECK(sim::stats().live_device_blocks == 0);
}

// Padded batches (padded_batch, with_mask): each replica's rows of L values, their lengths
// and their mask reach its device, read by a kernel when the simulated GPU runs it; L
// changes from step to step, and after the longest step the pools allocate nothing more.
TEST_CASE("sim: padded batches of changing L reach every replica; no allocation after the longest step" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));
  using seq = std::pair<std::vector<std::int32_t>, std::int32_t>;
  constexpr std::size_t R = 2, per = 4, G = R * per, steps = 30, longest_step = 5;
  std::vector<seq> rows(G * steps);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const std::size_t len = i / G == longest_step && i % G == 3 ? 40 : (i * 7) % 13;
    for (std::size_t j = 0; j < len; ++j) rows[i].first.push_back(std::int32_t(i * 100 + j));
    rows[i].second = std::int32_t(i);
  }
  for (const making mk : makings) {
    INFO("ahead " << mk.ahead << ", staging " << mk.staging);
    sim::reset(11, 4);
    std::mutex m;
    std::vector<std::string> wrong;
    std::uint64_t rows_checked = 0, allocs_after_longest = 0;
    {
      ferry::cuda::devices dev({0, 1});
      auto p = ferry::from_range(rows) | ferry::padded_batch(G, ferry::with_mask) |
               ferry::distribute(dev, {.host_resource = ferry::make_pinned_pool(), .steps_ahead = mk.ahead,
                                       .staging_thread = mk.staging});
      std::size_t k = 0;
      for (auto& st : p) {
        if (k == longest_step + 1) allocs_after_longest = sim::stats().device_allocs;
        std::size_t width = 0;
        for (std::size_t i = k * G; i < (k + 1) * G; ++i) width = std::max(width, rows[i].first.size());
        for (std::size_t r = 0; r < R; ++r) {
          auto& rb = st[r];
          REQUIRE(cudaSetDevice(rb.device()) == cudaSuccess);
          ferry::padded_view<std::int32_t> t = rb.field<0>();
          auto labels = rb.field<1>();
          ferry::padded_view<std::uint8_t> mask = rb.field<2>();
          REQUIRE(t.width == width);
          REQUIRE(mask.width == width);
          const std::size_t first = k * G + r * per;
          sim::launch(rb.stream(), "padded kernel",
                      {{t.values.data(), t.values.size_bytes()}, {t.lengths.data(), t.lengths.size_bytes()},
                       {labels.data(), labels.size_bytes()}, {mask.values.data(), mask.values.size_bytes()},
                       {mask.lengths.data(), mask.lengths.size_bytes()}},
                      {}, [&, t, labels, mask, first] {
                        std::lock_guard lk(m);
                        for (std::size_t i = 0; i < t.size(); ++i, ++rows_checked) {
                          const auto& want = rows[first + i];
                          bool ok = t.lengths[i] == want.first.size() && labels[i] == want.second;
                          for (std::size_t j = 0; ok && j < t.width; ++j)
                            ok = t[i][j] == (j < want.first.size() ? want.first[j] : 0) &&
                                 mask[i][j] == (j < want.first.size() ? 1 : 0);
                          ok = ok && mask.lengths[i] == t.lengths[i];
                          if (!ok) wrong.push_back("row " + std::to_string(first + i));
                        }
                      });
        }
        ++k;
      }
      CHECK(k == steps);
      if (!mk.staging)  // all on this thread: nothing at all after the longest step
        CHECK(sim::stats().device_allocs == allocs_after_longest);
      else  // the staging thread's pool grows to the blocks in flight (grow_below), then stops
        CHECK(sim::stats().device_allocs - allocs_after_longest <= R * (mk.ahead + 3));
      sim::drain();
    }
    for (const auto& w : wrong) FAIL_CHECK(w);
    CHECK(rows_checked == rows.size());
    for (const auto& v : sim::violations()) FAIL_CHECK(v);
    CHECK(sim::stats().live_device_blocks == 0);
  }
}

// A token budget (bucket_by_sequence_length's max_tokens): batch_size() is max_tokens rows,
// so distribute's G is large, while a batch of long rows has few. Each replica's block
// holds the step's rows of L values, not G/R rows of them: device memory stays within a
// few budgets' worth, whatever the step's shape.
TEST_CASE("sim: a token budget's steps take device memory for their rows, not G/R rows of L" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));
  using seq = std::pair<std::vector<std::int32_t>, std::int32_t>;
  constexpr std::size_t max_tokens = 2048, R = 2;
  std::vector<seq> rows;
  // 4 rows of 2048 tokens (batches of one: a replica with 1 row and one with none), then
  // short rows (batches of up to 2048 / 16 = 128 rows).
  for (std::int32_t i = 0; i < 4; ++i) rows.push_back({std::vector<std::int32_t>(max_tokens, i), i});
  for (std::int32_t i = 0; i < 1024; ++i) rows.push_back({std::vector<std::int32_t>(16, i), i});
  sim::reset(5, 4);
  std::mutex m;
  std::size_t most_used = 0, tokens = 0;
  {
    ferry::cuda::devices dev({0, 1});
    auto p = ferry::from_range(rows) |
             ferry::bucket_by_sequence_length([](const seq& s) { return s.first.size(); }, {64}, {},
                                              {.max_tokens = max_tokens}) |
             ferry::distribute(dev, {.remainder = ferry::remainder_policy::partial,
                                     .host_resource = ferry::make_pinned_pool(), .steps_ahead = 0});
    for (auto& st : p) {
      for (std::size_t r = 0; r < R; ++r) {
        REQUIRE(cudaSetDevice(st[r].device()) == cudaSuccess);
        ferry::padded_view<std::int32_t> t = st[r].field<0>();
        auto labels = st[r].field<1>();
        sim::launch(st[r].stream(), "count tokens",
                    {{t.values.data(), t.values.size_bytes()}, {t.lengths.data(), t.lengths.size_bytes()},
                     {labels.data(), labels.size_bytes()}},
                    {}, [&m, &tokens, t, labels] {  // tokens that are their row's label (as made above)
                      std::lock_guard lk(m);
                      for (std::size_t i = 0; i < t.size(); ++i)
                        for (std::size_t j = 0; j < t.lengths[i]; ++j) tokens += t[i][j] == labels[i];
                    });
        std::size_t free = 0, total = 0;
        REQUIRE(cudaMemGetInfo(&free, &total) == cudaSuccess);
        most_used = std::max(most_used, total - free);
      }
    }
    sim::drain();
  }
  CHECK(tokens == 4 * max_tokens + 1024 * 16);
  // A step's block: at most 2048 tokens of 4 bytes, its lengths and labels (a few KiB), per
  // step in flight. G/R rows of L = 2048 would be 1024 x 2048 x 4 bytes = 8 MiB a block.
  CHECK(most_used < std::size_t(1) << 20);
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  CHECK(sim::stats().live_device_blocks == 0);
}

// Ragged fields (batch() of vectors): each replica's values and its offsets, rebased to 0,
// reach its device, read by a kernel when the simulated GPU runs it; blocks grow to the
// largest step, then nothing more is allocated.
TEST_CASE("sim: ragged fields reach every replica with rebased offsets; no allocation after the largest step" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));
  using seq = std::pair<std::vector<std::int32_t>, std::int32_t>;
  constexpr std::size_t R = 2, per = 4, G = R * per, steps = 30, largest_step = 5;
  std::vector<seq> rows(G * steps);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const std::size_t len = i / G == largest_step && i % G == 6 ? 500 : (i * 7) % 13;
    for (std::size_t j = 0; j < len; ++j) rows[i].first.push_back(std::int32_t(i * 1000 + j));
    rows[i].second = std::int32_t(i);
  }
  for (const making mk : makings) {
    INFO("ahead " << mk.ahead << ", staging " << mk.staging);
    sim::reset(13, 4);
    std::mutex m;
    std::vector<std::string> wrong;
    std::uint64_t rows_checked = 0, allocs_after_largest = 0;
    {
      ferry::cuda::devices dev({0, 1});
      auto p = ferry::from_range(rows) | ferry::batch(G) |
               ferry::distribute(dev, {.host_resource = ferry::make_pinned_pool(), .steps_ahead = mk.ahead,
                                       .staging_thread = mk.staging});
      std::size_t k = 0;
      for (auto& st : p) {
        if (k == largest_step + 1) allocs_after_largest = sim::stats().device_allocs;
        for (std::size_t r = 0; r < R; ++r) {
          auto& rb = st[r];
          REQUIRE(cudaSetDevice(rb.device()) == cudaSuccess);
          ferry::ragged_view<std::int32_t> t = rb.field<0>();
          auto labels = rb.field<1>();
          const std::size_t first = k * G + r * per;
          sim::launch(rb.stream(), "ragged kernel",
                      {{t.values.data(), t.values.size_bytes()}, {t.offsets.data(), t.offsets.size_bytes()},
                       {labels.data(), labels.size_bytes()}},
                      {}, [&, t, labels, first] {
                        std::lock_guard lk(m);
                        if (t.offsets[0] != 0) wrong.push_back("offsets of row " + std::to_string(first));
                        for (std::size_t i = 0; i < t.size(); ++i, ++rows_checked) {
                          const auto& want = rows[first + i];
                          const auto got = t[i];
                          if (labels[i] != want.second ||
                              !std::equal(got.begin(), got.end(), want.first.begin(), want.first.end()))
                            wrong.push_back("row " + std::to_string(first + i));
                        }
                      });
        }
        ++k;
      }
      CHECK(k == steps);
      if (!mk.staging)
        CHECK(sim::stats().device_allocs == allocs_after_largest);
      else
        CHECK(sim::stats().device_allocs - allocs_after_largest <= R * (mk.ahead + 3));
      sim::drain();
    }
    for (const auto& w : wrong) FAIL_CHECK(w);
    CHECK(rows_checked == rows.size());
    for (const auto& v : sim::violations()) FAIL_CHECK(v);
    CHECK(sim::stats().live_device_blocks == 0);
  }
}

// Steps that keep growing (length-sorted sequences): each new largest step takes a larger
// block, and the smaller ones, once their last kernel is done, are freed rather than kept
// (a pool that kept one block of every size it passed held 120 for 2 in flight). Blocks
// are sized by classes, so a rising size allocates a few times per doubling, not each step.
// They are freed on the consumer's thread, between steps: the staging thread used to free
// them (a cudaFree, which waits for the device) while a trainer's replica threads may be
// half way through launching an NCCL all-reduce, NCCL's known deadlock.
TEST_CASE("sim: steps that keep growing keep a few blocks per replica, not one of every size" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));
  using seq = std::pair<std::vector<std::int32_t>, std::int32_t>;
  constexpr std::size_t R = 2, G = 8, steps = 120;
  std::vector<seq> rows(G * steps);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    rows[i].first.assign(i % G == 0 ? 16 * (i / G) + 1 : 1, std::int32_t(i));  // step k: L = 16k + 1
    rows[i].second = std::int32_t(i);
  }
  for (const making mk : makings) {
    INFO("ahead " << mk.ahead << ", staging " << mk.staging);
    sim::reset(17, 1);
    sim::frees_only_on_this_thread(true);
    std::uint64_t most_blocks = 0;
    std::size_t k = 0;
    {
      ferry::cuda::devices dev({0, 1});
      auto p = ferry::from_range(rows) | ferry::padded_batch(G) |
               ferry::distribute(dev, {.host_resource = ferry::make_pinned_pool(), .steps_ahead = mk.ahead,
                                       .staging_thread = mk.staging});
      for (auto& st : p) {
        for (std::size_t r = 0; r < R; ++r) {
          REQUIRE(cudaSetDevice(st[r].device()) == cudaSuccess);
          ferry::padded_view<std::int32_t> t = st[r].field<0>();
          // A last user of the block that the simulated GPU runs late: a block freed
          // before it ran would be a violation.
          sim::launch(st[r].stream(), "read", {{t.values.data(), t.values.size_bytes()}}, {}, [] {}, 1e-3);
        }
        most_blocks = std::max(most_blocks, sim::stats().live_device_blocks);
        ++k;
      }
      sim::drain();
    }
    CHECK(k == steps);
    // Blocks in flight: the step handed out, the steps made ahead, those released whose
    // kernels have not run (grow_below with the staging thread), per replica; and smaller
    // blocks retired while their last kernels have not run (at most the max_pending = 4
    // released steps the GPU may lag behind), freed by a later step without a host wait.
    CHECK(most_blocks <= R * (mk.ahead + (mk.staging ? 6 : 3) + 4));
    // Old: one allocation per step and replica (240). A block grows by half at least:
    // from ~0.3 to ~31 KiB, a dozen sizes, each a block or a few in flight: 36 on the
    // consumer's thread; with the staging thread, how many of each size depends on which
    // kernels have run when it asks (64 to 80 seen), so half the old count bounds it.
    CHECK(sim::stats().device_allocs < (mk.staging ? R * steps / 2 : R * steps / 3));
    MESSAGE("most blocks " << most_blocks << ", allocations " << sim::stats().device_allocs);
    for (const auto& v : sim::violations()) FAIL_CHECK(v);
    CHECK(sim::stats().live_device_blocks == 0);
  }
}

// A pinned pool past its bound frees blocks (cudaFreeHost, which waits for the device) as
// host batches come back; the staging thread did that beside a trainer's replica threads
// launching an NCCL all-reduce, the hazard of the test above. Now the consumer's next()
// frees them. Steps of varying size through a pool capped at 16 KiB: most of its blocks go
// back to the driver, each step.
TEST_CASE("sim: pinned blocks are freed on the consumer's thread, also with the staging thread" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));
  using seq = std::pair<std::vector<std::int32_t>, std::int32_t>;
  constexpr std::size_t G = 8, steps = 60;
  std::vector<seq> rows(G * steps);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    rows[i].first.assign(1 + (i * 37) % 700, std::int32_t(i));  // L from 1 to 700, varying
    rows[i].second = std::int32_t(i);
  }
  for (const making mk : makings) {
    INFO("ahead " << mk.ahead << ", staging " << mk.staging);
    sim::reset(23, 1);
    sim::frees_only_on_this_thread(true);
    auto pool = ferry::make_pinned_pool(16 << 10);
    std::size_t k = 0;
    std::uint64_t freed_while_running = 0;
    std::mutex m;
    std::size_t rows_right = 0;  // by kernels: each row's first value is its index
    {
      auto p = ferry::from_range(rows) | ferry::padded_batch(G) |
               ferry::distribute(ferry::cuda::devices{0, 1},
                                 {.host_resource = pool, .steps_ahead = mk.ahead, .staging_thread = mk.staging});
      for (auto& st : p) {
        for (std::size_t r = 0; r < 2; ++r) {
          REQUIRE(cudaSetDevice(st[r].device()) == cudaSuccess);
          ferry::padded_view<std::int32_t> t = st[r].field<0>();
          const std::size_t first = k * G + r * G / 2;
          sim::launch(st[r].stream(), "read", {{t.values.data(), t.values.size_bytes()}}, {},
                      [&m, &rows_right, t, first] {
                        std::lock_guard lk(m);
                        for (std::size_t i = 0; i < t.size(); ++i) rows_right += t[i][0] == std::int32_t(first + i);
                      });
        }
        ++k;
      }
      freed_while_running = pool->upstream_resource().deallocations();
      sim::drain();
    }
    CHECK(k == steps);
    CHECK(rows_right == rows.size());
    CHECK(freed_while_running > steps / 2);  // the pool did free blocks as it ran
    CHECK(pool->statistics().outstanding_bytes == 0);
    MESSAGE("pinned blocks freed while running " << freed_while_running);
    for (const auto& v : sim::violations()) FAIL_CHECK(v);
    sim::frees_only_on_this_thread(false);
  }
}

// The same hazard on the pipeline's other threads: a batch of more than 16 MiB, collated on
// prefetch's thread, outgrows its first pinned block, which goes back to a pool past its
// bound and so to the driver there (cudaFreeHost, which waits for the device), beside a
// trainer's replica threads. ferry's own threads defer those frees to distribute's
// consumer too.
TEST_CASE("sim: pinned blocks let go on prefetch's thread are freed on the consumer's thread" * doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));
  using row = std::array<std::int32_t, 16384>;  // 64 KiB: a batch of 300 is 18.75 MiB
  constexpr std::size_t G = 300, steps = 6;
  std::vector<std::uint32_t> ids(G * steps);
  std::iota(ids.begin(), ids.end(), 0u);
  const auto make_row = [](std::uint32_t i) {
    row r{};
    r.front() = r.back() = std::int32_t(i);
    return r;
  };
  for (const making mk : makings) {
    INFO("ahead " << mk.ahead << ", staging " << mk.staging);
    sim::reset(29, 1);
    sim::frees_only_on_this_thread(true);
    auto pool = ferry::make_pinned_pool(16 << 10);
    std::size_t k = 0;
    std::uint64_t freed_while_running = 0;
    std::mutex m;
    std::size_t rows_right = 0;  // by kernels: each row's first and last value
    {
      auto p = ferry::from_range(ids) | ferry::map(make_row) | ferry::batch(G) | ferry::prefetch(1) |
               ferry::distribute(ferry::cuda::devices{0, 1},
                                 {.host_resource = pool, .steps_ahead = mk.ahead, .staging_thread = mk.staging});
      for (auto& st : p) {
        for (std::size_t r = 0; r < 2; ++r) {
          REQUIRE(cudaSetDevice(st[r].device()) == cudaSuccess);
          const std::span<const row> t = st[r].field<0>();
          const std::size_t first = k * G + r * G / 2;
          sim::launch(st[r].stream(), "read", {{t.data(), t.size_bytes()}}, {}, [&m, &rows_right, t, first] {
            std::lock_guard lk(m);
            for (std::size_t i = 0; i < t.size(); ++i)
              rows_right += t[i].front() == std::int32_t(first + i) && t[i].back() == std::int32_t(first + i);
          });
        }
        ++k;
      }
      freed_while_running = pool->upstream_resource().deallocations();
      sim::drain();
    }
    CHECK(k == steps);
    CHECK(rows_right == ids.size());
    CHECK(freed_while_running >= steps);  // each batch's first block, at least, went back to the driver
    CHECK(pool->statistics().outstanding_bytes == 0);
    MESSAGE("pinned blocks freed while running " << freed_while_running);
    for (const auto& v : sim::violations()) FAIL_CHECK(v);
    sim::frees_only_on_this_thread(false);
  }
}

// Host-only pipelines over a pinned pool, with no distribute: map's workers let blocks go
// (a function that drops the pinned batch it was given), and prefetch's thread does (a
// batch of more than 16 MiB outgrowing its first block). A consumer that is not one of
// ferry's threads (the test's) frees them in next(), and one that stops part way frees what
// the threads let go after its last call when they are joined: nothing piles up.
TEST_CASE("sim: pinned blocks let go on map's workers or prefetch's thread, with no distribute, are freed on the "
          "consumer's thread" * doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));
  using small_row = std::array<std::int32_t, 1024>;  // 4 KiB: batches of 64 are 256 KiB
  using big_row = std::array<std::int32_t, 16384>;   // 64 KiB: batches of 300 are 18.75 MiB
  constexpr std::size_t steps = 12;
  std::vector<std::uint32_t> ids(300 * steps);
  std::iota(ids.begin(), ids.end(), 0u);
  const auto sum_of = [](const auto& b) {
    std::uint64_t s = 0;
    for (const auto& r : b.template field<0>()) s += std::uint64_t(r.front());
    return s;
  };
  // Stopping after the first batch: the first next() starts the threads after it freed the
  // list, so a block let go for the first batch comes after the consumer's last call.
  for (const bool on_map : {true, false}) {
    for (const std::size_t stop_after : {steps, std::size_t(1)}) {
      INFO(std::string(on_map ? "map's workers" : "prefetch's thread") << ", consumer stops after " << stop_after);
      sim::reset(31, 1);
      sim::frees_only_on_this_thread(true);
      const std::uint64_t live_before = sim::stats().live_host_blocks;
      const std::size_t G = on_map ? 64 : 300;
      std::uint64_t sum = 0, want = 0, batches = 0, freed_while_running = 0;
      for (std::size_t i = 0; i < stop_after * G; ++i) want += i;
      {
        auto pool = ferry::make_pinned_pool(16 << 10);
        auto consume = [&](auto&& p) {
          for (std::uint64_t s : p) {
            sum += s;
            if (++batches == stop_after) break;
          }
          freed_while_running = pool->upstream_resource().deallocations();
        };
        const auto ids_in = std::span<const std::uint32_t>(ids).first(steps * G);
        if (on_map)
          consume(ferry::from_range(ids_in) | ferry::map([](std::uint32_t i) {
                    small_row r{};
                    r.front() = std::int32_t(i);
                    return r;
                  }) |
                  ferry::batch(G, {.resource = pool}) |
                  ferry::map([&](ferry::batch_of<small_row> b) { return sum_of(b); },  // dropped on the worker
                             {.workers = 2}));
        else
          consume(ferry::from_range(ids_in) | ferry::map([](std::uint32_t i) {
                    big_row r{};
                    r.front() = std::int32_t(i);
                    return r;
                  }) |
                  ferry::batch(G, {.resource = pool}) | ferry::prefetch(1) |
                  ferry::map([&](const ferry::batch_of<big_row>& b) { return sum_of(b); }));
      }
      // Every block the pool let go is back with the driver now.
      CHECK(sim::stats().live_host_blocks == live_before);
      CHECK(batches == stop_after);
      CHECK(sum == want);
      CHECK(freed_while_running >= 1);  // the pool let blocks go as it ran
      for (const auto& v : sim::violations()) FAIL_CHECK(v);
      sim::frees_only_on_this_thread(false);
    }
  }
}

// Blocks one of ferry's threads let go belong to its engine's list, handed up only by that
// engine's consumer: another pipeline's consumer, on another thread, frees none of them
// (a process-wide list did: a background prefetch freed a trainer pipeline's blocks).
TEST_CASE("sim: a pipeline's consumer frees only the pinned blocks its own threads let go" * doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));
  sim::reset(37, 1);
  ferry::pinned_resource res;
  const std::uint64_t live_before = sim::stats().live_host_blocks;
  void* block = res.allocate(1 << 20);
  ferry::detail::deferred_pinned_list theirs;  // another engine's: a thread of it lets `block` go
  std::thread([&] {
    ferry::detail::pinned_frees_to = &theirs;
    res.deallocate(block, 1 << 20);
  }).join();
  CHECK(sim::stats().live_host_blocks == live_before + 1);  // deferred, not freed
  sim::frees_only_on_this_thread(true);
  std::vector<int> v(2000);
  std::iota(v.begin(), v.end(), 0);
  std::thread([&] {  // a host-only pipeline's consumer with a producer and map's workers
    long sum = 0;
    for (int x : ferry::from_range(v) | ferry::prefetch(1) | ferry::map([](int x) { return x + 1; }, {.workers = 2}))
      sum += x;
    CHECK(sum == 2000L * 2001 / 2);
  }).join();
  CHECK(sim::violations().empty());
  CHECK(sim::stats().live_host_blocks == live_before + 1);  // still theirs
  ferry::detail::hand_up(theirs);                           // their consumer: this thread
  CHECK(sim::stats().live_host_blocks == live_before);
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  sim::frees_only_on_this_thread(false);
}

// A copy that fails after another copy of the same replica was queued: the step's host
// batch must not go back to its pool (to be refilled by the next batch) while the queued
// copy may still read it.
TEST_CASE("sim: a step whose copy failed keeps its host batch until the copies queued before are done" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));
  sim::reset(19, 0);  // the GPU runs only when the host waits
  const auto data = make_data(16 * 4);
  auto pool = ferry::make_pinned_pool();
  {
    auto p = ferry::from_range(data) | ferry::batch(16) |
             ferry::distribute(ferry::cuda::devices{0}, {.host_resource = pool, .steps_ahead = 0});
    sim::fail_copy(2, cudaErrorLaunchFailure);  // field 0's copy queued, field 1's fails
    CHECK_THROWS_AS((void)p.next(), ferry::cuda_error);
    // The batch is back in its pool only once nothing queued reads it.
    CHECK(pool->statistics().outstanding_bytes == 0);
    CHECK(sim::pending_copies() == 0);
  }
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  CHECK(sim::stats().live_device_blocks == 0);
}

// report() over distribute: with the staging thread its row is made of two threads'
// counters; the time that thread spends in the upstream is the upstream's, not
// distribute's (it used to name distribute the bottleneck behind a slow map, busy 100%,
// its consumer's waits unreported).
TEST_CASE("sim: report() names a slow upstream the bottleneck, with or without the staging thread" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));
  ferry::enable_stats();
  struct off {
    ~off() { ferry::enable_stats(false); }
  } guard;
  for (const bool staging : {false, true}) {
    INFO("staging " << staging);
    sim::reset(29, 4);
    std::vector<float> data(64 * 20, 1.0f);
    {
      auto steps = ferry::from_range(data) | ferry::map([](float x) {
                     // A slow fn: 100 us of work (a spin, so the time is the map's own).
                     const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(100);
                     while (std::chrono::steady_clock::now() < until) {
                     }
                     return x;
                   }) |
                   ferry::batch(64) |
                   ferry::distribute(ferry::cuda::devices{0}, {.host_resource = ferry::make_pinned_pool(),
                                                               .steps_ahead = staging ? 2u : 1u,
                                                               .staging_thread = staging});
      std::size_t n = 0;
      for (auto& st : steps) n += st.global_size();
      CHECK(n == data.size());
      const ferry::pipeline_report r = ferry::report(steps);
      MESSAGE(r.summary());
      CHECK(r.bottleneck == "map");
      REQUIRE(r.stages.size() == 4);
      const auto& d = r.stages.back();
      CHECK(d.kind == "distribute");
      CHECK(d.elements == 20);
      CHECK(d.busy < 0.5);  // ~0.01 here, 0.26-0.32 under TSan; it was 0.998 (the whole upstream)
      if (staging) CHECK(d.wait_upstream > 0.5);  // its consumer waited for the staging thread
      ferry::reset_stats(steps);
      CHECK(ferry::report(steps).stages.back().elements == 0);
      sim::drain();
    }
    for (const auto& v : sim::violations()) FAIL_CHECK(v);
  }
}
