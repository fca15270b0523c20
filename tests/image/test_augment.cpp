// Augmentation's host path (ferry/image/augment.hpp) against a naive per-pixel oracle in
// double precision written here (random sizes, 1 to 4 channels, flip on and off, brightness
// and contrast); the host path's table lookup against the kernel's per-pixel body
// (augment_pixel, run here on the host), bit for bit; the draws as specified (splitmix64
// seeded by mix_seed({seed, key, row})), deterministic per key and independent of how a
// batch is split; their statistics; bad arguments; and the entry point on what
// distribute(host_replicas) hands out. The device path is checked against this one in
// tests/cuda/test_augment_sim.cpp (simulated runtime) and test_augment_gpu.cpp (a GPU).
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "ferry/detail/random.hpp"
#include "ferry/error.hpp"
#include "ferry/image/augment.hpp"
#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/distribute.hpp"

namespace {

namespace fi = ferry::image;

std::vector<std::uint8_t> random_bytes(std::size_t n, std::uint64_t seed) {
  ferry::detail::splitmix64 g(seed);
  std::vector<std::uint8_t> v(n);
  for (auto& b : v) b = std::uint8_t(g());
  return v;
}

// Uniform in [lo, hi) from g (the test's own draws; any fixed rule will do).
float uniform(ferry::detail::splitmix64& g, float lo, float hi) {
  return lo + (hi - lo) * float(double(g() >> 11) * 0x1.0p-53);
}

// The oracle: the formula of augment.hpp's top, plainly, per output value, in double.
std::vector<double> oracle(const std::vector<std::uint8_t>& hwc, std::size_t rows, const fi::augment_shape& s,
                           const fi::augment_options& o, const fi::augment_plan& p, std::uint64_t key,
                           std::uint64_t first_row = 0) {
  const std::size_t H = s.height, W = s.width, C = s.channels;
  std::vector<double> out(rows * C * H * W);
  for (std::size_t n = 0; n < rows; ++n) {
    const fi::augment_row r = fi::augment_draw(p, key, first_row + n);
    for (std::size_t c = 0; c < C; ++c)
      for (std::size_t y = 0; y < H; ++y)
        for (std::size_t x = 0; x < W; ++x) {
          const std::size_t sx = r.flip ? W - 1 - x : x;
          const double v = hwc[n * H * W * C + (y * W + sx) * C + c];
          double t = (v / 255.0 - 0.5) * double(r.contrast) + 0.5 + double(r.brightness);
          t = std::clamp(t, 0.0, 1.0);
          out[n * C * H * W + c * H * W + y * W + x] = (t - double(o.mean[c])) / double(o.stddev[c]);
        }
  }
  return out;
}

// Random options: channel statistics, and each augmentation on or off.
fi::augment_options random_options(ferry::detail::splitmix64& g, std::uint32_t C) {
  fi::augment_options o;
  for (std::uint32_t c = 0; c < C; ++c) {
    o.mean[c] = uniform(g, 0.f, 1.f);
    o.stddev[c] = uniform(g, 0.05f, 1.f);
  }
  const std::uint64_t which = g.below(8);
  o.flip_probability = which & 1 ? 0.5f : float(g.below(2));  // 0.5, or never / always
  if (which & 2) o.brightness = {uniform(g, -0.4f, 0.f), uniform(g, 0.f, 0.4f)};
  if (which & 4) o.contrast = {uniform(g, 0.5f, 1.f), uniform(g, 1.f, 1.6f)};
  o.seed = g();
  return o;
}

}  // namespace

