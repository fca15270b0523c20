// A simulated CUDA runtime for testing ferry's CUDA backend on machines without a GPU.
//
// It declares the part of the runtime API that ferry's host-side CUDA code calls
// (streams, events, cudaMemcpyAsync, cudaMalloc, cudaHostAlloc) and implements it in
// sim_cudart.cpp as a model of the stream semantics: each stream is a queue of work that
// runs later, in an order the simulator picks at random among the work whose waits are
// satisfied; an event completes when the work recorded before it has run. Copies read
// their source when they run, so reusing a host buffer too early shows up as wrong data.
// Every operation carries a vector clock, so the simulator can say whether one piece of
// work is ordered before another (sim::happens_before) and reports two accesses to the
// same device bytes that are not ordered, at least one a write (sim::violations()).
//
// A host wait blocks, as on a GPU, until the work it waits for has run; work that can
// never run (a collective whose peers never join) is reported as a deadlock after a few
// seconds without progress, and the wait returns, so a test fails instead of hanging.
// Collectives (sim::join_collective, used by the simulated NCCL in nccl.h) run when every
// member is at the head of its stream; they carry no vector clock across devices.
//
// Virtual time, for cudaEventElapsedTime: each piece of work starts when its stream, the
// events it waits for and the host allow, and lasts what the model says (a copy: bytes over
// link_bytes_per_s; a kernel: what sim::launch was given). The host's time moves only when
// it sees work end (a wait, a query that succeeds, a copy from pageable memory, which the
// runtime stages synchronously), so the times say what overlaps what if host code were
// free; collectives and copy-engine contention are not modelled.
//
// It is no substitute for a GPU (kernels are host functions, time is a model, no real
// copy engine), but it checks the ordering logic, which a GPU test would only catch when
// timing happens to expose it. Only the sim tests use it, through this include directory
// (with cublas_v2.h, nccl.h and thrust_shim/ beside it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorCudartUnloading = 4,
  cudaErrorInsufficientDriver = 35,
  cudaErrorDevicesUnavailable = 46,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorPeerAccessAlreadyEnabled = 704,
  cudaErrorLaunchFailure = 719,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
  cudaErrorStreamCaptureIsolation = 904,
  cudaErrorStreamCaptureWrongThread = 908,
};
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
};

struct CUstream_st;
struct CUevent_st;
struct CUgraph_st;
struct CUgraphExec_st;
using cudaStream_t = CUstream_st*;
using cudaEvent_t = CUevent_st*;
using cudaGraph_t = CUgraph_st*;
using cudaGraphExec_t = CUgraphExec_st*;
enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2,
};
enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2,
};

// Tests that time the host against the GPU check only on a real device: the simulator has
// no host time (its GPU runs in virtual time whenever the host calls in).
#define FERRY_CUDA_SIMULATED 1
#define cudaStreamNonBlocking 0x01
#define cudaEventDefault 0x00
#define cudaEventDisableTiming 0x02
#define cudaHostAllocDefault 0x00
#define cudaHostAllocPortable 0x01

struct cudaDeviceProp {
  char name[256];
  std::size_t totalGlobalMem;
  int major, minor, multiProcessorCount;
};

cudaError_t cudaDriverGetVersion(int* v);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int device);
cudaError_t cudaGetDeviceCount(int* n);
cudaError_t cudaGetDevice(int* d);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaGetLastError();
const char* cudaGetErrorName(cudaError_t e);
const char* cudaGetErrorString(cudaError_t e);
cudaError_t cudaDeviceSynchronize();
// Peer access: every pair of distinct devices can (unless sim::deny_peer_access); enabling
// it twice is cudaErrorPeerAccessAlreadyEnabled, as on a real machine.
cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer);
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags);

cudaError_t cudaStreamCreate(cudaStream_t* s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamQuery(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags = 0);

cudaError_t cudaEventCreate(cudaEvent_t* e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = nullptr);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b);

cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t n, cudaMemcpyKind k, cudaStream_t s = nullptr);
// Synchronous, on the device's legacy default stream: waits for the device's blocking
// streams (not for cudaStreamNonBlocking ones), then copies and waits for the copy.
cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t n, cudaMemcpyKind k);
cudaError_t cudaMemsetAsync(void* p, int value, std::size_t n, cudaStream_t s = nullptr);
cudaError_t cudaMemset(void* p, int value, std::size_t n);  // synchronous, as cudaMemcpy
cudaError_t cudaMemGetInfo(std::size_t* free, std::size_t* total);  // the current device's
cudaError_t cudaMalloc(void** p, std::size_t n);
cudaError_t cudaFree(void* p);
cudaError_t cudaHostAlloc(void** p, std::size_t n, unsigned flags);
cudaError_t cudaFreeHost(void* p);

// Stream capture and graphs. While a stream captures, the work enqueued on it (copies,
// memsets, kernels, collectives, event records and waits on events recorded in the same
// capture) is recorded, not run; cudaGraphLaunch enqueues the recorded work again, in
// order, on the launch stream, with the arguments it was captured with (a copy's pointers,
// a kernel's functor), as a graph replays. As on a GPU, these are errors that invalidate
// the capture (reported as violations too): synchronising or querying the capturing
// stream, waiting on an event recorded outside the capture, and, from the capturing thread
// (modes Global and ThreadLocal), the calls that are unsafe during capture: cudaMalloc,
// cudaFree, cudaHostAlloc, cudaFreeHost, cudaMemcpy, cudaMemset, cudaDeviceSynchronize,
// cudaStreamSynchronize and cudaEventSynchronize.
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph);
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags = 0);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);

