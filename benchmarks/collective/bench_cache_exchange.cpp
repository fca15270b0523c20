// cache_on_device's trade of rows between ranks (host replicas, MPI): the time of a later
// epoch's reorder (the rewind that trades the rows and reorders them) against its bound
// from the same run: a raw MPI_Alltoallv of the bytes the ranks trade (each rank's rows
// that it serves and another rank cached, (n-1)/n of them on average, split evenly) plus
// a hand-written gather of each rank's rows into a new order through a table of indices
// made beforehand (every row is written once into the epoch's buffer, read from a random
// place: the part of a shuffle no code avoids).
// Also the same reorder in one process (ranks = nullptr: no trade) for scale, and
// nccl-tests' bus bandwidth of the raw all-to-all (algbw x (n-1)/n).
//
//   mpirun -np 2 bench_cache_exchange [rows per rank, default 262144]   (rows of 256 bytes)
//
// Times are the slowest rank's, medians of 5 epochs. #wrong counts rows not served
// exactly once over the job in an epoch. Rank 0 prints; a JSON line closes.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "common/timing.hpp"
#include "ferry/collective/rank_exchange.hpp"
#include "ferry/distributed.hpp"
#include "ferry/sources/global_shuffle.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/cache_on_device.hpp"
#include "ferry/stages/distribute.hpp"

