// ferry/sources/example.hpp: tf.train.Example, the protobuf payload of most TFRecord
// datasets, parsed without protobuf, mostly without copying.
//
//   auto src = ferry::from_files({"train-*.tfrecord"}, ferry::tfrecord{})
//            | ferry::map(ferry::parse_example, {.workers = 4});
//   for (const ferry::example& ex : src) {
//     std::span<const std::int64_t> label = ex.int64s("label");
//     ferry::float_values x = ex.floats("x");               // x.copy_to(dst), x[i]
//     std::span<const std::string_view> img = ex.bytes("image/encoded");
//   }
//
// The wire format (tensorflow/core/example/{example,feature}.proto, proto3):
//   Example   { Features features = 1; }
//   Features  { map<string, Feature> feature = 1; }     entries: { key = 1; value = 2; }
//   Feature   { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2;
//                            Int64List int64_list = 3; } }
//   BytesList { repeated bytes value = 1; }  FloatList { repeated float value = 1; }
//   Int64List { repeated int64 value = 1; }  (floats and int64s packed or not)
// Parsed as protobuf parses it: unknown fields (any wire type, groups included) are
// skipped; a message field seen twice is merged (lists concatenate); a later map entry
// with the same key replaces the earlier one; the last oneof member seen wins; a map
// entry without a key has key "", without a value a feature of kind none.
//
// Zero-copy: the example holds the record (sharing its chunk, no copy); bytes values are
// string_views into it, and a float list written as one packed run (what every writer
// does) is a view of its little-endian floats. int64 lists (varints) are decoded into
// the example; so are unpacked floats.
//
// Errors: a corrupt payload throws ferry::example_error (a format_error) whose path and
// offset are the record's file and start offset (record::origin(), set by from_files and
// interleave), whose reason says what was wrong and at which byte of the payload:
//   "f.tfrecord: bad tf.train.Example (payload byte 17: truncated varint) at offset 4096"
// What is wrong: a truncated varint, a varint over 10 bytes, a length past the end of its
// message, field number 0, wire type 6 or 7, an unmatched end-group, a known field with
// the wrong wire type (which no writer produces; protobuf would keep it as an unknown
// field), a packed float run whose length is not a multiple of 4, groups nested over 64
// deep. Not checked: UTF-8 validity of feature names. Missing or mistyped features asked
// for by name (ex.floats("x")) throw example_error too, naming the feature.
// Thread: parse_example runs on the calling thread (a map worker); an example may be
// moved to and read from any thread.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <compare>
#include <cstring>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/error.hpp"
#include "ferry/sources/record.hpp"

namespace ferry {

namespace detail {
struct example_parser;
}
struct parse_example_t;

// A corrupt tf.train.Example: a format_error at the record's file and offset, plus the
// byte of the payload where parsing failed.
class example_error : public format_error {
 public:
  // `what` says what was wrong; path and record_offset name the record, payload_offset the
  // byte inside it.
  example_error(std::string path, std::uint64_t record_offset, std::uint64_t payload_offset,
                const std::string& what)
      : format_error(std::move(path), record_offset, what), payload_(payload_offset) {}
  // Byte of the record's payload where the problem is (for a missing or mistyped feature:
  // 0).
  std::uint64_t payload_offset() const noexcept { return payload_; }

 private:
  std::uint64_t payload_;
};

// Which list a feature holds (the Feature oneof); none when the oneof was not set.
enum class feature_kind : std::uint8_t { none, bytes_list, float_list, int64_list };

// The kind's name as in the .proto ("bytes_list", ...; "none"), for messages.
inline const char* to_string(feature_kind k) {
  switch (k) {
    case feature_kind::bytes_list: return "bytes_list";
    case feature_kind::float_list: return "float_list";
    case feature_kind::int64_list: return "int64_list";
    default: return "none";
  }
}

// A FloatList's values: a view of little-endian floats (in the record, or in the example
// for unpacked encodings). Elements are read with memcpy, so no alignment is assumed.
class float_values {
 public:
  float_values() = default;
  // A view of n floats stored little-endian at p (4 * n bytes, any alignment).
  float_values(const std::byte* p, std::size_t n) noexcept : p_(p), n_(n) {}
  // The number of floats.
  std::size_t size() const noexcept { return n_; }
  // Whether there is none.
  bool empty() const noexcept { return n_ == 0; }
  // Float i (i < size(), unchecked), read byte by byte.
  float operator[](std::size_t i) const noexcept {
    std::uint32_t v = 0;
    for (std::size_t b = 4; b-- > 0;) v = (v << 8) | std::to_integer<std::uint32_t>(p_[4 * i + b]);
    return std::bit_cast<float>(v);
  }
  // The raw little-endian bytes (4 * size()).
  std::span<const std::byte> bytes() const noexcept { return {p_, 4 * n_}; }
  // Copies the values to out (out.size() >= size()): one memcpy on little-endian hosts.
  void copy_to(std::span<float> out) const {
    if (out.size() < n_) throw config_error("float_values::copy_to: the output holds fewer than size() floats");
    if constexpr (std::endian::native == std::endian::little) {
      if (n_) std::memcpy(out.data(), p_, 4 * n_);
    } else {
      for (std::size_t i = 0; i < n_; ++i) out[i] = (*this)[i];
    }
  }
  // The values in a new vector.
  std::vector<float> to_vector() const {
    std::vector<float> v(n_);
    copy_to(v);
    return v;
  }

