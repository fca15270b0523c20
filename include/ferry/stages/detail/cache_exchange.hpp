// ferry/stages/detail/cache_exchange.hpp: cache_on_device's one order across replicas
// (cache_on_device_options::across_replicas). Epoch 0 numbers each cached row with its
// global index: the real rows every replica cached before it, step by step and, within a
// step, replica by replica (the order of the global batches, whatever the replica count).
// Each later epoch is one permutation of all those indices, drawn from (seed, epoch):
// replica r's j-th row is the row whose global index is perm(gid_r[j]), from whichever
// replica cached it. So a replica's steps draw from the whole dataset, each epoch's
// global batches are the same for any replica count, and every row is served once an
// epoch. The host path copies the rows (host replicas); device replicas need the exchange
// between GPUs, which is not built. Memory: 8 bytes per cached row for its index, and a
// table of 8 bytes per row, once. Runs on the stage's caller's thread; no user code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ferry/detail/permutation.hpp"
#include "ferry/error.hpp"
#include "ferry/stages/detail/cache_arena.hpp"

namespace ferry::detail {

class cache_exchange {
 public:
  static constexpr unsigned local_bits = 40;  // a row's index in its replica's cache
  static constexpr std::uint64_t local_mask = (std::uint64_t(1) << local_bits) - 1;

  // Forgets every row (a fill started again, or the cache given up).
  void clear() noexcept {
    gids_.clear();
    where_.clear();
    next_ = 0;
  }
  // Epoch 0: replica r (of `replicas`) cached `rows` more rows, after every row of the
  // replicas before it in this step. Throws std::bad_alloc.
  void add(std::size_t r, std::size_t replicas, std::uint64_t rows) {
    if (gids_.size() < replicas) gids_.resize(replicas);
    for (std::uint64_t i = 0; i < rows; ++i) gids_[r].push_back(next_++);
  }
  // The end of epoch 0: the table from global index to (replica, row). Throws
  // config_error past 2^40 rows in a replica or 2^24 replicas; std::bad_alloc.
  void finish() {
    if (gids_.size() >= (std::size_t(1) << (64 - local_bits)))
      throw config_error("cache_on_device: across_replicas: " + std::to_string(gids_.size()) + " replicas; at most 2^24");
    where_.assign(next_, 0);
    for (std::size_t r = 0; r < gids_.size(); ++r) {
      if (gids_[r].size() > local_mask)
        throw config_error("cache_on_device: across_replicas: replica " + std::to_string(r) + " cached " +
                           std::to_string(gids_[r].size()) + " rows; at most 2^40");
      for (std::uint64_t j = 0; j < gids_[r].size(); ++j) where_[gids_[r][j]] = (std::uint64_t(r) << local_bits) | j;
    }
  }
  // Rows numbered so far (epoch 0), all replicas.
  std::uint64_t rows() const noexcept { return next_; }
  // Bytes of index memory for `rows` rows (a replica's share of the budget).
  static constexpr std::size_t bytes_per_row = 2 * sizeof(std::uint64_t);

  // A later epoch's field f (rows of eb bytes) for every host replica: replica r's epoch
  // row j = the row with global index perm(gid_r[j]), from its replica's cache.
  void gather_host(std::vector<replica_arena>& arenas, std::size_t f, std::size_t eb, std::uint64_t key) const {
    const feistel_permutation perm(next_, key);
    for (std::size_t r = 0; r < arenas.size() && r < gids_.size(); ++r) {
      std::byte* dst = arenas[r].epoch[f];
      for (std::uint64_t j = 0; j < gids_[r].size(); ++j) {
        const std::uint64_t w = where_[perm(gids_[r][j])];
        std::memcpy(dst + j * eb, arenas[w >> local_bits].cache[f] + (w & local_mask) * eb, eb);
      }
    }
  }

 private:
  std::vector<std::vector<std::uint64_t>> gids_;  // per replica, each cached row's global index
  std::vector<std::uint64_t> where_;  // global index -> replica << 40 | row
  std::uint64_t next_ = 0;
};

}  // namespace ferry::detail
