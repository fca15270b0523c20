// ferry/image/augment.hpp: augmentation of uint8 image batches after distribute(): uint8 to
// float, a random left-right flip, random brightness and contrast, mean/std normalisation,
// HWC to CHW, in one pass. This header is the host implementation (host replicas, CI's
// oracle) and the dispatch; ferry/image/augment.cuh (nvcc) adds the kernel, which runs the
// same arithmetic on the replica's stream, one launch per replica batch.
//
//   ferry::image::augment_options o{.mean = {0.485f, 0.456f, 0.406f}, .stddev = {0.229f, 0.224f, 0.225f},
//                                   .flip_probability = 0.5f, .brightness = {-0.1f, 0.1f}, .seed = 7};
//   ferry::image::augmenter aug({224, 224, 3}, o);    // augment.cuh; host_augmenter here
//   for (auto& st : steps)                             // ... | distribute(...)
//     for (std::size_t r = 0; r < st.replicas(); ++r) {
//       ferry::image::augmented x = aug(st, r, ferry::image::augment_key(epoch, st.index()));
//       // x.data(): size() rows of C x H x W floats, device memory for a device replica,
//       // ready on st[r].stream(); enqueue the work that reads it there, then drop x.
//     }
//
// What a value becomes (v: a uint8 of channel c, in a row whose draw is flip, k, d):
//   x = v / 255, then x = (x - 0.5) * k + 0.5 + d, clamped to [0, 1], then (x - mean[c]) / stddev[c].
// Brightness d is additive, contrast k scales around mid grey 0.5 (torchvision's contrast
// pivots on each image's mean grey, which needs a reduction over the image before the
// values: a second pass, which this one-pass design leaves out). Computed as
//   a = k * (1/255), b = fmaf(-0.5, k, 0.5 + d);   y = clamp(fmaf(v, a, b));   fmaf(y, 1/stddev, -mean/stddev)
// with every multiply-add an explicit fmaf: an IEEE fused multiply-add is rounded once,
// the same on every CPU and GPU, and nothing is left for a compiler to contract (nvcc
// fuses a * b + c by default; g++ does not in ISO mode; clang may). So the host path and
// the kernel agree BIT FOR BIT, not within a tolerance, whatever the compilers and flags,
// except nvcc's --use_fast_math (it flushes subnormals; none arise from valid options, but
// it is not what is tested). Against the formula in exact arithmetic the error is a few
// float ulps (the coefficients' rounding).
//
// Draws: each row's flip, k and d come from splitmix64 seeded with mix_seed({seed, key,
// row}) (ferry/detail/random.hpp: defined bit for bit, unlike std's distributions), three
// words always drawn whatever is enabled, so turning one on does not change the others.
// `key` is the caller's per-step number (augment_key(epoch, step) mixes the two); `row` is
// the row's index in the GLOBAL batch, so a sample's augmentation does not depend on how
// many replicas the batch was split over. The kernel draws in the kernel (one thread per
// block, from the same code), so nothing per step is copied to the device.
//
// Threads: none. augment_host runs on the caller's thread; an augmenter may be used from
// several threads at once (one per replica); its pools are thread-safe.
//
// Errors: config_error for an invalid shape (a side of 0, channels not 1..4, more than
// 2^31 values an image), invalid options (a stddev that is 0, negative or not finite; a
// mean that is not finite; a flip probability outside [0, 1]; a range whose low end
// exceeds its high end; a negative contrast), and buffers whose sizes do not match;
// std::bad_alloc for host output buffers; cuda_error from the device path.
//
// Memory: augment_host allocates nothing (its per-row table is on the stack). An
// augmenter's outputs come from pools: host memory from a buffer_pool, device memory from
// one device_buffer_pool per device, reused in stream order (the block waits, on the GPU,
// for the work enqueued before the last output in it was dropped). Device blocks hold the
// most rows a replica batch has had, so a short batch (a partial last one) reuses a full
// one's block: after the largest step, no allocation per step.
#pragma once

#include <math.h>  // ::fmaf, declared __host__ __device__ by nvcc's math headers

#include <array>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>

#include "ferry/batch_of.hpp"
#include "ferry/config.hpp"
#include "ferry/cuda/stream_handle.hpp"
#include "ferry/detail/random.hpp"
#include "ferry/error.hpp"
#include "ferry/memory/buffer.hpp"
#include "ferry/step.hpp"

