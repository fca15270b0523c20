// gpu_augment.cu: the augmentation kernel for device replicas (augment.cuh needs nvcc), one
// launch per replica batch on the replica's stream; the g++ side sees only augment_fn.
#include <memory>

#include "ferry/image/augment.cuh"
#include "image_sample.hpp"

namespace ex12 {

augment_fn make_device_augment(const ferry::image::augment_shape& s, const ferry::image::augment_options& o) {
  auto a = std::make_shared<ferry::image::augmenter>(s, o);  // its pools outlive every output
  return [a](const ferry::step<sample>& st, std::size_t r, std::uint64_t key) { return (*a)(st, r, key); };
}

}  // namespace ex12
