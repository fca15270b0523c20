// ferry/detail/cache_store.hpp: where cache() keeps a pass: in memory, or in a file.
//
// Both stores have one shape, which cache_source drives:
//   begin_fill() / append(e) / commit() / discard()   the first complete pass, written
//   open_replay(index, offset) / read() / offset()     later passes, read back
// The file store writes "<path>.partial-<random id>" and renames it to <path> on commit, so
// a file at <path> is always a whole pass. The writer holds an flock on its partial file;
// a pass that starts filling removes the partial files of <path> that nobody holds and
// that nothing wrote for a minute (left by a writer that was killed; the minute covers a
// writer between its last write, close and rename), so crashed runs do not pile up dead
// passes on the disk.
// It reads the file back through from_files' byte_stream: pooled 1 MiB chunks, filled
// ahead by I/O threads (which run no user code and are joined when the reader closes).
//
// File layout (little-endian, as this machine writes it):
//   header  "ferryCa1", type fingerprint (u64), key hash (u64), count w of extra header
//           words (u64), w words (readers skip those they do not know)    32 + 8w bytes
//           extra word 0: the pass id, drawn when the pass was written (files of
//           earlier versions have none: id 0), so that a saved replay position is never
//           restored into another pass written at the same path
//   element payload length (u64), CRC-32C of the length word then payload (u32), payload
//   footer  element count (u64), "ferryCaE"                                    16 bytes
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <typeinfo>
#include <utility>
#include <vector>

#include "ferry/cache_codec.hpp"
#include "ferry/detail/unique_id.hpp"
#include "ferry/error.hpp"
#include "ferry/sources/detail/byte_stream.hpp"
#include "ferry/sources/detail/crc32c.hpp"
#include "ferry/state.hpp"

namespace ferry::detail {

template <class T>
class memory_cache_store {
 public:
  static constexpr const char* state_tag = "cache";
  void check_destination() {}
  void begin_fill() { items_.clear(); }
  void append(const T& e) { items_.push_back(e); }
  void commit() { complete_ = true; }
  void discard() noexcept {
    items_.clear();
    items_.shrink_to_fit();  // a partial pass gives its memory back
    complete_ = false;
  }
  // The memory store never outlives its pipeline: nothing to reuse or to resume from.
  bool try_reuse() { return false; }
  bool open_replay(std::uint64_t index, std::uint64_t /*offset*/, std::uint64_t /*id*/ = 0) {
    if (!complete_ || index > items_.size()) return false;
    pos_ = static_cast<std::size_t>(index);
    return true;
  }
  bool seek_end() {
    pos_ = items_.size();
    return complete_;
  }
  std::optional<T> read() {
    if (pos_ >= items_.size()) return std::nullopt;
    return items_[pos_++];
  }
  std::uint64_t offset() const noexcept { return 0; }
  std::uint64_t pass_id() const noexcept { return 0; }  // a pass in memory dies with its pipeline

 private:
  std::vector<T> items_;
  std::size_t pos_ = 0;
  bool complete_ = false;
};

template <class T>
class file_cache_store {
 public:
  static constexpr const char* state_tag = "cache_file";
  static constexpr std::uint64_t magic = 0x3161437972726566ull;      // "ferryCa1"
  static constexpr std::uint64_t end_magic = 0x4561437972726566ull;  // "ferryCaE"
  static constexpr std::size_t fixed_header = 32, footer_bytes = 16, frame_bytes = 12;
  static constexpr std::size_t write_flush = 1 << 20, read_chunk = 1 << 20;
  static constexpr std::uint64_t max_extra_words = 1 << 16;  // a sane bound for a damaged header

  // Reads with `read_ahead` chunks filled ahead by `read_threads` I/O threads (0: every
  // read(2) on the consumer's thread), as from_files does.
  file_cache_store(std::string path, std::string key, std::size_t read_ahead, std::size_t read_threads)
      : path_(std::move(path)), key_hash_(stage_tag(key)), fingerprint_(stage_tag(typeid(T).name())),
        read_ahead_(read_ahead), read_threads_(read_threads) {
    in_.set_pool(std::make_shared<chunk_pool>(read_chunk));
  }
  file_cache_store(file_cache_store&& o) noexcept
      : path_(std::move(o.path_)), key_hash_(o.key_hash_), fingerprint_(o.fingerprint_),
        tmp_(std::move(o.tmp_)), wfd_(std::exchange(o.wfd_, -1)), out_(std::move(o.out_)),
        written_(o.written_), count_(o.count_), read_ahead_(o.read_ahead_), read_threads_(o.read_threads_),
        in_(std::move(o.in_)), size_(o.size_), elements_at_(o.elements_at_), read_count_(o.read_count_),
        footer_count_(o.footer_count_) {}
  file_cache_store& operator=(file_cache_store&&) = delete;
  ~file_cache_store() { discard(); }

