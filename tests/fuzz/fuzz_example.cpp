// libFuzzer harness for parse_example: the input is a tf.train.Example payload. Every
// feature is read through every accessor. Any crash, sanitizer report, hang or huge
// allocation is a bug; ferry::example_error is the expected outcome for bad input.
#include <cstdint>
#include <cstring>
#include <memory>

#include "ferry/sources/example.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // A record owning a copy (so ASan sees reads past the payload), at an odd address.
  auto buf = std::shared_ptr<std::byte[]>(new std::byte[size + 1]);
  if (size) std::memcpy(buf.get() + 1, data, size);
  ferry::record r(std::shared_ptr<const std::byte>(buf, buf.get() + 1), size);
  try {
    const ferry::example ex = ferry::parse_example(r);
    std::uint64_t sum = 0;
    for (const ferry::feature& f : ex.features()) {
      sum += f.name().size() + f.size();
      for (std::string_view v : ex.bytes(f)) sum += v.empty() ? 0 : static_cast<unsigned char>(v.back());
      for (float x : ex.floats(f)) sum += x > 0;
      for (std::int64_t v : ex.int64s(f)) sum += static_cast<std::uint64_t>(v);
      if (ex.find(f.name()) == nullptr) __builtin_trap();  // every feature can be found by name
    }
    volatile std::uint64_t sink = sum;
    (void)sink;
  } catch (const ferry::example_error& e) {
    if (e.payload_offset() > size) __builtin_trap();  // the offset is inside the payload
  }
  return 0;
}