#if defined(FERRY_WITH_CUDART)
#include <cuda_runtime_api.h>

#include "ferry/cuda/device_pool.hpp"
#include "ferry/cuda/error.hpp"
#include "ferry/cuda/stream.hpp"
#endif

namespace ferry::image {

// The images of a batch: height x width x channels uint8 values a row (HWC).
struct augment_shape {
  std::uint32_t height = 0;    // pixel rows an image
  std::uint32_t width = 0;     // pixels a pixel row
  std::uint32_t channels = 3;  // values a pixel: 1 to 4
};

// What augmentation does (see the file's top for the formula). The defaults do nothing
// but scale to [0, 1] and reorder to CHW.
struct augment_options {
  std::array<float, 4> mean{0.f, 0.f, 0.f, 0.f};    // per channel, in [0, 1] units
  std::array<float, 4> stddev{1.f, 1.f, 1.f, 1.f};  // per channel, > 0 (only the first `channels` are read)
  float flip_probability = 0.f;                     // chance that a row is mirrored left to right, [0, 1]
  std::array<float, 2> brightness{0.f, 0.f};        // additive d, uniform in [lo, hi]
  std::array<float, 2> contrast{1.f, 1.f};          // factor k >= 0, uniform in [lo, hi]
  std::uint64_t seed = 0;                           // the draws' seed
};

// One row's draw. No default member initialisers: the kernel keeps one in shared memory.
struct augment_row {
  bool flip;         // mirrored left to right
  float contrast;    // k
  float brightness;  // d
  float a, b;        // the affine map of a uint8 value before the clamp: fmaf(v, a, b)
};

// Options checked and turned into what the arithmetic needs; trivially copyable (the
// kernel takes it by value). Made by make_augment_plan.
struct augment_plan {
  std::uint32_t height = 0;    // rows an image
  std::uint32_t width = 0;     // pixels a row
  std::uint32_t channels = 0;  // values a pixel (1..4)
  float scale[4] = {1.f, 1.f, 1.f, 1.f};   // 1 / stddev
  float offset[4] = {0.f, 0.f, 0.f, 0.f};  // -mean / stddev
  std::uint64_t seed = 0;  // augment_options::seed
  std::uint64_t flip_below = 0;  // flip when a draw's top 53 bits are below this (p * 2^53)
  float brightness_lo = 0.f;    // the brightness range's low end
  float brightness_span = 0.f;  // its width (0: no brightness change)
  float contrast_lo = 1.f;      // the contrast range's low end
  float contrast_span = 0.f;    // its width (0: no contrast change)

