// ferry/sources/webdataset.hpp: WebDataset's tar shards, for
// from_files(paths, ferry::webdataset{}), and parse_webdataset, which splits a sample into
// its members.
//
//   auto src = ferry::from_files({"photos/photos-*.tar"}, ferry::webdataset{}) | ferry::shard(n, i);
//   for (ferry::record& r : src) {
//     ferry::webdataset_sample s = ferry::parse_webdataset(r);
//     const ferry::record& jpg = s.at("jpg");   // 000123.jpg's bytes: a view, no copy
//     int label = std::stoi(std::string(s.at("cls").str()));
//   }
//
// A record is one sample: the run of consecutive tar members whose names share a key
// (WebDataset's rule: the key is the path up to the first dot of the base name, the
// extension the rest, lowercased as WebDataset does (ASCII letters): a/000123.Seg.PNG is
// key a/000123, extension seg.png), from the first member's header to the end of the last
// one's padding, so a sample is read, sharded, interleaved, shuffled and checkpointed like
// any record, and costs no copy.
// parse_webdataset(record) walks it again and gives each member as a record of its own
// (record::part: the same storage), whose origin is the member's header.
//
// Tar as written by GNU tar, Python's tarfile and WebDataset's writers: POSIX ustar
// (prefix + name), GNU long names ('L'), pax headers ('x': path and size), base-256
// sizes; directories, links, global pax headers, names without a dot (README) and
// WebDataset's metadata names (a first path component __like_this__: __meta__/info.json)
// carry no sample data and are passed over, as WebDataset's reader does: before a sample a
// chunk at a time, after a member within the sample's span (only past them is it known
// whether the sample goes on), so they never split one. Two zero blocks end an archive;
// reading goes on after them when another archive follows (cat a.tar b.tar), as tar
// --ignore-zeros does; bytes after them that are not a tar header end the file (a newline
// added at the end, padding), as plain tar stops at the zero blocks; a damaged header there
// (the ustar magic, or a checksum field that is a number, but a wrong sum) is a
// format_error, not an end that would drop the next archive's samples. After a lone zero
// block such bytes are a format_error (a member whose header was zeroed: its data
// follows), not a silent end that would drop the samples after it. Long-name and pax
// headers (pax records hold xattrs of any size) count toward max_record_bytes. GNU sparse
// members ('S', or pax GNU.sparse.* records) are a format_error: their data is a map and
// fragments, not the file's bytes. A sample is buffered whole: its members and what is
// passed over between them must fit max_record_bytes (64 MiB by default); a larger one is
// read past a chunk at a time and is a bad record (Errors). An entry passed over after a
// member that would take the sample past it ends the sample there, since whether the
// sample goes on after it is not known without reading it: only a member of the same key
// after it is a bad record (Errors). So do a member's long-name or pax headers that would.
//
// Threads: the framer runs where from_files reads (the thread calling next(), or
// interleave's reader threads); parse_webdataset on the calling thread (map's workers):
// neither runs user code.
//
// Errors: format_error, at the offset of the header where the bad member starts: "not a tar
// header (checksum mismatch)", a size field that is not a number, a truncated header or
// member ("truncated member 'a/1.jpg' (its header says n bytes, m are left)"), a long name
// or pax header with no member after it, a sparse member; with any of these the rest of
// the file cannot be read (a whole sample before a damaged header, or before an entry
// passed over that is cut short, comes out first). Bad records, which error_policy::skip
// passes over alone (raise throws them as format_errors, and the next call reads on after
// them): a sample larger than max_record_bytes (at its first header, naming the member that
// takes it past), a sample with
// two members of one extension (in any case: 1.jpg and 1.JPG, as WebDataset), and the rest of a sample that went on after an entry passed
// over, or at a member whose long-name or pax headers, would take it past max_record_bytes
// (framed from the next member's header on, naming the entry: the sample came out without
// them; not seen across a restore between the two, as the checkpoint is an offset). An
// archive cut at a member's end cannot be told from a whole one (tar has no count): its last
// sample has the members before the cut, and at() names the one missing. An empty file is an
// archive of no samples.
// parse_webdataset and at() throw format_error (see each).
//
// Memory: a sample is buffered whole in from_files' chunks (at most max_record_bytes);
// parse_webdataset allocates the sample's strings and member list, not its bytes (reuse
// one sample with the two-argument form to keep their capacity).
//
// Checkpoints: from_files' own: the offset of the next sample in its file.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/error.hpp"
#include "ferry/sources/array_meta.hpp"
#include "ferry/sources/detail/byte_stream.hpp"
#include "ferry/sources/detail/framing.hpp"
#include "ferry/sources/record.hpp"

