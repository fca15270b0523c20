// ferry/sources/detail/framing.hpp: what every record framer shares.
//
// A framer cuts one file's byte_stream into records. open() reads the file's header;
// next() either returns `record` with `out` viewing stream bytes and `advance` the bytes
// to consume once the record has been taken, `end`, or `bad_record` after consuming a
// bad record it could frame (only a TFRecord data-CRC mismatch). Anything else wrong
// throws format_error / io_error at the offset where the bad record starts; the rest of
// that file cannot be read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include "ferry/error.hpp"
#include "ferry/sources/array_meta.hpp"
#include "ferry/sources/detail/byte_stream.hpp"

namespace ferry::detail {

enum class frame_status { record, end, bad_record };

struct frame {
  std::span<const std::byte> out;
  std::size_t advance = 0;
  std::string why;  // bad_record: what was wrong (the offset is bad_offset)
  std::uint64_t bad_offset = 0;
};

inline std::uint64_t load_le64(const std::byte* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | std::to_integer<std::uint64_t>(p[i]);
  return v;
}
inline std::uint32_t load_le32(const std::byte* p) {
  std::uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | std::to_integer<std::uint32_t>(p[i]);
  return v;
}
inline std::uint32_t load_be32(const std::byte* p) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v = (v << 8) | std::to_integer<std::uint32_t>(p[i]);
  return v;
}

// "N bytes" of the file, or of its uncompressed stream, for messages.
inline std::string size_phrase(const byte_stream& s, std::uint64_t seen_to) {
  if (s.size()) return "the file has " + std::to_string(*s.size()) + " bytes";
  return "the uncompressed stream has " + std::to_string(seen_to) + " bytes";
}

inline bool mul_overflows(std::uint64_t a, std::uint64_t b, std::uint64_t& out) {
  return __builtin_mul_overflow(a, b, &out);
}

// Rows of equal size after a header: shared by .npy and IDX.
struct row_framer {
  std::uint64_t rows = 0, row_bytes = 0, done = 0;
  const char* what = "row";

  frame_status next(byte_stream& s, frame& f) {
    if (done == rows) {
      if (s.ensure(1) != 0)
        throw format_error(s.path(), s.offset(),
                           "unexpected bytes after the last " + std::string(what) + " (the header says " +
                               std::to_string(rows) + " rows)");
      return frame_status::end;
    }
    const std::size_t need = static_cast<std::size_t>(row_bytes);
    const std::size_t got = s.ensure(need);
    if (got < need)
      throw format_error(s.path(), s.offset(),
                         "truncated " + std::string(what) + " " + std::to_string(done) + " of " +
                             std::to_string(rows) + ": it needs " + std::to_string(need) + " bytes, " +
                             std::to_string(got) + " are left (" + size_phrase(s, s.offset() + got) + ")");
    f.out = {s.data(), need};
    f.advance = need;
    ++done;
    return frame_status::record;
  }
  // Checks the data region against the file size up front is not needed: rows that are
  // present are read, the first missing one is an error at its offset.
  void check_row_limit(const byte_stream& s, std::uint64_t data_offset, std::uint64_t max_record) const {
    const std::uint64_t in_file = s.size() ? (*s.size() > data_offset ? *s.size() - data_offset : 0) : max_record;
    if (rows > 0 && row_bytes > in_file && in_file < max_record)
      throw format_error(s.path(), data_offset,
                         "a " + std::string(what) + " of " + std::to_string(row_bytes) +
                             " bytes is larger than the data in the file (" + std::to_string(in_file) + " bytes)");
    if (rows > 0 && row_bytes > max_record)
      throw format_error(s.path(), data_offset,
                         "a " + std::string(what) + " of " + std::to_string(row_bytes) +
                             " bytes is larger than max_record_bytes (" + std::to_string(max_record) + ")");
  }
};

// npy and IDX: a header describing the array (m), then its rows. Each format's open()
// reads the header into m, consumes it and calls start_rows(header bytes).
struct array_framer {
  std::uint64_t max_record = 0;
  array_meta m;
  row_framer rows;

  const array_meta* meta() const { return &m; }
  void seek_rows(std::uint64_t r) { rows.done = r; }
  frame_status next(byte_stream& s, frame& f) { return rows.next(s, f); }

 protected:
  void start_rows(const byte_stream& s, std::uint64_t header_bytes) {
    rows = row_framer{m.rows, m.row_bytes, 0, "row"};
    rows.check_row_limit(s, header_bytes, max_record);
  }
};

}  // namespace ferry::detail
