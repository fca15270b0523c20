// The simulated NCCL (nccl.h): cliques of communicators in one process, collectives as
// simulator instances that run when every rank's member reaches the head of its stream.
#include "nccl.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

struct clique {
  int nranks = 0;
  struct buffers {
    const float* send = nullptr;
    float* recv = nullptr;
  };
  // The buffers of each instance's members, by rank (filled as ranks enqueue).
  std::map<std::uint64_t, std::vector<buffers>> pending;
  // A rank's sends and receives of one group (point to point).
  struct p2p {
    bool send = false;
    int peer = 0;
    const void* data = nullptr;
    std::size_t bytes = 0;
  };
  std::map<std::uint64_t, std::vector<std::vector<p2p>>> pending_p2p;
  int joined = 0;  // ncclCommInitRank calls (the rendezvous waits for nranks)
};

std::mutex m;
std::vector<std::shared_ptr<clique>> cliques;
std::map<std::string, std::shared_ptr<clique>> by_id;  // ncclCommInitRank's rendezvous
struct async_error {
  ncclResult_t result;
  int after;  // queries still to report ncclSuccess
};
std::map<int, async_error> async_errors;
long async_queries = 0;
int live = 0;
thread_local int group_depth = 0;
// This thread's open group's point-to-point calls, per communicator and its stream, in call order.
struct group_ops {
  ncclComm* comm;
  cudaStream_t stream;
  std::vector<clique::p2p> ops;
};
thread_local std::vector<group_ops> group_p2p;
// The rendezvous (sim::nccl_rendezvous): whether it waits, for how long, and the cliques this
// thread's open group joined.
bool rendezvous = false;
double rendezvous_timeout_s = 3.0;
std::condition_variable joined_cv;
thread_local std::vector<std::shared_ptr<clique>> group_inits;
ncclResult_t unique_id_result = ncclSuccess;  // sim::nccl_fail_unique_id

// Waits (rendezvous on) until every rank of each clique joined; reports a deadlock after the
// timeout. Called without m held.
ncclResult_t await_ranks(const std::vector<std::shared_ptr<clique>>& cs) {
  std::unique_lock lk(m);
  if (!rendezvous) return ncclSuccess;
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(rendezvous_timeout_s);
  for (const auto& c : cs)
    if (!joined_cv.wait_until(lk, until, [&] { return c->joined >= c->nranks; })) {
      const std::string what = "deadlock: ncclCommInitRank waits for the rest of a clique of " +
                               std::to_string(c->nranks) + " ranks, " + std::to_string(c->joined) +
                               " joined (NCCL would wait forever)";
      lk.unlock();
      sim::report(what);
      return ncclSystemError;
    }
  return ncclSuccess;
}

}  // namespace

struct ncclComm {
  std::shared_ptr<clique> c;
  int rank = 0, device = 0;
  std::uint64_t next_seq = 0;
};

