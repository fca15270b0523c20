// ferry/batch_of.hpp: batch_of<T>, what batch() hands out: n elements of T collated into
// one contiguous buffer per field (a ragged field: its values and n+1 offsets; a padded
// field, from padded_batch(): n rows of L values and n lengths), and the collator that
// builds one (for batch(), padded_batch(), distribute()'s padding, and tests that need a
// batch without a pipeline).
//
//   batch_of<std::tuple<std::array<float, 784>, std::int32_t>> b = ...;
//   std::span<const std::array<float, 784>> x = b.field<0>();
//   ferry::ragged_view<char> words = text_batch.field<0>();   // words[i]: a span
//   ferry::padded_view<std::int32_t> t = padded.field<0>();   // t[i]: L values, t.lengths[i] real
//
// A batch is move-only; its buffers return to the memory resource they came from (a pool)
// when it is destroyed. No threads; nothing runs user code. Throws: the collator what its
// memory resource throws (std::bad_alloc, or a pinned upstream's cuda_error).
// Compile-time errors: field<I>() past the last field is a static_assert naming I, the
// field count and T (detail::batch_field_index_out_of_range<I, Count, T>).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
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
#include "ferry/sources/record.hpp"

namespace ferry {

// The n+1 offsets and contiguous values of a ragged field: element i is
// values[offsets[i] .. offsets[i+1]).
template <class E>
struct ragged_view {
  std::span<const E> values;  // every element's values, back to back
  std::span<const std::uint64_t> offsets;  // n+1 offsets into values (empty for n == 0)
  // The number of elements n.
  std::size_t size() const { return offsets.empty() ? 0 : offsets.size() - 1; }
  // Element i's values (i < size(), unchecked).
  std::span<const E> operator[](std::size_t i) const {
    return values.subspan(offsets[i], offsets[i + 1] - offsets[i]);
  }
};

// The field type padded_batch() gives a ragged field of values E: n rows of the same
// length L (the real values, then padding) and each row's real length. Never an element
// itself: it only names the field's kind in batch_of<T>.
template <class E>
struct padded {
  using value_type = E;  // the values' type
};

// The n rows of a padded field: row i is values[i*width .. (i+1)*width), of which the first
// lengths[i] are real and the rest padding.
template <class E>
struct padded_view {
  std::span<const E> values;  // n * width values, row after row
  std::size_t width = 0;  // L, values per row
  std::span<const std::uint32_t> lengths;  // n real lengths, each <= width
  // The number of rows n.
  std::size_t size() const { return lengths.size(); }
  // Row i, padding included (i < size(), unchecked).
  std::span<const E> operator[](std::size_t i) const { return values.subspan(i * width, width); }
  // Row i's real values (i < size(), unchecked).
  std::span<const E> valid(std::size_t i) const { return values.subspan(i * width, lengths[i]); }
};

// padded_batch(n, ferry::with_mask), bucket_by_sequence_length(..., ferry::with_mask):
// the batches get a mask field for each padded field, appended after the element's own
// fields in their order: a padded<std::uint8_t> of the same L and lengths, each row 1 for a
// real value and 0 for padding. It travels as any padded field does (distribute() splits
// it and copies it to the replicas), so a model reads it where its rows land.
struct with_mask_t {
  explicit constexpr with_mask_t() = default;
};
// The tag that asks for mask fields (see with_mask_t).
inline constexpr with_mask_t with_mask{};

namespace detail {

template <class T>
struct is_padded_field : std::false_type {};
template <class E>
struct is_padded_field<padded<E>> : std::true_type {};

template <class T>
struct is_std_array : std::false_type {};
template <class T, std::size_t N>
struct is_std_array<std::array<T, N>> : std::true_type {};

template <class T>
concept ragged_field = std::ranges::contiguous_range<T> && std::ranges::sized_range<T> &&
                       !is_std_array<T>::value &&
                       std::is_trivially_copyable_v<std::ranges::range_value_t<T>>;

template <class T>
concept padded_field = is_padded_field<T>::value && std::is_trivially_copyable_v<typename T::value_type>;

template <class T>
concept fixed_field = std::is_trivially_copyable_v<T> && !ragged_field<T> && !is_padded_field<T>::value;

// A concept, so the byte check is never asked of a field that is not a range (clang does).
template <class T>
concept byte_ragged = ragged_field<T> && std::same_as<std::ranges::range_value_t<T>, std::byte>;

template <class T>
concept field_type = ragged_field<T> || fixed_field<T> || padded_field<T>;

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
  static constexpr bool padded = false;
};
template <ragged_field F>
struct field_traits<F> {
  using element = std::ranges::range_value_t<F>;
  static constexpr bool ragged = true;
  static constexpr bool padded = false;
};
template <class E>
struct field_traits<padded<E>> {
  using element = E;
  static constexpr bool ragged = false;
  static constexpr bool padded = true;
};

template <class FL>
struct no_ragged : std::false_type {};
template <class... Fs>
struct no_ragged<std::tuple<Fs...>> : std::bool_constant<(!field_traits<Fs>::ragged && ...)> {};
template <class FL>
struct no_padded : std::false_type {};
template <class... Fs>
struct no_padded<std::tuple<Fs...>> : std::bool_constant<(!field_traits<Fs>::padded && ...)> {};

// The element type padded_batch() names its batches by: each ragged field of T becomes
// padded<its value type>; fixed fields stay. A pair becomes a tuple.
template <class F>
struct pad_field {
  using type = F;
};
template <ragged_field F>
struct pad_field<F> {
  using type = padded<std::ranges::range_value_t<F>>;
};
template <class T, bool Mask = false, class FL = typename field_list<T>::type>
struct padded_element;
template <class T, class F>
  requires(!field_list<T>::is_tuple)
struct padded_element<T, false, std::tuple<F>> {
  using type = typename pad_field<F>::type;
};
template <class T, class... Fs>
  requires(field_list<T>::is_tuple)
struct padded_element<T, false, std::tuple<Fs...>> {
  using type = std::tuple<typename pad_field<Fs>::type...>;
};
// with_mask: T's fields padded, then a padded<std::uint8_t> per ragged field, in order.
template <class F>
struct mask_of {
  using type = std::tuple<>;
};
template <ragged_field F>
struct mask_of<F> {
  using type = std::tuple<padded<std::uint8_t>>;
};
template <class T, class... Fs>
struct padded_element<T, true, std::tuple<Fs...>> {
  using type = decltype(std::tuple_cat(std::declval<std::tuple<typename pad_field<Fs>::type...>>(),
                                       std::declval<typename mask_of<Fs>::type>()...));
};
// The field list's k-th ragged field (a mask field's source).
template <class FL>
struct ragged_index;
template <class... Fs>
struct ragged_index<std::tuple<Fs...>> {
  static constexpr std::size_t nth(std::size_t k) {
    constexpr bool r[] = {field_traits<Fs>::ragged...};
    for (std::size_t i = 0; i < sizeof...(Fs); ++i)
      if (r[i] && k-- == 0) return i;
    return sizeof...(Fs);
  }
};

template <std::size_t I, class T>
decltype(auto) get_field(T& e) {
  if constexpr (field_list<std::remove_cv_t<T>>::is_tuple)
    return std::get<I>(e);
  else
    return (e);
}

// n rounded up to a multiple of m >= 1, saturating at SIZE_MAX (a padded width: the
// batch's size check then refuses it rather than wrap to a small buffer).
constexpr std::size_t round_up(std::size_t n, std::size_t m) noexcept {
  const std::size_t r = n % m;
  if (r == 0) return n;
  return m - r > std::numeric_limits<std::size_t>::max() - n ? std::numeric_limits<std::size_t>::max() : n + (m - r);
}

// A padding value as the field's value type: converted when arithmetic, else value
// initialised (padded_batch, bucket_by_sequence_length and pack's pad_value).
template <class E>
E pad_as(double v) {
  if constexpr (std::is_arithmetic_v<E>)
    return static_cast<E>(v);
  else
    return E{};
}

// Throws config_error when pad_value v is not a value of each ragged field's value type
// (an integer type: a whole number in its range; a floating type: within its range, or not
// finite), which converting it would make undefined. `stage` names the caller.
template <class T>
void check_pad_value(double v, const char* stage) {
  using L = typename field_list<T>::type;
  auto one = [&]<std::size_t I>(std::integral_constant<std::size_t, I>) {
    using F = std::tuple_element_t<I, L>;
    using E = typename field_traits<F>::element;
    if constexpr (field_traits<F>::ragged && std::is_arithmetic_v<E>) {
      using lim = std::numeric_limits<E>;
      std::string range;
      bool ok = false;
      if constexpr (std::is_floating_point_v<E>) {
        ok = !std::isfinite(v) || (v >= double(lim::lowest()) && v <= double(lim::max()));
        range = "its finite range, or an infinity or NaN";
      } else {  // (max + 1.0: 2^64 for uint64, whose max does not fit a double)
        ok = std::trunc(v) == v && v >= double(lim::lowest()) && v < double(lim::max()) + 1.0;
        range = "whole numbers from " +
                (lim::is_signed ? std::to_string(static_cast<long long>(lim::lowest())) : std::string("0")) + " to " +
                std::to_string(static_cast<unsigned long long>(lim::max()));
      }
      char shown[32];
      std::snprintf(shown, sizeof shown, "%.17g", v);
      if (!ok)
        throw config_error(std::string(stage) + ": pad_value = " + shown + " is not a value of field " +
                           std::to_string(I) + "'s type (" + std::to_string(sizeof(E)) + "-byte " +
                           (std::is_floating_point_v<E> ? "floating point" : lim::is_signed ? "signed" : "unsigned") +
                           ": " + range + ")");
    }
  };
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (one(std::integral_constant<std::size_t, I>{}), ...);
  }(std::make_index_sequence<std::tuple_size_v<L>>{});
}

