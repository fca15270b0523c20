// The trainer's GPU backend (gpu_backend.cuh: cuBLAS + Thrust on the replica's stream) and
// the NCCL communicator, compiled by g++ against the simulated CUDA runtime, cuBLAS, NCCL
// and Thrust for_each of tests/cuda/sim, and checked against the host backend (the oracle,
// sim_reference.cpp). The simulator runs kernels later, in a random order that respects
// streams, events and collectives, reports races, calls on the wrong device and host waits
// that could never return (a GPU would hang). So this checks, on a machine with no GPU:
// the cuBLAS calls' operand order, transposes and leading dimensions (column-major, the
// documented semantics); that every operation runs on its replica's device; the NCCL
// all-reduce and broadcast of two ranks on two simulated GPUs; the pipeline feeding the
// trainer through distribute(cuda::devices); and the failure paths that need two GPUs: a
// replica that fails mid-step or while the trainer is built ends in an error, not a hang,
// and frees everything; a lost NCCL peer ends barrier() with its async error; and that
// asynchronous steps (train_step_async) never wait on the host, take_stats() once.
// It cannot check the kernels' speed or the real libraries: test_train_gpu does, on a GPU.
#include <doctest/doctest.h>

#include <cuda_runtime.h>  // the simulator's (this test's include path puts tests/cuda/sim first)
#include <cublas_v2.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ferry/collective/nccl.hpp"
#include "ferry/cuda/devices.hpp"
#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/prefetch.hpp"
#include "ferry/train/gpu_backend.cuh"
#include "common/close.hpp"
#include "common/doubles.hpp"
#include "cuda/sync_counter.hpp"
#include "sim_reference.hpp"

namespace {

namespace tr = ferry::train;
using sim_ref::dim;

const tr::mlp_config cfg{{dim, 48, 24, 5}, {1.0f, 2.0f, 0.5f, 1.0f, 1.5f}};
constexpr int B = 64, classes = 5;

// Device copies made by the test itself, freed at the end of the scope.
struct device_copies {
  std::vector<void*> blocks;
  cudaStream_t s[sim::device_count] = {};
  template <class T>
  T* put(int device, const std::vector<T>& v) {
    REQUIRE(cudaSetDevice(device) == cudaSuccess);
    if (!s[device]) REQUIRE(cudaStreamCreateWithFlags(&s[device], cudaStreamNonBlocking) == cudaSuccess);
    void* p = nullptr;
    REQUIRE(cudaMalloc(&p, v.size() * sizeof(T)) == cudaSuccess);
    REQUIRE(cudaMemcpyAsync(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, s[device]) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(s[device]) == cudaSuccess);
    blocks.push_back(p);
    return static_cast<T*>(p);
  }
  ~device_copies() {
    for (void* p : blocks) cudaFree(p);
    for (auto st : s)
      if (st) cudaStreamDestroy(st);
  }
};

// The two replicas' slices of batch s (B rows from row s * B of the copies on each device),
// `per` rows each: global slices `first` and `first` + 1 (process p of two ranks: 2p).
std::vector<tr::replica_input> two_slices(float* const (&dx)[2], std::int32_t* const (&dy)[2], int s, int per,
                                          int first = 0) {
  std::vector<tr::replica_input> in;
  for (int r = 0; r < 2; ++r) {
    const std::size_t off = std::size_t(s) * B + std::size_t(first + r) * std::size_t(per);
    in.push_back({dx[r] + off * dim, dy[r] + off, per, per});
  }
  return in;
}

// NaN (so every `< tol` check fails) once a value is not finite: tests/common/close.hpp.
using ferry_test::max_abs_diff;
using ferry_test::rel_diff;

void no_violations() {
  const auto& v = sim::violations();
  for (const auto& x : v) MESSAGE(x);
  CHECK(v.empty());
}

// Everything the trainer made is gone once it is.
void all_freed(const sim::counters& before) {
  const auto now = sim::stats();
  CHECK(now.live_device_blocks == 0);
  CHECK(now.live_streams == before.live_streams);
  CHECK(now.live_events == before.live_events);
  CHECK(sim::live_blas_handles() == 0);
  CHECK(sim::live_nccl_comms() == 0);
  CHECK(now.live_graph_execs == before.live_graph_execs);
}

// One run on a fresh simulator: `body` (which frees what it made), then no race,
// wrong-device call or deadlock seen, and everything freed.
template <class F>
void sim_run(std::uint64_t seed, int progress, F body) {
  // The simulator reports a deadlock after 2 s without progress; this catches any other
  // hang (doctest::timeout only reports a slow case once it has finished).
  ferry_test::watchdog wd(std::chrono::seconds(120), "a train_sim run");
  CAPTURE(seed);
  CAPTURE(progress);
  sim::reset(seed, progress);
  const auto before = sim::stats();
  body();
  no_violations();
  all_freed(before);
}

// Twelve batches of B rows, the last short (padded by distribute), for 2 replicas, and the
// host backend's two epochs over them (the oracle of the pipeline-fed tests).
struct padded_epochs {
  sim_ref::blobs d = sim_ref::make_blobs(B * 12, classes, 5);
  std::vector<sim_ref::row> rows = sim_ref::rows_of(d, std::size_t(B) * 12 - 20);
  tr::trainer_options o{.seed = 11, .max_rows = B / 2};
  sim_ref::curve ref = sim_ref::train_pipeline(cfg, o, rows, B, 2);
  std::size_t per_epoch = ref.loss.size() / 2;
};

}  // namespace