namespace {

ncclComm* make(std::shared_ptr<clique> c, int rank, int device) {
  auto* comm = new ncclComm{std::move(c), rank, device, 0};
  ++live;
  return comm;
}

// Enqueues this rank's member of the next instance; `combine` runs once per instance
// (on rank 0's member, when all are at their streams' heads) over every rank's buffers.
ncclResult_t collective(const char* call, ncclComm_t comm, cudaStream_t stream, const void* send, void* recv,
                        std::size_t count, void (*combine)(std::vector<clique::buffers>&, std::size_t, int),
                        int arg) {
  if (!comm) return ncclInvalidArgument;
  // Captured: each launch of the graph joins the next instance, as NCCL's captured
  // collectives do, so the call is made again at every replay (a fresh sequence number).
  if (sim::capture_node(stream, [=](cudaStream_t to) { collective(call, comm, to, send, recv, count, combine, arg); }))
    return ncclSuccess;
  std::uint64_t seq;
  {
    std::lock_guard lk(m);
    seq = comm->next_seq++;
    auto& b = comm->c->pending[seq];
    b.resize(comm->c->nranks);
    b[comm->rank] = {static_cast<const float*>(send), static_cast<float*>(recv)};
  }
  const std::size_t bytes = count * sizeof(float);
  for (const void* p : {send, static_cast<const void*>(recv)})
    if (bytes && sim::device_of(p) != comm->device)
      sim::report(std::string(call) + " (rank " + std::to_string(comm->rank) + "): a buffer that is not device " +
                  std::to_string(comm->device) + " memory");
  std::function<void()> run;
  if (comm->rank == 0) {
    std::shared_ptr<clique> c = comm->c;
    run = [c, seq, count, combine, arg] {
      std::vector<clique::buffers> b;
      {
        std::lock_guard lk(m);
        b = std::move(c->pending[seq]);
        c->pending.erase(seq);
      }
      combine(b, count, arg);
    };
  }
  const auto id = sim::join_collective(stream, comm->c.get(), seq, comm->rank, comm->c->nranks,
                                       std::string(call) + " rank " + std::to_string(comm->rank),
                                       {{send, bytes}}, {{recv, bytes}}, std::move(run));
  return id ? ncclSuccess : ncclInvalidUsage;
}

void reduce_sum_avg(std::vector<clique::buffers>& b, std::size_t count, int avg) {
  std::vector<float> out(count, 0.0f);
  for (auto& r : b)  // ranks in order: a fixed association, as NCCL's ring gives per size
    for (std::size_t i = 0; i < count; ++i) out[i] += r.send[i];
  if (avg)
    for (auto& v : out) v /= float(b.size());
  for (auto& r : b) std::memcpy(r.recv, out.data(), count * sizeof(float));
}
void bcast(std::vector<clique::buffers>& b, std::size_t count, int root) {
  std::vector<float> v(b[root].send, b[root].send + count);
  for (auto& r : b) std::memcpy(r.recv, v.data(), count * sizeof(float));
}

std::size_t type_bytes(ncclDataType_t t) { return t == ncclFloat32 ? 4 : 1; }

// One rank's group of sends and receives as its member of the clique's next instance; rank
// 0's member moves every rank's bytes (each send into the peer's matching receive).
ncclResult_t join_p2p(ncclComm* comm, cudaStream_t stream, std::vector<clique::p2p> ops) {
  std::uint64_t seq;
  std::vector<sim::range> reads, writes;
  for (const auto& o : ops) (o.send ? reads : writes).push_back({o.data, o.bytes});
  {
    std::lock_guard lk(m);
    seq = comm->next_seq++;
    auto& b = comm->c->pending_p2p[seq];
    b.resize(comm->c->nranks);
    b[comm->rank] = std::move(ops);
  }
  std::function<void()> run;
  if (comm->rank == 0) {
    std::shared_ptr<clique> c = comm->c;
    run = [c, seq] {
      std::vector<std::vector<clique::p2p>> all;
      {
        std::lock_guard lk(m);
        all = std::move(c->pending_p2p[seq]);
        c->pending_p2p.erase(seq);
      }
      std::vector<std::vector<std::size_t>> next(all.size(), std::vector<std::size_t>(all.size(), 0));  // [to][from]
      for (std::size_t from = 0; from < all.size(); ++from)
        for (const auto& o : all[from]) {
          if (!o.send) continue;
          const std::size_t to = std::size_t(o.peer);
          std::size_t& k = next[to][from];
          std::size_t seen = 0;
          const clique::p2p* match = nullptr;
          for (const auto& r : all[to])
            if (!r.send && r.peer == int(from) && seen++ == k) {
              match = &r;
              break;
            }
          ++k;
          if (!match) {
            sim::report("ncclSend from rank " + std::to_string(from) + " to " + std::to_string(to) +
                        " has no matching ncclRecv in the group");
            continue;
          }
          if (match->bytes != o.bytes) {
            sim::report("ncclSend of " + std::to_string(o.bytes) + " bytes from rank " + std::to_string(from) +
                        " to " + std::to_string(to) + " meets an ncclRecv of " + std::to_string(match->bytes));
            continue;
          }
          if (o.bytes) std::memmove(const_cast<void*>(match->data), o.data, o.bytes);
        }
      for (std::size_t to = 0; to < all.size(); ++to) {
        std::size_t recvs = 0, sends = 0;
        for (const auto& r : all[to]) recvs += !r.send;
        for (std::size_t from = 0; from < all.size(); ++from) sends += next[to][from];
        if (recvs != sends)
          sim::report("rank " + std::to_string(to) + " posted " + std::to_string(recvs) + " ncclRecv but " +
                      std::to_string(sends) + " sends reached it");
      }
    };
  }
  int prev = 0;  // NCCL launches each rank's part on its own device, whichever is current
  cudaGetDevice(&prev);
  cudaSetDevice(comm->device);
  const auto id = sim::join_collective(stream, comm->c.get(), seq, comm->rank, comm->c->nranks,
                                       "ncclSend/ncclRecv group rank " + std::to_string(comm->rank), reads, writes,
                                       std::move(run));
  cudaSetDevice(prev);
  return id ? ncclSuccess : ncclInvalidUsage;
}

ncclResult_t p2p_call(bool send, const void* data, std::size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  if (!comm || peer < 0 || peer >= comm->c->nranks) return ncclInvalidArgument;
  if (group_depth == 0) return ncclInvalidUsage;  // the sim's subset: inside a group
  const std::size_t bytes = count * type_bytes(type);
  if (bytes && sim::device_of(data) != comm->device)
    sim::report(std::string(send ? "ncclSend" : "ncclRecv") + " (rank " + std::to_string(comm->rank) +
                "): a buffer that is not device " + std::to_string(comm->device) + " memory");
  auto it = std::find_if(group_p2p.begin(), group_p2p.end(), [&](const group_ops& g) { return g.comm == comm; });
  if (it == group_p2p.end()) it = group_p2p.insert(group_p2p.end(), group_ops{comm, stream, {}});
  if (it->stream != stream) return ncclInvalidUsage;  // one stream per communicator in a group
  it->ops.push_back({send, peer, data, bytes});
  return ncclSuccess;
}

}  // namespace

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
  }
  return "unknown result code";
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  static std::mt19937_64 g(42);
  std::lock_guard lk(m);
  if (const ncclResult_t r = std::exchange(unique_id_result, ncclSuccess); r != ncclSuccess) return r;
  for (auto& ch : id->internal) ch = static_cast<char>(g());
  return ncclSuccess;
}

ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  if (ndev < 1) return ncclInvalidArgument;
  int count = 0;
  cudaGetDeviceCount(&count);
  for (int i = 0; i < ndev; ++i)  // every device first, as NCCL does: a failure makes no communicator
    if (const int d = devlist ? devlist[i] : i; d < 0 || d >= count) return ncclInvalidArgument;
  std::lock_guard lk(m);
  auto c = std::make_shared<clique>();
  c->nranks = ndev;
  cliques.push_back(c);
  for (int i = 0; i < ndev; ++i) comms[i] = make(c, i, devlist ? devlist[i] : i);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  if (nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  int dev = 0;
  cudaGetDevice(&dev);
  std::unique_lock lk(m);
  auto& c = by_id[std::string(id.internal, sizeof id.internal)];
  if (!c) {
    c = std::make_shared<clique>();
    c->nranks = nranks;
    cliques.push_back(c);
  }
  if (c->nranks != nranks) return ncclInvalidUsage;
  *comm = make(c, rank, dev);
  ++c->joined;
  joined_cv.notify_all();
  if (group_depth > 0) {  // NCCL connects the group's ranks at its ncclGroupEnd
    group_inits.push_back(c);
    return ncclSuccess;
  }
  std::vector<std::shared_ptr<clique>> one{c};
  lk.unlock();
  return await_ranks(one);
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return ncclInvalidArgument;
  sim::wait_collectives(comm->c.get(), comm->rank);  // NCCL finalizes: its work completes first
  std::lock_guard lk(m);
  delete comm;
  --live;
  return ncclSuccess;
}
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  sim::abort_collectives(comm->c.get(), comm->rank);
  std::lock_guard lk(m);
  delete comm;
  --live;
  return ncclSuccess;
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error) {
  if (!comm) return ncclInvalidArgument;
  std::lock_guard lk(m);
  ++async_queries;
  const auto it = async_errors.find(comm->rank);
  *async_error = ncclSuccess;
  if (it != async_errors.end()) {
    if (it->second.after > 0) --it->second.after;
    else *async_error = it->second.result;
  }
  return ncclSuccess;
}
ncclResult_t ncclGroupStart() {
  ++group_depth;
  return ncclSuccess;
}
ncclResult_t ncclGroupEnd() {
  if (group_depth == 0) return ncclInvalidUsage;
  if (--group_depth > 0) return ncclSuccess;
  std::vector<group_ops> groups = std::move(group_p2p);
  group_p2p.clear();
  std::vector<std::shared_ptr<clique>> inits = std::move(group_inits);
  group_inits.clear();
  ncclResult_t result = await_ranks(inits);
  for (auto& g : groups)
    if (join_p2p(g.comm, g.stream, std::move(g.ops)) != ncclSuccess) result = ncclInvalidUsage;
  return result;
}

