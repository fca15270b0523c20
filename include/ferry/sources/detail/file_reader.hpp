// ferry/sources/detail/file_reader.hpp: one file at a time, cut into records by a
// format's framer; the piece from_files and interleave share. Also the error policy.
#pragma once

#include <glob.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "ferry/error.hpp"
#include "ferry/sources/array_meta.hpp"
#include "ferry/sources/detail/byte_stream.hpp"
#include "ferry/sources/file_options.hpp"
#include "ferry/sources/fixed_length.hpp"
#include "ferry/sources/idx.hpp"
#include "ferry/sources/npy.hpp"
#include "ferry/sources/record.hpp"
#include "ferry/sources/text_lines.hpp"
#include "ferry/sources/tfrecord.hpp"
#include "ferry/sources/webdataset.hpp"

namespace ferry {

namespace detail {

inline void log_skip(const from_files_options& o, const skipped_record& s) {
  if (o.on_skip) o.on_skip(s);
  else std::fprintf(stderr, "ferry: skipped %s\n", s.message().c_str());
}

// The parts of a ferry error: for io_error "what (system message)".
inline skipped_record describe(const ferry::error& e) {
  skipped_record r;
  if (auto* f = dynamic_cast<const format_error*>(&e)) {
    r.path = f->path();
    r.offset = f->offset();
    r.reason = f->reason();
  } else if (auto* io = dynamic_cast<const io_error*>(&e)) {
    r.path = io->path();
    r.offset = io->offset();
    std::string w = e.what();
    const std::size_t start = io->path().size() + 2, stop = w.rfind(" at offset ");
    r.reason = (stop != std::string::npos && stop > start ? w.substr(start, stop - start) : std::string("I/O error")) +
               " (" + io->code().message() + ")";
  } else {
    r.reason = e.what();
  }
  return r;
}

using framer = std::variant<tfrecord_framer, npy_framer, idx_framer, fixed_framer, lines_framer, wds_framer>;

inline framer make_framer(const file_format& f, std::uint64_t max_record) {
  return std::visit(
      [&](const auto& o) -> framer {
        using O = std::decay_t<decltype(o)>;
        if constexpr (std::is_same_v<O, tfrecord>) return tfrecord_framer{o, max_record};
        else if constexpr (std::is_same_v<O, npy>) return npy_framer{{max_record, {}, {}}};
        else if constexpr (std::is_same_v<O, idx>) return idx_framer{{max_record, {}, {}}};
        else if constexpr (std::is_same_v<O, fixed_length>) return fixed_framer{o, max_record};
        else if constexpr (std::is_same_v<O, text_lines>) return lines_framer{max_record};
        else return wds_framer{max_record};
      },
      f);
}

inline constexpr std::size_t max_read_ahead = std::size_t(1) << 16, max_read_threads = 256,
                             max_chunk_bytes = std::size_t(1) << 30;
inline constexpr std::uint64_t max_record_limit = std::uint64_t(1) << 40;  // max_record_bytes at most

inline void check_format(const file_format& f, const from_files_options& o) {
  // Bounds that say what is wrong, where the value would otherwise fail deep inside (a
  // vector of read_ahead slots: std::length_error; read_threads threads: system_error).
  if (o.read_ahead > max_read_ahead)
    throw config_error("from_files: read_ahead = " + std::to_string(o.read_ahead) + " chunks ahead; at most " +
                       std::to_string(max_read_ahead));
  if (o.read_threads > max_read_threads)
    throw config_error("from_files: read_threads = " + std::to_string(o.read_threads) + " I/O threads per file; at most " +
                       std::to_string(max_read_threads));
  // At most 2^40 (1 TiB): a record's length plus its framing must not wrap (a TFRecord
  // length of 2^64 - 16 over "no limit" read past the buffer, or framed records forever).
  if (o.max_record_bytes == 0 || o.max_record_bytes > max_record_limit)
    throw config_error("from_files: max_record_bytes = " + std::to_string(o.max_record_bytes) + "; 1 to " +
                       std::to_string(max_record_limit) + " (1 TiB)");
  if (o.chunk_bytes > max_chunk_bytes)
    throw config_error("from_files: chunk_bytes = " + std::to_string(o.chunk_bytes) + "; at most " +
                       std::to_string(max_chunk_bytes) + " (1 GiB)");
  const auto* fl = std::get_if<fixed_length>(&f);
  if (!fl) return;
  if (fl->record_bytes == 0) throw config_error("from_files: fixed_length.record_bytes must be at least 1");
  // A record and the footer after it are framed from one contiguous buffer: their sum
  // must neither wrap (it would frame records of garbage) nor exceed the largest record
  // from_files will buffer. The header is skipped piece by piece; the three must still
  // fit a 64-bit file offset.
  std::uint64_t need, all;
  if (__builtin_add_overflow(std::uint64_t(fl->record_bytes), std::uint64_t(fl->footer_bytes), &need) ||
      need > o.max_record_bytes)
    throw config_error("from_files: fixed_length.record_bytes + footer_bytes (" + std::to_string(fl->record_bytes) +
                       " + " + std::to_string(fl->footer_bytes) + ") exceeds max_record_bytes (" +
                       std::to_string(o.max_record_bytes) + "); raise the options' max_record_bytes");
  if (__builtin_add_overflow(need, std::uint64_t(fl->header_bytes), &all))
    throw config_error("from_files: fixed_length.header_bytes + record_bytes + footer_bytes overflows (header " +
                       std::to_string(fl->header_bytes) + ")");
}

// An emit for file_reader::next_with that makes the record a ferry::record (a view holding
// a reference to its chunk, and its origin, with the reading source's epoch).
struct make_record {
  record& out;
  std::uint64_t epoch = 0;
  void operator()(const std::shared_ptr<chunk>& c, std::span<const std::byte> bytes, std::uint64_t offset,
                  std::uint32_t head) const {
    out = record(std::shared_ptr<const std::byte>(c, bytes.data()), bytes.size(), c->file.get(), offset, head, epoch);
  }
};

// Reads one file at a time. Not thread-safe; one per reading thread.
class file_reader {
 public:
  file_reader(const file_format& f, const from_files_options& o, std::shared_ptr<chunk_pool> pool)
      : fr_(make_framer(f, o.max_record_bytes)), compress_(o.compress) {
    s_.set_pool(std::move(pool));
    s_.set_read_ahead(o.read_ahead, o.read_threads);
    s_.set_inflater(o.inflater);
  }

