// ferry/sources/array_meta.hpp: the element type and shape behind the rows of a .npy or
// IDX file, so the consumer can interpret each record (one row along the first axis).
// A plain value: throws nothing but std::bad_alloc, runs no user code, any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ferry {

// The dtype and shape of a .npy or IDX file's array (from_files' meta()).
struct array_meta {
  // NumPy's type string: byte order (<, >, |) then kind and size, e.g. "<f4", "|u1",
  // ">i4". IDX files are big-endian: ">f4", ">i2", "|u1". Record bytes are as stored.
  std::string dtype;
  std::size_t item_bytes = 0;  // bytes of one item (4 for "<f4")
  std::vector<std::uint64_t> shape;  // the whole array of the file; {} for a scalar
  std::uint64_t rows = 0;            // records in the file (shape[0]; 1 for a scalar)
  std::uint64_t row_bytes = 0;       // bytes in each record

  // The shape of one record: shape without its first axis ({} for a scalar or a vector).
  std::vector<std::uint64_t> row_shape() const {
    return shape.empty() ? std::vector<std::uint64_t>{} : std::vector<std::uint64_t>(shape.begin() + 1, shape.end());
  }
  // Same layout of rows (dtype and row shape): files read together must agree.
  bool same_rows(const array_meta& o) const { return dtype == o.dtype && row_shape() == o.row_shape(); }
  // "dtype <f4, row shape (28, 28)": for error messages.
  std::string describe() const {
    std::string s = "dtype " + dtype + ", row shape (";
    auto rs = row_shape();
    for (std::size_t i = 0; i < rs.size(); ++i) s += (i ? ", " : "") + std::to_string(rs[i]);
    return s + ")";
  }
};

// The most rows of 0 bytes (a dimension of 0, or a 0-byte dtype) a .npy or IDX header may
// claim: no byte of the file backs them, and reading 2^64 of them would not end.
inline constexpr std::uint64_t max_empty_rows = std::uint64_t(1) << 24;

}  // namespace ferry
