// lockstep: ranks of a thread_group, each with its own number of steps, take the same
// number of steps (pad: the most, with empty steps; drop: the least), agreed step by
// step; every row is seen once under pad; an error on one rank ends the epoch on every
// rank at the same step, with no hang; checkpoints resume.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/doubles.hpp"
#include "ferry/collective/thread_collective.hpp"
#include "ferry/ferry.hpp"
#include "ferry/stages/distribute.hpp"

using namespace std::chrono_literals;

namespace {

using u64 = std::uint64_t;

// Rank r's pipeline: rows[r] rows (ids from `first`), batches of 4, over 2 host replicas;
// the generator throws at id `bad`.
auto rank_steps(u64 first, u64 rows, u64 bad = ~u64{0}) {
  return ferry::from_generator(rows,
                               [first, bad](u64 i) -> std::uint64_t {
                                 if (first + i == bad) throw std::runtime_error("row " + std::to_string(bad) + " failed");
                                 return first + i;
                               }) |
         ferry::batch(4) | ferry::distribute(ferry::host_replicas{2}, {.remainder = ferry::remainder_policy::partial});
}

struct rank_result {
  std::size_t steps = 0, empty = 0;
  std::vector<u64> ids;
  std::string error;
};

// Runs `ranks` threads, each over its own pipeline with lockstep.
std::vector<rank_result> run(const std::vector<u64>& rows, ferry::step_policy p, u64 bad = ~u64{0},
                             int save_at = -1) {
  const std::size_t W = rows.size();
  ferry::thread_group g{int(W)};
  std::vector<rank_result> out(W);
  std::vector<std::thread> ts;
  for (std::size_t r = 0; r < W; ++r)
    ts.emplace_back([&, r] {
      auto comm = g.communicator(int(r));
      u64 first = 0;
      for (std::size_t q = 0; q < r; ++q) first += rows[q];
      auto steps = rank_steps(first, rows[r], bad) | ferry::lockstep(comm, p);
      auto take = [&](auto& st) {
        ++out[r].steps;
        if (st.global_size() == 0) ++out[r].empty;
        CHECK(st.replicas() == 2);
        for (std::size_t k = 0; k < st.replicas(); ++k)
          for (u64 x : st[k].template field<0>()) out[r].ids.push_back(x);
      };
      try {
        if (save_at >= 0) {  // save after save_at steps, go on from a fresh pipeline
          for (int k = 0; k < save_at; ++k) {
            auto st = steps.next();
            REQUIRE(st);
            take(*st);
          }
          auto again = rank_steps(first, rows[r], bad) | ferry::lockstep(comm, p);
          ferry::restore_state(again, ferry::save_state(steps));
          while (auto st = again.next()) take(*st);
        } else {
          for (auto& st : steps) take(st);
        }
      } catch (const std::exception& e) {
        out[r].error = e.what();
      }
    });
  for (auto& t : ts) t.join();
  return out;
}

std::size_t steps_of(u64 rows) { return (rows + 3) / 4; }

}  // namespace

TEST_CASE("lockstep pad: every rank takes the most steps, empty ones after its data; every row once" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  for (const auto& rows : std::vector<std::vector<u64>>{{10, 3}, {0, 7, 40, 13}, {5}, {8, 8, 8}}) {
    const auto res = run(rows, ferry::step_policy::pad);
    std::size_t most = 0;
    u64 total = 0;
    for (u64 n : rows) most = std::max(most, steps_of(n)), total += n;
    std::vector<int> seen(total, 0);
    for (std::size_t r = 0; r < rows.size(); ++r) {
      CAPTURE(r);
      CHECK(res[r].error.empty());
      CHECK(res[r].steps == most);
      CHECK(res[r].empty == most - steps_of(rows[r]));
      for (u64 x : res[r].ids) ++seen[x];
    }
    for (int c : seen) CHECK(c == 1);
  }
}

// Stages between distribute() and lockstep (take, filter over steps) pass distribute's
// replicas() on: a rank with no data at all still gets empty steps of 2 replicas, not 1.
TEST_CASE("lockstep after take/filter: a rank with no step yet gets empty steps of distribute's replicas" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  const std::vector<u64> rows = {0, 9};
  ferry::thread_group g{2};
  std::vector<std::vector<std::size_t>> replicas(2);
  std::vector<std::thread> ts;
  for (std::size_t r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      auto comm = g.communicator(int(r));
      auto steps = rank_steps(r == 0 ? 0 : rows[0], rows[r]) | ferry::take(100) |
                   ferry::filter([](const auto&) { return true; }) | ferry::lockstep(comm, ferry::step_policy::pad);
      for (auto& st : steps) replicas[r].push_back(st.replicas());
    });
  for (auto& t : ts) t.join();
  CHECK(replicas[0] == std::vector<std::size_t>{2, 2, 2});
  CHECK(replicas[1] == std::vector<std::size_t>{2, 2, 2});
}

