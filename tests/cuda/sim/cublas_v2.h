// A simulated cuBLAS over the simulated runtime (cuda_runtime_api.h), for sim tests: the
// calls ferry's GPU backend makes, with cuBLAS's documented semantics (column-major, the
// argument checks that return CUBLAS_STATUS_INVALID_VALUE), run as kernels on the handle's
// stream when the simulator runs them, reading and writing device memory that the race
// check sees. A handle belongs to the device current at cublasCreate; using it while
// another device is current, or on a stream of another device, is reported as a violation
// (cuBLAS requires it). Scalars are read at the call (CUBLAS_POINTER_MODE_HOST).
#pragma once

#include "cuda_runtime_api.h"

enum cublasStatus_t {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_ARCH_MISMATCH = 8,
  CUBLAS_STATUS_MAPPING_ERROR = 11,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_INTERNAL_ERROR = 14,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
};
enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 };

struct cublasContext;
using cublasHandle_t = cublasContext*;

cublasStatus_t cublasCreate(cublasHandle_t* h);
cublasStatus_t cublasDestroy(cublasHandle_t h);
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s);
// The workspace cuBLAS uses instead of its own; `p` device memory of the handle's device.
// ferry's rule, which the sim checks: a GEMM captured into a graph runs on a workspace set
// here (cuBLAS's own would be allocated during capture), else a violation is reported.
cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void* p, std::size_t bytes);
const char* cublasGetStatusName(cublasStatus_t s);
const char* cublasGetStatusString(cublasStatus_t s);
cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                           const float* alpha, const float* a, int lda, const float* b, int ldb,
                           const float* beta, float* c, int ldc);
cublasStatus_t cublasSgemv(cublasHandle_t h, cublasOperation_t t, int m, int n, const float* alpha,
                           const float* a, int lda, const float* x, int incx, const float* beta, float* y,
                           int incy);

namespace sim {
// Makes the n-th cuBLAS compute call (gemm, gemv) on `device` from now fail with `status`.
void fail_blas(int device, int n, cublasStatus_t status);
// Makes the n-th cublasCreate on `device` (the current one) from now fail with `status`.
void fail_blas_create(int device, int n, cublasStatus_t status);
// cuBLAS handles alive.
int live_blas_handles();
}  // namespace sim
