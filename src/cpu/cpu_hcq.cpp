#include "cpu_hcq.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "fatal_signals.hpp"
#include "host.hpp"
#include "object_runtime.hpp"
#include "thread_pool.hpp"
#include "tinydev/counters.hpp"
#include "tinydev/error.hpp"
#include "tinydev/hcq_graph.hpp"
#include "tinydev/profile.hpp"

namespace tinydev::cpu {

// "LLVM's timeline", "LLVM stream 2's timeline" or "CPU signal #7" (defined with the live devices).
std::string describe_slot(const SignalSlot* slot);

namespace {

CpuHCQDevice& cpu_device(Compiled& device, std::string_view queue) {
  auto* cpu = dynamic_cast<CpuHCQDevice*>(&device);
  if (!cpu)
    throw InvalidArgument(fmt::format("cannot submit a CPU {} queue to {}: it runs on the CPU backends' devices only",
                                      queue, device.name()));
  cpu->check_usable();  // a forked child's device has no workers; a faulted one takes no work
  return *cpu;
}

template <class Queue>
void check_pools(const Queue& queue, const CpuHCQDevice& device) {
  for (const SignalPool* pool : queue.pools())
    if (!device.can_reach(*pool))
      throw InvalidArgument(fmt::format("cannot submit to {}: the queue uses a signal of pool '{}', which {} "
                                        "cannot reach; use signals from a CPU device's alloc_signal()",
                                        device.name(), pool->name(), device.name()));
}

// A copy command moving a large block streams it (Note [Streaming copies] in src/memory.cpp).
void copy_command(std::byte* dest, const std::byte* src, std::size_t size) {
  constexpr std::size_t kStreamFrom = 256u << 10;
  const bool overlap = dest < src + size && src < dest + size;
  if (size >= kStreamFrom && !overlap) detail::streaming_copy(dest, src, size);
  else std::memmove(dest, src, size);
}

}  // namespace

// ---- queues ---------------------------------------------------------------------------------------

// The local size goes unused: a CPU kernel has none (Note [Compact commands]).
void CpuComputeQueue::_exec(const CpuProgram& program, const Kernargs& kernargs, Dim3 global, Dim3 /*local*/) {
  program.check_launch(kernargs.num_buffers, kernargs.num_values, global);
  if (!kernargs.ptr && kernargs.size() != 0)
    throw InvalidArgument(fmt::format("exec of '{}': the kernargs have no memory; allocate them with the "
                                      "device's alloc_kernargs()",
                                      program.name()));
  mutable_commands().push_back(CpuCommand::of_exec(&program, kernargs.ptr, kernargs.num_buffers, kernargs.num_values,
                                                   global, Profiler::current_request(), Profiler::current_graph()));
}

void CpuComputeQueue::_update_exec(std::size_t cmd, Dim3 global, Dim3 /*local*/) {
  CpuCommand& c = *command_words(cmd);
  c.program->check_launch(c.num_buffers, c.num_values, global);
  c.global = global;
}

void CpuComputeQueue::_submit(Compiled& device) {
  CpuHCQDevice& cpu = cpu_device(device, "compute");
  check_pools(*this, cpu);
  cpu.compute_worker().submit(snapshot());
}

void CpuCopyQueue::_update_copy(std::size_t cmd, const std::optional<Allocation>& dest, const std::optional<Allocation>& src) {
  CpuCommand& c = *command_words(cmd);
  check_copy(dest ? *dest : Allocation{0, c.size, nullptr}, src ? *src : Allocation{0, c.size, nullptr}, c.size);
  if (dest) c.dest = dest->host_ptr<std::byte>();
  if (src) c.src = src->host_ptr<const std::byte>();
}

void CpuCopyQueue::_submit(Compiled& device) {
  CpuHCQDevice& cpu = cpu_device(device, "copy");
  check_pools(*this, cpu);
  cpu.copy_worker().submit(snapshot());
}

// ---- workers --------------------------------------------------------------------------------------

CpuQueueWorker::CpuQueueWorker(std::string device, std::string lane)
    : device_(std::move(device)), lane_(std::move(lane)) {}

CpuQueueWorker::~CpuQueueWorker() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
}

