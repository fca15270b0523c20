// ferry/stages/detail/cache_arena.hpp: cache_on_device's memory: one replica's blocks
// (host vectors, or device memory on the replica's stream), and the gather's host path.
// Throws cuda_error (device), std::bad_alloc (host), config_error (a device replica in a
// build without the CUDA runtime); runs on the stage's caller's thread.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ferry/config.hpp"
#include "ferry/cuda/stream_handle.hpp"
#include "ferry/detail/permutation.hpp"
#include "ferry/detail/random.hpp"
#include "ferry/error.hpp"
#include "ferry/step.hpp"

#if defined(FERRY_WITH_CUDART)
#include <cuda_runtime_api.h>

#include "ferry/cuda/error.hpp"
#include "ferry/cuda/stream.hpp"
#endif

namespace ferry::detail {

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
  template <class Args>
  [[noreturn]] static void launch_global(const Args&, cuda_stream) {
    launch({}, nullptr);
  }
};

// The bytes a replica holds after epoch 0 with `rows` rows cached and `served` served
// (under pad, with its steps' padding rows): the cache (trimmed to its rows with shuffle,
// unless a device_exchange swaps it with the epoch block), the epoch's shuffled copy, and
// a device_exchange's buffers (the widest field, 16 plan and 48 sort bytes a cached row).
inline std::size_t cache_bytes(std::uint64_t rows, std::uint64_t served, std::size_t row_bytes, std::size_t widest,
                               bool shuffle, bool devices) noexcept {
  const std::uint64_t cache = shuffle && !devices ? rows : served;
  return std::size_t(cache + (shuffle ? served : 0)) * row_bytes + (devices ? std::size_t(rows) * (widest + 64) : 0);
}

// The config_error of a replica over its budget (over_budget::error): replica r, at step
// `step`, would hold `bytes` for `rows` rows of row_bytes (per_row bytes each with the
// shuffled copy and the exchange's buffers) and `pad` padding rows served with them.
[[noreturn]] inline void throw_over_budget(std::size_t r, std::size_t budget, std::uint64_t step, std::uint64_t rows,
                                           std::uint64_t pad, std::size_t row_bytes, std::size_t per_row,
                                           std::size_t bytes) {
  throw config_error("cache_on_device: replica " + std::to_string(r) + " needs more than its budget of " +
                     std::to_string(budget) + " bytes: at step " + std::to_string(step) + " its cache reaches " +
                     std::to_string(bytes) + " bytes (" + std::to_string(rows) + " rows of " +
                     std::to_string(row_bytes) + " bytes" +
                     (per_row == 2 * row_bytes ? std::string(", twice: the cache and the epoch's shuffled copy")
                      : per_row > row_bytes ? ", " + std::to_string(per_row) + " a row with the epoch's shuffled copy "
                                              "and the exchange's buffers" : std::string()) +
                     (pad ? ", and " + std::to_string(pad) + " zero rows padding its served steps (remainder_policy::pad)"
                          : std::string()) +
                     "); raise budget_bytes, or choose over_budget::stream");
}

// A step's field f bytes a row (V: distribute's step).
template <class V>
std::size_t step_field_bytes(const V& st, std::size_t f) {
  const auto& rb = st[0];
  return rb.size() ? rb.field_bytes(f).size() / rb.size() : st.host_batch().element_bytes(f);
}

// One replica's memory: per field, the cache (rows as cached; with a device_exchange, the
// block the next epoch's trade fills: the two swap each epoch) and this epoch's copy, each
// one block (device memory, or a host vector).
struct replica_arena {
  int device = -1;  // -1: host memory
  cuda_stream stream = nullptr;
  std::vector<std::byte*> cache, epoch;  // per field
  std::vector<std::uint64_t> capacity;   // rows each field's cache block holds
  std::vector<std::vector<std::byte>> host_cache, host_epoch;
  std::uint64_t rows = 0;   // rows cached
  std::uint64_t served = 0;  // rows the serving buffer holds: steps x rows a step (pad rows zero)
  std::size_t bytes = 0;    // memory held
};

// A new replica's arena, with nf fields and nothing cached.
inline void arena_init(replica_arena& a, int device, cuda_stream stream, std::size_t nf) {
  a.device = device;
  a.stream = stream;
  a.cache.assign(nf, nullptr);
  a.epoch.assign(nf, nullptr);
  a.capacity.assign(nf, 0);
  a.host_cache.resize(nf);
  a.host_epoch.resize(nf);
}

