// ferry/cuda/devices.hpp: the CUDA backend of distribute(): one replica per listed device.
//
//   auto steps = std::move(batches) | ferry::distribute(ferry::cuda::devices{0, 1});
//   for (auto& step : steps) {
//     auto& rb = step[r];
//     my_kernel<<<g, b, 0, (cudaStream_t)rb.stream()>>>(rb.field<0>().data(), rb.size());
//   }
//
// Per step and replica: the replica's slice of the (pinned) host batch is copied with
// cudaMemcpyAsync on that replica's own copy stream into a block from the replica's
// device_buffer_pool; an event is recorded after the copy, and when next() hands the step
// out the replica's compute stream waits on it (cudaStreamWaitEvent): the data is ready
// for any work enqueued on rb.stream() after next() returned, and the host never waits.
//
// The release contract. A step is released when the next step is requested (next()) or
// when it is destroyed, whichever comes first. At release, an event is recorded on each
// replica's compute stream and the device block returns to its pool with it; the next
// copy into that block waits (on the GPU) for the event. So: enqueue all work that reads
// step k on rb.stream() (or on streams that rb.stream() waits for) before asking for step
// k+1; work enqueued after that may see the block overwritten. The host batch is kept
// until the copies out of it have finished (polled with cudaEventQuery), then returned
// to the pinned pool. A pool past its bound frees pinned blocks (cudaFreeHost, which
// waits for the device): on the staging thread that is deferred to the consumer's next()
// (ferry/detail/deferred_frees.hpp), as device blocks are (device_pool.hpp's top).
//
// Overlap. With distribute_options::steps_ahead = 1 (the default) step k+1 is made, its
// copies enqueued, when step k is handed out, so they run while the GPU works on step k,
// even when the consumer waits on the host for each step's result. Step k+1 reuses the
// block of step k-1 (released as step k is handed out): its copy waits, on the GPU, for
// step k-1's work and runs beside step k's. Two blocks per replica in steady state.
// With steps_ahead = 0 step k+1 is made when asked for: its copy overlaps step k's work
// only if step k is still alive then (range-for keeps it) and the host has not waited
// for that work.
//
// Backpressure. When more than `max_pending` released steps still have copies in flight
// (the host is that far ahead of the GPU), next() waits on the host for the oldest copy
// to finish, so pinned memory stays bounded; a GPU that keeps up never makes it wait.
//
// Streams: by default ferry creates one non-blocking copy stream and one non-blocking
// compute stream per replica; pass compute streams of your own in `compute_streams`
// (one per ordinal; they must outlive the pipeline and every step). The same ordinal may
// appear more than once: each occurrence is a separate replica with its own streams.
//
// Shutdown: when the pipeline and all its steps are gone, ferry synchronises the copy
// streams and the release events, then frees every block, event and owned stream, also
// mid-epoch. Throws config_error for an empty or out-of-range device list or no usable
// device, and cuda_error (call, device, status) for runtime failures. Runs on the thread
// calling next(); steps may be destroyed on any thread.
//
// Without the CUDA runtime (FERRY_WITH_CUDART unset) only the tag is defined, and
// distribute(cuda::devices{...}) fails to compile with a message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

#include "ferry/config.hpp"
#include "ferry/stages/distribute.hpp"

#if defined(FERRY_WITH_CUDART)
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>

#include "ferry/cuda/device_pool.hpp"
#include "ferry/cuda/error.hpp"
#include "ferry/cuda/runtime.hpp"
#include "ferry/cuda/stream.hpp"
#include "ferry/memory/pinned.hpp"
#endif

namespace ferry::cuda {

// The tag: CUDA device ordinals, one replica each.
struct devices {
  std::vector<int> ordinals;  // the devices, one replica each, in replica order
  std::vector<cuda_stream> compute_streams;  // cudaStream_t each; empty: ferry's own streams
  std::size_t max_pending = 4;         // released steps with copies in flight (backpressure)

