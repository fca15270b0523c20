// cache_on_device's gather kernel (ferry/stages/cache_on_device.cuh) on a real GPU: later
// epochs equal the host replicas' (the same seed gives the same order: the kernel computes
// the host gather's permutation), fields stay together, rows whose size is a multiple of 16
// (the 16-byte path) and not (the byte path); across_replicas' global gather; the
// exchange's plan kernel (CUB's sort) against the host plan, and the trade through NCCL
// (.devices, one GPU: its rows to itself). Compiled by nvcc. Exits 77 (SKIP) with the
// reason when there is no usable device.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <tuple>
#include <vector>

#include "ferry/collective/nccl.hpp"
#include "ferry/detail/random.hpp"

#include "ferry/cuda/devices.hpp"
#include "ferry/cuda/runtime.hpp"
#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/cache_on_device.cuh"
#include "ferry/stages/distribute.hpp"

namespace {

using u64 = std::uint64_t;

// Per replica, per epoch, the ids read back from the device (checking the second field).
template <class Row, class P>
std::vector<std::vector<u64>> epoch_of(P& p) {
  std::vector<std::vector<u64>> out;
  std::vector<Row> host;
  for (auto& st : p) {
    out.resize(st.replicas());
    for (std::size_t r = 0; r < st.replicas(); ++r) {
      const auto& rb = st[r];
      const std::size_t n = rb.valid();
      if (n == 0) continue;
      std::vector<u64> ids(n);
      using second = std::tuple_element_t<1, Row>;
      std::vector<second> extra(n);
      FERRY_CUDA_TRY(cudaMemcpyAsync(ids.data(), rb.template field<0>().data(), n * sizeof(u64), cudaMemcpyDeviceToHost,
                                     static_cast<cudaStream_t>(rb.stream())));
      FERRY_CUDA_TRY(cudaMemcpyAsync(extra.data(), rb.template field<1>().data(), n * sizeof(second),
                                     cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(rb.stream())));
      FERRY_CUDA_TRY(cudaStreamSynchronize(static_cast<cudaStream_t>(rb.stream())));
      for (std::size_t i = 0; i < n; ++i) {
        REQUIRE(extra[i][0] == std::uint8_t(ids[i] * 3));
        out[r].push_back(ids[i]);
      }
    }
  }
  p.rewind();
  return out;
}

template <std::size_t Extra>
void compare(std::size_t rows, bool across = false, bool nccl = false) {
  using row = std::tuple<u64, std::array<std::uint8_t, Extra>>;
  std::vector<row> data(rows);
  for (std::size_t i = 0; i < rows; ++i) {
    std::get<0>(data[i]) = i;
    std::get<1>(data[i]).fill(std::uint8_t(i * 3));
  }
  // .devices: one replica (NCCL has one rank a GPU), its rows traded with itself.
  std::optional<std::vector<ferry::nccl_communicator>> comms;
  std::optional<ferry::nccl_device_exchange> ex;
  if (nccl) comms.emplace(ferry::nccl_communicator::local({0})), ex.emplace(*comms);
  const ferry::cuda::devices gpus = nccl ? ferry::cuda::devices{0} : ferry::cuda::devices{0, 0};
  auto dev = ferry::from_range(data) | ferry::batch(32) | ferry::distribute(gpus) |
             ferry::cuda::cache_on_device({.seed = 4, .across_replicas = across, .devices = ex ? &*ex : nullptr});
  auto host = ferry::from_range(data) | ferry::batch(32) | ferry::distribute(ferry::host_replicas{nccl ? 1u : 2u}) |
              ferry::cache_on_device({.seed = 4, .across_replicas = across});
  for (int e = 0; e < 3; ++e) {
    CAPTURE(e);
    const auto d = epoch_of<row>(dev);
    std::vector<std::vector<u64>> h;
    for (auto& st : host) {
      h.resize(st.replicas());
      for (std::size_t r = 0; r < st.replicas(); ++r)
        for (std::size_t i = 0; i < st[r].valid(); ++i) h[r].push_back(st[r].template field<0>()[i]);
    }
    host.rewind();
    CHECK(d == h);
  }
  CHECK(dev.cached());
}

}  // namespace

