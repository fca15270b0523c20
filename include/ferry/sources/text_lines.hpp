// ferry/sources/text_lines.hpp: one record per line (TensorFlow's TextLineDataset), for
// from_files(paths, ferry::text_lines{}).
//
// Records are the line's bytes without its ending ("\n" or "\r\n"); empty lines are
// records; the last line may lack its newline (a file ending in "\n" has no extra empty
// record). A line longer than max_record_bytes (from_files_options; 64 MiB by default) is a
// format_error at the line's offset, in a plain file or a compressed stream, whatever the
// chunk size, and no more than max_record_bytes + 2 are buffered looking for its end.
//
// Threads: a format framer runs where from_files reads (the thread calling next(), or
// interleave's reader threads); it runs no user code.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "ferry/sources/array_meta.hpp"
#include "ferry/sources/detail/byte_stream.hpp"
#include "ferry/sources/detail/framing.hpp"

namespace ferry {

struct text_lines {};

namespace detail {

struct lines_framer {
  std::uint64_t max_record = 0;

  const array_meta* meta() const { return nullptr; }
  void seek_rows(std::uint64_t) {}
  void open(byte_stream&) {}

  frame_status next(byte_stream& s, frame& f) {
    std::size_t scanned = 0;
    for (;;) {
      const std::size_t avail = s.available();
      const void* nl = avail > scanned ? std::memchr(s.data() + scanned, '\n', avail - scanned) : nullptr;
      if (nl || s.at_eof()) {
        if (!nl && avail == 0) return frame_status::end;
        const std::size_t len = nl ? static_cast<std::size_t>(static_cast<const std::byte*>(nl) - s.data()) : avail;
        const std::size_t cut = (nl && len > 0 && s.data()[len - 1] == std::byte{'\r'}) ? len - 1 : len;
        // Checked on every line, not only while searching: whether a line was found in
        // what was already buffered depends on the chunk size.
        if (cut > max_record) too_long(s);
        f.out = {s.data(), cut};
        f.advance = nl ? len + 1 : avail;
        return frame_status::record;
      }
      scanned = avail;
      // grow(), not ensure(): the lines complete in what is read before a damaged
      // compressed stream ends are records, and the error comes at the first line after.
      // Never buffer more than max_record_bytes and a "\r\n" looking for the end.
      if (avail > max_record && avail - max_record > 1) too_long(s);
      const std::uint64_t cap = max_record > UINT64_MAX - 2 ? UINT64_MAX : max_record + 2;
      s.grow(static_cast<std::size_t>(std::min<std::uint64_t>(avail + std::max<std::size_t>(avail, 4096), cap)));
    }
  }
  [[noreturn]] void too_long(const byte_stream& s) const {
    throw format_error(s.path(), s.offset(), "a line longer than max_record_bytes (" + std::to_string(max_record) + ")");
  }
};

}  // namespace detail
}  // namespace ferry
