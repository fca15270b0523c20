// Augmentation's device path (ferry/image/augment.hpp's basic_augmenter) on the simulated
// CUDA runtime (tests/cuda/sim), fed by distribute(cuda::devices): every replica's output,
// read by a consumer kernel on the replica's stream when the simulated GPU runs it, equals
// augment_host of the same rows bit for bit; no access to device bytes races (the
// augmentation reads the block distribute copied into, after the copy; an output block
// reused for the next step is written only after the consumer's kernel read it); each
// launch has its replica's device current; steady state allocates nothing and waits for
// nothing on the host; a failed allocation or launch leaks no block. The kernel itself is
// simulated by its twin below, which runs the kernel's body (augment_draw, then
// augment_pixel for every pixel) when the simulator runs it; the real kernel
// (augment.cuh) is checked against augment_host on a GPU by test_augment_gpu.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>  // the simulator's (this test's include path puts it first)

#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/doubles.hpp"
#include "ferry/cuda/devices.hpp"
#include "ferry/image/augment.hpp"
#include "ferry/memory/pinned.hpp"
#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/distribute.hpp"

namespace {

namespace fi = ferry::image;

// The kernel's twin (as sim/sim_gpu_kernels.cpp is gpu_kernels.cu's): a simulated kernel
// on the stream, reading the input rows and writing the output rows (race-checked), that
// runs the kernel's per-block and per-thread code for every row and pixel. Its duration:
// the bytes over 3 TB/s. fail_next makes the next launch throw, as a failed launch would.
struct sim_kernel {
  static inline int launches = 0;
  static inline bool fail_next = false;
  static void launch(const fi::augment_plan& p, const fi::augment_launch& a, ferry::cuda_stream s) {
    if (fail_next) {
      fail_next = false;
      throw ferry::error("sim_kernel: launch failed (as told)");
    }
    const std::size_t in = std::size_t(a.rows) * p.values(), out = in * sizeof(float);
    sim::launch(s, "augment kernel", {{a.in, in}}, {{a.out, out}}, [p, a] {
      for (std::uint32_t row = 0; row < a.rows; ++row) {
        const fi::augment_row r = fi::augment_draw(p, a.key, a.first_row + row);  // thread 0 of each block
        for (std::uint32_t i = 0; i < p.pixels(); ++i)  // each thread its pixels
          fi::augment_pixel(p, r, a.in + row * p.values(), a.out + row * p.values(), i);
      }
    }, double(in + out) / 3e12);
    ++launches;
  }
};
using sim_augmenter = fi::basic_augmenter<sim_kernel>;

constexpr std::uint32_t H = 6, W = 7, C = 3;
constexpr std::size_t per = std::size_t(H) * W * C;
using picture = std::array<std::uint8_t, per>;

std::vector<picture> pictures(std::size_t n, std::uint64_t seed) {
  ferry::detail::splitmix64 g(seed);
  std::vector<picture> v(n);
  for (auto& p : v)
    for (auto& b : p) b = std::uint8_t(g());
  return v;
}

fi::augment_options options() {
  fi::augment_options o;
  o.mean = {0.485f, 0.456f, 0.406f};
  o.stddev = {0.229f, 0.224f, 0.225f};
  o.flip_probability = 0.5f;
  o.brightness = {-0.2f, 0.2f};
  o.contrast = {0.7f, 1.3f};
  o.seed = 17;
  return o;
}

struct scenario {
  std::vector<int> devices{0, 1};
  std::size_t per_replica = 5;
  std::size_t rows = 0;
  ferry::remainder_policy policy = ferry::remainder_policy::drop;
  int progress = 4;
  bool keep_previous = false;  // hold step k's outputs until step k+1's are made
  // Drop a step's outputs last replica first: with two replicas on one device, a block
  // then goes to the other replica's stream next, and must wait for the first's work.
  bool drop_reversed = false;
  std::uint64_t seed = 1;
};

struct trace {
  std::size_t steps = 0;
  std::uint64_t rows_checked = 0;
  std::vector<std::string> wrong;
  sim::counters warm, end;
  std::uint64_t augment_allocs_warm = 0, augment_allocs_end = 0;
};

trace run(const scenario& sc) {
  sim::reset(sc.seed, sc.progress);
  trace t;
  std::mutex m;
  const auto data = pictures(sc.rows, sc.seed);
  {
    auto pool = ferry::make_pinned_pool();
    sim_augmenter aug({H, W, C}, options());
    const std::size_t R = sc.devices.size(), G = R * sc.per_replica;
    auto steps = ferry::from_range(data) | ferry::batch(G) |
                 ferry::distribute(ferry::cuda::devices(sc.devices), {.remainder = sc.policy, .host_resource = pool});
    std::vector<fi::augmented> previous;
    for (auto& st : steps) {
      const std::size_t k = t.steps;
      if (k == 6) {
        t.warm = sim::stats();
        t.augment_allocs_warm = aug.device_allocations();
      }
      const std::uint64_t key = fi::augment_key(3, st.index());
      // The oracle: the global host batch through augment_host, rows 0..G-1.
      const std::size_t grows = st.global_size();
      std::vector<float> whole(grows * per);
      fi::augment_host({reinterpret_cast<const std::uint8_t*>(st.host_batch().field_buffer(0).data()), grows * per},
                       whole, aug.plan(), key);
      std::vector<fi::augmented> outs;
      std::size_t first = 0;
      REQUIRE(cudaSetDevice(0) == cudaSuccess);  // the augmenter makes each replica's device current itself
      for (std::size_t r = 0; r < st.replicas(); ++r) {
        const auto& rb = st[r];
        fi::augmented x = aug(st, r, key);
        REQUIRE(x.size() == rb.size());
        REQUIRE(x.device() == rb.device());
        REQUIRE(x.stream() == rb.stream());
        if (x.size()) {
          REQUIRE(sim::device_of(x.data().data()) == rb.device());
          std::vector<float> want(whole.begin() + std::ptrdiff_t(first * per),
                                  whole.begin() + std::ptrdiff_t((first + rb.size()) * per));
          REQUIRE(cudaSetDevice(rb.device()) == cudaSuccess);
          const std::span<const float> got = x.data();
          sim::launch(rb.stream(), "consumer of step " + std::to_string(k), {{got.data(), got.size_bytes()}}, {},
                      [&t, &m, got, want = std::move(want), k, r] {
                        std::lock_guard lk(m);
                        if (std::memcmp(got.data(), want.data(), got.size_bytes()) != 0)
                          t.wrong.push_back("step " + std::to_string(k) + " replica " + std::to_string(r) +
                                            ": the device output differs from augment_host");
                        t.rows_checked += got.size() / per;
                      });
        }
        first += rb.size();
        outs.push_back(std::move(x));
      }
      // Dropped here (after the consumer's kernel is enqueued), or one step later. A
      // block's release makes its device current and puts the caller's back.
      REQUIRE(cudaSetDevice(0) == cudaSuccess);
      if (sc.keep_previous) previous = std::move(outs);
      while (sc.drop_reversed && !outs.empty()) outs.pop_back();
      outs.clear();
      int now = -1;
      CHECK((cudaGetDevice(&now) == cudaSuccess && now == 0));
      ++t.steps;
    }
    previous.clear();
    t.end = sim::stats();
    t.augment_allocs_end = aug.device_allocations();
    sim::drain();  // the kernels run, and check
  }
  return t;
}

std::size_t rows_expected(const scenario& sc) {
  const std::size_t G = sc.devices.size() * sc.per_replica;
  switch (sc.policy) {
    case ferry::remainder_policy::drop: return sc.rows / G * G;
    case ferry::remainder_policy::pad: return (sc.rows + G - 1) / G * G;
    default: return sc.rows;
  }
}

void check_clean(const trace& t) {
  for (const auto& w : t.wrong) FAIL_CHECK(w);
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  const auto s = sim::stats();
  CHECK(s.live_device_blocks == 0);  // the augmenter's pools freed with it
  CHECK(s.live_events == 0);
  CHECK(s.pending_ops == 0);
}

}  // namespace

