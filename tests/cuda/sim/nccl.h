// A simulated NCCL over the simulated runtime (cuda_runtime_api.h), for sim tests: the
// calls ferry's nccl_communicator makes, in one process. A collective is enqueued on the
// given stream as a member of an instance (sim::join_collective); the k-th collective of
// every rank of a clique form one instance, as in NCCL, and it runs when all members are at
// the head of their streams. ncclCommAbort ends a rank's unfinished collectives (its peers
// still wait for it, as on a GPU); ncclCommDestroy waits for the rank's collectives, so a
// communicator torn down while a peer never joins is reported as a deadlock. Calls name
// their violations: a stream of another device than the communicator's, buffers that are
// not the communicator's device memory, group calls left open.
#pragma once

#include <cstddef>

#include "cuda_runtime.h"  // as the real nccl.h does

enum ncclResult_t {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
};
enum ncclRedOp_t { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 };
enum ncclDataType_t { ncclInt8 = 0, ncclChar = 0, ncclUint8 = 1, ncclFloat32 = 7, ncclFloat = 7 };

#define NCCL_UNIQUE_ID_BYTES 128
struct ncclUniqueId {
  char internal[NCCL_UNIQUE_ID_BYTES];
};
struct ncclComm;
using ncclComm_t = ncclComm*;

const char* ncclGetErrorString(ncclResult_t r);
ncclResult_t ncclGetUniqueId(ncclUniqueId* id);
ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist);
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error);
ncclResult_t ncclGroupStart();
ncclResult_t ncclGroupEnd();
ncclResult_t ncclAllReduce(const void* send, void* recv, std::size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclBroadcast(const void* send, void* recv, std::size_t count, ncclDataType_t type, int root,
                           ncclComm_t comm, cudaStream_t stream);
// Point to point, inside ncclGroupStart/End: the sim's subset. The group's calls of each
// communicator become one member of one clique-wide instance at the outermost
// ncclGroupEnd, so every rank of the clique must take part in each group that has them
// (an all-to-all, as ferry's row exchange is; zero counts count, as in NCCL 2.12.10+).
// Each send is matched with the peer's recv from this rank in call order, and a count that
// differs is reported (sim::report).
ncclResult_t ncclSend(const void* send, std::size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream);
ncclResult_t ncclRecv(void* recv, std::size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream);

namespace sim {
// Communicators alive (made, not yet destroyed or aborted).
int live_nccl_comms();
// Makes ncclCommGetAsyncError of `rank` in every clique report `r`, after `after_queries`
// more queries that still report ncclSuccess (an error NCCL notices some time into a wait);
// ncclSuccess clears it.
void nccl_async_error(int rank, ncclResult_t r, int after_queries = 0);
// ncclCommGetAsyncError calls made so far (all ranks).
long nccl_async_queries();
// ncclCommInitRank's rendezvous. Off (the default), every rank is made at once, so a test
// may join a clique's ranks one process after another from one thread. On, as in NCCL: the
// outermost ncclGroupEnd after ncclCommInitRank calls (or an ncclCommInitRank outside a
// group) waits until every rank of the cliques it joined has joined; after `timeout_s`
// without them it reports a deadlock (sim::report) and returns ncclSystemError, where NCCL
// would wait forever.
void nccl_rendezvous(bool on, double timeout_s = 3.0);
// Makes the next ncclGetUniqueId return `r` (what NCCL gives when it finds no network
// interface for its bootstrap, say); ncclSuccess clears it.
void nccl_fail_unique_id(ncclResult_t r);
}  // namespace sim
