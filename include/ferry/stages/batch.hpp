// ferry/stages/batch.hpp: batch(n, {.drop_remainder}) collates n elements into one
// contiguous buffer per field.
//
//   src | ferry::batch(256)                              // last batch may be short
//   src | ferry::batch(256, {.drop_remainder = true})    // every batch has 256 elements
//
// Collation: an element of a trivially-copyable type T (a struct, a number, a std::array)
// becomes one array of T; a std::tuple / std::pair of fields becomes one array per field;
// a field that is a contiguous range of trivially-copyable values (std::vector<float>,
// std::string, std::span<const std::byte>, a record view) becomes a ragged field: one
// contiguous value buffer plus n+1 offsets. Fixed-size fields are written straight into
// their buffer as elements arrive (no per-element allocation, no second copy), from where
// a map upstream leaves them (map's next_into) when stats are off. Records
// from a borrowing_source (from_files) are lent as views and copied at once, with no
// reference per record.
//
// Buffers come from a std::pmr::memory_resource, by default a buffer_pool private to the
// stage, so batches in steady state reuse the same memory. The hook
// set_buffer_resource(r) (called by distribute() before the first next()) makes batch
// collate into pinned memory instead, without the user changing the pipeline.
//
// Throws config_error for n == 0. Runs on the thread calling next(); upstream errors
// propagate unchanged, and the elements already pulled into the batch being built are
// dropped with it (as tf.data's batch drops them): the next batch starts after the
// element that failed. To keep them, skip bad elements before batch (error_policy::skip
// in from_files; a map function that catches, then filter).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <memory>
#include <optional>
#include <ranges>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/error.hpp"
#include "ferry/memory/buffer.hpp"
#include "ferry/stage.hpp"
#include "ferry/observe/hooks.hpp"
#include "ferry/source.hpp"
#include "ferry/sources/record.hpp"

namespace ferry {

// The n+1 offsets and contiguous values of a ragged field: element i is
// values[offsets[i] .. offsets[i+1]).
template <class E>
struct ragged_view {
  std::span<const E> values;
  std::span<const std::uint64_t> offsets;
  std::size_t size() const { return offsets.empty() ? 0 : offsets.size() - 1; }
  std::span<const E> operator[](std::size_t i) const {
    return values.subspan(offsets[i], offsets[i + 1] - offsets[i]);
  }
};

namespace detail {

template <class T>
struct is_std_array : std::false_type {};
template <class T, std::size_t N>
struct is_std_array<std::array<T, N>> : std::true_type {};

template <class T>
concept ragged_field = std::ranges::contiguous_range<T> && std::ranges::sized_range<T> &&
                       !is_std_array<T>::value &&
                       std::is_trivially_copyable_v<std::ranges::range_value_t<T>>;

template <class T>
concept fixed_field = std::is_trivially_copyable_v<T> && !ragged_field<T>;

// A concept, so the byte check is never asked of a field that is not a range (clang does).
template <class T>
concept byte_ragged = ragged_field<T> && std::same_as<std::ranges::range_value_t<T>, std::byte>;

template <class T>
concept field_type = ragged_field<T> || fixed_field<T>;

template <class T>
struct field_list {
  using type = std::tuple<T>;
  static constexpr bool is_tuple = false;
};
template <class... Ts>
struct field_list<std::tuple<Ts...>> {
  using type = std::tuple<Ts...>;
  static constexpr bool is_tuple = true;
};
template <class A, class B>
struct field_list<std::pair<A, B>> {
  using type = std::tuple<A, B>;
  static constexpr bool is_tuple = true;
};

// Struct specialisations rather than a lambda in a concept: nvcc 13 evaluates the latter
// to false.
template <class FL>
struct all_fields_ok : std::false_type {};
template <class... Fs>
struct all_fields_ok<std::tuple<Fs...>> : std::bool_constant<(field_type<Fs> && ...)> {};

template <class T>
concept batchable = all_fields_ok<typename field_list<T>::type>::value;

template <class F>
struct field_traits {  // fixed
  using element = F;
  static constexpr bool ragged = false;
};
template <ragged_field F>
struct field_traits<F> {
  using element = std::ranges::range_value_t<F>;
  static constexpr bool ragged = true;
};

template <class FL>
struct no_ragged : std::false_type {};
template <class... Fs>
struct no_ragged<std::tuple<Fs...>> : std::bool_constant<(!field_traits<Fs>::ragged && ...)> {};

template <std::size_t I, class T>
decltype(auto) get_field(T& e) {
  if constexpr (field_list<std::remove_cv_t<T>>::is_tuple)
    return std::get<I>(e);
  else
    return (e);
}

}  // namespace detail

// A collated batch of `size()` elements of T. Move-only; its buffers return to their pool
// when it is destroyed.
template <class T>
class batch_of {
  using fields = typename detail::field_list<T>::type;

