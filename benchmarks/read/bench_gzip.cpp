// Reading gzip files: from_files over Fashion-MNIST's gzip IDX files (what the main
// example reads every first epoch), inflated by ISA-L (the default when ferry is built
// with it) and by zlib, against `gzip -dc` of the same files to /dev/null (Debian's gzip:
// zlib's algorithm, no parsing; a process, timed whole: its start is about 1 ms) and
// Python's gzip module (zlib; timed inside the interpreter, from after `import gzip` to the
// last read, as ferry is timed inside its process: the interpreter's start, 20-30 ms, is
// not Python's inflate), in one run. Best of 7
// rounds, each running every contender once, odd rounds in reverse order. Prints a table,
// the ratios (ferry's speed / the baseline's) and a JSON line. Exits 77 without the files.
//
// usage: bench_gzip [DIR (default $FERRY_FASHION_MNIST or /usr/share/datasets/fashion-mnist)] [python3]
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "common/cat.hpp"
#include "common/timing.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/stages/batch.hpp"

namespace {

// A shell word: the path in single quotes.
std::string quoted(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'') q.append("'\\''");  // close, an escaped quote, reopen
    else q.push_back(c);
  }
  q.push_back('\'');
  return q;
}

// Python's gzip module reading `files` whole, timed by the interpreter around the reads
// only: the seconds it prints, or -1 when it cannot run.
double python_gzip_seconds(const std::string& py, const std::vector<std::string>& files) {
  std::string cmd = quoted(py) +
                    " -c 'import gzip, sys, time\n"
                    "t0 = time.perf_counter()\n"
                    "for f in sys.argv[1:]:\n"
                    "    with gzip.open(f, \"rb\") as g:\n"
                    "        while g.read(1 << 20): pass\n"
                    "print(time.perf_counter() - t0)'";
  for (const auto& f : files) {
    cmd.push_back(' ');
    cmd.append(quoted(f));
  }
  cmd += " 2>/dev/null";
  std::unique_ptr<FILE, int (*)(FILE*)> p(::popen(cmd.c_str(), "r"), ::pclose);
  if (!p) return -1;
  double t = -1;
  if (std::fscanf(p.get(), "%lf", &t) != 1) return -1;
  return ::pclose(p.release()) == 0 ? t : -1;
}