namespace ferry {

// The WebDataset (tar) format tag, for from_files (see the file's top).
struct webdataset {};

namespace detail {
inline char lower_ascii(char c) noexcept { return c >= 'A' && c <= 'Z' ? char(c - 'A' + 'a') : c; }
// Extensions compare as WebDataset's lowercased ones do.
inline bool same_ext(std::string_view a, std::string_view b) noexcept {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(),
                                            [](char x, char y) { return lower_ascii(x) == lower_ascii(y); });
}
inline std::string lowered(std::string_view x) {
  std::string s(x);
  for (char& c : s) c = lower_ascii(c);
  return s;
}
}  // namespace detail

// One member of a sample: its extension ("jpg", "seg.png") and its bytes.
struct webdataset_member {
  std::string ext;  // the name after the first dot of its base name, lowercased
  record data;      // its bytes, sharing the sample's storage; origin: its header
};

// A sample: its key and its members, in the tar's order.
struct webdataset_sample {
  std::string key;  // the path up to the first dot of the base name ("a/000123")
  std::vector<webdataset_member> members;  // each extension once

  // The member with extension `ext` (ASCII letters in any case: "jpg" finds 1.JPG), or
  // nullptr. Throws nothing.
  const record* find(std::string_view ext) const noexcept {
    for (const auto& m : members)
      if (detail::same_ext(m.ext, ext)) return &m.data;
    return nullptr;
  }
  // The member with extension `ext`; throws format_error naming the file, the sample's
  // offset (in `r`, where it was read), its key and the extensions it has, when missing.
  const record& at(std::string_view ext) const {
    if (const record* p = find(ext)) return *p;
    std::string have;
    for (const auto& m : members) have += (have.empty() ? "" : ", ") + m.ext;
    const record_origin o = members.empty() ? record_origin{} : members.front().data.origin();
    throw format_error(std::string(o.file), o.offset,
                       "sample '" + key + "' has no member '." + std::string(ext) + "' (it has " +
                           (have.empty() ? std::string("none") : have) + ")");
  }
};

namespace detail {

// One member of a tar archive, found at `start` (its first header, a long-name or pax
// header when there are some) in a buffer: data at `data`, `size` bytes; `end` after its
// padding (clipped to the buffer's end when the archive stops inside the padding).
// past_span: long-name or pax headers, not at the buffer's start, that reach past the
// reader's max_span: the entry they lead to is not read.
struct tar_entry {
  enum kind_t { file, other, zero, eof, past_span } kind = eof;
  std::size_t start = 0, data = 0;
  std::uint64_t size = 0, end = 0;
  std::string name;
};

inline constexpr std::size_t tar_block = 512;

// A 512-byte block a tar writer made, whether its checksum matches or not: the ustar magic,
// or a checksum field that is an octal number. Bytes after an archive's end that are not
// (a newline, padding) end the file; a damaged header there is an error, since the members
// of another archive (cat a.tar b.tar) may follow it.
inline bool looks_like_tar_header(const unsigned char* h) {
  if (std::memcmp(h + 257, "ustar", 5) == 0) return true;
  std::size_t i = 148;
  while (i < 156 && h[i] == ' ') ++i;
  const std::size_t first = i;
  while (i < 156 && h[i] >= '0' && h[i] <= '7') ++i;
  return i > first && (i == 156 || h[i] == 0 || h[i] == ' ');
}

// The archive's bytes through `view(n)`: at least n bytes from the buffer's start, or all
// there are (fewer only at the end); returns {data, available}. A byte_stream's ensure,
// or a record's whole bytes.
struct tar_reader {
  std::string_view path;   // made a string only for an error
  std::uint64_t base = 0;  // file offset of the buffer's first byte
  std::uint64_t max_span = UINT64_MAX;  // the most bytes from the buffer's start a header may reach

