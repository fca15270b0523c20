// The trainer on the host backend: gradients against finite differences, training a
// separable problem with 1, 2 and 4 replicas (same weights up to reassociation), run-to-run
// determinism, the distribute() step adapter, and input errors.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/close.hpp"
#include "common/doubles.hpp"
#include "ferry/collective/communicator.hpp"
#include "ferry/collective/thread_collective.hpp"
#include "ferry/train/host_trainer.hpp"

using namespace std::chrono_literals;
namespace tr = ferry::train;

namespace {

struct dataset {
  int dim, classes;
  std::vector<float> x;
  std::vector<std::int32_t> y;
  std::size_t size() const { return y.size(); }
};

// `classes` Gaussian blobs around well separated centres: linearly separable.
dataset blobs(int n, int dim, int classes, std::uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> centres(std::size_t(classes) * dim);
  for (auto& c : centres) c = 4.0f * nd(g);
  dataset d{dim, classes, {}, {}};
  for (int i = 0; i < n; ++i) {
    const int c = i % classes;
    d.y.push_back(c);
    for (int k = 0; k < dim; ++k) d.x.push_back(centres[std::size_t(c) * dim + k] + 0.3f * nd(g));
  }
  return d;
}

// Splits rows [first, first + B) into `reps` equal contiguous slices.
std::vector<tr::replica_input> split(const dataset& d, std::size_t first, int B, int reps) {
  std::vector<tr::replica_input> in;
  const int per = B / reps;
  for (int r = 0; r < reps; ++r) {
    const std::size_t row = first + std::size_t(r) * per;
    in.push_back({d.x.data() + row * d.dim, d.y.data() + row, per, per});
  }
  return in;
}

std::vector<float> train(const dataset& d, const tr::mlp_config& cfg, tr::trainer_options o,
                         int reps, int B, int epochs, double* last_loss = nullptr) {
  o.max_rows = B / reps;
  tr::host_trainer t(cfg, o, reps);
  double loss = 0;
  for (int e = 0; e < epochs; ++e)
    for (std::size_t first = 0; first + B <= d.size(); first += B)
      loss = t.train_step(split(d, first, B, reps)).loss;
  if (last_loss) *last_loss = loss;
  return t.parameters();
}

// L(p) = the weighted mean loss of one slice, through a 1-replica trainer.
double loss_at(tr::replica<tr::host_backend>& rep, const std::vector<float>& p,
               const tr::replica_input& in) {
  rep.upload_params(p);
  rep.forward_backward(in);
  return rep.read_stats().loss;
}

// Failures on demand for host replicas. The test sets `faults` between trainer calls; during
// a call only replica `rank`'s thread reads and counts it down (the trainer's hand-off to
// its threads orders the two).
struct fault_plan {
  int rank = -1;
  int gemms_before_failure = -1;  // that replica's GEMMs to run before one throws; -1: none
  int failing_uploads = 0;        // that replica's next uploads that throw
};
fault_plan faults;

// host_backend whose replica (replica_context::device = its index) fails as `faults` says.
class faulty_backend : public tr::host_backend {
 public:
  explicit faulty_backend(const tr::replica_context& c) : rank_(c.device) {}
  void gemm(bool ta, bool tb, int m, int n, int k, const float* a, int lda, const float* b,
            int ldb, float beta, float* c, int ldc) {
    if (rank_ == faults.rank && faults.gemms_before_failure >= 0 &&
        faults.gemms_before_failure-- == 0)
      throw std::runtime_error("injected GEMM failure");
    host_backend::gemm(ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc);
  }
  void upload(void* dst, const void* src, std::size_t bytes) {
    if (rank_ == faults.rank && faults.failing_uploads > 0) {
      --faults.failing_uploads;
      throw std::runtime_error("injected upload failure");
    }
    host_backend::upload(dst, src, bytes);
  }

 private:
  int rank_;
};
using faulty_trainer = tr::mirrored_trainer<faulty_backend, ferry::thread_communicator>;

// 4 replicas built with the generic constructor from the caller's thread_group.
std::vector<ferry::thread_communicator> comms_of(ferry::thread_group& g) {
  std::vector<ferry::thread_communicator> c;
  for (int r = 0; r < g.size(); ++r) c.push_back(g.communicator(r));
  return c;
}
const std::vector<tr::replica_context> four_contexts{{0, nullptr}, {1, nullptr}, {2, nullptr},
                                                      {3, nullptr}};

template <class Trainer>
void check_replicas_agree(Trainer& t) {
  const auto p0 = t.replica_at(0).download_params();
  for (int r = 1; r < t.replicas(); ++r) {
    INFO("replica " << r);
    CHECK(t.replica_at(r).download_params() == p0);
  }
  for (const int r : {-1, t.replicas(), t.replicas() + 7})
    CHECK_THROWS_WITH_AS(t.replica_at(r), doctest::Contains(("replica_at: replica " + std::to_string(r) + " of").c_str()),
                         ferry::config_error);
}

}  // namespace

