// bench/bench_support.hpp: the timing and formatting the benchmark programs share.
#pragma once

#include <fmt/format.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "tinydev/error.hpp"

namespace tinydev::bench {

// --quick: fewer batches.
inline bool g_quick = false;

// Median over batches of the time per operation, in nanoseconds: `ops` calls of `op`, then
// `after_batch` (e.g. a synchronize, so queued device work is paid for inside the batch).
inline double ns_per_op(const std::function<void()>& op, std::size_t ops, int batches = 15,
                        const std::function<void()>& after_batch = {}) {
  using Clock = std::chrono::steady_clock;
  if (g_quick) batches = std::min(batches, 5);
  std::vector<double> samples;
  op();  // warm up
  if (after_batch) after_batch();
  for (int b = 0; b < batches; ++b) {
    const auto start = Clock::now();
    for (std::size_t i = 0; i < ops; ++i) op();
    if (after_batch) after_batch();
    samples.push_back(std::chrono::duration<double, std::nano>(Clock::now() - start).count() / ops);
  }
  std::nth_element(samples.begin(), samples.begin() + samples.size() / 2, samples.end());
  return samples[samples.size() / 2];
}

// One result row: what, tinydev's figure, the baseline's, their ratio, the target, whether met.
using RowFn = std::function<void(std::string what, std::string lib, std::string base, std::string ratio,
                                 std::string target, bool met)>;

// bench_cpu_speed.cpp: the CPU rows users feel; `exe` is this program, re-run as a child for the
// rows that need a fresh process (--child-handoff pinned|idle, --child-open DEVICE).
void bench_cpu_speed(const RowFn& row, const std::string& exe);
int child_handoff(const std::string& mode);
int child_open(const std::string& device);
// bench_serving.cpp: streams and events (docs/serving.md).
void bench_serving(const RowFn& row);
// bench_disk.cpp: DISK reads and load_safetensors (docs/disk.md).
void bench_disk(const RowFn& row);

// bench_embedding.cpp: what linking tinydev costs a program (docs/embedding.md).
void bench_embedding(const RowFn& row);

// p50 and p99 of latency samples.
struct Percentiles {
  double p50 = 0, p99 = 0;
};
inline Percentiles percentiles(std::vector<double> samples) {
  std::sort(samples.begin(), samples.end());
  return {samples[samples.size() / 2], samples[std::min(samples.size() - 1, samples.size() * 99 / 100)]};
}

// The raw futex calls the sleeping baselines use.
inline void futex_wait(std::atomic<std::uint32_t>& word, std::uint32_t expected) {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}
inline void futex_wake(std::atomic<std::uint32_t>& word) {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// Runs this benchmark program again as `exe args` (a fresh process; --quick passed on) and
// returns the numbers on the first line it prints.
inline std::vector<double> run_child(const std::string& exe, const std::string& args) {
  std::FILE* p = ::popen(fmt::format("'{}' {}{}", exe, args, g_quick ? " --quick" : "").c_str(), "r");
  if (!p) throw Error("bench: cannot start a child");
  char line[256] = {};
  const bool got = std::fgets(line, sizeof line, p) != nullptr;
  const int rc = ::pclose(p);
  if (!got || rc != 0) throw Error(fmt::format("bench: child `{}` failed (exit {})", args, rc));
  std::vector<double> out;
  char* at = line;
  for (char* end = nullptr;; at = end) {
    const double v = std::strtod(at, &end);
    if (end == at) break;
    out.push_back(v);
  }
  return out;
}

inline std::string fmt_ns(double ns) {
  if (ns < 1e3) return fmt::format("{:.1f} ns", ns);
  if (ns < 1e6) return fmt::format("{:.2f} us", ns / 1e3);
  return fmt::format("{:.2f} ms", ns / 1e6);
}

}  // namespace tinydev::bench
