// cache_on_device on GPU replicas, against the simulated CUDA runtime (tests/cuda/sim): the
// gather stands in as a simulated kernel running the host gather (the oracle the real
// kernel in cache_on_device.cuh implements), so what is checked here is the stage's device
// logic: later epochs equal the host replicas' (same seed, same rows per replica), no copy
// at all and no allocation after the first reorder, every access ordered on the replicas'
// streams (the simulator's race check: the consumer's kernels read what the gather wrote,
// the next gather waits for them), the budget's stream choice frees the device memory;
// across_replicas: the global gather reads the other GPU's cache through peer access, or
// (.devices) the replicas trade rows through the simulated NCCL, in one process or across
// two simulated ranks (threads, each with its own pipeline), one epoch ahead on a side stream.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>  // the simulator's (this test's include path puts it first)

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <numeric>
#include <span>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "ferry/collective/nccl.hpp"
#include "ferry/collective/rank_exchange.hpp"

#include "ferry/cuda/devices.hpp"
#include "ferry/memory/pinned.hpp"
#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/cache_on_device.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/map.hpp"
#include "ferry/stages/prefetch.hpp"
#include "ferry/stages/repeat.hpp"
#include "ferry/stages/take.hpp"
#include "sim_cache_gather.hpp"

// Allocations of exactly fail_size bytes on this thread throw std::bad_alloc, once (0: none):
// a rank whose allocation fails where the others' succeed. (operator new[] and the aligned
// forms come through here or pair with their own deletes.)
namespace {
thread_local std::size_t fail_size = 0;
}  // namespace
void* operator new(std::size_t n) {
  if (fail_size && n == fail_size) {
    fail_size = 0;
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"  // it is malloc's: the new above
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop

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
// copies each field out, when the stream runs it (into `seen`, per replica).
struct model_reads {
  std::vector<std::vector<std::array<u64, 3>>> seen;
  std::mutex m;
  std::vector<std::pair<int, cudaStream_t>> streams;  // the replicas'
  // The rows read, per replica (after the kernels ran); each row's fields checked.
  epoch_rows rows() const {
    epoch_rows out;
    for (const auto& v : seen) {
      out.emplace_back();
      for (const auto& x : v) {
        REQUIRE(x[1] == x[0] * 3);
        REQUIRE(x[2] == x[0] * 7);
        out.back().push_back(x[0]);
      }
    }
    return out;
  }
};
// (valid: with it, each step's real rows per replica.)
template <class P>
void enqueue_reads(P& p, model_reads& mr, std::vector<std::vector<std::size_t>>* valid = nullptr) {
  for (auto& st : p) {
    if (mr.seen.empty()) mr.seen.resize(st.replicas());
    if (valid) valid->emplace_back();
    for (std::size_t r = 0; r < st.replicas() && valid; ++r) valid->back().push_back(st[r].valid());
    for (std::size_t r = 0; r < st.replicas(); ++r) {
      const auto& rb = st[r];
      const auto a = rb.template field<0>();
      const auto b = rb.template field<1>();
      const std::size_t n = rb.valid();
      const std::pair<int, cudaStream_t> ds(rb.device(), static_cast<cudaStream_t>(rb.stream()));
      if (std::find(mr.streams.begin(), mr.streams.end(), ds) == mr.streams.end()) mr.streams.push_back(ds);
      if (n == 0) continue;
      const int prev = [] {
        int d = 0;
        cudaGetDevice(&d);
        return d;
      }();
      cudaSetDevice(rb.device());
      sim::launch(static_cast<cudaStream_t>(rb.stream()), "model", {{a.data(), n * 8}, {b.data(), n * 16}}, {},
                  [&mr, r, a, b, n] {
                    std::lock_guard<std::mutex> l(mr.m);
                    for (std::size_t i = 0; i < n; ++i) mr.seen[r].push_back({a[i], b[i][0], b[i][1]});
                  });
      cudaSetDevice(prev);
    }
  }
}
// (own_streams: wait for this pipeline's streams only, not the whole simulated machine:
// another thread's pipeline may be mid-epoch.)
template <class P>
epoch_rows epoch_of(P& p, bool rewind = true, bool own_streams = false) {
  model_reads mr;
  enqueue_reads(p, mr);
  if (!own_streams) sim::drain();
  else
    for (const auto& [d, st] : mr.streams) {
      cudaSetDevice(d);
      cudaStreamSynchronize(st);
    }
  epoch_rows out = mr.rows();
  if (rewind) p.rewind();
  return out;
}

// One epoch as global batches: each step's real rows, replica after replica (read as
// epoch_of reads them), then the rewind.
template <class P>
std::vector<std::vector<u64>> global_steps_of(P& p) {
  model_reads mr;
  std::vector<std::vector<std::size_t>> valid;
  enqueue_reads(p, mr, &valid);
  sim::drain();
  const epoch_rows rows = mr.rows();
  std::vector<std::vector<u64>> out;
  std::vector<std::size_t> at(rows.size());
  for (const auto& v : valid) {
    out.emplace_back();
    for (std::size_t r = 0; r < v.size(); ++r) {
      out.back().insert(out.back().end(), rows[r].begin() + std::ptrdiff_t(at[r]),
                        rows[r].begin() + std::ptrdiff_t(at[r] + v[r]));
      at[r] += v[r];
    }
  }
  p.rewind();
  return out;
}

// The same pipeline's epochs on two host replicas (the device ones' oracle).
std::vector<epoch_rows> host_epochs(const std::vector<row>& data, ferry::cache_on_device_options o,
                                    ferry::remainder_policy policy, int epochs, std::size_t replicas = 2,
                                    std::size_t batch = 24) {
  auto h = ferry::from_range(data) | ferry::batch(batch) |
           ferry::distribute(ferry::host_replicas{replicas}, {.remainder = policy}) | ferry::cache_on_device(o);
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

// Four epochs of `data` on two simulated GPUs (batches of 24, partial remainder) into
// dev, the simulator's counters after the second and the fourth; whether the cache serves.
bool four_epochs(const std::vector<row>& data, const ferry::cache_on_device_options& o, epoch_rows_list& dev,
                 sim::counters& after1, sim::counters& after3) {
  auto pool = ferry::make_pinned_pool();
  auto p = ferry::from_range(data) | ferry::batch(24) |
           ferry::distribute(ferry::cuda::devices{0, 1},
                             {.remainder = ferry::remainder_policy::partial, .host_resource = pool}) |
           sim_cache(o);
  dev.push_back(epoch_of(p));
  dev.push_back(epoch_of(p));
  after1 = sim::stats();
  dev.push_back(epoch_of(p));
  dev.push_back(epoch_of(p));
  after3 = sim::stats();
  return p.cached();
}

// Simulated ranks: threads of one process, each a rank_exchange over shared memory. A
// collective waits at most a minute for the others (then throws: no test hangs).
class thread_ranks {
 public:
  explicit thread_ranks(int n) : n_(n), posted_(std::size_t(n)) {}
  class member final : public ferry::rank_exchange {
   public:
    member(thread_ranks& g, int r) : g_(g), r_(r) {}
    int rank() const override { return r_; }
    int size() const override { return g_.n_; }
    void all_gather(const void* mine, std::size_t bytes, void* all) override {
      g_.post(r_, {mine, nullptr, bytes});
      for (int p = 0; p < g_.n_; ++p)
        std::memcpy(static_cast<std::byte*>(all) + std::size_t(p) * bytes, g_.posted_[std::size_t(p)].data, bytes);
      g_.wait();  // nobody changes its buffer while another copies from it
    }
    void all_to_all(const void* send, const std::uint64_t* send_counts, void* recv, const std::uint64_t* recv_counts,
                    std::size_t unit) override {
      g_.post(r_, {send, send_counts, unit});
      std::size_t at = 0;
      for (int p = 0; p < g_.n_; ++p) {
        const auto& o = g_.posted_[std::size_t(p)];
        std::size_t from = 0;
        for (int q = 0; q < r_; ++q) from += o.counts[q];
        std::memcpy(static_cast<std::byte*>(recv) + at * unit, static_cast<const std::byte*>(o.data) + from * unit,
                    recv_counts[p] * unit);
        at += recv_counts[p];
      }
      g_.wait();
    }

   private:
    thread_ranks& g_;
    int r_;
  };

 private:
  struct post_t {
    const void* data;
    const std::uint64_t* counts;
    std::size_t bytes;
  };
  void post(int r, post_t p) {
    posted_[std::size_t(r)] = p;
    wait();
  }
  void wait() {
    std::unique_lock l(m_);
    const std::uint64_t gen = gen_;
    if (++arrived_ == n_) {
      arrived_ = 0, ++gen_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(l, std::chrono::seconds(60), [&] { return gen_ != gen; }))
      throw ferry::error("thread_ranks: a rank did not reach the collective in a minute");
  }
  int n_;
  std::vector<post_t> posted_;
  std::mutex m_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::uint64_t gen_ = 0;
};

// Two simulated ranks of two GPUs each (a clique of four NCCL ranks, a thread_ranks
// group): rank(w, its rank_exchange, its device_exchange) on a thread each, then the
// first exception either thrown, the communicators destroyed, the simulator drained and
// checked for races and leaks.
template <class Rank>
void two_sim_ranks(Rank&& rank) {
  const ncclUniqueId id = ferry::nccl_communicator::unique_id();
  std::array<std::vector<ferry::nccl_communicator>, 2> comms{ferry::nccl_communicator::join(id, 4, 0, {0, 1}),
                                                            ferry::nccl_communicator::join(id, 4, 2, {0, 1})};
  thread_ranks group(2);
  std::array<std::exception_ptr, 2> err;
  {
    std::vector<std::thread> threads;
    for (int w = 0; w < 2; ++w)
      threads.emplace_back([&, w] {
        try {
          thread_ranks::member me(group, w);
          ferry::nccl_device_exchange ex(comms[std::size_t(w)]);
          rank(w, me, ex);
        } catch (...) {
          err[std::size_t(w)] = std::current_exception();
        }
      });
    for (auto& t : threads) t.join();
  }
  for (auto& e : err)
    if (e) std::rethrow_exception(e);
  comms[0].clear();
  comms[1].clear();
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  CHECK(sim::stats().live_device_blocks == 0);
}

// Two simulated ranks of host replicas (a thread_ranks group): rank(w, its rank_exchange)
// on a thread each, then the first exception either thrown.
template <class Rank>
void two_host_ranks(Rank&& rank) {
  thread_ranks group(2);
  std::array<std::exception_ptr, 2> err;
  {
    std::vector<std::thread> threads;
    for (std::size_t w = 0; w < 2; ++w)
      threads.emplace_back([&, w] {
        try {
          thread_ranks::member me(group, int(w));
          rank(w, me);
        } catch (...) {
          err[w] = std::current_exception();
        }
      });
    for (auto& t : threads) t.join();
  }
  for (auto& e : err)
    if (e) std::rethrow_exception(e);
}

// Two ranks' parts of `data`, `steps` global batches of 48: rank w's step k is rows
// [48k + 24w, 48k + 24w + 24), so the job's global batch k is one process's batch of 48.
template <class Row>
std::array<std::vector<Row>, 2> rank_parts(const std::vector<Row>& data, std::size_t steps) {
  std::array<std::vector<Row>, 2> part;
  for (std::size_t k = 0; k < steps; ++k)
    for (std::size_t w = 0; w < 2; ++w)
      part[w].insert(part[w].end(), data.begin() + std::ptrdiff_t(48 * k + 24 * w),
                     data.begin() + std::ptrdiff_t(48 * k + 24 * w + 24));
  return part;
}
// Each rank's epochs (two replicas each) against one process's four host replicas' (want):
// global replica 2w + r is rank w's replica r.
void check_rank_epochs(const std::array<epoch_rows_list, 2>& got, const std::vector<epoch_rows>& want) {
  for (std::size_t w = 0; w < 2; ++w) REQUIRE(got[w].size() == want.size());
  for (std::size_t e = 0; e < want.size(); ++e)
    for (std::size_t w = 0; w < 2; ++w)
      for (std::size_t r = 0; r < 2; ++r) {
        CAPTURE(e);
        CAPTURE(w);
        CAPTURE(r);
        CHECK(got[w][e][r] == want[e][2 * w + r]);
      }
}

// `rows` in batches of 24 on two simulated GPUs (distribute's defaults, a pinned pool of its
// own), then `cache` with options o.
template <class Rows, class Cache>
auto on_two_gpus(const Rows& rows, Cache cache, const ferry::cache_on_device_options& o) {
  return ferry::from_range(rows) | ferry::batch(24) |
         ferry::distribute(ferry::cuda::devices{0, 1}, {.host_resource = ferry::make_pinned_pool()}) | cache(o);
}
// What the rewind throws (ferry::error), or "".
template <class P>
std::string rewind_error(P& p) {
  try {
    p.rewind();
  } catch (const ferry::error& e) {
    return e.what();
  }
  return {};
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
      auto p = on_two_gpus(data, sim_cache, {.seed = 9});
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
    auto p = on_two_gpus(data, sim_cache, {.budget_bytes = 3000, .when_over = ferry::over_budget::stream});
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

TEST_CASE("sim: under remainder_policy::pad the budget counts the padding rows served; the step over it is not lost") {
  sim::reset(17, 2);
  const auto data = make_rows(250);  // 11 steps of 12 rows a replica: replica 0 caches 130 rows, serves 132
  auto comms = ferry::nccl_communicator::local({0, 1});
  ferry::nccl_device_exchange ex(comms);
  const auto pipeline = [&](std::size_t budget, ferry::device_exchange* devices) {
    return ferry::from_range(data) | ferry::batch(24) |
           ferry::distribute(ferry::cuda::devices{0, 1}, {.remainder = ferry::remainder_policy::pad}) |
           sim_cache({.budget_bytes = budget, .seed = 6, .across_replicas = devices != nullptr, .devices = devices});
  };
  // Without .devices: the cache (130 rows) and the served copy (132) of 24 bytes; with it,
  // both blocks of 132 rows, and 80 bytes a cached row (its 16-byte field received, 64 the plan).
  using want = std::pair<ferry::device_exchange*, std::size_t>;
  for (const auto& [devices, need] : {want{nullptr, (130 + 132) * 24}, want{&ex, 2 * 132 * 24 + 130 * 80}}) {
    CAPTURE(devices != nullptr);
    {
      auto p = pipeline(need - 1, devices);
      std::size_t steps = 0;
      std::string what;
      for (;;) {
        try {
          if (!p.next()) break;
          ++steps;
        } catch (const ferry::config_error& e) {
          what = e.what();
        }
      }
      CHECK(what.find("2 zero rows padding its served steps") != std::string::npos);
      CHECK(steps == 11);  // the padded step, over the budget, handed out after the error
      p.rewind();
      CHECK(!p.cached());
      CHECK(p.bytes_per_replica() == 0);
    }
    {
      auto p = pipeline(need, devices);
      const epoch_rows e0 = epoch_of(p);
      CHECK(p.cached());
      if (!devices) CHECK(p.bytes_per_replica() == need);
      CHECK(epoch_of(p).size() == e0.size());
    }
  }
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  CHECK(sim::stats().live_device_blocks == 0);
}

TEST_CASE("sim: a reorder that fails part way gives the cache up: the upstream serves, in its order") {
  sim::reset(5, 2);
  const auto data = make_rows(240);
  {
    auto p = on_two_gpus(data, failing_cache, {.seed = 9});
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
      sim::counters after1, after3;
      CHECK(four_epochs(data, o, dev, after1, after3));
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

TEST_CASE("sim: short steps before epoch 0's last under partial (batch | repeat): each GPU serves epoch 0's step "
          "layout, the host replicas' global batches, own rows, peer reads or .devices") {
  sim::reset(3, 2);
  const auto data = make_rows(250);  // steps of 24 x 10, 10, 24 x 10, 10
  const auto host = [&](ferry::cache_on_device_options o) {
    auto h = ferry::from_range(data) | ferry::batch(24) | ferry::repeat(2) |
             ferry::distribute(ferry::host_replicas{2}, {.remainder = ferry::remainder_policy::partial}) |
             ferry::cache_on_device(o);
    std::vector<std::vector<std::vector<u64>>> out;
    for (int e = 0; e < 3; ++e) {
      out.emplace_back();
      for (auto& st : h) {
        out.back().emplace_back();
        for (std::size_t r = 0; r < st.replicas(); ++r)
          for (std::size_t i = 0; i < st[r].valid(); ++i) out.back().back().push_back(st[r].field<0>()[i]);
      }
      h.rewind();
    }
    CHECK(h.cached());
    return out;
  };
  for (int mode = 0; mode < 3; ++mode) {  // own rows; across_replicas by peer reads; by .devices (NCCL)
    CAPTURE(mode);
    auto comms = ferry::nccl_communicator::local({0, 1});
    ferry::nccl_device_exchange ex(comms);
    ferry::cache_on_device_options o{.seed = 8, .across_replicas = mode > 0, .devices = mode == 2 ? &ex : nullptr};
    std::vector<std::vector<std::vector<u64>>> dev;
    {
      auto pool = ferry::make_pinned_pool();
      auto p = ferry::from_range(data) | ferry::batch(24) | ferry::repeat(2) |
               ferry::distribute(ferry::cuda::devices{0, 1},
                                 {.remainder = ferry::remainder_policy::partial, .host_resource = pool}) |
               sim_cache(o);
      for (int e = 0; e < 3; ++e) dev.push_back(global_steps_of(p));
      CHECK(p.cached());
    }
    REQUIRE(dev[0].size() == 22);
    CHECK(dev[1][10].size() == 10);  // the short step stays where it was
    o.devices = nullptr;
    CHECK(dev == host(o));
    CHECK(dev[1] != dev[0]);
    sim::drain();
    for (const auto& v : sim::violations()) FAIL_CHECK(v);
  }
  CHECK(sim::stats().live_device_blocks == 0);
}

TEST_CASE("sim: across_replicas over GPUs without peer access: a config_error at the first rewind, then the upstream") {
  sim::reset(2, 2);
  sim::deny_peer_access();
  const auto data = make_rows(96);
  {
    auto p = on_two_gpus(data, sim_cache, {.seed = 3, .across_replicas = true});
    const epoch_rows e0 = epoch_of(p, false);
    CHECK_THROWS_WITH_AS(p.rewind(), doctest::Contains("GPU 0 cannot read GPU 1's memory (no peer access"),
                         ferry::config_error);
    CHECK(!p.cached());
    CHECK(epoch_of(p) == e0);  // streamed: the upstream's order
  }
  // With stages above it: they start their epochs as after a rewind (the stage streams),
  // then the error reaches the caller; they are not marked as failed (stage.hpp).
  {
    auto p = on_two_gpus(data, sim_cache, {.seed = 3, .across_replicas = true}) | ferry::take(1000) |
             ferry::repeat(1);
    const epoch_rows e0 = epoch_of(p, false);
    CHECK_THROWS_WITH_AS(p.rewind(), doctest::Contains("GPU 0 cannot read GPU 1's memory (no peer access"),
                         ferry::config_error);
    CHECK(epoch_of(p) == e0);
    CHECK(epoch_of(p) == e0);
  }
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  CHECK(sim::stats().live_device_blocks == 0);
}

TEST_CASE("sim: across_replicas with .devices (NCCL) on two GPUs without peer access: the host replicas' orders, "
          "no host-to-device byte and no allocation after the first reorder, no race") {
  for (int progress : {0, 3}) {
    CAPTURE(progress);
    sim::reset(6, progress);
    sim::deny_peer_access();  // the exchange needs none
    const auto data = make_rows(250);  // a short last batch: replicas with different row counts
    epoch_rows_list dev;
    {
      auto comms = ferry::nccl_communicator::local({0, 1});
      ferry::nccl_device_exchange ex(comms);
      const ferry::cache_on_device_options o{.seed = 4, .across_replicas = true, .devices = &ex};
      sim::counters after1, after3;
      CHECK(four_epochs(data, o, dev, after1, after3));
      CHECK(!sim::peer_enabled(0, 1));
      CHECK(after3.h2d_bytes == after1.h2d_bytes);  // nothing from the host: the counts go the other way
      CHECK(after3.device_allocs == after1.device_allocs);
      CHECK(after3.collectives >= after1.collectives + 2 * 2);  // an all-to-all per field and epoch
    }
    CHECK(dev == host_epochs(data, {.seed = 4, .across_replicas = true}, ferry::remainder_policy::partial, 4));
    sim::drain();
    for (const auto& v : sim::violations()) FAIL_CHECK(v);
    CHECK(sim::stats().live_device_blocks == 0);
    CHECK(sim::live_nccl_comms() == 0);
  }
}

// The current device is the calling thread's own (cuda::device_restore): building, each
// step, each rewind (the reorder and the NCCL trade), the pools' and streams' destructors
// and the exchange's frees all set devices, and each must put the caller's back.
TEST_CASE("sim: the caller's current device stays its own through the pipeline, the trade and the teardown") {
  const auto current = [] {
    int d = -1;
    REQUIRE(cudaGetDevice(&d) == cudaSuccess);
    return d;
  };
  for (const int mine : {0, 1}) {
    CAPTURE(mine);
    sim::reset(3, 0);
    sim::deny_peer_access();
    REQUIRE(cudaSetDevice(mine) == cudaSuccess);
    const auto data = make_rows(250);
    {
      auto comms = ferry::nccl_communicator::local({0, 1});
      CHECK(current() == mine);
      ferry::nccl_device_exchange ex(comms);
      auto p = on_two_gpus(data, sim_cache, {.seed = 4, .across_replicas = true, .devices = &ex});
      CHECK(current() == mine);
      for (int epoch = 0; epoch < 3; ++epoch) {
        CAPTURE(epoch);
        while (auto st = p.next()) CHECK(current() == mine);
        CHECK(current() == mine);
        p.rewind();
        CHECK(current() == mine);
      }
      CHECK(p.cached());
    }
    CHECK(current() == mine);
    sim::drain();
    for (const auto& v : sim::violations()) FAIL_CHECK(v);
    CHECK(sim::stats().live_device_blocks == 0);
  }
}

TEST_CASE("sim: across_replicas with .devices over two simulated ranks of two GPUs each: the one-process order") {
  // Rank w's step k is rows [48k + 24w, 48k + 24w + 24): the job's global batch k is one
  // process's batch of 48 over four host replicas, global replica 2w + r rank w's replica r.
  sim::reset(7, 2);
  const std::size_t steps = 5;
  const auto data = make_rows(48 * steps);
  const auto part = rank_parts(data, steps);
  std::array<epoch_rows_list, 2> got;
  std::array<bool, 2> h2d_after1{}, cached{};
  two_sim_ranks([&](int w, ferry::rank_exchange& me, ferry::device_exchange& ex) {
    auto p = on_two_gpus(part[std::size_t(w)], sim_cache,
                         {.seed = 9, .across_replicas = true, .ranks = &me, .devices = &ex});
    auto& mine = got[std::size_t(w)];
    mine.push_back(epoch_of(p, true, true));
    mine.push_back(epoch_of(p, true, true));  // both ranks' uploads are done: each reorder waits for both
    const std::uint64_t h2d = sim::stats().h2d_bytes;  // (the machine's: both ranks')
    mine.push_back(epoch_of(p, true, true));
    h2d_after1[std::size_t(w)] = sim::stats().h2d_bytes != h2d;
    cached[std::size_t(w)] = p.cached();
  });
  CHECK(cached == std::array{true, true});
  CHECK(h2d_after1 == std::array{false, false});
  check_rank_epochs(got, host_epochs(data, {.seed = 9, .across_replicas = true}, ferry::remainder_policy::drop, 3, 4, 48));
  // Every row once an epoch, across the four replicas.
  std::vector<u64> all;
  for (std::size_t w = 0; w < 2; ++w)
    for (std::size_t r = 0; r < 2; ++r) all.insert(all.end(), got[w][2][r].begin(), got[w][2][r].end());
  std::sort(all.begin(), all.end());
  std::vector<u64> ids(data.size());
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = i;
  CHECK(all == ids);
}

TEST_CASE("sim: host replicas over two simulated ranks, a rewind before every epoch (the first too): the caches "
          "serve the one-process order; resumed, the same") {
  // A loop that rewinds before each epoch: the rewind before the first next() begins no
  // epoch 0, so the ranks agree at the next one (they agreed there, on "not cached", and
  // streamed every epoch; resumed, "the cache was not filled").
  const std::size_t steps = 5;
  const auto data = make_rows(48 * steps);
  const auto part = rank_parts(data, steps);
  const auto run = [](auto& p, epoch_rows_list& out) {
    for (int e = 0; e < 3; ++e) {
      p.rewind();
      epoch_rows er;
      for (auto& st : p) {
        er.resize(st.replicas());
        for (std::size_t r = 0; r < st.replicas(); ++r)
          for (std::size_t i = 0; i < st[r].valid(); ++i) er[r].push_back(st[r].template field<0>()[i]);
      }
      out.push_back(er);
    }
  };
  for (const bool resume : {false, true}) {
    CAPTURE(resume);
    ferry::cache_on_device_options o{.seed = 9, .across_replicas = true};
    if (resume) o.resume = ferry::global_position{1, 2, 48 * steps, 48};
    epoch_rows_list want;  // one process, four host replicas, the same calls
    {
      auto h = ferry::from_range(data) | ferry::batch(48) | ferry::distribute(ferry::host_replicas{4}) |
               ferry::cache_on_device(o);
      run(h, want);
      CHECK(h.cached());
    }
    std::array<epoch_rows_list, 2> got;
    std::array<bool, 2> cached{};
    two_host_ranks([&](std::size_t w, ferry::rank_exchange& me) {
      ferry::cache_on_device_options mine = o;
      mine.ranks = &me;
      auto p = ferry::from_range(part[w]) | ferry::batch(24) | ferry::distribute(ferry::host_replicas{2}) |
               ferry::cache_on_device(mine);
      run(p, got[w]);
      cached[w] = p.cached();
    });
    CHECK(cached == std::array{true, true});
    check_rank_epochs(got, want);
  }
}

// At the end of epoch 0 the ranks gather each other's layouts; a rank whose allocation for
// that fails (the job's counts, W x steps x R words) must not leave the other waiting in a
// gather it never calls: both throw at the rewind, both stream every epoch after.
TEST_CASE("sim: host replicas over two simulated ranks, an allocation that fails on one at the end of epoch 0: both "
          "throw, both stream, no hang") {
  const std::size_t steps = 37;
  const auto part = rank_parts(make_rows(48 * steps), steps);
  const auto rows_of = [](auto& p) {  // one epoch's rows, replica after replica
    std::vector<u64> out;
    for (auto& st : p)
      for (std::size_t r = 0; r < st.replicas(); ++r)
        for (std::size_t i = 0; i < st[r].valid(); ++i) out.push_back(st[r].template field<0>()[i]);
    return out;
  };
  std::array<std::string, 2> what;
  std::array<bool, 2> streams_again{};
  two_host_ranks([&](std::size_t w, ferry::rank_exchange& me) {
    auto p = ferry::from_range(part[w]) | ferry::batch(24) | ferry::distribute(ferry::host_replicas{2}) |
             ferry::cache_on_device({.seed = 5, .across_replicas = true, .ranks = &me});
    const std::vector<u64> e0 = rows_of(p);
    if (w == 1) fail_size = 2 * steps * 2 * sizeof(u64);  // the job's counts, on rank 1 only
    try {
      p.rewind();
    } catch (const std::exception& e) {
      what[w] = e.what();
    }
    fail_size = 0;
    streams_again[w] = !p.cached() && rows_of(p) == e0 && (p.rewind(), rows_of(p) == e0);
  });
  CHECK(what[0].find("another rank failed") != std::string::npos);
  CHECK(what[1] == std::bad_alloc().what());
  CHECK(streams_again == std::array{true, true});
}

TEST_CASE("sim: .devices errors: host replicas, another process's ranks, GPU replicas across ranks without it") {
  sim::reset(8, 1);
  const auto data = make_rows(96);
  auto comms = ferry::nccl_communicator::local({0, 1});
  ferry::nccl_device_exchange ex(comms);
  {
    auto h = ferry::from_range(data) | ferry::batch(24) | ferry::distribute(ferry::host_replicas{2}) |
             ferry::cache_on_device({.across_replicas = true, .devices = &ex});
    CHECK_THROWS_WITH_AS(h.begin(), doctest::Contains(".devices with host replicas"), ferry::config_error);
  }
  CHECK_THROWS_WITH_AS(ferry::cache_on_device(ferry::from_range(data) | ferry::batch(24) |
                                                  ferry::distribute(ferry::host_replicas{2}),
                                              {.devices = &ex}),
                       doctest::Contains("need across_replicas"), ferry::config_error);
  {  // one GPU replica on a two-rank exchange: the ranks are not the replicas'
    auto pool = ferry::make_pinned_pool();
    auto p = ferry::from_range(data) | ferry::batch(24) |
             ferry::distribute(ferry::cuda::devices{0}, {.host_resource = pool}) |
             sim_cache({.seed = 3, .across_replicas = true, .devices = &ex});
    const epoch_rows e0 = epoch_of(p, false);
    CHECK_THROWS_WITH_AS(p.rewind(), doctest::Contains("the device_exchange has ranks 0..1 of 2"), ferry::config_error);
    CHECK(!p.cached());
    CHECK(epoch_of(p) == e0);  // streamed: the upstream's order
  }
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
}

namespace {
// A plan that fails (as a launch can) on the rank that uses it.
struct failing_plan : ferry_test::sim_gather {
  static void plan(const ferry::detail::exchange_plan_args&, ferry::cuda_stream) {
    throw ferry::config_error("simulated plan failure");
  }
};
constexpr ferry::detail::cache_on_device_t<failing_plan> failing_plan_cache{};
}  // namespace

TEST_CASE("sim: .devices across two simulated ranks, a plan that fails on one: both throw at the rewind, both "
          "stream, no NCCL call, no hang") {
  sim::reset(9, 1);
  const auto data = make_rows(24 * 8);
  std::array<std::string, 2> what;
  std::array<bool, 2> streams_again{};
  const std::uint64_t collectives = sim::stats().collectives;
  const auto run = [&](int w, ferry::rank_exchange& me, ferry::device_exchange& ex, auto cache) {
    auto p = on_two_gpus(data, cache, {.seed = 2, .across_replicas = true, .ranks = &me, .devices = &ex});
    const epoch_rows e0 = epoch_of(p, false, true);
    what[std::size_t(w)] = rewind_error(p);
    streams_again[std::size_t(w)] = !p.cached() && epoch_of(p, true, true) == e0;
  };
  two_sim_ranks([&](int w, ferry::rank_exchange& me, ferry::device_exchange& ex) {
    if (w == 0) run(w, me, ex, sim_cache);
    else run(w, me, ex, failing_plan_cache);  // rank 1's plan fails
  });
  CHECK(what[0].find("another rank failed") != std::string::npos);
  CHECK(what[1].find("simulated plan failure") != std::string::npos);
  CHECK(streams_again == std::array{true, true});
  CHECK(sim::stats().collectives == collectives);  // no rank reached NCCL
}

TEST_CASE("sim: .devices' buffers count in the budget and in bytes_per_replica") {
  sim::reset(10, 1);
  const auto data = make_rows(240);  // 120 rows a replica of 24 bytes (fields of 8 and 16)
  auto comms = ferry::nccl_communicator::local({0, 1});
  ferry::nccl_device_exchange ex(comms);
  const auto pipeline = [&](std::size_t budget) {
    return ferry::from_range(data) | ferry::batch(24) | ferry::distribute(ferry::cuda::devices{0, 1}) |
           sim_cache({.budget_bytes = budget, .seed = 1, .across_replicas = true, .devices = &ex});
  };
  {  // 48 bytes a row fit, 48 + 16 (the receive buffer) + 64 (the plan and the sort) do not
    auto p = pipeline(120 * 60);
    CHECK_THROWS_WITH_AS(epoch_of(p, false), doctest::Contains("128 a row with the epoch's shuffled copy"),
                         ferry::config_error);
  }
  {
    auto p = pipeline(120 * 128);
    const epoch_rows e0 = epoch_of(p);
    CHECK(p.cached());
    const std::size_t bytes = p.bytes_per_replica();
    CHECK(bytes > 120 * 48 + 120 * (16 + 16));  // the cache, the epoch copy, the received rows, the plan
    CHECK(bytes <= 120 * 128 + 4096);  // (and the layout's copies, a few hundred bytes)
    CHECK(epoch_of(p).size() == e0.size());
  }
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
}

namespace {
// The exchange's plans, counted; from the fail_from-th on (when not 0) they fail to enqueue.
struct counting_plan : ferry_test::sim_gather {
  static inline int plans = 0, fail_from = 0;
  static void plan(const ferry::detail::exchange_plan_args& a, ferry::cuda_stream s) {
    if (++plans >= fail_from && fail_from > 0) throw ferry::config_error("simulated plan failure");
    ferry_test::sim_gather::plan(a, s);
  }
};
constexpr ferry::detail::cache_on_device_t<counting_plan> counting_cache{};
}  // namespace

TEST_CASE("sim: .devices: a later rewind only launches; the next epoch's plan was made while the epoch was served") {
  sim::reset(11, 0);  // progress 0: the simulated GPUs run only what a host wait needs (and, at random, more)
  counting_plan::plans = 0, counting_plan::fail_from = 0;
  const auto data = make_rows(250);
  epoch_rows_list got;
  {
    auto comms = ferry::nccl_communicator::local({0, 1});
    ferry::nccl_device_exchange ex(comms);
    auto pool = ferry::make_pinned_pool();
    auto p = ferry::from_range(data) | ferry::batch(24) |
             ferry::distribute(ferry::cuda::devices{0, 1},
                               {.remainder = ferry::remainder_policy::partial, .host_resource = pool}) |
             counting_cache({.seed = 4, .across_replicas = true, .devices = &ex});
    got.push_back(epoch_of(p));  // then epoch 1's trade, planned in line, and epoch 2's plan
    CHECK(counting_plan::plans == 4);
    model_reads e1;
    enqueue_reads(p, e1);  // epoch 1's consumers; epoch 2's trade a unit a step, then epoch 3's plan
    CHECK(counting_plan::plans == 6);
    const sim::counters before = sim::stats();
    p.rewind();  // epoch 2's rows are traded; epoch 3's trade begins
    const sim::counters after = sim::stats();
    CHECK(counting_plan::plans == 6);
    CHECK(after.stream_syncs == before.stream_syncs);  // no wait for epoch 1's consumers
    CHECK(after.device_syncs == before.device_syncs);
    CHECK(after.event_syncs == before.event_syncs + 2);  // each replica's plan: its counts on the host
    CHECK(after.host_waits == before.host_waits + 2);    // and no other wait
    CHECK(after.h2d_bytes == before.h2d_bytes);
    CHECK(after.device_allocs == before.device_allocs);
    sim::drain();
    got.push_back(e1.rows());
    got.push_back(epoch_of(p));
  }
  CHECK(got == host_epochs(data, {.seed = 4, .across_replicas = true}, ferry::remainder_policy::partial, 3));
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  CHECK(sim::stats().live_device_blocks == 0);
  CHECK(sim::stats().live_streams == 0);
  CHECK(sim::stats().live_events == 0);
}

TEST_CASE("sim: .devices: the next epoch's plan fails to enqueue: that epoch still serves, the rewind after "
          "plans again, throws and streams") {
  sim::reset(12, 2);
  counting_plan::plans = 0, counting_plan::fail_from = 5;  // epoch 1's and 2's plans (2 each) work, the rest fail
  const auto data = make_rows(24 * 8);
  {
    auto comms = ferry::nccl_communicator::local({0, 1});
    ferry::nccl_device_exchange ex(comms);
    auto p = on_two_gpus(data, counting_cache, {.seed = 5, .across_replicas = true, .devices = &ex});
    const epoch_rows e0 = epoch_of(p);  // the rewind after it: epoch 1 traded, epoch 2 planned
    CHECK(p.cached());
    const epoch_rows e1 = epoch_of(p, false);  // with epoch 2's trade; epoch 3's plan fails, dropped
    CHECK(e1 == host_epochs(data, {.seed = 5, .across_replicas = true}, ferry::remainder_policy::partial, 2)[1]);
    const int before = counting_plan::plans;
    CHECK_THROWS_WITH_AS(p.rewind(), "simulated plan failure", ferry::config_error);
    CHECK(counting_plan::plans == before + 1);  // planned in line again (and failed)
    CHECK(!p.cached());
    CHECK(epoch_of(p) == e0);  // streamed: the upstream's order
  }
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  CHECK(sim::stats().live_device_blocks == 0);
}

TEST_CASE("sim: .devices under remainder_policy::pad, and a resume at a later epoch's step: the host replicas' rows") {
  sim::reset(13, 2);
  const auto data = make_rows(250);  // the last step: 10 real rows, 14 zero ones
  const auto want = host_epochs(data, {.seed = 6, .across_replicas = true}, ferry::remainder_policy::pad, 5);
  auto comms = ferry::nccl_communicator::local({0, 1});
  ferry::nccl_device_exchange ex(comms);
  const auto pipeline = [&](std::optional<ferry::global_position> at) {
    return ferry::from_range(data) | ferry::batch(24) |
           ferry::distribute(ferry::cuda::devices{0, 1}, {.remainder = ferry::remainder_policy::pad}) |
           sim_cache({.seed = 6, .across_replicas = true, .devices = &ex, .resume = at});
  };
  // A served epoch's padding rows (past valid()), all zero; and how many there were.
  const auto pad_rows_zero = [](auto& p, std::size_t& pads) {
    std::atomic<bool> zero{true};
    pads = 0;
    for (auto& st : p)
      for (std::size_t r = 0; r < st.replicas(); ++r) {
        const auto a = st[r].template field<0>();
        const std::size_t n = st[r].valid(), m = a.size();
        if (m == n) continue;
        pads += m - n;
        cudaSetDevice(st[r].device());
        sim::launch(static_cast<cudaStream_t>(st[r].stream()), "pad check", {{a.data() + n, (m - n) * 8}}, {},
                    [&zero, a, n, m] {
                      for (std::size_t i = n; i < m; ++i) zero = zero && a[i] == 0;
                    });
      }
    sim::drain();
    p.rewind();
    return zero.load();
  };
  {
    auto p = pipeline(std::nullopt);
    for (std::size_t e = 0; e < 5; ++e) {
      CAPTURE(e);
      CHECK(epoch_of(p) == want[e]);
    }
    for (int e = 0; e < 2; ++e) {  // the blocks swap places each epoch: the padding stays zero in both
      std::size_t pads = 0;
      CHECK(pad_rows_zero(p, pads));
      CHECK(pads == 14);
    }
  }
  {
    auto p = pipeline(ferry::global_position{3, 4, 250, 24});
    epoch_rows rest = want[3];
    for (auto& r : rest) r.erase(r.begin(), r.begin() + 4 * 12);  // 12 rows a replica a step
    CHECK(epoch_of(p) == rest);  // epoch 3 from step 4: traded from the rows as cached
    CHECK(epoch_of(p) == want[4]);
  }
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  CHECK(sim::stats().live_device_blocks == 0);
}

TEST_CASE("sim: a resume in epoch 0 at another replica count (3 host replicas saved, 2 GPUs resumed, peer access "
          "or .devices): the whole job's global batches in epochs 0, 1 and 2") {
  sim::reset(15, 2);
  const auto data = make_rows(250);  // 11 steps of 24 under pad, the last of 10 real rows
  // The uninterrupted job, on three host replicas: its global batches, 3 epochs.
  auto h = ferry::from_range(data) | ferry::batch(24) |
           ferry::distribute(ferry::host_replicas{3}, {.remainder = ferry::remainder_policy::pad}) |
           ferry::cache_on_device({.seed = 6, .across_replicas = true});
  std::vector<std::vector<std::vector<u64>>> want(3);
  for (auto& e : want) {
    for (auto& st : h) {
      e.emplace_back();
      for (std::size_t r = 0; r < st.replicas(); ++r)
        for (std::size_t i = 0; i < st[r].valid(); ++i) e.back().push_back(st[r].field<0>()[i]);
    }
    h.rewind();
  }
  REQUIRE(want[0].size() == 11);
  for (bool nccl : {false, true})
    for (u64 k : {u64(4), u64(11)}) {
      CAPTURE(nccl);
      CAPTURE(k);
      auto comms = ferry::nccl_communicator::local({0, 1});
      ferry::nccl_device_exchange ex(comms);
      {
        auto p = ferry::from_range(data) | ferry::batch(24) |
                 ferry::distribute(ferry::cuda::devices{0, 1}, {.remainder = ferry::remainder_policy::pad}) |
                 sim_cache({.seed = 6, .across_replicas = true, .devices = nccl ? &ex : nullptr,
                            .resume = ferry::global_position{0, k, 250, 24}});
        const auto rest = global_steps_of(p);  // epoch 0 from step k
        REQUIRE(rest.size() + k == want[0].size());
        for (std::size_t i = 0; i < rest.size(); ++i) CHECK(rest[i] == want[0][k + i]);
        CHECK(p.cached());
        CHECK(global_steps_of(p) == want[1]);
        CHECK(global_steps_of(p) == want[2]);
      }
      comms.clear();
    }
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  CHECK(sim::stats().live_device_blocks == 0);
}

namespace {
// A device_exchange that counts its all-to-alls (forwarding them).
struct counting_exchange final : ferry::device_exchange {
  ferry::device_exchange& inner;
  int calls = 0;
  explicit counting_exchange(ferry::device_exchange& x) : inner(x) {}
  int size() const override { return inner.size(); }
  int first() const override { return inner.first(); }
  int local() const override { return inner.local(); }
  int device(int i) const override { return inner.device(i); }
  void all_to_all(std::span<const ferry::device_all_to_all_part> parts) override {
    ++calls;
    inner.all_to_all(parts);
  }
  void abort() noexcept override { inner.abort(); }
};
using big_row = std::tuple<u64, std::array<u64, 4096>>;  // 32 KiB and 8 bytes
std::vector<big_row> make_big_rows(u64 n) {
  std::vector<big_row> data(n);
  for (u64 i = 0; i < n; ++i) {
    std::get<0>(data[i]) = i;
    std::get<1>(data[i]).fill(i * 3);
    std::get<1>(data[i])[4095] = i * 7;
  }
  return data;
}
// One epoch of big rows read by simulated kernels on the replicas' streams: the ids, and
// whether every row's wide field matched its id. With `ex`, calls_at gets the all-to-alls
// made while each step was served (next() serves). own_streams: as epoch_of's.
template <class P>
std::pair<epoch_rows, bool> big_epoch(P& p, counting_exchange* ex = nullptr, std::vector<int>* calls_at = nullptr,
                                      bool own_streams = false) {
  epoch_rows got;
  std::atomic<bool> ok{true};
  std::mutex m;
  std::vector<std::pair<int, cudaStream_t>> streams;
  int last = ex ? ex->calls : 0;
  for (auto& st : p) {
    if (ex) calls_at->push_back(ex->calls - last), last = ex->calls;
    got.resize(st.replicas());
    for (std::size_t r = 0; r < st.replicas(); ++r) {
      const auto a = st[r].template field<0>();
      const auto b = st[r].template field<1>();
      const std::size_t n = st[r].valid();
      const std::pair<int, cudaStream_t> ds(st[r].device(), static_cast<cudaStream_t>(st[r].stream()));
      if (std::find(streams.begin(), streams.end(), ds) == streams.end()) streams.push_back(ds);
      if (n == 0) continue;
      cudaSetDevice(st[r].device());
      sim::launch(ds.second, "model", {{a.data(), n * 8}, {b.data(), n * 32768}}, {}, [&, r, a, b, n] {
        std::lock_guard<std::mutex> l(m);
        for (std::size_t i = 0; i < n; ++i) {
          got[r].push_back(a[i]);
          if (b[i][0] != a[i] * 3 || b[i][4094] != a[i] * 3 || b[i][4095] != a[i] * 7) ok = false;
        }
      });
    }
  }
  if (!own_streams) sim::drain();
  else
    for (const auto& [d, st] : streams) {
      cudaSetDevice(d);
      cudaStreamSynchronize(st);
    }
  return {got, ok.load()};
}
}  // namespace

TEST_CASE("sim: .devices trades in chunks, a few a step while the epoch before is served: the host replicas' rows") {
  sim::reset(14, 1);
  const auto data = make_big_rows(250);
  // 125 rows of 32 KiB a replica (3.9 MiB: 3 chunks a field, at least 1 MiB of the widest),
  // 11 steps: 2 fields x 3 chunks = 6 units an epoch.
  const auto want = host_epochs(make_rows(250), {.seed = 8, .across_replicas = true}, ferry::remainder_policy::partial, 4);
  auto comms = ferry::nccl_communicator::local({0, 1});
  ferry::nccl_device_exchange nccl(comms);
  counting_exchange ex(nccl);
  auto pool = ferry::make_pinned_pool();
  auto p = ferry::from_range(data) | ferry::batch(24) |
           ferry::distribute(ferry::cuda::devices{0, 1},
                             {.remainder = ferry::remainder_policy::partial, .host_resource = pool}) |
           sim_cache({.seed = 8, .across_replicas = true, .devices = &ex});
  for (int e = 0; e < 4; ++e) {
    CAPTURE(e);
    std::vector<int> calls_at;
    const auto [got, fields_ok] = big_epoch(p, &ex, &calls_at);
    CHECK(fields_ok);
    CHECK(got == want[std::size_t(e)]);
    CAPTURE(calls_at);
    if (e >= 1) {  // the next epoch's 6 units, spread over the first 9 of 11 steps: one at most a step
      CHECK(std::accumulate(calls_at.begin(), calls_at.end(), 0) == 6);
      CHECK(*std::max_element(calls_at.begin(), calls_at.end()) == 1);
      REQUIRE(calls_at.size() == 11);
      CHECK(calls_at[9] + calls_at[10] == 0);  // the last two steps left for the last unit and the plan
    } else {
      CHECK(ex.calls == 0);
    }
    const int before = ex.calls;
    p.rewind();
    CHECK(ex.calls - before == (e == 0 ? 6 : 0));  // epoch 1's trade in line at the first rewind; later, none
  }
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
}

TEST_CASE("sim: .devices trades in chunks over two simulated ranks of two GPUs each (unequal counts a pair): the "
          "one-process order") {
  // As the two-rank test above, with rows of 32 KiB: 96 a replica, 3 MiB, 3 chunks a field.
  sim::reset(15, 2);
  const std::size_t steps = 8;
  const auto part = rank_parts(make_big_rows(48 * steps), steps);
  std::array<epoch_rows_list, 2> got;
  std::array<bool, 2> ok{true, true};
  two_sim_ranks([&](int w, ferry::rank_exchange& me, ferry::device_exchange& ex) {
    auto p = on_two_gpus(part[std::size_t(w)], sim_cache,
                         {.seed = 11, .across_replicas = true, .ranks = &me, .devices = &ex});
    for (int e = 0; e < 4; ++e) {
      const auto [rows, fine] = big_epoch(p, nullptr, nullptr, true);
      got[std::size_t(w)].push_back(rows);
      ok[std::size_t(w)] = ok[std::size_t(w)] && fine;
      p.rewind();
    }
  });
  CHECK(ok == std::array{true, true});
  check_rank_epochs(got, host_epochs(make_rows(48 * steps), {.seed = 11, .across_replicas = true},
                                     ferry::remainder_policy::drop, 4, 4, 48));
}

namespace {
// Moves (packs and unpacks) counted on each thread (a simulated rank); the fail_at-th on
// the thread fails to enqueue (when not 0), as a launch can.
struct failing_move : ferry_test::sim_gather {
  static inline thread_local int moves = 0, fail_at = 0;
  static void move_rows(const ferry::detail::move_rows_args& a, ferry::cuda_stream s) {
    if (++moves == fail_at) throw ferry::error("simulated move failure");
    ferry_test::sim_gather::move_rows(a, s);
  }
};
constexpr ferry::detail::cache_on_device_t<failing_move> failing_move_cache{};
// A device_exchange whose fail_at-th all-to-all (when not 0) fails before calling NCCL;
// aborts counted.
struct failing_exchange final : ferry::device_exchange {
  ferry::device_exchange& inner;
  int calls = 0, fail_at = 0;
  // Atomic: GCC 12 at -O1 (its IPA modref) read a plain count stale across the exception
  // that follows the abort (-fno-ipa-modref fixed it); an atomic is never cached.
  std::atomic<int> aborts{0};
  explicit failing_exchange(ferry::device_exchange& x) : inner(x) {}
  int size() const override { return inner.size(); }
  int first() const override { return inner.first(); }
  int local() const override { return inner.local(); }
  int device(int i) const override { return inner.device(i); }
  void all_to_all(std::span<const ferry::device_all_to_all_part> parts) override {
    if (++calls == fail_at) throw ferry::error("simulated NCCL failure");
    inner.all_to_all(parts);
  }
  void abort() noexcept override { aborts.fetch_add(1), inner.abort(); }
};
}  // namespace

TEST_CASE("sim: .devices over two simulated ranks, a unit that fails on one while an epoch is served: its NCCL calls "
          "still pair up, both serve that epoch whole, both throw at the rewind and stream, no hang") {
  sim::reset(16, 2);
  const std::size_t steps = 8;
  const auto part = rank_parts(make_rows(48 * steps), steps);
  std::array<epoch_rows_list, 2> got;
  std::array<std::string, 2> what;
  std::array<bool, 2> streams_again{};
  two_sim_ranks([&](int w, ferry::rank_exchange& me, ferry::device_exchange& ex) {
    // 2 fields, 2 replicas: the first rewind packs and unpacks 8 times in line; rank 1's
    // 11th move is epoch 2's trade's, enqueued while epoch 1 is served.
    failing_move::moves = 0, failing_move::fail_at = w == 1 ? 11 : 0;
    auto p = on_two_gpus(part[std::size_t(w)], failing_move_cache,
                         {.seed = 13, .across_replicas = true, .ranks = &me, .devices = &ex});
    got[std::size_t(w)].push_back(epoch_of(p, true, true));
    got[std::size_t(w)].push_back(epoch_of(p, false, true));  // epoch 1, whole: the failure was in the next trade
    what[std::size_t(w)] = rewind_error(p);
    streams_again[std::size_t(w)] = !p.cached() && epoch_of(p, true, true) == got[std::size_t(w)][0];
    CHECK(failing_move::moves >= 11);
  });
  check_rank_epochs(got, host_epochs(make_rows(48 * steps), {.seed = 13, .across_replicas = true},
                                     ferry::remainder_policy::drop, 2, 4, 48));
  CHECK(what[0].find("another rank failed") != std::string::npos);
  CHECK(what[1].find("simulated move failure") != std::string::npos);
  CHECK(streams_again == std::array{true, true});
}

TEST_CASE("sim: .devices over two simulated ranks, an all-to-all that fails on one while an epoch is served: next() "
          "throws it there once, after aborting its exchange; the other aborts at the rewind; both throw there and "
          "stream, nothing waits") {
  sim::reset(17, 2);
  const std::size_t steps = 8;
  const auto part = rank_parts(make_rows(48 * steps), steps);
  std::array<epoch_rows_list, 2> got;
  std::array<std::string, 2> what;
  std::array<int, 2> aborts_in_epoch{}, aborts_after{}, thrown_in_epoch{};
  std::array<bool, 2> streams_again{};
  two_sim_ranks([&](int w, ferry::rank_exchange& me, ferry::device_exchange& ex) {
    failing_exchange fx(ex);
    fx.fail_at = w == 1 ? 3 : 0;  // 2 calls at the first rewind (2 fields), then epoch 2's trade's first
    auto p = on_two_gpus(part[std::size_t(w)], sim_cache,
                         {.seed = 14, .across_replicas = true, .ranks = &me, .devices = &fx});
    got[std::size_t(w)].push_back(epoch_of(p, true, true));
    model_reads mr;  // epoch 1; rank 0's calls of epoch 2's trade wait for rank 1's
    for (bool more = true; more;) {
      try {
        enqueue_reads(p, mr);  // on rank 1, the step whose unit failed is served again
        more = false;
      } catch (const ferry::error& e) {
        CHECK(std::string(e.what()).find("simulated NCCL failure") != std::string::npos);
        ++thrown_in_epoch[std::size_t(w)];
      }
    }
    for (const auto& [d, st] : mr.streams) {
      cudaSetDevice(d);
      cudaStreamSynchronize(st);
    }
    got[std::size_t(w)].push_back(mr.rows());
    aborts_in_epoch[std::size_t(w)] = fx.aborts;
    what[std::size_t(w)] = rewind_error(p);
    aborts_after[std::size_t(w)] = fx.aborts;
    streams_again[std::size_t(w)] = !p.cached() && epoch_of(p, true, true) == got[std::size_t(w)][0];
  });
  check_rank_epochs(got, host_epochs(make_rows(48 * steps), {.seed = 14, .across_replicas = true},
                                     ferry::remainder_policy::drop, 2, 4, 48));
  CHECK(thrown_in_epoch == std::array{0, 1});
  CHECK(aborts_in_epoch == std::array{0, 1});
  CHECK(aborts_after == std::array{1, 1});
  CHECK(what[0].find("another rank's trade failed in NCCL") != std::string::npos);
  CHECK(what[1].find("simulated NCCL failure") != std::string::npos);
  CHECK(streams_again == std::array{true, true});
}

namespace {
// Plans counted on each thread (a simulated rank); from the fail_from-th on (when not 0)
// they fail to enqueue.
struct failing_plan_from : ferry_test::sim_gather {
  static inline thread_local int plans = 0, fail_from = 0;
  static void plan(const ferry::detail::exchange_plan_args& a, ferry::cuda_stream s) {
    if (++plans >= fail_from && fail_from > 0) throw ferry::config_error("simulated plan failure");
    ferry_test::sim_gather::plan(a, s);
  }
};
constexpr ferry::detail::cache_on_device_t<failing_plan_from> failing_plan_from_cache{};
}  // namespace

TEST_CASE("sim: .devices over two simulated ranks, failures at the first rewind on one rank (an all-to-all of the "
          "trade made in line, the next epoch's plan): both throw there and stream, nothing waits") {
  for (const int which : {0, 1, 2}) {  // the first call fails, the second, or the plans after the swap
    CAPTURE(which);
    sim::reset(18 + which, 2);
    const std::size_t steps = 8;
    const auto part = rank_parts(make_rows(48 * steps), steps);
    std::array<std::string, 2> what;
    std::array<bool, 2> streams_again{};
    two_sim_ranks([&](int w, ferry::rank_exchange& me, ferry::device_exchange& ex) {
      failing_exchange fx(ex);
      fx.fail_at = w == 1 && which < 2 ? which + 1 : 0;
      // 2 replicas: epoch 1's plans are the first 2, epoch 2's (after the swap) the next 2.
      failing_plan_from::plans = 0, failing_plan_from::fail_from = w == 1 && which == 2 ? 3 : 0;
      auto p = on_two_gpus(part[std::size_t(w)], failing_plan_from_cache,
                           {.seed = 15, .across_replicas = true, .ranks = &me, .devices = &fx});
      const epoch_rows e0 = epoch_of(p, false, true);
      what[std::size_t(w)] = rewind_error(p);
      streams_again[std::size_t(w)] = !p.cached() && epoch_of(p, true, true) == e0;
    });
    CHECK(what[0].find(which < 2 ? "another rank's trade failed in NCCL" : "another rank failed") != std::string::npos);
    CHECK(what[1].find(which < 2 ? "simulated NCCL failure" : "simulated plan failure") != std::string::npos);
    CHECK(streams_again == std::array{true, true});
  }
}

TEST_CASE("sim: .devices over two simulated ranks that cut an epoch short at different steps: the rest of the trade "
          "is made in line where it is left, the next epoch is the one-process order") {
  sim::reset(21, 2);
  const std::size_t steps = 8;
  const auto part = rank_parts(make_rows(48 * steps), steps);
  std::array<epoch_rows_list, 2> got;
  two_sim_ranks([&](int w, ferry::rank_exchange& me, ferry::device_exchange& ex) {
    auto p = on_two_gpus(part[std::size_t(w)], sim_cache,
                         {.seed = 16, .across_replicas = true, .ranks = &me, .devices = &ex});
    got[std::size_t(w)].push_back(epoch_of(p, true, true));
    // epoch 1: rank 0 takes every step (every unit of epoch 2's trade made), rank 1 one step
    for (std::size_t k = 0; k < (w == 0 ? steps : 1); ++k) REQUIRE(p.next());
    p.rewind();
    got[std::size_t(w)].push_back(epoch_of(p, true, true));  // epoch 2
  });
  const auto want = host_epochs(make_rows(48 * steps), {.seed = 16, .across_replicas = true},
                                ferry::remainder_policy::drop, 3, 4, 48);
  check_rank_epochs(got, {want[0], want[2]});
}

// Across ranks (or devices) each step is an all-to-all every rank joins: a thread reading
// ahead would run it early, and a rank that stops leaves the others waiting in it.
TEST_CASE("sim: prefetch or a map with workers over cache_on_device across ranks is a config_error") {
  sim::reset(23, 2);
  const auto data = make_rows(240);
  thread_ranks group(1);
  thread_ranks::member me(group, 0);
  const ferry::cache_on_device_options across{.seed = 3, .across_replicas = true, .ranks = &me};
  CHECK(on_two_gpus(data, sim_cache, across).joins_collectives_at_run_time());
  CHECK_THROWS_WITH_AS(on_two_gpus(data, sim_cache, across) | ferry::prefetch(2),
                       doctest::Contains("joins a collective"), ferry::config_error);
  const auto id = [](auto st) { return st; };
  CHECK_THROWS_WITH_AS(on_two_gpus(data, sim_cache, across) | ferry::map(id, {.workers = 2}),
                       doctest::Contains("map: workers after lockstep() (or cache_on_device"), ferry::config_error);
  // One process's replicas only: nothing to join; but epoch 0's steps are distribute's,
  // each valid only until the next is asked for, so prefetch refuses the first.
  auto local = on_two_gpus(data, sim_cache, {.seed = 3});
  CHECK(!local.joins_collectives_at_run_time());
  auto ahead = std::move(local) | ferry::prefetch(2);
  CHECK_THROWS_WITH_AS(ahead.next(), doctest::Contains("distribute onto devices is pulled by prefetch's thread"),
                       ferry::config_error);
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
}
