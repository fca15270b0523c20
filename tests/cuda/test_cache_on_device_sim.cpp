// cache_on_device on GPU replicas, against the simulated CUDA runtime (tests/cuda/sim): the
// gather stands in as a simulated kernel running the host gather (the oracle the real
// kernel in cache_on_device.cuh implements), so what is checked here is the stage's device
// logic: later epochs equal the host replicas' (same seed, same rows per replica), no copy
// at all and no allocation after the first reorder, every access ordered on the replicas'
// streams (the simulator's race check: the consumer's kernels read what the gather wrote,
// the next gather waits for them), the budget's stream choice frees the device memory.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>  // the simulator's (this test's include path puts it first)

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <tuple>
#include <vector>

#include "ferry/cuda/devices.hpp"
#include "ferry/memory/pinned.hpp"
#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/cache_on_device.hpp"
#include "ferry/stages/distribute.hpp"

namespace {

using u64 = std::uint64_t;
using row = std::tuple<u64, std::array<u64, 2>>;
using epoch_rows = std::vector<std::vector<u64>>;

// The gather as a simulated kernel: the host gather, run when the simulator runs the
// stream, its ranges checked for races.
struct sim_gather {
  static void launch(const ferry::detail::gather_args& a, ferry::cuda_stream s) {
    const std::size_t n = std::size_t(a.rows) * a.row_bytes;
    sim::launch(static_cast<cudaStream_t>(s), "gather", {{a.src, n}}, {{a.dst, n}},
                [a] { ferry::detail::gather_rows_host(a); });
  }
};
constexpr ferry::detail::cache_on_device_t<sim_gather> sim_cache{};

// A gather whose launch fails once, at the n-th call (as a real launch can).
int fail_at = 0;
struct failing_gather {
  static void launch(const ferry::detail::gather_args& a, ferry::cuda_stream s) {
    if (--fail_at == 0) throw ferry::config_error("simulated launch failure");
    sim_gather::launch(a, s);
  }
};
constexpr ferry::detail::cache_on_device_t<failing_gather> failing_cache{};

std::vector<row> make_rows(u64 n) {
  std::vector<row> v;
  for (u64 i = 0; i < n; ++i) v.push_back(row{i, {i * 3, i * 7}});
  return v;
}

// One epoch read the way a model reads it: a simulated kernel on the replica's stream
// copies each field out, when the stream runs it.
template <class P>
epoch_rows epoch_of(P& p, bool rewind = true) {
  epoch_rows out;
  std::vector<std::vector<std::array<u64, 3>>> seen;
  std::mutex m;
  for (auto& st : p) {
    if (seen.empty()) seen.resize(st.replicas());
    for (std::size_t r = 0; r < st.replicas(); ++r) {
      const auto& rb = st[r];
      const auto a = rb.template field<0>();
      const auto b = rb.template field<1>();
      const std::size_t n = rb.valid();
      if (n == 0) continue;
      const int prev = [] {
        int d = 0;
        cudaGetDevice(&d);
        return d;
      }();
      cudaSetDevice(rb.device());
      sim::launch(static_cast<cudaStream_t>(rb.stream()), "model", {{a.data(), n * 8}, {b.data(), n * 16}}, {},
                  [&seen, &m, r, a, b, n] {
                    std::lock_guard<std::mutex> l(m);
                    for (std::size_t i = 0; i < n; ++i) seen[r].push_back({a[i], b[i][0], b[i][1]});
                  });
      cudaSetDevice(prev);
    }
  }
  sim::drain();
  for (const auto& v : seen) {
    out.emplace_back();
    for (const auto& x : v) {
      REQUIRE(x[1] == x[0] * 3);
      REQUIRE(x[2] == x[0] * 7);
      out.back().push_back(x[0]);
    }
  }
  if (rewind) p.rewind();
  return out;
}

}  // namespace

