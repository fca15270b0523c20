// ferry/memory/buffer.hpp: owned byte buffers and the pool that recycles them.
//
// Batches own their storage through `buffer`, which returns its bytes to the
// std::pmr::memory_resource it came from when destroyed. `buffer_pool` is that resource
// for every batch: it caches freed blocks by (size class, alignment), within a byte bound,
// and hands them out again, so a pipeline in steady state allocates nothing per batch. The
// pinned pool of the CUDA layer is a buffer_pool over a pinned upstream resource.
//
// Thread safety: buffer_pool is safe to use from any number of threads (batches are built
// on prefetch threads and freed on the consumer's). buffer is a single-owner value. No
// user code runs here.
// Throws: allocation throws std::bad_alloc, or what the upstream resource throws (a
// pinned upstream: cuda_error); freeing, trim() and the destructors throw nothing.
#pragma once

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <memory_resource>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ferry/error.hpp"

namespace ferry {

// Alignment of every batch field: wide enough for AVX-512 loads and GPU copy engines.
inline constexpr std::size_t buffer_alignment = 256;

// An owned block of bytes from a memory resource, given back to it on destruction;
// move-only, single-owner.
class buffer {
 public:
  buffer() = default;
  // Throws std::bad_alloc (or what the resource throws) when allocation fails.
  buffer(std::shared_ptr<std::pmr::memory_resource> res, std::size_t bytes,
         std::size_t align = buffer_alignment)
      : res_(std::move(res)), bytes_(bytes), align_(align) {
    if (bytes_ != 0) p_ = static_cast<std::byte*>(res_->allocate(bytes_, align_));
  }
  // Takes o's block; o is left empty.
  buffer(buffer&& o) noexcept
      : res_(std::move(o.res_)), p_(std::exchange(o.p_, nullptr)),
        bytes_(std::exchange(o.bytes_, 0)), align_(o.align_) {}
  // Gives back this buffer's block, then takes o's; o is left empty.
  buffer& operator=(buffer&& o) noexcept {
    if (this != &o) {
      release();
      res_ = std::move(o.res_);
      p_ = std::exchange(o.p_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
      align_ = o.align_;
    }
    return *this;
  }
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  ~buffer() { release(); }

  // The bytes (null when empty).
  std::byte* data() noexcept { return p_; }
  // The bytes, read-only (null when empty).
  const std::byte* data() const noexcept { return p_; }
  // Their count, as requested.
  std::size_t size() const noexcept { return bytes_; }
  // The resource the block came from and returns to.
  const std::shared_ptr<std::pmr::memory_resource>& resource() const noexcept { return res_; }

 private:
  void release() noexcept {
    if (p_) res_->deallocate(p_, bytes_, align_);
    p_ = nullptr;
  }
  std::shared_ptr<std::pmr::memory_resource> res_;
  std::byte* p_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t align_ = buffer_alignment;
};

// A memory_resource that recycles blocks. Requests are rounded up to size classes (eighths
// of a power of two: 1/8 steps between 2^k and 2^(k+1), at least 256 bytes), so at most
// 12.5% is wasted, and batches whose sizes vary a little (ragged fields: every batch a new
// byte count) share blocks instead of each caching a block of its own. A request is served
// from the smallest cached class that fits, of the same alignment, up to twice its own
// class; else from upstream. Freed blocks are cached up to max_cached_bytes (by default a
// bound that grows with the largest block: see auto_max_cached); past that the oldest
// cached blocks go back upstream first. A block whose class exceeds a fixed bound is never
// cached: it is taken from and returned to upstream at its exact size. Its
// upstream is where new blocks come from: new/delete by default, pinned memory in the CUDA
// layer.
//
// Statistics: upstream_allocations counts blocks taken from upstream; reuses, requests
// served from the cache; evictions, cached blocks returned to make room; outstanding_bytes
// is the sum of the sizes requested and not yet freed; cached_bytes the (class-rounded)
// sizes of the blocks parked now, never more than max_cached_bytes.
//
// allocate throws std::bad_alloc (or what upstream throws); deallocate and trim never throw.
class buffer_pool : public std::pmr::memory_resource {
 public:
  // The default cache bound (max_cached_bytes = auto_max_cached): 256 MiB, or 16 blocks of
  // the largest class requested so far when that is more. With size classes the cache
  // holds about what is in flight at once (depth+2 batches per field), so batches of any
  // size keep being reused (never pinned per batch), while ragged batches of varying size
  // no longer fill up to a fixed large bound. A value other than auto_max_cached is a
  // fixed bound.
  static constexpr std::size_t auto_max_cached = 0;
  static constexpr std::size_t default_max_cached_bytes = std::size_t(256) << 20;  // auto's floor: 256 MiB
  static constexpr std::size_t auto_blocks = 16;  // auto's bound in blocks of the largest class
  static constexpr std::size_t min_class_bytes = 256;  // the smallest size class

