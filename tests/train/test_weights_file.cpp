// The weights file: round trip, and every damaged file is a clear error naming the file.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <zlib.h>

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
// The temporary files save_weights left beside `path` (its name + ".tmp" and more).
std::vector<std::string> temp_files(const std::string& path) {
  const fs::path p(path);
  const std::string prefix = p.filename().string() + ".tmp";
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(p.parent_path()))
    if (e.path().filename().string().rfind(prefix, 0) == 0) left.push_back(e.path().string());
  return left;
}
// A weights file as the format's top describes it, whatever its sizes (load's limits are
// not checked here: this writes what save_weights refuses).
std::string weights_bytes(const std::vector<std::uint32_t>& sizes, const std::vector<float>& params) {
  std::string out("FERRYMLP", 8);
  auto put = [&](const void* v, std::size_t n) { out.append(static_cast<const char*>(v), n); };
  const std::uint32_t version = 1, count = static_cast<std::uint32_t>(sizes.size());
  put(&version, 4);
  put(&count, 4);
  put(sizes.data(), 4 * sizes.size());
  const std::uint64_t P = params.size();
  put(&P, 8);
  put(params.data(), 4 * params.size());
  const auto crc = static_cast<std::uint32_t>(crc32_z(0L, reinterpret_cast<const Bytef*>(out.data()), out.size()));
  put(&crc, 4);
  return out;
}
std::size_t implied_params(const std::vector<int>& layers) {
  std::size_t n = 0;
  for (std::size_t i = 1; i < layers.size(); ++i) n += std::size_t(layers[i - 1]) * layers[i] + layers[i];
  return n;
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
  CHECK(temp_files(path).empty());
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

// One shared limit: a model save_weights writes is one load_weights reads, and a model past
// the format's limits is refused by save before anything is written (it would otherwise be
// lost at load), and by load when a file claims it.
TEST_CASE("save refuses, before writing, the models load refuses; at the limits they round-trip") {
  const std::string path = temp_path("limits.fmlp");
  const std::size_t max_sizes = tr::weights_max_sizes;
  const int max_layer = static_cast<int>(tr::weights_max_layer);
  REQUIRE(max_sizes == 4096);
  REQUIRE(max_layer == 1 << 24);
  // Past the limits: config_error naming the fault; `path` (an older checkpoint) untouched.
  const std::vector<int> small{2, 3};
  const auto p_small = tr::init_params(tr::mlp_layout(tr::mlp_config{small, {}}), 3);
  tr::save_weights(path, small, p_small);
  const std::string before = read_all(path);
  const std::vector<std::pair<std::vector<int>, std::string>> refused = {
      {std::vector<int>(max_sizes + 1, 1), "bad layer count 4097"},
      {{max_layer + 1, 1}, "bad layer size 16777217"},
      {{1, 2, max_layer + 1}, "bad layer size 16777217"},
  };
  for (const auto& [layers, what] : refused) {
    CAPTURE(what);
    // The right parameter count, so only the limit is at fault (the large one without its
    // 64 MiB of floats: the limit is checked first).
    std::vector<float> params(layers.size() > 3 ? implied_params(layers) : 0);
    CHECK_THROWS_WITH_AS(tr::save_weights(path, layers, params), doctest::Contains(what.c_str()), ferry::config_error);
    CHECK(read_all(path) == before);
    CHECK(temp_files(path).empty());
  }
  // At the limits: saved and loaded back, bit for bit.
  for (const auto& layers : {std::vector<int>(max_sizes, 1), std::vector<int>{max_layer, 1}}) {
    CAPTURE(layers.size());
    std::vector<float> params(implied_params(layers));
    for (std::size_t i = 0; i < params.size(); i += 4099) params[i] = float(i);
    tr::save_weights(path, layers, params);
    const auto w = tr::load_weights(path);
    CHECK(w.layers == layers);
    CHECK(w.params == params);
  }
  // The same limits at load, in files made by hand: format_error at the offending field.
  write_all(path, weights_bytes(std::vector<std::uint32_t>(max_sizes + 1, 1), std::vector<float>(2 * max_sizes)));
  expect_format_error(path, 12, "bad layer count 4097 (expected 2 .. 4096)");
  write_all(path, weights_bytes({1, std::uint32_t(max_layer) + 1}, std::vector<float>(2 * (std::size_t(max_layer) + 1))));
  expect_format_error(path, 20, "bad layer size 16777217 (expected 1 .. 16777216)");
  fs::remove(path);
  CHECK(temp_files(path).empty());
}

// Every MPI rank may call trainer.save(path): each save writes its own temporary file and
// renames it over path, so all succeed, the file is always one writer's whole file (a
// reader meanwhile never sees a half one), and no temporary file stays behind.
TEST_CASE("concurrent saves to one path all succeed; the file is one writer's whole file; no temporary "
          "file remains" * doctest::timeout(60)) {
  const std::string path = temp_path("shared.fmlp");
  const std::vector<int> layers{16, 32, 4};
  constexpr int writers = 6, rounds = 25;
  std::vector<std::vector<float>> params;
  for (int w = 0; w < writers; ++w)
    params.push_back(tr::init_params(tr::mlp_layout(tr::mlp_config{layers, {}}), std::uint64_t(w)));
  std::mutex m;
  std::vector<std::string> errors;
  int loads = 0, bad_loads = 0;
  std::atomic<bool> done{false};
  std::thread reader([&] {  // loads while the writers rename: whole files only
    while (!done.load()) {
      try {
        const auto w = tr::load_weights(path);
        bool known = false;
        for (const auto& p : params) known = known || w.params == p;
        std::lock_guard lk(m);
        ++loads;
        bad_loads += !known || w.layers != layers;
      } catch (const ferry::io_error&) {  // not there yet
      } catch (const std::exception& e) {
        std::lock_guard lk(m);
        errors.push_back(std::string("load: ") + e.what());
      }
    }
  });
  for (int round = 0; round < rounds; ++round) {
    std::vector<std::thread> ts;
    for (int w = 0; w < writers; ++w)
      ts.emplace_back([&, w] {
        try {
          tr::save_weights(path, layers, params[std::size_t(w)]);
        } catch (const std::exception& e) {
          std::lock_guard lk(m);
          errors.push_back(e.what());
        }
      });
    for (auto& t : ts) t.join();
  }
  done = true;
  reader.join();
  for (const auto& e : errors) MESSAGE(e);
  CHECK(errors.empty());
  CHECK(bad_loads == 0);
  const auto w = tr::load_weights(path);
  CHECK(w.layers == layers);
  CHECK(std::find(params.begin(), params.end(), w.params) != params.end());
  CHECK(temp_files(path).empty());
  fs::remove(path);
}

// A rename that fails (here: path is a directory) is an io_error naming path and saying
// what failed, and the temporary file it was renaming is removed.
TEST_CASE("a failed rename: io_error naming the path and the temporary file, which is removed") {
  const std::string path = temp_path("a_directory.fmlp");
  fs::create_directories(path + "/inside");  // not empty: no rename can replace it
  const std::vector<int> layers{3, 2};
  try {
    tr::save_weights(path, layers, tr::init_params(tr::mlp_layout(tr::mlp_config{layers, {}}), 1));
    FAIL("no error for a rename over a directory");
  } catch (const ferry::io_error& e) {
    const std::string msg = e.what();
    INFO(msg);
    CHECK(e.path() == path);
    CHECK(msg.rfind(path + ": cannot replace it with the new weights written to " + path + ".tmp.", 0) == 0);
    CHECK(msg.find(" to at ") == std::string::npos);
  }
  CHECK(temp_files(path).empty());
  CHECK(fs::is_directory(path + "/inside"));
  fs::remove_all(path);
}
