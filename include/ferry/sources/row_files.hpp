// ferry/sources/row_files.hpp: the rows of .npy, IDX and fixed-length files as a
// random-access dataset (size() and operator[]), for global_shuffle: row i is read where it
// lies (one pread), so any order costs one read per row and no pass over the data.
//
//   auto rows = ferry::row_files({"images.npy"}, ferry::npy{});
//   ferry::record r = rows[123];            // its bytes, origin: the file and the row's offset
//   auto src = ferry::global_shuffle(rows, {.seed = 1, .global_batch = 256});
//
// The files' rows in the order given (glob patterns expanded as from_files expands them).
// npy and IDX: every file's rows must match the first file's (dtype and row shape), as in
// from_files, and the file must hold the rows its header counts; fixed_length: header +
// k * record_bytes + footer bytes. Either, else a format_error.
// Uncompressed files only (a compressed one cannot be read at an offset). TFRecord, text
// lines and WebDataset have no row offsets without an index: a config_error.
//
// Threads: the constructor runs on the caller's thread; operator[] may be called from
// several threads at once (pread on shared descriptors), as a map's workers would.
//
// Errors: the constructor throws io_error (a missing file, a pattern that matches nothing),
// format_error (a bad header, rows that differ from the first file's, a fixed-length file
// of the wrong size), config_error (a format without row offsets, a compressed file, bad
// fixed_length sizes). operator[] throws io_error for a failed or short read (a file cut
// after it was opened), naming the file and the row's offset; std::out_of_range for an
// index past size().
//
// Memory: one open descriptor per file (kept by every copy, closed with the last), the
// rows' prefix counts; each record read owns its bytes (one allocation).
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
#include "ferry/sources/detail/file_reader.hpp"
#include "ferry/sources/file_options.hpp"
#include "ferry/sources/record.hpp"

namespace ferry {

// Rows of .npy, IDX or fixed-length files by index (see the file's top).
class row_files {
 public:
  // The rows of `paths` in `fmt` (npy{}, idx{} or fixed_length{...}). Throws as above.
  row_files(const std::vector<std::string>& paths, const file_format& fmt) : s_(std::make_shared<shared>()) {
    if (!std::holds_alternative<npy>(fmt) && !std::holds_alternative<idx>(fmt) &&
        !std::holds_alternative<fixed_length>(fmt))
      throw config_error("row_files: rows by index need npy, idx or fixed_length files (TFRecord, text lines and "
                         "WebDataset have no row offsets without an index)");
    const from_files_options opt{.read_ahead = 0, .compress = compression::none};
    detail::check_format(fmt, opt);
    std::optional<array_meta> first;
    auto pool = std::make_shared<detail::chunk_pool>(64 * 1024);
    for (const std::string& p : detail::expand_paths(paths)) {
      if (p.ends_with(".gz") || p.ends_with(".gzip") || p.ends_with(".zlib"))
        throw config_error("row_files: " + p + " is compressed: rows cannot be read at an offset (inflate it first)");
      file f;
      f.name = std::make_shared<const std::string>(p);
      if (const auto* fl = std::get_if<fixed_length>(&fmt)) {
        f.fd = open_fd(p);
        struct stat st {};
        if (::fstat(f.fd->fd, &st) != 0)
          throw io_error(p, 0, std::error_code(errno, std::generic_category()), "cannot stat");
        const std::uint64_t size = std::uint64_t(st.st_size), frame = fl->header_bytes + fl->footer_bytes;
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
        struct stat st {};
        if (::fstat(f.fd->fd, &st) != 0)
          throw io_error(p, 0, std::error_code(errno, std::generic_category()), "cannot stat");
        if (std::uint64_t(st.st_size) < f.data + f.rows * f.row_bytes)
          throw format_error(p, f.data, "the header says " + std::to_string(f.rows) + " rows of " +
                                            std::to_string(f.row_bytes) + " bytes; the file has " +
                                            std::to_string(st.st_size) + " bytes");
      }
      s_->total += f.rows;
      s_->ends.push_back(s_->total);
      s_->files.push_back(std::move(f));
    }
    meta_ = first;
  }

  // Rows in all the files.
  std::uint64_t size() const noexcept { return s_->total; }
  // The dtype and shape of npy/IDX rows (none for fixed_length).
  const std::optional<array_meta>& meta() const noexcept { return meta_; }
  // Row i (i < size(): else std::out_of_range), read now; its origin is the file and the
  // row's offset. Throws io_error for a failed or short read.
  record operator[](std::uint64_t i) const {
    if (i >= s_->total) throw std::out_of_range("row_files: row " + std::to_string(i) + " of " + std::to_string(s_->total));
    const std::size_t k = std::size_t(std::upper_bound(s_->ends.begin(), s_->ends.end(), i) - s_->ends.begin());
    const file& f = s_->files[k];
    const std::uint64_t row = i - (k == 0 ? 0 : s_->ends[k - 1]);
    const std::uint64_t at = f.data + row * f.row_bytes;
    auto buf = std::make_shared<row_buffer>();
    buf->file = f.name;
    buf->bytes.resize(std::size_t(f.row_bytes));
    std::size_t got = 0;
    while (got < buf->bytes.size()) {
      const ssize_t n = ::pread(f.fd->fd, buf->bytes.data() + got, buf->bytes.size() - got, off_t(at + got));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw io_error(*f.name, at, std::error_code(errno, std::generic_category()), "cannot read row " + std::to_string(row));
      if (n == 0)
        throw io_error(*f.name, at, std::make_error_code(std::errc::io_error),
                       "short read of row " + std::to_string(row) + " (the file was cut after it was opened)");
      got += std::size_t(n);
    }
    const std::size_t n = buf->bytes.size();
    const std::byte* p = buf->bytes.data();
    const std::string* name = buf->file.get();
    return record(std::shared_ptr<const std::byte>(std::move(buf), p), n, name, at, 0);
  }

 private:
  struct descriptor {
    int fd = -1;
    ~descriptor() {
      if (fd >= 0) ::close(fd);
    }
  };
  struct file {
    std::shared_ptr<const std::string> name;
    std::shared_ptr<descriptor> fd;
    std::uint64_t data = 0, row_bytes = 0, rows = 0;
  };
  struct shared {
    std::vector<file> files;
    std::vector<std::uint64_t> ends;  // rows up to and including each file
    std::uint64_t total = 0;
  };
  struct row_buffer {
    std::shared_ptr<const std::string> file;  // the record's origin points at it
    std::vector<std::byte> bytes;
  };
  static std::shared_ptr<descriptor> open_fd(const std::string& p) {
    auto d = std::make_shared<descriptor>();
    d->fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    if (d->fd < 0) throw io_error(p, 0, std::error_code(errno, std::generic_category()), "cannot open");
    return d;
  }

  std::shared_ptr<shared> s_;
  std::optional<array_meta> meta_;
};

}  // namespace ferry
