// tinydev/hcq.hpp: the hardware-command-queue layer (layer 5), as templates over a backend.
//
// A backend defines its command word type and two queue classes deriving (CRTP) from
// HWComputeQueue / HWCopyQueue, supplying only the primitives (_signal, _wait, _timestamp,
// _memory_barrier, _exec, _copy, their _update_* twins and _submit). The templates record the
// seed's per-command metadata (offset, length, kind) so a recorded queue can be patched in place
// and submitted any number of times; no virtual call happens per command.
//
// Ownership: a queue owns its recorded commands. Submitting hands the device a reference-counted
// snapshot, so a queue may be patched or destroyed right after submit (copy-on-write: patching a
// queue whose snapshot is still queued copies it first).
// Thread safety: one queue object is used by one thread at a time. HCQCompiled's timeline is
// advanced under its submit mutex; HCQAllocator's copies take it themselves.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tinydev/config.hpp"
#include "tinydev/device.hpp"
#include "tinydev/error.hpp"
#include "tinydev/memory.hpp"
#include "tinydev/profile.hpp"
#include "tinydev/signal.hpp"

namespace tinydev {

enum class CommandKind : std::uint8_t { signal, wait, timestamp, memory_barrier, exec, copy };
constexpr std::string_view to_string(CommandKind kind) noexcept {
  constexpr std::string_view names[] = {"signal", "wait", "timestamp", "memory_barrier", "exec", "copy"};
  return names[static_cast<int>(kind)];
}

using Dim3 = std::array<std::uint32_t, 3>;

// A block of kernel arguments in memory the device reads when the kernel starts: 8-byte buffer
// addresses, then 4-byte values (the seed's fill_kernargs layout). Owned by whoever allocated it
// (a device's kernargs ring, a graph).
struct Kernargs {
  std::byte* ptr = nullptr;
  std::uint32_t num_buffers = 0;
  std::uint32_t num_values = 0;
  static constexpr std::size_t bytes_for(std::size_t buffers, std::size_t values) noexcept {
    return buffers * 8 + values * 4;
  }
  std::size_t size() const noexcept { return bytes_for(num_buffers, num_values); }
  void set_buffer(std::size_t i, std::uint64_t address) const noexcept { std::memcpy(ptr + i * 8, &address, 8); }
  void set_value(std::size_t i, std::int32_t value) const noexcept {
    std::memcpy(ptr + num_buffers * 8 + i * 4, &value, 4);
  }
  std::uint64_t buffer(std::size_t i) const noexcept {
    std::uint64_t a;
    std::memcpy(&a, ptr + i * 8, 8);
    return a;
  }
  std::int32_t value(std::size_t i) const noexcept {
    std::int32_t v;
    std::memcpy(&v, ptr + num_buffers * 8 + i * 4, 4);
    return v;
  }
};

// Checks the counts against the program's signature (when it declares one), then writes the
// arguments (the seed's HCQCompatProgram.fill_kernargs).
void fill_kernargs(const Program& program, const Kernargs& kernargs, std::span<const Allocation> buffers,
                   std::span<const std::int32_t> values);

// ---- queues ---------------------------------------------------------------------------------------

template <class Derived, class Command>
class HWCommandQueue {
 public:
  using command_type = Command;

  std::size_t size() const noexcept { return kinds_.size(); }  // number of commands (seed: len)
  CommandKind kind(std::size_t cmd) const { return kinds_.at(cmd); }

  Derived& signal(const Signal& signal, std::uint64_t value) {
    return record(CommandKind::signal, signal, [&] { self()._signal(signal, value); });
  }
  Derived& wait(const Signal& signal, std::uint64_t value) {
    return record(CommandKind::wait, signal, [&] { self()._wait(signal, value); });
  }
  Derived& timestamp(const Signal& signal) {
    return record(CommandKind::timestamp, signal, [&] { self()._timestamp(signal); });
  }

