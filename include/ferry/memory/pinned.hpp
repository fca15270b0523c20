// ferry/memory/pinned.hpp: page-locked host memory for batches that go to a GPU.
//
//   auto pool = ferry::pinned_pool();          // process-wide buffer_pool over pinned memory
//   auto mine = ferry::make_pinned_pool();     // a private one (its own statistics)
//
// pinned_resource allocates with cudaHostAlloc(cudaHostAllocPortable) when a CUDA driver
// and device are present, so every device's copy engine can DMA from it; otherwise
// (no driver, no device, or a build without the runtime) it returns page-aligned memory
// from std::aligned_alloc, transparently. The choice is made once per process
// (cuda::available()). Pinning is slow (a syscall and page-table work per block), which
// is why batches never allocate from it directly: buffer_pool recycles its blocks, so a
// pipeline in steady state pins nothing.
//
// Throws pinned_bad_alloc (a std::bad_alloc whose what() names the bytes asked for) when
// memory runs out or the size cannot be had at all, and ferry::cuda_error when
// cudaHostAlloc fails otherwise. Thread-safe; no user code runs. A block freed on one of
// ferry's own threads (prefetch's, map's workers, distribute's staging thread) goes back to
// the driver later, on a consumer's thread (ferry/detail/deferred_frees.hpp).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <memory_resource>
#include <new>
#include <string>

#include "ferry/config.hpp"
#include "ferry/cuda/error.hpp"
#include "ferry/cuda/runtime.hpp"
#include "ferry/detail/deferred_frees.hpp"
#include "ferry/memory/buffer.hpp"

namespace ferry {

namespace detail {

// What hand_up() calls for a block one of ferry's threads let go (deferred_frees.hpp).
inline void free_pinned_block(void* p) noexcept {
#if defined(FERRY_WITH_CUDART)
  FERRY_CUDA_LOG(cudaFreeHost(p));
#else
  (void)p;
#endif
}

}  // namespace detail

// The page size the fallback aligns and rounds blocks to (and the largest alignment the
// resource grants).
inline constexpr std::size_t page_bytes = 4096;

// Out of host memory in pinned_resource: a std::bad_alloc (as memory resources throw) whose
// message says how many bytes, and of which kind, could not be had.
class pinned_bad_alloc : public std::bad_alloc {
 public:
  // `bytes` the request; `pinned` whether it asked the driver (else the page-aligned fallback).
  pinned_bad_alloc(std::size_t bytes, bool pinned)
      : what_(std::string("ferry::pinned_resource: cannot allocate ") + std::to_string(bytes) + " bytes of " +
              (pinned ? "page-locked (cudaHostAlloc)" : "page-aligned host") + " memory") {}
  // "ferry::pinned_resource: cannot allocate N bytes of ... memory".
  const char* what() const noexcept override { return what_.c_str(); }
 private:
  std::string what_;
};

// A memory_resource of page-locked host memory, or page-aligned memory without CUDA (see
// the file's top).
class pinned_resource : public std::pmr::memory_resource {
 public:
  // Decided once per resource, from the once-per-process probe.
  pinned_resource() : pinned_(cuda::available()) {}

  // True when blocks are page-locked by the driver; false when page-aligned fallback.
  bool pinned() const noexcept { return pinned_; }
  // Blocks obtained from the driver / the OS so far, and returned.
  std::uint64_t allocations() const noexcept { return allocs_.load(std::memory_order_relaxed); }
  // Blocks returned to the driver / the OS so far (on a thread that defers pinned frees,
  // counted when handed to the deferred list).
  std::uint64_t deallocations() const noexcept { return frees_.load(std::memory_order_relaxed); }

 private:
  static std::size_t rounded(std::size_t bytes) noexcept {
    return (bytes + page_bytes - 1) / page_bytes * page_bytes;
  }

  void* do_allocate(std::size_t bytes, std::size_t align) override {
    if (align > page_bytes) throw std::bad_alloc();  // pages are all either can promise
    if (bytes == 0) bytes = 1;
    if (bytes > SIZE_MAX - page_bytes) throw pinned_bad_alloc(bytes, pinned_);  // rounding would wrap
    void* p = nullptr;
#if defined(FERRY_WITH_CUDART)
    if (pinned_) {
      const cudaError_t st = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
      if (st == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        throw pinned_bad_alloc(bytes, true);
      }
      FERRY_CUDA_TRY(st);
      allocs_.fetch_add(1, std::memory_order_relaxed);
      return p;
    }
#endif
    p = std::aligned_alloc(page_bytes, rounded(bytes));
    if (!p) throw pinned_bad_alloc(bytes, false);
    allocs_.fetch_add(1, std::memory_order_relaxed);
    return p;
  }

  void do_deallocate(void* p, std::size_t, std::size_t) override {
    frees_.fetch_add(1, std::memory_order_relaxed);
#if defined(FERRY_WITH_CUDART)
    if (pinned_) {
      // On one of ferry's threads: to its engine's list, freed by the thread that pulls it.
      if (!detail::defer_pinned_free(p, detail::free_pinned_block)) FERRY_CUDA_LOG(cudaFreeHost(p));
      return;
    }
#endif
    std::free(p);
  }

  bool do_is_equal(const std::pmr::memory_resource& o) const noexcept override { return this == &o; }

  bool pinned_;
  std::atomic<std::uint64_t> allocs_{0}, frees_{0};
};

// A buffer_pool over its own pinned_resource; the pool owns the resource.
class pinned_buffer_pool : public buffer_pool {
  // Base-from-member: the resource must exist before the pool that uses it.
  struct holder {
    pinned_resource res;
  };

 public:
  // A pool caching up to max_cached_bytes (buffer_pool's bound) over a new pinned_resource.
  explicit pinned_buffer_pool(std::size_t max_cached_bytes = buffer_pool::auto_max_cached)
      : pinned_buffer_pool(std::make_unique<holder>(), max_cached_bytes) {}
  ~pinned_buffer_pool() override { trim(); }  // before the resource goes
  // The pinned_resource its blocks come from (its allocation counts).
  const pinned_resource& upstream_resource() const noexcept { return h_->res; }
  // True when its blocks are page-locked (a CUDA driver and device were found).
  bool pinned() const noexcept { return h_->res.pinned(); }

 private:
  pinned_buffer_pool(std::unique_ptr<holder> h, std::size_t max_cached)
      : buffer_pool(&h->res, max_cached), h_(std::move(h)) {}
  std::unique_ptr<holder> h_;
};

// A private pinned pool: its statistics count only what its users allocate.
inline std::shared_ptr<pinned_buffer_pool> make_pinned_pool(
    std::size_t max_cached_bytes = buffer_pool::auto_max_cached) {
  return std::make_shared<pinned_buffer_pool>(max_cached_bytes);
}

// The process-wide pinned pool that distribute() hands to batch() by default. It is
// never destroyed (freeing pinned memory after the CUDA runtime has unloaded at exit
// fails); its cached blocks stay reachable until the process ends.
inline const std::shared_ptr<pinned_buffer_pool>& pinned_pool() {
  static auto* p = new std::shared_ptr<pinned_buffer_pool>(make_pinned_pool());
  return *p;
}

}  // namespace ferry
