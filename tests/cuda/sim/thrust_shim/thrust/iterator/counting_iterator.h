// Sim shim of thrust::counting_iterator (see ../for_each.h): a value, dereferenced.
#pragma once

namespace thrust {
inline namespace ferry_sim {

template <class T>
struct counting_iterator {
  T v{};
  counting_iterator() = default;
  explicit counting_iterator(T x) : v(x) {}
  T operator*() const { return v; }
};

}  // namespace ferry_sim
}  // namespace thrust
