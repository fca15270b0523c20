// ferry/stages/detail/map_autotune.hpp: map's autotuner (workers = ferry::autotune): a
// pure decision per measured period (autotune_state, tested apart from the clock) and the
// period bookkeeping (map_tuner) that map's consumer side feeds. Runs on the consumer's
// thread, inside map's next(); throws nothing.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>

namespace ferry::detail {

// The autotuner's decision, one call per period: a pure function of what the period
// measured, so it is tested apart from the clock. Hill-climbing on the rate the workers
// produce, both ways, where a worker "pays" if it adds a quarter of what one more worker
// could (1/a of the rate at a workers; a quarter, because a VM's rates swing), and at
// least 3% (so noise cannot keep adding workers when each adds little):
// - down: every 16 steady periods, whatever else happens, park one; keep it parked unless
//   it paid, else bring it back and wait twice as long (up to 512) before the next test;
// - up: while the consumer waits for the map, add a worker; keep it if it pays; else park
//   it again and wait twice as many periods (up to 64) before the next try;
// - shed: the consumer hardly waits and the workers mostly wait for room: park one.
// The period after every change settles and is not judged. Rates are compared as means
// of two periods: the two before a change (one, for a new tuner) against the two after.
struct autotune_sample {
  double rate = 0;           // elements the workers produced per second
  double consumer_wait = 0;  // fraction of the period the consumer waited for elements
  double worker_wait = 0;    // fraction of the active workers' time spent waiting for room
};
struct autotune_state {
  static constexpr unsigned max_backoff = 64, first_down = 16, max_down = 512, judge_periods = 2;
  static constexpr double share = 0.25, floor = 0.03;
  enum class phase : unsigned char { steady, judge_up, judge_down };
  phase ph = phase::steady;
  unsigned settle = 1;         // periods still to discard (a new tuner: thread start-up)
  double last_rate = 0;        // the last steady period's rate at this count (0: none yet)
  double base_rate = 0;        // the mean rate before the change being judged
  double judged_sum = 0;       // rates of the periods judged so far
  unsigned judged = 0;
  std::size_t from = 0;        // the count before that change
  unsigned backoff = 1, hold = 0;                    // up: periods to wait after a useless worker
  unsigned down_every = first_down, since_down = 0;  // down: steady periods between tests

  // A period is long enough to judge at 50 ms with 64 elements, or with fewer over longer
  // (a slow fn): rates from a handful of elements are mostly noise.
  static bool period_done(double seconds, std::uint64_t elements) {
    return seconds >= 0.05 && (elements >= 64 || (seconds >= 1 && elements >= 8) || (seconds >= 10 && elements >= 1));
  }
  // Does going from `fewer` workers at rate `low` to one more at rate `high` pay?
  static bool pays(double low, double high, std::size_t fewer) {
    return high >= low * (1 + std::max(share / double(fewer), floor));
  }

  std::size_t decide(const autotune_sample& m, std::size_t active, std::size_t max) {
    if (settle > 0) {
      --settle;
      return active;
    }
    auto settle_at = [&](std::size_t to) {
      ph = phase::steady;
      settle = 1;
      last_rate = 0;
      return to;
    };
    double base;  // the mean of the last two periods at this count
    if (ph != phase::steady) {
      judged_sum += m.rate;
      if (++judged < judge_periods) return active;
      const double after = judged_sum / judged;
      if (ph == phase::judge_up) {
        if (!pays(base_rate, after, from)) {
          backoff = std::min(backoff * 2, max_backoff);
          hold = backoff;
          return settle_at(from);
        }
        backoff = 1;  // it paid: keep it (and go on below: one more if the consumer still waits)
      } else {
        if (pays(after, base_rate, active)) {  // the parked worker paid: bring it back
          down_every = std::min(down_every * 2, max_down);
          hold = backoff;  // and no up-probe at once: that count was just tested
          return settle_at(from);
        }
        down_every = first_down;  // it did not pay: it stays parked, and the next
        backoff = std::min(backoff * 2, max_backoff);  // try to add one waits longer
        hold = backoff;
      }
      ph = phase::steady;
      base = after;
    } else {
      base = last_rate > 0 ? (last_rate + m.rate) / 2 : m.rate;
    }
    last_rate = m.rate;
    auto change = [&](phase p, std::size_t to) {
      base_rate = base;
      from = active;
      judged_sum = 0;
      judged = 0;
      since_down = 0;
      settle_at(to);
      ph = p;
      return to;
    };
    if (active > 1 && ++since_down >= down_every) return change(phase::judge_down, active - 1);
    if (hold > 0) {
      --hold;
      return active;
    }
    if (m.consumer_wait > 0.05 && active < max) return change(phase::judge_up, active + 1);
    if (active > 1 && m.consumer_wait < 0.01 && m.worker_wait > 0.5) {  // plainly too many
      hold = backoff;
      since_down = 0;
      return settle_at(active - 1);
    }
    return active;
  }
};

// One parallel map's periods: what the consumer waited, what the workers made, and when
// a period is long enough to hand to autotune_state. Consumer's thread only.
struct map_tuner {
  using clock = std::chrono::steady_clock;
  static constexpr std::int64_t poll_every = 256;  // elements handed out between clock reads

