// ferry/sources/detail/byte_stream.hpp: sequential reads of one file (plain or gzip/zlib)
// into pooled chunks, so records can be handed out as views that own their chunk.
//
// A chunk is filled by large read(2) calls (or zlib inflate); a framer asks ensure(n) for
// n contiguous bytes at the current position, builds a record from them and consume()s
// it. When the bytes do not fit in the current chunk, a fresh chunk is taken from the
// pool and only the unconsumed tail is copied over. Chunks are never written below the
// fill mark once handed out, so records viewing an older part stay valid for as long as
// they hold a reference; a chunk goes back to the pool when its last record is gone.
// Memory is bounded: the stream holds one chunk; the rest are held by records downstream.
//
// Errors: io_error (open/read failures, with path and offset), format_error (corrupt or
// truncated gzip stream, at the offset in the uncompressed stream). Single-threaded;
// chunk_pool is thread-safe (records may die on any thread).
//
// Compressed files: concatenated gzip (or zlib) members, what `cat a.gz b.gz` makes, are
// one stream, as gzip(1) reads them. Zero bytes after a member (tape or block padding)
// are skipped, as gzip(1), Python's gzip and zlib's gzread skip them; no member starts
// with a zero byte, so nothing is lost, and a member after them is read. Any other bytes
// after the last member are a format_error at the end of the uncompressed data ("corrupt
// gzip stream (incorrect header check ...)", or "truncated gzip stream" when they are
// the start of a member): they may be a member whose header is damaged, and ignoring
// them, as gzip(1) does with a warning, could drop data silently.
//
// Inflating: zlib, or Intel ISA-L's igzip (FERRY_WITH_ISAL; 1.3-2x zlib's speed on the
// Fashion-MNIST files), chosen by inflate_engine. Both read the same streams the same way
// (members, padding, the errors above); their messages for a damaged deflate stream differ
// in wording ("corrupt gzip stream (<what the library says>)").
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#if defined(FERRY_WITH_ISAL)
#include <isa-l/igzip_lib.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstddef>
#include <exception>
#include <cstdint>
#include <utility>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "ferry/detail/producer.hpp"
#include "ferry/error.hpp"
#include "ferry/sources/compression.hpp"

namespace ferry {

namespace detail {

#if defined(FERRY_WITH_ISAL)
inline constexpr bool have_isal = true;
#else
inline constexpr bool have_isal = false;
#endif

// The engine `e` means here (never automatic). Throws config_error for isal in a build
// without ISA-L, and for a FERRY_INFLATE other than "zlib" or "isal".
inline inflate_engine resolve_inflater(inflate_engine e) {
  if (e == inflate_engine::automatic) {
    const char* env = std::getenv("FERRY_INFLATE");
    const std::string v = env ? env : "";
    if (v == "zlib") e = inflate_engine::zlib;
    else if (v == "isal") e = inflate_engine::isal;
    else if (!v.empty()) throw config_error("FERRY_INFLATE must be zlib or isal, not '" + v + "'");
    else return have_isal ? inflate_engine::isal : inflate_engine::zlib;
  }
  if (e == inflate_engine::isal && !have_isal)
    throw config_error("inflate_engine::isal (or FERRY_INFLATE=isal): this build of ferry has no ISA-L "
                       "(install libisal-dev and rebuild)");
  return e;
}

struct chunk {
  std::byte* data;
  std::size_t capacity;
  // The file the chunk was filled from: records viewing the chunk point at this name, so
  // it lives as long as they do. A chunk only ever holds bytes of one file.
  std::shared_ptr<const std::string> file;
};

// Recycles read chunks of the default size; larger (one-off) chunks are freed.
class chunk_pool : public std::enable_shared_from_this<chunk_pool> {
 public:
  explicit chunk_pool(std::size_t chunk_bytes, std::size_t max_free = 8)
      : bytes_(chunk_bytes), max_free_(max_free) {}
  ~chunk_pool() {
    for (chunk* c : free_) destroy(c);
  }
  std::size_t chunk_bytes() const { return bytes_; }

  std::shared_ptr<chunk> acquire(std::size_t min_bytes) {
    chunk* c = nullptr;
    if (min_bytes <= bytes_) {
      std::lock_guard lk(m_);
      if (!free_.empty()) {
        c = free_.back();
        free_.pop_back();
      }
    }
    if (!c) {
      const std::size_t cap = std::max(min_bytes, bytes_);
      c = new chunk{static_cast<std::byte*>(::operator new(cap, std::align_val_t{64})), cap, nullptr};
    }
    std::weak_ptr<chunk_pool> home = weak_from_this();
    return std::shared_ptr<chunk>(c, [home](chunk* p) {
      if (auto pool = home.lock()) pool->give_back(p);
      else destroy(p);
    });
  }
  std::size_t free_chunks() const {
    std::lock_guard lk(m_);
    return free_.size();
  }