TEST_CASE("host path equals the per-pixel oracle: random sizes, 1 to 4 channels, flip, brightness, contrast") {
  ferry::detail::splitmix64 g(20261127);
  std::size_t flipped = 0, straight = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const fi::augment_shape s{std::uint32_t(1 + g.below(23)), std::uint32_t(1 + g.below(31)),
                              trial % 4 == 3 ? std::uint32_t(1 + g.below(4)) : (trial % 2 ? 3u : 1u)};
    const fi::augment_options o = random_options(g, s.channels);
    const fi::augment_plan p = fi::make_augment_plan(s, o);
    const std::size_t rows = 1 + g.below(6), per = p.values();
    const std::uint64_t key = g(), first = g.below(1000);
    CAPTURE(trial);
    CAPTURE(s.height);
    CAPTURE(s.width);
    CAPTURE(s.channels);
    CAPTURE(rows);
    const auto in = random_bytes(rows * per, g());
    std::vector<float> out(rows * per + 5, -7.f);  // 5 past the end: must stay untouched
    fi::augment_host(in, out, p, key, first);
    const auto want = oracle(in, rows, s, o, p, key, first);
    // The float path rounds its coefficients and two fused multiply-adds: a few ulps of
    // values of order 1 / stddev. A misplaced pixel, channel or flip is off by at least
    // contrast / 255 / stddev (>= 0.0019 here), far above this.
    std::size_t bad = 0;
    for (std::size_t i = 0; i < rows * per; ++i) {
      const double tol = 4e-6 * (1.0 + std::abs(want[i]));
      if (!(std::abs(double(out[i]) - want[i]) <= tol) && bad++ < 5)
        FAIL_CHECK("value " << i << ": " << out[i] << ", oracle " << want[i]);
    }
    CHECK(bad == 0);
    for (std::size_t i = rows * per; i < out.size(); ++i) CHECK(out[i] == -7.f);
    for (std::size_t n = 0; n < rows; ++n) (fi::augment_draw(p, key, first + n).flip ? flipped : straight)++;
    if (o.flip_probability == 0.f)
      for (std::size_t n = 0; n < rows; ++n) CHECK_FALSE(fi::augment_draw(p, key, first + n).flip);
    if (o.flip_probability == 1.f)
      for (std::size_t n = 0; n < rows; ++n) CHECK(fi::augment_draw(p, key, first + n).flip);
  }
  CHECK(flipped > 50);  // both kinds of row were checked
  CHECK(straight > 50);
}

TEST_CASE("the host table and the kernel's per-pixel body agree bit for bit") {
  // What the kernel runs for each pixel is augment_pixel; the host path looks values up in
  // a table made with the same augment_value. Equal bits here and on the device (the same
  // IEEE operations: fmaf, exact compares) is what lets the device tests compare exactly.
  ferry::detail::splitmix64 g(5);
  for (int trial = 0; trial < 60; ++trial) {
    const fi::augment_shape s{std::uint32_t(1 + g.below(40)), std::uint32_t(1 + g.below(40)),
                              std::uint32_t(1 + g.below(4))};
    const fi::augment_options o = random_options(g, s.channels);
    const fi::augment_plan p = fi::make_augment_plan(s, o);
    const std::size_t rows = 1 + g.below(4), per = p.values();
    const std::uint64_t key = g();
    const auto in = random_bytes(rows * per, g());
    std::vector<float> host(rows * per), pixel(rows * per, std::numeric_limits<float>::quiet_NaN());
    fi::augment_host(in, host, p, key);
    for (std::size_t n = 0; n < rows; ++n) {
      const fi::augment_row r = fi::augment_draw(p, key, n);
      for (std::uint32_t i = 0; i < p.pixels(); ++i) {
        if (i % 2)  // both forms: channels from p, and known to the compiler
          fi::augment_pixel(p, r, in.data() + n * per, pixel.data() + n * per, i);
        else if (s.channels == 3)
          fi::augment_pixel<3>(p, r, in.data() + n * per, pixel.data() + n * per, i);
        else
          fi::augment_pixel<0>(p, r, in.data() + n * per, pixel.data() + n * per, i);
      }
    }
    CAPTURE(trial);
    CHECK(std::memcmp(host.data(), pixel.data(), host.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("draws: as specified, deterministic per key, the same whatever the split") {
  const fi::augment_shape s{7, 9, 3};
  fi::augment_options o;
  o.flip_probability = 0.5f;
  o.brightness = {-0.2f, 0.3f};
  o.contrast = {0.7f, 1.4f};
  o.seed = 99;
  const fi::augment_plan p = fi::make_augment_plan(s, o);

  SUBCASE("each row's draw is splitmix64 seeded with mix_seed({seed, key, row})") {
    for (std::uint64_t row = 0; row < 200; ++row) {
      ferry::detail::splitmix64 g(ferry::detail::mix_seed({99, 1234, row}));
      const std::uint64_t wf = g(), wb = g(), wc = g();
      const fi::augment_row r = fi::augment_draw(p, 1234, row);
      CHECK(r.flip == ((wf >> 11) < (std::uint64_t(1) << 52)));
      CHECK(r.brightness == std::fma(0.5f, float(wb >> 40) * 0x1.0p-24f, -0.2f));
      CHECK(r.contrast == std::fma(1.4f - 0.7f, float(wc >> 40) * 0x1.0p-24f, 0.7f));
    }
  }

  const std::size_t rows = 12, per = p.values();
  const auto in = random_bytes(rows * per, 3);
  std::vector<float> a(rows * per), b(rows * per);

  SUBCASE("the same key gives the same bits; another key other values") {
    fi::augment_host(in, a, p, 41);
    fi::augment_host(in, b, p, 41);
    CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    fi::augment_host(in, b, p, 42);
    CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) != 0);
    fi::augment_host(in, b, fi::make_augment_plan(s, {.flip_probability = 0.5f, .brightness = {-0.2f, 0.3f},
                                                      .contrast = {0.7f, 1.4f}, .seed = 100}), 41);
    CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) != 0);  // another seed
  }

  SUBCASE("rows augmented in parts, each with its first global row, equal the whole") {
    fi::augment_host(in, a, p, 7);
    for (std::size_t cut : {1u, 5u, 11u}) {
      fi::augment_host(std::span(in).first(cut * per), std::span(b).first(cut * per), p, 7, 0);
      fi::augment_host(std::span(in).subspan(cut * per), std::span(b).subspan(cut * per), p, 7, cut);
      CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    }
  }

  SUBCASE("enabling flip does not change the brightness and contrast draws") {
    fi::augment_options o2 = o;
    o2.flip_probability = 0.f;
    const fi::augment_plan p2 = fi::make_augment_plan(s, o2);
    for (std::uint64_t row = 0; row < 50; ++row) {
      CHECK(fi::augment_draw(p2, 5, row).brightness == fi::augment_draw(p, 5, row).brightness);
      CHECK(fi::augment_draw(p2, 5, row).contrast == fi::augment_draw(p, 5, row).contrast);
    }
  }
}

