// ferry/detail/deferred_frees.hpp: pinned-memory frees that ferry's own threads hand back to
// the thread that consumes them.
//
// cudaFreeHost waits for the device. Beside a trainer's replica threads half way through
// launching an NCCL all-reduce GPU by GPU, a thread waiting there can hold up the last
// launch that the kernels already running wait for (NCCL's known deadlock). So every thread
// ferry starts (a producer's: prefetch, distribute's staging thread, read-ahead; map's
// workers; interleave's readers) points pinned_frees_to at a list its engine owns, and
// pinned_resource puts the blocks it lets go there. The engine's consumer hands that list up
// (hand_up) when it takes an element and when it joins the threads: into its own thread's
// list when it is one of ferry's threads too, else it frees them, there. So a block goes up
// the chain of threads to the one that pulls the pipeline (distribute's consumer between
// steps, or a host-only pipeline's caller), and no thread frees another pipeline's blocks.
// No CUDA header: a list holds the function that frees its blocks (pinned.hpp's).
// Never throws; thread-safe.
#pragma once

#include <atomic>
#include <mutex>
#include <vector>

namespace ferry::detail {

struct deferred_pinned_list;
// The list of the engine whose thread this is; null on threads ferry did not start.
inline thread_local deferred_pinned_list* pinned_frees_to = nullptr;

struct deferred_pinned_list {
  std::mutex m;
  std::vector<void*> blocks;
  void (*free_one)(void*) noexcept = nullptr;  // every block here is freed by it
  std::atomic<bool> any{false};                // the consumer looks without the lock

  deferred_pinned_list() = default;
  deferred_pinned_list(const deferred_pinned_list&) = delete;
  deferred_pinned_list& operator=(const deferred_pinned_list&) = delete;
  ~deferred_pinned_list();  // hands up what is left
};

// Puts `p` on this thread's list, to be freed by `free_one` later. False on a thread ferry
// did not start, or when the list cannot take it (out of memory): the caller frees it now.
inline bool defer_pinned_free(void* p, void (*free_one)(void*) noexcept) noexcept {
  deferred_pinned_list* l = pinned_frees_to;
  if (!l) return false;
  std::lock_guard lk(l->m);
  try {
    l->blocks.push_back(p);
  } catch (...) {
    return false;
  }
  l->free_one = free_one;
  l->any.store(true, std::memory_order_release);
  return true;
}

// The consumer's side of an engine: the blocks its threads let go go to this thread's list
// when this is one of ferry's threads, else they are freed here. One load when there are
// none. Never throws (a list that cannot grow keeps the blocks for the next call).
inline void hand_up(deferred_pinned_list& l) noexcept {
  if (!l.any.load(std::memory_order_acquire)) return;
  deferred_pinned_list* up = pinned_frees_to;
  if (up == &l) return;  // this thread's own: its consumer hands it up
  if (up) {
    std::scoped_lock lk(l.m, up->m);
    try {
      up->blocks.insert(up->blocks.end(), l.blocks.begin(), l.blocks.end());
    } catch (...) {
      return;  // no memory to move them: they stay, for the next call
    }
    l.blocks.clear();
    up->free_one = l.free_one;
    up->any.store(true, std::memory_order_release);
    l.any.store(false, std::memory_order_relaxed);
    return;
  }
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

inline deferred_pinned_list::~deferred_pinned_list() { hand_up(*this); }

}  // namespace ferry::detail
