// tinydev/hcq_device.hpp: HCQCompiled, the device of an HCQ backend (layer 5): its timeline
// signal, signal allocation with deferred reuse, profiling scopes, and the checks that its queues
// and programs satisfy the HCQ contract (tinydev/hcq_concepts.hpp).
//
// Thread safety: HCQCompiled's timeline is advanced under its submit mutex; every member may be
// called from any thread.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tinydev/config.hpp"
#include "tinydev/counters.hpp"
#include "tinydev/device.hpp"
#include "tinydev/hcq_concepts.hpp"
#include "tinydev/hcq_queue.hpp"
#include "tinydev/profile.hpp"
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

namespace detail {
// Note [Devices and fork]
// Devices know the process that opened them: a pthread_atfork child handler (registered by the
// first device) bumps a process-wide fork generation, and every entry point of an HCQ device
// compares it with the generation it was opened in (one relaxed load). In a forked child a device
// opened before the fork has no queue threads (fork copies only the calling thread) and possibly
// a half-copied state (a mutex some other thread held), so every use is a ForkedDevice error, as
// PyTorch's "Cannot re-initialize CUDA in forked subprocess"; the child opens devices of its own
// under new names ("LLVM:1"), or execs. The parent is untouched.
std::uint64_t watch_forks();  // registers the handler once; returns the current generation
std::uint64_t fork_generation() noexcept;
[[noreturn]] void throw_forked_device(const std::string& device);
}  // namespace detail

// ---- the device -----------------------------------------------------------------------------------

// One span of device work to put in the trace: timestamps taken by the queue into two signals.
struct ProfileRecord {
  Signal start, end;
  std::string name;
  bool is_copy;
  std::uint64_t request = 0;  // Profiler::current_request() where the work was issued
};

template <class ComputeQueue, class CopyQueue>
class HCQCompiled : public Compiled {
 public:
  using compute_queue_type = ComputeQueue;
  using copy_queue_type = CopyQueue;

  // Note [Timeline wrap]
  // The timeline value only grows; once it passes 2^31 the next synchronize (when no work is in
  // flight) swaps in the shadow signal reset to 0 and restarts at 1, as the seed's
  // _wrap_timeline_signal. Staging slots tagged with old values are reset with it. A value taken
  // before a wrap names finished work (the wrap waited for it) but is larger than any the new
  // timeline has handed out: a wait for a value past timeline_value() on a timeline that wrapped
  // is for such a value and returns at once, as the allocator's free marks are read
  // (HCQAllocator::queued_work_done). Without this, a graph replay's own wait, or a caller's, for a
  // value taken just before another thread's synchronize wrapped the timeline would wait for the
  // new timeline to count up to it: TINYDEV_WAIT_TIMEOUT_MS and a Timeout for work long finished. The wrap count and
  // the list of dropped values change together, under one lock, so a wait that a wrap overtook
  // does not check its value against the new timeline's dropped ones. (A value from early in an
  // old timeline, no larger than the new timeline_value(), and first waited on after a wrap, is
  // still taken for the new timeline's: held for some 2^31 submissions, a value says no more.)
  static constexpr std::uint64_t kTimelineWrap = 1ull << 31;

