// ferry/stages/cache_on_device.hpp: after the first epoch, steps come from each replica's
// own memory: no host reads, no host-to-device copies.
//
//   auto steps = ferry::global_shuffle(rows, {.seed = 7, .global_batch = 384})
//              | ferry::map(decode) | ferry::batch(384)
//              | ferry::distribute(ferry::cuda::devices{0, 1, 2})
//              | ferry::cuda::cache_on_device({.budget_bytes = 40ull << 30, .seed = 7});   // cache_on_device.cuh
//   for (int e = 0; e < epochs; ++e, steps.rewind())
//     for (auto& st : steps) train(st);
//
// Epoch 0 passes distribute's steps through and keeps each replica's real rows (valid())
// in that replica's memory: device memory for a GPU replica (copied device to device on
// the replica's stream, in stream order with the step), host memory for a host replica.
// rewind() then never reads the upstream again: each later epoch, each replica's rows are
// put in a new order (a Feistel permutation of its rows drawn from (seed, epoch, replica),
// computed in the kernel: nothing is copied from the host) by one gather per field into a
// second buffer, and steps are views of it: step s is rows [s * B, (s + 1) * B) of it, B
// the replica's rows per step in epoch 0. Every epoch has epoch 0's step count on every
// replica. So a dataset split over N GPUs costs each about 2 x (its rows) x (row bytes) of
// device memory: the cache, and the epoch's shuffled copy (once when shuffle = false: steps
// are views of the cache). Rows stay with the replica that cached them: each replica
// reshuffles its own part (the exchange between replicas is not built yet).
//
// The budget (per replica, bytes, the cache and the shuffled copy together; 0: none):
// over_budget::error throws config_error at the step that would exceed it, naming the
// replica and the size reached; over_budget::stream gives up the cache there (freed) and
// passes the upstream through every epoch, as if the stage were not there. Memory is never
// allocated past the budget: the cache grows by doubling, capped at the budget.
//
// Fields: fixed-size fields only (a ragged or padded field is a compile-time error). A
// cached step's host_batch() is empty (no host batch exists).
//
// Threads: none of its own; runs on the thread calling next(). The device path enqueues
// copies and the gather on each replica's stream (the stream distribute gave it), so a
// consumer that enqueues its work on rb.stream() is ordered after them, and the next
// epoch's gather after that work.
//
// Errors: config_error for a ragged or padded upstream step (compile time), over budget
// (over_budget::error), replicas, devices or streams that change between steps, a device replica
// with the host-only stage (use ferry::cuda::cache_on_device from the .cuh), restore of a
// state (a cache cannot be checkpointed: cannot_save). cuda_error from the runtime
// (an allocation that fails part way frees what was allocated; the stage is then empty
// and rewinding streams from the upstream again).
//
// Memory: see above; the arenas are freed with the stage. Host replicas: std::vector
// buffers grown by doubling in epoch 0, nothing allocated in later epochs.
//
// Checkpoints: none (cannot_save: the cache is memory, not a position; a resumed job
// fills it again in its first epoch).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ferry/config.hpp"
#include "ferry/detail/permutation.hpp"
#include "ferry/detail/random.hpp"
#include "ferry/error.hpp"
#include "ferry/source.hpp"
#include "ferry/stage.hpp"
#include "ferry/step.hpp"

#if defined(FERRY_WITH_CUDART)
#include <cuda_runtime_api.h>

#include "ferry/cuda/error.hpp"
#include "ferry/cuda/stream.hpp"
#endif