TEST_CASE("draws: flip rate and ranges") {
  fi::augment_options o;
  o.flip_probability = 0.3f;
  o.brightness = {-0.25f, 0.15f};
  o.contrast = {0.6f, 1.8f};
  o.seed = 11;
  const fi::augment_plan p = fi::make_augment_plan({4, 4, 1}, o);
  const int n = 40000;
  int flips = 0;
  double bsum = 0, csum = 0;
  float bmin = 1e9f, bmax = -1e9f, cmin = 1e9f, cmax = -1e9f;
  for (int i = 0; i < n; ++i) {
    const fi::augment_row r = fi::augment_draw(p, fi::augment_key(2, std::uint64_t(i / 100)), std::uint64_t(i % 100));
    flips += r.flip;
    bsum += r.brightness, csum += r.contrast;
    bmin = std::min(bmin, r.brightness), bmax = std::max(bmax, r.brightness);
    cmin = std::min(cmin, r.contrast), cmax = std::max(cmax, r.contrast);
  }
  // Binomial(40000, 0.3): sd 92; 0.012 * n = 480 is more than 5 sd.
  CHECK(std::abs(flips - 0.3 * n) < 0.012 * n);
  CHECK(std::abs(bsum / n - (-0.05)) < 0.006);  // uniform's sd / sqrt(n) = 0.00058
  CHECK(std::abs(csum / n - 1.2) < 0.017);
  CHECK(bmin >= -0.25f);
  CHECK(bmax <= 0.15f);
  CHECK(bmin < -0.24f);
  CHECK(bmax > 0.14f);
  CHECK(cmin >= 0.6f);
  CHECK(cmax <= 1.8f);
}

