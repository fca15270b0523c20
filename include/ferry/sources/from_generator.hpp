// ferry/sources/from_generator.hpp: a source from a function of the element index.
//
//   ferry::from_generator([](std::uint64_t i) -> std::optional<T> { ... })  // nullopt ends
//   ferry::from_generator(n, [](std::uint64_t i) { return T{...}; })        // n elements
//
// Because elements are a function of their index, save/restore and rewind are exact and
// free.
//
// Threads: the function is called with 0, 1, 2, ... on the thread that calls next() (a
// map or prefetch worker when those stages sit downstream); from_generator starts no
// thread.
//
// Errors: if the function throws for index i, next() throws ferry::element_error
// ("from_generator: user function threw at element i: ...") with the original exception
// nested (std::rethrow_if_nested); ferry's own errors pass through unchanged. Both forms
// then skip index i: a consumer that catches and goes on gets element i + 1 next (a retry
// would throw forever when the failure is a function of the index, as it should be). A
// next_bulk() call (batch() pulling a run at once) throws the same error; the run's
// elements before i go with it, as batch() drops the batch it was building on any error.
// restore() throws config_error for a state past the count (Checkpoints);
// from_generator(count, f), for a negative count.
//
// Memory: the function (moved in), the next index and whether the function has ended the
// epoch (returned nullopt); no element is held.
//
// Checkpoints: save() records the next index and whether the epoch has ended; restore()
// throws config_error for an index past this generator's count (a state saved from a
// longer one).
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "ferry/detail/holds_ahead.hpp"
#include "ferry/error.hpp"
#include "ferry/stage.hpp"

namespace ferry {
namespace detail {

template <class T>
struct is_optional : std::false_type {
  using element = T;
};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {
  using element = T;
};

template <class F>
class generator_source
    : public source_base<generator_source<F>, typename is_optional<std::invoke_result_t<F&, std::uint64_t>>::element> {
  using result = std::invoke_result_t<F&, std::uint64_t>;
  using T = typename is_optional<result>::element;
  friend source_base<generator_source, T>;

 public:
  static constexpr char name[] = "from_generator";
  generator_source(std::uint64_t count, F f) : count_(count), f_(std::move(f)) {}

 private:
  std::optional<T> pull() {
    if (done_ || i_ >= count_) return std::nullopt;
    const std::uint64_t i = i_;
    try {
      const auto call = [&]() -> result { return f_(i); };  // user code (holds_ahead.hpp)
      if constexpr (is_optional<result>::value) {
        std::optional<T> v = as_user_code<T>(call);
        if (!v) {
          done_ = true;
          return v;
        }
        ++i_;
        return v;
      } else {
        std::optional<T> v(as_user_code<T>(call));
        ++i_;
        return v;
      }
    } catch (...) {
      i_ = i + 1;  // skip the failed index (see the header)
      rethrow_element(std::current_exception(), name, i);
    }
  }
  std::size_t pull_bulk(std::span<T> out) {
    std::size_t k = 0;
    if constexpr (is_optional<result>::value) {
      while (k < out.size())
        if (auto v = pull()) out[k++] = std::move(*v);
        else break;
    } else {
      const std::uint64_t left = done_ ? 0 : count_ - i_;
      const std::size_t n = out.size() < left ? out.size() : static_cast<std::size_t>(left);
      try {
        const in_user_code<T> user;  // f runs user code (holds_ahead.hpp)
        for (; k < n; ++k) {
          out[k] = f_(i_);
          ++i_;
        }
      } catch (...) {
        rethrow_element(std::current_exception(), name, i_++);
      }
    }
    return k;
  }
  void start_epoch() {
    i_ = 0;
    done_ = false;
  }
  void save_words(state_writer& w) const {
    w.put(i_);
    w.put(done_);
  }
  // Throws config_error for a state past this generator's count (saved from a longer one).
  void restore_words(state_reader& r) {
    const std::uint64_t i = r.get();
    if (i > count_)
      throw config_error("restore_state: from_generator: the state is at index " + std::to_string(i) +
                         ", past this generator's count of " + std::to_string(count_) +
                         " (saved from a longer one?)");
    i_ = i;
    done_ = r.get() != 0;
  }

  std::uint64_t count_;
  F f_;
  std::uint64_t i_ = 0;
  bool done_ = false;
};

}  // namespace detail

// The type of ferry::from_generator.
struct from_generator_t {
  // from_generator(f): f(i) returns std::optional<T>; the first nullopt ends the epoch.
  template <class F>
    requires std::is_invocable_v<F&, std::uint64_t> &&
             detail::is_optional<std::invoke_result_t<F&, std::uint64_t>>::value
  auto operator()(F f) const {
    return detail::generator_source<F>(std::numeric_limits<std::uint64_t>::max(), std::move(f));
  }
  // from_generator(count, f): the elements f(0) ... f(count - 1) (when f returns a
  // std::optional, its first nullopt ends the epoch sooner). Throws config_error for a
  // negative count (an int -5 would otherwise become 2^64 - 5 elements).
  template <class F>
    requires std::is_invocable_v<F&, std::uint64_t>
  auto operator()(int_arg count, F f) const {
    return detail::generator_source<F>(count.count("from_generator", "the count"), std::move(f));
  }
};
// from_generator(f) / from_generator(count, f): a source from a function of the element
// index (see the file's top).
inline constexpr from_generator_t from_generator{};

}  // namespace ferry