namespace ferry {

// What cache_on_device does when a replica's cache would pass the budget.
enum class over_budget {
  error,   // config_error naming the replica and the bytes reached
  stream,  // give the cache up and pass the upstream through every epoch
};

// cache_on_device's options.
struct cache_on_device_options {
  std::size_t budget_bytes = 0;  // per replica: the cache and the epoch's shuffled copy; 0: no limit
  over_budget when_over = over_budget::error;  // see over_budget
  std::uint64_t seed = 0;  // with the epoch and the replica, fixes each epoch's order
  bool shuffle = true;     // a new order of each replica's rows every epoch
};

namespace detail {

// A gather: dst row p = src row perm(p) (perm: feistel_permutation(rows, key), or the
// identity without shuffle), row_bytes each, on `stream` (device memory) or now (host).
struct gather_args {
  const std::byte* src = nullptr;
  std::byte* dst = nullptr;
  std::uint64_t rows = 0;
  std::size_t row_bytes = 0;
  std::uint64_t key = 0;
  bool shuffle = true;
};

// The host gather (host replicas; the oracle of the device one).
inline void gather_rows_host(const gather_args& a) {
  const feistel_permutation perm(a.rows, a.key);
  for (std::uint64_t p = 0; p < a.rows; ++p)
    std::memcpy(a.dst + p * a.row_bytes, a.src + (a.shuffle ? perm(p) : p) * a.row_bytes, a.row_bytes);
}

// The launcher of the host-only stage: a device replica is a config_error.
struct no_gather_kernel {
  [[noreturn]] static void launch(const gather_args&, cuda_stream) {
    throw config_error("cache_on_device: a device replica needs the gather kernel: include "
                       "ferry/stages/cache_on_device.cuh (nvcc) and use ferry::cuda::cache_on_device");
  }
};

// One replica's memory: per field, the cache (rows as cached) and this epoch's copy.
struct replica_arena {
  int device = -1;  // -1: host memory
  cuda_stream stream = nullptr;
  std::vector<std::byte*> cache, epoch;  // per field (device pointers, or into host_*)
  std::vector<std::size_t> capacity;     // rows each field's cache holds
  std::vector<std::vector<std::byte>> host_cache, host_epoch;
  std::uint64_t rows = 0;  // rows cached
};

template <source Up, class Launch>
class cache_on_device_source : public stage<cache_on_device_source<Up, Launch>, Up> {
  friend stage<cache_on_device_source, Up>;
  using V = value_t<Up>;
  using T = typename step_element<V>::type;  // cache_on_device goes after distribute()
  static constexpr std::size_t nf = batch_of<T>::field_count;
  static_assert([]<std::size_t... I>(std::index_sequence<I...>) {
    return (!(batch_of<T>::template is_padded<I> || batch_of<T>::template is_ragged<I>) && ...);
  }(std::make_index_sequence<nf>{}), "ferry::cache_on_device: fixed-size fields only (no ragged or padded field)");

 public:
  static constexpr char name[] = "cache_on_device";
  static constexpr bool changes_batch_size = true;  // steps, not batches
  static constexpr bool cannot_save = true;         // the cache is memory, not a position

  cache_on_device_source(Up up, cache_on_device_options o) : stage<cache_on_device_source, Up>(std::move(up)), o_(o) {}
  cache_on_device_source(cache_on_device_source&&) noexcept = default;
  cache_on_device_source& operator=(cache_on_device_source&& o) noexcept {
    if (this != &o) {
      free_all();
      stage<cache_on_device_source, Up>::operator=(std::move(o));
      o_ = o.o_;
      arenas_ = std::move(o.arenas_);
      state_ = o.state_;
      filled_ = o.filled_;
      epoch_ = o.epoch_;
      steps_ = o.steps_;
      step_ = o.step_;
      rows_per_step_ = std::move(o.rows_per_step_);
      row_bytes_ = o.row_bytes_;
      field_bytes_ = o.field_bytes_;
      empty_ = std::move(o.empty_);
    }
    return *this;
  }
  ~cache_on_device_source() { free_all(); }

  // Whether later epochs come from the caches (false while filling, and after giving up).
  bool cached() const noexcept { return state_ == mode::serving; }
  // Rows cached by replica r (r < replicas seen).
  std::uint64_t rows(std::size_t r) const { return arenas_.at(r).rows; }
  // Bytes of memory each replica holds for it at most (the cache and the epoch's copy).
  std::size_t bytes_per_replica() const noexcept {
    std::size_t m = 0;
    for (const auto& a : arenas_) m = std::max(m, footprint(a.rows));
    return m;
  }

