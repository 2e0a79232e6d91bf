// include/tinydev/cpu/fatal_signals.hpp: what a fatal signal in kernel code says before the process dies
// (Note [Fatal signals in kernels] in fatal_signals.cpp).
//
// Thread safety: RunningKernelScope is per thread; install_fatal_signal_handlers may be called from
// any thread, any number of times.
#pragma once

#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev::cpu {

// The kernel a thread is running, for the fatal-signal message. The strings must outlive the
// scope that publishes them (a program's name, a device's name).
struct RunningKernel {
  const char* kernel = nullptr;
  const char* device = nullptr;
  const char* lane = nullptr;  // "COMPUTE", "direct call", "grid thread"
};

// The current thread's running kernel (nullptr when it runs none).
RunningKernel* running_kernel() noexcept;

// Publishes `kernel` as this thread's running kernel for the scope's life.
class RunningKernelScope {
 public:
  explicit RunningKernelScope(RunningKernel* kernel) noexcept;
  ~RunningKernelScope();
  RunningKernelScope(const RunningKernelScope&) = delete;
  RunningKernelScope& operator=(const RunningKernelScope&) = delete;

 private:
  RunningKernel* previous_;
};

// Installs the SIGSEGV, SIGBUS, SIGFPE and SIGILL handlers once (unless TINYDEV_FATAL_SIGNALS=0),
// chaining to whatever handler was installed before.
void install_fatal_signal_handlers();

// Gives the calling thread an alternate signal stack (once), so a kernel that overflowed its
// stack still gets its message printed.
void ensure_alternate_signal_stack() noexcept;

}  // namespace tinydev::cpu

TINYDEV_API_END