 public:
  using element_type = T;
  static constexpr std::size_t field_count = std::tuple_size_v<fields>;
  template <std::size_t I>
  using field_t = std::tuple_element_t<I, fields>;
  template <std::size_t I>
  static constexpr bool is_ragged = detail::field_traits<field_t<I>>::ragged;

  batch_of() = default;

  std::size_t size() const noexcept { return n_; }
  bool empty() const noexcept { return n_ == 0; }

  // Field I: a span of values (fixed fields) or a ragged_view (ragged fields).
  template <std::size_t I = 0>
  auto field() const {
    using E = typename detail::field_traits<field_t<I>>::element;
    if constexpr (is_ragged<I>) {
      auto off = reinterpret_cast<const std::uint64_t*>(offsets_[I].data());
      return ragged_view<E>{
          std::span<const E>(reinterpret_cast<const E*>(data_[I].data()), n_ ? off[n_] : 0),
          std::span<const std::uint64_t>(off, n_ ? n_ + 1 : 0)};
    } else {
      return std::span<const E>(reinterpret_cast<const E*>(data_[I].data()), n_);
    }
  }
  template <std::size_t I = 0>
    requires(!is_ragged<I>)
  std::span<field_t<I>> field() {
    return std::span<field_t<I>>(reinterpret_cast<field_t<I>*>(data_[I].data()), n_);
  }

  // Element i of a single-field batch: the value (fixed) or a span of its values (ragged).
  decltype(auto) operator[](std::size_t i) const
    requires(field_count == 1)
  {
    return field<0>()[i];
  }

  // Raw view of field f's bytes for elements [first, first + count): what distribute()
  // copies to a replica. Ragged fields give their values' bytes.
  std::span<const std::byte> field_bytes(std::size_t f, std::size_t first, std::size_t count) const {
    const std::size_t es = elem_bytes_[f];
    if (!ragged_[f]) return {data_[f].data() + first * es, count * es};
    auto off = reinterpret_cast<const std::uint64_t*>(offsets_[f].data());
    return {data_[f].data() + off[first] * es, (off[first + count] - off[first]) * es};
  }
  std::span<const std::byte> field_bytes(std::size_t f) const { return field_bytes(f, 0, n_); }
  // Bytes of one value of field f (for ragged fields: of one value inside an element).
  std::size_t element_bytes(std::size_t f) const { return elem_bytes_[f]; }
  bool field_is_ragged(std::size_t f) const { return ragged_[f]; }
  // The buffer behind field f: to check where a batch lives (pinned, pooled).
  const buffer& field_buffer(std::size_t f) const { return data_[f]; }
  std::size_t payload_bytes() const {
    std::size_t s = 0;
    for (std::size_t f = 0; f < field_count; ++f) s += field_bytes(f).size();
    return s;
  }

 private:
  template <class>
  friend struct batch_collator;