  [[noreturn]] void fail(std::size_t at, const std::string& why) const {
    throw format_error(std::string(path), base + at, why);
  }

  // A numeric field: octal digits between optional spaces and a NUL/space, or GNU's
  // base-256 (high bit of the first byte set), for sizes of 8 GiB and more.
  std::uint64_t number(const unsigned char* f, std::size_t n, std::size_t at, const char* what) const {
    if (f[0] & 0x80) {
      if (f[0] != 0x80) fail(at, std::string("tar header: a negative or too large ") + what + " (base-256)");
      std::uint64_t v = 0;
      for (std::size_t i = 1; i < n; ++i) {
        if (v >> 56) fail(at, std::string("tar header: the ") + what + " does not fit 64 bits");
        v = (v << 8) | f[i];
      }
      return v;
    }
    std::size_t i = 0;
    while (i < n && f[i] == ' ') ++i;
    std::uint64_t v = 0;
    bool digits = false;
    for (; i < n && f[i] >= '0' && f[i] <= '7'; ++i, digits = true) {
      if (v >> 60) fail(at, std::string("tar header: the ") + what + " does not fit 64 bits");
      v = v * 8 + (f[i] - '0');
    }
    const bool sum = std::string_view(what) == "checksum";
    if ((i < n && f[i] != 0 && f[i] != ' ') || (sum && !digits))
      fail(at, sum ? std::string("not a tar header (its checksum field is not a number)")
                   : std::string("tar header: the ") + what + " field is not an octal number");
    return v;
  }

  static std::string field(const unsigned char* f, std::size_t n) {
    const void* z = std::memchr(f, 0, n);
    // z is in [f, f + n): the distance is not negative
    return std::string(reinterpret_cast<const char*>(f),
                       z ? static_cast<std::size_t>(static_cast<const unsigned char*>(z) - f) : n);
  }

  // pax records "<len> <key>=<value>\n": path and size override the next header's.
  void pax(const unsigned char* p, std::size_t n, std::size_t at, std::string& path_out, std::uint64_t& size_out,
           bool& has_size) const {
    std::size_t i = 0;
    while (i < n && p[i] != 0) {
      std::size_t len = 0, j = i;
      while (j < n && p[j] >= '0' && p[j] <= '9' && len < n) len = len * 10 + (p[j++] - '0');
      if (j == i || j >= n || p[j] != ' ' || len <= j - i + 1 || len > n - i || p[i + len - 1] != '\n')
        fail(at, "a damaged pax header record");
      const std::string_view rec(reinterpret_cast<const char*>(p) + j + 1, len - (j - i) - 2);
      const std::size_t eq = rec.find('=');
      if (eq == std::string_view::npos) fail(at, "a damaged pax header record (no '=')");
      const std::string_view k = rec.substr(0, eq), v = rec.substr(eq + 1);
      if (k.starts_with("GNU.sparse."))  // the data is a map and fragments, not the file's bytes
        fail(at, "a sparse member (GNU tar --sparse, pax " + std::string(k) +
                     "): not supported; write the shard without --sparse");
      if (k == "path") {
        path_out.assign(v);
      } else if (k == "size") {
        std::uint64_t s = 0;
        if (v.empty() || v.size() > 19) fail(at, "a pax size that is not a number");
        for (char c : v) {
          if (c < '0' || c > '9') fail(at, "a pax size that is not a number");
          s = s * 10 + static_cast<unsigned>(c - '0');
        }
        size_out = s;
        has_size = true;
      }
      i += len;
    }
  }

