// ferry/sources/from_files.hpp: records streamed from many files, with bounded memory.
//
//   auto src = ferry::from_files({"data/train-*.tfrecord"}, ferry::tfrecord{});
//   auto src = ferry::from_files({"x.npy"}, ferry::npy{}, {.on_error = ferry::error_policy::skip});
//   for (ferry::record& r : src) use(r.bytes());
//
// Formats: ferry::tfrecord{.verify_crc}, npy{}, idx{}, fixed_length{.record_bytes,
// .header_bytes, .footer_bytes}, text_lines{}, webdataset{} (tar shards: a record is a
// sample, parse_webdataset splits it; see each header). Files whose names end in
// .gz/.gzip/.zlib are inflated on the fly (options.compress overrides the guess);
// concatenated members are one stream, zero padding after the last is ignored, other
// trailing bytes are an error (detail/byte_stream.hpp).
// Paths containing * ? [ are glob patterns, expanded (sorted) when from_files is called,
// unless a file of that very name exists (data[1].tfrecord is then that file);
// files are read in the order given, or with options.shuffle_files in a new order every
// epoch: a permutation seeded from (options.shuffle_seed, epoch), the same on every rank
// and build, where rewind() starts the next epoch (tf.data's list_files(shuffle=True)).
//
// Reading: each file is read sequentially with large read(2) calls into pooled chunks of
// options.chunk_bytes (default 1 MiB); a record is a view into its chunk that owns a
// reference to it (ferry::record), valid until the record and its copies are destroyed.
// Only a record larger than a chunk needs a larger chunk, never larger than what is left
// in the file nor than options.max_record_bytes (64 MiB by default), in any format.
// batch() takes records through next_borrowed (borrowing_source): views, with one chunk
// reference per chunk, copied into the batch at once.
// Nothing is opened until the first next(). After the end, next() returns nullopt until
// rewind().
// Read-ahead: a plain regular file with more than two chunks left is read by
// options.read_threads I/O threads (default 2) that keep up to options.read_ahead chunks
// (default 4, or two per thread when that is more; 0 turns read-ahead off) filled ahead
// with pread(2), each thread a producer engine (detail/producer.hpp), so the kernel's copy out
// of the page cache runs beside the framing, CRC checks and batching, and on more than
// one core. On the 2-core machine (bench_read 256 1024, benchmarks/results/
// read-vm-2026-11-21T173819.json and T203019.json): TFRecord with CRC 0.71-0.72x `cat`
// with read_ahead = 0 -> 1.05-1.09x with it, measured in the same runs; fixed-length
// records 1.34-1.37x, against 0.91x before read-ahead (read-vm-2026-11-21T155457.json,
// an earlier commit reading 64 MiB rather than 256). Memory grows by read_ahead chunks
// per open file. Small files, pipes and compressed files are read on the calling thread.
//
// File-level sharding: `| shard(n, i)` right after from_files calls shard_files(n, i),
// keeping files j with j % n == i (tf.data's rule) - no record of another shard is read.
// j is the place in the list as given: with shuffle_files a shard keeps its files and
// reads them in a new order every epoch.
//
// Threads: everything runs on the thread calling next() (on_skip included); only the
// read(2)s of options.read_ahead run on the I/O threads, which run no user code.
//
// Errors: with error_policy::raise (default) next() throws io_error (missing file,
// directory, read failure) or format_error (file, offset where the bad record starts,
// what was wrong); reading can go on after the throw, past the bad record (a TFRecord
// data CRC mismatch) or from the next file. With error_policy::skip those are counted
// (skipped()) and reported through options.on_skip. from_files itself throws config_error
// for a bad format option and io_error for a pattern matching no file; shard_files
// (`| shard(n, i)`) throws config_error for a bad count or index or more shards than files.
//
// Memory: bounded: the open file's current chunk of options.chunk_bytes (1 MiB), and with
// read-ahead up to options.read_ahead more chunks, or two per I/O thread when that is more
// (pooled and reused); a record larger
// than a chunk takes a chunk of its size, at most options.max_record_bytes. A record
// keeps its chunk alive for as long as it (or a copy) lives.
//
// Checkpoints: save() records the file list (a hash), the format (with a `compress` that
// overrides what a file's name says), shuffle_files and shuffle_seed, then the epoch, the place in this epoch's file order, whether a file is
// open with its offset and record count, and whether the epoch has ended. restore()
// throws config_error, naming what differs, for a state saved with another file list,
// format or shuffling, and for a damaged one; the file is re-opened at the next next(),
// at the saved offset (compressed files are inflated up to it). The state holds the
// epoch, so a resumed job continues that epoch's order and the later epochs' orders.
#pragma once

