// ferry/cache_codec.hpp: how cache(path) writes an element to its file and reads it back.
//
// ferry::cache_codec<T> is the customization point. ferry provides it for:
//   - trivially copyable types (arithmetic types, enums, plain structs, std::array of
//     them): their object bytes (a bool read back is checked to be 0 or 1; an enum or a
//     struct's fields are not checked). A struct holding pointers caches the addresses,
//     not what they point to: give such a type its own codec;
//   - std::string, std::vector<T>, std::array<T, N>, std::pair and std::tuple of codable
//     types (a vector of trivially copyable T is one length word and one copy);
//   - ferry::record: its bytes. A record read back views the cache's read chunk (no copy)
//     and its origin() names the cache file and the offset of its length word there.
// For another type, specialize it in namespace ferry:
//
//   template <> struct ferry::cache_codec<my_type> {
//     static void encode(const my_type& v, std::string& out);   // append v's bytes
//     static my_type decode(ferry::cache_cursor& in);           // read them back, in order
//   };
//
// decode reads with in.take(n) (n bytes, or throws when fewer are left), in.get<U>() and
// in.chunk() (what a type that views the chunk, as record does, needs). The cache stores
// each element with its length and a CRC-32C, so decode only ever sees what encode wrote,
// unless the element type changed without the file's name or key (cache_options::key).
// Throws: encode may throw std::bad_alloc; decode throws cache_cursor::short_input when it
// asks for more bytes than the element has (cache() turns it into a format_error naming
// the file and offset). Runs on the consumer's thread, inside cache's next().
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/sources/record.hpp"

namespace ferry {

// The bytes of one cached element, as decode reads them, and the read chunk they are in.
class cache_cursor {
 public:
  struct short_input {};  // asked for more bytes than the element has left
  // Where the element's bytes live: `owner` keeps the chunk alive; `file` (owned by the
  // chunk) and `offset` are the cache file and the offset of the element's frame there.
  struct chunk_ref {
    std::shared_ptr<const void> owner;  // keeps the read chunk alive
    const std::string* file = nullptr;  // the cache file's path
    std::uint64_t offset = 0;  // the element's frame's offset in the file
    const std::byte* frame = nullptr;  // the element's frame start (at `offset` in the file)
  };

  // Reads `bytes`, which lie in `chunk` (cache() makes the cursor; both outlive it).
  cache_cursor(std::span<const std::byte> bytes, const chunk_ref& chunk) noexcept
      : p_(bytes.data()), end_(bytes.data() + bytes.size()), chunk_(&chunk) {}

  // The next n bytes, a view into the chunk; throws short_input when fewer are left.
  std::span<const std::byte> take(std::size_t n) {
    if (n > left()) throw short_input{};
    std::span<const std::byte> s(p_, n);
    p_ += n;
    return s;
  }
  // The next sizeof(U) bytes as a U (memcpy: no alignment assumed); throws short_input
  // when fewer are left.
  template <class U>
    requires std::is_trivially_copyable_v<U>
  U get() {
    U v;
    std::memcpy(&v, take(sizeof(U)).data(), sizeof(U));
    return v;
  }
  // The element's bytes not read yet.
  std::size_t left() const noexcept { return static_cast<std::size_t>(end_ - p_); }
  // The chunk the bytes lie in, for a type that views it (record's codec).
  const chunk_ref& chunk() const noexcept { return *chunk_; }