  std::size_t n_ = 0;
  std::array<buffer, field_count> data_;
  std::array<buffer, field_count> offsets_;
  std::array<std::size_t, field_count> elem_bytes_{};
  std::array<bool, field_count> ragged_{};
};

// Builds batch_of<T> from elements; used by the batch stage and by tests that need a batch
// without a pipeline. Not thread-safe; one per stage.
template <class T>
struct batch_collator {
  static_assert(detail::batchable<T>,
                "ferry::batch: each field must be trivially copyable (a struct, number or "
                "std::array) or a contiguous range of trivially-copyable values "
                "(std::vector<float>, std::string, std::span<const std::byte>); map "
                "elements to such a type before batch()");
  using B = batch_of<T>;
  static constexpr std::size_t nf = B::field_count;
  static constexpr bool all_fixed = detail::no_ragged<typename detail::field_list<T>::type>::value;

  // Fixed-only types: allocate for `capacity` elements, then put() each one in place.
  B start(const std::shared_ptr<std::pmr::memory_resource>& res, std::size_t capacity) const {
    B b;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((b.data_[I] = buffer(res, capacity * sizeof(typename B::template field_t<I>)),
        b.elem_bytes_[I] = sizeof(typename B::template field_t<I>)),
       ...);
    }(std::make_index_sequence<nf>{});
    return b;
  }
  void set_size(B& b, std::size_t n) const { b.n_ = n; }
  // Rows the batch's buffers hold (fixed-only types).
  std::size_t capacity(const B& b) const { return b.data_[0].size() / sizeof(typename B::template field_t<0>); }
  // Fixed-only types: new buffers of `capacity` rows, the rows so far copied over.
  void grow(B& b, const std::shared_ptr<std::pmr::memory_resource>& res, std::size_t capacity) const {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((grow_field<I>(b, res, capacity)), ...);
    }(std::make_index_sequence<nf>{});
  }
  // Bytes one row takes in the batch (a ragged field: its offset; its values come apart).
  static constexpr std::size_t row_bytes() {
    return []<std::size_t... I>(std::index_sequence<I...>) {
      return ((B::template is_ragged<I> ? sizeof(std::uint64_t) : sizeof(typename B::template field_t<I>)) + ... + 0);
    }(std::make_index_sequence<nf>{});
  }
  // A single-field batch's whole buffer (capacity elements) as a span, to fill in place.
  std::span<T> whole(B& b, std::size_t capacity) const {
    return std::span<T>(reinterpret_cast<T*>(b.data_[0].data()), capacity);
  }
  void put(B& b, T& e) const {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((std::memcpy(b.data_[I].data() + b.n_ * sizeof(typename B::template field_t<I>),
                    &detail::get_field<I>(e), sizeof(typename B::template field_t<I>))),
       ...);
    }(std::make_index_sequence<nf>{});
    ++b.n_;
  }

  // A single ragged field of bytes (ferry::record) from views of each element's bytes.
  B collate_bytes(const std::shared_ptr<std::pmr::memory_resource>& res,
                  std::span<const std::span<const std::byte>> elems) const
    requires(nf == 1 && detail::byte_ragged<typename B::template field_t<0>>)
  {
    B b;
    fill_ragged<0>(b, res, elems.size(), [&](std::size_t i) { return elems[i]; });
    b.n_ = elems.size();
    return b;
  }

  // Any types: all elements at hand, sizes known, one allocation per buffer.
  B collate(const std::shared_ptr<std::pmr::memory_resource>& res, std::span<T> elems) const {
    B b;
    const std::size_t n = elems.size();
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (collate_field<I>(b, res, elems), ...);
    }(std::make_index_sequence<nf>{});
    b.n_ = n;
    return b;
  }

 private:
  template <std::size_t I>
  void grow_field(B& b, const std::shared_ptr<std::pmr::memory_resource>& res, std::size_t capacity) const {
    constexpr std::size_t es = sizeof(typename B::template field_t<I>);
    buffer bigger(res, capacity * es);
    if (b.n_) std::memcpy(bigger.data(), b.data_[I].data(), b.n_ * es);
    b.data_[I] = std::move(bigger);
  }
  // Ragged field I of n elements, element i's values being the contiguous range get(i):
  // n+1 offsets, then the values copied into one buffer.
  template <std::size_t I, class Get>
  void fill_ragged(B& b, const std::shared_ptr<std::pmr::memory_resource>& res, std::size_t n, Get get) const {
    using E = std::ranges::range_value_t<typename B::template field_t<I>>;
    b.ragged_[I] = true;
    b.elem_bytes_[I] = sizeof(E);
    b.offsets_[I] = buffer(res, (n + 1) * sizeof(std::uint64_t));
    auto* off = reinterpret_cast<std::uint64_t*>(b.offsets_[I].data());
    off[0] = 0;
    for (std::size_t i = 0; i < n; ++i) off[i + 1] = off[i] + std::ranges::size(get(i));
    b.data_[I] = buffer(res, off[n] * sizeof(E));
    for (std::size_t i = 0; i < n; ++i) {
      auto&& r = get(i);
      const std::size_t bytes = std::ranges::size(r) * sizeof(E);
      if (bytes) std::memcpy(b.data_[I].data() + off[i] * sizeof(E), std::ranges::data(r), bytes);
    }
  }

  template <std::size_t I>
  void collate_field(B& b, const std::shared_ptr<std::pmr::memory_resource>& res,
                     std::span<T> elems) const {
    using F = typename B::template field_t<I>;
    const std::size_t n = elems.size();
    if constexpr (B::template is_ragged<I>) {
      fill_ragged<I>(b, res, n, [&](std::size_t i) -> decltype(auto) { return detail::get_field<I>(elems[i]); });
    } else {
      b.elem_bytes_[I] = sizeof(F);
      b.data_[I] = buffer(res, n * sizeof(F));
      for (std::size_t i = 0; i < n; ++i)
        std::memcpy(b.data_[I].data() + i * sizeof(F), &detail::get_field<I>(elems[i]), sizeof(F));
    }
  }
};

