// libFuzzer harness for the record parsers: the input is written to a memfd and read
// through from_files, plain and gzip-inflated, with both error policies. Any crash,
// sanitizer report, hang or huge allocation is a bug; ferry::error is the expected outcome.
// Build one per format with -DFERRY_FUZZ_FORMAT=<tfrecord|npy|idx|fixed|lines|webdataset>;
// webdataset's samples are also split by parse_webdataset and each member read. The same
// bytes are indexed by row_files and every row read by index (its own TFRecord header walk).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
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

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const int fd = ::memfd_create("ferry-fuzz", 0);
  if (fd < 0) return 0;
  if (size && ::write(fd, data, size) != static_cast<ssize_t>(size)) {
    ::close(fd);
    return 0;
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  for (auto comp : {ferry::compression::none, ferry::compression::gzip})
    for (auto pol : {ferry::error_policy::raise, ferry::error_policy::skip}) {
      try {
        auto src = ferry::from_files({path}, fuzz_format(),
                                     {.on_error = pol, .on_skip = [](const ferry::skipped_record&) {},
                                      .chunk_bytes = 64, .max_record_bytes = 1 << 20, .compress = comp});
        // A valid header may promise billions of zero-byte rows (an IDX or npy dimension of
        // 0): reading them all is correct but slow, and the fuzzer hunts crashes, not speed.
        // Each record's bytes are read (a checksum), so a record that lies about its size is
        // touched where ASan sees it.
        std::uint64_t sum = 0, records = 0;
        while (records++ < 100000)
          if (auto r = src.next()) {
            for (const std::byte b : r->bytes()) sum += std::to_integer<unsigned>(b);
            if (std::holds_alternative<ferry::webdataset>(fuzz_format()))
              for (const auto& m : ferry::parse_webdataset(*r).members)
                for (const std::byte b : m.data.bytes()) sum += std::to_integer<unsigned>(b) + m.ext.size();
          } else {
            break;
          }
        fuzz_sink = sum;
      } catch (const ferry::error&) {
      }
    }
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
