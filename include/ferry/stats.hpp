// ferry/stats.hpp: per-stage counters and the report that names the stage limiting
// throughput.
//
//   ferry::enable_stats();                        // or FERRY_STATS=1 in the environment
//   auto p = src | ferry::map(decode, {.workers = 4}) | ferry::batch(256) | ferry::prefetch(2);
//   for (auto& b : p) train(b);
//   std::cout << ferry::report(p);                // a table, then e.g.
//   // "map is the bottleneck: 93% busy; prefetch waited 71% of the time on upstream"
//
// Every stage counts elements and bytes out, the time it spends working (its own work,
// the time inside its upstream excluded, summed over its threads), and, for stages with
// their own threads (prefetch, a parallel map, interleave), the time the consumer waited
// for them (wait upstream) and the time their threads waited for the consumer to make
// room (wait downstream). Fractions are of the pipeline's wall time (first to last call
// of its last stage) times the stage's thread count. The stage with the largest busy
// fraction is the bottleneck; the consumer (your loop: time outside the pipeline's
// next()) competes too.
//
// Stats are off by default; off, each stage call costs one relaxed load and a branch.
// A plain source (from_range, from_generator, a user's own) is timed by the stage after
// it and reported as "source". report() may be called from any thread, while the pipeline
// runs. Throws nothing but std::bad_alloc.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <ostream>
#include <string>
#include <vector>

#include "ferry/observe/hooks.hpp"

namespace ferry {

// Turns the per-stage counters on or off, for every pipeline in the process.
inline void enable_stats(bool on = true) noexcept { observe::set_bit(observe::stats_bit, on); }
// Whether the counters are on (enable_stats, FERRY_STATS=1, or an open tracing session).
inline bool stats_enabled() noexcept { return observe::on(); }

// One stage's row of a pipeline_report.
struct stage_stats {
  std::size_t index = 0;     // position in the pipeline, 0 = the source
  std::string name;          // the stage's kind ("map", "batch", ...), "#index" added if repeated
  std::string kind;          // the stage's kind alone ("map", "source", ...)
  std::size_t threads = 1;   // threads doing the stage's work
  std::uint64_t elements = 0;  // elements handed downstream
  std::uint64_t bytes = 0;     // their payload bytes
  double busy_s = 0;             // own work, upstream excluded, summed over its threads
  double wait_upstream_s = 0;    // stages with threads: the consumer blocked in next(), nothing ready
  double wait_downstream_s = 0;  // stages with threads: their threads blocked on a full queue
  // As fractions: busy and wait_downstream of wall × threads, wait_upstream of wall.
  double busy = 0, wait_upstream = 0, wait_downstream = 0;
};

// What report(pipeline) returns: a row per stage, the consumer's share, and the
// bottleneck.
struct pipeline_report {
  std::vector<stage_stats> stages;  // pipeline order, source first
  double wall_s = 0;                // first to last call of the last stage
  double consumer_s = 0;            // time the consumer spent outside the pipeline's next()
  double consumer = 0;              // ... as a fraction of wall_s
  std::string bottleneck;           // a stage name, "consumer", or empty when nothing ran

  // "map is the bottleneck: 93% busy; prefetch waited 71% of the time on upstream"
  std::string summary() const {
    if (bottleneck.empty())
      return "no activity recorded: call ferry::enable_stats() (or set FERRY_STATS=1) before the first next()";
    std::string s;
    auto pct = [](double f) { return std::to_string(static_cast<int>(f * 100 + 0.5)) + "%"; };
    if (bottleneck == "consumer")
      s = "the consumer is the bottleneck: " + pct(consumer) + " of the time outside the pipeline's next()";
    else
      for (const stage_stats& st : stages)
        if (st.name == bottleneck) s = st.name + " is the bottleneck: " + pct(st.busy) + " busy";
    for (const stage_stats& st : stages) {
      // prefetch only moves upstream's elements: an empty queue means upstream is slower.
      // A stage with work of its own (map, interleave): its consumer waited for that work.
      if (st.wait_upstream >= 0.05)
        s += "; " + (st.kind == "prefetch" ? st.name + " waited " + pct(st.wait_upstream) + " of the time on upstream"
                                           : st.name + "'s consumer waited " + pct(st.wait_upstream) + " of the time for it");
      if (st.wait_downstream >= 0.05)
        s += "; " + st.name + " waited " + pct(st.wait_downstream) + " of the time on downstream";
    }
    return s;
  }

