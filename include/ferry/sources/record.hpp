// ferry/sources/record.hpp: one record read from a file: a contiguous, read-only byte
// range that keeps the read chunk it views alive.
//
// A record is a view into the reader's chunk (no copy on the read path) plus a shared
// reference to that chunk, so it stays valid for as long as the record (or any copy of
// it) exists, on any thread; the chunk returns to the reader's pool when its last record
// is destroyed. Copying a record copies the reference, not the bytes. It models
// std::ranges::contiguous_range of std::byte, so batch() collates records as a ragged
// field (one contiguous buffer plus offsets). Holding many records holds their chunks:
// consume or copy them if you keep them long.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <utility>

namespace ferry {

class record {
 public:
  using value_type = std::byte;

  record() = default;
  record(std::shared_ptr<const std::byte> bytes, std::size_t size) noexcept
      : p_(std::move(bytes)), n_(size) {}

  const std::byte* data() const noexcept { return p_.get(); }
  std::size_t size() const noexcept { return n_; }
  bool empty() const noexcept { return n_ == 0; }
  const std::byte* begin() const noexcept { return p_.get(); }
  const std::byte* end() const noexcept { return p_.get() + n_; }
  std::span<const std::byte> bytes() const noexcept { return {p_.get(), n_}; }
  std::string_view str() const noexcept { return {reinterpret_cast<const char*>(p_.get()), n_}; }

 private:
  std::shared_ptr<const std::byte> p_;
  std::size_t n_ = 0;
};

}  // namespace ferry