  HCQCompiled(std::string name, std::shared_ptr<Allocator> allocator, std::shared_ptr<Compiler> compiler,
              std::shared_ptr<Runtime> runtime, SourceLanguage language, std::shared_ptr<SignalPool> pool)
      : Compiled(std::move(name), std::move(allocator), std::move(compiler), std::move(runtime), language),
        pool_(std::move(pool)),
        timeline_signal_(pool_->alloc(0)),
        shadow_timeline_signal_(pool_->alloc(0)),
        timeline_slot_(&timeline_signal_.slot()),
        fork_generation_(detail::watch_forks()) {
    static_assert(HCQComputeQueue<ComputeQueue>,
                  "the compute queue lacks a primitive of the HCQ contract: see the unsatisfied requirement "
                  "below and tinydev/hcq_concepts.hpp");
    static_assert(HCQCopyQueue<CopyQueue>,
                  "the copy queue lacks a primitive of the HCQ contract: see the unsatisfied requirement below "
                  "and tinydev/hcq_concepts.hpp");
    static_assert(HCQProgram<typename ComputeQueue::program_type>,
                  "the compute queue's program_type must derive from Program and have device(): see "
                  "tinydev/hcq_concepts.hpp");
  }
  // Only a failed open destroys a device (devices live as long as the process), and then
  // on_opened never ran: no hook points at it.
  ~HCQCompiled() override {
    if (profile_hook_) Profiler::global().remove_flush(profile_hook_);
    allocator().detach_device();  // frees from now on do not look at this device's timeline
  }

  // A profile written at exit (or by Profiler::write) must include the device's finished work.
  // Registered once the device is whole (Compiled::on_opened): a flush never meets a device
  // under construction or destruction.
  void on_opened() override {
    Compiled::on_opened();
    profile_hook_ = Profiler::global().on_flush([this](bool finish) {
      // Profiler::write() takes what is done and waits for nothing; the exit writer finishes the
      // device's work first so that the file has all of it.
      if (!finish) return process_profile_records(/*finished_only=*/true);
      try {
        synchronize();
      } catch (const std::exception& e) {
        debug_log(1, this->name(), TINYDEV_FMT("could not finish work for the profile: {}"), e.what());
      }
    });
  }

  ComputeQueue compute_queue() const { return ComputeQueue(); }  // the seed's hw_compute_queue_t()
  CopyQueue copy_queue() const { return CopyQueue(); }

  // The current timeline slot (lock-free; it changes when the timeline wraps or recovers).
  const SignalSlot* timeline_slot() const noexcept { return timeline_slot_.load(std::memory_order_acquire); }
  // The timeline signal handle (changes when the timeline wraps or the device recovers; read it
  // under submit_mutex()).
  const Signal& timeline_signal() const noexcept { return timeline_signal_; }
  // Note [Recorded events]
  // Compiled::record: complete at once when the default queue's work (lazy work included) has
  // finished; otherwise one more submission, after that work, writes the next value of a signal
  // of the device's own that only grows. Not an Event on the timeline: a server records once
  // after loading its weights and has streams wait on it for hours, while the timeline wraps
  // (Note [Timeline wrap]) and its old slot is reset two wraps later, which would make a finished
  // Event read as unfinished. Work before it that fails poisons that signal (a queue stops at a
  // failed wait and poisons what it would signal), so the Event reports the failure; after
  // recover() the next record takes a fresh signal, the failed one staying for its Events.
  Event record() override {
    check_usable();
    check_no_reservation_held("record()");
    std::lock_guard lock(submit_mutex_);
    signal_lazy_work_now();     // so that idle() says whether everything submitted finished
    if (idle()) return Event();
    if (!record_signal_.valid() || record_signal_.slot().poisoned.load(std::memory_order_acquire)) {
      record_signal_ = pool_->alloc(0);  // a failed one is kept (never freed): its Events stay failed
      records_ = 0;
    }
    auto reservation = reserve_timeline_value();
    const std::uint64_t mark = records_ + 1;
    compute_queue()
        .wait(timeline_signal_, reservation.value() - 1)
        .signal(record_signal_, mark)
        .signal(timeline_signal_, reservation.value())
        .submit(*this);
    reservation.submitted();
    records_ = mark;
    return Event(record_signal_, mark, &name());
  }
  // The next value to signal on the timeline; value - 1 is the last one submitted.
  std::uint64_t timeline_value() const noexcept { return timeline_value_.load(std::memory_order_acquire); }
  // Takes the next timeline value (caller holds submit_mutex()). Lazy work is signalled first
  // (Note [Lazy timeline signals]), so work ordered after the value is ordered after it too.
  std::uint64_t next_timeline_value() {
    check_usable();
    if (lazy_work_.load(std::memory_order_relaxed)) [[unlikely]]
      signal_lazy_work_now();
    // Writers hold submit_mutex(), so a load and a store do (no locked read-modify-write on the
    // path of every submission); lock-free readers see the value released.
    const std::uint64_t value = timeline_value_.load(std::memory_order_relaxed);
    timeline_value_.store(value + 1, std::memory_order_release);
    return value;
  }
  // The last timeline value submitted, covering lazy work too (it is signalled first). Wait for
  // this, not timeline_value() - 1, to wait for everything submitted so far.
  std::uint64_t last_submitted_value() {
    signal_lazy_work_now();
    return timeline_value() - 1;
  }

