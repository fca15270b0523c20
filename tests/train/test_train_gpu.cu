// The trainer's GPU backend (cuBLAS + Thrust CUDA on the replica's stream) against the host
// backend, the mirrored trainer with NCCL, one rank per local GPU, and the real pipeline
// (batch | prefetch | distribute(cuda::devices) onto the trainer's own streams) feeding it;
// asynchronous steps against synchronous ones, counting host waits (sync_counter.cpp).
// Exits 77 (SKIP) with a reason when no CUDA device is usable; must pass on a GPU machine.
#include <cuda_runtime.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <tuple>
#include <vector>

#include "blobs.hpp"
#include "common/close.hpp"
#include "cuda/sync_counter.hpp"
#include "ferry/cuda/runtime.hpp"
#include "ferry/collective/nccl.hpp"
#include "ferry/cuda/devices.hpp"
#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/prefetch.hpp"
#include "ferry/train/gpu_backend.cuh"
#include "ferry/train/host_trainer.hpp"

namespace tr = ferry::train;

static int failures = 0;
#define EXPECT(cond, ...)                                   \
  do {                                                      \
    if (!(cond)) {                                          \
      ++failures;                                           \
      std::printf("FAILED %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::printf(__VA_ARGS__);                             \
      std::printf("\n");                                    \
    }                                                       \
  } while (0)

// A CUDA call of the test itself that fails: counted, and named with its status.
#define EXPECT_CUDA(call)                                         \
  do {                                                            \
    const cudaError_t status_ = (call);                           \
    EXPECT(status_ == cudaSuccess, "%s: %s", #call, cudaGetErrorName(status_)); \
  } while (0)

template <class T>
static T* to_device(const std::vector<T>& v) {
  T* p = nullptr;
  EXPECT_CUDA(cudaMalloc(&p, v.size() * sizeof(T)));
  EXPECT_CUDA(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  // A pageable cudaMemcpy may return before its DMA ends, and it is on the legacy stream,
  // which the replicas' non-blocking streams do not wait for.
  EXPECT_CUDA(cudaDeviceSynchronize());
  return p;
}
using ferry_test::rel_diff;
using ferry_test::worst;

// Every local GPU, one replica each on a stream of its own backend's.
struct all_gpus {
  std::vector<int> devs;
  std::vector<tr::replica_context> ctx;
  explicit all_gpus(int count) {
    for (int i = 0; i < count; ++i) {
      devs.push_back(i);
      ctx.push_back({i, nullptr});
    }
  }
};

int main() {
  if (!ferry::cuda::available()) {
    std::printf("SKIP: no usable CUDA device: %s\n", ferry::cuda::unavailable_reason().c_str());
    return 77;
  }
  const int count = ferry::cuda::device_count();
  const int dim = 32, classes = 5, B = 64, steps = 60;
  const tr::mlp_config cfg{{dim, 48, 24, classes}, {1.0f, 2.0f, 0.5f, 1.0f, 1.5f}};
  const train_test::blobs d = train_test::make_blobs(B * steps, dim, classes, 3);
  float* dx = to_device(d.x);
  std::int32_t* dy = to_device(d.y);

  // 1. One replica each: gradients of the first step, then the loss curve.
  {
    const tr::mlp_layout lay(cfg);
    const auto p0 = tr::init_params(lay, 7);
    tr::replica<tr::host_backend> h(cfg, {}, p0, B, tr::replica_context{});
    tr::replica<tr::gpu_backend> g(cfg, {}, p0, B, tr::replica_context{0, nullptr});
    h.forward_backward({d.x.data(), d.y.data(), B, B - 3});
    g.forward_backward({dx, dy, B, B - 3});
    std::vector<float> gh(h.gradient_buffer().begin(), h.gradient_buffer().end());
    std::vector<float> gg(lay.grad_floats());
    g.backend().download(gg.data(), g.gradient_buffer().data(), gg.size() * sizeof(float));
    // NaN (so the check fails) if either buffer holds a NaN or an infinity.
    const double grad_diff = ferry_test::max_abs_diff(gh, gg), scale = ferry_test::max_abs(gh);
    EXPECT(scale > 0, "the host gradient is all zeros (or not finite): scale %g", scale);
    EXPECT(grad_diff <= 1e-4 * scale + 1e-5, "gradients differ: worst %g (scale %g)", grad_diff, scale);

    tr::host_trainer ht(cfg, {.seed = 7, .max_rows = B}, 1);
    tr::mirrored_trainer<tr::gpu_backend, ferry::solo_communicator> gt(
        cfg, {.seed = 7, .max_rows = B}, std::vector<ferry::solo_communicator>(1),
        {tr::replica_context{0, nullptr}});
    double worst_loss = 0;
    for (int s = 0; s < steps; ++s) {
      const std::size_t o = std::size_t(s) * B;
      const tr::replica_input hi{d.x.data() + o * dim, d.y.data() + o, B, B};
      const tr::replica_input gi{dx + o * dim, dy + o, B, B};
      const double lh = ht.train_step(std::span(&hi, 1)).loss;
      const double lg = gt.train_step(std::span(&gi, 1)).loss;
      EXPECT(std::isfinite(lh) && std::isfinite(lg), "step %d: loss %g on the host, %g on the GPU", s, lh, lg);
      worst_loss = worst(worst_loss, rel_diff(lg, lh));
    }
    EXPECT(worst_loss < 1e-3, "loss curves differ: worst relative %g", worst_loss);
    std::printf("gpu vs host: gradient max diff %g, loss curve max rel diff %g over %d steps\n",
                grad_diff, worst_loss, steps);
  }

  // 2. NCCL, one rank per local GPU, against one host replica with the same global batch.
  {
    const all_gpus g(count);
    const auto& devs = g.devs;
    const auto& ctx = g.ctx;
    const int per = B / count;  // B is a multiple of 1, 2, 4, 8
    tr::mirrored_trainer<tr::gpu_backend, ferry::nccl_communicator> gt(
        cfg, {.seed = 9, .max_rows = per}, ferry::nccl_communicator::local(devs), ctx);
    tr::host_trainer ht(cfg, {.seed = 9, .max_rows = B}, 1);
    std::vector<float*> rx(count);
    std::vector<std::int32_t*> ry(count);
    for (int r = 0; r < count; ++r) {  // every device gets its own copy of the data
      EXPECT_CUDA(cudaSetDevice(r));
      rx[r] = to_device(d.x);
      ry[r] = to_device(d.y);
    }
    double worst_loss = 0;
    for (int s = 0; s < steps; ++s) {
      const std::size_t o = std::size_t(s) * B;
      std::vector<tr::replica_input> gi;
      for (int r = 0; r < count; ++r)
        gi.push_back({rx[r] + (o + std::size_t(r) * per) * dim, ry[r] + o + std::size_t(r) * per, per, per});
      const tr::replica_input hi{d.x.data() + o * dim, d.y.data() + o, B, B};
      const double lh = ht.train_step(std::span(&hi, 1)).loss;
      const double lg = gt.train_step(gi).loss;
      EXPECT(std::isfinite(lh) && std::isfinite(lg), "step %d: loss %g on the host, %g on the GPUs", s, lh, lg);
      worst_loss = worst(worst_loss, rel_diff(lg, lh));
    }
    EXPECT(worst_loss < 1e-3, "nccl trainer loss differs from host: %g", worst_loss);
    const auto p0 = gt.parameters();
    for (int r = 1; r < count; ++r)
      EXPECT(gt.replica_at(r).download_params() == p0, "replica %d diverged", r);
    std::printf("nccl: %d rank(s), loss curve max rel diff vs host %g\n", count, worst_loss);
  }
  // 3. The real pipeline: distribute(cuda::devices{all}, onto the GPU trainer's streams)
  //    against distribute(host_replicas{1}) into a host trainer, the same rows; the last
  //    batch is short and padded, so valid() < size() reaches the GPU too. With and
  //    without CUDA graphs (the graphs read the step's blocks through their own copies).
  for (const bool graphs : {false, true}) {
    constexpr int D = 32;
    static_assert(D == dim);
    using row = std::tuple<std::array<float, D>, std::int32_t>;
    const std::size_t n = std::size_t(B) * 20 - 20;
    std::vector<row> rows(n);
    for (std::size_t i = 0; i < n; ++i) {
      for (int k = 0; k < D; ++k) std::get<0>(rows[i])[k] = d.x[i * D + k];
      std::get<1>(rows[i]) = d.y[i];
    }
    const all_gpus g(count);
    const auto& devs = g.devs;
    const auto& ctx = g.ctx;
    const int per = B / count;
    tr::mirrored_trainer<tr::gpu_backend, ferry::nccl_communicator> gt(
        cfg, {.seed = 11, .max_rows = per, .graphs = graphs}, ferry::nccl_communicator::local(devs), ctx);
    tr::host_trainer ht(cfg, {.seed = 11, .max_rows = B}, 1);
    std::vector<ferry::cuda_stream> streams;
    for (int r = 0; r < count; ++r) streams.push_back(gt.replica_at(r).backend().stream());
    auto gp = ferry::from_range(rows) | ferry::batch(std::size_t(B)) | ferry::prefetch(2) |
              ferry::distribute(ferry::cuda::devices(devs, streams),
                                {.remainder = ferry::remainder_policy::pad});
    auto hp = ferry::from_range(rows) | ferry::batch(std::size_t(B)) |
              ferry::distribute(ferry::host_replicas{1}, {.remainder = ferry::remainder_policy::pad});
    double worst_loss = 0;
    int steps_done = 0;
    double last_rows = 0;
    for (int epoch = 0; epoch < 2; ++epoch) {
      for (;;) {
        auto gs = gp.next();
        auto hs = hp.next();
        EXPECT(bool(gs) == bool(hs), "the two pipelines yield different step counts");
        if (!gs || !hs) break;
        const auto lg = gt.train_step(*gs);
        const auto lh = ht.train_step(*hs);
        EXPECT(lg.rows == lh.rows, "step %d: %g rows on the GPU, %g on the host", steps_done,
               lg.rows, lh.rows);
        last_rows = lg.rows;
        EXPECT(std::isfinite(lh.loss) && std::isfinite(lg.loss), "step %d: loss %g on the host, %g on the GPUs",
               steps_done, lh.loss, lg.loss);
        worst_loss = worst(worst_loss, rel_diff(lg.loss, lh.loss));
        ++steps_done;
      }
      gp.rewind();
      hp.rewind();
    }
    EXPECT(steps_done == 2 * 20, "%d steps, expected 40", steps_done);
    EXPECT(last_rows == double(B - 20), "the padded last step counted %g rows", last_rows);
    EXPECT(worst_loss < 1e-3, "pipeline-fed GPU loss differs from host: %g", worst_loss);
    std::printf("pipeline -> %d GPU replica(s)%s: %d steps, loss curve max rel diff vs host %g\n",
                count, graphs ? " with CUDA graphs" : "", steps_done, worst_loss);
  }
  // 4. train_step_async: train_step's weights bit for bit, take_stats the statistics of the
  //    same steps' train_step combined by hand; no host wait in the steps, one in the take.
  {
    using solo_trainer = tr::mirrored_trainer<tr::gpu_backend, ferry::solo_communicator>;
    const tr::trainer_options opts{.seed = 13, .max_rows = B};
    solo_trainer sync(cfg, opts, std::vector<ferry::solo_communicator>(1), {tr::replica_context{0, nullptr}});
    solo_trainer async(cfg, opts, std::vector<ferry::solo_communicator>(1), {tr::replica_context{0, nullptr}});
    double loss_sum = 0, weight = 0, correct = 0, rows = 0;
    for (int s = 0; s < steps; ++s) {
      const std::size_t o = std::size_t(s) * B;
      const tr::replica_input gi{dx + o * dim, dy + o, B, B};
      const auto st = sync.train_step(std::span(&gi, 1));
      loss_sum += st.loss * st.weight;
      weight += st.weight;
      correct += st.accuracy * st.rows;
      rows += st.rows;
    }
    const auto s0 = ferry_test::count_host_syncs();
    for (int s = 0; s < steps; ++s) {
      const std::size_t o = std::size_t(s) * B;
      const tr::replica_input gi{dx + o * dim, dy + o, B, B};
      async.train_step_async(std::span(&gi, 1));
    }
    const auto s1 = ferry_test::count_host_syncs();
    const auto got = async.take_stats();
    const auto s2 = ferry_test::count_host_syncs();
    EXPECT(s1.stream == s0.stream && s1.event == s0.event && s1.device == s0.device,
           "%d async steps waited on the host: %ld stream, %ld event, %ld device syncs", steps,
           s1.stream - s0.stream, s1.event - s0.event, s1.device - s0.device);
    EXPECT(s2.stream - s1.stream == 1 && s2.event == s1.event && s2.device == s1.device,
           "take_stats: %ld stream, %ld event, %ld device syncs (expected 1, 0, 0)",
           s2.stream - s1.stream, s2.event - s1.event, s2.device - s1.device);
    EXPECT(rows == double(B) * steps && got.rows == rows, "rows: %g taken, %g by hand", got.rows, rows);
    EXPECT(got.weight == weight, "weight: %g taken, %g by hand", got.weight, weight);
    const double want = weight > 0 ? loss_sum / weight : 0.0;
    EXPECT(rel_diff(got.loss, want) <= 1e-6, "loss: %.9g taken, %.9g by hand", got.loss, want);
    EXPECT(rel_diff(got.accuracy, correct / rows) <= 1e-12, "accuracy: %.9g taken, %.9g by hand",
           got.accuracy, correct / rows);
    EXPECT(async.parameters() == sync.parameters(), "async and sync steps left different weights");
    std::printf("async: %d steps, %ld host waits, take_stats loss %.6f (by hand %.6f)\n", steps,
                (s1.stream - s0.stream) + (s1.event - s0.event) + (s1.device - s0.device), got.loss, want);
  }
  // 5. CUDA graphs (trainer_options::graphs), NCCL over every GPU: the weights of direct
  //    steps over new data every step and three slice shapes (full, padded, short), one
  //    capture per shape and replica, no host wait in the asynchronous steps. The host
  //    time to enqueue a step, both ways, is printed (benchmarks/train measures the rest).
  {
    const all_gpus g(count);
    const auto& devs = g.devs;
    const auto& ctx = g.ctx;
    const int per = B / count;
    using nccl_trainer = tr::mirrored_trainer<tr::gpu_backend, ferry::nccl_communicator>;
    tr::trainer_options opts{.seed = 17, .max_rows = per, .graphs = false};
    nccl_trainer direct(cfg, opts, ferry::nccl_communicator::local(devs), ctx);
    opts.graphs = true;
    nccl_trainer graphed(cfg, opts, ferry::nccl_communicator::local(devs), ctx);
    std::vector<float*> rx(count);
    std::vector<std::int32_t*> ry(count);
    for (int r = 0; r < count; ++r) {
      EXPECT_CUDA(cudaSetDevice(r));
      rx[r] = to_device(d.x);
      ry[r] = to_device(d.y);
    }
    EXPECT_CUDA(cudaSetDevice(0));
    auto slices = [&](int s) {
      const int rows = s % 7 == 6 ? per - 1 : per, valid = s % 5 == 4 ? rows - 2 : rows;
      std::vector<tr::replica_input> in;
      const std::size_t o = std::size_t(s) * B;
      for (int r = 0; r < count; ++r)
        in.push_back({rx[r] + (o + std::size_t(r) * per) * dim, ry[r] + o + std::size_t(r) * per, rows, valid});
      return in;
    };
    double host_us[2] = {0, 0};
    ferry_test::host_syncs waited{};
    for (int k = 0; k < 2; ++k) {
      nccl_trainer& t = k ? graphed : direct;
      const auto s0 = ferry_test::count_host_syncs();
      const auto t0 = std::chrono::steady_clock::now();
      for (int s = 0; s < steps; ++s) t.train_step_async(slices(s));
      host_us[k] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / steps;
      const auto s1 = ferry_test::count_host_syncs();
      if (k) waited = {.device = s1.device - s0.device, .stream = s1.stream - s0.stream, .event = s1.event - s0.event};
      t.take_stats();
    }
    EXPECT(waited.stream == 0 && waited.event == 0 && waited.device == 0,
           "%d graph steps waited on the host: %ld stream, %ld event, %ld device syncs", steps, waited.stream,
           waited.event, waited.device);
    const auto pd = direct.parameters(), pg = graphed.parameters();
    const double diff = ferry_test::max_abs_diff(pd, pg), scale = ferry_test::max_abs(pd);
    EXPECT(scale > 0 && diff <= 1e-6 * scale, "graph steps' weights differ from direct steps': %g (scale %g)", diff,
           scale);
    for (int r = 0; r < count; ++r) {
      EXPECT(graphed.replica_at(r).graphs_captured() == 4, "replica %d captured %llu graphs, expected 4 shapes", r,
             static_cast<unsigned long long>(graphed.replica_at(r).graphs_captured()));
      if (r) EXPECT(graphed.replica_at(r).download_params() == pg, "graph replica %d diverged", r);
    }
    std::printf("graphs: %d steps, weights %s direct steps' (max diff %g), %llu captures per replica, "
                "host enqueue %.1f us/step direct, %.1f us/step graphs (warm-up and captures included)\n",
                steps, diff == 0 ? "bit for bit" : "close to", diff,
                static_cast<unsigned long long>(graphed.replica_at(0).graphs_captured()), host_us[0], host_us[1]);
    // 6. evaluate_async: no host wait per batch, take_eval the weighted mean of the same
    //    batches' evaluate().
    {
      double loss_sum = 0, weight = 0, correct = 0, rows = 0;
      for (int s = 0; s < 20; ++s) {
        const auto e = direct.evaluate(slices(s));
        loss_sum += e.loss * e.weight;
        weight += e.weight;
        correct += e.accuracy * e.rows;
        rows += e.rows;
      }
      (void)direct.take_eval();
      const auto e0 = ferry_test::count_host_syncs();
      for (int s = 0; s < 20; ++s) direct.evaluate_async(slices(s));
      const auto e1 = ferry_test::count_host_syncs();
      const auto got = direct.take_eval();
      EXPECT(e1.stream == e0.stream && e1.event == e0.event && e1.device == e0.device,
             "20 async evaluations waited on the host: %ld stream, %ld event, %ld device syncs",
             e1.stream - e0.stream, e1.event - e0.event, e1.device - e0.device);
      EXPECT(got.rows == rows && got.weight == weight, "take_eval: %g rows, weight %g; by hand %g, %g", got.rows,
             got.weight, rows, weight);
      EXPECT(rel_diff(got.loss, loss_sum / weight) <= 1e-6, "take_eval loss %.9g, by hand %.9g", got.loss,
             loss_sum / weight);
      EXPECT(rel_diff(got.accuracy, correct / rows) <= 1e-12, "take_eval accuracy %.9g, by hand %.9g", got.accuracy,
             correct / rows);
      std::printf("evaluate_async: 20 batches, %ld host waits, take_eval loss %.6f (by hand %.6f)\n",
                  (e1.stream - e0.stream) + (e1.event - e0.event) + (e1.device - e0.device), got.loss,
                  loss_sum / weight);
    }
    for (int r = 0; r < count; ++r) {
      EXPECT_CUDA(cudaSetDevice(r));
      EXPECT_CUDA(cudaFree(rx[r]));
      EXPECT_CUDA(cudaFree(ry[r]));
    }
    EXPECT_CUDA(cudaSetDevice(0));
  }
  std::printf("%s\n", failures ? "FAILED" : "OK");
  return failures ? 1 : 0;
}