// field<I>() with I >= Count, named with T, the element type (source.hpp says how).
template <std::size_t I, std::size_t Count, class T>
struct batch_field_index_out_of_range {
  static_assert(I < Count,
                "ferry::batch_of::field<I>: I is past the batch's last field (I and the field count "
                "are the first two arguments of batch_field_index_out_of_range<I, Count, T> above, "
                "T the element type); fields count from 0");
};

}  // namespace detail

// A collated batch of `size()` elements of T. Move-only; its buffers return to their pool
// when it is destroyed.
template <class T>
class batch_of {
  using fields = typename detail::field_list<T>::type;

 public:
  using element_type = T;  // the element type the batch was collated from
  static constexpr std::size_t field_count = std::tuple_size_v<fields>;  // 1, or the tuple's / pair's size
  // The type of field I (T itself for a single-field batch).
  template <std::size_t I>
  using field_t = std::tuple_element_t<I, fields>;
  // Whether field I is ragged (a contiguous range: values plus offsets).
  template <std::size_t I>
  static constexpr bool is_ragged = detail::field_traits<field_t<I>>::ragged;
  // Whether field I is padded (padded_batch(): rows of one length L plus real lengths).
  template <std::size_t I>
  static constexpr bool is_padded = detail::field_traits<field_t<I>>::padded;

