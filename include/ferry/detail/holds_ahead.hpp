// ferry/detail/holds_ahead.hpp: which of ferry's stages, if any, holds what it pulls on this
// thread while it pulls more (prefetch's and interleave's producer threads, map's workers,
// shuffle filling a window), so that distribute() onto devices can refuse to be pulled
// there.
//
// Why: a device replica's step is valid only until the next one is asked for (its device
// blocks go back to the pool for the next copies), so a stage that holds steps ahead would
// hand out steps whose memory already holds later rows. distribute checks this flag in
// every next(), whatever the element type above it (a step wrapped by zip or map is caught
// too), before it makes a step. Host replicas' steps own their rows and are not refused.
// No CUDA header; never throws.
#pragma once

namespace ferry::detail {

// The holding stage's thread name ("ferry prefetch", "ferry map worker", "shuffle"), or null.
inline thread_local const char* holds_ahead = nullptr;

// Marks this thread as holding ahead for a scope (shuffle's window fill); restores the
// mark it found, so a shuffle on prefetch's thread leaves prefetch's.
class holding_ahead {
 public:
  explicit holding_ahead(const char* stage) noexcept : saved_(holds_ahead) { holds_ahead = stage; }
  holding_ahead(const holding_ahead&) = delete;
  holding_ahead& operator=(const holding_ahead&) = delete;
  ~holding_ahead() { holds_ahead = saved_; }

 private:
  const char* saved_;
};

}  // namespace ferry::detail
