// ferry/sources/row_files.hpp: the rows of .npy, IDX, fixed-length and TFRecord files as a
// random-access dataset (size() and operator[]), for global_shuffle: row i is read where it
// lies (one pread), so any order costs one read per row and no pass over the data.
//
//   auto rows = ferry::row_files({"images.npy"}, ferry::npy{});
//   ferry::record r = rows[123];            // its bytes, origin: the file and the row's offset
//   auto src = ferry::global_shuffle(rows, {.seed = 1, .global_batch = 256});
//   auto recs = ferry::row_files({"train-*.tfrecord"}, ferry::tfrecord{});   // records by index
//
// The files' rows in the order given (glob patterns expanded as from_files expands them).
// npy and IDX: every file's rows must match the first file's (dtype and row shape), as in
// from_files, and the file must hold the rows its header counts; fixed_length: header +
// k * record_bytes + footer bytes. Either, else a format_error.
// TFRecord: the constructor indexes each file, reading only the 12-byte record headers
// (a 64 KiB window slides over small records; past a large one it reads the next header's
// 4 KiB, so the data is skipped) and checking each length and its CRC: the records are the
// data bytes, as from_files gives them, with the same origins (the record's header offset).
// A data CRC is checked when the record is read (.verify_crc).
// WebDataset and text lines: the constructor indexes each file by one sequential read
// through from_files' own framer (a sample's members are grouped by key, a line ends at its
// newline: rules the data must be read for), keeping each record's offset and size; a
// record read later is a sample parse_webdataset splits, or a line, as from_files gives it.
// Uncompressed files only (a compressed one cannot be read at an offset).
//
// Threads: the constructor runs on the caller's thread; operator[] may be called from
// several threads at once (pread on shared descriptors), as a map's workers would.
//
// Errors: the constructor throws io_error (a missing file, a pattern that matches nothing, a
// directory or FIFO: rows are read at offsets of regular files),
// format_error (a bad header, rows that differ from the first file's, a header counting
// more rows than its file holds or, with the files before it, more than 2^64, a
// fixed-length file of the wrong size; TFRecord: a truncated record, a length CRC mismatch, a length over
// max_record_bytes, each naming the file and the record's offset; WebDataset and text
// lines: what from_files throws for the file), config_error (a compressed file, bad
// fixed_length sizes, max_record_bytes of 0). operator[] throws
// io_error for a failed or short read (a file cut after it was opened), naming the file and
// the row's offset; format_error for a TFRecord data CRC mismatch or a header changed since
// the index was built (the file and offset); std::out_of_range for an index past size().
//
// Memory: one open descriptor per file (kept by every copy, closed with the last), the
// rows' prefix counts, and 8 bytes per record for TFRecord (its offset), 24 for WebDataset
// and text lines (offset, size, header); each record read owns its bytes.
//
// Checkpoints: none of its own (a dataset, not a stage); global_shuffle saves positions.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "ferry/error.hpp"
#include "ferry/sources/detail/crc32c.hpp"
#include "ferry/sources/detail/file_reader.hpp"
#include "ferry/sources/detail/framing.hpp"
#include "ferry/sources/file_options.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/sources/record.hpp"