  Derived& update_signal(std::size_t cmd, std::optional<Signal> signal = {}, std::optional<std::uint64_t> value = {}) {
    check(cmd, CommandKind::signal, "update_signal");
    if (signal) note_pool(*signal);
    self()._update_signal(cmd, signal, value);
    return self();
  }
  Derived& update_wait(std::size_t cmd, std::optional<Signal> signal = {}, std::optional<std::uint64_t> value = {}) {
    check(cmd, CommandKind::wait, "update_wait");
    if (signal) note_pool(*signal);
    self()._update_wait(cmd, signal, value);
    return self();
  }

  // Hands a snapshot of the commands to `device`. Throws InvalidArgument (nothing queued) when the
  // device is of another kind or cannot reach a signal the queue uses.
  template <class Device>
  Derived& submit(Device& device) {
    self()._submit(device);
    return self();
  }

  // The signal pools this queue's commands reference (devices check they can reach them).
  const std::vector<const SignalPool*>& pools() const noexcept { return pools_; }

 protected:
  HWCommandQueue() : q_(std::make_shared<std::vector<Command>>()) {}

  Derived& self() noexcept { return static_cast<Derived&>(*this); }

  // Records one command: `emit` appends its words; if it throws, nothing stays recorded.
  template <class Emit>
  Derived& record(CommandKind kind, Emit&& emit) {
    std::vector<Command>& q = mutable_commands();
    const std::size_t before = q.size();
    try {
      emit();
    } catch (...) {
      mutable_commands().resize(before);
      throw;
    }
    offsets_.push_back(static_cast<std::uint32_t>(before));
    lens_.push_back(static_cast<std::uint32_t>(mutable_commands().size() - before));
    kinds_.push_back(kind);
    return self();
  }
  template <class Emit>
  Derived& record(CommandKind kind, const Signal& signal, Emit&& emit) {
    signal.slot();  // throws for a freed or empty handle, before anything is recorded
    note_pool(signal);
    return record(kind, std::forward<Emit>(emit));
  }

  void check(std::size_t cmd, CommandKind want, std::string_view what) const {
    if (cmd >= kinds_.size())
      throw InvalidArgument(fmt::format("{}: command index {} is out of range: the queue has {} commands",
                                        what, cmd, kinds_.size()));
    if (kinds_[cmd] != want)
      throw InvalidArgument(fmt::format("called {} not on a {} command: command {} is a {}", what,
                                        to_string(want), cmd, to_string(kinds_[cmd])));
  }

  // The words of command `cmd`, writable (copied first if a submitted snapshot shares them).
  Command* command_words(std::size_t cmd) { return mutable_commands().data() + offsets_[cmd]; }
  std::vector<Command>& mutable_commands() {
    if (q_.use_count() > 1) q_ = std::make_shared<std::vector<Command>>(*q_);
    else std::atomic_thread_fence(std::memory_order_acquire);  // the worker's release of its snapshot
    return *q_;                                                   // happens before our writes
  }
  std::shared_ptr<const std::vector<Command>> snapshot() const { return q_; }

  void note_pool(const Signal& signal) {
    if (std::find(pools_.begin(), pools_.end(), signal.pool()) == pools_.end()) pools_.push_back(signal.pool());
  }

 private:
  std::shared_ptr<std::vector<Command>> q_;
  std::vector<std::uint32_t> offsets_, lens_;
  std::vector<CommandKind> kinds_;
  std::vector<const SignalPool*> pools_;
};

template <class Derived, class Command, class ProgramT>
class HWComputeQueue : public HWCommandQueue<Derived, Command> {
  using Base = HWCommandQueue<Derived, Command>;

 public:
  using program_type = ProgramT;

  Derived& memory_barrier() {
    return this->record(CommandKind::memory_barrier, [&] { this->self()._memory_barrier(); });
  }
  // Launches `program` reading its arguments from `kernargs` when it starts.
  Derived& exec(const ProgramT& program, const Kernargs& kernargs, Dim3 global_size, Dim3 local_size) {
    return this->record(CommandKind::exec, [&] { this->self()._exec(program, kernargs, global_size, local_size); });
  }
  Derived& update_exec(std::size_t cmd, Dim3 global_size, Dim3 local_size) {
    this->check(cmd, CommandKind::exec, "update_exec");
    this->self()._update_exec(cmd, global_size, local_size);
    return this->self();
  }