  // A random-access iterator over the values, yielding floats by value (they are not
  // stored as floats, so there is no float& to give).
  class iterator {
   public:
    using iterator_category = std::random_access_iterator_tag;  // random access
    using value_type = float;                                   // a float
    using difference_type = std::ptrdiff_t;                     // a distance in floats
    using reference = float;                                    // by value: no float is stored
    using pointer = void;                                       // no address to give
    iterator() = default;
    // At float i of v.
    iterator(const float_values* v, std::size_t i) : v_(v), i_(i) {}
    // The current float.
    float operator*() const { return (*v_)[i_]; }
    // The float d places on (a negative d wraps around in size_t: -d places back).
    float operator[](difference_type d) const { return (*v_)[i_ + static_cast<std::size_t>(d)]; }
    // The next float.
    iterator& operator++() { ++i_; return *this; }
    // The next float; returns the iterator before the step.
    iterator operator++(int) { auto t = *this; ++i_; return t; }
    // The float before.
    iterator& operator--() { --i_; return *this; }
    // The float before; returns the iterator before the step.
    iterator operator--(int) { auto t = *this; --i_; return t; }
    // d floats on.
    iterator& operator+=(difference_type d) { i_ += static_cast<std::size_t>(d); return *this; }
    // d floats back.
    iterator& operator-=(difference_type d) { i_ -= static_cast<std::size_t>(d); return *this; }
    // a moved d floats on.
    friend iterator operator+(iterator a, difference_type d) { return a += d; }
    // a moved d floats on.
    friend iterator operator+(difference_type d, iterator a) { return a += d; }
    // a moved d floats back.
    friend iterator operator-(iterator a, difference_type d) { return a -= d; }
    // The distance from b to a, in floats.
    friend difference_type operator-(iterator a, iterator b) {
      return static_cast<difference_type>(a.i_) - static_cast<difference_type>(b.i_);
    }
    // The same place (iterators of the same float_values).
    friend bool operator==(iterator a, iterator b) { return a.i_ == b.i_; }
    // Ordered by place.
    friend auto operator<=>(iterator a, iterator b) { return a.i_ <=> b.i_; }

   private:
    const float_values* v_ = nullptr;
    std::size_t i_ = 0;
  };
  // The first float; the iterators refer to this float_values, which must outlive them.
  iterator begin() const { return {this, 0}; }
  // Past the last float.
  iterator end() const { return {this, n_}; }

 private:
  const std::byte* p_ = nullptr;
  std::size_t n_ = 0;
};

class example;

// One named feature of an example; valid while its example is alive and not moved from
// (bytes values stay valid as long as the record's chunk, i.e. any copy of the record).
class feature {
 public:
  // The feature's name (the map key), a view into the record.
  std::string_view name() const noexcept { return name_; }
  // Which list it holds.
  feature_kind kind() const noexcept { return kind_; }
  // Number of values (0 for kind none).
  std::size_t size() const noexcept { return n_; }

 private:
  friend class example;
  friend struct detail::example_parser;
  std::string_view name_;
  feature_kind kind_ = feature_kind::none;
  bool float_in_record_ = false;  // float values view the record (one packed run)
  std::size_t first_ = 0;         // index into the example's arena for the kind
  std::size_t n_ = 0;
  const std::byte* floats_ = nullptr;  // float_in_record_: the packed run
  std::uint64_t seq_ = 0;              // map entry order, for "last entry wins"
};

// A parsed tf.train.Example. Holds its record (a shared reference to the read chunk).
class example {
 public:
  example() = default;