 private:
  static void destroy(chunk* c) noexcept {
    ::operator delete(c->data, std::align_val_t{64});
    delete c;
  }
  void give_back(chunk* c) noexcept {
    c->file.reset();
    if (c->capacity == bytes_) {
      std::lock_guard lk(m_);
      if (free_.size() < max_free_) {
        try {
          free_.push_back(c);
          return;
        } catch (...) {
        }
      }
    }
    destroy(c);
  }
  std::size_t bytes_, max_free_;
  mutable std::mutex m_;
  std::vector<chunk*> free_;
};

// Background reads of a plain file (from_files_options::read_ahead, read_threads), on the
// producer engine (ferry/detail/producer.hpp): block k of the file covers bytes
// [from + k * room, from + (k + 1) * room), and with t I/O threads thread i reads blocks
// i, i + t, i + 2t, ... with pread(2) into pooled chunks, each thread one producer that
// queues its blocks in order; the reader takes block k from producer k mod t, so the
// blocks come in file order. Each chunk leaves `headroom` bytes free at its front, so the
// reader can put the unconsumed tail of the previous chunk there (records stay contiguous
// without copying the new data). At most depth chunks are in flight (queued or being
// read), or two per thread when depth is less than that. The threads run no user
// code; they stop and are joined in the destructor (which may wait for a read(2) each). A
// read error is queued as that block's error, at its place: the reader gets the bytes
// before it, then a block carrying the io_error, and the thread reads no further. A short
// block is the end of the file.
class read_ahead {
 public:
  struct block {
    std::shared_ptr<chunk> c;
    std::size_t start = 0, bytes = 0;  // data at c->data[start, start + bytes)
    bool last = false;                 // the file ends in (or before) this block
    std::exception_ptr err;
  };

  // Throws ferry::error naming the file when a thread cannot be started (none is left
  // running then).
  read_ahead(int fd, std::uint64_t from, std::size_t depth, std::size_t threads,
             std::shared_ptr<chunk_pool> pool, std::shared_ptr<const std::string> file)
      : fd_(fd), from_(from), pool_(std::move(pool)), file_(std::move(file)),
        start_(headroom(pool_->chunk_bytes())), room_(pool_->chunk_bytes() - start_) {
    depth = depth ? depth : 1;
    const std::size_t n = std::min(threads ? threads : 1, depth);
    // Each thread queues `queued` blocks and holds one more being read: depth in all, or
    // two per thread when depth is less than that.
    const std::size_t queued = depth / n > 1 ? depth / n - 1 : 1;
    lanes_.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      lanes_[i].set_spin(0);  // a block takes far longer than a wake-up: spinning would hold a core
      try {
        lanes_[i].start(queued, queued - 1, names, nullptr, nullptr,
                        [this, k = std::uint64_t(i), n, ended = false]() mutable { return read_block(k, n, ended); },
                        nullptr);
      } catch (const std::exception& e) {  // no thread to be had: said with the file's name
        lanes_.clear();  // joins those started
        throw error("from_files: " + (file_ ? *file_ : std::string("?")) + ": could not start read-ahead thread " +
                    std::to_string(i + 1) + " of " + std::to_string(n) + ": " + e.what());
      }
    }
  }
  read_ahead(const read_ahead&) = delete;
  read_ahead& operator=(const read_ahead&) = delete;
  ~read_ahead() = default;  // each producer halts and joins its thread
  static std::size_t headroom(std::size_t chunk_bytes) { return chunk_bytes / 16; }

  // The next block, in file order; waits for the I/O threads. After the last block, an
  // empty one (the end of the file).
  block take() {
    if (taken_last_) return block{.c = nullptr, .start = 0, .bytes = 0, .last = true, .err = nullptr};
    std::optional<block> b;
    try {
      b = lanes_[next_ % lanes_.size()].take();
    } catch (...) {
      b = block{.c = nullptr, .start = 0, .bytes = 0, .last = true, .err = std::current_exception()};
    }
    ++next_;
    if (!b) b = block{.c = nullptr, .start = 0, .bytes = 0, .last = true, .err = nullptr};  // past an error
    taken_last_ = b->last;
    return std::move(*b);
  }

 private:
  static constexpr producer_names names{"ferry readahead", "read-ahead wait", "read-ahead full"};