  // Note [Lazy timeline signals]
  // A device may run some work without taking a timeline value (CUDA's direct kernel calls, which
  // its stream's order already places after earlier compute work) and mark it with
  // note_lazy_work(). Whoever next takes a timeline value, synchronizes, or asks for
  // last_submitted_value() first makes the device signal one value covering that work
  // (signal_lazy_work), so the timeline still means "everything before this value finished".
  // Until then idle() is false. This saves a timeline write per direct call.
  void signal_lazy_work_now() {
    std::lock_guard lock(submit_mutex_);
    if (!lazy_work_.load(std::memory_order_relaxed)) return;
    // The value is taken before the flag goes, so idle() (read without the mutex) never sees
    // the lazy work gone while the timeline does not yet count the value covering it.
    const std::uint64_t value = timeline_value_.fetch_add(1, std::memory_order_acq_rel);
    lazy_work_.store(false, std::memory_order_release);
    try {
      signal_lazy_work(value);
    } catch (...) {
      abandon_timeline_value(value);  // taken but not signalled: completed empty, or the timeline poisoned
      throw;
    }
  }
  std::recursive_mutex& submit_mutex() const noexcept { return submit_mutex_; }

  // Note [Timeline reservations]
  // The pattern for submitting work of one's own (docs/hcq.md): take the next timeline value,
  // record a queue that waits for value - 1 and signals value, submit it, then say so:
  //
  //   auto r = device.reserve_timeline_value();   // holds submit_mutex() until it is dropped
  //   device.compute_queue().wait(device.timeline_signal(), r.value() - 1)
  //         .exec(...).signal(device.timeline_signal(), r.value()).submit(device);
  //   r.submitted();
  //
  // A reservation dropped before submitted() (recording or submitting threw) completes its value
  // in order with an empty queue, so the device goes on; a host wait for exactly that value
  // (wait_timeline) throws an Error saying the value was abandoned, as nothing ran for it.
  // While the thread holds it, what would wait for the reserved value or queue work behind it
  // (synchronize, record, the allocator's copies, graph replays, direct kernel calls) is
  // InvalidArgument on that thread (check_no_reservation_held): the work after it would wait for
  // a value only this thread can submit, a host wait for TINYDEV_WAIT_TIMEOUT_MS and then Timeout, a queue for good
  // (the in-order worker holds the reserved work's queue behind it). Other threads wait for the
  // submit mutex as usual.
  class TimelineReservation {
   public:
    explicit TimelineReservation(HCQCompiled& device) : device_(&device), lock_(device.submit_mutex()) {
      value_ = device.next_timeline_value();
      device.reservation_opened(value_);
    }
    TimelineReservation(TimelineReservation&& other) noexcept
        : device_(other.device_), lock_(std::move(other.lock_)), value_(other.value_), done_(other.done_) {
      other.done_ = true;
    }
    TimelineReservation& operator=(TimelineReservation&&) = delete;
    ~TimelineReservation() {
      if (done_) return;
      device_->reservation_closed();
      device_->abandon_timeline_value(value_);
    }
    std::uint64_t value() const noexcept { return value_; }
    // The work signalling value() was submitted: the reservation is spent, the lock released.
    void submitted() noexcept {
      if (done_) return;
      done_ = true;
      device_->reservation_closed();
      if (lock_.owns_lock()) lock_.unlock();
    }