TEST_CASE("lockstep drop: every rank takes the fewest steps" * doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  const std::vector<u64> rows = {10, 30, 22};
  const auto res = run(rows, ferry::step_policy::drop);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    CHECK(res[r].error.empty());
    CHECK(res[r].steps == steps_of(10));
    CHECK(res[r].empty == 0);
  }
}

TEST_CASE("lockstep: an error on one rank is an error on every rank at that step; then all go on, "
          "nothing lost, no hang" * doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  const std::vector<u64> rows = {12, 20, 9};
  const u64 bad = 12 + 9;  // rank 1's tenth row: its third step
  // A range-for ends at the first throw on every rank alike.
  const auto res = run(rows, ferry::step_policy::pad, bad);
  CHECK(res[1].error.find("row 21 failed") != std::string::npos);
  for (std::size_t r : {0u, 2u}) {
    CHECK(res[r].error.find("lockstep: 1 other rank(s) failed at step 2") != std::string::npos);
    CHECK(res[r].steps == 2);
  }
  // next() after the error: every rank goes on; every row but rank 1's failed batch once.
  ferry::thread_group g{3};
  std::vector<std::vector<u64>> ids(3), index(3);
  std::vector<int> errors(3, 0);
  std::vector<std::thread> ts;
  for (int r = 0; r < 3; ++r)
    ts.emplace_back([&, r] {
      auto comm = g.communicator(r);
      const u64 first = r == 0 ? 0 : r == 1 ? 12 : 32;
      auto steps = rank_steps(first, rows[std::size_t(r)], bad) | ferry::lockstep(comm, ferry::step_policy::pad);
      for (;;) {
        try {
          auto st = steps.next();
          if (!st) break;
          index[std::size_t(r)].push_back(st->index());
          for (std::size_t k = 0; k < st->replicas(); ++k)
            for (u64 x : (*st)[k].field<0>()) ids[std::size_t(r)].push_back(x);
        } catch (const std::exception&) {
          ++errors[std::size_t(r)];
        }
      }
    });
  for (auto& t : ts) t.join();
  std::vector<int> seen(41, 0);
  for (int r = 0; r < 3; ++r) {
    CHECK(errors[std::size_t(r)] == 1);
    for (u64 x : ids[std::size_t(r)]) ++seen[x];
  }
  // Rank 1: row 21 failed, and row 20, pulled into the batch it broke, went with it (batch());
  // the next batch starts at row 22.
  for (u64 x = 0; x < 41; ++x) CHECK(seen[x] == (x == 20 || x == 21 ? 0 : 1));
  // The same index() at every agreed step on every rank, empty steps too (the failed one
  // is no step: distribute's count goes on without it).
  CHECK(index[0] == std::vector<u64>{0, 1, 2, 3, 4});  // rank 1's 5 steps (its third failed)
  CHECK(index[1] == index[0]);
  CHECK(index[2] == index[0]);
}

TEST_CASE("lockstep pad: an empty step's ragged field has offsets {0}, as distribute's empty slice" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  ferry::thread_group g{2};
  std::vector<std::vector<u64>> values(2), empty(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      auto comm = g.communicator(r);
      std::vector<std::string> words = r == 0 ? std::vector<std::string>{"ab", "c"}
                                              : std::vector<std::string>{"x", "yy", "zzz", "w"};
      auto steps = ferry::from_range(std::move(words)) | ferry::batch(2) | ferry::distribute(ferry::host_replicas{2}) |
                   ferry::lockstep(comm, ferry::step_policy::pad);
      for (auto& st : steps)
        for (std::size_t k = 0; k < st.replicas(); ++k) {
          const auto f = st[k].field<0>();
          REQUIRE(f.offsets.size() == st[k].size() + 1);
          values[std::size_t(r)].push_back(f.offsets.back());  // the slice's characters
          if (st.global_size() == 0) empty[std::size_t(r)].push_back(f.offsets.front());
        }
    });
  for (auto& t : ts) t.join();
  CHECK(values[0] == std::vector<u64>{2, 1, 0, 0});  // "ab" | "c", then an empty step
  CHECK(values[1] == std::vector<u64>{1, 2, 3, 1});
  CHECK(empty[0] == std::vector<u64>{0, 0});
}