  // Block k on its I/O thread, then k + n next time; nothing after the end or an error.
  std::optional<block> read_block(std::uint64_t& k, std::size_t n, bool& ended) {
    if (ended) return std::nullopt;
    const std::uint64_t at = from_ + k * room_;
    k += n;
    block b;
    ended = true;  // unless the whole block is read
    b.c = pool_->acquire(pool_->chunk_bytes());
    b.c->file = file_;
    b.start = start_;
    while (b.bytes < room_) {
      const ssize_t r = ::pread(fd_, b.c->data + b.start + b.bytes, room_ - b.bytes, static_cast<off_t>(at + b.bytes));
      if (r > 0) {
        b.bytes += static_cast<std::size_t>(r);
      } else if (r == 0) {
        break;
      } else if (errno != EINTR) {
        const int e = errno;
        throw io_error(*file_, at + b.bytes, std::error_code(e, std::generic_category()), "read failed");
      }
    }
    b.last = b.bytes < room_;
    ended = b.last;
    return b;
  }

  int fd_;
  std::uint64_t from_;
  std::shared_ptr<chunk_pool> pool_;
  std::shared_ptr<const std::string> file_;
  std::size_t start_, room_;
  std::uint64_t next_ = 0;    // the block take() hands out next
  bool taken_last_ = false;   // take() handed out the last block
  std::vector<producer<block>> lanes_;  // last: their threads stop before the rest goes
};

inline bool name_says_compressed(const std::string& p) {
  auto ends = [&](const char* s) {
    const std::size_t n = std::strlen(s);
    return p.size() >= n && p.compare(p.size() - n, n, s) == 0;
  };
  return ends(".gz") || ends(".gzip") || ends(".zlib") || ends(".GZ") || ends(".tgz");  // .tgz: a gzipped tar
}

// Thrown by a read of a pipe that a reader's owner asked to stop (set_cancel): not an
// error of the data; the owner is tearing the reader down.
struct read_cancelled {};

class byte_stream {
 public:
  byte_stream() = default;
  byte_stream(const byte_stream&) = delete;
  byte_stream& operator=(const byte_stream&) = delete;
  byte_stream(byte_stream&& o) noexcept { *this = std::move(o); }
  byte_stream& operator=(byte_stream&& o) noexcept {
    if (this != &o) {
      close();
      pool_ = std::move(o.pool_);
      depth_ = o.depth_;
      threads_ = o.threads_;
      ra_ = std::move(o.ra_);
      path_ = std::move(o.path_);
      file_ = std::move(o.file_);
      fd_ = std::exchange(o.fd_, -1);
      pollable_ = o.pollable_;
      cancel_ = o.cancel_;
      size_ = o.size_;
      gz_ = o.gz_;
      zs_ = std::move(o.zs_);  // on the heap: zlib's state points at its z_stream
      z_live_ = std::exchange(o.z_live_, false);
      isal_cfg_ = o.isal_cfg_;
      isal_ = o.isal_;
#if defined(FERRY_WITH_ISAL)
      ig_ = std::move(o.ig_);
#endif
      z_new_ = o.z_new_;
      member_in_ = o.member_in_;
      member_out_ = o.member_out_;
      z_skip_ = o.z_skip_;
      z_in_ = std::move(o.z_in_);
      z_eof_in_ = o.z_eof_in_;
      z_end_ = o.z_end_;
      z_err_ = std::move(o.z_err_);
      file_pos_ = o.file_pos_;
      cur_ = std::move(o.cur_);
      pos_ = o.pos_;
      end_ = o.end_;
      base_ = o.base_;
      eof_ = o.eof_;
    }
    return *this;
  }
  ~byte_stream() { close(); }

  void set_pool(std::shared_ptr<chunk_pool> p) { pool_ = std::move(p); }
  // A flag whose setting ends a wait for a pipe's data (read_cancelled within 50 ms): for
  // reader threads whose owner must be able to stop them. Null: a pipe is waited for.
  void set_cancel(const std::atomic<bool>* c) { cancel_ = c; }
  // Chunks read ahead by I/O threads for plain files (0: read(2) on the calling thread).
  void set_read_ahead(std::size_t depth, std::size_t threads = 1) {
    depth_ = depth;
    threads_ = threads;
  }
  // Which library inflates the compressed files opened from now on (resolved as
  // resolve_inflater does; throws config_error as it does).
  void set_inflater(inflate_engine e) { isal_cfg_ = resolve_inflater(e) == inflate_engine::isal; }

