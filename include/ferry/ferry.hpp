// ferry/ferry.hpp: the whole CPU layer (g++ alone). The CUDA layer is included separately
// (ferry/cuda/...), so this header never needs nvcc. It only includes the others: what
// each stage throws and which thread runs user code is at the top of its own header.
#pragma once

// ferry needs C++20: one error line under an older standard instead of hundreds.
#if !defined(__cplusplus) || __cplusplus < 202002L
#error "ferry needs C++20: compile with -std=c++20 (pkg-config's ferry.pc and CMake's ferry::ferry add it)"
#else

#include "ferry/any_source.hpp"
#include "ferry/config.hpp"
#include "ferry/error.hpp"
#include "ferry/memory/buffer.hpp"
#include "ferry/source.hpp"
#include "ferry/sources/from_generator.hpp"
#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/bucket_by_sequence_length.hpp"
#include "ferry/stages/cache.hpp"
#include "ferry/stages/concatenate.hpp"
#include "ferry/stages/filter.hpp"
#include "ferry/stages/flat_map.hpp"
#include "ferry/stages/lockstep.hpp"
#include "ferry/stages/map.hpp"
#include "ferry/stages/pack.hpp"
#include "ferry/stages/padded_batch.hpp"
#include "ferry/stages/prefetch.hpp"
#include "ferry/stages/repeat.hpp"
#include "ferry/stages/sample_from.hpp"
#include "ferry/stages/shard.hpp"
#include "ferry/stages/shuffle.hpp"
#include "ferry/stages/skip.hpp"
#include "ferry/stages/take.hpp"
#include "ferry/stages/zip.hpp"
#include "ferry/stats.hpp"
#include "ferry/trace.hpp"
#endif  // C++20