   private:
    HCQCompiled* device_;
    std::unique_lock<std::recursive_mutex> lock_;
    std::uint64_t value_ = 0;
    bool done_ = false;
  };
  TimelineReservation reserve_timeline_value() { return TimelineReservation(*this); }

  // Completes a taken timeline value whose work never got submitted (Note [Timeline reservations]).
  void abandon_timeline_value(std::uint64_t value) noexcept {
    std::lock_guard lock(submit_mutex_);
    try {
      compute_queue().wait(timeline_signal_, value - 1).signal(timeline_signal_, value).submit(*this);
      std::lock_guard abandoned_lock(abandoned_mutex_);
      if (abandoned_.size() >= 64) abandoned_.erase(abandoned_.begin());
      abandoned_.push_back(value);
      has_abandoned_.store(true, std::memory_order_release);
      debug_log(1, name(), TINYDEV_FMT("timeline value {} was reserved and dropped without its work: completed empty"), value);
    } catch (const std::exception& e) {
      // Not even an empty queue went in: make the hole loud rather than a hang.
      poison_own_timeline(fmt::format(TINYDEV_FMT("{}: timeline value {} was reserved and dropped, and completing it "
                                      "failed: {}"), name(), value, e.what()));
    }
  }

  // Faults the device with `reason`, as a failed queue would (fault(), and DeviceFault from every
  // entry point until recover(), which first waits for the queues to drain): for work that went
  // in part-way and can only fail, such as a graph replay whose second queue could not be
  // submitted after its first was. The first reason stays.
  void fault_device(std::string_view reason) const noexcept { poison_own_timeline(reason); }

