// ferry/stages/lockstep.hpp: lockstep(comm, policy) makes every rank of a communicator
// take the same number of steps this epoch, agreed as they go: before handing out a step,
// each rank says whether it has one, in one small all-reduce. No counting pass: ranks
// whose step counts cannot be known ahead (bucket_by_sequence_length, filter, a token
// budget) still end the epoch together, so no rank waits forever in an all-reduce another
// rank never enters.
//
//   auto steps = from_files(...) | shard(world, rank) | ... | bucket_by_sequence_length(...)
//              | distribute(ferry::host_replicas{1}, {.remainder = ferry::remainder_policy::partial})
//              | ferry::lockstep(ctx.world(), ferry::step_policy::pad);
//   for (auto& st : steps) trainer.train_step(st);   // the same count on every rank
//
// Policies (agree_steps.hpp's):
//   pad   the epoch goes on while any rank has a step; a rank that has run out gets empty
//         steps (every replica's slice has 0 rows: no loss, no gradient, and it still joins
//         the trainer's all-reduce). Every row of the epoch is seen exactly once.
//   drop  the epoch ends at the first step some rank lacks; the others' steps after it are
//         not seen this epoch (every step is full everywhere).
//
// The elements are distribute()'s steps; an empty step has as many replicas as
// distribute() has (asked through the stages between, which pass replicas() on; an
// upstream that hides it, such as an any_source, gives the last step's count, or 1 before
// this rank's first step), index() continuing the epoch's count, and no host batch rows.
// A trainer accepts it (empty slices wait for no copy, so their streams are not checked).
//
// Cost: one all_reduce_sum of two floats per step on `comm` (host memory: an MPI or
// thread communicator; one of device memory, NCCL, is refused at compile time), on the
// thread calling next().
//
// Threads: none of its own; runs on the thread calling next(), which must be the one that
// uses `comm` for this rank; no user code of its own. No thread may read ahead of it: a
// prefetch over it is a compile-time error, a map with workers a config_error (a rank that
// stops mid-epoch would leave the others in the all-reduce its thread had begun).
//
// Errors: an upstream error on one rank still joins that step's all-reduce, flagged: that
// rank rethrows its error, and every other rank throws ferry::error ("lockstep: 1 other
// rank(s) failed at step 17 ...") at the same step, keeping its own step for the next
// call. So no rank hangs, the error is an event at the same place on every rank, and
// nothing is lost: the epoch goes on at the next next(). A rank whose pipeline refuses
// pulls after a restore or rewind() that failed part way (config_error: stage.hpp), here or
// in a stage over lockstep, joins the step's all-reduce flagged the same way before it
// throws (not found below a zip or concatenate over lockstep, nor, after a failed restore,
// below a take(k) over it that had handed out its k steps when saved: keep lockstep last).
// Collective errors propagate.
// Every rank must call next() the same number of times (a range-for does, and ends at the
// first throw on every rank alike).
//
// Memory: this rank's step held after another rank's failure, and one empty batch shared
// by its empty steps.
//
// Checkpoints: this rank's "ran out" and "over" flags and step count, then the upstream's
// state (ahead of it, so a restore that fails below has set them: see Errors); ranks
// restore their own checkpoints (saved at the same step). The communicator is not saved.
// Saving right after another rank's failure, while this rank holds its step for the next
// call, is a config_error (call next() first).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "ferry/batch_of.hpp"
#include "ferry/collective/agree_steps.hpp"
#include "ferry/collective/communicator.hpp"
#include "ferry/error.hpp"
#include "ferry/source.hpp"
#include "ferry/stage.hpp"
#include "ferry/step.hpp"

namespace ferry {
namespace detail {

template <source Up, class Comm>
class lockstep_source : public stage<lockstep_source<Up, Comm>, Up> {
  // Its two floats live on this thread's stack: a communicator of device memory (NCCL)
  // would be handed host memory, read later by an asynchronous kernel.
  static_assert(span_memory_of<Comm> != span_memory::device,
                "ferry::lockstep(comm): comm all-reduces device memory (nccl_communicator); lockstep agrees on "
                "steps in host memory: give it the ranks' host communicator (mpi_communicator, thread_communicator)");

 public:
  static constexpr char name[] = "lockstep";
  static constexpr bool changes_batch_size = true;  // steps, not batches
  static constexpr bool joins_collective = true;    // no thread may read ahead of it (prefetch, map's workers)
  lockstep_source(Up up, Comm& comm, step_policy p) : stage<lockstep_source, Up>(std::move(up)), comm_(&comm), p_(p) {}

 private:
  friend stage<lockstep_source, Up>;
  using V = value_t<Up>;
  using T = typename step_element<V>::type;  // lockstep goes after distribute()