TEST_CASE("gpu_backend on a simulated GPU: the gradients and the loss curve of the host backend" *
          doctest::timeout(120)) {
  const auto d = sim_ref::make_blobs(B * 40 + B, classes, 3);
  for (const std::uint64_t seed : {1u, 2u, 3u})
    for (const int progress : {0, 3}) {
      sim_run(seed, progress, [&] {
        device_copies dc;
        float* dx = dc.put(0, d.x);
        std::int32_t* dy = dc.put(0, d.y);

        // One forward/backward, padding rows included: the packed buffer equals the host's.
        const tr::mlp_layout lay(cfg);
        const auto want = sim_ref::first_gradient(cfg, 7, d, B, B - 3);
        {
          tr::replica<tr::gpu_backend> g(cfg, {}, tr::init_params(lay, 7), B, tr::replica_context{0, nullptr});
          g.forward_backward({dx, dy, B, B - 3});
          std::vector<float> got(lay.grad_floats());
          g.backend().download(got.data(), g.gradient_buffer().data(), got.size() * sizeof(float));
          REQUIRE(got.size() == want.size());
          const double diff = max_abs_diff(got, want), scale = ferry_test::max_abs(want);
          CHECK(scale > 0);
          CHECK(diff <= 1e-4 * scale + 1e-5);
        }

        // 40 Adam steps, then evaluate: the loss curve and the weights of the host's.
        const tr::trainer_options o{.seed = 7, .max_rows = B};
        const auto ref = sim_ref::train(cfg, o, d, B, 40, B);
        tr::mirrored_trainer<tr::gpu_backend, ferry::solo_communicator> t(
            cfg, o, std::vector<ferry::solo_communicator>(1), {tr::replica_context{0, nullptr}});
        double worst = 0;
        for (int s = 0; s < 40; ++s) {
          const std::size_t off = std::size_t(s) * B;
          const tr::replica_input in{dx + off * dim, dy + off, B, B};
          const auto st = t.train_step(std::span(&in, 1));
          CHECK(std::isfinite(st.loss));
          worst = ferry_test::worst(worst, rel_diff(st.loss, ref.loss[s]));
          CHECK(st.rows == ref.rows[s]);
          CHECK(st.accuracy == doctest::Approx(ref.accuracy[s]).epsilon(0.02));
        }
        CHECK(worst < 1e-3);
        CHECK(ref.loss.back() < 0.5 * ref.loss.front());  // it learns, so the curve says something
        CHECK(max_abs_diff(t.parameters(), ref.params) < 1e-3);
        const std::size_t off = std::size_t(40) * B;
        const tr::replica_input ev{dx + off * dim, dy + off, B, B};
        const auto e = t.evaluate(std::span(&ev, 1));
        CHECK(rel_diff(e.loss, ref.eval.loss) < 1e-3);
        CHECK(e.rows == ref.eval.rows);
      });
    }
}

TEST_CASE("NCCL, one rank per simulated GPU: the weights of one host replica with the same global batch" *
          doctest::timeout(120)) {
  const auto d = sim_ref::make_blobs(B * 30 + B, classes, 4);
  for (const std::uint64_t seed : {5u, 6u})
    for (const int progress : {0, 3}) {
      sim_run(seed, progress, [&] {
        device_copies dc;
        float* dx[2] = {dc.put(0, d.x), dc.put(1, d.x)};
        std::int32_t* dy[2] = {dc.put(0, d.y), dc.put(1, d.y)};
        const int per = B / 2;
        const tr::trainer_options o{.opt = {.kind = tr::optimizer_kind::sgd, .lr = 0.05f, .momentum = 0.9f},
                                    .seed = 9, .max_rows = per};
        const auto ref = sim_ref::train(cfg, o, d, B, 30, B);
        tr::mirrored_trainer<tr::gpu_backend, ferry::nccl_communicator> t(
            cfg, o, ferry::nccl_communicator::local({0, 1}), {{0, nullptr}, {1, nullptr}});
        // Replica 0 runs on this thread: leave another device current, as a caller may.
        REQUIRE(cudaSetDevice(1) == cudaSuccess);
        double worst = 0;
        for (int s = 0; s < 30; ++s) {
          const auto st = t.train_step(two_slices(dx, dy, s, per));
          CHECK(std::isfinite(st.loss));
          worst = ferry_test::worst(worst, rel_diff(st.loss, ref.loss[s]));
          CHECK(st.rows == ref.rows[s]);
        }
        CHECK(worst < 1e-3);
        const auto p0 = t.parameters();
        CHECK(t.replica_at(1).download_params() == p0);  // identical, bit for bit
        CHECK(max_abs_diff(p0, ref.params) < 1e-3);
        const std::size_t off = std::size_t(30) * B;
        const tr::replica_input ev[2] = {{dx[0] + off * dim, dy[0] + off, per, per},
                                         {dx[1] + (off + per) * dim, dy[1] + off + per, per, per}};
        const auto e = t.evaluate(std::span(ev));
        CHECK(rel_diff(e.loss, ref.eval.loss) < 1e-3);
        CHECK(e.rows == ref.eval.rows);
        CHECK(sim::stats().collectives > 0);
        REQUIRE(cudaSetDevice(0) == cudaSuccess);
      });
    }
}

TEST_CASE("the pipeline feeds two simulated GPUs' trainer: distribute(cuda::devices) onto its streams" *
          doctest::timeout(120)) {
  const padded_epochs pe;
  const auto& [d, rows, o, ref, per_epoch] = pe;
  for (const int progress : {0, 4}) {
    sim_run(17, progress, [&] {
      tr::mirrored_trainer<tr::gpu_backend, ferry::nccl_communicator> t(
          cfg, o, ferry::nccl_communicator::local({0, 1}), {{0, nullptr}, {1, nullptr}});
      std::vector<ferry::cuda_stream> streams{t.replica_at(0).backend().stream(), t.replica_at(1).backend().stream()};
      auto p = ferry::from_range(rows) | ferry::batch(std::size_t(B)) | ferry::prefetch(2) |
               ferry::distribute(ferry::cuda::devices({0, 1}, streams), {.remainder = ferry::remainder_policy::pad});
      std::size_t k = 0;
      double worst = 0;
      for (int e = 0; e < 2; ++e) {
        for (auto& step : p) {
          REQUIRE(k < ref.loss.size());
          const auto st = t.train_step(step);
          CHECK(st.rows == ref.rows[k]);
          CHECK(std::isfinite(st.loss));
          worst = ferry_test::worst(worst, rel_diff(st.loss, ref.loss[k]));
          ++k;
        }
        p.rewind();
      }
      CHECK(k == ref.loss.size());
      CHECK(ref.rows[ref.rows.size() / 2 - 1] == double(B - 20));  // the padded step was there
      CHECK(worst < 1e-3);
      CHECK(max_abs_diff(t.parameters(), ref.params) < 1e-3);
    });
  }
}

TEST_CASE("a GPU replica that fails mid-step: the error, then a spent trainer that shuts down without a hang" *
          doctest::timeout(120)) {
  const auto d = sim_ref::make_blobs(B * 8, classes, 6);
  for (const int progress : {0, 3}) {
    sim_run(23, progress, [&] {
      device_copies dc;
      float* dx[2] = {dc.put(0, d.x), dc.put(1, d.x)};
      std::int32_t* dy[2] = {dc.put(0, d.y), dc.put(1, d.y)};
      const int per = B / 2;
      // Direct steps: the failure is injected into a cuBLAS call, which a graph's replay does
      // not make (a failing capture: the graph case below).
      tr::mirrored_trainer<tr::gpu_backend, ferry::nccl_communicator> t(
          cfg, {.seed = 3, .max_rows = per, .graphs = false}, ferry::nccl_communicator::local({0, 1}),
          {{0, nullptr}, {1, nullptr}});
      auto slices = [&](int s) { return two_slices(dx, dy, s, per); };
      t.train_step(slices(0));
      // Replica 1's third GEMM of the next step fails: it never joins that step's all-reduce,
      // which replica 0 has enqueued and its GPU would wait on for ever.
      sim::fail_blas(1, 3, CUBLAS_STATUS_EXECUTION_FAILED);
      std::string what;
      try {
        t.train_step(slices(1));
      } catch (const ferry::error& e) {
        what = e.what();
      }
      CHECK(what.find("cublasSgemm") != std::string::npos);
      CHECK(what.find("device 1") != std::string::npos);
      CHECK(what.find("CUBLAS_STATUS_EXECUTION_FAILED") != std::string::npos);
      CHECK_THROWS_WITH_AS(t.train_step(slices(2)), doctest::Contains("build a new trainer"), ferry::error);
    });  // the trainer goes: its streams must drain (the aborted all-reduce ends)
  }
}

