// ferry/train/mirrored_trainer.hpp: MirroredStrategy for C++: one MLP replicated on every
// local replica, each replica training on its slice of the global batch, gradients
// all-reduced so every replica stays identical.
//
//   // host replicas (threads), in-process all-reduce:
//   ferry::train::host_trainer t({.layers = {784, 256, 128, 10}},
//                                {.opt = {.lr = 1e-3f}, .seed = 1, .max_rows = 64}, 4);
//   for (auto& step : batches | ferry::distribute(ferry::host_replicas{4}))
//     auto s = t.train_step(step);         // s.loss, s.accuracy: global, every replica
//
//   // no wait per step (GPUs: the host enqueues step k+1 while the GPU runs step k):
//   for (auto& step : steps) t.train_step_async(step);
//   auto e = t.take_stats();               // one wait: the steps since the last take
//   for (auto& step : test) t.evaluate_async(step);
//   auto v = t.take_eval();                // one wait: the test pass
//
//   // any communicator (NCCL for GPUs, MPI across processes, your own thread_group's
//   // thread_communicators): one replica per local communicator
//   ferry::train::mirrored_trainer<Backend, Comm> t(cfg, opts, std::move(comms), contexts);
//
// A step: every replica runs forward/backward on its own thread (replica 0 on the
// caller's), packs all layers' gradients AND the step statistics into one contiguous
// buffer, calls ONE all_reduce_sum, and applies the optimizer, dividing by the global
// weight sum: the mean loss over the global batch, whatever the replica count. So 1 x B
// and N x B/N give the same weights up to float reassociation. Nothing is allocated per
// step: activations are sized for max_rows rows per replica.
//
// CUDA graphs (trainer_options::graphs, GPU backends): each replica's step is captured
// into a graph the first time a slice shape is met (allocating the graph's input buffers
// and cuBLAS's workspace then, once) and replayed after, on the replica's thread as
// before; see replica.hpp.
//
// Statistics: train_step reads the step's statistics back (a wait for replica 0's
// backend: on a GPU, its stream; with NCCL, first a poll of every replica's stream).
// train_step_async enqueues the same work, then one 4-element op on replica 0's backend
// that adds the step's statistics into running totals (compensated float sums, allocated
// with the trainer); take_stats() reads them with one wait and starts afresh. Both kinds
// of step add to the totals, so they mix, and both leave the same weights, bit for bit.
// Evaluations likewise: evaluate reads back, evaluate_async does not, and both add to
// evaluation totals of their own that take_eval() reads with one wait.
//
// Threads: replicas 1..N-1 run on worker threads that live as long as the trainer and are
// joined by its destructor; a 1-replica trainer starts none. The trainer itself is used
// from one thread (take_stats reads replica 0's backend on it). Runs no user code.
//
// BLAS threads: a backend with its own GEMM threads (host_backend: OpenBLAS) is set to
// trainer_options::blas_threads per GEMM when the trainer is built; 0 (auto) means 1, as
// the replicas are the parallelism (see trainer_options), unless OPENBLAS_NUM_THREADS is set.
//
// Errors: a slice larger than max_rows, with more valid rows than rows or a negative count,
// or a step with the wrong number of slices, is a config_error (checked on the caller
// before any replica starts); so is blas_threads < 0, and a distribute() step given to
// train_step_async whose streams are not the replicas'. A trainer that holds every rank of
// its group stays usable after such an error. One that holds only some ranks (one trainer
// per rank of a shared group, or per process) aborts its communicators first where they
// can be (thread_communicator, nccl_communicator), releasing the other ranks from the
// call's all-reduce they may already wait in, and is spent; with MPI the error must end
// the job (abort_on_exception), as nothing can release the others.
// train_step_async throws as train_step does (the replica failures below included),
// except that on a GPU a fault the device meets while running the enqueued work (not one
// seen when enqueueing it) is reported by the next call that waits for it: take_stats,
// train_step, evaluate, parameters. A step that throws adds nothing to the totals.
// take_stats throws backend errors (cuda_error), and ferry::error once the trainer is spent.
// Communicators whose errors surface asynchronously (nccl_communicator: a lost peer, a
// broken network): every call that waits for the replicas' work (train_step, take_stats,
// evaluate, parameters, and the destructor) polls the streams and check_async() instead
// of blocking, so a collective that a lost peer never joins ends in that async error
// (every communicator aborted, the trainer spent) rather than a hang; a stream's fault
// seen while polling (cuda_error) ends the same way.
// If a replica throws, the first error is rethrown on the caller, and the others are
// released from their collective as the communicator allows:
//  * communicators with abort() and reset() (thread_communicator): aborted from the failing
//    replica's thread at once. When the trainer holds every rank of the group (the
//    `int replicas` constructor, or comms.size() == comms[0].size()), it resets the group
//    once every replica is back and stays usable. When it holds only some ranks (a group
//    shared with other trainers or threads, e.g. one trainer per simulated rank), it cannot
//    know when the other ranks are out of the aborted collective, or whether one is still
//    on its way into it (after a reset that rank would wait for peers that have left, or
//    pair with their next call), so it leaves the group aborted and is spent, as with NCCL:
//    every trainer on the group then throws (the others ferry::error naming the rank that
//    aborted) and is spent; build a new group. Aborting reaches the whole group either way.
//    Calls without collectives (set_parameters, load) abort nothing.
//  * communicators with abort() only (nccl_communicator): every one is aborted once all
//    replicas are back from a call that enqueues collectives (a step, evaluate), since the
//    others' all-reduce would wait on the GPU forever; that trainer is then spent (later
//    calls throw ferry::error) but shuts down without hanging.
//  * communicators without abort() (solo, mpi_communicator, user types): nothing releases
//    a replica waiting for a failed sibling, so with several replicas a failure hangs the
//    call; use them with one replica per trainer (MPI: one per process, see
//    docs/multi_node.md), where a failure simply propagates.
// set_parameters uploads per replica without collectives: if one upload fails, the
// previous weights (replica 0's, read first) are uploaded back to every replica, so they
// still agree (optimizer state cleared), and the error is rethrown; if that restore fails
// too, the trainer is spent. load() throws what load_weights throws, and config_error when
// the file's layers differ from the model's.
#pragma once