  // A fixed-width table: a row per stage (threads, elements, MB, elements/s, busy,
  // wait_up, wait_down), the consumer's row, and the wall time.
  std::string table() const {
    std::string out;
    char line[256];
    std::snprintf(line, sizeof line, "%-3s %-16s %7s %12s %10s %12s %6s %8s %9s\n", "#", "stage", "threads", "elements",
                  "MB", "elem/s", "busy", "wait_up", "wait_down");
    out += line;
    for (const stage_stats& s : stages) {
      std::snprintf(line, sizeof line, "%-3zu %-16s %7zu %12llu %10.2f %12.4g %5.1f%% %7.1f%% %8.1f%%\n", s.index,
                    s.name.c_str(), s.threads, static_cast<unsigned long long>(s.elements), double(s.bytes) / 1e6,
                    wall_s > 0 ? double(s.elements) / wall_s : 0.0, 100 * s.busy, 100 * s.wait_upstream,
                    100 * s.wait_downstream);
      out += line;
    }
    std::snprintf(line, sizeof line, "%-3s %-16s %7s %12s %10s %12s %5.1f%%\n", "", "(consumer)", "1", "", "", "",
                  100 * consumer);
    out += line;
    std::snprintf(line, sizeof line, "wall %.3f s\n", wall_s);
    out += line;
    return out;
  }

  // table(), then summary() on its own line.
  friend std::ostream& operator<<(std::ostream& os, const pipeline_report& r) {
    return os << r.table() << r.summary() << '\n';
  }
};

namespace observe {
// The arithmetic of report(), on raw counters (exposed for tests).
inline pipeline_report make_report(const std::vector<raw_stage>& raw) {
  pipeline_report r;
  if (raw.empty()) return r;
  const double k = ns_per_tick() * 1e-9;
  const raw_stage& last = raw.back();
  const double wall = last.last > last.first ? double(last.last - last.first) * k : 0.0;
  r.wall_s = wall;
  for (std::size_t i = 0; i < raw.size(); ++i) {
    const raw_stage& s = raw[i];
    stage_stats st;
    st.index = i;
    st.kind = s.kind;
    st.name = s.kind;
    if (std::count_if(raw.begin(), raw.end(), [&](const raw_stage& o) { return std::string(o.kind) == s.kind; }) > 1)
      st.name += '#' + std::to_string(i);  // not "#" + ...: GCC 12 warns falsely (-Wrestrict)
    st.threads = s.threads;
    st.elements = s.elements;
    st.bytes = s.bytes;
    double self = 0;
    switch (s.mode) {
      case stage_mode::source_stage: self = double(s.incl); break;
      case stage_mode::inline_stage:
        self = double(s.incl) - (s.joined ? double(s.upstreams_incl) : i > 0 ? double(raw[i - 1].incl) : 0.0);
        break;
      case stage_mode::threaded_stage: self = double(s.incl) - double(s.wait_up) + double(s.work); break;
    }
    st.busy_s = std::max(self, 0.0) * k;
    st.wait_upstream_s = double(s.wait_up) * k;
    st.wait_downstream_s = double(s.wait_down) * k;
    if (wall > 0) {
      const double cap = wall * double(s.threads);
      st.busy = std::min(st.busy_s / cap, 1.0);
      // The consumer side is one thread; the worker side has `threads`.
      st.wait_upstream = std::min(st.wait_upstream_s / wall, 1.0);
      st.wait_downstream = std::min(st.wait_downstream_s / cap, 1.0);
    }
    r.stages.push_back(std::move(st));
  }
  if (wall <= 0) return r;
  r.consumer_s = std::max(wall - double(last.incl) * k, 0.0);
  r.consumer = std::min(r.consumer_s / wall, 1.0);
  double best = r.consumer;
  r.bottleneck = "consumer";
  for (const stage_stats& st : r.stages)
    if (st.busy > best) {
      best = st.busy;
      r.bottleneck = st.name;
    }
  return r;
}
}  // namespace observe

// The counters of every stage of `p`, as a report. Any thread, any time.
template <observe::observable P>
pipeline_report report(const P& p) {
  observe::stage_visitor v;
  p.visit_stages(v);
  return observe::make_report(v.stages());
}

// Zeroes the counters of every stage of `p` (e.g. after a warm-up epoch). Call it while
// no thread of `p` runs a stage (before next(), or after the epoch ended).
template <observe::observable P>
void reset_stats(const P& p) {
  observe::stage_visitor v(/*reset=*/true);
  p.visit_stages(v);
}

}  // namespace ferry