// Note [Submission ring]
// Submissions reach the worker through a ring of kRing slots: a submit puts the words in slot
// tail % kRing and publishes tail_ + 1; the worker spins on tail_, runs each slot in order and
// publishes head_. In a pipelined eager run (a queue of wait, exec and signal made, submitted and
// dropped per kernel) the cost of a submit on this kind of machine is the cache lines it must take
// back from the worker's core, about 0.2 us each when the other core touched them last, and
// more when a locked instruction waits for them. The first design, a vector swapped out whole
// under the worker's lock, had the worker take that lock, the vector and a hand-back list every
// batch, and nearly every batch was one submission: 1.6-2 us per kernel. With the ring the
// worker never takes the submitters' lock in the steady state, the submitter stores tail_ with a
// release store under that lock (taken by submitters only), and what still crosses is the slot,
// the words and their reference count: 1.1-1.2 us per kernel here in `tinydev_bench --only hcq`,
// 1.4 us when run after other sections (the record alone, not submitted, is 0.2 us). Since then a
// slot has a cache line of its own (Note [Worker layout]), commands are half the size (Note
// [Compact commands]), a queue keeps its per-command records in one allocation, not three, and
// its signal uses and pools in place, and kernel arguments no longer read the timeline the worker
// writes: 0.90-1.00 us, where the build before read 1.18-1.21 us (docs/performance.md, 2026-12-07).
// - Freed where allocated. An eager queue is dropped right after its submit, so the run's end
//   dropped the last reference to its words, on the worker: two blocks per submission allocated
//   on one thread and freed on another, which glibc does under its arena lock (perf put half of
//   a pipelined submitter's time in malloc, page faults and futex calls for that lock). Words
//   only the ring holds (use count 1: no queue holds them, nor can one take them again) now stay
//   in their slot after their run, and the submit that reuses the slot frees them, on its own
//   thread. Words a queue still holds are released by the worker at once, as before, so the
//   queue reuses them in place (Note [Queue resubmission]).
// - Memory. The words of at most kRing submissions, of any size, wait so while work comes; once
//   nothing was submitted for the worker's spin budget the submitters are quiet, and the worker
//   frees every slot before it sleeps.
// - Full ring. A submit never blocks on the worker (it may be waiting for a signal the submitter
//   sets later): past kRing unrun submissions they go to overflow_, in order, and keep going
//   there until the worker, having emptied the ring, takes the overflow under the lock. The
//   worker frees overflow words itself after their run: a producer that stays 128 submissions
//   ahead pays the cross-thread frees again, but it is ahead, not waiting.
// - Counting. submitted_ is raised before a submission is published (ring or overflow) and
//   finished_ after it ran, so finished_ never passes submitted_ and idle() never reports idle
//   while a submission is queued or running (Note [Inline replay] relies on it).
// Note [Worker layout]
// CpuQueueWorker's fields are grouped by who writes them, each group on cache lines of its own:
// what submitters write under the lock, tail_ (the one line the worker spins on), the worker's
// own counters, what it runs (BlockedOn, written per kernel), and the ring, a line per slot (four
// slots to a line had a submit filling slot p take back the line the worker was reading slot
// p - 1 from). Before, the worker's
// per-submission and per-kernel stores shared lines with the counters every submit writes or
// reads, so each submit missed on lines the worker had written for no reason of its own.
void CpuQueueWorker::submit(Words commands) {
  bool wake;
  {
    const std::lock_guard lock(mutex_);
    if (!thread_.joinable()) [[unlikely]]
      thread_ = std::thread([this] { run(); });  // throws std::system_error, nothing queued
    const std::uint64_t tail = tail_.load(std::memory_order_relaxed);  // stored only under this lock
    if (overflow_.empty() && tail - head_seen_ >= kRing) head_seen_ = head_.load(std::memory_order_acquire);
    if (overflow_.empty() && tail - head_seen_ < kRing) {
      Words& slot = ring_[tail % kRing].words;
      if (slot) release_snapshot(slot);  // run long ago (head_ is past it): freed on this thread
      slot = std::move(commands);
      submitted_.fetch_add(1, std::memory_order_seq_cst);
      tail_.store(tail + 1, std::memory_order_release);
    } else {
      overflow_.push_back(std::move(commands));  // may throw: nothing queued
      submitted_.fetch_add(1, std::memory_order_seq_cst);
      overflowed_.store(true, std::memory_order_release);
    }
    wake = sleeping_;
  }
  if (wake) wake_.notify_one();
}

