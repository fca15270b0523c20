// progress_bar: log lines when not a terminal (one per 10%), a redrawn bar in terminal
// mode, nothing when off; its loss is the running mean of what it was given, which on the
// final line is the epoch's mean.
#include <doctest/doctest.h>

#include <cstdint>
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
    bar.finish();
  }
  const std::string s = contents(f);
  CHECK(count(s, "\n") == 10);  // 9 at 10%..90% and the final line
  CHECK(count(s, "\r") == 0);
  CHECK(s.find("epoch 1: 1000/1000 samples") != std::string::npos);
  CHECK(count(s, "running mean loss 0.5000,") == 9);
  CHECK(count(s, ", mean loss 0.5000, took") == 1);
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
    bar.finish();
  }
  CHECK(contents(f).empty());
  std::fclose(f);
}

TEST_CASE("no loss is shown before the first update; then the running mean, and the final line's mean") {
  std::FILE* f = std::tmpfile();
  REQUIRE(f);
  {
    ferry::train::progress_bar bar("epoch 3", 1000, f);  // lines
    for (int i = 1; i <= 250; ++i) bar.advance(i);    // 10%, 20%: no loss yet
    CHECK_FALSE(bar.mean_loss().has_value());
    bar.update(250, 0.25, 250);
    for (int i = 251; i <= 1000; ++i) bar.advance(i);  // 30%..90%: the mean so far
    bar.update(1000, 0.75, 750);                       // the rest of the epoch's rows
    bar.finish();                                      // the final line: the epoch's mean
  }
  const std::string s = contents(f);
  CHECK(count(s, "\n") == 10);
  CHECK(count(s, "loss -") == 0);
  CHECK(count(s, "loss") == 8);  // not on the two lines before the first update
  CHECK(count(s, "running mean loss 0.2500,") == 7);
  CHECK(count(s, "epoch 3: 1000/1000 samples, ") == 1);
  CHECK(count(s, ", mean loss 0.6250, took") == 1);  // (0.25 * 250 + 0.75 * 750) / 1000
  std::fclose(f);
}

TEST_CASE("the last running mean is the epoch mean when the bar sees every step") {
  // Steps of unequal rows and losses, as a loop with a short last batch gives them; the
  // loop's epoch loss is sum(loss * rows) / sum(rows), the epoch line's number.
  const int rows[] = {128, 128, 128, 37};
  const double loss[] = {2.3025, 1.1, 0.71, 0.4603};
  double sum = 0, weight = 0;
  std::FILE* f = std::tmpfile();
  REQUIRE(f);
  ferry::train::progress_bar bar("epoch 1", 421, f, ferry::train::progress_mode::terminal);
  std::uint64_t done = 0;
  for (int k = 0; k < 4; ++k) {
    done += std::uint64_t(rows[k]);
    bar.update(done, loss[k], rows[k]);
    sum += loss[k] * rows[k];
    weight += rows[k];
  }
  REQUIRE(bar.mean_loss().has_value());
  CHECK(*bar.mean_loss() == sum / weight);  // bit for bit: the same sums in the same order
  bar.finish();
  char epoch_line[64];
  std::snprintf(epoch_line, sizeof epoch_line, "mean loss %.4f took", sum / weight);
  const std::string s = contents(f);
  CHECK(s.find(epoch_line) != std::string::npos);
  CHECK(s.rfind("running mean loss") < s.rfind(epoch_line));  // the final line says mean
  std::fclose(f);
}

TEST_CASE("a terminal line is blanked past its end when it gets shorter") {
  std::FILE* f = std::tmpfile();
  REQUIRE(f);
  {
    ferry::train::progress_bar bar("e", 2, f, ferry::train::progress_mode::terminal);
    bar.update(2, 1.0);  // drawn at once: done == total
    bar.finish();        // "mean loss", 8 characters shorter than "running mean loss"
  }
  const std::string s = contents(f);
  REQUIRE(count(s, "\r") == 2);
  const std::size_t second = s.find('\r', 1);
  const std::string first_line = s.substr(1, second - 1);
  const std::string final_line = s.substr(second + 1, s.size() - second - 2);  // no "\n"
  CHECK(first_line.find("running mean loss 1.0000") != std::string::npos);
  CHECK(final_line.find("running") == std::string::npos);
  CHECK(final_line.size() >= first_line.size());  // blanks cover the rest of the old line
  CHECK(s.find("mean loss 1.0000") != std::string::npos);
  std::fclose(f);
}