// Images and labels, as the example reads them (one from_files per file), batched.
std::uint64_t ferry_read(const std::vector<std::string>& files, ferry::inflate_engine e, std::uint64_t& bytes) {
  std::uint64_t n = 0;
  bytes = 0;
  for (const auto& f : files) {
    auto p = ferry::from_files({f}, ferry::idx{}, {.inflater = e}) | ferry::batch(256);
    while (auto b = p.next()) {
      n += b->size();
      for (std::size_t i = 0; i < b->size(); ++i) bytes += (*b)[i].size();
    }
  }
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  const char* env = std::getenv("FERRY_FASHION_MNIST");
  const std::string dir = argc > 1 ? argv[1] : env ? env : "/usr/share/datasets/fashion-mnist";
  const std::string py = argc > 2 ? argv[2] : "/usr/bin/python3";
  const std::vector<std::string> files = {dir + "/train-images-idx3-ubyte.gz", dir + "/train-labels-idx1-ubyte.gz"};
  for (const auto& f : files)
    if (!std::filesystem::exists(f)) {
      std::printf("skipped: no %s (give the Fashion-MNIST directory)\n", f.c_str());
      return 77;
    }
  std::uint64_t compressed = 0;
  for (const auto& f : files) compressed += std::filesystem::file_size(f);
  const bool isal = ferry::detail::have_isal;

  bench::cat_once(files);  // warm the page cache
  double t_isal = 1e100, t_zlib = 1e100, t_gzip = 1e100, t_py = 1e100;
  std::uint64_t recs_isal = 0, recs_zlib = 0, bytes_isal = 0, bytes_zlib = 0;
  bool gzip_ok = true, py_ok = true;
  auto best = [](double& b, double t) { b = std::min(b, t); };
  std::vector<std::string> gzip_cmd = {"gzip", "-dc"};
  gzip_cmd.insert(gzip_cmd.end(), files.begin(), files.end());
  const std::vector<std::function<void()>> contenders = {
      [&] {
        if (!isal) return;
        const double t0 = bench::now();
        recs_isal = ferry_read(files, ferry::inflate_engine::isal, bytes_isal);
        best(t_isal, bench::now() - t0);
      },
      [&] {
        const double t0 = bench::now();
        recs_zlib = ferry_read(files, ferry::inflate_engine::zlib, bytes_zlib);
        best(t_zlib, bench::now() - t0);
      },
      [&] {
        const double t = bench::run_to_null(gzip_cmd);
        if (t < 0) gzip_ok = false;
        else best(t_gzip, t);
      },
      [&] {
        const double t = python_gzip_seconds(py, files);
        if (t < 0) py_ok = false;
        else best(t_py, t);
      },
  };
  for (int round = 0; round < 7; ++round)
    for (std::size_t i = 0; i < contenders.size(); ++i) contenders[round % 2 ? contenders.size() - 1 - i : i]();

  const std::uint64_t want_recs = 2 * 60000, want_bytes = 60000ull * 784 + 60000;
  const bool ok = recs_zlib == want_recs && bytes_zlib == want_bytes &&
                  (!isal || (recs_isal == want_recs && bytes_isal == want_bytes));
  const double mb = double(want_bytes) / 1e6;
  std::printf("# gzip: Fashion-MNIST train images + labels, %.1f MB compressed, %.1f MB inflated; best of 7 rounds\n",
              double(compressed) / 1e6, mb);
  std::printf("%-40s %10s %12s %7s\n", "what", "time s", "MB/s out", "#wrong");
  auto row = [&](const char* w, double t, bool good) {
    if (t >= 1e99) std::printf("%-40s %10s %12s %7s\n", w, "-", "-", "n/a");
    else std::printf("%-40s %10.4f %12.1f %7d\n", w, t, mb / t, good ? 0 : 1);
  };
  row("gzip -dc > /dev/null", gzip_ok ? t_gzip : 1e100, true);
  row("python3 gzip module", py_ok ? t_py : 1e100, true);
  row("ferry from_files(idx) | batch, zlib", t_zlib, recs_zlib == want_recs && bytes_zlib == want_bytes);
  row("ferry from_files(idx) | batch, ISA-L", isal ? t_isal : 1e100, recs_isal == want_recs && bytes_isal == want_bytes);
  const double r_gzip = gzip_ok && isal ? t_gzip / t_isal : 0, r_py = py_ok && isal ? t_py / t_isal : 0;
  const double r_zlib = isal ? t_zlib / t_isal : 0, r_zlib_gzip = gzip_ok ? t_gzip / t_zlib : 0;
  if (isal) {
    std::printf("ratio_isal_gzip: %.2f (ferry with ISA-L / gzip -dc, speed)\n", r_gzip);
    std::printf("ratio_isal_python: %.2f\n", r_py);
    std::printf("ratio_isal_zlib: %.2f (ISA-L / zlib inside ferry)\n", r_zlib);
  } else {
    std::printf("# this build has no ISA-L: zlib only\n");
  }
  std::printf("ratio_zlib_gzip: %.2f\n", r_zlib_gzip);
  std::printf("{\"bench\":\"gzip\",\"mb_out\":%.3f,\"isal\":%s,\"ferry_isal_s\":%.5f,\"ferry_zlib_s\":%.5f,"
              "\"gzip_dc_s\":%.5f,\"python_gzip_s\":%.5f,\"ratio_isal_gzip\":%.3f,\"ratio_isal_python\":%.3f,"
              "\"ratio_isal_zlib\":%.3f,\"ratio_zlib_gzip\":%.3f}\n",
              mb, isal ? "true" : "false", isal ? t_isal : 0.0, t_zlib, gzip_ok ? t_gzip : 0.0, py_ok ? t_py : 0.0,
              r_gzip, r_py, r_zlib, r_zlib_gzip);
  return ok ? 0 : 1;
}
