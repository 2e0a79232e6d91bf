// tinydev/signal.hpp: timeline signals for HCQ devices (layer 5).
//
// A signal is a 64-bit value plus a timestamp slot (ns) in pool memory that both the host and the
// device's queues read and write. Queued `signal` commands store a value, `wait` commands block the
// queue until value >= wanted, `timestamp` commands store the device clock. The host waits with
// Signal::wait: a short spin, then a futex sleep, then a Timeout naming the signal, the value
// wanted and the value seen. A device-side failure poisons a signal: its waiters get an Error with
// the reason instead of hanging, for good: a value written after the poison (a GPU's queue let go
// past the failure, Note [CUDA waits on failed signals]) does not complete a wait for it, as it
// does not complete an Event (Note [Events after a poison] in src/stream.cpp).
//
// Ownership and lifetime: a SignalPool owns its slots for its whole life (slots never move, so
// queued commands hold raw slot pointers). A Signal is a small copyable handle (pool, index,
// generation); freeing it bumps the slot's generation, so any later host use of the stale handle,
// or recording it into a queue, is an InvalidArgument. HCQ devices defer the slot's reuse until
// their timeline has passed every command that could still touch it (Note [Deferred signal free]).
//
// Thread safety: all members may be used from any thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>
#include "tinydev/config.hpp"  // default_wait_timeout
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

// One signal's memory. Devices write `value` and `timestamp_ns` through the pointer; everything
// else is the host's bookkeeping. Cache-line aligned, so two signals never share a line (a
// waiter polling one must not be disturbed by stores to another).
struct alignas(64) SignalSlot {
  // First cache line: what a store and a spinning waiter touch, and nothing else.
  std::atomic<std::uint64_t> value{0};
  std::atomic<std::uint32_t> wake_seq{0};    // futex word: bumped when a store wakes sleepers
  std::atomic<std::uint32_t> waiters{0};     // sleeping host waiters (skip the wake syscall at 0)
  // The smallest value a sleeping waiter wants (UINT64_MAX: none): a store below it wakes nobody
  // (Note [Signal waits]), so a graph bumping its signal between its queues makes no futex call each time.
  std::atomic<std::uint64_t> wake_at{~std::uint64_t{0}};
  // Set by a pool whose slots a device writes without waking anyone (a GPU's stream memory
  // operation): host waiters then poll instead of sleeping on wake_seq (Note [Polled signals]).
  std::uint32_t polled = 0;
  // From the second line on: read on every use and written almost never. A handle check reads `generation`,
  // and a submit reads its timeline's `poisoned`; here neither pulls the first line, which the
  // device writing the signal (a worker on another core) owns between stores.
  alignas(64) std::atomic<std::uint32_t> generation{0};  // bumped by free: stale handles are detected
  std::atomic<std::uint32_t> poisoned{0};
  std::atomic<std::uint32_t> poison_claim{0};  // the first poisoner writes the reason
  // Bumped each time the pool hands the slot out (under its mutex): one who kept the slot's
  // pointer can tell, under SignalPool::hold_reuse, that it is still the signal it kept.
  std::atomic<std::uint32_t> reuses{0};
  // The value the slot held when it was poisoned (written before `poisoned`): an Event past it
  // reports the failure even once a device writes its value later (Note [Events after a poison]).
  std::atomic<std::uint64_t> poisoned_at{0};
  // Called once, by the first poisoner, after the flag is set: the pool's SignalMemory::on_poison.
  void (*on_poison)(SignalSlot&) noexcept = nullptr;
  char poison_reason[432] = {};              // written by the claimant before `poisoned` is set
  // Last line: written by a device's timestamp command, away from the lines read on every use.
  alignas(64) std::atomic<std::uint64_t> timestamp_ns{0};

  // Stores a value and wakes sleeping waiters (what a device's `signal` command does).
  void store(std::uint64_t v) noexcept;
  // Marks a device-side failure and wakes every waiter, who then throw an Error with `reason`.
  void poison(std::string_view reason) noexcept;
  // Whether the slot was handed out again since its `reuses` was `seen` (read under
  // SignalPool::hold_reuse to act on it).
  bool stale_since(std::uint32_t seen) const noexcept { return reuses.load(std::memory_order_acquire) != seen; }
  // The reason the first poisoner wrote ("" if none).
  std::string poison_text() const;
  // Takes the poison away (a device recovering from a fault, when nothing can touch the slot).
  void clear_poison() noexcept;
};

class SignalPool;

