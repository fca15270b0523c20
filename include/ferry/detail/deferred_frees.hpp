// ferry/detail/deferred_frees.hpp: pinned-memory frees that ferry's own threads hand to a
// thread that may wait for the device.
//
// cudaFreeHost waits for the device. Beside a trainer's replica threads half way through
// launching an NCCL all-reduce GPU by GPU, a thread waiting there can hold up the last
// launch that the kernels already running wait for (NCCL's known deadlock). So the threads
// ferry starts (producers: prefetch's, distribute's staging thread; map's workers) set
// pinned_frees_deferred, and pinned_resource hands the blocks they let go to the list
// below; a thread that may wait frees them with free_deferred_pinned(): distribute's
// consumer in next(), and the consumer of a producer or of map's workers when it is not
// itself one of ferry's threads (a host-only pipeline over a pinned pool frees them there),
// in its next() and when it joins them (what they let go after its last call).
// No CUDA header: the list holds the function that frees a block (pinned.hpp's).
// Never throws; thread-safe.
#pragma once

#include <atomic>
#include <mutex>
#include <vector>

namespace ferry::detail {

// Set on a thread that must not wait for the device (see the file's top).
inline thread_local bool pinned_frees_deferred = false;

struct deferred_pinned_list {
  std::mutex m;
  std::vector<void*> blocks;
  void (*free_one)(void*) noexcept = nullptr;  // every block here is freed by it
  std::atomic<bool> any{false};                // next() looks without the lock
};
inline deferred_pinned_list& deferred_pinned() {
  static auto* l = new deferred_pinned_list;  // never destroyed: blocks may come at exit
  return *l;
}
// Hands `p` to the list, to be freed by `free_one` later. False when the list cannot take
// it (out of memory): the caller frees it now.
inline bool defer_pinned_free(void* p, void (*free_one)(void*) noexcept) noexcept {
  deferred_pinned_list& l = deferred_pinned();
  std::lock_guard lk(l.m);
  try {
    l.blocks.push_back(p);
  } catch (...) {
    return false;
  }
  l.free_one = free_one;
  l.any.store(true, std::memory_order_release);
  return true;
}
// Frees the blocks deferred so far, on this thread. Never throws.
inline void free_deferred_pinned() noexcept {
  deferred_pinned_list& l = deferred_pinned();
  if (!l.any.load(std::memory_order_acquire)) return;  // every step: one load
  std::vector<void*> blocks;
  void (*free_one)(void*) noexcept = nullptr;
  {
    std::lock_guard lk(l.m);
    blocks.swap(l.blocks);
    free_one = l.free_one;
    l.any.store(false, std::memory_order_relaxed);
  }
  for (void* p : blocks) free_one(p);
}
// On a consumer's side of ferry's threads: frees the deferred blocks unless this thread
// is one of ferry's own (then its own consumer frees them later).
inline void free_deferred_pinned_here() noexcept {
  if (!pinned_frees_deferred) free_deferred_pinned();
}

}  // namespace ferry::detail
