// ferry/memory/buffer.hpp: owned byte buffers and the pool that recycles them.
//
// Batches own their storage through `buffer`, which returns its bytes to the
// std::pmr::memory_resource it came from when destroyed. `buffer_pool` is that resource
// for every batch: it caches freed blocks by (size, alignment) and hands them out again,
// so a pipeline in steady state allocates nothing per batch. The pinned pool of the CUDA
// layer is a buffer_pool over a pinned upstream resource.
//
// Thread safety: buffer_pool is safe to use from any number of threads (batches are built
// on prefetch threads and freed on the consumer's). buffer is a single-owner value.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <memory_resource>
#include <mutex>
#include <utility>
#include <vector>

#include "ferry/error.hpp"

namespace ferry {

// Alignment of every batch field: wide enough for AVX-512 loads and GPU copy engines.
inline constexpr std::size_t buffer_alignment = 256;

class buffer {
 public:
  buffer() = default;
  // Throws std::bad_alloc (or what the resource throws) when allocation fails.
  buffer(std::shared_ptr<std::pmr::memory_resource> res, std::size_t bytes,
         std::size_t align = buffer_alignment)
      : res_(std::move(res)), bytes_(bytes), align_(align) {
    if (bytes_ != 0) p_ = static_cast<std::byte*>(res_->allocate(bytes_, align_));
  }
  buffer(buffer&& o) noexcept
      : res_(std::move(o.res_)), p_(std::exchange(o.p_, nullptr)),
        bytes_(std::exchange(o.bytes_, 0)), align_(o.align_) {}
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

  std::byte* data() noexcept { return p_; }
  const std::byte* data() const noexcept { return p_; }
  std::size_t size() const noexcept { return bytes_; }
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

// A memory_resource that recycles blocks of the sizes it has seen. Blocks freed to it are
// kept (up to max_cached_bytes; beyond that they go back upstream) and handed out again
// for a request of the same size and alignment. Its upstream is where new blocks come
// from: new/delete by default, pinned memory in the CUDA layer.
class buffer_pool : public std::pmr::memory_resource {
 public:
  struct stats {
    std::uint64_t upstream_allocations = 0;  // blocks obtained from upstream, ever
    std::uint64_t reuses = 0;                // requests served from the cache
    std::uint64_t cached_bytes = 0;          // bytes parked in the cache now
    std::uint64_t outstanding_bytes = 0;     // bytes handed out and not yet returned
  };

  explicit buffer_pool(std::pmr::memory_resource* upstream = std::pmr::new_delete_resource(),
                       std::size_t max_cached_bytes = std::size_t(1) << 30)
      : upstream_(upstream), max_cached_(max_cached_bytes) {}
  buffer_pool(const buffer_pool&) = delete;
  buffer_pool& operator=(const buffer_pool&) = delete;
  ~buffer_pool() override { trim(); }

  stats statistics() const {
    std::lock_guard lk(m_);
    return st_;
  }

  // Returns every cached block to upstream.
  void trim() noexcept {
    std::lock_guard lk(m_);
    for (auto& [key, blocks] : free_)
      for (void* p : blocks) upstream_->deallocate(p, key.first, key.second);
    free_.clear();
    st_.cached_bytes = 0;
  }

 private:
  using key = std::pair<std::size_t, std::size_t>;  // (bytes, alignment)

  void* do_allocate(std::size_t bytes, std::size_t align) override {
    {
      std::lock_guard lk(m_);
      auto it = free_.find({bytes, align});
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        st_.cached_bytes -= bytes;
        st_.outstanding_bytes += bytes;
        ++st_.reuses;
        return p;
      }
    }
    void* p = upstream_->allocate(bytes, align);  // outside the lock: may be slow (pinning)
    std::lock_guard lk(m_);
    ++st_.upstream_allocations;
    st_.outstanding_bytes += bytes;
    return p;
  }

  void do_deallocate(void* p, std::size_t bytes, std::size_t align) override {
    {
      std::lock_guard lk(m_);
      st_.outstanding_bytes -= bytes;
      if (st_.cached_bytes + bytes <= max_cached_) {
        free_[{bytes, align}].push_back(p);
        st_.cached_bytes += bytes;
        return;
      }
    }
    upstream_->deallocate(p, bytes, align);
  }

  bool do_is_equal(const std::pmr::memory_resource& o) const noexcept override { return this == &o; }

  std::pmr::memory_resource* upstream_;
  std::size_t max_cached_;
  mutable std::mutex m_;
  std::map<key, std::vector<void*>> free_;
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