  autotune_state state;
  clock::time_point period_start{}, wait_start{};
  bool waiting = false;
  double waited_s = 0;  // the consumer's wait for elements in this period
  std::uint64_t pulled0 = 0, room0 = 0;
  // The open period's share from earlier epochs, and where this epoch's last look was.
  double carry_s = 0;
  std::uint64_t carry_n = 0, last_pulled = 0;
  clock::time_point last_seen{};
  std::int64_t countdown = poll_every;

  void begin_wait(clock::time_point t) { waiting = true, wait_start = t; }
  void end_wait(clock::time_point t) {
    waiting = false;
    waited_s += std::chrono::duration<double>(t - wait_start).count();
  }
  // Counts n elements handed out; true every poll_every of them (time to look at the clock).
  bool due(std::uint64_t n) {
    if ((countdown -= std::int64_t(n)) > 0) return false;
    countdown = poll_every;
    return true;
  }
  // A new epoch's workers start: the learned count and backoffs carry over. The open
  // period goes on: what the last epoch added to it until its last look (pulled0..
  // last_pulled over period_start..last_seen) is carried, the gap is not.
  void new_epoch(clock::time_point now) {
    if (last_seen > period_start) {
      carry_s += std::chrono::duration<double>(last_seen - period_start).count();
      carry_n += last_pulled - pulled0;
    }
    countdown = poll_every;
    period_start = last_seen = now;
    pulled0 = last_pulled = 0;  // the workers' pull count starts again from 0
    waiting = false;
  }
  // Called with `pulled` (elements the workers have pulled this epoch), `room_ns` (their
  // total wait for room, ever) and the active count: once the period is long enough,
  // measures it and returns the count autotune_state decides (else `active`).
  std::size_t look(clock::time_point now, std::uint64_t pulled, std::uint64_t room_ns, std::size_t active,
                   std::size_t max) {
    // A period runs on across epochs (their gaps left out), so short epochs still add up.
    const double dt = carry_s + std::chrono::duration<double>(now - period_start).count();
    const std::uint64_t made = carry_n + (pulled - pulled0);
    last_seen = now;
    last_pulled = pulled;
    if (!autotune_state::period_done(dt, made)) return active;
    if (waiting) end_wait(now), begin_wait(now);
    autotune_sample m;
    // Production (elements the workers pulled to map), not what the consumer took: a
    // consumer draining a full window would make a period look faster than the workers.
    m.rate = double(made) / dt;
    m.consumer_wait = std::min(1.0, waited_s / dt);
    // A room wait is counted when it ends, so a long one can land in a later period.
    m.worker_wait = std::min(1.0, double(room_ns - room0) * 1e-9 / (dt * double(active)));
    const std::size_t next = state.decide(m, active, max);
    period_start = now;
    pulled0 = pulled;
    carry_s = 0;
    carry_n = 0;
    room0 = room_ns;
    waited_s = 0;
    return next;
  }
};

}  // namespace ferry::detail
