// ferry/collective/device_exchange.hpp: an all-to-all of bytes between GPUs, behind one
// small interface, for stages that are not templates on a communicator (cache_on_device's
// one order across GPU replicas without peer access, or across processes:
// cache_on_device_options::devices). ferry::nccl_device_exchange (collective/nccl.hpp)
// implements it with grouped ncclSend/ncclRecv.
//
//   auto comms = ferry::nccl_communicators(ctx);              // ferry/distributed.hpp
//   ferry::nccl_device_exchange ex(comms);                    // this process's ranks
//   auto steps = ... | ferry::distribute(ferry::cuda::devices{0, 1})
//              | ferry::cuda::cache_on_device({.seed = 7, .across_replicas = true, .ranks = &mpi_ex, .devices = &ex});
//
// The clique's ranks are the job's GPU replicas: global replica w x R + r (rank w's
// replica r) is clique rank w x R + r, on that replica's device. cache_on_device calls it a
// unit a step while an epoch is served: give it the communicators the trainer all-reduces
// with, so that NCCL orders both alike on every rank (NCCL does not promise that calls on
// two communicators running at once cannot deadlock). The trainer replays its all-reduce
// in CUDA graphs (trainer_options::graphs) while these calls run outside graphs on the
// same communicators: NCCL allows that mix with NCCL_GRAPH_MIXING_SUPPORT=1, its default;
// a job that sets it to 0 (for speed) must turn the trainer's graphs off.
//
// Threads: one exchange is used by one thread at a time (the stage's caller), which
// drives all of this process's ranks (one group); runs no user code. Errors: what the
// communicator throws (ferry::error naming the NCCL call). A call that fails leaves the
// clique's calls unmatched: cache_on_device aborts the exchange on that rank at once and
// throws, and on the others at its next rewind; the job should end (abort_on_exception:
// ranks that reach no rewind wait in NCCL otherwise).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "ferry/cuda/stream_handle.hpp"

namespace ferry {

// One local rank's part of an all-to-all: to each rank p, send_bytes[p] bytes taken from
// `send` rank after rank; from each rank p, recv_bytes[p] bytes into `recv`, rank after
// rank (recv_bytes[p] here = send_bytes[this rank] on p: the caller agrees the counts);
// or, with send_at / recv_at, rank p's bytes at those offsets. Device memory of the rank's
// device; enqueued on `stream`.
struct device_all_to_all_part {
  const std::byte* send = nullptr;            // what goes out, rank after rank
  const std::uint64_t* send_bytes = nullptr;  // size() counts (host memory)
  std::byte* recv = nullptr;                  // what comes in, rank after rank
  const std::uint64_t* recv_bytes = nullptr;  // size() counts (host memory)
  cuda_stream stream = nullptr;               // the rank's stream: the trade is ordered on it
  const std::uint64_t* send_at = nullptr;     // size() offsets in send (host memory), or rank after rank
  const std::uint64_t* recv_at = nullptr;     // size() offsets in recv (host memory), or rank after rank
};

// This process's ranks of a clique of GPUs that exchange bytes (see the file's top).
class device_exchange {
 public:
  virtual ~device_exchange() = default;
  // The clique's ranks: every GPU replica of the job.
  virtual int size() const = 0;
  // This process's first rank: its ranks are first() .. first() + local() - 1, its
  // replicas in order.
  virtual int first() const = 0;
  // This process's count of ranks.
  virtual int local() const = 0;
  // Local rank i's device.
  virtual int device(int i) const = 0;
  // One all-to-all of every local rank (parts[i]: local rank i's), in one group: enqueued
  // on each part's stream, returns at once. Every rank of the clique calls it, with the
  // same count of parts as its local().
  virtual void all_to_all(std::span<const device_all_to_all_part> parts) = 0;
  // Ends this process's unfinished calls (a rank that stopped calling will never match
  // them: NCCL's ncclCommAbort), so that their streams drain; every later call throws.
  // cache_on_device calls it on every rank when a trade's call failed on any rank.
  // Idempotent; never throws.
  virtual void abort() noexcept = 0;
};

}  // namespace ferry
