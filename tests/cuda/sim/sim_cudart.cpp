// The simulated CUDA runtime (see cuda_runtime_api.h): streams as queues of deferred work
// run in a random order that respects stream order, event waits and collectives, vector
// clocks for "is this ordered before that", and a race check on device memory.
#include "cuda_runtime_api.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using clock_t_ = std::vector<std::uint64_t>;  // one entry per stream ever created

enum class kind { copy, kernel, record, wait, collective };

struct op {
  sim::op_id id = 0;
  CUstream_st* stream = nullptr;
  kind k = kind::kernel;
  void* dst = nullptr;
  const void* src = nullptr;
  std::size_t n = 0;
  std::function<void()> run;
  sim::op_id waits_for = 0;
  clock_t_ clock;
  bool done = false;
  std::string label;
  // kind::collective: member `rank` of `nranks` of instance (group, seq)
  const void* group = nullptr;
  std::uint64_t seq = 0;
  int rank = 0, nranks = 1;
  bool aborted = false;
  double vend = 0;  // virtual time (s) at which it ends
  std::vector<char> staged;  // a copy from pageable memory: its bytes, taken at the call
};

struct mem_access {
  sim::op_id op;
  std::uintptr_t lo, hi;
  bool write;
};

struct device_block {
  std::size_t bytes;
  int device;
  std::vector<mem_access> accesses;
};

}  // namespace

// A captured graph: the calls recorded while its stream captured, each made again on the
// launch stream at every cudaGraphLaunch.
struct CUgraph_st {
  int device = 0;
  std::vector<std::function<void(cudaStream_t)>> nodes;
};
struct CUgraphExec_st {
  int device = 0;
  std::vector<std::function<void(cudaStream_t)>> nodes;
};
struct CUstream_st {
  std::size_t idx;
  int device;
  bool blocking = true;  // synchronises with the legacy default stream (cudaMemcpy)
  std::deque<op*> q;
  clock_t_ clock;
  double vtail = 0;  // virtual time at which its last op ends
  bool alive = true;
  // Capture: the graph being recorded (null when not capturing), whether an error has
  // invalidated it, and the capturing thread and mode.
  CUgraph_st* capture = nullptr;
  bool capture_invalid = false;
  std::thread::id capture_thread;
  cudaStreamCaptureMode capture_mode = cudaStreamCaptureModeGlobal;
};
struct CUevent_st {
  int device;
  sim::op_id recorded = 0;
  clock_t_ clock;
  double vtime = 0;  // virtual time of the last record
  bool timing = true;
  bool alive = true;
  const CUgraph_st* captured_in = nullptr;  // its last record was captured into this graph
};