  batch_of() = default;

  // The number of elements.
  std::size_t size() const noexcept { return n_; }
  // Whether it has none.
  bool empty() const noexcept { return n_ == 0; }

  // Field I: a span of values (fixed fields), a ragged_view (ragged fields) or a
  // padded_view (padded fields).
  template <std::size_t I = 0>
  auto field() const {
    if constexpr (I >= field_count) {  // a misuse stops here, before <tuple>'s errors
      return typename detail::batch_field_index_out_of_range<I, field_count, T>::error_above{};
    } else if constexpr (is_padded<I>) {
      using E = typename detail::field_traits<field_t<I>>::element;
      const std::size_t w = elem_bytes_[I] / sizeof(E);
      return padded_view<E>{std::span<const E>(reinterpret_cast<const E*>(data_[I].data()), n_ * w), w,
                            std::span<const std::uint32_t>(reinterpret_cast<const std::uint32_t*>(offsets_[I].data()), n_)};
    } else if constexpr (is_ragged<I>) {
      using E = typename detail::field_traits<field_t<I>>::element;
      auto off = reinterpret_cast<const std::uint64_t*>(offsets_[I].data());
      return ragged_view<E>{
          std::span<const E>(reinterpret_cast<const E*>(data_[I].data()), n_ ? off[n_] : 0),
          std::span<const std::uint64_t>(off, n_ ? n_ + 1 : 0)};
    } else {
      using E = field_t<I>;
      return std::span<const E>(reinterpret_cast<const E*>(data_[I].data()), n_);
    }
  }
  // Fixed field I, writable (to fix up values in place, e.g. to normalise).
  // The count first, and no field_t<I> in the signature (clang substitutes it before the
  // constraint): out of range, the const one above reports it.
  template <std::size_t I = 0>
    requires(I < field_count && !is_ragged<I> && !is_padded<I>)
  auto field() {
    return std::span<field_t<I>>(reinterpret_cast<field_t<I>*>(data_[I].data()), n_);
  }