TEST_CASE("lockstep: a map with workers over it is a config_error (its workers would read the all-reduce ahead); "
          "inline, fine") {
  ferry::thread_group g{1};
  auto comm = g.communicator(0);
  const auto over = [&] { return rank_steps(0, 8) | ferry::lockstep(comm, ferry::step_policy::pad); };
  const auto id = [](auto st) { return st; };
  CHECK_THROWS_WITH_AS(over() | ferry::map(id, {.workers = 2}), doctest::Contains("map: workers after lockstep()"),
                       ferry::config_error);
  CHECK_THROWS_WITH_AS(over() | ferry::take(5) | ferry::map(id, {.workers = ferry::autotune}),
                       doctest::Contains("map: workers after lockstep()"), ferry::config_error);
  auto fine = over() | ferry::map(id);
  std::size_t steps = 0;
  for (auto& st : fine) steps += st.global_size() > 0;
  CHECK(steps == 2);
  // Before distribute, workers are fine (lockstep is not below them).
  auto before = ferry::from_generator(u64(8), [](u64 i) { return i; }) | ferry::map([](u64 x) { return x; }, {.workers = 2}) |
                ferry::batch(4) | ferry::distribute(ferry::host_replicas{2}) | ferry::lockstep(comm, ferry::step_policy::pad);
  steps = 0;
  for (auto& st : before) steps += st.global_size() > 0;
  CHECK(steps == 2);
}

// Erased, lockstep's type no longer says it joins a collective: prefetch and map's workers
// ask the pipeline at run time, through any stage above the any_source too.
TEST_CASE("lockstep inside an any_source: prefetch or a map with workers over it is still a config_error") {
  ferry::thread_group g{1};
  auto comm = g.communicator(0);
  using step_t = ferry::value_t<decltype(rank_steps(0, 8) | ferry::lockstep(comm, ferry::step_policy::pad))>;
  const auto erased = [&] {
    return ferry::any_source<step_t>(rank_steps(0, 8) | ferry::lockstep(comm, ferry::step_policy::pad));
  };
  CHECK(erased().joins_collectives_at_run_time());
  CHECK_THROWS_WITH_AS(erased() | ferry::prefetch(2), doctest::Contains("joins a collective"), ferry::config_error);
  CHECK_THROWS_WITH_AS(erased() | ferry::take(5) | ferry::prefetch(2), doctest::Contains("joins a collective"),
                       ferry::config_error);
  const auto id = [](auto st) { return st; };
  CHECK_THROWS_WITH_AS(erased() | ferry::map(id, {.workers = 2}), doctest::Contains("map: workers after lockstep()"),
                       ferry::config_error);
  // Inline, fine; and an any_source without lockstep is not refused.
  auto fine = erased() | ferry::map(id);
  std::size_t steps = 0;
  for (auto& st : fine) steps += st.global_size() > 0;
  CHECK(steps == 2);
  auto plain = ferry::any_source<step_t>(rank_steps(0, 8));
  CHECK(!plain.joins_collectives_at_run_time());
  auto ahead = std::move(plain) | ferry::prefetch(2);
  steps = 0;
  for (auto& st : ahead) steps += st.global_size() > 0;
  CHECK(steps == 2);
}

TEST_CASE("lockstep: each rank's checkpoint resumes the agreed steps" * doctest::timeout(60)) {
  ferry_test::watchdog wd(60s);
  const std::vector<u64> rows = {6, 25};
  for (int at : {0, 1, 2, 4, 6}) {
    CAPTURE(at);
    const auto res = run(rows, ferry::step_policy::pad, ~u64{0}, at);
    u64 total = 0;
    for (u64 n : rows) total += n;
    std::vector<int> seen(total, 0);
    for (std::size_t r = 0; r < rows.size(); ++r) {
      CHECK(res[r].error.empty());
      CHECK(res[r].steps == steps_of(25));
      for (u64 x : res[r].ids) ++seen[x];
    }
    for (int c : seen) CHECK(c == 1);
  }
}

namespace {

// Rows first..first+n-1; rewind() throws while *fail is set (a file that cannot be reopened).
class flaky_rewind_source : public ferry::source_interface<flaky_rewind_source> {
 public:
  using value_type = u64;
  flaky_rewind_source(u64 first, u64 n, std::shared_ptr<std::atomic<bool>> fail)
      : first_(first), n_(n), fail_(std::move(fail)) {}
  std::optional<u64> next() {
    if (i_ >= n_) return std::nullopt;
    return first_ + i_++;
  }
  void rewind() {
    if (*fail_) throw std::runtime_error("rewind failed");
    i_ = 0;
  }
  void save(ferry::state_writer& w) const {
    w.tag("flaky");
    w.put(i_);
  }
  void restore(ferry::state_reader& r) {
    r.expect("flaky");
    i_ = r.get();
  }

 private:
  u64 first_, n_, i_ = 0;
  std::shared_ptr<std::atomic<bool>> fail_;
};

}  // namespace