  // The member at `pos`. `view(n)` makes n bytes from the buffer's start available (see
  // above) and returns {data, available}.
  template <class View>
  tar_entry next(View&& view, std::size_t pos) const {
    tar_entry e;
    e.start = pos;
    std::string long_name;
    std::uint64_t pax_size = 0;
    bool has_pax_size = false, prefixed = false;
    for (;;) {
      auto [buf, avail] = view(pos + tar_block);
      if (avail <= pos) {
        if (prefixed) fail(e.start, "a long-name or pax header with no member after it");
        e.kind = tar_entry::eof;
        return e;
      }
      const auto* h = reinterpret_cast<const unsigned char*>(buf) + pos;
      if (avail < pos + tar_block) {
        // An archive cut inside its closing zero blocks has lost nothing.
        if (!prefixed && std::all_of(h, h + (avail - pos), [](unsigned char c) { return c == 0; })) {
          e.kind = tar_entry::eof;
          return e;
        }
        fail(pos, "truncated tar header (" + std::to_string(avail - pos) + " bytes of 512)");
      }
      if (std::all_of(h, h + tar_block, [](unsigned char c) { return c == 0; })) {
        if (prefixed) fail(e.start, "a long-name or pax header with no member after it");
        e.kind = tar_entry::zero;
        e.end = pos + tar_block;
        return e;
      }
      // The checksum: the sum of the header's bytes with its own field as spaces; old
      // writers summed signed chars.
      const std::uint64_t want = number(h + 148, 8, pos, "checksum");
      std::uint64_t sum = 8 * ' ';
      std::int64_t ssum = 8 * ' ';
      for (std::size_t i = 0; i < tar_block; ++i)
        if (i < 148 || i >= 156) {
          sum += h[i];
          ssum += static_cast<signed char>(h[i]);
        }
      if (want != sum && static_cast<std::int64_t>(want) != ssum) fail(pos, "not a tar header (checksum mismatch)");
      const char type = static_cast<char>(h[156]);
      if (type == 'S')  // passed over as an entry of no data, the member would be lost unseen
        fail(pos, "a sparse member '" + field(h, 100) + "' (GNU tar --sparse): not supported; write the shard "
                  "without --sparse");
      const bool prefix = type == 'L' || type == 'x' || type == 'K';
      std::uint64_t size = number(h + 124, 12, pos, "size");
      if (has_pax_size && !prefix) size = pax_size;  // a pax size is the member's, not a long name's
      if (size > (std::uint64_t(1) << 62)) fail(pos, "tar header: a size of " + std::to_string(size) + " bytes");
      const std::uint64_t padded = (size + tar_block - 1) / tar_block * tar_block;
      const std::size_t data = pos + tar_block;
      if (prefix) {  // about the next header
        // A chain of them (pax headers hold xattrs of any size) is bounded by max_span
        // alone, and never buffered past it.
        if (data + padded + tar_block > max_span) {
          if (e.start > 0) {  // a sample in the buffer may end before them (the framer)
            e.kind = tar_entry::past_span;
            return e;
          }
          fail(e.start, "long-name or pax headers reaching past max_record_bytes (" + std::to_string(max_span) + ")");
        }
        auto [b2, a2] = view(data + static_cast<std::size_t>(size));
        if (a2 < data + size)
          fail(pos, "truncated tar member (a " + std::string(1, type) + " header of " + std::to_string(size) +
                        " bytes, " + std::to_string(a2 - data) + " are left)");
        const auto* d = reinterpret_cast<const unsigned char*>(b2) + data;
        if (type == 'L') long_name = field(d, static_cast<std::size_t>(size));
        else if (type == 'x') pax(d, static_cast<std::size_t>(size), pos, long_name, pax_size, has_pax_size);
        prefixed = true;
        pos = data + static_cast<std::size_t>(padded);
        continue;
      }
      if (long_name.empty()) {
        long_name = field(h, 100);
        // POSIX ustar (magic "ustar\0"): the full name is prefix/name. GNU's "ustar  \0"
        // has no prefix field.
        if (std::memcmp(h + 257, "ustar\0", 6) == 0 && h[345] != 0) long_name = field(h + 345, 155) + "/" + long_name;
      }
      e.name = std::move(long_name);
      e.kind = (type == '0' || type == '\0' || type == '7') ? tar_entry::file : tar_entry::other;
      e.data = data;
      e.size = size;
      e.end = data + padded;  // complete() checks the data is there
      return e;
    }
  }