  // Element i of a single-field batch: the value (fixed) or a span of its values (ragged).
  decltype(auto) operator[](std::size_t i) const
    requires(field_count == 1)
  {
    return field<0>()[i];
  }

  // Raw view of field f's bytes for elements [first, first + count): what distribute()
  // copies to a replica. Ragged fields give their values' bytes; padded fields their rows'
  // (element_bytes(f) = L values a row).
  std::span<const std::byte> field_bytes(std::size_t f, std::size_t first, std::size_t count) const {
    const std::size_t es = elem_bytes_[f];
    if (!ragged_[f]) return {data_[f].data() + first * es, count * es};
    auto off = reinterpret_cast<const std::uint64_t*>(offsets_[f].data());
    if (!off) return {};  // no rows (nothing collated, or moved from)
    return {data_[f].data() + off[first] * es, (off[first + count] - off[first]) * es};
  }
  // The bytes of field f for every element.
  std::span<const std::byte> field_bytes(std::size_t f) const { return field_bytes(f, 0, n_); }
  // Bytes of one value of field f (for ragged fields: of one value inside an element).
  std::size_t element_bytes(std::size_t f) const { return elem_bytes_[f]; }
  // Whether field f is ragged (is_ragged, at run time).
  bool field_is_ragged(std::size_t f) const { return ragged_[f]; }
  // Whether field f is padded (is_padded, at run time).
  bool field_is_padded(std::size_t f) const { return padded_[f]; }
  // A ragged field's n+1 offsets (null for other fields, and for a batch of no rows).
  const std::uint64_t* ragged_offsets(std::size_t f) const {
    return ragged_[f] && n_ ? reinterpret_cast<const std::uint64_t*>(offsets_[f].data()) : nullptr;
  }
  // A padded field's real lengths for rows [first, first + count), as bytes (uint32 each);
  // empty for other fields. distribute() copies them beside the rows.
  std::span<const std::byte> lengths_bytes(std::size_t f, std::size_t first, std::size_t count) const {
    if (!padded_[f]) return {};
    return {offsets_[f].data() + first * sizeof(std::uint32_t), count * sizeof(std::uint32_t)};
  }
  // The buffer behind field f: to check where a batch lives (pinned, pooled).
  const buffer& field_buffer(std::size_t f) const { return data_[f]; }
  // The bytes of every field's values (offsets not counted): what report() counts.
  std::size_t payload_bytes() const {
    std::size_t s = 0;
    for (std::size_t f = 0; f < field_count; ++f) s += field_bytes(f).size();
    return s;
  }

 private:
  template <class>
  friend struct batch_collator;

