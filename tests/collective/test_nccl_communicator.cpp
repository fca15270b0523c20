// nccl_communicator: one rank per local GPU, all ranks driven from their own threads. Each
// rank starts from values of its own, so a collective that did nothing (or the wrong thing)
// leaves some rank with the wrong numbers; results are checked exactly against the oracle:
//
//   all_reduce_sum      rank r holds r + 1 + (i % 7)      -> sum_r (r + 1) + count (i % 7)
//   broadcast(last)     rank r holds 1000 r + (i % 5)     -> 1000 (count - 1) + (i % 5)
//   all_reduce_average  rank r holds 2 r + (i % 3) / 2    -> (count - 1) + (i % 3) / 2
//
// (all integers or halves: exact in float; the average is exact for a power-of-two count,
// NCCL's float average being a sum of x / count, and within a few ulps otherwise.)
// Then nccl_device_exchange::all_to_all, every rank driven from one thread: rank r sends peer
// p bytes of value 16 r + p + 1, checked at their offsets. Each call must leave the calling
// thread's current device where it was (checked with another rank's device current).
// Every CUDA call is checked. Plain cudaMemcpy runs on the legacy default stream, which the
// communicator's cudaStreamNonBlocking stream is not ordered with: cudaDeviceSynchronize
// after each upload and before each download orders them (as bench_nccl_allreduce does).
//
// With one GPU a collective over one rank is the identity: that is what is checked then, and
// the test says that the cross-rank checks did not run (they need two GPUs). Exits 77 (SKIP)
// with a reason when no CUDA device is usable; must pass on a GPU machine.
// Also built against the simulated runtime and NCCL (collective_nccl_sim: two simulated
// GPUs, where fewer than two ranks is a failure; tests/cuda/sim/sim_report_at_exit.cpp
// makes a race or deadlock fail it too).
#include <cuda_runtime_api.h>

#include <atomic>
#include <barrier>
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ferry/cuda/runtime.hpp"
#include "ferry/collective/nccl.hpp"

namespace {

std::mutex print_mutex;
std::atomic<int> failures{0};

void fail(int rank, const std::string& what) {
  ++failures;
  std::lock_guard lk(print_mutex);
  std::printf("FAILED rank %d: %s\n", rank, what.c_str());
}

// Throws (caught by the rank's phase, which counts it) when a CUDA call of the test fails.
void ck(cudaError_t e, const char* call, int line) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(__FILE__) + ":" + std::to_string(line) + ": " + call + ": " +
                             cudaGetErrorName(e));
}
#define CK(call) ck((call), #call, __LINE__)

// Compares a rank's downloaded buffer with the oracle; reports the first few mismatches.
template <class Want>
int check(int rank, const char* what, const std::vector<float>& got, Want want, float tol) {
  int bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const float w = want(i);
    if (!(std::fabs(got[i] - w) <= tol)) {  // a NaN is wrong too
      if (++bad <= 3)
        fail(rank, std::string(what) + ": element " + std::to_string(i) + " is " + std::to_string(got[i]) +
                       ", expected " + std::to_string(w));
    }
  }
  return bad;
}

}  // namespace