  // Before a pass may end in a rename over path(): throws config_error when something
  // there is not a regular file, is not a ferry cache, or is one of another element type
  // or key (never overwritten). A damaged ferry cache, one that cannot be read, or no file
  // is fine.
  void check_destination() {
    if (!exists()) return;
    try {
      open_checked();
    } catch (const format_error&) {
    } catch (const io_error&) {
    }
    in_.close();
  }

  // Opens a new partial file and writes the header (after removing dead writers' partial
  // files: see the file's top). Throws io_error.
  void begin_fill() {
    discard();
    remove_dead_partials();
    // A name no other pipeline, process or host draws, created only if new (O_EXCL): a
    // counter per element type and the pid (1 in every container) let two passes write
    // one file, and a pipeline replay the other's elements. Locked at once, so that
    // remove_dead_partials() never takes it for a dead writer's (on a file system without
    // locks it is written unlocked, and such files are never removed).
    for (int tries = 0; tries < 8; ++tries) {
      char id[17];
      std::snprintf(id, sizeof id, "%016llx", static_cast<unsigned long long>(unique_id()));
      tmp_ = path_ + ".partial-" + id;
      wfd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (wfd_ >= 0) {
        if (::flock(wfd_, LOCK_EX | LOCK_NB) == 0 || errno != EWOULDBLOCK) break;
        ::unlink(tmp_.c_str());  // held by someone else already: never ours to write
        ::close(std::exchange(wfd_, -1));
        errno = EWOULDBLOCK;
      } else if (errno != EEXIST) {
        break;
      }
    }
    if (wfd_ < 0) {
      const int e = errno;
      tmp_.clear();
      throw io_error(path_, 0, {e, std::generic_category()}, "cannot create the cache's partial file");
    }
    written_ = 0;
    count_ = 0;
    out_.clear();
    // One extra header word: this pass's id, 63 bits, never 0 (0: a file with no id).
    const std::uint64_t id = (unique_id() >> 1) | 1;
    const std::uint64_t h[5] = {magic, fingerprint_, key_hash_, 1, id};
    cache_put_bytes(out_, h, sizeof h);
  }
  // Encodes and frames e; writes when a megabyte is buffered. Throws io_error.
  void append(const T& e) {
    const std::size_t at = out_.size();
    out_.append(frame_bytes, '\0');
    cache_codec<T>::encode(e, out_);
    const std::uint64_t n = out_.size() - at - frame_bytes;
    std::memcpy(out_.data() + at, &n, 8);
    const std::uint32_t crc = crc32c::extend(crc32c::value(&n, 8), out_.data() + at + frame_bytes, n);
    std::memcpy(out_.data() + at + 8, &crc, 4);
    ++count_;
    if (out_.size() >= write_flush) flush();
  }
  // Writes the footer, syncs, and renames the partial file to path(): after a crash the
  // name holds a whole pass or the previous file. Throws io_error.
  void commit() {
    const std::uint64_t f[2] = {count_, end_magic};
    cache_put_bytes(out_, f, sizeof f);
    flush();
    if (::fsync(wfd_) != 0) fail_write(errno, "cannot sync the cache's partial file");
    const int fd = std::exchange(wfd_, -1);
    if (::close(fd) != 0) fail_write(errno, "cannot close the cache's partial file");
    if (::rename(tmp_.c_str(), path_.c_str()) != 0)
      fail_write(errno, "cannot rename the cache's partial file to this name");
    tmp_.clear();
    in_.close();
  }
  // Removes "<path>.partial-<16 hex digits>" files that no writer holds locked and that
  // were last written over a minute ago: a writer killed mid-pass leaves one, as large as
  // the pass it had written. A file system that cannot lock leaves them (the lock cannot
  // tell a live writer). Never throws.
  void remove_dead_partials() noexcept {
    const std::size_t slash = path_.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path_.substr(0, slash));
    const std::string prefix = (slash == std::string::npos ? path_ : path_.substr(slash + 1)) + ".partial-";
    DIR* d = ::opendir(dir.c_str());
    if (!d) return;
    try {
      while (const dirent* e = ::readdir(d)) {
        const std::string name = e->d_name;
        if (name.size() != prefix.size() + 16 || name.compare(0, prefix.size(), prefix) != 0) continue;
        if (name.find_first_not_of("0123456789abcdef", prefix.size()) != std::string::npos) continue;
        const std::string full = dir + "/" + name;
        const int fd = ::open(full.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
        if (fd < 0) continue;
        struct stat held{}, named{};
        if (::fstat(fd, &held) == 0 && S_ISREG(held.st_mode) && held.st_mtime + 60 < ::time(nullptr) &&
            ::flock(fd, LOCK_EX | LOCK_NB) == 0 &&
            ::lstat(full.c_str(), &named) == 0 && named.st_dev == held.st_dev && named.st_ino == held.st_ino)
          ::unlink(full.c_str());  // nobody writes it: its writer is gone
        ::close(fd);
      }
    } catch (...) {  // no memory for a name: the next fill tries again
    }
    ::closedir(d);
  }

