// The simulated cuBLAS (cublas_v2.h): reference loops with cuBLAS's column-major
// semantics, enqueued through the simulated runtime's kernels.
#include "cublas_v2.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <vector>

struct cublasContext {
  int device = 0;
  cudaStream_t stream = nullptr;  // null: the legacy default stream, which the sim has not
  void* workspace = nullptr;      // cublasSetWorkspace's
};

namespace {
std::mutex m;
std::map<int, std::pair<int, cublasStatus_t>> fail_in;  // device -> (n, status)
std::map<int, std::pair<int, cublasStatus_t>> create_fail_in;  // the same, for cublasCreate
int live = 0;

// Checks the handle against the current device; the status to return for a failure
// injected with sim::fail_blas (SUCCESS when none).
cublasStatus_t enter(cublasHandle_t h, const char* call) {
  int cur = -1;
  cudaGetDevice(&cur);
  if (cur != h->device)
    sim::report(std::string(call) + ": a cuBLAS handle of device " + std::to_string(h->device) + " used while device " +
              std::to_string(cur) + " is current");
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  if (h->stream && cudaStreamIsCapturing(h->stream, &cap) == cudaSuccess && cap != cudaStreamCaptureStatusNone &&
      !h->workspace)
    sim::report(std::string(call) + ": captured into a graph with no cublasSetWorkspace (cuBLAS would allocate "
                "its workspace during capture)");
  std::lock_guard lk(m);
  auto it = fail_in.find(h->device);
  if (it != fail_in.end() && --it->second.first == 0) {
    const cublasStatus_t st = it->second.second;
    fail_in.erase(it);
    return st;
  }
  return CUBLAS_STATUS_SUCCESS;
}

// Bytes of a column-major rows x cols matrix with leading dimension ld.
std::size_t extent(int rows, int cols, int ld) {
  if (rows == 0 || cols == 0) return 0;
  return (std::size_t(cols - 1) * std::size_t(ld) + std::size_t(rows)) * sizeof(float);
}
}  // namespace

cublasStatus_t cublasCreate(cublasHandle_t* h) {
  int device = 0;
  cudaGetDevice(&device);
  std::lock_guard lk(m);
  auto it = create_fail_in.find(device);
  if (it != create_fail_in.end() && --it->second.first == 0) {
    const cublasStatus_t st = it->second.second;
    create_fail_in.erase(it);
    return st;
  }
  *h = new cublasContext;
  (*h)->device = device;
  ++live;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy(cublasHandle_t h) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete h;
  std::lock_guard lk(m);
  --live;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  h->stream = s;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void* p, std::size_t bytes) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (bytes && sim::device_of(p) != h->device) {
    sim::report("cublasSetWorkspace: a workspace that is not device " + std::to_string(h->device) + " memory");
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  h->workspace = bytes ? p : nullptr;
  return CUBLAS_STATUS_SUCCESS;
}
const char* cublasGetStatusName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}
const char* cublasGetStatusString(cublasStatus_t s) {
  return s == CUBLAS_STATUS_SUCCESS ? "success" : "simulated failure";
}

// C(m x n) = alpha op(A) op(B) + beta C, all column-major; op(A) is m x k, op(B) k x n.
cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                           const float* alpha, const float* a, int lda, const float* b, int ldb,
                           const float* beta, float* c, int ldc) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (const auto st = enter(h, "cublasSgemm"); st != CUBLAS_STATUS_SUCCESS) return st;
  const int ar = ta == CUBLAS_OP_N ? m : k, ac = ta == CUBLAS_OP_N ? k : m;  // A as stored
  const int br = tb == CUBLAS_OP_N ? k : n, bc = tb == CUBLAS_OP_N ? n : k;
  if (m < 0 || n < 0 || k < 0 || lda < std::max(1, ar) || ldb < std::max(1, br) || ldc < std::max(1, m))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  const float al = *alpha, be = *beta;
  std::vector<sim::range> reads{{a, extent(ar, ac, lda)}, {b, extent(br, bc, ldb)}};
  if (be != 0.0f) reads.push_back({c, extent(m, n, ldc)});
  sim::launch(h->stream, "cublasSgemm", reads, {{c, extent(m, n, ldc)}}, [=] {
    auto A = [&](int i, int p) { return ta == CUBLAS_OP_N ? a[i + std::size_t(p) * lda] : a[p + std::size_t(i) * lda]; };
    auto B = [&](int p, int j) { return tb == CUBLAS_OP_N ? b[p + std::size_t(j) * ldb] : b[j + std::size_t(p) * ldb]; };
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) {
        double acc = 0;
        for (int p = 0; p < k; ++p) acc += double(A(i, p)) * double(B(p, j));
        float& out = c[i + std::size_t(j) * ldc];
        out = float(al * acc) + (be == 0.0f ? 0.0f : be * out);  // beta = 0: C is not read (NaN-safe)
      }
  });
  return CUBLAS_STATUS_SUCCESS;
}

// y = alpha op(A) x + beta y; A is m x n column-major.
cublasStatus_t cublasSgemv(cublasHandle_t h, cublasOperation_t t, int m, int n, const float* alpha,
                           const float* a, int lda, const float* x, int incx, const float* beta, float* y,
                           int incy) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (const auto st = enter(h, "cublasSgemv"); st != CUBLAS_STATUS_SUCCESS) return st;
  if (m < 0 || n < 0 || lda < std::max(1, m) || incx == 0 || incy == 0) return CUBLAS_STATUS_INVALID_VALUE;
  if (incx != 1 || incy != 1) return CUBLAS_STATUS_NOT_SUPPORTED;  // the sim's subset
  const int xn = t == CUBLAS_OP_N ? n : m, yn = t == CUBLAS_OP_N ? m : n;
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  const float al = *alpha, be = *beta;
  std::vector<sim::range> reads{{a, extent(m, n, lda)}, {x, std::size_t(xn) * sizeof(float)}};
  if (be != 0.0f) reads.push_back({y, std::size_t(yn) * sizeof(float)});
  sim::launch(h->stream, "cublasSgemv", reads, {{y, std::size_t(yn) * sizeof(float)}}, [=] {
    for (int i = 0; i < yn; ++i) {
      double acc = 0;
      for (int p = 0; p < xn; ++p)
        acc += double(t == CUBLAS_OP_N ? a[i + std::size_t(p) * lda] : a[p + std::size_t(i) * lda]) * double(x[p]);
      y[i] = float(al * acc) + (be == 0.0f ? 0.0f : be * y[i]);
    }
  });
  return CUBLAS_STATUS_SUCCESS;
}

namespace sim {
void fail_blas(int device, int n, cublasStatus_t status) {
  std::lock_guard lk(m);
  fail_in[device] = {n, status};
}
void fail_blas_create(int device, int n, cublasStatus_t status) {
  std::lock_guard lk(m);
  create_fail_in[device] = {n, status};
}
int live_blas_handles() {
  std::lock_guard lk(m);
  return live;
}
}  // namespace sim