TEST_CASE("gradients match central finite differences (host backend)") {
  for (bool weighted : {false, true}) {
    tr::mlp_config cfg{{5, 7, 6, 3}, {}};
    if (weighted) cfg.class_weights = {0.5f, 2.0f, 1.25f};
    const tr::mlp_layout lay(cfg);
    auto p = tr::init_params(lay, 42);
    for (std::size_t l = 0; l < lay.layers(); ++l)  // non-zero biases exercise their gradient
      for (int j = 0; j < lay.out(l); ++j) p[lay.b_off[l] + j] = 0.05f * float(j + 1);
    std::mt19937 g(7);
    std::normal_distribution<float> nd;
    const int n = 9, valid = 8;  // the last row is padding: no loss, no gradient
    std::vector<float> x(std::size_t(n) * 5);
    for (auto& v : x) v = nd(g);
    std::vector<std::int32_t> y(n);
    for (int i = 0; i < n; ++i) y[i] = i % 3;
    tr::replica<tr::host_backend> rep(cfg, {}, p, n);
    const tr::replica_input in{x.data(), y.data(), n, valid};
    rep.forward_backward(in);
    const auto G = rep.gradient_buffer();
    const float W = G[lay.params + tr::mlp_layout::weight_sum];
    float wsum = 0;
    for (int i = 0; i < valid; ++i) wsum += weighted ? cfg.class_weights[y[i]] : 1.0f;
    CHECK(W == doctest::Approx(wsum));
    CHECK(G[lay.params + tr::mlp_layout::valid] == valid);
    std::vector<float> analytic(G.begin(), G.begin() + lay.params);
    for (auto& a : analytic) a /= W;

    std::size_t checked = 0, bad = 0;
    double worst = 0;
    for (std::size_t i = 0; i < lay.params; ++i) {
      const float h = 1e-2f;
      auto pp = p, pm = p;
      pp[i] += h;
      pm[i] -= h;
      const double fd = (loss_at(rep, pp, in) - loss_at(rep, pm, in)) / (2.0 * h);
      const double err = std::abs(fd - analytic[i]);  // NaN if either is: counted bad below
      worst = ferry_test::worst(worst, err);
      if (!(err <= 2e-3 + 2e-2 * std::abs(fd))) ++bad;
      ++checked;
    }
    INFO("weighted=" << weighted << " worst abs error " << worst);
    CHECK(checked == lay.params);
    CHECK(bad == 0);
  }
}

TEST_CASE("a separable problem trains to near-zero loss; 1, 2, 4 replicas agree" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(60s, "separable training");
  const dataset d = blobs(512, 8, 4, 3);
  const tr::mlp_config cfg{{8, 16, 4}, {}};
  for (auto kind : {tr::optimizer_kind::sgd, tr::optimizer_kind::adam}) {
    tr::trainer_options o;
    o.seed = 11;
    o.opt.kind = kind;
    o.opt.lr = kind == tr::optimizer_kind::sgd ? 0.05f : 0.01f;
    double loss1 = 0, loss2 = 0, loss4 = 0;
    const auto w1 = train(d, cfg, o, 1, 32, 6, &loss1);
    const auto w2 = train(d, cfg, o, 2, 32, 6, &loss2);
    const auto w4 = train(d, cfg, o, 4, 32, 6, &loss4);
    INFO("optimizer " << (kind == tr::optimizer_kind::sgd ? "sgd" : "adam"));
    CHECK(loss1 < 0.02);
    CHECK(loss2 < 0.02);
    CHECK(loss4 < 0.02);
    // NaN, so the checks fail, if a weight is not finite (tests/common/close.hpp).
    const double d2 = ferry_test::max_abs_diff(w1, w2), d4 = ferry_test::max_abs_diff(w1, w4),
                 scale = ferry_test::max_abs(w1);
    INFO("max |w1 - w2| " << d2 << ", max |w1 - w4| " << d4 << ", max |w| " << scale);
    CHECK(d2 < 1e-3 * scale);
    CHECK(d4 < 1e-3 * scale);
    CHECK(w2 != tr::init_params(tr::mlp_layout(cfg), o.seed));  // it did train
  }
}

TEST_CASE("the same seed gives the same weights run to run, bit for bit" *
          doctest::timeout(30)) {
  ferry_test::watchdog wd(30s, "determinism");
  const dataset d = blobs(256, 6, 3, 9);
  const tr::mlp_config cfg{{6, 10, 3}, {}};
  tr::trainer_options o;
  o.seed = 5;
  for (int reps : {1, 2, 3}) {
    const auto a = train(d, cfg, o, reps, 24, 2);
    const auto b = train(d, cfg, o, reps, 24, 2);
    CHECK(a == b);
  }
  o.seed = 6;
  CHECK(train(d, cfg, o, 1, 24, 1) != train(d, cfg, {.seed = 5}, 1, 24, 1));
}

TEST_CASE("evaluate reduces loss and accuracy across replicas and skips padding" *
          doctest::timeout(30)) {
  ferry_test::watchdog wd(30s, "evaluate");
  const dataset d = blobs(64, 4, 2, 1);
  const tr::mlp_config cfg{{4, 8, 2}, {}};
  tr::host_trainer one(cfg, {.seed = 3, .max_rows = 64}, 1);
  tr::host_trainer two(cfg, {.seed = 3, .max_rows = 32}, 2);
  const auto s1 = one.evaluate(split(d, 0, 64, 1));
  auto in2 = split(d, 0, 64, 2);
  const auto s2 = two.evaluate(in2);
  CHECK(s1.rows == 64);
  CHECK(s2.rows == 64);
  CHECK(s2.loss == doctest::Approx(s1.loss).epsilon(1e-5));
  CHECK(s2.accuracy == doctest::Approx(s1.accuracy));
  in2[1].valid = 10;  // 22 padding rows: not counted
  CHECK(two.evaluate(in2).rows == 42);
}

namespace {
// The shape distribute() hands out (ferry::step / ferry::replica_batch), over host arrays.
struct fake_replica_batch {
  std::span<const std::array<float, 4>> x;
  std::span<const std::int32_t> y;
  std::size_t valid_rows;
  std::size_t size() const { return y.size(); }
  std::size_t valid() const { return valid_rows; }
  int device() const { return -1; }
  void* stream() const { return nullptr; }
  template <std::size_t I>
  auto field() const {
    if constexpr (I == 0) return x; else return y;
  }
};
struct fake_step {
  std::vector<fake_replica_batch> rb;
  std::size_t replicas() const { return rb.size(); }
  fake_replica_batch& operator[](std::size_t r) { return rb[r]; }
};
}  // namespace

TEST_CASE("train_step takes a distribute() step" * doctest::timeout(30)) {
  ferry_test::watchdog wd(30s, "step adapter");
  const dataset d = blobs(64, 4, 2, 2);
  const tr::mlp_config cfg{{4, 8, 2}, {}};
  tr::host_trainer a(cfg, {.seed = 1, .max_rows = 32}, 2);
  tr::host_trainer b(cfg, {.seed = 1, .max_rows = 32}, 2);
  auto* rows = reinterpret_cast<const std::array<float, 4>*>(d.x.data());
  fake_step st{{{{rows, 32}, {d.y.data(), 32}, 32}, {{rows + 32, 32}, {d.y.data() + 32, 32}, 32}}};
  const auto sa = a.train_step(st);
  const auto sb = b.train_step(split(d, 0, 64, 2));
  CHECK(sa.loss == sb.loss);
  CHECK(a.parameters() == b.parameters());
  fake_step wrong{{st.rb[0]}};
  CHECK_THROWS_AS(a.train_step(wrong), ferry::config_error);
}