#include <array>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "ferry/collective/communicator.hpp"
#include "ferry/collective/thread_collective.hpp"
#include "ferry/cuda/stream_handle.hpp"
#include "ferry/error.hpp"
#include "ferry/train/mlp.hpp"
#include "ferry/train/optimizer.hpp"
#include "ferry/train/replica.hpp"
#include "ferry/train/weights_file.hpp"

// The mirrored trainer of an MLP and what it is built from: backends, replicas, optimizer,
// loss, weights files and a progress bar.
namespace ferry::train {

// A trainer's options, a braced list: {.opt = {.lr = 1e-3f}, .seed = 1, .max_rows = 64}.
struct trainer_options {
  optimizer_config opt{};  // the optimizer (optimizer.hpp)
  std::uint64_t seed = 0;  // seeds the initial weights, the same on every replica
  int max_rows = 256;  // the most rows one replica's slice may have
  // Backends with their own BLAS threads (host_backend: OpenBLAS, process-wide): threads per
  // GEMM. 0 = auto: 1, since every replica already runs on its own thread and the input
  // pipeline needs cores too (OpenBLAS's threads spin in sched_yield while waiting, so
  // oversubscribing them costs 2-3x in wall time on a busy machine); left alone when
  // OPENBLAS_NUM_THREADS is set in the environment.
  int blas_threads = 0;
  // GPU backends: run each replica's step as a CUDA graph, captured on the slice shape's
  // first step (replica.hpp): per step, two input copies and one graph launch instead of
  // about 25 kernel launches. On by default: the same weights, bit for bit, and the
  // Fashion-MNIST MLP's step, bound by the host's launches, ran 1.28-1.75x faster on an
  // H200 (docs/train.md). Costs per replica: cuBLAS's 32 MiB workspace, input buffers of
  // max_rows rows, up to max_graphs graphs. false: a direct launch of every kernel (a
  // step whose shapes change every time, or a profiler that should see each launch).
  // Ignored by backends without graphs (host_backend).
  bool graphs = true;
};

// Where a replica runs: passed to the backend's constructor (-1 / null for host).
struct replica_context {
  int device = -1;  // the CUDA device ordinal; -1 for host
  cuda_stream stream = nullptr;  // the stream the replica's work goes on (a distribute() step's)
};

namespace detail {
// The floats one input row holds inline: float, float[N] or std::array<float, N>; 0 for
// any other type, whose bytes must not be read as floats (int pixels would train as
// denormals, silently).
template <class T>
struct float_row_size : std::integral_constant<std::size_t, 0> {};
template <>
struct float_row_size<float> : std::integral_constant<std::size_t, 1> {};
template <std::size_t N>
struct float_row_size<float[N]> : std::integral_constant<std::size_t, N> {};
template <std::size_t N>
struct float_row_size<std::array<float, N>> : std::integral_constant<std::size_t, N> {};

// Field 0 of a step given to the trainer, named with its element type X so the compiler
// prints it (see batch_field_index_out_of_range).
template <class X>
struct trainer_inputs_not_floats {
  static constexpr std::size_t floats = float_row_size<std::remove_cv_t<X>>::value;
  static_assert(floats > 0,
                "mirrored_trainer: field 0 (the inputs) must be float, float[N] or std::array<float, N> "
                "(X, the argument of trainer_inputs_not_floats<X> above, is not); convert the rows, "
                "e.g. with map, before batch");
  static_assert(floats == 0 || sizeof(X) == floats * sizeof(float), "an input row is not packed floats");
};
}  // namespace detail

// The replica inputs of a step as distribute() hands it out (field 0 the inputs: float,
// float[N] or std::array<float, N>, e.g. std::array<float, 784>, a compile-time error
// otherwise; field 1 the int32 labels), one per replica, into `out` (resized; pointers into
// the step's memory, valid while the step lives). For callers that keep the trainer behind
// a non-template interface. Throws config_error when the step has another number of
// replicas or rows of another width than the model's `inputs`. Runs on the caller's
// thread, no user code.
template <class Step>
  requires requires(Step& s) { s.replicas(); s[0].valid(); }
void step_inputs(Step& step, std::size_t replicas, int inputs, std::vector<replica_input>& out) {
  if (static_cast<std::size_t>(step.replicas()) != replicas)
    throw config_error("mirrored_trainer: a step for " + std::to_string(step.replicas()) +
                       " replicas, the trainer has " + std::to_string(replicas));
  out.resize(replicas);
  for (std::size_t r = 0; r < replicas; ++r) {
    auto& rb = step[r];
    auto x = rb.template field<0>();
    auto y = rb.template field<1>();
    using X = typename decltype(x)::element_type;
    using Y = typename decltype(y)::element_type;
    constexpr std::size_t floats = detail::trainer_inputs_not_floats<X>::floats;
    static_assert(sizeof(Y) == 4 && std::is_integral_v<std::remove_cv_t<Y>>,
                  "mirrored_trainer: field 1 must be the int32 labels");
    if (floats != static_cast<std::size_t>(inputs))
      throw config_error("mirrored_trainer: inputs have " +
                         std::to_string(floats) + " floats, the model " +
                         std::to_string(inputs));
    out[r] = replica_input{reinterpret_cast<const float*>(x.data()),
                           reinterpret_cast<const std::int32_t*>(y.data()),
                           static_cast<int>(rb.size()), static_cast<int>(rb.valid())};
  }
}

// One MLP replicated on every local replica (see the file's top): Backend runs each
// replica's math, Comm all-reduces their gradients.
template <class Backend, communicator Comm>
class mirrored_trainer {
  // The communicator reduces the backend's buffers in place, so both must mean the same
  // memory: NCCL given host arrays, or a thread all-reduce given device pointers, fails or
  // reads garbage at run time. A backend says so with on_device (none: host).
  static constexpr bool backend_on_device = [] {
    if constexpr (requires { { Backend::on_device } -> std::convertible_to<bool>; })
      return bool(Backend::on_device);
    else
      return false;
  }();
  static_assert(span_memory_of<Comm> == span_memory::any ||
                    (span_memory_of<Comm> == span_memory::device) == backend_on_device,
                "mirrored_trainer<Backend, Comm>: the communicator all-reduces the backend's buffers in place, so "
                "both must use the same memory: gpu_backend (device memory) with nccl_communicator, host_backend "
                "with thread_communicator or mpi_communicator, solo_communicator with either");
  // abort() callable from any thread while the others wait in a collective, and reset()
  // making it usable again once all are back (thread_communicator).
  static constexpr bool resettable = requires(Comm& c) {
    c.abort();
    c.reset();
  };

