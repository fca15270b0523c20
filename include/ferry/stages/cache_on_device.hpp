// ferry/stages/cache_on_device.hpp: after the first epoch, steps come from each replica's
// own memory: no host reads, no host-to-device copies.
//
//   auto steps = ferry::global_shuffle(rows, {.seed = 7, .global_batch = 384}) | ferry::batch(384)
//              | ferry::distribute(ferry::cuda::devices{0, 1, 2})
//              | ferry::cuda::cache_on_device({.budget_bytes = 40ull << 30, .seed = 7});   // cache_on_device.cuh
//   for (int e = 0; e < epochs; ++e, steps.rewind())
//     for (auto& st : steps) train(st);
//
// Epoch 0 passes distribute's steps through and keeps each replica's real rows (valid())
// in its memory: device memory for a GPU replica (copied on its stream, in order with the
// step), host memory for a host replica. rewind() never reads the upstream again: each
// later epoch, each replica's rows get a new order (a Feistel permutation drawn from (seed,
// epoch, replica), computed in the kernel) by one gather per field into a second buffer,
// whose slices are the steps: each step has as many rows as the replica had real rows at
// that step of epoch 0 (every epoch has epoch 0's step count and slice sizes, short steps
// included); under remainder_policy::pad every slice keeps epoch 0's size, its padding rows
// zero (only the last step may be padded: below). A served
// step's memory is valid until the next rewind(). With across_replicas, an epoch is one
// permutation, drawn from (seed, epoch), of the rows' places in epoch 0's global batches:
// each replica's steps draw from the whole dataset, the same global batches for any
// replica count. GPU replicas read each other's memory (peer access; one process), or with
// .devices (a device_exchange: NCCL) trade rows by all-to-all. With .ranks (several
// processes, a rank_exchange; GPU replicas need .devices too), global replica w x R + r
// is rank w's replica r, the order is the same for any rank count, and each epoch the
// ranks trade rows by all-to-all (cache_exchange.hpp); unless every rank cached a whole
// epoch 0 (agreed at the first rewind after a next(): a rewind before the first next()
// begins no epoch 0), every rank streams.
//
// The budget (per replica, bytes, the cache and the shuffled copy together, under pad with
// the padding rows served; 0: none): over_budget::error throws config_error at the step that
// would pass it, naming the replica and the size reached, then streams: that step is the
// next next()'s (no row lost); over_budget::stream gives up the cache there (freed) and
// passes the upstream through every epoch. Fixed-size fields only (a ragged or padded
// field: a compile-time error); a cached step's host_batch() is empty.
//
// Threads: none of its own; runs on the thread calling next(). The device path enqueues
// copies and gathers on each replica's stream (distribute's): work a consumer enqueues on
// rb.stream() is ordered after them, and the next gather after it. With .devices, the next
// epoch's trade runs on a side stream, a unit a step, while an epoch is served.
//
// Errors: config_error for a ragged or padded upstream step (compile time), over budget,
// replicas, devices or streams that change between steps, a device replica with the
// host-only stage and shuffle (at the first step), across_replicas without shuffle, ranks,
// devices or resume without it, GPUs that cannot read each other's memory, GPU replicas
// across ranks without .devices, .devices not the replicas' GPUs, ranks whose epoch 0 had
// other step or replica counts, seeds or row layouts (fields, bytes), another rank's
// failure (at the end of epoch 0 or a rewind, on every rank), a resume past the epoch, of
// another global batch or dataset size, or without a filled cache (at the first next(); in
// epoch 0, when the upstream ends before the step, and at the first rewind: Checkpoints),
// under pad, an epoch-0 step after a padded one (only the last may be padded; then every
// epoch streams); GPU replicas under prefetch or shuffle: distribute's config_error at the
// first step (epoch 0's steps are distribute's, each valid only until the next).
// cuda_error, std::bad_alloc, what the rank_exchange and device_exchange throw: whatever
// fails while filling, at the end of epoch 0, in a reorder or in .devices' trade (kept
// until the rewind; a failed NCCL call also thrown by next() at once) frees the caches,
// and the stage streams from then on (on every rank; docs/distribute.md).
//
// Memory: per replica, after epoch 0, (its rows) x (row bytes) for the cache and as much
// again for the epoch's shuffled copy (none with shuffle = false), each block at its size;
// epoch 0's step layout (8 bytes a step and replica); with across_replicas, epoch 0's step layout (16 bytes a step and replica of the job);
// across ranks, the traded rows' buffers (kept between epochs); with .devices, per replica
// a receive buffer (its rows x the widest field), 16 + 48 bytes a row (the plan; the sort),
// a stream, 3 events, 16 pinned bytes a job replica. Epoch 0's cache doubles as it grows,
// capped by the budget. Freed with the stage; nothing else is allocated after epoch 0 (but
// the layout on GPUs; across ranks, the traded rows' buffers when an epoch trades more).
//
// Checkpoints: none (cannot_save: the cache is memory). A job resumes with .resume = the
// global_position it saved (epoch, step), at any replica and rank count (the same global
// batches from there), its upstream (global_shuffle) at epoch 0, step 0. In epoch 0, the
// caches fill from its first step but next() hands out the steps from `step` on (those
// before are cached, or streamed, and not returned; on every rank alike); later, epoch 0
// is read whole to fill the caches, serving none of it, then that epoch is served from that
// step. Checked: the order (when the position has one: order() is its fingerprint), G, the
// step, the dataset size (exactly when the rows cached are not a
// multiple of G: partial, pad; else to within G - 1: under drop, n to n + G - 1 rows fill
// the same steps); in epoch 0 the step when the upstream ends before it, G and the size at
// the end of epoch 0 (the first rewind), where the cache serves. Not seen (the upstream's
// position is not the stage's): an upstream not at epoch 0 whose steps match. The same
// sequence only where each job's epoch 0 filled the cache whole: one whose epoch 0 stopped
// part way (refilled from the upstream's epoch 1) or that streamed (over budget) serves
// other rows from epoch 1 on. Also not seen: under partial and pad, a saved size up to G - 1
// above rows cached that are a multiple of G.
//
// Under remainder_policy::pad only epoch 0's last step may be padded (later epochs serve a
// replica's padding rows after all its real rows): the step after a padded one (batch(G) |
// repeat(n), concatenate, a batch smaller than global_batch) is a config_error, handed out
// by the next next(), and every epoch then streams. Under partial any step may be short.
// A rewind() before the first next() of a job resumed at epoch e >= 1 goes on to epoch
// e + 1, from its start.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/config.hpp"
#include "ferry/detail/random.hpp"
#include "ferry/error.hpp"
#include "ferry/source.hpp"
#include "ferry/sources/global_shuffle.hpp"
#include "ferry/stage.hpp"
#include "ferry/stages/detail/cache_arena.hpp"
#include "ferry/stages/detail/cache_exchange.hpp"
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
  bool across_replicas = false;  // one order of all replicas' rows each epoch (the top); needs shuffle
  rank_exchange* ranks = nullptr;  // with it: the processes sharing that order (not owned)
  device_exchange* devices = nullptr;  // with it: GPU replicas trade rows through it (NCCL; not owned)
  // With it: go on from this saved epoch and step, the upstream at epoch 0 (the top: Checkpoints).
  std::optional<global_position> resume = std::nullopt;
};