TEST_CASE("values: the defaults scale to [0, 1]; the clamp; channel statistics") {
  const std::vector<std::uint8_t> px{0, 1, 128, 255};
  std::vector<float> out(4);
  fi::augment_host(px, out, fi::make_augment_plan({1, 4, 1}, {}), 0);
  CHECK(out[0] == 0.f);
  CHECK(out[1] == doctest::Approx(1.0 / 255).epsilon(1e-6));
  CHECK(out[2] == doctest::Approx(128.0 / 255).epsilon(1e-6));
  CHECK(out[3] == 1.f);
  // Brightness +0.5 exactly: values above half clamp to 1, then normalise with mean 0.5, std 0.25.
  fi::augment_options o;
  o.brightness = {0.5f, 0.5f};
  o.mean = {0.5f};
  o.stddev = {0.25f};
  fi::augment_host(px, out, fi::make_augment_plan({1, 4, 1}, o), 0);
  CHECK(out[0] == 0.f);        // 0 + 0.5 -> (0.5 - 0.5) / 0.25
  CHECK(out[2] == 2.f);        // clamped to 1 -> (1 - 0.5) / 0.25
  CHECK(out[3] == 2.f);
  // The raw-pointer form, CHW order of a 1x2 RGB image with a flip on every row.
  const std::vector<std::uint8_t> rgb{10, 20, 30, 40, 50, 60};  // pixel 0, pixel 1
  std::vector<float> chw(6);
  fi::augment_host(rgb.data(), 1, 1, 2, 3, chw.data(), {.flip_probability = 1.f}, 0);
  const float want[6] = {40, 10, 50, 20, 60, 30};  // R plane, G plane, B plane, mirrored
  for (int i = 0; i < 6; ++i) CHECK(chw[i] == doctest::Approx(want[i] / 255.0).epsilon(1e-6));
}

TEST_CASE("bad shapes, options and buffers are config_errors") {
  using E = ferry::config_error;
  const fi::augment_options ok;
  CHECK_THROWS_AS(fi::make_augment_plan({0, 4, 3}, ok), E);
  CHECK_THROWS_AS(fi::make_augment_plan({4, 0, 3}, ok), E);
  CHECK_THROWS_AS(fi::make_augment_plan({4, 4, 0}, ok), E);
  CHECK_THROWS_AS(fi::make_augment_plan({4, 4, 5}, ok), E);
  CHECK_THROWS_AS(fi::make_augment_plan({65536, 32768, 2}, ok), E);  // 2^31 values an image is the most
  CHECK_NOTHROW(fi::make_augment_plan({65536, 32768, 1}, ok));
  auto with = [&](auto f) {
    fi::augment_options o = ok;
    f(o);
    return o;
  };
  CHECK_THROWS_AS(fi::make_augment_plan({4, 4, 3}, with([](auto& o) { o.stddev[1] = 0.f; })), E);
  CHECK_THROWS_AS(fi::make_augment_plan({4, 4, 3}, with([](auto& o) { o.stddev[2] = -1.f; })), E);
  CHECK_THROWS_AS(fi::make_augment_plan({4, 4, 3}, with([](auto& o) { o.stddev[0] = NAN; })), E);
  CHECK_THROWS_AS(fi::make_augment_plan({4, 4, 3}, with([](auto& o) { o.stddev[0] = 1e-39f; })), E);  // 1/std overflows
  CHECK_THROWS_AS(fi::make_augment_plan({4, 4, 3}, with([](auto& o) { o.mean[0] = INFINITY; })), E);
  CHECK_NOTHROW(fi::make_augment_plan({4, 4, 1}, with([](auto& o) { o.stddev[1] = 0.f; })));  // unused channel
  CHECK_THROWS_AS(fi::make_augment_plan({4, 4, 3}, with([](auto& o) { o.flip_probability = -0.1f; })), E);
  CHECK_THROWS_AS(fi::make_augment_plan({4, 4, 3}, with([](auto& o) { o.flip_probability = 1.5f; })), E);
  CHECK_THROWS_AS(fi::make_augment_plan({4, 4, 3}, with([](auto& o) { o.flip_probability = NAN; })), E);
  CHECK_THROWS_AS(fi::make_augment_plan({4, 4, 3}, with([](auto& o) { o.brightness = {0.2f, 0.1f}; })), E);
  CHECK_THROWS_AS(fi::make_augment_plan({4, 4, 3}, with([](auto& o) { o.brightness = {-INFINITY, 0.1f}; })), E);
  CHECK_THROWS_AS(fi::make_augment_plan({4, 4, 3}, with([](auto& o) { o.contrast = {-0.5f, 1.f}; })), E);
  CHECK_THROWS_AS(fi::make_augment_plan({4, 4, 3}, with([](auto& o) { o.contrast = {2.f, 1.f}; })), E);

  const fi::augment_plan p = fi::make_augment_plan({2, 3, 3}, ok);
  std::vector<std::uint8_t> in(2 * 18);
  std::vector<float> out(2 * 18);
  CHECK_NOTHROW(fi::augment_host(in, out, p, 0));
  CHECK_THROWS_AS(fi::augment_host(std::span(in).first(17), out, p, 0), E);  // not whole images
  CHECK_THROWS_AS(fi::augment_host(in, std::span(out).first(35), p, 0), E);   // output too small
  CHECK_THROWS_AS(fi::augment_host(in, out, fi::augment_plan{}, 0), E);      // not from make_augment_plan
  CHECK_THROWS_AS(fi::augment_host(in.data(), 2, 2, 3, 3, out.data(), with([](auto& o) { o.stddev[0] = 0.f; }), 0), E);
  CHECK_THROWS_AS(fi::host_augmenter({2, 3, 3}, with([](auto& o) { o.contrast = {-1.f, 0.f}; })), E);
}