 private:
  enum class mode { filling, serving, streaming };

  std::optional<V> pull() {
    if (state_ == mode::serving) return serve();
    std::optional<V> st = this->pull_up();
    if (state_ == mode::streaming) return st;
    if (!st) {
      filled_ = steps_ > 0;  // the whole epoch is cached
      return st;
    }
    bool kept = false;
    try {
      kept = keep(*st);
    } catch (...) {
      free_all();  // nothing half cached is ever served
      state_ = mode::streaming;
      throw;
    }
    if (!kept) {  // over budget, over_budget::stream
      free_all();
      state_ = mode::streaming;
    }
    ++steps_;
    return st;
  }

  void start_epoch() {
    ++epoch_;
    step_ = 0;
    if (state_ == mode::filling) {
      if (filled_) {
        state_ = mode::serving;
      } else {  // epoch 0 stopped part way: fill again from the start
        free_all();
        steps_ = 0;
      }
    }
    if (state_ == mode::serving) reorder();
  }
  // rewind(): the base rewinds the upstream first; when serving it is never read again.

  // Bytes a replica of `rows` cached rows holds (the cache, and the epoch's copy).
  std::size_t footprint(std::uint64_t rows) const noexcept {
    return std::size_t(rows) * row_bytes_ * (o_.shuffle ? 2 : 1);
  }

  // Epoch 0: appends each replica's real rows to its cache; false when over budget under
  // over_budget::stream.
  bool keep(const V& st) {
    if (arenas_.empty()) {
      arenas_.resize(st.replicas());
      for (std::size_t r = 0; r < st.replicas(); ++r) {
        auto& a = arenas_[r];
        a.device = st[r].device();
        a.stream = st[r].stream();
        a.cache.assign(nf, nullptr);
        a.epoch.assign(nf, nullptr);
        a.capacity.assign(nf, 0);
        a.host_cache.resize(nf);
        a.host_epoch.resize(nf);
      }
      rows_per_step_.assign(st.replicas(), 0);
      row_bytes_ = 0;
      for (std::size_t f = 0; f < nf; ++f) row_bytes_ += (field_bytes_[f] = elem_bytes(st, f));
    }
    if (st.replicas() != arenas_.size())
      throw config_error("cache_on_device: steps of " + std::to_string(st.replicas()) + " replicas after " +
                         std::to_string(arenas_.size()));
    for (std::size_t r = 0; r < st.replicas(); ++r) {
      const auto& rb = st[r];
      auto& a = arenas_[r];
      if (rb.device() != a.device || rb.stream() != a.stream)  // the copies and gathers are ordered on one stream
        throw config_error("cache_on_device: replica " + std::to_string(r) + " changed device or stream between "
                           "steps (device " + std::to_string(a.device) + " to " + std::to_string(rb.device()) + ")");
      rows_per_step_[r] = std::max(rows_per_step_[r], rb.size());
      const std::uint64_t add = rb.valid();
      if (add == 0) continue;
      const std::uint64_t want = a.rows + add;
      if (o_.budget_bytes && footprint(want) > o_.budget_bytes) {
        if (o_.when_over == over_budget::stream) return false;
        throw config_error("cache_on_device: replica " + std::to_string(r) + " needs more than its budget of " +
                           std::to_string(o_.budget_bytes) + " bytes: at step " + std::to_string(steps_) +
                           " its cache reaches " + std::to_string(footprint(want)) + " bytes (" +
                           std::to_string(want) + " rows of " + std::to_string(row_bytes_) + " bytes" +
                           (o_.shuffle ? ", twice: the cache and the epoch's shuffled copy" : "") +
                           "); raise budget_bytes, or choose over_budget::stream");
      }
      for (std::size_t f = 0; f < nf; ++f) {
        const std::size_t eb = elem_bytes(st, f);
        grow(a, f, want, eb);
        copy_in(a, f, a.rows * eb, rb.field_bytes(f).data(), add * eb);
      }
      a.rows = want;
    }
    return true;
  }