 protected:
  void _memory_barrier() {}
};

template <class Derived, class Command>
class HWCopyQueue : public HWCommandQueue<Derived, Command> {
 public:
  // Copies `size` bytes; InvalidArgument (nothing recorded) if it runs past either allocation.
  Derived& copy(const Allocation& dest, const Allocation& src, std::size_t size) {
    check_copy(dest, src, size);
    return this->record(CommandKind::copy, [&] { this->self()._copy(dest, src, size); });
  }
  Derived& update_copy(std::size_t cmd, std::optional<Allocation> dest = {}, std::optional<Allocation> src = {}) {
    this->check(cmd, CommandKind::copy, "update_copy");
    this->self()._update_copy(cmd, dest, src);
    return this->self();
  }

  // InvalidArgument when a copy of `size` bytes runs past either allocation.
  static void check_copy(const Allocation& dest, const Allocation& src, std::size_t size) {
    if (size > dest.size || size > src.size)
      throw InvalidArgument(fmt::format("copy of {} bytes runs past the end of the {} ({} bytes)", size,
                                        size > dest.size ? "destination" : "source",
                                        size > dest.size ? dest.size : src.size));
  }
};

// ---- the device -----------------------------------------------------------------------------------

// One span of device work to put in the trace: timestamps taken by the queue into two signals.
struct ProfileRecord {
  Signal start, end;
  std::string name;
  bool is_copy;
};

template <class ComputeQueue, class CopyQueue>
class HCQCompiled : public Compiled {
 public:
  using compute_queue_type = ComputeQueue;
  using copy_queue_type = CopyQueue;

  // Note [Timeline wrap]
  // The timeline value only grows; once it passes 2^31 the next synchronize (when no work is in
  // flight) swaps in the shadow signal reset to 0 and restarts at 1, as the seed's
  // _wrap_timeline_signal. Staging slots tagged with old values are reset with it.
  static constexpr std::uint64_t kTimelineWrap = 1ull << 31;

  HCQCompiled(std::string name, std::shared_ptr<Allocator> allocator, std::unique_ptr<Compiler> compiler,
              std::unique_ptr<Runtime> runtime, SourceLanguage language, std::shared_ptr<SignalPool> pool)
      : Compiled(std::move(name), std::move(allocator), std::move(compiler), std::move(runtime), language),
        pool_(std::move(pool)),
        timeline_signal_(pool_->alloc(0)),
        shadow_timeline_signal_(pool_->alloc(0)),
        timeline_slot_(&timeline_signal_.slot()) {}

  ComputeQueue compute_queue() const { return ComputeQueue(); }  // the seed's hw_compute_queue_t()
  CopyQueue copy_queue() const { return CopyQueue(); }

  // The timeline signal handle (changes when the timeline wraps; read it under submit_mutex()).
  const Signal& timeline_signal() const noexcept { return timeline_signal_; }
  // The next value to signal on the timeline; value - 1 is the last one submitted.
  std::uint64_t timeline_value() const noexcept { return timeline_value_.load(std::memory_order_acquire); }
  // Takes the next timeline value (caller holds submit_mutex()).
  std::uint64_t next_timeline_value() noexcept { return timeline_value_.fetch_add(1, std::memory_order_acq_rel); }
  std::recursive_mutex& submit_mutex() const noexcept { return submit_mutex_; }
  SignalPool& signal_pool() const noexcept { return *pool_; }

  // Whether this device's queues can wait on and write signals of `pool`.
  virtual bool can_reach(const SignalPool& pool) const noexcept { return &pool == pool_.get(); }

  // A timeline position: reached once `slot` holds at least `value`.
  struct TimelineMark {
    const SignalSlot* slot;
    std::uint64_t value;
    bool reached() const noexcept { return slot->value.load(std::memory_order_acquire) >= value; }
  };
  // Where every device whose queues may use this device's signals stands now (the last value
  // submitted on each timeline). A freed signal's slot is reused only once all are reached. Devices
  // sharing a signal pool with others override this to list them all.
  virtual std::vector<TimelineMark> signal_users_now() const {
    return {TimelineMark{timeline_slot_.load(std::memory_order_acquire), timeline_value() - 1}};
  }