void CpuQueueWorker::run_submission(const std::vector<CpuCommand>& words) {
  execute_commands(words, 0, device_, lane_, /*blocking=*/true, &blocked_);
  // BlockedOn: running_name was cleared; a reader that read it before is seen here.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  while (blocked_.readers.load(std::memory_order_acquire) != 0) detail::cpu_relax();
}

void CpuQueueWorker::run() {
  ensure_alternate_signal_stack();  // Note [Fatal signals in kernels]
  std::uint64_t head = 0;
  std::vector<Words> overflow;
  // Whether a submission waits: in the ring past what this thread ran, or in the overflow. What
  // the spin, the checks under the lock and the sleep all wait for.
  const auto work_came = [&] {
    return tail_.load(std::memory_order_acquire) != head || overflowed_.load(std::memory_order_acquire);
  };
  while (true) {
    const std::uint64_t tail = tail_.load(std::memory_order_acquire);
    if (head != tail) {
      for (; head != tail; ++head) {
        Words& slot = ring_[head % kRing].words;
        run_submission(*slot);
        if (slot.use_count() != 1) release_snapshot(slot);  // a queue holds them (Note [Snapshot release ordering])
        head_.store(head + 1, std::memory_order_release);
        finished_.fetch_add(1, std::memory_order_release);
      }
      continue;
    }
    if (overflowed_.load(std::memory_order_acquire)) {
      {
        const std::lock_guard lock(mutex_);
        if (tail_.load(std::memory_order_relaxed) != head) continue;  // ring first: it was filled before
        overflow.swap(overflow_);
        overflowed_.store(false, std::memory_order_relaxed);
      }
      for (Words& words : overflow) {
        run_submission(*words);
        release_snapshot(words);  // the rare path: freed here
        finished_.fetch_add(1, std::memory_order_release);
      }
      overflow.clear();
      continue;
    }
    // A pipelined producer submits again within microseconds: spin a little before sleeping
    // (Note [Adaptive spinning]: the budget shrinks when the producer does not come back soon).
    if (detail::adaptive_spin(work_came)) continue;
    std::unique_lock lock(mutex_);
    if (work_came()) continue;
    // Quiet for the spin budget, and every slot has run: free what the ring still holds, here
    // (Note [Submission ring]: memory), with the lock let go so a submit coming now need not wait.
    if (std::any_of(ring_.begin(), ring_.end(), [](const Slot& slot) { return slot.words != nullptr; })) {
      std::array<Words, kRing> quiet;
      for (std::size_t i = 0; i < kRing; ++i) quiet[i] = std::move(ring_[i].words);
      lock.unlock();
      for (Words& words : quiet)
        if (words) release_snapshot(words);
      lock.lock();
      if (work_came()) continue;
    }
    if (stop_) return;
    sleeping_ = true;
    wake_.wait(lock, [&] { return work_came() || stop_; });
    sleeping_ = false;
  }
}