namespace detail {

template <source Up, class Launch>
class cache_on_device_source : public stage<cache_on_device_source<Up, Launch>, Up> {
  friend stage<cache_on_device_source, Up>;
  using V = value_t<Up>;
  using T = typename step_element<V>::type;  // cache_on_device goes after distribute()
  static constexpr std::size_t nf = batch_of<T>::field_count;
  static_assert([]<std::size_t... I>(std::index_sequence<I...>) {
    return (!(batch_of<T>::template is_padded<I> || batch_of<T>::template is_ragged<I>) && ...);
  }(std::make_index_sequence<nf>{}), "ferry::cache_on_device: fixed-size fields only (no ragged or padded field)");
  static constexpr bool has_kernel = !std::is_same_v<Launch, no_gather_kernel>;

 public:
  static constexpr char name[] = "cache_on_device";
  // Across ranks or devices each step trades rows (an all-to-all every rank joins): no
  // thread may read ahead of it (prefetch and map's workers refuse it; see stage.hpp).
  bool joins_collective_now() const noexcept { return o_.ranks != nullptr || o_.devices != nullptr; }
  static constexpr bool changes_batch_size = true;  // steps, not batches
  static constexpr bool cannot_save = true;         // the cache is memory, not a position

  // Throws config_error for across_replicas without shuffle, ranks without across_replicas,
  // a resume position of another order.
  cache_on_device_source(Up up, cache_on_device_options o) : stage<cache_on_device_source, Up>(std::move(up)), o_(o) {
    if (o_.across_replicas && !o_.shuffle)
      throw config_error("cache_on_device: across_replicas reorders rows across replicas each epoch; it needs shuffle");
    if ((o_.ranks || o_.devices || o_.resume) && !o_.across_replicas)
      throw config_error("cache_on_device: ranks, devices and resume need across_replicas = true (one order for any count)");
    if (o_.resume && o_.resume->order != 0 && o_.resume->order != order()) throw order_mismatch(name);
    exchange_.set_ranks(o_.ranks, o_.devices, o_.seed);
  }
  cache_on_device_source(cache_on_device_source&&) noexcept = default;  // takes o's caches (o keeps none)
  cache_on_device_source& operator=(cache_on_device_source&&) = delete;  // distribute cannot be assigned either
  ~cache_on_device_source() { free_all(); }