  // devices{0, 1}: those ordinals, ferry's own streams.
  devices(std::initializer_list<int> ids) : ordinals(ids) {}
  // The ordinals, and optionally the compute stream of each (one per ordinal).
  explicit devices(std::vector<int> ids, std::vector<cuda_stream> streams = {})
      : ordinals(std::move(ids)), compute_streams(std::move(streams)) {}
};

#if !defined(FERRY_WITH_CUDART)

// Without the CUDA runtime: distribute(devices{...}) is a compile error saying so.
template <class D>
  requires std::same_as<D, devices>
auto make_distribute_backend(const D&) {
  static_assert(::ferry::detail::always_false<D>,
                "ferry::cuda::devices needs the CUDA runtime: link cudart and define "
                "FERRY_WITH_CUDART (Meson: cudart_dep), or use ferry::host_replicas");
  return ::ferry::detail::host_replicas_backend(host_replicas{1});
}

#else

namespace detail {

inline constexpr std::size_t field_alignment = 256;

// Everything the backend owns; shared by the stage and by the steps it handed out, so it
// lives until both are gone.
class devices_state {
 public:
  struct replica {
    int device = 0;
    stream copy;
    stream compute;
    std::unique_ptr<device_buffer_pool> pool;
  };
  // A host batch whose copies may still be running, and the events that say when not.
  struct deferred {
    std::shared_ptr<const void> host;
    std::vector<std::pair<std::size_t, cudaEvent_t>> copies;  // (replica, event)
  };

  devices_state(const std::vector<int>& ordinals, const std::vector<cuda_stream>& streams) {
    r_.reserve(ordinals.size());
    for (std::size_t i = 0; i < ordinals.size(); ++i) {
      replica rep;
      rep.device = ordinals[i];
      rep.copy = stream::create(ordinals[i]);
      rep.compute = streams.empty() ? stream::create(ordinals[i])
                                    : stream::borrow(static_cast<cudaStream_t>(streams[i]), ordinals[i]);
      rep.pool = std::make_unique<device_buffer_pool>(ordinals[i], /*frees_on_reclaim=*/true);  // hand_out frees
      r_.push_back(std::move(rep));
    }
  }
  devices_state(const devices_state&) = delete;
  devices_state& operator=(const devices_state&) = delete;
  ~devices_state() {
    for (auto& rep : r_) {
      rep.copy.synchronize_noexcept();
      if (rep.compute.owned()) rep.compute.synchronize_noexcept();
    }
    for (auto& d : pending_)
      for (auto [r, e] : d.copies) r_[r].pool->give_event(e);
    pending_.clear();
    // replicas go in reverse member order: pool (waits on release events) before streams
  }

  replica& at(std::size_t r) { return r_[r]; }
  const replica& at(std::size_t r) const { return r_[r]; }
  std::size_t size() const noexcept { return r_.size(); }

  // Frees host batches whose copies have finished; never blocks.
  void poll() noexcept {
    std::vector<std::shared_ptr<const void>> done;
    {
      std::lock_guard lk(m_);
      while (!pending_.empty() && copies_done(pending_.front())) {
        for (auto [r, e] : pending_.front().copies) r_[r].pool->give_event(e);
        done.push_back(std::move(pending_.front().host));
        pending_.pop_front();
      }
    }
  }  // `done` frees the batches here, outside the lock

  // Parks a released step's host batch until its copies are done; poll() (on the thread
  // that makes steps) returns it. No CUDA call here: release() runs on the consumer's
  // thread, whose every microsecond a launch-bound training loop feels.
  void defer(deferred d) noexcept {
    if (d.copies.empty()) return;
    std::lock_guard lk(m_);
    try {
      pending_.push_back(std::move(d));
    } catch (...) {  // out of memory: wait instead
      for (auto [r, e] : d.copies) {
        FERRY_CUDA_LOG(cudaEventSynchronize(e));
        r_[r].pool->give_event(e);
      }
    }
  }
  std::size_t pending_host_batches() const {
    std::lock_guard lk(m_);
    return pending_.size();
  }
  // Backpressure: while more than `limit` host batches have copies in flight, waits on the
  // host for the oldest. Returns how many it waited for. Its events are read outside the
  // lock: safe because only the stage's thread (make_step) polls and gives them back;
  // leases released on other threads only defer().
  std::size_t wait_while_more_than(std::size_t limit) {
    std::size_t waited = 0;
    for (;;) {
      std::vector<std::pair<std::size_t, cudaEvent_t>> oldest;
      {
        std::lock_guard lk(m_);
        if (pending_.size() <= limit) return waited;
        oldest = pending_.front().copies;
      }
      for (auto [r, e] : oldest) {
        const device_guard g(r_[r].device);  // a failure names the replica's device
        FERRY_CUDA_TRY(cudaEventSynchronize(e));
      }
      ++waited;
      poll();
    }
  }

