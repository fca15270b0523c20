// ferry/train/progress.hpp: a per-epoch progress display: a redrawn bar on a terminal
// (samples/s, loss, ETA), plain log lines when the output is a file or a pipe.
//
//   ferry::train::progress_bar bar("epoch 3", 60000);      // stderr, mode auto
//   bar.update(samples_done, loss, rows);                   // a loss measured over `rows` rows
//   bar.advance(samples_done);                              // or: no new loss (async steps)
//   double epoch_loss = bar.mean_loss().value_or(0);        // what the final line shows
//   bar.finish();                                           // final line / newline
//
// Terminal: one line rewritten with '\r' at most 10 times a second. Not a terminal: a line
// at every 10% of the epoch, so logs stay short.
//
// Loss: the bar keeps the weighted mean of every loss update() was given, sum(loss * rows)
// / sum(rows), and shows it as "running mean loss" while the epoch runs and as "mean loss"
// on the final line. With every step (or every take_stats() total) given to update(), the
// final mean is the epoch's mean loss over its rows: a training loop prints mean_loss() as
// its epoch loss, so the two never disagree. Before the first update the line shows no loss
// at all. advance() moves the count, rate and ETA on between losses, e.g. every
// asynchronous step while the loss is read only now and then; the mean then covers the rows
// up to the last update, not up to the count.
//
// Writes only to its FILE*; throws nothing; use from one thread.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

namespace ferry::train {

// How a progress_bar draws: automatic picks terminal on a TTY and lines otherwise;
// terminal redraws one line in place; lines prints a line at every 10% of the epoch; off
// prints nothing.
enum class progress_mode { automatic, terminal, lines, off };

// A progress line for a training loop (see the file's top).
class progress_bar {
 public:
  using clock = std::chrono::steady_clock;  // what elapsed time and rates are measured with

  // `total` samples in the epoch, drawn to `out` (null: nothing) with the label in front.
  progress_bar(std::string label, std::uint64_t total, std::FILE* out = stderr,
               progress_mode mode = progress_mode::automatic)
      : label_(std::move(label)), total_(total), out_(out), start_(clock::now()), last_(start_) {
    if (mode == progress_mode::automatic)
      mode = (out_ && isatty(fileno(out_))) ? progress_mode::terminal : progress_mode::lines;
    mode_ = out_ ? mode : progress_mode::off;
  }
  progress_bar(const progress_bar&) = delete;
  progress_bar& operator=(const progress_bar&) = delete;
  ~progress_bar() {
    if (!finished_) finish();
  }

  // The mode in use (automatic resolved; off when out is null).
  progress_mode mode() const { return mode_; }

  // Adds `loss`, a mean over `weight` rows (a step's loss and rows, or a take_stats()
  // total's loss and weight), to the running mean and moves the count to `done`. A weight
  // <= 0 (no rows) adds nothing to the mean.
  void update(std::uint64_t done, double loss, double weight = 1.0) {
    if (weight > 0) {
      loss_sum_ += loss * weight;
      weight_ += weight;
    }
    advance(done);
  }

  // Progress without a new loss: the line shows the mean so far.
  void advance(std::uint64_t done) {
    done_ = done;
    const auto now = clock::now();
    if (mode_ == progress_mode::terminal) {
      if (now - last_ < std::chrono::milliseconds(100) && done < total_) return;
      last_ = now;
      draw(now, false);
    } else if (mode_ == progress_mode::lines && total_ > 0) {
      const std::uint64_t tenth = done * 10 / total_;
      if (tenth > printed_tenth_ && done < total_) {
        printed_tenth_ = tenth;
        draw(now, false);
      }
    }
  }

  // sum(loss * weight) / sum(weight) over every update(); nullopt before the first one
  // with rows.
  std::optional<double> mean_loss() const {
    if (weight_ > 0) return loss_sum_ / weight_;
    return std::nullopt;
  }

  // The final line, with mean_loss() (the epoch's mean when update() saw every step).
  void finish() {
    if (finished_) return;
    finished_ = true;
    if (mode_ == progress_mode::off) return;
    done_ = done_ < total_ ? done_ : total_;
    draw(clock::now(), true);
  }

 private:
  void draw(clock::time_point now, bool final_line) {
    const double secs = std::chrono::duration<double>(now - start_).count();
    const double rate = secs > 0 ? double(done_) / secs : 0.0;
    const double eta = rate > 0 ? double(total_ - (done_ < total_ ? done_ : total_)) / rate : 0.0;
    char line[256], loss[48] = "";
    if (const auto m = mean_loss())
      std::snprintf(loss, sizeof loss, mode_ == progress_mode::terminal ? "%s %.4f " : "%s %.4f, ",
                    final_line ? "mean loss" : "running mean loss", *m);
    if (mode_ == progress_mode::terminal) {
      constexpr int width = 24;
      const int fill = total_ ? int(double(done_) / double(total_) * width) : width;
      char bar[width + 1];
      for (int i = 0; i < width; ++i) bar[i] = i < fill ? '=' : (i == fill ? '>' : ' ');
      bar[width] = 0;
      int n = std::snprintf(line, sizeof line, "\r%s [%s] %llu/%llu %.0f samples/s %s%s %.0fs ",
                            label_.c_str(), bar, (unsigned long long)done_,
                            (unsigned long long)total_, rate, loss, final_line ? "took" : "ETA",
                            final_line ? secs : eta);
      n = n < int(sizeof line) ? n : int(sizeof line) - 1;
      // Blank what a longer earlier line left ("running mean loss" becomes "mean loss").
      std::fprintf(out_, "%s%*s", line, drawn_ > n ? drawn_ - n : 0, "");
      drawn_ = n;
      if (final_line) std::fputc('\n', out_);
    } else {
      std::snprintf(line, sizeof line, "%s: %llu/%llu samples, %.0f samples/s, %s%s %.0f s\n",
                    label_.c_str(), (unsigned long long)done_, (unsigned long long)total_, rate,
                    loss, final_line ? "took" : "ETA", final_line ? secs : eta);
      std::fputs(line, out_);
    }
    std::fflush(out_);
  }

  std::string label_;
  std::uint64_t total_;
  std::FILE* out_;
  progress_mode mode_ = progress_mode::off;
  clock::time_point start_, last_;
  std::uint64_t done_ = 0, printed_tenth_ = 0;
  double loss_sum_ = 0, weight_ = 0;
  int drawn_ = 0;  // the length of the last terminal line
  bool finished_ = false;
};

}  // namespace ferry::train
