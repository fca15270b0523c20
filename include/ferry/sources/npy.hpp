// ferry/sources/npy.hpp: NumPy .npy files (numpy.save), for from_files(paths, ferry::npy{}).
//
// Versions 1.0, 2.0 and 3.0. Each record is one row along the first axis (a scalar array
// is one record), its bytes as stored; the source's meta() gives dtype and shape. All
// files read together must have the same dtype and row shape.
// Refused with a format_error naming file and offset: a bad magic or version, a header
// length beyond the file (or over 1 MiB), a header that is not the dict NumPy writes,
// object dtypes ('|O': pickles), structured dtypes, a size NumPy has not for its kind
// ('<i3'), fortran_order True with more than one dimension, shapes whose size overflows,
// more than max_empty_rows (2^24) rows of 0 bytes, rows missing from the file (at the
// first missing row) and bytes after the last row.
//
// Threads: a format framer runs where from_files reads (the thread calling next(), or
// interleave's reader threads); it runs no user code.
#pragma once

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/sources/array_meta.hpp"
#include "ferry/sources/detail/byte_stream.hpp"
#include "ferry/sources/detail/framing.hpp"

namespace ferry {

struct npy {};

namespace detail {

inline constexpr std::size_t npy_max_header = 1 << 20;

// Parses NumPy's header dict; returns an error message, or empty on success.
inline std::string parse_npy_header(std::string_view h, array_meta& m, bool& fortran) {
  std::size_t i = 0;
  auto ws = [&] {
    while (i < h.size() && (h[i] == ' ' || h[i] == '\t' || h[i] == '\n' || h[i] == '\r')) ++i;
  };
  auto lit = [&](char c) {
    ws();
    if (i < h.size() && h[i] == c) {
      ++i;
      return true;
    }
    return false;
  };
  auto str = [&](std::string& out) {
    ws();
    if (i >= h.size() || (h[i] != '\'' && h[i] != '"')) return false;
    const char q = h[i++];
    const std::size_t e = h.find(q, i);
    if (e == std::string_view::npos) return false;
    out.assign(h.substr(i, e - i));
    i = e + 1;
    return true;
  };
  bool have_descr = false, have_order = false, have_shape = false;
  std::string descr;
  if (!lit('{')) return "the npy header is not a dict";
  for (;;) {
    if (lit('}')) break;
    std::string key;
    if (!str(key) || !lit(':')) return "the npy header is not a dict of quoted keys";
    ws();
    if (key == "descr") {
      if (i < h.size() && h[i] == '[') return "structured dtypes are not supported";
      if (!str(descr)) return "the npy descr is not a string";
      have_descr = true;
    } else if (key == "fortran_order") {
      if (h.substr(i, 4) == "True") fortran = true, i += 4;
      else if (h.substr(i, 5) == "False") fortran = false, i += 5;
      else return "the npy fortran_order is not True or False";
      have_order = true;
    } else if (key == "shape") {
      if (!lit('(')) return "the npy shape is not a tuple";
      m.shape.clear();
      for (;;) {
        if (lit(')')) break;
        ws();
        if (i >= h.size() || !std::isdigit(static_cast<unsigned char>(h[i]))) return "the npy shape holds a non-integer";
        std::uint64_t v = 0;
        while (i < h.size() && std::isdigit(static_cast<unsigned char>(h[i]))) {
          if (mul_overflows(v, 10, v) || __builtin_add_overflow(v, std::uint64_t(h[i] - '0'), &v))
            return "the npy shape overflows";
          ++i;
        }
        if (h.substr(i, 1) == "L") ++i;  // Python 2 longs
        m.shape.push_back(v);
        if (m.shape.size() > 64) return "the npy shape has more than 64 dimensions";
        if (lit(')')) {
          // Python reads "(3)" as the number 3, which NumPy refuses as a shape: "(3,)".
          if (m.shape.size() == 1) return "the npy shape (" + std::to_string(v) + ") is not a tuple (NumPy writes (" + std::to_string(v) + ",))";
          break;
        }
        if (!lit(',')) return "the npy shape is not a tuple of integers";
      }
      have_shape = true;
    } else {
      return "unknown key '" + key + "' in the npy header";
    }
    if (lit('}')) break;
    if (!lit(',')) return "the npy header dict is malformed";
  }
  ws();
  if (i != h.size()) return "unexpected text after the npy header dict";
  if (!have_descr || !have_order || !have_shape) return "the npy header lacks descr, fortran_order or shape";

  // descr: byte order, kind, size (e.g. <f4, |u1, <U10, <M8[ns]).
  if (descr.size() < 2) return "unsupported npy dtype '" + descr + "'";
  char order = descr[0], kind = descr[1];
  if (order != '<' && order != '>' && order != '|' && order != '=') return "unsupported npy dtype '" + descr + "'";
  if (kind == 'O') return "object arrays ('" + descr + "': Python pickles) are refused";
  std::size_t j = 2;
  std::uint64_t size = 0;
  while (j < descr.size() && std::isdigit(static_cast<unsigned char>(descr[j]))) {
    size = size * 10 + std::uint64_t(descr[j] - '0');
    if (size > (1u << 30)) return "unsupported npy dtype '" + descr + "'";
    ++j;
  }
  const std::string_view rest = std::string_view(descr).substr(j);
  static constexpr std::string_view kinds = "biufcSUVMm?";
  if (kinds.find(kind) == std::string_view::npos) return "unsupported npy dtype '" + descr + "'";
  if (kind == '?' && j == 2) size = 1;
  if (kind == 'U') size *= 4;
  if (!rest.empty() && !((kind == 'M' || kind == 'm') && rest.front() == '[' && rest.back() == ']'))
    return "unsupported npy dtype '" + descr + "'";
  if (size == 0 && kind != 'S' && kind != 'V' && kind != 'U') return "unsupported npy dtype '" + descr + "'";
  // The sizes NumPy writes for each kind (a '<i3' or '<f3' is no dtype of NumPy's).
  const auto one_of = [&](std::initializer_list<std::uint64_t> v) { return std::find(v.begin(), v.end(), size) != v.end(); };
  if (((kind == 'b' || kind == '?') && size != 1) || ((kind == 'i' || kind == 'u') && !one_of({1, 2, 4, 8})) ||
      (kind == 'f' && !one_of({2, 4, 8, 12, 16})) || (kind == 'c' && !one_of({8, 16, 24, 32})) ||
      ((kind == 'M' || kind == 'm') && size != 8))
    return "unsupported npy dtype '" + descr + "' (no such size for its kind)";
  m.dtype = descr;
  m.item_bytes = static_cast<std::size_t>(size);
  if (fortran && m.shape.size() > 1)
    return "fortran_order: True arrays of more than one dimension are not supported (rows are not contiguous)";
  std::uint64_t row = m.item_bytes;
  for (std::size_t d = 1; d < m.shape.size(); ++d)
    if (mul_overflows(row, m.shape[d], row)) return "the npy shape's size overflows";
  m.row_bytes = row;
  m.rows = m.shape.empty() ? 1 : m.shape[0];
  std::uint64_t total;
  if (mul_overflows(m.rows, m.row_bytes, total)) return "the npy shape's size overflows";
  if (m.row_bytes == 0 && m.rows > max_empty_rows)
    return "the header claims " + std::to_string(m.rows) + " rows of 0 bytes (at most 2^24: no byte of the file backs them)";
  return {};
}

struct npy_framer : array_framer {
  void open(byte_stream& s) {
    const std::size_t got = s.ensure(10);
    const std::byte* p = s.data();
    static constexpr unsigned char magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
    if (got < 6 || std::memcmp(p, magic, 6) != 0)
      throw format_error(s.path(), 0, got < 6 ? "truncated npy header (the file is too short for the magic)"
                                              : "not a .npy file (bad magic)");
    if (got < 10) throw format_error(s.path(), 0, "truncated npy header");
    const unsigned major = std::to_integer<unsigned>(p[6]), minor = std::to_integer<unsigned>(p[7]);
    if (major < 1 || major > 3 || minor != 0)
      throw format_error(s.path(), 6, "unsupported npy version " + std::to_string(major) + "." + std::to_string(minor));
    std::size_t prefix = major == 1 ? 10 : 12;
    if (s.ensure(prefix) < prefix) throw format_error(s.path(), 0, "truncated npy header");
    p = s.data();
    const std::uint64_t hlen = major == 1 ? (std::to_integer<std::uint64_t>(p[8]) | std::to_integer<std::uint64_t>(p[9]) << 8)
                                          : load_le32(p + 8);
    if (hlen > npy_max_header)
      throw format_error(s.path(), 8, "npy header length " + std::to_string(hlen) + " exceeds the limit of " +
                                          std::to_string(npy_max_header) + " bytes");
    const std::size_t total = prefix + static_cast<std::size_t>(hlen);
    const std::size_t have = s.ensure(total);
    if (have < total)
      throw format_error(s.path(), 8, "truncated npy header (the header length field says " + std::to_string(hlen) +
                                          " bytes, " + std::to_string(have - prefix) + " are in the file)");
    std::string_view h(reinterpret_cast<const char*>(s.data() + prefix), static_cast<std::size_t>(hlen));
    bool fortran = false;
    m = array_meta{};
    if (std::string err = parse_npy_header(h, m, fortran); !err.empty()) throw format_error(s.path(), prefix, err);
    s.consume(total);
    start_rows(s, total);
  }
};

}  // namespace detail
}  // namespace ferry
