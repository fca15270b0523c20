// A source that checks a read-ahead bound on every pull, on whichever thread pulls: the
// elements pulled minus those the consumer has asked for never exceed `bound`. The
// consumer calls ask() before each next(), so the check holds whatever the timing (a stage
// cannot have handed out an element before it was asked for) and records every excess.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>

#include "ferry/source.hpp"

namespace ferry_test {

class ahead_source : public ferry::source_interface<ahead_source> {
 public:
  struct counters {
    std::atomic<std::uint64_t> pulled{0}, asked{0}, max_ahead{0}, excess{0};
    std::uint64_t bound = 0;
    void ask() { ++asked; }
    std::uint64_t ahead() const { return pulled.load() - asked.load(); }
  };
  using value_type = std::uint64_t;
  ahead_source(std::uint64_t n, std::uint64_t bound) : n_(n), c_(std::make_shared<counters>()) {
    c_->bound = bound;
  }
  std::optional<value_type> next() {
    if (i_ >= n_) return std::nullopt;
    const std::uint64_t p = ++c_->pulled, a = c_->asked.load();
    const std::uint64_t ahead = p > a ? p - a : 0;
    std::uint64_t m = c_->max_ahead.load();
    while (ahead > m && !c_->max_ahead.compare_exchange_weak(m, ahead)) {
    }
    if (ahead > c_->bound) ++c_->excess;
    return i_++;
  }
  std::shared_ptr<counters> control() const { return c_; }

 private:
  std::uint64_t n_, i_ = 0;
  std::shared_ptr<counters> c_;
};

}  // namespace ferry_test