#include <cstdint>
#include <memory_resource>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ferry/detail/random.hpp"
#include "ferry/error.hpp"
#include "ferry/stage.hpp"
#include "ferry/sources/array_meta.hpp"
#include "ferry/sources/detail/file_reader.hpp"
#include "ferry/sources/file_options.hpp"
#include "ferry/sources/record.hpp"

namespace ferry {
namespace detail {

class file_source : public source_base<file_source, record> {
  friend source_base<file_source, record>;

 public:
  static constexpr char name[] = "from_files";

  file_source(std::vector<std::string> files, file_format fmt, from_files_options o)
      : base_(std::move(files)), fmt_(std::move(fmt)), opt_(std::move(o)),
        pool_(std::make_shared<chunk_pool>(std::max<std::size_t>(opt_.chunk_bytes, 64))),
        reader_(fmt_, opt_, pool_), hash_(hash_files(base_)) {
    order_files();
  }

 private:
  std::optional<record> pull() { return next_impl(); }
  // The borrowing_source fast path (source.hpp): the next records as views, one chunk
  // reference per chunk instead of one per record. Throws as next() does; the records
  // appended before a throw stay in `out`.
  std::size_t pull_borrowed(borrowed_records& out, std::size_t max) { return borrow(out, max); }

  std::optional<record> next_impl() {
    record r;
    if (!advance(make_record{r, epoch_})) return std::nullopt;
    return r;
  }
  std::size_t borrow(borrowed_records& out, std::size_t max) {
    std::size_t n = 0;
    const auto emit = [&](const std::shared_ptr<chunk>& c, std::span<const std::byte> bytes, std::uint64_t,
                          std::uint32_t) { out.add(c, bytes); };
    while (n < max && advance(emit)) ++n;
    return n;
  }

  // Moves to the next record and hands its place to emit (see file_reader::next_with);
  // false at the end of the epoch. Applies the error policy.
  template <class Emit>
  bool advance(const Emit& emit) {
    for (;;) {
      if (done_) return false;
      if (!reader_.is_open()) {
        if (fi_ >= files_.size()) {
          done_ = true;
          return false;
        }
        try {
          // Restored past the first file: its layout is still the one to match; with
          // shuffle_files the first readable one of the list as given, every epoch.
          if (!first_meta_ && (fi_ > 0 || opt_.shuffle_files)) first_meta_ = reference_layout(fi_);
          reader_.open(files_[fi_], first_meta_);
          if (pending_) {
            reader_.seek(pending_->first, pending_->second);
            pending_.reset();
          }
        } catch (const ferry::error& e) {
          reader_.close();  // seek may throw with the file open: the next file is next
          pending_.reset();
          ++fi_;
          on_bad(e);
          continue;
        } catch (...) {  // not the file's fault (std::bad_alloc): the next call tries it again
          reader_.close();
          throw;
        }
      }
      skipped_record bad;
      frame_status st;
      try {
        st = reader_.next_with(bad, emit);
      } catch (const ferry::error& e) {
        reader_.close();
        ++fi_;
        on_bad(e);
        continue;
      }
      if (st == frame_status::record) return true;
      if (st == frame_status::end) {
        reader_.close();
        ++fi_;
        continue;
      }
      if (opt_.on_error == error_policy::raise) throw format_error(bad.path, bad.offset, bad.reason);
      ++skipped_;
      log_skip(opt_, bad);
    }
  }