  // Whether later epochs come from the caches (false while filling, and after giving up).
  bool cached() const noexcept { return state_ == mode::serving; }
  // The fingerprint of the order across replicas (its seed), for global_position::order.
  std::uint64_t order() const noexcept { return order_fingerprint(0x646576636163ull /* "devcac" */, o_.seed, o_.shuffle); }
  // Rows cached by replica r (r < the replicas seen; 0 when none).
  std::uint64_t rows(std::size_t r) const noexcept { return r < arenas_.size() ? arenas_[r].rows : 0; }
  // The most memory one replica holds for it now, in bytes (its cache and epoch blocks, and
  // with .devices the exchange's buffers).
  std::size_t bytes_per_replica() const noexcept {
    std::size_t m = 0;
    for (std::size_t r = 0; r < arenas_.size(); ++r) m = std::max(m, arenas_[r].bytes + exchange_.device_bytes(r));
    return m;
  }

 private:
  enum class mode { filling, serving, streaming };

  std::optional<V> pull() {
    begun_ = true;
    if (held_) return std::exchange(held_, std::nullopt);  // the step whose keep() threw
    if (o_.resume && !resumed_) return resume();
    return state_ == mode::serving ? serve() : fill();
  }
  // Epoch 0 (or streaming): the upstream's step, kept. A step whose keep() throws (over
  // budget under ::error, a failed copy) is held and handed out by the next next() (unless
  // a resume skips it): the caller who goes on loses no rows, and a rank keeps the others'
  // step count.
  std::optional<V> fill() {
    std::optional<V> st = this->pull_up();
    const bool out = !o_.resume || resumed_;  // handed out (not a resume's steps before its own)
    if (st && !out) ++skipped_;
    if (state_ == mode::streaming) return st;
    if (!st) { filled_ = steps_ > 0; return st; }  // filled: the whole epoch was cached
    ++steps_;
    try {
      if (!keep(*st)) give_up();  // over budget, over_budget::stream
    } catch (...) {
      give_up();  // nothing half cached is ever served
      if (out) held_ = std::move(st);
      throw;
    }
    return st;
  }