  Signal alloc_signal(std::uint64_t value = 0) {
    reclaim_signals();
    return pool_->alloc(value);
  }
  // Note [Deferred signal free]
  // Work already submitted may still touch the signal, on this device or on any other device
  // whose queues reach the same pool, so its slot is only reused once every one of those timelines
  // has passed what was submitted before the free (signal_users_now). The handle dies at once.
  void free_signal(const Signal& signal) {
    std::lock_guard lock(submit_mutex_);
    if (signal.pool() != pool_.get())
      throw InvalidArgument(fmt::format("{}: cannot free {}: it was allocated elsewhere", name(), signal.describe()));
    const std::uint32_t index = pool_->retire(signal);  // the handle is dead now; a second free throws
    pending_frees_.emplace_back(index, signal_users_now());
    reclaim_signals();
  }

  void synchronize() override {
    std::lock_guard lock(submit_mutex_);
    wait_timeline(timeline_value() - 1);
    if (timeline_value() > kTimelineWrap) wrap_timeline();
    reclaim_signals();
    process_profile_records();
  }

  // Blocks until the timeline reached `value`. Timeout names the device.
  // Safe without the submit mutex (the current timeline slot is published atomically).
  // A wrap in the meantime (Note [Timeline wrap]) means everything before it finished: done too.
  void wait_timeline(std::uint64_t value, std::chrono::milliseconds timeout = std::chrono::seconds(30)) const {
    const std::uint64_t wraps = wraps_.load(std::memory_order_acquire);
    SignalSlot* slot = timeline_slot_.load(std::memory_order_acquire);
    if (slot->value.load(std::memory_order_acquire) >= value) return;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      try {
        wait_signal_slot(*slot, value, std::chrono::milliseconds(50), nullptr);
        return;
      } catch (const Timeout& e) {
        if (wraps_.load(std::memory_order_acquire) != wraps) return;
        if (std::chrono::steady_clock::now() >= deadline)
          throw Timeout(fmt::format("{}: waiting for timeline value {} timed out after {} ms: it is at {}", name(),
                                    value, timeout.count(), slot->value.load()));
      }
    }
  }
  // Whether everything submitted so far has finished. Lock-free.
  bool idle() const noexcept {
    return timeline_slot_.load(std::memory_order_acquire)->value.load(std::memory_order_acquire) + 1 >= timeline_value();
  }

  void wrap_timeline() {
    std::lock_guard lock(submit_mutex_);
    wait_timeline(timeline_value() - 1);
    std::swap(timeline_signal_, shadow_timeline_signal_);
    timeline_signal_.set(0);
    timeline_value_.store(1, std::memory_order_release);
    timeline_slot_.store(&timeline_signal_.slot(), std::memory_order_release);
    // Pending frees keep marks on the old slot, which holds its final value until the next wrap.
    wraps_.fetch_add(1, std::memory_order_release);
    on_timeline_wrapped();
  }

  // For tests of the wrap: jumps the timeline to `value` (the device must be idle).
  void set_timeline_for_testing(std::uint64_t value) {
    std::lock_guard lock(submit_mutex_);
    wait_timeline(timeline_value() - 1);
    timeline_signal_.set(value - 1);
    timeline_value_.store(value, std::memory_order_release);
    on_timeline_wrapped();
  }

  // Profiling (TINYDEV_PROFILE): timestamps of device work, turned into trace events on
  // synchronize. Devices convert their clock with device_to_cpu_ns.
  bool profiling() const { return Profiler::global().enabled(); }
  void add_profile_record(ProfileRecord record) {
    std::lock_guard lock(submit_mutex_);
    profile_records_.push_back(std::move(record));
  }
  void process_profile_records() {
    std::lock_guard lock(submit_mutex_);
    for (ProfileRecord& r : profile_records_) {
      Profiler::global().add(ProfileEvent{r.name, device_to_cpu_ns(r.start.timestamp(), r.is_copy),
                                          device_to_cpu_ns(r.end.timestamp(), r.is_copy), name(),
                                          r.is_copy ? "DMA" : "COMPUTE"});
      pool_->free(r.start);
      pool_->free(r.end);
    }
    profile_records_.clear();
  }
  virtual std::uint64_t device_to_cpu_ns(std::uint64_t device_ns, bool is_copy) const = 0;

