// The weights file: round trip, and every damaged file is a clear error naming the file.
#include <doctest/doctest.h>

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
// Expects format_error mentioning the path and `what`.
void expect_format_error(const std::string& p, const std::string& what) {
  try {
    tr::load_weights(p);
    FAIL("no error for a bad file: " << what);
  } catch (const ferry::format_error& e) {
    INFO(std::string(e.what()));
    CHECK(e.path() == p);
    CHECK(std::string(e.what()).find(what) != std::string::npos);
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

TEST_CASE("damaged files are format_errors naming the file") {
  const std::vector<int> layers{3, 2};
  const auto p = tr::init_params(tr::mlp_layout(tr::mlp_config{layers, {}}), 1);
  const std::string good_path = temp_path("good.fmlp");
  tr::save_weights(good_path, layers, p);
  const std::string good = read_all(good_path);
  const std::string path = temp_path("bad.fmlp");

  SUBCASE("every truncation") {
    for (std::size_t n = 0; n < good.size(); ++n) {
      write_all(path, good.substr(0, n));
      INFO("truncated to " << n << " bytes");
      CHECK_THROWS_AS(tr::load_weights(path), ferry::format_error);
    }
    write_all(path, good.substr(0, 10));
    expect_format_error(path, "truncated");
  }
  SUBCASE("wrong magic") {
    std::string b = good;
    b[0] = 'X';
    write_all(path, b);
    expect_format_error(path, "not a ferry weights file");
  }
  SUBCASE("unknown version") {
    std::string b = good;
    b[8] = 2;
    write_all(path, b);
    expect_format_error(path, "version 2");
  }
  SUBCASE("absurd layer count, no huge allocation") {
    std::string b = good;
    b[12] = b[13] = b[14] = b[15] = '\xff';
    write_all(path, b);
    expect_format_error(path, "layer count");
  }
  SUBCASE("layer sizes that claim more parameters than the file holds") {
    std::string b = good;
    b[16] = '\x7f';  // input size 127 instead of 3
    write_all(path, b);
    expect_format_error(path, "parameter count");
  }
  SUBCASE("a flipped bit in the parameters") {
    std::string b = good;
    b[40] ^= 0x10;  // inside the parameters (they start at byte 32)
    write_all(path, b);
    expect_format_error(path, "checksum");
  }
  SUBCASE("trailing bytes") {
    write_all(path, good + "x");
    expect_format_error(path, "trailing");
  }
  fs::remove(path);
  fs::remove(good_path);
}

TEST_CASE("a missing file is an io_error; a model of another shape is a config_error") {
  CHECK_THROWS_AS(tr::load_weights(temp_path("does_not_exist.fmlp")), ferry::io_error);
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