class Signal {
 public:
  Signal() = default;
  // The current value. InvalidArgument if this handle was freed.
  std::uint64_t value() const;
  // Sets the value from the host and wakes waiters.
  void set(std::uint64_t v) const;
  // The last timestamp a queue stored, in ns of the device clock.
  std::uint64_t timestamp() const;
  // Blocks until value() >= wanted. Timeout after `timeout` (TINYDEV_WAIT_TIMEOUT_MS, 30 s, unless
  // given); Error if the signal is poisoned and had not reached `wanted` when it was (whatever is
  // written to it afterwards).
  void wait(std::uint64_t wanted, std::chrono::milliseconds timeout = default_wait_timeout()) const;
  // Marks a device-side failure: waiters (now and later) throw an Error carrying `reason`.
  void poison(const std::string& reason) const;

  bool valid() const noexcept { return pool_ != nullptr; }
  SignalPool* pool() const noexcept { return pool_; }
  std::uint32_t index() const noexcept { return index_; }
  std::string describe() const;  // "CPU signal #3"
  // The slot, after checking that this handle is still live. For queue recording.
  SignalSlot& slot() const;

  friend bool operator==(const Signal& a, const Signal& b) noexcept {
    return a.pool_ == b.pool_ && a.index_ == b.index_ && a.generation_ == b.generation_;
  }

 private:
  friend class SignalPool;
  Signal(SignalPool* pool, std::uint32_t index, std::uint32_t generation)
      : pool_(pool), index_(index), generation_(generation) {}
  SignalPool* pool_ = nullptr;
  std::uint32_t index_ = 0;
  std::uint32_t generation_ = 0;
};

// Where a pool's slots live. The default is ordinary host memory. A backend whose device writes
// signals itself passes memory the device can reach (a GPU's pinned, device-mapped host memory)
// and says the device's writes wake nobody (`device_writes_without_wake`).
struct SignalMemory {
  // Returns `bytes` bytes aligned to 64, or throws (OutOfMemory naming the device).
  std::function<void*(std::size_t bytes)> allocate;
  // Gives back what allocate returned; called when the pool dies. Must not throw.
  std::function<void(void* memory, std::size_t bytes)> release;
  bool device_writes_without_wake = false;
  // Called by the first poisoner of a slot, after the slot is marked, with no lock of the pool's
  // held; it may be called from any thread, under the poisoner's locks, so it must only hand the
  // slot on (a GPU backend wakes a thread that lets its queues' waits go: Note [CUDA waits on
  // failed signals]). It must not throw, block or poison a slot itself.
  void (*on_poison)(SignalSlot& slot) noexcept = nullptr;
};

class SignalPool {
 public:
  explicit SignalPool(std::string name);
  SignalPool(std::string name, SignalMemory memory);
  ~SignalPool();
  SignalPool(const SignalPool&) = delete;
  SignalPool& operator=(const SignalPool&) = delete;

  Signal alloc(std::uint64_t initial = 0);
  // Invalidates the handle at once and makes the slot reusable. Devices call this only once their
  // timeline has passed every queued use (HCQ devices' free_signal defers it for you).
  void free(const Signal& signal);
  // The two halves of free, for deferred reuse: retire invalidates the handle now (a second free
  // or any later use is an error) and returns the slot index; recycle makes it reusable later.
  std::uint32_t retire(const Signal& signal);
  void recycle(std::uint32_t index);
  const std::string& name() const noexcept { return name_; }
  std::size_t live() const;

  // While the returned lock is held no slot is handed out (alloc waits): a slot whose `reuses` is
  // what it was is still the signal it was, and may be written (Note [CUDA waits on failed
  // signals]). Hold it briefly, and allocate nothing meanwhile.
  std::unique_lock<std::mutex> hold_reuse() const { return std::unique_lock(mutex_); }
  // Slot access for a handle, checking the generation.
  SignalSlot& slot(const Signal& signal);
  // The index of a slot of this pool (for messages), nullopt if it is not one.
  std::optional<std::uint32_t> index_of(const SignalSlot* slot) const;

 private:
  // Slots live in chunks that never move; the chunk table is fixed-size so that slot() can read it
  // without the lock (it is on every wait and every recorded command).
  static constexpr std::size_t kChunk = 256;
  static constexpr std::size_t kMaxChunks = 4096;  // a million signals per pool
  mutable std::mutex mutex_;
  std::string name_;
  std::unique_ptr<std::atomic<SignalSlot*>[]> chunk_table_;
  SignalMemory memory_;
  std::vector<SignalSlot*> chunks_;  // kChunk slots each, constructed in memory_'s memory
  std::vector<std::uint32_t> free_;
  std::size_t live_ = 0;
  std::atomic<std::size_t> capacity_{0};
};

