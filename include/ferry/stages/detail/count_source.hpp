// ferry/stages/detail/count_source.hpp: the stage behind take(n) and skip(n). The two are
// each other's complement over one count per epoch, saved and restored alike, so one
// class serves both; take.hpp and skip.hpp document each one's contract.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <utility>

#include "ferry/error.hpp"
#include "ferry/stage.hpp"

namespace ferry::detail {

// Take: the first n elements of every epoch; otherwise (skip) every element after them.
template <source Up, bool Take>
class count_source : public stage<count_source<Up, Take>, Up> {
  friend stage<count_source, Up>;

 public:
  static constexpr const char* name = Take ? "take" : "skip";
  count_source(Up up, std::uint64_t n) : stage<count_source, Up>(std::move(up)), n_(n) {}

 private:
  std::optional<value_t<Up>> pull() {
    if constexpr (Take) {
      if (count_ >= n_) return std::nullopt;  // n taken: the upstream is not called
      std::optional<value_t<Up>> e = this->pull_up();
      if (e) ++count_;
      return e;
    } else {
      for (; count_ < n_; ++count_)
        if (!this->pull_up()) return std::nullopt;  // the epoch ended inside the first n
      return this->pull_up();
    }
  }

  // take: one run of at most what is left of n, into `out` itself. skip: skips in runs of
  // out.size(), pulled into `out` itself, then fills it.
  std::size_t pull_bulk(std::span<value_t<Up>> out)
    requires bulk_source<Up>
  {
    if (out.empty()) return 0;
    if constexpr (Take) {
      if (count_ >= n_) return 0;
      const std::size_t want = left(out);
      std::size_t k;
      try {
        k = this->pull_up_bulk(out.first(want));
      } catch (...) {
        count_ += want - 1;  // all the run may have used up, the error not (see take.hpp)
        throw;
      }
      count_ += k;
      return k;
    } else {
      while (count_ < n_) {
        const std::size_t want = left(out);
        const std::size_t k = this->pull_up_bulk(out.first(want));
        count_ += k;
        if (k < want) return 0;  // the epoch ended inside the first n
      }
      return this->pull_up_bulk(out);
    }
  }
  // What is left of n, at most out.size().
  std::size_t left(std::span<value_t<Up>> out) const {
    const std::uint64_t rest = n_ - count_;
    return out.size() < rest ? out.size() : static_cast<std::size_t>(rest);
  }

  void start_epoch() { count_ = 0; }
  void save_words(state_writer& w) const { w.put(count_); }
  // Throws config_error for a state that counted more than n.
  void restore_words(state_reader& r) {
    count_ = Take ? r.get_count(n_, name, "took", "hands on") : r.get_count(n_, name, "skipped", "drops");
  }

  std::uint64_t n_;
  // Elements taken (or counted for a failed run) or skipped this epoch, at most n_.
  std::uint64_t count_ = 0;
};

inline constexpr char take_name[] = "take";  // count_adaptor's Name
inline constexpr char skip_name[] = "skip";

template <class Up>
using take_source = count_source<Up, true>;
template <class Up>
using skip_source = count_source<Up, false>;

}  // namespace ferry::detail
