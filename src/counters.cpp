#include "tinydev/counters.hpp"

#include <unistd.h>

#include <fmt/core.h>
#include <memory>
#include <mutex>
#include <string>

#include "tinydev/log.hpp"

namespace tinydev {

constinit std::atomic<std::int64_t> GlobalCounters::mem_used{0};
constinit std::atomic<std::int64_t> GlobalCounters::kernel_count{0};
constinit std::atomic<double> GlobalCounters::time_sum{0.0};

namespace {

// One write(2) per line so lines from different threads never interleave mid-line.
void write_stderr_line(LogLevel level, std::string_view subsystem, std::string_view message) noexcept {
  try {
    std::string line = fmt::format("tinydev: {}: {}: {}\n", to_string(level), subsystem, message);
    const char* p = line.data();
    std::size_t left = line.size();
    while (left > 0) {
      ssize_t n = ::write(STDERR_FILENO, p, left);
      if (n <= 0) return;  // stderr closed: logs are best effort
      p += n;
      left -= static_cast<std::size_t>(n);
    }
  } catch (...) {
    // Out of memory formatting a log line: the line is dropped.
  }
}

// In this file's anonymous namespace, so the std templates instantiated over it stay local (a
// shared_ptr<const LogSink> would be a std instance a plugin exports: tinydev/export.hpp).
struct InstalledSink {
  LogSink call;
};
struct SinkState {
  std::mutex mutex;
  std::shared_ptr<const InstalledSink> sink;  // null: the default
};
SinkState& sink_state() {
  static SinkState* state = new SinkState();  // never destroyed: exit handlers log
  return *state;
}
thread_local bool in_sink = false;  // a message the sink itself causes goes to stderr

}  // namespace

std::string_view to_string(LogLevel level) noexcept {
  switch (level) {
    case LogLevel::debug: return "debug";
    case LogLevel::info: return "info";
    case LogLevel::warning: return "warning";
    case LogLevel::error: return "error";
  }
  return "?";
}

void set_log_sink(LogSink sink) {
  auto next = sink ? std::make_shared<const InstalledSink>(InstalledSink{std::move(sink)}) : nullptr;
  SinkState& state = sink_state();
  std::lock_guard lock(state.mutex);
  state.sink = std::move(next);
}

void log_message(LogLevel level, std::string_view subsystem, std::string_view message) noexcept {
  std::shared_ptr<const InstalledSink> sink;
  if (!in_sink) {
    SinkState& state = sink_state();
    std::lock_guard lock(state.mutex);
    sink = state.sink;
  }
  if (!sink) return write_stderr_line(level, subsystem, message);
  in_sink = true;
  try {
    sink->call(level, subsystem, message);
  } catch (...) {
    // Note in log.hpp: a sink's exception is dropped; the library's caller must not see it.
  }
  in_sink = false;
}

}  // namespace tinydev
