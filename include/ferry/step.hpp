// ferry/step.hpp: what distribute() hands out: a step<T> per global batch, holding one
// replica_batch<T> per replica (its rows in that replica's memory, ready on its stream);
// and the host backend (distribute(ferry::host_replicas{n})), which splits a batch into
// views of it and copies nothing. stages/distribute.hpp documents the splitting, the
// remainder policy and the release contract.
//
//   for (auto& st : steps)
//     for (std::size_t r = 0; r < st.replicas(); ++r) {
//       ferry::replica_batch<T>& rb = st[r];   // rb.field<0>(), rb.size(), rb.valid(), rb.stream()
//     }
//
// A step is move-only; it keeps its host batch (and a backend's device buffers) until it is
// destroyed or the next step is asked for. No threads; nothing runs user code. Throws:
// config_error from host_replicas_backend for 0 replicas. field<I>() past the last field
// is a compile-time error naming I and the field count, as batch_of's.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <memory_resource>
#include <span>
#include <type_traits>
#include <vector>

#include "ferry/batch_of.hpp"
#include "ferry/cuda/stream_handle.hpp"
#include "ferry/detail/is_step.hpp"
#include "ferry/error.hpp"
#include "ferry/memory/buffer.hpp"

namespace ferry {

// The host backend's tag: n replicas whose batches stay in host memory.
struct host_replicas {
  std::size_t n = 1;  // the number of replicas, at least 1
};

// What distribute() does with a global batch shorter than G: drop, pad or partial (see
// stages/distribute.hpp); every replica gets the same number of steps either way.
enum class remainder_policy { drop, pad, partial };

template <class T>
class step;

namespace detail {
struct step_access;

// T of step<T>, for a stage after distribute whose upstream's elements are V; a clear error
// when they are not steps (the stage was put before distribute).
template <class V>
struct step_element {
  static_assert(is_step<V>::value, "ferry: this stage goes after distribute(): its upstream's elements must be steps");
  using type = typename is_step<V>::element;
};

// Rows [first, first + rows) of the global batch; the first `valid` of them are data.
struct replica_slice {
  std::size_t first = 0, rows = 0, valid = 0;
};

// Backend resources a step holds; release() says "the consumer has enqueued all its work
// on this step" (called when the next step is requested or the step is destroyed).
struct step_lease {
  virtual ~step_lease() = default;
  virtual void release() noexcept = 0;
};
}  // namespace detail

// One replica's part of a step: `size()` rows of each field in that replica's memory.
template <class T>
class replica_batch {
  using B = batch_of<T>;

 public:
  static constexpr std::size_t field_count = B::field_count;  // as batch_of<T>'s
  // The type of field I, as batch_of<T>'s.
  template <std::size_t I>
  using field_t = typename B::template field_t<I>;

  replica_batch() = default;

  // Rows in this slice (padding included).
  std::size_t size() const noexcept { return size_; }
  // Rows that are real data: the first valid() rows. == size() except for a padded or
  // partial last batch.
  std::size_t valid() const noexcept { return valid_; }
  // Whether the slice has no row (partial remainder: a replica past the data).
  bool empty() const noexcept { return size_ == 0; }
  // -1 for host replicas, else the CUDA device ordinal the data is on.
  int device() const noexcept { return device_; }
  // The stream on which the data is ready (enqueue work on it): a cudaStream_t (the same
  // type, ferry/cuda/stream_handle.hpp); null for host replicas.
  cuda_stream stream() const noexcept { return stream_; }