namespace {

using instance_key = std::pair<const void*, std::uint64_t>;

struct state {
  std::recursive_mutex m;
  std::condition_variable_any changed;  // new work, aborts: what a blocked host wait waits for
  std::uint64_t generation = 0;
  std::map<instance_key, std::vector<op*>> instances;  // collectives: members by rank
  std::vector<std::unique_ptr<op>> ops;  // ops[id - 1]
  std::vector<std::unique_ptr<CUstream_st>> streams;
  std::vector<std::unique_ptr<CUevent_st>> events;
  std::map<std::uintptr_t, device_block> blocks;  // by base address
  std::map<void*, std::size_t> host_blocks;  // cudaHostAlloc'd: bytes
  clock_t_ host_clock;
  double host_vt = 0;  // the host's virtual time: what its waits and queries have seen end
  std::mt19937_64 rng{1};
  int progress = 2;
  sim::counters c;
  std::vector<std::string> violations;
  int fail_in = 0;
  cudaError_t fail_status = cudaSuccess;
  int wait_fail_in = 0;
  cudaError_t wait_fail_status = cudaSuccess;
  std::map<int, int> malloc_fail_in;  // device -> n-th cudaMalloc from now fails
  std::map<int, std::pair<int, cudaError_t>> graph_fail_in;  // device -> (n-th cudaGraphLaunch, status)
  std::map<int, std::pair<int, cudaError_t>> set_device_fail_in;  // device -> (n-th cudaSetDevice, status)
  bool peer_denied = false;
  std::set<std::pair<int, int>> peers;  // (device, peer) with access enabled
  std::thread::id frees_only_on{};  // sim::frees_only_on_this_thread: none when default
};

// cudaFree and cudaFreeHost wait for the device: on a thread other than the one the test
// named, beside another thread's NCCL launches, they can deadlock (sim::frees_only_on_this_thread).
void check_free_thread(state& s, const char* call) {
  if (s.frees_only_on != std::thread::id{} && std::this_thread::get_id() != s.frees_only_on)
    s.violations.push_back(std::string(call) + " on a thread other than the consumer's (it waits for the device: "
                           "beside another thread's half-launched NCCL collective it can deadlock)");
}


state& S() {
  static state* s = new state;  // never destroyed: ferry objects may outlive statics
  return *s;
}

// How long a host wait may see no progress at all before it is called a deadlock.
constexpr auto deadlock_after = std::chrono::seconds(2);

void changed() {
  ++S().generation;
  S().changed.notify_all();
}

thread_local int current_device = 0;
thread_local cudaError_t last_error = cudaSuccess;
thread_local std::vector<CUstream_st*> my_captures;  // streams this thread captures (not Relaxed)

cudaError_t fail(cudaError_t e) {
  last_error = e;
  return e;
}

void join(clock_t_& a, const clock_t_& b) {
  if (a.size() < b.size()) a.resize(b.size(), 0);
  for (std::size_t i = 0; i < b.size(); ++i) a[i] = std::max(a[i], b[i]);
}
std::uint64_t at(const clock_t_& c, std::size_t i) { return i < c.size() ? c[i] : 0; }

bool hb(const op& a, const op& b) {
  return a.id != b.id && at(a.clock, a.stream->idx) <= at(b.clock, a.stream->idx);
}

std::string where(const op& o) {
  return o.label + " (op " + std::to_string(o.id) + ", stream " + std::to_string(o.stream->idx) + ")";
}

device_block* block_of(std::uintptr_t p, std::uintptr_t* base = nullptr) {
  auto& s = S();
  auto it = s.blocks.upper_bound(p);
  if (it == s.blocks.begin()) return nullptr;
  --it;
  if (p >= it->first + it->second.bytes) return nullptr;
  if (base) *base = it->first;
  return &it->second;
}

// Whether [p, p + n) lies in one cudaHostAlloc block.
bool pinned(const void* p, std::size_t n) {
  auto& hb = S().host_blocks;
  auto it = hb.upper_bound(const_cast<void*>(p));
  if (it == hb.begin()) return false;
  --it;
  const auto* base = static_cast<const char*>(it->first);
  return static_cast<const char*>(p) + n <= base + it->second;
}

// Records an mem_access of `o` to [p, p + n) of device memory and reports unordered conflicts.
void touch(op& o, const void* p, std::size_t n, bool write) {
  auto& s = S();
  if (n == 0) return;
  const auto lo = reinterpret_cast<std::uintptr_t>(p), hi = lo + n;
  std::uintptr_t base = 0;
  device_block* b = block_of(lo, &base);
  if (!b || hi > base + b->bytes) {
    s.violations.push_back(where(o) + ": touches memory that is not a live device allocation");
    return;
  }
  if (b->device != o.stream->device && !s.peers.count({o.stream->device, b->device}))  // peer access enabled: allowed
    s.violations.push_back(where(o) + ": touches device " + std::to_string(b->device) +
                           " memory from a stream of device " + std::to_string(o.stream->device));
  // Accesses the host has seen complete are ordered before anything enqueued from now on.
  std::erase_if(b->accesses, [&](const mem_access& a) {
    const op& prev = *s.ops[a.op - 1];
    return prev.done && at(s.host_clock, prev.stream->idx) >= at(prev.clock, prev.stream->idx);
  });
  for (const mem_access& a : b->accesses) {
    if (a.op == o.id || !(a.write || write) || a.hi <= lo || hi <= a.lo) continue;  // in-place is fine
    const op& prev = *s.ops[a.op - 1];
    if (!hb(prev, o))
      s.violations.push_back("race: " + where(o) + (write ? " writes" : " reads") + " bytes that " + where(prev) +
                             (a.write ? " writes" : " reads") + ", unordered");
  }
  b->accesses.push_back({o.id, lo, hi, write});
}

// Virtual time (sim::virtual_time). Work starts when its stream, the events it waits for
// and the host that enqueued it allow; the host's time moves only when it sees work end.
void observe(double t) { S().host_vt = std::max(S().host_vt, t); }
// The host has seen a stream's work so far end: ordered after it, and no earlier in time.
void saw(const CUstream_st& st) {
  join(S().host_clock, st.clock);
  observe(st.vtail);
}
// The same for the work an event marks.
void saw(const CUevent_st& e) {
  join(S().host_clock, e.clock);
  observe(e.vtime);
}

op& enqueue(CUstream_st* st, kind k, std::string label, double seconds = 0, double after = 0) {
  auto& s = S();
  auto o = std::make_unique<op>();
  o->id = s.ops.size() + 1;
  o->stream = st;
  o->k = k;
  o->label = std::move(label);
  join(st->clock, s.host_clock);
  st->clock[st->idx] += 1;
  o->clock = st->clock;
  o->vend = std::max({st->vtail, s.host_vt, after}) + seconds;
  st->vtail = o->vend;
  st->q.push_back(o.get());
  ++s.c.pending_ops;
  s.ops.push_back(std::move(o));
  changed();
  return *s.ops.back();
}

// A collective instance can run when all its members are enqueued, none aborted, and each
// is at the head of its stream.
bool instance_ready(const op& h) {
  const auto it = S().instances.find({h.group, h.seq});
  if (it == S().instances.end()) return false;
  for (const op* m : it->second)
    if (!m || m->aborted || m->stream->q.empty() || m->stream->q.front() != m) return false;
  return true;
}

bool runnable(const CUstream_st& st) {
  if (st.q.empty()) return false;
  const op& h = *st.q.front();
  if (h.k == kind::wait) return S().ops[h.waits_for - 1]->done;
  if (h.k == kind::collective) return h.aborted || instance_ready(h);
  return true;
}

// Runs one piece of work chosen at random among the runnable; false when none is.
bool step_one() {
  auto& s = S();
  std::vector<CUstream_st*> ready;
  for (auto& st : s.streams)
    if (runnable(*st)) ready.push_back(st.get());
  if (ready.empty()) return false;
  CUstream_st* st = ready[s.rng() % ready.size()];
  op* o = st->q.front();
  if (o->k == kind::collective && !o->aborted) {  // every member at once, in rank order
    auto node = s.instances.extract({o->group, o->seq});
    for (op* m : node.mapped()) m->stream->q.pop_front();
    for (op* m : node.mapped()) {
      if (m->run) m->run();
      m->done = true;
      --s.c.pending_ops;
    }
    ++s.c.collectives;
    return true;
  }
  st->q.pop_front();
  if (o->k == kind::copy) std::memcpy(o->dst, o->src, o->n);
  if (o->k == kind::kernel && o->run) o->run();
  o->done = true;
  --s.c.pending_ops;
  return true;
}

// A host wait: runs work until `pred` holds. When nothing can run, another thread may yet
// enqueue what is missing (a collective's peer), so it blocks; after deadlock_after with
// no progress anywhere it reports a deadlock and gives up (a GPU would hang).
// The caller holds S().m exactly once.
template <class Pred>
bool wait_until(Pred pred, const std::string& what) {
  auto& s = S();
  auto since = std::chrono::steady_clock::now();
  while (!pred()) {
    if (step_one()) {
      since = std::chrono::steady_clock::now();
      continue;
    }
    const auto gen = s.generation;
    s.changed.wait_for(s.m, std::chrono::milliseconds(20));
    if (s.generation != gen) {
      since = std::chrono::steady_clock::now();
    } else if (std::chrono::steady_clock::now() - since > deadlock_after) {
      s.violations.push_back("deadlock: " + what + ", which can never run");
      return false;
    }
  }
  return true;
}

void run_until_done(sim::op_id id) {
  auto& s = S();
  wait_until([&] { return s.ops[id - 1]->done; }, "waiting for " + where(*s.ops[id - 1]));
}

// Waits for all work on the streams of `device` (-1: every device).
void drain_device(int device) {
  auto& s = S();
  auto idle = [&] {
    for (auto& st : s.streams)
      if ((device < 0 || st->device == device) && !st->q.empty()) return false;
    return true;
  };
  std::string what = "waiting for all work of ";
  what += device < 0 ? std::string("every device") : "device " + std::to_string(device);
  wait_until(idle, what);
  for (auto& st : s.streams)
    if (device < 0 || st->device == device) {
      saw(*st);
    }
}
void drain_all() { drain_device(-1); }

// The GPU runs a little of its own accord each time the host calls in.
void tick() {
  auto& s = S();
  if (s.progress <= 0) return;
  const int k = static_cast<int>(s.rng() % static_cast<std::uint64_t>(s.progress + 1));
  for (int i = 0; i < k && step_one(); ++i) {
  }
}

// Work enqueued on a stream needs the stream's device current, as a real launch does.
void check_current(const CUstream_st* st, const std::string& what) {
  if (st->device != current_device)
    S().violations.push_back(what + " on a stream of device " + std::to_string(st->device) + " while device " +
                             std::to_string(current_device) + " is current");
}

bool valid(CUstream_st* st) {
  if (!st) return false;
  for (auto& p : S().streams)
    if (p.get() == st) return p->alive;
  return false;
}
bool valid(CUevent_st* e) {
  if (!e) return false;
  for (auto& p : S().events)
    if (p.get() == e) return p->alive;
  return false;
}

// Capture. An error during capture invalidates it: later calls are swallowed and
// cudaStreamEndCapture fails, as on a GPU; the sim reports it too.
cudaError_t invalidate(CUstream_st* st, std::string why, cudaError_t e) {
  S().violations.push_back("stream capture: " + why);
  st->capture_invalid = true;
  return fail(e);
}
// When `st` is capturing: records `node` (nothing runs now) and returns true.
bool record_node(CUstream_st* st, std::function<void(cudaStream_t)> node) {
  if (!st || !st->capture) return false;
  if (!st->capture_invalid) st->capture->nodes.push_back(std::move(node));
  return true;
}
// A call that is unsafe during capture, made by a capturing thread (modes Global and
// ThreadLocal): an error that invalidates that thread's captures.
bool unsafe_in_capture(const char* call) {
  if (my_captures.empty()) return false;
  for (CUstream_st* st : my_captures)
    invalidate(st, std::string(call) + " from a thread that is capturing stream " + std::to_string(st->idx) +
                       " (unsafe during capture)",
               cudaErrorStreamCaptureUnsupported);
  return true;
}

}  // namespace

