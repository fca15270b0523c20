// nccl_communicator: one rank per local GPU, all ranks driven from their own threads.
// Exits 77 (SKIP) with a reason when no CUDA device is usable; must pass on a GPU machine.
// Also built against the simulated runtime and NCCL (collective_nccl_sim: two simulated
// GPUs; tests/cuda/sim/sim_report_at_exit.cpp makes a race or deadlock fail it too).
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "ferry/cuda/runtime.hpp"
#include "ferry/collective/nccl.hpp"

int main() {
  if (!ferry::cuda::available()) {
    std::printf("SKIP: no usable CUDA device: %s\n", ferry::cuda::unavailable_reason().c_str());
    return 77;
  }
  const int count = ferry::cuda::device_count();
  std::vector<int> devs;
  for (int d = 0; d < count; ++d) devs.push_back(d);
  auto comms = ferry::nccl_communicator::local(devs);
  const std::size_t len = 1 << 20;
  std::vector<int> bad(count, 0);
  std::vector<std::thread> ts;
  for (int r = 0; r < count; ++r)
    ts.emplace_back([&, r] {
      cudaSetDevice(devs[r]);
      cudaStream_t s;
      cudaStreamCreate(&s);
      comms[r].set_stream(s);
      float* d = nullptr;
      cudaMalloc(&d, len * sizeof(float));
      std::vector<float> h(len);
      for (std::size_t i = 0; i < len; ++i) h[i] = float(r + 1) + float(i % 7);
      cudaMemcpy(d, h.data(), len * sizeof(float), cudaMemcpyHostToDevice);
      comms[r].all_reduce_sum({d, len});
      comms[r].barrier();
      cudaMemcpy(h.data(), d, len * sizeof(float), cudaMemcpyDeviceToHost);
      const float ranks = float(count) * float(count + 1) / 2.0f;
      for (std::size_t i = 0; i < len; ++i)
        if (h[i] != ranks + float(count) * float(i % 7)) ++bad[r];
      // broadcast from the last rank
      for (std::size_t i = 0; i < len; ++i) h[i] = float(r);
      cudaMemcpy(d, h.data(), len * sizeof(float), cudaMemcpyHostToDevice);
      comms[r].broadcast({d, len}, count - 1);
      comms[r].all_reduce_average({d, len});
      comms[r].barrier();
      cudaMemcpy(h.data(), d, len * sizeof(float), cudaMemcpyDeviceToHost);
      for (std::size_t i = 0; i < len; ++i)
        if (h[i] != float(count - 1)) ++bad[r];
      cudaFree(d);
      cudaStreamDestroy(s);
    });
  for (auto& t : ts) t.join();
  int wrong = 0;
  for (int b : bad) wrong += b;
  // abort(): later calls throw a clear error; destruction afterwards does not hang.
  bool clear = true;
  for (auto& c : comms) c.abort();
  for (auto& c : comms) {
    clear = clear && c.aborted();
    try {
      c.barrier();
      clear = false;
    } catch (const ferry::error& e) {
      clear = clear && std::string(e.what()).find("aborted") != std::string::npos;
    }
  }
  comms.clear();
  std::printf("nccl_communicator: %d rank(s), %zu floats, #wrong %d, abort %s\n", count, len, wrong,
              clear ? "ok" : "WRONG");
  return wrong == 0 && clear ? 0 : 1;
}