  // Pixels an image.
  FERRY_HOST_DEVICE std::uint32_t pixels() const { return height * width; }
  // uint8 values an input row (HWC), and floats an output row (CHW): the same count.
  FERRY_HOST_DEVICE std::size_t values() const { return std::size_t(height) * width * channels; }
};

// Checks shape and options; throws config_error saying what is wrong (see the file's top).
// Runs on the caller's thread; allocates nothing unless it throws.
inline augment_plan make_augment_plan(const augment_shape& s, const augment_options& o) {
  auto bad = [](const std::string& what) { throw config_error("augment: " + what); };
  if (s.height == 0 || s.width == 0)
    bad("the image size must be at least 1x1 (got " + std::to_string(s.height) + "x" + std::to_string(s.width) + ")");
  if (s.channels < 1 || s.channels > 4) bad("channels must be 1 to 4 (got " + std::to_string(s.channels) + ")");
  if (std::uint64_t(s.height) * s.width * s.channels > (std::uint64_t(1) << 31))
    bad("an image of " + std::to_string(s.height) + "x" + std::to_string(s.width) + "x" + std::to_string(s.channels) +
        " values is more than the 2^31 supported");
  augment_plan p;
  p.height = s.height, p.width = s.width, p.channels = s.channels;
  for (std::uint32_t c = 0; c < s.channels; ++c) {
    const float sd = o.stddev[c], m = o.mean[c];
    if (!std::isfinite(sd) || !(sd > 0.f))
      bad("stddev[" + std::to_string(c) + "] must be finite and > 0 (got " + std::to_string(sd) + ")");
    if (!std::isfinite(m)) bad("mean[" + std::to_string(c) + "] must be finite");
    p.scale[c] = 1.f / sd;
    p.offset[c] = -m * p.scale[c];
    if (!std::isfinite(p.scale[c]) || !std::isfinite(p.offset[c]))
      bad("stddev[" + std::to_string(c) + "] is too small: 1/stddev or mean/stddev overflows a float");
  }
  if (!(o.flip_probability >= 0.f && o.flip_probability <= 1.f))
    bad("flip_probability must be in [0, 1] (got " + std::to_string(o.flip_probability) + ")");
  auto range = [&](const std::array<float, 2>& r, const char* name) {
    if (!std::isfinite(r[0]) || !std::isfinite(r[1]) || r[0] > r[1])
      bad(std::string(name) + " must be a finite range [lo, hi] with lo <= hi (got [" + std::to_string(r[0]) + ", " +
          std::to_string(r[1]) + "])");
  };
  range(o.brightness, "brightness");
  range(o.contrast, "contrast");
  if (o.contrast[0] < 0.f) bad("contrast must be >= 0 (got lo " + std::to_string(o.contrast[0]) + ")");
  p.seed = o.seed;
  // p * 2^53 is exact in double (p is a float); p == 1 gives 2^53: every row.
  p.flip_below = std::uint64_t(double(o.flip_probability) * 0x1.0p53);
  p.brightness_lo = o.brightness[0], p.brightness_span = o.brightness[1] - o.brightness[0];
  p.contrast_lo = o.contrast[0], p.contrast_span = o.contrast[1] - o.contrast[0];
  if (!std::isfinite(p.brightness_span) || !std::isfinite(p.contrast_span))
    bad("a range's width overflows a float");
  return p;
}

// A step's key for the draws from (epoch, step index): different for every pair.
inline std::uint64_t augment_key(std::uint64_t epoch, std::uint64_t step) {
  return ferry::detail::mix_seed({epoch, step});
}

// Row `row` (of the global batch) of the step with key `key`: its flip, contrast and
// brightness, and the affine coefficients. The same on host and device (nvcc needs
// --expt-relaxed-constexpr for random.hpp's constexpr functions; augment.cuh checks).
FERRY_HOST_DEVICE inline augment_row augment_draw(const augment_plan& p, std::uint64_t key, std::uint64_t row) {
  ferry::detail::splitmix64 g(ferry::detail::mix_seed({p.seed, key, row}));
  const std::uint64_t wf = g(), wb = g(), wc = g();
  augment_row r;
  r.flip = (wf >> 11) < p.flip_below;
  // 24 random bits as a float in [0, 1), exactly; then lo + span * u, rounded once.
  const float ub = float(wb >> 40) * 0x1.0p-24f, uc = float(wc >> 40) * 0x1.0p-24f;
  r.brightness = ::fmaf(p.brightness_span, ub, p.brightness_lo);
  r.contrast = ::fmaf(p.contrast_span, uc, p.contrast_lo);
  r.a = r.contrast * (1.f / 255.f);
  r.b = ::fmaf(-0.5f, r.contrast, 0.5f + r.brightness);
  return r;
}

// One value: uint8 v of channel c, in a row drawn as r (the file's top gives the formula).
FERRY_HOST_DEVICE inline float augment_value(const augment_plan& p, const augment_row& r, std::uint32_t c,
                                             std::uint8_t v) {
  float x = ::fmaf(float(v), r.a, r.b);
  x = x < 0.f ? 0.f : (x > 1.f ? 1.f : x);
  return ::fmaf(x, p.scale[c], p.offset[c]);
}

// Pixel i (0 <= i < p.pixels(), row-major in the OUTPUT) of one image: its channels from
// in_row (HWC, mirrored when r.flip) to the planes of out_row (CHW). The kernel's body,
// one call per thread and pixel; the simulator's twin runs it too. C: p.channels known to
// the compiler (the loop unrolls; the kernel's indices into p stay out of local memory),
// or 0 to read it from p.
template <std::uint32_t C = 0>
FERRY_HOST_DEVICE inline void augment_pixel(const augment_plan& p, const augment_row& r, const std::uint8_t* in_row,
                                            float* out_row, std::uint32_t i) {
  const std::uint32_t ch = C != 0 ? C : p.channels;
  const std::uint32_t y = i / p.width, x = i - y * p.width;
  const std::uint32_t sx = r.flip ? p.width - 1 - x : x;
  const std::uint8_t* px = in_row + (std::size_t(y) * p.width + sx) * ch;
  const std::uint32_t n = p.pixels();
  for (std::uint32_t c = 0; c < ch; ++c) out_row[std::size_t(c) * n + i] = augment_value(p, r, c, px[c]);
}

namespace detail {
// One image on the host: a table of the 256 values of each channel (the same augment_value
// calls the kernel makes per pixel, so the same bits), then a lookup per value.
template <std::uint32_t C>
void augment_image_host(const augment_plan& p, const augment_row& r, const std::uint8_t* in, float* out) {
  float table[C][256];
  for (std::uint32_t c = 0; c < C; ++c)
    for (unsigned v = 0; v < 256; ++v) table[c][v] = augment_value(p, r, c, std::uint8_t(v));
  const std::uint32_t w = p.width, n = p.pixels();
  for (std::uint32_t y = 0; y < p.height; ++y) {
    const std::uint8_t* src = in + std::size_t(y) * w * C;
    float* dst = out + std::size_t(y) * w;
    for (std::uint32_t x = 0; x < w; ++x) {
      const std::uint8_t* px = src + std::size_t(r.flip ? w - 1 - x : x) * C;
      for (std::uint32_t c = 0; c < C; ++c) dst[std::size_t(c) * n + x] = table[c][px[c]];
    }
  }
}
}  // namespace detail

// The host implementation: rows = hwc.size() / p.values() images (HWC) into chw (at least
// rows * p.values() floats, CHW each), rows drawn as global rows first_row, first_row + 1,
// ... of the step with key `key`. Throws config_error when hwc is not a whole number of
// images or chw is too small. Runs on the caller's thread; allocates nothing.
inline void augment_host(std::span<const std::uint8_t> hwc, std::span<float> chw, const augment_plan& p,
                         std::uint64_t key, std::uint64_t first_row = 0) {
  const std::size_t per = p.values();
  if (per == 0) throw config_error("augment_host: the plan is empty (make it with make_augment_plan)");
  if (hwc.size() % per != 0)
    throw config_error("augment_host: " + std::to_string(hwc.size()) + " input bytes are not a whole number of " +
                       std::to_string(p.height) + "x" + std::to_string(p.width) + "x" + std::to_string(p.channels) +
                       " images");
  const std::size_t rows = hwc.size() / per;
  if (chw.size() < rows * per)
    throw config_error("augment_host: the output holds " + std::to_string(chw.size()) + " floats, fewer than the " +
                       std::to_string(rows * per) + " of " + std::to_string(rows) + " images");
  for (std::size_t i = 0; i < rows; ++i) {
    const augment_row r = augment_draw(p, key, first_row + i);
    const std::uint8_t* in = hwc.data() + i * per;
    float* out = chw.data() + i * per;
    switch (p.channels) {
      case 1: detail::augment_image_host<1>(p, r, in, out); break;
      case 2: detail::augment_image_host<2>(p, r, in, out); break;
      case 3: detail::augment_image_host<3>(p, r, in, out); break;
      default: detail::augment_image_host<4>(p, r, in, out); break;
    }
  }
}

// The same with the shape and options given directly (checked at each call: see
// make_augment_plan): n images of h x w x c at hwc, into chw_out (n * h * w * c floats).
inline void augment_host(const std::uint8_t* hwc, std::size_t n, std::uint32_t h, std::uint32_t w, std::uint32_t c,
                         float* chw_out, const augment_options& o, std::uint64_t key) {
  const augment_plan p = make_augment_plan({h, w, c}, o);
  augment_host(std::span<const std::uint8_t>(hwc, n * p.values()), std::span<float>(chw_out, n * p.values()), p, key);
}

// What one kernel launch covers: `rows` images from `in` (device, HWC) to `out` (device,
// CHW), drawn as global rows first_row... of the step with key `key`.
struct augment_launch {
  const std::uint8_t* in = nullptr;  // the rows' uint8 HWC values (device)
  float* out = nullptr;              // their float CHW values (device)
  std::uint32_t rows = 0;            // images
  std::uint64_t key = 0;             // the step's key (augment_key)
  std::uint64_t first_row = 0;       // the first row's index in the global batch
};

// The launcher of a host-only augmenter: a device replica is a config_error saying what to
// include instead.
struct no_kernel {
  // Throws config_error (no kernel in a host-only augmenter).
  [[noreturn]] static void launch(const augment_plan&, const augment_launch&, cuda_stream) {
    throw config_error(
        "augment: a device replica needs the kernel: include ferry/image/augment.cuh (nvcc) and use "
        "ferry::image::augmenter, not host_augmenter");
  }
};

template <class Launch>
class basic_augmenter;

// An augmented replica batch: size() rows of C x H x W floats, in host memory for a host
// replica, else in device memory on device(), written by work enqueued on stream(). Its
// memory returns to the augmenter's pool when it is destroyed: for device memory, after the
// work enqueued on stream() by then (an event), so enqueue everything that reads it on
// stream() before dropping it. Move-only. The destructor never throws; it may run on any
// thread.
class augmented {
 public:
  augmented() = default;
  // Takes o's memory; o is left empty.
  augmented(augmented&& o) noexcept { *this = std::move(o); }
  // Gives back this one's memory, then takes o's; o is left empty.
  augmented& operator=(augmented&& o) noexcept {
    if (this != &o) {
      reset();
      host_ = std::move(o.host_);
      data_ = std::exchange(o.data_, nullptr);
      rows_ = std::exchange(o.rows_, 0);
      block_ = std::exchange(o.block_, 0);
      per_ = o.per_;
      device_ = o.device_;
      stream_ = o.stream_;
#if defined(FERRY_WITH_CUDART)
      pool_ = std::move(o.pool_);
#endif
    }
    return *this;
  }
  augmented(const augmented&) = delete;
  augmented& operator=(const augmented&) = delete;
  ~augmented() { reset(); }

