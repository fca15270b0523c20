// Augmentation's kernel (ferry/image/augment.cuh) on a real GPU against the host path
// (augment_host), bit for bit: fed by distribute(cuda::devices) with two replicas on
// device 0 (each with its own stream), image shapes of 1 and 3 channels, widths that are
// not multiples of anything, a partial last batch; more rows than a grid's y dimension
// holds; and no device allocation per step after warm-up. Compiled by nvcc (it includes
// augment.cuh). Exits 77 (SKIP) with the reason when there is no usable device.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "ferry/cuda/devices.hpp"
#include "ferry/cuda/runtime.hpp"
#include "ferry/detail/random.hpp"
#include "ferry/image/augment.cuh"
#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/distribute.hpp"

namespace {

namespace fi = ferry::image;

fi::augment_options options(std::uint32_t channels) {
  fi::augment_options o;
  o.mean = channels == 1 ? std::array<float, 4>{0.2860f} : std::array<float, 4>{0.485f, 0.456f, 0.406f};
  o.stddev = channels == 1 ? std::array<float, 4>{0.3530f, 1, 1, 1} : std::array<float, 4>{0.229f, 0.224f, 0.225f, 1};
  o.flip_probability = 0.5f;
  o.brightness = {-0.2f, 0.2f};
  o.contrast = {0.6f, 1.4f};
  o.seed = 2026;
  return o;
}

// Steps of replicas {0, 0} of H x W x C pictures; each replica's output copied back and
// compared with augment_host of the same global rows. Returns the rows compared.
template <std::uint32_t H, std::uint32_t W, std::uint32_t C>
std::size_t compare_shape(std::size_t rows, std::size_t per_replica) {
  constexpr std::size_t per = std::size_t(H) * W * C;
  using picture = std::array<std::uint8_t, per>;
  std::vector<picture> data(rows);
  ferry::detail::splitmix64 g(H * 1000 + W * 10 + C);
  for (auto& p : data)
    for (auto& b : p) b = std::uint8_t(g());
  fi::augmenter aug({H, W, C}, options(C));
  auto steps = ferry::from_range(data) | ferry::batch(2 * per_replica) |
               ferry::distribute(ferry::cuda::devices{0, 0}, {.remainder = ferry::remainder_policy::partial});
  std::size_t compared = 0, k = 0;
  std::uint64_t allocs_warm = 0;
  std::vector<float> got, want;
  for (auto& st : steps) {
    if (k++ == 2) allocs_warm = aug.device_allocations();
    const std::uint64_t key = fi::augment_key(1, st.index());
    const std::size_t grows = st.global_size();
    want.resize(grows * per);
    fi::augment_host({reinterpret_cast<const std::uint8_t*>(st.host_batch().field_buffer(0).data()), grows * per}, want,
                     aug.plan(), key);
    std::size_t first = 0;
    for (std::size_t r = 0; r < st.replicas(); ++r) {
      fi::augmented x = aug(st, r, key);
      REQUIRE(x.size() == st[r].size());
      REQUIRE(x.device() == 0);
      if (x.size()) {
        got.assign(x.data().size(), -1.f);
        FERRY_CUDA_TRY(cudaMemcpyAsync(got.data(), x.data().data(), x.data().size_bytes(), cudaMemcpyDeviceToHost,
                                       x.stream()));
        FERRY_CUDA_TRY(cudaStreamSynchronize(x.stream()));
        std::size_t wrong = 0;
        for (std::size_t i = 0; i < got.size(); ++i)
          if (std::memcmp(&got[i], &want[first * per + i], sizeof(float)) != 0 && wrong++ < 3)
            FAIL_CHECK("step " << st.index() << " replica " << r << " value " << i << ": device " << got[i]
                               << ", host " << want[first * per + i]);
        CHECK(wrong == 0);
        compared += x.size();
      }
      first += st[r].size();
    }
  }
  if (k > 3) CHECK(aug.device_allocations() == allocs_warm);  // none per step after warm-up
  CHECK(aug.device_allocations() <= 2);  // one block per replica (each output dropped before the next)
  return compared;
}

}  // namespace

TEST_CASE("gpu: the kernel's output equals augment_host bit for bit, on every replica") {
  CHECK(compare_shape<224, 224, 3>(2 * 4 * 3 + 3, 4) == 2 * 4 * 3 + 3);
  CHECK(compare_shape<37, 53, 3>(2 * 16 * 5 + 7, 16) == 2 * 16 * 5 + 7);
  CHECK(compare_shape<28, 28, 1>(2 * 64 * 4 + 1, 64) == 2 * 64 * 4 + 1);
}

TEST_CASE("gpu: more rows than a grid's y dimension holds") {
  // 70000 rows of 1x3 pixels, 2 channels: the kernel's rows loop past gridDim.y (65535).
  const fi::augment_plan p = fi::make_augment_plan({1, 3, 2}, options(3));
  const std::uint32_t rows = 70000;
  const std::size_t n = std::size_t(rows) * p.values();
  std::vector<std::uint8_t> in(n);
  ferry::detail::splitmix64 g(4);
  for (auto& b : in) b = std::uint8_t(g());
  std::vector<float> want(n), got(n);
  fi::augment_host(in, want, p, 77, 1000);
  std::uint8_t* d_in = nullptr;
  float* d_out = nullptr;
  FERRY_CUDA_TRY(cudaMalloc(&d_in, n));
  FERRY_CUDA_TRY(cudaMalloc(&d_out, n * sizeof(float)));
  FERRY_CUDA_TRY(cudaMemcpy(d_in, in.data(), n, cudaMemcpyHostToDevice));
  fi::launch_augment(p, {d_in, d_out, rows, 77, 1000}, nullptr);
  FERRY_CUDA_TRY(cudaMemcpy(got.data(), d_out, n * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK(std::memcmp(got.data(), want.data(), n * sizeof(float)) == 0);
  FERRY_CUDA_TRY(cudaFree(d_in));
  FERRY_CUDA_TRY(cudaFree(d_out));
}

int main(int argc, char** argv) {
  if (!ferry::cuda::available()) {
    std::printf("SKIP: no usable CUDA device: %s\n", ferry::cuda::unavailable_reason().c_str());
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
