// distribute(cuda::devices{0}) of variable-length steps on a GPU: padded batches whose L
// changes from step to step (padded_batch), and ragged batches (values plus offsets), each
// step's values read by a training-like kernel that computes for about twice the step's
// copy time; against the same kernels on device-resident data of the same sizes, in the
// same run. As bench_distribute_gpu, the batches are collated into pinned memory before
// timing and handed over by a source that only moves them, so what is timed is
// distribute's path: slicing, rebasing offsets, pools sized to the largest step, copies.
// Ends with:
//   padded_hidden_copy_ratio: <step time fed by distribute / step time on device data>
//   ragged_hidden_copy_ratio: <the same for ragged steps>
// Exits 77 without a usable device.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "ferry/batch_of.hpp"
#include "ferry/cuda/devices.hpp"
#include "ferry/cuda/runtime.hpp"
#include "ferry/cuda/stream.hpp"
#include "ferry/detail/random.hpp"
#include "ferry/memory/pinned.hpp"
#include "ferry/stages/distribute.hpp"
#include "common/timing.hpp"
#include "gpu_kernels.hpp"

namespace {
using clk = std::chrono::steady_clock;
using seq = std::vector<std::int32_t>;  // one sequence of token ids
using padded_batch_t = ferry::batch_of<ferry::padded<std::int32_t>>;
using ragged_batch_t = ferry::batch_of<seq>;

constexpr std::size_t rows = 4096, steps = 40;
constexpr int rounds = 5;

// Hands out pre-built batches by moving them: no work per element.
template <class B>
class ready_batches : public ferry::source_interface<ready_batches<B>> {
 public:
  using value_type = B;
  explicit ready_batches(std::vector<B> v) : v_(std::move(v)) {}
  std::optional<B> next() {
    if (i_ >= v_.size()) return std::nullopt;
    return std::move(v_[i_++]);
  }