 public:
  // Epochs started before this one (rewinds since construction or the restored state's).
  std::uint64_t epoch() const { return epoch_; }
  // Sets the epoch, and with shuffle_files the order of files() to that epoch's. For
  // interleave, which reads the files itself; call only between epochs.
  void set_epoch(std::uint64_t e) {
    epoch_ = e;
    if (opt_.shuffle_files) order_files();
  }
  // The hash of the file list as given (whatever the epoch's order): what a state checks.
  std::uint64_t list_hash() const { return hash_; }
  // The format and what frames records (fixed_length's sizes): a state of another format
  // over the same files would seek to another record.
  // So is a compress option that overrides the name's guess for a file (offsets count in
  // the inflated stream, or in the bytes): mixed in only then, so `automatic` and an
  // option that agrees with the names hash alike.
  std::uint64_t format_hash() const {
    std::uint64_t h = mix_seed({0x666f726d6174ull /* "format" */, fmt_.index()});
    if (const auto* f = std::get_if<fixed_length>(&fmt_)) h = mix_seed({h, f->record_bytes, f->header_bytes, f->footer_bytes});
    if (opt_.compress != compression::automatic)
      for (const std::string& p : files_)
        if ((opt_.compress == compression::gzip) != name_says_compressed(p))
          return mix_seed({h, 0x636f6d7072657373ull /* "compress" */, std::uint64_t(opt_.compress)});
    return h;
  }
  bool set_buffer_resource(const std::shared_ptr<std::pmr::memory_resource>&) {
    this->check_not_moved();
    return false;
  }

  // Keeps files j with j % count == index. Throws config_error when count == 0,
  // index >= count or count > the number of files. Call before the first next().
  file_source shard_files(std::size_t count, std::size_t index) && {
    if (count == 0 || index >= count)
      throw config_error("shard: index must be in [0, count): got index " + std::to_string(index) + " of " +
                         std::to_string(count));
    if (count > files_.size())
      throw config_error("shard: " + std::to_string(count) + " shards of " + std::to_string(files_.size()) +
                         " files would leave some shards empty; shard fewer ways, or by element "
                         "(shard(count, index, ferry::by_element))");
    std::vector<std::string> keep;
    for (std::size_t j = index; j < base_.size(); j += count) keep.push_back(std::move(base_[j]));
    return file_source(std::move(keep), std::move(fmt_), std::move(opt_));
  }

  // This epoch's files, in the order they are read (the list as given, or with
  // shuffle_files its permutation for epoch()).
  const std::vector<std::string>& files() const { return files_; }
  const file_format& format() const { return fmt_; }
  const from_files_options& options() const { return opt_; }
  // Records skipped under error_policy::skip since construction (a file that could not
  // be framed to its end counts once).
  std::uint64_t skipped() const { return skipped_; }
  // npy/IDX: the row layout of the first of files()[0, upto) whose header reads, which a
  // read from the start takes as the one every file must match (nullopt: none reads, or
  // another format); with shuffle_files, of the first in the list as given, whatever the
  // epoch's order and upto, so the same files are refused every epoch and after a resume.
  // Those files' own errors come when they are read. Opens headers with a reader of its
  // own (no read-ahead threads), so interleave's workers may call it.
  std::optional<array_meta> reference_layout(std::size_t upto = std::size_t(-1)) const {
    if (!array_format()) return std::nullopt;
    const std::vector<std::string>& list = opt_.shuffle_files ? base_ : files_;
    if (opt_.shuffle_files) upto = list.size();
    for (std::size_t j = 0; j < upto && j < list.size(); ++j) {
      try {
        std::optional<array_meta> m;
        file_reader r(fmt_, header_only(), pool_);
        r.open(list[j], m);
        return m;
      } catch (const ferry::error&) {
      }
    }
    return std::nullopt;
  }
  // For npy and idx: dtype and shape of the rows (reads the header of the file next()
  // would open if none has been read yet; throws as next() would: under
  // error_policy::skip, the first file from there whose header reads, nullopt when none
  // does). nullopt for the other formats.
  std::optional<array_meta> meta() {
    if (!first_meta_ && !reader_.is_open() && !done_ && fi_ < files_.size() && array_format()) {
      if (fi_ > 0 || opt_.shuffle_files)
        if (auto m = reference_layout(fi_)) return m;
      for (std::size_t j = fi_; j < files_.size(); ++j) {
        std::optional<array_meta> probe;
        try {
          file_reader r(fmt_, header_only(), pool_);
          r.open(files_[j], probe);
          return probe;
        } catch (const ferry::error&) {
          if (opt_.on_error != error_policy::skip) throw;
        }
      }
      return std::nullopt;
    }
    return first_meta_;
  }