// A rank whose rewind() or restore failed part way refuses next() (config_error): where the
// other ranks' next() joins the step's all-reduce, it joins it flagged first, so they throw
// at that step instead of waiting for it (or pairing its next all-reduce with this one);
// where theirs joins none (the epoch is over), neither does it. Found through a stage over
// lockstep and an any_source too. Then every rank rewinds and the epoch runs whole.
TEST_CASE("lockstep: a rank whose rewind() or restore failed part way fails that step on every rank, no hang; "
          "a good rewind() then runs the epoch whole" * doctest::timeout(120)) {
  ferry_test::watchdog wd(120s);
  const std::vector<u64> rows = {12, 20, 9};
  enum mode { rewind_mid_epoch, rewind_after_epoch, restore_after_epoch, restore_mid_epoch };
  for (int m : {rewind_mid_epoch, rewind_after_epoch, restore_after_epoch, restore_mid_epoch})
    for (int form = 0; form < 4; ++form) {  // lockstep last; take over it; an any_source; take over that
      CAPTURE(m);
      CAPTURE(form);
      ferry::thread_group g{3};
      std::vector<std::string> error(3);
      std::vector<int> ended(3, 0);
      std::vector<std::vector<u64>> ids(3);
      std::vector<std::size_t> steps(3, 0);
      std::vector<std::thread> ts;
      for (std::size_t r = 0; r < 3; ++r)
        ts.emplace_back([&, r] {
          auto comm = g.communicator(int(r));
          const u64 first = r == 0 ? 0 : r == 1 ? 12 : 32;
          auto fail = std::make_shared<std::atomic<bool>>(false);
          const auto source = [&] {
            return flaky_rewind_source(first, rows[r], fail) | ferry::batch(4) |
                   ferry::distribute(ferry::host_replicas{2}, {.remainder = ferry::remainder_policy::partial});
          };
          const auto base = [&] { return source() | ferry::lockstep(comm, ferry::step_policy::pad); };
          // Another shape below lockstep (a take): a state of base() fails there.
          const auto other = [&] { return source() | ferry::take(1000) | ferry::lockstep(comm, ferry::step_policy::pad); };
          using step_t = ferry::value_t<decltype(base())>;
          const auto drain = [&](auto& p) {
            for (auto& st : p) {
              ++steps[r];
              for (std::size_t k = 0; k < st.replicas(); ++k)
                for (u64 x : st[k].template field<0>()) ids[r].push_back(x);
            }
          };
          // After the failure: one next() on every rank, then a good rewind and the epoch.
          const auto go_on = [&](auto& p) {
            try {
              if (!p.next()) ended[r] = 1;
            } catch (const std::exception& e) {
              error[r] = e.what();
            }
            p.rewind();  // every rank, rank 1's good now
            drain(p);
          };
          const auto run_form = [&](auto shape) {
            auto p = shape(base);
            if (m == rewind_mid_epoch || m == restore_mid_epoch) {
              REQUIRE(p.next());
            } else {
              for (auto& st : p) (void)st;  // the whole epoch: over
            }
            if (m == rewind_mid_epoch || m == rewind_after_epoch) {
              *fail = r == 1;
              if (r == 1)
                CHECK_THROWS_WITH_AS(p.rewind(), "rewind failed", std::runtime_error);
              else
                p.rewind();
              *fail = false;
              go_on(p);
              return;
            }
            const ferry::pipeline_state saved = ferry::save_state(p);
            if (r == 1) {
              auto q = shape(other);
              CHECK_THROWS_AS(ferry::restore_state(q, saved), ferry::config_error);
              go_on(q);
            } else {
              auto q = shape(base);
              ferry::restore_state(q, saved);
              go_on(q);
            }
          };
          if (form == 0) run_form([](auto make) { return make(); });
          if (form == 1) run_form([](auto make) { return make() | ferry::take(1000); });
          if (form == 2) run_form([](auto make) { return ferry::any_source<step_t>(make()); });
          if (form == 3) run_form([](auto make) { return ferry::any_source<step_t>(make()) | ferry::take(1000); });
        });
      for (auto& t : ts) t.join();
      CHECK(error[1].find("failed part way") != std::string::npos);
      if (m == restore_after_epoch) {  // the others' epoch is over: no all-reduce, no error
        CHECK(ended[0] == 1);
        CHECK(ended[2] == 1);
      } else {
        for (std::size_t r : {0u, 2u}) {
          CAPTURE(r);
          CHECK(error[r].find("lockstep: 1 other rank(s) failed at step") != std::string::npos);
        }
      }
      std::vector<int> seen(41, 0);
      for (std::size_t r = 0; r < 3; ++r) {
        CHECK(steps[r] == steps_of(20));
        for (u64 x : ids[r]) ++seen[x];
      }
      for (int c : seen) CHECK(c == 1);
    }
}
