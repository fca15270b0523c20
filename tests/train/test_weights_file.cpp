// The weights file: round trip, and every damaged file is a clear error naming the file.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "ferry/train/host_trainer.hpp"
#include "ferry/train/weights_file.hpp"

namespace tr = ferry::train;
namespace fs = std::filesystem;

namespace {
std::string temp_path(const std::string& name) {
  return (fs::temp_directory_path() / ("ferry_test_" + std::to_string(::getpid()) + "_" + name))
      .string();
}
std::string read_all(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}
void write_all(const std::string& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(s.data(), std::streamsize(s.size()));
}
// Expects format_error naming the path and the byte `offset`, its reason mentioning `what`.
void expect_format_error(const std::string& p, std::uint64_t offset, const std::string& what) {
  try {
    tr::load_weights(p);
    FAIL("no error for a bad file: " << what);
  } catch (const ferry::format_error& e) {
    INFO(std::string(e.what()));
    CHECK(e.path() == p);
    CHECK(e.offset() == offset);
    CHECK(e.reason().find(what) != std::string::npos);
    CHECK(std::string(e.what()).find(" at offset " + std::to_string(offset)) != std::string::npos);
  }
}
}  // namespace

TEST_CASE("save then load gives the same layers and bits; the layout is as documented") {
  const std::vector<int> layers{5, 4, 3};
  const auto p = tr::init_params(tr::mlp_layout(tr::mlp_config{layers, {}}), 9);
  const std::string path = temp_path("roundtrip.fmlp");
  tr::save_weights(path, layers, p);
  const auto w = tr::load_weights(path);
  CHECK(w.layers == layers);
  CHECK(w.params == p);
  const std::string bytes = read_all(path);
  CHECK(bytes.size() == 16 + 4 * 3 + 8 + 4 * p.size() + 4);
  CHECK(bytes.substr(0, 8) == "FERRYMLP");
  CHECK(bytes[8] == 1);
  CHECK(bytes[12] == 3);
  CHECK(!fs::exists(path + ".tmp"));
  fs::remove(path);
}

TEST_CASE("damaged files are format_errors naming the file and the byte offset") {
  const std::vector<int> layers{3, 2};
  const auto p = tr::init_params(tr::mlp_layout(tr::mlp_config{layers, {}}), 1);
  const std::string good_path = temp_path("good.fmlp");
  tr::save_weights(good_path, layers, p);
  const std::string good = read_all(good_path);
  const std::string path = temp_path("bad.fmlp");
  // The documented layout (weights_file.hpp) for S = 2 sizes {3, 2}: header [0, 16), sizes
  // [16, 24), P at 24, P = 3*2 + 2 = 8 floats at doff = 32, the CRC at doff + 4P = 64.
  const std::size_t S = 2, P = 8, poff = 16 + 4 * S, doff = poff + 8, crc_off = doff + 4 * P,
                    total = crc_off + 4;
  REQUIRE(p.size() == P);
  REQUIRE(good.size() == total);

  SUBCASE("every truncation: the error is at the end of the file, naming what is missing") {
    for (std::size_t n = 0; n < good.size(); ++n) {
      write_all(path, good.substr(0, n));
      INFO("truncated to " << n << " bytes");
      // Every prefix ends inside a part the reader needs: the error is where the file ends.
      // Before byte 16 the header is cut; before poff + 8 the sizes or P; after that the
      // header is whole, and the declared size (total) is checked against the file's.
      const std::string what = n < 16 ? "expected the header (16 bytes)"
                               : n < doff ? "expected the layer sizes and parameter count (" + std::to_string(doff) + " bytes)"
                                          : "expected " + std::to_string(total) + " bytes, the file has " + std::to_string(n);
      expect_format_error(path, n, "truncated weights file: " + what);
    }
  }
  SUBCASE("wrong magic") {
    std::string b = good;
    b[0] = 'X';
    write_all(path, b);
    expect_format_error(path, 0, "not a ferry weights file");
  }
  SUBCASE("unknown version") {
    std::string b = good;
    b[8] = 2;
    write_all(path, b);
    expect_format_error(path, 8, "version 2");
  }
  SUBCASE("absurd layer count, no huge allocation") {
    std::string b = good;
    b[12] = b[13] = b[14] = b[15] = '\xff';
    write_all(path, b);
    expect_format_error(path, 12, "layer count");
  }
  SUBCASE("a layer size of 0, at 16 + 4i") {
    for (std::size_t i = 0; i < S; ++i) {
      CAPTURE(i);
      std::string b = good;
      for (std::size_t k = 0; k < 4; ++k) b[16 + 4 * i + k] = 0;
      write_all(path, b);
      expect_format_error(path, 16 + 4 * i, "bad layer size 0");
    }
  }
  SUBCASE("layer sizes that claim more parameters than the file holds") {
    std::string b = good;
    b[16] = '\x7f';  // input size 127 instead of 3: 127*2 + 2 = 256 parameters, P says 8
    write_all(path, b);
    expect_format_error(path, poff, "parameter count 8 does not match the layer sizes (256)");
  }
  SUBCASE("a flipped bit in the parameters") {
    std::string b = good;
    b[doff + 8] ^= 0x10;  // inside the parameters
    write_all(path, b);
    expect_format_error(path, crc_off, "checksum");
  }
  SUBCASE("a flipped bit in the checksum") {
    std::string b = good;
    b[crc_off + 3] ^= 0x01;
    write_all(path, b);
    expect_format_error(path, crc_off, "checksum");
  }
  SUBCASE("trailing bytes") {
    write_all(path, good + "x");
    expect_format_error(path, total, "trailing");
  }
  fs::remove(path);
  fs::remove(good_path);
}

TEST_CASE("a missing file is an io_error naming it; a model of another shape is a config_error") {
  const std::string missing = temp_path("does_not_exist.fmlp");
  try {
    tr::load_weights(missing);
    FAIL("no error for a missing file");
  } catch (const ferry::io_error& e) {
    INFO(std::string(e.what()));
    CHECK(e.path() == missing);
    CHECK(e.offset() == 0);
    CHECK(e.code() == std::errc::no_such_file_or_directory);
    CHECK(std::string(e.what()).find(missing) != std::string::npos);
  }
  const std::string path = temp_path("shape.fmlp");
  tr::save_weights(path, {3, 2}, tr::init_params(tr::mlp_layout(tr::mlp_config{{3, 2}, {}}), 1));
  tr::host_trainer t(tr::mlp_config{{3, 4, 2}, {}}, {.seed = 1, .max_rows = 4}, 1);
  CHECK_THROWS_AS(t.load(path), ferry::config_error);
  fs::remove(path);
}

TEST_CASE("trainer save/load restores the weights on every replica" * doctest::timeout(30)) {
  const tr::mlp_config cfg{{3, 4, 2}, {}};
  tr::host_trainer a(cfg, {.seed = 1, .max_rows = 4}, 2);
  tr::host_trainer b(cfg, {.seed = 2, .max_rows = 4}, 2);
  REQUIRE(a.parameters() != b.parameters());
  const std::string path = temp_path("trainer.fmlp");
  a.save(path);
  b.load(path);
  CHECK(b.parameters() == a.parameters());
  CHECK(b.replica_at(1).download_params() == a.parameters());
  fs::remove(path);
}
