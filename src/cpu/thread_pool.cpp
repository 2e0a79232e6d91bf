#include "thread_pool.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "tinydev/config.hpp"

namespace tinydev::cpu {

// ---- CpuThreadPool --------------------------------------------------------------------------------

struct CpuThreadPool::Impl {
  struct Job {
    void (*fn)(void*, std::uint64_t, std::uint64_t);
    void* ctx;
    std::uint64_t n, chunk;
    std::atomic<std::uint64_t> next{0};
    int active = 0;  // pool threads inside the job (guarded by mutex)
  };
  std::mutex job_mutex;  // one grid at a time
  std::mutex mutex;
  std::condition_variable wake, done;
  Job* job = nullptr;
  std::uint64_t generation = 0;
  std::vector<std::thread> threads;

  static void work(Job& job) {
    while (true) {
      const std::uint64_t begin = job.next.fetch_add(job.chunk, std::memory_order_relaxed);
      if (begin >= job.n) return;
      job.fn(job.ctx, begin, std::min(job.n, begin + job.chunk));
    }
  }
  void run() {
    std::uint64_t seen = 0;
    std::unique_lock lock(mutex);
    while (true) {
      wake.wait(lock, [&] { return generation != seen; });
      seen = generation;
      Job* j = job;
      if (!j) continue;
      j->active += 1;
      lock.unlock();
      work(*j);
      lock.lock();
      if (--j->active == 0) done.notify_all();
    }
  }
};

CpuThreadPool::CpuThreadPool(std::size_t threads) : threads_(std::max<std::size_t>(1, threads)), impl_(new Impl) {
  for (std::size_t i = 1; i < threads_; ++i) {
    impl_->threads.emplace_back([impl = impl_] { impl->run(); });
    impl_->threads.back().detach();  // the pool lives as long as the process
  }
}

CpuThreadPool& CpuThreadPool::global() {
  static CpuThreadPool* pool = [] {
    const int configured = settings().cpu_threads;
    const unsigned cores = std::thread::hardware_concurrency();
    return new CpuThreadPool(configured > 0 ? static_cast<std::size_t>(configured) : std::max(1u, cores));
  }();
  return *pool;
}

void CpuThreadPool::parallel_for(std::uint64_t n, void (*fn)(void*, std::uint64_t, std::uint64_t), void* ctx) {
  if (threads_ == 1 || n < 2) {
    fn(ctx, 0, n);
    return;
  }
  std::lock_guard one_job(impl_->job_mutex);
  Impl::Job job;
  job.fn = fn;
  job.ctx = ctx;
  job.n = n;
  job.chunk = std::max<std::uint64_t>(1, n / (threads_ * 8));
  {
    std::lock_guard lock(impl_->mutex);
    impl_->job = &job;
    impl_->generation += 1;
  }
  impl_->wake.notify_all();
  Impl::work(job);
  std::unique_lock lock(impl_->mutex);
  impl_->done.wait(lock, [&] { return job.active == 0; });
  impl_->job = nullptr;  // late threads see no job; none can still be inside this one
}
}  // namespace tinydev::cpu