  // Features sorted by name.
  std::span<const feature> features() const noexcept { return features_; }
  // The number of features.
  std::size_t size() const noexcept { return features_.size(); }
  // nullptr when there is no feature of that name.
  const feature* find(std::string_view name) const noexcept {
    auto it = std::lower_bound(features_.begin(), features_.end(), name,
                               [](const feature& f, std::string_view n) { return f.name_ < n; });
    return it != features_.end() && it->name_ == name ? &*it : nullptr;
  }
  // Whether there is a feature of that name.
  bool contains(std::string_view name) const noexcept { return find(name) != nullptr; }

  // The values of one feature. Throw example_error when the feature is missing or of
  // another kind (a feature of kind none reads as an empty list of any kind).
  std::span<const std::string_view> bytes(std::string_view name) const {
    return bytes(get(name, feature_kind::bytes_list));
  }
  // The float_list named `name`; throws example_error as bytes(name) does.
  float_values floats(std::string_view name) const { return floats(get(name, feature_kind::float_list)); }
  // The int64_list named `name`; throws example_error as bytes(name) does.
  std::span<const std::int64_t> int64s(std::string_view name) const {
    return int64s(get(name, feature_kind::int64_list));
  }
  // The same, for a feature of this example (of that kind, or none: then empty).
  std::span<const std::string_view> bytes(const feature& f) const {
    if (f.kind_ != feature_kind::bytes_list) return {};
    return {bytes_.data() + f.first_, f.n_};
  }
  // f's floats (empty when f is not a float_list).
  float_values floats(const feature& f) const {
    if (f.kind_ != feature_kind::float_list) return {};
    if (f.float_in_record_) return float_values(f.floats_, f.n_);
    return float_values(floats_.data() + 4 * f.first_, f.n_);  // first_ counts floats; floats_ holds bytes
  }
  // f's int64s (empty when f is not an int64_list).
  std::span<const std::int64_t> int64s(const feature& f) const {
    if (f.kind_ != feature_kind::int64_list) return {};
    return {ints_.data() + f.first_, f.n_};
  }

  // The record the example was parsed from (empty when parsed from a span of bytes).
  const ferry::record& record() const noexcept { return rec_; }

 private:
  friend struct detail::example_parser;
  friend struct parse_example_t;

  const feature& get(std::string_view name, feature_kind want) const {
    const feature* f = find(name);
    record_origin o = rec_.origin();
    if (o.file.empty()) o = {span_file_, span_offset_, span_offset_};  // parsed from a span: its origin
    const std::string path = o.file.empty() ? std::string("<memory>") : std::string(o.file);
    if (!f) throw example_error(path, o.offset, 0, "tf.train.Example has no feature '" + std::string(name) + "'");
    if (f->kind_ != want && f->kind_ != feature_kind::none)
      throw example_error(path, o.offset, 0,
                          "tf.train.Example feature '" + std::string(name) + "' is a " + to_string(f->kind_) +
                              ", not a " + to_string(want));
    return *f;
  }

  ferry::record rec_;
  std::string span_file_;            // parsed from a span: the origin given (errors name it)
  std::uint64_t span_offset_ = 0;
  std::vector<feature> features_;
  std::vector<std::string_view> bytes_;
  std::vector<std::int64_t> ints_;
  std::vector<std::byte> floats_;  // little-endian floats of unpacked / several-run lists
};

namespace detail {

struct example_parser {
  const std::byte* base;
  record_origin origin;
  example& ex;
  std::uint64_t seq = 0;

  [[noreturn]] void fail(const std::byte* at, const std::string& what) const {
    const std::uint64_t k = static_cast<std::uint64_t>(at - base);
    throw example_error(origin.file.empty() ? std::string("<memory>") : std::string(origin.file), origin.offset, k,
                        "bad tf.train.Example (payload byte " + std::to_string(k) + ": " + what + ")");
  }

  std::uint64_t varint(const std::byte*& p, const std::byte* stop) const {
    const std::byte* start = p;
    std::uint64_t v = 0;
    for (int i = 0; i < 10; ++i) {
      if (p == stop) fail(start, "truncated varint");
      const auto b = std::to_integer<std::uint64_t>(*p++);
      v |= (b & 0x7f) << (7 * i);
      if (!(b & 0x80)) return v;
    }
    fail(start, "varint longer than 10 bytes");
  }

  struct tag_t {
    std::uint32_t field;
    std::uint32_t wire;
    const std::byte* at;
  };
  tag_t tag(const std::byte*& p, const std::byte* stop) const {
    const std::byte* at = p;
    const std::uint64_t t = varint(p, stop);
    const std::uint64_t field = t >> 3;
    const auto wire = static_cast<std::uint32_t>(t & 7);
    if (field == 0) fail(at, "field number 0");
    if (field > 0x1fffffff) fail(at, "field number " + std::to_string(field) + " is out of range");
    if (wire > 5) fail(at, "invalid wire type " + std::to_string(wire));
    return {static_cast<std::uint32_t>(field), wire, at};
  }