 private:
  static bool copies_done(const deferred& d) noexcept {
    for (auto [r, e] : d.copies) {
      const cudaError_t st = cudaEventQuery(e);
      if (st == cudaErrorNotReady) return false;
      if (st != cudaSuccess) FERRY_CUDA_LOG(st);  // treat as done: nothing more will run
    }
    return true;
  }

  std::vector<replica> r_;
  mutable std::mutex m_;
  std::deque<deferred> pending_;
};

// The device blocks and host batch one step holds.
class devices_lease final : public ::ferry::detail::step_lease {
 public:
  struct held {
    void* p = nullptr;
    std::size_t bytes = 0;
    cudaEvent_t copied = nullptr;
  };
  devices_lease(std::shared_ptr<devices_state> st, std::shared_ptr<const void> host)
      : st_(std::move(st)), host_(std::move(host)), held_(st_->size()) {}
  ~devices_lease() override { release(); }

  held& at(std::size_t r) { return held_[r]; }

  void release() noexcept override {
    std::lock_guard lk(m_);
    if (released_) return;
    released_ = true;
    devices_state::deferred d;
    d.host = std::move(host_);
    const cuda::device_restore keep;
    for (std::size_t r = 0; r < held_.size(); ++r) {
      auto& h = held_[r];
      auto& rep = st_->at(r);
      FERRY_CUDA_LOG(cudaSetDevice(rep.device));
      if (h.copied) {
        try {
          d.copies.emplace_back(r, h.copied);
        } catch (...) {
          FERRY_CUDA_LOG(cudaEventSynchronize(h.copied));
          rep.pool->give_event(h.copied);
        }
      } else if (h.p) {  // make_step threw after some of this replica's copies were queued
        rep.copy.synchronize_noexcept();
      }
      if (!h.p) continue;
      cudaEvent_t ev = rep.pool->try_take_event();
      if (ev && cudaEventRecord(ev, rep.compute.get()) == cudaSuccess) {
        rep.pool->release(h.p, h.bytes, ev);
      } else {  // cannot order reuse on the GPU: wait for the consumer on the host
        if (ev) rep.pool->give_event(ev);
        rep.compute.synchronize_noexcept();
        rep.pool->release(h.p, h.bytes, nullptr);
      }
      h.p = nullptr;
    }
    st_->defer(std::move(d));
  }

 private:
  std::mutex m_;
  std::shared_ptr<devices_state> st_;
  std::shared_ptr<const void> host_;
  std::vector<held> held_;
  bool released_ = false;
};

class devices_backend {
 public:
  static constexpr bool copies_to_devices = true;  // distribute() makes steps ahead

  explicit devices_backend(const devices& d)
      : ord_(d.ordinals), streams_(d.compute_streams), max_pending_(d.max_pending) {
    if (ord_.empty()) throw config_error("distribute(cuda::devices{}): list at least one device");
    if (!available())
      throw config_error("distribute(cuda::devices): no usable CUDA device (" + unavailable_reason() +
                         "); use ferry::host_replicas on machines without a GPU");
    for (int o : ord_)
      if (o < 0 || o >= device_count())
        throw config_error("distribute(cuda::devices): device " + std::to_string(o) +
                           " does not exist (this machine has " + std::to_string(device_count()) + ")");
    if (!streams_.empty() && streams_.size() != ord_.size())
      throw config_error("distribute(cuda::devices): give one compute stream per device (" +
                         std::to_string(ord_.size()) + "), or none");
  }

  devices_backend(devices_backend&& o) noexcept
      : ord_(std::move(o.ord_)), streams_(std::move(o.streams_)), max_pending_(o.max_pending_), grow_below_(o.grow_below_),
        block_bytes_(o.block_bytes_),
        backpressure_waits_(o.backpressure_waits_.load(std::memory_order_relaxed)), st_(std::move(o.st_)) {}

  std::size_t replicas() const noexcept { return ord_.size(); }
  std::shared_ptr<std::pmr::memory_resource> default_host_resource() const { return pinned_pool(); }