 public:
  // One replica per communicator (their ranks' order). contexts: one per replica, or empty.
  mirrored_trainer(const mlp_config& cfg, const trainer_options& o, std::vector<Comm> comms,
                   std::vector<replica_context> contexts = {})
      : cfg_(cfg), opts_(o), comms_(std::move(comms)) {
    if constexpr (resettable) {  // e.g. thread_communicators of the caller's thread_group
      abort_ = [this](std::size_t failed) {
        comms_[failed].abort();  // first: the others' errors name the failed replica's rank
        for (auto& c : comms_) c.abort();
      };
      // Only a trainer holding every rank knows when all are out of a collective (see Errors).
      if (!comms_.empty() && comms_.size() == static_cast<std::size_t>(comms_[0].size()))
        reset_ = [this] {
          for (auto& c : comms_) c.reset();
        };
    }
    init(std::move(contexts));
  }

  // Host replicas: `replicas` threads joined by an in-process thread_group.
  mirrored_trainer(const mlp_config& cfg, const trainer_options& o, int replicas)
    requires std::same_as<Comm, thread_communicator>
      : cfg_(cfg), opts_(o), group_(std::make_unique<thread_group>(replicas)) {
    for (int r = 0; r < replicas; ++r) comms_.push_back(group_->communicator(r));
    abort_ = [this](std::size_t failed) { comms_[failed].abort(); };  // the whole group
    reset_ = [g = group_.get()] { g->reset(); };
    init({});
  }

