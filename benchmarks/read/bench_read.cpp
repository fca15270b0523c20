// Read throughput of from_files | batch against `cat` of the same files to /dev/null (the
// page-cache read limit) and PyTorch's DataLoader (num_workers=2, same batch size) on the
// same records, all in one run; TFRecord also with read_ahead = 0 (every read(2) on the
// consuming thread), to show what the I/O thread buys, and through interleave(4) with two
// reader threads (tf.data's parallel interleave), to show what mixing files costs; and in
// one global order (global_shuffle over row_files' index of the TFRecord files: one pread a
// record, in a shuffled order), with the index's build time. Prints a table, the ratios,
// and a JSON line.
//
// Usage: bench_read [MiB per format, default 256] [record bytes, default 1024] [python3]
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <ranges>
#include <string>
#include <vector>

#include "common/cat.hpp"
#include "common/timing.hpp"
#include "ferry/sources/detail/crc32c.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/sources/global_shuffle.hpp"
#include "ferry/sources/row_files.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/interleave.hpp"
#include "ferry/stages/map.hpp"

namespace {
using bench::cat_once;
using bench::now;

std::string le(std::uint64_t v, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += static_cast<char>(v >> (8 * i));
  return s;
}

std::uint64_t ferry_read(const std::vector<std::string>& files, ferry::file_format fmt, std::size_t batch,
                         ferry::from_files_options o = {}) {
  std::uint64_t n = 0;
  auto p = ferry::from_files(files, fmt, o) | ferry::batch(batch);
  while (auto b = p.next()) n += b->size();
  return n;
}
std::uint64_t ferry_interleave(const std::vector<std::string>& files, std::size_t batch) {
  std::uint64_t n = 0;
  auto p = ferry::from_files(files, ferry::tfrecord{}) | ferry::interleave(files.size(), {.workers = 2}) |
           ferry::batch(batch);
  while (auto b = p.next()) n += b->size();
  return n;
}
// One epoch of one global order over the TFRecord files (the index built once, before).
std::uint64_t ferry_global(const ferry::row_files& rows, std::size_t batch) {
  std::uint64_t n = 0;
  auto p = ferry::global_shuffle(rows, {.seed = 1, .global_batch = batch}) | ferry::batch(batch);
  while (auto b = p.next()) n += b->size();
  return n;
}
// The same order with the reads in map's workers: global_shuffle draws indices only.
std::uint64_t ferry_global_workers(const ferry::row_files& rows, std::size_t batch) {
  std::uint64_t n = 0;
  auto p = ferry::global_shuffle(std::views::iota(std::uint64_t{0}, rows.size()), {.seed = 1, .global_batch = batch}) |
           ferry::map([&rows](std::uint64_t i) { return rows[i]; }, {.workers = 2}) | ferry::batch(batch);
  while (auto b = p.next()) n += b->size();
  return n;
}
// The baseline of both: a hand-written loop of one pread per record at the offsets the
// writer knows, in a shuffled order, each record's data CRC checked, one buffer reused.
std::uint64_t pread_loop(const std::vector<std::string>& files, std::size_t per_file, std::size_t rec,
                         const std::vector<std::uint32_t>& order) {
  std::vector<int> fds;
  for (const auto& f : files) fds.push_back(::open(f.c_str(), O_RDONLY));
  std::vector<char> buf(rec + 16);
  std::uint64_t n = 0;
  namespace c = ferry::detail::crc32c;
  for (std::uint32_t i : order) {
    const off_t at = off_t(i % per_file) * off_t(rec + 16);
    if (::pread(fds[i / per_file], buf.data(), buf.size(), at) != ssize_t(buf.size())) break;
    std::uint32_t crc;
    std::memcpy(&crc, buf.data() + 12 + rec, 4);
    n += c::mask(c::value(buf.data() + 12, rec)) == crc;
  }
  for (int fd : fds) ::close(fd);
  return n;
}
}  // namespace