  template <class T>
  step<T> make_step(std::shared_ptr<const batch_of<T>> host,
                    std::span<const ::ferry::detail::replica_slice> slices, std::size_t per,
                    std::uint64_t index) {
    using access = ::ferry::detail::step_access;
    constexpr std::size_t nf = batch_of<T>::field_count;
    if (!st_) st_ = std::make_shared<devices_state>(ord_, streams_);
    st_->poll();
    backpressure_waits_.fetch_add(st_->wait_while_more_than(max_pending_), std::memory_order_relaxed);

    // One block per replica, each field at an aligned offset. Fixed fields: the full
    // per-replica rows, the same size every step, so the pool always reuses. Padded fields
    // (with their lengths): the step's most rows a replica has, times L; L and the rows
    // change from step to step (a token budget's batch of one row of L = max_tokens must
    // not take per × L). Ragged fields: their values, which change too. Blocks are the
    // largest size seen, so after the largest step nothing more is allocated (and the pool
    // frees the smaller blocks as they come back). A ragged field: its values, then its
    // offsets rebased to 0 (rebased on the host into one pinned buffer the step keeps until
    // its copies are done).
    auto aligned = [](std::size_t b) { return (b + field_alignment - 1) / field_alignment * field_alignment; };
    std::array<std::size_t, nf> off{}, aux_off{};
    std::size_t total = 0;
    constexpr bool has_ragged = !::ferry::detail::no_ragged<typename ::ferry::detail::field_list<T>::type>::value;
    std::size_t rebased_words = 0, most_rows = 0;
    for (std::size_t r = 0; r < ord_.size(); ++r) most_rows = std::max(most_rows, slices[r].rows);
    for (std::size_t f = 0; f < nf; ++f) {
      off[f] = total;
      if (host->field_is_ragged(f)) {
        std::size_t most = 0;
        for (std::size_t r = 0; r < ord_.size(); ++r) {
          most = std::max(most, ::ferry::detail::ragged_values(*host, f, slices[r].first, slices[r].rows));
          rebased_words += slices[r].rows + 1;
        }
        total += aligned(most * host->element_bytes(f));
        aux_off[f] = total;
        total += aligned((per + 1) * sizeof(std::uint64_t));
        continue;
      }
      if (host->field_is_padded(f)) {
        total += aligned(most_rows * host->element_bytes(f));
        aux_off[f] = total;
        total += aligned(most_rows * sizeof(std::uint32_t));
        continue;
      }
      total += aligned(per * host->element_bytes(f));
    }
    // A larger step grows the block by half at least: data whose steps keep growing
    // (length-sorted sequences) then allocates (and retires the smaller blocks, freed by
    // hand_out once their last users are done) about twice per doubling, not every step. The price: a
    // block up to half larger than the largest step.
    if (total > block_bytes_)
      block_bytes_ = buffer_pool::size_class(block_bytes_ == 0 ? total : std::max(total, block_bytes_ + block_bytes_ / 2));
    std::shared_ptr<const void> keep = host;
    std::uint64_t* rebased = nullptr;
    if constexpr (has_ragged) {
      auto k = std::make_shared<std::pair<std::shared_ptr<const batch_of<T>>, buffer>>(
          host, buffer(pinned_pool(), rebased_words * sizeof(std::uint64_t)));
      rebased = reinterpret_cast<std::uint64_t*>(k->second.data());
      keep = std::move(k);
    }

    auto lease = std::make_shared<devices_lease>(st_, std::move(keep));
    step<T> s = access::make<T>(host, ord_.size(), index);
    for (std::size_t r = 0; r < ord_.size(); ++r) {
      auto& rep = st_->at(r);
      device_guard g(rep.device);
      auto& h = lease->at(r);
      h.p = rep.pool->acquire(block_bytes_, rep.copy.get(), grow_below_);
      h.bytes = block_bytes_;
      auto* base = static_cast<std::byte*>(h.p);
      std::array<const std::byte*, nf> data{}, aux{};
      std::array<std::size_t, nf> values{};
      for (std::size_t f = 0; f < nf; ++f) {
        data[f] = base + off[f];
        const std::size_t es = host->element_bytes(f);
        if (host->field_is_ragged(f)) {
          const std::size_t first = slices[r].first, rows = slices[r].rows;
          values[f] = ::ferry::detail::ragged_values(*host, f, first, rows);
          if (values[f])
            FERRY_CUDA_TRY(cudaMemcpyAsync(base + off[f], host->field_bytes(f, first, rows).data(), values[f] * es,
                                           cudaMemcpyHostToDevice, rep.copy.get()));
          ::ferry::detail::rebase_offsets(*host, f, first, rows, rebased);
          aux[f] = base + aux_off[f];
          FERRY_CUDA_TRY(cudaMemcpyAsync(base + aux_off[f], rebased, (rows + 1) * sizeof(std::uint64_t),
                                         cudaMemcpyHostToDevice, rep.copy.get()));
          rebased += rows + 1;
          continue;
        }
        const std::size_t bytes = slices[r].rows * es;
        if (bytes)
          FERRY_CUDA_TRY(cudaMemcpyAsync(base + off[f], host->field_buffer(f).data() + slices[r].first * es,
                                         bytes, cudaMemcpyHostToDevice, rep.copy.get()));
        if (host->field_is_padded(f)) {
          aux[f] = base + aux_off[f];
          const auto lb = host->lengths_bytes(f, slices[r].first, slices[r].rows);
          if (!lb.empty())
            FERRY_CUDA_TRY(cudaMemcpyAsync(base + aux_off[f], lb.data(), lb.size(), cudaMemcpyHostToDevice,
                                           rep.copy.get()));
        }
      }
      // Set only once recorded: a lease without it (a copy above threw) waits for the copy
      // stream before the host batch goes back to its pool (devices_lease::release).
      cudaEvent_t copied = rep.pool->take_event();
      if (const cudaError_t st = cudaEventRecord(copied, rep.copy.get()); st != cudaSuccess) {
        rep.pool->give_event(copied);
        FERRY_CUDA_TRY(st);
      }
      h.copied = copied;
      access::set_replica(s[r], data.data(), aux.data(), values.data(), *host, slices[r], rep.device,
                          rep.compute.get());
    }
    access::set_lease(s, std::move(lease));
    return s;
  }