// ---- the runtime API ---------------------------------------------------------------------

cudaError_t cudaDriverGetVersion(int* v) {
  *v = 13000;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) {
  if (d < 0 || d >= sim::device_count) return fail(cudaErrorInvalidDevice);
  *p = cudaDeviceProp{};
  std::snprintf(p->name, sizeof p->name, "simulated GPU %d", d);
  p->totalGlobalMem = sim::device_memory;
  p->major = 9;
  p->multiProcessorCount = 132;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceCount(int* n) {
  *n = sim::device_count;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* d) {
  *d = current_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d >= sim::device_count) return fail(cudaErrorInvalidDevice);
  {
    auto& s = S();
    std::lock_guard lk(s.m);
    if (auto f = s.set_device_fail_in.find(d); f != s.set_device_fail_in.end() && --f->second.first == 0) {
      const cudaError_t e = f->second.second;
      s.set_device_fail_in.erase(f);
      return fail(e);
    }
  }
  current_device = d;
  return cudaSuccess;
}
cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  if (device < 0 || device >= sim::device_count || peer < 0 || peer >= sim::device_count)
    return fail(cudaErrorInvalidDevice);
  std::lock_guard lk(S().m);
  *can = device != peer && !S().peer_denied;
  return cudaSuccess;
}
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags) {
  if (peer < 0 || peer >= sim::device_count || peer == current_device) return fail(cudaErrorInvalidDevice);
  if (flags != 0) return fail(cudaErrorInvalidValue);
  std::lock_guard lk(S().m);
  if (S().peer_denied) return fail(cudaErrorInvalidDevice);
  if (!S().peers.insert({current_device, peer}).second) return fail(cudaErrorPeerAccessAlreadyEnabled);
  return cudaSuccess;
}
cudaError_t cudaGetLastError() { return std::exchange(last_error, cudaSuccess); }
const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorCudartUnloading: return "cudaErrorCudartUnloading";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorDevicesUnavailable: return "cudaErrorDevicesUnavailable";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorPeerAccessAlreadyEnabled: return "cudaErrorPeerAccessAlreadyEnabled";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureIsolation: return "cudaErrorStreamCaptureIsolation";
    case cudaErrorStreamCaptureWrongThread: return "cudaErrorStreamCaptureWrongThread";
  }
  return "cudaErrorUnknown";
}
const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "simulated error"; }