TEST_CASE("bad configurations and slices are config_errors; the trainer stays usable" *
          doctest::timeout(30)) {
  ferry_test::watchdog wd(30s, "errors");
  CHECK_THROWS_AS(tr::mlp_layout(tr::mlp_config{{4}, {}}), ferry::config_error);
  CHECK_THROWS_AS(tr::mlp_layout(tr::mlp_config{{4, 0, 2}, {}}), ferry::config_error);
  CHECK_THROWS_AS(tr::mlp_layout(tr::mlp_config{{4, 2}, {1.0f}}), ferry::config_error);
  CHECK_THROWS_AS(tr::mlp_layout(tr::mlp_config{{4, 2}, {1.0f, -1.0f}}), ferry::config_error);
  CHECK_THROWS_AS(tr::host_trainer(tr::mlp_config{{4, 2}, {}}, {.opt = {.lr = 0.0f}}, 1),
                  ferry::config_error);
  CHECK_THROWS_AS(tr::host_trainer(tr::mlp_config{{4, 2}, {}}, {}, 0), ferry::config_error);

  const dataset d = blobs(64, 4, 2, 4);
  tr::host_trainer t(tr::mlp_config{{4, 8, 2}, {}}, {.seed = 2, .max_rows = 16}, 2);
  CHECK_THROWS_AS(t.train_step(split(d, 0, 64, 2)), ferry::config_error);  // 32 > 16 rows
  CHECK_THROWS_AS(t.train_step(split(d, 0, 32, 1)), ferry::config_error);  // 1 slice for 2
  auto in = split(d, 0, 32, 2);
  in[0].valid = 17;
  CHECK_THROWS_AS(t.train_step(in), ferry::config_error);
  CHECK(t.train_step(split(d, 0, 32, 2)).rows == 32);
  CHECK(t.steps() == 1);
}