int main() {
  if (!ferry::cuda::available()) {
    std::printf("SKIP: no usable CUDA device: %s\n", ferry::cuda::unavailable_reason().c_str());
    return 77;
  }
  const int count = ferry::cuda::device_count();
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    std::printf("FAILED: cudaGetDeviceProperties(0)\n");
    return 1;
  }
  const bool simulated = std::string(prop.name).rfind("simulated GPU", 0) == 0;
  if (simulated && count < 2) {
    std::printf("FAILED: the simulator has two GPUs, this run sees %d: the cross-rank checks would not run\n",
                count);
    return 1;
  }
  std::vector<int> devs;
  for (int d = 0; d < count; ++d) devs.push_back(d);
  auto comms = ferry::nccl_communicator::local(devs);
  const std::size_t len = 1 << 20;
  const float n = float(count);
  const bool pow2 = (count & (count - 1)) == 0;
  // NCCL's float average: x_r * (1 / count) summed; exact for a power of two, else a few
  // rounding errors of values up to 2 count.
  const float avg_tol = pow2 ? 0.0f : 8.0f * n * FLT_EPSILON * 2.0f * n;
  std::vector<int> wrong(count, 0);
  // Every rank ends each phase here. When one failed, all skip the phases after (a rank that
  // left early would leave its peers waiting in the next collective for ever): `stopped`
  // is read from `failed` once every rank has arrived, so all ranks see the same value.
  std::atomic<bool> failed{false};
  bool stopped = false;
  std::barrier sync(count, [&]() noexcept { stopped = failed.load(); });

  std::vector<std::thread> ts;
  for (int r = 0; r < count; ++r)
    ts.emplace_back([&, r] {
      auto phase = [&](auto body) {
        if (!stopped) {
          try {
            body();
          } catch (const std::exception& e) {
            fail(r, e.what());
            failed = true;
          }
        }
        sync.arrive_and_wait();
      };
      cudaStream_t s = nullptr;
      float* d = nullptr;
      std::vector<float> h(len);
      auto upload = [&] {
        CK(cudaMemcpy(d, h.data(), len * sizeof(float), cudaMemcpyHostToDevice));
        CK(cudaDeviceSynchronize());  // the DMA has ended before the communicator's stream reads d
      };
      auto download = [&] {
        CK(cudaDeviceSynchronize());  // the collective has ended before the legacy stream reads d
        CK(cudaMemcpy(h.data(), d, len * sizeof(float), cudaMemcpyDeviceToHost));
      };
      // A call leaves the thread's current device where it was: here another rank's device
      // (the same one with one GPU), put back to the rank's own after.
      auto keeps_device = [&](const char* what, auto call) {
        const int other = devs[std::size_t((r + 1) % count)];
        CK(cudaSetDevice(other));
        call();
        int now = -1;
        CK(cudaGetDevice(&now));
        if (now != other)
          fail(r, std::string(what) + " moved the thread's current device from " + std::to_string(other) + " to " +
                      std::to_string(now));
        CK(cudaSetDevice(devs[r]));
      };
      // 1. all_reduce_sum
      phase([&] {
        CK(cudaSetDevice(devs[r]));
        CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        comms[r].set_stream(s);
        CK(cudaMalloc(&d, len * sizeof(float)));
        for (std::size_t i = 0; i < len; ++i) h[i] = float(r + 1) + float(i % 7);
        upload();
      });
      phase([&] {
        keeps_device("all_reduce_sum", [&] { comms[r].all_reduce_sum({d, len}); });
        keeps_device("barrier", [&] { comms[r].barrier(); });
        download();
        wrong[r] += check(r, "all_reduce_sum", h, [&](std::size_t i) { return n * (n + 1) / 2 + n * float(i % 7); },
                          0.0f);
      });
      // 2. broadcast from the last rank
      phase([&] {
        for (std::size_t i = 0; i < len; ++i) h[i] = 1000.0f * float(r) + float(i % 5);
        upload();
      });
      phase([&] {
        keeps_device("broadcast", [&] { comms[r].broadcast({d, len}, count - 1); });
        comms[r].barrier();
        download();
        wrong[r] += check(r, "broadcast from the last rank", h,
                          [&](std::size_t i) { return 1000.0f * (n - 1) + float(i % 5); }, 0.0f);
      });
      // 3. all_reduce_average of values that differ from rank to rank
      phase([&] {
        for (std::size_t i = 0; i < len; ++i) h[i] = 2.0f * float(r) + 0.5f * float(i % 3);
        upload();
      });
      phase([&] {
        keeps_device("all_reduce_average", [&] { comms[r].all_reduce_average({d, len}); });
        comms[r].barrier();
        download();
        wrong[r] += check(r, "all_reduce_average", h, [&](std::size_t i) { return (n - 1) + 0.5f * float(i % 3); },
                          avg_tol);
      });
      // Teardown, whatever happened above.
      try {
        if (d) CK(cudaFree(d));
        if (s) CK(cudaStreamDestroy(s));
      } catch (const std::exception& e) {
        fail(r, e.what());
      }
    });
  for (auto& t : ts) t.join();
  int bad = 0;
  for (int b : wrong) bad += b;

  // 4. nccl_device_exchange::all_to_all, every rank driven from this thread (one group of
  // ncclSend/ncclRecv): rank r sends peer p `block` bytes of value 16 r + p + 1, so a
  // block sent to the wrong peer or stored at the wrong offset is seen. The thread's
  // current device (the first rank's) stays where it was.
  int exchange_wrong = 0;
  try {
    const std::size_t block = 4096;
    const auto K = std::size_t(count);
    std::vector<std::byte*> snd(K, nullptr), rcv(K, nullptr);
    std::vector<cudaStream_t> ss(K, nullptr);
    const std::vector<std::uint64_t> sizes(K, block);
    std::vector<ferry::device_all_to_all_part> parts(K);
    for (std::size_t r = 0; r < K; ++r) {
      CK(cudaSetDevice(devs[r]));
      CK(cudaMalloc(&snd[r], K * block));
      CK(cudaMalloc(&rcv[r], K * block));
      CK(cudaStreamCreateWithFlags(&ss[r], cudaStreamNonBlocking));
      for (std::size_t p = 0; p < K; ++p) CK(cudaMemset(snd[r] + p * block, int(16 * r + p + 1), block));
      CK(cudaMemset(rcv[r], 0, K * block));
      CK(cudaDeviceSynchronize());
      parts[r] = {snd[r], sizes.data(), rcv[r], sizes.data(), ss[r]};
    }
    ferry::nccl_device_exchange ex(comms);
    const int before = devs.front();  // the exchange sets each rank's device, the last one last
    CK(cudaSetDevice(before));
    ex.all_to_all(parts);
    int now = -1;
    CK(cudaGetDevice(&now));
    if (now != before)
      fail(-1, "nccl_device_exchange::all_to_all moved the thread's current device from " + std::to_string(before) +
                   " to " + std::to_string(now));
    std::vector<unsigned char> got(K * block);
    for (std::size_t r = 0; r < K; ++r) {
      CK(cudaSetDevice(devs[r]));
      CK(cudaStreamSynchronize(ss[r]));
      CK(cudaMemcpy(got.data(), rcv[r], K * block, cudaMemcpyDeviceToHost));
      for (std::size_t q = 0; q < K; ++q)  // from rank q, at q's offset
        for (std::size_t i = 0; i < block; ++i)
          if (got[q * block + i] != (unsigned char)(16 * q + r + 1)) {
            if (++exchange_wrong <= 3)
              fail(int(r), "all_to_all: byte " + std::to_string(i) + " from rank " + std::to_string(q) + " is " +
                               std::to_string(got[q * block + i]) + ", expected " + std::to_string(16 * q + r + 1));
            break;
          }
      CK(cudaFree(snd[r]));
      CK(cudaFree(rcv[r]));
      CK(cudaStreamDestroy(ss[r]));
    }
  } catch (const std::exception& e) {
    fail(-1, e.what());
  }
  bad += exchange_wrong;

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
  std::printf("nccl_communicator: %d rank(s)%s, %zu floats: #wrong %d, abort %s, %d failure(s)\n", count,
              simulated ? " (simulated)" : "", len, bad, clear ? "ok" : "WRONG", failures.load());
  if (count < 2)
    std::printf("NOTE: one GPU: only checked that init works and that each collective over one rank is the "
                "identity; the cross-rank checks (sum, broadcast, average across ranks) need >= 2 GPUs and "
                "did NOT run\n");
  return bad == 0 && clear && failures == 0 ? 0 : 1;
}
