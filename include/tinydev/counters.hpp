// tinydev/counters.hpp: process-wide counters (the seed's GlobalCounters).
//
// Counters are relaxed atomics: safe to read and update from any thread; a reading taken while
// other threads work is a consistent value per counter, not across counters.
#pragma once

#include <atomic>
#include <cstdint>
#include <string_view>

#include "tinydev/config.hpp"
#include "tinydev/log.hpp"  // debug_log, formerly declared here
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

// One set per copy of tinydev in a process (Note [Copies in one process]): defined in counters.cpp,
// not inline, so a plugin never shares them with another copy through a unique symbol.
struct GlobalCounters {
  // Bytes held by allocated base Buffers (DISK buffers excluded, as in the seed).
  static std::atomic<std::int64_t> mem_used;
  // Kernel launches: direct Program calls and execs run by device queues.
  static std::atomic<std::int64_t> kernel_count;
  // Seconds spent in kernels that were launched with wait=true.
  static std::atomic<double> time_sum;

  static void reset() noexcept {
    kernel_count = 0;
    time_sum = 0.0;
  }
};

}  // namespace tinydev

TINYDEV_API_END