  static std::size_t elem_bytes(const V& st, std::size_t f) {
    const auto& rb = st[0];
    return rb.size() ? rb.field_bytes(f).size() / rb.size() : st.host_batch().element_bytes(f);
  }

  // Room for `rows` rows of field f: doubling, capped by the budget.
  void grow(replica_arena& a, std::size_t f, std::uint64_t rows, std::size_t eb) {
    if (rows <= a.capacity[f]) return;
    std::uint64_t cap = std::max<std::uint64_t>(rows, a.capacity[f] * 2);
    if (o_.budget_bytes) {
      const std::uint64_t limit = o_.budget_bytes / (row_bytes_ * (o_.shuffle ? 2 : 1));
      cap = std::max(rows, std::min(cap, limit));
    }
    if (a.device < 0) {
      a.host_cache[f].resize(std::size_t(cap) * eb);
      a.cache[f] = a.host_cache[f].data();
    } else {
#if defined(FERRY_WITH_CUDART)
      const cuda::device_guard g(a.device);
      void* p = nullptr;
      FERRY_CUDA_TRY(cudaMalloc(&p, std::size_t(cap) * eb));
      if (a.cache[f]) {
        const cudaError_t c = cudaMemcpyAsync(p, a.cache[f], std::size_t(a.rows) * eb, cudaMemcpyDeviceToDevice,
                                              static_cast<cudaStream_t>(a.stream));
        const cudaError_t s = c == cudaSuccess ? cudaStreamSynchronize(static_cast<cudaStream_t>(a.stream)) : c;
        if (s != cudaSuccess) {
          FERRY_CUDA_LOG(cudaFree(p));
          FERRY_CUDA_TRY(s);
        }
        FERRY_CUDA_LOG(cudaFree(a.cache[f]));
      }
      a.cache[f] = static_cast<std::byte*>(p);
#else
      throw config_error("cache_on_device: a device replica in a build without the CUDA runtime (FERRY_WITH_CUDART)");
#endif
    }
    a.capacity[f] = std::size_t(cap);
  }

  void copy_in(replica_arena& a, std::size_t f, std::size_t at, const std::byte* src, std::size_t n) {
    if (a.device < 0) {
      std::memcpy(a.cache[f] + at, src, n);
      return;
    }
#if defined(FERRY_WITH_CUDART)
    const cuda::device_guard g(a.device);
    // On the replica's stream: after the step's own copy, before the consumer's work and
    // the release of the step's buffers.
    FERRY_CUDA_TRY(cudaMemcpyAsync(a.cache[f] + at, src, n, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(a.stream)));
#endif
  }

  // A new epoch's order: each field's rows gathered into the epoch buffer (or, without
  // shuffle, the cache itself serves).
  void reorder() {
    for (std::size_t r = 0; r < arenas_.size(); ++r) {
      auto& a = arenas_[r];
      if (!o_.shuffle || a.rows == 0) continue;
      const std::uint64_t key = mix_seed({0x646576636163ull /* "devcac" */, o_.seed, epoch_, r});
      for (std::size_t f = 0; f < nf; ++f) {
        const std::size_t eb = field_bytes_[f];
        if (!a.epoch[f]) alloc_epoch(a, f, eb);
        const gather_args g{a.cache[f], a.epoch[f], a.rows, eb, key, true};
        if (a.device < 0) {
          gather_rows_host(g);
        } else {
#if defined(FERRY_WITH_CUDART)
          const cuda::device_guard dg(a.device);
#endif
          Launch::launch(g, a.stream);
        }
      }
    }
  }
  void alloc_epoch(replica_arena& a, std::size_t f, std::size_t eb) {
    const std::size_t bytes = std::size_t(a.rows) * eb;
    if (a.device < 0) {
      a.host_epoch[f].resize(bytes);
      a.epoch[f] = a.host_epoch[f].data();
      return;
    }
#if defined(FERRY_WITH_CUDART)
    const cuda::device_guard g(a.device);
    void* p = nullptr;
    FERRY_CUDA_TRY(cudaMalloc(&p, std::max<std::size_t>(bytes, 1)));
    a.epoch[f] = static_cast<std::byte*>(p);
#endif
  }

