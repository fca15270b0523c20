// ferry/sources/idx.hpp: IDX files (MNIST, Fashion-MNIST), plain or gzip-compressed, for
// from_files(paths, ferry::idx{}).
//
//   uint8 0, uint8 0, uint8 type, uint8 ndim, uint32 dim[ndim] (big-endian), data
//
// Each record is one row along the first axis, its bytes as stored (multi-byte values stay
// big-endian); meta() gives dtype (">f4", "|u1", ...) and shape. Refused with a
// format_error naming file and offset: a wrong magic or type, ndim 0, a truncated header,
// shapes whose size overflows, more than max_empty_rows (2^24) rows of 0 bytes (a
// dimension of 0), missing rows (at the first missing one) and bytes after the last row. A compressed file cut short: a format_error at the first row it cannot
// complete (offset in the uncompressed data).
//
// Threads: a format framer runs where from_files reads (the thread calling next(), or
// interleave's reader threads); it runs no user code.
#pragma once

#include <cstdint>
#include <string>

#include "ferry/sources/array_meta.hpp"
#include "ferry/sources/detail/byte_stream.hpp"
#include "ferry/sources/detail/framing.hpp"

namespace ferry {

struct idx {};

namespace detail {

struct idx_framer : array_framer {
  void open(byte_stream& s) {
    const std::size_t got = s.ensure(4);
    if (got < 4) throw format_error(s.path(), 0, "truncated IDX header (" + std::to_string(got) + " bytes)");
    const std::byte* p = s.data();
    const unsigned type = std::to_integer<unsigned>(p[2]), ndim = std::to_integer<unsigned>(p[3]);
    const char* dt = nullptr;
    std::size_t item = 0;
    switch (type) {
      case 0x08: dt = "|u1", item = 1; break;
      case 0x09: dt = "|i1", item = 1; break;
      case 0x0B: dt = ">i2", item = 2; break;
      case 0x0C: dt = ">i4", item = 4; break;
      case 0x0D: dt = ">f4", item = 4; break;
      case 0x0E: dt = ">f8", item = 8; break;
      default: break;
    }
    if (p[0] != std::byte{0} || p[1] != std::byte{0} || !dt || ndim == 0) {
      char hex[16];
      std::snprintf(hex, sizeof hex, "0x%08x", load_be32(p));
      throw format_error(s.path(), 0, std::string("not an IDX file (wrong magic ") + hex + ")");
    }
    const std::size_t hdr = 4 + 4 * std::size_t(ndim);
    if (s.ensure(hdr) < hdr)
      throw format_error(s.path(), 0, "truncated IDX header (" + std::to_string(ndim) + " dimensions need " +
                                          std::to_string(hdr) + " bytes)");
    p = s.data();
    m = array_meta{};
    m.dtype = dt;
    m.item_bytes = item;
    for (unsigned d = 0; d < ndim; ++d) m.shape.push_back(load_be32(p + 4 + 4 * d));
    std::uint64_t row = item;
    for (unsigned d = 1; d < ndim; ++d)
      if (mul_overflows(row, m.shape[d], row)) throw format_error(s.path(), 4, "the IDX shape's size overflows");
    m.rows = m.shape[0];
    m.row_bytes = row;
    std::uint64_t total;  // as npy: the whole array's size must be a number
    if (mul_overflows(m.rows, row, total)) throw format_error(s.path(), 4, "the IDX shape's size overflows");
    if (row == 0 && m.rows > max_empty_rows)
      throw format_error(s.path(), 4, "the header claims " + std::to_string(m.rows) +
                                          " rows of 0 bytes (at most 2^24: no byte of the file backs them)");
    s.consume(hdr);
    start_rows(s, hdr);
  }
};

}  // namespace detail
}  // namespace ferry