  // Field I of this slice: host memory for host replicas, device memory for CUDA (do not
  // dereference it on the host then). A padded field (padded_batch()) is a padded_view of
  // this slice's rows and their lengths, its width the step's L. A ragged field is a
  // ragged_view of this slice's values and its size()+1 offsets, rebased to start at 0.
  template <std::size_t I = 0>
  auto field() const {
    if constexpr (I >= field_count) {  // a misuse stops here, before <tuple>'s errors
      return typename detail::batch_field_index_out_of_range<I, field_count, T>::error_above{};
    } else if constexpr (B::template is_padded<I>) {
      using E = typename field_t<I>::value_type;
      const std::size_t w = elem_bytes_[I] / sizeof(E);
      return padded_view<E>{std::span<const E>(reinterpret_cast<const E*>(data_[I]), size_ * w), w,
                            std::span<const std::uint32_t>(reinterpret_cast<const std::uint32_t*>(aux_[I]), size_)};
    } else if constexpr (B::template is_ragged<I>) {
      using E = typename detail::field_traits<field_t<I>>::element;
      // A slice made without a batch (lockstep's empty steps) has no offsets: {0}, as an
      // empty slice of distribute's has.
      static constexpr std::uint64_t no_rows = 0;
      const std::uint64_t* off = aux_[I] ? reinterpret_cast<const std::uint64_t*>(aux_[I]) : &no_rows;
      return ragged_view<E>{std::span<const E>(reinterpret_cast<const E*>(data_[I]), values_[I]),
                            std::span<const std::uint64_t>(off, aux_[I] ? size_ + 1 : 1)};
    } else {
      return std::span<const field_t<I>>(reinterpret_cast<const field_t<I>*>(data_[I]), size_);
    }
  }
  // Raw bytes of field f: size() * the field's row bytes (a padded field: L values a
  // row); a ragged field's values.
  std::span<const std::byte> field_bytes(std::size_t f) const {
    return {data_[f], (ragged_[f] ? values_[f] : size_) * elem_bytes_[f]};
  }
  // A padded field's lengths as bytes (size() uint32 values); empty for other fields.
  std::span<const std::byte> lengths_bytes(std::size_t f) const {
    if (!aux_[f] || ragged_[f]) return {};
    return {aux_[f], size_ * sizeof(std::uint32_t)};
  }
  // A ragged field's size()+1 offsets (rebased to 0) as bytes; empty for other fields.
  std::span<const std::byte> offsets_bytes(std::size_t f) const {
    if (!ragged_[f]) return {};
    return {aux_[f], (size_ + 1) * sizeof(std::uint64_t)};
  }

 private:
  friend struct detail::step_access;
  std::array<const std::byte*, field_count> data_{};
  std::array<const std::byte*, field_count> aux_{};  // padded fields' lengths, ragged fields' offsets
  std::array<std::size_t, field_count> values_{};  // ragged fields' value counts
  std::array<bool, field_count> ragged_{};
  std::array<std::size_t, field_count> elem_bytes_{};
  std::size_t size_ = 0, valid_ = 0;
  int device_ = -1;
  cuda_stream stream_ = nullptr;
};

// One training step: one replica_batch per replica. Every replica's size() is G/R, except
// for a short last batch under remainder_policy::partial, where sizes differ by at most one
// (some may be 0). Move-only.
// It keeps the host batch alive (and, for CUDA, the device buffers leased to it).
template <class T>
class step {
 public:
  step() = default;
  // Takes o's batches and resources; o is left empty.
  step(step&&) noexcept = default;
  // Releases this step's resources, then takes o's.
  step& operator=(step&&) noexcept = default;
  step(const step&) = delete;
  step& operator=(const step&) = delete;

  // The number of replicas R.
  std::size_t replicas() const noexcept { return r_.size(); }
  // Replica r's batch (r < replicas(), unchecked).
  replica_batch<T>& operator[](std::size_t r) { return r_[r]; }
  // Replica r's batch, read-only.
  const replica_batch<T>& operator[](std::size_t r) const { return r_[r]; }
  // The first replica's batch: `for (auto& rb : step)` visits them in order.
  auto begin() { return r_.begin(); }
  // Past the last replica's batch.
  auto end() { return r_.end(); }
  // The first replica's batch, read-only.
  auto begin() const { return r_.begin(); }
  // Past the last replica's batch, read-only.
  auto end() const { return r_.end(); }