  // Whether this process opened the device (false in a forked child: Note [Devices and fork]).
  bool opened_in_this_process() const noexcept { return detail::fork_generation() == fork_generation_; }
  // Throws ForkedDevice in a forked child (Note [Devices and fork]) and DeviceFault once the
  // device's queue failed (fault()). Lock-free; every entry point that queues or copies calls it.
  void check_usable() const {
    check_not_forked();
    if (timeline_slot_.load(std::memory_order_relaxed)->poisoned.load(std::memory_order_acquire)) [[unlikely]]
      throw_fault();
  }
  void check_not_forked() const {
    if (detail::fork_generation() != fork_generation_) [[unlikely]]
      detail::throw_forked_device(name());
  }
  // InvalidArgument when the calling thread holds an unsubmitted timeline reservation of this
  // device (Note [Timeline reservations]): `what` would wait for the reserved value. Lock-free.
  void check_no_reservation_held(std::string_view what) const {
    if (reservation_holder_.load(std::memory_order_relaxed) == std::this_thread::get_id()) [[unlikely]]
      throw InvalidArgument(fmt::format(
          TINYDEV_FMT("{}: {} while this thread holds timeline value {} reserved and not submitted: it would wait for "
                      "that value, which only this thread can submit; submit the reserved work and call "
                      "submitted() first (Note [Timeline reservations])"),
          name(), what, held_reservation_value_));
  }
  [[noreturn]] void throw_fault() const {
    throw DeviceFault(fmt::format(TINYDEV_FMT("{} cannot take more work: {}. {}"), name(), fault(), recovery_hint()));
  }
  // What a faulted device's errors tell the caller to do.
  virtual std::string recovery_hint() const { return "Call recover() on it to go on (docs/serving.md)"; }
  std::string fault() const override {
    const SignalSlot* slot = timeline_slot_.load(std::memory_order_acquire);
    if (!slot->poisoned.load(std::memory_order_acquire)) return {};
    const std::string reason = slot->poison_text();
    return fmt::format(TINYDEV_FMT("its queue failed: {}"), reason.empty() ? "no reason recorded" : reason);
  }
  // Note [Fault recovery]: after a failure the queues fail fast (each later submission's first
  // wait sees the poisoned timeline), so draining takes microseconds unless a kernel still runs.
  std::string recover(std::chrono::milliseconds timeout = default_wait_timeout()) override {
    check_not_forked();
    std::lock_guard lock(submit_mutex_);
    std::string was = fault();
    if (was.empty()) return was;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!queues_idle()) {
      if (std::chrono::steady_clock::now() >= deadline) {
        const std::string stall = describe_stall();
        throw Timeout(fmt::format(TINYDEV_FMT("{}: recover() waited {} ms for its queues to drain{}{} (a recover() given "
                                              "no timeout waits TINYDEV_WAIT_TIMEOUT_MS)"),
                                  name(), timeout.count(), stall.empty() ? "" : ": ", stall));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    lazy_work_.store(false, std::memory_order_relaxed);
    // The failed timeline stays poisoned for good: events and waits on values it never reached
    // keep failing. The device goes on with a fresh timeline signal holding the last value taken
    // (so kernargs pages and staging slots tagged with earlier values count as free). The old
    // slot is never reused: deferred frees marked with it are simply not reclaimed.
    timeline_signal_ = pool_->alloc(timeline_value() - 1);
    timeline_slot_.store(&timeline_signal_.slot(), std::memory_order_release);
    {
      std::lock_guard abandoned_lock(abandoned_mutex_);
      abandoned_.clear();
      has_abandoned_.store(false, std::memory_order_release);
    }
    debug_log(1, name(), TINYDEV_FMT("recovered from a fault: {}"), was);
    return was;
  }
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
      throw InvalidArgument(fmt::format(TINYDEV_FMT("{}: cannot free {}: it was allocated elsewhere"), name(), signal.describe()));
    const std::uint32_t index = pool_->retire(signal);  // the handle is dead now; a second free throws
    pending_frees_.emplace_back(index, signal_users_now());
    reclaim_signals();
  }

  void synchronize() override {
    check_usable();
    check_no_reservation_held("synchronize()");
    std::lock_guard lock(submit_mutex_);
    wait_submitted();
    if (wraps_timeline_ && timeline_value() > kTimelineWrap) wrap_timeline();
    reclaim_signals();
    process_profile_records();
  }