// Each fault of a slice in its own words: max_rows only when rows exceed it.
TEST_CASE("a bad slice's config_error names its fault: too many rows, more valid than rows, a negative "
          "count" * doctest::timeout(30)) {
  ferry_test::watchdog wd(30s, "slice messages");
  const dataset d = blobs(64, 4, 2, 4);
  tr::host_trainer t(tr::mlp_config{{4, 8, 2}, {}}, {.seed = 2, .max_rows = 16}, 2);
  auto message = [&](int rows, int valid) {
    auto in = split(d, 0, 32, 2);
    in[1].rows = rows;
    in[1].valid = valid;
    try {
      t.train_step(in);
    } catch (const ferry::config_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const auto has = [](const std::string& m, const char* what) {
    INFO(m);
    return m.find(what) != std::string::npos && m.find("replica 1's slice") != std::string::npos;
  };
  CHECK(has(message(17, 17), "has 17 rows; at most max_rows = 16 fit"));
  CHECK(has(message(17, 3), "at most max_rows = 16 fit"));
  CHECK(has(message(8, 9), "more valid rows than rows (8 rows, 9 valid)"));
  CHECK(has(message(-1, 0), "negative count (-1 rows, 0 valid)"));
  CHECK(has(message(4, -2), "negative count (4 rows, -2 valid)"));
  for (auto [rows, valid] : {std::pair{8, 9}, std::pair{-1, 0}, std::pair{4, -2}})
    CHECK(message(rows, valid).find("max_rows") == std::string::npos);
  CHECK(message(16, 16) == "no error");
  // The replica's own check (forward_backward, evaluate_local) in the same words.
  tr::replica<tr::host_backend> rep(tr::mlp_config{{4, 8, 2}, {}}, {}, tr::init_params(tr::mlp_layout({{4, 8, 2}, {}}), 1), 4);
  CHECK_THROWS_WITH_AS(rep.forward_backward({d.x.data(), d.y.data(), 3, 4}),
                       doctest::Contains("more valid rows than rows (3 rows, 4 valid)"), ferry::config_error);
  CHECK_THROWS_WITH_AS(rep.evaluate_local({d.x.data(), d.y.data(), 5, 5}),
                       doctest::Contains("has 5 rows; at most max_rows = 4 fit"), ferry::config_error);
}

// Field 0 of a step is read as floats only when it holds floats (a compile-time error
// otherwise: tests/compile_fail/train_inputs_not_float.cpp).
static_assert(tr::detail::float_row_size<float>::value == 1);
static_assert(tr::detail::float_row_size<float[5]>::value == 5);
static_assert(tr::detail::float_row_size<std::array<float, 3>>::value == 3);
static_assert(tr::detail::trainer_inputs_not_floats<const std::array<float, 784>>::floats == 784);
static_assert(tr::detail::float_row_size<std::array<std::int32_t, 3>>::value == 0);
static_assert(tr::detail::float_row_size<std::int32_t>::value == 0);
static_assert(tr::detail::float_row_size<double>::value == 0);
static_assert(tr::detail::float_row_size<std::array<double, 2>>::value == 0);
static_assert(tr::detail::float_row_size<std::array<std::array<float, 2>, 2>>::value == 0);

TEST_CASE("a batch of padding only leaves the weights unchanged" * doctest::timeout(30)) {
  ferry_test::watchdog wd(30s, "padding");
  const dataset d = blobs(16, 4, 2, 4);
  tr::host_trainer t(tr::mlp_config{{4, 8, 2}, {}}, {.seed = 2, .max_rows = 8}, 2);
  const auto before = t.parameters();
  auto in = split(d, 0, 16, 2);
  in[0].valid = in[1].valid = 0;
  const auto s = t.train_step(in);
  CHECK(s.rows == 0);
  CHECK(t.parameters() == before);
}

// Padding rows are never read (replica_input): whatever they hold (NaN, infinities, huge
// values, labels in or out of range), a step leaves the weights of the same step with zero
// padding, bit for bit, and those of one replica trained on the real rows alone, up to
// float reassociation. Random shapes: replicas, rows, valid rows (0 included), optimizers.
TEST_CASE("padding rows of NaN and Inf change nothing: zero padding's weights bit for bit, and a "
          "1-replica oracle's on the real rows (SGD, Adam, valid 0)" * doctest::timeout(60)) {
  ferry_test::watchdog wd(60s, "garbage padding");
  const float garbage[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(), 3e38f, -std::numeric_limits<float>::quiet_NaN()};
  for (std::uint32_t trial = 0; trial < 40; ++trial) {
    CAPTURE(trial);
    std::mt19937 g(1000 + trial);
    auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(g); };
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const int reps = uni(1, 3), per = uni(1, 8), dim = uni(1, 6), classes = uni(2, 4);
    tr::mlp_config cfg{{dim, uni(1, 9), classes}, {}};
    if (trial % 3 == 1)
      for (int c = 0; c < classes; ++c) cfg.class_weights.push_back(0.5f * float(uni(0, 4)));
    const auto kind = trial % 2 ? tr::optimizer_kind::adam : tr::optimizer_kind::sgd;
    tr::trainer_options o{.opt = {.kind = kind, .lr = kind == tr::optimizer_kind::sgd ? 0.1f : 0.01f,
                                  .momentum = trial % 4 == 0 ? 0.9f : 0.0f},
                          .seed = trial, .max_rows = per};
    CAPTURE(reps);
    CAPTURE(per);
    tr::host_trainer dirty(cfg, o, reps), clean(cfg, o, reps);
    o.max_rows = reps * per;
    tr::host_trainer oracle(cfg, o, 1);
    for (int step = 0; step < 4; ++step) {
      CAPTURE(step);
      // Per replica: its rows in a buffer of `per` rows, padding after the valid ones.
      std::vector<float> xd(std::size_t(reps * per * dim)), xc(xd.size()), xo;
      std::vector<std::int32_t> yd(std::size_t(reps * per)), yc(yd.size()), yo;
      std::vector<tr::replica_input> in_d, in_c;
      for (int r = 0; r < reps; ++r) {
        int rows = uni(0, per), valid = uni(0, rows);
        if (step == 1 && r == 0) valid = 0;  // a replica with padding only
        if (step == 2 && trial % 4 == 0) rows = per, valid = 0;  // a step with padding only
        for (int i = 0; i < per; ++i) {
          const std::size_t row = std::size_t(r * per + i);
          const bool real = i < valid;
          const std::int32_t label = real ? uni(0, classes - 1) : 0;
          yc[row] = label;
          yd[row] = real ? label : std::int32_t(uni(-2, classes + 2));  // in range or not
          if (real) yo.push_back(label);
          for (int k = 0; k < dim; ++k) {
            const float v = real ? nd(g) : 0.0f;
            xc[row * dim + k] = v;
            xd[row * dim + k] = real ? v : garbage[std::size_t(uni(0, 4))];
            if (real) xo.push_back(v);
          }
        }
        in_c.push_back({xc.data() + std::size_t(r * per * dim), yc.data() + std::size_t(r * per), rows, valid});
        in_d.push_back({xd.data() + std::size_t(r * per * dim), yd.data() + std::size_t(r * per), rows, valid});
      }
      const int total = static_cast<int>(yo.size());
      const std::vector<tr::replica_input> in_o{{xo.data(), yo.data(), total, total}};
      if (step == 3) {  // an evaluation, then no update
        const auto ed = dirty.evaluate(in_d), ec = clean.evaluate(in_c), eo = oracle.evaluate(in_o);
        CHECK(ed.loss == ec.loss);
        CHECK(ed.rows == eo.rows);
        CHECK(ferry_test::rel_diff(ed.loss, eo.loss) <= 1e-5);
        continue;
      }
      const auto sd = dirty.train_step(in_d), sc = clean.train_step(in_c), so = oracle.train_step(in_o);
      CHECK(sd.loss == sc.loss);
      CHECK(sd.weight == sc.weight);
      CHECK(sd.rows == so.rows);
      CHECK(ferry_test::rel_diff(sd.loss, so.loss) <= 1e-5);
      CHECK(ferry_test::rel_diff(sd.weight, so.weight) <= 1e-6);
    }
    const auto pd = dirty.parameters(), pc = clean.parameters(), po = oracle.parameters();
    const double diff = ferry_test::max_abs_diff(pd, po), scale = ferry_test::max_abs(po);
    INFO("max |dirty - oracle| " << diff << ", max |oracle| " << scale);
    CHECK(pd == pc);
    CHECK(diff <= 1e-5 * std::max(1.0, scale));  // NaN, so failed, if a weight is not finite
    CHECK(dirty.replica_at(reps - 1).download_params() == pd);
  }
}

TEST_CASE("a step of weight 0 leaves the optimizer state alone: padding, then a real step, is "
          "the real step alone (Adam, SGD)" * doctest::timeout(30)) {
  ferry_test::watchdog wd(30s, "padding then a step");
  const dataset d = blobs(32, 4, 2, 5);
  for (auto kind : {tr::optimizer_kind::adam, tr::optimizer_kind::sgd}) {
    INFO((kind == tr::optimizer_kind::adam ? "adam" : "sgd"));
    // A batch whose weight sum is 0 two ways: padding only, and only rows of class weight 0.
    for (bool by_class_weight : {false, true}) {
      INFO((by_class_weight ? "class weight 0" : "padding only"));
      tr::mlp_config cfg{{4, 8, 2}, {}};
      if (by_class_weight) cfg.class_weights = {0.0f, 1.0f};
      const tr::trainer_options o{.opt = {.kind = kind, .lr = 0.05f}, .seed = 3, .max_rows = 8};
      std::vector<tr::replica_input> nothing;
      std::vector<std::int32_t> zeros(16, 0);
      if (by_class_weight) {
        nothing = split(d, 0, 16, 2);
        for (int r = 0; r < 2; ++r) nothing[r].y = zeros.data() + 8 * r;  // all class 0
      } else {
        nothing = split(d, 0, 16, 2);
        nothing[0].valid = nothing[1].valid = 0;
      }
      const auto real = split(d, 16, 16, 2);

      tr::host_trainer a(cfg, o, 2), b(cfg, o, 2);
      CHECK(a.train_step(nothing).weight == 0.0);
      a.train_step(real);
      a.train_step(real);  // the second step's bias correction tells the step counts apart too
      b.train_step(real);
      b.train_step(real);
      CHECK(a.parameters() == b.parameters());
    }
  }
}

TEST_CASE("set_parameters clears Adam's step count with its moments" * doctest::timeout(30)) {
  ferry_test::watchdog wd(30s, "set_parameters resets adam");
  const dataset d = blobs(32, 4, 2, 6);
  const tr::mlp_config cfg{{4, 8, 2}, {}};
  const tr::trainer_options o{.opt = {.lr = 0.05f}, .seed = 4, .max_rows = 8};
  tr::host_trainer a(cfg, o, 2), b(cfg, o, 2);
  const auto p0 = a.parameters();
  a.train_step(split(d, 0, 16, 2));
  a.set_parameters(p0);
  a.train_step(split(d, 16, 16, 2));
  b.train_step(split(d, 16, 16, 2));
  CHECK(a.parameters() == b.parameters());
}

TEST_CASE("a replica failing mid-step, generic constructor with thread_communicators: the error, "
          "no hang, a usable trainer" * doctest::timeout(30)) {
  ferry_test::watchdog wd(30s, "generic constructor failure");
  const dataset d = blobs(64, 4, 2, 7);
  const tr::mlp_config cfg{{4, 8, 2}, {}};
  const tr::trainer_options o{.seed = 5, .max_rows = 4};
  ferry::thread_group g(4);
  faulty_trainer t(cfg, o, comms_of(g), four_contexts);
  tr::host_trainer ref(cfg, o, 4);  // the same steps, no failure
  t.train_step(split(d, 0, 16, 4));
  ref.train_step(split(d, 0, 16, 4));
  for (int failing : {1, 0, 3}) {  // a worker, the caller's replica, the last
    INFO("replica " << failing << " fails");
    faults = {.rank = failing, .gemms_before_failure = 2};  // in the step's backward
    CHECK_THROWS_WITH_AS(t.train_step(split(d, 16, 16, 4)), "injected GEMM failure",
                         std::runtime_error);
    faults = {};
    check_replicas_agree(t);
    t.train_step(split(d, 32, 16, 4));  // usable: the group was reset
    ref.train_step(split(d, 32, 16, 4));
    check_replicas_agree(t);
    CHECK(t.parameters() == ref.parameters());  // the failed step changed nothing
  }
  CHECK(t.evaluate(split(d, 48, 16, 4)).rows == 16);
}

// One trainer per rank over ONE shared thread_group (ranks simulated by threads, as with
// one replica per MPI process). Rank 2 fails in step 1 and aborts the group; rank 0 is
// released; rank 1 calls step 1 only once ranks 0 and 2 are back. Each trainer used to
// reset the group as soon as its own replica was back, so rank 1 then waited for peers that
// had left (or rank 0, if it arrived after rank 2's reset): a hang. A trainer holding part
// of a group must leave it aborted: every rank throws, and every trainer is spent.
TEST_CASE("trainers sharing one thread_group: a failure on one rank ends every rank's call, "
          "no hang; the trainers are spent" * doctest::timeout(60)) {
  ferry_test::watchdog wd(60s, "shared group failure");
  const dataset d = blobs(48, 4, 2, 11);
  const tr::mlp_config cfg{{4, 8, 2}, {}};
  const tr::trainer_options o{.seed = 5, .max_rows = 4};
  constexpr int W = 3;
  ferry::thread_group g(W);
  std::barrier sync(W + 1);
  std::atomic<int> back{0}, done{0};
  std::vector<std::string> errs(W), after(W);
  std::vector<std::thread> ts;
  for (int r = 0; r < W; ++r)
    ts.emplace_back([&, r] {
      faulty_trainer t(cfg, o, {g.communicator(r)}, {{r, nullptr}});
      t.train_step(split(d, 4 * std::size_t(r), 4, 1));  // step 0, every rank
      sync.arrive_and_wait();  // the caller sets the faults
      sync.arrive_and_wait();
      const auto step = [&](std::size_t first) {  // its message, or "(no error)"
        try {
          t.train_step(split(d, first + 4 * std::size_t(r), 4, 1));
          return std::string("(no error)");
        } catch (const std::exception& e) {
          return std::string(e.what());
        }
      };
      if (r == 1)  // only once ranks 0 and 2 are back
        for (int b = back.load(); b < 2; b = back.load()) back.wait(b);
      errs[r] = step(12);
      back.fetch_add(1);
      back.notify_all();
      sync.arrive_and_wait();  // the caller clears the faults
      sync.arrive_and_wait();
      after[r] = step(24);
      ++done;
    });
  sync.arrive_and_wait();
  faults = {.rank = 2, .gemms_before_failure = 0};  // its first GEMM of step 1
  sync.arrive_and_wait();
  // A rank stuck in the all-reduce is released by aborting the group again, so the old
  // behaviour fails the checks below instead of hanging the test.
  bool stuck = false;
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (back.load() < W) {
    if (std::chrono::steady_clock::now() > deadline) {
      stuck = true;
      g.abort();
    }
    std::this_thread::sleep_for(1ms);
  }
  sync.arrive_and_wait();
  faults = {};
  sync.arrive_and_wait();
  while (done.load() < W) {  // (the same release, for later calls)
    if (std::chrono::steady_clock::now() > deadline + 5s) {
      stuck = true;
      g.abort();
    }
    std::this_thread::sleep_for(1ms);
  }
  for (auto& t : ts) t.join();
  CHECK_FALSE(stuck);
  CHECK(errs[2] == "injected GEMM failure");
  for (int r : {0, 1}) {
    INFO("rank " << r << ": " << errs[r]);
    CHECK(errs[r] == "thread_group rank " + std::to_string(r) + " of 3: the collective was aborted by rank 2 "
                     "(a replica failed)");
  }
  for (int r = 0; r < W; ++r) {
    INFO("rank " << r << "'s next step: " << after[r]);
    CHECK(after[r].find("build a new group and trainers") != std::string::npos);
  }
  CHECK(g.aborted());
}

// A slice one rank's trainer refuses (over max_rows: bucketed batches differ by rank) is
// refused before its replica starts, while the other ranks may already wait in that step's
// all-reduce: the refusal aborts the group, so every rank's call ends (no hang), and the
// trainers are spent. A trainer holding every rank stays usable (the test above).
TEST_CASE("trainers sharing one thread_group: a slice refused on one rank ends every rank's call, no hang; the "
          "trainers are spent" * doctest::timeout(60)) {
  ferry_test::watchdog wd(60s, "shared group refused slice");
  const dataset d = blobs(48, 4, 2, 13);
  const tr::mlp_config cfg{{4, 8, 2}, {}};
  constexpr int W = 2;
  ferry::thread_group g(W);
  std::vector<std::string> errs(W), after(W);
  std::atomic<int> back{0}, done{0};
  std::vector<std::thread> ts;
  for (int r = 0; r < W; ++r)
    ts.emplace_back([&, r] {
      tr::mirrored_trainer<tr::host_backend, ferry::thread_communicator> t(cfg, {.seed = 5, .max_rows = 4},
                                                                           {g.communicator(r)});
      const auto step = [&](std::size_t first, int rows) {  // its message, or "(no error)"
        try {
          t.train_step(split(d, first, rows, 1));
          return std::string("(no error)");
        } catch (const std::exception& e) {
          return std::string(e.what());
        }
      };
      CHECK(step(4 * std::size_t(r), 4) == "(no error)");  // step 0, every rank
      errs[std::size_t(r)] = step(8 + 5 * std::size_t(r), r == 0 ? 5 : 4);  // rank 0: one row over max_rows
      back.fetch_add(1);
      after[std::size_t(r)] = step(24 + 4 * std::size_t(r), 4);
      ++done;
    });
  // A rank stuck in the all-reduce is released by aborting the group by hand, so the old
  // behaviour fails the checks below instead of hanging the test.
  bool stuck = false;
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (done.load() < W) {
    if (std::chrono::steady_clock::now() > deadline && !stuck) {
      stuck = true;
      g.abort();
    }
    std::this_thread::sleep_for(1ms);
  }
  for (auto& t : ts) t.join();
  CHECK_FALSE(stuck);
  INFO("rank 0: " << errs[0] << "; rank 1: " << errs[1]);
  CHECK(errs[0] == "mirrored_trainer: replica 0's slice has 5 rows; at most max_rows = 4 fit");
  CHECK(errs[1] == "thread_group rank 1 of 2: the collective was aborted by rank 0 (a replica failed)");
  for (int r = 0; r < W; ++r) {
    INFO("rank " << r << "'s next step: " << after[std::size_t(r)]);
    CHECK(after[std::size_t(r)].find("build a new group and trainers") != std::string::npos);
  }
  CHECK(g.aborted());
}

// Uploads join no collective: a failed set_parameters on a trainer that holds part of a
// shared group must not abort the group (the other ranks could not reset it).
TEST_CASE("trainers sharing one thread_group: a failed set_parameters aborts nothing" * doctest::timeout(30)) {
  ferry_test::watchdog wd(30s, "shared group set_parameters");
  const dataset d = blobs(32, 4, 2, 12);
  const tr::mlp_config cfg{{4, 8, 2}, {}};
  const tr::trainer_options o{.seed = 5, .max_rows = 4};
  ferry::thread_group g(2);
  std::barrier sync(3);
  std::string err;
  std::vector<int> ok(2, 0);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      faulty_trainer t(cfg, o, {g.communicator(r)}, {{r, nullptr}});
      t.train_step(split(d, 4 * std::size_t(r), 4, 1));
      sync.arrive_and_wait();  // the caller sets the fault
      sync.arrive_and_wait();
      if (r == 1) {
        try {
          t.set_parameters(t.parameters());
        } catch (const std::exception& e) {
          err = e.what();
        }
      }
      sync.arrive_and_wait();  // the caller checks the group and clears the fault
      sync.arrive_and_wait();
      try {
        t.train_step(split(d, 8 + 4 * std::size_t(r), 4, 1));  // both ranks still train together
        ok[r] = 1;
      } catch (const std::exception&) {
        g.abort();  // release the other rank: a failure, not a hang
      }
    });
  sync.arrive_and_wait();
  faults = {.rank = 1, .failing_uploads = 1};
  sync.arrive_and_wait();
  sync.arrive_and_wait();
  CHECK(err == "injected upload failure");
  CHECK_FALSE(g.aborted());
  faults = {};
  sync.arrive_and_wait();
  for (auto& t : ts) t.join();
  CHECK(ok == std::vector<int>{1, 1});
}