// ---- the simulator's controls, for tests -----------------------------------------------
namespace sim {

using op_id = std::uint64_t;  // 0: none

struct counters {
  std::uint64_t host_waits = 0;        // every host wait, implicit ones (cudaMemcpy, cudaFree) included
  std::uint64_t device_syncs = 0;      // cudaDeviceSynchronize calls
  std::uint64_t stream_syncs = 0;      // cudaStreamSynchronize calls
  std::uint64_t event_syncs = 0;       // cudaEventSynchronize calls
  std::uint64_t device_allocs = 0;     // cudaMalloc
  std::uint64_t host_allocs = 0;       // cudaHostAlloc
  std::uint64_t copies = 0;            // cudaMemcpyAsync
  std::uint64_t h2d_bytes = 0;         // of those, host to device
  std::uint64_t collectives = 0;       // collective instances run (aborted ones not counted)
  std::uint64_t live_device_blocks = 0;
  std::uint64_t live_host_blocks = 0;  // cudaHostAlloc'd, not yet freed (reset() keeps them: counted then)
  std::uint64_t live_streams = 0;
  std::uint64_t live_events = 0;
  std::uint64_t pending_ops = 0;       // enqueued, not yet run
  std::uint64_t captures = 0;          // cudaStreamEndCapture that made a graph
  std::uint64_t graph_launches = 0;    // cudaGraphLaunch
  std::uint64_t live_graph_execs = 0;  // instantiated, not destroyed
};

inline constexpr int device_count = 2;  // the simulated machine's GPUs
inline constexpr std::size_t device_memory = std::size_t(1) << 34;  // per GPU (cudaMemGetInfo's total)
inline constexpr double link_bytes_per_s = 25e9;   // H2D and D2H copies (virtual time)
inline constexpr double d2d_bytes_per_s = 1e12;    // D2D copies and memsets

// Starts afresh (call with no ferry CUDA object alive): random choices from `seed`.
// `progress` is how much work the simulated GPU runs, at random, each time the host calls
// into the runtime: 0 means only when the host waits (a GPU that lags as far behind as it
// is allowed to); larger means a GPU that keeps up.
void reset(std::uint64_t seed, int progress);
counters stats();
// Problems seen: unordered accesses to the same device bytes, frees of memory that pending
// work uses, calls on objects of the wrong device, deadlocks. Empty when all went well.
const std::vector<std::string>& violations();
void clear_violations();
// Adds a violation (for the simulated libraries beside the runtime).
void report(std::string what);

// A kernel: `run` executes when the simulator runs it (on the host, later); `reads` and
// `writes` are the device ranges it touches, checked for races. Enqueued on `s`, whose
// device must be current (as for a real launch); it lasts `seconds` of virtual time.
// Returns its id.
struct range {
  const void* p;
  std::size_t n;
};
op_id launch(cudaStream_t s, std::string label, std::vector<range> reads, std::vector<range> writes,
             std::function<void()> run, double seconds = 0);
// For the simulated libraries beside the runtime: when `s` is capturing, records `node`
// (called at each cudaGraphLaunch with the launch stream, the launching thread's current
// device that of the stream) and returns true; false (nothing recorded) otherwise. A
// library whose calls carry state that must be fresh at each replay (NCCL's collective
// sequence) records a node that makes the call again.
bool capture_node(cudaStream_t s, std::function<void(cudaStream_t)> node);
// Whether the calling thread is capturing a stream (mode Global or ThreadLocal).
bool thread_capturing();
// The last copy enqueued that writes the byte at p (0 when none).
op_id last_copy_into(const void* p);
// Whether a is ordered before b by streams, events and what the host observed.
bool happens_before(op_id a, op_id b);
bool done(op_id a);
// Copies enqueued and not yet run.
std::uint64_t pending_copies();
// Runs everything enqueued so far on every device (uncounted).
void drain();
// Makes the n-th cudaMemcpyAsync from now (1 = the next) fail with `status`.
void fail_copy(int n, cudaError_t status);
// Makes the n-th cudaStreamWaitEvent from now (1 = the next) fail with `status`,
// enqueueing nothing.
void fail_wait(int n, cudaError_t status);
// A machine whose GPUs cannot read each other's memory (until the next reset).
void deny_peer_access();
// With on = true, a cudaFree or cudaFreeHost on any other thread is a violation (until
// called with false, or the next reset): they wait for the device, which beside another
// thread's half-launched NCCL collective can deadlock.
void frees_only_on_this_thread(bool on);
// Whether `device` has enabled access to `peer`'s memory.
bool peer_enabled(int device, int peer);
// Makes the n-th cudaMalloc on `device` from now fail with cudaErrorMemoryAllocation.
void fail_malloc(int device, int n);
// Makes the n-th cudaGraphLaunch of a graph of `device` from now fail with `status`,
// enqueueing nothing.
void fail_graph_launch(int device, int n, cudaError_t status);
// Makes the n-th cudaSetDevice(device) from now fail with `status` (a device in exclusive
// mode taken by another process: cudaErrorDevicesUnavailable), the current device unchanged.
void fail_set_device(int device, int n, cudaError_t status);

// A member of a collective: instance `seq` of `group`, member `rank` of `nranks`. Enqueued
// on `s` (whose device must be current); the instance runs when every member is at the
// head of its stream, all at once: each member's `run`, in rank order. `reads`/`writes`
// are checked for races like a kernel's.
op_id join_collective(cudaStream_t s, const void* group, std::uint64_t seq, int rank, int nranks,
                      std::string label, std::vector<range> reads, std::vector<range> writes,
                      std::function<void()> run);
// Ends member `rank`'s unfinished collectives of `group`: they complete without running
// (what ncclCommAbort does to its kernels); peers not aborted still wait for it.
void abort_collectives(const void* group, int rank);
// Blocks, as a host wait does, until member `rank`'s collectives of `group` have run or
// been aborted (a deadlock is reported after a while without progress).
void wait_collectives(const void* group, int rank);
// Whether `p` lies in a live cudaMalloc block, and that block's device (-1 when none).
int device_of(const void* p);

}  // namespace sim
