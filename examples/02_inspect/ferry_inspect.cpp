// ferry-inspect: reads files through a ferry pipeline (from_files | batch) and prints what
// it read, so a dataset can be validated before a long run:
//
//   files: <number of files>
//   records: <number of records>
//   bytes: <total payload bytes>
//   fnv1a64: <FNV-1a 64 over all payloads, concatenated in read order>
//
// Usage: ferry-inspect --format tfrecord|npy|idx|fixed:<bytes>[:<header>[:<footer>]]|lines
//                      [--shard i/n] [--no-verify] [--on-error skip] [--no-digest] FILE...
// A bad file: "error: <file>: <what> at offset <n>" on stderr and exit status 1. With
// --on-error skip each bad record gets that line, reading goes on and "skipped: <n>" is
// printed last (exit status 0). Bad arguments: a message and exit status 2.
#include <CLI/CLI.hpp>

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "ferry/sources/from_files.hpp"
#include "ferry/stages/batch.hpp"

namespace {

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "ferry-inspect: %s\n"
               "usage: ferry-inspect --format tfrecord|npy|idx|fixed:<bytes>[:<header>[:<footer>]]|lines\n"
               "                     [--shard i/n] [--no-verify] [--on-error skip] [--no-digest] FILE...\n",
               why.c_str());
  std::exit(2);
}

bool parse_u64(const std::string& s, std::uint64_t& v) {
  if (s.empty() || s.size() > 19) return false;
  v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + std::uint64_t(c - '0');
  }
  return true;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out(1);
  for (char c : s) {
    if (c == sep) out.emplace_back();
    else out.back() += c;
  }
  return out;
}

void print_error(const ferry::error& e) {
  const ferry::skipped_record d = ferry::detail::describe(e);
  if (d.path.empty()) std::fprintf(stderr, "error: %s\n", e.what());
  else std::fprintf(stderr, "error: %s\n", d.message().c_str());
}

}  // namespace

int main(int argc, char** argv) {
  std::string format, on_error = "throw", shard;
  bool no_verify = false, no_digest = false;
  std::vector<std::string> files;
  CLI::App app("Reads files through a ferry pipeline and prints what it read.", "ferry-inspect");
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // the last one counts
  app.add_option("--format", format, "tfrecord|npy|idx|fixed:<bytes>[:<header>[:<footer>]]|lines");
  app.add_option("--shard", shard, "i/n: keep the files at positions j with j mod n == i");
  app.add_flag("--no-verify", no_verify, "tfrecord: no CRC check");
  app.add_option("--on-error", on_error, "skip: report bad records and read on")
      ->check(CLI::IsMember({"skip", "throw"}));
  app.add_flag("--no-digest", no_digest, "print fnv1a64: -");
  app.add_option("FILE", files, "the files, in order")->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    usage(e.what());
  }
  const bool verify = !no_verify, digest = !no_digest, skip = on_error == "skip", sharded = !shard.empty();
  std::uint64_t shard_i = 0, shard_n = 1;
  if (sharded) {
    const auto parts = split(shard, '/');
    if (parts.size() != 2 || !parse_u64(parts[0], shard_i) || !parse_u64(parts[1], shard_n) || shard_n == 0 ||
        shard_i >= shard_n)
      usage("--shard takes i/n with 0 <= i < n");
  }
  if (format.empty()) usage("--format is required");
  if (files.empty()) usage("no FILE given");

  ferry::file_format fmt;
  if (format == "tfrecord") fmt = ferry::tfrecord{.verify_crc = verify};
  else if (format == "npy") fmt = ferry::npy{};
  else if (format == "idx") fmt = ferry::idx{};
  else if (format == "lines") fmt = ferry::text_lines{};
  else if (format.rfind("fixed:", 0) == 0) {
    const auto parts = split(format.substr(6), ':');
    std::uint64_t v[3] = {0, 0, 0};
    if (parts.size() > 3) usage("--format fixed:<bytes>[:<header>[:<footer>]]");
    for (std::size_t i = 0; i < parts.size(); ++i)
      if (!parse_u64(parts[i], v[i])) usage("--format fixed:<bytes>[:<header>[:<footer>]]: bad number '" + parts[i] + "'");
    if (v[0] == 0) usage("--format fixed:<bytes> needs bytes >= 1");
    fmt = ferry::fixed_length{.record_bytes = v[0], .header_bytes = v[1], .footer_bytes = v[2]};
  } else {
    usage("unknown format '" + format + "'");
  }

  // tf.data's rule on the list as given: keep position j when j mod n == i.
  if (sharded) {
    std::vector<std::string> keep;
    for (std::size_t j = 0; j < files.size(); ++j)
      if (j % shard_n == shard_i) keep.push_back(files[j]);
    files.swap(keep);
  }

  ferry::from_files_options opt;
  opt.on_error = skip ? ferry::error_policy::skip : ferry::error_policy::raise;
  opt.on_skip = [](const ferry::skipped_record& s) { std::fprintf(stderr, "error: %s\n", s.message().c_str()); };

  std::uint64_t records = 0, bytes = 0, h = 0xcbf29ce484222325ull, skipped = 0;
  try {
    auto src = ferry::from_files(files, fmt, opt);
    const std::size_t nfiles = src.files().size();
    auto batches = std::move(src) | ferry::batch(1024);
    while (auto b = batches.next()) {
      records += b->size();
      const std::span<const std::byte> payload = b->field_bytes(0);
      bytes += payload.size();
      if (digest)
        for (std::byte c : payload) h = (h ^ std::to_integer<std::uint64_t>(c)) * 0x100000001b3ull;
    }
    skipped = batches.upstream().skipped();
    std::printf("files: %zu\nrecords: %" PRIu64 "\nbytes: %" PRIu64 "\n", nfiles, records, bytes);
    if (digest) std::printf("fnv1a64: %016" PRIx64 "\n", h);
    else std::printf("fnv1a64: -\n");
    if (skip) std::printf("skipped: %" PRIu64 "\n", skipped);
  } catch (const ferry::config_error& e) {
    usage(e.what());
  } catch (const ferry::error& e) {
    print_error(e);
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