TEST_CASE("a failed set_parameters restores the previous weights on every replica" *
          doctest::timeout(30)) {
  ferry_test::watchdog wd(30s, "set_parameters failure");
  const dataset d = blobs(64, 4, 2, 8);
  const tr::mlp_config cfg{{4, 8, 2}, {}};
  ferry::thread_group g(4);
  faulty_trainer t(cfg, {.seed = 6, .max_rows = 4}, comms_of(g), four_contexts);
  t.train_step(split(d, 0, 16, 4));
  const auto before = t.parameters();
  std::vector<float> other(before.size(), 0.25f);
  for (int failing : {2, 0}) {
    INFO("replica " << failing << "'s upload fails");
    faults = {.rank = failing, .failing_uploads = 1};
    CHECK_THROWS_WITH_AS(t.set_parameters(other), "injected upload failure", std::runtime_error);
    faults = {};
    check_replicas_agree(t);
    CHECK(t.parameters() == before);
  }
  t.train_step(split(d, 16, 16, 4));  // still usable
  check_replicas_agree(t);

  // The restore fails as well: the replicas may disagree, so the trainer refuses more work.
  faults = {.rank = 3, .failing_uploads = 2};
  CHECK_THROWS_AS(t.set_parameters(other), std::runtime_error);
  faults = {};
  CHECK_THROWS_AS(t.train_step(split(d, 32, 16, 4)), ferry::error);
  CHECK_THROWS_AS(t.set_parameters(other), ferry::error);
}

