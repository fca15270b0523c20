// ferry/sources/record.hpp: one record read from a file: a contiguous, read-only byte
// range that keeps the read chunk it views alive, and knows where it came from.
//
// A record is a view into the reader's chunk (no copy on the read path) plus a shared
// reference to that chunk, so it stays valid for as long as the record (or any copy of
// it) exists, on any thread; the chunk returns to the reader's pool when its last record
// is destroyed. Copying a record copies the reference, not the bytes. It models
// std::ranges::contiguous_range of std::byte, so batch() collates records as a ragged
// field (one contiguous buffer plus offsets). Holding many records holds their chunks:
// consume or copy them if you keep them long.
//
// origin() says where a record read by from_files/interleave was: the file and the byte
// offset where the record starts (its header, for TFRecord; in the uncompressed stream
// for compressed files), so a decoder further down the pipeline (parse_example) can
// report "file: what at offset n" like the readers do, and the epoch of the reading
// source it came from (from_files' and interleave's epoch: the count of rewinds;
// global_shuffle's and cache()'s own for the records they hand out), so a
// random draw keyed on (seed, epoch, file, offset) is the same whichever thread, worker
// count or resume produced the record (ferry/image/random_crop.hpp). The file name is owned by the
// chunk the record holds, so it lives exactly as long as the record. Records built by
// hand have an empty origin (file "").
//
// Throws: building a record from bytes may throw std::bad_alloc; views and origin() throw
// nothing. A record may be read and destroyed on any thread (its chunk's count is
// atomic); no user code runs here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ferry {

// Where a record was read: what origin() returns (see above).
struct record_origin {
  std::string_view file;     // "" when unknown
  std::uint64_t offset = 0;  // where the record starts in the file (its framing header)
  std::uint64_t data_offset = 0;  // where its first payload byte is
  std::uint32_t epoch = 0;  // the reading source's epoch (modulo 2^32); 0 when built by hand
};

// One record: a read-only view of its bytes that keeps them alive (see above).
class record {
 public:
  using value_type = std::byte;  // a contiguous range of bytes

  record() = default;
  // size bytes at bytes.get(), kept alive by `bytes` (an aliasing shared_ptr into a chunk,
  // or storage of its own); the origin is empty.
  record(std::shared_ptr<const std::byte> bytes, std::size_t size) noexcept
      : p_(std::move(bytes)), n_(size) {}
  // `file` must live as long as the bytes do (from_files keeps it in the chunk).
  record(std::shared_ptr<const std::byte> bytes, std::size_t size, const std::string* file,
         std::uint64_t offset, std::uint32_t header_bytes, std::uint64_t epoch = 0) noexcept
      : p_(std::move(bytes)), n_(size), file_(file), off_(offset), head_(header_bytes),
        epoch_(static_cast<std::uint32_t>(epoch)) {}

  // The first byte (null for an empty default record).
  const std::byte* data() const noexcept { return p_.get(); }
  // The number of bytes.
  std::size_t size() const noexcept { return n_; }
  // Whether it has no byte.
  bool empty() const noexcept { return n_ == 0; }
  // The first byte, for range-for and ranges.
  const std::byte* begin() const noexcept { return p_.get(); }
  // Past the last byte.
  const std::byte* end() const noexcept { return p_.get() + n_; }
  // The bytes as a span.
  std::span<const std::byte> bytes() const noexcept { return {p_.get(), n_}; }
  // The bytes as text (a text_lines line, a TFRecord of text).
  std::string_view str() const noexcept { return {reinterpret_cast<const char*>(p_.get()), n_}; }
  // Where it was read: file, record offset and payload offset (file "" when built by hand).
  record_origin origin() const noexcept {
    return {file_ ? std::string_view(*file_) : std::string_view(), off_, off_ + head_, epoch_};
  }
  // Part of this record: the `size` bytes from byte `at` (at + size <= size(): the caller
  // checks), as a record of its own that shares this one's storage (no copy), file and
  // epoch. Its origin says its record begins header_bytes before its first byte (a tar
  // member inside a WebDataset sample: its header, then its data). Throws nothing.
  record part(std::size_t at, std::size_t size, std::uint32_t header_bytes = 0) const noexcept {
    return record(std::shared_ptr<const std::byte>(p_, p_.get() + at), size, file_,
                  off_ + head_ + at - header_bytes, header_bytes, epoch_);
  }
  // Sets the epoch origin() says (modulo 2^32): a stage that hands records out again in
  // epochs of its own stamps its epoch on them (global_shuffle over row_files, whose
  // records are read at random with no epoch; cache(), which replays a pass), so that
  // draws keyed on it differ from epoch to epoch. Throws nothing.
  void set_epoch(std::uint64_t epoch) noexcept { epoch_ = static_cast<std::uint32_t>(epoch); }

 private:
  std::shared_ptr<const std::byte> p_;
  std::size_t n_ = 0;
  const std::string* file_ = nullptr;
  std::uint64_t off_ = 0;
  std::uint32_t head_ = 0;
  std::uint32_t epoch_ = 0;  // fills what was padding: a record stays 48 bytes
};

// Records lent without a reference each (see borrowing_source in ferry/source.hpp): views
// of their bytes, plus one reference to each block of storage (a read chunk) the views
// point into, which keeps every view valid until clear(). What batch() of records uses,
// since it copies the bytes at once: a record's own reference is an atomic increment and
// decrement per record, the larger part of reading 128-byte records.
struct borrowed_records {
  std::vector<std::span<const std::byte>> views;  // each record's bytes, in order
  std::vector<std::shared_ptr<const void>> owners;  // one reference per chunk the views point into

  // The number of records lent.
  std::size_t size() const noexcept { return views.size(); }
  // Drops the views and the references (the views are invalid after); keeps the capacity.
  void clear() noexcept {
    views.clear();
    owners.clear();
  }
  // Adds a view into storage owned by `owner`, taking a reference only when the owner is
  // none of the last few views' (interleave alternates among a few files' chunks).
  // Throws std::bad_alloc.
  template <class T>
  void add(const std::shared_ptr<T>& owner, std::span<const std::byte> v) {
    const void* p = owner.get();
    const std::size_t n = owners.size(), from = n > 8 ? n - 8 : 0;
    bool held = false;
    for (std::size_t i = n; i > from && !held; --i) held = owners[i - 1].get() == p;
    if (!held) owners.emplace_back(owner);
    views.push_back(v);
  }
};

}  // namespace ferry