  // A resumed job's first step. In epoch 0: its first at.step steps filled (or streamed)
  // and not handed out (after a skipped step's error, the next next() skips on), then the
  // next one. Later: epoch 0 read into the caches, then the saved epoch from its step.
  std::optional<V> resume() {
    const global_position& at = *o_.resume;
    if (at.epoch == 0) {
      while (skipped_ < at.step)
        if (!fill()) cache_exchange::throw_resume_past(at, skipped_);  // the upstream ended first
      resumed_ = true;
      return fill();
    }
    while (state_ == mode::filling && fill()) continue;
    // Rewinds before this first next() went past the saved epoch: epoch at.epoch + r, from
    // its start.
    const std::uint64_t r = early_rewinds_;
    epoch_ = at.epoch - 1 + r;
    start_epoch();  // the ranks' agreement, the end of the fill, the saved epoch's order
    exchange_.check_resume(at, state_ == mode::serving, steps_);
    step_ = r ? 0 : at.step;
    resumed_ = true;
    return serve();
  }

  // The upstream from now on, every epoch; the memory freed.
  void give_up() noexcept { free_all(), state_ = mode::streaming; }

  // A failure in start_epoch() (the agreement, the end of the fill, a reorder) gives the
  // cache up and throws: the stage then streams, so the base's rewind() leaves it usable.
  static constexpr bool usable_when_start_epoch_throws = true;
  void start_epoch() {
    held_.reset();  // a step of the epoch left
    if (o_.resume && o_.resume->epoch == 0) resumed_ = true;  // past its position (or given up)
    if (o_.resume && !resumed_) ++early_rewinds_;  // a later epoch's resume: counted there
    ++epoch_;
    step_ = 0;
    // A rewind before the first next() (a loop that rewinds before each epoch) has begun no
    // epoch 0: across ranks, the agreement waits for the rewind after one.
    const bool idle = state_ == mode::filling && !std::exchange(begun_, false);
    try {
      // The ranks' agreement inside: a collective that fails gives the cache up too, or the
      // next fill would append to epoch 0's rows.
      if (!exchange_.agree_once(state_ == mode::filling && filled_, idle)) return give_up();
      if (state_ == mode::filling && !filled_) {  // epoch 0 stopped part way: fill again from the start
        free_all();
        steps_ = 0;
        return;
      }
      if (state_ == mode::filling) {
        std::exception_ptr e;  // across ranks, every rank learns whether one failed here
        try { finish_fill(); } catch (...) { e = std::current_exception(); }
        exchange_.settle(e);
        state_ = mode::serving;
        if (o_.resume && o_.resume->epoch == 0) exchange_.check_resume(*o_.resume, true, steps_);  // G, n
      }
      if (state_ == mode::serving) reorder();
    } catch (...) {
      give_up();  // an allocation or launch that failed: stream, never serve half a reorder
      throw;
    }
  }

  // A cached row's cost: its bytes, twice with shuffle, + .devices' (its widest field, 16 plan, 48 sort).
  std::size_t per_row() const noexcept { return cache_bytes(1, 1, row_bytes_, widest_, o_.shuffle, o_.devices != nullptr); }