  // distribute() hands the step to the consumer: its compute streams wait (on the GPU) for
  // the copies. Done now, not in make_step: a step made ahead would otherwise put the wait
  // before the consumer's work on the step before, and that work behind the copy.
  template <class T>
  void hand_out(step<T>& s) {
    auto* lease = static_cast<devices_lease*>(::ferry::detail::step_access::lease(s).get());
    for (std::size_t r = 0; r < ord_.size(); ++r) {
      auto& rep = st_->at(r);
      device_guard g(rep.device);
      FERRY_CUDA_TRY(cudaStreamWaitEvent(rep.compute.get(), lease->at(r).copied, 0));
      // Blocks a larger step replaced, freed here on the consumer's thread between steps,
      // not by the staging thread while a trainer's replicas launch collectives
      // (device_pool.hpp's top).
      rep.pool->reclaim();
    }
    // Pinned blocks the staging thread let go come up through its producer's take()
    // (deferred_frees.hpp).
  }

  // distribute's staging thread keeps `n` steps ahead: let each replica's pool grow to the
  // blocks that keeps in flight (handed out, queued, being made, released and still read)
  // rather than make a copy wait for the step just released (device_buffer_pool::acquire).
  void set_staging_depth(std::size_t n) noexcept { grow_below_ = n == 0 ? 0 : n + 3; }

  // For tests and benchmarks.
  cudaStream_t copy_stream(std::size_t r) const { return st_ ? st_->at(r).copy.get() : nullptr; }
  cudaStream_t compute_stream(std::size_t r) const { return st_ ? st_->at(r).compute.get() : nullptr; }
  device_buffer_pool::stats pool_stats(std::size_t r) const {
    return st_ ? st_->at(r).pool->statistics() : device_buffer_pool::stats{};
  }
  std::size_t pending_host_batches() const { return st_ ? st_->pending_host_batches() : 0; }
  // Times next() waited on the host because the GPU was max_pending steps behind.
  std::uint64_t backpressure_waits() const noexcept { return backpressure_waits_.load(std::memory_order_relaxed); }

 private:
  std::vector<int> ord_;
  std::vector<cuda_stream> streams_;
  std::size_t max_pending_;
  std::size_t grow_below_ = 0;
  std::size_t block_bytes_ = 0;  // the largest step's block: touched by the thread making steps
  std::atomic<std::uint64_t> backpressure_waits_{0};  // counted on the thread making steps
  std::shared_ptr<devices_state> st_;  // created by the first step (nothing runs before)
};

}  // namespace detail

// The customisation point distribute() finds by ADL on the tag: d's replicas' backend.
inline detail::devices_backend make_distribute_backend(const devices& d) {
  return detail::devices_backend(d);
}

#endif

}  // namespace ferry::cuda