  mirrored_trainer(const mirrored_trainer&) = delete;
  mirrored_trainer& operator=(const mirrored_trainer&) = delete;

  ~mirrored_trainer() {
    shutdown();
    // Before the backends synchronise their streams (their destructors): a collective that
    // a lost peer never joins would keep a stream busy forever; settle() ends on the
    // communicator's async error and aborts the communicators, so the streams drain.
    try {
      settle();
    } catch (...) {
    }
  }

  // The number of replicas.
  int replicas() const { return static_cast<int>(reps_.size()); }
  // The model's shape and parameter offsets.
  const mlp_layout& layout() const { return reps_[0]->layout(); }
  // Replica r, for tests and tools; throws config_error for r outside [0, replicas()).
  replica<Backend>& replica_at(int r) {
    if (r < 0 || r >= replicas())
      throw config_error("mirrored_trainer::replica_at: replica " + std::to_string(r) + " of " +
                         std::to_string(replicas()) + " (replicas are 0 to " + std::to_string(replicas() - 1) + ")");
    return *reps_[static_cast<std::size_t>(r)];
  }
  // Training steps taken so far.
  std::uint64_t steps() const { return steps_; }

  // One training step on one slice per replica (in each replica's backend memory).
  // Returns the global loss (weighted mean) and accuracy of the batch, before the update;
  // waits for replica 0's backend to read them. Also adds them to the running totals that
  // take_stats() reads, so sync and async steps mix.
  step_stats train_step(std::span<const replica_input> in) {
    train_step_async(in);
    settle();
    return reps_[0]->read_stats();
  }

  // A step as distribute() hands it out: field 0 the inputs (floats, e.g.
  // std::array<float, 784>), field 1 the int32 labels.
  // The step's streams must be the trainer's, as for train_step_async (a config_error
  // otherwise): the trainer's work waits for the step's copies only on those streams.
  template <class Step>
    requires requires(Step& s) { s.replicas(); s[0].valid(); }
  step_stats train_step(Step& step) {
    train_step_async(step);
    settle();
    return reps_[0]->read_stats();
  }

  // The same step without reading its statistics back: on a GPU it returns once every
  // replica has enqueued its work (no blocking wait), so the host enqueues step k+1 while
  // the GPU runs step k. With NCCL the host runs at most gpu_backend::marks (3) steps
  // ahead of replica 0: past that it polls the stream and the communicators' async errors
  // (see Errors) before enqueuing. The step's reduced statistics are added, on replica 0's
  // backend, to running totals that take_stats() reads. The inputs must stay valid until
  // the device has run the step: a distribute() step does (see the Step& overload); data of
  // your own, until a later call that waits (take_stats, train_step, evaluate, parameters).
  void train_step_async(std::span<const replica_input> in) {
    checking([&] { check(in); });
    throttle();
    run_all([&](std::size_t r) { reps_[r]->step(in[r], comms_[r], opts_.graphs); });
    reps_[0]->add_to_totals();  // after run_all: a step that throws adds nothing
    mark();
    ++steps_;
  }

