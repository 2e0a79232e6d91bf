#include "tinydev/counters.hpp"

#include <unistd.h>

#include <string>

namespace tinydev {

constinit std::atomic<std::int64_t> GlobalCounters::mem_used{0};
constinit std::atomic<std::int64_t> GlobalCounters::kernel_count{0};
constinit std::atomic<double> GlobalCounters::time_sum{0.0};

}  // namespace tinydev

namespace tinydev::detail {

void write_log_line(std::string_view line) {
  // One write(2) per line so lines from different threads never interleave mid-line.
  std::string buf(line);
  buf.push_back('\n');
  const char* p = buf.data();
  std::size_t left = buf.size();
  while (left > 0) {
    ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n <= 0) return;  // stderr closed: logs are best effort
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

}  // namespace tinydev::detail