  // The counters of statistics() (see above).
  struct stats {
    std::uint64_t upstream_allocations = 0;  // blocks obtained from upstream, ever
    std::uint64_t reuses = 0;                // requests served from the cache
    std::uint64_t cached_bytes = 0;          // bytes parked in the cache now
    std::uint64_t outstanding_bytes = 0;     // bytes handed out and not yet returned
    std::uint64_t evictions = 0;             // cached blocks returned upstream to keep the cap
  };

  // A pool over upstream (which must outlive it), caching up to max_cached_bytes.
  explicit buffer_pool(std::pmr::memory_resource* upstream = std::pmr::new_delete_resource(),
                       std::size_t max_cached_bytes = auto_max_cached)
      : upstream_(upstream), max_cached_(max_cached_bytes) {}
  buffer_pool(const buffer_pool&) = delete;
  buffer_pool& operator=(const buffer_pool&) = delete;
  ~buffer_pool() override { trim(); }

  // A snapshot of the counters, taken under the pool's lock (any thread).
  stats statistics() const {
    std::lock_guard lk(m_);
    return st_;
  }
  // The bound now (it grows with the largest class requested under auto_max_cached).
  std::size_t max_cached_bytes() const noexcept { return cap(); }

  // The bytes a request of `bytes` occupies: its size class (a multiple of 1/8 of the
  // largest power of two not above it), or `bytes` itself when that would overflow.
  static std::size_t size_class(std::size_t bytes) noexcept {
    if (bytes <= min_class_bytes) return min_class_bytes;
    // step = 2^shift: shifts, not a 64-bit division (tens of cycles, three per batch).
    const int shift = static_cast<int>(std::bit_width(bytes)) - 4;
    const std::size_t steps = ((bytes - 1) >> shift) + 1;
    if (steps > (std::numeric_limits<std::size_t>::max() >> shift)) return bytes;
    return steps << shift;
  }

  // Returns every cached block to upstream (outside the lock, as eviction does).
  void trim() noexcept {
    std::map<key, std::vector<cached>> gone;
    {
      std::lock_guard lk(m_);
      gone.swap(free_);
      hot_ = free_.end();
      st_.cached_bytes = 0;
    }
    for (auto& [k, blocks] : gone)
      for (const cached& c : blocks) upstream_->deallocate(c.p, k.first, k.second);
  }

 private:
  using key = std::pair<std::size_t, std::size_t>;  // (class bytes, alignment)
  struct cached {
    void* p;
    std::uint64_t age;  // when it was freed: eviction takes the smallest
  };

  // What upstream gives a request: its class, unless the class could never be cached.
  std::size_t block_bytes(std::size_t bytes) const noexcept {
    const std::size_t c = size_class(bytes);
    return c <= cap() ? c : bytes;
  }

  void* do_allocate(std::size_t bytes, std::size_t align) override {
    const std::size_t c = size_class(bytes);
    // The automatic bound grows with this class, but only once a block of it exists: a
    // request that fails (a corrupt length asking for a petabyte) must not lift it for good.
    const bool automatic = max_cached_ == auto_max_cached;
    const std::size_t bound = automatic ? std::max(cap(), auto_cap(c)) : cap();
    const std::size_t want = c <= bound ? c : bytes;
    if (want <= bound) {
      std::lock_guard lk(m_);
      // The class freed last first (a steady pipeline's own: no search), then the smallest
      // cached class that fits, up to twice the request's own.
      if (hot_ != free_.end() && hot_->first.first == want && hot_->first.second == align &&
          !hot_->second.empty()) [[likely]]
        return take(hot_, bytes);
      for (auto it = free_.lower_bound({want, 0}); it != free_.end() && it->first.first / 2 <= want; ++it) {
        if (it->first.second != align || it->second.empty()) continue;
        if (it->first.first != want) oversized_.emplace(it->second.back().p, it->first.first);  // may throw: nothing taken yet
        return take(it, bytes);
      }
    }
    void* p = upstream_->allocate(want, align);  // outside the lock: may be slow (pinning)
    if (automatic) {  // before deallocate can see the block: it sizes it by cap()
      std::size_t seen = largest_.load(std::memory_order_relaxed);
      while (c > seen && !largest_.compare_exchange_weak(seen, c, std::memory_order_relaxed)) {
      }
    }
    std::lock_guard lk(m_);
    ++st_.upstream_allocations;
    st_.outstanding_bytes += bytes;
    return p;
  }

