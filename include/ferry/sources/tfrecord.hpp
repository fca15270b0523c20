// ferry/sources/tfrecord.hpp: the TFRecord format (TensorFlow's TFRecordWriter), for
// from_files(paths, ferry::tfrecord{...}).
//
//   record := uint64 length (LE) | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)
//
// Records are the data bytes. CRCs are verified unless .verify_crc = false. Files whose
// names end in .gz/.zlib are inflated (whole-file GZIP/ZLIB, as TFRecordOptions writes).
// Errors (format_error, at the offset where the bad record starts; in the uncompressed
// stream for compressed files): "truncated record", "corrupted record (length CRC
// mismatch)", "corrupted record (data CRC mismatch)", a length larger than what is left in
// the file (never allocated). An empty file is a valid file of no records, as in TensorFlow.
//
// Threads: a format framer runs where from_files reads (the thread calling next(), or
// interleave's reader threads); it runs no user code.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "ferry/sources/array_meta.hpp"
#include "ferry/sources/detail/byte_stream.hpp"
#include "ferry/sources/detail/crc32c.hpp"
#include "ferry/sources/detail/framing.hpp"

namespace ferry {

// The TFRecord format tag, for from_files (see the file's top).
struct tfrecord {
  bool verify_crc = true;  // check both CRCs of every record (format_error on a mismatch)
};

namespace detail {

struct tfrecord_framer {
  tfrecord opt;
  std::uint64_t max_record = 0;
  // Records already verified (both CRCs) from the bytes at the current position, front
  // first: their data lengths. See verify_ahead().
  std::array<std::uint64_t, 4> ok_len{};
  unsigned ok_n = 0, ok_i = 0;
  static constexpr std::size_t lane_max = 256;  // longer: one at a time (ISA-L) is faster

  void open(byte_stream&) { ok_n = ok_i = 0; }
  void seek_rows(std::uint64_t) { ok_n = ok_i = 0; }
  const array_meta* meta() const { return nullptr; }

  frame_status next(byte_stream& s, frame& f) {
    if (ok_i < ok_n || (opt.verify_crc && verify_ahead(s))) {
      const std::uint64_t len = ok_len[ok_i++];
      f.out = {s.data() + 12, static_cast<std::size_t>(len)};
      f.advance = static_cast<std::size_t>(len) + 16;
      return frame_status::record;
    }
    const std::size_t h = s.ensure(12);
    if (h == 0) return frame_status::end;
    if (h < 12)
      throw format_error(s.path(), s.offset(),
                         "truncated record (" + std::to_string(h) + " bytes of a 12-byte header)");
    const std::byte* p = s.data();
    const std::uint64_t len = load_le64(p);
    if (opt.verify_crc && crc32c::mask(crc32c::value(p, 8)) != load_le32(p + 8))
      throw format_error(s.path(), s.offset(), "corrupted record (length CRC mismatch)");
    std::uint64_t left;
    if (s.size()) {
      left = *s.size() - s.offset();
      if (len > left || left - len < 16)
        throw format_error(s.path(), s.offset(),
                           "truncated record (the length field says " + std::to_string(len) + " bytes, " +
                               std::to_string(left < 16 ? 0 : left - 16) + " are left in the file)");
    }
    if (len > max_record)  // in a plain file too: nothing allocates the rest of a file
      throw format_error(s.path(), s.offset(),
                         "record length " + std::to_string(len) + " exceeds max_record_bytes (" +
                             std::to_string(max_record) + ")");
    const std::size_t need = static_cast<std::size_t>(len) + 16;
    const std::size_t got = s.ensure(need);
    if (got < need)
      throw format_error(s.path(), s.offset(),
                         "truncated record (the length field says " + std::to_string(len) + " bytes, " +
                             std::to_string(got < 16 ? 0 : got - 16) + " are left)");
    p = s.data();
    if (opt.verify_crc &&
        crc32c::mask(crc32c::value(p + 12, static_cast<std::size_t>(len))) != load_le32(p + 12 + len)) {
      f.bad_offset = s.offset();
      f.why = "corrupted record (data CRC mismatch)";
      s.consume(need);
      return frame_status::bad_record;
    }
    f.out = {p + 12, static_cast<std::size_t>(len)};
    f.advance = need;
    return frame_status::record;
  }

  // When the next four records are short, of one length and already buffered, checks
  // their length and data CRCs four at a time (crc32c::value_x4) and keeps those before
  // the first failure, which the one-by-one path above then reports as before. True
  // when it verified at least one.
  bool verify_ahead(const byte_stream& s) {
    ok_n = ok_i = 0;
    const std::byte* p = s.data();
    std::size_t left = s.available();
    if (!p || left < 12) return false;
    const std::uint64_t len = load_le64(p);
    if (len >= lane_max || 4 * (len + 16) > left || len > max_record) return false;
    const unsigned char *head[4], *data[4];
    for (int k = 0; k < 4; ++k, p += len + 16) {
      if (k > 0 && load_le64(p) != len) return false;
      head[k] = reinterpret_cast<const unsigned char*>(p);
      data[k] = head[k] + 12;
    }
    std::uint32_t hc[4], dc[4];
    crc32c::value_x4(head, 8, hc);
    crc32c::value_x4(data, static_cast<std::size_t>(len), dc);
    for (int k = 0; k < 4; ++k) {
      const std::byte* r = reinterpret_cast<const std::byte*>(head[k]);
      if (crc32c::mask(hc[k]) != load_le32(r + 8) || crc32c::mask(dc[k]) != load_le32(r + 12 + len)) break;
      ok_len[ok_n++] = len;
    }
    return ok_n > 0;
  }
};

}  // namespace detail
}  // namespace ferry
