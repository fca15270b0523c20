// Interposes the runtime's host-blocking calls to count them: the executable's own
// definitions win over libcudart.so's (the test links the shared runtime), and forward
// to the real ones. Lets the GPU test prove the hot path never waits on the host.
#include <dlfcn.h>

#include <atomic>
#include <cuda_runtime_api.h>

namespace ferry_test {
std::atomic<long> device_syncs{0}, stream_syncs{0}, event_syncs{0};
}

namespace {
template <class F>
F real(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_NEXT, name));
}
}  // namespace

extern "C" {
cudaError_t cudaDeviceSynchronize(void) {
  static auto f = real<cudaError_t (*)(void)>("cudaDeviceSynchronize");
  ++ferry_test::device_syncs;
  return f();
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  static auto f = real<cudaError_t (*)(cudaStream_t)>("cudaStreamSynchronize");
  ++ferry_test::stream_syncs;
  return f(s);
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  static auto f = real<cudaError_t (*)(cudaEvent_t)>("cudaEventSynchronize");
  ++ferry_test::event_syncs;
  return f(e);
}
}