TEST_CASE("a GPU replica that fails while the trainer is built: cuda_error, nothing hangs, nothing leaks" *
          doctest::timeout(60)) {
  for (const int progress : {0, 3}) {
    sim_run(29, progress, [&] {
      sim::fail_malloc(1, 4);  // replica 1's fourth block: replica 0 goes on to the broadcast
      try {
        tr::mirrored_trainer<tr::gpu_backend, ferry::nccl_communicator> t(
            cfg, {.seed = 3, .max_rows = 16}, ferry::nccl_communicator::local({0, 1}), {{0, nullptr}, {1, nullptr}});
        FAIL("the trainer was built");
      } catch (const ferry::cuda_error& e) {
        CHECK(e.device() == 1);
        CHECK(e.call().find("cudaMalloc") != std::string::npos);
        CHECK(e.status() == int(cudaErrorMemoryAllocation));
      }
    });
  }
}

TEST_CASE("a gpu_backend whose cuBLAS handle cannot be made: the error, its stream freed, the caller's device kept" *
          doctest::timeout(60)) {
  for (const bool own_stream : {true, false}) {
    CAPTURE(own_stream);
    sim_run(31, 0, [&] {
      REQUIRE(cudaSetDevice(0) == cudaSuccess);
      cudaStream_t user = nullptr;
      if (!own_stream) {  // the replica's stream, on its device
        REQUIRE(cudaSetDevice(1) == cudaSuccess);
        REQUIRE(cudaStreamCreate(&user) == cudaSuccess);
        REQUIRE(cudaSetDevice(0) == cudaSuccess);
      }
      sim::fail_blas_create(1, 1, CUBLAS_STATUS_ALLOC_FAILED);
      CHECK_THROWS_WITH_AS(tr::gpu_backend(tr::replica_context{1, user}), doctest::Contains("cublasCreate failed on device 1"),
                           ferry::error);
      int now = -1;
      REQUIRE(cudaGetDevice(&now) == cudaSuccess);
      CHECK(now == 0);
      // The next one is made; sim_run checks that nothing the failed one made is left.
      { tr::gpu_backend ok(tr::replica_context{1, user}); }
      if (user) CHECK(cudaStreamDestroy(user) == cudaSuccess);
    });
  }
}

TEST_CASE("nccl_communicator::local refuses a device listed twice (NCCL: one rank per device)") {
  sim_run(32, 2, [&] {
    CHECK_THROWS_WITH_AS(ferry::nccl_communicator::local({0, 1, 0}), doctest::Contains("device 0 is listed twice"),
                         ferry::config_error);
    CHECK(ferry::nccl_communicator::local({1, 0}).size() == 2);
  });
}

TEST_CASE("a lost NCCL peer: barrier() ends with the communicator's async error, not a hang" *
          doctest::timeout(60)) {
  sim_run(31, 2, [&] {
    cudaStream_t s[2];
    {
      auto comms = ferry::nccl_communicator::local({0, 1});
      for (int r = 0; r < 2; ++r) {
        REQUIRE(cudaSetDevice(r) == cudaSuccess);
        REQUIRE(cudaStreamCreateWithFlags(&s[r], cudaStreamNonBlocking) == cudaSuccess);
        comms[r].set_stream(s[r]);
      }
      // Rank 0 never comes; rank 1's barrier waits in its all-reduce until NCCL reports the
      // peer lost (what a dead process or a broken network gives).
      sim::nccl_async_error(1, ncclRemoteError);
      CHECK_THROWS_WITH_AS(comms[1].barrier(), doctest::Contains("asynchronous error"), ferry::error);
      CHECK(comms[1].aborted());
      CHECK_THROWS_WITH_AS(comms[1].barrier(), doctest::Contains("aborted"), ferry::error);
      sim::nccl_async_error(1, ncclSuccess);
    }  // rank 0 has nothing pending: its teardown returns; rank 1's all-reduce was aborted
    for (auto st : s) CHECK(cudaStreamDestroy(st) == cudaSuccess);
  });
}