namespace ferry {

// Options of row_files.
struct row_files_options {
  // A record longer than this is a format_error when indexed (nothing is allocated from a
  // length field's claim), and a row of npy, IDX or fixed_length longer than this a
  // config_error or format_error, as in from_files (1 to 2^40).
  std::uint64_t max_record_bytes = std::uint64_t(64) << 20;
};

// Rows (records, samples, lines) of files of any format by index (see the file's top).
class row_files {
 public:
  // The rows of `paths` in `fmt` (npy{}, idx{}, fixed_length{...}, tfrecord{...},
  // webdataset{} or text_lines{}). Throws as above.
  row_files(const std::vector<std::string>& paths, const file_format& fmt, row_files_options o = {})
      : s_(std::make_shared<shared>()) {
    if (o.max_record_bytes == 0) throw config_error("row_files: max_record_bytes must be > 0");
    const from_files_options opt{.read_ahead = 0, .max_record_bytes = o.max_record_bytes, .compress = compression::none};
    detail::check_format(fmt, opt);
    std::optional<array_meta> first;
    auto pool = std::make_shared<detail::chunk_pool>(64 * 1024);
    for (const std::string& p : detail::expand_paths(paths)) {
      if (detail::name_says_compressed(p))
        throw config_error("row_files: " + p + " is compressed: rows cannot be read at an offset (inflate it first)");
      file f;
      f.name = std::make_shared<const std::string>(p);
      if (const auto* t = std::get_if<tfrecord>(&fmt)) {
        f.fd = open_fd(p);
        f.tf = true;
        f.verify_crc = t->verify_crc;
        f.end = file_size(f);
        index_tfrecord(f, o.max_record_bytes);
        f.rows = f.starts.size();
      } else if (std::holds_alternative<webdataset>(fmt) || std::holds_alternative<text_lines>(fmt)) {
        f.fd = open_fd(p);
        auto seq = from_files(std::vector<std::string>{p}, fmt,
                              {.read_ahead = 0, .max_record_bytes = o.max_record_bytes, .compress = compression::none});
        while (const std::optional<record> r = seq.next()) {
          const record_origin at = r->origin();
          f.spans.push_back({at.offset, r->size(), std::uint32_t(at.data_offset - at.offset)});
        }
        f.rows = f.spans.size();
      } else if (const auto* fl = std::get_if<fixed_length>(&fmt)) {
        f.fd = open_fd(p);
        const std::uint64_t size = file_size(f), frame = fl->header_bytes + fl->footer_bytes;
        if (size < frame || (size - frame) % fl->record_bytes != 0)
          throw format_error(p, 0, "the size is not header (" + std::to_string(fl->header_bytes) + ") + k * " +
                                       std::to_string(fl->record_bytes) + " + footer (" +
                                       std::to_string(fl->footer_bytes) + "): the file has " + std::to_string(size) +
                                       " bytes");
        f.data = fl->header_bytes;
        f.row_bytes = fl->record_bytes;
        f.rows = (size - frame) / fl->record_bytes;
      } else {
        detail::file_reader rd(fmt, opt, pool);
        rd.open(p, first);  // reads and checks the header (rows like the first file's)
        const array_meta* m = rd.meta();
        f.data = rd.offset();
        f.row_bytes = m->row_bytes;
        f.rows = m->rows;
        rd.close();
        f.fd = open_fd(p);
        const std::uint64_t size = file_size(f);
        // Divided, not multiplied: a header's count times its row size, plus its own bytes,
        // may pass 2^64 (and would then seem to fit).
        if (size < f.data || (f.row_bytes != 0 && f.rows > (size - f.data) / f.row_bytes))
          throw format_error(p, f.data, "the header says " + std::to_string(f.rows) + " rows of " +
                                            std::to_string(f.row_bytes) + " bytes; the file has " +
                                            std::to_string(size) + " bytes");
      }
      if (__builtin_add_overflow(s_->total, f.rows, &s_->total))
        throw format_error(p, f.data, "the header says " + std::to_string(f.rows) + " rows, which with the files "
                                      "before it pass 2^64 rows");
      s_->ends.push_back(s_->total);
      s_->files.push_back(std::move(f));
    }
    meta_ = first;
  }

  // Rows in all the files.
  std::uint64_t size() const noexcept { return s_->total; }
  // The dtype and shape of npy/IDX rows (none for the other formats).
  const std::optional<array_meta>& meta() const noexcept { return meta_; }
  // Row i (i < size(): else std::out_of_range), read now; its origin is the file and the
  // row's offset. Throws io_error for a failed or short read; TFRecord: format_error for a
  // data CRC mismatch or a header changed since indexing.
  record operator[](std::uint64_t i) const {
    if (i >= s_->total) throw std::out_of_range("row_files: row " + std::to_string(i) + " of " + std::to_string(s_->total));
    const std::size_t k = std::size_t(std::upper_bound(s_->ends.begin(), s_->ends.end(), i) - s_->ends.begin());
    const file& f = s_->files[k];
    const std::uint64_t row = i - (k == 0 ? 0 : s_->ends[k - 1]);
    // The record starts at `at`, its payload `head` bytes later; `from` is where the read
    // starts (a TFRecord's header is read too, to be checked) and `n` how much it reads.
    std::uint64_t at = f.data + row * f.row_bytes, n = f.row_bytes, from = at;
    std::uint32_t head = 0;
    if (f.tf) {
      at = from = f.starts[std::size_t(row)];
      n = (row + 1 < f.rows ? f.starts[std::size_t(row) + 1] : f.end) - at;
      head = 12;
    } else if (!f.spans.empty()) {
      const span& e = f.spans[std::size_t(row)];
      at = e.offset;
      head = e.head;
      from = at + head;
      n = e.size;
    }
    auto buf = std::make_shared<row_buffer>();
    buf->file = f.name;
    buf->bytes.reset(new std::byte[std::size_t(n)]);  // not zeroed: pread fills it
    read_at(f, from, buf->bytes.get(), std::size_t(n), row);
    const std::byte* p = buf->bytes.get();
    if (f.tf) {  // the header indexed at open, the data's CRC now
      namespace c = detail::crc32c;
      const std::uint64_t len = n - 16;
      if (detail::load_le64(p) != len || (f.verify_crc && c::mask(c::value(p, 8)) != detail::load_le32(p + 8)))
        throw format_error(*f.name, at, "record " + std::to_string(row) + "'s header changed since the file was indexed");
      if (f.verify_crc && c::mask(c::value(p + 12, std::size_t(len))) != detail::load_le32(p + 12 + len))
        throw format_error(*f.name, at, "corrupted record (data CRC mismatch)");
      p += 12;
      n = len;
    }
    const std::string* name = buf->file.get();
    return record(std::shared_ptr<const std::byte>(std::move(buf), p), std::size_t(n), name, at, head);
  }