  // Drops a partial pass: closes and removes its file. Never throws.
  void discard() noexcept {
    if (!tmp_.empty()) ::unlink(tmp_.c_str());  // before the close drops the lock
    if (wfd_ >= 0) ::close(std::exchange(wfd_, -1));
    tmp_.clear();
    out_.clear();
    out_.shrink_to_fit();
  }

  // A file left at path() by an earlier run (or pipeline): true when it is a whole ferry
  // cache of this element type and key, ready to read; false when there is no file.
  // Throws config_error when the file is not a ferry cache (it is never overwritten) or
  // is one of another element type or key; format_error when it is a damaged ferry
  // cache (the next fill replaces it); io_error when it cannot be read.
  bool try_reuse() {
    if (!exists()) return false;
    open_checked();
    return true;
  }
  // Positions the reader at a saved place (index elements read, at byte offset), after
  // checking the file as try_reuse() does. false when there is no file, or a damaged one,
  // or the place is not in it, or `id` is not 0 and the file's pass id is not `id` (another
  // pass was written there since): the caller refills. Throws config_error as try_reuse.
  bool open_replay(std::uint64_t index, std::uint64_t offset, std::uint64_t id = 0) {
    if (!in_.is_open()) {
      if (!exists()) return false;
      try {
        open_checked();
      } catch (const format_error&) {
        return false;
      } catch (const io_error&) {
        return false;
      }
    }
    if (offset == 0) offset = elements_at_;
    if ((id != 0 && id != pass_id_) || offset < elements_at_ || offset > size_ - footer_bytes ||
        index > footer_count_) {
      in_.close();
      return false;
    }
    in_.seek(offset);
    read_count_ = index;
    return true;
  }
  // After commit(): positioned after the last element. false when the file cannot be
  // opened any more.
  bool seek_end() {
    if (!open_replay(0, 0)) return false;
    in_.seek(size_ - footer_bytes);
    read_count_ = footer_count_;
    return true;
  }
  // The next element, or nullopt after the last. Throws format_error (damaged file: the
  // offset of the element's frame) and io_error.
  std::optional<T> read() {
    const std::uint64_t elements_end = size_ - footer_bytes;
    const std::uint64_t at = in_.offset();
    if (at >= elements_end) {
      if (read_count_ != footer_count_)
        throw format_error(path_, at, "cache file ends after " + std::to_string(read_count_) +
                                          " elements; its footer says " + std::to_string(footer_count_));
      return std::nullopt;
    }
    if (elements_end - at < frame_bytes || in_.ensure(frame_bytes) < frame_bytes)
      throw format_error(path_, at, "cache element frame cut short (the file is damaged)");
    std::uint64_t n;
    std::uint32_t crc;
    std::memcpy(&n, in_.data(), 8);
    std::memcpy(&crc, in_.data() + 8, 4);
    if (n > elements_end - at - frame_bytes)
      throw format_error(path_, at, "cache element length " + std::to_string(n) +
                                        " runs past the end of the file (the file is damaged)");
    if (in_.ensure(frame_bytes + n) < frame_bytes + n)
      throw format_error(path_, at, "cache file cut short while being read");
    const std::byte* frame = in_.data();
    if (crc32c::extend(crc32c::value(&n, 8), frame + frame_bytes, n) != crc)
      throw format_error(path_, at, "cache element CRC-32C mismatch (the file is damaged)");
    const std::shared_ptr<chunk>& c = in_.current_chunk();
    const cache_cursor::chunk_ref ref{c, c->file.get(), at, frame};
    cache_cursor cur({frame + frame_bytes, static_cast<std::size_t>(n)}, ref);
    std::optional<T> v;
    try {
      v.emplace(cache_codec<T>::decode(cur));
    } catch (const cache_cursor::short_input&) {
      throw format_error(path_, at, "cache element does not decode as this element type (damaged, or "
                                    "written by another build?)");
    }
    if (cur.left() != 0)
      throw format_error(path_, at, "cache element decodes to " + std::to_string(n - cur.left()) + " of its " +
                                        std::to_string(n) + " bytes (written as another type?)");
    in_.consume(frame_bytes + n);
    ++read_count_;
    return v;
  }
  // The byte offset of the next element to read (saved with the pipeline's state).
  std::uint64_t offset() const noexcept { return in_.is_open() ? in_.offset() : 0; }
  // The open file's pass id (0 when closed, or for a file written before ids).
  std::uint64_t pass_id() const noexcept { return in_.is_open() ? pass_id_ : 0; }

