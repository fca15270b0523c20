// ferry/stages/zip.hpp: zip(a, b) pairs the i-th elements of two sources.
//
//   auto pairs = ferry::zip(from_files({images}, ferry::idx{}), from_files({labels}, ferry::idx{}));
//   // value_type: std::pair<record, record>; batch() collates each half as a field
//
// Unlike Python's zip and tf.data's Dataset.zip, sources of different lengths are an
// error, not a silent truncation: zipped sources are almost always parallel files (images
// and labels), and a missing tail means they do not match. next() then throws
// ferry::error naming the element at which one source ended. rewind() applies to both
// sources. In report(): the first source's stages, the second's, then zip.
//
// Threads: runs both sources on the thread that calls next(); zip runs no user code and
// starts no thread.
//
// Errors: the sources' errors propagate unchanged. Once either source throws (or the
// lengths differ), zip cannot know how to pair what follows: a failing source may have
// skipped any number of its elements (a whole missing file), so going on would pair a[i]
// with b[j != i] silently. The error is re-thrown unchanged, and every later next() (and
// save()) throws ferry::error saying the sources are out of step since that error (which
// source, at which pair, and the original message) until rewind() or restore_state()
// starts them again together.
//
// Memory: no element is held beyond the pair being made (one element of each source).
//
// Checkpoints: save() records the first source's state, the second's, then the number of
// pairs handed out this epoch; after an error it throws ferry::error instead (the saved
// positions would pair the wrong elements). restore() restores both sources and starts
// them in step again; a state of another shape is a config_error.
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <utility>

#include "ferry/error.hpp"
#include "ferry/stage.hpp"

namespace ferry {
namespace detail {

template <source A, source B>
class zip_source : public join_stage<zip_source<A, B>, std::pair<value_t<A>, value_t<B>>, A, B> {
  friend join_stage<zip_source, std::pair<value_t<A>, value_t<B>>, A, B>;
  using T = std::pair<value_t<A>, value_t<B>>;

 public:
  static constexpr char name[] = "zip";
  zip_source(A a, B b) : join_stage<zip_source, std::pair<value_t<A>, value_t<B>>, A, B>(std::move(a), std::move(b)) {}

 private:
  void start_epoch() {
    n_ = 0;
    out_of_step_ = false;
  }
  // Throws ferry::error after an error (see the header): the saved positions would pair
  // the wrong elements on restore.
  void save_upstream(state_writer& w) const {
    if (out_of_step_) throw_out_of_step();
    this->template up<0>().save(w);
    this->template up<1>().save(w);
  }
  void save_words(state_writer& w) const { w.put(n_); }
  void restore_words(state_reader& r) {
    n_ = r.get();
    out_of_step_ = false;
  }

  std::optional<T> pull() {
    if (out_of_step_) throw_out_of_step();
    std::optional<value_t<A>> x;
    std::optional<value_t<B>> y;
    try {
      x = this->template pull_up<0>();
    } catch (...) {
      break_off("first");
      throw;
    }
    try {
      y = this->template pull_up<1>();
    } catch (...) {
      break_off("second");  // a's element is already taken: the sides no longer line up
      throw;
    }
    if (!x && !y) return std::nullopt;
    if (!x || !y) {
      error e("zip: the sources have different lengths: the " + std::string(x ? "second" : "first") +
              " ended after " + std::to_string(n_) + " elements");
      out_of_step_ = true;
      why_ = std::string("zip: the sources are out of step since an earlier error: ") + e.what() +
             "; rewind() or restore_state() starts them again";
      throw e;
    }
    ++n_;
    return T(std::move(*x), std::move(*y));
  }

  // Called inside a catch block: remembers why the sides are out of step. Never throws,
  // so the caller re-throws the original (a bad_alloc here keeps the generic message).
  void break_off(const char* side) noexcept {
    out_of_step_ = true;
    try {
      std::string what = "unknown exception";
      try {
        throw;
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      why_ = "zip: the sources are out of step since an earlier error from the " + std::string(side) +
             " source at pair " + std::to_string(n_) + " (" + what +
             "); rewind() or restore_state() starts them again";
    } catch (...) {
      why_.clear();  // out of memory: throw_out_of_step() says it without details
    }
  }
  [[noreturn]] void throw_out_of_step() const {
    if (why_.empty())
      throw error("zip: the sources are out of step since an earlier error; rewind() or restore_state() "
                  "starts them again");
    throw error(why_);
  }

  std::uint64_t n_ = 0;  // pairs handed out this epoch
  bool out_of_step_ = false;  // after an error: every next() throws why_
  std::string why_;
};

}  // namespace detail

// zip(a, b): pairs the i-th elements of two sources of equal length (see the file's top).
inline constexpr join_adaptor<detail::zip_source> zip{};

}  // namespace ferry
