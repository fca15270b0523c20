// Host all-reduce: ferry's mpi_communicator::all_reduce_sum against a raw MPI_Allreduce
// of the same buffer, in the same run, nccl-tests style:
//
//   mpirun -np 4 bench_mpi_allreduce [--max-bytes 67108864] [--iters N] [--json FILE]
//
//   size  count  type  time_us(ferry) algbw busbw  time_us(raw) algbw busbw  ratio  #wrong
//
// algbw = bytes / time; busbw = algbw * 2(n-1)/n (the bytes each rank must move in a
// ring all-reduce, so figures compare across rank counts). Times: the slowest rank's
// mean over a round of calls; 5 rounds alternate ferry and raw and each reports its
// median round, so a scheduling blip on a loaded machine hits neither alone. #wrong counts elements differing from the exact sum (integer-
// valued floats, so the sum is exact whatever the order). Rank 0 prints.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/timing.hpp"
#include "ferry/distributed.hpp"

namespace {
using bench::now;
}  // namespace

int main(int argc, char** argv) {
  ferry::distributed_context ctx(argc, argv, {.devices_per_rank = 0});
  return ferry::abort_on_exception([&] {
    std::size_t max_bytes = std::size_t(64) << 20;
    int iters_arg = 0;
    std::string json;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--max-bytes" && i + 1 < argc) max_bytes = std::strtoull(argv[++i], nullptr, 10);
      else if (a == "--iters" && i + 1 < argc) iters_arg = std::atoi(argv[++i]);
      else if (a == "--json" && i + 1 < argc) json = argv[++i];
      else throw ferry::config_error("usage: bench_mpi_allreduce [--max-bytes B] [--iters N] [--json FILE]");
    }
    auto& w = ctx.world();
    const int n = w.size(), me = w.rank();
    MPI_Comm raw = MPI_COMM_NULL;
    MPI_Comm_dup(MPI_COMM_WORLD, &raw);  // the baseline: its own communicator, plain calls
    const double busf = n > 1 ? 2.0 * (n - 1) / n : 0.0;
    if (me == 0) {
      std::printf("# ferry mpi_communicator vs raw MPI_Allreduce, %d ranks, float sum, in place\n", n);
      std::printf("# %10s %10s %5s | %10s %8s %8s | %10s %8s %8s | %6s %6s\n", "size", "count",
                  "type", "time(us)", "algbw", "busbw", "raw(us)", "algbw", "busbw", "ratio",
                  "#wrong");
    }
    std::FILE* jf = (me == 0 && !json.empty()) ? std::fopen(json.c_str(), "w") : nullptr;
    if (jf) std::fprintf(jf, "[\n");
    bool first = true;
    for (std::size_t bytes = 8; bytes <= max_bytes; bytes *= 4) {
      const std::size_t count = bytes / sizeof(float);
      std::vector<float> buf(count);
      auto fill = [&] {
        for (std::size_t i = 0; i < count; ++i) buf[i] = float((i + std::size_t(me)) % 17);
      };
      // Fewer repetitions for big buffers: ~0.1 s per variant per size.
      const int iters = iters_arg > 0 ? iters_arg
                                      : int(std::clamp<std::size_t>((std::size_t(32) << 20) / bytes, 5, 1000));
      // Rounds alternate ferry and raw; each variant's figure is its median round, so a
      // scheduling blip on a loaded machine hits neither alone.
      constexpr int rounds = 5;
      const int per = std::max(1, iters / rounds);
      auto round = [&](auto&& call) {
        w.barrier();
        const double t0 = now();
        for (int k = 0; k < per; ++k) call();
        double t = (now() - t0) / per;
        MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        return t;
      };
      auto ferry_call = [&] { w.all_reduce_sum(std::span<float>(buf)); };
      auto raw_call = [&] {
        MPI_Allreduce(MPI_IN_PLACE, buf.data(), int(count), MPI_FLOAT, MPI_SUM, raw);
      };
      fill();
      ferry_call();  // warm-up both paths
      raw_call();
      std::vector<double> vf, vr;
      for (int q = 0; q < rounds; ++q) {
        vf.push_back(round(ferry_call));
        vr.push_back(round(raw_call));
      }
      std::sort(vf.begin(), vf.end());
      std::sort(vr.begin(), vr.end());
      const double tf = vf[rounds / 2], tr = vr[rounds / 2];
      // Correctness of one fresh ferry call: element i sums (i + q) % 17 over ranks q.
      fill();
      w.all_reduce_sum(std::span<float>(buf));
      std::int64_t bad = 0;
      for (std::size_t i = 0; i < count; ++i) {
        float e = 0;
        for (int q = 0; q < n; ++q) e += float((i + std::size_t(q)) % 17);
        bad += buf[i] != e;
      }
      bad = w.all_reduce_sum(bad);
      const double af = double(bytes) / tf / 1e9, ar = double(bytes) / tr / 1e9;
      if (me == 0) {
        std::printf("  %10zu %10zu %5s | %10.2f %8.3f %8.3f | %10.2f %8.3f %8.3f | %6.3f %6lld\n",
                    bytes, count, "float", tf * 1e6, af, af * busf, tr * 1e6, ar, ar * busf,
                    tf / tr, static_cast<long long>(bad));
        if (jf)
          std::fprintf(jf,
                       "%s  {\"ranks\": %d, \"bytes\": %zu, \"ferry_us\": %.3f, \"raw_us\": %.3f, "
                       "\"ferry_busbw\": %.4f, \"raw_busbw\": %.4f, \"ratio\": %.4f, \"wrong\": %lld}",
                       first ? "" : ",\n", n, bytes, tf * 1e6, tr * 1e6, af * busf, ar * busf,
                       tf / tr, static_cast<long long>(bad));
        first = false;
      }
    }
    if (jf) {
      std::fprintf(jf, "\n]\n");
      std::fclose(jf);
    }
    MPI_Comm_free(&raw);
    return 0;
  });
}
