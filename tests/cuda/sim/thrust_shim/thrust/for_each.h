// Sim shim of Thrust's for_each for the simulated runtime: only the form ferry's GPU backend
// uses, thrust::for_each(thrust::cuda::par_nosync.on(stream), first, last, f) over counting
// iterators, enqueued as a kernel on `stream` that calls f(i) for every i when the simulator
// runs it. The functor is copied, as a kernel launch copies it. Declared in an inline
// namespace so it never collides with the real Thrust that another file of the same test
// may use (the host backend).
#pragma once

#include <cstddef>
#include <string>

#include <cuda_runtime_api.h>

#include "thrust/iterator/counting_iterator.h"
#include "thrust/system/cuda/execution_policy.h"

namespace thrust {
inline namespace ferry_sim {

template <class T, class F>
void for_each(cuda::stream_policy p, counting_iterator<T> first, counting_iterator<T> last, F f) {
  const T lo = *first, hi = *last;
  if (hi <= lo) return;
  sim::launch(p.stream, "thrust::for_each over " + std::to_string(hi - lo), {}, {}, [f, lo, hi] {
    for (T i = lo; i < hi; ++i) f(i);
  });
}

}  // namespace ferry_sim
}  // namespace thrust