ncclResult_t ncclSend(const void* send, std::size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return p2p_call(true, send, count, type, peer, comm, stream);
}
ncclResult_t ncclRecv(void* recv, std::size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return p2p_call(false, recv, count, type, peer, comm, stream);
}

ncclResult_t ncclAllReduce(const void* send, void* recv, std::size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  if (type != ncclFloat32 || (op != ncclSum && op != ncclAvg)) return ncclInvalidArgument;  // the sim's subset
  return collective("ncclAllReduce", comm, stream, send, recv, count, reduce_sum_avg, op == ncclAvg);
}
ncclResult_t ncclBroadcast(const void* send, void* recv, std::size_t count, ncclDataType_t type, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  if (type != ncclFloat32 || !comm || root < 0 || root >= comm->c->nranks) return ncclInvalidArgument;
  return collective("ncclBroadcast", comm, stream, send, recv, count, bcast, root);
}

namespace sim {
int live_nccl_comms() {
  std::lock_guard lk(m);
  return live;
}
void nccl_async_error(int rank, ncclResult_t r, int after_queries) {
  std::lock_guard lk(m);
  if (r == ncclSuccess) async_errors.erase(rank);
  else async_errors[rank] = {r, after_queries};
}
long nccl_async_queries() {
  std::lock_guard lk(m);
  return async_queries;
}
void nccl_fail_unique_id(ncclResult_t r) {
  std::lock_guard lk(m);
  unique_id_result = r;
}
void nccl_rendezvous(bool on, double timeout_s) {
  std::lock_guard lk(m);
  rendezvous = on;
  rendezvous_timeout_s = timeout_s;
}
}  // namespace sim
