// Test doubles shared by the test executables.
//
//   counting_source   counts next() calls: proves laziness and bounded read-ahead
//   throwing_source   throws std::runtime_error at element k
//   gated_source      releases elements only when the test opens the gate
//   single_pass_source fails the test if read again after its end without rewind()
//   watchdog          aborts the whole process when a test hangs (doctest::timeout only
//                     reports a slow test after it finishes; a hang would never finish)
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ferry/source.hpp"

namespace ferry_test {

class counting_source : public ferry::source_interface<counting_source> {
 public:
  using value_type = std::uint64_t;
  explicit counting_source(std::uint64_t n, std::shared_ptr<std::atomic<std::uint64_t>> calls =
                                                std::make_shared<std::atomic<std::uint64_t>>(0))
      : n_(n), calls_(std::move(calls)) {}
  std::optional<value_type> next() {
    ++*calls_;
    if (i_ >= n_) return std::nullopt;
    return i_++;
  }
  void rewind() { i_ = 0; }
  void save(ferry::state_writer& w) const { w.tag("counting"); w.put(i_); }
  void restore(ferry::state_reader& r) { r.expect("counting"); i_ = r.get(); }
  std::shared_ptr<std::atomic<std::uint64_t>> calls() const { return calls_; }

 private:
  std::uint64_t n_;
  std::uint64_t i_ = 0;
  std::shared_ptr<std::atomic<std::uint64_t>> calls_;
};

class throwing_source : public ferry::source_interface<throwing_source> {
 public:
  using value_type = std::uint64_t;
  throwing_source(std::uint64_t n, std::uint64_t throw_at) : n_(n), k_(throw_at) {}
  std::optional<value_type> next() {
    if (i_ >= n_) return std::nullopt;
    if (i_ == k_) {
      ++i_;
      throw std::runtime_error("source failed at " + std::to_string(k_));
    }
    return i_++;
  }

 private:
  std::uint64_t n_, k_, i_ = 0;
};

// Elements 0..n-1, each released by open(count); next() blocks until released.
class gated_source : public ferry::source_interface<gated_source> {
  struct gate {
    std::mutex m;
    std::condition_variable cv;
    std::uint64_t released = 0;
    bool closed = false;  // releases everything (used to unblock at teardown)
    std::uint64_t pulled = 0;  // elements next() has returned
  };

 public:
  using value_type = std::uint64_t;
  explicit gated_source(std::uint64_t n) : n_(n), g_(std::make_shared<gate>()) {}
  std::optional<value_type> next() {
    if (i_ >= n_) return std::nullopt;
    std::unique_lock lk(g_->m);
    g_->cv.wait(lk, [&] { return g_->closed || g_->released > i_; });
    g_->pulled = i_ + 1;
    return i_++;
  }
  // Handles the test keeps after moving the source into a pipeline.
  struct handle {
    std::shared_ptr<gate> g;
    void open(std::uint64_t count) {
      { std::lock_guard lk(g->m); g->released += count; }
      g->cv.notify_all();
    }
    void close() {
      { std::lock_guard lk(g->m); g->closed = true; }
      g->cv.notify_all();
    }
    std::uint64_t pulled() const {
      std::lock_guard lk(g->m);
      return g->pulled;
    }
  };
  handle control() const { return {g_}; }

 private:
  std::uint64_t n_, i_ = 0;
  std::shared_ptr<gate> g_;
};

class single_pass_source : public ferry::source_interface<single_pass_source> {
 public:
  using value_type = int;
  explicit single_pass_source(int n) : n_(n) {}
  std::optional<value_type> next() {
    if (i_ < n_) return i_++;
    if (++after_end_ > 1000) throw std::logic_error("single_pass_source: polled 1000 times after its end");
    return std::nullopt;
  }

 private:
  int n_, i_ = 0, after_end_ = 0;
};

// Aborts the process (failing the test run loudly) if not destroyed within `limit`.
class watchdog {
 public:
  explicit watchdog(std::chrono::seconds limit, const char* what = "test")
      : t_([this, limit, what] {
          std::unique_lock lk(m_);
          if (!cv_.wait_for(lk, limit, [&] { return done_; })) {
            std::fprintf(stderr, "watchdog: %s did not finish within %lld s: aborting\n", what,
                         static_cast<long long>(limit.count()));
            std::abort();
          }
        }) {}
  ~watchdog() {
    { std::lock_guard lk(m_); done_ = true; }
    cv_.notify_all();
    t_.join();
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread t_;
};

// Drains a source into a vector.
template <class S>
auto drain(S& s) {
  std::vector<ferry::value_t<S>> out;
  while (auto e = s.next()) out.push_back(std::move(*e));
  return out;
}

}  // namespace ferry_test
