// Helpers for the source tests: a temporary directory, file writers, a naive oracle.
#pragma once

#include <stdlib.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include "ferry/sources/detail/crc32c.hpp"
#include "ferry/sources/detail/file_reader.hpp"

namespace src_test {

inline std::string data_dir() {
  const char* d = std::getenv("FERRY_TEST_DATA");
  return std::string(d ? d : "tests/data") + "/sources";
}

struct temp_dir {
  std::string path;
  temp_dir() {
    char tmpl[] = "/tmp/ferry-src-XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~temp_dir() { std::filesystem::remove_all(path); }
  std::string operator/(const std::string& n) const { return path + "/" + n; }
};

inline void write_file(const std::string& p, const std::string& bytes) {
  FILE* f = std::fopen(p.c_str(), "wb");
  if (!f) throw std::runtime_error("cannot write " + p);
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
}
inline void write_gzip(const std::string& p, const std::string& bytes) {
  gzFile f = gzopen(p.c_str(), "wb");
  gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(f);
}
inline std::string read_file(const std::string& p) {
  FILE* f = std::fopen(p.c_str(), "rb");
  if (!f)  // the test's data, most likely: meson test sets FERRY_TEST_DATA, a run by hand may not
    throw std::runtime_error("cannot read " + p + " (run from the source tree, or set FERRY_TEST_DATA to its tests/data)");
  std::string s;
  char buf[65536];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
  std::fclose(f);
  return s;
}

inline std::string le(std::uint64_t v, int bytes) {
  std::string s;
  for (int i = 0; i < bytes; ++i) s += static_cast<char>(v >> (8 * i));
  return s;
}
// One TFRecord (the test-side writer; its CRC/masking is checked against the bytes
// TensorFlow's TFRecordWriter writes, vectors.tfrecord from make_fixtures.py).
inline std::string tfrecord_of(const std::string& data) {
  namespace c = ferry::detail::crc32c;
  std::string len = le(data.size(), 8);
  return len + le(c::mask(c::value(len.data(), 8)), 4) + data + le(c::mask(c::value(data.data(), data.size())), 4);
}

inline std::string be32(std::uint32_t v) {
  std::string s;
  for (int i = 3; i >= 0; --i) s += static_cast<char>(v >> (8 * i));
  return s;
}

// A .npy file as numpy.lib.format writes it: magic, version, header length, the dict
// padded with spaces (plus `extra_pad`) to a multiple of 64 and ended by '\n', the data.
inline std::string npy_with_dict(const std::string& dict, const std::string& data, int major = 1,
                                 std::size_t extra_pad = 0) {
  const std::size_t prefix = major == 1 ? 10 : 12;
  std::string h = dict + std::string(extra_pad, ' ');
  while ((prefix + h.size() + 1) % 64 != 0) h += ' ';
  h += '\n';
  std::string out = "\x93NUMPY";
  out += static_cast<char>(major);
  out += '\0';
  return out + le(h.size(), major == 1 ? 2 : 4) + h + data;
}
inline std::string npy_of(const std::string& descr, const std::string& shape, const std::string& data) {
  return npy_with_dict("{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }", data);
}
// An IDX file: 0, 0, type, ndim, big-endian dims, data.
inline std::string idx_of(unsigned type, const std::vector<std::uint32_t>& dims, const std::string& data) {
  std::string s{'\0', '\0', static_cast<char>(type), static_cast<char>(dims.size())};
  for (std::uint32_t d : dims) s += be32(d);
  return s + data;
}

inline std::string random_bytes(std::mt19937_64& g, std::size_t n) {
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(g());
  return s;
}

// A tar archive as GNU tar and Python's tarfile write one (the test-side writer, checked
// against GNU tar's own archives in test_webdataset.cpp): ustar headers, a GNU 'L' or pax
// 'x' header for names over 100 bytes (long_kind), or ustar's prefix field ('p').
struct tar_writer {
  std::string out;

  static std::string octal(std::uint64_t v, std::size_t width) {  // width - 1 digits, then NUL
    std::string s(width - 1, '0');
    for (std::size_t i = width - 1; i-- > 0; v >>= 3) s[i] = static_cast<char>('0' + (v & 7));
    return s + '\0';
  }
  // One header block; base256 writes the size as GNU does for 8 GiB and more.
  static std::string header(const std::string& name, std::uint64_t size, char type, const std::string& prefix = "",
                            bool base256 = false) {
    std::string h(512, '\0');
    h.replace(0, std::min<std::size_t>(name.size(), 100), name.substr(0, 100));
    h.replace(100, 8, octal(0644, 8));
    h.replace(108, 8, octal(0, 8));
    h.replace(116, 8, octal(0, 8));
    if (base256) {
      h[124] = static_cast<char>(0x80);
      for (int i = 0; i < 8; ++i) h[135 - i] = static_cast<char>(size >> (8 * i));
    } else {
      h.replace(124, 12, octal(size, 12));
    }
    h.replace(136, 12, octal(1700000000, 12));
    h[156] = type;
    h.replace(257, 6, std::string("ustar\0", 6));
    h.replace(263, 2, "00");
    h.replace(345, std::min<std::size_t>(prefix.size(), 155), prefix.substr(0, 155));
    h.replace(148, 8, "        ");
    unsigned sum = 0;
    for (unsigned char c : h) sum += c;
    h.replace(148, 8, octal(sum, 7) + ' ');
    return h;
  }
  static std::string padded(const std::string& data) {
    return data + std::string((512 - data.size() % 512) % 512, '\0');
  }
  static std::string pax_record(const std::string& key, const std::string& value) {
    const std::string body = " " + key + "=" + value + "\n";
    std::size_t n = body.size() + 1;
    while (std::to_string(n).size() + body.size() != n) ++n;
    return std::to_string(n) + body;
  }
  // Adds a member; returns its header's offset.
  std::size_t add(const std::string& name, const std::string& data, char type = '0', char long_kind = 'L',
                  bool base256 = false) {
    const std::size_t at = out.size();
    std::string field = name, prefix;
    if (name.size() > 100 && long_kind == 'L') {
      out += header("././@LongLink", name.size() + 1, 'L') + padded(name + '\0');
      field = name.substr(0, 100);
    } else if (name.size() > 100 && long_kind == 'x') {
      const std::string rec = pax_record("path", name);
      out += header("PaxHeaders/x", rec.size(), 'x') + padded(rec);
      field = name.substr(0, 100);
    } else if (name.size() > 100 && long_kind == 'p') {
      const std::size_t cut = name.rfind('/', 155);
      prefix = name.substr(0, cut);
      field = name.substr(cut + 1);
    }
    out += header(field, data.size(), type, prefix, base256) + padded(data);
    return at;
  }
  void end() { out += std::string(1024, '\0'); }
};

// Runs `f`, expecting a ferry error naming `path` at `offset` whose message contains `what`.
template <class E = ferry::error, class F>
void expect_error(F&& f, const std::string& path, std::uint64_t offset, const std::string& what) {
  try {
    f();
    FAIL("no error; expected: " << what);
  } catch (const E& e) {
    const auto d = ferry::detail::describe(e);
    CHECK(d.path == path);
    CHECK(d.offset == offset);
    CHECK_MESSAGE(std::string(e.what()).rfind(path + ": ", 0) == 0, std::string(e.what()));  // names the file
    CHECK_MESSAGE(std::string(e.what()).find(what) != std::string::npos, std::string(e.what()));
  }
}

}  // namespace src_test
