// include/tinydev/cpu/thread_pool.hpp: the worker threads CPU
// kernels launched with a grid run on (Note [CPU grid ABI] in cpu_program.cpp).
//
// Ownership: one process-wide pool, created on first use and never destroyed (its threads are
// detached and outlive static destructors that may still launch kernels).
// Thread safety: parallel_for may be called from any thread; grids of concurrent callers run at
// the same time, sharing the pool's threads (Note [Concurrent grids]).
#pragma once

#include <cstddef>
#include <cstdint>
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev::cpu {

// TINYDEV_CPU_THREADS threads in all (default: one per core), the caller counting as one.
class CpuThreadPool {
 public:
  static CpuThreadPool& global();
  std::size_t threads() const noexcept { return threads_; }
  // Calls fn(begin, end) over [0, n) in chunks, on the pool and the calling thread; returns when
  // every index ran. fn must not throw.
  void parallel_for(std::uint64_t n, void (*fn)(void* ctx, std::uint64_t begin, std::uint64_t end), void* ctx);

 private:
  explicit CpuThreadPool(std::size_t threads);
  void start_threads();
  struct Impl;
  std::size_t threads_;
  Impl* impl_;
};

}  // namespace tinydev::cpu

TINYDEV_API_END