  // A length-delimited field's body: [p, p + len) after the length varint.
  std::span<const std::byte> delimited(const std::byte*& p, const std::byte* stop) const {
    const std::byte* at = p;
    const std::uint64_t len = varint(p, stop);
    const auto left = static_cast<std::uint64_t>(stop - p);
    if (len > left)
      fail(at, "length " + std::to_string(len) + " runs past the end of its message (" + std::to_string(left) +
                   " bytes left)");
    std::span<const std::byte> body(p, static_cast<std::size_t>(len));
    p += len;
    return body;
  }

  void need(const std::byte*& p, const std::byte* stop, std::size_t n, const char* what) const {
    if (static_cast<std::size_t>(stop - p) < n)
      fail(p, std::string("truncated ") + what + " (" + std::to_string(n) + " bytes needed, " +
                  std::to_string(stop - p) + " left)");
  }

  // Skips an unknown field whose tag has been read, as protobuf does (groups included).
  void skip(const tag_t& t, const std::byte*& p, const std::byte* stop, int depth = 0) const {
    switch (t.wire) {
      case 0: varint(p, stop); return;
      case 1: need(p, stop, 8, "fixed64 field"); p += 8; return;
      case 2: delimited(p, stop); return;
      case 5: need(p, stop, 4, "fixed32 field"); p += 4; return;
      case 3: {
        if (depth >= 64) fail(t.at, "groups nested more than 64 deep");
        for (;;) {
          if (p == stop) fail(t.at, "group of field " + std::to_string(t.field) + " is not closed");
          const tag_t in = tag(p, stop);
          if (in.wire == 4) {
            if (in.field != t.field)
              fail(in.at, "end-group of field " + std::to_string(in.field) + " closes a group of field " +
                              std::to_string(t.field));
            return;
          }
          skip(in, p, stop, depth + 1);
        }
      }
      default: fail(t.at, "end-group without a start-group");
    }
  }

  void expect_wire(const tag_t& t, std::uint32_t want, const char* field) const {
    if (t.wire != want)
      fail(t.at, std::string("wrong wire type ") + std::to_string(t.wire) + " for " + field + " (expected " +
                     std::to_string(want) + ")");
  }

  // Walks the fields of message m: on(t, p, stop) reads a field it knows (its tag already
  // read, p at its body) and returns true; false leaves the field to skip(), as protobuf
  // skips unknown fields.
  template <class On>
  void fields(std::span<const std::byte> m, On&& on) {
    const std::byte* p = m.data();
    const std::byte* const stop = p + m.size();
    while (p != stop) {
      const tag_t t = tag(p, stop);
      if (!on(t, p, stop)) skip(t, p, stop);
    }
  }

  void parse(std::span<const std::byte> msg) {
    fields(msg, [&](const tag_t& t, const std::byte*& p, const std::byte* stop) {
      if (t.field != 1) return false;
      expect_wire(t, 2, "Example.features");
      features(delimited(p, stop));
      return true;
    });
  }

  void features(std::span<const std::byte> m) {
    fields(m, [&](const tag_t& t, const std::byte*& p, const std::byte* stop) {
      if (t.field != 1) return false;
      expect_wire(t, 2, "Features.feature");
      entry(delimited(p, stop));
      return true;
    });
  }

  void entry(std::span<const std::byte> m) {
    feature f;
    f.seq_ = seq++;
    fields(m, [&](const tag_t& t, const std::byte*& p, const std::byte* stop) {
      if (t.field == 1) {
        expect_wire(t, 2, "Features.feature key");
        const auto k = delimited(p, stop);
        f.name_ = std::string_view(reinterpret_cast<const char*>(k.data()), k.size());
      } else if (t.field == 2) {
        expect_wire(t, 2, "Features.feature value");
        value(delimited(p, stop), f);
      } else {
        return false;
      }
      return true;
    });
    ex.features_.push_back(f);
  }

  // One Feature message, merged into f (a value field seen twice in an entry merges).
  void value(std::span<const std::byte> m, feature& f) {
    fields(m, [&](const tag_t& t, const std::byte*& p, const std::byte* stop) {
      if (t.field < 1 || t.field > 3) return false;
      static constexpr const char* names[] = {"", "Feature.bytes_list", "Feature.float_list", "Feature.int64_list"};
      expect_wire(t, 2, names[t.field]);
      const auto body = delimited(p, stop);
      const auto k = static_cast<feature_kind>(t.field);
      if (f.kind_ != k) {  // a new oneof member: drops the other's values
        f.kind_ = k;
        f.n_ = 0;
        f.float_in_record_ = false;
        f.first_ = k == feature_kind::bytes_list ? ex.bytes_.size()
                   : k == feature_kind::int64_list ? ex.ints_.size()
                                                   : ex.floats_.size() / 4;
      }
      if (k == feature_kind::bytes_list) bytes_list(body, f);
      else if (k == feature_kind::int64_list) int64_list(body, f);
      else float_list(body, f);
      return true;
    });
  }