namespace {
constexpr std::uint32_t H = 5, W = 6, C = 3;
using picture = std::array<std::uint8_t, H * W * C>;
}  // namespace

TEST_CASE("the entry point on distribute(host_replicas): each replica's rows as in the whole batch") {
  std::vector<picture> data(53);
  ferry::detail::splitmix64 g(8);
  for (auto& d : data)
    for (auto& b : d) b = std::uint8_t(g());
  fi::augment_options o;
  o.flip_probability = 0.5f;
  o.brightness = {-0.1f, 0.1f};
  o.contrast = {0.8f, 1.2f};
  o.mean = {0.4f, 0.5f, 0.6f};
  o.stddev = {0.2f, 0.3f, 0.25f};
  fi::host_augmenter aug({H, W, C}, o);
  const std::size_t per = std::size_t(H) * W * C;
  for (auto pol : {ferry::remainder_policy::drop, ferry::remainder_policy::pad, ferry::remainder_policy::partial}) {
    CAPTURE(int(pol));
    auto steps = ferry::from_range(data) | ferry::batch(12) | ferry::distribute(ferry::host_replicas{3}, {.remainder = pol});
    std::size_t nsteps = 0, rows_seen = 0;
    for (auto& st : steps) {
      const std::uint64_t key = fi::augment_key(1, st.index());
      // The oracle: the whole global batch on the host, rows 0..G-1.
      const auto& hb = st.host_batch();
      const std::size_t grows = st.global_size();
      std::vector<float> whole(grows * per);
      fi::augment_host({reinterpret_cast<const std::uint8_t*>(hb.field_buffer(0).data()), grows * per}, whole,
                       aug.plan(), key);
      std::size_t first = 0;
      for (std::size_t r = 0; r < st.replicas(); ++r) {
        fi::augmented x = aug(st, r, key);
        CHECK(x.device() == -1);
        CHECK(x.stream() == nullptr);
        REQUIRE(x.size() == st[r].size());
        REQUIRE(x.data().size() == st[r].size() * per);
        if (x.size())
          CHECK(std::memcmp(x.data().data(), whole.data() + first * per, x.data().size_bytes()) == 0);
        first += st[r].size();
        rows_seen += st[r].size();
      }
      ++nsteps;
    }
    CHECK(nsteps == (pol == ferry::remainder_policy::drop ? 4u : 5u));
    CHECK(rows_seen == (pol == ferry::remainder_policy::drop ? 48u : pol == ferry::remainder_policy::pad ? 60u : 53u));
  }
  // A field of another size is a config_error naming both sizes.
  fi::host_augmenter wrong({H, W, 1}, {});
  auto steps = ferry::from_range(data) | ferry::batch(12) | ferry::distribute(ferry::host_replicas{2});
  for (auto& st : steps) {
    CHECK_THROWS_AS(wrong(st, 0, 0), ferry::config_error);
    break;
  }
}