TEST_CASE("OpenBLAS threads: 1 per replica by default, as asked otherwise" * doctest::timeout(30)) {
  ferry_test::watchdog wd(30s, "blas threads");
  const tr::mlp_config cfg{{4, 8, 2}, {}};
  CHECK_THROWS_AS(tr::host_trainer(cfg, {.seed = 1, .max_rows = 8, .blas_threads = -1}, 1),
                  ferry::config_error);
  {
    tr::host_trainer t(cfg, {.seed = 1, .max_rows = 8, .blas_threads = 2}, 1);
    CHECK(openblas_get_num_threads() == std::min(2, openblas_get_num_procs()));
  }
  if (!std::getenv("OPENBLAS_NUM_THREADS")) {  // auto leaves a user's setting alone
    tr::host_trainer t(cfg, {.seed = 1, .max_rows = 8}, 1);
    CHECK(openblas_get_num_threads() == 1);
  }
}

namespace {
// The statistics of several steps combined by hand, from each step's own (train_step's):
// the oracle of take_stats.
struct combined {
  double loss_sum = 0, weight = 0, correct = 0, rows = 0;
  void add(const tr::step_stats& s) {
    loss_sum += s.loss * s.weight;
    weight += s.weight;
    correct += s.accuracy * s.rows;
    rows += s.rows;
  }
  double loss() const { return weight > 0 ? loss_sum / weight : 0.0; }
  double accuracy() const { return rows > 0 ? correct / rows : 0.0; }
};

void check_stats(const tr::step_stats& got, const combined& want) {
  CHECK(want.rows > 0);
  CHECK(got.rows == want.rows);      // whole numbers: exact either way
  CHECK(got.weight == want.weight);  // sums of 0.5, 1 and 2: exact either way
  CHECK(ferry_test::rel_diff(got.loss, want.loss()) <= 1e-6);
  CHECK(ferry_test::rel_diff(got.accuracy, want.accuracy()) <= 1e-12);
}

// Rows [i*B, (i+1)*B) in `reps` slices, the last (i + r) % 3 rows of slice r padding: the
// steps weigh differently.
std::vector<tr::replica_input> padded_step(const dataset& d, int i, int B, int reps) {
  auto in = split(d, std::size_t(i) * B, B, reps);
  for (int r = 0; r < reps; ++r) in[r].valid = in[r].rows - (i + r) % 3;
  return in;
}
}  // namespace