  // Opens `path` and reads its header; with `first` set, checks its rows match (npy/idx).
  // Throws io_error / format_error (then nothing is open).
  void open(const std::string& path, std::optional<array_meta>& first) {
    try {
      s_.open(path, compress_);
      std::visit([&](auto& f) { f.open(s_); }, fr_);
      if (const array_meta* m = meta()) {
        if (!first) first = *m;
        else if (!first->same_rows(*m))
          throw format_error(path, 0, "its rows (" + m->describe() + ") differ from the first file's (" +
                                          first->describe() + ")");
      }
    } catch (...) {
      s_.close();
      throw;
    }
    rec_ = 0;
  }
  // Moves to a saved position (offset of the next record, records read before it).
  void seek(std::uint64_t offset, std::uint64_t rec) {
    s_.seek(offset);
    std::visit([&](auto& f) { f.seek_rows(rec); }, fr_);
    rec_ = rec;
  }
  void close() { s_.close(); }
  // See byte_stream::set_cancel: a stop flag that ends a wait for a pipe's data.
  void set_cancel(const std::atomic<bool>* c) { s_.set_cancel(c); }
  bool is_open() const { return s_.is_open(); }
  std::uint64_t offset() const { return s_.offset(); }
  std::uint64_t records() const { return rec_; }
  const std::string& path() const { return s_.path(); }
  const array_meta* meta() const {
    return std::visit([](const auto& f) { return f.meta(); }, fr_);
  }

  // Throws format_error / io_error when the rest of the file cannot be read.
  frame_status next(record& out, skipped_record& bad) { return next_with(bad, make_record{out}); }
  // The same, handing emit(chunk, bytes, offset, header bytes) the record's place instead
  // of a record: the bytes stay valid while the caller holds a reference to the chunk.
  template <class Emit>
  frame_status next_with(skipped_record& bad, Emit&& emit) {
    frame f;
    frame_status st = std::visit([&](auto& fr) { return fr.next(s_, f); }, fr_);
    if (st == frame_status::record) {
      emit(s_.current_chunk(), std::span<const std::byte>(f.out), s_.offset(),
           static_cast<std::uint32_t>(f.out.data() - s_.data()));
      s_.consume(f.advance);
      ++rec_;
    } else if (st == frame_status::bad_record) {
      bad = skipped_record{s_.path(), f.bad_offset, std::move(f.why)};
      ++rec_;
    }
    return st;
  }

 private:
  byte_stream s_;
  framer fr_;
  compression compress_;
  std::uint64_t rec_ = 0;
};

inline bool has_glob_chars(const std::string& p) { return p.find_first_of("*?[") != std::string::npos; }

// Expands glob patterns (sorted, as glob(3) sorts); plain paths are kept as given, even
// when missing (the error comes when the file is read). A pattern that matches nothing
// is an io_error.
inline std::vector<std::string> expand_paths(const std::vector<std::string>& in) {
  std::vector<std::string> out;
  for (const std::string& p : in) {
    // A name that exists as written is that file, glob characters or not: data[1].tfrecord
    // is not the pattern that matches data1.tfrecord.
    if (!has_glob_chars(p) || ::access(p.c_str(), F_OK) == 0) {
      out.push_back(p);
      continue;
    }
    glob_t g{};
    const int rc = ::glob(p.c_str(), GLOB_ERR, nullptr, &g);
    if (rc == GLOB_NOMATCH) {
      globfree(&g);
      throw io_error(p, 0, std::make_error_code(std::errc::no_such_file_or_directory), "no file matches the pattern");
    }
    if (rc != 0) {
      globfree(&g);
      throw io_error(p, 0, std::make_error_code(std::errc::io_error), "cannot expand the pattern");
    }
    for (std::size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
    globfree(&g);
  }
  return out;
}

inline std::uint64_t hash_files(const std::vector<std::string>& files) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (const auto& f : files) {
    for (char c : f) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
    h = (h ^ 0xff) * 0x100000001b3ull;
  }
  return h;
}

}  // namespace detail
}  // namespace ferry
