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
// it, in host code and (FERRY_HOST_DEVICE) in a kernel (host code walks a replica's rows
// step by step, so a row's own global index needs no search). Host replicas copy the rows
// here.
// Device replicas (one process): at the end of epoch 0 each replica's device gets the
// layout and, per field, the table of every replica's cache address (16 bytes a step and
// replica, copied once); peer access is enabled between the replicas' devices (a config_error where the
// GPUs cannot read each other's memory: no NVLink or PCIe P2P); each replica's stream
// waits for every replica's epoch-0 copies. Each later epoch, replica r's gather kernel
// reads the rows it serves straight from the other GPUs' caches (cache_on_device.cuh).
// Across processes (host replicas, a rank_exchange: MPI): at the end of epoch 0 the ranks
// gather each other's layouts (every rank then holds the whole job's, 16 bytes a step and
// replica of the job), global replica w x R + r being rank w's replica r (the order of
// global_shuffle's parts); each later epoch every rank asks each other rank for the rows
// it serves that rank cached (their global indices, one all-to-all) and gets them (one
// all-to-all per field). Where local work may fail on one rank only (the end of epoch 0,
// a reorder's allocations) the ranks then agree (settle) and all throw or none does, so
// no rank waits in a collective another will not call.
// GPU replicas with a device_exchange (NCCL: across ranks, or GPUs without peer access):
// each replica has two blocks a field, the rows in the order they are held (the served
// epoch's) and the other; an epoch's trade moves every row from where it is held to where
// the next epoch serves it. Each replica plans its part on its device (exchange_plan_args:
// its held rows sorted by where they go, through the new permutation's inverse, and its
// new rows by where they come from, through the held order's inverse; the per-replica
// counts come back to the host, 16 bytes a replica pair), then per field packs its
// outgoing rows into the other block, trades them by one all-to-all (grouped
// ncclSend/ncclRecv) into a receive buffer, and scatters them to their places there.
// Nothing is copied from the host after epoch 0. Plans and trades run on a side stream,
// one epoch ahead: at the rewind into epoch e, each replica's stream waits for epoch e's
// trade (made while epoch e - 1 was served) and the blocks swap; epoch e + 1's trade
// begins, its units (a field's slice of every replica pair's run) enqueued on the side
// stream as epoch e's steps are served, a few a step (on_step), after epoch e - 1's steps
// (which read the block they write), and after the last unit the plan of the trade after
// it. NCCL runs one communicator's calls in the order they are made, whatever the stream,
// so a whole trade would hold the epoch's first all-reduce back; a unit holds one back by a
// unit's time. The units end two steps before the epoch does, so a rewind's one wait, for
// the plan after the last unit, finds its counts on the host (the first rewind plans and
// trades epoch 1 in line, from the rows as cached). A trade's failure is kept until the
// rewind (the served epoch is whole); a rank whose launch failed still makes its NCCL
// calls, one whose NCCL call failed aborts the device_exchange and throws it at once; at
// the rewind the ranks settle before an NCCL call or a host wait could depend on it, and
// all give up (the others aborting too when a call failed) or none does.
// Throws cuda_error, config_error, std::bad_alloc, what the rank_exchange and the
// device_exchange throw; runs on the stage's caller's thread; no user code.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <string>
#include <vector>

