// ferry/sources/fixed_length.hpp: back-to-back records of one size (TensorFlow's
// FixedLengthRecordDataset), with optional header and footer bytes to skip, for
// from_files(paths, ferry::fixed_length{.record_bytes = 3073, .header_bytes = 0}).
//
// A file whose size is not header + k * record_bytes + footer: the whole records before
// the partial one are read, then a format_error at the partial record's offset names the
// size found. from_files throws config_error for record_bytes == 0, for record_bytes +
// footer_bytes over from_files_options::max_record_bytes, and for sizes whose sum overflows.
//
// Threads: a format framer runs where from_files reads (the thread calling next(), or
// interleave's reader threads); it runs no user code.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "ferry/sources/array_meta.hpp"
#include "ferry/sources/detail/byte_stream.hpp"
#include "ferry/sources/detail/framing.hpp"

namespace ferry {

// The fixed-length format tag, for from_files (see the file's top).
struct fixed_length {
  std::size_t record_bytes = 0;  // every record's size (required: 0 is a config_error)
  std::size_t header_bytes = 0;  // bytes skipped at the start of each file
  std::size_t footer_bytes = 0;  // bytes skipped at the end of each file
};

namespace detail {

struct fixed_framer {
  fixed_length opt;
  std::uint64_t max_record = 0;

  const array_meta* meta() const { return nullptr; }
  void seek_rows(std::uint64_t) {}

  std::string shape_msg(const byte_stream& s, std::uint64_t seen) const {
    return "the size is not header (" + std::to_string(opt.header_bytes) + ") + k * " +
           std::to_string(opt.record_bytes) + " + footer (" + std::to_string(opt.footer_bytes) + "): " +
           size_phrase(s, seen);
  }
  void open(byte_stream& s) {
    // In pieces: a large header never needs a buffer of its size (compressed streams).
    std::size_t left = opt.header_bytes;
    while (left > 0) {
      const std::size_t step = std::min<std::size_t>(left, std::size_t(1) << 20);
      const std::size_t got = s.ensure(step);
      if (got < step) throw format_error(s.path(), 0, shape_msg(s, s.offset() + got));
      s.consume(got);
      left -= step;
    }
  }
  frame_status next(byte_stream& s, frame& f) {
    const std::size_t need = opt.record_bytes + opt.footer_bytes;
    const std::size_t got = s.ensure(need);
    if (got == need) {
      f.out = {s.data(), opt.record_bytes};
      f.advance = opt.record_bytes;
      return frame_status::record;
    }
    if (got == opt.footer_bytes) return frame_status::end;  // the footer is not read
    throw format_error(s.path(), s.offset(), shape_msg(s, s.offset() + got));
  }
};

}  // namespace detail
}  // namespace ferry
