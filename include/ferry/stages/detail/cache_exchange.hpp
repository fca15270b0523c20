// ferry/stages/detail/cache_exchange.hpp: cache_on_device's one order across replicas
// (cache_on_device_options::across_replicas). Epoch 0 numbers each cached row with its
// global index: the real rows every replica cached before it, step by step and, within a
// step, replica by replica (the order of the global batches, whatever the replica count).
// Each later epoch is one permutation of all those indices, drawn from (seed, epoch):
// replica r's j-th row is the row whose global index is perm(gid_r(j)), from whichever
// replica cached it. So a replica's steps draw from the whole dataset, each epoch's
// global batches are the same for any replica count, and every row is served once an
// epoch.
//
// The numbering is kept as epoch 0's step layout, not per row: for each step, where each
// replica's rows start among the step's and in the replica's cache (8 x (2R + 2) bytes a
// step). A row's global index and a global index's (replica, row) are binary searches in
// it, in host code and (FERRY_HOST_DEVICE) in a kernel. Host replicas copy the rows here.
// Device replicas (one process): at the end of epoch 0 each replica's device gets the
// layout and, per field, the table of every replica's cache address (16 bytes a step and
// replica, copied once); peer access is enabled between the replicas' devices (a config_error where the
// GPUs cannot read each other's memory: no NVLink or PCIe P2P); each replica's stream
// waits for every replica's epoch-0 copies. Each later epoch, replica r's gather kernel
// reads the rows it serves straight from the other GPUs' caches (cache_on_device.cuh).
// Across processes (MPI ranks) the rows would need an NCCL all-to-all: not built.
// Throws cuda_error, config_error, std::bad_alloc; runs on the stage's caller's thread;
// no user code.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "ferry/config.hpp"
#include "ferry/detail/permutation.hpp"
#include "ferry/error.hpp"
#include "ferry/stages/detail/cache_arena.hpp"

#if defined(FERRY_WITH_CUDART)
#include <cuda_runtime_api.h>

#include "ferry/cuda/error.hpp"
#include "ferry/cuda/stream.hpp"
#endif

namespace ferry::detail {

// Epoch 0's step layout, as plain arrays (host vectors here; device copies for a kernel).
struct cache_layout_view {
  const std::uint64_t* step_base = nullptr;   // steps + 1: the step's first global index (the last: N)
  const std::uint64_t* in_step = nullptr;     // steps x (R + 1): replica r's first row within step k
  const std::uint64_t* local_base = nullptr;  // R x (steps + 1): rows replica r cached before step k
  std::uint64_t steps = 0, replicas = 0;

  // The last i in [0, n) with v[i] <= x (v non-decreasing, v[0] <= x).
  FERRY_HOST_DEVICE static std::uint64_t floor_index(const std::uint64_t* v, std::uint64_t n, std::uint64_t x) noexcept {
    std::uint64_t lo = 0, hi = n;  // v[lo] <= x < v[hi] (v[n] taken as infinite)
    while (hi - lo > 1) {
      const std::uint64_t mid = lo + (hi - lo) / 2;
      if (v[mid] <= x)
        lo = mid;
      else
        hi = mid;
    }
    return lo;
  }
  // The global index of replica r's row j.
  FERRY_HOST_DEVICE std::uint64_t global(std::uint64_t r, std::uint64_t j) const noexcept {
    const std::uint64_t* lb = local_base + r * (steps + 1);
    const std::uint64_t k = floor_index(lb, steps, j);
    return step_base[k] + in_step[k * (replicas + 1) + r] + (j - lb[k]);
  }
  // Where global index g was cached: its replica, and its row there.
  FERRY_HOST_DEVICE void owner(std::uint64_t g, std::uint64_t& r, std::uint64_t& j) const noexcept {
    const std::uint64_t k = floor_index(step_base, steps, g);
    const std::uint64_t o = g - step_base[k];
    const std::uint64_t* row = in_step + k * (replicas + 1);
    r = floor_index(row, replicas, o);
    j = local_base[r * (steps + 1) + k] + (o - row[r]);
  }
};

// One replica's gather of a later epoch (device replicas): its epoch row j of `row_bytes`
// = row i of replica q's cache, (q, i) the owner of perm(layout.global(replica, j)).
// Every pointer is device memory of the replica's device (srcs: one per replica, peers'
// included).
struct global_gather_args {
  const std::byte* const* srcs = nullptr;
  std::byte* dst = nullptr;
  std::uint64_t rows = 0;  // the replica's
  std::size_t row_bytes = 0;
  cache_layout_view layout;
  std::uint64_t replica = 0;
  std::uint64_t total_rows = 0;  // every replica's: the permutation's size
  std::uint64_t key = 0;         // feistel_permutation(total_rows, key)
};

class cache_exchange {
 public:
  cache_exchange() = default;
  cache_exchange(cache_exchange&& o) noexcept
      : step_base_(std::move(o.step_base_)), in_step_(std::move(o.in_step_)), local_base_(std::move(o.local_base_)), replicas_(o.replicas_), dev_(std::move(o.dev_)) {
    o.dev_.clear();
  }
  cache_exchange& operator=(cache_exchange&&) = delete;
  ~cache_exchange() { free_devices(); }