  // Makes e's data available (e.end - e.start bytes from e.start must not exceed what
  // the caller is willing to buffer); a member cut short is an error, a last padding cut
  // short is not (e.end is clipped).
  template <class View>
  void complete(View&& view, tar_entry& e) const {
    if (e.kind != tar_entry::file && e.kind != tar_entry::other) return;
    auto [b, a] = view(e.end);
    (void)b;
    if (a < e.data + e.size)
      fail(e.start, "truncated member '" + e.name + "' (its header says " + std::to_string(e.size) + " bytes, " +
                        std::to_string(a - e.data) + " are left)");
    e.end = std::min(e.end, a);
  }
};

// WebDataset's base_plus_ext: key and extension (case kept) of a member's name; false for
// a name whose base name has no dot, and for a metadata name (its first path component
// __like_this__), which WebDataset's reader passes over.
inline bool split_wds_name(std::string_view name, std::string_view& key, std::string_view& ext) {
  const std::string_view first = name.substr(0, name.find('/'));
  if (first.size() >= 4 && first.starts_with("__") && first.ends_with("__")) return false;
  const std::size_t slash = name.rfind('/');
  const std::size_t base = slash == std::string_view::npos ? 0 : slash + 1;
  const std::size_t dot = name.find('.', base);
  if (dot == std::string_view::npos || dot == base) return false;  // no dot, or a hidden file
  key = name.substr(0, dot);
  ext = name.substr(dot + 1);
  return true;
}

struct wds_framer {
  explicit wds_framer(std::uint64_t max) : max_record(max) {}

  std::uint64_t max_record = 0;
  // The key of the sample last ended early, before an entry passed over (no sample data),
  // or long-name or pax headers, that would have taken it past max_record, and what that
  // was (for the message): a member of that key after it is a bad record (the sample came
  // out without it).
  std::string cut_key, cut_by;

  const array_meta* meta() const { return nullptr; }
  void seek_rows(std::uint64_t) {}
  void open(byte_stream&) { cut_key.clear(); }

  // tar_reader's view(n) of the stream: ensure(n), then its bytes from the current offset.
  static auto view_of(byte_stream& s) {
    return [&s](std::size_t n) {
      const std::size_t a = s.ensure(n);
      return std::pair<const std::byte*, std::size_t>(s.data(), a);
    };
  }

  // A sample larger than max_record (its member `e`, whose header starts at e.start, ends
  // past it): passed over a chunk at a time, with its members after `e` and the entries of
  // no sample data between them (as a buffered sample's span has them), and framed as a bad
  // record at the sample's start, so that error_policy::skip loses it alone: its headers
  // say where it ends. A damaged header after it is the next call's error.
  frame_status pass_over_sample(byte_stream& s, tar_entry e, const std::string& key, frame& f) {
    const std::uint64_t at = s.offset();
    f.bad_offset = at;
    f.why = "sample '" + key + "' is larger than max_record_bytes (" + std::to_string(max_record) + "): its member '" +
            e.name + "' (" + std::to_string(e.size) + " bytes, header at offset " + std::to_string(at + e.start) +
            ") ends " + std::to_string(e.end) + " bytes from the sample's start";
    s.consume(e.start);  // the members before it
    e.data -= e.start, e.end -= e.start, e.start = 0;
    pass_over(s, e);
    const auto view = view_of(s);
    for (;;) {
      const tar_reader rd{s.path(), s.offset(), max_record};
      tar_entry n;
      try {
        n = rd.next(view, 0);
      } catch (const format_error&) {
        break;
      }
      std::string_view k, x;
      const bool member = n.kind == tar_entry::file && split_wds_name(n.name, k, x);
      if (n.kind == tar_entry::eof || n.kind == tar_entry::zero || (member && k != key)) break;
      pass_over(s, n);  // its member, or an entry of no sample data
    }
    cut_key.clear();
    return frame_status::bad_record;
  }

