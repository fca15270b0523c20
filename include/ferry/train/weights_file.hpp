// ferry/train/weights_file.hpp: save and load MLP weights in a small, versioned,
// checksummed file.
//
// Format version 1, all integers and floats little-endian:
//
//   offset     bytes  field
//   0          8      magic "FERRYMLP"
//   8          4      u32 format version (1)
//   12         4      u32 S, the number of layer sizes (2 .. 4096)
//   16         4*S    u32 layer sizes (input, hidden..., classes), each >= 1
//   16+4S      8      u64 P, the parameter count (must equal what the sizes imply)
//   24+4S      4*P    f32 parameters in mlp_layout order (W_l row-major out x in, b_l)
//   24+4S+4P   4      u32 CRC-32 (zlib's crc32) of every preceding byte
//
// save_weights writes to a temporary file of its own beside `path` ("<path>.tmp.<pid>.<id>",
// removed if anything fails) then renames it over `path`, so a crash
// never leaves a half file under `path`, and concurrent saves to one path (every MPI rank
// calling trainer.save(path)) each succeed, the last rename winning. It refuses (before
// writing anything) a model this format cannot hold, the limits load_weights checks:
// weights_max_sizes layer sizes, each at most weights_max_layer. load_weights throws io_error when the file cannot be opened or read, and
// format_error (naming the file and byte offset) for a wrong magic, an unknown version,
// bad sizes, a truncated file, trailing bytes or a checksum mismatch. It checks the
// declared sizes against the file's length before allocating. Runs on the caller's thread.
#pragma once

#include <zlib.h>

#include <unistd.h>  // getpid

#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "ferry/detail/unique_id.hpp"
#include "ferry/error.hpp"
#include "ferry/train/mlp.hpp"

namespace ferry::train {

static_assert(std::endian::native == std::endian::little,
              "ferry weights files are little-endian; add byte swapping for this target");

// The file's first 8 bytes, "FERRYMLP".
inline constexpr char weights_magic[8] = {'F', 'E', 'R', 'R', 'Y', 'M', 'L', 'P'};
// The format version written, and the only one read.
inline constexpr std::uint32_t weights_version = 1;

// The format's limits, checked by save_weights (config_error, nothing written) and
// load_weights (format_error): a model saved is a model that loads.
inline constexpr std::uint64_t weights_max_sizes = 4096;  // layer sizes (input, hidden..., classes)
inline constexpr std::uint64_t weights_max_layer = std::uint64_t(1) << 24;  // each size

namespace detail {
// Why `count` layer sizes do not fit the format ("" when they do).
inline std::string weights_count_problem(std::uint64_t count) {
  if (count >= 2 && count <= weights_max_sizes) return {};
  return "bad layer count " + std::to_string(count) + " (expected 2 .. " + std::to_string(weights_max_sizes) + ")";
}
// Why a layer size does not fit the format ("" when it does).
inline std::string weights_size_problem(std::int64_t size) {
  if (size >= 1 && std::uint64_t(size) <= weights_max_layer) return {};
  return "bad layer size " + std::to_string(size) + " (expected 1 .. " + std::to_string(weights_max_layer) + ")";
}
// A temporary name beside `path` no other save uses: this process's id (readable) and a
// unique_id() (other threads, processes, hosts sharing the file system).
inline std::string weights_temp_name(const std::string& path) {
  return path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(ferry::detail::unique_id());
}
}  // namespace detail

// What load_weights returns: the layer sizes and the parameters, as save_weights took them.
struct mlp_weights {
  std::vector<int> layers;  // input size, hidden sizes..., number of classes
  std::vector<float> params;  // in mlp_layout order
};

// Writes layers and params to path (through a temporary file of its own and a rename; see
// the file's top). Throws config_error, before writing anything, for bad sizes, sizes past
// the format's limits or a params count the layers do not imply; io_error (naming the file)
// when the file cannot be written or renamed, after removing the temporary file. Safe to
// call from several threads or processes for one path. Runs on the caller's thread.
inline void save_weights(const std::string& path, const std::vector<int>& layers,
                         const std::vector<float>& params) {
  const mlp_layout lay(mlp_config{layers, {}});
  if (std::string why = detail::weights_count_problem(layers.size()); !why.empty())
    throw config_error("save_weights: " + path + ": " + why + ": a weights file could not hold it");
  for (std::size_t i = 0; i < layers.size(); ++i)
    if (std::string why = detail::weights_size_problem(layers[i]); !why.empty())
      throw config_error("save_weights: " + path + ": layer size " + std::to_string(i) + ": " + why +
                         ": a weights file could not hold it");
  if (params.size() != lay.params)
    throw config_error("save_weights: " + std::to_string(params.size()) +
                       " parameters for layers needing " + std::to_string(lay.params));
  std::string out;
  out.append(weights_magic, 8);
  auto put32 = [&](std::uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); };
  put32(weights_version);
  put32(static_cast<std::uint32_t>(layers.size()));
  for (int s : layers) put32(static_cast<std::uint32_t>(s));
  const std::uint64_t P = params.size();
  out.append(reinterpret_cast<const char*>(&P), 8);
  out.append(reinterpret_cast<const char*>(params.data()), params.size() * sizeof(float));
  put32(static_cast<std::uint32_t>(
      crc32_z(0L, reinterpret_cast<const Bytef*>(out.data()), out.size())));  // z_size_t: past 4 GiB

