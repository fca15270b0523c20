// ferry/stages/take.hpp: take(n) hands on the first n elements of every epoch, then ends
// it; skip(n)'s complement.
//
//   src | ferry::take(1000)   // the validation split
//   src | ferry::skip(1000)   // the training split: everything after it
//
// Pulls at most n elements from upstream (never one more), and once n are taken it calls
// the upstream no more until rewind(): take(0) never pulls at all (nor starts a parallel
// map's workers upstream). Every epoch (every pass after rewind()) hands on its own first
// n.
//
// Threads: runs on the thread that calls next(); take runs no user code and starts no
// thread.
//
// Errors: take(n) throws config_error for n below -1 (-1 takes every element, as tf.data's
// take(-1)), and restore() refuses a state it cannot resume
// (Checkpoints). An upstream exception reaches the consumer unchanged, at its position,
// and does not count toward n (no element was taken); the next call goes on. next() takes
// element by element, so this holds exactly: take(n) and skip(n) over the same
// (deterministic) upstream hand on, between them, every element once. next_bulk()
// (batch() pulling a run) takes in runs of at most what is left of n, into the caller's
// own buffer: if the upstream throws inside a run, take cannot tell how many of that
// run's elements the upstream used up before the error (they go with it, as any bulk
// run's do: batch() drops the batch it was building), so it counts all it may have: the
// run less one, as the error is no element (next_bulk stops at an error as next() calls
// would). It may then hand on fewer than n, never more: an element after the first n is
// never handed on, so take(n) never shares one with skip(n), which errs the other way. A
// run of one is exact.
//
// Memory: no element is held: a count of what was taken, and next_bulk() runs go straight
// into the caller's buffer.
//
// Checkpoints: the upstream's state, then how many elements this epoch took so far (with
// what a failed run counted); a restore hands on only the rest of the n. A state that took
// more than this take's n (saved from a take of a larger n) is a config_error naming both.
#pragma once

#include "ferry/stages/detail/count_source.hpp"

namespace ferry {

// take(n) or take(src, n): the first n elements of every epoch (see the file's top).
inline constexpr count_adaptor<detail::take_source, detail::take_name> take{};

}  // namespace ferry