  // Consumes an entry that carries no sample data (a directory, a file without a dot),
  // whatever its size, a chunk at a time: never buffered whole.
  static void pass_over(byte_stream& s, const tar_entry& e) {
    if (e.kind == tar_entry::zero || e.kind == tar_entry::eof) {
      s.consume(static_cast<std::size_t>(e.end));
      return;
    }
    s.consume(e.data);
    std::uint64_t left = e.end - e.data;  // data and padding
    const std::uint64_t need = e.size;    // the data must be there; the padding may be cut
    std::uint64_t seen = 0;
    while (left > 0) {
      const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(left, std::uint64_t(1) << 20));
      const std::size_t got = s.ensure(want);
      if (got == 0) {
        if (seen < need)
          throw format_error(s.path(), s.offset() - seen - e.data + e.start,
                             "truncated member '" + e.name + "' (its header says " + std::to_string(e.size) +
                                 " bytes, " + std::to_string(seen) + " are left)");
        return;
      }
      s.consume(got);
      seen += got;
      left -= got;
    }
  }

  frame_status next(byte_stream& s, frame& f) {
    const auto view = view_of(s);
    std::size_t pos = 0, end = 0;
    std::string key;
    std::vector<std::string> exts;
    bool dup = false;
    std::string tail;  // why this sample is the rest of a cut one (a bad record)
    unsigned zeros = 0;  // zero blocks passed over just now (two: the end-of-archive marker)
    for (;;) {
      const tar_reader rd{s.path(), s.offset(), max_record};
      tar_entry e;
      try {
        e = rd.next(view, pos);
      } catch (const format_error& err) {
        // After the end-of-archive zero blocks, what is not another archive's header is
        // not the archive's (a newline an editor added, padding): tar stops there too. A
        // damaged header is an error: the samples of the archive it starts would be lost.
        if (end == 0 && zeros >= 2) {
          const auto [b, a] = view(tar_block);
          if (a < tar_block || !looks_like_tar_header(reinterpret_cast<const unsigned char*>(b))) {
            cut_key.clear();
            return frame_status::end;
          }
          throw format_error(err.path(), err.offset(), err.reason() + ", after the end-of-archive zero blocks (a "
                                                                      "damaged header of an archive that follows?)");
        }
        // After one zero block it may be a member's data whose header was lost to zeros:
        // ending there would drop the samples after it unseen.
        if (end == 0 && zeros == 1)
          throw format_error(err.path(), err.offset(), err.reason() + ", after a lone zero block (a member's header "
                                                                      "lost to zeros?)");
        if (end == 0) throw;
        break;  // a damaged header after a whole sample: the sample now, the error next call
      }
      std::string_view k, x;
      const bool member = e.kind == tar_entry::file && split_wds_name(e.name, k, x);
      if (end == 0) {  // nothing of a sample yet: pass over what carries no sample data
        if (e.kind == tar_entry::eof) {
          cut_key.clear();
          return frame_status::end;
        }
        if (!member) {
          pass_over(s, e);
          zeros = e.kind == tar_entry::zero ? zeros + 1 : 0;
          continue;
        }
        if (!cut_key.empty()) {
          // Framed as a sample of its own, so that error_policy::skip passes over it alone.
          if (k == cut_key)
            tail = "sample '" + cut_key + "' goes on after " + cut_by + ", which would take it past max_record_bytes (" +
                   std::to_string(max_record) + "): it came out without its members from here on";
          cut_key.clear();
        }
      } else if (e.kind == tar_entry::eof || e.kind == tar_entry::zero || (member && k != key)) {
        break;  // the next sample's: not read further
      } else if (e.kind == tar_entry::past_span) {
        // Headers that would take the sample past the bound, before an entry not read yet:
        // the sample ends here, and a member of its key there is a bad record.
        cut_key = key;
        cut_by = "the long-name or pax headers at offset " + std::to_string(s.offset() + e.start);
        break;
      } else if (!member && e.end > max_record) {
        // Past the bound only if the sample goes on after it, which is not known without
        // reading it: the sample ends here, and a member of its key after it is the error.
        cut_key = key;
        cut_by = "'" + e.name + "' (" + std::to_string(e.size) + " bytes, no sample data)";
        break;
      }
      if (e.end > max_record) return pass_over_sample(s, e, end == 0 ? std::string(k) : key, f);
      try {
        rd.complete(view, e);
      } catch (const format_error&) {
        if (end == 0 || member) throw;
        break;  // a README cut short after a whole sample: the sample now, the error next call
      }
      pos = static_cast<std::size_t>(e.end);
      if (!member) continue;  // a README or directory in the span: the sample may go on after it
      if (end == 0) key.assign(k);
      if (std::any_of(exts.begin(), exts.end(), [x](const std::string& y) { return same_ext(x, y); })) dup = true;
      exts.emplace_back(x);
      end = pos;
    }
    if (dup || !tail.empty()) {
      f.bad_offset = s.offset();
      f.why = !tail.empty() ? std::move(tail) : "sample '" + key + "' has two members with one extension";
      s.consume(end);
      return frame_status::bad_record;
    }
    s.ensure(end);
    f.out = {s.data(), end};
    f.advance = end;
    return frame_status::record;
  }
};

}  // namespace detail

