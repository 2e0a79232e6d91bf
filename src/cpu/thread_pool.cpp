#include "thread_pool.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "fatal_signals.hpp"
#include "tinydev/config.hpp"
#include "tinydev/hcq_device.hpp"

namespace tinydev::cpu {

// ---- CpuThreadPool --------------------------------------------------------------------------------

// Note [Concurrent grids]
// Several grids may run at once (two streams, two devices, two threads making direct calls): each
// caller publishes its job in `jobs` and works on it itself; pool threads take chunks from the
// oldest job that has chunks left, so a grid never waits for another grid to finish, and an idle
// pool thread helps whichever grid is running. A caller returns once its own job's indices all ran
// and no pool thread is still inside it.
struct CpuThreadPool::Impl {
  struct Job {
    void (*fn)(void*, std::uint64_t, std::uint64_t);
    void* ctx;
    std::uint64_t n, chunk;
    std::atomic<std::uint64_t> next{0};
    int active = 0;  // pool threads inside the job (guarded by mutex)
    RunningKernel* kernel = nullptr;  // the caller's, for fatal-signal messages
  };
  std::mutex mutex;
  std::condition_variable wake, done;
  std::vector<Job*> jobs;  // running jobs, oldest first (guarded by mutex)

  static void work(Job& job) {
    while (true) {
      const std::uint64_t begin = job.next.fetch_add(job.chunk, std::memory_order_relaxed);
      if (begin >= job.n) return;
      job.fn(job.ctx, begin, std::min(job.n, begin + job.chunk));
    }
  }
  // A job with chunks left, or nullptr (mutex held).
  Job* pick() {
    for (Job* j : jobs)
      if (j->next.load(std::memory_order_relaxed) < j->n) return j;
    return nullptr;
  }
  void run() {
    ensure_alternate_signal_stack();
    std::unique_lock lock(mutex);
    while (true) {
      Job* j = nullptr;
      wake.wait(lock, [&] { return (j = pick()) != nullptr; });
      j->active += 1;
      lock.unlock();
      {
        RunningKernel grid_thread = j->kernel ? *j->kernel : RunningKernel{};
        grid_thread.lane = "a grid thread";
        RunningKernelScope scope(j->kernel ? &grid_thread : nullptr);
        work(*j);
      }
      lock.lock();
      if (--j->active == 0) done.notify_all();
    }
  }
};

CpuThreadPool::CpuThreadPool(std::size_t threads) : threads_(std::max<std::size_t>(1, threads)), impl_(new Impl) {
  start_threads();
}

void CpuThreadPool::start_threads() {
  for (std::size_t i = 1; i < threads_; ++i) {
    std::thread([impl = impl_] { impl->run(); }).detach();  // the pool lives as long as the process
  }
}

CpuThreadPool& CpuThreadPool::global() {
  static CpuThreadPool* pool = [] {
    const int configured = settings().cpu_threads;
    const unsigned cores = std::thread::hardware_concurrency();
    return new CpuThreadPool(configured > 0 ? static_cast<std::size_t>(configured) : std::max(1u, cores));
  }();
  // Note [Devices and fork]: a forked child has none of the pool's threads, and its mutex may have
  // been copied held. The child gets a pool of its own (the old one is leaked, never touched).
  static std::atomic<std::uint64_t> generation{detail::watch_forks()};
  static std::mutex refork_mutex;
  if (detail::fork_generation() != generation.load(std::memory_order_acquire)) [[unlikely]] {
    std::lock_guard lock(refork_mutex);
    if (detail::fork_generation() != generation.load(std::memory_order_relaxed)) {
      pool->impl_ = new Impl;
      pool->start_threads();
      generation.store(detail::fork_generation(), std::memory_order_release);
    }
  }
  return *pool;
}

void CpuThreadPool::parallel_for(std::uint64_t n, void (*fn)(void*, std::uint64_t, std::uint64_t), void* ctx) {
  if (threads_ == 1 || n < 2) {
    fn(ctx, 0, n);
    return;
  }
  Impl& impl = *impl_;
  Impl::Job job;
  job.fn = fn;
  job.ctx = ctx;
  job.n = n;
  job.chunk = std::max<std::uint64_t>(1, n / (threads_ * 8));
  job.kernel = running_kernel();
  {
    std::lock_guard lock(impl.mutex);
    impl.jobs.push_back(&job);
  }
  impl.wake.notify_all();
  Impl::work(job);
  std::unique_lock lock(impl.mutex);
  // Our indices are all taken: no pool thread picks this job again (pick skips it).
  impl.done.wait(lock, [&] { return job.active == 0; });
  std::erase(impl.jobs, &job);
}
}  // namespace tinydev::cpu
