// A user's g++ program on ferry's CUDA layer (ferry-cuda / ferry::cuda): the runtime probe,
// the pinned pool (page-aligned fallback without a driver), and one call each into cuBLAS
// and NCCL that needs no device, so every library the component promises is linked.
#include <cublas_v2.h>
#include <nccl.h>

#include <cstdio>

#include "ferry/cuda/runtime.hpp"
#include "ferry/memory/pinned.hpp"

int main() {
  int nccl_version = 0, cublas_major = 0;
  ncclGetVersion(&nccl_version);
  cublasGetProperty(MAJOR_VERSION, &cublas_major);
  void* p = ferry::pinned_pool()->allocate(1 << 20, 4096);
  static_cast<char*>(p)[0] = 1;
  ferry::pinned_pool()->deallocate(p, 1 << 20, 4096);
  const int devices = ferry::cuda::device_count();
  const bool ok = nccl_version > 0 && cublas_major > 0;
  std::printf("%s: nccl %d, cublas %d, %d device(s)%s%s\n", ok ? "ok" : "WRONG", nccl_version, cublas_major,
              devices, devices ? "" : ": ", devices ? "" : ferry::cuda::unavailable_reason().c_str());
  return ok ? 0 : 1;
}