  // Epoch 0: each replica's real rows appended to its cache; false: over budget, under ::stream.
  bool keep(const V& st) {
    if (arenas_.empty()) {
      arenas_.resize(st.replicas());
      for (std::size_t r = 0; r < st.replicas(); ++r) {
        arena_init(arenas_[r], st[r].device(), st[r].stream(), nf);
        if (st[r].device() >= 0 && o_.shuffle && !has_kernel) no_gather_kernel::launch({}, nullptr);  // before caching
      }
      rows_per_step_.assign(st.replicas(), 0);
      row_bytes_ = 0;
      for (std::size_t f = 0; f < nf; ++f) row_bytes_ += (field_bytes_[f] = step_field_bytes(st, f));
      widest_ = *std::max_element(field_bytes_.begin(), field_bytes_.end());
      if (o_.devices && st[0].device() < 0) throw config_error("cache_on_device: .devices with host replicas (use .ranks)");
      if (row_bytes_ == 0) throw config_error("cache_on_device: rows of 0 bytes");
    }
    if (st.replicas() != arenas_.size())
      throw config_error("cache_on_device: steps of " + std::to_string(st.replicas()) + " replicas after " +
                         std::to_string(arenas_.size()));
    // Under pad, later epochs serve each replica's padding rows after all its real rows:
    // only the last step may be padded (one before it, from batch(G) | repeat(n),
    // concatenate or a batch smaller than distribute's global_batch, would need padding
    // rows between real ones). Refused, before this step is cached: it is handed out next,
    // and the upstream streams.
    if (padded_)  // the step before this one was padded (the first padded step is refused at the next)
      throw config_error("cache_on_device: epoch 0's step " + std::to_string(steps_ - 1) + " comes after a padded " +
                         "step (step " + std::to_string(steps_ - 2) + "); under remainder_policy::pad later epochs " +
                         "serve the padding rows after every real row, so only the last step may be padded: caching "
                         "stops, and every epoch streams from the upstream (use remainder_policy::partial, batch "
                         "with drop_remainder, or put repeat or concatenate after cache_on_device)");
    for (std::size_t r = 0; r < st.replicas(); ++r) firsts_.push_back(arenas_[r].rows);
    for (std::size_t r = 0; r < st.replicas(); ++r) padded_ = padded_ || st[r].size() > st[r].valid();
    for (std::size_t r = 0; r < st.replicas(); ++r) {
      const auto& rb = st[r];
      auto& a = arenas_[r];
      if (rb.device() != a.device || rb.stream() != a.stream)  // the copies and gathers are ordered on one stream
        throw config_error("cache_on_device: replica " + std::to_string(r) + " changed device or stream between "
                           "steps (device " + std::to_string(a.device) + " to " + std::to_string(rb.device()) + ")");
      rows_per_step_[r] = std::max(rows_per_step_[r], rb.size());
      const std::uint64_t add = rb.valid(), want = a.rows + add;
      // As if the epoch ended here (finish_fill's sizes): under pad, its padding rows too.
      if (!within_budget(r, want, padded_ ? std::max<std::uint64_t>(want, steps_ * rows_per_step_[r]) : want))
        return false;
      if (add == 0) continue;
      for (std::size_t f = 0; f < nf; ++f) {
        arena_grow(a, f, field_bytes_[f], want, o_.budget_bytes ? o_.budget_bytes / per_row() : 0);
        arena_copy_in(a, f, std::size_t(a.rows) * field_bytes_[f], rb.field_bytes(f).data(), std::size_t(add) * field_bytes_[f]);
      }
      a.rows = want;
    }
    if (o_.across_replicas) exchange_.add_step(st.replicas(), [&](std::size_t r) { return st[r].valid(); });
    return true;
  }

  // Whether replica r may cache `rows` rows and serve `served` (padding rows with them);
  // throws under over_budget::error.
  bool within_budget(std::size_t r, std::uint64_t rows, std::uint64_t served) const {
    const std::size_t need = cache_bytes(rows, served, row_bytes_, widest_, o_.shuffle, o_.devices != nullptr);
    if (!o_.budget_bytes || need <= o_.budget_bytes) return true;
    if (o_.when_over == over_budget::stream) return false;
    throw_over_budget(r, o_.budget_bytes, steps_ - 1, rows, served - rows, row_bytes_, per_row(), need);
  }

  // The end of epoch 0: each replica's serving buffer (arena_finish), the layout's end.
  void finish_fill() {
    if (o_.across_replicas) exchange_.finish(field_bytes_.data(), nf);
    for (std::size_t r = 0; r < arenas_.size(); ++r)
      arena_finish(arenas_[r], std::uint64_t(steps_) * rows_per_step_[r], padded_, o_.shuffle, o_.devices != nullptr,
                   field_bytes_.data(), nf);
    if (o_.across_replicas && !arenas_.empty() && arenas_[0].device >= 0)
      exchange_.template to_devices<Launch>(arenas_, nf, widest_);
  }

