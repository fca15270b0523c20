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
// it, in host code and (FERRY_HOST_DEVICE) in a kernel. The host path copies the rows
// (host replicas); device replicas need the exchange between GPUs, which is not built.
// Runs on the stage's caller's thread; no user code.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ferry/config.hpp"
#include "ferry/detail/permutation.hpp"
#include "ferry/error.hpp"
#include "ferry/stages/detail/cache_arena.hpp"

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

class cache_exchange {
 public:
  // Forgets every row (a fill started again, or the cache given up).
  void clear() noexcept {
    step_base_.clear();
    in_step_.clear();
    counts_.clear();
    local_base_.clear();
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
      counts_.push_back(v);
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
        local_base_[r * (s + 1) + k + 1] = local_base_[r * (s + 1) + k] + counts_[k * R + r];
  }
  // Rows numbered so far (epoch 0), all replicas.
  std::uint64_t rows() const noexcept { return step_base_.empty() ? 0 : step_base_.back(); }
  std::uint64_t steps() const noexcept { return step_base_.empty() ? 0 : step_base_.size() - 1; }
  // The layout (after finish()), valid while this object is unchanged.
  cache_layout_view view() const noexcept {
    return {step_base_.data(), in_step_.data(), local_base_.data(), steps(), replicas_};
  }
  // Bytes the layout takes (a step's entries; no memory per row).
  std::size_t bytes() const noexcept {
    return (step_base_.size() + in_step_.size() + counts_.size() + local_base_.size()) * sizeof(std::uint64_t);
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
  std::vector<std::uint64_t> step_base_, in_step_, counts_, local_base_;
  std::uint64_t replicas_ = 0;
};

}  // namespace ferry::detail