  // "x": never open a file another save made (a name collision is then an error, not two
  // writers in one file).
  const std::string tmp = detail::weights_temp_name(path);
  std::FILE* f = std::fopen(tmp.c_str(), "wbx");
  if (!f) throw io_error(tmp, 0, std::error_code(errno, std::generic_category()), "cannot create the temporary file");
  const std::size_t w = std::fwrite(out.data(), 1, out.size(), f);
  const int write_errno = errno;
  const bool closed = std::fclose(f) == 0;  // flushes: a full disk may show only here
  const int close_errno = errno;
  if (!closed || w != out.size()) {
    std::remove(tmp.c_str());
    throw io_error(tmp, w, std::error_code(w != out.size() ? write_errno : close_errno, std::generic_category()),
                   "cannot write");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw io_error(path, 0, ec, "cannot replace it with the new weights written to " + tmp + " (rename)");
  }
}

// Reads a weights file; throws io_error or format_error as the file's top says.
inline mlp_weights load_weights(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw io_error(path, 0, std::error_code(errno, std::generic_category()), "cannot open");
  struct closer {
    std::FILE* f;
    ~closer() { std::fclose(f); }
  } guard{f};
  std::error_code ec;
  const std::uint64_t size = std::filesystem::file_size(path, ec);
  if (ec) throw io_error(path, 0, ec, "cannot stat");
  // Reads bytes [have, upto) into data: only what the header says the file should hold.
  std::string data;
  auto read_to = [&](std::size_t upto) {
    const std::size_t have = data.size();
    data.resize(upto);
    const std::size_t got = std::fread(data.data() + have, 1, upto - have, f);
    if (got != upto - have) {
      if (std::ferror(f))
        throw io_error(path, have + got, std::error_code(errno, std::generic_category()), "cannot read");
      data.resize(have + got);
    }
  };
  auto need = [&](std::size_t bytes, const char* what) {
    if (data.size() < bytes) read_to(bytes);
    if (data.size() < bytes)
      throw format_error(path, data.size(), std::string("truncated weights file: expected ") + what +
                                                " (" + std::to_string(bytes) +
                                                " bytes), the file ends");
  };
  auto get32 = [&](std::size_t off) {
    std::uint32_t v;
    std::memcpy(&v, data.data() + off, 4);
    return v;
  };
  need(16, "the header");
  if (std::memcmp(data.data(), weights_magic, 8) != 0)
    throw format_error(path, 0, "not a ferry weights file (magic is not \"FERRYMLP\")");
  const std::uint32_t ver = get32(8);
  if (ver != weights_version)
    throw format_error(path, 8, "unsupported weights format version " + std::to_string(ver) +
                                    " (this ferry reads version 1)");
  const std::uint32_t S = get32(12);
  if (std::string why = detail::weights_count_problem(S); !why.empty()) throw format_error(path, 12, why);
  need(16 + 4ull * S + 8, "the layer sizes and parameter count");
  mlp_weights w;
  std::uint64_t implied = 0;
  for (std::uint32_t i = 0; i < S; ++i) {
    const std::uint32_t s = get32(16 + 4ull * i);
    if (std::string why = detail::weights_size_problem(s); !why.empty())
      throw format_error(path, 16 + 4ull * i, why);
    w.layers.push_back(static_cast<int>(s));
    if (i > 0) implied += std::uint64_t(w.layers[i - 1]) * s + s;
  }
  const std::size_t poff = 16 + 4ull * S;
  std::uint64_t P;
  std::memcpy(&P, data.data() + poff, 8);
  if (P != implied)
    throw format_error(path, poff, "parameter count " + std::to_string(P) + " does not match the "
                                   "layer sizes (" + std::to_string(implied) + ")");
  const std::size_t doff = poff + 8;
  const std::uint64_t total = doff + P * 4 + 4;
  if (size < total)  // checked before allocating what the header claims
    throw format_error(path, size, "truncated weights file: expected " + std::to_string(total) +
                                       " bytes, the file has " + std::to_string(size));
  if (size > total) throw format_error(path, total, "trailing bytes after the checksum");
  need(total, "the parameters and checksum");
  const std::uint32_t want = get32(doff + P * 4);
  const auto got = static_cast<std::uint32_t>(
      crc32_z(0L, reinterpret_cast<const Bytef*>(data.data()), doff + P * 4));
  if (want != got)
    throw format_error(path, doff + P * 4, "checksum mismatch (the file is corrupt)");
  w.params.resize(P);
  std::memcpy(w.params.data(), data.data() + doff, P * 4);
  return w;
}

}  // namespace ferry::train