struct batch_options {
  bool drop_remainder = false;  // drop a last batch with fewer than n elements
  // Where batch buffers come from; null means a buffer_pool private to the stage.
  std::shared_ptr<std::pmr::memory_resource> resource = nullptr;
};

namespace detail {

template <source Up>
class batch_source : public stage<batch_source<Up>, Up, batch_of<value_t<Up>>> {
  using base = stage<batch_source<Up>, Up, batch_of<value_t<Up>>>;
  friend base;
  using T = value_t<Up>;
  using B = batch_of<T>;

 public:
  static constexpr char name[] = "batch";
  // Throws config_error for n rows whose bytes do not fit in a size_t.
  batch_source(Up up, std::size_t n, batch_options o)
      : base(std::move(up)), n_(n), drop_(o.drop_remainder), res_(std::move(o.resource)) {
    constexpr std::size_t row = batch_collator<T>::row_bytes();
    if (n_ > std::numeric_limits<std::size_t>::max() / (row + 1))
      throw config_error("batch: a batch of " + std::to_string(n_) + " rows of " + std::to_string(row) +
                         " bytes does not fit in memory's address range; use a smaller batch size");
    // A batch's buffers start at the batch size, or at 16 MiB of rows when that is less,
    // and grow as rows come: batch(2^34) over ten elements allocates for ten.
    first_rows_ = std::min<std::size_t>(n_, std::max<std::size_t>(1, (std::size_t(16) << 20) / std::max<std::size_t>(row, 1)));
    if (!res_) res_ = std::make_shared<buffer_pool>();
  }

  // Where batches are collated from now on (distribute's pinned pool).
  bool set_buffer_resource(const std::shared_ptr<std::pmr::memory_resource>& r) {
    this->check_live();
    res_ = r;
    return true;
  }
  std::size_t batch_size() const { return n_; }
  bool drops_remainder() const { return drop_; }
  Up& upstream() { return this->up(); }