 private:
  struct descriptor {
    int fd = -1;
    std::uint64_t size = 0;  // at open (open_fd's fstat)
    ~descriptor() {
      if (fd >= 0) ::close(fd);
    }
  };
  struct span {
    std::uint64_t offset, size;  // the record's start (its header) and payload bytes
    std::uint32_t head;          // payload offset - offset
  };
  struct file {
    std::shared_ptr<const std::string> name;
    std::shared_ptr<descriptor> fd;
    std::uint64_t data = 0, row_bytes = 0, rows = 0;
    bool tf = false, verify_crc = true;  // TFRecord: records at starts, the last ending at end
    std::vector<std::uint64_t> starts;
    std::uint64_t end = 0;
    std::vector<span> spans;  // WebDataset, text lines
  };
  struct shared {
    std::vector<file> files;
    std::vector<std::uint64_t> ends;  // rows up to and including each file
    std::uint64_t total = 0;
  };
  struct row_buffer {
    std::shared_ptr<const std::string> file;  // the record's origin points at it
    std::unique_ptr<std::byte[]> bytes;
  };
  static std::uint64_t file_size(const file& f) { return f.fd->size; }
  // n bytes at `at` (row `row`'s, or an index window), or io_error.
  static void read_at(const file& f, std::uint64_t at, std::byte* dst, std::size_t n, std::uint64_t row) {
    std::size_t got = 0;
    while (got < n) {
      const ssize_t r = ::pread(f.fd->fd, dst + got, n - got, off_t(at + got));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) throw io_error(*f.name, at, std::error_code(errno, std::generic_category()), "cannot read row " + std::to_string(row));
      if (r == 0)
        throw io_error(*f.name, at, std::make_error_code(std::errc::io_error),
                       "short read of row " + std::to_string(row) + " (the file was cut after it was opened)");
      got += std::size_t(r);
    }
  }
  // The offsets of f's TFRecord records, from their headers alone (see the file's top).
  static void index_tfrecord(file& f, std::uint64_t max_record) {
    namespace c = detail::crc32c;
    std::vector<std::byte> win(64 * 1024);
    std::uint64_t win_at = 0, win_n = 0, at = 0;
    std::size_t want = win.size();
    while (at < f.end) {
      const std::uint64_t left = f.end - at;
      if (left < 12)
        throw format_error(*f.name, at, "truncated record (" + std::to_string(left) + " bytes of a 12-byte header)");
      if (at < win_at || at + 12 > win_at + win_n) {
        win_n = std::min<std::uint64_t>(want, left);
        read_at(f, at, win.data(), std::size_t(win_n), f.starts.size());
        win_at = at;
      }
      const std::byte* p = win.data() + (at - win_at);
      const std::uint64_t len = detail::load_le64(p);
      if (f.verify_crc && c::mask(c::value(p, 8)) != detail::load_le32(p + 8))
        throw format_error(*f.name, at, "corrupted record (length CRC mismatch)");
      if (len > left || left - len < 16)
        throw format_error(*f.name, at,
                           "truncated record (the length field says " + std::to_string(len) + " bytes, " +
                               std::to_string(left < 16 ? 0 : left - 16) + " are left in the file)");
      if (len > max_record)
        throw format_error(*f.name, at, "record length " + std::to_string(len) + " exceeds max_record_bytes (" +
                                            std::to_string(max_record) + ")");
      f.starts.push_back(at);
      want = len + 16 > 4096 ? 4096 : win.size();  // past a large record, only the next header's page
      at += len + 16;
    }
  }
  // A regular file, opened for reads at offsets: a directory (whose size would count as
  // rows) or a FIFO (open() would block until a writer came) is an io_error.
  static std::shared_ptr<descriptor> open_fd(const std::string& p) {
    auto d = std::make_shared<descriptor>();
    d->fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (d->fd < 0) throw io_error(p, 0, std::error_code(errno, std::generic_category()), "cannot open");
    struct stat st {};
    if (::fstat(d->fd, &st) != 0) throw io_error(p, 0, std::error_code(errno, std::generic_category()), "cannot stat");
    if (!S_ISREG(st.st_mode))
      throw io_error(p, 0, std::error_code(S_ISDIR(st.st_mode) ? EISDIR : ESPIPE, std::generic_category()),
                     "row_files reads rows at offsets: not a regular file");
    d->size = std::uint64_t(st.st_size);
    return d;
  }

  std::shared_ptr<shared> s_;
  std::optional<array_meta> meta_;
};

}  // namespace ferry