  void bytes_list(std::span<const std::byte> m, feature& f) {
    fields(m, [&](const tag_t& t, const std::byte*& p, const std::byte* stop) {
      if (t.field != 1) return false;
      expect_wire(t, 2, "BytesList.value");
      const auto v = delimited(p, stop);
      ex.bytes_.emplace_back(reinterpret_cast<const char*>(v.data()), v.size());
      ++f.n_;
      return true;
    });
  }

  void int64_list(std::span<const std::byte> m, feature& f) {
    fields(m, [&](const tag_t& t, const std::byte*& p, const std::byte* stop) {
      if (t.field != 1) return false;
      if (t.wire == 0) {
        ex.ints_.push_back(static_cast<std::int64_t>(varint(p, stop)));
        ++f.n_;
        return true;
      }
      expect_wire(t, 2, "Int64List.value");
      const auto run = delimited(p, stop);
      const std::byte* q = run.data();
      const std::byte* const qe = q + run.size();
      while (q != qe) {
        ex.ints_.push_back(static_cast<std::int64_t>(varint(q, qe)));
        ++f.n_;
      }
      return true;
    });
  }

  void float_list(std::span<const std::byte> m, feature& f) {
    fields(m, [&](const tag_t& t, const std::byte*& p, const std::byte* stop) {
      if (t.field != 1) return false;
      std::span<const std::byte> run;
      if (t.wire == 5) {
        need(p, stop, 4, "float value");
        run = {p, 4};
        p += 4;
      } else {
        expect_wire(t, 2, "FloatList.value");
        const std::byte* at = p;
        run = delimited(p, stop);
        if (run.size() % 4 != 0)
          fail(at, "packed float list of " + std::to_string(run.size()) + " bytes (not a multiple of 4)");
      }
      if (run.empty()) return true;
      if (f.n_ == 0 && t.wire == 2) {  // the first run: a view into the record
        f.float_in_record_ = true;
        f.floats_ = run.data();
        f.n_ = run.size() / 4;
        return true;
      }
      if (f.float_in_record_) {  // a second run: move the first into the example
        f.float_in_record_ = false;
        f.first_ = ex.floats_.size() / 4;
        ex.floats_.insert(ex.floats_.end(), f.floats_, f.floats_ + 4 * f.n_);
      }
      ex.floats_.insert(ex.floats_.end(), run.begin(), run.end());
      f.n_ += run.size() / 4;
      return true;
    });
  }

  // Sorted by name; of equal names the last map entry wins.
  void finish() {
    auto& v = ex.features_;
    std::sort(v.begin(), v.end(), [](const feature& a, const feature& b) {
      return a.name_ != b.name_ ? a.name_ < b.name_ : a.seq_ < b.seq_;
    });
    std::size_t out = 0;
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (i + 1 < v.size() && v[i + 1].name_ == v[i].name_) continue;
      v[out++] = v[i];
    }
    v.resize(out);
  }
};

}  // namespace detail

// The type of ferry::parse_example, a function object for map(): map(parse_example).
// Runs on the calling thread (a map worker); keeps no state between calls.
struct parse_example_t {
  // Parses r's bytes; the example shares r's chunk (no copy). Throws example_error.
  example operator()(ferry::record r) const {
    example ex;
    const record_origin o = r.origin();
    ex.rec_ = std::move(r);
    const auto bytes = ex.rec_.bytes();
    detail::example_parser p{bytes.data(), o, ex};
    p.parse(bytes);
    p.finish();
    return ex;
  }
  // Parses bytes that outlive the example (a copy of the record is not kept). Errors name
  // `origin` (file "" reads "<memory>").
  example operator()(std::span<const std::byte> bytes, record_origin origin = {}) const {
    example ex;
    ex.span_file_ = origin.file;
    ex.span_offset_ = origin.offset;
    detail::example_parser p{bytes.data(), origin, ex};
    p.parse(bytes);
    p.finish();
    return ex;
  }
};
// parse_example(record): the record's tf.train.Example (see the file's top).
inline constexpr parse_example_t parse_example{};

}  // namespace ferry