 private:
  std::vector<B> v_;
  std::size_t i_ = 0;
};

// Step k's rows: lengths L_k / 2 .. L_k, with L_k cycling through 256 .. 512 (so the padded
// width and the ragged value count change every step). The same rows every run.
std::vector<std::vector<seq>> make_rows() {
  std::vector<std::vector<seq>> out(steps + 1);
  ferry::detail::splitmix64 g(24);
  for (std::size_t k = 0; k <= steps; ++k) {
    const std::size_t L = 256 + 64 * (k % 5);
    for (std::size_t i = 0; i < rows; ++i) {
      seq s(L / 2 + g.below(L / 2 + 1));
      for (auto& t : s) t = std::int32_t(g.below(50000)) + 1;  // non-zero data, as on the device
      out[k].push_back(std::move(s));
    }
  }
  return out;
}

// A private pinned pool for each kind of batch, holding every batch of a run at once (see
// bench_distribute_gpu: no block is pinned or unpinned while timing, which the end checks).
// Never destroyed.
template <class B>
const std::shared_ptr<ferry::pinned_buffer_pool>& batch_pool() {
  static const auto& pool =
      *new std::shared_ptr<ferry::pinned_buffer_pool>(ferry::make_pinned_pool(std::size_t(2) << 30));
  return pool;
}

std::vector<padded_batch_t> build_padded(const std::vector<std::vector<seq>>& r) {
  ferry::batch_collator<ferry::padded<std::int32_t>> c;
  std::vector<padded_batch_t> out;
  for (const auto& step : r) {
    std::size_t L = 0;
    for (const seq& s : step) L = std::max(L, s.size());
    L = (L + 63) / 64 * 64;  // padded_batch's multiple_of = 64
    out.push_back(c.collate_padded(batch_pool<padded_batch_t>(), std::span<const seq>(step), {L}, 0));
  }
  return out;
}
std::vector<ragged_batch_t> build_ragged(const std::vector<std::vector<seq>>& r) {
  ferry::batch_collator<seq> c;
  std::vector<ragged_batch_t> out;
  for (auto step : r) out.push_back(c.collate(batch_pool<ragged_batch_t>(), std::span<seq>(step)));
  return out;
}

double seconds_since(clk::time_point t0) { return std::chrono::duration<double>(clk::now() - t0).count(); }

struct result {
  double fed_s = 0, dev_s = 0;  // a step, medians of the rounds
  double mean_bytes = 0;        // a step's values, mean
  double raw_gbs = 0;           // raw pinned cudaMemcpyAsync of the same steps
  unsigned long long pinned_new = 0, evicted = 0;
  std::size_t wrong_steps = 0;  // steps whose value bytes were not the batch's: the run fails
};

// Fed by distribute against device-resident data of the same sizes, for batches made by
// build(r); the kernel reads each step's values once, then computes for about twice the
// mean step's copy time.
template <class B, class Build>
result measure(const std::vector<std::vector<seq>>& r, Build build, cudaStream_t s, float* out) {
  result res;
  std::vector<std::size_t> nbytes;
  std::size_t most = 0;
  {
    const std::vector<B> probe = build(r);
    for (const auto& b : probe) nbytes.push_back(b.field_bytes(0).size());
    most = *std::max_element(nbytes.begin(), nbytes.end());
  }
  for (std::size_t k = 1; k < nbytes.size(); ++k) res.mean_bytes += double(nbytes[k]) / double(nbytes.size() - 1);
  void* dev = nullptr;
  FERRY_CUDA_TRY(cudaMalloc(&dev, most));
  {  // the raw copy rate of these steps, and the device-resident data (the last step's bytes)
    const std::vector<B> raw = build(r);
    FERRY_CUDA_TRY(cudaMemcpyAsync(dev, raw[0].field_bytes(0).data(), nbytes[0], cudaMemcpyHostToDevice, s));
    FERRY_CUDA_TRY(cudaStreamSynchronize(s));
    const auto t0 = clk::now();
    double total = 0;
    for (std::size_t k = 1; k < raw.size(); ++k) {
      FERRY_CUDA_TRY(cudaMemcpyAsync(dev, raw[k].field_bytes(0).data(), nbytes[k], cudaMemcpyHostToDevice, s));
      total += double(nbytes[k]);
    }
    FERRY_CUDA_TRY(cudaStreamSynchronize(s));
    res.raw_gbs = total / seconds_since(t0) / 1e9;
    FERRY_CUDA_TRY(cudaMemset(static_cast<char*>(dev) + nbytes.back(), 1, most - nbytes.back()));
    FERRY_CUDA_TRY(cudaDeviceSynchronize());  // the legacy stream's memset, before stream s reads
  }
  const long long cycles = ferry_test::cycles_for_ms(2 * res.mean_bytes / (res.raw_gbs * 1e9) * 1e3);

  // Fed: each run a new pipeline; the clock starts once step 0 is handed out and the GPU
  // has drained. Timed: steps 1.. handed out, copied and consumed.
  auto run_ferry = [&] {
    auto p = ready_batches<B>(build(r)) | ferry::distribute(ferry::cuda::devices{0});
    clk::time_point t0;
    cudaStream_t cs = nullptr;
    std::size_t k = 0;
    for (auto& st : p) {
      cs = static_cast<cudaStream_t>(st[0].stream());
      const auto v = st[0].template field<0>().values;  // device memory: this step's values
      if (v.size_bytes() != nbytes[k]) {
        std::printf("FAIL: step %zu: %zu value bytes, %zu expected\n", k, v.size_bytes(), nbytes[k]);
        ++res.wrong_steps;
      }
      if (k > 0)
        FERRY_CUDA_TRY(ferry_test::launch_consume(cs, reinterpret_cast<const float*>(v.data()), v.size_bytes() / 4,
                                                  cycles, out));
      if (k == 0) {
        FERRY_CUDA_TRY(cudaDeviceSynchronize());
        t0 = clk::now();
      }
      ++k;
    }
    FERRY_CUDA_TRY(cudaStreamSynchronize(cs));
    const double t = seconds_since(t0) / double(k - 1);
    // The last steps' host batches go back to the pool when their copies are done: before
    // the next run builds its batches, or it would pin new blocks for them.
    FERRY_CUDA_TRY(cudaStreamSynchronize(p.backend().copy_stream(0)));
    return t;
  };
  auto device_loop = [&] {
    FERRY_CUDA_TRY(cudaStreamSynchronize(s));
    const auto t0 = clk::now();
    for (std::size_t k = 1; k < nbytes.size(); ++k)
      FERRY_CUDA_TRY(ferry_test::launch_consume(s, static_cast<const float*>(dev), nbytes[k] / 4, cycles, out));
    FERRY_CUDA_TRY(cudaStreamSynchronize(s));
    return seconds_since(t0) / double(nbytes.size() - 1);
  };
  // Warm: the CUDA context's pools, and the pinned pool's blocks (a block taken for a
  // smaller request goes back as its own size class, so the first runs may pin a block or
  // two more before the pool settles).
  for (int w = 0; w < 3; ++w) run_ferry();
  const auto before = batch_pool<B>()->statistics();
  std::vector<double> fed, devs;
  for (int round = 0; round < rounds; ++round) {  // alternating, so drift hits both
    devs.push_back(device_loop());
    fed.push_back(run_ferry());
  }
  const auto after = batch_pool<B>()->statistics();
  res.fed_s = bench::median(fed), res.dev_s = bench::median(devs);
  res.pinned_new = after.upstream_allocations - before.upstream_allocations;
  res.evicted = after.evictions - before.evictions;
  FERRY_CUDA_TRY(cudaFree(dev));
  return res;
}
}  // namespace

