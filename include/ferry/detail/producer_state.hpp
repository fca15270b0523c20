// ferry/detail/producer_state.hpp: the upstream position a producer thread records after
// each pull (prefetch's producer, distribute's staging thread), so that the consumer's
// save() at that element gives where the upstream stood after it.
#pragma once

#include <exception>
#include <mutex>
#include <string>

#include "ferry/error.hpp"
#include "ferry/state.hpp"

namespace ferry::detail {

// Saves `up`'s position into `state` (has_state = true) unless an earlier save failed.
// An upstream that cannot be saved at all (config_error: an unordered parallel map) sets
// `save_error` once, under `m`, and the data still flows; only save() will fail. Any other
// failure (an upstream that cannot say where it is after its error, such as zip, or no
// memory to say it) leaves the position before standing and becomes the element's error
// when it has none. Runs on the producer thread; never throws.
template <class Up>
void save_after_pull(Up& up, pipeline_state& state, bool& has_state, std::exception_ptr& error,
                     std::string& save_error, std::mutex& m) noexcept {
  if (!save_error.empty()) return;  // written only by this thread
  try {
    state_writer w(state);
    up.save(w);
    has_state = true;
  } catch (const config_error& e) {
    try {
      std::lock_guard lk(m);
      save_error = e.what();
    } catch (...) {  // no memory for the message: the element fails instead
      if (!error) error = std::current_exception();
    }
  } catch (...) {
    state.words.clear();
    if (!error) error = std::current_exception();
  }
}

}  // namespace ferry::detail