// Splits a sample read with ferry::webdataset into its key and members, into `out`
// (reusing its capacity). Throws format_error, naming the record's file and the offset of
// the bad header, for bytes that are not the tar members of one sample (a record built by
// hand, or from another format), and for a sample with no member. std::bad_alloc.
inline void parse_webdataset(const record& r, webdataset_sample& out) {
  out.key.clear();
  out.members.clear();
  const record_origin o = r.origin();
  const detail::tar_reader rd{o.file.empty() ? std::string_view("webdataset sample") : o.file, o.data_offset};
  const auto view = [&r](std::size_t) { return std::pair<const std::byte*, std::size_t>(r.data(), r.size()); };
  std::size_t pos = 0;
  while (pos < r.size()) {
    detail::tar_entry e = rd.next(view, pos);
    if (e.kind == detail::tar_entry::eof) break;
    rd.complete(view, e);
    pos = static_cast<std::size_t>(e.end);
    std::string_view k, x;
    if (e.kind != detail::tar_entry::file || !detail::split_wds_name(e.name, k, x)) continue;
    if (out.members.empty()) out.key.assign(k);
    else if (k != out.key)
      rd.fail(e.start, "member '" + e.name + "' is not of sample '" + out.key + "': not one sample's bytes");
    if (out.find(x)) rd.fail(e.start, "sample '" + out.key + "' has two members '." + std::string(x) + "'");
    out.members.push_back(webdataset_member{
        detail::lowered(x), r.part(e.data, static_cast<std::size_t>(e.size), static_cast<std::uint32_t>(e.data - e.start))});
  }
  if (out.members.empty()) rd.fail(0, "no member in the sample (not a WebDataset sample's bytes)");
}

// The same, returning a new sample.
inline webdataset_sample parse_webdataset(const record& r) {
  webdataset_sample s;
  parse_webdataset(r, s);
  return s;
}

}  // namespace ferry