TEST_CASE("a peer lost mid-training: the trainer's wait ends with the communicator's async error, not a hang" *
          doctest::timeout(120)) {
  // Two "processes" (threads) of two ranks each in one clique of four. Process 1 trains 3
  // steps and leaves (a process that died). Process 0's 4th step's all-reduce then waits
  // for ranks 2 and 3 forever; NCCL says so only as an async error of the communicator,
  // noticed some way into the wait (here from the 20th query on). Three ways process 0
  // goes on:
  //  * sync: train_step's wait for the statistics must end on that error (a blocking
  //    cudaStreamSynchronize would wait forever: the simulator reports a deadlock), with
  //    the communicators aborted, the trainer spent, its weights still readable;
  //  * destroy: the trainer destroyed with such a step pending (nothing else waits);
  //  * fed: async steps fed by distribute(cuda::devices) on the trainer's streams, as the
  //    example trains: the host must not run ahead into distribute's backpressure wait
  //    (cudaEventSynchronize on the stuck stream) but end on the error in a step.
  const auto d = sim_ref::make_blobs(B * 24, classes, 9);
  const int per = B / 4;
  const tr::trainer_options o{.seed = 5, .max_rows = per};
  for (const char* mode : {"sync", "destroy", "fed"}) {
    CAPTURE(mode);
    const std::string m = mode;
    sim_run(43, 2, [&] {
      device_copies dc;
      float* dx[2] = {dc.put(0, d.x), dc.put(1, d.x)};
      std::int32_t* dy[2] = {dc.put(0, d.y), dc.put(1, d.y)};
      const ncclUniqueId id = ferry::nccl_communicator::unique_id();
      auto step = [&](int p, int s) { return two_slices(dx, dy, s, per, 2 * p); };
      std::string error1;
      std::thread other([&] {
        try {
          tr::mirrored_trainer<tr::gpu_backend, ferry::nccl_communicator> t(
              cfg, o, ferry::nccl_communicator::join(id, 4, 2, {0, 1}), {{0, nullptr}, {1, nullptr}});
          for (int s = 0; s < 3; ++s) t.train_step(step(1, s));
        } catch (const std::exception& e) {
          error1 = e.what();
        }
      });
      {
        tr::mirrored_trainer<tr::gpu_backend, ferry::nccl_communicator> t(
            cfg, o, ferry::nccl_communicator::join(id, 4, 0, {0, 1}), {{0, nullptr}, {1, nullptr}});
        for (int s = 0; s < 3; ++s) t.train_step(step(0, s));
        other.join();  // process 1 is gone
        CHECK(error1 == "");
        sim::nccl_async_error(0, ncclRemoteError, 20);
        const long q0 = sim::nccl_async_queries();
        if (m == "destroy") {
          t.train_step_async(step(0, 3));  // enqueued; nothing waits before the destructor
        } else if (m == "sync") {
          CHECK_THROWS_WITH_AS(t.train_step(step(0, 3)), doctest::Contains("asynchronous error"), ferry::error);
          CHECK(sim::nccl_async_queries() - q0 > 20);  // it polled while waiting, then saw the error
          CHECK_THROWS_WITH_AS(t.train_step(step(0, 0)), doctest::Contains("build a new trainer"), ferry::error);
          CHECK_THROWS_WITH_AS(t.take_stats(), doctest::Contains("build a new trainer"), ferry::error);
          CHECK(t.parameters().size() == t.layout().params);  // the weights can still be saved
        } else {
          std::vector<ferry::cuda_stream> streams{t.replica_at(0).backend().stream(), t.replica_at(1).backend().stream()};
          // Process 0's rows: its half of each of 20 more batches.
          std::vector<sim_ref::row> mine;
          const auto all = sim_ref::rows_of(d, std::size_t(B) * 24);
          for (int s = 4; s < 24; ++s)
            for (int k = 0; k < 2 * per; ++k) mine.push_back(all[std::size_t(s) * B + std::size_t(k)]);
          auto p = ferry::from_range(mine) | ferry::batch(std::size_t(2 * per)) |
                   ferry::distribute(ferry::cuda::devices({0, 1}, streams));
          int steps = 0;
          CHECK_THROWS_WITH_AS(
              [&] {
                for (auto& st : p) {
                  t.train_step_async(st);
                  ++steps;
                }
              }(),
              doctest::Contains("asynchronous error"), ferry::error);
          CHECK(steps <= int(tr::gpu_backend::marks));  // at most that many steps in flight
          CHECK(p.backend().backpressure_waits() == 0);  // never blocked in distribute first
        }
      }  // destroyed: no deadlock, every stream drained, the communicators gone
      sim::nccl_async_error(0, ncclSuccess);
    });
  }
}

TEST_CASE("ncclCommInitRank across processes: two trainers of two ranks each in one clique of four" *
          doctest::timeout(120)) {
  // Two "processes" (threads here, as in one rank per process with two GPUs each) join one
  // clique with nccl_communicator::join, as nccl_communicators(ctx) does after MPI_Bcast of
  // the id. Global rank 2p + r is replica r of process p, on device r, with global slice
  // 2p + r of each batch: the same weights as one host replica with the whole batch.
  const auto d = sim_ref::make_blobs(B * 20 + B, classes, 8);
  const int per = B / 4, steps = 20;
  const tr::trainer_options o{.seed = 13, .max_rows = per};
  const auto ref = sim_ref::train(cfg, o, d, B, steps, B);
  sim_run(37, 2, [&] {
    device_copies dc;
    float* dx[2] = {dc.put(0, d.x), dc.put(1, d.x)};
    std::int32_t* dy[2] = {dc.put(0, d.y), dc.put(1, d.y)};
    const ncclUniqueId id = ferry::nccl_communicator::unique_id();
    struct result {
      std::vector<double> loss;
      std::vector<float> params;
      std::string error;
    } res[2];
    auto process = [&](int p) {
      try {
        auto comms = ferry::nccl_communicator::join(id, 4, 2 * p, {0, 1});
        if (comms[0].rank() != 2 * p || comms[1].rank() != 2 * p + 1 || comms[0].size() != 4)
          throw std::runtime_error("ranks " + std::to_string(comms[0].rank()) + "," + std::to_string(comms[1].rank()));
        tr::mirrored_trainer<tr::gpu_backend, ferry::nccl_communicator> t(cfg, o, std::move(comms),
                                                                          {{0, nullptr}, {1, nullptr}});
        for (int s = 0; s < steps; ++s) res[p].loss.push_back(t.train_step(two_slices(dx, dy, s, per, 2 * p)).loss);
        res[p].params = t.parameters();
      } catch (const std::exception& e) {
        res[p].error = e.what();
      }
    };
    std::thread other(process, 1);
    process(0);
    other.join();
    CHECK(res[0].error == "");
    CHECK(res[1].error == "");
    REQUIRE(res[0].loss.size() == std::size_t(steps));
    REQUIRE(res[1].loss.size() == std::size_t(steps));
    double worst = 0;
    for (int s = 0; s < steps; ++s) worst = ferry_test::worst(worst, rel_diff(res[0].loss[s], ref.loss[s]));
    CHECK(worst < 1e-3);
    CHECK(res[0].loss == res[1].loss);      // every rank reads the same global statistics
    CHECK(res[0].params == res[1].params);  // and holds the same weights
    CHECK(max_abs_diff(res[0].params, ref.params) < 1e-3);
  });
}

