#include "fatal_signals.hpp"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "signal_chain.hpp"
#include "tinydev/config.hpp"

namespace tinydev::cpu {

// Note [Fatal signals in kernels]
// A CPU kernel that writes through a bad pointer or divides an integer by zero raises SIGSEGV or
// SIGFPE on whichever thread runs it (a queue worker, a grid thread, the caller of a direct call).
// The process dies of it, as it must: the kernel's writes, the locks its thread held and the state
// of its queue are unknown, so carrying on would be unsound (we do not offer turning the fault
// into a poisoned queue). What we add is the message: threads publish the kernel they run
// (RunningKernelScope, a thread-local pointer), and the handler, only if the faulting thread runs
// a kernel, writes "tinydev: fatal SIGSEGV in kernel 'k' on LLVM (COMPUTE queue), faulting address
// 0x0" to stderr with async-signal-safe calls, then hands the signal to the handler installed
// before ours (a sanitizer's, a crash reporter's) or to the default action, which kills the process
// (with a core dump where enabled). Signals not raised by a kernel are passed on untouched.
// TINYDEV_FATAL_SIGNALS=0 keeps the handlers out entirely.

namespace {

// The default TLS model: initial-exec would save a __tls_get_addr call per launch but can make a
// shared libtinydev fail to dlopen (static TLS exhausted), which a plugin host cannot afford.
thread_local RunningKernel* tls_running = nullptr;

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
struct sigaction previous_actions[NSIG];

void write_str(const char* s) noexcept {
  if (!s) s = "?";
  ssize_t ignored = ::write(STDERR_FILENO, s, std::strlen(s));
  (void)ignored;
}

void write_hex(std::uintptr_t v) noexcept {
  char buf[2 + 16 + 1];
  char* p = buf + sizeof buf - 1;
  *p = '\0';
  do {
    *--p = "0123456789abcdef"[v & 0xf];
    v >>= 4;
  } while (v && p > buf + 2);
  *--p = 'x';
  *--p = '0';
  write_str(p);
}

const char* signal_name(int sig) noexcept {
  switch (sig) {
    case SIGSEGV: return "SIGSEGV (invalid memory access)";
    case SIGBUS: return "SIGBUS (bus error)";
    case SIGFPE: return "SIGFPE (arithmetic fault, e.g. integer division by zero)";
    case SIGILL: return "SIGILL (illegal instruction)";
    default: return "signal";
  }
}

void fatal_handler(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;  // a chained handler that returns must find errno as it was
  if (const RunningKernel* k = tls_running) {
    write_str("tinydev: fatal ");
    write_str(signal_name(sig));
    write_str(" in kernel '");
    write_str(k->kernel);
    write_str("' on ");
    write_str(k->device);
    write_str(" (");
    write_str(k->lane);
    write_str("), faulting address ");
    write_hex(reinterpret_cast<std::uintptr_t>(info ? info->si_addr : nullptr));
    write_str("; the process cannot go on safely\n");
  }
  errno = saved_errno;
  detail::pass_signal_on(previous_actions[sig], sig, info, context);
}

}  // namespace

RunningKernel* running_kernel() noexcept { return tls_running; }

RunningKernelScope::RunningKernelScope(RunningKernel* kernel) noexcept : previous_(tls_running) { tls_running = kernel; }
RunningKernelScope::~RunningKernelScope() { tls_running = previous_; }

void install_fatal_signal_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (!settings().fatal_signal_messages) return;
    for (int sig : kSignals) {
      struct sigaction action {};
      action.sa_sigaction = &fatal_handler;
      action.sa_flags = SA_SIGINFO | SA_ONSTACK;
      sigemptyset(&action.sa_mask);
      sigaction(sig, &action, &previous_actions[sig]);
    }
  });
}

namespace {
// The calling thread's alternate stack, taken down when the thread exits.
struct AlternateStack {
  void* memory = nullptr;
  bool done = false;
  ~AlternateStack() {
    if (!memory) return;
    stack_t off{};
    off.ss_flags = SS_DISABLE;
    sigaltstack(&off, nullptr);
    std::free(memory);
  }
};
thread_local AlternateStack tls_alternate_stack;
}  // namespace

void ensure_alternate_signal_stack() noexcept {
  AlternateStack& alt = tls_alternate_stack;
  if (alt.done) return;
  alt.done = true;
  stack_t current{};
  if (sigaltstack(nullptr, &current) == 0 && !(current.ss_flags & SS_DISABLE)) return;  // someone set one
  constexpr std::size_t kBytes = 64 * 1024;
  void* memory = std::malloc(kBytes);
  if (!memory) return;
  stack_t stack{};
  stack.ss_sp = memory;
  stack.ss_size = kBytes;
  if (sigaltstack(&stack, nullptr) != 0) std::free(memory);
  else alt.memory = memory;
}

}  // namespace tinydev::cpu