  // Throws io_error when the path cannot be opened, is a directory, or cannot be read.
  // Never blocks: a FIFO without a writer opens at once (O_NONBLOCK), and its reads wait
  // for data in poll(2), where set_cancel's flag can end them.
  void open(const std::string& path, compression c) {
    close();
    if (path_ != path || !file_) file_ = std::make_shared<const std::string>(path);
    path_ = path;
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) throw io_error(path, 0, std::error_code(errno, std::generic_category()), "cannot open");
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      throw io_error(path, 0, std::error_code(e, std::generic_category()), "cannot stat");
    }
    if (S_ISDIR(st.st_mode)) {
      ::close(fd);
      throw io_error(path, 0, std::make_error_code(std::errc::is_a_directory), "cannot read");
    }
    pollable_ = !S_ISREG(st.st_mode);  // a pipe, a socket, a device: reads may wait
    if (!pollable_) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    fd_ = fd;
#ifdef POSIX_FADV_SEQUENTIAL
    ::posix_fadvise(fd_, 0, 0, POSIX_FADV_SEQUENTIAL);
#endif
    gz_ = c == compression::gzip || (c == compression::automatic && name_says_compressed(path));
    size_ = (S_ISREG(st.st_mode) && !gz_) ? std::optional<std::uint64_t>(st.st_size) : std::nullopt;
    file_pos_ = 0;
    base_ = 0;
    pos_ = end_ = 0;
    eof_ = false;
    cur_.reset();
    if (gz_) {
      if (z_in_.size() != in_bytes) z_in_.assign(in_bytes, std::byte{});
      z_eof_in_ = false;
      z_end_ = false;
      z_err_.clear();
      z_skip_ = 0;
      isal_ = isal_cfg_;
#if defined(FERRY_WITH_ISAL)
      if (isal_) {
        if (!ig_) ig_ = std::make_unique<inflate_state>();  // about 40 KB: once per stream
        isal_inflate_init(ig_.get());
        ig_->avail_in = 0;
        z_new_ = true;  // the first member's header comes first
        return;
      }
#endif
      if (!zs_) zs_ = std::make_unique<z_stream>();
      *zs_ = z_stream{};
      if (inflateInit2(zs_.get(), 15 + 32) != Z_OK)  // 15 + 32: gzip or zlib header, detected
        throw io_error(path, 0, std::make_error_code(std::errc::not_enough_memory), "cannot start zlib");
      z_live_ = true;
      zs_->avail_in = 0;
    }
  }
  void close() noexcept {
    ra_.reset();  // joins the I/O threads before their fd goes
    if (z_live_) inflateEnd(zs_.get());
    z_live_ = false;
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    cur_.reset();
    pos_ = end_ = 0;
  }
  bool is_open() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }
  bool compressed() const { return gz_; }
  // Whether this compressed file is being inflated by ISA-L (false with zlib, and once a
  // damaged member was handed to zlib). For tests.
  bool inflating_with_isal() const { return gz_ && isal_; }
  // Size of the (uncompressed) stream when known: plain regular files only.
  std::optional<std::uint64_t> size() const { return size_; }
  // Offset of the current position in the (uncompressed) stream.
  std::uint64_t offset() const { return base_ + pos_; }
  const std::byte* data() const { return cur_ ? cur_->data + pos_ : nullptr; }
  std::size_t available() const { return end_ - pos_; }
  const std::shared_ptr<chunk>& current_chunk() const { return cur_; }
  // True once the whole file has been read into the buffer (available() is all that's left).
  bool at_eof() const { return eof_; }

  // Makes n contiguous bytes available at data(); returns fewer only at the end of the file.
  std::size_t ensure(std::size_t n) {
    if (end_ - pos_ >= n) return n;
    while (end_ - pos_ < n && !eof_) refill(n);
    return std::min(n, end_ - pos_);
  }
  void consume(std::size_t n) { pos_ += n; }
  // One read toward n contiguous bytes, for a framer looking for a delimiter: returns
  // available(), larger than before unless the file has ended. Unlike ensure(), it stops
  // after one read, so the bytes read before an error (a damaged compressed stream) reach
  // the framer, which may complete records from them; the error comes at the next call.
  std::size_t grow(std::size_t n) {
    if (end_ - pos_ < n && !eof_) refill(n);
    return end_ - pos_;
  }

  // Moves to `target` in the (uncompressed) stream: lseek for plain files, inflate and
  // discard for compressed ones (they can only be read sequentially).
  void seek(std::uint64_t target) {
    if (target == offset()) return;
    if (!gz_) {
      // Past the end the file reads as ended: a restore into a file that shrank since the
      // checkpoint would skip the rest of it unseen.
      if (const auto n = size(); n && target > *n)
        throw format_error(path_, target, "cannot resume: the file has " + std::to_string(*n) +
                                              " bytes, fewer than the saved position (it changed since the checkpoint)");
      ra_.reset();  // it was reading from the old position
      if (::lseek(fd_, static_cast<off_t>(target), SEEK_SET) < 0)
        throw io_error(path_, target, std::error_code(errno, std::generic_category()), "cannot seek");
      file_pos_ = target;
      base_ = target;
      pos_ = end_ = 0;
      eof_ = false;
      cur_.reset();
      return;
    }
    if (target < offset()) open(path_, compression::gzip);
    while (offset() < target) {
      std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(target - offset(), pool_->chunk_bytes()));
      std::size_t got = ensure(want);
      if (got == 0)
        throw format_error(path_, offset(), "cannot resume: the compressed stream ends before the saved position");
      consume(got);
    }
  }

 private:
  static constexpr std::size_t in_bytes = 256 * 1024;

  void refill(std::size_t n) {
    // Read ahead only where it pays for a thread: plain regular files with more than two
    // chunks still to read (size_ is known for exactly those).
    if (ra_ || (depth_ > 0 && size_ && *size_ > file_pos_ + 2 * pool_->chunk_bytes())) return refill_ahead(n);
    const std::size_t have = end_ - pos_;
    const std::size_t chunk_bytes = pool_->chunk_bytes();
    // A fresh chunk when the current one cannot hold n bytes from pos_, or its free tail
    // is too small for a worthwhile read.
    const std::size_t room_now = cur_ ? cur_->capacity - end_ : 0;
    if (!cur_ || cur_->capacity - pos_ < n || room_now < chunk_bytes / 16) {
      std::size_t want = std::max(n, chunk_bytes);
      if (size_ && *size_ > offset() + have) {  // never allocate beyond what the file holds
        const std::uint64_t left = *size_ - offset();
        if (want > left) want = static_cast<std::size_t>(left);
      } else {  // a stream, or a file read past its size at open (it grew): twice what it
                // has given, so a length field's claim is never allocated ahead of the
                // bytes (a 60-byte .gz claiming 2^39 bytes was bad_alloc at every call),
                // and the copies stay linear in the bytes (a grown file's long line was
                // read a byte a call: quadratic)
        const std::size_t held = std::max(have, cur_ ? cur_->capacity : std::size_t(0));
        want = std::min(want, std::max(chunk_bytes, held > SIZE_MAX / 2 ? SIZE_MAX : 2 * held));
      }
      want = std::max(want, have + 1);
      std::shared_ptr<chunk> fresh = pool_->acquire(want);
      fresh->file = file_;
      if (have) std::memcpy(fresh->data, cur_->data + pos_, have);
      base_ += pos_;
      cur_ = std::move(fresh);
      pos_ = 0;
      end_ = have;
    }
    std::byte* dst = cur_->data + end_;
    const std::size_t room = cur_->capacity - end_;
#if defined(FERRY_WITH_ISAL)
    const std::size_t got = !gz_ ? read_into(dst, room) : isal_ ? inflate_isal(dst, room) : inflate_into(dst, room);
#else
    const std::size_t got = gz_ ? inflate_into(dst, room) : read_into(dst, room);
#endif
    end_ += got;
    if (got == 0) eof_ = true;
  }

  // refill() with the I/O thread: the next block becomes the current chunk, with the
  // unconsumed tail copied into its headroom; a tail too large for that (a record longer
  // than the headroom) goes with the new bytes into a chunk that can hold n.
  void refill_ahead(std::size_t n) {
    if (!ra_) ra_ = std::make_unique<read_ahead>(fd_, file_pos_, depth_, threads_, pool_, file_);
    read_ahead::block b = ra_->take();
    if (b.err) {
      ra_.reset();
      std::rethrow_exception(b.err);
    }
    if (b.bytes == 0) {
      ra_.reset();
      eof_ = true;
      return;
    }
    file_pos_ += b.bytes;
    const std::uint64_t off = offset();
    const std::size_t have = end_ - pos_;
    if (have <= b.start) {
      if (have) std::memcpy(b.c->data + b.start - have, cur_->data + pos_, have);
      cur_ = std::move(b.c);
      pos_ = b.start - have;
      end_ = b.start + b.bytes;
    } else if (cur_->capacity - end_ >= b.bytes) {  // appending below nobody's view
      std::memcpy(cur_->data + end_, b.c->data + b.start, b.bytes);
      end_ += b.bytes;
    } else {
      std::shared_ptr<chunk> big = pool_->acquire(std::max(n, have + b.bytes));
      big->file = file_;
      std::memcpy(big->data, cur_->data + pos_, have);
      std::memcpy(big->data + have, b.c->data + b.start, b.bytes);
      cur_ = std::move(big);
      pos_ = 0;
      end_ = have + b.bytes;
    }
    base_ = off - pos_;
  }

  std::size_t read_into(std::byte* dst, std::size_t room) {
    for (;;) {
      if (pollable_) wait_readable();
      ssize_t r = ::read(fd_, dst, room);
      if (r >= 0) {
        file_pos_ += static_cast<std::uint64_t>(r);
        return static_cast<std::size_t>(r);
      }
      if (errno == EINTR || (pollable_ && errno == EAGAIN)) continue;
      const int e = errno;
      if (e == EISDIR)
        throw io_error(path_, file_pos_, std::make_error_code(std::errc::is_a_directory), "cannot read");
      throw io_error(path_, offset(), std::error_code(e, std::generic_category()), "read failed");
    }
  }

  // A pipe: waits until it has data, or its writer has gone (POLLHUP: the read then sees
  // the end). A FIFO whose writer never came keeps waiting (Linux reports POLLHUP only
  // after a writer has come and gone). With a cancel flag, looks at it every 50 ms.
  void wait_readable() {
    for (;;) {
      pollfd p{fd_, POLLIN, 0};
      const int rc = ::poll(&p, 1, cancel_ ? 50 : -1);
      if (rc > 0) {
        if (p.revents & POLLNVAL)
          throw io_error(path_, offset(), std::make_error_code(std::errc::bad_file_descriptor), "read failed");
        return;  // data, the writer's end, or an error the read will report
      }
      if (rc < 0 && errno != EINTR)
        throw io_error(path_, offset(), std::error_code(errno, std::generic_category()), "poll failed");
      if (cancel_ && cancel_->load(std::memory_order_relaxed)) throw read_cancelled{};
    }
  }

  // Steps over zero bytes (padding after a member: no member starts with one).
  template <class Ptr, class Count>
  static void skip_zeros(Ptr& next, Count& avail) {
    while (avail > 0 && *next == 0) {
      ++next;
      --avail;
    }
  }

  // Inflates into dst; 0 only at the clean end of the stream. Concatenated gzip members
  // (what `cat a.gz b.gz` makes) are read as one stream, as gzip(1) does.
  std::size_t inflate_into(std::byte* dst, std::size_t room) {
    // After ISA-L handed a damaged member over (isal_to_zlib): the member's bytes it
    // produced, inflated again and dropped. An error among them is thrown at once (the
    // bytes before it are already out).
    while (z_skip_ > 0) {
      const std::size_t got = inflate_zlib(dst, static_cast<std::size_t>(std::min<std::uint64_t>(z_skip_, room)));
      if (!z_err_.empty()) throw format_error(path_, offset(), z_err_);
      if (got == 0)
        throw format_error(path_, offset(), "corrupt gzip stream (ends before the bytes already inflated; "
                                            "offset in the uncompressed data)");
      z_skip_ -= got;
    }
    return inflate_zlib(dst, room);
  }
  std::size_t inflate_zlib(std::byte* dst, std::size_t room) {
    if (!z_err_.empty()) throw format_error(path_, offset(), z_err_);
    zs_->next_out = reinterpret_cast<Bytef*>(dst);
    zs_->avail_out = static_cast<uInt>(std::min<std::size_t>(room, 1u << 30));
    const uInt start = zs_->avail_out;
    while (zs_->avail_out == start) {
      if (zs_->avail_in == 0 && !z_eof_in_) {
        std::size_t got = read_into(z_in_.data(), z_in_.size());
        if (got == 0) z_eof_in_ = true;
        zs_->next_in = reinterpret_cast<Bytef*>(z_in_.data());
        zs_->avail_in = static_cast<uInt>(got);
      }
      if (z_end_) {
        skip_zeros(zs_->next_in, zs_->avail_in);  // padding after a member
        if (zs_->avail_in == 0 && z_eof_in_) return 0;  // clean end
        if (zs_->avail_in == 0) continue;
        inflateReset(zs_.get());  // another member follows
        z_end_ = false;
      }
      if (zs_->avail_in == 0 && z_eof_in_)
        throw format_error(path_, offset(),
                           "truncated gzip stream (offset in the uncompressed data)");
      int rc = inflate(zs_.get(), Z_NO_FLUSH);
      if (rc == Z_STREAM_END) {
        z_end_ = true;
      } else if (rc == Z_BUF_ERROR) {
        continue;  // needs more input; loop reads it
      } else if (rc != Z_OK) {
        std::string why = std::string("corrupt gzip stream (") + (zs_->msg ? zs_->msg : "zlib error") +
                          "; offset in the uncompressed data)";
        // The bytes inflated before the damage (all of them, for a bad trailer CRC) are
        // handed out first; the error comes at the first record they cannot complete.
        if (zs_->avail_out != start) {
          z_err_ = std::move(why);
          break;
        }
        throw format_error(path_, offset(), why);
      }
    }
    return start - zs_->avail_out;
  }

