// cache_on_device's gather kernel (ferry/stages/cache_on_device.cuh) on a real GPU: later
// epochs equal the host replicas' (the same seed gives the same order: the kernel computes
// the host gather's permutation), fields stay together, rows whose size is a multiple of 16
// (the 16-byte path) and not (the byte path); and across_replicas' global gather. Compiled by nvcc. Exits 77 (SKIP) with the
// reason when there is no usable device.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <tuple>
#include <vector>

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
void compare(std::size_t rows, bool across = false) {
  using row = std::tuple<u64, std::array<std::uint8_t, Extra>>;
  std::vector<row> data(rows);
  for (std::size_t i = 0; i < rows; ++i) {
    std::get<0>(data[i]) = i;
    std::get<1>(data[i]).fill(std::uint8_t(i * 3));
  }
  auto dev = ferry::from_range(data) | ferry::batch(32) | ferry::distribute(ferry::cuda::devices{0, 0}) |
             ferry::cuda::cache_on_device({.seed = 4, .across_replicas = across});
  auto host = ferry::from_range(data) | ferry::batch(32) | ferry::distribute(ferry::host_replicas{2}) |
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

int main(int argc, char** argv) {
  if (!ferry::cuda::available()) {
    std::printf("SKIP: no usable CUDA device: %s\n", ferry::cuda::unavailable_reason().c_str());
    return 77;
  }
  doctest::Context c(argc, argv);
  return c.run();
}