  // The output, size() * values a row floats (device memory when device() >= 0).
  std::span<float> data() const noexcept { return {data_, rows_ * per_}; }
  // Rows (images).
  std::size_t size() const noexcept { return rows_; }
  // -1 for host memory, else the device holding data().
  int device() const noexcept { return device_; }
  // The stream the output is written on (null for host memory).
  cuda_stream stream() const noexcept { return stream_; }

 private:
  template <class>
  friend class basic_augmenter;
  void reset() noexcept {
#if defined(FERRY_WITH_CUDART)
    if (pool_ && data_) {
      // The block goes back after the work enqueued on the stream so far (as distribute's
      // release does); with no event to be had, the host waits for it instead.
      const cuda::device_restore g(device_);
      cudaEvent_t ev = pool_->try_take_event();
      if (ev && cudaEventRecord(ev, stream_) == cudaSuccess) {
        pool_->release(data_, block_, ev);
      } else {
        if (ev) pool_->give_event(ev);
        FERRY_CUDA_LOG(cudaStreamSynchronize(stream_));
        pool_->release(data_, block_, nullptr);
      }
    }
    pool_.reset();
#endif
    host_ = buffer();
    data_ = nullptr;
    rows_ = 0;
  }
#if defined(FERRY_WITH_CUDART)
  std::shared_ptr<cuda::device_buffer_pool> pool_;
#endif
  buffer host_;
  float* data_ = nullptr;
  std::size_t rows_ = 0, per_ = 0, block_ = 0;  // block_: the device block's bytes (>= rows_ x per_ floats)
  int device_ = -1;
  cuda_stream stream_ = nullptr;
};

// Augments what distribute() hands out: field I of a replica batch, a fixed field of
// exactly H x W x C uint8 bytes a row (e.g. std::array<std::uint8_t, H * W * C>), on the
// host for a host replica (augment_host) and with Launch's kernel on the replica's stream
// for a device replica. Use ferry::image::augmenter (augment.cuh) for both, or
// host_augmenter (this header) for host replicas only. Construction throws config_error
// (make_augment_plan). Calls may come from several threads at once.
template <class Launch>
class basic_augmenter {
 public:
  // Images of shape s, augmented with o. Throws config_error (make_augment_plan).
  basic_augmenter(const augment_shape& s, const augment_options& o)
      : plan_(make_augment_plan(s, o)), host_pool_(std::make_shared<buffer_pool>()) {}