#if defined(FERRY_WITH_ISAL)
  // inflate_into with ISA-L's igzip, for well-formed gzip members (ISA-L parses the gzip
  // header and checks the trailer). Anything else goes to zlib (isal_to_zlib), which reads
  // the rest of the file:
  //  - a member that does not start with gzip's 1f 8b: a zlib-wrapped one (ISA-L 2.30 reads
  //    a byte past a zlib member's trailer, which would eat the next member's first byte),
  //    or no member at all (zlib's "incorrect header check"); zlib starts on those bytes;
  //  - damage ISA-L meets in a member (a deflate or trailer error, the input ending): zlib
  //    inflates the member again from its first byte, drops the bytes of it handed out
  //    before this call, and makes this call's output itself. So what a damaged file
  //    yields, records and error alike, is zlib's: zlib decodes every whole symbol before
  //    a cut, where ISA-L leaves the last few undecoded (which would lose the records they
  //    complete), and ISA-L may decode a few hundred bytes past damage inside the deflate
  //    data before it notices (at most 364 in 20,000 random one-byte changes, none in
  //    half). Only when those bytes reached an earlier call's output (damage within that
  //    much of the end of a chunk, or a chunk smaller than that) are records past the
  //    damage handed out before zlib's error, which then comes at the next record.
  std::size_t inflate_isal(std::byte* dst, std::size_t room) {
    inflate_state& s = *ig_;
    s.next_out = reinterpret_cast<std::uint8_t*>(dst);
    s.avail_out = static_cast<std::uint32_t>(std::min<std::size_t>(room, 1u << 30));
    const std::uint32_t start = s.avail_out;
    const std::uint64_t out_at = base_ + end_;  // dst's offset in the uncompressed stream
    while (s.avail_out == start) {
      if (s.avail_in == 0 && !z_eof_in_) isal_read(0);
      if (z_end_) {
        skip_zeros(s.next_in, s.avail_in);  // padding after a member
        if (s.avail_in == 0 && z_eof_in_) return 0;  // clean end
        if (s.avail_in == 0) continue;
        z_end_ = false;
        z_new_ = true;  // another member follows
      }
      if (z_new_) {
        if (s.avail_in < 4 && !z_eof_in_) {
          isal_read(s.avail_in);
          continue;
        }
        member_in_ = file_pos_ - s.avail_in;
        member_out_ = out_at + (start - s.avail_out);
        // Not gzip, or reserved FLG bits set (RFC 1952: an error, which ISA-L does not
        // check): zlib reads from here, and says so as for any file.
        if (s.avail_in < 4 || s.next_in[0] != 0x1f || s.next_in[1] != 0x8b || (s.next_in[3] & 0xe0) != 0)
          return isal_to_zlib(dst, room, start - s.avail_out, ISAL_INVALID_WRAPPER, true);
        std::uint8_t* in = s.next_in;
        const std::uint32_t avail = s.avail_in;
        std::uint8_t* out = s.next_out;
        const std::uint32_t room_left = s.avail_out;
        isal_inflate_reset(&s);  // a new member: keep the buffers
        s.next_in = in;
        s.avail_in = avail;
        s.next_out = out;
        s.avail_out = room_left;
        s.crc_flag = ISAL_GZIP;
        z_new_ = false;
      }
      if (s.avail_in == 0 && z_eof_in_) return isal_to_zlib(dst, room, start - s.avail_out, ISAL_END_INPUT, false);
      const int rc = isal_inflate(&s);
      if (rc < 0) return isal_to_zlib(dst, room, start - s.avail_out, rc, false);
      if (s.block_state == ISAL_BLOCK_FINISH) z_end_ = true;  // trailer read and checked
    }
    return start - s.avail_out;
  }
  // zlib reads the rest of the file, `made` bytes into this call's output, from the
  // member that starts at member_in_ (file) / member_out_ (uncompressed stream):
  //  - `fresh`: at its start (nothing of it read, its bytes still buffered); this call's
  //    bytes (of whole members before it) are returned first, zlib goes on at the next;
  //  - after ISA-L met damage (`rc`) in it: from its first byte again, dropping the bytes
  //    of it handed out before this call; zlib makes this call's output in place of
  //    ISA-L's. A file that cannot seek back (a pipe) gets ISA-L's own error instead,
  //    after this call's bytes.
  std::size_t isal_to_zlib(std::byte* dst, std::size_t room, std::size_t made, int rc, bool fresh) {
    const std::uint64_t produced = base_ + end_ + made - member_out_;
    if (!zs_) zs_ = std::make_unique<z_stream>();
    *zs_ = z_stream{};
    if (inflateInit2(zs_.get(), 15 + 32) != Z_OK)
      throw io_error(path_, offset(), std::make_error_code(std::errc::not_enough_memory), "cannot start zlib");
    z_live_ = true;
    isal_ = false;  // zlib reads the rest of this file
    z_end_ = false;
    if (fresh) {  // the member's bytes are where ISA-L would have started
      zs_->next_in = reinterpret_cast<Bytef*>(ig_->next_in);
      zs_->avail_in = ig_->avail_in;
      z_skip_ = 0;
      return made ? made : inflate_into(dst, room);
    }
    if (::lseek(fd_, static_cast<off_t>(member_in_), SEEK_SET) < 0) {
      std::string why = rc == ISAL_END_INPUT ? std::string("truncated gzip stream (offset in the uncompressed data)")
                                             : std::string("corrupt gzip stream (") + isal_reason(rc) +
                                                   "; offset in the uncompressed data)";
      if (made) {
        z_err_ = std::move(why);
        return made;
      }
      throw format_error(path_, offset(), why);
    }
    file_pos_ = member_in_;
    zs_->avail_in = 0;
    z_eof_in_ = false;
    z_skip_ = produced - made;
    return inflate_into(dst, room);
  }
  // Reads more compressed bytes after the `keep` not yet inflated (moved to the front).
  void isal_read(std::uint32_t keep) {
    inflate_state& s = *ig_;
    if (keep) std::memmove(z_in_.data(), s.next_in, keep);
    const std::size_t got = read_into(z_in_.data() + keep, z_in_.size() - keep);
    if (got == 0) z_eof_in_ = true;
    s.next_in = reinterpret_cast<std::uint8_t*>(z_in_.data());
    s.avail_in = static_cast<std::uint32_t>(keep + got);
  }
  // For a file that cannot be handed to zlib: zlib's words where they name the same damage.
  static const char* isal_reason(int rc) {
    switch (rc) {
      case ISAL_INVALID_BLOCK: return "invalid deflate block";
      case ISAL_INVALID_SYMBOL: return "invalid deflate symbol";
      case ISAL_INVALID_LOOKBACK: return "invalid distance too far back";
      case ISAL_INVALID_WRAPPER: return "incorrect header check";
      case ISAL_UNSUPPORTED_METHOD: return "unknown compression method";
      case ISAL_INCORRECT_CHECKSUM: return "incorrect data check";
      default: return "ISA-L inflate error";
    }
  }
