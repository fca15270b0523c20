// ferry/stages/detail/step_ahead.hpp: distribute's step made ahead on the consumer's thread
// (steps_ahead = 1, no staging thread). After handing out step k it makes step k+1, so
// k+1's copies run while the consumer computes on k. It keeps the upstream's position
// after step k, for save() (a restore makes k+1 again), and an error met while making k+1,
// thrown where k+1 would have come. Runs on the consumer's thread; the user code it runs
// is the upstream's, through make().
#pragma once

#include <exception>
#include <optional>
#include <utility>

#include "ferry/error.hpp"
#include "ferry/state.hpp"

namespace ferry::detail {

template <class V>
class step_ahead {
 public:
  // The next step, or nullopt at the end. make() makes a step (nullopt at the end);
  // release() lets the consumer's previous step go; hand_out(v) gives v to the consumer;
  // save(w) writes the upstream's position (Resumable: after the step handed out). Throws
  // what make() threw, in its place.
  template <bool Resumable, class Make, class Release, class HandOut, class Save>
  std::optional<V> next(Make&& make, Release&& release, HandOut&& hand_out, Save&& save) {
    if (error_) {
      release();
      std::rethrow_exception(std::exchange(error_, nullptr));
    }
    if (!have_) {  // the first step, or the first after an error or a rewind
      release();
      ahead_ = make();
    }
    have_ = false;
    if (!ahead_) {  // the end: the last step handed out is released here, as without ahead
      release();
      return std::nullopt;
    }
    if constexpr (Resumable) {
      delivered_.words.clear();
      delivered_error_ = nullptr;
      try {
        state_writer w(delivered_);
        save(w);
      } catch (...) {  // e.g. an unordered map upstream: only save() fails, as without ahead
        delivered_error_ = std::current_exception();
      }
    }
    V out = std::move(*ahead_);
    ahead_.reset();
    release();  // the consumer has enqueued its work on the step before
    hand_out(out);
    try {
      ahead_ = make();
      have_ = true;
    } catch (...) {
      error_ = std::current_exception();
    }
    return out;
  }

  // Whether the upstream has been pulled past the last step handed out.
  bool ahead() const noexcept { return have_ || error_; }
  // Whether a step (not the end) waits, made ahead.
  bool holds_step() const noexcept { return ahead() && ahead_.has_value(); }
  // The upstream's words after the last step handed out (when ahead()). Throws what saving
  // them threw.
  const pipeline_state& position() const {
    if (delivered_error_) std::rethrow_exception(delivered_error_);
    return delivered_;
  }
  // Drops what was made ahead (rewind, restore, destruction).
  void drop() noexcept {
    ahead_.reset();
    have_ = false;
    error_ = nullptr;
  }

 private:
  std::optional<V> ahead_;  // the step made ahead (or the end, nullopt)
  bool have_ = false;
  std::exception_ptr error_;
  pipeline_state delivered_;  // upstream position after the last step handed out
  std::exception_ptr delivered_error_;  // why that position could not be saved
};

}  // namespace ferry::detail
