// ferry/cuda/stream_handle.hpp: ferry::cuda_stream, a CUDA stream's type without the CUDA
// runtime's headers. It is the type cudaStream_t names (a pointer to the runtime's opaque
// struct CUstream_st), so a cudaStream_t converts to it and back with no cast, and code
// built with g++ alone (host replicas: always null) keeps it typed rather than void*.
// Throws nothing; no threads.
#pragma once

struct CUstream_st;

namespace ferry {
// A CUDA stream, the same type as cudaStream_t (see the file's top).
using cuda_stream = CUstream_st*;
}  // namespace ferry