namespace {

// The statistics of steps [from, to) combined by hand from each step's own: the oracle of
// take_stats.
struct combined {
  double loss_sum = 0, weight = 0, correct = 0, rows = 0;
  double loss() const { return weight > 0 ? loss_sum / weight : 0.0; }
  double accuracy() const { return rows > 0 ? correct / rows : 0.0; }
};
combined combine(const std::vector<tr::step_stats>& v, std::size_t from, std::size_t to) {
  combined c;
  for (std::size_t i = from; i < to; ++i) {
    c.loss_sum += v[i].loss * v[i].weight;
    c.weight += v[i].weight;
    c.correct += v[i].accuracy * v[i].rows;
    c.rows += v[i].rows;
  }
  return c;
}
combined combine(const sim_ref::curve& c, std::size_t from, std::size_t to) {
  std::vector<tr::step_stats> v;
  for (std::size_t i = 0; i < c.loss.size(); ++i) v.push_back({c.loss[i], c.accuracy[i], c.weight[i], c.rows[i]});
  return combine(v, from, to);
}

// take_stats against the same GPU math's train_step statistics, combined by hand: the same
// floats, summed in another order.
void check_same(const tr::step_stats& got, const combined& want) {
  CHECK(want.rows > 0);
  CHECK(got.rows == want.rows);
  CHECK(got.weight == want.weight);  // sums of the class weights: exact either way
  CHECK(rel_diff(got.loss, want.loss()) <= 1e-6);
  CHECK(rel_diff(got.accuracy, want.accuracy()) <= 1e-12);
}
// ... and against the host backend's, within the tolerances of the other sim tests.
void check_close(const tr::step_stats& got, const combined& host) {
  CHECK(host.rows > 0);
  CHECK(got.rows == host.rows);
  CHECK(got.weight == host.weight);
  CHECK(rel_diff(got.loss, host.loss()) < 1e-3);
  CHECK(got.accuracy == doctest::Approx(host.accuracy()).epsilon(0.02));
}

struct waits {
  ferry_test::host_syncs syncs;
  std::uint64_t all;  // every host wait, implicit ones included
};
waits now_waits() { return {ferry_test::count_host_syncs(), sim::stats().host_waits}; }
// The explicit waits between a and b: cudaStreamSynchronize, cudaEventSynchronize,
// cudaDeviceSynchronize; and all of them.
void check_waits(const waits& a, const waits& b, long stream, long event, std::uint64_t all) {
  CHECK(b.syncs.stream - a.syncs.stream == stream);
  CHECK(b.syncs.event - a.syncs.event == event);
  CHECK(b.syncs.device - a.syncs.device == 0);
  CHECK(b.all - a.all == all);
}

using nccl_trainer = tr::mirrored_trainer<tr::gpu_backend, ferry::nccl_communicator>;

}  // namespace

TEST_CASE("asynchronous steps on two simulated GPUs: no host wait per step, one per take_stats; "
          "train_step's weights bit for bit, the host backend's statistics" * doctest::timeout(120)) {
  constexpr int steps = 24, head = 10;
  const int per = B / 2;
  const auto d = sim_ref::make_blobs(B * steps + B, classes, 9);
  const tr::trainer_options o{.seed = 19, .max_rows = per};  // Adam
  const auto ref = sim_ref::train(cfg, o, d, B, steps, B);
  for (const int progress : {0, 3}) {
    sim_run(41, progress, [&] {
      device_copies dc;
      float* dx[2] = {dc.put(0, d.x), dc.put(1, d.x)};
      std::int32_t* dy[2] = {dc.put(0, d.y), dc.put(1, d.y)};
      auto slices = [&](int s) { return two_slices(dx, dy, s, per); };
      std::vector<tr::step_stats> sync_stats;
      std::vector<float> sync_params;
      {  // train_step on the same simulated GPUs: the same math, read back every step
        nccl_trainer a(cfg, o, ferry::nccl_communicator::local({0, 1}), {{0, nullptr}, {1, nullptr}});
        for (int s = 0; s < steps; ++s) sync_stats.push_back(a.train_step(slices(s)));
        sync_params = a.parameters();
      }
      nccl_trainer t(cfg, o, ferry::nccl_communicator::local({0, 1}), {{0, nullptr}, {1, nullptr}});
      const waits w0 = now_waits();
      for (int s = 0; s < head; ++s) t.train_step_async(slices(s));
      const waits w1 = now_waits();
      check_waits(w0, w1, 0, 0, 0);
      const auto first = t.take_stats();
      const waits w2 = now_waits();
      check_waits(w1, w2, 1, 0, 1);
      for (int s = head; s < steps; ++s) t.train_step_async(slices(s));
      const waits w3 = now_waits();
      check_waits(w2, w3, 0, 0, 0);
      const auto second = t.take_stats();
      const auto none = t.take_stats();
      check_waits(w3, now_waits(), 2, 0, 2);  // one each, with or without steps
      CHECK(none.rows == 0);
      CHECK(none.weight == 0);
      CHECK(none.loss == 0);

      check_same(first, combine(sync_stats, 0, head));
      check_same(second, combine(sync_stats, head, steps));
      check_close(first, combine(ref, 0, head));
      check_close(second, combine(ref, head, steps));
      const auto p0 = t.parameters();
      CHECK(p0 == sync_params);  // bit for bit
      CHECK(t.replica_at(1).download_params() == p0);
      CHECK(max_abs_diff(p0, ref.params) < 1e-3);

      // A train_step among async steps: its statistics go into the totals too.
      t.train_step_async(slices(0));
      const auto mid = t.train_step(slices(1));
      t.train_step_async(slices(2));
      const auto mixed = t.take_stats();
      CHECK(mixed.rows == 3.0 * B);
      CHECK(mid.rows == double(B));
    });
  }
}

TEST_CASE("asynchronous steps fed by distribute(cuda::devices) onto the trainer's streams: the "
          "host backend's epochs, no host wait but distribute's backpressure" * doctest::timeout(120)) {
  const padded_epochs pe;
  const auto& [d, rows, o, ref, per_epoch] = pe;
  for (const int progress : {0, 4}) {
    sim_run(43, progress, [&] {
      nccl_trainer t(cfg, o, ferry::nccl_communicator::local({0, 1}), {{0, nullptr}, {1, nullptr}});
      std::vector<ferry::cuda_stream> streams{t.replica_at(0).backend().stream(), t.replica_at(1).backend().stream()};
      auto p = ferry::from_range(rows) | ferry::batch(std::size_t(B)) | ferry::prefetch(2) |
               ferry::distribute(ferry::cuda::devices({0, 1}, streams), {.remainder = ferry::remainder_policy::pad});
      for (std::size_t e = 0; e < 2; ++e) {
        CAPTURE(e);
        const waits w0 = now_waits();
        const auto bp0 = p.backend().backpressure_waits();
        std::size_t k = 0;
        for (auto& step : p) {
          t.train_step_async(step);  // released by the next next(): its blocks wait for this work
          ++k;
        }
        const waits w1 = now_waits();
        // The only waits: distribute's backpressure (one event per replica), when the
        // simulated GPU lags max_pending steps behind.
        const long bp = long(p.backend().backpressure_waits() - bp0);
        check_waits(w0, w1, 0, 2 * bp, std::uint64_t(2 * bp));
        CHECK(k == per_epoch);
        check_close(t.take_stats(), combine(ref, e * per_epoch, (e + 1) * per_epoch));
        p.rewind();
      }
      CHECK(ref.rows[per_epoch - 1] == double(B - 20));  // the padded step was there
      CHECK(max_abs_diff(t.parameters(), ref.params) < 1e-3);
    });
  }
}