  bool supports_graph() const noexcept override { return true; }

 protected:
  // Hook for the allocator's staging timelines (reset to 0 on wrap).
  virtual void on_timeline_wrapped() {}

  void reclaim_signals() {
    std::lock_guard lock(submit_mutex_);
    auto ready = std::stable_partition(pending_frees_.begin(), pending_frees_.end(), [](const auto& entry) {
      return !std::all_of(entry.second.begin(), entry.second.end(), [](const TimelineMark& m) { return m.reached(); });
    });
    for (auto it = ready; it != pending_frees_.end(); ++it) pool_->recycle(it->first);
    pending_frees_.erase(ready, pending_frees_.end());
  }

 private:
  mutable std::recursive_mutex submit_mutex_;
  std::shared_ptr<SignalPool> pool_;
  Signal timeline_signal_, shadow_timeline_signal_;
  std::atomic<SignalSlot*> timeline_slot_;
  std::atomic<std::uint64_t> timeline_value_{1};
  std::vector<std::pair<std::uint32_t, std::vector<TimelineMark>>> pending_frees_;  // (slot index, marks)
  std::atomic<std::uint64_t> wraps_{0};
  std::vector<ProfileRecord> profile_records_;
};

// The seed's hcq_profile: when profiling, brackets work with two timestamp commands (in `queue`
// when given, else in queues of their own) and records the span under `name`.
template <class Device, class Queue>
class HCQProfileScope {
 public:
  HCQProfileScope(Device& device, std::string name, bool is_copy, Queue* queue = nullptr)
      : device_(device), name_(std::move(name)), is_copy_(is_copy), queue_(queue), enabled_(device.profiling()),
        exceptions_(std::uncaught_exceptions()) {
    if (!enabled_) return;
    start_ = device.alloc_signal();
    end_ = device.alloc_signal();
    if (queue_) queue_->timestamp(start_);
    else submit_timestamp(start_);
  }
  ~HCQProfileScope() noexcept(false) {
    if (!enabled_) return;
    if (std::uncaught_exceptions() > exceptions_) {
      // Unwinding an error: the bracketed work may not have been queued. Record nothing.
      device_.free_signal(start_);
      device_.free_signal(end_);
      return;
    }
    if (queue_) queue_->timestamp(end_);
    else submit_timestamp(end_);
    device_.add_profile_record(ProfileRecord{start_, end_, std::move(name_), is_copy_});
  }
  HCQProfileScope(const HCQProfileScope&) = delete;
  HCQProfileScope& operator=(const HCQProfileScope&) = delete;

 private:
  // A queue of its own that takes a timeline value, so synchronize() also waits for the timestamp
  // (the records are read, and their signals freed, after a synchronize).
  void submit_timestamp(const Signal& signal) {
    std::lock_guard lock(device_.submit_mutex());
    const std::uint64_t value = device_.next_timeline_value();
    Queue().wait(device_.timeline_signal(), value - 1).timestamp(signal).signal(device_.timeline_signal(), value).submit(device_);
  }

  Device& device_;
  std::string name_;
  bool is_copy_;
  Queue* queue_;
  bool enabled_;
  int exceptions_;
  Signal start_, end_;
};

// ---- the allocator --------------------------------------------------------------------------------

// The seed's HCQCompatAllocator over a device `Device` (an HCQCompiled). The backend supplies
// alloc_impl/free_impl (device memory, and host memory for options.host) and `host_copy`, which
// copies between host pointers and host-visible device memory.
//
// Note [Staging ring]
// copyin goes through a ring of `batch_count` host buffers of `batch_size` bytes: each chunk is
// copied into the next slot on the caller's thread, then a copy queue moves it to the device and
// signals the timeline; the slot is tagged with that timeline value and reused only once the
// timeline has passed it (never by a device-wide synchronize), so copyin returns as soon as the
// caller's memory has been read. Where device memory is host-visible and the device is idle,
// copyin and copyout copy directly (nothing is in flight to order against).
template <class Device>
class HCQAllocator : public LRUAllocator {
 public:
  static constexpr std::size_t kDefaultBatchSize = 2u << 20;
  static constexpr std::size_t kDefaultBatchCount = 32;