  // A new epoch's order: each field's rows gathered into the epoch buffer with one key per
  // replica (its fields stay together); without shuffle the cache serves as it is.
  void reorder() {
    if (!o_.shuffle) return;
    std::uint64_t all[3];  // this epoch's key, the next's, the one after
    for (std::uint64_t k = 0; k < 3; ++k) all[k] = mix_seed({0x646576636163ull, o_.seed, epoch_ + k, 0x616c6cull /* "all" */});
    if (o_.across_replicas) return exchange_.template reorder<Launch>(arenas_, field_bytes_.data(), nf, all);
    gather_own<Launch>(arenas_, field_bytes_.data(), nf, o_.seed, epoch_);
  }

  // A later epoch's step: each replica's next rows of its serving buffer, as views (valid
  // until the next rewind()). Under pad, every replica's slice has epoch 0's size, the
  // padding rows zero; otherwise the real rows only.
  std::optional<V> serve() {
    if (step_ >= steps_) return std::nullopt;
    if (!empty_) empty_ = std::make_shared<const batch_of<T>>();
    V s = step_access::make<T>(empty_, arenas_.size(), step_);
    for (std::size_t r = 0; r < arenas_.size(); ++r) {
      const auto& a = arenas_[r];
      const std::size_t R = arenas_.size();
      const std::uint64_t first = firsts_[step_ * R + r], end = step_ + 1 < steps_ ? firsts_[(step_ + 1) * R + r] : a.rows;
      const replica_slice sl = served_slice(a, first, end, rows_per_step_[r], padded_);
      std::array<const std::byte*, nf> data{};
      for (std::size_t f = 0; f < nf; ++f) data[f] = (o_.shuffle ? a.epoch[f] : a.cache[f]) + sl.first * field_bytes_[f];
      set_fixed_replica(s[r], data.data(), field_bytes_.data(), sl, a.device, a.stream);
    }
    if (o_.across_replicas) exchange_.template on_step<Launch>(arenas_, field_bytes_.data(), step_, steps_);
    ++step_;
    return s;
  }

  void free_all() noexcept {
    exchange_.clear();  // first: it waits for every replica's gathers, which read the others' caches
    for (auto& a : arenas_) arena_free(a);
    arenas_.clear();
    firsts_.clear();
    filled_ = padded_ = false;
  }

  cache_on_device_options o_;
  std::vector<replica_arena> arenas_;
  cache_exchange exchange_;  // across_replicas: epoch 0's step layout
  mode state_ = mode::filling;
  bool filled_ = false;  // epoch 0 read to its end with every step cached
  std::uint64_t early_rewinds_ = 0;  // rewinds of a job resumed at epoch >= 1 before its first next()
  bool begun_ = false;  // next() called since the last rewind (else a rewind begins no epoch 0)
  bool padded_ = false, resumed_ = false;  // epoch 0 had padding rows (later ones pad alike); o_.resume reached
  std::uint64_t epoch_ = 0, steps_ = 0, step_ = 0, skipped_ = 0;  // steps: epoch 0's count; skipped: a resume's, not out
  std::vector<std::size_t> rows_per_step_;  // per replica, its largest epoch-0 slice (under pad: every slice's)
  std::vector<std::uint64_t> firsts_;  // epoch 0's layout: step k's replica r served from row firsts_[k * R + r]
  std::size_t row_bytes_ = 0, widest_ = 0;
  std::array<std::size_t, nf> field_bytes_{};
  std::shared_ptr<const batch_of<T>> empty_;
  std::optional<V> held_;  // see fill()
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

// A gather launcher's argument: a replica's own rows,
using cache_gather_args = detail::gather_args;
// or across_replicas' gather.
using cache_global_gather_args = detail::global_gather_args;
// cache_on_device_with<Launch>(options): for GPUs in code g++ compiles; Launch's static
// launch(const cache_gather_args&, cuda_stream) and launch_global(...) are defined in a .cu
// file as calls of ferry::cuda::cache_gather_launcher's (cache_on_device.cuh; example 04).
template <class Launch>
inline constexpr detail::cache_on_device_t<Launch> cache_on_device_with{};

}  // namespace ferry