cudaError_t cudaDeviceSynchronize() {
  std::lock_guard lk(S().m);
  if (unsafe_in_capture("cudaDeviceSynchronize")) return cudaErrorStreamCaptureUnsupported;
  ++S().c.host_waits;
  ++S().c.device_syncs;
  drain_device(current_device);
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* out) { return cudaStreamCreateWithFlags(out, 0); }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* out, unsigned flags) {
  auto& s = S();
  std::lock_guard lk(s.m);
  auto st = std::make_unique<CUstream_st>();
  st->idx = s.streams.size();
  st->device = current_device;
  st->blocking = !(flags & cudaStreamNonBlocking);
  st->clock.assign(st->idx + 1, 0);
  *out = st.get();
  s.streams.push_back(std::move(st));
  ++s.c.live_streams;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t st) {
  std::lock_guard lk(S().m);
  if (!valid(st)) return fail(cudaErrorInvalidResourceHandle);
  st->alive = false;  // pending work still runs, as on a GPU
  --S().c.live_streams;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t st) {
  auto& s = S();
  std::lock_guard lk(s.m);
  if (!valid(st)) return fail(cudaErrorInvalidResourceHandle);
  if (st->capture)
    return invalidate(st, "cudaStreamSynchronize of the capturing stream " + std::to_string(st->idx),
                      cudaErrorStreamCaptureUnsupported);
  if (unsafe_in_capture("cudaStreamSynchronize")) return cudaErrorStreamCaptureUnsupported;
  ++s.c.host_waits;
  ++s.c.stream_syncs;
  if (!st->q.empty()) run_until_done(st->q.back()->id);
  saw(*st);
  return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t st) {
  auto& s = S();
  std::lock_guard lk(s.m);
  if (!valid(st)) return fail(cudaErrorInvalidResourceHandle);
  if (st->capture)
    return invalidate(st, "cudaStreamQuery of the capturing stream " + std::to_string(st->idx),
                      cudaErrorStreamCaptureUnsupported);
  step_one();  // a host that polls still sees the GPU move, even a lagging one
  tick();
  if (!st->q.empty()) return cudaErrorNotReady;
  saw(*st);
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t st, cudaEvent_t e, unsigned) {
  auto& s = S();
  std::lock_guard lk(s.m);
  if (!valid(st) || !valid(e)) return fail(cudaErrorInvalidResourceHandle);
  if (s.wait_fail_in > 0 && --s.wait_fail_in == 0) return fail(s.wait_fail_status);
  if (st->capture) {
    if (e->captured_in != st->capture)
      return invalidate(st, "stream " + std::to_string(st->idx) + " waits on an event recorded outside its capture",
                        cudaErrorStreamCaptureIsolation);
    record_node(st, [e](cudaStream_t to) { cudaStreamWaitEvent(to, e); });
    return cudaSuccess;
  }
  if (e->captured_in) {
    s.violations.push_back("cudaStreamWaitEvent: stream " + std::to_string(st->idx) +
                           " (not capturing) waits on an event last recorded into a capture");
    return fail(cudaErrorStreamCaptureIsolation);
  }
  tick();
  if (e->recorded == 0) return cudaSuccess;  // never recorded: nothing to wait for
  join(st->clock, e->clock);
  op& o = enqueue(st, kind::wait, "wait for op " + std::to_string(e->recorded), 0, e->vtime);
  o.waits_for = e->recorded;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* out, unsigned flags) {
  auto& s = S();
  std::lock_guard lk(s.m);
  auto e = std::make_unique<CUevent_st>();
  e->device = current_device;
  e->timing = !(flags & cudaEventDisableTiming);
  *out = e.get();
  s.events.push_back(std::move(e));
  ++s.c.live_events;
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  std::lock_guard lk(S().m);
  if (!valid(e)) return fail(cudaErrorInvalidResourceHandle);
  e->alive = false;
  --S().c.live_events;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t st) {
  auto& s = S();
  std::lock_guard lk(s.m);
  if (!valid(st) || !valid(e)) return fail(cudaErrorInvalidResourceHandle);
  if (e->device != st->device) {
    s.violations.push_back("cudaEventRecord: an event of device " + std::to_string(e->device) +
                           " recorded on a stream of device " + std::to_string(st->device));
    return fail(cudaErrorInvalidResourceHandle);
  }
  if (st->capture) {
    if (!st->capture_invalid) e->captured_in = st->capture;
    record_node(st, [e](cudaStream_t to) { cudaEventRecord(e, to); });
    return cudaSuccess;
  }
  e->captured_in = nullptr;
  tick();
  op& o = enqueue(st, kind::record, "event record");
  e->recorded = o.id;
  e->clock = o.clock;
  e->vtime = o.vend;
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  auto& s = S();
  std::lock_guard lk(s.m);
  if (!valid(e)) return fail(cudaErrorInvalidResourceHandle);
  step_one();  // as cudaStreamQuery: a host that polls still sees the GPU move
  tick();
  if (e->recorded != 0 && !s.ops[e->recorded - 1]->done) return cudaErrorNotReady;  // not sticky
  saw(*e);
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  auto& s = S();
  std::lock_guard lk(s.m);
  if (!valid(e)) return fail(cudaErrorInvalidResourceHandle);
  if (unsafe_in_capture("cudaEventSynchronize")) return cudaErrorStreamCaptureUnsupported;
  ++s.c.host_waits;
  ++s.c.event_syncs;
  if (e->recorded != 0) run_until_done(e->recorded);
  saw(*e);
  return cudaSuccess;
}
// As the runtime: both events recorded, complete and made with timing; virtual time.
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  auto& s = S();
  std::lock_guard lk(s.m);
  if (!valid(a) || !valid(b) || !a->timing || !b->timing || !a->recorded || !b->recorded)
    return fail(cudaErrorInvalidResourceHandle);
  if (!s.ops[a->recorded - 1]->done || !s.ops[b->recorded - 1]->done) return fail(cudaErrorNotReady);
  *ms = static_cast<float>((b->vtime - a->vtime) * 1e3);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t n, cudaMemcpyKind k, cudaStream_t st) {
  auto& s = S();
  std::lock_guard lk(s.m);
  if (!valid(st)) return fail(cudaErrorInvalidResourceHandle);
  if (record_node(st, [=](cudaStream_t to) { cudaMemcpyAsync(dst, src, n, k, to); })) return cudaSuccess;
  if (s.fail_in > 0 && --s.fail_in == 0) return fail(s.fail_status);
  if (k == cudaMemcpyHostToHost) return fail(cudaErrorInvalidValue);  // ferry never does
  const bool dev_src = k == cudaMemcpyDeviceToHost || k == cudaMemcpyDeviceToDevice;
  const bool dev_dst = k == cudaMemcpyHostToDevice || k == cudaMemcpyDeviceToDevice;
  if (!dev_src && block_of(reinterpret_cast<std::uintptr_t>(src)))
    s.violations.push_back("cudaMemcpyAsync: a host source that is device memory");
  if (!dev_dst && block_of(reinterpret_cast<std::uintptr_t>(dst)))
    s.violations.push_back("cudaMemcpyAsync: a host destination that is device memory");
  tick();
  ++s.c.copies;
  if (k == cudaMemcpyHostToDevice) s.c.h2d_bytes += n;
  static const char* names[] = {"", "H2D", "D2H", "D2D"};
  const double bw = k == cudaMemcpyDeviceToDevice ? sim::d2d_bytes_per_s : sim::link_bytes_per_s;
  op& o = enqueue(st, kind::copy, std::string(names[k]) + " copy of " + std::to_string(n) + " bytes",
                  static_cast<double>(n) / bw);
  o.dst = dst;
  o.src = src;
  o.n = n;
  if (dev_src) touch(o, src, n, false);
  if (dev_dst) touch(o, dst, n, true);
  // From or to pageable memory the runtime stages the bytes through its own pinned buffer:
  // the call returns (in virtual time) when the copy has ended, so the host cannot run ahead.
  // From pageable memory the bytes are staged at the call, as the runtime does: the caller
  // may free or reuse its buffer as soon as the call returns.
  if (k != cudaMemcpyDeviceToDevice && !pinned(dev_src ? dst : src, n)) {
    if (!dev_src) {
      o.staged.assign(static_cast<const char*>(src), static_cast<const char*>(src) + n);
      o.src = o.staged.data();
    }
    observe(o.vend);
  }
  return cudaSuccess;
}
// The device's legacy default stream: made on first use, non-blocking itself so that
// waiting for the blocking streams does not wait for it. The caller holds S().m.
CUstream_st* legacy_stream() {
  static std::map<int, CUstream_st*> legacy;
  CUstream_st*& ls = legacy[current_device];
  if (!ls || !valid(ls)) {
    cudaStream_t made = nullptr;
    cudaStreamCreateWithFlags(&made, cudaStreamNonBlocking);
    --S().c.live_streams;  // the runtime's own, not the program's
    ls = made;
  }
  return ls;
}
// A synchronous call (cudaMemcpy, cudaMemset): waits for the device's blocking streams (not
// for cudaStreamNonBlocking ones), enqueues `async` on the legacy stream and waits for it.
template <class F>
cudaError_t on_legacy_stream(const char* what, F async) {
  auto& s = S();
  std::lock_guard lk(s.m);
  if (unsafe_in_capture(what)) return cudaErrorStreamCaptureUnsupported;
  CUstream_st* ls = legacy_stream();
  ++s.c.host_waits;
  const int dev = current_device;
  wait_until(
      [&] {
        for (auto& st : s.streams)
          if (st->device == dev && st->blocking && !st->q.empty()) return false;
        return true;
      },
      std::string(what) + " waiting for the blocking streams of device " + std::to_string(dev));
  for (auto& st : s.streams)
    if (st->device == dev && st->blocking) {
      saw(*st);
    }
  const cudaError_t r = async(ls);
  if (r != cudaSuccess) return r;
  run_until_done(ls->q.back()->id);
  saw(*ls);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t n, cudaMemcpyKind k) {
  return on_legacy_stream("cudaMemcpy", [&](CUstream_st* ls) { return cudaMemcpyAsync(dst, src, n, k, ls); });
}
cudaError_t cudaMemset(void* p, int value, std::size_t n) {
  return on_legacy_stream("cudaMemset", [&](CUstream_st* ls) { return cudaMemsetAsync(p, value, n, ls); });
}
cudaError_t cudaMemGetInfo(std::size_t* free, std::size_t* total) {
  auto& s = S();
  std::lock_guard lk(s.m);
  *total = sim::device_memory;
  std::size_t used = 0;
  for (const auto& [base, b] : s.blocks)
    if (b.device == current_device) used += b.bytes;
  *free = *total - std::min(*total, used);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, std::size_t n, cudaStream_t st) {
  auto& s = S();
  std::lock_guard lk(s.m);
  if (!valid(st)) return fail(cudaErrorInvalidResourceHandle);
  check_current(st, "cudaMemsetAsync");
  if (record_node(st, [=](cudaStream_t to) { cudaMemsetAsync(p, value, n, to); })) return cudaSuccess;
  tick();
  op& o = enqueue(st, kind::kernel, "memset of " + std::to_string(n) + " bytes",
                  static_cast<double>(n) / sim::d2d_bytes_per_s);
  o.run = [p, value, n] { std::memset(p, value, n); };
  touch(o, p, n, true);
  return cudaSuccess;
}
cudaError_t cudaMalloc(void** p, std::size_t n) {
  auto& s = S();
  std::lock_guard lk(s.m);
  if (unsafe_in_capture("cudaMalloc")) return cudaErrorStreamCaptureUnsupported;
  if (auto f = s.malloc_fail_in.find(current_device); f != s.malloc_fail_in.end() && --f->second == 0) {
    s.malloc_fail_in.erase(f);
    return fail(cudaErrorMemoryAllocation);
  }
  const std::size_t bytes = (std::max<std::size_t>(n, 1) + 255) / 256 * 256;
  *p = std::aligned_alloc(256, bytes);
  if (!*p) return fail(cudaErrorMemoryAllocation);
  s.blocks[reinterpret_cast<std::uintptr_t>(*p)] = {bytes, current_device, {}};
  ++s.c.device_allocs;
  ++s.c.live_device_blocks;
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  auto& s = S();
  std::lock_guard lk(s.m);
  if (!p) return cudaSuccess;
  if (unsafe_in_capture("cudaFree")) return cudaErrorStreamCaptureUnsupported;
  check_free_thread(s, "cudaFree");
  auto it = s.blocks.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == s.blocks.end()) return fail(cudaErrorInvalidValue);
  // A real cudaFree waits for the device when work may still use the block.
  for (const mem_access& a : it->second.accesses)
    if (!s.ops[a.op - 1]->done) {
      ++s.c.host_waits;  // an implicit synchronisation
      drain_device(it->second.device);
      break;
    }
  it = s.blocks.find(reinterpret_cast<std::uintptr_t>(p));  // the wait let other threads in
  if (it == s.blocks.end()) return fail(cudaErrorInvalidValue);
  s.blocks.erase(it);
  std::free(p);
  --s.c.live_device_blocks;
  return cudaSuccess;
}
cudaError_t cudaHostAlloc(void** p, std::size_t n, unsigned) {
  auto& s = S();
  std::lock_guard lk(s.m);
  if (unsafe_in_capture("cudaHostAlloc")) return cudaErrorStreamCaptureUnsupported;
  *p = std::aligned_alloc(4096, (std::max<std::size_t>(n, 1) + 4095) / 4096 * 4096);
  if (!*p) return fail(cudaErrorMemoryAllocation);
  s.host_blocks[*p] = n;
  ++s.c.host_allocs;
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  auto& s = S();
  std::lock_guard lk(s.m);
  if (unsafe_in_capture("cudaFreeHost")) return cudaErrorStreamCaptureUnsupported;
  check_free_thread(s, "cudaFreeHost");
  auto it = s.host_blocks.find(p);
  if (it == s.host_blocks.end()) return fail(cudaErrorInvalidValue);
  const std::size_t bytes = it->second;
  s.host_blocks.erase(it);
  auto reads_it = [&](const op& o) {
    return !o.done && o.k == kind::copy && o.src >= p &&
           static_cast<const char*>(o.src) < static_cast<const char*>(p) + bytes;
  };
  if (std::any_of(s.ops.begin(), s.ops.end(), [&](auto& o) { return reads_it(*o); })) {
    ++s.c.host_waits;  // copies not yet run that read this block: the host waits first
    double until = 0;
    for (auto& o : s.ops)
      if (reads_it(*o)) until = std::max(until, o->vend);
    wait_until([&] { return std::none_of(s.ops.begin(), s.ops.end(), [&](auto& o) { return reads_it(*o); }); },
               "cudaFreeHost waiting for the copies that read the block");
    observe(until);
  }
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t st, cudaStreamCaptureMode mode) {
  auto& s = S();
  std::lock_guard lk(s.m);
  if (!valid(st)) return fail(cudaErrorInvalidResourceHandle);
  if (st->capture) return fail(cudaErrorInvalidValue);  // already capturing
  check_current(st, "cudaStreamBeginCapture");
  st->capture = new CUgraph_st{st->device, {}};
  st->capture_invalid = false;
  st->capture_thread = std::this_thread::get_id();
  st->capture_mode = mode;
  if (mode != cudaStreamCaptureModeRelaxed) my_captures.push_back(st);
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t st, cudaGraph_t* graph) {
  auto& s = S();
  std::lock_guard lk(s.m);
  *graph = nullptr;
  if (!valid(st)) return fail(cudaErrorInvalidResourceHandle);
  if (!st->capture) return fail(cudaErrorInvalidValue);  // not capturing
  if (st->capture_mode != cudaStreamCaptureModeRelaxed && st->capture_thread != std::this_thread::get_id())
    return fail(cudaErrorStreamCaptureWrongThread);
  std::erase(my_captures, st);
  CUgraph_st* g = std::exchange(st->capture, nullptr);
  if (std::exchange(st->capture_invalid, false)) {
    delete g;
    return fail(cudaErrorStreamCaptureInvalidated);
  }
  ++s.c.captures;
  *graph = g;
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t st, cudaStreamCaptureStatus* status) {
  std::lock_guard lk(S().m);
  if (!valid(st)) return fail(cudaErrorInvalidResourceHandle);
  *status = !st->capture         ? cudaStreamCaptureStatusNone
            : st->capture_invalid ? cudaStreamCaptureStatusInvalidated
                                  : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  auto& s = S();
  std::lock_guard lk(s.m);
  if (!graph) return fail(cudaErrorInvalidValue);
  *exec = new CUgraphExec_st{graph->device, graph->nodes};
  ++s.c.live_graph_execs;
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t st) {
  auto& s = S();
  std::lock_guard lk(s.m);
  if (!exec || !valid(st)) return fail(cudaErrorInvalidResourceHandle);
  if (st->device != exec->device) {
    s.violations.push_back("cudaGraphLaunch: a graph of device " + std::to_string(exec->device) +
                           " launched on a stream of device " + std::to_string(st->device));
    return fail(cudaErrorInvalidValue);
  }
  check_current(st, "cudaGraphLaunch");
  if (auto f = s.graph_fail_in.find(exec->device); f != s.graph_fail_in.end() && --f->second.first == 0) {
    const cudaError_t e = f->second.second;
    s.graph_fail_in.erase(f);
    return fail(e);  // enqueues nothing
  }
  ++s.c.graph_launches;
  for (auto& node : exec->nodes) node(st);
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  std::lock_guard lk(S().m);
  if (!exec) return fail(cudaErrorInvalidValue);
  delete exec;
  --S().c.live_graph_execs;
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  if (!graph) return fail(cudaErrorInvalidValue);
  delete graph;
  return cudaSuccess;
}