  HCQAllocator(Device& device, std::size_t batch_size = kDefaultBatchSize,
               std::size_t batch_count = kDefaultBatchCount, bool host_visible = false)
      : device_(device), batch_size_(batch_size), batch_count_(batch_count), host_visible_(host_visible) {
    if (batch_size == 0 || batch_count == 0)
      throw InvalidArgument("an HCQ allocator's staging ring needs at least one slot of at least one byte");
  }

  // Forces every copyin/copyout through the staging ring (tests, benchmarks of the ring).
  void set_force_staging(bool force) noexcept { force_staging_ = force; }
  // Changes the ring's shape: waits for the device to finish what uses the old ring, frees it;
  // the new one is made at the next staged copy.
  void set_staging_shape(std::size_t batch_size, std::size_t batch_count) {
    if (batch_size == 0 || batch_count == 0)
      throw InvalidArgument("an HCQ allocator's staging ring needs at least one slot of at least one byte");
    std::lock_guard lock(device_.submit_mutex());
    device_.synchronize();
    release_ring();
    batch_size_ = batch_size;
    batch_count_ = batch_count;
    next_ = 0;
  }
  std::size_t staging_batch_size() const noexcept { return batch_size_; }
  std::size_t staging_batch_count() const noexcept { return batch_count_; }

  void copyin(Allocation dest, std::span<const std::byte> src) override {
    detail::check_fits(src.size(), dest, "copyin", describe());
    std::lock_guard lock(device_.submit_mutex());
    if (host_visible_ && !force_staging_ && device_.idle()) {
      direct_copy(dest.host_ptr<std::byte>(), src.data(), src.size(), "CPU", device_.name());
      return;
    }
    ensure_ring();
    HCQProfileScope<Device, typename Device::copy_queue_type> prof(device_, fmt::format("CPU -> {}", device_.name()), true);
    for (std::size_t i = 0; i < src.size(); i += batch_size_) {
      const std::size_t n = std::min(batch_size_, src.size() - i);
      next_ = (next_ + 1) % ring_.size();
      device_.timeline_signal().wait(ring_timeline_[next_]);
      host_copy(ring_[next_].template host_ptr<std::byte>(), src.data() + i, n);
      const std::uint64_t value = device_.next_timeline_value();
      device_.copy_queue()
          .wait(device_.timeline_signal(), value - 1)
          .copy(Allocation{dest.va_addr + i, n, dest.backend}, ring_[next_], n)
          .signal(device_.timeline_signal(), value)
          .submit(device_);
      ring_timeline_[next_] = value;
    }
  }

  void copyout(std::span<std::byte> dest, Allocation src) override {
    detail::check_fits(dest.size(), src, "copyout", describe());
    std::lock_guard lock(device_.submit_mutex());
    device_.synchronize();
    if (host_visible_ && !force_staging_) {
      direct_copy(dest.data(), src.host_ptr<std::byte>(), dest.size(), device_.name(), "CPU");
      return;
    }
    ensure_ring();
    HCQProfileScope<Device, typename Device::copy_queue_type> prof(device_, fmt::format("{} -> CPU", device_.name()), true);
    for (std::size_t i = 0; i < dest.size(); i += batch_size_) {
      const std::size_t n = std::min(batch_size_, dest.size() - i);
      const std::uint64_t value = device_.next_timeline_value();
      device_.copy_queue()
          .wait(device_.timeline_signal(), value - 1)
          .copy(ring_[0], Allocation{src.va_addr + i, n, src.backend}, n)
          .signal(device_.timeline_signal(), value)
          .submit(device_);
      device_.timeline_signal().wait(value);
      host_copy(dest.data() + i, ring_[0].template host_ptr<std::byte>(), n);
    }
  }

