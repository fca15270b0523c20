// ferry/sources/file_options.hpp: what from_files (and interleave, and cache(path)'s reader)
// is told: the file format, the error policy and what a skip reports, and the options.
//
//   ferry::from_files({"x/*.tfrecord"}, ferry::tfrecord{}, {.on_error = ferry::error_policy::skip,
//                                                           .shuffle_files = true, .shuffle_seed = 7})
//
// Plain values: no threads; on_skip runs where from_files says (the reading thread).
// Nothing here throws; from_files checks the options (config_error, from_files.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <variant>

#include "ferry/error.hpp"
#include "ferry/sources/compression.hpp"
#include "ferry/sources/fixed_length.hpp"
#include "ferry/sources/idx.hpp"
#include "ferry/sources/npy.hpp"
#include "ferry/sources/text_lines.hpp"
#include "ferry/sources/tfrecord.hpp"
#include "ferry/sources/webdataset.hpp"

namespace ferry {

// The format of the files from_files reads: one of the format tags, with its options.
using file_format = std::variant<tfrecord, npy, idx, fixed_length, text_lines, webdataset>;

// error_policy (raise, skip): in ferry/error.hpp.

// What a skip reports: the file, the offset where the bad record starts (in the
// uncompressed stream for compressed files) and what was wrong.
struct skipped_record {
  std::string path;  // the file
  std::uint64_t offset = 0;  // where the bad record starts
  std::string reason;  // what was wrong: a format_error's reason; for an io_error, "what (OS message)"
  // "path: reason at offset n", as the default on_skip prints it (after "ferry: skipped ").
  std::string message() const { return path + ": " + reason + " at offset " + std::to_string(offset); }
};

// from_files' options, a braced list (the example above).
struct from_files_options {
  // raise: the first bad record throws (format_error / io_error). skip: bad records are
  // counted, reported to on_skip, and reading goes on (a bad TFRecord data CRC skips that
  // record; anything that loses the framing skips the rest of that file, counted once).
  error_policy on_error = error_policy::raise;
  // Called for each skip; by default a line on stderr. Runs on the thread reading the
  // file (a worker of interleave when it has workers): make it thread-safe there.
  std::function<void(const skipped_record&)> on_skip = nullptr;
  std::size_t chunk_bytes = 1 << 20;               // size of each read buffer
  std::size_t read_ahead = 4;                      // chunks filled ahead by I/O threads (0: none)
  std::size_t read_threads = 2;                    // I/O threads filling them (at most read_ahead)
  // The largest record (a line, a TFRecord, a row, a fixed_length record + footer) read
  // from any file, plain or compressed: no more than about this much is ever buffered for
  // one record, whatever a damaged length field or a file without newlines says. Raise it
  // for larger records: 1 to 2^40 (a config_error otherwise).
  std::uint64_t max_record_bytes = std::uint64_t(64) << 20;
  compression compress = compression::automatic;   // by file name: .gz / .gzip / .zlib / .tgz
  // Which library inflates them: ISA-L when ferry was built with it, else zlib, unless
  // the environment's FERRY_INFLATE says zlib or isal (byte_stream.hpp). from_files
  // throws config_error for isal without ISA-L, and for another FERRY_INFLATE.
  inflate_engine inflater = inflate_engine::automatic;
  // A new order of the files every epoch (tf.data's list_files(shuffle=True)): a
  // permutation seeded from (shuffle_seed, epoch), where rewind() starts the next epoch.
  // After shard(n, i), this shard's files are permuted: a rank keeps its files. Records
  // keep their order within a file; mix them with interleave and shuffle.
  bool shuffle_files = false;
  std::uint64_t shuffle_seed = 0;  // with the epoch, fixes shuffle_files' orders
};

}  // namespace ferry
