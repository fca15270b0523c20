// bench_padded_batch: padded_batch(256) over variable-length token rows, against a
// hand-written loop that pads the same rows into a reused buffer, in the same run.
//
// The rows are views into one token array (as records from files, or a tokenized corpus
// in memory, come), of lengths 1 to 256 drawn so that most are short (the shape of
// sentence lengths): the loop and ferry read the same bytes. Both find each batch's
// longest row, then write every row's tokens, its padding and its length; ferry also
// carries each row's label.
//
// ferry is consumed with next(), each batch dropped before the next is made as the loop
// reuses its buffer, and again with a range-for (which keeps two batches alive).
//
// Output: a table, a JSON line, `padded_batch_range_for_ratio:`, and last
// `padded_batch_ratio: <ferry rows/s / loop rows/s>`.
// Usage: bench_padded_batch [rows (default 2097152)] [repetitions (default 7)]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <tuple>
#include <vector>

#include "common/timing.hpp"
#include "ferry/detail/random.hpp"
#include "ferry/ferry.hpp"

namespace {

using i32 = std::int32_t;
using row = std::tuple<std::span<const i32>, i32>;

volatile std::uint64_t sink;

}  // namespace

int main(int argc, char** argv) {
  const std::size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : (std::size_t(1) << 21);
  const int reps = argc > 2 ? std::atoi(argv[2]) : 7;
  constexpr std::size_t bs = 256;

  // Lengths: the smallest of three uniform draws in 1..256 (mean about 64).
  ferry::detail::splitmix64 g(42);
  std::vector<std::size_t> len(n), start(n);
  std::size_t total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    len[i] = 1 + std::min({g.below(256), g.below(256), g.below(256)});
    start[i] = total;
    total += len[i];
  }
  std::vector<i32> tokens(total);
  for (std::size_t i = 0; i < total; ++i) tokens[i] = i32(i % 30000);
  std::vector<row> rows(n);
  for (std::size_t i = 0; i < n; ++i) rows[i] = {std::span<const i32>(tokens.data() + start[i], len[i]), i32(i % 10)};

  // The loop: per batch, the longest row, then rows, padding and lengths into reused buffers.
  std::uint64_t ref = 0, got = 0;
  const double loop_s = bench::median_seconds(reps, [&] {
    std::vector<i32> values, labels(bs);
    std::vector<std::uint32_t> lengths(bs);
    std::uint64_t s = 0;
    for (std::size_t b = 0; b < n; b += bs) {
      const std::size_t m = std::min(bs, n - b);
      std::size_t width = 0;
      for (std::size_t i = 0; i < m; ++i) width = std::max(width, std::get<0>(rows[b + i]).size());
      values.resize(m * width);
      for (std::size_t i = 0; i < m; ++i) {
        auto t = std::get<0>(rows[b + i]);
        std::memcpy(values.data() + i * width, t.data(), t.size() * sizeof(i32));
        std::fill(values.data() + i * width + t.size(), values.data() + (i + 1) * width, 0);
        lengths[i] = std::uint32_t(t.size());
        labels[i] = std::get<1>(rows[b + i]);
      }
      s += values[(m - 1) * width] + lengths[m / 2] + width + labels[0];
    }
    ref = s;
  });
  const double ferry_s = bench::median_seconds(reps, [&] {
    auto p = ferry::from_range(std::span<const row>(rows)) | ferry::padded_batch(bs);
    std::uint64_t s = 0;
    while (auto b = p.next()) {  // each batch gone before the next is made, as in the loop
      ferry::padded_view<i32> t = b->field<0>();
      const std::size_t m = b->size();
      s += t.values[(m - 1) * t.width] + t.lengths[m / 2] + t.width + b->field<1>()[0];
    }
    got = s;
  });
  // The same through a range-for, which holds batch k while batch k+1 is made (two batches'
  // buffers in use, not one).
  std::uint64_t got_for = 0;
  const double ferry_for_s = bench::median_seconds(reps, [&] {
    auto p = ferry::from_range(std::span<const row>(rows)) | ferry::padded_batch(bs);
    std::uint64_t s = 0;
    for (auto& b : p) {
      ferry::padded_view<i32> t = b.field<0>();
      const std::size_t m = b.size();
      s += t.values[(m - 1) * t.width] + t.lengths[m / 2] + t.width + b.field<1>()[0];
    }
    got_for = s;
  });
  sink = got + got_for;
  if (got != ref || got_for != ref) {
    std::fprintf(stderr, "bench_padded_batch: checksums differ (%llu vs %llu)\n", (unsigned long long)got,
                 (unsigned long long)ref);
    return 1;
  }
  std::size_t padded = 0;
  for (std::size_t b = 0; b < n; b += bs) {
    const std::size_t m = std::min(bs, n - b);
    padded += m * *std::max_element(len.begin() + std::ptrdiff_t(b), len.begin() + std::ptrdiff_t(b + m));
  }
  const double loop_rate = double(n) / loop_s, ferry_rate = double(n) / ferry_s, for_rate = double(n) / ferry_for_s;
  std::printf("%-44s %12s %14s\n", "case", "rows", "rows/s");
  std::printf("%-44s %12zu %14.4g\n", "hand-written padding loop", n, loop_rate);
  std::printf("%-44s %12zu %14.4g\n", "from_range | padded_batch(256), next()", n, ferry_rate);
  std::printf("%-44s %12zu %14.4g\n", "the same, range-for", n, for_rate);
  std::printf("{\"bench\":\"padded_batch\",\"rows\":%zu,\"tokens\":%zu,\"padding_fraction\":%.4f,"
              "\"loop_rows_per_s\":%.6g,\"ferry_rows_per_s\":%.6g,\"ferry_range_for_rows_per_s\":%.6g}\n",
              n, total, 1.0 - double(total) / double(padded), loop_rate, ferry_rate, for_rate);
  std::printf("padded_batch_range_for_ratio: %.3f\n", for_rate / loop_rate);
  std::printf("padded_batch_ratio: %.3f\n", ferry_rate / loop_rate);
  return 0;
}