TEST_CASE("asynchronous evaluations on two simulated GPUs: no host wait per batch, one per take_eval; the "
          "statistics of evaluate(), also fed by distribute(cuda::devices) onto the trainer's streams" *
          doctest::timeout(120)) {
  constexpr int batches = 12;
  const int per = B / 2;
  const auto d = sim_ref::make_blobs(B * batches, classes, 13);
  const tr::trainer_options o{.seed = 23, .max_rows = per};
  for (const int progress : {0, 3}) {
    sim_run(59, progress, [&] {
      device_copies dc;
      float* dx[2] = {dc.put(0, d.x), dc.put(1, d.x)};
      std::int32_t* dy[2] = {dc.put(0, d.y), dc.put(1, d.y)};
      auto slices = [&](int s) {  // padding in some slices: the batches weigh differently
        auto in = two_slices(dx, dy, s, per);
        in[s % 2].valid = per - s % 5;
        return in;
      };
      nccl_trainer t(cfg, o, ferry::nccl_communicator::local({0, 1}), {{0, nullptr}, {1, nullptr}});
      for (int s = 0; s < 4; ++s) t.train_step_async(slices(s));  // trained a little first
      (void)t.take_stats();
      std::vector<tr::step_stats> sync;
      for (int s = 0; s < batches; ++s) sync.push_back(t.evaluate(slices(s)));
      (void)t.take_eval();  // evaluate() fed the totals: start afresh
      const waits w0 = now_waits();
      for (int s = 0; s < batches; ++s) t.evaluate_async(slices(s));
      const waits w1 = now_waits();
      check_waits(w0, w1, 0, 0, 0);
      const auto got = t.take_eval();
      check_waits(w1, now_waits(), 1, 0, 1);
      check_same(got, combine(sync, 0, batches));
      CHECK(t.take_stats().rows == 0);  // evaluations are not steps
      CHECK(t.steps() == 4);

      // The example's test pass: distribute onto the trainer's streams, each step released
      // at the next next() while its evaluation may still be queued on the GPU.
      const auto rows = sim_ref::rows_of(d, std::size_t(B) * batches - 20);  // a padded last batch
      std::vector<ferry::cuda_stream> streams{t.replica_at(0).backend().stream(), t.replica_at(1).backend().stream()};
      auto p = ferry::from_range(rows) | ferry::batch(std::size_t(B)) |
               ferry::distribute(ferry::cuda::devices({0, 1}, streams), {.remainder = ferry::remainder_policy::pad});
      std::vector<tr::step_stats> by_step;
      for (auto& step : p) by_step.push_back(t.evaluate(step));
      (void)t.take_eval();
      p.rewind();
      std::size_t k = 0;
      for (auto& step : p) {
        t.evaluate_async(step);
        ++k;
      }
      CHECK(k == by_step.size());
      const auto pass = t.take_eval();
      check_same(pass, combine(by_step, 0, by_step.size()));
      CHECK(pass.rows == double(B * batches - 20));

      // A step on distribute's own streams: nothing would order the trainer's kernels after
      // its copies, so every entry refuses it, before any work (the trainer goes on).
      auto own = ferry::from_range(rows) | ferry::batch(std::size_t(B)) |
                 ferry::distribute(ferry::cuda::devices{0, 1}, {.remainder = ferry::remainder_policy::pad});
      auto other = own.next();
      REQUIRE(other);
      const auto refused = doctest::Contains("slice is ready on another stream than the replica computes on");
      CHECK_THROWS_WITH_AS(t.evaluate(*other), refused, ferry::config_error);
      CHECK_THROWS_WITH_AS(t.evaluate_async(*other), refused, ferry::config_error);
      CHECK_THROWS_WITH_AS(t.train_step_async(*other), refused, ferry::config_error);
      CHECK(t.take_eval().rows == 0);
      CHECK(t.steps() == 4);
    });
  }
}

TEST_CASE("train_step and train_step_async refuse a distribute() step whose slices are ready on other streams" *
          doctest::timeout(60)) {
  const auto d = sim_ref::make_blobs(B * 2, classes, 7);
  const auto rows = sim_ref::rows_of(d, std::size_t(B) * 2);
  sim_run(47, 2, [&] {
    nccl_trainer t(cfg, {.seed = 3, .max_rows = B / 2}, ferry::nccl_communicator::local({0, 1}),
                   {{0, nullptr}, {1, nullptr}});
    auto p = ferry::from_range(rows) | ferry::batch(std::size_t(B)) |
             ferry::distribute(ferry::cuda::devices{0, 1});  // distribute's own streams
    auto step = p.next();
    REQUIRE(step);
    CHECK_THROWS_WITH_AS(t.train_step_async(*step), doctest::Contains("another stream"), ferry::config_error);
    CHECK_THROWS_WITH_AS(t.train_step(*step), doctest::Contains("another stream"), ferry::config_error);
    CHECK(t.steps() == 0);
    CHECK(t.take_stats().rows == 0);
  });
}

// ---- CUDA graphs (trainer_options::graphs) -------------------------------------------------

namespace {

// Step k's slices of two replicas: `rows` rows each (the first `valid` real), replica r's
// from row k * B + r * per of its device's copy, so every step reads other data.
std::vector<tr::replica_input> shaped(float* const (&dx)[2], std::int32_t* const (&dy)[2], int k, int rows,
                                      int valid) {
  std::vector<tr::replica_input> in;
  for (int r = 0; r < 2; ++r) {
    const std::size_t off = std::size_t(k) * B + std::size_t(r) * std::size_t(B / 2);
    in.push_back({dx[r] + off * dim, dy[r] + off, rows, valid});
  }
  return in;
}

}  // namespace