TEST_CASE("train_step_async: train_step's weights bit for bit, and take_stats the weighted mean "
          "of those steps' statistics; sync steps feed the totals too (1, 2, 4 replicas)" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(60s, "async steps");
  constexpr int B = 24, N = 12, first_take = 5;
  const dataset d = blobs(B * N, 6, 3, 12);
  // Class weights: a step's weight is not its row count, so the weighted mean is the test.
  const tr::mlp_config cfg{{6, 10, 3}, {0.5f, 2.0f, 1.0f}};
  for (int reps : {1, 2, 4}) {
    INFO(reps << " replica(s)");
    const tr::trainer_options o{.opt = {.lr = 0.02f}, .seed = 8, .max_rows = B / reps};
    tr::host_trainer sync(cfg, o, reps), async(cfg, o, reps), mixed(cfg, o, reps);
    combined all, head, tail;
    double unweighted = 0;
    for (int i = 0; i < N; ++i) {
      const auto s = sync.train_step(padded_step(d, i, B, reps));
      all.add(s);
      (i < first_take ? head : tail).add(s);
      unweighted += s.loss / N;
    }
    // The oracle tells a weighted mean from a plain one, and a missing step shows.
    CHECK(ferry_test::rel_diff(unweighted, all.loss()) > 1e-3);

    for (int i = 0; i < first_take; ++i) async.train_step_async(padded_step(d, i, B, reps));
    check_stats(async.take_stats(), head);
    for (int i = first_take; i < N; ++i) async.train_step_async(padded_step(d, i, B, reps));
    check_stats(async.take_stats(), tail);
    CHECK(async.steps() == std::uint64_t(N));
    CHECK(async.parameters() == sync.parameters());
    check_replicas_agree(async);

    check_stats(sync.take_stats(), all);  // train_step fed the totals as well
    const auto none = sync.take_stats();  // no step since the last take
    CHECK(none.loss == 0);
    CHECK(none.accuracy == 0);
    CHECK(none.weight == 0);
    CHECK(none.rows == 0);

    // Sync and async steps in turn, an evaluation between them: one total over all of them.
    for (int i = 0; i < N; ++i) {
      const auto in = padded_step(d, i, B, reps);
      if (i % 2) mixed.train_step_async(in);
      else CHECK(mixed.train_step(in).rows > 0);
      if (i == 3) CHECK(mixed.evaluate(split(d, 0, B, reps)).rows == B);  // not a step: not counted
    }
    check_stats(mixed.take_stats(), all);
    CHECK(mixed.parameters() == sync.parameters());
  }
}

