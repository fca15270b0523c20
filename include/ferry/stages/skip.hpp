// ferry/stages/skip.hpp: skip(n) drops the first n elements of every epoch and hands on
// the rest; take(n)'s complement.
//
//   src | ferry::take(1000)   // the validation split
//   src | ferry::skip(1000)   // the training split: everything after it
//
// Every epoch (every pass after rewind()) drops its own first n elements; skip(0) hands
// everything on, and an epoch of n elements or fewer is empty (not an error).
//
// Threads: runs on the thread that calls next(); skip runs no user code and starts no
// thread.
//
// Errors: skip(n) throws config_error for n below -1 (-1 skips every element, as tf.data's
// skip(-1)), and restore() refuses a state it cannot resume
// (Checkpoints). An upstream exception reaches the consumer unchanged, at its position,
// and does not count toward n (no element was skipped); the next call goes on. next()
// skips element by element, so this holds exactly. next_bulk() (batch() pulling a run)
// skips in runs, into the caller's own buffer (no allocation): if the upstream throws
// inside a run being skipped, skip cannot tell how many of that run's elements the
// upstream used up before the error (they go with it, as any bulk run's do: batch() drops
// the batch it was building), so it counts none of them. It may then drop more than n,
// never fewer: an element among the first n is never handed on.
//
// Memory: no element is held: skipped elements are dropped as they come, and next_bulk()
// skips in runs pulled into the caller's own buffer (no allocation).
//
// Checkpoints: the upstream's state, then how many elements this epoch skipped so far;
// a restore mid-skip drops only the rest of the n. A state that skipped more than this
// skip's n (saved from a skip of a larger n) is a config_error naming both.
#pragma once

#include "ferry/stages/detail/count_source.hpp"

namespace ferry {

// skip(n) or skip(src, n): drops the first n elements of every epoch (see the file's top).
inline constexpr count_adaptor<detail::skip_source, detail::skip_name> skip{};

}  // namespace ferry