 private:
  std::optional<B> pull() {
    Up& up = this->up();
    if constexpr (bulk_source<Up> && batch_collator<T>::all_fixed && B::field_count == 1 &&
                  !field_list<T>::is_tuple) {
      // One call fills the batch buffer in place (one per growth of a huge batch).
      B b = collator_.start(res_, first_rows_);
      std::size_t k = 0, cap = first_rows_;
      for (;;) {
        k += this->pull_up_bulk(collator_.whole(b, cap).subspan(k));
        if (k < cap || cap == n_) break;
        collator_.set_size(b, k);
        cap = more_rows(cap);
        collator_.grow(b, res_, cap);
      }
      collator_.set_size(b, k);
      if (k == 0 || (drop_ && k < n_)) return std::nullopt;
      return b;
    } else if constexpr (borrowing_source<Up> && std::same_as<T, record>) {
      // Records lent as views: copied into the batch at once, so no reference per record.
      borrowed_.clear();
      this->pull_up_borrowed(borrowed_, n_);
      if (borrowed_.size() == 0 || (drop_ && borrowed_.size() < n_)) {
        borrowed_.clear();
        return std::nullopt;
      }
      B b = collator_.collate_bytes(res_, borrowed_.views);
      borrowed_.clear();
      return b;
    } else if constexpr (batch_collator<T>::all_fixed) {
      B b = collator_.start(res_, first_rows_);
      std::size_t cap = first_rows_;
      auto room = [&] {  // a row's room, grown when a huge batch has filled its buffers
        if (b.size() == cap) collator_.grow(b, res_, cap = more_rows(cap));
      };
      // An upstream that can hand an element where it lies (map's next_into) is copied
      // from there; with stats on, through the probe, which times the pull.
      bool pulled = false;
      if constexpr (requires { up.next_into([](T&) {}); }) {
        if (!observe::on()) {
          while (b.size() < n_ && (room(), up.next_into([&](T& e) { collator_.put(b, e); }))) {
          }
          pulled = true;
        }
      }
      while (!pulled && b.size() < n_) {
        std::optional<T> e = this->pull_up();
        if (!e) break;
        room();
        collator_.put(b, *e);
      }
      if (b.empty() || (drop_ && b.size() < n_)) return std::nullopt;
      return b;
    } else {
      hold_.clear();
      while (hold_.size() < n_) {
        std::optional<T> e = this->pull_up();
        if (!e) break;
        hold_.push_back(std::move(*e));
      }
      if (hold_.empty() || (drop_ && hold_.size() < n_)) return std::nullopt;
      return collator_.collate(res_, std::span<T>(hold_));
    }
  }

  std::size_t more_rows(std::size_t cap) const { return cap > n_ / 2 ? n_ : cap * 2; }

  std::size_t n_;
  std::size_t first_rows_ = 0;  // rows a batch's buffers hold at first (fixed fields)
  bool drop_;
  std::shared_ptr<std::pmr::memory_resource> res_;
  batch_collator<T> collator_;
  std::vector<T> hold_;  // ragged types only; capacity reused batch to batch
  borrowed_records borrowed_;  // records from a borrowing_source; likewise
};

inline void check_batch_args(std::size_t n) {
  if (n == 0) throw config_error("batch: the batch size must be at least 1 (got 0)");
}

}  // namespace detail

// Not a stage_adaptor: its options are a braced list (batch(256, {.drop_remainder = true})),
// which a template parameter pack cannot take.
struct batch_t {
  template <source S>
  auto operator()(S&& s, std::size_t n, batch_options o = {}) const {
    detail::require_rvalue_source<S>();
    detail::check_batch_args(n);
    return detail::batch_source<std::remove_cvref_t<S>>(std::forward<S>(s), n, std::move(o));
  }
  auto operator()(std::size_t n, batch_options o = {}) const {
    detail::check_batch_args(n);
    return make_closure([n, o]<class S>(S&& s) { return batch_t{}(std::forward<S>(s), n, o); });
  }
};
inline constexpr batch_t batch{};

}  // namespace ferry
