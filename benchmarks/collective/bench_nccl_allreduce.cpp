// GPU all-reduce: ferry's nccl_communicator (made by join(), the path the MPI bootstrap
// takes) against a raw ncclAllReduce on its own communicator, same sizes, same GPU, same
// run. One GPU means one rank: this measures ferry's overhead per call (a cudaSetDevice
// and a status check), not scaling; docs/multi_node.md models 8 and 2x8 GPUs from NCCL's
// published bus bandwidths.
//
//   bench_nccl_allreduce [--max-bytes 268435456] [--json FILE]
//
// Prints nccl-tests' columns for both (time, algbw, busbw with 2(n-1)/n, which is 0 for
// n = 1, so algbw is the figure here) and the ratio. With one rank an in-place all-reduce
// moves no data, so both times are the cost of a call (NCCL enqueues nothing): the ratio
// is large and means little, and the figure to read is ferry's added time per call,
// printed last as `nccl_call_overhead_us` (median over sizes), against what a real
// all-reduce of the trainer's gradients costs (docs/multi_node.md). Exits 77 without a
// usable GPU.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "ferry/collective/nccl.hpp"
#include "ferry/cuda/runtime.hpp"

#define CK(x)                                                                         \
  do {                                                                                \
    if ((x) != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(cudaGetLastError())); \
      return 1;                                                                       \
    }                                                                                 \
  } while (0)

int main(int argc, char** argv) try {
  std::size_t max_bytes = std::size_t(256) << 20;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--max-bytes" && i + 1 < argc) max_bytes = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--json" && i + 1 < argc) json = argv[++i];
    else { std::fprintf(stderr, "usage: bench_nccl_allreduce [--max-bytes B] [--json FILE]\n"); return 2; }
  }
  if (!ferry::cuda::available()) {
    std::printf("SKIP: %s\n", ferry::cuda::unavailable_reason().c_str());
    return 77;
  }
  CK(cudaSetDevice(0));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  auto comms = ferry::nccl_communicator::join(ferry::nccl_communicator::unique_id(), 1, 0, {0});
  auto& fc = comms[0];
  fc.set_stream(st);
  ncclComm_t raw;
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  if (ncclCommInitRank(&raw, 1, id, 0) != ncclSuccess) throw ferry::error("ncclCommInitRank");
  const int n = 1;
  const double busf = n > 1 ? 2.0 * (n - 1) / n : 0.0;
  float* buf = nullptr;
  CK(cudaMalloc(&buf, max_bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::FILE* jf = json.empty() ? nullptr : std::fopen(json.c_str(), "w");
  if (jf) std::fprintf(jf, "[\n");
  std::printf("# ferry nccl_communicator vs raw ncclAllReduce, %d rank(s), float sum, in place\n", n);
  std::printf("# %10s %10s | %10s %8s %8s | %10s %8s %8s | %6s %6s\n", "size", "count", "time(us)",
              "algbw", "busbw", "raw(us)", "algbw", "busbw", "ratio", "#wrong");
  bool first = true;
  std::vector<double> overhead_us;
  for (std::size_t bytes = 8; bytes <= max_bytes; bytes *= 4) {
    const std::size_t count = bytes / sizeof(float);
    const int iters = int(std::clamp<std::size_t>((std::size_t(1) << 30) / bytes, 20, 1000));
    auto time_it = [&](auto&& call) -> double {
      for (int k = 0; k < 5; ++k) call();
      cudaEventRecord(e0, st);
      for (int k = 0; k < iters; ++k) call();
      cudaEventRecord(e1, st);
      cudaEventSynchronize(e1);
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      return double(ms) * 1e-3 / iters;
    };
    const std::span<float> s(buf, count);
    const double tf = time_it([&] { fc.all_reduce_sum(s); });
    const double tr = time_it([&] { ncclAllReduce(buf, buf, count, ncclFloat, ncclSum, raw, st); });
    // Correctness: with one rank the sum is the input.
    std::vector<float> h(count), back(count);
    for (std::size_t i = 0; i < count; ++i) h[i] = float(i % 251);
    // Plain cudaMemcpy is on the legacy stream, which the communicator's stream does not
    // wait for (nor it for that one): synchronise the device on both sides.
    cudaMemcpy(buf, h.data(), bytes, cudaMemcpyHostToDevice);
    cudaDeviceSynchronize();
    fc.all_reduce_sum(s);
    fc.barrier();
    cudaDeviceSynchronize();
    cudaMemcpy(back.data(), buf, bytes, cudaMemcpyDeviceToHost);
    long long bad = 0;
    for (std::size_t i = 0; i < count; ++i) bad += back[i] != h[i];
    const double af = double(bytes) / tf / 1e9, ar = double(bytes) / tr / 1e9;
    overhead_us.push_back((tf - tr) * 1e6);
    std::printf("  %10zu %10zu | %10.2f %8.2f %8.2f | %10.2f %8.2f %8.2f | %6.3f %6lld\n", bytes,
                count, tf * 1e6, af, af * busf, tr * 1e6, ar, ar * busf, tf / tr, bad);
    if (jf)
      std::fprintf(jf, "%s  {\"bytes\": %zu, \"ferry_us\": %.3f, \"raw_us\": %.3f, \"ferry_algbw\": %.3f, "
                       "\"raw_algbw\": %.3f, \"ratio\": %.4f, \"wrong\": %lld}",
                   first ? "" : ",\n", bytes, tf * 1e6, tr * 1e6, af, ar, tf / tr, bad);
    first = false;
  }
  if (jf) {
    std::fprintf(jf, "\n]\n");
    std::fclose(jf);
  }
  cudaFree(buf);
  ncclCommDestroy(raw);
  std::sort(overhead_us.begin(), overhead_us.end());
  std::printf("nccl_call_overhead_us: %.3f\n", overhead_us[overhead_us.size() / 2]);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_nccl_allreduce: %s\n", e.what());
  return 1;
}
