// ferry/trace.hpp: a Chrome trace (JSON) of every stage's activity, per thread: open it
// in Perfetto (ui.perfetto.dev) or chrome://tracing.
//
//   {
//     ferry::tracing session("pipeline.trace.json");   // or ferry::trace_to(path)
//     for (auto& b : pipeline) train(b);
//   }                                                   // written here
//
// While a session is open, each stage call becomes one complete event ("map", "batch",
// ...; nested calls of inline stages nest on their thread) and each blocking wait one
// event ("prefetch: wait upstream", "map: wait downstream", "map: fn" for a parallel
// map's function). Threads carry their role as name ("ferry prefetch", "ferry map worker").
// Events go into a fixed buffer of `capacity` events (32 bytes each) filled lock-free;
// once it is full, further events are counted as dropped and the file stays valid JSON
// ("otherData": {"dropped_events": n, "session_us": the session's length}). Events
// begun before the session (stats were on) are cut at its start. Stats (ferry/stats.hpp) are collected meanwhile.
//
// One session at a time per process: opening a second is a config_error. stop() (or the
// destructor) waits for events being recorded, then writes the file; stop() throws
// io_error when the file cannot be written, the destructor prints the error to stderr
// instead. With no session open tracing costs one relaxed load and a branch per stage call.
#pragma once

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <charconv>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>

#include "ferry/error.hpp"
#include "ferry/observe/hooks.hpp"

namespace ferry {

// A tracing session's options, a braced list: tracing(path, {.capacity = n}).
struct tracing_options {
  std::size_t capacity = std::size_t(1) << 20;  // events kept (32 MiB at 32 bytes each)
};

// A tracing session: open while the object lives (see the file's top); one per process.
class tracing {
 public:
  // Opens the session; the file is written to path when it stops. Throws config_error
  // when another session is open.
  explicit tracing(std::string path, tracing_options o = {}) : path_(std::move(path)) {
    auto b = std::make_unique<observe::trace_buffer>();
    b->events.resize(o.capacity);
    b->generation = generation().fetch_add(1, std::memory_order_relaxed) + 1;
    observe::trace_buffer* expected = nullptr;
    if (!observe::detail::trace_buf.compare_exchange_strong(expected, b.get(), std::memory_order_seq_cst))
      throw config_error("tracing: a tracing session is already open (one at a time per process)");
    start_ = observe::now();
    buf_ = std::move(b);
    observe::set_bit(observe::trace_bit, true);
  }
  tracing(const tracing&) = delete;
  tracing& operator=(const tracing&) = delete;
  ~tracing() {
    try {
      stop();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ferry::tracing: %s\n", e.what());
    }
  }

  // Ends the session and writes the file (once; later calls do nothing).
  // Throws io_error when the file cannot be written.
  void stop() {
    if (!buf_) return;
    observe::set_bit(observe::trace_bit, false);
    observe::detail::trace_buf.store(nullptr, std::memory_order_seq_cst);
    // A writer that saw the buffer is inside record() for a few instructions.
    while (observe::detail::trace_writers.load(std::memory_order_seq_cst) != 0) std::this_thread::yield();
    std::unique_ptr<observe::trace_buffer> b = std::move(buf_);
    recorded_ = std::min(b->next.load(), b->events.size());
    dropped_ = b->dropped.load();
    end_ = observe::now();  // every event kept ended before this
    write(*b);
  }

  // Events kept and events dropped (final after stop()).
  std::size_t recorded() const noexcept {
    return buf_ ? std::min(buf_->next.load(std::memory_order_relaxed), buf_->events.size()) : recorded_;
  }
  // Events that found no room (past capacity).
  std::uint64_t dropped() const noexcept { return buf_ ? buf_->dropped.load(std::memory_order_relaxed) : dropped_; }
  // The trace file's path.
  const std::string& path() const noexcept { return path_; }

 private:
  static std::atomic<std::uint64_t>& generation() {
    static std::atomic<std::uint64_t> g{0};
    return g;
  }

  static void escape(std::string& out, std::string_view s) {
    for (char ch : s) {
      const unsigned char c = static_cast<unsigned char>(ch);
      if (c == '"' || c == '\\') {
        out += '\\';
        out += ch;
      } else if (c < 0x20) {
        char u[8];
        std::snprintf(u, sizeof u, "\\u%04x", c);
        out += u;
      } else {
        out += ch;
      }
    }
  }

  // v with 3 decimals, whatever the C locale (snprintf's %f writes "16,765" under de_DE,
  // which no JSON reader takes).
  static void fixed3(std::string& out, double v) {
    char buf[64];
    const auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::fixed, 3);
    out.append(buf, r.ptr);
  }

  void write(const observe::trace_buffer& b) const {
    const double ns = observe::ns_per_tick();
    std::string out;
    out.reserve(64 + recorded_ * 96);
    out += "{\"displayTimeUnit\":\"ns\",\"otherData\":{\"recorded_events\":" + std::to_string(recorded_) +
           ",\"dropped_events\":" + std::to_string(dropped_) + ",\"session_us\":";
    fixed3(out, end_ > start_ ? double(end_ - start_) * ns / 1e3 : 0.0);
    out += "},\n\"traceEvents\":[\n";
    bool first = true;
    auto sep = [&] {
      if (!first) out += ",\n";
      first = false;
    };
    for (const auto& [tid, name] : b.thread_names) {
      sep();
      out += "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":1,\"tid\":" + std::to_string(tid) + ",\"args\":{\"name\":\"";
      escape(out, name);
      out += "\"}}";
    }
    for (std::size_t i = 0; i < recorded_; ++i) {
      const observe::trace_event& e = b.events[i];
      // An event begun before the session is cut at its start, so it still ends when it
      // ended and nests with the thread's later events.
      const observe::ticks t0 = e.t0 > start_ ? e.t0 : start_;
      const double ts = double(t0 - start_) * ns / 1e3;
      const double dur = e.t1 > t0 ? double(e.t1 - t0) * ns / 1e3 : 0.0;
      sep();
      out += "{\"name\":\"";
      escape(out, e.name ? e.name : "");
      if (e.threw) out += " (threw)";
      out += "\",\"cat\":\"ferry\",\"ph\":\"X\",\"pid\":1,\"tid\":" + std::to_string(e.tid) + ",\"ts\":";
      fixed3(out, ts);
      out += ",\"dur\":";
      fixed3(out, dur);
      out += "}";
    }
    out += "\n]}\n";
    std::FILE* f = std::fopen(path_.c_str(), "wb");
    if (!f) throw io_error(path_, 0, std::error_code(errno, std::generic_category()), "cannot open the trace file");
    const bool ok = std::fwrite(out.data(), 1, out.size(), f) == out.size();
    const int err = errno;
    if (std::fclose(f) != 0 || !ok)
      throw io_error(path_, 0, std::error_code(ok ? errno : err, std::generic_category()), "cannot write the trace file");
  }

  std::string path_;
  std::unique_ptr<observe::trace_buffer> buf_;
  observe::ticks start_ = 0, end_ = 0;
  std::size_t recorded_ = 0;
  std::uint64_t dropped_ = 0;
};

// Opens a tracing session writing to `path` when it ends (see tracing).
[[nodiscard]] inline std::unique_ptr<tracing> trace_to(std::string path, tracing_options o = {}) {
  return std::make_unique<tracing>(std::move(path), o);
}

}  // namespace ferry