namespace {
// The time a kernel started, for "running kernel 'k' for N ms": the coarse clock (a few ms of
// resolution) costs a few ns per exec where the precise one costs 20-25.
std::int64_t coarse_now_ns() noexcept {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

// Note [Queue failure]: commands from `from` on will not run; every signal they would set is
// poisoned, so whoever waits for that work gets `reason` instead of a hang.
void poison_signals_from(const std::vector<CpuCommand>& commands, std::size_t from, const std::string& reason) {
  for (std::size_t j = from; j < commands.size(); ++j)
    if (commands[j].kind == CommandKind::signal) commands[j].signal->poison(reason);
}
}  // namespace

std::size_t execute_commands(const std::vector<CpuCommand>& commands, std::size_t from, const std::string& device,
                             const std::string& lane, bool blocking, BlockedOn* blocked) {
  const bool profiling = Profiler::global().enabled();
  RunningKernel running{nullptr, device.c_str(), lane.c_str()};  // Note [Fatal signals in kernels]
  std::size_t i = from;
  try {
    for (; i < commands.size(); ++i) {
      const CpuCommand& c = commands[i];
      switch (c.kind) {
        case CommandKind::signal:
          c.signal->store(c.value);
          break;
        case CommandKind::wait:
          // A value written after a poison is no success (poison_failed): fail as the wait would.
          if (poison_failed(*c.signal, c.value)) wait_signal_slot(*c.signal, c.value, std::chrono::nanoseconds(0), nullptr);
          if (!blocking && c.signal->value.load(std::memory_order_acquire) < c.value &&
              !c.signal->poisoned.load(std::memory_order_acquire))
            return i;
          if (c.signal->value.load(std::memory_order_acquire) < c.value) {
            if (blocked) {
              blocked->value.store(c.value, std::memory_order_relaxed);
              blocked->command.store(i, std::memory_order_relaxed);
              blocked->since_ns.store(Profiler::now_ns(), std::memory_order_relaxed);
              blocked->signal.store(c.signal, std::memory_order_release);
            }
            struct Unblock {
              BlockedOn* b;
              ~Unblock() {
                if (b) b->signal.store(nullptr, std::memory_order_release);
              }
            } unblock{blocked};
            while (c.signal->value.load(std::memory_order_acquire) < c.value)
              wait_signal_slot(*c.signal, c.value, std::chrono::hours(1), nullptr);
          }
          break;
        case CommandKind::timestamp:
          c.signal->timestamp_ns.store(Profiler::now_ns(), std::memory_order_release);
          break;
        case CommandKind::memory_barrier:
          std::atomic_thread_fence(std::memory_order_seq_cst);
          break;
        case CommandKind::exec: {
          std::uint64_t args[kMaxKernelArgs];
          for (std::uint32_t b = 0; b < c.num_buffers; ++b) std::memcpy(&args[b], c.kernargs + 8 * b, 8);
          for (std::uint32_t v = 0; v < c.num_values; ++v) {
            std::uint32_t value;
            std::memcpy(&value, c.kernargs + 8 * c.num_buffers + 4 * v, 4);
            args[c.num_buffers + v] = value;
          }
          const std::uint64_t start = profiling ? Profiler::now_ns() : 0;
          if (blocked) {
            blocked->running_since_ns.store(coarse_now_ns(), std::memory_order_relaxed);
            blocked->running_command.store(static_cast<std::int64_t>(i), std::memory_order_relaxed);
            blocked->running_name.store(&c.program->name(), std::memory_order_release);
          }
          running.kernel = c.program->name().c_str();
          {
            RunningKernelScope scope(&running);
            c.program->launch(args, c.num_buffers + c.num_values, c.global);
          }
          if (blocked) blocked->running_name.store(nullptr, std::memory_order_release);
          const std::int64_t launched = GlobalCounters::kernel_count.fetch_add(1, std::memory_order_relaxed) + 1;
          debug_log(2, device, "*** {:<7} {:>6} {:<40} arg {:>3} (queued)", device, launched, c.program->name(),
                    c.num_buffers + c.num_values);
          if (profiling)
            Profiler::global().add(ProfileEvent{c.program->name(), start, Profiler::now_ns(), device, lane, c.request,
                                                c.graph});
          break;
        }
        case CommandKind::copy:
          copy_command(c.dest, c.src, c.size);
          break;
      }
    }
  } catch (const std::exception& e) {
    // Note [Queue failure]: the rest of this submission does not run; every signal it would have
    // set is poisoned, so whoever waits for this work gets the reason instead of a hang. A wait
    // on a failed signal passes the first failure on, leading, so chains of waits keep the root.
    const CpuCommand& c = commands[i];
    if (blocked) blocked->running_name.store(nullptr, std::memory_order_release);
    if (c.kind == CommandKind::wait && c.signal->poisoned.load(std::memory_order_acquire))
      poison_signals_from(commands, i,
                          fmt::format("{} (so {} {} queue command {}, a wait for it, failed)", c.signal->poison_text(),
                                      device, lane, i));
    else
      poison_signals_from(commands, i,
                          fmt::format("{} {} queue: command {} ({}) failed: {}", device, lane, i, to_string(c.kind),
                                      e.what()));
  }
  return commands.size();
}

std::string CpuQueueWorker::describe_blocked() const {
  const std::int64_t coarse_now = coarse_now_ns();
  const auto now = static_cast<std::int64_t>(Profiler::now_ns());
  {
    // Announced as a reader, the running program's name stays alive while we copy it (BlockedOn).
    BlockedOn& b = blocked_;
    b.readers.fetch_add(1, std::memory_order_seq_cst);
    std::string kernel;
    std::int64_t command = -1, since = 0;
    if (const std::string* name = b.running_name.load(std::memory_order_seq_cst)) {
      kernel = *name;
      command = b.running_command.load(std::memory_order_relaxed);
      since = b.running_since_ns.load(std::memory_order_relaxed);
    }
    b.readers.fetch_sub(1, std::memory_order_seq_cst);
    if (command >= 0)
      return fmt::format("its {} queue has been running kernel '{}' (command {} of a submission) for {} ms", lane_,
                         kernel, command, (coarse_now - since) / 1'000'000);
  }
  SignalSlot* slot = blocked_.signal.load(std::memory_order_acquire);
  if (!slot) return {};
  const std::int64_t for_ms = (now - blocked_.since_ns.load(std::memory_order_relaxed)) / 1'000'000;
  return fmt::format("its {} queue is blocked on command {} of a submission, a wait for {} to reach {} (it is "
                     "at {}, for {} ms)",
                     lane_, blocked_.command.load(std::memory_order_relaxed), describe_slot(slot),
                     blocked_.value.load(std::memory_order_relaxed), slot->value.load(std::memory_order_acquire),
                     for_ms);
}

// ---- allocator ------------------------------------------------------------------------------------

// Note [CPU staging ring size]
// The seed's 32 x 2 MiB ring suits a GPU, where the ring is only read by the copy engine. On the
// CPU the ring is written by the caller and read by the copy worker through the same caches: a
// ring that fits in the last-level cache (4 x 2 MiB) is read back from cache and never written to
// DRAM, so a copyin through it runs near memcpy speed (bench: 0.5x with 64 MiB of ring, 0.97x with 8).
CpuAllocator::CpuAllocator(CpuHCQDevice& device)
    : HCQAllocator<CpuHCQDevice>(device, kDefaultBatchSize, 4, /*host_visible=*/true) {}

CpuAllocator::~CpuAllocator() {
  release_ring();
  free_cache();
}

std::string CpuAllocator::describe() const { return fmt::format("{} allocator (host memory)", device_.name()); }

Allocation CpuAllocator::alloc_impl(std::size_t size, const BufferOptions&) {
  return detail::alloc_host_memory(size, describe());
}

void CpuAllocator::free_impl(Allocation allocation, std::size_t size, const BufferOptions&) {
  if (!wait_before_free(size)) return;  // running work may still touch it: leaked, not freed under it
  detail::free_host_memory(allocation);
}

// ---- the device -----------------------------------------------------------------------------------

const std::shared_ptr<SignalPool>& CpuHCQDevice::shared_signal_pool() {
  static auto* pool = new std::shared_ptr<SignalPool>(std::make_shared<SignalPool>("CPU"));
  return *pool;
}

namespace {
// The live CPU devices, for signal_users_now (they share one signal pool).
struct LiveDevices {
  std::mutex mutex;
  std::vector<const CpuHCQDevice*> devices;
};
LiveDevices& live_devices() {
  static auto* live = new LiveDevices;  // never destroyed: devices outlive static destructors
  return *live;
}
}  // namespace

std::string describe_slot(const SignalSlot* slot) {
  {
    LiveDevices& live = live_devices();
    std::lock_guard lock(live.mutex);
    for (const CpuHCQDevice* device : live.devices)
      if (device->timeline_slot() == slot) return fmt::format("{}'s timeline", device->name());
  }
  if (auto index = CpuHCQDevice::shared_signal_pool()->index_of(slot))
    return fmt::format("{} signal #{}", CpuHCQDevice::shared_signal_pool()->name(), *index);
  return "a signal";
}

// Note [Program retirement]
// A queued exec refers to its program by a plain pointer (a reference count touched per exec would
// bounce one cache line between the submitting thread and the worker on every launch). Instead the
// programs the CPU runtimes hand out (make_cpu_program) are not deleted when their last handle
// goes: they are retired, with how many submissions every live CPU device's compute worker had
// been given at that moment, and deleted once each of those workers has finished that many. Any exec
// that could still launch the program was submitted before, so it has run by then. Retired
// programs are looked at again when another program retires and on every synchronize.
namespace {
struct RetiredPrograms {
  std::mutex mutex;
  std::vector<std::pair<const CpuProgram*, std::vector<std::pair<const CpuQueueWorker*, std::uint64_t>>>> programs;
};
RetiredPrograms& retired_programs() {
  static auto* retired = new RetiredPrograms;  // never destroyed: programs may retire during exit
  return *retired;
}
// Deletes the retired programs no worker can still run (caller holds retired.mutex).
void reclaim_programs(RetiredPrograms& retired) {
  std::erase_if(retired.programs, [](const auto& entry) {
    for (const auto& [worker, count] : entry.second)
      if (worker->finished() < count) return false;
    delete entry.first;
    return true;
  });
}
}  // namespace

std::shared_ptr<CpuProgram> make_cpu_program(std::string name, std::string device, std::shared_ptr<void> code,
                                             void* fn, std::optional<KernelSignature> signature,
                                             CallOrdering* ordering) {
  return std::shared_ptr<CpuProgram>(
      new CpuProgram(std::move(name), std::move(device), std::move(code), fn, signature, ordering),
      [](CpuProgram* program) {
        std::vector<std::pair<const CpuQueueWorker*, std::uint64_t>> marks;
        {
          LiveDevices& live = live_devices();
          std::lock_guard lock(live.mutex);
          for (const CpuHCQDevice* device : live.devices) {
            const CpuQueueWorker& worker = device->compute_worker();
            if (worker.finished() < worker.submitted()) marks.emplace_back(&worker, worker.submitted());
          }
        }
        RetiredPrograms& retired = retired_programs();
        std::lock_guard lock(retired.mutex);
        if (marks.empty()) delete program;  // nothing queued anywhere: nothing can run it
        else retired.programs.emplace_back(program, std::move(marks));
        reclaim_programs(retired);
      });
}

std::vector<CpuHCQDevice::TimelineMark> CpuHCQDevice::signal_users_now() const {
  std::vector<TimelineMark> marks;
  LiveDevices& live = live_devices();
  std::lock_guard lock(live.mutex);
  for (const CpuHCQDevice* device : live.devices) {
    auto own = device->HCQCompiled::signal_users_now();
    marks.insert(marks.end(), own.begin(), own.end());
  }
  return marks;
}

CpuHCQDevice::CpuHCQDevice(const std::string& name, std::unique_ptr<Compiler> compiler, SourceLanguage language,
                           const RuntimeFactory& make_runtime)
    : HCQCompiled(name, std::make_shared<CpuAllocator>(*this), std::move(compiler), make_runtime(name, this), language,
                  shared_signal_pool()),
      compute_worker_(name, "COMPUTE"),
      copy_worker_(name, "DMA"),
      kernargs_(name) {
  install_fatal_signal_handlers();  // Note [Fatal signals in kernels]
  // Last: a constructor that throws runs no destructor, and only the destructor removes the
  // registration (it points at this device).
  LiveDevices& live = live_devices();
  std::lock_guard lock(live.mutex);
  live.devices.push_back(this);
}

CpuHCQDevice::CpuHCQDevice(CpuHCQDevice& parent, std::string lane_name)
    : HCQCompiled(lane_name, std::make_shared<CpuAllocator>(*this), parent.shared_compiler(), parent.shared_runtime(),
                  parent.source_language(), shared_signal_pool()),
      compute_worker_(lane_name, "COMPUTE"),
      copy_worker_(lane_name, "DMA"),
      kernargs_(lane_name),
      parent_(&parent) {
  never_wrap_timeline();  // its events live on (Note [Timeline wrap])
  LiveDevices& live = live_devices();
  std::lock_guard lock(live.mutex);
  live.devices.push_back(this);
}

CpuHCQDevice::~CpuHCQDevice() {
  LiveDevices& live = live_devices();
  std::lock_guard lock(live.mutex);
  std::erase(live.devices, this);
}

// Note [Kernargs pages] (tinydev/hcq_queue.hpp).
Kernargs CpuHCQDevice::alloc_kernargs(std::uint32_t num_buffers, std::uint32_t num_values) {
  std::lock_guard lock(submit_mutex());
  return kernargs_.alloc(num_buffers, num_values, timeline_signal().slot().value, timeline_value());
}

std::shared_ptr<std::byte[]> CpuHCQDevice::allocate_kernargs_block(std::size_t bytes) const {
  return std::shared_ptr<std::byte[]>(new std::byte[bytes]());
}

void CpuHCQDevice::before_direct_call() {
  check_usable();
  check_no_reservation_held("a direct kernel call");
  if (!idle()) wait_timeline_reached(timeline_value() - 1);
}

void CpuHCQDevice::synchronize() {
  HCQCompiled::synchronize();
  {
    RetiredPrograms& retired = retired_programs();
    std::lock_guard lock(retired.mutex);
    if (!retired.programs.empty()) reclaim_programs(retired);
  }
  lanes_.synchronize_all();  // every stream's work ends, finished or failed
}

std::shared_ptr<Stream> CpuHCQDevice::create_stream(const StreamOptions& options) {
  check_usable();
  if (parent_) return parent_->create_stream(options);
  CpuHCQDevice* lane = lanes_.take(kMaxStreams, name(), [&](std::size_t number) {
    return std::unique_ptr<CpuHCQDevice>(new CpuHCQDevice(*this, fmt::format("{} stream {}", name(), number)));
  });
  try {
    return make_cpu_stream(*this, *lane, options);
  } catch (...) {
    return_lane(lane);
    throw;
  }
}

// Note [Inline replay]
// A graph replayed and waited for on an idle device runs on the calling thread, as a direct call
// or a copyin on an idle device does: handing it to the workers and waiting costs two thread
// hand-offs (microseconds, tens of them when threads outnumber cores) for work that may take
// less. Its compute and copy lists run in turns, each until it reaches a wait whose value is not
// there yet; the graph's signal orders them, so one of the two can always go on. Should both wait
// on something else (a signal neither list sets), the rest goes to the workers as usual.
bool CpuHCQDevice::run_inline_if_idle(const CpuComputeQueue& compute, const CpuCopyQueue& copy, std::uint64_t before,
                                      std::unique_lock<std::recursive_mutex>& lock) {
  if (timeline_signal().slot().value.load(std::memory_order_acquire) < before) return false;
  // A worker stores the timeline value before it finishes its bookkeeping for that submission:
  // give it a moment (the adaptive spin) rather than hand this graph to it.
  if (!detail::adaptive_spin([&] { return compute_worker_.idle() && copy_worker_.idle(); })) return false;
  lock.unlock();
  const auto compute_words = compute.words(), copy_words = copy.words();
  std::size_t at_compute = 0, at_copy = 0;
  while (at_compute < compute_words->size() || at_copy < copy_words->size()) {
    const std::size_t before_compute = at_compute, before_copy = at_copy;
    at_compute = execute_commands(*compute_words, at_compute, name(), "COMPUTE", /*blocking=*/false);
    at_copy = execute_commands(*copy_words, at_copy, name(), "DMA", /*blocking=*/false);
    if (at_compute == before_compute && at_copy == before_copy) {
      // Both wait for a signal from elsewhere: the workers take the rest.
      try {
        if (at_copy < copy_words->size())
          copy_worker_.submit(std::make_shared<const std::vector<CpuCommand>>(copy_words->begin() + at_copy, copy_words->end()));
        at_copy = copy_words->size();
        if (at_compute < compute_words->size())
          compute_worker_.submit(
              std::make_shared<const std::vector<CpuCommand>>(compute_words->begin() + at_compute, compute_words->end()));
      } catch (const std::exception& e) {
        // Nothing may wait forever for signals this replay will now never set.
        const std::string reason =
            fmt::format("{}: handing the rest of a graph replay to the workers failed: {}", name(), e.what());
        poison_signals_from(*compute_words, at_compute, reason);
        poison_signals_from(*copy_words, at_copy, reason);
      }
      break;
    }
  }
  return true;
}

std::unique_ptr<Graph> CpuHCQDevice::create_graph(std::vector<GraphNode> nodes) {
  return std::make_unique<HCQGraph<CpuHCQDevice>>(*this, std::move(nodes));
}

DeviceCapabilities CpuHCQDevice::capabilities() const {
  return DeviceCapabilities{.compiles_source = true,
                            .rejects_invalid_source = true,
                            .caches_compiles = compiler().cache_key().has_value(),
                            .runs_kernels = true,
                            .checks_signatures = true,
                            .host_objects = dynamic_cast<const ObjectRuntime*>(&runtime()) != nullptr,
                            .native_graphs = true,
                            .host_visible_memory = true,
                            .hcq = true,
                            .streams = true};
}

std::map<std::string, std::string> CpuHCQDevice::properties() const {
  auto props = Compiled::properties();
  props.merge(host_properties());
  if (const auto* objects = dynamic_cast<const ObjectRuntime*>(&runtime())) props["loader"] = objects->describe();
  props["queues"] = fmt::format("HCQ: compute + copy worker threads, grids on {} threads",
                                CpuThreadPool::global().threads());
  return props;
}

std::string CpuHCQDevice::describe_stall() const {
  std::string compute = compute_worker_.describe_blocked(), copy = copy_worker_.describe_blocked();
  if (!compute.empty() && !copy.empty()) return compute + "; " + copy;
  return compute.empty() ? copy : compute;
}

void CpuHCQDevice::on_timeline_wrapped() {
  // The wrap happens with nothing in flight: every retired page is free again.
  cpu_allocator().reset_staging_timelines();
  kernargs_.timeline_wrapped();
}

}  // namespace tinydev::cpu
