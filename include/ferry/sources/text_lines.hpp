// ferry/sources/text_lines.hpp: one record per line (TensorFlow's TextLineDataset), for
// from_files(paths, ferry::text_lines{}).
//
// Records are the line's bytes without its ending ("\n" or "\r\n"); empty lines are
// records; the last line may lack its newline (a file ending in "\n" has no extra empty
// record). A line longer than the file cannot exist; in a compressed stream a line longer
// than max_record_bytes is a format_error at the line's offset.
#pragma once

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
      if (nl) {
        const std::size_t len = static_cast<const std::byte*>(nl) - s.data();
        const std::size_t cut = (len > 0 && s.data()[len - 1] == std::byte{'\r'}) ? len - 1 : len;
        f.out = {s.data(), cut};
        f.advance = len + 1;
        return frame_status::record;
      }
      scanned = avail;
      if (s.at_eof()) {
        if (avail == 0) return frame_status::end;
        f.out = {s.data(), avail};
        f.advance = avail;
        return frame_status::record;
      }
      if (!s.size() && avail > max_record)
        throw format_error(s.path(), s.offset(),
                           "a line longer than max_record_bytes (" + std::to_string(max_record) + ")");
      s.ensure(avail + std::max<std::size_t>(avail, 4096));
    }
  }
};

}  // namespace detail
}  // namespace ferry
