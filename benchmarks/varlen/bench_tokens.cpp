// bench_tokens: tokens/s of variable-length rows made ready for a model, ferry against
// PyTorch's DataLoader with a pad_sequence collate, on the same data with the same worker
// count, in the same run. The data: Debian's word lists (benchmarks/varlen/bench_bucket.cpp
// says which), a fixed random subset, written to a temporary file that PyTorch's side reads
// (the same words on both sides); a word's tokens are its bytes (0-255) as int64. Both
// sides shuffle, turn each word into int64 tokens on `workers` workers, and hand out
// batches of 128 padded to the batch's longest word, with the lengths; each side's figure
// is the median of 3 epochs, each from a new iterator (its workers started in the epoch's
// time, as a DataLoader without persistent workers starts them), and each side's token
// count is checked against the words':
//   ferry:   from_range | shuffle | map(word -> std::vector<int64>, {.workers}) | padded_batch(128)
//   PyTorch: DataLoader(Dataset -> torch.tensor(int64), shuffle, num_workers, pad_sequence)
//
// Output: a table, a JSON line, and last `tokens_vs_pytorch: <ferry tokens/s / PyTorch's>`.
// Usage: bench_tokens [words (default 400000)] [workers (default 2)] [dict dir] [python3].
// Exits 77 without word lists; PyTorch's figure is 0 (and the ratio n/a) without torch.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/timing.hpp"
#include "ferry/detail/random.hpp"
#include "ferry/ferry.hpp"

#ifndef FERRY_BENCH_DIR
#define FERRY_BENCH_DIR "."
#endif

int main(int argc, char** argv) {
  const std::size_t limit = argc > 1 ? std::stoul(argv[1]) : 400000;
  const std::size_t workers = argc > 2 ? std::stoul(argv[2]) : 2;
  const std::string dir = argc > 3 ? argv[3] : "/usr/share/dict";
  const std::string py = argc > 4 ? argv[4] : "/usr/bin/python3";
  const char* lists[] = {"american-english", "french", "ngerman", "spanish", "italian", "portuguese", "dutch"};
  std::vector<std::string> words;
  for (const char* l : lists) {
    std::ifstream in(dir + "/" + l);
    for (std::string w; std::getline(in, w);)
      if (!w.empty()) words.push_back(w);
  }
  if (words.empty()) {
    std::printf("bench_tokens: no word list in %s\n", dir.c_str());
    return 77;
  }
  ferry::detail::splitmix64 g(2026);
  for (std::size_t i = words.size(); i > 1; --i) std::swap(words[i - 1], words[g.below(i)]);
  words.resize(std::min(limit, words.size()));
  std::vector<std::span<const char>> views(words.begin(), words.end());
  std::size_t real_tokens = 0;
  for (const auto& w : words) real_tokens += w.size();
  // The chosen words, one a line, for PyTorch's side.
  const std::string chosen =
      (std::filesystem::temp_directory_path() / ("ferry_bench_tokens_" + std::to_string(::getpid()) + ".txt")).string();
  {
    std::ofstream out(chosen, std::ios::binary);
    for (const auto& w : words) out << w << '\n';
    if (!out) {
      std::fprintf(stderr, "bench_tokens: cannot write %s\n", chosen.c_str());
      return 1;
    }
  }

  constexpr std::size_t bs = 128;
  std::size_t seen = 0;
  const double ferry_s = bench::median_seconds(3, [&] {
    auto p = ferry::from_range(std::span<const std::span<const char>>(views)) | ferry::shuffle(100000, 7) |
             ferry::map(
                 [](std::span<const char> w) {
                   std::vector<std::int64_t> t(w.size());
                   for (std::size_t i = 0; i < w.size(); ++i) t[i] = static_cast<unsigned char>(w[i]);  // 0-255
                   return t;
                 },
                 {.workers = workers}) |
             ferry::padded_batch(bs);
    std::size_t t = 0;
    for (auto& b : p)
      for (auto l : b.field<0>().lengths) t += l;
    seen = t;
  });
  if (seen != real_tokens) {
    std::fprintf(stderr, "bench_tokens: ferry handed out %zu tokens, not %zu\n", seen, real_tokens);
    return 1;
  }
  double torch_tps = 0;
  const std::string cmd = py + " " + std::string(FERRY_BENCH_DIR) + "/torch_tokens.py " + std::to_string(workers) +
                          " " + std::to_string(bs) + " " + chosen + " 2>/dev/null";
  if (FILE* f = popen(cmd.c_str(), "r")) {
    double torch_s = 0;
    unsigned long long torch_tokens = 0;
    if (std::fscanf(f, "%llu %lf", &torch_tokens, &torch_s) == 2 && torch_s > 0) {
      if (torch_tokens != real_tokens) {
        std::fprintf(stderr, "bench_tokens: PyTorch handed out %llu tokens, not %zu\n", torch_tokens, real_tokens);
        pclose(f);
        std::filesystem::remove(chosen);
        return 1;
      }
      torch_tps = double(torch_tokens) / torch_s;
    }
    pclose(f);
  }
  std::filesystem::remove(chosen);
  const double ferry_tps = double(real_tokens) / ferry_s;
  std::printf("%-58s %14s\n", "case", "tokens/s");
  std::printf("%-58s %14.4g\n", "ferry: shuffle | map(int64, workers) | padded_batch(128)", ferry_tps);
  std::printf("%-58s %14.4g\n", "PyTorch DataLoader(num_workers) + pad_sequence", torch_tps);
  std::printf("{\"bench\":\"tokens\",\"words\":%zu,\"tokens\":%zu,\"workers\":%zu,\"ferry_tokens_per_s\":%.6g,"
              "\"torch_tokens_per_s\":%.6g}\n",
              words.size(), real_tokens, workers, ferry_tps, torch_tps);
  if (torch_tps > 0)
    std::printf("tokens_vs_pytorch: %.1f\n", ferry_tps / torch_tps);
  else
    std::printf("tokens_vs_pytorch: n/a (no PyTorch)\n");
  return 0;
}