TEST_CASE("cache_on_device on a GPU: the kernel's order is the host gather's") {
  compare<16>(32 * 40);  // 16-byte words (the u64 field is 8 bytes: bytes)
  compare<13>(32 * 40 + 7);
}

TEST_CASE("cache_on_device across_replicas on a GPU: the global gather kernel's order is the host replicas'") {
  // Two replicas on one device: the kernel reads both caches (no peer access needed).
  compare<16>(32 * 40, true);
  compare<13>(32 * 40 + 7, true);
}

TEST_CASE("cache_on_device .devices on a GPU: the plan kernel (CUB's sort) equals the host plan") {
  // A layout of three replicas with uneven counts a step, planned for each on one GPU.
  ferry::detail::cache_exchange ex;
  ferry::detail::splitmix64 g(5);
  for (int k = 0; k < 300; ++k) ex.add_step(3, [&](std::size_t) { return g.below(40); });
  ex.finish();
  const auto l = ex.view();
  const u64 S = l.steps, R = l.replicas;
  const auto up = [](const u64* v, std::size_t n) {
    u64* d = nullptr;
    FERRY_CUDA_TRY(cudaMalloc(&d, n * 8 + 8));
    FERRY_CUDA_TRY(cudaMemcpy(d, v, n * 8, cudaMemcpyHostToDevice));
    return d;
  };
  u64* sb = up(l.step_base, S + 1);
  u64* is = up(l.in_step, S * (R + 1));
  u64* lb = up(l.local_base, R * (S + 1));
  for (u64 k = 0; k < 2 * R; ++k) {  // from the rows as cached, then from another epoch's order
    const u64 r = k % R;
    CAPTURE(k);
    const u64 n = l.local_base[r * (S + 1) + S];
    ferry::detail::exchange_plan_args a{{sb, is, lb, S, R}, r, n, ex.rows(), 77};
    a.from_shuffled = k >= R, a.from_key = 78;
    std::vector<u64> want_rows(2 * n), want_at(2 * (R + 1));
    ferry::detail::exchange_plan_args h = a;
    h.layout = l, h.send_rows = want_rows.data(), h.recv_rows = want_rows.data() + n, h.at = want_at.data();
    ferry::detail::plan_exchange_host(h);
    a.scratch_bytes = ferry::cuda::cache_gather_launcher::plan_scratch(n);
    FERRY_CUDA_TRY(cudaMalloc(&a.scratch, a.scratch_bytes));
    FERRY_CUDA_TRY(cudaMalloc(&a.send_rows, 2 * n * 8));
    FERRY_CUDA_TRY(cudaMalloc(&a.at, 2 * (R + 1) * 8));
    a.recv_rows = a.send_rows + n;
    ferry::cuda::cache_gather_launcher::plan(a, nullptr);
    std::vector<u64> got_rows(2 * n), got_at(2 * (R + 1));
    FERRY_CUDA_TRY(cudaMemcpy(got_rows.data(), a.send_rows, 2 * n * 8, cudaMemcpyDeviceToHost));
    FERRY_CUDA_TRY(cudaMemcpy(got_at.data(), a.at, 2 * (R + 1) * 8, cudaMemcpyDeviceToHost));
    CHECK(got_rows == want_rows);
    CHECK(got_at == want_at);
    for (void* p : {a.scratch, static_cast<void*>(a.send_rows), static_cast<void*>(a.at)}) FERRY_CUDA_TRY(cudaFree(p));
  }
  for (u64* p : {sb, is, lb}) FERRY_CUDA_TRY(cudaFree(p));
}

TEST_CASE("cache_on_device .devices on a GPU: rows traded through NCCL give the host replica's order") {
  compare<16>(32 * 40, true, true);
  compare<13>(32 * 40 + 7, true, true);
}

int main(int argc, char** argv) {
  if (!ferry::cuda::available()) {
    std::printf("SKIP: no usable CUDA device: %s\n", ferry::cuda::unavailable_reason().c_str());
    return 77;
  }
  doctest::Context c(argc, argv);
  return c.run();
}