int main(int argc, char** argv) {
  const std::size_t mib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 256;
  const std::size_t rec = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 1024;
  const std::string py = argc > 3 ? argv[3] : "/usr/bin/python3";
  const std::size_t batch = 256, nfiles = 4;
  const std::size_t per_file = mib * (1u << 20) / nfiles / rec;
  char tmpl[] = "/tmp/ferry-bench-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  std::vector<std::string> fixed, tf;
  std::mt19937_64 g(1);
  std::string r(rec, '\0');
  for (std::size_t f = 0; f < nfiles; ++f) {
    fixed.push_back(dir + "/f" + std::to_string(f) + ".bin");
    tf.push_back(dir + "/f" + std::to_string(f) + ".tfrecord");
    std::ofstream a(fixed.back(), std::ios::binary), b(tf.back(), std::ios::binary);
    namespace c = ferry::detail::crc32c;
    const std::string len = le(rec, 8), lcrc = le(c::mask(c::value(len.data(), 8)), 4);
    for (std::size_t i = 0; i < per_file; ++i) {
      for (auto& ch : r) ch = static_cast<char>(g());
      a.write(r.data(), static_cast<std::streamsize>(r.size()));
      b << len << lcrc << r << le(c::mask(c::value(r.data(), r.size())), 4);
    }
  }
  const double records = double(per_file * nfiles);
  cat_once(fixed), cat_once(tf);  // warm the page cache
  // Best of 8 rounds, each running every contender once; odd rounds in reverse order, so
  // each contender runs after different ones (a run right after `cat` is slower on this
  // VM, whatever runs) and a slow spell of the machine hits them alike.
  double cat_fixed = 1e100, cat_tf = 1e100, t_fixed = 1e100, t_tf = 1e100, t_tf_sync = 1e100, t_il = 1e100;
  double t_index = 1e100, t_global = 1e100, t_global_w = 1e100, t_pread = 1e100;
  bool ok_fixed = true, ok_tf = true, ok_tf_sync = true, ok_il = true, ok_index = true, ok_global = true,
       ok_global_w = true, ok_pread = true;
  const std::uint64_t want = per_file * nfiles;
  std::vector<std::uint32_t> order(want);
  for (std::uint32_t i = 0; i < want; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), g);
  const ferry::row_files indexed(tf, ferry::tfrecord{});
  auto timed = [&](double& best, bool* ok, auto&& f) {
    const double t0 = now();
    const std::uint64_t got = f();
    best = std::min(best, now() - t0);
    if (ok) *ok = *ok && got == want;
  };
  const std::vector<std::function<void()>> contenders = {
      [&] { timed(cat_fixed, nullptr, [&] { cat_once(fixed); return want; }); },
      [&] { timed(t_fixed, &ok_fixed, [&] { return ferry_read(fixed, ferry::fixed_length{.record_bytes = rec}, batch); }); },
      [&] { timed(cat_tf, nullptr, [&] { cat_once(tf); return want; }); },
      [&] { timed(t_tf, &ok_tf, [&] { return ferry_read(tf, ferry::tfrecord{}, batch); }); },
      // The same without the I/O thread (read_ahead = 0): every read(2) on the consuming thread.
      [&] { timed(t_tf_sync, &ok_tf_sync, [&] { return ferry_read(tf, ferry::tfrecord{}, batch, {.read_ahead = 0}); }); },
      [&] { timed(t_il, &ok_il, [&] { return ferry_interleave(tf, batch); }); },
      // The index alone (headers only, once a job), then an epoch of the global order.
      [&] { timed(t_index, &ok_index, [&] { return ferry::row_files(tf, ferry::tfrecord{}).size(); }); },
      [&] { timed(t_global, &ok_global, [&] { return ferry_global(indexed, batch) + want % batch; }); },
      [&] { timed(t_pread, &ok_pread, [&] { return pread_loop(tf, per_file, rec, order); }); },
      [&] { timed(t_global_w, &ok_global_w, [&] { return ferry_global_workers(indexed, batch) + want % batch; }); },
  };
  for (int round = 0; round < 8; ++round)
    for (std::size_t i = 0; i < contenders.size(); ++i)
      contenders[round % 2 ? contenders.size() - 1 - i : i]();

  // PyTorch's DataLoader on the same fixed-length records (a bounded sample: it is slow).
  double torch_rps = 0;
  {
    std::string cmd = py + " " + std::string(FERRY_BENCH_DIR) + "/torch_baseline.py " + std::to_string(rec) + " " +
                      std::to_string(batch) + " " + std::to_string(std::min<std::size_t>(per_file * nfiles, 200000));
    for (auto& f : fixed) cmd += " " + f;
    if (FILE* p = ::popen(cmd.c_str(), "r")) {
      if (std::fscanf(p, "%lf", &torch_rps) != 1) torch_rps = 0;
      ::pclose(p);
    }
  }
  const double bytes_fixed = records * rec, bytes_tf = records * (rec + 16);
  std::printf("# read: %zu files, %.0f records of %zu bytes, batch %zu\n", nfiles, records, rec, batch);
  std::printf("%-34s %12s %12s %14s %7s\n", "what", "time s", "GB/s", "records/s", "#wrong");
  auto row = [](const char* w, double t, double b, double n, bool ok) {
    std::printf("%-34s %12.4f %12.3f %14.0f %7d\n", w, t, b / t / 1e9, n / t, ok ? 0 : 1);
  };
  row("cat fixed > /dev/null", cat_fixed, bytes_fixed, records, true);
  row("ferry fixed_length | batch", t_fixed, bytes_fixed, records, ok_fixed);
  row("cat tfrecord > /dev/null", cat_tf, bytes_tf, records, true);
  row("ferry tfrecord (CRC) | batch", t_tf, bytes_tf, records, ok_tf);
  row("  same, read_ahead = 0", t_tf_sync, bytes_tf, records, ok_tf_sync);
  row("  interleave(4, 2 workers) | batch", t_il, bytes_tf, records, ok_il);
  row("  row_files index (headers only)", t_index, bytes_tf, records, ok_index);
  row("  hand-written shuffled pread loop", t_pread, bytes_tf, records, ok_pread);
  row("  global_shuffle(row_files) | batch", t_global, bytes_tf, records, ok_global);
  row("  same, reads in map(2 workers)", t_global_w, bytes_tf, records, ok_global_w);
  std::printf("%-34s %12s %12s %14.0f %7s\n", "pytorch DataLoader(num_workers=2)", "-", "-", torch_rps, torch_rps > 0 ? "0" : "n/a");
  const double r_fixed = cat_fixed / t_fixed, r_tf = cat_tf / t_tf, r_torch = torch_rps > 0 ? (records / t_fixed) / torch_rps : 0;
  std::printf("ratio fixed/cat: %.2f (target >= 0.8)\nratio tfrecord/cat: %.2f (target >= 0.7)\n", r_fixed, r_tf);
  std::printf("ratio tfrecord/cat, read_ahead = 0: %.2f\n", cat_tf / t_tf_sync);
  std::printf("ratio tfrecord interleave/cat: %.2f (interleave/from_files: %.2f)\n", cat_tf / t_il, t_tf / t_il);
  std::printf("ratio ferry/pytorch records/s: %.1f (target >= 20)\n", r_torch);
  std::printf("ratio tfrecord global order/hand-written pread loop: %.2f (reads in map(2 workers): %.2f; "
              "global order/from_files: %.2f; cat/index build: %.2f)\n",
              t_pread / t_global, t_pread / t_global_w, t_tf / t_global, cat_tf / t_index);
  std::printf("{\"bench\":\"read\",\"record_bytes\":%zu,\"records\":%.0f,\"cat_fixed_s\":%.5f,\"ferry_fixed_s\":%.5f,"
              "\"cat_tfrecord_s\":%.5f,\"ferry_tfrecord_s\":%.5f,\"torch_records_per_s\":%.0f,"
              "\"ratio_fixed_cat\":%.3f,\"ratio_tfrecord_cat\":%.3f,\"ratio_torch\":%.2f,"
              "\"ferry_tfrecord_sync_s\":%.5f,\"ratio_tfrecord_sync_cat\":%.3f,"
              "\"ferry_interleave_s\":%.5f,\"ratio_interleave_cat\":%.3f,"
              "\"ferry_index_s\":%.5f,\"ferry_global_s\":%.5f,\"ratio_global_cat\":%.3f,\"ferry_global_workers_s\":%.5f,\"pread_loop_s\":%.5f}\n",
              rec, records, cat_fixed, t_fixed, cat_tf, t_tf, torch_rps, r_fixed, r_tf, r_torch, t_tf_sync,
              cat_tf / t_tf_sync, t_il, cat_tf / t_il, t_index, t_global, cat_tf / t_global, t_global_w, t_pread);
  std::string rm = "rm -rf '" + dir + "'";
  std::system(rm.c_str());
  return ok_fixed && ok_tf && ok_tf_sync && ok_il && ok_index && ok_global && ok_global_w && ok_pread ? 0 : 1;
}