 private:
  // Whether anything is at path(); throws config_error when it is not a regular file (a
  // directory, a FIFO that would block the open, a device): never opened, never replaced.
  bool exists() const {
    struct stat st {};
    if (::stat(path_.c_str(), &st) != 0) return errno != ENOENT;  // unreadable: open says why
    if (!S_ISREG(st.st_mode))
      throw config_error("cache: " + path_ + " exists and is not a regular file; it is left alone: "
                         "choose another path");
    return true;
  }
  [[noreturn]] void fail_write(int e, const char* what) {
    const std::uint64_t at = written_;
    discard();
    throw io_error(path_, at, {e, std::generic_category()}, what);
  }
  void flush() {
    std::size_t done = 0;
    while (done < out_.size()) {
      const ssize_t w = ::write(wfd_, out_.data() + done, out_.size() - done);
      if (w < 0) {
        if (errno == EINTR) continue;
        fail_write(errno, "cannot write the cache's partial file");
      }
      done += static_cast<std::size_t>(w);
      written_ += static_cast<std::uint64_t>(w);
    }
    out_.clear();
  }

  // Opens path() and checks its header and footer; the reader is left at the first
  // element. Throws config_error (not a ferry cache; another type or key), format_error
  // (a damaged ferry cache), io_error; the reader is closed then.
  void open_checked() {
    in_.close();
    try {
      in_.set_read_ahead(0);  // the header and footer: a few bytes each, no threads
      in_.open(path_, compression::none);
      size_ = in_.size().value_or(0);
      auto read_at = [&](void* dst, std::size_t n, std::uint64_t at) {
        in_.seek(at);
        if (in_.ensure(n) < n) return false;
        std::memcpy(dst, in_.data(), n);
        return true;
      };
      std::uint64_t h[4] = {}, f[2] = {};
      if (size_ < 8) {  // a file cut inside the magic (or empty) is a damaged cache
        char head[8] = {};
        const std::size_t n = static_cast<std::size_t>(size_);
        if (n) read_at(head, n, 0);
        if (std::memcmp(head, &magic, n) == 0)
          throw format_error(path_, 0, "cache file cut short inside its header (the file is damaged)");
      }
      if (size_ < 8 || !read_at(h, 8, 0) || h[0] != magic)
        throw config_error("cache: " + path_ + " exists and is not a ferry cache file (no \"ferryCa1\" at "
                           "offset 0); it is left alone: remove it or choose another path");
      if (size_ < fixed_header + footer_bytes || !read_at(h, fixed_header, 0))
        throw format_error(path_, 0, "cache file shorter than its header and footer (the file is damaged)");
      if (h[1] != fingerprint_)
        throw config_error("cache: " + path_ + " holds elements of another type (fingerprint " +
                           std::to_string(h[1]) + ", this pipeline's is " + std::to_string(fingerprint_) +
                           "); remove it or choose another path");
      if (h[2] != key_hash_)
        throw config_error("cache: " + path_ + " was written with another cache_options::key; "
                           "remove it or choose another path");
      // Word 3: extra header words before the elements (1 from this version: the pass id).
      if (h[3] > max_extra_words || fixed_header + 8 * h[3] + footer_bytes > size_)
        throw format_error(path_, 24, "cache header's extra word count " + std::to_string(h[3]) +
                                          " does not fit the file (the file is damaged)");
      elements_at_ = fixed_header + 8 * h[3];
      pass_id_ = 0;
      if (h[3] >= 1 && !read_at(&pass_id_, 8, fixed_header))
        throw format_error(path_, fixed_header, "cache header cut short (the file is damaged)");
      if (!read_at(f, footer_bytes, size_ - footer_bytes) || f[1] != end_magic)
        throw format_error(path_, size_ - footer_bytes, "cache file has no footer (\"ferryCaE\"; the file is damaged)");
      footer_count_ = f[0];
      in_.set_read_ahead(read_ahead_, read_threads_);
      in_.seek(elements_at_);
    } catch (...) {
      in_.close();
      throw;
    }
    read_count_ = 0;
  }

  std::string path_;
  std::uint64_t key_hash_, fingerprint_;
  // writing
  std::string tmp_;
  int wfd_ = -1;
  std::string out_;
  std::uint64_t written_ = 0, count_ = 0;
  std::size_t read_ahead_, read_threads_;
  // reading: one file through from_files' reader (pooled chunks, read-ahead threads)
  byte_stream in_;
  std::uint64_t size_ = 0, elements_at_ = fixed_header;
  std::uint64_t read_count_ = 0, footer_count_ = 0;
  std::uint64_t pass_id_ = 0;  // the open file's (header extra word 0)
};

}  // namespace ferry::detail