TEST_CASE("sim: every replica's device output equals augment_host bit for bit, with no race" *
          doctest::timeout(120)) {
  ferry_test::watchdog wd(std::chrono::seconds(120));
  std::uint64_t seed = 1;
  for (auto devs : {std::vector<int>{0}, std::vector<int>{0, 1}, std::vector<int>{1, 0, 1}})
    for (auto pol : {ferry::remainder_policy::drop, ferry::remainder_policy::pad, ferry::remainder_policy::partial})
      for (int progress : {0, 1, 6})
        for (int drop : {0, 1, 2}) {  // in order, last replica first, a step later
          const bool keep = drop == 2;
          scenario sc{.devices = devs, .per_replica = 2 + seed % 4, .policy = pol, .progress = progress,
                      .keep_previous = keep, .drop_reversed = drop == 1, .seed = seed};
          sc.rows = sc.per_replica * devs.size() * (4 + seed % 3) + seed % 5;
          ++seed;
          INFO("devices " << devs.size() << ", policy " << int(pol) << ", progress " << progress << ", drop " << drop
                          << ", rows " << sc.rows << ", per replica " << sc.per_replica);
          const int launches = sim_kernel::launches;
          const trace t = run(sc);
          CHECK(t.rows_checked == rows_expected(sc));
          CHECK(sim_kernel::launches > launches);
          check_clean(t);
        }
}