  // The row count, 0 once moved from, as the buffers are (it used to keep its count, and a
  // ragged field's payload_bytes() then read offsets that had moved away): the moves stay
  // the defaulted ones.
  struct row_count {
    std::size_t v = 0;
    row_count() = default;
    row_count(std::size_t n) noexcept : v(n) {}  // NOLINT(google-explicit-constructor): stands for the count
    row_count(row_count&& o) noexcept : v(std::exchange(o.v, 0)) {}
    row_count& operator=(row_count&& o) noexcept {
      v = std::exchange(o.v, 0);
      return *this;
    }
    row_count& operator++() noexcept {
      ++v;
      return *this;
    }
    operator std::size_t() const noexcept { return v; }  // NOLINT(google-explicit-constructor)
  };
  row_count n_;
  std::array<buffer, field_count> data_;
  std::array<buffer, field_count> offsets_;
  std::array<std::size_t, field_count> elem_bytes_{};  // a padded field: L values' bytes
  std::array<bool, field_count> ragged_{};
  std::array<bool, field_count> padded_{};  // offsets_ then holds n uint32 lengths
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
  using B = batch_of<T>;  // the batch it builds
  static constexpr std::size_t nf = B::field_count;  // its number of fields
  // No ragged or padded field: start(), put() and whole() apply.
  static constexpr bool all_fixed = detail::no_ragged<typename detail::field_list<T>::type>::value &&
                                    detail::no_padded<typename detail::field_list<T>::type>::value;

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
  // Whether b's buffers are what start(res, capacity) would allocate (the same resource
  // and row count), so that a new batch can be collated into them in place.
  bool fits(const B& b, const std::shared_ptr<std::pmr::memory_resource>& res, std::size_t capacity) const {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return ((b.data_[I].data() && b.data_[I].resource() == res &&
               b.data_[I].size() == capacity * sizeof(typename B::template field_t<I>)) &&
              ...);
    }(std::make_index_sequence<nf>{});
  }
  // Sets b's element count to n, after its rows were written in place (whole()).
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
  // Fixed-only types: copies e into row size() of b (which must have room) and counts it.
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

  // Padded types (padded_batch()): the rows of `elems`, elements of Src whose ragged fields
  // are T's padded fields. Padded field I's rows are width[I] values long: a row's first
  // values (at most width[I]: a longer row is cut, the caller has decided it may be), then
  // `pad` converted to the value type (value-initialised values for a non-arithmetic one).
  // With with_mask, B's fields past Src's are masks: width[] is read for Src's fields only.
  template <class Src>
  B collate_padded(const std::shared_ptr<std::pmr::memory_resource>& res, std::span<const Src> elems,
                   const std::array<std::size_t, nf>& width, double pad) const {
    B b;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (collate_padded_field<I>(b, res, elems, width, pad), ...);
    }(std::make_index_sequence<nf>{});
    b.n_ = elems.size();
    return b;
  }

  // Types whose fields are all padded (pack()): buffers for `rows` rows of width[I] values
  // per field, written in place through padded_values() and padded_lengths(), then
  // set_size(). Throws what the resource throws.
  B start_padded(const std::shared_ptr<std::pmr::memory_resource>& res, std::size_t rows,
                 const std::array<std::size_t, nf>& width) const {
    B b;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((b.padded_[I] = true, b.elem_bytes_[I] = width[I] * sizeof(typename B::template field_t<I>::value_type),
        b.data_[I] = buffer(res, rows * b.elem_bytes_[I]), b.offsets_[I] = buffer(res, rows * sizeof(std::uint32_t))),
       ...);
    }(std::make_index_sequence<nf>{});
    return b;
  }
  // Padded field I's values, row after row, to write in place (start_padded()).
  template <std::size_t I>
  auto* padded_values(B& b) const {
    return reinterpret_cast<typename B::template field_t<I>::value_type*>(b.data_[I].data());
  }
  // Padded field I's lengths, to write in place (start_padded()).
  template <std::size_t I>
  std::uint32_t* padded_lengths(B& b) const {
    return reinterpret_cast<std::uint32_t*>(b.offsets_[I].data());
  }

  // b's rows, then value-initialised rows up to `global` (padded fields: zero values and
  // length 0; ragged fields: empty sequences): distribute()'s short batch under
  // remainder_policy::pad. b.size() <= global.
  B pad_rows(const std::shared_ptr<std::pmr::memory_resource>& res, std::size_t global, const B& b) const {
    B p;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (pad_field_rows<I>(p, res, global, b), ...);
    }(std::make_index_sequence<nf>{});
    p.n_ = global;
    return p;
  }

 private:
  template <std::size_t I, class Src>
  void collate_padded_field(B& b, const std::shared_ptr<std::pmr::memory_resource>& res, std::span<const Src> elems,
                            const std::array<std::size_t, nf>& widths, double pad) const {
    using F = typename B::template field_t<I>;
    using SL = typename detail::field_list<Src>::type;
    const std::size_t n = elems.size();
    if constexpr (I >= std::tuple_size_v<SL>) {  // with_mask: the mask of Src's ragged field r
      constexpr std::size_t r = detail::ragged_index<SL>::nth(I - std::tuple_size_v<SL>);
      const std::size_t width = widths[r];
      b.padded_[I] = true;
      b.elem_bytes_[I] = width;
      b.offsets_[I] = buffer(res, n * sizeof(std::uint32_t));
      b.data_[I] = buffer(res, n * width);
      auto* len = reinterpret_cast<std::uint32_t*>(b.offsets_[I].data());
      std::byte* out = b.data_[I].data();
      for (std::size_t i = 0; i < n; ++i, out += width) {
        const std::size_t k = std::min<std::size_t>(std::ranges::size(detail::get_field<r>(elems[i])), width);
        if (k) std::memset(out, 1, k);
        if (k < width) std::memset(out + k, 0, width - k);
        len[i] = static_cast<std::uint32_t>(k);
      }
    } else if constexpr (B::template is_padded<I>) {
      const std::size_t width = widths[I];
      using E = typename F::value_type;
      b.padded_[I] = true;
      b.elem_bytes_[I] = width * sizeof(E);
      b.offsets_[I] = buffer(res, n * sizeof(std::uint32_t));
      b.data_[I] = buffer(res, n * width * sizeof(E));
      auto* len = reinterpret_cast<std::uint32_t*>(b.offsets_[I].data());
      E* out = reinterpret_cast<E*>(b.data_[I].data());
      const E fill = detail::pad_as<E>(pad);
      // Zero padding (the usual) by memset: wide stores, where filling with a value known
      // only at run time makes 16-byte ones (bench_padded_batch: 0.61 -> 0.79 of the loop).
      std::array<std::byte, sizeof(E)> bytes;
      std::memcpy(bytes.data(), &fill, sizeof(E));
      const bool zero = std::ranges::all_of(bytes, [](std::byte x) { return x == std::byte{0}; });
      for (std::size_t i = 0; i < n; ++i, out += width) {
        auto&& r = detail::get_field<I>(elems[i]);
        const std::size_t k = std::min<std::size_t>(std::ranges::size(r), width);
        if (k) std::memcpy(out, std::ranges::data(r), k * sizeof(E));
        if (zero && k < width)  // (width 0: no buffer, and memset may not take null)
          std::memset(out + k, 0, (width - k) * sizeof(E));
        else
          std::fill(out + k, out + width, fill);
        len[i] = static_cast<std::uint32_t>(k);
      }
    } else {
      b.elem_bytes_[I] = sizeof(F);
      b.data_[I] = buffer(res, n * sizeof(F));
      for (std::size_t i = 0; i < n; ++i)
        std::memcpy(b.data_[I].data() + i * sizeof(F), &detail::get_field<I>(elems[i]), sizeof(F));
    }
  }

  template <std::size_t I>
  void pad_field_rows(B& p, const std::shared_ptr<std::pmr::memory_resource>& res, std::size_t global,
                      const B& b) const {
    using F = typename B::template field_t<I>;
    const std::size_t es = b.elem_bytes_[I], n = b.n_;
    // An absurd global batch (an option of 2^62 rows) would wrap the byte count to a tiny
    // buffer that the copies below overrun.
    if (es != 0 && global > std::numeric_limits<std::size_t>::max() / es)
      throw config_error("distribute: a global batch of " + std::to_string(global) + " rows of " + std::to_string(es) +
                         " bytes does not fit in memory (remainder_policy::pad pads short batches to it)");
    p.elem_bytes_[I] = es;
    if constexpr (!B::template is_ragged<I>) {
      p.data_[I] = buffer(res, global * es);
      if (n != 0 && es != 0) std::memcpy(p.data_[I].data(), b.data_[I].data(), n * es);
    }
    if constexpr (B::template is_padded<I>) {
      p.padded_[I] = true;
      if (global > n && es != 0) std::memset(p.data_[I].data() + n * es, 0, (global - n) * es);
      p.offsets_[I] = buffer(res, global * sizeof(std::uint32_t));
      if (n) std::memcpy(p.offsets_[I].data(), b.offsets_[I].data(), n * sizeof(std::uint32_t));
      if (global > n) std::memset(p.offsets_[I].data() + n * sizeof(std::uint32_t), 0, (global - n) * sizeof(std::uint32_t));
    } else if constexpr (B::template is_ragged<I>) {  // padding rows are empty sequences
      const auto* from = b.ragged_offsets(I);
      const std::uint64_t values = from ? from[n] : 0;
      p.ragged_[I] = true;
      p.elem_bytes_[I] = es;
      p.data_[I] = buffer(res, values * es);
      if (values && es) std::memcpy(p.data_[I].data(), b.data_[I].data(), values * es);
      p.offsets_[I] = buffer(res, (global + 1) * sizeof(std::uint64_t));
      auto* off = reinterpret_cast<std::uint64_t*>(p.offsets_[I].data());
      for (std::size_t i = 0; i <= global; ++i) off[i] = i <= n && from ? from[i] : values;
    } else {
      const F zero{};
      for (std::size_t i = n; i < global; ++i) std::memcpy(p.data_[I].data() + i * es, &zero, es);
    }
  }

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

}  // namespace ferry
