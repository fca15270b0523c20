// The optimizers and elementwise functors on the host backend against naive double
// oracles: Adam as Kingma & Ba write it, SGD with momentum in PyTorch's form, the
// bias + ReLU forward over (row, column) and the ReLU backward. The backend runs the
// functors through its vectorized paths (scalar()/apply, for_each_2d), so these are the
// loops a training step runs.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "ferry/train/host_backend.hpp"
#include "ferry/train/optimizer.hpp"
#include "ferry/train/replica.hpp"

namespace tr = ferry::train;

namespace {

std::vector<float> randoms(std::size_t n, std::uint32_t seed, float lo, float hi) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(g);
  return v;
}

void close_to(const std::vector<float>& got, const std::vector<double>& want, double rel) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("index " << i);
    CHECK(std::abs(got[i] - want[i]) <= rel * (std::abs(want[i]) + 1e-6));
  }
}

}  // namespace

TEST_CASE("Adam matches the textbook update over several steps, odd lengths included") {
  tr::host_backend be;
  for (std::size_t n : {1u, 3u, 17u, 1000u, 4099u}) {
    INFO("n = " << n);
    const tr::optimizer_config c{.kind = tr::optimizer_kind::adam, .lr = 3e-3f};
    std::vector<float> p = randoms(n, 1, -1, 1), m(n, 0.0f), v(n, 0.0f);
    std::vector<double> P(p.begin(), p.end()), M(n, 0.0), V(n, 0.0);
    std::vector<float> sched(tr::adam_schedule::floats, 0.0f);
    for (std::uint64_t t = 1; t <= 6; ++t) {
      std::vector<float> g = randoms(n + 1, std::uint32_t(t * 7 + n), -5, 5);
      g[n] = 4.0f + float(t);  // the weight sum, where the trainer keeps it: after the gradients
      be.for_each(1, tr::adam_advance{sched.data(), &g[n], c.lr, c.beta1, c.beta2});
      CHECK(sched[tr::adam_schedule::t_lo] == float(t));
      be.for_each(n, tr::adam_update{p.data(), g.data(), m.data(), v.data(), &g[n], sched.data(),
                                     c.beta1, c.beta2, c.eps});
      for (std::size_t i = 0; i < n; ++i) {
        const double gi = double(g[i]) / double(g[n]);
        M[i] = 0.9 * M[i] + 0.1 * gi;
        V[i] = 0.999 * V[i] + 0.001 * gi * gi;
        const double mh = M[i] / (1 - std::pow(0.9, double(t)));
        const double vh = V[i] / (1 - std::pow(0.999, double(t)));
        P[i] -= 3e-3 * mh / (std::sqrt(vh) + 1e-8);
      }
    }
    close_to(p, P, 1e-4);
  }
}

TEST_CASE("SGD with momentum matches PyTorch's form; a zero weight sum changes nothing") {
  tr::host_backend be;
  const std::size_t n = 1031;
  std::vector<float> p = randoms(n, 2, -1, 1), vel(n, 0.0f);
  std::vector<double> P(p.begin(), p.end()), Vl(n, 0.0);
  for (int t = 1; t <= 5; ++t) {
    std::vector<float> g = randoms(n + 1, std::uint32_t(t), -2, 2);
    g[n] = 8.0f;
    be.for_each(n, tr::sgd_update{p.data(), g.data(), vel.data(), &g[n], 0.05f, 0.9f});
    for (std::size_t i = 0; i < n; ++i) {
      Vl[i] = 0.9 * Vl[i] + double(g[i]) / 8.0;
      P[i] -= 0.05 * Vl[i];
    }
  }
  close_to(p, P, 1e-5);

  const std::vector<float> before = p;
  std::vector<float> g = randoms(n + 1, 9, -2, 2);
  g[n] = 0.0f;  // a batch of padding only
  be.for_each(n, tr::sgd_update{p.data(), g.data(), vel.data(), &g[n], 0.05f, 0.9f});
  std::vector<float> m(n, 0.0f), v(n, 0.0f), sched(tr::adam_schedule::floats, 0.0f);
  const tr::optimizer_config a{};
  be.for_each(1, tr::adam_advance{sched.data(), &g[n], a.lr, a.beta1, a.beta2});
  be.for_each(n, tr::adam_update{p.data(), g.data(), m.data(), v.data(), &g[n], sched.data(),
                                 a.beta1, a.beta2, a.eps});
  CHECK(p == before);
  CHECK(m == std::vector<float>(n, 0.0f));
  CHECK(sched == std::vector<float>(tr::adam_schedule::floats, 0.0f));  // still step 0
}

TEST_CASE("Adam's step count carries into its high half past 2^24 steps") {
  tr::host_backend be;
  std::vector<float> sched(tr::adam_schedule::floats, 0.0f);
  sched[tr::adam_schedule::t_lo] = 16777215.0f;  // 2^24 - 1
  const float w = 1.0f;
  be.for_each(1, tr::adam_advance{sched.data(), &w, 1e-3f, 0.9f, 0.999f});
  CHECK(sched[tr::adam_schedule::t_lo] == 0.0f);
  CHECK(sched[tr::adam_schedule::t_hi] == 1.0f);
  be.for_each(1, tr::adam_advance{sched.data(), &w, 1e-3f, 0.9f, 0.999f});
  CHECK(sched[tr::adam_schedule::t_lo] == 1.0f);
  CHECK(sched[tr::adam_schedule::step] == doctest::Approx(1e-3));  // bias corrections ~1
  CHECK(sched[tr::adam_schedule::inv_sqrt_bc2] == doctest::Approx(1.0));
}

TEST_CASE("bias + ReLU over (row, column) and the ReLU backward match a naive loop") {
  tr::host_backend be;
  for (int rows : {1, 5, 64}) {
    for (int cols : {1, 7, 10, 256}) {
      for (bool relu : {false, true}) {
        INFO(rows << " x " << cols << (relu ? " relu" : ""));
        std::vector<float> z = randoms(std::size_t(rows) * cols, 3, -1, 1);
        const std::vector<float> b = randoms(std::size_t(cols), 4, -0.5f, 0.5f), z0 = z;
        be.for_each_2d(std::size_t(rows), std::size_t(cols), tr::bias_act{z.data(), b.data(), cols, relu});
        std::vector<double> want(z.size());
        for (int r = 0; r < rows; ++r)
          for (int c = 0; c < cols; ++c) {
            const double x = double(z0[std::size_t(r) * cols + c]) + double(b[std::size_t(c)]);
            want[std::size_t(r) * cols + c] = relu && x < 0 ? 0.0 : x;
          }
        close_to(z, want, 1e-6);

        std::vector<float> d = randoms(z.size(), 5, -1, 1);
        const std::vector<float> d0 = d;
        be.for_each(d.size(), tr::relu_backward{d.data(), z.data()});
        for (std::size_t i = 0; i < d.size(); ++i) CHECK(d[i] == (z[i] > 0 ? d0[i] : 0.0f));
      }
    }
  }
}