TEST_CASE("CUDA graph steps on two simulated GPUs: the weights of direct steps, bit for bit, with new data "
          "every step; one capture per slice shape, the oldest of max_graphs dropped" * doctest::timeout(120)) {
  const int per = B / 2;
  // (rows, valid) per step: repeats (replays), a padded shape, and six shapes in all, so the
  // cache of max_graphs drops some and captures them again.
  const std::vector<std::pair<int, int>> shapes = {
      {per, per}, {per, per}, {per, per - 3}, {per, per}, {per - 5, per - 5}, {per - 1, per - 1},
      {per - 2, per - 2}, {per, per}, {per - 3, per - 4}, {per, per}, {per - 5, per - 5}, {per, per - 3},
      {per, per}, {per, per}, {1, 1}, {per, per}};
  const int steps = static_cast<int>(shapes.size());
  // The oracle of the cache: the oldest captured shape goes when a fifth comes.
  std::uint64_t want_captures = 0;
  {
    std::vector<std::pair<int, int>> cache;
    for (const auto& sh : shapes)
      if (std::find(cache.begin(), cache.end(), sh) == cache.end()) {
        if (cache.size() == tr::replica<tr::gpu_backend>::max_graphs) cache.erase(cache.begin());
        cache.push_back(sh);
        ++want_captures;
      }
  }
  REQUIRE(want_captures > 6);  // some shapes were dropped and met again
  const auto d = sim_ref::make_blobs(B * (steps + 1), classes, 12);
  for (const auto kind : {tr::optimizer_kind::adam, tr::optimizer_kind::sgd})
    for (const int progress : {0, 3}) {
      sim_run(51, progress, [&] {
        CAPTURE(int(kind));
        device_copies dc;
        float* dx[2] = {dc.put(0, d.x), dc.put(1, d.x)};
        std::int32_t* dy[2] = {dc.put(0, d.y), dc.put(1, d.y)};
        tr::trainer_options o{.opt = {.kind = kind, .lr = kind == tr::optimizer_kind::sgd ? 0.05f : 1e-3f},
                              .seed = 21, .max_rows = per, .graphs = false};
        nccl_trainer direct(cfg, o, ferry::nccl_communicator::local({0, 1}), {{0, nullptr}, {1, nullptr}});
        o.graphs = true;
        nccl_trainer graphed(cfg, o, ferry::nccl_communicator::local({0, 1}), {{0, nullptr}, {1, nullptr}});
        std::vector<tr::step_stats> want, got;
        const auto launches0 = sim::stats().graph_launches;
        for (int k = 0; k < steps; ++k) {
          const auto in = shaped(dx, dy, k, shapes[k].first, shapes[k].second);
          if (k % 4 == 3) {  // train_step among async steps
            want.push_back(direct.train_step(in));
            got.push_back(graphed.train_step(in));
          } else {
            direct.train_step_async(in);
            graphed.train_step_async(in);
          }
        }
        CHECK(sim::stats().graph_launches - launches0 == std::uint64_t(2 * steps));
        for (std::size_t i = 0; i < want.size(); ++i) {
          CHECK(got[i].loss == want[i].loss);
          CHECK(got[i].rows == want[i].rows);
          CHECK(got[i].accuracy == want[i].accuracy);
        }
        const auto a = direct.take_stats(), b = graphed.take_stats();
        CHECK(b.loss == a.loss);
        CHECK(b.rows == a.rows);
        CHECK(b.weight == a.weight);
        const auto p = graphed.parameters();
        CHECK(p == direct.parameters());  // bit for bit: the same kernels on the same data
        CHECK(graphed.replica_at(1).download_params() == p);
        CHECK(p != tr::init_params(tr::mlp_layout(cfg), 21));  // it trained
        for (int r = 0; r < 2; ++r) {
          CHECK(graphed.replica_at(r).graphs_captured() == want_captures);
          CHECK(direct.replica_at(r).graphs_captured() == 0);
        }
        // evaluate and set_parameters between graph steps: the graphs read the same buffers.
        const auto ev = shaped(dx, dy, steps, per, per);
        CHECK(graphed.evaluate(ev).loss == direct.evaluate(ev).loss);
        graphed.set_parameters(tr::init_params(tr::mlp_layout(cfg), 5));
        direct.set_parameters(tr::init_params(tr::mlp_layout(cfg), 5));
        for (int k = 0; k < 3; ++k) {
          const auto in = shaped(dx, dy, k, per, per);
          CHECK(graphed.train_step(in).loss == direct.train_step(in).loss);
        }
        CHECK(graphed.parameters() == direct.parameters());
      });
    }
}

// Padding rows are never read on a GPU either (the same replica code as the host's):
// NaN, infinities and labels out of range there leave the weights of finite padding.
TEST_CASE("padding rows of NaN and Inf on two simulated GPUs: the weights of finite padding, bit for bit, "
          "direct and graph steps; a step with no valid row" * doctest::timeout(120)) {
  const int per = B / 2;
  const std::vector<std::pair<int, int>> shapes = {{per, per - 3}, {per, 0}, {per, per}, {per - 2, per - 7},
                                                   {per, per - 3}, {per - 1, 1}};
  const int steps = static_cast<int>(shapes.size());
  const auto clean = sim_ref::make_blobs(B * (steps + 1), classes, 13);
  auto dirty = clean;
  const float garbage[] = {NAN, INFINITY, -INFINITY, 3e38f};
  for (int k = 0; k < steps; ++k)
    for (int r = 0; r < 2; ++r)
      for (int i = shapes[k].second; i < per; ++i) {  // past the valid rows, and past `rows` too
        const std::size_t row = std::size_t(k) * B + std::size_t(r) * per + std::size_t(i);
        dirty.y[row] = i % 2 ? 99 : -1;
        for (int c = 0; c < dim; ++c) dirty.x[row * dim + c] = garbage[(i + c) % 4];
      }
  for (const auto kind : {tr::optimizer_kind::adam, tr::optimizer_kind::sgd})
    sim_run(61, 0, [&] {
      CAPTURE(int(kind));
      device_copies dc;
      float* cx[2] = {dc.put(0, clean.x), dc.put(1, clean.x)};
      std::int32_t* cy[2] = {dc.put(0, clean.y), dc.put(1, clean.y)};
      float* dx[2] = {dc.put(0, dirty.x), dc.put(1, dirty.x)};
      std::int32_t* dy[2] = {dc.put(0, dirty.y), dc.put(1, dirty.y)};
      tr::trainer_options o{.opt = {.kind = kind, .lr = kind == tr::optimizer_kind::sgd ? 0.05f : 1e-3f},
                            .seed = 23, .max_rows = per, .graphs = false};
      nccl_trainer want(cfg, o, ferry::nccl_communicator::local({0, 1}), {{0, nullptr}, {1, nullptr}});
      nccl_trainer direct(cfg, o, ferry::nccl_communicator::local({0, 1}), {{0, nullptr}, {1, nullptr}});
      o.graphs = true;
      nccl_trainer graphed(cfg, o, ferry::nccl_communicator::local({0, 1}), {{0, nullptr}, {1, nullptr}});
      for (int k = 0; k < steps; ++k) {
        CAPTURE(k);
        const auto [rows, valid] = shapes[k];
        const auto w = want.train_step(shaped(cx, cy, k, rows, valid));
        const auto a = direct.train_step(shaped(dx, dy, k, rows, valid));
        const auto b = graphed.train_step(shaped(dx, dy, k, rows, valid));
        CHECK(a.loss == w.loss);
        CHECK(b.loss == w.loss);
        CHECK(a.rows == 2.0 * valid);
        CHECK(b.weight == w.weight);
      }
      const auto p = want.parameters();
      CHECK(ferry_test::max_abs(p) < 1e3);  // finite (NaN fails)
      CHECK(direct.parameters() == p);
      CHECK(graphed.parameters() == p);
      CHECK(graphed.replica_at(1).download_params() == p);
      const auto ev = shaped(dx, dy, 3, shapes[3].first, shapes[3].second);
      CHECK(graphed.evaluate(ev).loss == want.evaluate(shaped(cx, cy, 3, shapes[3].first, shapes[3].second)).loss);
    });
}