int main() {
  if (!ferry::cuda::available()) {
    std::printf("SKIP: no usable CUDA device: %s\n", ferry::cuda::unavailable_reason().c_str());
    return 77;
  }
  cudaDeviceProp prop{};
  FERRY_CUDA_TRY(cudaGetDeviceProperties(&prop, 0));
  const std::time_t now = std::time(nullptr);
  char date[64];
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&now));
  std::printf("# device: %s (sm_%d%d), date: %s\n", prop.name, prop.major, prop.minor, date);

  auto s = ferry::cuda::stream::create(0);
  float* out = nullptr;
  FERRY_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&out), sizeof(float)));
  const auto r = make_rows();
  const result pad = measure<padded_batch_t>(r, build_padded, s.get(), out);
  const result rag = measure<ragged_batch_t>(r, build_ragged, s.get(), out);
  FERRY_CUDA_TRY(cudaFree(out));

  std::printf("%-28s %14s %12s %14s %14s\n", "steps (4096 rows each)", "bytes/step", "raw GB/s", "device us/step",
              "fed us/step");
  std::printf("%-28s %14.0f %12.2f %14.1f %14.1f\n", "padded, L 256..512 by step", pad.mean_bytes, pad.raw_gbs,
              pad.dev_s * 1e6, pad.fed_s * 1e6);
  std::printf("%-28s %14.0f %12.2f %14.1f %14.1f\n", "ragged (values + offsets)", rag.mean_bytes, rag.raw_gbs,
              rag.dev_s * 1e6, rag.fed_s * 1e6);
  std::printf("# %zu steps a run, medians of %d rounds; the kernel reads a step once, then computes for 2x its copy\n",
              steps, rounds);
  std::printf("# pinned blocks allocated while timing: %llu, evicted: %llu\n", pad.pinned_new + rag.pinned_new,
              pad.evicted + rag.evicted);
  std::printf("padded_hidden_copy_ratio: %.3f\n", pad.fed_s / pad.dev_s);
  std::printf("ragged_hidden_copy_ratio: %.3f\n", rag.fed_s / rag.dev_s);
  if (pad.pinned_new + rag.pinned_new + pad.evicted + rag.evicted != 0) {
    std::printf("FAIL: the pinned pool allocated or evicted blocks while timing; the figures include that\n");
    return 1;
  }
  if (pad.wrong_steps + rag.wrong_steps != 0) return 1;  // said above, step by step
  return 0;
}