// Gives a block back (device: after the work enqueued on the replica's stream).
inline void arena_release(replica_arena& a, std::byte* p, std::size_t bytes) noexcept {
  a.bytes -= std::min(a.bytes, bytes);
  if (a.device < 0 || !p) return;
#if defined(FERRY_WITH_CUDART)
  const cuda::device_restore keep(a.device);
  FERRY_CUDA_LOG(cudaStreamSynchronize(static_cast<cudaStream_t>(a.stream)));
  FERRY_CUDA_LOG(cudaFree(p));
#endif
}
// A block of `bytes` in the replica's memory (host blocks zeroed; device ones zeroed on
// the stream when asked).
inline std::byte* arena_alloc(replica_arena& a, std::vector<std::byte>& host, std::size_t bytes, bool zero) {
  if (a.device < 0) {
    std::vector<std::byte> v(bytes);  // exactly: never more than asked
    host.swap(v);
    a.bytes += bytes;
    return host.data();
  }
#if defined(FERRY_WITH_CUDART)
  const cuda::device_guard g(a.device);
  void* p = nullptr;
  FERRY_CUDA_TRY(cudaMalloc(&p, std::max<std::size_t>(bytes, 1)));
  a.bytes += bytes;
  if (zero) {
    const cudaError_t z = cudaMemsetAsync(p, 0, bytes, static_cast<cudaStream_t>(a.stream));
    if (z != cudaSuccess) {
      arena_release(a, static_cast<std::byte*>(p), bytes);
      FERRY_CUDA_TRY(z);
    }
  }
  return static_cast<std::byte*>(p);
#else
  (void)zero;
  throw config_error("cache_on_device: a device replica in a build without the CUDA runtime (FERRY_WITH_CUDART)");
#endif
}
// Field f's cache block (rows of eb bytes) resized to exactly `cap` rows, its first `keep`
// rows copied, the rest zero.
inline void arena_resize(replica_arena& a, std::size_t f, std::size_t eb, std::uint64_t cap, std::uint64_t keep) {
  std::vector<std::byte> host;
  std::byte* p = arena_alloc(a, host, std::size_t(cap) * eb, cap > keep);
  if (a.cache[f] && keep) {
    if (a.device < 0) {
      std::memcpy(p, a.cache[f], std::size_t(keep) * eb);
    } else {
#if defined(FERRY_WITH_CUDART)
      const cuda::device_guard g(a.device);
      const cudaError_t c = cudaMemcpyAsync(p, a.cache[f], std::size_t(keep) * eb, cudaMemcpyDeviceToDevice,
                                            static_cast<cudaStream_t>(a.stream));
      if (c != cudaSuccess) {
        arena_release(a, p, std::size_t(cap) * eb);
        FERRY_CUDA_TRY(c);
      }
#endif
    }
  }
  arena_release(a, a.device < 0 ? nullptr : a.cache[f], std::size_t(a.capacity[f]) * eb);
  if (a.device < 0) a.host_cache[f].swap(host);
  a.cache[f] = p;
  a.capacity[f] = cap;
}

// n bytes from src (the replica's memory) to byte `at` of field f's cache, on the
// replica's stream.
inline void arena_copy_in(replica_arena& a, std::size_t f, std::size_t at, const std::byte* src, std::size_t n) {
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


// The end of epoch 0 for a replica of `slots` = steps x rows a step: its serving buffer
// holds its cached rows, then under pad zero rows up to `slots`: the cache itself without
// shuffle, trimmed to that; with shuffle the cache is trimmed to its rows (with a
// device_exchange to the serving rows: the two blocks trade places each epoch) and the
// epoch block made.
inline void arena_finish(replica_arena& a, std::uint64_t slots, bool padded, bool shuffle, bool devices,
                         const std::size_t* field_bytes, std::size_t fields) {
  const std::uint64_t serve_rows = padded ? std::max(a.rows, slots) : a.rows;
  a.served = serve_rows;
  for (std::size_t f = 0; f < fields; ++f) {
    if (!shuffle) {
      if (a.capacity[f] != serve_rows) arena_resize(a, f, field_bytes[f], serve_rows, a.rows);
      continue;
    }
    if (const std::uint64_t keep = devices ? serve_rows : a.rows; a.capacity[f] != keep)
      arena_resize(a, f, field_bytes[f], keep, a.rows);
    a.epoch[f] = arena_alloc(a, a.host_epoch[f], std::size_t(serve_rows) * field_bytes[f], serve_rows > a.rows);
  }
}

// Gives a device replica's blocks back (a host replica's vectors go with the arena).
inline void arena_free(replica_arena& a) noexcept {
  if (a.device < 0) return;
  for (std::size_t f = 0; f < a.cache.size(); ++f) {
    arena_release(a, a.cache[f], 0);
    arena_release(a, a.epoch[f], 0);
  }
}

// A later epoch's step of a replica: its rows [first, end) in epoch 0's layout (the real
// rows it had at that step); under pad, the slice keeps epoch 0's size b, its padding rows
// past the real ones (only the last step is padded: every earlier one has b real rows).
inline replica_slice served_slice(const replica_arena& a, std::uint64_t first, std::uint64_t end, std::uint64_t b,
                                  bool padded) noexcept {
  const std::uint64_t real = end - first;
  return {std::size_t(first), std::size_t(padded ? std::min<std::uint64_t>(b, a.served - first) : real), std::size_t(real)};
}

// Room for `rows` rows of field f (eb bytes each): doubling, capped at max_rows (0: none).
inline void arena_grow(replica_arena& a, std::size_t f, std::size_t eb, std::uint64_t rows, std::uint64_t max_rows) {
  if (rows <= a.capacity[f]) return;
  std::uint64_t cap = std::max<std::uint64_t>(rows, a.capacity[f] * 2);
  if (max_rows) cap = std::max(rows, std::min(cap, max_rows));
  arena_resize(a, f, eb, cap, a.rows);
}

// Each replica's own rows in a new order (without across_replicas): one gather per field
// into its epoch block, one key per replica from (seed, epoch, replica), so that its fields
// stay together; on the replica's stream (Launch) for a device replica.
template <class Launch>
void gather_own(std::vector<replica_arena>& arenas, const std::size_t* field_bytes, std::size_t fields,
                std::uint64_t seed, std::uint64_t epoch) {
  for (std::size_t r = 0; r < arenas.size(); ++r) {
    replica_arena& a = arenas[r];
    if (a.rows == 0) continue;
    const std::uint64_t key = mix_seed({0x646576636163ull /* "devcac" */, seed, epoch, r});
    for (std::size_t f = 0; f < fields; ++f) {
      const gather_args g{a.cache[f], a.epoch[f], a.rows, field_bytes[f], key, true};
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
}  // namespace ferry::detail
