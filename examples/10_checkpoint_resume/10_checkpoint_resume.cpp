// 10_checkpoint_resume: stop a job mid-epoch and resume it in a new process, on exactly
// the batches it would have had next.
//
//   from_files(FILE..., fixed_length) | shard(world, rank) | shuffle | map(decode)
//   | batch | distribute(host_replicas{2})
//
//   10_checkpoint_resume --make-files /tmp/d --save-after 5 --state /tmp/ck   # run, save at step 5
//   10_checkpoint_resume /tmp/d/part-*.bin --resume /tmp/ck                    # new process: step 6 on
//
// Reads the user's files (fixed-length records of --record-bytes), or writes four example
// files into the --make-files directory first. ferry::save_state is tens of words of
// positions and seeds, never buffered data; a job writes them beside its own counters (here
// the epoch) and its model. Prints one line per step,
//   epoch <e> step <i> rows <n> checksum <FNV-1a 64 of the step's samples, replicas in order>
// (i counts from 1 in each epoch)
// so a resumed run's lines can be compared with the uninterrupted run's
// (test_resume.py). Exit status 1 with a message on bad arguments, unreadable files, or a
// state file that is damaged or from another pipeline.
#include <CLI/CLI.hpp>

#include <cinttypes>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "ferry/ferry.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/state.hpp"

namespace {

struct sample {
  std::uint64_t hash;  // FNV-1a 64 of the record
  double mean;         // its mean byte: stands in for decoded features
};
static_assert(sizeof(sample) == 16, "no padding: a batch's bytes are its values");

std::uint64_t fnv1a(const std::byte* p, std::size_t n, std::uint64_t h = 0xcbf29ce484222325ull) {
  for (std::size_t i = 0; i < n; ++i) h = (h ^ std::to_integer<std::uint64_t>(p[i])) * 0x100000001b3ull;
  return h;
}

sample decode(const ferry::record& r) {
  double sum = 0;
  for (std::byte b : r.bytes()) sum += std::to_integer<int>(b);
  return {fnv1a(r.data(), r.size()), r.size() ? sum / double(r.size()) : 0.0};
}

// Four files of 300 records, each record's bytes from (file, record): the same every time.
std::vector<std::string> make_files(const std::string& dir, std::size_t record_bytes) {
  std::filesystem::create_directories(dir);
  std::vector<std::string> paths;
  for (int f = 0; f < 4; ++f) {
    paths.push_back(dir + "/part-" + std::to_string(f) + ".bin");
    std::ofstream out(paths.back(), std::ios::binary | std::ios::trunc);
    for (std::uint64_t j = 0; j < 300; ++j) {
      std::uint64_t x = std::uint64_t(f) << 32 | j;
      for (std::size_t k = 0; k < record_bytes; ++k) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        out.put(char(x >> 56));
      }
    }
    if (!out) throw std::runtime_error("cannot write " + paths.back());
  }
  return paths;
}

// The checkpoint file: "epoch <e>\n", then pipeline_state::to_bytes() (which checks itself).
void write_checkpoint(const std::string& path, int epoch, const ferry::pipeline_state& st) {
  const std::string tmp = path + ".tmp";  // renamed when complete: no half-written checkpoint
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << "epoch " << epoch << "\n" << st.to_bytes();
    if (!out.flush()) throw std::runtime_error("cannot write " + tmp);
  }
  std::filesystem::rename(tmp, path);
}

ferry::pipeline_state read_checkpoint(const std::string& path, int& epoch) {
  std::ifstream in(path, std::ios::binary);
  std::string line;
  if (!in || !std::getline(in, line) || std::sscanf(line.c_str(), "epoch %d", &epoch) != 1)
    throw ferry::config_error(path + ": not a checkpoint of this program");
  const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  return ferry::pipeline_state::from_bytes(bytes);  // config_error when cut short or damaged
}

}  // namespace

int main(int argc, char** argv) try {
  std::vector<std::string> files;
  std::string make_dir, state_path, resume_path;
  std::size_t record_bytes = 16, batch = 32, world = 1, rank = 0, save_after = 0;
  std::uint64_t seed = 1;
  int epochs = 2;
  CLI::App app("Saves a pipeline's position mid-epoch and resumes it in a new process.",
               "10_checkpoint_resume");
  app.add_option("FILE", files, "files of fixed-length records");
  app.add_option("--make-files", make_dir, "write four example files into DIR and read them too");
  app.add_option("--record-bytes", record_bytes)->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--batch", batch, "the global batch")->check(CLI::Range(2, 1 << 20))->capture_default_str();
  app.add_option("--epochs", epochs)->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--seed", seed, "the shuffle's")->capture_default_str();
  app.add_option("--world", world, "shards (by file)")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--rank", rank, "this one's shard")->check(CLI::Range(0, 1 << 20))->capture_default_str();
  auto* state = app.add_option("--state", state_path, "where --save-after writes the checkpoint");
  app.add_option("--save-after", save_after, "save after the N-th step this process runs")
      ->check(CLI::Range(1, 1 << 30))->needs(state);
  app.add_option("--resume", resume_path, "resume from a checkpoint written with --save-after");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 1;  // --help: 0; else the message and 1
  }
  if (!make_dir.empty()) {
    const auto made = make_files(make_dir, record_bytes);
    files.insert(files.begin(), made.begin(), made.end());
  }
  if (files.empty()) throw ferry::config_error("no FILE and no --make-files DIR (see --help)");

  auto steps = ferry::from_files(files, ferry::fixed_length{.record_bytes = record_bytes})
             | ferry::shard(world, rank)                          // this rank's files
             | ferry::shuffle(256, seed)                          // a new order every epoch
             | ferry::map(decode, {.workers = 2})                 // in order: checkpointable
             | ferry::batch(batch)
             | ferry::distribute(ferry::host_replicas{2});       // one slice per replica
  int first_epoch = 1;
  if (!resume_path.empty()) {
    // A fresh pipeline of the same shape, before its first step: it goes on after the step
    // the saving run had handed out last (a shape or shard that differs is a config_error).
    ferry::restore_state(steps, read_checkpoint(resume_path, first_epoch));
    std::fprintf(stderr, "resumed from %s in epoch %d\n", resume_path.c_str(), first_epoch);
  }
  std::size_t ran = 0;
  for (int e = first_epoch; e <= epochs; ++e) {
    for (auto& step : steps) {
      std::uint64_t h = 0xcbf29ce484222325ull;
      std::size_t rows = 0;
      for (std::size_t r = 0; r < step.replicas(); ++r) {
        const auto x = step[r].field<0>();  // rows past valid() are not data
        h = fnv1a(reinterpret_cast<const std::byte*>(x.data()), step[r].valid() * sizeof(sample), h);
        rows += step[r].valid();
      }
      // index(): the step's place in its epoch, restored with the state; printed from 1.
      std::printf("epoch %d step %" PRIu64 " rows %zu checksum %016" PRIx64 "\n", e, step.index() + 1, rows, h);
      if (++ran == save_after) {
        const ferry::pipeline_state st = ferry::save_state(steps);  // between two steps
        write_checkpoint(state_path, e, st);
        std::fprintf(stderr, "saved the position after this step (%zu words) to %s\n", st.words.size(),
                     state_path.c_str());
      }
    }
    steps.rewind();
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "10_checkpoint_resume: %s\n", e.what());
  return 1;
}
