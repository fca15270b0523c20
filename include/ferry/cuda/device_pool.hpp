// ferry/cuda/device_pool.hpp: device memory blocks recycled in stream order.
//
// A block released with an event (recorded on the stream of its last user) can be handed
// out again at once: acquire(bytes, s) makes stream `s` wait for that event on the GPU
// (cudaStreamWaitEvent), so the new copy into the block runs only after the last user's
// work, and the host never waits. In steady state nothing is allocated: blocks and events
// are cached. Blocks are reused oldest-released first, so a copy waits for the work of the
// oldest released step, not for the step being computed (which is what lets it overlap
// that step). One pool per replica (its device is made current inside).
//
// grow_below: a stage that makes steps ahead on a thread of its own (distribute's staging
// thread) may ask for a block just after the consumer released one; that block's last user
// (the step just computed) may still be queued, and a copy into it would wait for it,
// serialising copy and compute. With grow_below = n, a block whose last user has not
// finished is passed over for a new one while this pool holds fewer than n blocks of that
// size: the pool grows to the depth the pipeline keeps in flight, then reuses.
//
// Sizes: blocks are reused at the size asked for. Callers ask for the largest size seen so
// far (a step's block grows with its longest step, never shrinks), so a free block smaller
// than a request is never used again: acquire frees it (after its last user), or a step
// size that keeps rising (length-sorted data) would keep a block of every size it passed.
//
// Where blocks are freed: cudaFree waits for the device, and a thread waiting there while
// another thread of the process has NCCL kernels half launched (the all-reduce running on
// GPU 0, GPU 1's not yet launched, its thread blocked behind the free) deadlocks: NCCL's
// known hazard. A pool built with frees_on_reclaim = true (distribute's, whose acquire runs
// on the staging thread beside the trainer's replica threads) frees nothing in acquire: it
// retires the smaller blocks, and reclaim() frees those whose last users are done, without
// waiting, on the thread that calls it (distribute's consumer, between steps, where no
// collective launch is half done). Otherwise acquire frees them itself, waiting for their
// last users.
//
// Thread-safe. acquire/take_event throw ferry::cuda_error (a failed cudaMalloc names the
// bytes asked for); release/give_event and the destructor never throw (the destructor
// waits for pending release events, then frees).
#pragma once

#include "ferry/config.hpp"

#if defined(FERRY_WITH_CUDART)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "ferry/cuda/error.hpp"
#include "ferry/cuda/stream.hpp"

namespace ferry::cuda {

class device_buffer_pool {
 public:
  struct stats {
    std::uint64_t allocations = 0;  // cudaMalloc calls, ever
    std::uint64_t reuses = 0;       // blocks handed out again
    std::uint64_t outstanding = 0;  // blocks handed out now
    std::uint64_t events_created = 0;
  };

  // frees_on_reclaim: see the file's top.
  explicit device_buffer_pool(int device, bool frees_on_reclaim = false)
      : device_(device), frees_on_reclaim_(frees_on_reclaim) {}
  device_buffer_pool(const device_buffer_pool&) = delete;
  device_buffer_pool& operator=(const device_buffer_pool&) = delete;
  ~device_buffer_pool() {
    // Each block once its last user is done; their events go back to events_, destroyed last.
    for (const auto& [bytes, blocks] : free_) free_blocks(blocks);
    free_blocks(retired_);
    for (cudaEvent_t e : events_) FERRY_CUDA_LOG(cudaEventDestroy(e));
  }

  int device() const noexcept { return device_; }
  stats statistics() const {
    std::lock_guard lk(m_);
    return st_;
  }

  // A block of `bytes`, ready for work enqueued on `s` after this call.
  void* acquire(std::size_t bytes, cudaStream_t s, std::size_t grow_below = 0) {
    block b{};
    std::vector<block> smaller;  // free blocks no request will fit again
    {
      std::lock_guard lk(m_);
      largest_ = std::max(largest_, bytes);
      if (!free_.empty() && free_.begin()->first < bytes) take_smaller(bytes, frees_on_reclaim_ ? retired_ : smaller);
      auto it = free_.find(bytes);
      const bool busy = it != free_.end() && !it->second.empty() && grow_below > 0 && it->second.front().after &&
                        count_[bytes] < grow_below && cudaEventQuery(it->second.front().after) == cudaErrorNotReady;
      if (it != free_.end() && !it->second.empty() && !busy) {
        b = it->second.front();  // least recently released: its last user is likeliest done
        it->second.pop_front();
        ++st_.reuses;
        ++st_.outstanding;
      }
    }
    free_blocks(smaller);
    if (b.p) {
      if (b.after) {
        const cudaError_t st = cudaStreamWaitEvent(s, b.after, 0);
        if (st != cudaSuccess) {
          // Back with its event: its last user may still read it, so whoever takes it next
          // must still wait for that event (a null event would let a copy overwrite it).
          release(b.p, bytes, b.after);
          FERRY_CUDA_TRY(st);
        }
        give_event(b.after);
      }
      return b.p;
    }
    device_guard g(device_);
    void* p = nullptr;
    if (const cudaError_t st = cudaMalloc(&p, bytes); st != cudaSuccess) {
      std::lock_guard lk(m_);
      std::size_t held = 0, blocks = 0;
      for (const auto& [size, k] : count_) held += size * k, blocks += k;
      throw detail::make_cuda_error(st,
                                    "cudaMalloc of " + std::to_string(bytes) + " bytes (this pool holds " +
                                        std::to_string(held) + " bytes in " + std::to_string(blocks) + " blocks)",
                                    device_, __FILE__, __LINE__);
    }
    std::lock_guard lk(m_);
    ++st_.allocations;
    ++st_.outstanding;
    ++count_[bytes];
    return p;
  }