#include "ferry/collective/device_exchange.hpp"
#include "ferry/collective/rank_exchange.hpp"
#include "ferry/config.hpp"
#include "ferry/detail/permutation.hpp"
#include "ferry/error.hpp"
#include "ferry/sources/global_shuffle.hpp"
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

  // The last i in [0, n) with v[i] <= x (v non-decreasing, v[0] <= x). Branch-free: the
  // searched values are random (a shuffle), so a branch would mispredict half the time.
  FERRY_HOST_DEVICE static std::uint64_t floor_index(const std::uint64_t* v, std::uint64_t n, std::uint64_t x) noexcept {
    std::uint64_t lo = 0;  // v[lo] <= x; the answer is in [lo, lo + n)
    while (n > 1) {
      const std::uint64_t half = n / 2;
      lo = v[lo + half] <= x ? lo + half : lo;
      n -= half;
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

// One replica's plan of a later epoch's trade (device_exchange), made on its device, from
// the order its rows are held in (row i holds global index from(gid_r(i)): `from` the
// permutation of from_key, or the identity: the rows as cached) to the epoch's (row i
// holds perm(gid_r(i))): send_rows = its held rows ordered by (destination replica,
// destination row), send_at[q] where destination q's start (G + 1 values); recv_rows = its
// epoch rows ordered by (source replica, epoch row), recv_at alike. So what replica q sends
// to r, in order, is what r expects from q, in order. Every pointer is device memory of the
// replica's device.
struct exchange_plan_args {
  cache_layout_view layout;
  std::uint64_t replica = 0;     // global
  std::uint64_t rows = 0;        // its cached rows (its epoch rows too)
  std::uint64_t total_rows = 0;  // every replica's: the permutation's size
  std::uint64_t key = 0;         // feistel_permutation(total_rows, key)
  std::uint64_t *send_rows = nullptr, *recv_rows = nullptr;  // rows each
  std::uint64_t* at = nullptr;   // send_at (G + 1), then recv_at (G + 1)
  void* scratch = nullptr;       // the launcher's plan_scratch(rows) bytes
  std::size_t scratch_bytes = 0;
  bool from_shuffled = false;    // the rows are held in from_key's order (else as cached)
  std::uint64_t from_key = 0;
};
// A plan's sort key: (replica, row), replicas < 2^24 and rows < 2^40.
inline constexpr unsigned plan_row_bits = 40;
// Where a held row goes and where an epoch row comes from, as (replica, row) keys (the
// plan's two sort keys): row i of the held order and of the epoch's.
struct plan_keys {
  cache_layout_view l;
  feistel_permutation to, from;
  bool shuffled;
  FERRY_HOST_DEVICE std::uint64_t send(std::uint64_t replica, std::uint64_t i) const noexcept {
    const std::uint64_t g = l.global(replica, i);
    std::uint64_t q = 0, j = 0;
    l.owner(to.inverse(shuffled ? from(g) : g), q, j);
    return q << plan_row_bits | j;
  }
  FERRY_HOST_DEVICE std::uint64_t recv(std::uint64_t replica, std::uint64_t i) const noexcept {
    const std::uint64_t g = to(l.global(replica, i));
    std::uint64_t q = 0, j = 0;
    l.owner(shuffled ? from.inverse(g) : g, q, j);
    return q << plan_row_bits | i;
  }
};
// A pack (dst[k] = src[idx[k]]) or an unpack (dst[idx[k]] = src[k]) of `rows` rows of
// row_bytes, device memory.
struct move_rows_args {
  const std::byte* src = nullptr;
  std::byte* dst = nullptr;
  const std::uint64_t* idx = nullptr;
  std::uint64_t rows = 0;
  std::size_t row_bytes = 0;
  bool scatter = false;
};

// The plan on the host: the oracle the launchers' kernels implement.
inline void plan_exchange_host(const exchange_plan_args& a) {
  const cache_layout_view& l = a.layout;
  const plan_keys keys{l, {a.total_rows, a.key}, {a.total_rows, a.from_key}, a.from_shuffled};
  std::vector<std::uint64_t> sk(a.rows), rk(a.rows), order(a.rows);
  for (std::uint64_t i = 0; i < a.rows; ++i) {
    sk[i] = keys.send(a.replica, i);  // where this held row goes
    rk[i] = keys.recv(a.replica, i);  // where this epoch row comes from
  }
  const auto out = [&](const std::vector<std::uint64_t>& k, std::uint64_t* rows, std::uint64_t* at) {
    for (std::uint64_t i = 0; i < a.rows; ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](std::uint64_t x, std::uint64_t y) { return k[x] < k[y]; });
    for (std::uint64_t i = 0; i < a.rows; ++i) rows[i] = order[i];
    std::uint64_t p = 0;
    for (std::uint64_t q = 0; q <= l.replicas; ++q) {
      while (p < a.rows && k[order[p]] >> plan_row_bits < q) ++p;
      at[q] = p;
    }
  };
  out(sk, a.send_rows, a.at);
  out(rk, a.recv_rows, a.at + l.replicas + 1);
}
// A pack or unpack on the host (the launchers' oracle).
inline void move_rows_host(const move_rows_args& a) {
  for (std::uint64_t k = 0; k < a.rows; ++k)
    if (a.scatter) std::memcpy(a.dst + a.idx[k] * a.row_bytes, a.src + k * a.row_bytes, a.row_bytes);
    else std::memcpy(a.dst + k * a.row_bytes, a.src + a.idx[k] * a.row_bytes, a.row_bytes);
}

// Row copies from random places, 16 at a time, each source's first lines prefetched when
// it is added, so that the cache misses of a batch overlap.
class gather_batch {
 public:
  explicit gather_batch(std::size_t row_bytes) noexcept : eb_(row_bytes) {}
  void add(std::byte* dst, const std::byte* src) noexcept {
    for (std::size_t o = 0; o < eb_ && o < 256; o += 64) __builtin_prefetch(src + o);
    dst_[n_] = dst;
    src_[n_] = src;
    if (++n_ == 16) flush();
  }
  void flush() noexcept {
    for (unsigned k = 0; k < n_; ++k) std::memcpy(dst_[k], src_[k], eb_);
    n_ = 0;
  }

 private:
  std::size_t eb_;
  unsigned n_ = 0;
  std::byte* dst_[16];
  const std::byte* src_[16];
};

class cache_exchange {
 public:
  cache_exchange() = default;
  cache_exchange(cache_exchange&& o) noexcept
      : step_base_(std::move(o.step_base_)), in_step_(std::move(o.in_step_)), local_base_(std::move(o.local_base_)), replicas_(o.replicas_), dev_(std::move(o.dev_)),
        ranks_(o.ranks_), devx_(o.devx_), trades_(std::move(o.trades_)), seed_(o.seed_), agreed_(o.agreed_), first_(o.first_),
        local_(o.local_), votes_(std::move(o.votes_)) {
    o.dev_.clear();
  }
  cache_exchange& operator=(cache_exchange&&) = delete;
  ~cache_exchange() { free_devices(); }

  // Forgets every row (a fill started again, or the cache given up).
  void clear() noexcept {
    free_devices();
    for (std::vector<std::uint64_t>* v : {&step_base_, &in_step_, &local_base_}) v->clear();
    replicas_ = first_ = local_ = 0;
  }
  // This process is one rank of x's group (nullptr or a group of one: this process alone),
  // with the stage's seed (checked equal on every rank); GPU replicas trade rows through
  // devx when given (else they read each other's memory: one process). Throws
  // std::bad_alloc (the agreements' buffer: made now, so that no rank fails to allocate it
  // at a collective the others enter).
  void set_ranks(rank_exchange* x, device_exchange* devx, std::uint64_t seed) {
    ranks_ = x, devx_ = devx, seed_ = seed;
    votes_.assign(x ? std::size_t(x->size()) : 0, 0);
  }
  bool across_ranks() const noexcept { return ranks_ && ranks_->size() > 1; }
  // Across ranks, at the first rewind after an epoch 0 began (every rank calls it at each
  // rewind until then, whatever its state): false unless every rank has a whole epoch 0
  // cached (`mine` for this one). Later, or alone: true.
  // Across ranks, after local work that may have failed on this rank only (e): every rank
  // learns whether any failed, and all throw (e, or a config_error saying another rank
  // failed) or none does. Alone: rethrows e, if any.
  void settle(std::exception_ptr e) { throw_settled(e, worst_of_ranks(e ? 1 : 0)); }
  // (idle: this rank has not begun an epoch 0: a rewind before its first next(). When every
  // rank is idle the agreement waits for the next rewind, true meanwhile; an idle rank among
  // others that are not: false.)
  bool agree_once(bool mine, bool idle = false) {
    if (!across_ranks() || agreed_) return true;
    const std::uint64_t worst = worst_of_ranks(mine ? 0 : idle ? 1 : 2);
    if (worst == 1 && *std::min_element(votes_.begin(), votes_.end()) == 1) return true;  // no rank began
    agreed_ = true;
    return worst == 0;
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
  // The end of epoch 0: each replica's rows before each step (across ranks, the job's
  // layout first; a row's `fields`, of field_bytes[f] each). Throws std::bad_alloc;
  // config_error, on every rank, when the ranks had other step or replica counts, seeds,
  // or rows of other fields or bytes.
  void finish(const std::size_t* field_bytes = nullptr, std::size_t fields = 0) {
    local_ = replicas_;
    first_ = 0;
    if (across_ranks()) merge_ranks(field_bytes, fields);
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
  // A resume at `at` (cache_on_device_options::resume), after the fill and the first
  // rewind (at.epoch >= 1), or at the end of epoch 0's fill where the cache serves
  // (at.epoch 0): throws config_error unless the cache serves; at.global_batch G (when not 0) is
  // the rows of epoch 0's first global step (fewer when it is the only step: a dataset
  // smaller than G); at.dataset_size (with G) is the rows cached when they are not a
  // multiple of G (partial, pad: every row), else within G - 1 above them (drop); and
  // at.step is within the epoch's `steps`.
  void check_resume(const global_position& at, bool serving, std::uint64_t steps) const {
    const std::string where = resume_where(at);
    if (!serving)
      throw config_error(where + (steps == 0 ? "epoch 0 had no steps (fewer rows than one global batch, under "
                                               "remainder_policy::drop?): nothing was cached to resume"
                                             : "the cache was not filled (over budget, or a rank short)"));
    const std::uint64_t g = step_base_.size() > 1 ? step_base_[1] : 0, G = at.global_batch, N = rows();
    if (G && G != g && !(steps == 1 && g < G))
      throw config_error(where + "saved with global steps of " + std::to_string(G) + " rows, epoch 0's have " +
                         std::to_string(g));
    const std::uint64_t n = at.dataset_size;
    if (G && n && (N % G ? n != N : n < N || n - N >= G))
      throw config_error(where + "saved over " + std::to_string(n) + " rows, but epoch 0 has " + std::to_string(steps) +
                         " steps of " + std::to_string(G) + ", " + std::to_string(N) + " rows cached (" +
                         (N % G ? "every row" : "a dataset of " + std::to_string(N) + " to " + std::to_string(N + G - 1)) +
                         "; another dataset, or the upstream not at epoch 0)");
    if (at.step > steps) throw_resume_past(at, steps);
  }
  // The config_error of a resume at `at` past its epoch's `steps` steps.
  [[noreturn]] static void throw_resume_past(const global_position& at, std::uint64_t steps) {
    throw config_error(resume_where(at) + "past the epoch's " + std::to_string(steps) + " steps");
  }
  static std::string resume_where(const global_position& at) {
    return "cache_on_device: resume at epoch " + std::to_string(at.epoch) + ", step " + std::to_string(at.step) + ": ";
  }
  // Device memory replica r's side holds (the layout's copies, the trade's buffers).
  std::size_t device_bytes(std::size_t r) const noexcept { return r < dev_.size() ? dev_[r].bytes : 0; }
  // The layout (after finish()), valid while this object is unchanged.
  cache_layout_view view() const noexcept {
    return {step_base_.data(), in_step_.data(), local_base_.data(), steps(), replicas_};
  }


  // Device replicas, after finish(): the layout on each replica's device; then with a
  // device_exchange each replica's plan and receive buffers (`widest`: the widest field's
  // row bytes), else every field's table of cache addresses, peer access enabled, and each
  // replica's stream after every replica's epoch-0 work. Throws config_error (devices that
  // cannot reach each other, a device_exchange that is not these replicas'), cuda_error.
  template <class Launch>
  void to_devices(std::vector<replica_arena>& arenas, std::size_t fields, std::size_t widest) {
    if (across_ranks() && !devx_)
      throw config_error("cache_on_device: across_replicas over several ranks with GPU replicas trades rows through "
                         "NCCL: set .devices (a ferry::nccl_device_exchange of this process's replicas)");
#if defined(FERRY_WITH_CUDART)
    free_devices();
    if (devx_) return plan_buffers<Launch>(arenas, widest);
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
      device_side& side = add_side(d, arenas[r].stream, host);
      for (std::size_t f = 0; f < fields; ++f) {
        std::vector<const std::byte*> srcs(R);
        for (std::size_t q = 0; q < R; ++q) srcs[q] = arenas[q].cache[f];
        side.srcs.push_back(reinterpret_cast<const std::byte* const*>(upload(side, srcs.data(), R)));
      }
    }
#else
    (void)arenas;
    (void)fields;
    (void)widest;
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
  // host replicas, Launch::launch_global on each replica's stream for device ones (keys:
  // this epoch's, the next's, the one after; a device_exchange trades ahead).
  template <class Launch>
  void reorder(std::vector<replica_arena>& arenas, const std::size_t* field_bytes, std::size_t fields,
               const std::uint64_t* keys) {
    const std::uint64_t key = keys[0];
    if (arenas.empty()) return;
    if (arenas[0].device < 0) {
      if (across_ranks()) return exchange_host(arenas, field_bytes, fields, key);
      for (std::size_t f = 0; f < fields; ++f) gather_host(arenas, f, field_bytes[f], key);
      return;
    }
#if defined(FERRY_WITH_CUDART)
    if (devx_) return exchange_device<Launch>(arenas, field_bytes, fields, keys);
#endif
    for (std::size_t r = 0; r < arenas.size(); ++r) {
#if defined(FERRY_WITH_CUDART)
      const cuda::device_guard g(arenas[r].device);
#endif
      for (std::size_t f = 0; f < fields; ++f)
        Launch::launch_global(device_args(r, f, arenas[r].rows, field_bytes[f], arenas[r].epoch[f], key), arenas[r].stream);
    }
  }

  // While an epoch of `steps` is served, at its step `step` (device replicas with a
  // device_exchange; else nothing): the next epoch's trade units due by then, so that they
  // spread over the epoch's first trade_span(steps) steps (the last few left for the last
  // unit, its unpack and the next plan). NCCL runs one communicator's calls in the order
  // they are made, on every stream: a whole trade at the rewind would hold the epoch's
  // first all-reduce back until it ended, a unit a step holds each back a unit's time at
  // most. A local failure is kept for the next rewind (trade_units); a failed NCCL call is
  // thrown now, once (the device_exchange aborted: the job should end, as the trainer's
  // next call on those communicators will say), and kept for the rewind too.
  template <class Launch>
  void on_step(std::vector<replica_arena>& arenas, const std::size_t* field_bytes, std::uint64_t step,
               std::uint64_t steps) {
#if defined(FERRY_WITH_CUDART)
    if constexpr (requires { Launch::plan_scratch(std::uint64_t{}); }) {
      if (!devx_ || !trades_.trade_ahead || trades_.done == trades_.units || trades_.broken) return;
      const std::uint64_t span = trade_span(steps), u = trades_.units;
      trade_units<Launch>(arenas, field_bytes, step + 1 >= span ? u : std::min(u, (u * (step + 1) + span - 1) / span));
      if (trades_.broken) std::rethrow_exception(trades_.failed);
    }
#endif
    (void)arenas, (void)field_bytes, (void)step, (void)steps;
  }
  // The steps of an epoch of `steps` that its trade's units spread over: all but the last
  // two (one of 4 to 7 steps; none of 3 or fewer).
  static std::uint64_t trade_span(std::uint64_t steps) noexcept {
    return std::max<std::uint64_t>(1, steps - std::min<std::uint64_t>(2, steps / 4));
  }

  // A later epoch's field f (rows of eb bytes) for every host replica: replica r's epoch
  // row j = the row with global index perm(gid_r(j)), from its replica's cache.
  void gather_host(std::vector<replica_arena>& arenas, std::size_t f, std::size_t eb, std::uint64_t key) const {
    const feistel_permutation perm(rows(), key);
    const cache_layout_view l = view();
    gather_batch copy(eb);
    for (std::size_t r = 0; r < arenas.size() && r < replicas_; ++r) {
      std::byte* dst = arenas[r].epoch[f];
      const std::uint64_t* lb = l.local_base + r * (l.steps + 1);
      for (std::uint64_t k = 0; k < l.steps; ++k) {  // row j's global index, step by step (no search)
        const std::uint64_t base = l.step_base[k] + l.in_step[k * (replicas_ + 1) + r] - lb[k];
        for (std::uint64_t j = lb[k]; j < lb[k + 1]; ++j) {
          std::uint64_t q = 0, i = 0;
          l.owner(perm(base + j), q, i);
          copy.add(dst + j * eb, arenas[q].cache[f] + i * eb);
        }
      }
    }
    copy.flush();
  }

  // A later epoch across ranks (host replicas): every rank asks each other rank for the
  // rows it serves that rank cached (their global indices, in its rows' order), then per
  // field gets them back in that order; its own rows it copies. Nothing is kept per row
  // but the requests: the sources are computed again per pass. Buffers are kept for the
  // next epoch.
  void exchange_host(std::vector<replica_arena>& arenas, const std::size_t* field_bytes, std::size_t fields,
                     std::uint64_t key) {
    const feistel_permutation perm(rows(), key);
    const cache_layout_view l = view();
    const std::size_t W = std::size_t(ranks_->size()), R = std::size_t(local_), me = std::size_t(first_ / local_);
    // fn(replica r, row j, global index g, owner's rank p, its replica q there, its row i)
    // for every local row, in order; a row's own global index step by step (no search).
    const std::uint64_t G = replicas_;
    const auto each_row = [&](auto&& fn) {
      for (std::size_t r = 0; r < R; ++r) {
        const std::uint64_t* lb = l.local_base + (first_ + r) * (l.steps + 1);
        for (std::uint64_t k = 0; k < l.steps; ++k) {
          const std::uint64_t base = l.step_base[k] + l.in_step[k * (G + 1) + first_ + r];
          for (std::uint64_t j = lb[k]; j < lb[k + 1]; ++j) {
            std::uint64_t q = 0, i = 0;
            const std::uint64_t g = perm(base + (j - lb[k]));
            l.owner(g, q, i);
            fn(r, j, g, std::size_t(q / R), q % R, i);
          }
        }
      }
    };
    // The requests, per rank in this rank's rows' order, then joined in rank order; room
    // for the widest field's rows back. Local work: the ranks settle before trading.
    std::size_t widest = 0;
    for (std::size_t f = 0; f < fields; ++f) widest = std::max(widest, field_bytes[f]);
    std::exception_ptr err;
    try {
      asks_of_.resize(W);
      for (auto& a : asks_of_) a.clear();
      each_row([&](std::size_t, std::uint64_t, std::uint64_t g, std::size_t p, std::uint64_t, std::uint64_t) {
        if (p != me) asks_of_[p].push_back(g);
      });
      ask_.assign(W, 0), at_.assign(W + 1, 0), counts_.resize(W * W), give_.resize(W);
      for (std::size_t p = 0; p < W; ++p) at_[p + 1] = at_[p] + (ask_[p] = asks_of_[p].size());
      asks_.resize(std::size_t(at_[W]));
      for (std::size_t p = 0; p < W; ++p) std::copy(asks_of_[p].begin(), asks_of_[p].end(), asks_.begin() + std::ptrdiff_t(at_[p]));
      back_.resize(std::size_t(at_[W]) * widest);
    } catch (...) {
      err = std::current_exception();
    }
    settle(err);
    // Every rank's asks of every rank: what this one gives p is what p asks of it.
    ranks_->all_gather(ask_.data(), W * sizeof(std::uint64_t), counts_.data());
    std::uint64_t asked = 0;
    for (std::size_t p = 0; p < W; ++p) asked += (give_[p] = counts_[p * W + me]);
    try {
      wanted_.resize(std::size_t(asked));
      out_.resize(std::size_t(asked) * widest);
    } catch (...) {
      err = std::current_exception();
    }
    settle(err);
    ranks_->all_to_all(asks_.data(), ask_.data(), wanted_.data(), give_.data(), sizeof(std::uint64_t));
    for (const std::uint64_t g : wanted_) {  // rows this rank cached, else no rank trades
      std::uint64_t q = 0, i = 0;
      if (g < rows()) l.owner(g, q, i);
      if (g >= rows() || q / R != me) {
        err = std::make_exception_ptr(config_error("cache_on_device: across ranks: asked for row " + std::to_string(g) +
                                                   ", which this rank did not cache (ranks with other layouts)"));
        break;
      }
    }
    settle(err);
    std::vector<std::uint64_t>& next = next_;
    for (std::size_t f = 0; f < fields; ++f) {
      const std::size_t eb = field_bytes[f];
      gather_batch copy(eb);
      for (std::size_t k = 0; k < wanted_.size(); ++k) {
        std::uint64_t q = 0, i = 0;
        l.owner(wanted_[k], q, i);
        copy.add(out_.data() + k * eb, arenas[std::size_t(q % R)].cache[f] + i * eb);
      }
      copy.flush();
      ranks_->all_to_all(out_.data(), give_.data(), back_.data(), ask_.data(), eb);
      next.assign(at_.begin(), at_.end() - 1);
      each_row([&](std::size_t r, std::uint64_t j, std::uint64_t, std::size_t p, std::uint64_t q, std::uint64_t i) {
        copy.add(arenas[r].epoch[f] + j * eb, p == me ? arenas[std::size_t(q)].cache[f] + i * eb : back_.data() + next[p]++ * eb);
      });
      copy.flush();
    }
  }

 private:
  // The largest of every rank's `mine` (one all-gather); alone, mine.
  std::uint64_t worst_of_ranks(std::uint64_t mine) {
    if (!across_ranks()) return mine;
    ranks_->all_gather(&mine, sizeof mine, votes_.data());
    return *std::max_element(votes_.begin(), votes_.end());
  }
  // After an agreement on failures (worst: 0 none, 1 one failed, 2 a trade's NCCL call
  // failed): e rethrown, else an error saying what another rank's was, else nothing.
  static void throw_settled(std::exception_ptr e, std::uint64_t worst) {
    if (e) std::rethrow_exception(e);
    if (worst == 2)
      throw error("cache_on_device: another rank's trade failed in NCCL (its own error says why); the device_exchange "
                  "is aborted here too (its communicators: every later call on them throws); every rank streams");
    if (worst == 1) throw config_error("cache_on_device: another rank failed (its own error says why); every rank streams");
  }
  // Across ranks: rank w's replicas' counts joined into the job's layout (global replica
  // w x R + r), every rank the same.
  // Every rank checks the others' shapes (the same verdict on every rank, before any trade):
  // the all-to-alls trade rows of one size. Everything it needs is allocated first and the
  // ranks settle on that, so a rank whose allocation fails (W x steps x R words) leaves no
  // other waiting in a gather; nothing is allocated after the gathers.
  void merge_ranks(const std::size_t* field_bytes, std::size_t fields) {
    const std::uint64_t W = std::uint64_t(ranks_->size()), w = std::uint64_t(ranks_->rank());
    const std::uint64_t s = steps(), R = replicas_, G = W * R;
    std::uint64_t bytes = 0, hash = 0xcbf29ce484222325ull;  // the row's bytes, and each field's (FNV-1a)
    for (std::size_t f = 0; f < fields; ++f) bytes += field_bytes[f], hash = (hash ^ field_bytes[f]) * 0x100000001b3ull;
    constexpr std::size_t n = 6;
    const std::uint64_t mine[n] = {s, R, seed_, fields, bytes, hash};
    std::vector<std::uint64_t> shape, mine_counts, all, in_step, step_base;
    std::exception_ptr e;
    try {
      shape.resize(n * W);
      mine_counts.resize(s * R);
      all.resize(W * s * R);
      in_step.resize(s * (G + 1));
      step_base.resize(s + 1);
    } catch (...) {
      e = std::current_exception();
    }
    settle(e);
    ranks_->all_gather(mine, sizeof mine, shape.data());
    for (std::uint64_t p = 0; p < W; ++p)
      if (shape[n * p] != s || shape[n * p + 1] != R || shape[n * p + 2] != seed_)
        throw config_error("cache_on_device: across ranks, every rank needs the same steps, replicas and seed in "
                           "epoch 0: rank " + std::to_string(p) + " had " + std::to_string(shape[n * p]) + " steps of " +
                           std::to_string(shape[n * p + 1]) + " replicas, seed " + std::to_string(shape[n * p + 2]) +
                           "; rank " + std::to_string(w) + " " + std::to_string(s) + " of " + std::to_string(R) +
                           ", seed " + std::to_string(seed_));
    for (std::uint64_t p = 0; p < W; ++p)
      if (shape[n * p + 3] != fields || shape[n * p + 4] != bytes || shape[n * p + 5] != hash)
        throw config_error("cache_on_device: across ranks, every rank's rows need the same fields, each of the same "
                           "bytes: rank " + std::to_string(p) + "'s rows have " + std::to_string(shape[n * p + 3]) +
                           " fields, " + std::to_string(shape[n * p + 4]) + " bytes; rank " + std::to_string(w) +
                           "'s " + std::to_string(fields) + " fields, " + std::to_string(bytes) + " bytes" +
                           (shape[n * p + 3] == fields && shape[n * p + 4] == bytes ? " (fields of other sizes)" : ""));
    for (std::uint64_t k = 0; k < s; ++k)
      for (std::uint64_t r = 0; r < R; ++r)
        mine_counts[k * R + r] = in_step_[k * (R + 1) + r + 1] - in_step_[k * (R + 1) + r];
    ranks_->all_gather(mine_counts.data(), mine_counts.size() * sizeof(std::uint64_t), all.data());
    for (std::uint64_t k = 0; k < s; ++k) {
      std::uint64_t o = 0;
      for (std::uint64_t p = 0; p < W; ++p)
        for (std::uint64_t r = 0; r < R; ++r) {
          in_step[k * (G + 1) + p * R + r] = o;
          o += all[(p * s + k) * R + r];
        }
      in_step[k * (G + 1) + G] = o;
      step_base[k + 1] = step_base[k] + o;
    }
    in_step_.swap(in_step);
    step_base_.swap(step_base);
    replicas_ = G;
    first_ = w * R;
    local_ = R;
  }

  // The order a replica's rows are held in: a permutation's (key), or as cached.
  struct held_order {
    bool shuffled = false;
    std::uint64_t key = 0;
    bool operator==(const held_order&) const = default;
  };
  // A replica's device copies: the layout's arrays and per field the cache addresses.
  struct device_side {
    int device = -1;
    cuda_stream stream = nullptr;
    const std::uint64_t *step_base = nullptr, *in_step = nullptr, *local_base = nullptr;
    std::vector<const std::byte* const*> srcs;  // per field
    // With a device_exchange: the plan's outputs, its scratch, the received rows.
    std::uint64_t *send_rows = nullptr, *recv_rows = nullptr, *at = nullptr;
    void* scratch = nullptr;
    std::size_t scratch_bytes = 0;
    std::byte* recv = nullptr;
    // The side stream (plans and trades), events (cudaEvent_t) recorded after a plan's counts
    // reach host_at (planned), after a trade's last unpack (traded) and on the replica's
    // stream at a rewind (mark), and host_at (pinned: send_at, recv_at).
    cuda_stream side = nullptr;
    void *planned = nullptr, *traded = nullptr, *mark = nullptr;
    std::uint64_t* host_at = nullptr;
    std::vector<void*> blocks;  // the device memory above, to free
    std::size_t bytes = 0;      // their size
  };

#if defined(FERRY_WITH_CUDART)
  // `n` values to a new block of the side's device (current), there when this returns:
  // cudaMemcpy from pageable memory may return before its DMA ends, and orders nothing
  // before kernels on non-blocking streams (the replicas' and the plan's), so the device is
  // synchronised after it. Once per table, at the end of epoch 0.
  template <class T>
  static const std::uint64_t* upload(device_side& side, const T* v, std::size_t n) {
    void* p = nullptr;
    FERRY_CUDA_TRY(cudaMalloc(&p, std::max<std::size_t>(n * sizeof(T), 1)));
    side.blocks.push_back(p);
    side.bytes += n * sizeof(T);
    if (n) {
      FERRY_CUDA_TRY(cudaMemcpy(p, v, n * sizeof(T), cudaMemcpyHostToDevice));
      FERRY_CUDA_TRY(cudaDeviceSynchronize());
    }
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
  // A replica's side on device d (current): the layout `host` uploaded.
  device_side& add_side(int d, cuda_stream stream, const cache_layout_view& host) {
    device_side& side = dev_.emplace_back();
    side.device = d;
    side.stream = stream;
    side.step_base = upload(side, host.step_base, host.steps + 1);
    side.in_step = upload(side, host.in_step, host.steps * (host.replicas + 1));
    side.local_base = upload(side, host.local_base, host.replicas * (host.steps + 1));
    return side;
  }
  static void* device_block(device_side& side, std::size_t bytes) {
    void* p = nullptr;
    FERRY_CUDA_TRY(cudaMalloc(&p, std::max<std::size_t>(bytes, 1)));
    side.blocks.push_back(p);
    side.bytes += bytes;
    return p;
  }
  // With a device_exchange: the layout and each replica's plan buffers on its device, sized
  // once (every epoch trades each replica's rows: the same counts).
  template <class Launch>
  void plan_buffers(std::vector<replica_arena>& arenas, std::size_t widest) {
    if constexpr (!requires { Launch::plan_scratch(std::uint64_t{}); }) {
      throw config_error("cache_on_device: .devices needs a launcher with the exchange kernels "
                         "(ferry::cuda::cache_on_device, or cache_gather_launcher's plan, move_rows and plan_scratch)");
    } else {
      const std::size_t R = arenas.size();
      if (std::uint64_t(devx_->local()) != R || std::uint64_t(devx_->first()) != first_ ||
          std::uint64_t(devx_->size()) != replicas_)
        throw config_error("cache_on_device: the device_exchange has ranks " + std::to_string(devx_->first()) + ".." +
                           std::to_string(devx_->first() + devx_->local() - 1) + " of " + std::to_string(devx_->size()) +
                           "; this process's replicas are " + std::to_string(first_) + ".." +
                           std::to_string(first_ + R - 1) + " of " + std::to_string(replicas_));
      if (replicas_ >= (std::uint64_t(1) << (64 - plan_row_bits)))
        throw config_error("cache_on_device: more than 2^24 replicas");
      const cache_layout_view host = view();
      for (std::size_t r = 0; r < R; ++r) {
        const int d = arenas[r].device;
        if (devx_->device(int(r)) != d)
          throw config_error("cache_on_device: replica " + std::to_string(r) + " is on GPU " + std::to_string(d) +
                             ", its device_exchange rank on GPU " + std::to_string(devx_->device(int(r))));
        const std::uint64_t n = arenas[r].rows;
        if (n >= (std::uint64_t(1) << plan_row_bits)) throw config_error("cache_on_device: 2^40 rows or more in a replica");
        const cuda::device_guard g(d);
        device_side& side = add_side(d, arenas[r].stream, host);
        side.send_rows = static_cast<std::uint64_t*>(device_block(side, std::size_t(n) * 8));
        side.recv_rows = static_cast<std::uint64_t*>(device_block(side, std::size_t(n) * 8));
        side.at = static_cast<std::uint64_t*>(device_block(side, std::size_t(replicas_ + 1) * 16));
        side.scratch_bytes = Launch::plan_scratch(n);
        side.scratch = device_block(side, side.scratch_bytes);
        side.recv = static_cast<std::byte*>(device_block(side, std::size_t(n) * widest));
        cudaStream_t ps = nullptr;
        FERRY_CUDA_TRY(cudaStreamCreateWithFlags(&ps, cudaStreamNonBlocking));
        side.side = ps;
        for (void** e : {&side.planned, &side.traded, &side.mark}) {
          cudaEvent_t made = nullptr;
          FERRY_CUDA_TRY(cudaEventCreateWithFlags(&made, cudaEventDisableTiming));
          *e = made;
        }
        void* h = nullptr;
        FERRY_CUDA_TRY(cudaHostAlloc(&h, std::size_t(replicas_ + 1) * 16, cudaHostAllocDefault));
        side.host_at = static_cast<std::uint64_t*>(h);
      }
    }
  }
  // Replica r's plan from `from` to key's order on its side stream (after its last trade,
  // which read the plan's buffers), then its counts to host_at and `planned` recorded.
  template <class Launch>
  void enqueue_plan(const std::vector<replica_arena>& arenas, std::size_t r, held_order from, std::uint64_t key) {
    device_side& d = dev_[r];
    const cuda::device_guard g(d.device);
    const auto ss = static_cast<cudaStream_t>(d.side);
    Launch::plan({{d.step_base, d.in_step, d.local_base, steps(), replicas_}, first_ + r, arenas[r].rows, rows(), key,
                  d.send_rows, d.recv_rows, d.at, d.scratch, d.scratch_bytes, from.shuffled, from.key},
                 d.side);
    FERRY_CUDA_TRY(cudaMemcpyAsync(d.host_at, d.at, std::size_t(replicas_ + 1) * 16, cudaMemcpyDeviceToHost, ss));
    FERRY_CUDA_TRY(cudaEventRecord(static_cast<cudaEvent_t>(d.planned), ss));
  }
  // Every replica's plan from `from` to key's order, its counts on the host (enqueued now
  // unless it was enqueued after the trade's last unit), then the trade to key's order
  // begun (begin_trade). Local work: across ranks the caller settles (settle_trade) before
  // any rank calls NCCL.
  template <class Launch>
  void plan_trade(const std::vector<replica_arena>& arenas, held_order from, std::uint64_t key, std::uint64_t plan_next,
                  const std::size_t* field_bytes, std::size_t fields) {
    const bool ahead = trades_.plan_ahead && trades_.plan_from == from && trades_.plan_to == key;
    trades_.plan_ahead = false;  // used (or failed) either way
    if (!ahead)
      for (std::size_t r = 0; r < arenas.size(); ++r) enqueue_plan<Launch>(arenas, r, from, key);
    for (const device_side& d : dev_) {
      const cuda::device_guard g(d.device);
      FERRY_CUDA_TRY(cudaEventSynchronize(static_cast<cudaEvent_t>(d.planned)));
    }
    begin_trade(key, plan_next, field_bytes, fields);
  }
  // Across ranks, at a rewind: every rank learns whether one's trade failed (e, or a failure
  // kept by trade_units; `broken`: an NCCL call failed, its calls no longer pair up). Then
  // all throw (e, or an error saying another rank failed) or none does; when one broke,
  // every rank first aborts the device_exchange, which ends the calls no rank will match.
  // Alone: the same, without the all-gather. Before any wait for the side streams' work.
  void settle_trade(std::exception_ptr e) {
    if (!e) e = trades_.failed;
    trades_.failed = nullptr;
    const std::uint64_t worst = worst_of_ranks(trades_.broken ? 2 : e ? 1 : 0);
    if (worst == 2 && !trades_.broken) devx_->abort(), trades_.broken = true;
    throw_settled(e, worst);
  }
  // The next trade, to key's order, by the plans on the host (their counts kept): in
  // units, a field's rows in `chunks` slices of every replica pair's run, so that it can be
  // enqueued a step at a time (on_step). Chunks: fields x chunks <= steps (one unit a step
  // at most, unless steps < fields or a resume catches up) and about 1 MiB a replica at
  // least (the same count on every rank: the job's sizes). plan_next: the key of the plan
  // enqueued after the last unit.
  void begin_trade(std::uint64_t key, std::uint64_t plan_next, const std::size_t* field_bytes, std::size_t fields) {
    std::size_t widest = 0;
    for (std::size_t f = 0; f < fields; ++f) widest = std::max(widest, field_bytes[f]);
    const std::uint64_t per_replica = rows() / std::max<std::uint64_t>(replicas_, 1) * widest;
    trades_.chunks = std::max<std::uint64_t>(1, std::min<std::uint64_t>(steps() / std::max<std::size_t>(fields, 1),
                                                                        per_replica >> 20));
    trades_.units = fields * trades_.chunks, trades_.done = 0;
    trades_.trade_ahead = true, trades_.trade_to = key, trades_.plan_next = plan_next;
    trades_.at.resize(dev_.size());
    trades_.x.resize(dev_.size());
    trades_.parts.resize(dev_.size());
    for (std::size_t r = 0; r < dev_.size(); ++r) {
      trades_.at[r].assign(dev_[r].host_at, dev_[r].host_at + 2 * (replicas_ + 1));
      trades_.x[r].resize(4 * replicas_);
    }
  }
  // The pending trade's units up to `upto`, on the side streams. A unit: (its field's first)
  // the held rows (epoch block) packed into the other block, one all-to-all of a slice of
  // each replica pair's run into the receive buffer, (its field's last) the unpack to the
  // rows' places in the other block. After the last: `traded`, and the plan after it (one
  // that fails to enqueue is dropped: the next rewind plans in line, and reports a failure
  // then). Never throws: a local failure (a launch, an event) is kept in trades_.failed and the
  // units go on, so that every rank's NCCL calls still pair up; a failed all-to-all marks
  // the trade broken, aborts the device_exchange (its calls can no longer pair up) and
  // ends the units here. The next rewind's settle_trade reports either on every rank.
  template <class Launch>
  void trade_units(std::vector<replica_arena>& arenas, const std::size_t* field_bytes, std::uint64_t upto) noexcept {
    const std::size_t R = arenas.size();
    const std::uint64_t G = replicas_, K = trades_.chunks;
    std::vector<device_all_to_all_part>& parts = trades_.parts;
    const auto local = [&](auto&& work) {  // kept, not thrown: the NCCL calls go on
      try {
        work();
      } catch (...) {
        if (!trades_.failed) trades_.failed = std::current_exception();
      }
    };
    for (; trades_.done < upto && !trades_.broken; ++trades_.done) {
      const std::size_t f = std::size_t(trades_.done / K), eb = field_bytes[f];
      const std::uint64_t k = trades_.done % K;
      for (std::size_t r = 0; r < R; ++r) {
        device_side& d = dev_[r];
        const std::uint64_t* at = trades_.at[r].data();  // rows: send_at (G + 1), recv_at (G + 1)
        std::uint64_t* x = trades_.x[r].data();  // bytes and offsets, sent and received
        for (std::uint64_t q = 0; q < G; ++q) {
          const std::uint64_t n = at[q + 1] - at[q], m = at[G + 2 + q] - at[G + 1 + q];
          x[q] = (n * (k + 1) / K - n * k / K) * eb, x[G + q] = (at[q] + n * k / K) * eb;
          x[2 * G + q] = (m * (k + 1) / K - m * k / K) * eb, x[3 * G + q] = (at[G + 1 + q] + m * k / K) * eb;
        }
        parts[r] = {arenas[r].cache[f], x, d.recv, x + 2 * G, d.side, x + G, x + 3 * G};
        if (k == 0)
          local([&] {
            const cuda::device_guard g(d.device);
            Launch::move_rows({arenas[r].epoch[f], arenas[r].cache[f], d.send_rows, arenas[r].rows, eb, false}, d.side);
          });
      }
      try {
        devx_->all_to_all(parts);
      } catch (...) {
        if (!trades_.failed) trades_.failed = std::current_exception();
        trades_.broken = true;
        devx_->abort();  // now: the trainer's calls on these communicators fail rather than wait
        return;
      }
      if (k + 1 == K)
        for (std::size_t r = 0; r < R; ++r)
          local([&] {
            device_side& d = dev_[r];
            const cuda::device_guard g(d.device);
            Launch::move_rows({d.recv, arenas[r].cache[f], d.recv_rows, arenas[r].rows, eb, true}, d.side);
          });
      if (trades_.done + 1 < trades_.units) continue;
      local([&] {
        for (const device_side& d : dev_) {
          const cuda::device_guard g(d.device);
          FERRY_CUDA_TRY(cudaEventRecord(static_cast<cudaEvent_t>(d.traded), static_cast<cudaStream_t>(d.side)));
        }
      });
      const held_order from{true, trades_.trade_to};
      try {
        for (std::size_t r = 0; r < R; ++r) enqueue_plan<Launch>(arenas, r, from, trades_.plan_next);
        trades_.plan_ahead = true, trades_.plan_from = from, trades_.plan_to = trades_.plan_next;
      } catch (...) {
      }
    }
  }
  // A later epoch with a device_exchange (keys: this epoch's order, the next one's, the one
  // after). This epoch's rows were traded into the other blocks while the last epoch was
  // served (else, at the first rewind, they are now: the rows as cached moved to the epoch
  // blocks' place first; an epoch cut short: the rest now); each replica's stream waits for
  // them, and the two blocks swap places. Then the next epoch's trade begins: its units
  // are enqueued on the side streams step by step (on_step), after the last epoch's steps,
  // which read the block they write. Across ranks, every failure is settled (settle_trade)
  // before an NCCL call could depend on it and before the host waits for a side stream
  // that holds NCCL calls (the first rewind's plan waits before any is queued): the plans
  // (without a trade ahead), then the whole trade (the units left made in line, on every
  // rank, however many each has left), then the next plan; every rank throws or none
  // does, and the stage streams on every rank.
  template <class Launch>
  void exchange_device(std::vector<replica_arena>& arenas, const std::size_t* field_bytes, std::size_t fields,
                       const std::uint64_t* keys) {
    if constexpr (requires { Launch::plan_scratch(std::uint64_t{}); }) {
      const std::size_t R = arenas.size();
      const auto swap_blocks = [&] {
        for (replica_arena& a : arenas)
          for (std::size_t f = 0; f < fields; ++f) std::swap(a.cache[f], a.epoch[f]);
      };
      // The same on every rank: set at the last rewind, which every rank passed.
      const bool ahead = trades_.trade_ahead && trades_.trade_to == keys[0];
      std::exception_ptr err;
      try {
        if (!trades_.swapped_in) swap_blocks(), trades_.swapped_in = true, trades_.held = {};
        for (std::size_t r = 0; r < R; ++r) {  // the side streams after the last epoch's steps
          const device_side& d = dev_[r];
          const cuda::device_guard g(d.device);
          FERRY_CUDA_TRY(cudaEventRecord(static_cast<cudaEvent_t>(d.mark), static_cast<cudaStream_t>(d.stream)));
          FERRY_CUDA_TRY(cudaStreamWaitEvent(static_cast<cudaStream_t>(d.side), static_cast<cudaEvent_t>(d.mark), 0));
        }
        if (!ahead)  // the first rewind, a resume: no NCCL call of the stage is queued yet
          plan_trade<Launch>(arenas, trades_.held, keys[0], keys[1], field_bytes, fields);
      } catch (...) {
        err = std::current_exception();
      }
      if (!ahead) settle_trade(err), err = nullptr;  // every rank's plans, before the trade's first call
      trade_units<Launch>(arenas, field_bytes, trades_.units);  // in line: what is left (an epoch cut short)
      settle_trade(err);  // the whole trade, on every rank, before any wait for it
      trades_.trade_ahead = false;
      try {
        for (std::size_t r = 0; r < R; ++r) {
          const device_side& d = dev_[r];
          const cuda::device_guard g(d.device);
          FERRY_CUDA_TRY(cudaStreamWaitEvent(static_cast<cudaStream_t>(d.stream), static_cast<cudaEvent_t>(d.traded), 0));
        }
        swap_blocks();
        trades_.held = {true, keys[0]};
        plan_trade<Launch>(arenas, trades_.held, keys[1], keys[2], field_bytes, fields);
      } catch (...) {
        err = std::current_exception();
      }
      settle_trade(err);  // before the next trade's first NCCL call
    } else {
      (void)arenas, (void)field_bytes, (void)fields, (void)keys;
    }
  }
#endif
  // Frees the device copies, after every replica's work that may read them.
  void free_devices() noexcept {
#if defined(FERRY_WITH_CUDART)
    if (dev_.empty()) return;
    const cuda::device_restore keep;
    for (const device_side& d : dev_)
      if (cudaSetDevice(d.device) == cudaSuccess)
        for (cuda_stream st : {d.stream, d.side})
          if (st) FERRY_CUDA_LOG(cudaStreamSynchronize(static_cast<cudaStream_t>(st)));
    for (const device_side& d : dev_)
      if (cudaSetDevice(d.device) == cudaSuccess) {
        for (void* p : d.blocks) FERRY_CUDA_LOG(cudaFree(p));
        if (d.side) FERRY_CUDA_LOG(cudaStreamDestroy(static_cast<cudaStream_t>(d.side)));
        for (void* e : {d.planned, d.traded, d.mark})
          if (e) FERRY_CUDA_LOG(cudaEventDestroy(static_cast<cudaEvent_t>(e)));
        if (d.host_at) FERRY_CUDA_LOG(cudaFreeHost(d.host_at));
      }
#endif
    dev_.clear();
    trades_ = {};
  }

  std::vector<std::uint64_t> step_base_, in_step_, local_base_;
  std::uint64_t replicas_ = 0;  // the job's (all ranks') after finish()
  std::vector<device_side> dev_;  // device replicas: per replica
  rank_exchange* ranks_ = nullptr;
  device_exchange* devx_ = nullptr;
  // With devx_: the order the epoch buffers hold, whether the caches moved there (the
  // first rewind), and what the side streams have enqueued for the next rewinds.
  struct trade_state {
    held_order held;
    bool swapped_in = false, plan_ahead = false, trade_ahead = false;
    held_order plan_from;  // plan_ahead: the plan from plan_from to plan_to's order
    std::uint64_t plan_to = 0;
    // trade_ahead: the trade to trade_to's order into the other blocks, `done` of its
    // `units` enqueued (fields x chunks), by the counts `at` (per replica), then the plan to plan_next.
    std::uint64_t trade_to = 0, chunks = 1, units = 0, done = 0, plan_next = 0;
    std::exception_ptr failed;  // the first local failure of the trade (trade_units), for the rewind
    bool broken = false;        // an all-to-all failed: the device_exchange is aborted
    std::vector<std::vector<std::uint64_t>> at, x;  // x: a unit's bytes and offsets (kept: no allocation a step)
    std::vector<device_all_to_all_part> parts;
  };
  trade_state trades_;
  std::uint64_t seed_ = 0;
  bool agreed_ = false;  // agree_once ran (clear() keeps it: once a job)
  std::uint64_t first_ = 0, local_ = 0;  // this rank's first global replica, and its count
  // Across ranks, kept between epochs: requests, rows asked of this rank, rows out and back.
  std::vector<std::uint64_t> asks_, wanted_;
  std::vector<std::uint64_t> votes_;  // an agreement's all-gather, a word a rank (set_ranks)
  std::vector<std::vector<std::uint64_t>> asks_of_;  // per rank
  std::vector<std::uint64_t> ask_, at_, counts_, give_, next_;  // per rank (counts: W x W)
  std::vector<std::byte> out_, back_;
};

}  // namespace ferry::detail