  // Blocks until the timeline reached `value`. Timeout names the device and what its queues are
  // blocked on; an Error if `value` was reserved and dropped (Note [Timeline reservations]).
  // Safe without the submit mutex (the current timeline slot is published atomically).
  // A wrap in the meantime, or before the call for a value taken before it (Note [Timeline wrap]),
  // means everything before it finished: done too.
  void wait_timeline(std::uint64_t value, std::chrono::milliseconds timeout = default_wait_timeout()) const {
    const std::uint64_t wraps = wraps_.load(std::memory_order_acquire);
    wait_timeline_reached(value, timeout);
    if (has_abandoned_.load(std::memory_order_acquire)) [[unlikely]]
      check_abandoned(value, wraps);
  }
  // Waits for everything submitted so far (last_submitted_value()). Timeout as wait_timeline; a
  // DeviceFault naming the failure when the work failed meanwhile.
  void wait_submitted(std::chrono::milliseconds timeout = default_wait_timeout()) {
    try {
      wait_timeline_reached(last_submitted_value(), timeout);
    } catch (const Timeout&) {
      throw;
    } catch (const Error&) {
      if (!fault().empty()) throw_fault();
      throw;
    }
  }
  // wait_timeline for waits that cover everything before `value` (synchronize, frees), where an
  // abandoned value is no error.
  void wait_timeline_reached(std::uint64_t value, std::chrono::milliseconds timeout = default_wait_timeout()) const {
    const std::uint64_t wraps = wraps_.load(std::memory_order_acquire);
    SignalSlot* slot = timeline_slot_.load(std::memory_order_acquire);
    if (slot->value.load(std::memory_order_acquire) >= value) return;
    // A value from before a wrap: its work finished before the wrap (Note [Timeline wrap]).
    if (wraps != 0 && value > timeline_value()) return;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      try {
        wait_signal_slot(*slot, value, std::chrono::milliseconds(50), nullptr);
        return;
      } catch (const Timeout& e) {
        if (wraps_.load(std::memory_order_acquire) != wraps) return;
        check_health();  // a device that failed without signalling poisons the timeline here
        if (std::chrono::steady_clock::now() >= deadline) {
          timed_out_.store(true, std::memory_order_relaxed);
          const std::string stall = describe_stall();
          throw Timeout(fmt::format(TINYDEV_FMT("{}: waiting for timeline value {} timed out after {} ms: it is at {}{}{} "
                                                "(a wait given no timeout lasts TINYDEV_WAIT_TIMEOUT_MS)"),
                                    name(), value, timeout.count(), slot->value.load(), stall.empty() ? "" : "; ", stall));
        }
      }
    }
  }
  // Whether a host wait on this device's timeline ever timed out (a hung kernel, a wait nobody
  // signals): later waits that only guard a free are kept short.
  bool has_timed_out() const noexcept { return timed_out_.load(std::memory_order_relaxed); }
  // How long a wait that only guards a free lasts: TINYDEV_WAIT_TIMEOUT_MS, or at most 1 s once a
  // wait timed out (so a process with a hung kernel still exits in reasonable time).
  std::chrono::milliseconds free_wait_timeout() const noexcept {
    const std::chrono::milliseconds full = default_wait_timeout();
    return has_timed_out() ? std::min<std::chrono::milliseconds>(std::chrono::seconds(1), full) : full;
  }
  // The work a wait timed out on has finished since (a stream lane taken back): those waits get
  // their full time again.
  void forget_timeouts() noexcept { timed_out_.store(false, std::memory_order_relaxed); }
  // Whether everything submitted so far has finished. Lock-free.
  // Direct calls ran without a timeline value yet (Note [Lazy timeline signals]): the value that
  // will cover them is timeline_value().
  bool has_lazy_work() const noexcept { return lazy_work_.load(std::memory_order_acquire); }
  bool idle() const noexcept {
    if (lazy_work_.load(std::memory_order_acquire)) return false;
    return timeline_slot_.load(std::memory_order_acquire)->value.load(std::memory_order_acquire) + 1 >= timeline_value();
  }

  // Waits until the queues hold no work at all, finished or failed (queues_idle), at most
  // `timeout`; false if they did not drain by then. For what must not go while failed work may
  // still run (a free, a module's unload): after a failure the timeline no longer says, since a
  // GPU's queue goes on past a failed wait (Note [CUDA waits on failed signals] in
  // backends/cuda/cuda_device.cpp).
  bool wait_queues_drained(std::chrono::milliseconds timeout) const {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!queues_idle()) {
      if (std::chrono::steady_clock::now() >= deadline) {
        timed_out_.store(true, std::memory_order_relaxed);  // later waits that guard a free are kept short
        return false;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    return true;
  }

  void wrap_timeline() {
    std::lock_guard lock(submit_mutex_);
    wait_timeline_reached(last_submitted_value());
    std::swap(timeline_signal_, shadow_timeline_signal_);
    timeline_signal_.set(0);
    timeline_value_.store(1, std::memory_order_release);
    timeline_slot_.store(&timeline_signal_.slot(), std::memory_order_release);
    // Pending frees keep marks on the old slot, which holds its final value until the next wrap.
    {
      // Values dropped before the wrap were completed with it; the numbers are handed out again.
      // The count and the list change together (Note [Timeline wrap]; check_abandoned).
      std::lock_guard abandoned_lock(abandoned_mutex_);
      wraps_.fetch_add(1, std::memory_order_release);
      abandoned_.clear();
      has_abandoned_.store(false, std::memory_order_release);
    }
    on_timeline_wrapped();
  }

  // For tests of the wrap: jumps the timeline to `value` (the device must be idle).
  void set_timeline_for_testing(std::uint64_t value) {
    std::lock_guard lock(submit_mutex_);
    wait_timeline_reached(last_submitted_value());
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
  // Turns records into events: all of them (after a synchronize), or with `finished_only` those
  // whose timestamps the queue has stored already (a profile written while work runs; a signal
  // comes from SignalPool::alloc with its timestamp 0).
  void process_profile_records(bool finished_only = false) {
    std::lock_guard lock(submit_mutex_);
    std::size_t kept = 0;
    for (std::size_t i = 0; i < profile_records_.size(); ++i) {
      ProfileRecord& r = profile_records_[i];
      if (finished_only && (r.start.timestamp() == 0 || r.end.timestamp() == 0)) {
        if (kept != i) profile_records_[kept] = std::move(r);
        ++kept;
        continue;
      }
      Profiler::global().add(ProfileEvent{r.name, device_to_cpu_ns(r.start.timestamp(), r.is_copy),
                                          device_to_cpu_ns(r.end.timestamp(), r.is_copy), name(),
                                          r.is_copy ? "DMA" : "COMPUTE", r.request});
      pool_->free(r.start);
      pool_->free(r.end);
    }
    profile_records_.erase(profile_records_.begin() + static_cast<std::ptrdiff_t>(kept), profile_records_.end());
  }
  virtual std::uint64_t device_to_cpu_ns(std::uint64_t device_ns, bool is_copy) const = 0;

  DeviceCapabilities capabilities() const override {
    DeviceCapabilities caps = Compiled::capabilities();
    caps.hcq = true;
    return caps;
  }

 protected:
  // Hook for the allocator's staging timelines (reset to 0 on wrap).
  virtual void on_timeline_wrapped() {}
  // Lazy work (Note [Lazy timeline signals]): mark it (caller holds the submit mutex), and submit
  // a signal of `value` on the timeline ordered after it (called under the submit mutex).
  void note_lazy_work() noexcept { lazy_work_.store(true, std::memory_order_release); }
  virtual void signal_lazy_work(std::uint64_t value) { (void)value; }
  // Poisons this device's own timeline with `reason` (the first reason stays). Devices whose host
  // callbacks must not run while or after that happens (CUDA's host-function copies) override it
  // to poison under their own lock.
  virtual void poison_own_timeline(std::string_view reason) const noexcept { timeline_slot_.load()->poison(reason); }
  // Called every 50 ms while a host thread waits for the timeline: a device whose failures are
  // only seen by asking (a GPU's sticky error) checks here and poisons its timeline.
  virtual void check_health() const {}
  // What the device's queues are blocked on now, for timeout messages ("" if it cannot say).
  virtual std::string describe_stall() const { return {}; }
  // Whether the device's queues hold no work (recover drains them). Devices whose queues can
  // hold work after a failure override this.
  virtual bool queues_idle() const { return true; }
  // Devices whose Events outlive any synchronize (streams) never wrap (Note [Timeline wrap]).
  void never_wrap_timeline() noexcept { wraps_timeline_ = false; }

  // `wraps`: the wrap count when the wait began; after a wrap, the list holds the new timeline's
  // dropped values, not those of the timeline `value` was taken on.
  void check_abandoned(std::uint64_t value, std::uint64_t wraps) const {
    std::lock_guard lock(abandoned_mutex_);
    if (wraps_.load(std::memory_order_acquire) != wraps) return;
    if (std::find(abandoned_.begin(), abandoned_.end(), value) != abandoned_.end())
      throw Error(fmt::format(TINYDEV_FMT("{}: timeline value {} was reserved and then dropped before its work was submitted (an "
                              "exception while recording?): nothing ran for it (Note [Timeline reservations])"),
                              name(), value));
  }

  void reclaim_signals() {
    std::lock_guard lock(submit_mutex_);
    // Recycles the slots whose marks are all reached and keeps the rest in order. A loop, not
    // std::stable_partition, whose temporary buffer clang-19 flags as deprecated in consumers'
    // -Werror builds against libstdc++ 12.
    std::size_t kept = 0;
    for (std::size_t i = 0; i < pending_frees_.size(); ++i) {
      auto& entry = pending_frees_[i];
      if (std::all_of(entry.second.begin(), entry.second.end(), [](const TimelineMark& m) { return m.reached(); })) {
        pool_->recycle(entry.first);
      } else {
        if (kept != i) pending_frees_[kept] = std::move(entry);
        ++kept;
      }
    }
    pending_frees_.erase(pending_frees_.begin() + static_cast<std::ptrdiff_t>(kept), pending_frees_.end());
  }

 private:
  mutable std::recursive_mutex submit_mutex_;
  std::shared_ptr<SignalPool> pool_;
  Signal timeline_signal_, shadow_timeline_signal_;
  std::atomic<SignalSlot*> timeline_slot_;
  std::atomic<std::uint64_t> timeline_value_{1};
  std::atomic<bool> lazy_work_{false};
  std::vector<std::pair<std::uint32_t, std::vector<TimelineMark>>> pending_frees_;  // (slot index, marks)
  std::atomic<std::uint64_t> wraps_{0};
  std::vector<ProfileRecord> profile_records_;
  std::uint64_t profile_hook_ = 0;
  std::uint64_t fork_generation_;
  bool wraps_timeline_ = true;
  Signal record_signal_;       // Note [Recorded events]; guarded by submit_mutex_
  std::uint64_t records_ = 0;  // its last value submitted
  mutable std::mutex abandoned_mutex_;
  std::vector<std::uint64_t> abandoned_;  // timeline values dropped unsubmitted, newest last (at most 64)
  std::atomic<bool> has_abandoned_{false};
  mutable std::atomic<bool> timed_out_{false};
  // Note [Timeline reservations]: the thread holding unsubmitted reservations (it holds the
  // submit mutex meanwhile, so only it writes these), how many, and the first one's value.
  std::atomic<std::thread::id> reservation_holder_{};
  int open_reservations_ = 0;
  std::uint64_t held_reservation_value_ = 0;
  void reservation_opened(std::uint64_t value) noexcept {
    if (open_reservations_++ == 0) {
      held_reservation_value_ = value;
      reservation_holder_.store(std::this_thread::get_id(), std::memory_order_relaxed);
    }
  }
  void reservation_closed() noexcept {
    if (--open_reservations_ == 0) reservation_holder_.store(std::thread::id(), std::memory_order_relaxed);
  }
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
    device_.add_profile_record(ProfileRecord{start_, end_, std::move(name_), is_copy_, Profiler::current_request()});
  }
  HCQProfileScope(const HCQProfileScope&) = delete;
  HCQProfileScope& operator=(const HCQProfileScope&) = delete;

 private:
  // A queue of its own that takes a timeline value, so synchronize() also waits for the timestamp
  // (the records are read, and their signals freed, after a synchronize).
  void submit_timestamp(const Signal& signal) {
    auto reservation = device_.reserve_timeline_value();
    const std::uint64_t value = reservation.value();
    Queue().wait(device_.timeline_signal(), value - 1).timestamp(signal).signal(device_.timeline_signal(), value).submit(device_);
    reservation.submitted();
  }

  Device& device_;
  std::string name_;
  bool is_copy_;
  Queue* queue_;
  bool enabled_;
  int exceptions_;
  Signal start_, end_;
};

}  // namespace tinydev

TINYDEV_API_END
