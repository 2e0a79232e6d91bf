// tinydev/log.hpp: where the library's messages go (docs/embedding.md, "Logging").
//
// Every message tinydev writes goes through one process-wide sink (one per copy of tinydev in a
// process): TINYDEV_DEBUG traces, warnings (an unknown TINYDEV_ variable) and errors it cannot
// throw (a failed profile write at exit, an I/O failure in a worker). The default sink writes one
// line to stderr, "tinydev: <level>: <subsystem>: <message>", with one write(2) so lines from
// different threads never interleave. The one exception is the report of a fatal signal in a
// kernel, written from the signal handler with async-signal-safe calls just before the process
// dies (Note [Fatal signals in kernels]).
//
// Thread safety: every function here may be called from any thread. The sink is called from
// whichever thread logs, concurrently from several; it must not block for long. A sink installed
// by set_log_sink may still be running on another thread when set_log_sink returns. Messages a
// sink causes while it runs (it calls tinydev) go to the default sink, not back into it; an
// exception a sink throws is dropped.
#pragma once

#include <fmt/core.h>

#include <cstdint>
#include <functional>
#include <string_view>
#include <utility>

#include "tinydev/config.hpp"
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

enum class LogLevel : std::uint8_t {
  debug,    // TINYDEV_DEBUG >= 2: per-kernel and per-copy traces
  info,     // TINYDEV_DEBUG >= 1: devices opened, cache decisions
  warning,  // always: something is off but tinydev goes on (an unknown TINYDEV_ variable)
  error,    // always: a failure nobody could be told by an exception (a failed write at exit)
};
std::string_view to_string(LogLevel level) noexcept;  // "debug", "info", "warning", "error"

// The sink: the level, the subsystem (a device name such as "LLVM" or "CUDA:1", or one of
// "config", "cache", "buffer", "profile", "compiler") and the message, one line without a newline.
using LogSink = std::function<void(LogLevel level, std::string_view subsystem, std::string_view message)>;

// Sends every later message to `sink`; an empty function restores the default (stderr).
void set_log_sink(LogSink sink);

// Sends one message to the sink. Never throws.
void log_message(LogLevel level, std::string_view subsystem, std::string_view message) noexcept;

// A TINYDEV_DEBUG trace: sent when TINYDEV_DEBUG >= `verbosity` (1: info, 2 and up: debug).
// Formatting happens only when it is sent.
template <class... Args>
void debug_log(int verbosity, std::string_view subsystem, fmt::format_string<Args...> format, Args&&... args) {
  if (settings().debug < verbosity) return;
  log_message(verbosity <= 1 ? LogLevel::info : LogLevel::debug, subsystem,
              fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace tinydev

TINYDEV_API_END