  // Forgets every row (a fill started again, or the cache given up).
  void clear() noexcept {
    free_devices();
    for (std::vector<std::uint64_t>* v : {&step_base_, &in_step_, &local_base_}) v->clear();
    replicas_ = 0;
  }
  // Epoch 0: one step's real rows, valid(r) of them for replica r < replicas. Throws
  // std::bad_alloc.
  template <class Valid>
  void add_step(std::size_t replicas, Valid&& valid) {
    if (step_base_.empty()) {
      replicas_ = replicas;
      step_base_.push_back(0);
    }
    std::uint64_t o = 0;
    for (std::size_t r = 0; r < replicas; ++r) {
      const std::uint64_t v = valid(r);
      in_step_.push_back(o);
      o += v;
    }
    in_step_.push_back(o);
    step_base_.push_back(step_base_.back() + o);
  }
  // The end of epoch 0: each replica's rows before each step. Throws std::bad_alloc.
  void finish() {
    const std::uint64_t s = steps(), R = replicas_;
    local_base_.assign(R * (s + 1), 0);
    for (std::uint64_t r = 0; r < R; ++r)
      for (std::uint64_t k = 0; k < s; ++k)
        local_base_[r * (s + 1) + k + 1] =
            local_base_[r * (s + 1) + k] + in_step_[k * (R + 1) + r + 1] - in_step_[k * (R + 1) + r];
  }
  // Rows numbered so far (epoch 0), all replicas.
  std::uint64_t rows() const noexcept { return step_base_.empty() ? 0 : step_base_.back(); }
  std::uint64_t steps() const noexcept { return step_base_.empty() ? 0 : step_base_.size() - 1; }
  // The layout (after finish()), valid while this object is unchanged.
  cache_layout_view view() const noexcept {
    return {step_base_.data(), in_step_.data(), local_base_.data(), steps(), replicas_};
  }


  // Device replicas, after finish(): the layout and every field's table of cache addresses
  // on each replica's device, peer access enabled, and each replica's stream after every
  // replica's epoch-0 work. Throws config_error (devices that cannot reach each other),
  // cuda_error.
  void to_devices(std::vector<replica_arena>& arenas, std::size_t fields) {
#if defined(FERRY_WITH_CUDART)
    free_devices();
    const cache_layout_view host = view();
    const std::size_t R = arenas.size();
    std::vector<cuda::event> done(R);
    for (std::size_t r = 0; r < R; ++r) {
      const cuda::device_guard g(arenas[r].device);
      done[r] = cuda::event::create();
      done[r].record(static_cast<cudaStream_t>(arenas[r].stream));
    }
    for (std::size_t r = 0; r < R; ++r) {
      const int d = arenas[r].device;
      const cuda::device_guard g(d);
      for (std::size_t q = 0; q < R; ++q) {
        const int pd = arenas[q].device;
        if (pd != d) enable_peer(d, pd);
        if (q != r)
          FERRY_CUDA_TRY(cudaStreamWaitEvent(static_cast<cudaStream_t>(arenas[r].stream), done[q].get(), 0));
      }
      device_side& side = dev_.emplace_back();
      side.device = d;
      side.stream = arenas[r].stream;
      side.step_base = upload(side, host.step_base, host.steps + 1);
      side.in_step = upload(side, host.in_step, host.steps * (R + 1));
      side.local_base = upload(side, host.local_base, R * (host.steps + 1));
      for (std::size_t f = 0; f < fields; ++f) {
        std::vector<const std::byte*> srcs(R);
        for (std::size_t q = 0; q < R; ++q) srcs[q] = arenas[q].cache[f];
        side.srcs.push_back(reinterpret_cast<const std::byte* const*>(upload(side, srcs.data(), R)));
      }
    }
#else
    (void)arenas;
    (void)fields;
    throw config_error("cache_on_device: a device replica in a build without the CUDA runtime (FERRY_WITH_CUDART)");
#endif
  }
  // Replica r's gather of field f (rows of eb bytes) in a later epoch (after to_devices()).
  global_gather_args device_args(std::size_t r, std::size_t f, std::uint64_t rows, std::size_t eb, std::byte* dst,
                                 std::uint64_t key) const noexcept {
    const device_side& d = dev_[r];
    return {d.srcs[f], dst, rows, eb, {d.step_base, d.in_step, d.local_base, steps(), replicas_}, r, this->rows(), key};
  }