  // The checked options.
  const augment_plan& plan() const noexcept { return plan_; }

  // Replica r of step st: its rows are drawn as the global rows they are (the sum of the
  // sizes of replicas 0..r-1 first). Throws as the other overload.
  template <std::size_t I = 0, class T>
  augmented operator()(const step<T>& st, std::size_t r, std::uint64_t key) {
    std::uint64_t first = 0;
    for (std::size_t q = 0; q < r; ++q) first += st[q].size();
    return (*this).template operator()<I>(st[r], key, first);
  }

  // Field I of rb, its rows drawn as global rows first_row, first_row + 1, ... of key's
  // step. Host replica: computed before returning. Device replica: enqueued on rb.stream()
  // (device rb.device() is made current for the call), nothing waited for. A slice of no
  // rows gives an empty result and launches nothing. Throws config_error when the field's
  // rows are not H x W x C bytes, std::bad_alloc, cuda_error (getting a block or launching).
  template <std::size_t I = 0, class T>
  augmented operator()(const replica_batch<T>& rb, std::uint64_t key, std::uint64_t first_row = 0) {
    using F = typename replica_batch<T>::template field_t<I>;
    static_assert(ferry::detail::fixed_field<F>,
                  "augment: the image field must be a fixed-size field (e.g. std::array<std::uint8_t, H * W * C>), "
                  "not a ragged or padded one");
    const std::size_t per = plan_.values();
    if (sizeof(F) != per)
      throw config_error("augment: field " + std::to_string(I) + " has " + std::to_string(sizeof(F)) +
                         " bytes a row, not the " + std::to_string(plan_.height) + "x" + std::to_string(plan_.width) +
                         "x" + std::to_string(plan_.channels) + " = " + std::to_string(per) + " of the shape");
    const std::span<const std::byte> in = rb.field_bytes(I);
    augmented out;
    out.per_ = per;
    out.device_ = rb.device();
    out.stream_ = rb.stream();
    if (rb.size() == 0) return out;
    if (rb.device() < 0) {
      out.host_ = buffer(host_pool_, rb.size() * per * sizeof(float));
      out.data_ = reinterpret_cast<float*>(out.host_.data());
      out.rows_ = rb.size();
      augment_host({reinterpret_cast<const std::uint8_t*>(in.data()), in.size()}, out.data(), plan_, key, first_row);
      return out;
    }
    if (rb.size() > 0xffffffffu) throw config_error("augment: more than 2^32 rows in one replica batch");
#if defined(FERRY_WITH_CUDART)
    std::shared_ptr<cuda::device_buffer_pool> pool = device_pool(rb.device());
    cuda::device_guard g(rb.device());
    // The most rows seen: a short batch takes a full one's block (the pool reuses blocks of
    // one size only), so the last, partial batch of an epoch allocates nothing.
    std::size_t most = most_rows_.load(std::memory_order_relaxed);
    while (most < rb.size() && !most_rows_.compare_exchange_weak(most, rb.size(), std::memory_order_relaxed)) {
    }
    const std::size_t bytes = std::max(most, rb.size()) * per * sizeof(float);
    const cudaStream_t s = rb.stream();
    auto* p = static_cast<float*>(pool->acquire(bytes, s));
    // From here `out` owns the block: if the launch throws, its destructor returns it after
    // what is enqueued on s (the wait acquire may have enqueued).
    out.pool_ = std::move(pool);
    out.data_ = p;
    out.rows_ = rb.size();
    out.block_ = bytes;
    Launch::launch(plan_, {reinterpret_cast<const std::uint8_t*>(in.data()), p, std::uint32_t(rb.size()), key, first_row},
                   rb.stream());
    return out;
#else
    Launch::launch(plan_, {}, rb.stream());  // no_kernel throws; no other launcher builds without the runtime
    throw config_error("augment: a device replica in a build without the CUDA runtime (FERRY_WITH_CUDART)");
#endif
  }

#if defined(FERRY_WITH_CUDART)
  // cudaMalloc calls made for outputs so far, on every device (flat after warm-up).
  std::uint64_t device_allocations() const {
    std::lock_guard lk(m_);
    std::uint64_t n = 0;
    for (const auto& [d, pool] : pools_) n += pool->statistics().allocations;
    return n;
  }
#endif

 private:
#if defined(FERRY_WITH_CUDART)
  std::shared_ptr<cuda::device_buffer_pool> device_pool(int device) {
    std::lock_guard lk(m_);
    auto& p = pools_[device];
    if (!p) p = std::make_shared<cuda::device_buffer_pool>(device);
    return p;
  }
  mutable std::mutex m_;
  std::map<int, std::shared_ptr<cuda::device_buffer_pool>> pools_;  // one per device, made on first use
  std::atomic<std::size_t> most_rows_{0};  // the most rows a device replica batch has had
#endif
  augment_plan plan_;
  std::shared_ptr<buffer_pool> host_pool_;
};

// Host replicas only (a device replica is a config_error); needs neither nvcc nor the
// CUDA runtime. ferry::image::augmenter (augment.cuh) does both.
using host_augmenter = basic_augmenter<no_kernel>;

}  // namespace ferry::image