  // Copies `size` bytes from `src` on src_device to `dest` on dest_device, ordered after the work
  // already submitted to both, on src_device's copy queue (the seed's transfer).
  static void transfer(Allocation dest, Allocation src, std::size_t size, Device& src_device, Device& dest_device) {
    // Checked before a timeline value is taken: a value taken and never signalled hangs the device.
    Device::copy_queue_type::check_copy(dest, src, size);
    std::scoped_lock lock(src_device.submit_mutex(), dest_device.submit_mutex());
    using Queue = typename Device::copy_queue_type;
    Queue q;
    const bool same = &src_device == &dest_device;
    const std::uint64_t dest_done = dest_device.timeline_value() - 1;  // read before taking a value
    const std::uint64_t value = src_device.next_timeline_value();
    {
      HCQProfileScope<Device, Queue> prof(src_device, fmt::format("{} -> {}", src_device.name(), dest_device.name()),
                                          true, &q);
      q.wait(src_device.timeline_signal(), value - 1);
      if (!same) q.wait(dest_device.timeline_signal(), dest_done);
      q.copy(dest, src, size);
    }
    q.signal(src_device.timeline_signal(), value).submit(src_device);
    if (!same) {
      const std::uint64_t value = dest_device.next_timeline_value();
      dest_device.compute_queue()
          .wait(src_device.timeline_signal(), src_device.timeline_value() - 1)
          .wait(dest_device.timeline_signal(), value - 1)
          .signal(dest_device.timeline_signal(), value)
          .submit(dest_device);
    }
  }

  bool supports_offset() const noexcept override { return true; }
  Allocation offset(Allocation base, std::size_t size, std::size_t offset) override {
    return detail::sub_allocation(base, size, offset, describe());
  }
  std::optional<std::span<std::byte>> as_buffer(Allocation allocation) override {
    if (!host_visible_) return std::nullopt;
    device_.synchronize();  // zero-copy readers must see finished work
    return std::span<std::byte>(allocation.host_ptr<std::byte>(), allocation.size);
  }

  // Called by the device when its timeline wraps (Note [Timeline wrap]).
  void reset_staging_timelines() {
    std::fill(ring_timeline_.begin(), ring_timeline_.end(), 0);
  }

 protected:
  // Copies between host pointers / host-visible memory.
  virtual void host_copy(std::byte* dest, const std::byte* src, std::size_t size) { std::memcpy(dest, src, size); }
  // Backends call this in free_impl before memory really goes: a staged copy or a queued kernel
  // submitted earlier may still write it (the seed's allocators synchronize in _free likewise).
  void wait_before_free() const {
    if (device_alive_ && !device_.idle()) device_.wait_timeline(device_.timeline_value() - 1);
  }

 public:
  // A device being destroyed (only a failed open does that) calls this first: frees from then
  // on do not look at its timeline.
  void detach_device() noexcept { device_alive_ = false; }

 protected:
  // Derived destructors must call this before their own memory goes (see LRUAllocator).
  void release_ring() {
    for (Allocation& b : ring_) free_impl(b, batch_size_, BufferOptions{.host = true});
    ring_.clear();
    ring_timeline_.clear();
  }
  Device& device_;

 private:
  // A copy on the caller's thread (host-visible memory, nothing in flight), traced like a queue's.
  void direct_copy(std::byte* dest, const std::byte* src, std::size_t size, std::string_view from, std::string_view to) {
    const std::uint64_t start = device_.profiling() ? Profiler::now_ns() : 0;
    host_copy(dest, src, size);
    if (start) Profiler::global().add({fmt::format("{} -> {}", from, to), start, Profiler::now_ns(), device_.name(), "DMA"});
  }
  void ensure_ring() {
    if (!ring_.empty()) return;
    std::vector<Allocation> ring;
    try {
      for (std::size_t i = 0; i < batch_count_; ++i) ring.push_back(alloc_impl(batch_size_, BufferOptions{.host = true}));
    } catch (...) {
      for (Allocation& b : ring) free_impl(b, batch_size_, BufferOptions{.host = true});
      throw;
    }
    ring_timeline_.assign(batch_count_, 0);
    ring_ = std::move(ring);
  }

  std::size_t batch_size_, batch_count_;
  bool host_visible_;
  bool device_alive_ = true;
  bool force_staging_ = false;
  std::vector<Allocation> ring_;
  std::vector<std::uint64_t> ring_timeline_;
  std::size_t next_ = 0;
};

}  // namespace tinydev