 private:
  const std::byte* p_;
  const std::byte* end_;
  const chunk_ref* chunk_;
};

template <class T>
struct cache_codec;  // no codec: cache(path) says to write one (or to cache in memory)

template <class T>
concept cache_codable = requires(const T& v, std::string& out, cache_cursor& in) {
  cache_codec<T>::encode(v, out);
  { cache_codec<T>::decode(in) } -> std::same_as<T>;
};

namespace detail {
inline void cache_put_bytes(std::string& out, const void* p, std::size_t n) {
  if (n) out.append(static_cast<const char*>(p), n);  // an empty vector's data() may be null
}
inline void cache_put_length(std::string& out, std::uint64_t n) { cache_put_bytes(out, &n, sizeof n); }
// A length word read back, refused when it claims more than `min_each` bytes per item
// than are left (so a damaged length cannot ask for gigabytes).
inline std::size_t cache_get_length(cache_cursor& in, std::size_t min_each) {
  const auto n = in.get<std::uint64_t>();
  if (min_each && n > in.left() / min_each) throw cache_cursor::short_input{};
  return static_cast<std::size_t>(n);
}
}  // namespace detail

// Trivially copyable types (not pointers): their object bytes.
template <class T>
  requires std::is_trivially_copyable_v<T> && (!std::is_pointer_v<T>)
struct cache_codec<T> {
  // Appends v's sizeof(T) bytes.
  static void encode(const T& v, std::string& out) { detail::cache_put_bytes(out, &v, sizeof(T)); }
  // Reads them back; a bool byte other than 0 or 1 throws short_input.
  static T decode(cache_cursor& in) {
    if constexpr (std::is_same_v<T, bool>) {  // a byte other than 0 or 1 is not a bool
      const auto b = in.take(1)[0];
      if (b != std::byte{0} && b != std::byte{1}) throw cache_cursor::short_input{};
      return b == std::byte{1};
    } else {
      return in.template get<T>();
    }
  }
};

// Strings: a length word, then the characters.
template <class C, class Tr, class A>
struct cache_codec<std::basic_string<C, Tr, A>> {
  using type = std::basic_string<C, Tr, A>;  // the string type
  // Appends the length and the characters.
  static void encode(const type& v, std::string& out) {
    detail::cache_put_length(out, v.size());
    detail::cache_put_bytes(out, v.data(), v.size() * sizeof(C));
  }
  // Reads them back; a length past the element's bytes throws short_input.
  static type decode(cache_cursor& in) {
    const std::size_t n = detail::cache_get_length(in, sizeof(C));
    type v(n, C{});
    std::memcpy(v.data(), in.take(n * sizeof(C)).data(), n * sizeof(C));
    return v;
  }
};

// Vectors of codable types: a length word, then the elements.
template <class T, class A>
  requires cache_codable<T>
struct cache_codec<std::vector<T, A>> {
  using type = std::vector<T, A>;  // the vector type
  // Appends the length, then the elements (one copy when T is trivially copyable).
  static void encode(const type& v, std::string& out) {
    detail::cache_put_length(out, v.size());
    if constexpr (std::is_trivially_copyable_v<T>)
      detail::cache_put_bytes(out, v.data(), v.size() * sizeof(T));
    else
      for (const T& e : v) cache_codec<T>::encode(e, out);
  }
  // Reads them back; a damaged length throws short_input rather than allocating for it.
  static type decode(cache_cursor& in) {
    // An element encodes to at least one byte unless it is an empty trivially copyable type.
    const std::size_t n = detail::cache_get_length(in, std::is_empty_v<T> ? 0 : 1);
    type v;
    if constexpr (std::is_trivially_copyable_v<T>) {
      if (n > in.left() / (sizeof(T) ? sizeof(T) : 1)) throw cache_cursor::short_input{};
      v.resize(n);
      const auto b = in.take(n * sizeof(T));
      if (n) std::memcpy(v.data(), b.data(), n * sizeof(T));
    } else {
      // n is checked against the bytes left, not their size in memory: reserve no more
      // than the element's bytes could make, and let a damaged count fail in decode.
      v.reserve(std::min(n, in.left() / (sizeof(T) > 64 ? sizeof(T) : 64) + 1));
      for (std::size_t i = 0; i < n; ++i) v.push_back(cache_codec<T>::decode(in));
    }
    return v;
  }
};

// Arrays of codable types that are not trivially copyable (those are their bytes): the
// elements in order.
template <class T, std::size_t N>
  requires cache_codable<T> && (!std::is_trivially_copyable_v<std::array<T, N>>)
struct cache_codec<std::array<T, N>> {
  using type = std::array<T, N>;  // the array type
  // Appends the N elements, in order (no length: N is in the type).
  static void encode(const type& v, std::string& out) {
    for (const T& e : v) cache_codec<T>::encode(e, out);
  }
  // Reads the N elements back, in order.
  static type decode(cache_cursor& in) {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return type{((void)I, cache_codec<T>::decode(in))...};  // braces: left to right
    }(std::make_index_sequence<N>{});
  }
};

// Tuples of codable types: the fields in order.
template <class... Ts>
  requires(cache_codable<Ts> && ...)
struct cache_codec<std::tuple<Ts...>> {
  using type = std::tuple<Ts...>;  // the tuple type
  // Appends each field, in order.
  static void encode(const type& v, std::string& out) {
    std::apply([&](const Ts&... e) { (cache_codec<Ts>::encode(e, out), ...); }, v);
  }
  // Reads each field back, in order.
  static type decode(cache_cursor& in) { return type{cache_codec<Ts>::decode(in)...}; }  // left to right
};

// Pairs of codable types: first, then second.
template <class A, class B>
  requires cache_codable<A> && cache_codable<B>
struct cache_codec<std::pair<A, B>> {
  using type = std::pair<A, B>;  // the pair type
  // Appends first, then second.
  static void encode(const type& v, std::string& out) {
    cache_codec<A>::encode(v.first, out);
    cache_codec<B>::encode(v.second, out);
  }
  // Reads first, then second.
  static type decode(cache_cursor& in) { return type{cache_codec<A>::decode(in), cache_codec<B>::decode(in)}; }
};

// Records: a length word, then the bytes; read back as a view of the cache's chunk.
template <>
struct cache_codec<record> {
  // Appends the length and the bytes.
  static void encode(const record& v, std::string& out) {
    detail::cache_put_length(out, v.size());
    detail::cache_put_bytes(out, v.data(), v.size());
  }
  // A view of the cache's read chunk (kept alive by the record). Its origin is the cache
  // file, at the record's own length word (its bytes follow it).
  static record decode(cache_cursor& in) {
    const std::size_t n = detail::cache_get_length(in, 1);
    const std::span<const std::byte> b = in.take(n);
    const auto& c = in.chunk();
    const std::uint64_t at = c.offset + static_cast<std::uint64_t>(b.data() - c.frame) - 8;
    return record(std::shared_ptr<const std::byte>(c.owner, b.data()), n, c.file, at, 8);
  }
};

}  // namespace ferry
