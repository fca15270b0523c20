// What replaying a cache() costs, against what it is compared to in the same run:
//   - cache() in memory: a later pass, | batch(256), against a hand-written loop that
//     copies the same kept records into one reused batch buffer (what batch does for a
//     ragged field);
//   - cache(path): a later pass, read back from the file | batch(256), against `cat` of the
//     same file to /dev/null (the page-cache read limit);
//   - and the upstream pass it saves: records built by a generator that fills each one
//     with splitmix64 output (a stand-in for decoding).
// Best of 5 rounds, the contenders interleaved (odd rounds reversed). Prints a table, the
// ratios and a JSON line.
//
// Usage: bench_cache [MiB, default 256] [record bytes, default 1024]
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/cat.hpp"
#include "common/timing.hpp"
#include "ferry/detail/random.hpp"
#include "ferry/sources/from_generator.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/cache.hpp"

namespace {
using bench::now;

// Record i: `bytes` bytes of splitmix64 output seeded by i.
ferry::record make_record(std::uint64_t i, std::size_t bytes) {
  auto b = std::shared_ptr<std::byte[]>(new std::byte[bytes]);
  ferry::detail::splitmix64 g(i);
  for (std::size_t k = 0; k < bytes; k += 8) {
    const std::uint64_t w = g();
    std::memcpy(b.get() + k, &w, bytes - k < 8 ? bytes - k : 8);
  }
  return ferry::record(std::shared_ptr<const std::byte>(b, b.get()), bytes);
}

auto upstream(std::uint64_t n, std::size_t bytes) {
  return ferry::from_generator(n, [bytes](std::uint64_t i) { return make_record(i, bytes); });
}

// Records handed out by one pass of `p` (a pipeline of batches).
template <class P>
std::uint64_t drain(P& p) {
  std::uint64_t n = 0;
  while (auto b = p.next()) n += b->size();
  return n;
}
}  // namespace

int main(int argc, char** argv) {
  const std::size_t mib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 256;
  const std::size_t rec = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 1024;
  const std::size_t batch = 256;
  const std::uint64_t n = mib * (std::uint64_t(1) << 20) / rec;
  char tmpl[] = "/tmp/ferry-bench-cache-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  const std::string path = dir + "/records.cache";

  // The fill passes (timed once: they are what a first epoch costs).
  auto mem = upstream(n, rec) | ferry::cache() | ferry::batch(batch);
  double t0 = now();
  const bool ok_mem_fill = drain(mem) == n;
  const double mem_fill = now() - t0;
  auto file = upstream(n, rec) | ferry::cache(path) | ferry::batch(batch);
  t0 = now();
  const bool ok_file_fill = drain(file) == n;
  const double file_fill = now() - t0;
  const double file_bytes = double(std::filesystem::file_size(path));

  // The baseline loop's input: the same records, kept in a vector.
  std::vector<ferry::record> kept;
  kept.reserve(n);
  for (std::uint64_t i = 0; i < n; ++i) kept.push_back(make_record(i, rec));
  std::vector<std::byte> buf(batch * rec);
  std::vector<std::uint64_t> offsets(batch + 1);
  auto hand_loop = [&] {
    std::uint64_t done = 0, check = 0;
    for (std::uint64_t i = 0; i < n; i += batch) {
      const std::uint64_t m = n - i < batch ? n - i : batch;
      std::uint64_t at = 0;
      for (std::uint64_t j = 0; j < m; ++j) {
        const ferry::record& r = kept[i + j];
        if (at + r.size() > buf.size()) buf.resize(2 * (at + r.size()));
        std::memcpy(buf.data() + at, r.data(), r.size());
        offsets[j] = at;
        at += r.size();
      }
      offsets[m] = at;
      check += static_cast<std::uint64_t>(buf[at - 1]);
      done += m;
    }
    return done + (check == ~std::uint64_t(0));  // keeps the copies
  };

  double t_up = 1e100, t_mem = 1e100, t_loop = 1e100, t_file = 1e100, t_cat = 1e100;
  bool ok = ok_mem_fill && ok_file_fill;
  auto timed = [&](double& best, auto&& f) {
    const double a = now();
    const std::uint64_t got = f();
    best = std::min(best, now() - a);
    ok = ok && got == n;
  };
  bench::cat_once({path});  // warm the page cache
  const std::vector<std::function<void()>> contenders = {
      [&] { timed(t_up, [&] { auto p = upstream(n, rec) | ferry::batch(batch); return drain(p); }); },
      [&] { timed(t_mem, [&] { mem.rewind(); return drain(mem); }); },
      [&] { timed(t_loop, hand_loop); },
      [&] { timed(t_file, [&] { file.rewind(); return drain(file); }); },
      [&] { timed(t_cat, [&] { bench::cat_once({path}); return n; }); },
  };
  for (int round = 0; round < 5; ++round)
    for (std::size_t i = 0; i < contenders.size(); ++i) contenders[round % 2 ? contenders.size() - 1 - i : i]();
  std::filesystem::remove_all(dir);

  const double bytes = double(n) * double(rec);
  std::printf("# cache: %llu records of %zu bytes (%.0f MiB; the file %.0f MiB), batch %zu\n",
              static_cast<unsigned long long>(n), rec, bytes / (1 << 20), file_bytes / (1 << 20), batch);
  std::printf("%-40s %10s %10s %14s\n", "what", "time s", "GB/s", "records/s");
  auto row = [&](const char* w, double t) {
    std::printf("%-40s %10.4f %10.3f %14.0f\n", w, t, bytes / t / 1e9, double(n) / t);
  };
  row("upstream pass (generate) | batch", t_up);
  row("cache() first pass (fill) | batch", mem_fill);
  row("cache() later pass | batch", t_mem);
  row("hand loop over kept records", t_loop);
  row("cache(path) first pass (fill) | batch", file_fill);
  row("cache(path) later pass | batch", t_file);
  std::printf("%-40s %10.4f %10.3f %14s\n", "cat of the cache file", t_cat, file_bytes / t_cat / 1e9, "-");
  std::printf("ratio cache() replay/hand loop: %.2f\n", t_loop / t_mem);
  std::printf("ratio cache(path) replay/cat: %.2f\n", t_cat / t_file);
  std::printf("ratio cache(path) replay/upstream pass: %.2f\n", t_up / t_file);
  std::printf("{\"bench\":\"cache\",\"record_bytes\":%zu,\"records\":%llu,\"upstream_s\":%.5f,"
              "\"memory_fill_s\":%.5f,\"memory_replay_s\":%.5f,\"loop_s\":%.5f,\"file_fill_s\":%.5f,"
              "\"file_replay_s\":%.5f,\"cat_s\":%.5f,\"ratio_memory_loop\":%.3f,\"ratio_file_cat\":%.3f,"
              "\"ratio_file_upstream\":%.3f,\"ok\":%s}\n",
              rec, static_cast<unsigned long long>(n), t_up, mem_fill, t_mem, t_loop, file_fill, t_file, t_cat,
              t_loop / t_mem, t_cat / t_file, t_up / t_file, ok ? "true" : "false");
  if (!ok) std::fprintf(stderr, "bench_cache: a pass handed out the wrong number of records\n");
  return ok ? 0 : 1;
}