TEST_CASE("evaluate_async: take_eval is the weighted mean of the same batches' evaluate(); evaluate "
          "feeds the totals too; training and evaluation totals stay apart (1, 2, 4 replicas)" *
          doctest::timeout(60)) {
  ferry_test::watchdog wd(60s, "async evaluations");
  constexpr int B = 24, N = 9;
  const dataset d = blobs(B * N, 6, 3, 14);
  const tr::mlp_config cfg{{6, 10, 3}, {0.5f, 2.0f, 1.0f}};
  for (int reps : {1, 2, 4}) {
    INFO(reps << " replica(s)");
    const tr::trainer_options o{.opt = {.lr = 0.02f}, .seed = 9, .max_rows = B / reps};
    tr::host_trainer sync(cfg, o, reps), async(cfg, o, reps);
    for (int i = 0; i < 3; ++i) {  // trained a little, so the batches score differently
      sync.train_step(padded_step(d, i, B, reps));
      async.train_step(padded_step(d, i, B, reps));
    }
    const auto trained = async.take_stats();
    combined all;
    double unweighted = 0;
    for (int i = 0; i < N; ++i) {
      const auto s = sync.evaluate(padded_step(d, i, B, reps));
      all.add(s);
      unweighted += s.loss / N;
    }
    CHECK(ferry_test::rel_diff(unweighted, all.loss()) > 1e-5);  // the oracle tells the weighting (check_stats: 1e-6)
    for (int i = 0; i < N; ++i) async.evaluate_async(padded_step(d, i, B, reps));
    check_stats(async.take_eval(), all);
    check_stats(sync.take_eval(), all);  // evaluate fed the totals as well
    const auto none = async.take_eval();
    CHECK(none.rows == 0);
    CHECK(none.weight == 0);
    CHECK(none.loss == 0);
    // Evaluations are not steps: no update, no training statistics; and training steps
    // leave the evaluation totals alone.
    CHECK(async.parameters() == sync.parameters());
    CHECK(async.steps() == 3);
    CHECK(async.take_stats().rows == 0);
    CHECK(trained.rows > 0);
    async.train_step(padded_step(d, 0, B, reps));
    CHECK(async.take_eval().rows == 0);
    // A bad slice: a config_error, nothing added.
    auto bad = padded_step(d, 0, B, reps);
    bad[0].rows = B;  // more than max_rows = B / reps (or padding beyond it)
    bad[0].valid = B + 1;
    CHECK_THROWS_AS(async.evaluate_async(bad), ferry::config_error);
    CHECK(async.take_eval().rows == 0);
  }
}

TEST_CASE("take_stats over thousands of steps: as exact as a double sum of the steps' float "
          "statistics (compensated)" * doctest::timeout(60)) {
  ferry_test::watchdog wd(60s, "compensated totals");
  constexpr int B = 8, rows = 256, N = 6000;
  const dataset d = blobs(rows, 4, 2, 13);
  tr::host_trainer t(tr::mlp_config{{4, 6, 2}, {}}, {.opt = {.lr = 0.01f}, .seed = 9, .max_rows = B}, 1);
  double exact = 0, weight = 0;
  float naive = 0;  // what a plain float running sum would give
  for (int i = 0; i < N; ++i) {
    const auto s = t.train_step(split(d, std::size_t(i % (rows / B)) * B, B, 1));
    const double l = s.loss * s.weight;
    exact += l;
    naive += float(l);
    weight += s.weight;
  }
  const auto got = t.take_stats();
  CHECK(got.weight == weight);
  CHECK(got.rows == double(B) * N);
  const double want = exact / weight;
  // The plain float sum is off by far more than the tolerance: the check can tell them apart.
  CHECK(ferry_test::rel_diff(double(naive) / weight, want) > 1e-7);
  CHECK(ferry_test::rel_diff(got.loss, want) <= 1e-9);
}

namespace {
// A step whose slices are ready on some stream other than the one the replicas compute on
// (none, for host replicas).
struct other_stream_batch : fake_replica_batch {
  void* stream() const { return reinterpret_cast<void*>(std::uintptr_t{0x1000}); }
};
struct other_stream_step {
  std::vector<other_stream_batch> rb;
  std::size_t replicas() const { return rb.size(); }
  other_stream_batch& operator[](std::size_t r) { return rb[r]; }
};
}  // namespace

TEST_CASE("train_step_async's errors: config_errors as train_step's, a failed step adds nothing, "
          "a step on other streams is refused" * doctest::timeout(30)) {
  ferry_test::watchdog wd(30s, "async errors");
  const dataset d = blobs(96, 4, 2, 14);
  const tr::mlp_config cfg{{4, 8, 2}, {}};
  const tr::trainer_options o{.seed = 5, .max_rows = 4};
  {
    tr::host_trainer t(cfg, o, 2);
    CHECK_THROWS_AS(t.train_step_async(split(d, 0, 16, 2)), ferry::config_error);  // 8 > 4 rows
    CHECK_THROWS_AS(t.train_step_async(split(d, 0, 8, 1)), ferry::config_error);   // 1 slice for 2
    CHECK(t.steps() == 0);
    t.train_step_async(split(d, 0, 8, 2));
    const auto s = t.take_stats();
    CHECK(s.rows == 8);  // the refused steps added nothing
  }
  {
    ferry::thread_group g(4);
    faulty_trainer t(cfg, o, comms_of(g), four_contexts);
    tr::host_trainer ref(cfg, o, 4);
    combined want;
    t.train_step_async(split(d, 0, 16, 4));
    want.add(ref.train_step(split(d, 0, 16, 4)));
    faults = {.rank = 2, .gemms_before_failure = 2};
    CHECK_THROWS_WITH_AS(t.train_step_async(split(d, 16, 16, 4)), "injected GEMM failure",
                         std::runtime_error);
    faults = {};
    t.train_step_async(split(d, 32, 16, 4));
    want.add(ref.train_step(split(d, 32, 16, 4)));
    check_stats(t.take_stats(), want);
    CHECK(t.parameters() == ref.parameters());
  }
  {
    tr::host_trainer t(cfg, {.seed = 1, .max_rows = 32}, 2);
    auto* rows = reinterpret_cast<const std::array<float, 4>*>(d.x.data());
    fake_step st{{{{rows, 32}, {d.y.data(), 32}, 32}, {{rows + 32, 32}, {d.y.data() + 32, 32}, 32}}};
    t.train_step_async(st);  // host replicas: no stream on either side
    CHECK(t.take_stats().rows == 64);
    other_stream_step elsewhere{{{st.rb[0]}, {st.rb[1]}}};
    CHECK_THROWS_WITH_AS(t.train_step_async(elsewhere), doctest::Contains("another stream"),
                         ferry::config_error);
    CHECK_THROWS_WITH_AS(t.train_step(elsewhere), doctest::Contains("another stream"), ferry::config_error);
    CHECK(t.steps() == 1);
    CHECK(t.take_stats().rows == 0);
  }
}
