// ferry/collective/rank_exchange.hpp: the two collectives that move rows between processes,
// behind one small interface, for stages that are not templates on a communicator
// (cache_on_device's one order across ranks: cache_on_device_options::ranks).
//
//   ferry::mpi_communicator world;                          // collective/mpi.hpp
//   ferry::rank_exchange_over<ferry::mpi_communicator> ex(world);
//   auto steps = ... | ferry::distribute(ferry::host_replicas{2})
//              | ferry::cache_on_device({.seed = 7, .across_replicas = true, .ranks = &ex});
//
// Every rank calls the same collectives in the same order (MPI's contract): a stage that
// uses one calls them at the same points of every rank's epochs.
//
// Threads: one exchange is used by one thread at a time (the stage's caller); runs no user
// code. Errors: what the communicator throws (ferry::error naming the MPI call); a failed
// collective leaves the group unusable.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ferry {

// One process's handle on a group of processes that exchange bytes (see the file's top).
class rank_exchange {
 public:
  virtual ~rank_exchange() = default;
  // This process's index in [0, size()).
  virtual int rank() const = 0;
  // The number of processes.
  virtual int size() const = 0;
  // Every rank's `bytes` bytes (the same count on every rank), in rank order, into `all`
  // (size() x bytes).
  virtual void all_gather(const void* mine, std::size_t bytes, void* all) = 0;
  // To each rank p, send_counts[p] units of `unit` bytes, taken from `send` rank after rank;
  // from each rank p, recv_counts[p] units into `recv`, rank after rank (recv_counts[p] on
  // this rank = send_counts[this rank] on p: the caller agrees the counts first).
  virtual void all_to_all(const void* send, const std::uint64_t* send_counts, void* recv,
                          const std::uint64_t* recv_counts, std::size_t unit) = 0;
};

// A rank_exchange over a communicator C that has rank(), size(), all_gather_bytes and
// all_to_all_bytes of these signatures (ferry::mpi_communicator). Holds a reference: C
// must outlive it.
template <class C>
class rank_exchange_over final : public rank_exchange {
 public:
  // Exchanges through c.
  explicit rank_exchange_over(C& c) noexcept : c_(c) {}
  // c.rank().
  int rank() const override { return c_.rank(); }
  // c.size().
  int size() const override { return c_.size(); }
  // c.all_gather_bytes(mine, bytes, all).
  void all_gather(const void* mine, std::size_t bytes, void* all) override { c_.all_gather_bytes(mine, bytes, all); }
  // c.all_to_all_bytes(send, send_counts, recv, recv_counts, unit).
  void all_to_all(const void* send, const std::uint64_t* send_counts, void* recv, const std::uint64_t* recv_counts,
                  std::size_t unit) override {
    c_.all_to_all_bytes(send, send_counts, recv, recv_counts, unit);
  }

 private:
  C& c_;
};

}  // namespace ferry
