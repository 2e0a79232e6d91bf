// bench/bench_support.hpp: the timing and formatting the benchmark programs share.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

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

inline std::string fmt_ns(double ns) {
  if (ns < 1e3) return fmt::format("{:.1f} ns", ns);
  if (ns < 1e6) return fmt::format("{:.2f} us", ns / 1e3);
  return fmt::format("{:.2f} ms", ns / 1e6);
}

}  // namespace tinydev::bench