namespace detail {
// One spin-wait pause (x86 `pause`, AArch64 `yield`): for spin loops on signal memory.
inline void cpu_relax() noexcept {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Note [Adaptive spinning]
// A thread about to sleep until another thread acts spins first, because a futex round trip
// costs more than most hand-offs in a pipelined queue take. The spin is budgeted in time, not
// iterations (a PAUSE costs 10 ns on one CPU and 140 ns on another), and the budget is each
// thread's own and adapts: a spin that ended with the wait satisfied doubles it (up to 40 us), a
// spin that ran out halves it (down to 0.5 us), so a thread whose waits are long or whose partner
// cannot run stops spinning. The spin also yields the CPU every 2 us: when threads outnumber
// cores, the thread we wait for may be waiting for our core, and a yield lets it run (on an idle
// core the yield returns at once). A yield that took over 1 us means another thread did run on
// our core: the next spins of this thread yield at once and between every few looks, so a
// hand-off between threads sharing a core costs a context switch, not 2 us of spinning.
//
// A budget at its floor would never learn that waits got short again (a spin of 0.5 us fails on
// a 2 us gap for ever), so one spin in 16 at the floor probes with the full 40 us; if that one
// ends the wait, the budget starts again from half the maximum.
struct SpinBudget {
  static constexpr std::int64_t kMinNs = 500, kMaxNs = 40'000, kYieldEveryNs = 2'000, kContendedYieldNs = 1'000;
  static constexpr std::uint32_t kProbeEvery = 16;
  std::int64_t budget_ns = 10'000;
  std::uint32_t spins_at_floor = 0;
  bool yield_early = false;  // the last yield ran another thread: our core is contended
};
SpinBudget& this_thread_spin_budget() noexcept;
void spin_yield() noexcept;  // sched_yield
inline std::int64_t spin_clock_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Spins until ready() or this thread's budget runs out (Note [Adaptive spinning]); returns ready().
template <class Ready>
bool adaptive_spin(Ready&& ready) {
  for (int i = 0; i < 32; ++i) {  // the common pipelined case: ready within a few pauses
    if (ready()) return true;
    cpu_relax();
  }
  SpinBudget& budget = this_thread_spin_budget();
  const std::int64_t start = spin_clock_ns();
  const bool probe = budget.budget_ns <= SpinBudget::kMinNs && ++budget.spins_at_floor % SpinBudget::kProbeEvery == 0;
  const std::int64_t end = start + (probe ? SpinBudget::kMaxNs : budget.budget_ns);
  std::int64_t next_yield = start + (budget.yield_early ? 0 : SpinBudget::kYieldEveryNs);
  while (true) {
    for (int i = 0; i < 16; ++i) {
      if (ready()) {
        budget.budget_ns = probe ? SpinBudget::kMaxNs / 2 : std::min(SpinBudget::kMaxNs, budget.budget_ns * 2);
        return true;
      }
      cpu_relax();
    }
    const std::int64_t now = spin_clock_ns();
    if (now >= end) {
      budget.budget_ns = std::max(SpinBudget::kMinNs, budget.budget_ns / 2);
      return ready();
    }
    if (now >= next_yield) {
      spin_yield();
      const std::int64_t after = spin_clock_ns();
      budget.yield_early = after - now > SpinBudget::kContendedYieldNs;
      next_yield = after + (budget.yield_early ? 0 : SpinBudget::kYieldEveryNs);
    }
  }
}
}  // namespace detail

// Note [Polled signals]
// A GPU's stream memory operation writes a slot's value over PCIe and wakes no futex, so a host
// waiter on such a slot (SignalSlot::polled) spins for 50 us, then polls with sleeps that grow to
// 128 us: latency stays in microseconds for short waits, a wait for long work overshoots its end
// by at most about 128 us plus the kernel's timer slack, and the CPU is free meanwhile.

// Waits for slot->value >= wanted (spin, then futex sleep, or polling for polled slots); an Error
// once the slot is poisoned for `wanted` (poison_failed), even if the value comes afterwards.
// `handle_for_errors` names the signal in errors. Used by Signal::wait and by device queues that
// wait on the host side.
void wait_signal_slot(SignalSlot& slot, std::uint64_t wanted, std::chrono::nanoseconds timeout,
                      const Signal* handle_for_errors);

// Whether a wait for `wanted` on `slot` failed: the slot is poisoned and had not reached `wanted`
// when it was. Values written after the poison do not count (Note [Events after a poison]).
inline bool poison_failed(const SignalSlot& slot, std::uint64_t wanted) noexcept {
  return slot.poisoned.load(std::memory_order_acquire) != 0 &&
         slot.poisoned_at.load(std::memory_order_relaxed) < wanted;
}

}  // namespace tinydev

TINYDEV_API_END