  // A later epoch's gathers, every field (field_bytes[f] a row) of every replica: here for
  // host replicas, Launch::launch_global on each replica's stream for device ones.
  template <class Launch>
  void reorder(std::vector<replica_arena>& arenas, const std::size_t* field_bytes, std::size_t fields,
               std::uint64_t key) const {
    if (arenas.empty()) return;
    if (arenas[0].device < 0) {
      for (std::size_t f = 0; f < fields; ++f) gather_host(arenas, f, field_bytes[f], key);
      return;
    }
    for (std::size_t r = 0; r < arenas.size(); ++r) {
#if defined(FERRY_WITH_CUDART)
      const cuda::device_guard g(arenas[r].device);
#endif
      for (std::size_t f = 0; f < fields; ++f)
        Launch::launch_global(device_args(r, f, arenas[r].rows, field_bytes[f], arenas[r].epoch[f], key), arenas[r].stream);
    }
  }

  // A later epoch's field f (rows of eb bytes) for every host replica: replica r's epoch
  // row j = the row with global index perm(gid_r(j)), from its replica's cache.
  void gather_host(std::vector<replica_arena>& arenas, std::size_t f, std::size_t eb, std::uint64_t key) const {
    const feistel_permutation perm(rows(), key);
    const cache_layout_view l = view();
    for (std::size_t r = 0; r < arenas.size() && r < replicas_; ++r) {
      std::byte* dst = arenas[r].epoch[f];
      for (std::uint64_t j = 0; j < arenas[r].rows; ++j) {
        std::uint64_t q = 0, i = 0;
        l.owner(perm(l.global(r, j)), q, i);
        std::memcpy(dst + j * eb, arenas[q].cache[f] + i * eb, eb);
      }
    }
  }

 private:
  // A replica's device copies: the layout's arrays and per field the cache addresses.
  struct device_side {
    int device = -1;
    cuda_stream stream = nullptr;
    const std::uint64_t *step_base = nullptr, *in_step = nullptr, *local_base = nullptr;
    std::vector<const std::byte* const*> srcs;  // per field
    std::vector<void*> blocks;  // everything above, to free
  };

#if defined(FERRY_WITH_CUDART)
  // `n` values to a new block of the side's device (current), at once.
  template <class T>
  static const std::uint64_t* upload(device_side& side, const T* v, std::size_t n) {
    void* p = nullptr;
    FERRY_CUDA_TRY(cudaMalloc(&p, std::max<std::size_t>(n * sizeof(T), 1)));
    side.blocks.push_back(p);
    if (n) FERRY_CUDA_TRY(cudaMemcpy(p, v, n * sizeof(T), cudaMemcpyHostToDevice));
    return static_cast<const std::uint64_t*>(p);
  }
  // Device d (current) reads peer's memory from now on; throws config_error when it cannot.
  static void enable_peer(int d, int peer) {
    int can = 0;
    FERRY_CUDA_TRY(cudaDeviceCanAccessPeer(&can, d, peer));
    if (!can)
      throw config_error("cache_on_device: across_replicas: GPU " + std::to_string(d) + " cannot read GPU " +
                         std::to_string(peer) + "'s memory (no peer access: no NVLink or PCIe P2P between them); "
                         "use across_replicas = false");
    const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled)
      (void)cudaGetLastError();  // enabled before (by this stage or the program): fine
    else
      FERRY_CUDA_TRY(e);
  }
#endif
  // Frees the device copies, after every replica's work that may read them.
  void free_devices() noexcept {
#if defined(FERRY_WITH_CUDART)
    if (dev_.empty()) return;
    int prev = -1;
    if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
    for (const device_side& d : dev_)
      if (cudaSetDevice(d.device) == cudaSuccess) FERRY_CUDA_LOG(cudaStreamSynchronize(static_cast<cudaStream_t>(d.stream)));
    for (const device_side& d : dev_)
      if (cudaSetDevice(d.device) == cudaSuccess)
        for (void* p : d.blocks) FERRY_CUDA_LOG(cudaFree(p));
    if (prev >= 0) FERRY_CUDA_LOG(cudaSetDevice(prev));
#endif
    dev_.clear();
  }

  std::vector<std::uint64_t> step_base_, in_step_, local_base_;
  std::uint64_t replicas_ = 0;
  std::vector<device_side> dev_;  // device replicas: per replica
};

}  // namespace ferry::detail