  // Rows over all replicas (padding included), and real rows.
  std::size_t global_size() const noexcept {
    std::size_t s = 0;
    for (auto& b : r_) s += b.size();
    return s;
  }
  // Real rows over all replicas (the sum of their valid()).
  std::size_t valid() const noexcept {
    std::size_t s = 0;
    for (auto& b : r_) s += b.valid();
    return s;
  }
  // 0-based step number within the epoch.
  std::uint64_t index() const noexcept { return index_; }
  // The global host batch the slices were cut from (the padded copy under pad); an empty
  // batch for a default-constructed or moved-from step.
  const batch_of<T>& host_batch() const {
    static const batch_of<T> none;
    return host_ ? *host_ : none;
  }

 private:
  friend struct detail::step_access;
  std::vector<replica_batch<T>> r_;
  std::shared_ptr<const batch_of<T>> host_;
  std::shared_ptr<detail::step_lease> lease_;
  std::uint64_t index_ = 0;
};

namespace detail {

// What backends use to build steps.
struct step_access {
  template <class T>
  static step<T> make(std::shared_ptr<const batch_of<T>> host, std::size_t replicas,
                      std::uint64_t index) {
    step<T> s;
    s.host_ = std::move(host);
    s.r_.resize(replicas);
    s.index_ = index;
    return s;
  }
  template <class T>
  static void set_lease(step<T>& s, std::shared_ptr<step_lease> l) {
    s.lease_ = std::move(l);
  }
  template <class T>
  static const std::shared_ptr<step_lease>& lease(const step<T>& s) {
    return s.lease_;
  }
  // data[f]: field f's rows (a ragged field's values); aux[f]: a padded field's lengths or
  // a ragged field's rebased offsets (null otherwise); values[f]: a ragged field's values.
  template <class T>
  static void set_replica(replica_batch<T>& rb, const std::byte* const* data, const std::byte* const* aux,
                          const std::size_t* values, const batch_of<T>& host, const replica_slice& sl, int device,
                          cuda_stream stream) {
    for (std::size_t f = 0; f < batch_of<T>::field_count; ++f) {
      rb.data_[f] = data[f];
      rb.aux_[f] = aux[f];
      rb.values_[f] = values[f];
      rb.ragged_[f] = host.field_is_ragged(f);
      rb.elem_bytes_[f] = host.element_bytes(f);
    }
    rb.size_ = sl.rows;
    rb.valid_ = sl.valid;
    rb.device_ = device;
    rb.stream_ = stream;
  }
  template <class T>
  static void set_fixed(replica_batch<T>& rb, const std::byte* const* data, const std::size_t* elem_bytes,
                        const replica_slice& sl, int device, cuda_stream stream) {
    for (std::size_t f = 0; f < batch_of<T>::field_count; ++f) {
      rb.data_[f] = data[f];
      rb.aux_[f] = nullptr;
      rb.values_[f] = 0;
      rb.ragged_[f] = false;
      rb.elem_bytes_[f] = elem_bytes[f];
    }
    rb.size_ = sl.rows;
    rb.valid_ = sl.valid;
    rb.device_ = device;
    rb.stream_ = stream;
  }
};

template <class T>
void set_fixed_replica(replica_batch<T>& rb, const std::byte* const* data, const std::size_t* elem_bytes,
                       const replica_slice& sl, int device, cuda_stream stream) {
  step_access::set_fixed(rb, data, elem_bytes, sl, device, stream);
}

// A replica batch of fixed fields with no host batch behind it (cache_on_device's steps):
// data[f] field f's rows, elem_bytes[f] its row bytes.
template <class T>
void set_fixed_replica(replica_batch<T>& rb, const std::byte* const* data, const std::size_t* elem_bytes,
                       const replica_slice& sl, int device, cuda_stream stream);

// A ragged field's offsets for rows [first, first + rows) of b, rebased to start at 0
// (rows + 1 of them) into out.
template <class T>
void rebase_offsets(const batch_of<T>& b, std::size_t f, std::size_t first, std::size_t rows, std::uint64_t* out) {
  const std::uint64_t* off = b.ragged_offsets(f);
  for (std::size_t i = 0; i <= rows; ++i) out[i] = off ? off[first + i] - off[first] : 0;
}
// The values of rows [first, first + rows) of ragged field f.
template <class T>
std::size_t ragged_values(const batch_of<T>& b, std::size_t f, std::size_t first, std::size_t rows) {
  const std::uint64_t* off = b.ragged_offsets(f);
  return off ? static_cast<std::size_t>(off[first + rows] - off[first]) : 0;
}

// What a host step keeps besides the host batch: its replicas' rebased offsets.
struct host_offsets_lease final : step_lease {
  buffer offsets;
  explicit host_offsets_lease(buffer b) : offsets(std::move(b)) {}
  void release() noexcept override {}
};

// The host backend: slices are views of the host batch; nothing is copied but a ragged
// field's offsets, rebased for each replica (from a pool: no allocation after warm-up).
class host_replicas_backend {
 public:
  explicit host_replicas_backend(host_replicas h) : n_(h.n) {
    if (n_ == 0) throw config_error("distribute(host_replicas{0}): need at least one replica");
  }
  std::size_t replicas() const noexcept { return n_; }
  std::shared_ptr<std::pmr::memory_resource> default_host_resource() const {
    return std::make_shared<buffer_pool>();
  }
  template <class T>
  step<T> make_step(std::shared_ptr<const batch_of<T>> host, std::span<const replica_slice> slices,
                    std::size_t /*rows_per_replica*/, std::uint64_t index) {
    constexpr std::size_t nf = batch_of<T>::field_count;
    step<T> s = step_access::make<T>(host, n_, index);
    std::uint64_t* rebased = nullptr;
    if constexpr (!no_ragged<typename field_list<T>::type>::value) {
      std::size_t words = 0;
      for (std::size_t f = 0; f < nf; ++f)
        if (host->field_is_ragged(f))
          for (std::size_t r = 0; r < n_; ++r) words += slices[r].rows + 1;
      if (!pool_) pool_ = std::make_shared<buffer_pool>();
      auto lease = std::make_shared<host_offsets_lease>(buffer(pool_, words * sizeof(std::uint64_t)));
      rebased = reinterpret_cast<std::uint64_t*>(lease->offsets.data());
      step_access::set_lease(s, std::move(lease));
    }
    for (std::size_t r = 0; r < n_; ++r) {
      std::array<const std::byte*, nf> data{}, aux{};
      std::array<std::size_t, nf> values{};
      const std::size_t first = slices[r].first;
      for (std::size_t f = 0; f < nf; ++f) {
        if (host->field_is_ragged(f)) {
          const std::uint64_t* off = host->ragged_offsets(f);
          data[f] = host->field_buffer(f).data() + (off ? off[first] : 0) * host->element_bytes(f);
          values[f] = ragged_values(*host, f, first, slices[r].rows);
          rebase_offsets(*host, f, first, slices[r].rows, rebased);
          aux[f] = reinterpret_cast<const std::byte*>(rebased);
          rebased += slices[r].rows + 1;
          continue;
        }
        data[f] = host->field_buffer(f).data() + first * host->element_bytes(f);
        if (host->field_is_padded(f)) aux[f] = host->lengths_bytes(f, first, 0).data();
      }
      step_access::set_replica(s[r], data.data(), aux.data(), values.data(), *host, slices[r], -1, nullptr);
    }
    return s;
  }

 private:
  std::size_t n_;
  std::shared_ptr<buffer_pool> pool_;  // rebased offsets; created by the first ragged step
};

}  // namespace detail

// The customisation point: found by ADL on the tag.
inline detail::host_replicas_backend make_distribute_backend(const host_replicas& h) {
  return detail::host_replicas_backend(h);
}

}  // namespace ferry
