// 09_any_source: a pipeline chosen at run time, built by a function that returns it with
// its type erased (ferry::any_source, what tf.data's Dataset is in Python).
//
//   ./09_any_source train|eval
//
// make_input() gives a training pipeline (shuffled, augmented, repeated for two epochs) or
// an evaluation one (in order, one pass): different types, one return type. What follows
// it (batch, prefetch) is written once. Prints the batches, the elements, the checksum of
// the elements, and checks it against the same sum computed by hand:
//   train: 32 batches, 2000 elements, checksum ok
// Exits 1 if the checksum is wrong.
#include <cstdint>
#include <cstdio>
#include <string>

#include "ferry/ferry.hpp"

namespace {

constexpr std::uint64_t n = 1000;
std::uint64_t decode(std::uint64_t i) { return i * 3 + 1; }
std::uint64_t augment(std::uint64_t x) { return x ^ 1; }

ferry::any_source<std::uint64_t> make_input(bool train) {
  auto decoded = ferry::from_generator(n, [](std::uint64_t i) { return i; }) | ferry::map(decode);
  if (train)
    return std::move(decoded) | ferry::shuffle(256, /*seed=*/7) | ferry::map(augment) | ferry::repeat(2);
  return decoded;
}

}  // namespace

int main(int argc, char** argv) {
  const bool train = argc > 1 && std::string(argv[1]) == "train";
  auto batches = make_input(train) | ferry::batch(64) | ferry::prefetch(2);
  std::uint64_t sum = 0, elements = 0, count = 0;
  for (auto& b : batches) {
    for (auto v : b.field()) sum += v;
    elements += b.size();
    ++count;
  }
  std::uint64_t expect = 0;
  for (std::uint64_t i = 0; i < n; ++i) expect += train ? 2 * augment(decode(i)) : decode(i);
  std::printf("%s: %llu batches, %llu elements, checksum %s\n", train ? "train" : "eval",
              static_cast<unsigned long long>(count), static_cast<unsigned long long>(elements),
              sum == expect ? "ok" : "WRONG");
  return sum == expect ? 0 : 1;
}
