// The static NVTX injection behind nvtx_recorder.hpp: NVTX3's loader binds its weak
// InitializeInjectionNvtx2_fnptr to the definition below and calls it at the first NVTX
// call, which then routes the core module's RangePushA and RangePop here.
#include <cstdint>

// Declared before NVTX's loader, which reads it (its weak definition is left out below).
extern "C" int (*InitializeInjectionNvtx2_fnptr)(const void* (*)(std::uint32_t));
#define NVTX_STATIC_INJECTION_IMPL
#include <nvtx3/nvToolsExt.h>

#include <atomic>
#include <mutex>

#include "nvtx_recorder.hpp"

namespace {
std::mutex m;
std::vector<ferry_test::nvtx_event> events;
std::atomic<bool> injected{false};

int NVTX_API push(const char* name) {
  std::lock_guard lk(m);
  events.push_back({true, name ? name : "", std::this_thread::get_id()});
  return 0;
}
int NVTX_API pop() {
  std::lock_guard lk(m);
  events.push_back({false, "", std::this_thread::get_id()});
  return 0;
}
int NVTX_API init(NvtxGetExportTableFunc_t get) {
  auto* cb = static_cast<const NvtxExportTableCallbacks*>(get(NVTX_ETID_CALLBACKS));
  NvtxFunctionTable table = nullptr;
  unsigned int size = 0;
  if (!cb || !cb->GetModuleFunctionTable(NVTX_CB_MODULE_CORE, &table, &size) || !table ||
      size <= NVTX_CBID_CORE_RangePop)
    return 0;
  *table[NVTX_CBID_CORE_RangePushA] = reinterpret_cast<NvtxFunctionPointer>(&push);
  *table[NVTX_CBID_CORE_RangePop] = reinterpret_cast<NvtxFunctionPointer>(&pop);
  injected = true;
  return 1;
}
}  // namespace

NvtxInitializeInjectionNvtxFunc_t InitializeInjectionNvtx2_fnptr = init;

namespace ferry_test {
std::vector<nvtx_event> nvtx_events() {
  std::lock_guard lk(m);
  return events;
}
void nvtx_clear() {
  std::lock_guard lk(m);
  events.clear();
}
bool nvtx_injected() { return injected; }
}  // namespace ferry_test