  // Frees the retired blocks (frees_on_reclaim) whose last users are done; the others stay
  // for a later call. Never waits for the device; never throws.
  void reclaim() noexcept {
    std::vector<block> done;
    {
      std::lock_guard lk(m_);
      if (retired_.empty()) return;
      const auto busy_end = std::partition(retired_.begin(), retired_.end(), [](const block& b) {
        return b.after && cudaEventQuery(b.after) == cudaErrorNotReady;
      });
      try {
        done.assign(busy_end, retired_.end());
      } catch (...) {
        return;  // no memory for the list: the next call frees them
      }
      retired_.erase(busy_end, retired_.end());
    }
    free_blocks(done);  // their events are done: no wait
  }
  // Blocks retired and not yet freed (for tests).
  std::size_t retired() const {
    std::lock_guard lk(m_);
    return retired_.size();
  }

  // Takes `p` back; `after` (an event from take_event, recorded on the last user's
  // stream, or null when no work is pending) now belongs to the pool.
  void release(void* p, std::size_t bytes, cudaEvent_t after) noexcept {
    {
      std::lock_guard lk(m_);
      --st_.outstanding;
      try {
        if (frees_on_reclaim_ && bytes < largest_) {  // no request will fit it again
          retired_.push_back({p, after});
          --count_[bytes];
        } else
          free_[bytes].push_back({p, after});
        return;
      } catch (...) {  // no memory for the bookkeeping: free the block instead
        --count_[bytes];
      }
    }
    const block one{p, after};
    free_blocks(std::span<const block>(&one, 1));
  }

  // An event on this pool's device (cached, timing disabled).
  cudaEvent_t take_event() {
    {
      std::lock_guard lk(m_);
      if (!events_.empty()) {
        cudaEvent_t e = events_.back();
        events_.pop_back();
        return e;
      }
    }
    device_guard g(device_);
    cudaEvent_t e = nullptr;
    FERRY_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    std::lock_guard lk(m_);
    ++st_.events_created;
    return e;
  }
  // The non-throwing form for release paths: null when no event could be had.
  cudaEvent_t try_take_event() noexcept {
    try {
      return take_event();
    } catch (...) {
      return nullptr;
    }
  }
  void give_event(cudaEvent_t e) noexcept {
    std::lock_guard lk(m_);
    try {
      events_.push_back(e);
    } catch (...) {
      FERRY_CUDA_LOG(cudaEventDestroy(e));
    }
  }

 private:
  struct block {
    void* p = nullptr;
    cudaEvent_t after = nullptr;
  };

  // Under m_: moves the free blocks smaller than `bytes` to `out`.
  void take_smaller(std::size_t bytes, std::vector<block>& out) {
    const auto end = free_.lower_bound(bytes);
    for (auto it = free_.begin(); it != end; ++it) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      count_[it->first] -= it->second.size();
    }
    free_.erase(free_.begin(), end);
  }
  // Outside m_: frees blocks once their last users are done (never throws).
  template <class Blocks>
  void free_blocks(const Blocks& blocks) noexcept {
    if (blocks.empty()) return;
    const device_restore keep(device_);
    for (const block& b : blocks) {
      if (b.after) {
        FERRY_CUDA_LOG(cudaEventSynchronize(b.after));
        give_event(b.after);
      }
      FERRY_CUDA_LOG(cudaFree(b.p));
    }
  }

  int device_;
  bool frees_on_reclaim_;
  mutable std::mutex m_;
  std::vector<block> retired_;  // smaller than a request since, waiting for reclaim()
  std::size_t largest_ = 0;     // the largest request so far
  std::map<std::size_t, std::deque<block>> free_;
  std::map<std::size_t, std::size_t> count_;  // blocks of each size, free or handed out
  std::vector<cudaEvent_t> events_;
  stats st_;
};

}  // namespace ferry::cuda
#endif