  std::optional<V> pull() {
    if (over_) return std::nullopt;
    std::optional<V> mine = std::move(held_);
    held_.reset();
    std::exception_ptr failed;
    if (!mine && !ran_out_) {
      try {
        mine = this->pull_up();
        if (!mine) ran_out_ = true;
      } catch (...) {
        failed = std::current_exception();
      }
    }
    // [ranks with a step, ranks that failed], summed over the ranks.
    std::array<float, 2> w{mine ? 1.0f : 0.0f, failed ? 1.0f : 0.0f};
    comm_->all_reduce_sum(std::span<float>(w));
    const std::size_t have = std::size_t(w[0] + 0.5f), errors = std::size_t(w[1] + 0.5f);
    // A failed step is no step: the steps handed out keep distribute's count (index()).
    const std::uint64_t k = steps_;
    if (errors) {
      if (failed) std::rethrow_exception(failed);
      held_ = std::move(mine);  // handed out at the next call
      throw error("lockstep: " + std::to_string(errors) + " other rank(s) failed at step " + std::to_string(k) +
                  " of the epoch (see the failing rank's error); every rank goes on at the next call");
    }
    ++steps_;
    const std::size_t ranks = std::size_t(comm_->size());
    if (have == 0 || (p_ == step_policy::drop && have < ranks)) {
      over_ = true;
      return std::nullopt;
    }
    if (mine) {
      replicas_ = mine->replicas();
      return mine;
    }
    return empty_step(k);
  }

  // This rank's pull is refused (a failed restore or rewind(): stage.hpp's check_pull):
  // the step's all-reduce, joined as a failure, so the other ranks throw at this step and
  // keep theirs (as for an upstream error) instead of waiting for this rank.
  void refused_pull() {
    if (over_) return;  // the ranks agreed the epoch is over: theirs join nothing either
    std::array<float, 2> w{0.0f, 1.0f};
    comm_->all_reduce_sum(std::span<float>(w));
  }

  V empty_step(std::uint64_t k) {
    std::size_t r = replicas_;
    if constexpr (requires(const Up& u) { u.replicas(); })  // distribute's, through the stages between
      if (r == 0) r = this->up().replicas();
    if (!empty_) empty_ = std::make_shared<const batch_of<T>>();
    return step_access::make<T>(empty_, r == 0 ? 1 : r, k);
  }

  // Its words go ahead of the upstream's: a restore that fails in the upstream has set
  // over_ already, so this rank's refused pulls join an all-reduce exactly where the
  // other ranks' pulls, restored from the same step, do.
  void save_upstream(state_writer& w) const {
    if (held_)
      throw config_error("lockstep: cannot save right after another rank failed, while this rank holds its step "
                         "for the next call; call next() first");
    w.put(ran_out_);
    w.put(over_);
    w.put(steps_);
    this->up().save(w);
  }
  void restore_upstream(state_reader& r) {
    held_.reset();  // a used pipeline restored after another rank's failure: its step is the state's to give
    ran_out_ = r.get_flag(name);
    over_ = r.get_flag(name);
    steps_ = r.get();
    this->up().restore(r);
  }
  // Before the upstream's rewind: a rewind that throws there leaves a fresh epoch's state,
  // as the other ranks' rewinds do (over_ kept from the epoch before, a refused pull would
  // join no all-reduce while they wait in their first).
  void before_rewind() { start_epoch(); }
  // A restore that fails in lockstep's own words leaves a fresh epoch's state, not the one
  // before (which no other rank has).
  void before_restore() { start_epoch(); }
  void start_epoch() {
    held_.reset();
    ran_out_ = over_ = false;
    steps_ = 0;
  }

  Comm* comm_;
  step_policy p_;
  bool ran_out_ = false;  // this rank's upstream has ended this epoch
  bool over_ = false;  // the ranks have agreed the epoch is over
  std::uint64_t steps_ = 0;  // steps agreed this epoch
  std::size_t replicas_ = 0;  // from the last step this rank had
  std::shared_ptr<const batch_of<T>> empty_;  // empty steps' host batch
  std::optional<V> held_;  // this rank's step, kept when another rank failed
};

}  // namespace detail

// lockstep(comm, policy): every rank of comm takes the same number of steps, agreed as
// they go (see the file's top). comm must outlive the pipeline.
struct lockstep_t {
  // lockstep(src, comm, policy): the stage over src (moved in).
  template <source S, class Comm>
  auto operator()(S&& s, Comm& comm, step_policy p) const {
    detail::require_rvalue_source<S>();
    return detail::lockstep_source<std::remove_cvref_t<S>, Comm>(std::forward<S>(s), comm, p);
  }
  // lockstep(comm, policy): a closure for `steps | lockstep(comm, policy)`.
  template <class Comm>
    requires(!source<Comm>)
  auto operator()(Comm& comm, step_policy p) const {
    Comm* c = &comm;
    return make_closure([c, p]<class S>(S&& s) { return lockstep_t{}(std::forward<S>(s), *c, p); });
  }
};
// lockstep(comm, policy): equal step counts across ranks without a counting pass.
inline constexpr lockstep_t lockstep{};

}  // namespace ferry
