// image_sample.hpp: what 12_image_classification.cpp (g++) and gpu_augment.cu (nvcc) share:
// the batch element the pipeline collates and the augmentation call for one replica batch.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <tuple>

#include "ferry/image/augment.hpp"
#include "ferry/step.hpp"

namespace ex12 {

constexpr std::uint32_t side = 28;  // Fashion-MNIST: 28 x 28 greyscale
constexpr int classes = 10;
using pixels = std::array<std::uint8_t, side * side>;
using sample = std::tuple<pixels, std::int32_t>;  // HWC uint8 image, class

// Replica r of a step, augmented under the step's key: floats CHW (C = 1, so the rows the
// MLP reads), in the replica's memory, ready on its stream.
using augment_fn =
    std::function<ferry::image::augmented(const ferry::step<sample>&, std::size_t r, std::uint64_t key)>;

// gpu_augment.cu (nvcc, FERRY_EXAMPLE_GPU): ferry::image::augmenter, the kernel on each
// device replica's stream. Throws config_error for bad options.
augment_fn make_device_augment(const ferry::image::augment_shape& s, const ferry::image::augment_options& o);

}  // namespace ex12