  // A step as distribute() hands it out. Safe to release at once (the next next()): the
  // step's device blocks go back to distribute's pool with an event recorded on each
  // replica's stream after the work enqueued here, so they are overwritten only after it
  // ran. That needs the step's streams to be the trainer's (cuda::devices(ordinals,
  // streams of replica_at(r).backend().stream()), as the example does): a config_error
  // otherwise.
  template <class Step>
    requires requires(Step& s) { s.replicas(); s[0].valid(); }
  void train_step_async(Step& step) {
    train_step_async(std::span<const replica_input>(checked_slices(step)));
  }

  // The statistics of every step (train_step or train_step_async) since the last take, or
  // since the trainer was built: loss = total loss / total weight, accuracy = correct /
  // valid rows, weight and rows the totals (all 0 when there was no step, or only padding).
  // Then starts the totals afresh. Waits once for replica 0's backend, even with no step
  // (on a GPU: one cudaStreamSynchronize of replica 0's stream, after a poll of every
  // replica's stream with NCCL). evaluate(),
  // set_parameters() and load() leave the totals alone.
  step_stats take_stats() {
    if (spent_) throw error(spent_why_);
    settle();
    return reps_[0]->take_totals();
  }

  // Loss and accuracy on a held-out batch, reduced across replicas; no update. Waits for
  // replica 0's backend to read them; also adds them to the evaluation totals that
  // take_eval() reads, so evaluate and evaluate_async mix.
  step_stats evaluate(std::span<const replica_input> in) {
    checking([&] { check(in); });
    run_all([&](std::size_t r) { comms_[r].all_reduce_sum(reps_[r]->evaluate_local(in[r])); });
    reps_[0]->add_eval_to_totals();
    settle();
    return reps_[0]->read_eval();
  }
  // evaluate() of a distribute() step (field 0 the inputs, field 1 the labels); a step on
  // other streams than the trainer's is a config_error, as for train_step_async(Step&).
  template <class Step>
    requires requires(Step& s) { s.replicas(); s[0].valid(); }
  step_stats evaluate(Step& step) {
    // (its streams checked: else nothing orders the forward pass after the step's copies)
    return evaluate(std::span<const replica_input>(checked_slices(step)));
  }

  // evaluate() without reading back: on a GPU it returns once every replica has enqueued
  // the forward pass and the reduction (no blocking wait; throttled as train_step_async
  // is), and the batch's reduced statistics are added, on replica 0's backend, to
  // evaluation totals that take_eval() reads: a test pass of N batches waits once, not N
  // times. The inputs must stay valid as for train_step_async (a distribute() step on the
  // trainer's streams does; a step on other streams is a config_error). Throws as
  // evaluate does, with device faults reported by the next call that waits.
  void evaluate_async(std::span<const replica_input> in) {
    checking([&] { check(in); });
    throttle();
    run_all([&](std::size_t r) { comms_[r].all_reduce_sum(reps_[r]->evaluate_local(in[r])); });
    reps_[0]->add_eval_to_totals();  // after run_all: an evaluation that throws adds nothing
    mark();
  }
  // evaluate_async() of a distribute() step; a step on other streams than the trainer's
  // is a config_error.
  template <class Step>
    requires requires(Step& s) { s.replicas(); s[0].valid(); }
  void evaluate_async(Step& step) {
    evaluate_async(std::span<const replica_input>(checked_slices(step)));
  }
  // The statistics of every evaluation (evaluate or evaluate_async) since the last take
  // (loss = total loss / total weight, accuracy = correct / valid rows), then starts
  // afresh. One wait for replica 0's backend, as take_stats. Training steps leave these
  // totals alone, and evaluations the training totals.
  step_stats take_eval() {
    if (spent_) throw error(spent_why_);
    settle();
    return reps_[0]->take_eval_totals();
  }

