#include "signal_chain.hpp"

namespace tinydev::detail {

void pass_signal_on(const struct sigaction& previous, int sig, siginfo_t* info, void* context) noexcept {
  if ((previous.sa_flags & SA_SIGINFO) && previous.sa_sigaction) {
    previous.sa_sigaction(sig, info, context);
    return;
  }
  if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN && previous.sa_handler) {
    previous.sa_handler(sig);
    return;
  }
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(sig, &dfl, nullptr);
  if (!info || info->si_code <= 0) raise(sig);
}

}  // namespace tinydev::detail
