// ferry/train/host_trainer.hpp: the mirrored trainer on host replicas: OpenBLAS + Thrust
// CPP on N threads, gradients all-reduced in-process (thread_group).
//
//   ferry::train::host_trainer t(cfg, {.opt = {...}, .seed = 1, .max_rows = 64}, replicas);
//
// See mirrored_trainer.hpp for the step, errors and threads; host_backend.hpp for the
// build flags (OpenBLAS, Thrust's headers, THRUST_DEVICE_SYSTEM per target).
#pragma once

#include "ferry/collective/thread_collective.hpp"
#include "ferry/train/host_backend.hpp"
#include "ferry/train/mirrored_trainer.hpp"

namespace ferry::train {
// The mirrored trainer on host replicas (see the file's top).
using host_trainer = mirrored_trainer<host_backend, thread_communicator>;
}  // namespace ferry::train