namespace {
using bench::now;
constexpr std::size_t row_bytes = 256;
using row = std::array<std::uint8_t, row_bytes>;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  ferry::distributed_context ctx(argc, argv, {.devices_per_rank = 0});
  return ferry::abort_on_exception([&] {
    auto& w = ctx.world();
    const std::uint64_t W = std::uint64_t(w.size()), me = std::uint64_t(w.rank());
    const std::uint64_t per_rank = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 262144;
    const std::uint64_t n = per_rank * W, G = 256 * W, R = 2, rounds = 5;
    std::vector<row> data(n);
    for (std::uint64_t i = 0; i < n; ++i) std::memcpy(data[i].data(), &i, sizeof i);
    ferry::rank_exchange_over<ferry::mpi_communicator> ex(w);
    std::int64_t wrong = 0;
    // The slowest rank's median time of a later epoch's rewind (the reorder), served in full.
    const auto run = [&](std::span<const row> rows, std::uint64_t ranks, std::uint64_t rank, ferry::rank_exchange* x,
                          bool check) {
      auto p = ferry::global_shuffle(rows, {.seed = 1, .global_batch = G, .ranks = ranks, .rank = rank}) |
               ferry::batch(G / ranks) | ferry::distribute(ferry::host_replicas{R}) |
               ferry::cache_on_device({.seed = 2, .across_replicas = true, .ranks = x});
      while (p.next()) {
      }
      std::vector<double> t;
      for (std::uint64_t e = 0; e < rounds; ++e) {
        w.barrier();
        const double t0 = now();
        p.rewind();
        t.push_back(now() - t0);
        std::vector<std::int64_t> seen(check ? n : 0, 0);
        while (auto st = p.next())
          if (check)
            for (std::size_t r = 0; r < st->replicas(); ++r)
              for (const row& v : (*st)[r].field<0>().first((*st)[r].valid())) {
                std::uint64_t id;
                std::memcpy(&id, v.data(), sizeof id);
                seen[std::size_t(id)]++;
              }
        if (check) {
          w.all_reduce_sum(std::span<std::int64_t>(seen));
          wrong += std::count_if(seen.begin(), seen.end(), [](std::int64_t v) { return v != 1; });
        }
      }
      const double worst = median(t);
      std::vector<double> all(W);
      w.all_gather_bytes(&worst, sizeof worst, all.data());
      return *std::max_element(all.begin(), all.end());
    };
    const double t_ex = run(data, W, me, &ex, true);
    // The bound: a raw all-to-all of the traded bytes and one pass over the rank's rows.
    MPI_Comm raw = MPI_COMM_NULL;
    MPI_Comm_dup(MPI_COMM_WORLD, &raw);
    const std::uint64_t traded = per_rank * (W - 1) / W * row_bytes, each = W > 1 ? traded / (W - 1) : 0;
    std::vector<std::uint8_t> send(traded + 1), recv(traded + 1), cache(per_rank * row_bytes, 1),
        epoch(per_rank * row_bytes);
    std::vector<int> counts(W, int(each)), displs(W, 0);
    counts[me] = 0;
    for (std::uint64_t p = 0, o = 0; p < W; ++p) displs[p] = int(o), o += std::uint64_t(counts[p]);
    std::vector<std::uint32_t> order(per_rank);
    for (std::uint32_t i = 0; i < per_rank; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), std::mt19937_64(me));
    std::vector<double> t_a2a, t_copy;
    for (std::uint64_t e = 0; e < rounds; ++e) {
      MPI_Barrier(raw);
      double t0 = now();
      MPI_Alltoallv(send.data(), counts.data(), displs.data(), MPI_BYTE, recv.data(), counts.data(), displs.data(),
                    MPI_BYTE, raw);
      t_a2a.push_back(now() - t0);
      t0 = now();
      for (std::size_t j = 0; j < order.size(); ++j)
        std::memcpy(epoch.data() + j * row_bytes, cache.data() + std::size_t(order[j]) * row_bytes, row_bytes);
      t_copy.push_back(now() - t0);
    }
    double mine[2] = {median(t_a2a), median(t_copy)};
    std::vector<double> all(2 * W);
    w.all_gather_bytes(mine, sizeof mine, all.data());
    double a2a = 0, copy = 0;
    for (std::uint64_t p = 0; p < W; ++p) a2a = std::max(a2a, all[2 * p]), copy = std::max(copy, all[2 * p + 1]);
    MPI_Comm_free(&raw);
    // One process, one rank's share of the rows, no trade: the reorder alone.
    const double t_solo = run(std::span<const row>(data).first(per_rank), 1, 0, nullptr, false);
    if (me == 0) {
      const double bound = a2a + copy, algbw = a2a > 0 ? double(traded) / a2a / 1e9 : 0;
      std::printf("# cache_on_device across %llu ranks x %llu host replicas: %llu rows of %zu bytes a rank, "
                  "global batch %llu\n",
                  (unsigned long long)W, (unsigned long long)R, (unsigned long long)per_rank, row_bytes,
                  (unsigned long long)G);
      std::printf("reorder with trade (ms):        %10.2f\n", t_ex * 1e3);
      std::printf("raw MPI_Alltoallv of %6.1f MiB: %10.2f  (algbw %.2f GB/s, busbw %.2f GB/s)\n",
                  double(traded) / (1 << 20), a2a * 1e3, algbw, algbw * double(W - 1) / double(W));
      std::printf("hand gather of the rank's rows: %10.2f  (a table of indices)\n", copy * 1e3);
      std::printf("one process, %llu rows, no trade:%10.2f\n", (unsigned long long)per_rank, t_solo * 1e3);
      std::printf("exchange_vs_bound: %.2f\n", t_ex / bound);
      std::printf("#wrong: %lld\n", (long long)wrong);
      std::printf("{\"bench\":\"cache_exchange\",\"ranks\":%llu,\"rows_per_rank\":%llu,\"row_bytes\":%zu,"
                  "\"reorder_ms\":%.3f,\"alltoall_ms\":%.3f,\"gather_ms\":%.3f,\"solo_ms\":%.3f,"
                  "\"exchange_vs_bound\":%.3f,\"wrong\":%lld}\n",
                  (unsigned long long)W, (unsigned long long)per_rank, row_bytes, t_ex * 1e3, a2a * 1e3, copy * 1e3,
                  t_solo * 1e3, t_ex / bound, (long long)wrong);
    }
    return wrong == 0 ? 0 : 1;
  });
}