TEST_CASE("sim: cache_on_device serves later epochs from device memory, no copy, no allocation, no race") {
  for (int progress : {0, 3}) {
    CAPTURE(progress);
    sim::reset(7, progress);
    const auto data = make_rows(240);
    std::vector<epoch_rows> dev, host;
    sim::counters after0{}, after1{};
    std::size_t bytes = 0;
    {
      auto pool = ferry::make_pinned_pool();
      auto p = ferry::from_range(data) | ferry::batch(24) |
               ferry::distribute(ferry::cuda::devices{0, 1}, {.host_resource = pool}) | sim_cache({.seed = 9});
      dev.push_back(epoch_of(p));
      after0 = sim::stats();
      dev.push_back(epoch_of(p));
      after1 = sim::stats();
      dev.push_back(epoch_of(p));
      const sim::counters after2 = sim::stats();
      CHECK(p.cached());
      CHECK(after1.copies == after0.copies);  // nothing copied after epoch 0
      CHECK(after2.copies == after0.copies);
      CHECK(after2.device_allocs == after1.device_allocs);  // the epoch buffers, made once
      bytes = p.bytes_per_replica();
    }
    CHECK(bytes == 2 * 120 * 24);
    // The same rows per replica as host replicas, in the same orders (the same seed).
    auto h = ferry::from_range(data) | ferry::batch(24) | ferry::distribute(ferry::host_replicas{2}) |
             ferry::cache_on_device({.seed = 9});
    for (int e = 0; e < 3; ++e) {
      epoch_rows er;
      for (auto& st : h) {
        er.resize(st.replicas());
        for (std::size_t r = 0; r < st.replicas(); ++r)
          for (std::size_t i = 0; i < st[r].valid(); ++i) er[r].push_back(st[r].field<0>()[i]);
      }
      h.rewind();
      host.push_back(er);
    }
    CHECK(dev == host);
    CHECK(dev[1] != dev[0]);
    sim::drain();
    for (const auto& v : sim::violations()) FAIL_CHECK(v);
    CHECK(sim::stats().live_device_blocks == 0);
  }
}

TEST_CASE("sim: over budget with over_budget::stream frees the cache and streams every epoch") {
  sim::reset(3, 2);
  const auto data = make_rows(240);
  {
    auto pool = ferry::make_pinned_pool();
    auto p = ferry::from_range(data) | ferry::batch(24) |
             ferry::distribute(ferry::cuda::devices{0, 1}, {.host_resource = pool}) |
             sim_cache({.budget_bytes = 3000, .when_over = ferry::over_budget::stream});
    const epoch_rows e0 = epoch_of(p);
    const auto c0 = sim::stats().copies;
    const epoch_rows e1 = epoch_of(p);
    CHECK(!p.cached());
    CHECK(e0 == e1);
    CHECK(sim::stats().copies > c0);  // streamed: the upstream's copies again
  }
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  CHECK(sim::stats().live_device_blocks == 0);
}

TEST_CASE("sim: a reorder that fails part way gives the cache up: the upstream serves, in its order") {
  sim::reset(5, 2);
  const auto data = make_rows(240);
  {
    auto pool = ferry::make_pinned_pool();
    auto p = ferry::from_range(data) | ferry::batch(24) |
             ferry::distribute(ferry::cuda::devices{0, 1}, {.host_resource = pool}) | failing_cache({.seed = 9});
    const epoch_rows e0 = epoch_of<decltype(p)>(p, false);
    fail_at = 3;  // the second replica's first field, at the first reorder
    CHECK_THROWS_WITH_AS(p.rewind(), "simulated launch failure", ferry::config_error);
    CHECK(!p.cached());
    CHECK(epoch_of<decltype(p)>(p, true) == e0);  // streamed: epoch 0's order again
  }
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  CHECK(sim::stats().live_device_blocks == 0);
}

TEST_CASE("sim: across_replicas with device replicas is a config_error at the first step, before anything is cached") {
  sim::reset(2, 2);
  const auto data = make_rows(96);
  {
    auto pool = ferry::make_pinned_pool();
    auto p = ferry::from_range(data) | ferry::batch(24) |
             ferry::distribute(ferry::cuda::devices{0, 1}, {.host_resource = pool}) |
             sim_cache({.seed = 3, .across_replicas = true});
    CHECK_THROWS_WITH_AS(p.next(), doctest::Contains("across_replicas with a device replica (replica 0, device 0)"),
                         ferry::config_error);
    CHECK(!p.cached());
  }
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  CHECK(sim::stats().live_device_blocks == 0);
}
