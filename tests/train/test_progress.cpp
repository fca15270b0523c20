// progress_bar: log lines when not a terminal (one per 10%), a redrawn bar in terminal
// mode, nothing when off.
#include <doctest/doctest.h>

#include <cstdio>
#include <string>

#include "ferry/train/progress.hpp"

namespace {
std::string contents(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string s;
  char buf[512];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
  return s;
}
int count(const std::string& s, const std::string& what) {
  int c = 0;
  for (std::size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++c;
  return c;
}
}  // namespace

TEST_CASE("a file gets plain log lines, about one per 10% of the epoch") {
  std::FILE* f = std::tmpfile();
  REQUIRE(f);
  {
    ferry::train::progress_bar bar("epoch 1", 1000, f);  // a file: automatic -> lines
    CHECK(bar.mode() == ferry::train::progress_mode::lines);
    for (int i = 1; i <= 1000; ++i) bar.update(i, 0.5);
    bar.finish(0.5);
  }
  const std::string s = contents(f);
  CHECK(count(s, "\n") == 10);  // 9 at 10%..90% and the final line
  CHECK(count(s, "\r") == 0);
  CHECK(s.find("epoch 1: 1000/1000 samples") != std::string::npos);
  CHECK(s.find("loss 0.5000") != std::string::npos);
  CHECK(s.find("samples/s") != std::string::npos);
  CHECK(s.find("ETA") != std::string::npos);
  std::fclose(f);
}

TEST_CASE("terminal mode redraws one line with a bar, ETA and rate") {
  std::FILE* f = std::tmpfile();
  REQUIRE(f);
  {
    ferry::train::progress_bar bar("epoch 2", 10, f, ferry::train::progress_mode::terminal);
    for (int i = 1; i <= 10; ++i) bar.update(i, 1.0);
  }  // the destructor finishes the line
  const std::string s = contents(f);
  CHECK(count(s, "\n") == 1);
  CHECK(count(s, "\r") >= 2);
  CHECK(s.find("[========================]") != std::string::npos);
  CHECK(s.find("10/10") != std::string::npos);
  std::fclose(f);
}

TEST_CASE("off writes nothing") {
  std::FILE* f = std::tmpfile();
  REQUIRE(f);
  {
    ferry::train::progress_bar bar("x", 10, f, ferry::train::progress_mode::off);
    bar.update(5, 1.0);
    bar.finish(1.0);
  }
  CHECK(contents(f).empty());
  std::fclose(f);
}

TEST_CASE("advance moves the count on without a loss: '-' until the first, then the last one given") {
  std::FILE* f = std::tmpfile();
  REQUIRE(f);
  {
    ferry::train::progress_bar bar("epoch 3", 1000, f);  // lines
    for (int i = 1; i <= 250; ++i) bar.advance(i);    // 10%, 20%: no loss yet
    bar.update(250, 0.25);
    for (int i = 251; i <= 1000; ++i) bar.advance(i);  // 30%..90%: the last loss given
    bar.finish(0.75);                                  // the final line: the epoch's loss
  }
  const std::string s = contents(f);
  CHECK(count(s, "\n") == 10);
  CHECK(count(s, "loss -,") == 2);
  CHECK(count(s, "loss 0.2500") == 7);
  CHECK(count(s, "loss 0.7500") == 1);
  CHECK(s.find("epoch 3: 1000/1000 samples") != std::string::npos);
  std::fclose(f);
}