TEST_CASE("sim: steady state allocates nothing and waits for nothing on the host" * doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));
  for (bool keep : {false, true}) {
    scenario sc{.devices = {0, 1}, .per_replica = 8, .rows = 8 * 2 * 30, .progress = 12, .keep_previous = keep, .seed = 5};
    INFO("keep " << keep);
    const trace t = run(sc);
    REQUIRE(t.steps == 30);
    CHECK(t.rows_checked == 8 * 2 * 30);
    CHECK(t.end.host_waits == t.warm.host_waits);
    CHECK(t.end.device_allocs == t.warm.device_allocs);
    CHECK(t.augment_allocs_end == t.augment_allocs_warm);
    // One output block per replica, two when step k's outputs live until step k+1's exist.
    CHECK(t.augment_allocs_end == (keep ? 4u : 2u));
    check_clean(t);
  }
  // A partial last batch (5 rows, short on each replica) takes a full batch's blocks: the
  // pool reuses blocks of one size only, so a block sized to its rows was a new allocation.
  scenario sc{.devices = {0, 1}, .per_replica = 8, .rows = 8 * 2 * 30 + 5,
              .policy = ferry::remainder_policy::partial, .progress = 12, .seed = 6};
  const trace t = run(sc);
  REQUIRE(t.steps == 31);
  CHECK(t.rows_checked == sc.rows);
  CHECK(t.augment_allocs_end == t.augment_allocs_warm);
  CHECK(t.augment_allocs_end == 2u);
  check_clean(t);
}

TEST_CASE("sim: a failed allocation or launch is an error and leaks no block" * doctest::timeout(60)) {
  ferry_test::watchdog wd(std::chrono::seconds(60));
  sim::reset(9, 3);
  const auto data = pictures(4 * 10, 9);
  {
    sim_augmenter aug({H, W, C}, options());
    auto steps = ferry::from_range(data) | ferry::batch(4) | ferry::distribute(ferry::cuda::devices{0, 1});
    std::size_t k = 0;
    for (auto& st : steps) {
      const std::uint64_t key = fi::augment_key(0, st.index());
      if (k == 0) {
        sim::fail_malloc(0, 1);  // the next cudaMalloc on device 0: the augmenter's first block
        try {
          (void)aug(st, 0, key);
          FAIL("no error");
        } catch (const ferry::cuda_error& e) {  // names the bytes asked for (2 rows), and the device
          CHECK(e.device() == 0);
          CHECK(e.status() == cudaErrorMemoryAllocation);
          CHECK(std::string(e.what()).find("cudaMalloc of " + std::to_string(2 * per * sizeof(float)) +
                                           " bytes") != std::string::npos);
        }
        CHECK(aug.device_allocations() == 0);
      }
      if (k == 3) {
        const std::uint64_t before = aug.device_allocations();
        sim_kernel::fail_next = true;
        CHECK_THROWS_AS(aug(st, 1, key), ferry::error);
        CHECK(aug(st, 1, key).size() == 2);  // the block came back: reused, not a new one
        CHECK(aug.device_allocations() == before);
      }
      for (std::size_t r = 0; r < 2; ++r) CHECK(aug(st, r, key).size() == 2);
      ++k;
    }
    CHECK(k == 10);
  }
  sim::drain();
  for (const auto& v : sim::violations()) FAIL_CHECK(v);
  CHECK(sim::stats().live_device_blocks == 0);
  CHECK(sim::stats().pending_ops == 0);
}

TEST_CASE("sim: host replicas take the host path through the same augmenter") {
  sim::reset(2, 1);
  const auto data = pictures(12, 2);
  sim_augmenter aug({H, W, C}, options());
  const int launches = sim_kernel::launches;
  auto steps = ferry::from_range(data) | ferry::batch(6) | ferry::distribute(ferry::host_replicas{2});
  std::size_t n = 0;
  for (auto& st : steps) {
    const std::uint64_t key = fi::augment_key(0, st.index());
    std::vector<float> whole(6 * per);
    fi::augment_host({reinterpret_cast<const std::uint8_t*>(st.host_batch().field_buffer(0).data()), 6 * per}, whole,
                     aug.plan(), key);
    for (std::size_t r = 0; r < 2; ++r) {
      fi::augmented x = aug(st, r, key);
      REQUIRE(x.device() == -1);
      REQUIRE(x.size() == 3);
      CHECK(std::memcmp(x.data().data(), whole.data() + r * 3 * per, x.data().size_bytes()) == 0);
      ++n;
    }
  }
  CHECK(n == 4);
  CHECK(sim_kernel::launches == launches);
  CHECK(aug.device_allocations() == 0);
}