  // A later epoch's step: each replica's next rows of its epoch buffer, as views.
  std::optional<V> serve() {
    if (step_ >= steps_) return std::nullopt;
    if (!empty_) empty_ = std::make_shared<const batch_of<T>>();
    V s = step_access::make<T>(empty_, arenas_.size(), step_);
    for (std::size_t r = 0; r < arenas_.size(); ++r) {
      const auto& a = arenas_[r];
      const std::uint64_t b = rows_per_step_[r], first = std::min<std::uint64_t>(step_ * b, a.rows);
      const std::uint64_t n = std::min<std::uint64_t>(b, a.rows - first);
      std::array<const std::byte*, nf> data{};
      for (std::size_t f = 0; f < nf; ++f)
        data[f] = (o_.shuffle ? a.epoch[f] : a.cache[f]) + first * field_bytes_[f];
      const replica_slice sl{std::size_t(first), std::size_t(n), std::size_t(n)};
      set_fixed_replica(s[r], data.data(), field_bytes_.data(), sl, a.device, a.stream);
    }
    ++step_;
    return s;
  }

  void free_all() noexcept {
    for (auto& a : arenas_) {
      if (a.device >= 0) {
#if defined(FERRY_WITH_CUDART)
        int prev = -1;
        if (cudaGetDevice(&prev) == cudaSuccess && prev != a.device) FERRY_CUDA_LOG(cudaSetDevice(a.device));
        if (a.stream) FERRY_CUDA_LOG(cudaStreamSynchronize(static_cast<cudaStream_t>(a.stream)));
        for (std::byte* p : a.cache)
          if (p) FERRY_CUDA_LOG(cudaFree(p));
        for (std::byte* p : a.epoch)
          if (p) FERRY_CUDA_LOG(cudaFree(p));
        if (prev >= 0 && prev != a.device) FERRY_CUDA_LOG(cudaSetDevice(prev));
#endif
      }
    }
    arenas_.clear();
    filled_ = false;
  }

  cache_on_device_options o_;
  std::vector<replica_arena> arenas_;
  mode state_ = mode::filling;
  bool filled_ = false;  // epoch 0 read to its end with every step cached
  std::uint64_t epoch_ = 0, steps_ = 0, step_ = 0;  // steps: epoch 0's count
  std::vector<std::size_t> rows_per_step_;
  std::size_t row_bytes_ = 0;
  std::array<std::size_t, nf> field_bytes_{};
  std::shared_ptr<const batch_of<T>> empty_;
};

// The type of ferry::cache_on_device (Launch: the device gather; the .cuh's for GPUs).
template <class Launch>
struct cache_on_device_t {
  // cache_on_device(steps, options): the stage over steps (moved in).
  template <source S>
  auto operator()(S&& s, cache_on_device_options o) const {
    require_rvalue_source<S>();
    return cache_on_device_source<std::remove_cvref_t<S>, Launch>(std::forward<S>(s), o);
  }
  // cache_on_device(options): a closure for `steps | cache_on_device(options)`.
  auto operator()(cache_on_device_options o = {}) const {
    return make_closure([o]<class S>(S&& s) { return cache_on_device_t{}(std::forward<S>(s), o); });
  }
};

}  // namespace detail

// cache_on_device(options): later epochs from each replica's memory (see the file's top).
// Host replicas only here; ferry::cuda::cache_on_device (cache_on_device.cuh) for GPUs.
inline constexpr detail::cache_on_device_t<detail::no_gather_kernel> cache_on_device{};

}  // namespace ferry
