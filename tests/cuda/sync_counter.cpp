// Interposes the runtime's host-blocking calls to count them: the executable's own
// definitions win over libcudart.so's (the test links the shared runtime), and forward
// to the real ones. Lets the GPU test prove the hot path never waits on the host.
#include <dlfcn.h>

#include <atomic>
#include <cuda_runtime_api.h>

#include "sync_counter.hpp"

namespace {
std::atomic<long> device_syncs{0}, stream_syncs{0}, event_syncs{0};

template <class F>
F real(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_NEXT, name));
}
}  // namespace

ferry_test::host_syncs ferry_test::count_host_syncs() { return {device_syncs, stream_syncs, event_syncs}; }

extern "C" {
cudaError_t cudaDeviceSynchronize(void) {
  static auto f = real<cudaError_t (*)(void)>("cudaDeviceSynchronize");
  ++device_syncs;
  return f();
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  static auto f = real<cudaError_t (*)(cudaStream_t)>("cudaStreamSynchronize");
  ++stream_syncs;
  return f(s);
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  static auto f = real<cudaError_t (*)(cudaEvent_t)>("cudaEventSynchronize");
  ++event_syncs;
  return f(e);
}
}
