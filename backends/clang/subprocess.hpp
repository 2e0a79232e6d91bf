// backends/clang/subprocess.hpp: run a program with bytes on its stdin, capturing stdout and
// stderr, without temporary files or a shell. Internal to the CLANG backend.
// Thread safety: run_process may be called from several threads at once.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev::clang_backend {

// The most bytes kept of each of stdout and stderr; more is a runaway process, killed at once.
inline constexpr std::size_t kMaxOutputBytes = 256u << 20;

struct ProcessResult {
  int exit_code = -1;      // the exit status, 128 + signal number when killed by a signal, -1 when
                           // the status could not be learned (the process was reaped elsewhere)
  std::string out;         // stdout, bytes verbatim
  std::string err;         // stderr
  bool timed_out = false;  // killed (with its process group) because it ran past the timeout
  bool output_overflow = false;  // killed because it wrote more than kMaxOutputBytes
  int pid = -1;            // the process (and its process group), reaped by the time this returns
};

// Runs argv[0] (searched on PATH) with `input` on stdin, in a process group of its own. Past
// `timeout` the whole group is killed with SIGKILL and reaped (no zombie is left), and the result
// says timed_out. Throws tinydev::Error when the process cannot be started (naming it and the OS
// error).
ProcessResult run_process(const std::vector<std::string>& argv, std::string_view input,
                          std::chrono::milliseconds timeout);

// The absolute path of `program` found on PATH, or "" when it is not there.
std::string find_on_path(const std::string& program);

}  // namespace tinydev::clang_backend

TINYDEV_API_END
