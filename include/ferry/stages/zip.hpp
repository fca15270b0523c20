// ferry/stages/zip.hpp: zip(a, b) pairs the i-th elements of two sources.
//
//   auto pairs = ferry::zip(from_files({images}, ferry::idx{}), from_files({labels}, ferry::idx{}));
//   // value_type: std::pair<record, record>; batch() collates each half as a field
//
// Unlike Python's zip and tf.data's Dataset.zip, sources of different lengths are an
// error, not a silent truncation: zipped sources are almost always parallel files (images
// and labels), and a missing tail means they do not match. next() then throws
// ferry::error naming the element at which one source ended.
// Runs both sources on the thread that calls next(); their errors propagate unchanged.
// rewind(), save() and restore() apply to both sources.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "ferry/error.hpp"
#include "ferry/memory/buffer.hpp"
#include "ferry/source.hpp"

namespace ferry {
namespace detail {

template <source A, source B>
class zip_source : public source_interface<zip_source<A, B>> {
 public:
  using value_type = std::pair<value_t<A>, value_t<B>>;
  zip_source(A a, B b) : a_(std::move(a)), b_(std::move(b)) {}

  std::optional<value_type> next() {
    std::optional<value_t<A>> x = a_.next();
    std::optional<value_t<B>> y = b_.next();
    if (!x && !y) return std::nullopt;
    if (!x || !y)
      throw error("zip: the sources have different lengths: the " + std::string(x ? "second" : "first") +
                  " ended after " + std::to_string(n_) + " elements");
    ++n_;
    return value_type(std::move(*x), std::move(*y));
  }
  void rewind()
    requires rewindable_source<A> && rewindable_source<B>
  {
    a_.rewind();
    b_.rewind();
    n_ = 0;
  }
  void save(state_writer& w) const
    requires resumable_source<A> && resumable_source<B>
  {
    a_.save(w);
    b_.save(w);
    w.tag("zip");
    w.put(n_);
  }
  void restore(state_reader& r)
    requires resumable_source<A> && resumable_source<B>
  {
    a_.restore(r);
    b_.restore(r);
    r.expect("zip");
    n_ = r.get();
  }
  bool set_buffer_resource(const std::shared_ptr<std::pmr::memory_resource>& r) {
    const bool ta = forward_buffer_resource(a_, r);
    const bool tb = forward_buffer_resource(b_, r);
    return ta || tb;
  }

 private:
  A a_;
  B b_;
  std::uint64_t n_ = 0;  // pairs handed out this epoch
};

}  // namespace detail

struct zip_t {
  template <source A, source B>
  auto operator()(A&& a, B&& b) const {
    detail::require_rvalue_source<A>();
    detail::require_rvalue_source<B>();
    return detail::zip_source<std::remove_cvref_t<A>, std::remove_cvref_t<B>>(std::forward<A>(a),
                                                                             std::forward<B>(b));
  }
};
inline constexpr zip_t zip{};

}  // namespace ferry
