// ferry/detail/spin.hpp: a CPU hint for short spin-waits before blocking.
#pragma once

namespace ferry::detail {

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace ferry::detail