  // Replica 0's parameters (every replica holds the same).
  std::vector<float> parameters() {
    settle();
    return reps_[0]->download_params();
  }
  // Sets every replica's parameters and clears the optimizer state. On failure every
  // replica gets the previous weights back (see Errors above) and the error is rethrown.
  void set_parameters(const std::vector<float>& p) {
    if (p.size() != layout().params)
      throw config_error("mirrored_trainer::set_parameters: " + std::to_string(p.size()) +
                         " values for " + std::to_string(layout().params) + " parameters");
    if (spent_) throw error(spent_why_);
    // The uploads are independent: a failure leaves the others holding p (and the failed
    // one maybe part of it). Keep replica 0's weights to put back everywhere (one copy per
    // call, not per step).
    const std::vector<float> old = parameters();
    try {
      run_all([&](std::size_t r) { reps_[r]->upload_params(p); }, /*collectives=*/false);
    } catch (...) {
      try {
        run_all([&](std::size_t r) { reps_[r]->upload_params(old); }, /*collectives=*/false);
      } catch (...) {
        spent_ = true;
        spent_why_ = "mirrored_trainer: set_parameters failed and the previous weights could "
                     "not be restored on every replica; build a new trainer";
      }
      throw;  // the first failure
    }
  }

  // Writes the parameters to a weights file (weights_file.hpp); throws io_error.
  void save(const std::string& path) { save_weights(path, cfg_.layers, parameters()); }
  // Reads a weights file into every replica (as set_parameters); throws what load_weights
  // throws, and config_error when the file's layers are not the model's.
  void load(const std::string& path) {
    mlp_weights w = load_weights(path);
    if (w.layers != cfg_.layers) {
      auto str = [](const std::vector<int>& v) {
        std::string s;
        for (int x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
        return s;
      };
      throw config_error(path + ": the file holds an MLP " + str(w.layers) + ", the model is " +
                         str(cfg_.layers));
    }
    set_parameters(w.params);
  }

 private:
  // Before the host waits for the replicas' work (reading statistics or parameters, and at
  // destruction), with communicators whose errors surface asynchronously (NCCL: a lost
  // peer or a broken network is an async error of the communicator, not a failed call,
  // and the collective it never joins keeps the stream busy forever): polls the replicas'
  // streams and the communicators' async errors instead of blocking. On such an error
  // every communicator is aborted (their collectives end, the streams drain), the trainer
  // is spent, and the error is thrown. Nothing to do for other backends or communicators,
  // or once the trainer is spent.
  void settle() {
    if constexpr (polls_async)
      poll_until([&] {
        bool idle = true;
        for (auto& r : reps_) idle = r->backend().idle() && idle;
        return idle;
      });
  }
  // Before enqueuing a step, with the same communicators: waits (polling, as settle()) until
  // at most Backend::marks - 1 earlier steps are still running on replica 0, so the host
  // never runs so far ahead that it blocks elsewhere first (distribute's backpressure waits
  // in cudaEventSynchronize, a full launch queue in the launch), out of reach of the
  // communicators' async errors.
  void throttle() {
    if constexpr (polls_async)
      if (issued_ >= Backend::marks) poll_until([&] { return reps_[0]->backend().marked(issued_ - Backend::marks); });
  }
  // After enqueuing a step or an asynchronous evaluation: the mark throttle() polls.
  void mark() {
    if constexpr (polls_async) reps_[0]->backend().mark(issued_);
    ++issued_;
  }
  // A distribute() step's slices must be ready on the replicas' own streams (see
  // train_step_async(Step&)); an empty slice (lockstep's empty steps) waits for nothing.
  template <class Step>
  void check_streams(Step& step) {
    if constexpr (requires { step[0].stream(); reps_[0]->backend().stream(); })
      for (std::size_t r = 0; r < reps_.size(); ++r)
        if (step[r].size() != 0 && step[r].stream() != reps_[r]->backend().stream())
          throw config_error("mirrored_trainer: replica " + std::to_string(r) +
                             "'s slice is ready on another stream than the replica computes on; "
                             "distribute onto the trainer's streams (cuda::devices(ordinals, streams))");
  }
  static constexpr bool polls_async = requires(Comm& c, Backend& b, std::uint64_t i) {
    c.check_async();
    { b.idle() } -> std::convertible_to<bool>;
    b.mark(i);
    { b.marked(i) } -> std::convertible_to<bool>;
    Backend::marks;
  };
  // Polls done() and the communicators' async errors until done() (nothing once the
  // trainer is spent). On an error, or a throw from done(): every communicator is aborted
  // (their collectives end, the streams drain), the trainer is spent, the error rethrown.
  template <class Done>
  void poll_until(const Done& done) {
    if (spent_) return;
    try {
      for (;;) {
        for (auto& c : comms_) c.check_async();
        if (done()) return;
        std::this_thread::yield();
      }
    } catch (...) {
      for (auto& c : comms_) c.abort();
      spent_ = true;
      spent_why_ = "mirrored_trainer: the replicas' work failed in an earlier call (an async error of "
                   "a communicator, or of a stream) and the communicators were aborted; build a new trainer";
      throw;
    }
  }

  void init(std::vector<replica_context> ctx) {
    if (comms_.empty()) throw config_error("mirrored_trainer: no replicas");
    if (opts_.blas_threads < 0)
      throw config_error("mirrored_trainer: blas_threads must be >= 0 (0 = auto)");
    if constexpr (requires { Backend::set_blas_threads(1); }) {
      if (opts_.blas_threads > 0) Backend::set_blas_threads(opts_.blas_threads);
      else if (!std::getenv("OPENBLAS_NUM_THREADS")) Backend::set_blas_threads(1);
    }
    if (!ctx.empty() && ctx.size() != comms_.size())
      throw config_error("mirrored_trainer: " + std::to_string(ctx.size()) + " contexts for " +
                         std::to_string(comms_.size()) + " replicas");
    ctx.resize(comms_.size());
    const mlp_layout lay(cfg_);
    const std::vector<float> p0 = init_params(lay, opts_.seed);
    reps_.resize(comms_.size());
    errs_.resize(comms_.size());
    slices_.resize(comms_.size());
    for (std::size_t r = 1; r < comms_.size(); ++r)
      workers_.emplace_back([this, r] { worker(r); });
    // Each replica is built on its own thread (its memory is first touched there); then
    // rank 0's parameters are broadcast, so ranks of other processes agree too.
    try {
      run_all([&](std::size_t r) {
      reps_[r] = std::make_unique<replica<Backend>>(cfg_, opts_.opt, p0, opts_.max_rows, ctx[r]);
      if constexpr (requires { comms_[r].set_stream(ctx[r].stream); })
        comms_[r].set_stream(reps_[r]->backend().stream());
      comms_[r].broadcast(reps_[r]->parameters(), 0);
      });
    } catch (...) {
      shutdown();  // a constructor that throws runs no destructor: join here
      throw;
    }
  }

  void shutdown() noexcept {
    {
      std::lock_guard lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_)
      if (t.joinable()) t.join();
  }

  template <class Step>
  std::vector<replica_input>& slices(Step& step) {
    step_inputs(step, reps_.size(), layout().inputs(), slices_);
    return slices_;
  }
  // A distribute() step's slices, checked with its streams (check_streams) as checking() does.
  template <class Step>
  std::vector<replica_input>& checked_slices(Step& step) {
    checking([&] {
      slices(step);
      check_streams(step);
    });
    return slices_;
  }
  // Runs a call's checks (its slices, their streams: config_errors), before any replica
  // starts. When the trainer holds every rank of its group, a failure is the caller's alone
  // (no rank has entered the call's collectives) and the trainer stays usable. When it holds
  // only some (one trainer per rank of a shared group, or per process), the other ranks may
  // already wait in the call's all-reduce: the failure releases them as a replica's would,
  // every communicator that can be aborted is, and the trainer is spent. An MPI
  // communicator cannot be aborted: there the error must end the job (abort_on_exception).
  template <class F>
  void checking(F&& f) {
    try {
      f();
    } catch (...) {
      if (comms_.size() != static_cast<std::size_t>(comms_[0].size())) release_peers();
      throw;
    }
  }
  void release_peers() {
    if constexpr (requires(Comm& c) { c.abort(); }) {
      for (auto& c : comms_) c.abort();
      spent_ = true;
      spent_why_ = "mirrored_trainer: a call's slices were refused on a trainer that holds only some ranks of its "
                   "group, and its communicators were aborted to release the other ranks from the call's "
                   "collectives; build a new group and trainers";
    }
  }

  void check(std::span<const replica_input> in) const {
    if (in.size() != reps_.size())
      throw config_error("mirrored_trainer: " + std::to_string(in.size()) + " slices for " +
                         std::to_string(reps_.size()) + " replicas");
    for (std::size_t r = 0; r < in.size(); ++r)
      if (std::string why = slice_problem(in[r], opts_.max_rows); !why.empty())
        throw config_error("mirrored_trainer: replica " + std::to_string(r) + "'s slice " + why);
  }

  // Runs job(r) for every replica r, replica 0 on this thread; rethrows the first failure.
  // `collectives`: whether job enqueues collectives (then a failure aborts NCCL ones).
  template <class F>
  void run_all(F&& job, bool collectives = true) {
    if (spent_) throw error(spent_why_);
    std::function<void(std::size_t)> fn = std::ref(job);
    const std::size_t N = reps_.size();
    job_collectives_ = collectives;  // read by the workers after the hand-off below
    if (N > 1) {
      std::lock_guard lk(m_);
      job_ = &fn;
      done_ = 0;
      ++gen_;
    }
    cv_.notify_all();
    run_one(fn, 0);
    if (N > 1) {
      std::unique_lock lk(m_);
      done_cv_.wait(lk, [&] { return done_ == N - 1; });
      job_ = nullptr;
    }
    if (failed_ >= 0) {
      std::exception_ptr e = errs_[static_cast<std::size_t>(failed_)];  // failed_ >= 0: a replica
      for (auto& x : errs_) x = nullptr;
      failed_ = -1;
      if (collectives) {  // run_one aborted the communicators (those that can be)
        if constexpr (resettable) {
          if (reset_) {
            reset_();  // every rank of the group is this trainer's, and all are back
          } else {
            spent_ = true;
            spent_why_ = "mirrored_trainer: a replica failed in an earlier call and its thread_group, which "
                         "this trainer shares with ranks it does not hold, was aborted and cannot be reset "
                         "from here; build a new group and trainers";
          }
        }
        // Communicators that can end their collectives but not be reset (NCCL): the other
        // replicas' all-reduce waits on the GPU for the replica that failed, so the streams
        // would never drain. Every thread is out of its calls now: abort them all; the
        // trainer is then spent.
        if constexpr (requires(Comm& c) { c.abort(); } && !resettable) {
          for (auto& c : comms_) c.abort();
          spent_ = true;
          spent_why_ = "mirrored_trainer: a replica failed in an earlier call and its NCCL "
                       "communicators were aborted; build a new trainer";
        }
      }
      std::rethrow_exception(e);
    }
  }
  void run_one(std::function<void(std::size_t)>& fn, std::size_t r) {
    try {
      fn(r);
    } catch (...) {
      {
        std::lock_guard lk(fail_m_);
        errs_[r] = std::current_exception();
        if (failed_ < 0) failed_ = static_cast<int>(r);  // the first failure, not the aborts it caused
      }
      // Release the siblings waiting in a collective; a job without any (uploads) needs no
      // abort, which would reach ranks outside this trainer on a shared group.
      if (abort_ && job_collectives_) abort_(r);
    }
  }
  void worker(std::size_t r) {
    std::uint64_t seen = 0;
    for (;;) {
      std::function<void(std::size_t)>* fn;
      {
        std::unique_lock lk(m_);
        cv_.wait(lk, [&] { return stop_ || gen_ != seen; });
        if (stop_) return;
        seen = gen_;
        fn = job_;
      }
      run_one(*fn, r);
      {
        std::lock_guard lk(m_);
        ++done_;
      }
      done_cv_.notify_one();
    }
  }

  mlp_config cfg_;
  trainer_options opts_;
  std::unique_ptr<thread_group> group_;  // host replicas only
  std::vector<Comm> comms_;
  std::function<void(std::size_t)> abort_;  // from the failed replica's thread, given its index
  std::function<void()> reset_;
  bool spent_ = false;  // unusable after a failure (spent_why_ says why)
  const char* spent_why_ = "";
  std::vector<std::unique_ptr<replica<Backend>>> reps_;
  std::vector<replica_input> slices_;
  std::uint64_t steps_ = 0;
  std::uint64_t issued_ = 0;  // steps and asynchronous evaluations enqueued (mark, throttle)

  std::vector<std::thread> workers_;
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  std::function<void(std::size_t)>* job_ = nullptr;
  bool job_collectives_ = true;  // whether job_ calls collectives (run_all's argument)
  std::uint64_t gen_ = 0;
  std::size_t done_ = 0;
  bool stop_ = false;
  std::mutex fail_m_;
  std::vector<std::exception_ptr> errs_;
  int failed_ = -1;
};

}  // namespace ferry::train
