// src/signal_chain.hpp: handing a signal on to the handler installed before ours. Private to the
// library: the CPU devices' fatal-signal handlers and the DISK backend's SIGBUS guard use it.
#pragma once

#include <signal.h>

namespace tinydev::detail {

// Called from a signal handler (async-signal-safe) that does not want `sig`: passes it to
// `previous`, the action ours replaced. A previous handler is called; where there was none (the
// default action, or SIG_IGN, which for a fault would re-fault forever), the default is
// reinstated: a fault raises itself again when the faulting instruction reruns, and a signal sent
// by kill() (si_code <= 0) is sent again.
void pass_signal_on(const struct sigaction& previous, int sig, siginfo_t* info, void* context) noexcept;

}  // namespace tinydev::detail