 private:
  // The next epoch (with shuffle_files: a new order of the files).
  void start_epoch() {
    reader_.close();
    fi_ = 0;
    done_ = false;
    pending_.reset();
    set_epoch(epoch_ + 1);
  }
  // What a state must have been saved with: the files, their format, their order.
  template <class F>
  void config(F&& f) const {
    f("file list", hash_, true);
    f("format", format_hash(), true);
    f("shuffle_files", opt_.shuffle_files ? 1 : 0);
    f("shuffle_seed", opt_.shuffle_files ? opt_.shuffle_seed : 0);
  }
  // Words: epoch, file index, open flag, offset, records read in the file, done.
  void save_words(state_writer& w) const {
    w.put(epoch_);
    w.put(fi_);
    const bool open = reader_.is_open() || pending_.has_value();
    w.put(open);
    w.put(reader_.is_open() ? reader_.offset() : pending_ ? pending_->first : 0);
    w.put(reader_.is_open() ? reader_.records() : pending_ ? pending_->second : 0);
    w.put(done_);
  }
  // The file is re-opened at the next next(); compressed files are inflated up to the
  // saved offset.
  void restore_words(state_reader& r) {
    const std::uint64_t epoch = r.get(), fi = r.get(), open = r.get();
    const std::uint64_t off = r.get(), rec = r.get(), done = r.get();
    if (fi > files_.size() || open > 1 || done > 1 || (open && fi >= files_.size()))
      throw config_error("restore_state: from_files: a damaged state (file " + std::to_string(fi) + " of " +
                         std::to_string(files_.size()) + ")");
    reader_.close();
    set_epoch(epoch);
    fi_ = fi;
    done_ = done != 0;
    pending_.reset();
    if (open) pending_ = std::make_pair(off, rec);
  }

  // files_ = base_ in this epoch's order: Fisher-Yates driven by SplitMix64 seeded from
  // (shuffle_seed, epoch), bit for bit the same on every build and rank.
  void order_files() {
    files_ = base_;
    if (!opt_.shuffle_files) return;
    splitmix64 g(mix_seed({0x73656c6966ull /* "files" */, opt_.shuffle_seed, epoch_}));
    permute(files_, g);
  }
  bool array_format() const { return std::holds_alternative<npy>(fmt_) || std::holds_alternative<idx>(fmt_); }
  from_files_options header_only() const {
    from_files_options o = opt_;
    o.read_ahead = 0;  // a header: no I/O threads for it
    return o;
  }

  void on_bad(const ferry::error& e) {
    if (opt_.on_error == error_policy::raise) throw;
    ++skipped_;
    log_skip(opt_, describe(e));
  }

  std::vector<std::string> base_;   // the list as given (after shard_files)
  std::vector<std::string> files_;  // this epoch's order of base_
  std::uint64_t epoch_ = 0;
  file_format fmt_;
  from_files_options opt_;
  std::shared_ptr<chunk_pool> pool_;
  file_reader reader_;
  std::uint64_t hash_;
  std::size_t fi_ = 0;
  bool done_ = false;
  std::uint64_t skipped_ = 0;
  std::optional<array_meta> first_meta_;
  std::optional<std::pair<std::uint64_t, std::uint64_t>> pending_;
};

}  // namespace detail

// The type of ferry::from_files.
struct from_files_t {
  // Throws config_error for a bad format option, io_error for a pattern matching nothing.
  auto operator()(const std::vector<std::string>& paths, file_format fmt, from_files_options o = {}) const {
    detail::check_format(fmt, o);
    return detail::file_source(detail::expand_paths(paths), std::move(fmt), std::move(o));
  }
  // One path (or glob pattern); throws as the list form does.
  auto operator()(const char* path, file_format fmt, from_files_options o = {}) const {
    return (*this)(std::vector<std::string>{path}, std::move(fmt), std::move(o));
  }
};
// from_files(paths, format, options): records streamed from many files (see the file's
// top).
inline constexpr from_files_t from_files{};

}  // namespace ferry