  void do_deallocate(void* p, std::size_t bytes, std::size_t align) override {
    std::size_t have = block_bytes(bytes);
    {
      std::unique_lock lk(m_);
      st_.outstanding_bytes -= bytes;
      if (!oversized_.empty()) {  // served from a larger class: it goes back as what it is
        if (auto it = oversized_.find(p); it != oversized_.end()) {
          have = it->second;
          oversized_.erase(it);
        }
      }
      if (have <= cap() && cache(p, have, align)) {
        // Past the bound, the oldest blocks go upstream one at a time, each freed outside
        // the lock: a pinned free (cudaFreeHost) can take milliseconds and may wait for the
        // device, and every other thread's batch would wait with it.
        for (;;) {
          const std::optional<evicted> e = evict_one();
          if (!e) return;
          lk.unlock();
          upstream_->deallocate(e->p, e->bytes, e->align);
          lk.lock();
        }
      }
    }
    upstream_->deallocate(p, have, align);
  }

  using class_list = std::map<key, std::vector<cached>>;
  // Hands out the most recently freed block of a class (likeliest warm in cache). Under m_.
  void* take(class_list::iterator it, std::size_t bytes) noexcept {
    void* p = it->second.back().p;
    st_.cached_bytes -= it->first.first;
    it->second.pop_back();  // the class's entry stays, empty: no allocation per batch
    st_.outstanding_bytes += bytes;
    ++st_.reuses;
    return p;
  }

  // Parks p; false when it cannot (out of memory for the bookkeeping). Under m_.
  bool cache(void* p, std::size_t have, std::size_t align) noexcept {
    try {
      if (hot_ == free_.end() || hot_->first != key{have, align}) hot_ = free_.try_emplace({have, align}).first;
      hot_->second.push_back({p, ++clock_});
    } catch (...) {
      return false;
    }
    st_.cached_bytes += have;
    return true;
  }

  struct evicted {
    void* p;
    std::size_t bytes, align;
  };
  // Takes the oldest cached block out of the cache when the cache is over its bound (the
  // block just cached is the newest and fits alone, so it stays); the caller frees it
  // after unlocking. Once taken out, no reuse can hand it out. Under m_.
  std::optional<evicted> evict_one() noexcept {
    if (st_.cached_bytes <= cap()) return std::nullopt;
    auto oldest = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it)  // few classes: a scan is cheap
      if (!it->second.empty() && (oldest == free_.end() || it->second.front().age < oldest->second.front().age))
        oldest = it;
    const evicted e{oldest->second.front().p, oldest->first.first, oldest->first.second};
    oldest->second.erase(oldest->second.begin());  // rare, and a class holds few blocks
    st_.cached_bytes -= e.bytes;
    ++st_.evictions;
    return e;
  }

  bool do_is_equal(const std::pmr::memory_resource& o) const noexcept override { return this == &o; }

  std::pmr::memory_resource* upstream_;
  std::size_t cap() const noexcept {
    if (max_cached_ != auto_max_cached) return max_cached_;
    return auto_cap(largest_.load(std::memory_order_relaxed));
  }
  // The automatic bound when the largest class is l.
  static std::size_t auto_cap(std::size_t l) noexcept {
    return l > default_max_cached_bytes / auto_blocks ? (l > SIZE_MAX / auto_blocks ? SIZE_MAX : l * auto_blocks)
                                                     : default_max_cached_bytes;
  }

  std::size_t max_cached_;             // auto_max_cached: see cap()
  std::atomic<std::size_t> largest_{0};  // the largest class requested (auto bound)
  mutable std::mutex m_;
  // Per class, oldest first. A class's entry and its vector's capacity stay when it
  // empties, so a steady pipeline's allocate/deallocate pair allocates no bookkeeping.
  class_list free_;
  class_list::iterator hot_ = free_.end();  // the class cached last (entries are never erased)
  std::unordered_map<void*, std::size_t> oversized_;  // handed-out blocks of a larger class
  std::uint64_t clock_ = 0;
  stats st_;
};

namespace detail {
// Passes a batch-buffer resource up the pipeline to the batch stage (see batch.hpp).
// Returns whether some upstream stage took it.
template <class Up>
bool forward_buffer_resource(Up& up, const std::shared_ptr<std::pmr::memory_resource>& r) {
  if constexpr (requires { { up.set_buffer_resource(r) } -> std::same_as<bool>; })
    return up.set_buffer_resource(r);
  else
    return false;
}
}  // namespace detail

}  // namespace ferry
