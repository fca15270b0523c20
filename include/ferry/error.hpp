// ferry/error.hpp: the exception hierarchy. Every library failure throws one of these.
//
//   ferry::error            base of everything ferry throws (a std::runtime_error)
//   ferry::config_error     a bad argument: says what is allowed
//   ferry::io_error         an OS-level failure: path, byte offset, std::error_code
//   ferry::format_error     corrupt or truncated data: path, byte offset, what was expected
//   ferry::element_error    user code (a map function, a filter predicate, a generator)
//                           threw at element k; the original is kept as the nested exception
//
// Constructing one may throw std::bad_alloc (the message is a std::string); nothing here
// runs user code or starts threads. Any thread may throw and catch them.
#pragma once

#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <system_error>

namespace ferry {

// Base of everything ferry throws: catch it to catch any library failure.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A bad argument or configuration (a zero batch size, a checkpoint of another pipeline):
// the message says what is allowed.
class config_error : public error {
 public:
  using error::error;
};

// An OS-level failure (open, read, write): the message is "path: what at offset N: the
// OS's message".
class io_error : public error {
 public:
  // `what` names the operation that failed, e.g. "cannot open the trace file".
  io_error(std::string path, std::uint64_t offset, std::error_code code, const std::string& what)
      : error(path + ": " + what + " at offset " + std::to_string(offset) + ": " + code.message()),
        path_(std::move(path)), offset_(offset), code_(code) {}
  // The file that failed.
  const std::string& path() const noexcept { return path_; }
  // The byte offset in it where the operation was.
  std::uint64_t offset() const noexcept { return offset_; }
  // The OS's error code (errno as a std::error_code).
  std::error_code code() const noexcept { return code_; }

 private:
  std::string path_;
  std::uint64_t offset_;
  std::error_code code_;
};

// Corrupt or truncated data: the message is "path: what was expected at offset N".
class format_error : public error {
 public:
  // `what` says what was expected, e.g. "corrupted record (length CRC mismatch)".
  format_error(std::string path, std::uint64_t offset, const std::string& what)
      : error(path + ": " + what + " at offset " + std::to_string(offset)),
        path_(std::move(path)), offset_(offset), reason_(what) {}
  // The file with the bad data.
  const std::string& path() const noexcept { return path_; }
  // The byte offset of the bad record or header in it.
  std::uint64_t offset() const noexcept { return offset_; }
  // What was expected, without path and offset.
  const std::string& reason() const noexcept { return reason_; }

 private:
  std::string path_;
  std::uint64_t offset_;
  std::string reason_;
};

// Thrown on the consumer's thread when user code failed on a worker thread. It is also a
// std::nested_exception holding the original: std::rethrow_if_nested(e) recovers it.
class element_error : public error, public std::nested_exception {
 public:
  // Must be constructed inside a catch block (or with the original current), as
  // std::nested_exception captures std::current_exception().
  element_error(const std::string& stage, std::uint64_t element, const std::string& what)
      : error(stage + ": user function threw at element " + std::to_string(element) + ": " + what),
        element_(element) {}
  // The element's index k (counted as the stage's header says, usually per epoch).
  std::uint64_t element() const noexcept { return element_; }

 private:
  std::uint64_t element_;
};

// What from_files does with a bad record (from_files_options::on_error). Declared here, not
// in sources/file_options.hpp, so that it precedes every stage header's `ferry::skip`: GCC
// 12's -Wshadow takes a scoped enumerator declared after it for a shadow.
enum class error_policy { raise, skip };

namespace detail {
// Rethrows `original` on this thread wrapped as an element_error naming the stage and
// element; ferry's own errors (already carrying file and offset) pass through unchanged.
[[noreturn]] inline void rethrow_element(std::exception_ptr original, const char* stage,
                                         std::uint64_t element) {
  try {
    std::rethrow_exception(original);
  } catch (const ferry::error&) {
    throw;
  } catch (const std::exception& e) {
    throw element_error(stage, element, e.what());
  } catch (...) {
    throw element_error(stage, element, "unknown exception");
  }
}
}  // namespace detail

}  // namespace ferry
