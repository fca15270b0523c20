// cache_on_device on GPU replicas, against the simulated CUDA runtime (tests/cuda/sim): the
// gather stands in as a simulated kernel running the host gather (the oracle the real
// kernel in cache_on_device.cuh implements), so what is checked here is the stage's device
// logic: later epochs equal the host replicas' (same seed, same rows per replica), no copy
// at all and no allocation after the first reorder, every access ordered on the replicas'
// streams (the simulator's race check: the consumer's kernels read what the gather wrote,
// the next gather waits for them), the budget's stream choice frees the device memory;
// across_replicas: the global gather reads the other GPU's cache through peer access.
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
#include "sim_cache_gather.hpp"

namespace {

using u64 = std::uint64_t;
using row = std::tuple<u64, std::array<u64, 2>>;
using epoch_rows = std::vector<std::vector<u64>>;
using epoch_rows_list = std::vector<epoch_rows>;

using ferry_test::sim_gather;
constexpr ferry::detail::cache_on_device_t<sim_gather> sim_cache{};

// A gather whose launch fails once, at the n-th call (as a real launch can).
int fail_at = 0;
struct failing_gather {
  static void launch(const ferry::detail::gather_args& a, ferry::cuda_stream s) {
    if (--fail_at == 0) throw ferry::config_error("simulated launch failure");
    sim_gather::launch(a, s);
  }
  static void launch_global(const ferry::detail::global_gather_args& a, ferry::cuda_stream s) {
    if (--fail_at == 0) throw ferry::config_error("simulated launch failure");
    sim_gather::launch_global(a, s);
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

// The same pipeline's epochs on two host replicas (the device ones' oracle).
std::vector<epoch_rows> host_epochs(const std::vector<row>& data, ferry::cache_on_device_options o,
                                    ferry::remainder_policy policy, int epochs) {
  auto h = ferry::from_range(data) | ferry::batch(24) | ferry::distribute(ferry::host_replicas{2}, {.remainder = policy}) |
           ferry::cache_on_device(o);
  std::vector<epoch_rows> out;
  for (int e = 0; e < epochs; ++e) {
    epoch_rows er;
    for (auto& st : h) {
      er.resize(st.replicas());
      for (std::size_t r = 0; r < st.replicas(); ++r)
        for (std::size_t i = 0; i < st[r].valid(); ++i) er[r].push_back(st[r].field<0>()[i]);
    }
    h.rewind();
    out.push_back(er);
  }
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
    host = host_epochs(data, {.seed = 9}, ferry::remainder_policy::drop, 3);
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

TEST_CASE("sim: across_replicas on two GPUs: the host replicas' orders, rows read from the peer, no copy, no race") {
  for (int progress : {0, 3}) {
    CAPTURE(progress);
    sim::reset(5, progress);
    const auto data = make_rows(250);  // a short last batch: replicas with different row counts
    const ferry::cache_on_device_options o{.seed = 4, .across_replicas = true};
    epoch_rows_list dev;
    {
      auto pool = ferry::make_pinned_pool();
      auto p = ferry::from_range(data) | ferry::batch(24) |
               ferry::distribute(ferry::cuda::devices{0, 1}, {.remainder = ferry::remainder_policy::partial, .host_resource = pool}) |
               sim_cache(o);
      dev.push_back(epoch_of(p));
      dev.push_back(epoch_of(p));
      const sim::counters after1 = sim::stats();
      dev.push_back(epoch_of(p));
      dev.push_back(epoch_of(p));
      const sim::counters after3 = sim::stats();
      CHECK(p.cached());
      CHECK(sim::peer_enabled(0, 1));
      CHECK(sim::peer_enabled(1, 0));
      CHECK(after3.copies == after1.copies);  // no copy after the first reorder (the layout's, once)
      CHECK(after3.device_allocs == after1.device_allocs);
    }
    CHECK(dev == host_epochs(data, o, ferry::remainder_policy::partial, 4));
    // Rows moved between the GPUs: replica 0 serves rows that replica 1 cached.
    const std::vector<u64> mine = [&] {
      auto v = dev[0][0];
      std::sort(v.begin(), v.end());
      return v;
    }();
    std::size_t foreign = 0;
    for (u64 id : dev[1][0]) foreign += !std::binary_search(mine.begin(), mine.end(), id);
    CHECK(foreign > dev[1][0].size() / 4);
    sim::drain();
    for (const auto& v : sim::violations()) FAIL_CHECK(v);
    CHECK(sim::stats().live_device_blocks == 0);
  }
}

TEST_CASE("sim: across_replicas over GPUs without peer access: a config_error at the first rewind, then the upstream") {
  sim::reset(2, 2);
  sim::deny_peer_access();
  const auto data = make_rows(96);
  {
    auto pool = ferry::make_pinned_pool();
    auto p = ferry::from_range(data) | ferry::batch(24) |
             ferry::distribute(ferry::cuda::devices{0, 1}, {.host_resource = pool}) |
             sim_cache({.seed = 3, .across_replicas = true});
    const epoch_rows e0 = epoch_of(p, false);
    CHECK_THROWS_WITH_AS(p.rewind(), doctest::Contains("GPU 0 cannot read GPU 1's memory (no peer access"),
                         ferry::config_error);
    CHECK(!p.cached());
    CHECK(epoch_of(p) == e0);  // streamed: the upstream's order
  }
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  CHECK(sim::stats().live_device_blocks == 0);
}
