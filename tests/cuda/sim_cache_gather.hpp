// tests/cuda/sim_cache_gather.hpp: cache_on_device's gather kernels as the simulator's
// kernels (tests/cuda/sim): the host gathers (the oracles the kernels of
// ferry/stages/cache_on_device.cuh implement), run when the simulator runs the stream, their
// device ranges declared for its race check. For code g++ compiles against the simulator:
// the cache_on_device tests and the example's simulated GPU build.
#pragma once

#include <cuda_runtime_api.h>  // the simulator's

#include <cstdint>
#include <cstring>
#include <vector>

#include "ferry/stages/cache_on_device.hpp"

namespace ferry_test {

// The gather as a simulated kernel: the host gather, run when the simulator runs the
// stream, its ranges checked for races.
struct sim_gather {
  static void launch(const ferry::detail::gather_args& a, ferry::cuda_stream s) {
    const std::size_t n = std::size_t(a.rows) * a.row_bytes;
    sim::launch(static_cast<cudaStream_t>(s), "gather", {{a.src, n}}, {{a.dst, n}},
                [a] { ferry::detail::gather_rows_host(a); });
  }
  // across_replicas: the kernel's loop on the host, reading every replica's cache (the
  // simulator's device memory is the host's: peers' memory included).
  static void launch_global(const ferry::detail::global_gather_args& a, ferry::cuda_stream s) {
    const auto& l = a.layout;
    const std::uint64_t R = l.replicas, S = l.steps;
    std::vector<sim::range> reads{{a.srcs, R * sizeof(void*)},
                                  {l.step_base, (S + 1) * 8},
                                  {l.in_step, S * (R + 1) * 8},
                                  {l.local_base, R * (S + 1) * 8}};
    for (std::uint64_t q = 0; q < R; ++q) reads.push_back({a.srcs[q], l.local_base[q * (S + 1) + S] * a.row_bytes});
    sim::launch(static_cast<cudaStream_t>(s), "gather_global", reads, {{a.dst, a.rows * a.row_bytes}}, [a] {
      const ferry::detail::feistel_permutation perm(a.total_rows, a.key);
      for (std::uint64_t j = 0; j < a.rows; ++j) {
        std::uint64_t q = 0, i = 0;
        a.layout.owner(perm(a.layout.global(a.replica, j)), q, i);
        std::memcpy(a.dst + j * a.row_bytes, a.srcs[q] + i * a.row_bytes, a.row_bytes);
      }
    });
  }
  // With a device_exchange: the plan and the moves, as the host oracles (the sim's
  // scratch: one value a row, written, so that the stage's sizing is exercised).
  static std::size_t plan_scratch(std::uint64_t rows) { return std::size_t(rows) * 8; }
  static void plan(const ferry::detail::exchange_plan_args& a, ferry::cuda_stream s) {
    const auto& l = a.layout;
    const std::uint64_t R = l.replicas, S = l.steps;
    sim::launch(static_cast<cudaStream_t>(s), "exchange_plan",
                {{l.step_base, (S + 1) * 8}, {l.in_step, S * (R + 1) * 8}, {l.local_base, R * (S + 1) * 8}},
                {{a.send_rows, a.rows * 8}, {a.recv_rows, a.rows * 8}, {a.at, (R + 1) * 16}, {a.scratch, a.scratch_bytes}},
                [a] {
                  ferry::detail::plan_exchange_host(a);
                  if (a.scratch_bytes) std::memset(a.scratch, 0, a.scratch_bytes);
                });
  }
  static void move_rows(const ferry::detail::move_rows_args& a, ferry::cuda_stream s) {
    const std::size_t n = std::size_t(a.rows) * a.row_bytes;
    sim::launch(static_cast<cudaStream_t>(s), a.scatter ? "unpack" : "pack", {{a.src, n}, {a.idx, a.rows * 8}},
                {{a.dst, n}}, [a] { ferry::detail::move_rows_host(a); });
  }
};

}  // namespace ferry_test
