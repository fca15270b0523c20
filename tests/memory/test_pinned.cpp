// Pinned memory: the upstream resource, its fallback without a driver, the pool that
// recycles it, and cuda_error. Built twice: without the CUDA runtime and (when the
// toolkit is present) with it, where on a machine with no driver the probe must find
// "no device" once and fall back.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "ferry/cuda/error.hpp"
#include "ferry/cuda/runtime.hpp"
#include "ferry/memory/pinned.hpp"
#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"

TEST_CASE("probe: a usable device or a reason, decided once") {
  const int n = ferry::cuda::device_count();
  CHECK(n >= 0);
  CHECK(ferry::cuda::available() == (n > 0));
  if (n == 0) CHECK_FALSE(ferry::cuda::unavailable_reason().empty());
  CHECK(ferry::cuda::device_count() == n);  // cached
  MESSAGE("devices: " << n << " (" << ferry::cuda::unavailable_reason() << ")");
}

TEST_CASE("pinned_resource: pinned exactly when a device exists, else page-aligned") {
  ferry::pinned_resource r;
  CHECK(r.pinned() == ferry::cuda::available());
  std::vector<std::pair<void*, std::size_t>> blocks;
  for (std::size_t bytes : {1u, 100u, 4096u, 4097u, 1u << 20}) {
    void* p = r.allocate(bytes, ferry::buffer_alignment);
    REQUIRE(p != nullptr);
    CHECK(reinterpret_cast<std::uintptr_t>(p) % ferry::buffer_alignment == 0);
    if (!r.pinned()) CHECK(reinterpret_cast<std::uintptr_t>(p) % ferry::page_bytes == 0);
    std::memset(p, 0xab, bytes);  // the whole block is writable (ASan checks the bounds)
    blocks.emplace_back(p, bytes);
  }
  CHECK(r.allocations() == blocks.size());
  for (auto [p, b] : blocks) r.deallocate(p, b, ferry::buffer_alignment);
  CHECK(r.deallocations() == blocks.size());
}

TEST_CASE("pinned_resource: an alignment beyond a page is refused, not ignored") {
  ferry::pinned_resource r;
  CHECK_THROWS_AS((void)r.allocate(64, 2 * ferry::page_bytes), std::bad_alloc);
}

TEST_CASE("pinned_resource: a request too large to round up is a bad_alloc naming its bytes, not a tiny block") {
  ferry::pinned_resource r;
  for (std::size_t n : {std::numeric_limits<std::size_t>::max(), std::numeric_limits<std::size_t>::max() - 100,
                        std::numeric_limits<std::size_t>::max() - ferry::page_bytes + 1}) {
    INFO(n);
    try {
      void* p = r.allocate(n, 64);
      r.deallocate(p, n, 64);
      FAIL("allocated " << n << " bytes");
    } catch (const ferry::pinned_bad_alloc& e) {
      CHECK(std::string(e.what()).find(std::to_string(n) + " bytes") != std::string::npos);
    }
  }
  // Through a pool (whose size classes pass such sizes through unchanged) too.
  ferry::buffer_pool pool(&r);
  CHECK_THROWS_AS((void)pool.allocate(std::numeric_limits<std::size_t>::max() - 100, 64), std::bad_alloc);
  CHECK(pool.statistics().outstanding_bytes == 0);
}

TEST_CASE("pinned pool: a steady stream of same-size buffers pins once") {
  auto pool = ferry::make_pinned_pool();
  for (int i = 0; i < 100; ++i) {
    ferry::buffer b(pool, 1 << 16);
    b.data()[0] = std::byte{1};
  }
  CHECK(pool->statistics().upstream_allocations == 1);
  CHECK(pool->statistics().reuses == 99);
  CHECK(pool->upstream_resource().allocations() == 1);
}

TEST_CASE("pinned pool: batch() collating into it stops allocating after the first epoch") {
  auto pool = ferry::make_pinned_pool();
  std::vector<std::uint32_t> data(1000);
  for (std::uint32_t i = 0; i < data.size(); ++i) data[i] = i;
  auto p = ferry::batch(ferry::from_range(data), 64, {.resource = pool});
  std::uint64_t after_first = 0;
  for (int epoch = 0; epoch < 4; ++epoch) {
    std::uint64_t sum = 0, count = 0;
    for (auto& b : p) {
      CHECK(b.field_buffer(0).resource() == pool);  // written straight into the pool
      for (auto v : b.field<0>()) sum += v;
      count += b.size();
    }
    CHECK(count == 1000);
    CHECK(sum == 999u * 1000u / 2);
    if (epoch == 0) after_first = pool->statistics().upstream_allocations;
    p.rewind();
  }
  CHECK(after_first >= 1);
  CHECK(pool->statistics().upstream_allocations == after_first);
  CHECK(pool->statistics().outstanding_bytes == 0);
}

TEST_CASE("pinned_pool(): one process-wide pool") {
  CHECK(ferry::pinned_pool().get() == ferry::pinned_pool().get());
  CHECK(ferry::pinned_pool()->pinned() == ferry::cuda::available());
}

TEST_CASE("cuda_error names the call, the device and the status") {
  ferry::cuda_error e("cudaMemcpyAsync(d, h, n, k, s)", 3, 700, "cudaErrorIllegalAddress",
                      "an illegal memory access was encountered", "x.hpp", 42);
  const std::string w = e.what();
  CHECK(w.find("cudaMemcpyAsync") != std::string::npos);
  CHECK(w.find("device 3") != std::string::npos);
  CHECK(w.find("700") != std::string::npos);
  CHECK(w.find("cudaErrorIllegalAddress") != std::string::npos);
  CHECK(w.find("x.hpp:42") != std::string::npos);
  CHECK(e.status() == 700);
  CHECK(e.device() == 3);
  const ferry::error& base = e;  // catchable as any ferry error
  CHECK(std::string(base.what()) == w);
}

#if defined(FERRY_WITH_CUDART)
TEST_CASE("FERRY_CUDA_TRY throws cuda_error for a failing call; FERRY_CUDA_LOG does not") {
  // Fails everywhere: with no driver (35), and with one (invalid device ordinal).
  bool thrown = false;
  try {
    FERRY_CUDA_TRY(cudaSetDevice(1 << 20));
  } catch (const ferry::cuda_error& e) {
    thrown = true;
    CHECK(e.call().find("cudaSetDevice") != std::string::npos);
    CHECK(e.status() != 0);
    CHECK(std::string(e.what()).find("cudaSetDevice") != std::string::npos);
  }
  CHECK(thrown);
  auto logged = []() noexcept { FERRY_CUDA_LOG(cudaSetDevice(1 << 20)); };
  logged();  // prints, returns
}
#endif
