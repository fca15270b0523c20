// ferry/train/progress.hpp: a per-epoch progress display: a redrawn bar on a terminal
// (samples/s, loss, ETA), plain log lines when the output is a file or a pipe.
//
//   ferry::train::progress_bar bar("epoch 3", 60000);      // stderr, mode auto
//   bar.update(samples_done, loss);                         // after each step
//   bar.advance(samples_done);                              // or: no new loss (async steps)
//   bar.finish(loss);                                       // final line (this loss) / newline
//
// Terminal: one line rewritten with '\r' at most 10 times a second. Not a terminal: a line
// at every 10% of the epoch, so logs stay short. Loss shown is an exponential moving
// average of what update() is given ("-" before the first), and on the final line the
// loss finish() is given (the epoch's). advance() moves the count, rate
// and ETA on between losses, e.g. every asynchronous step while the loss is read only now
// and then. Writes only to its FILE*; throws nothing; use from one thread.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace ferry::train {

enum class progress_mode { automatic, terminal, lines, off };

class progress_bar {
 public:
  using clock = std::chrono::steady_clock;

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
    if (!finished_) finish(ema_);
  }

  progress_mode mode() const { return mode_; }

  void update(std::uint64_t done, double loss) {
    ema_ = have_ ? 0.9 * ema_ + 0.1 * loss : loss;
    have_ = true;
    advance(done);
  }

  // Progress without a new loss: the line shows the last average.
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

  void finish(double loss) {
    if (finished_) return;
    finished_ = true;
    ema_ = loss;  // the final line shows the epoch's loss, not the running average
    have_ = true;
    if (mode_ == progress_mode::off) return;
    done_ = done_ < total_ ? done_ : total_;
    draw(clock::now(), true);
  }

 private:
  void draw(clock::time_point now, bool final_line) {
    const double secs = std::chrono::duration<double>(now - start_).count();
    const double rate = secs > 0 ? double(done_) / secs : 0.0;
    const double eta = rate > 0 ? double(total_ - (done_ < total_ ? done_ : total_)) / rate : 0.0;
    char line[256], loss[32] = "-";
    if (have_) std::snprintf(loss, sizeof loss, "%.4f", ema_);
    if (mode_ == progress_mode::terminal) {
      constexpr int width = 24;
      const int fill = total_ ? int(double(done_) / double(total_) * width) : width;
      char bar[width + 1];
      for (int i = 0; i < width; ++i) bar[i] = i < fill ? '=' : (i == fill ? '>' : ' ');
      bar[width] = 0;
      std::snprintf(line, sizeof line, "\r%s [%s] %llu/%llu %.0f samples/s loss %s %s %.0fs ",
                    label_.c_str(), bar, (unsigned long long)done_, (unsigned long long)total_,
                    rate, loss, final_line ? "took" : "ETA", final_line ? secs : eta);
      std::fputs(line, out_);
      if (final_line) std::fputc('\n', out_);
    } else {
      std::snprintf(line, sizeof line, "%s: %llu/%llu samples, %.0f samples/s, loss %s, %s %.0f s\n",
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
  double ema_ = 0;
  bool have_ = false, finished_ = false;
};

}  // namespace ferry::train
