// benchmarks/common/cat.hpp: `cat FILES > /dev/null`, the page-cache read limit the read
// benchmarks compare against.
#pragma once

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "common/timing.hpp"

namespace bench {

// One run of `argv[0] argv[1..] > /dev/null` (found on PATH), in seconds; -1 when it
// cannot be run or fails. posix_spawn, not system(): a fork would mark this process's
// pages copy-on-write, and the next ferry run would pay a page fault on each page of its
// (reused) read buffers.
inline double run_to_null(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  const double t0 = now();
  pid_t pid = 0;
  int status = 0;
  const bool ok = posix_spawnp(&pid, argv[0], &fa, nullptr, argv.data(), environ) == 0 &&
                  ::waitpid(pid, &status, 0) == pid && status == 0;
  const double t = now() - t0;
  posix_spawn_file_actions_destroy(&fa);
  return ok ? t : -1;
}

// One run of `cat FILES > /dev/null`, in seconds.
inline double cat_once(const std::vector<std::string>& files) {
  std::vector<std::string> args{"cat"};
  args.insert(args.end(), files.begin(), files.end());
  const double t = run_to_null(std::move(args));
  if (t < 0) std::fprintf(stderr, "cat failed\n");
  return t;
}

}  // namespace bench