TEST_CASE("CUDA graph steps fed by distribute's staging thread onto the trainer's streams: the epochs of "
          "direct steps, a capture per slice shape (full, padded)" * doctest::timeout(120)) {
  const padded_epochs pe;
  const auto& [d, rows, o, ref, per_epoch] = pe;
  for (const int progress : {0, 4}) {
    sim_run(53, progress, [&] {
      auto run = [&](bool graphs, std::vector<tr::step_stats>& epochs) {
        tr::trainer_options go = o;
        go.graphs = graphs;
        nccl_trainer t(cfg, go, ferry::nccl_communicator::local({0, 1}), {{0, nullptr}, {1, nullptr}});
        std::vector<ferry::cuda_stream> streams{t.replica_at(0).backend().stream(), t.replica_at(1).backend().stream()};
        auto p = ferry::from_range(rows) | ferry::batch(std::size_t(B)) |
                 ferry::distribute(ferry::cuda::devices({0, 1}, streams),
                                   {.remainder = ferry::remainder_policy::pad, .steps_ahead = 3, .staging_thread = true});
        for (int e = 0; e < 2; ++e) {
          std::size_t k = 0;
          for (auto& step : p) {
            t.train_step_async(step);
            ++k;
          }
          CHECK(k == per_epoch);
          epochs.push_back(t.take_stats());
          p.rewind();
        }
        // The padded batch's 44 rows: replica 0's 32 all valid (its one shape), replica 1's 12.
        CHECK(t.replica_at(0).graphs_captured() == (graphs ? 1u : 0u));
        CHECK(t.replica_at(1).graphs_captured() == (graphs ? 2u : 0u));
        return t.parameters();
      };
      std::vector<tr::step_stats> direct, graphed;
      const auto pd = run(false, direct);
      const auto pg = run(true, graphed);
      CHECK(pg == pd);
      for (std::size_t e = 0; e < 2; ++e) {
        CHECK(graphed[e].loss == direct[e].loss);
        CHECK(graphed[e].rows == direct[e].rows);
        check_close(graphed[e], combine(ref, e * per_epoch, (e + 1) * per_epoch));
      }
      CHECK(max_abs_diff(pg, ref.params) < 1e-3);
    });
  }
}

TEST_CASE("a CUDA graph step whose capture fails: the error, no stream left capturing, a spent trainer that "
          "shuts down without a hang" * doctest::timeout(120)) {
  const auto d = sim_ref::make_blobs(B * 8, classes, 6);
  for (const int progress : {0, 3}) {
    sim_run(57, progress, [&] {
      device_copies dc;
      float* dx[2] = {dc.put(0, d.x), dc.put(1, d.x)};
      std::int32_t* dy[2] = {dc.put(0, d.y), dc.put(1, d.y)};
      const int per = B / 2;
      nccl_trainer t(cfg, {.seed = 3, .max_rows = per, .graphs = true}, ferry::nccl_communicator::local({0, 1}),
                     {{0, nullptr}, {1, nullptr}});
      t.train_step(shaped(dx, dy, 0, per, per));
      // A new shape: replica 1's capture meets a failing GEMM (cuBLAS checks its arguments
      // when called, so a capture sees such errors); replica 0 has captured and launched
      // its graph, whose all-reduce waits for replica 1.
      sim::fail_blas(1, 2, CUBLAS_STATUS_INVALID_VALUE);
      std::string what;
      try {
        t.train_step(shaped(dx, dy, 1, per - 1, per - 1));
      } catch (const ferry::error& e) {
        what = e.what();
      }
      CHECK(what.find("cublasSgemm") != std::string::npos);
      CHECK(what.find("device 1") != std::string::npos);
      for (int r = 0; r < 2; ++r) {
        cudaStreamCaptureStatus cs = cudaStreamCaptureStatusActive;
        REQUIRE(cudaStreamIsCapturing(t.replica_at(r).backend().stream(), &cs) ==
                cudaSuccess);
        CHECK(cs == cudaStreamCaptureStatusNone);
      }
      CHECK(t.replica_at(0).graphs_captured() == 2);
      CHECK(t.replica_at(1).graphs_captured() == 1);
      CHECK_THROWS_WITH_AS(t.train_step(shaped(dx, dy, 2, per, per)), doctest::Contains("build a new trainer"),
                           ferry::error);
    });
  }
}

TEST_CASE("a replayed CUDA graph whose launch fails on one replica: the error, then a spent trainer that shuts "
          "down without a hang" * doctest::timeout(120)) {
  const auto d = sim_ref::make_blobs(B * 8, classes, 6);
  for (const bool async : {false, true})
    for (const int progress : {0, 3}) {
      sim_run(59, progress, [&] {
        CAPTURE(async);
        device_copies dc;
        float* dx[2] = {dc.put(0, d.x), dc.put(1, d.x)};
        std::int32_t* dy[2] = {dc.put(0, d.y), dc.put(1, d.y)};
        const int per = B / 2;
        nccl_trainer t(cfg, {.seed = 3, .max_rows = per}, ferry::nccl_communicator::local({0, 1}),
                       {{0, nullptr}, {1, nullptr}});  // graphs: the default
        t.train_step(shaped(dx, dy, 0, per, per));    // captured and launched
        // The replay of the same shape: replica 1's launch fails, while replica 0's graph,
        // whose all-reduce waits for replica 1, is enqueued.
        sim::fail_graph_launch(1, 1, cudaErrorLaunchFailure);
        std::string what;
        try {
          if (async) {
            t.train_step_async(shaped(dx, dy, 1, per, per));
            (void)t.take_stats();
          } else {
            (void)t.train_step(shaped(dx, dy, 1, per, per));
          }
        } catch (const ferry::error& e) {
          what = e.what();
        }
        CHECK(what.find("cudaGraphLaunch") != std::string::npos);
        CHECK(what.find("device 1") != std::string::npos);
        CHECK(t.replica_at(0).graphs_captured() == 1);
        CHECK(t.replica_at(1).graphs_captured() == 1);
        CHECK_THROWS_WITH_AS(t.train_step(shaped(dx, dy, 2, per, per)), doctest::Contains("build a new trainer"),
                             ferry::error);
      });  // the trainer goes: replica 0's all-reduce must be aborted, or its stream never drains
    }
}