#endif

  std::shared_ptr<chunk_pool> pool_;
  std::size_t depth_ = 0, threads_ = 1;
  std::unique_ptr<read_ahead> ra_;
  std::string path_;
  std::shared_ptr<const std::string> file_;  // path_, shared with the chunks filled from it
  int fd_ = -1;
  bool pollable_ = false;                   // not a regular file: reads wait in poll(2)
  const std::atomic<bool>* cancel_ = nullptr;  // set_cancel
  std::optional<std::uint64_t> size_;
  bool gz_ = false;
  // On the heap, so that a move (a pipeline moved mid-file) keeps its address: zlib's state
  // points back at it, and a z_stream copied elsewhere fails every inflate() after.
  std::unique_ptr<z_stream> zs_;
  bool z_live_ = false;
  bool isal_cfg_ = have_isal;  // inflate with ISA-L (set_inflater)
  bool isal_ = false;          // this file: ISA-L, until it hands a damaged member to zlib
#if defined(FERRY_WITH_ISAL)
  std::unique_ptr<inflate_state> ig_;
#endif
  bool z_new_ = false;  // ISA-L: at the start of a member, its wrapper not yet known
  std::uint64_t member_in_ = 0, member_out_ = 0;  // ISA-L: where the member began (file, stream)
  std::uint64_t z_skip_ = 0;  // zlib: bytes to inflate and drop (isal_to_zlib)
  std::vector<std::byte> z_in_;
  bool z_eof_in_ = false, z_end_ = false;
  std::string z_err_;  // a zlib error met after some output: thrown at the next inflate
  std::uint64_t file_pos_ = 0;  // bytes read from the file itself
  std::shared_ptr<chunk> cur_;
  std::size_t pos_ = 0, end_ = 0;
  std::uint64_t base_ = 0;  // stream offset of cur_->data[0]
  bool eof_ = false;
};

}  // namespace detail
}  // namespace ferry