// ---- the controls ----------------------------------------------------------------------

namespace sim {

void reset(std::uint64_t seed, int progress) {
  auto& s = S();
  std::lock_guard lk(s.m);
  // Work left over is dropped, not run: its kernels may refer to a finished test's data.
  for (auto& [base, b] : s.blocks) std::free(reinterpret_cast<void*>(base));
  s.blocks.clear();
  s.instances.clear();
  s.ops.clear();
  // Streams and events are kept (ferry may still hold dead ones' handles): only emptied.
  for (auto& st : s.streams) {
    st->q.clear();
    delete std::exchange(st->capture, nullptr);
    st->capture_invalid = false;
  }
  my_captures.clear();
  s.host_clock.clear();
  s.host_vt = 0;
  for (auto& st : s.streams) {
    st->clock.assign(st->idx + 1, 0);
    st->vtail = 0;
  }
  for (auto& e : s.events) {
    e->captured_in = nullptr;
    e->recorded = 0;
    e->clock.clear();
    e->vtime = 0;
  }
  s.rng.seed(seed);
  s.progress = progress;
  const auto live_streams = s.c.live_streams, live_events = s.c.live_events;
  const auto live_graph_execs = s.c.live_graph_execs;
  s.c = counters{};
  s.c.live_streams = live_streams;
  s.c.live_events = live_events;
  s.c.live_graph_execs = live_graph_execs;
  s.violations.clear();
  s.fail_in = 0;
  s.wait_fail_in = 0;
  s.malloc_fail_in.clear();
  s.graph_fail_in.clear();
  s.set_device_fail_in.clear();
  s.peer_denied = false;
  s.peers.clear();
  s.frees_only_on = {};
}

void frees_only_on_this_thread(bool on) {
  std::lock_guard lk(S().m);
  S().frees_only_on = on ? std::this_thread::get_id() : std::thread::id{};
}

counters stats() {
  std::lock_guard lk(S().m);
  counters c = S().c;
  c.live_host_blocks = S().host_blocks.size();
  return c;
}
const std::vector<std::string>& violations() { return S().violations; }
void clear_violations() {
  std::lock_guard lk(S().m);
  S().violations.clear();
}
void report(std::string what) {
  std::lock_guard lk(S().m);
  S().violations.push_back(std::move(what));
}

op_id launch(cudaStream_t st, std::string label, std::vector<range> reads, std::vector<range> writes,
             std::function<void()> run, double seconds) {
  auto& s = S();
  std::lock_guard lk(s.m);
  if (!valid(st)) {
    s.violations.push_back("launch of " + label + " on a stream that does not exist");
    return 0;
  }
  check_current(st, "launch of " + label);
  if (record_node(st, [=](cudaStream_t to) { launch(to, label, reads, writes, run, seconds); })) return 0;
  tick();
  op& o = enqueue(st, kind::kernel, std::move(label), seconds);
  o.run = std::move(run);
  for (auto r : reads) touch(o, r.p, r.n, false);
  for (auto r : writes) touch(o, r.p, r.n, true);
  return o.id;
}

op_id last_copy_into(const void* p) {
  auto& s = S();
  std::lock_guard lk(s.m);
  for (auto it = s.ops.rbegin(); it != s.ops.rend(); ++it) {
    const op& o = **it;
    if (o.k == kind::copy && p >= o.dst && static_cast<const char*>(p) < static_cast<const char*>(o.dst) + o.n)
      return o.id;
  }
  return 0;
}

bool happens_before(op_id a, op_id b) {
  auto& s = S();
  std::lock_guard lk(s.m);
  if (a == 0 || b == 0 || a > s.ops.size() || b > s.ops.size()) return false;
  return hb(*s.ops[a - 1], *s.ops[b - 1]);
}

std::uint64_t pending_copies() {
  std::lock_guard lk(S().m);
  std::uint64_t n = 0;
  for (const auto& o : S().ops) n += o->k == kind::copy && !o->done;
  return n;
}

bool done(op_id a) {
  std::lock_guard lk(S().m);
  return a != 0 && a <= S().ops.size() && S().ops[a - 1]->done;
}

void drain() {
  std::lock_guard lk(S().m);
  drain_all();
}

void fail_copy(int n, cudaError_t status) {
  std::lock_guard lk(S().m);
  S().fail_in = n;
  S().fail_status = status;
}

void fail_wait(int n, cudaError_t status) {
  std::lock_guard lk(S().m);
  S().wait_fail_in = n;
  S().wait_fail_status = status;
}

void deny_peer_access() {
  std::lock_guard lk(S().m);
  S().peer_denied = true;
}
bool peer_enabled(int device, int peer) {
  std::lock_guard lk(S().m);
  return S().peers.count({device, peer}) != 0;
}

void fail_malloc(int device, int n) {
  std::lock_guard lk(S().m);
  S().malloc_fail_in[device] = n;
}

void fail_graph_launch(int device, int n, cudaError_t status) {
  std::lock_guard lk(S().m);
  S().graph_fail_in[device] = {n, status};
}

void fail_set_device(int device, int n, cudaError_t status) {
  std::lock_guard lk(S().m);
  S().set_device_fail_in[device] = {n, status};
}

op_id join_collective(cudaStream_t st, const void* group, std::uint64_t seq, int rank, int nranks,
                      std::string label, std::vector<range> reads, std::vector<range> writes,
                      std::function<void()> run) {
  auto& s = S();
  std::lock_guard lk(s.m);
  if (!valid(st)) {
    s.violations.push_back(label + " on a stream that does not exist");
    return 0;
  }
  check_current(st, label);
  if (record_node(st, [=](cudaStream_t to) { join_collective(to, group, seq, rank, nranks, label, reads, writes, run); }))
    return 0;
  auto& members = s.instances[{group, seq}];
  members.resize(static_cast<std::size_t>(nranks), nullptr);
  if (rank < 0 || rank >= nranks || members[rank]) {
    s.violations.push_back(label + ": rank " + std::to_string(rank) + " joins instance " + std::to_string(seq) +
                           " twice or out of range");
    return 0;
  }
  tick();
  op& o = enqueue(st, kind::collective, std::move(label));
  o.group = group;
  o.seq = seq;
  o.rank = rank;
  o.nranks = nranks;
  o.run = std::move(run);
  s.instances[{group, seq}][rank] = &o;
  for (auto r : reads) touch(o, r.p, r.n, false);
  for (auto r : writes) touch(o, r.p, r.n, true);
  return o.id;
}

void abort_collectives(const void* group, int rank) {
  auto& s = S();
  std::lock_guard lk(s.m);
  for (auto& o : s.ops)
    if (!o->done && o->k == kind::collective && o->group == group && o->rank == rank) {
      o->aborted = true;
      o->run = nullptr;
    }
  changed();
}

void wait_collectives(const void* group, int rank) {
  auto& s = S();
  std::lock_guard lk(s.m);
  ++s.c.host_waits;
  double until = 0;
  for (auto& o : s.ops)
    if (!o->done && o->k == kind::collective && o->group == group && o->rank == rank) until = std::max(until, o->vend);
  wait_until(
      [&] {
        return std::none_of(s.ops.begin(), s.ops.end(), [&](auto& o) {
          return !o->done && o->k == kind::collective && o->group == group && o->rank == rank;
        });
      },
      "a communicator's teardown waiting for its collectives");
  observe(until);
}

bool capture_node(cudaStream_t st, std::function<void(cudaStream_t)> node) {
  std::lock_guard lk(S().m);
  return valid(st) && record_node(st, std::move(node));
}

bool thread_capturing() { return !my_captures.empty(); }

int device_of(const void* p) {
  std::lock_guard lk(S().m);
  const device_block* b = block_of(reinterpret_cast<std::uintptr_t>(p));
  return b ? b->device : -1;
}

}  // namespace sim
