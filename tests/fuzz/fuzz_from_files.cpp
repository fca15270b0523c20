// libFuzzer harness for the record parsers: the input is written to a memfd and read
// through from_files, plain and gzip-inflated, with both error policies. Any crash,
// sanitizer report, hang or huge allocation is a bug; ferry::error is the expected outcome.
// Build one per format with -DFERRY_FUZZ_FORMAT=<tfrecord|npy|idx|fixed|lines|webdataset>;
// webdataset's samples are also split by parse_webdataset and each member read. The same
// bytes are indexed by row_files and every row read by index (its own TFRecord header walk).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "ferry/sources/from_files.hpp"
#include "ferry/sources/row_files.hpp"

#ifndef FERRY_FUZZ_FORMAT
#define FERRY_FUZZ_FORMAT tfrecord
#endif
#define FERRY_STR2(x) #x
#define FERRY_STR(x) FERRY_STR2(x)

static ferry::file_format fuzz_format() {
  const std::string f = FERRY_STR(FERRY_FUZZ_FORMAT);
  if (f == "npy") return ferry::npy{};
  if (f == "idx") return ferry::idx{};
  if (f == "fixed") return ferry::fixed_length{.record_bytes = 7, .header_bytes = 3, .footer_bytes = 2};
  if (f == "lines") return ferry::text_lines{};
  if (f == "webdataset") return ferry::webdataset{};
  return ferry::tfrecord{};
}

volatile std::uint64_t fuzz_sink;  // keeps the checksum

// Tar headers (the ustar magic at 257) get their checksum recomputed, so that a mutated
// size, type or name reaches the framer instead of failing its checksum (the unit tests
// cover checksum mismatches).
static std::string with_tar_checksums(const std::uint8_t* data, std::size_t size) {
  std::string b(reinterpret_cast<const char*>(data), size);
  for (std::size_t at = 0; at + 512 <= b.size(); at += 512) {
    if (b.compare(at + 257, 5, "ustar") != 0) continue;
    unsigned sum = 8 * ' ';
    for (std::size_t i = 0; i < 512; ++i)
      if (i < 148 || i >= 156) sum += static_cast<unsigned char>(b[at + i]);
    char field[8];
    std::snprintf(field, sizeof field, "%06o", sum & 0777777u);
    b.replace(at + 148, 8, std::string(field, 6) + '\0' + ' ');
  }
  return b;
}

static void read_file_all_ways(const std::string& path, std::uint64_t max_record) {
  for (auto comp : {ferry::compression::none, ferry::compression::gzip})
    for (auto pol : {ferry::error_policy::raise, ferry::error_policy::skip}) {
      try {
        auto src = ferry::from_files({path}, fuzz_format(),
                                     {.on_error = pol, .on_skip = [](const ferry::skipped_record&) {},
                                      .chunk_bytes = 64, .max_record_bytes = max_record, .compress = comp});
        // A valid header may promise billions of zero-byte rows (an IDX or npy dimension of
        // 0): reading them all is correct but slow, and the fuzzer hunts crashes, not speed.
        // Each record's bytes are read (a checksum), so a record that lies about its size is
        // touched where ASan sees it. Under raise, reading goes on after an error (a bad
        // record is passed, a framing error ends the file), as a caller that logs may.
        std::uint64_t sum = 0, records = 0;
        int errors = 0;
        while (records++ < 100000 && errors < 8) {
          try {
            auto r = src.next();
            if (!r) break;
            for (const std::byte b : r->bytes()) sum += std::to_integer<unsigned>(b);
            if (std::holds_alternative<ferry::webdataset>(fuzz_format()))
              for (const auto& m : ferry::parse_webdataset(*r).members)
                for (const std::byte b : m.data.bytes()) sum += std::to_integer<unsigned>(b) + m.ext.size();
          } catch (const ferry::error&) {
            ++errors;
          }
        }
        fuzz_sink = sum;
      } catch (const ferry::error&) {
      }
    }
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const bool tar = std::holds_alternative<ferry::webdataset>(fuzz_format());
  const std::string bytes = tar ? with_tar_checksums(data, size) : std::string(reinterpret_cast<const char*>(data), size);
  const int fd = ::memfd_create("ferry-fuzz", 0);
  if (fd < 0) return 0;
  if (size && ::write(fd, bytes.data(), size) != static_cast<ssize_t>(size)) {
    ::close(fd);
    return 0;
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  read_file_all_ways(path, 1 << 20);
  // A tar's samples over a small bound (inputs are a few kB): the oversized-sample, cut and
  // pass-over paths.
  if (tar) read_file_all_ways(path, 3072);
  try {
    const ferry::row_files rows({path}, fuzz_format(), {.max_record_bytes = 1 << 20});
    std::uint64_t sum = 0;
    for (std::uint64_t i = 0; i < rows.size() && i < 100000; ++i) try {
        const ferry::record r = rows[i];
        for (const std::byte b : r.bytes()) sum += std::to_integer<unsigned>(b);
      } catch (const ferry::error&) {  // a data CRC mismatch: that row only
      }
    fuzz_sink = sum;
  } catch (const ferry::error&) {
  }
  ::close(fd);
  return 0;
}
