// bench_bucket: how much of a batch is padding, with and without bucket_by_sequence_length,
// on real lengths: every word of Debian's word lists (wamerican, wfrench, wngerman,
// wspanish, witalian, wportuguese, wdutch; scripts/setup.sh installs them), shuffled with
// a fixed seed, each word's bytes a row labelled with its language (the text example's
// data). padded_batch(128) pads each batch to its longest word; bucket_by_sequence_length
// groups words of like length first (buckets of width 2 to 4 bytes up to 24, batch size
// 128 each). Also rows/s of both, from one run.
//
// Output: a table, a JSON line, then `nobucket_padding_fraction:`,
// `bucket_padding_fraction:` and last `bucket_padding_reduction: <nobucket / bucket>`.
// Usage: bench_bucket [dictionary directory (default /usr/share/dict)]. Exits 77 when no
// word list is there.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/timing.hpp"
#include "ferry/detail/random.hpp"
#include "ferry/ferry.hpp"

namespace {
using row = std::pair<std::span<const std::uint8_t>, std::int32_t>;

struct figures {
  double padding = 0, seconds = 0;
  std::size_t batches = 0;
};
template <class Make>
figures measure(Make make) {
  figures f;
  f.seconds = bench::median_seconds(3, [&] {
    double real = 0, all = 0;
    std::size_t batches = 0;
    auto p = make();
    while (auto b = p.next()) {
      auto t = b->template field<0>();
      for (auto l : t.lengths) real += l;
      all += double(t.values.size());
      ++batches;
    }
    f.padding = 1 - real / all;
    f.batches = batches;
  });
  return f;
}
}  // namespace

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : "/usr/share/dict";
  const char* lists[] = {"american-english", "french", "ngerman", "spanish", "italian", "portuguese", "dutch"};
  std::vector<std::uint8_t> bytes;
  std::vector<std::pair<std::size_t, std::size_t>> spans;  // offset, length
  std::vector<std::int32_t> labels;
  int found = 0;
  for (int l = 0; l < 7; ++l) {
    std::ifstream in(dir + "/" + lists[l]);
    if (!in) continue;
    ++found;
    for (std::string w; std::getline(in, w);) {
      if (w.empty()) continue;
      spans.push_back({bytes.size(), w.size()});
      bytes.insert(bytes.end(), w.begin(), w.end());
      labels.push_back(l);
    }
  }
  if (found == 0) {
    std::printf("bench_bucket: no word list in %s (install wamerican etc.: scripts/setup.sh)\n", dir.c_str());
    return 77;
  }
  std::vector<row> rows(spans.size());
  for (std::size_t i = 0; i < rows.size(); ++i)
    rows[i] = {std::span<const std::uint8_t>(bytes.data() + spans[i].first, spans[i].second), labels[i]};
  ferry::detail::splitmix64 g(2026);
  for (std::size_t i = rows.size(); i > 1; --i) std::swap(rows[i - 1], rows[g.below(i)]);

  constexpr std::size_t bs = 128;
  const std::vector<std::size_t> bounds = {4, 6, 8, 10, 12, 14, 16, 20, 24};
  const std::vector<std::size_t> sizes(bounds.size() + 1, bs);
  auto len = [](const row& r) { return r.first.size(); };
  const figures plain = measure([&] { return ferry::from_range(std::span<const row>(rows)) | ferry::padded_batch(bs); });
  const figures bucket = measure([&] {
    return ferry::from_range(std::span<const row>(rows)) | ferry::bucket_by_sequence_length(len, bounds, sizes);
  });
  std::printf("%-44s %10s %10s %14s\n", "case", "batches", "padding", "rows/s");
  std::printf("%-44s %10zu %10.4f %14.4g\n", "padded_batch(128)", plain.batches, plain.padding,
              double(rows.size()) / plain.seconds);
  std::printf("%-44s %10zu %10.4f %14.4g\n", "bucket_by_sequence_length(10 buckets, 128)", bucket.batches,
              bucket.padding, double(rows.size()) / bucket.seconds);
  std::printf("{\"bench\":\"bucket\",\"words\":%zu,\"lists\":%d,\"nobucket_padding\":%.5f,\"bucket_padding\":%.5f,"
              "\"nobucket_rows_per_s\":%.6g,\"bucket_rows_per_s\":%.6g}\n",
              rows.size(), found, plain.padding, bucket.padding, double(rows.size()) / plain.seconds,
              double(rows.size()) / bucket.seconds);
  std::printf("nobucket_padding_fraction: %.4f\n", plain.padding);
  std::printf("bucket_padding_fraction: %.4f\n", bucket.padding);
  std::printf("bucket_padding_reduction: %.2f\n", plain.padding / bucket.padding);
  return 0;
}
